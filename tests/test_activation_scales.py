"""W4A4 activation scales: ``quantize_rows`` against a static global scale, the ``xla``
reference's W4A4 mode (``MoEConfig.reference_activations="nvfp4"``), the choice between a
checkpoint's ``input_scale`` and per-row dynamic scales (``MoEConfig.activation_scale``), and how
the scales travel (expert parallelism, the NNX module).

The float64 models here are written from the rule that TensorRT-LLM and vLLM apply to W4A4
activations (static global scale, E4M3 block scale ``clamp(block_amax / (6 * global), 2**-9,
448)``, E2M1 rounding half to even saturating at 6) and share no code with ``moe_jax.nvfp4``.
The rule's quotients and products are float32 operations; the models compute each in float64
and round it to float32, which is the correctly rounded float32 result (53 >= 2 * 24 + 2 bits).
"""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import synthetic_checkpoint as sc
from flax import nnx
from harness import FORWARD, random_params

import moe_jax
import sharding
from moe_jax import MoE, MoEConfig, moe_forward, nvfp4, resolve, router
from moe_jax.checkpoint import load_moe_layer
from moe_jax.layer import reference_forward, shard_params
from moe_jax.module import InputScale

E2M1_GRID = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
TOLERANCE = 1e-2  # relative (Frobenius) against the float64 model of the same quantization
CONFIG = MoEConfig.kimi_k2(num_experts=8, top_k=2, hidden_size=128, expert_intermediate_size=64,
                           weight_format="nvfp4", shared_weight_format="bf16", reference_activations="nvfp4")
ROUTED = ("gate_e", "up_e", "down_e")


def f32(v) -> np.ndarray:
    """float64 values rounded to float32 (and back to float64)."""
    return np.asarray(v, np.float64).astype(np.float32).astype(np.float64)


def quantize_rows_np(x_mk, global_m=None):
    """``(codes, block scales, global scales)`` of the rows of ``x_mk``, float64: signed E2M1
    values ``[M, K]``, E4M3 values ``[M, K/16]``, ``[M]``. ``global_m`` None: each row's own
    ``amax / 2688``."""
    x = np.asarray(x_mk, np.float32).astype(np.float64)
    m, k = x.shape
    blocks = x.reshape(m, k // 16, 16)
    block_amax = np.abs(blocks).max(-1)
    g = f32(block_amax.max(-1) / 2688) if global_m is None else np.asarray(global_m, np.float32).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = f32(block_amax / f32(6 * g)[:, None])
        ratio = np.where((ratio == 0) | np.isnan(ratio), 1.0, ratio)  # a zero block: scale 1
        scale = np.clip(ratio, 2.0**-9, 448.0).astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
        q = np.where(blocks == 0, 0.0, f32(np.abs(blocks) / f32(scale * g[:, None])[..., None]))
    # The nearest E2M1 magnitude (6 for anything above 5: saturation); a tie, exact in binary,
    # goes to the even code: odd codes' distances count 1e-12 more, far below float32's spacing.
    magnitude = E2M1_GRID[np.argmin(np.abs(q[..., None] - E2M1_GRID) + 1e-12 * (np.arange(8) % 2), axis=-1)]
    return (np.sign(blocks) * magnitude).reshape(m, k), scale, g


def dequantized_rows_np(x_mk, global_m=None) -> np.ndarray:
    codes, scale, g = quantize_rows_np(x_mk, global_m)
    return codes * np.repeat(scale, 16, axis=-1) * g[:, None]


def decode_np(packed) -> np.ndarray:
    """uint8 ``[..., K/2]`` to signed E2M1 values ``[..., K]`` (element 2i in the low nibble)."""
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
    return np.where(codes & 8, -1.0, 1.0) * E2M1_GRID[codes & 7]


def weight_np(t) -> np.ndarray:
    """An NVFP4 ``[E, N, K]`` with one global scale per matrix, dequantized in float64."""
    scales = np.asarray(t.scales).astype(np.float64)
    return decode_np(np.asarray(t.packed)) * np.repeat(scales, 16, axis=-1) * np.asarray(t.global_scale,
                                                                                        np.float64)[:, None, None]


def silu(v):
    return v / (1 + np.exp(-v))


def w4a4_layer_np(params, x, config, static: bool):
    """The layer in float64 with the routed experts' activations quantized as W4A4 quantizes
    them: against ``params["input_scales"]`` (gate/up: the larger of gate's and up's) when
    ``static``, else per row; the SwiGLU output rounded to bf16 first, as the kernel writes it.
    Also returns the amax of each expert's two inputs, ``[E, 2]`` (calibration)."""
    x_th = np.asarray(x, np.float64)
    logits = x_th @ np.asarray(params["router"]["w_eh"], np.float64).T
    ids, weights = router.route(jnp.asarray(logits, jnp.float32), config,
                                correction_bias_e=jnp.asarray(params["router"]["bias_e"]))
    ids, weights = np.asarray(ids), np.asarray(weights, np.float64)
    w_gu, w_dn = weight_np(params["experts"]["w_gate_up_egh"]), weight_np(params["experts"]["w_down_ehf"])
    scales = {name: np.asarray(v, np.float32) for name, v in params.get("input_scales", {}).items()}
    f = config.expert_intermediate_size
    y = np.zeros_like(x_th)
    amax_e2 = np.zeros((config.num_experts, 2))
    for e in np.unique(ids).tolist():
        t, slot = np.nonzero(ids == e)
        rows = np.full(len(t), 1, np.float32)
        x_q = dequantized_rows_np(x_th[t], rows * max(scales["gate_e"][e], scales["up_e"][e]) if static else None)
        h = x_q @ w_gu[e].T
        a = (silu(h[:, :f]) * h[:, f:]).astype(np.float32).astype(ml_dtypes.bfloat16)
        a_q = dequantized_rows_np(a, rows * scales["down_e"][e] if static else None)
        y[t] += weights[t, slot, None] * (a_q @ w_dn[e].T)
        amax_e2[e] = np.abs(x_th[t]).max(), np.abs(a.astype(np.float64)).max()
    s = config.shared_size
    h = x_th @ np.asarray(params["shared"]["w_gate_up_gh"], np.float64).T
    y += (silu(h[:, :s]) * h[:, s:]) @ np.asarray(params["shared"]["w_down_hs"], np.float64).T
    return y, amax_e2


def relative(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def make_calibrated(rng, tokens=48):
    """Random params (bias too) and tokens, with input scales calibrated on these tokens: the
    amax of each expert's inputs over ``6 * 448``, gate's or up's (by expert) that value and the
    other a smaller one, so that only their maximum is calibrated."""
    params = random_params(CONFIG, rng)
    # Channels of different sizes, as real activations have (outlier channels).
    x = jnp.asarray(rng.standard_normal((tokens, CONFIG.hidden_size)) * rng.lognormal(0, 0.7, CONFIG.hidden_size),
                    jnp.bfloat16)
    _, amax_e2 = w4a4_layer_np(params, x, CONFIG, static=False)
    amax_e2 = np.where(amax_e2 > 0, amax_e2, 1.0)  # experts no token chose: any positive scale
    calibrated_e2 = (amax_e2 / 2688).astype(np.float32)
    smaller_e = rng.uniform(0.3, 0.9, CONFIG.num_experts).astype(np.float32)
    gate_is_larger_e = rng.random(CONFIG.num_experts) < 0.5
    params["input_scales"] = {
        "gate_e": jnp.asarray(calibrated_e2[:, 0] * np.where(gate_is_larger_e, 1, smaller_e)),
        "up_e": jnp.asarray(calibrated_e2[:, 0] * np.where(gate_is_larger_e, smaller_e, 1)),
        "down_e": jnp.asarray(calibrated_e2[:, 1]),
    }
    return params, x


def off_by(params, factor_e):
    """``params`` with every routed input scale of expert e multiplied by ``factor_e[e]``."""
    scales = {name: v * jnp.asarray(factor_e, jnp.float32) for name, v in params["input_scales"].items()}
    return {**params, "input_scales": scales}


def forward(params, x, config, mesh=None):
    plan = resolve(config, mesh)
    if mesh is not None:
        params = shard_params(params, plan)
    return np.asarray(FORWARD(params, x, plan)[0], np.float64)


# --- quantize_rows with a static global scale ------------------------------------------------------


def test_quantize_rows_with_a_static_global_scale_follows_the_rule(rng):
    """Rows at many magnitudes against static scales: calibrated, too small (the row's amax
    past ``6 * 448 * global``: its largest blocks get scale 448 and their codes saturate at 6),
    and tiny rows (block scales at the 2**-9 clamp), bf16 and float32 inputs, with zero blocks."""
    m, k = 24, 128
    x = rng.standard_normal((m, k)) * rng.uniform(0.01, 100, (m, 1))
    x[3, 16:48] = 0  # two zero blocks
    x[5] *= 1e-7  # a tiny row
    own_m = np.abs(x).max(-1) / 2688
    global_m = own_m * np.where(np.arange(m) % 3 == 0, rng.uniform(0.1, 0.5, m), rng.uniform(1.0, 3.0, m))
    # Block ratios below 448 / 4e5 < 2**-9: the smallest E4M3 scale, with codes up to about 3.
    global_m[5] = own_m[5] * 4e5
    global_m = global_m.astype(np.float32)
    for dtype in (jnp.float32, jnp.bfloat16):
        x_mk = jnp.asarray(x, dtype)
        packed, scales, g = nvfp4.quantize_rows(x_mk, jnp.asarray(global_m))
        codes_np, scales_np, g_np = quantize_rows_np(np.asarray(x_mk.astype(jnp.float32)), global_m)
        np.testing.assert_array_equal(np.asarray(g), global_m)
        np.testing.assert_array_equal(np.asarray(scales).astype(np.float64), scales_np)
        np.testing.assert_array_equal(decode_np(np.asarray(packed)), codes_np)
    # The cases the rule has corners for were there: saturated codes, the clamps at both ends.
    saturated = np.abs(x) > 6 * 448 * global_m[:, None].astype(np.float64)
    assert saturated[np.arange(m) % 3 == 0].any() and (np.abs(codes_np[saturated]) == 6).all()
    assert (scales_np == 448).any() and (scales_np[5] == 2.0**-9).all() and np.abs(codes_np[5]).max() > 0


def test_a_row_s_own_amax_as_static_scale_gives_the_dynamic_bits(rng):
    x = jnp.asarray(rng.standard_normal((7, 64)) * rng.uniform(0.01, 100, (7, 1)), jnp.float32)
    dynamic = nvfp4.quantize_rows(x)
    static = nvfp4.quantize_rows(x, dynamic[2])
    for a, b in zip(dynamic, static, strict=True):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


@pytest.mark.parametrize("global_m, message", [
    (jnp.ones((4,), jnp.float32), r"global_scale_m: float32 \(4,\), expected float32 \(3,\), one per row of x_mk"),
    (jnp.ones((3,), jnp.bfloat16), r"global_scale_m: bfloat16 \(3,\), expected float32 \(3,\)"),
    (jnp.asarray([1.0, 0.0, -1.0], jnp.float32), r"global_scale_m: 2 of 3 not finite and > 0"),
    (jnp.asarray([1.0, jnp.nan, jnp.inf], jnp.float32), r"global_scale_m: 2 of 3 not finite and > 0"),
])
def test_bad_static_scales_raise_naming_the_argument(global_m, message):
    with pytest.raises(ValueError, match=message):
        nvfp4.quantize_rows(jnp.ones((3, 32), jnp.float32), global_m)


# --- the layer: the xla reference's W4A4 mode -------------------------------------------------------


@pytest.mark.parametrize("activation_scale", ["checkpoint", "dynamic"])
def test_w4a4_reference_matches_a_float64_model_when_calibrated(rng, activation_scale):
    params, x = make_calibrated(rng)
    config = dataclasses.replace(CONFIG, activation_scale=activation_scale)
    got = forward(params, x, config)
    want, _ = w4a4_layer_np(params, x, config, static=activation_scale == "checkpoint")
    assert relative(got, want) < TOLERANCE
    # Calibrated scales cost no more than dynamic ones: quantizing activations adds an
    # NVFP4-sized error to the layer's, bf16 activations (W4A16) far less.
    exact = reference_forward(params, np.asarray(x, np.float64), CONFIG)
    assert 0.02 < relative(got, exact) < 0.25
    assert relative(forward(params, x, dataclasses.replace(config, reference_activations="bf16")), exact) < 0.02


def test_checkpoint_and_dynamic_differ_when_the_scales_are_off(rng):
    """Input scales 4x too small saturate what the checkpoint's rule quantizes (and the model
    of that rule agrees); dynamic scales do not read them at all."""
    params, x = make_calibrated(rng)
    params = off_by(params, np.full(CONFIG.num_experts, 0.25))
    exact = reference_forward(params, np.asarray(x, np.float64), CONFIG)
    checkpoint = forward(params, x, dataclasses.replace(CONFIG, activation_scale="checkpoint"))
    dynamic = forward(params, x, dataclasses.replace(CONFIG, activation_scale="dynamic"))
    assert relative(checkpoint, w4a4_layer_np(params, x, CONFIG, static=True)[0]) < TOLERANCE
    assert relative(dynamic, w4a4_layer_np(params, x, CONFIG, static=False)[0]) < TOLERANCE
    assert relative(checkpoint, exact) > 2 * relative(dynamic, exact)


def test_auto_takes_the_checkpoint_s_scales_when_the_params_carry_them(rng):
    params, x = make_calibrated(rng)
    params = off_by(params, rng.uniform(0.2, 1.0, CONFIG.num_experts))
    auto = dataclasses.replace(CONFIG, activation_scale="auto")
    np.testing.assert_array_equal(forward(params, x, auto),
                                  forward(params, x, dataclasses.replace(CONFIG, activation_scale="checkpoint")))
    dynamic = forward(params, x, dataclasses.replace(CONFIG, activation_scale="dynamic"))
    without = {group: leaves for group, leaves in params.items() if group != "input_scales"}
    np.testing.assert_array_equal(forward(without, x, auto), dynamic)
    assert not np.array_equal(forward(params, x, auto), dynamic)


def test_activation_scales_change_nothing_where_activations_are_not_quantized(rng):
    params, x = make_calibrated(rng)
    params = off_by(params, np.full(CONFIG.num_experts, 0.25))
    w4a16 = dataclasses.replace(CONFIG, reference_activations="bf16", activation_scale="checkpoint")
    without = {group: leaves for group, leaves in params.items() if group != "input_scales"}
    np.testing.assert_array_equal(forward(params, x, w4a16),
                                  forward(without, x, dataclasses.replace(w4a16, activation_scale="dynamic")))


def test_checkpoint_without_input_scales_raises_naming_them_and_the_field(rng):
    params, x = make_calibrated(rng)
    config = dataclasses.replace(CONFIG, activation_scale="checkpoint")
    message = (r"^params\['input_scales'\]: no 'gate_e', 'up_e', 'down_e' \(the routed experts' input_scale\), "
               r"expected with MoEConfig.activation_scale='checkpoint'")
    without = {group: leaves for group, leaves in params.items() if group != "input_scales"}
    with pytest.raises(ValueError, match=message):
        moe_forward(without, x, config)
    shared_only = {**without, "input_scales": {name: jnp.float32(0.01) for name in ("shared_gate", "shared_up",
                                                                                    "shared_down")}}
    with pytest.raises(ValueError, match=message):
        moe_forward(shared_only, x, config)
    with pytest.raises(ValueError, match=message):
        MoE(config, rngs=nnx.Rngs(0))  # random parameters carry no calibrated scales


def test_w4a4_reference_gradients_pass_the_rounding_straight_through(rng):
    """The activations' rounding is the identity backwards (as ``qat``'s weights'), so the input
    gradient is near the W4A16 one; without that it would miss the routed experts entirely."""
    params, x = make_calibrated(rng)
    cotangent = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)

    def input_grad(config):
        plan = resolve(config, training=True)
        loss = lambda x: jnp.sum(moe_forward(params, x, plan)[0].astype(jnp.float32) * cotangent)
        return np.asarray(jax.jit(jax.grad(loss))(x.astype(jnp.float32)), np.float64)

    w4a16 = input_grad(dataclasses.replace(CONFIG, reference_activations="bf16"))
    for activation_scale in ("checkpoint", "dynamic"):
        w4a4 = input_grad(dataclasses.replace(CONFIG, activation_scale=activation_scale))
        assert np.isfinite(w4a4).all() and relative(w4a4, w4a16) < 0.25


@pytest.mark.slow  # 21 s in the suite: five W4A4-reference layers compiled
def test_expert_parallel_w4a4_reference_equals_one_device(rng, cpu_devices):
    """Each device quantizes its experts' rows against its experts' scales: with scales that
    differ by expert (half of them 4x too small), any mix-up would change the output."""
    params, x = make_calibrated(rng, tokens=8 * 6 + 3)
    params = off_by(params, np.where(np.arange(CONFIG.num_experts) % 2, 0.25, 1.0))
    # The checkpoint's scales, which are per expert, on two meshes; dynamic scales, which read
    # only the row, on one (there is nothing per expert to mix up).
    for activation_scale, ep in (("checkpoint", 8), ("checkpoint", 4), ("dynamic", 4)):
        config = dataclasses.replace(CONFIG, activation_scale=activation_scale)
        one = forward(params, x, config)
        got = forward(params, x, config, sharding.make_mesh(ep, data_parallel=8 // ep, devices=cpu_devices))
        # The same rows, the same arithmetic: at most a bf16 rounding apart (XLA's blocking of
        # float32 sums may differ with the row count).
        assert relative(got, one) < 2e-3, (activation_scale, ep)


def test_the_module_keeps_input_scales_as_untrained_variables(rng, cpu_devices):
    params, x = make_calibrated(rng)
    config = dataclasses.replace(CONFIG, activation_scale="checkpoint")
    layer = MoE(config, rngs=nnx.Rngs(0), params=params)
    kept = layer.params()["input_scales"]
    assert set(kept) == set(ROUTED)
    for name in ROUTED:
        np.testing.assert_array_equal(np.asarray(kept[name]), np.asarray(params["input_scales"][name]))
    assert set(nnx.state(layer, InputScale)["input_scales"]) == set(ROUTED)
    assert "input_scales" not in nnx.state(layer, nnx.Param)
    np.testing.assert_array_equal(np.asarray(nnx.jit(lambda m, x: m(x)[0])(layer, x), np.float64),
                                  forward(params, x, config))
    # Again from what it returned (a round trip), and on a mesh: split along the experts.
    mesh = sharding.make_mesh(4, data_parallel=2, devices=cpu_devices)
    sharded = MoE(config, rngs=nnx.Rngs(0), mesh=mesh, params=layer.params())
    gate_e = sharded.params()["input_scales"]["gate_e"]
    assert gate_e.sharding.spec[0] == config.expert_axis
    on_mesh = nnx.jit(lambda m, x: m(x)[0])(sharded, x)
    assert relative(np.asarray(on_mesh, np.float64), forward(params, x, config)) < 2e-3
    assert "input_scales" not in MoE(CONFIG, rngs=nnx.Rngs(0)).params()


def _activations_line(config) -> str:
    return next(line for line in resolve(config).report.splitlines() if line.startswith("  activations: "))


def test_the_report_says_which_activation_scaling_is_in_effect():
    lines = {scale: _activations_line(dataclasses.replace(CONFIG, activation_scale=scale))
             for scale in ("checkpoint", "dynamic", "auto")}
    assert lines["checkpoint"].startswith("  activations: NVFP4 per row, global scale from the checkpoint's static "
                                          "input_scale of each expert (gate/up: the larger) "
                                          "(activation_scale='checkpoint'; the reference's W4A4 mode")
    assert "NVFP4 per row, dynamic per-row global scale, amax / (6 * 448)" in lines["dynamic"]
    assert "where the params carry them (gate/up: the larger), else dynamic per row" in lines["auto"]
    assert all(line.endswith("the shared expert's stay bfloat16") for line in lines.values())
    w4a16 = _activations_line(dataclasses.replace(CONFIG, reference_activations="bf16"))
    assert w4a16.startswith("  activations: bfloat16, not quantized (W4A16 reference;")
    assert moe_jax.resolve(CONFIG).report.count("activations:") == 1


# --- from a checkpoint ------------------------------------------------------------------------------


def test_a_checkpoint_s_input_scales_drive_the_w4a4_reference(rng, tmp_path):
    """A synthetic ModelOpt checkpoint in the exact format, ``input_scale`` on every projection:
    the loader keeps them as stored, and the W4A4 reference quantizes against them (the float64
    model of the rule agrees), not per row; tokens large enough that some saturate."""
    synthetic = sc.build(seed=int(rng.integers(1 << 16)))
    directory = sc.write(tmp_path / "ckpt", synthetic.tensors, synthetic.config, files=2)
    config, params = load_moe_layer(directory, sc.FIRST_MOE, progress=False)
    stored = synthetic.expected[sc.FIRST_MOE]["input_scales"]
    for name in ROUTED:
        np.testing.assert_array_equal(np.asarray(params["input_scales"][name]), stored[name])
    config = dataclasses.replace(config, expert_gemm="xla", reference_activations="nvfp4", activation_scale="checkpoint")
    x = jnp.asarray(rng.standard_normal((40, config.hidden_size)) * 2.0, jnp.bfloat16)
    got = forward(params, x, config)
    assert relative(got, w4a4_layer_np(params, x, config, static=True)[0]) < TOLERANCE
    dynamic = forward(params, x, dataclasses.replace(config, activation_scale="dynamic"))
    assert relative(dynamic, w4a4_layer_np(params, x, config, static=False)[0]) < TOLERANCE
    assert relative(got, dynamic) > 0.05  # the checkpoint's scales, not the rows' own
