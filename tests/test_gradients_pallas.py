"""Gradients through the Pallas expert kernels (``moe_jax.expert_gemm.pallas_expert_gemm``'s custom
VJP) equal ``jax.grad`` of the ``xla`` reference path: in the Pallas interpreter on CPU, natively
on a GPU, on one device and under an expert-parallel ``shard_map``.

The loss is ``sum(y * r) + 0.1 * load_balance_loss`` with ``r`` random, so every output element
and the router see a gradient. Leaves compared: ``x``, the router, the shared expert, and the
routed experts when they are trainable (bf16 weights, or ``qat`` masters through the
straight-through estimator); NVFP4 weights stored as such are frozen. Tolerance: relative
Frobenius error 2e-2 per leaf: the backward kernels recompute the gate/up product in bf16 and
round the SwiGLU gradient to bf16, where the reference keeps float32 (about 5e-3 measured).
Router logits run at "highest" on both sides (TF32 could flip a near-tied expert).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import EP_EXCHANGES, names
from jax.sharding import AbstractDevice, AbstractMesh
from test_layer_triton import _needs_native_installed

import sharding
from moe_jax import MoEConfig, init_params, moe_forward, nvfp4, quantize_params, resolve, shard_params

CONFIG = MoEConfig(num_experts=8, top_k=3, hidden_size=128, expert_intermediate_size=64, num_shared_experts=1,
                   scoring="sigmoid", router_bias=True)
# The Pallas interpreter runs every grid program in Python: CPU tests take the smallest shape
# that still has several experts, empty ones and padding rows.
CPU_CONFIG = dataclasses.replace(CONFIG, num_experts=4, top_k=2, hidden_size=64)
TOLERANCE = 2e-2
FORMATS = ["bf16", "nvfp4", "nvfp4_own_scales", "qat"]


def _config(fmt: str, base: MoEConfig = CONFIG, **overrides) -> MoEConfig:
    weight_format = "bf16" if fmt == "bf16" else "nvfp4"
    config = dataclasses.replace(base, weight_format=weight_format, qat=fmt == "qat", **overrides)
    if fmt == "qat" and config.num_shared_experts:
        # qat trains the routed experts' masters; the shared expert then trains in bf16.
        config = dataclasses.replace(config, shared_weight_format="bf16")
    return config


def _params(config: MoEConfig, fmt: str, rng):
    """bf16 parameters; NVFP4 experts for the frozen formats (gate and up quantized separately,
    up 3-10x larger, for ``nvfp4_own_scales``); bf16 masters for ``qat``."""
    dense = dataclasses.replace(config, weight_format="bf16", qat=False)
    params = init_params(dense, jax.random.key(int(rng.integers(1 << 30))))
    params["router"]["bias_e"] = jnp.asarray(rng.standard_normal(config.num_experts) * 0.3, jnp.float32)
    match fmt:
        case "bf16" | "qat":
            pass
        case "nvfp4":
            params = quantize_params(params, config)
        case "nvfp4_own_scales":
            params = quantize_params(params, config)
            gate, up = jnp.split(nvfp4.dequantize(params["experts"]["w_gate_up_egh"]), 2, axis=1)
            up = up * jnp.asarray(rng.uniform(3, 10, (config.num_experts, 1, 1)), jnp.float32)
            params["experts"]["w_gate_up_egh"] = nvfp4.concat_rows(nvfp4.quantize(gate), nvfp4.quantize(up))
        case _:
            raise AssertionError(fmt)
    return params


def _split(params):
    """(trainable, frozen): NVFP4 tensors are frozen, everything else is trained."""
    is_frozen = lambda w: isinstance(w, nvfp4.NVFP4Tensor)
    frozen = {g: {n: w for n, w in leaves.items() if is_frozen(w)} for g, leaves in params.items()}
    trainable = {g: {n: w for n, w in leaves.items() if not is_frozen(w)} for g, leaves in params.items()}
    return trainable, frozen


def _grads(params, x, r, plan):
    def loss(trainable, x, frozen):
        merged = {g: {**trainable[g], **frozen[g]} for g in trainable}
        y, stats = moe_forward(merged, x, plan)
        return jnp.sum(y.astype(jnp.float32) * r) + 0.1 * stats["load_balance_loss"]

    trainable, frozen = _split(params)
    with jax.default_matmul_precision("highest"):  # router logits: see the module docstring
        return jax.jit(jax.grad(loss, argnums=(0, 1)))(trainable, x, frozen)


def check_gradients(fmt: str, devices, rng, *, ep: int = 1, exchange: str = "auto", interpret: bool,
                    tokens: int = 16, implementation: str = "pallas"):
    """``implementation``'s gradients on ``ep`` devices (a mesh when ep > 1) against xla on one device."""
    config = _config(fmt, CPU_CONFIG if interpret else CONFIG, exchange=exchange, interpret=interpret)
    params = _params(config, fmt, rng)
    x = jnp.asarray(rng.standard_normal((tokens, config.hidden_size)), jnp.bfloat16)
    r = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
    where = sharding.make_mesh(ep, devices=devices[:ep]) if ep > 1 else devices[:1]
    plan = resolve(dataclasses.replace(config, expert_gemm=implementation), where, training=True)
    reference = resolve(dataclasses.replace(config, expert_gemm="xla", exchange="auto", interpret=False),
                        devices[:1], training=True)
    placed = shard_params(params, plan) if ep > 1 else params
    got, want = _grads(placed, x, r, plan), _grads(params, x, r, reference)
    trainable_experts = sorted(got[0]["experts"])
    assert trainable_experts == ([] if fmt.startswith("nvfp4") else ["w_down_ehf", "w_gate_up_egh"])
    errors = {}
    for path, a in jax.tree_util.tree_leaves_with_path(got):
        b = np.asarray(_at(want, path), np.float64)
        a = np.asarray(a, np.float64)
        assert np.isfinite(a).all(), jax.tree_util.keystr(path)
        # The selection bias has no gradient on either side (it only picks experts): zeros.
        scale = np.linalg.norm(b) or 1.0
        errors[jax.tree_util.keystr(path)] = np.linalg.norm(a - b) / scale
    bad = {k: f"{v:.3g}" for k, v in errors.items() if not v <= TOLERANCE}
    assert not bad, f"relative errors above {TOLERANCE}: {bad}; all: { {k: f'{v:.2g}' for k, v in errors.items()} }"
    return plan


def _at(tree, path):
    for key in path:
        tree = tree[key.idx if hasattr(key, "idx") else key.key]
    return tree


# Plain NVFP4 runs on the GPU; per-half scales cover the frozen path here.
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4_own_scales", "qat"])
def test_interpreted_kernel_gradients_match_the_reference(rng, cpu_devices, fmt):
    plan = check_gradients(fmt, cpu_devices, rng, interpret=True)
    assert plan.expert_gemm == "pallas" and plan.target.training


def test_interpreted_kernel_gradients_under_an_expert_parallel_mesh(rng, cpu_devices):
    check_gradients("qat", cpu_devices, rng, ep=2, exchange="padded", interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_kernel_gradients_match_the_reference(rng, fmt):
    plan = check_gradients(fmt, jax.devices(), rng, interpret=False, tokens=301)
    assert plan.target.platform == "cuda"


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4", "nvfp4_own_scales", "qat"])
def test_gpu_native_kernel_gradients_match_the_reference(rng, fmt):
    """The Triton-language kernels' VJP (bf16: ``BF16_BACKEND``, which ``auto`` takes for bf16
    training on SM90, with its padding-rows kernel; W4A16: the native input-gradient kernel; qat
    masters' weight gradients through the Pallas kernel). Their CPU twins are the interpreted
    kernel tests (tests/interpreter/)."""
    plan = check_gradients(fmt, jax.devices(), rng, interpret=False, tokens=301, implementation="triton")
    assert plan.expert_gemm == "triton"


@pytest.mark.parametrize("ep", [pytest.param(2, marks=pytest.mark.gpu(count=2)),
                                pytest.param(4, marks=pytest.mark.gpu(count=4))])
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4", "qat"])
@pytest.mark.parametrize("exchange", names(EP_EXCHANGES))
def test_gpu_kernel_gradients_under_shard_map_with_every_exchange(rng, ep, exchange, fmt):
    plan = check_gradients(fmt, jax.devices(), rng, ep=ep, exchange=exchange, interpret=False, tokens=64 * ep + 3)
    assert plan.exchange == exchange


def test_auto_picks_the_kernels_for_training_on_a_gpu_and_says_so():
    device = AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="cuda")
    mesh = AbstractMesh((1,), ("expert",), abstract_device=device)
    # Where the native bf16 kernels have no tiles (not SM90), the Pallas kernels, and why.
    ampere = AbstractMesh((1,), ("expert",), abstract_device=AbstractDevice(device_kind="NVIDIA A100-SXM4-80GB",
                                                                             num_cores=None, platform="cuda"))
    plan = resolve(dataclasses.replace(CONFIG, weight_format="bf16"), ampere, training=True)
    assert plan.expert_gemm == "pallas" and plan.target.training
    assert "differentiable" in plan.report, plan.report
    _needs_native_installed()
    plan = resolve(dataclasses.replace(CONFIG, weight_format="bf16"), mesh, training=True)
    assert plan.expert_gemm == "triton", plan.report
    assert "bf16 training" in plan.report and "train_step_h100/af45c6d/train_step.json" in plan.report, plan.report
    plan = resolve(dataclasses.replace(CONFIG, weight_format="nvfp4"), mesh, training=True)
    assert plan.expert_gemm == "triton", plan.report
    assert "NVFP4 training" in plan.report and "train_step_h200/train_step.json" in plan.report, plan.report


def test_qat_needs_nvfp4():
    with pytest.raises(ValueError, match=r"^MoEConfig.qat = True: needs weight_format='nvfp4'"):
        MoEConfig(num_experts=4, top_k=1, hidden_size=64, expert_intermediate_size=64, qat=True)


def test_qat_keeps_float_masters_and_the_forward_uses_their_quantization(rng, cpu_devices):
    """Under qat the parameters are float masters, and the layer's output is that of the same
    layer with the masters' NVFP4 quantization stored (the host quantizer's)."""
    config = _config("qat", CPU_CONFIG)
    params = init_params(config, jax.random.key(int(rng.integers(1 << 30))))
    assert all(not isinstance(w, nvfp4.NVFP4Tensor) and w.dtype == jnp.bfloat16 for w in params["experts"].values())
    x = jnp.asarray(rng.standard_normal((16, config.hidden_size)), jnp.bfloat16)
    frozen_config = dataclasses.replace(config, qat=False)
    frozen = quantize_params(params, frozen_config)
    forward = jax.jit(moe_forward, static_argnums=2)
    for gemm in ("xla", "pallas"):
        overrides = dict(expert_gemm=gemm, interpret=gemm == "pallas")
        y, _ = forward(params, x, resolve(dataclasses.replace(config, **overrides), cpu_devices[:1]))
        y_frozen, _ = forward(frozen, x, resolve(dataclasses.replace(frozen_config, **overrides), cpu_devices[:1]))
        np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_frozen, np.float32), err_msg=gemm)


def test_qat_trains_below_frozen_nvfp4(rng, cpu_devices):
    """A small layer fitted to a teacher with optax: training the masters through their NVFP4
    quantization (qat) ends at a lower loss than training only the router and the shared expert
    around frozen NVFP4 experts quantized from the same start."""
    import optax

    config = _config("qat", num_shared_experts=0, expert_gemm="xla")
    teacher = init_params(dataclasses.replace(config, qat=False, weight_format="bf16"), jax.random.key(7))
    start = init_params(config, jax.random.key(int(rng.integers(1 << 30))))
    x_all = jnp.asarray(rng.standard_normal((8, 64, config.hidden_size)), jnp.bfloat16)
    teacher_plan = resolve(dataclasses.replace(config, qat=False, weight_format="bf16"), cpu_devices[:1])
    # Jitted (one program for the 8 batches), here and for the final loss: run eagerly, each of
    # the layer's ops compiled alone (~130 compilations, 3 s of this test's 10).
    teach = jax.jit(lambda x: moe_forward(teacher, x, teacher_plan)[0].astype(jnp.float32))
    targets = [teach(x) for x in x_all]

    def fit(params, plan, steps=60):
        trainable, frozen = _split(params)
        optimizer = optax.adam(3e-3)
        state = optimizer.init(trainable)

        def loss(trainable, x, target):
            y, _ = moe_forward({g: {**trainable[g], **frozen[g]} for g in trainable}, x, plan)
            return jnp.mean((y.astype(jnp.float32) - target) ** 2)

        @jax.jit
        def step(trainable, state, x, target):
            value, grads = jax.value_and_grad(loss)(trainable, x, target)
            updates, state = optimizer.update(grads, state, trainable)
            return optax.apply_updates(trainable, updates), state, value

        for i in range(steps):
            trainable, state, _ = step(trainable, state, x_all[i % 8], targets[i % 8])
        final_loss = jax.jit(loss)
        return float(np.mean([final_loss(trainable, x, t) for x, t in zip(x_all, targets)]))

    qat_loss = fit(start, resolve(config, cpu_devices[:1], training=True))
    frozen_config = dataclasses.replace(config, qat=False)
    frozen_loss = fit(quantize_params(start, frozen_config), resolve(frozen_config, cpu_devices[:1], training=True))
    assert qat_loss < 0.8 * frozen_loss, (qat_loss, frozen_loss)
