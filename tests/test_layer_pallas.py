"""The layer with the Pallas expert kernels: in the interpreter on CPU (on one device and under
an expert-parallel mesh), natively on a GPU."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import EP_EXCHANGES, FORWARD, WEIGHT_FORMATS, check_against_reference, dot_operands, make, names, rel_err

import sharding
from moe_jax import MoEConfig, expert_gemm, moe_forward, nvfp4, reference_forward, resolve, shard_params

SHAPE = dict(num_experts=8, top_k=3, hidden_size=128, expert_intermediate_size=64)


def test_pallas_in_the_interpreter_with_a_global_scale_per_gate_and_up_half(rng, cpu_devices):
    config = MoEConfig.kimi_k2(**SHAPE, weight_format="nvfp4", expert_gemm="pallas", interpret=True)
    check_against_reference(config, cpu_devices[:1], rng, own_scales=True)


def test_global_scale_per_half_under_an_expert_parallel_mesh(rng, cpu_devices):
    """``[E, 2]`` global scales shard with their experts (``(expert, None)``) and the layer on a
    2-device mesh, interpreted kernels inside its shard_map, still matches the reference."""
    config = MoEConfig.kimi_k2(**{**SHAPE, "top_k": 2}, weight_format="nvfp4", expert_gemm="pallas",
                               exchange="padded", interpret=True)
    mesh = sharding.make_mesh(2, devices=cpu_devices[:2])
    params, _ = make(config, rng, tokens=1, own_scales=True)
    placed = shard_params(params, resolve(config, mesh))
    global_scale = placed["experts"]["w_gate_up_egh"].global_scale
    assert global_scale.sharding.spec == jax.sharding.PartitionSpec("expert", None)
    assert {s.data.shape for s in global_scale.addressable_shards} == {(config.num_experts // 2, 2)}
    check_against_reference(config, mesh, rng, own_scales=True)


def test_the_dense_shared_experts_gradients_multiply_in_bf16(rng):
    """``matmul_f32_grads_in_operand_dtype`` against float64: a float32 product whose backward
    rounds the cotangent to bf16 (exact where it is a bf16 value, as the layer's down projection's
    is), accumulates in float32 and returns bf16 gradients, every product in bf16."""
    a = jnp.asarray(rng.standard_normal((48, 96)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((80, 96)), jnp.bfloat16)
    a64, w64 = (np.asarray(v, np.float64) for v in (a, w))
    y, pull = jax.vjp(expert_gemm.matmul_f32_grads_in_operand_dtype, a, w)
    assert y.dtype == jnp.float32 and rel_err(y, a64 @ w64.T) < 1e-6
    exact = jnp.asarray(rng.standard_normal((48, 80)), jnp.bfloat16).astype(jnp.float32)
    rough = jnp.asarray(rng.standard_normal((48, 80)), jnp.float32)
    for g in (exact, rough):
        da, dw = pull(g)
        assert (da.dtype, dw.dtype) == (jnp.bfloat16, jnp.bfloat16)
        g64 = np.asarray(g.astype(jnp.bfloat16), np.float64)  # the cotangent it multiplies
        assert rel_err(da, g64 @ w64) < 4e-3 and rel_err(dw, g64.T @ a64) < 4e-3
    assert rel_err(pull(rough)[0], np.asarray(rough, np.float64) @ w64) < 1e-2  # bf16's precision
    vjp = jax.jit(lambda a, w, g: jax.vjp(expert_gemm.matmul_f32_grads_in_operand_dtype, a, w)[1](g))
    dots = dot_operands(vjp.lower(a, w, rough).as_text())
    assert dots and {dtype for dot in dots for _, dtype in dot} == {"bf16"}, dots


@pytest.mark.parametrize("expert_gemm_name", ["pallas", "xla"])
def test_the_layers_gradient_multiplies_a_bf16_shared_expert_in_bf16(rng, cpu_devices, expert_gemm_name):
    """The kernels' layer gradient runs the bf16 shared expert's four backward products in bf16
    (as float32 dots they took ~0.9 ms of a Kimi-shaped 4096-token step on an H100, TF32); the
    ``xla`` reference keeps them in float32, which the gradient tests compare the kernels with."""
    config = MoEConfig.kimi_k2(**{**SHAPE, "hidden_size": 256}, expert_gemm=expert_gemm_name,
                               interpret=True)
    plan = resolve(config, cpu_devices[:1], training=True)
    params, x = make(config, rng, tokens=40)
    s, h = config.shared_size, config.hidden_size
    shared_shapes = {(2 * s, h), (h, s), (40, 2 * s), (40, s)}  # its weights and activations
    assert len(shared_shapes | {(40, h), (h, config.num_experts), (40, config.num_experts)}) == 7  # no clash
    grad = jax.jit(jax.grad(lambda p, x: moe_forward(p, x, plan)[0].astype(jnp.float32).sum(), argnums=(0, 1)))
    f32_shared = [dot for dot in dot_operands(grad.lower(params, x).as_text())
                  if any(dtype == "f32" and shape in shared_shapes for shape, dtype in dot)]
    if expert_gemm_name == "xla":
        assert len(f32_shared) == 4, f32_shared
        assert "gradients multiplied" not in plan.report
    else:
        assert f32_shared == []
        assert plan.report.splitlines()[-1].endswith("bf16 weights, XLA dot, gradients multiplied in bfloat16")


@pytest.mark.parametrize("exchange", names(EP_EXCHANGES))
@pytest.mark.parametrize("weight_format", WEIGHT_FORMATS)
def test_gpu_kernels_trace_under_shard_map_with_vma_checks(rng, cpu_devices, exchange, weight_format):
    """The CPU twin of the GPU path under expert parallelism: the compiled (not interpreted)
    kernels inside the layer's ``shard_map(check_vma=True)``, traced for a 2 x H200 target.

    On GPUs this failed at trace time ("manual_axis_type on jax.ShapeDtypeStruct must not be
    None"); tracing needs no GPU, so the typing is checked here for every exchange.
    """
    config = MoEConfig.kimi_k2(**SHAPE, weight_format=weight_format, exchange=exchange, expert_gemm="pallas",
                               interpret=True)
    mesh = sharding.make_mesh(2, devices=cpu_devices[:2])
    on_cpu = resolve(dataclasses.replace(config, exchange="padded"), mesh)
    h200 = dataclasses.replace(on_cpu.target, platform="cuda", device_kind="NVIDIA H200", compute_capability=90)
    plan = dataclasses.replace(on_cpu, config=dataclasses.replace(config, interpret=False), target=h200,
                               decisions=tuple(dataclasses.replace(d, chosen=getattr(config, d.stage))
                                               for d in on_cpu.decisions))
    assert (plan.expert_gemm, plan.exchange, plan.config.interpret) == ("pallas", exchange, False)
    params, x = make(config, rng, tokens=40)
    jaxpr = FORWARD.trace(params, x, plan).jaxpr
    [body] = [eqn.params["jaxpr"] for eqn in jaxpr.eqns if eqn.primitive.name == "shard_map"]
    assert "pallas_call" in str(body)  # the kernels run inside the shard_map


@pytest.mark.parametrize("exchange", names(EP_EXCHANGES))
@pytest.mark.parametrize("qat", [False, True], ids=["bf16", "qat"])
def test_gpu_kernel_gradients_trace_under_shard_map_with_vma_checks(rng, cpu_devices, exchange, qat):
    """As above for ``jax.grad`` with a training plan: the backward kernels (input and weight
    gradients) are typed for ``shard_map(check_vma=True)`` too, the weight gradients varying over
    the expert axis with their weights."""
    config = MoEConfig.kimi_k2(**SHAPE, weight_format="nvfp4" if qat else "bf16", qat=qat, shared_weight_format="bf16",
                               exchange=exchange, expert_gemm="pallas", interpret=True)
    mesh = sharding.make_mesh(2, devices=cpu_devices[:2])
    on_cpu = resolve(dataclasses.replace(config, exchange="padded"), mesh, training=True)
    h200 = dataclasses.replace(on_cpu.target, platform="cuda", device_kind="NVIDIA H200", compute_capability=90)
    plan = dataclasses.replace(on_cpu, config=dataclasses.replace(config, interpret=False), target=h200,
                               decisions=tuple(dataclasses.replace(d, chosen=getattr(config, d.stage))
                                               for d in on_cpu.decisions))
    params, x = make(dataclasses.replace(config, weight_format="bf16", qat=False), rng, tokens=40)

    def loss(params, x):
        y, stats = moe_forward(params, x, plan)
        return jnp.sum(y.astype(jnp.float32) ** 2) + stats["load_balance_loss"]

    jaxpr = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(params, x).jaxpr
    names = re.findall(r"name=(grouped_[a-z0-9_]+)", str(jaxpr))
    assert {"grouped_matmul_input_grad_bf16_decode", "grouped_weight_grad_bfloat16"} <= set(names) or (
        qat and {"grouped_matmul_input_grad_nvfp4_decode", "grouped_weight_grad_bfloat16"} <= set(names)), set(names)


def test_pallas_on_cpu_without_the_interpreter_raises(cpu_devices):
    config = MoEConfig.kimi_k2(**SHAPE, expert_gemm="pallas")
    with pytest.raises(ValueError, match="expert_gemm = 'pallas' cannot run on .*needs an NVIDIA GPU, found cpu"):
        resolve(config, cpu_devices[:1])


@pytest.mark.gpu
@pytest.mark.parametrize("weight_format", ["bf16", "nvfp4"])
def test_pallas_on_gpu_matches_the_reference(rng, weight_format):
    config = MoEConfig.kimi_k2(**SHAPE, weight_format=weight_format, expert_gemm="pallas")
    check_against_reference(config, jax.devices("gpu")[:1], rng, tokens=300)


@pytest.mark.gpu
def test_pallas_on_gpu_with_a_global_scale_per_gate_and_up_half(rng):
    config = MoEConfig.kimi_k2(**SHAPE, weight_format="nvfp4", expert_gemm="pallas")
    check_against_reference(config, jax.devices("gpu")[:1], rng, tokens=300, own_scales=True)


def test_an_nvfp4_shared_expert_runs_through_the_kernels_up_to_its_token_limit(rng, cpu_devices):
    """As one expert holding every token, against float64 of the same NVFP4 weights; beyond the
    limit (here: a plan with limit 0) densely, and the layer matches the reference both ways."""
    config = MoEConfig.kimi_k2(**SHAPE, weight_format="nvfp4", expert_gemm="pallas", interpret=True)
    plan = resolve(config, cpu_devices[:1])
    assert plan.shared_kernel_max_tokens == expert_gemm.SHARED_KERNEL_MAX_TOKENS["pallas"] == 1024
    params, x = make(config, rng, tokens=24)
    w_gate_up, w_down = params["shared"]["w_gate_up_gh"], params["shared"]["w_down_hs"]
    gate_up = np.asarray(nvfp4.dequantize(w_gate_up, jnp.float32), np.float64)
    down = np.asarray(nvfp4.dequantize(w_down, jnp.float32), np.float64)
    h = np.asarray(x, np.float64) @ gate_up.T
    gate, up = np.split(h, 2, axis=1)
    ref = (gate / (1 + np.exp(-gate)) * up) @ down.T
    y = np.asarray(jax.jit(expert_gemm.shared_expert_mlp, static_argnums=3)(x, w_gate_up, w_down, plan), np.float64)
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 1e-2
    dense = dataclasses.replace(plan, shared_kernel_max_tokens=0)

    def pallas_calls(p):
        return str(jax.make_jaxpr(lambda x: moe_forward(params, x, p)[0])(x)).count("pallas_call")

    assert pallas_calls(plan) == pallas_calls(dense) + 2  # gate/up + SwiGLU and down, for the shared expert
    for p, scope in ((plan, "moe_jax.shared_expert.pallas"), (dense, "moe_jax.shared_expert.dense")):
        hlo = FORWARD.lower(params, x, p).compile().as_text()
        assert set(re.findall(r"moe_jax\.shared_expert\.[a-z_]+", hlo)) == {scope}
    layer_ref = reference_forward(params, np.asarray(x, np.float64), config)
    for p in (plan, dense):
        y_layer = np.asarray(FORWARD(params, x, p)[0], np.float64)
        assert np.linalg.norm(y_layer - layer_ref) / np.linalg.norm(layer_ref) < 1e-2
