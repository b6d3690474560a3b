"""Checkpoint loading and saving (``moe_jax.checkpoint``), ``MoEConfig.from_hf_config`` and
per-group weight formats, against synthetic Kimi K2-style ModelOpt NVFP4 checkpoints
(``tests/synthetic_checkpoint.py``) written with the safetensors library."""

import dataclasses
import json
import re
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import synthetic_checkpoint as sc
from safetensors.numpy import save_file

import moe_jax
from moe_jax import MoEConfig, checkpoint, moe_forward, nvfp4, reference_forward, resolve
from moe_jax.checkpoint import Checkpoint, CheckpointError, load_moe_layer, moe_layer_indices, save_moe_layer
from moe_jax.checkpoint import load as checkpoint_load
from moe_jax.layer import check_params, init_params, param_logical_axes, quantize_params
from pallas_kernels.grouped_matmul import reference as gmm_reference
from sharding.mesh import make_mesh

KIMI_K2_CONFIG = {  # moonshotai/Kimi-K2-Instruct config.json, the MoE keys
    "hidden_size": 7168, "moe_intermediate_size": 2048, "n_routed_experts": 384, "num_experts_per_tok": 8,
    "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True,
    "first_k_dense_replace": 1, "num_hidden_layers": 61, "moe_layer_freq": 1,
}


@pytest.fixture(scope="module")
def synthetic():
    return sc.build(seed=0)


@pytest.fixture(scope="module")
def ckpt_dir(synthetic, tmp_path_factory):
    return sc.write(tmp_path_factory.mktemp("kimi") / "ckpt", synthetic.tensors, synthetic.config, files=3)


def variant(tmp_path, synthetic, *, edit=None, config_edit=None, files=3, extra_files=None):
    """A copy of the synthetic checkpoint with ``edit(tensors)`` / ``config_edit(config)`` applied
    and ``extra_files`` (name -> text) written beside it."""
    tensors, config = dict(synthetic.tensors), json.loads(json.dumps(synthetic.config))
    if edit:
        edit(tensors)
    if config_edit:
        config_edit(config)
    directory = sc.write(tmp_path / "variant", tensors, config, files=files)
    for name, text in (extra_files or {}).items():
        (directory / name).write_text(text)
    return directory


def leaves_with_paths(tree):
    return jax.tree_util.tree_flatten_with_path(tree)[0]


def assert_bitwise_equal(got, expected):
    got_leaves, expected_leaves = leaves_with_paths(got), leaves_with_paths(expected)
    assert [jax.tree_util.keystr(p) for p, _ in got_leaves] == [jax.tree_util.keystr(p) for p, _ in expected_leaves]
    for (path, a), (_, b) in zip(got_leaves, expected_leaves):
        a, b = np.asarray(a), np.asarray(b)
        where = jax.tree_util.keystr(path)
        assert (a.dtype, a.shape) == (b.dtype, b.shape), where
        assert a.reshape(-1).view(np.uint8).tobytes() == b.reshape(-1).view(np.uint8).tobytes(), where


def rel_err(y, ref):
    y = np.asarray(y, np.float64)
    return np.linalg.norm(y - ref) / np.linalg.norm(ref)


# ---------------------------------------------------------------------------------------------
# MoEConfig.from_hf_config, moe_layer_indices


def test_from_hf_config_maps_kimi_k2_and_deepseek_v3(tmp_path):
    assert MoEConfig.from_hf_config(KIMI_K2_CONFIG) == MoEConfig.kimi_k2()
    deepseek = {**KIMI_K2_CONFIG, "n_routed_experts": 256, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5}
    assert MoEConfig.from_hf_config(deepseek) == MoEConfig.deepseek_v3()
    (tmp_path / "config.json").write_text(json.dumps(KIMI_K2_CONFIG))
    for source in (tmp_path, str(tmp_path / "config.json")):
        config = MoEConfig.from_hf_config(source, weight_format="nvfp4", shared_weight_format="bf16")
        assert config == MoEConfig.kimi_k2(weight_format="nvfp4", shared_weight_format="bf16")
    greedy = MoEConfig.from_hf_config({**KIMI_K2_CONFIG, "topk_method": "greedy", "scoring_func": "softmax"})
    assert (greedy.router_bias, greedy.scoring, greedy.num_groups) == (False, "softmax", 1)


@pytest.mark.parametrize("change, message", [
    (dict(n_routed_experts=None), r"^config.json: n_routed_experts = None, expected int$"),
    (dict(norm_topk_prob=1), r"^config.json: norm_topk_prob = 1, expected bool$"),
    (dict(topk_method="group_limited_greedy"), r"^config.json: topk_method = 'group_limited_greedy' is not supported"),
    (dict(scoring_func="softplus"), r"^config.json: scoring_func = 'softplus' is not supported"),
    (dict(n_group=5), r"^config.json: MoEConfig.num_groups = 5: must divide num_experts = 384$"),
])
def test_from_hf_config_errors_name_the_key(change, message):
    with pytest.raises(ValueError, match=message):
        MoEConfig.from_hf_config({**KIMI_K2_CONFIG, **change})


def test_from_hf_config_missing_key_and_file(tmp_path):
    config = {k: v for k, v in KIMI_K2_CONFIG.items() if k != "moe_intermediate_size"}
    with pytest.raises(ValueError, match=r"^config.json: key 'moe_intermediate_size' is missing$"):
        MoEConfig.from_hf_config(config)
    with pytest.raises(ValueError, match=r"^config_json: .*config.json does not exist"):
        MoEConfig.from_hf_config(tmp_path)


def test_moe_layer_indices():
    assert moe_layer_indices(KIMI_K2_CONFIG) == range(1, 61)
    assert moe_layer_indices(sc.hf_config()) == range(1, 4)
    with pytest.raises(ValueError, match=r"moe_layer_freq = 2 is not supported"):
        moe_layer_indices({**KIMI_K2_CONFIG, "moe_layer_freq": 2})
    with pytest.raises(ValueError, match=r"first_k_dense_replace = 62, expected 0..num_hidden_layers = 61"):
        moe_layer_indices({**KIMI_K2_CONFIG, "first_k_dense_replace": 62})


# ---------------------------------------------------------------------------------------------
# Per-group weight formats


def test_shared_weight_format_is_validated_and_reported():
    mixed = sc.layer_config(weight_format="nvfp4", shared_weight_format="bf16")
    assert (mixed.weight_format, mixed.shared_format) == ("nvfp4", "bf16")
    assert sc.layer_config(weight_format="nvfp4").shared_format == "nvfp4"
    with pytest.raises(ValueError, match=r"MoEConfig.shared_weight_format = 'fp8': must be one of None, 'bf16', 'nvfp4'"):
        sc.layer_config(shared_weight_format="fp8")
    with pytest.raises(ValueError, match=r"MoEConfig.shared_weight_format = 'bf16': needs num_shared_experts >= 1"):
        MoEConfig(num_experts=8, top_k=2, hidden_size=32, expert_intermediate_size=16, shared_weight_format="bf16")
    with pytest.raises(ValueError, match=r"MoEConfig.shared_intermediate_size = 24: must be a multiple of 16 for NVFP4 shared"):
        sc.layer_config(shared_weight_format="nvfp4", shared_intermediate_size=24)
    head = resolve(mixed).report.splitlines()[0]
    assert head.endswith("nvfp4 expert weights, bf16 shared-expert weights"), head
    assert resolve(sc.layer_config(weight_format="nvfp4")).report.splitlines()[0].endswith(", nvfp4 weights")


@pytest.mark.parametrize("experts, shared", [("nvfp4", "bf16"), ("bf16", "nvfp4")])
def test_init_quantize_and_check_params_honour_each_group(experts, shared):
    config = sc.layer_config(weight_format=experts, shared_weight_format=shared)
    params = init_params(config, jax.random.key(0))
    is_q = {"nvfp4": True, "bf16": False}
    assert isinstance(params["experts"]["w_down_ehf"], nvfp4.NVFP4Tensor) is is_q[experts]
    assert isinstance(params["shared"]["w_down_hs"], nvfp4.NVFP4Tensor) is is_q[shared]
    check_params(params, config)
    bf16 = init_params(sc.layer_config(), jax.random.key(0))
    requantized = quantize_params(bf16, config)
    check_params(requantized, config)
    # An NVFP4 tensor is kept as it is, never quantized again.
    assert quantize_params(params, config)["experts"]["w_down_ehf"] is params["experts"]["w_down_ehf"]
    wrong = dataclasses.replace(config, shared_weight_format=experts)
    with pytest.raises(ValueError, match=r"params\['shared'\]\['w_gate_up_gh'\]"):
        check_params(params, wrong)


def test_check_params_accepts_input_scales_and_checks_them():
    config = sc.layer_config(weight_format="nvfp4", shared_weight_format="bf16")
    params = init_params(config, jax.random.key(0))
    ones = jnp.ones(sc.E, jnp.float32)
    check_params({**params, "input_scales": {"gate_e": ones, "up_e": ones, "down_e": ones}}, config)
    with pytest.raises(ValueError, match=r"params\['input_scales'\]: \['down_e'\] missing"):
        check_params({**params, "input_scales": {"gate_e": ones, "up_e": ones}}, config)
    with pytest.raises(ValueError, match=r"params\['input_scales'\]\['down_e'\]: float32 \(4,\), expected float32 \(16,\)"):
        check_params({**params, "input_scales": {"gate_e": ones, "up_e": ones, "down_e": ones[:4]}}, config)
    with pytest.raises(ValueError, match=r"params: unexpected groups \['extra'\]"):
        check_params({**params, "extra": {}}, config)
    axes = param_logical_axes({"input_scales": {"gate_e": ones, "shared_up": jnp.float32(1)}})
    assert axes == {"input_scales": {"gate_e": ("experts",), "shared_up": ()}}


# ---------------------------------------------------------------------------------------------
# Reading safetensors


def test_reader_matches_the_safetensors_writer(tmp_path, rng):
    arrays = {
        "f8": rng.standard_normal((5, 7)).astype(ml_dtypes.float8_e4m3fn),
        "bf16": rng.standard_normal((3, 4)).astype(ml_dtypes.bfloat16),
        "u8": rng.integers(0, 256, (6, 3), dtype=np.uint8),
        "f32_scalar": np.asarray(np.float32(rng.standard_normal())),
        "f16": rng.standard_normal((2, 2, 3)).astype(np.float16),
        "empty": np.zeros((0, 4), np.float32),
    }
    # Every float8 bit pattern, NaN included, must come back as stored.
    arrays["f8_all"] = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    save_file(arrays, str(tmp_path / "model.safetensors"))
    from safetensors.flax import save_file as flax_save_file  # a second writer, from jax arrays
    flax_save_file({"f8_flax": jnp.asarray(arrays["f8"])}, str(tmp_path / "flax.safetensors"))
    ckpt = Checkpoint(tmp_path)
    assert set(ckpt.tensors) == set(arrays)
    for name, a in arrays.items():
        got = ckpt.read(name)
        assert (got.dtype, got.shape) == (a.dtype, a.shape), name
        assert got.tobytes() == a.tobytes(), name
    info = checkpoint.read_header(tmp_path / "flax.safetensors")["f8_flax"]
    assert (info.dtype, info.shape) == ("F8_E4M3", (5, 7))
    # safetensors' own numpy reader, where it can (not float8: numpy has no such type).
    from safetensors import safe_open
    with safe_open(str(tmp_path / "model.safetensors"), framework="numpy") as f:
        for name in ("u8", "f32_scalar", "f16"):
            assert np.array_equal(f.get_tensor(name), ckpt.read(name))


def test_a_truncated_file_is_an_error(tmp_path, rng):
    save_file({"w": rng.standard_normal((8, 8)).astype(np.float32)}, str(tmp_path / "model.safetensors"))
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-4])
    with pytest.raises(CheckpointError, match=r"^w: data_offsets \[0, 256\] in model.safetensors .*expected 256 bytes"):
        Checkpoint(tmp_path)


# ---------------------------------------------------------------------------------------------
# Loading


@pytest.mark.parametrize("layer", [1, 2, 3])
def test_loads_exactly_the_stored_tensors(ckpt_dir, synthetic, layer):
    config, params = load_moe_layer(ckpt_dir, layer, progress=False)
    expected_format = "bf16" if layer == sc.EXCLUDED_LAYER else "nvfp4"
    assert (config.weight_format, config.shared_weight_format) == (expected_format, "bf16")
    assert dataclasses.replace(config, weight_format="bf16", shared_weight_format=None) == sc.layer_config()
    assert_bitwise_equal(params, synthetic.expected[layer])


@pytest.mark.parametrize("layer", [1, 2])
def test_layer_matches_the_float64_reference_of_the_stored_weights(ckpt_dir, synthetic, rng, layer):
    config, params = load_moe_layer(ckpt_dir, layer, config=sc.layer_config(expert_gemm="xla"), progress=False)
    x = jnp.asarray(rng.standard_normal((32, sc.H)), jnp.bfloat16)
    y, stats = jax.jit(moe_forward, static_argnums=2)(params, x, resolve(config))
    ref = reference_forward(synthetic.expected[layer], np.asarray(x, np.float64), config)
    assert rel_err(y, ref) < 1e-2
    assert int(stats["tokens_per_expert"].sum()) == 32 * sc.K


def test_single_file_and_hf_quant_config_json(tmp_path, synthetic):
    def older_settings(config):
        q = config.pop("quantization_config")
        (tmp_path / "variant").mkdir(parents=True, exist_ok=True)
        (tmp_path / "variant" / "hf_quant_config.json").write_text(json.dumps({
            "producer": {"name": "modelopt", "version": "0.29.0"},
            "quantization": {"quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None,
                             "exclude_modules": q["ignore"]},
        }))

    directory = variant(tmp_path, synthetic, config_edit=older_settings, files=1)
    assert (directory / "model.safetensors").is_file() and not (directory / "model.safetensors.index.json").exists()
    for layer in (1, 2):
        _, params = load_moe_layer(directory, layer, progress=False)
        assert_bitwise_equal(params, synthetic.expected[layer])


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16], ids=["BF16", "F16"])
def test_a_half_precision_correction_bias_loads_widened_exactly(tmp_path, synthetic, dtype):
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    stored = synthetic.tensors[name].astype(dtype)
    directory = variant(tmp_path, synthetic, edit=lambda t: t.update({name: stored}))
    _, params = load_moe_layer(directory, 1, progress=False)
    bias = np.asarray(params["router"]["bias_e"])
    assert bias.dtype == np.float32
    np.testing.assert_array_equal(bias, stored.astype(np.float64))  # the stored values, exactly


def test_both_quantization_settings_files_load_when_they_agree(tmp_path, synthetic):
    q = synthetic.config["quantization_config"]
    same = json.dumps({"quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": q["ignore"][::-1]}})
    directory = variant(tmp_path, synthetic, extra_files={"hf_quant_config.json": same})
    for layer in (1, 2):
        _, params = load_moe_layer(directory, layer, progress=False)
        assert_bitwise_equal(params, synthetic.expected[layer])


def test_progress_bar_goes_to_stderr(ckpt_dir, capfd):
    load_moe_layer(ckpt_dir, 2, progress=False)
    assert capfd.readouterr().err == ""
    from tqdm import tqdm as base
    original = base.__init__

    def forced(self, *args, **kwargs):  # pytest's stderr is not a terminal: tqdm would hide itself
        original(self, *args, **{**kwargs, "disable": False})

    base.__init__ = forced
    try:
        load_moe_layer(ckpt_dir, 2, progress=True)
    finally:
        base.__init__ = original
    assert "layer 2" in capfd.readouterr().err


# ---------------------------------------------------------------------------------------------
# Onto a mesh


@pytest.mark.parametrize("expert_parallel, data_parallel", [(4, 1), (2, 2)])
def test_each_device_reads_and_holds_exactly_its_experts(ckpt_dir, synthetic, monkeypatch, cpu_devices,
                                                         expert_parallel, data_parallel):
    """Bit for bit, shard by shard (the loaded layer runs on a mesh in
    test_differing_gate_up_scales_on_an_expert_parallel_mesh and in tests/test_examples.py)."""
    mesh = make_mesh(expert_parallel, data_parallel=data_parallel, devices=cpu_devices[:expert_parallel * data_parallel])
    log, current = [], {"experts": None}
    original_read, original_leaf_read = Checkpoint.read, checkpoint_load._Leaf.read

    def read(self, name):
        log.append((current["experts"], name))
        return original_read(self, name)

    def leaf_read(self, index):
        if self.per_expert is not None:
            current["experts"] = set(range(*index[0].indices(self.shape[0])))
        try:
            return original_leaf_read(self, index)
        finally:
            current["experts"] = None

    monkeypatch.setattr(Checkpoint, "read", read)
    monkeypatch.setattr(checkpoint_load._Leaf, "read", leaf_read)
    _, params = load_moe_layer(ckpt_dir, 1, config=sc.layer_config(expert_gemm="xla"), mesh=mesh, progress=False)

    # The large per-expert tensors are read inside the shard read of an owning device, once.
    big = [(owned, name) for owned, name in log if re.search(r"experts\.\d+\..*\.(weight|weight_scale)$", name)]
    assert len(big) == len({name for _, name in big}) == sc.E * 3 * 2
    for owned, name in big:
        assert owned is not None and int(re.search(r"experts\.(\d+)\.", name)[1]) in owned, name
        assert len(owned) == sc.E // expert_parallel

    # Each device's shard holds its experts' values, the rest is replicated.
    per_device = sc.E // expert_parallel
    axis = mesh.axis_names.index("expert")
    expected = synthetic.expected[1]
    for (path, array), (_, want) in zip(leaves_with_paths(params), leaves_with_paths(expected)):
        want = np.asarray(want)
        stacked = re.search(r"'(experts|input_scales)'", jax.tree_util.keystr(path)) is not None
        assert len(array.addressable_shards) == mesh.size
        for shard in array.addressable_shards:
            position = np.argwhere(mesh.devices == shard.device)[0][axis]
            if stacked:
                assert shard.index[0] == slice(position * per_device, (position + 1) * per_device)
            else:
                assert all(s == slice(None) for s in shard.index)
            got = np.asarray(shard.data)
            assert got.tobytes() == np.ascontiguousarray(want[shard.index]).tobytes(), jax.tree_util.keystr(path)



# ---------------------------------------------------------------------------------------------
# Saving


@pytest.mark.parametrize("shard_size", [None, 300_000])
@pytest.mark.parametrize("layer", [1, 2])
def test_save_round_trips_bit_exactly(ckpt_dir, synthetic, tmp_path, layer, shard_size):
    config, params = load_moe_layer(ckpt_dir, layer, progress=False)
    save_moe_layer(tmp_path / "saved", layer, params, config, shard_size=shard_size)
    files = sorted(p.name for p in (tmp_path / "saved").glob("*.safetensors"))
    assert len(files) > 1 if shard_size else files == ["model.safetensors"]
    again_config, again = load_moe_layer(tmp_path / "saved", layer, progress=False)
    assert again_config == config
    assert_bitwise_equal(again, params)
    # The same tensors as the original checkpoint, bit for bit.
    saved, original = Checkpoint(tmp_path / "saved"), Checkpoint(ckpt_dir)
    prefix = f"model.layers.{layer}.mlp."
    assert set(saved.tensors) == {n for n in original.tensors if n.startswith(prefix)}
    for name in saved.tensors:
        a, b = saved.read(name), original.read(name)
        assert (a.dtype, a.shape, a.tobytes()) == (b.dtype, b.shape, b.tobytes()), name
    with pytest.raises(ValueError, match=r"^directory: .* already holds .*safetensors"):
        save_moe_layer(tmp_path / "saved", layer, params, config)


# ---------------------------------------------------------------------------------------------
# Every error: one line naming the tensor, what was found, what was expected

MLP1 = r"model\.layers\.1\.mlp"


def drop(name):
    return lambda t: t.pop(name)


def replace(name, value):
    return lambda t: t.__setitem__(name, value(t[name]))


def set_ignore(patterns):
    return lambda c: c["quantization_config"].__setitem__("ignore", patterns)


def drop_experts(layer, experts):
    pattern = rf"model\.layers\.{layer}\.mlp\.experts\.({'|'.join(map(str, experts))})\."
    return lambda t: [t.pop(n) for n in [n for n in t if re.match(pattern, n)]]


def renumber_experts(layer, shift):
    prefix = f"model.layers.{layer}.mlp.experts."

    def edit(t):
        moved = {n: t.pop(n) for n in [n for n in t if n.startswith(prefix)]}
        for name, value in moved.items():
            e, rest = name[len(prefix):].split(".", 1)
            t[f"{prefix}{int(e) + shift}.{rest}"] = value
    return edit


def with_bytes(scales, byte_at):
    """E4M3 block scales with the bytes at some indices replaced."""
    u8 = scales.view(np.uint8).copy()
    for index, byte in byte_at.items():
        u8[index] = byte
    return u8.view(ml_dtypes.float8_e4m3fn)


def as_exact_f16(w_bf16):
    """bf16 weights as F16 holding the same values: those below F16's normal range (2**-14),
    where F16 has fewer than bf16's 8 significant bits, are zeroed first."""
    w = w_bf16.astype(np.float32)
    w = np.where(np.abs(w) < 2.0**-14, np.float32(0), w)
    w_f16 = w.astype(np.float16)
    assert (w_f16.astype(np.float32) == w).all()
    return w_f16


def f16_with_inexact(w_bf16, indices):
    """``as_exact_f16`` with 1 + 2**-10 (an F16 value, 3 bits past bf16's mantissa) at ``indices``."""
    w = as_exact_f16(w_bf16)
    for index in indices:
        w[index] = 1 + 2.0**-10
    return w


ERRORS = {
    "missing tensor": (
        dict(edit=drop("model.layers.1.mlp.experts.5.down_proj.weight_scale")), 1,
        rf"^{MLP1}\.experts\.5\.down_proj\.weight_scale: missing \(stored .*down_proj\.weight: U8 \[256, 64\]\), "
        r"expected F8_E4M3 \[256, 8\] \(nvfp4 by .*config.json quantization_config\)$"),
    "wrong shape": (
        dict(edit=replace("model.layers.1.mlp.experts.3.gate_proj.weight_scale", lambda a: a[:, :4])), 1,
        rf"^{MLP1}\.experts\.3\.gate_proj\.weight_scale: F8_E4M3 \[128, 4\], expected F8_E4M3 \[128, 16\]"),
    "wrong dtype": (
        dict(edit=replace("model.layers.1.mlp.experts.0.up_proj.weight_scale", lambda a: a.astype(np.float32))), 1,
        rf"^{MLP1}\.experts\.0\.up_proj\.weight_scale: F32 \[128, 16\], expected F8_E4M3 \[128, 16\]"),
    "wrong scale_2 dtype": (
        dict(edit=replace("model.layers.3.mlp.experts.1.down_proj.weight_scale_2", lambda a: a.astype(np.float16))), 3,
        r"^model\.layers\.3\.mlp\.experts\.1\.down_proj\.weight_scale_2: F16 \[\], expected F32 \[\]"),
    "bias dtype": (
        dict(edit=replace("model.layers.1.mlp.gate.e_score_correction_bias", lambda a: a.astype(np.int32))), 1,
        rf"^{MLP1}\.gate\.e_score_correction_bias: I32 \[16\], expected F32/BF16/F16 \[16\]"),
    "NaN weight_scale_2": (
        dict(edit=replace("model.layers.1.mlp.experts.3.down_proj.weight_scale_2", lambda a: a * np.nan)), 1,
        rf"^{MLP1}\.experts\.3\.down_proj\.weight_scale_2: nan, expected a finite scale > 0$"),
    "zero weight_scale_2": (
        dict(edit=replace("model.layers.1.mlp.experts.0.gate_proj.weight_scale_2", lambda a: a * 0)), 1,
        rf"^{MLP1}\.experts\.0\.gate_proj\.weight_scale_2: 0\.0, expected a finite scale > 0$"),
    "negative input_scale": (
        dict(edit=replace("model.layers.1.mlp.experts.5.up_proj.input_scale", lambda a: -a)), 1,
        rf"^{MLP1}\.experts\.5\.up_proj\.input_scale: -\S+, expected a finite scale > 0$"),
    "bias shape": (
        dict(edit=replace("model.layers.1.mlp.gate.e_score_correction_bias", lambda a: a[:8])), 1,
        rf"^{MLP1}\.gate\.e_score_correction_bias: F32 \[8\], expected F32/BF16/F16 \[16\]"),
    "quantization settings disagree": (
        dict(extra_files={"hf_quant_config.json": json.dumps({"quantization": {
            "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head", "model.layers.*.mlp.shared_experts*"]}})}),
        1, r"config\.json quantization_config and \S+hf_quant_config\.json disagree on ignore / exclude_modules: "),
    "missing router": (
        dict(edit=drop("model.layers.3.mlp.gate.weight")), 3,
        r"^model\.layers\.3\.mlp\.gate\.weight: missing from the checkpoint in "),
    "expert count": (
        dict(config_edit=lambda c: c.update(n_routed_experts=8)), 1,
        rf"^{MLP1}\.gate\.weight: BF16 \[16, 256\], expected BF16/F32/F16 \[8, 256\] \(router \[n_routed_experts"),
    "an extra expert": (
        dict(edit=lambda t: t.update({"model.layers.1.mlp.experts.16.down_proj.weight_scale_2": np.float32(1)})), 1,
        rf"^{MLP1}\.experts\.\{{e\}}: 17 expert ids \(0\.\.16\) in the checkpoint, but config\.json has "
        r"n_routed_experts = 16, expected experts 0\.\.15$"),
    "the last experts missing": (
        dict(edit=drop_experts(1, [14, 15])), 1,
        rf"^{MLP1}\.experts\.\{{e\}}: 14 expert ids \(0\.\.13\) in the checkpoint, but config\.json has "
        r"n_routed_experts = 16, expected experts 0\.\.15$"),
    "an expert missing in the middle": (
        dict(edit=drop_experts(3, [5])), 3,
        r"^model\.layers\.3\.mlp\.experts\.\{e\}: 15 expert ids \(0\.\.15, 1 missing, the first 5\) in the "
        r"checkpoint, but config\.json has n_routed_experts = 16, expected experts 0\.\.15$"),
    "experts numbered from 1": (
        dict(edit=renumber_experts(2, 1)), 2,
        r"^model\.layers\.2\.mlp\.experts\.\{e\}: 16 expert ids \(1\.\.16, 1 missing, the first 0\) in the "
        r"checkpoint, but config\.json has n_routed_experts = 16"),
    "NaN block scales": (
        dict(edit=replace("model.layers.1.mlp.experts.3.gate_proj.weight_scale",
                          lambda a: with_bytes(a, {(2, 5): 0x7F, (7, 1): 0xFF, (9, 0): 0xB0, (1, 1): 0x80}))), 1,
        rf"^{MLP1}\.experts\.3\.gate_proj\.weight_scale: 3 of 2048 block scales NaN or negative \(first at "
        r"\[2, 5\]: nan, byte 0x7f\), expected finite E4M3 scales >= 0$"),
    "a negative block scale": (
        dict(edit=replace("model.layers.3.mlp.experts.15.down_proj.weight_scale",
                          lambda a: with_bytes(a, {(1, 1): 0x80, (200, 3): 0xB0}))), 3,
        r"^model\.layers\.3\.mlp\.experts\.15\.down_proj\.weight_scale: 1 of 2048 block scales NaN or negative "
        r"\(first at \[200, 3\]: -0\.5, byte 0xb0\), expected finite E4M3 scales >= 0$"),
    "F16 expert weights bf16 cannot hold": (
        dict(edit=replace("model.layers.2.mlp.experts.4.down_proj.weight",
                          lambda a: f16_with_inexact(a, [(255, 127), (0, 3), (10, 7)]))), 2,
        r"^model\.layers\.2\.mlp\.experts\.4\.down_proj\.weight: F16 \[256, 128\], 3 of 32768 values not exact in "
        r"bf16 \(first at \[0, 3\]: 1\.0009765625\), expected BF16, or F16 that bf16 holds exactly"),
    "F16 shared weights bf16 cannot hold": (
        dict(edit=replace("model.layers.1.mlp.shared_experts.up_proj.weight", lambda a: f16_with_inexact(a, [(5, 6)]))),
        1, rf"^{MLP1}\.shared_experts\.up_proj\.weight: F16 \[128, 256\], 1 of 32768 values not exact in bf16 "
           r"\(first at \[5, 6\]: 1\.0009765625\)"),
    "a leftover tensor": (
        dict(edit=lambda t: t.update({"model.layers.1.mlp.experts.0.gate_proj.bias": np.zeros(128, np.float32)})), 1,
        rf"^{MLP1}\.experts\.0\.gate_proj\.bias: F32 \[128\], not a tensor of a nvfp4 MoE layer with a bf16 shared"),
    "dense layer": (
        {}, 0,
        r"^layer: 0 is a dense layer \(first_k_dense_replace = 1; its MLP is model\.layers\.0\.mlp\.\{gate,up,down\}_proj\), "
        r"expected a MoE layer in 1\.\.3$"),
    "layer past the end": ({}, 4, r"^layer: 4, expected an int in 0\.\.3 \(num_hidden_layers = 4\)$"),
    "negative layer": ({}, -1, r"^layer: -1, expected an int in 0\.\.3"),
    "unsupported quant_algo": (
        dict(config_edit=lambda c: c["quantization_config"].update(quant_algo="FP8")), 1,
        r"config.json quantization_config: quant_algo = 'FP8' is not supported, expected 'NVFP4'$"),
    "unsupported group size": (
        dict(config_edit=lambda c: c["quantization_config"].update(group_size=32)), 1,
        r"config.json quantization_config: group_size = 32 is not supported, expected 16 \(NVFP4\)$"),
    "unsupported quant_method": (
        dict(config_edit=lambda c: c["quantization_config"].update(quant_method="fp8")), 1,
        r"quant_method = 'fp8' is not supported, expected 'modelopt'$"),
    "bf16 where the settings say NVFP4": (
        dict(config_edit=set_ignore(["model.layers.*.mlp.shared_experts*"])), 2,
        r"^model\.layers\.2\.mlp\.experts\.0\.gate_proj\.weight: BF16 \[128, 256\], expected U8 \[128, 128\] \(nvfp4 by "),
    "NVFP4 where the settings exclude it": (
        dict(config_edit=set_ignore(["model.layers.*.mlp.shared_experts*", "model.layers.1.mlp.experts*"])), 1,
        rf"^{MLP1}\.experts\.0\.gate_proj\.weight: U8 \[128, 128\], expected BF16/F16 \[128, 256\] \(bf16 by "),
    "shared expert not excluded": (
        dict(config_edit=set_ignore([])), 1,
        rf"^{MLP1}\.shared_experts\.gate_proj\.weight: BF16 \[128, 256\], expected U8 \[128, 128\] \(nvfp4 by "),
    "one expert excluded": (
        dict(config_edit=set_ignore(["model.layers.*.mlp.shared_experts*", "model.layers.1.mlp.experts.3.*"])), 1,
        rf"^{MLP1}\.experts\.3\.gate_proj: bf16 by .*, but {MLP1}\.experts\.0\.gate_proj is nvfp4; the routed experts "
        r"of layer 1 must share one format$"),
    "partial input scales": (
        dict(edit=drop("model.layers.1.mlp.experts.2.down_proj.input_scale")), 1,
        rf"^{MLP1}\.experts\.2\.down_proj\.input_scale: missing, expected F32 \[\] \(other projections"),
    "missing config.json": (dict(config_edit=lambda c: c.clear()), 1, r"key 'hidden_size' is missing$"),
}


@pytest.mark.parametrize("case", ERRORS)
def test_errors_name_the_tensor_what_was_found_and_expected(tmp_path, synthetic, case):
    changes, layer, message = ERRORS[case]
    directory = variant(tmp_path, synthetic, **changes)
    with pytest.raises(CheckpointError if case != "missing config.json" else ValueError, match=message) as info:
        load_moe_layer(directory, layer, progress=False)
    assert "\n" not in str(info.value)


def test_index_errors(tmp_path, synthetic):
    directory = variant(tmp_path, synthetic)
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    moved = "model.layers.1.mlp.experts.0.gate_proj.weight"
    wrong_file = next(f for f in set(index["weight_map"].values()) if f != index["weight_map"][moved])
    index["weight_map"][moved] = wrong_file
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"^{re.escape(moved)}: missing from {wrong_file}, where "
                                              r"model.safetensors.index.json says it is$"):
        load_moe_layer(directory, 1, progress=False)
    (directory / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-00002-of-00003.safetensors: missing, but "
                                              r"model.safetensors.index.json lists it \(for \S+ and \d+ more\)$"):
        load_moe_layer(directory, 1, progress=False)


INDEX = "model.safetensors.index.json"
MOVED = "model.layers.1.mlp.experts.2.up_proj.weight_scale"


def index_and_another_file(directory):
    """The index, the file it maps MOVED to, and another of its files."""
    index = json.loads((directory / INDEX).read_text())
    home = index["weight_map"][MOVED]
    return index, home, next(f for f in sorted(set(index["weight_map"].values())) if f != home)


def test_an_index_mapping_to_a_missing_file_names_the_tensor(tmp_path, synthetic):
    directory = variant(tmp_path, synthetic)
    index, _, _ = index_and_another_file(directory)
    index["weight_map"][MOVED] = "model-00004-of-00003.safetensors"
    (directory / INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(directory))}/model-00004-of-00003\.safetensors: "
                                              rf"missing, but {INDEX} lists it \(for {re.escape(MOVED)}\)$"):
        load_moe_layer(directory, 1, progress=False)


@pytest.mark.parametrize("listed", [True, False], ids=["index maps it to one", "index lacks it"])
def test_a_tensor_in_two_files_is_an_error(tmp_path, synthetic, listed):
    """Which of two copies is meant cannot be known, whether or not the index names one."""
    directory = variant(tmp_path, synthetic)
    index, home, other = index_and_another_file(directory)
    in_other = {n: np.array(synthetic.tensors[n], order="C") for n, f in index["weight_map"].items() if f == other}
    save_file({**in_other, MOVED: synthetic.tensors[MOVED]}, str(directory / other), metadata={"format": "pt"})
    if not listed:
        del index["weight_map"][MOVED]
        (directory / INDEX).write_text(json.dumps(index))
    first, second = sorted([home, other])
    mapped = f"maps it to {home}" if listed else "does not list it"
    with pytest.raises(CheckpointError, match=rf"^{re.escape(MOVED)}: stored in both {first} and {second}, expected "
                                              rf"one file \({INDEX} {mapped}\)$"):
        load_moe_layer(directory, 1, progress=False)


def test_an_index_mapping_a_tensor_twice_is_an_error(tmp_path, synthetic):
    """JSON allows a key twice and json.loads keeps the last: the index would pick a file silently."""
    directory = variant(tmp_path, synthetic)
    _, home, other = index_and_another_file(directory)
    text = (directory / INDEX).read_text()
    entry = f'"{MOVED}": "{home}"'
    assert text.count(entry) == 1
    (directory / INDEX).write_text(text.replace(entry, f'{entry},\n    "{MOVED}": "{other}"'))
    with pytest.raises(CheckpointError, match=rf"^{re.escape(MOVED)}: given twice in {INDEX}, as '{home}' and "
                                              rf"'{other}', expected once$"):
        load_moe_layer(directory, 1, progress=False)


def test_zero_block_scales_load_as_stored(tmp_path, synthetic):
    """0 (an all-zero block) and -0 are valid block scales: kept bit for bit."""
    name = "model.layers.1.mlp.experts.6.up_proj.weight_scale"
    zeros = {(0, 0): 0x00, (3, 2): 0x80, (127, 15): 0x00}
    directory = variant(tmp_path, synthetic, edit=replace(name, lambda a: with_bytes(a, zeros)))
    _, params = load_moe_layer(directory, 1, progress=False)
    expected = synthetic.expected[1]
    w = expected["experts"]["w_gate_up_egh"]
    scales = w.scales.copy()
    scales[6, sc.F:] = with_bytes(scales[6, sc.F:], zeros)
    assert_bitwise_equal(params, {**expected, "experts": {**expected["experts"], "w_gate_up_egh": dataclasses.replace(
        w, scales=scales)}})


def test_a_nan_block_scale_is_caught_in_the_shard_read_of_its_device(tmp_path, synthetic, cpu_devices):
    """With a mesh, the scales are checked as each device's experts are read (the last device's here)."""
    name = "model.layers.1.mlp.experts.15.down_proj.weight_scale"
    directory = variant(tmp_path, synthetic, edit=replace(name, lambda a: with_bytes(a, {(4, 2): 0xFF})))
    with pytest.raises(CheckpointError, match=rf"^{re.escape(name)}: 1 of 2048 block scales NaN or negative \(first at "
                                              r"\[4, 2\]: nan, byte 0xff\)"):
        load_moe_layer(directory, 1, mesh=make_mesh(4, devices=cpu_devices[:4]), progress=False)


@pytest.mark.parametrize("mesh_size", [None, 4])
def test_f16_unquantized_projections_load_as_the_bf16_values_they_hold(tmp_path, synthetic, cpu_devices, mesh_size):
    """F16 routed experts (layer 2, excluded from quantization) and a shared expert whose gate
    alone is F16 (layer 1), every value one that bf16 holds: loaded as bf16, the same values."""
    f16_names = [n for n in synthetic.tensors if re.fullmatch(r"model\.layers\.2\.mlp\.experts\.\d+\.\w+\.weight", n)]
    f16_names.append("model.layers.1.mlp.shared_experts.gate_proj.weight")

    def to_f16(t):
        t.update({n: as_exact_f16(t[n]) for n in f16_names})

    directory = variant(tmp_path, synthetic, edit=to_f16)
    assert {Checkpoint(directory).info(n).dtype for n in f16_names} == {"F16"}
    mesh = None if mesh_size is None else make_mesh(mesh_size, devices=cpu_devices[:mesh_size])

    def zero_small(w_bf16):  # the values as_exact_f16 stores, as bf16
        return np.where(np.abs(w_bf16.astype(np.float32)) < 2.0**-14, 0, w_bf16).astype(ml_dtypes.bfloat16)

    for layer in (1, 2):
        config, params = load_moe_layer(directory, layer, mesh=mesh, progress=False)
        assert (config.weight_format, config.shared_format) == ("bf16" if layer == 2 else "nvfp4", "bf16")
        expected = synthetic.expected[layer]
        if layer == 2:
            expected = {**expected, "experts": jax.tree.map(zero_small, expected["experts"])}
        else:
            s_gu = expected["shared"]["w_gate_up_gh"]
            expected = {**expected, "shared": {**expected["shared"], "w_gate_up_gh": np.concatenate(
                [zero_small(s_gu[:sc.F]), s_gu[sc.F:]])}}
        assert_bitwise_equal(params, expected)


def test_other_errors(tmp_path, ckpt_dir, cpu_devices):
    with pytest.raises(CheckpointError, match=r"neither model.safetensors.index.json nor model.safetensors"):
        shutil.copy(ckpt_dir / "config.json", tmp_path / "config.json")
        load_moe_layer(tmp_path, 1, progress=False)
    with pytest.raises(CheckpointError, match=r"^directory: .*nowhere is not a directory"):
        load_moe_layer(tmp_path / "nowhere", 1, progress=False)
    (tmp_path / "config.json").unlink()
    with pytest.raises(ValueError, match=r"^config_json: .*config.json does not exist"):
        load_moe_layer(tmp_path, 1, progress=False)
    with pytest.raises(CheckpointError, match=r"^config.top_k = 2, but .*config.json \(num_experts_per_tok\) gives 4$"):
        load_moe_layer(ckpt_dir, 1, config=sc.layer_config(top_k=2), progress=False)
    mesh = jax.make_mesh((2,), ("data",), devices=cpu_devices[:2])
    with pytest.raises(ValueError, match=r"expert_axis: 'expert' is not an axis of the mesh \('data',\)"):
        load_moe_layer(ckpt_dir, 1, mesh=mesh, progress=False)
    assert load_moe_layer(ckpt_dir, 3, mesh=make_mesh(8, devices=cpu_devices), progress=False)[0].weight_format == "nvfp4"
    with pytest.raises(ValueError, match=r"size 16, which \('expert',\) \(3 devices\) does not divide"):
        load_moe_layer(ckpt_dir, 1, mesh=make_mesh(3, devices=cpu_devices[:3]), progress=False)


def test_differing_shared_gate_up_scales_load_exactly(tmp_path, synthetic, rng):
    """An NVFP4 shared expert: loaded as stored, and where its gate and up scales differ, with a
    global scale per half (``[2]``), exactly; equal scales keep one (``[]``)."""
    def quantized_shared(t):
        for layer in (1, 3):
            mlp = f"model.layers.{layer}.mlp.shared_experts"
            w = np.concatenate([t[f"{mlp}.gate_proj.weight"], t[f"{mlp}.up_proj.weight"]]).astype(np.float32)
            q = jax.tree.map(np.asarray, nvfp4.quantize(jnp.asarray(w)))
            d = jax.tree.map(np.asarray, nvfp4.quantize(jnp.asarray(t[f"{mlp}.down_proj.weight"].astype(np.float32))))
            for proj, rows, src in (("gate", slice(0, sc.F), q), ("up", slice(sc.F, None), q), ("down", slice(None), d)):
                t[f"{mlp}.{proj}_proj.weight"] = src.packed[rows]
                t[f"{mlp}.{proj}_proj.weight_scale"] = src.scales[rows]
                t[f"{mlp}.{proj}_proj.weight_scale_2"] = np.asarray(src.global_scale)
        t["model.layers.3.mlp.shared_experts.up_proj.weight_scale_2"] = np.float32(0.02)

    directory = variant(tmp_path, synthetic, edit=quantized_shared,
                        config_edit=set_ignore(["model.layers.0.*", "model.layers.2*"]))
    config, params = load_moe_layer(directory, 1, progress=False)
    assert (config.weight_format, config.shared_format) == ("nvfp4", "nvfp4")
    assert isinstance(params["shared"]["w_gate_up_gh"], nvfp4.NVFP4Tensor)
    assert params["shared"]["w_gate_up_gh"].global_scale.shape == ()
    assert "shared_gate" not in params["input_scales"]  # this shared expert stores no input scales

    config, params = load_moe_layer(directory, 3, config=sc.layer_config(expert_gemm="xla"), progress=False)
    stored = Checkpoint(directory)
    shared = "model.layers.3.mlp.shared_experts"
    want = np.array([stored.read(f"{shared}.{p}_proj.weight_scale_2") for p in ("gate", "up")], np.float32)
    assert want[1] == np.float32(0.02) and want[0] != want[1]
    assert np.asarray(params["shared"]["w_gate_up_gh"].global_scale).tobytes() == want.tobytes()
    assert params["experts"]["w_gate_up_egh"].global_scale.shape == (sc.E,)  # the routed experts agree
    x = jnp.asarray(rng.standard_normal((16, sc.H)), jnp.bfloat16)
    y, _ = jax.jit(moe_forward, static_argnums=2)(params, x, resolve(config))
    assert rel_err(y, reference_forward(params, np.asarray(x, np.float64), config)) < 1e-2
    save_moe_layer(tmp_path / "saved", 3, params, config)
    for name in (n for n in stored.tensors if n.startswith(f"{shared}.")):
        a, b = Checkpoint(tmp_path / "saved").read(name), stored.read(name)
        assert (a.dtype, a.shape, a.tobytes()) == (b.dtype, b.shape, b.tobytes()), name


# ---------------------------------------------------------------------------------------------
# Routed experts whose gate and up weight_scale_2 differ


@pytest.fixture(scope="module")
def separate():
    """Gate and up of every expert quantized on their own: two weight_scale_2, 3x-10x apart."""
    return sc.build(seed=1, separate_gate_up=True)


@pytest.fixture(scope="module")
def separate_dir(separate, tmp_path_factory):
    return sc.write(tmp_path_factory.mktemp("kimi_separate") / "ckpt", separate.tensors, separate.config, files=3)


@pytest.mark.parametrize("layer", [1, 3])
def test_differing_gate_up_scales_load_bit_exactly(separate_dir, separate, layer):
    _, params = load_moe_layer(separate_dir, layer, progress=False)
    assert_bitwise_equal(params, separate.expected[layer])
    w = params["experts"]["w_gate_up_egh"]
    assert w.global_scale.shape == (sc.E, 2)
    stored = Checkpoint(separate_dir)
    for e in range(sc.E):
        names = [f"model.layers.{layer}.mlp.experts.{e}.{p}_proj" for p in ("gate", "up")]
        scales = np.array([stored.read(f"{n}.weight_scale_2") for n in names], np.float32)
        assert np.asarray(w.global_scale[e]).tobytes() == scales.tobytes()
        # Each half dequantizes exactly as its stored projection does on its own.
        halves = [gmm_reference.dequantize(stored.read(f"{n}.weight")[None], stored.read(f"{n}.weight_scale")[None],
                                           scales[i:i + 1]) for i, n in enumerate(names)]
        fused = gmm_reference.dequantize(np.asarray(w.packed[e:e + 1]), np.asarray(w.scales[e:e + 1]),
                                         np.asarray(w.global_scale[e:e + 1]))
        np.testing.assert_array_equal(fused, np.concatenate(halves, axis=1))


def test_differing_gate_up_scales_on_an_expert_parallel_mesh(separate_dir, separate, rng, cpu_devices):
    """``[E, 2]`` global scales shard with their experts, ``(expert, None)``, read per device; on an
    expert- and data-parallel mesh, the loaded layer equals the float64 reference of the stored
    tensors to bf16 rounding. (The Pallas kernels with ``[E, 2]`` scales: tests/test_layer_pallas.py;
    the exchange is not under test here, and allgather compiles fastest on CPU.)"""
    mesh = make_mesh(2, data_parallel=2, devices=cpu_devices[:4])
    config, params = load_moe_layer(separate_dir, 1, config=sc.layer_config(expert_gemm="xla", exchange="allgather"),
                                    mesh=mesh, progress=False)
    global_scale = params["experts"]["w_gate_up_egh"].global_scale
    assert global_scale.sharding.spec == jax.sharding.PartitionSpec("expert", None)
    want = np.asarray(separate.expected[1]["experts"]["w_gate_up_egh"].global_scale)
    for shard in global_scale.addressable_shards:
        assert shard.data.shape == (sc.E // 2, 2)
        assert np.asarray(shard.data).tobytes() == np.ascontiguousarray(want[shard.index]).tobytes()
    x = jnp.asarray(rng.standard_normal((32, sc.H)), jnp.bfloat16)
    y, _ = jax.jit(moe_forward, static_argnums=2)(params, x, resolve(config, mesh))
    expected = separate.expected[1]
    ref = reference_forward(expected, np.asarray(x, np.float64), config)
    assert rel_err(y, ref) < 1e-2
    # The check can tell: one global scale (gate's) for both halves is far off.
    w = expected["experts"]["w_gate_up_egh"]
    gate_scale_only = {**expected, "experts": {**expected["experts"], "w_gate_up_egh": dataclasses.replace(
        w, global_scale=w.global_scale[:, 0])}}
    assert rel_err(reference_forward(gate_scale_only, np.asarray(x, np.float64), config), ref) > 0.1


def test_differing_gate_up_scales_save_round_trips_bit_exactly(separate_dir, tmp_path):
    config, params = load_moe_layer(separate_dir, 1, progress=False)
    save_moe_layer(tmp_path / "saved", 1, params, config)
    again_config, again = load_moe_layer(tmp_path / "saved", 1, progress=False)
    assert again_config == config
    assert_bitwise_equal(again, params)
    saved, original = Checkpoint(tmp_path / "saved"), Checkpoint(separate_dir)
    assert set(saved.tensors) == {n for n in original.tensors if n.startswith("model.layers.1.mlp.")}
    for name in saved.tensors:
        a, b = saved.read(name), original.read(name)
        assert (a.dtype, a.shape, a.tobytes()) == (b.dtype, b.shape, b.tobytes()), name


def test_one_expert_one_ulp_apart_gives_the_layer_per_half_scales(tmp_path, synthetic):
    """One array holds every expert's scales: one expert whose gate and up differ (by one ulp
    here, which still changes its weights) gives every expert of the layer a scale per half."""
    name = "model.layers.1.mlp.experts.7.up_proj.weight_scale_2"
    directory = variant(tmp_path, synthetic, edit=replace(name, lambda a: np.nextafter(a, np.float32(1))))
    _, params = load_moe_layer(directory, 1, progress=False)
    shared = np.asarray(synthetic.expected[1]["experts"]["w_gate_up_egh"].global_scale)
    want = np.stack([shared, shared], axis=1)
    want[7, 1] = np.nextafter(want[7, 1], np.float32(1))
    assert np.asarray(params["experts"]["w_gate_up_egh"].global_scale).tobytes() == want.tobytes()
    # Layer 3 (untouched) keeps one scale per expert.
    assert load_moe_layer(directory, 3, progress=False)[1]["experts"]["w_gate_up_egh"].global_scale.shape == (sc.E,)


def test_check_params_takes_a_global_scale_per_half_for_gate_up_only(separate):
    params = separate.expected[1]
    config = dataclasses.replace(sc.layer_config(), weight_format="nvfp4", shared_weight_format="bf16")
    check_params(params, config)
    w_down = params["experts"]["w_down_ehf"]
    per_half_down = dataclasses.replace(w_down, global_scale=np.stack([w_down.global_scale] * 2, axis=1))
    with pytest.raises(ValueError, match=r"^params\['experts'\]\['w_down_ehf'\]\.global_scale: shape \(16, 2\), "
                                         r"expected \(16,\)$"):
        check_params({**params, "experts": {**params["experts"], "w_down_ehf": per_half_down}}, config)
    w = params["experts"]["w_gate_up_egh"]
    four = dataclasses.replace(w, global_scale=np.concatenate([w.global_scale] * 2, axis=1))
    with pytest.raises(ValueError, match=r"^params\['experts'\]\['w_gate_up_egh'\]\.global_scale: shape \(16, 4\), "
                                         r"expected \(16,\) or \(16, 2\)$"):
        check_params({**params, "experts": {**params["experts"], "w_gate_up_egh": four}}, config)


def test_lazy_exports():
    assert moe_jax.checkpoint is checkpoint
    assert moe_jax.load_moe_layer is load_moe_layer and moe_jax.save_moe_layer is save_moe_layer


def test_scalars_stored_as_one_element_vectors_load(tmp_path, synthetic):
    """Some exports store weight_scale_2 / input_scale as [1] rather than []: the same value."""
    def as_vectors(t):
        for name in [n for n in t if n.startswith("model.layers.1.") and n.endswith(("weight_scale_2", "input_scale"))]:
            t[name] = t[name].reshape(1)

    _, params = load_moe_layer(variant(tmp_path, synthetic, edit=as_vectors), 1, progress=False)
    assert_bitwise_equal(params, synthetic.expected[1])
