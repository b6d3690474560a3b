"""The layer against float64 oracles: with every expert GEMM and exchange (those that cannot run
here skip with their reason), on the reference path with each preset's router; plus bad input
and isolation."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from harness import (
    FORWARD, WEIGHT_FORMATS, check_against_reference, combinations, devices_for, make, plan_or_skip, rel_err, tolerance_for,
)

import moe_jax
from moe_jax import MoEConfig, moe_forward, reference_forward, resolve

# On a GPU machine these run there: `auto` picks the GPU kernels, and XLA:GPU computes the rest
# (TF32 by default for float32 matmuls). No gpu-marked twin covers that at these shapes.
pytestmark = pytest.mark.gpu_check

TINY = dict(num_experts=8, hidden_size=64, expert_intermediate_size=32)
CONFIGS = {
    "mixtral": MoEConfig.mixtral_8x7b(**TINY),
    "kimi": MoEConfig.kimi_k2(**TINY, top_k=4),
    "deepseek": MoEConfig.deepseek_v3(num_experts=16, hidden_size=64, expert_intermediate_size=32, top_k=4),
    "qwen_like": MoEConfig(**TINY, top_k=3, normalize=False, num_shared_experts=1, shared_intermediate_size=48),
}


PALLAS_SHAPE = dict(num_experts=8, top_k=2, hidden_size=128, expert_intermediate_size=64)


@pytest.mark.parametrize("expert_gemm,exchange,weight_format", combinations())
def test_each_implementation_matches_the_float64_reference(rng, expert_gemm, exchange, weight_format):
    """Every registered expert GEMM with every registered exchange and weight format, on this
    machine's devices (an exchange between devices on an expert axis of 2), against the float64
    reference; a Pallas-kernel GEMM runs in the interpreter where there is no GPU."""
    config = MoEConfig.kimi_k2(**PALLAS_SHAPE, weight_format=weight_format, expert_gemm=expert_gemm,
                               exchange=exchange)
    where = devices_for(exchange, jax.devices())
    plan = plan_or_skip(config, where)
    check_against_reference(config, where, rng, plan=plan, tolerance=tolerance_for(plan))


# Kimi K2's router (sigmoid, correction bias, scaling) with both formats: the cross-product test
# above, which takes the kimi_k2 preset.
@pytest.mark.parametrize("name", [name for name in CONFIGS if name != "kimi"])
@pytest.mark.parametrize("weight_format", WEIGHT_FORMATS)
def test_matches_the_float64_reference(rng, name, weight_format):
    config = dataclasses.replace(CONFIGS[name], weight_format=weight_format)
    params, x = make(config, rng)
    # Precision "highest" (IEEE float32) for the router's float32 logits: under the GPU default,
    # TF32 (10-bit mantissa, ~5e-4 relative per product), an expert near the top-k boundary
    # can be chosen differently from the float64 oracle's choice, which changes that token
    # entirely. The expert GEMMs take bf16 operands, which this setting does not change.
    with jax.default_matmul_precision("highest"):
        y, stats = FORWARD(params, x, resolve(config))
    ref = reference_forward(params, np.asarray(x, np.float64), config)
    assert y.shape == x.shape and y.dtype == jnp.bfloat16
    # bf16 rounding of the SwiGLU output and of y: about 2^-8 relative.
    assert rel_err(y, ref) < 1e-2
    assert rel_err(y, ref, axis=1).max() < 3e-2  # every token, not just on average
    assert int(stats["tokens_per_expert"].sum()) == x.shape[0] * config.top_k
    assert int(stats["dropped"]) == 0
    assert np.isfinite(float(stats["load_balance_loss"]))


def test_all_tokens_on_one_expert_and_empty_experts(rng):
    config = MoEConfig.kimi_k2(**TINY, top_k=1, weight_format="nvfp4")
    params, x = make(config, rng, tokens=33)
    params["router"]["bias_e"] = jnp.zeros(8).at[5].set(100.0)  # selection only: weight stays sigmoid
    y, stats = FORWARD(params, x, resolve(config))
    np.testing.assert_array_equal(stats["tokens_per_expert"], [0] * 5 + [33] + [0] * 2)
    ref = reference_forward(params, np.asarray(x, np.float64), config)
    assert rel_err(y, ref) < 1e-2


def test_leading_dimensions_are_kept(rng):
    config = CONFIGS["kimi"]
    params, _ = make(config, rng)
    x = jnp.asarray(rng.standard_normal((2, 3, 5, 64)), jnp.bfloat16)
    y, _ = moe_forward(params, x, resolve(config))
    flat, _ = moe_forward(params, x.reshape(-1, 64), resolve(config))
    assert y.shape == x.shape
    np.testing.assert_array_equal(np.asarray(y).reshape(-1, 64), flat)


@pytest.mark.parametrize("poison", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("weight_format", ["bf16", "nvfp4"])
def test_a_non_finite_token_changes_no_other_token(rng, poison, weight_format):
    config = dataclasses.replace(CONFIGS["kimi"], weight_format=weight_format)
    params, x = make(config, rng, tokens=32)
    clean, _ = FORWARD(params, x, resolve(config))
    y, _ = FORWARD(params, x.at[7, 3].set(poison), resolve(config))
    others = np.arange(32) != 7
    np.testing.assert_array_equal(np.asarray(y)[others], np.asarray(clean)[others])
    assert np.isfinite(np.asarray(clean, np.float32)).all()


def test_capacity_drops_are_counted(rng):
    config = dataclasses.replace(CONFIGS["kimi"], capacity_factor=0.5)
    params, x = make(config, rng, tokens=30)
    _, stats = FORWARD(params, x, resolve(config))
    assert int(stats["dropped"]) == 30 * 4 - math.ceil(0.5 * 30 * 4)


def test_bad_input_raises_naming_the_argument(rng):
    config = CONFIGS["kimi"]
    params, x = make(config, rng)
    plan = resolve(config)
    with pytest.raises(ValueError, match=r"x: shape \(\), expected \[\.\.\., H\]"):
        moe_forward(params, x[0, 0], plan)
    with pytest.raises(ValueError, match=r"x: shape \(24, 63\), expected last dimension H = config.hidden_size = 64"):
        moe_forward(params, x[:, :63], plan)
    with pytest.raises(ValueError, match=r"x: dtype int32, expected a floating dtype"):
        moe_forward(params, x.astype(jnp.int32), plan)
    broken = {**params, "experts": {**params["experts"], "w_down_ehf": params["experts"]["w_down_ehf"][:, :, :16]}}
    with pytest.raises(ValueError, match=r"params\['experts'\]\['w_down_ehf'\]: shape \(8, 64, 16\), expected \(8, 64, 32\)"):
        moe_forward(broken, x, plan)
    missing = {**params, "router": {"w_eh": params["router"]["w_eh"]}}
    with pytest.raises(ValueError, match=r"params\['router'\]\['bias_e'\]: missing"):
        moe_forward(missing, x, plan)
    with pytest.raises(ValueError, match=r"params\['experts'\]\['w_gate_up_egh'\]: a bfloat16 array, expected an NVFP4Tensor"):
        moe_forward(params, x, resolve(dataclasses.replace(config, weight_format="nvfp4")))


def dense_forward(params, x, config):
    """Every expert on every token, weighted by a dense [T, E] combine matrix: no sorting,
    no ragged ops; the independent oracle for gradients (float32)."""
    logits = x @ params["router"]["w_eh"].T
    ids, w = moe_jax.router.route(logits, config, correction_bias_e=params["router"].get("bias_e"))
    combine_te = jnp.zeros((x.shape[0], config.num_experts)).at[jnp.arange(x.shape[0])[:, None], ids].add(w)
    h = jnp.einsum("th,egh->teg", x, params["experts"]["w_gate_up_egh"])
    gate, up = jnp.split(h, 2, axis=-1)
    y_teh = jnp.einsum("tef,ehf->teh", jax.nn.silu(gate) * up, params["experts"]["w_down_ehf"])
    return jnp.einsum("te,teh->th", combine_te, y_teh)


def test_gradients_match_a_dense_formulation(rng):
    config = MoEConfig.kimi_k2(**TINY, top_k=2, num_shared_experts=0, dtype="float32")
    params, x = make(config, rng, tokens=16)
    params = jax.tree.map(lambda a: a.astype(jnp.float32), params)
    x = x.astype(jnp.float32)
    probe = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
    plan = resolve(config, training=True)

    def loss(fn):
        return lambda p, x: jnp.sum(fn(p, x) * probe)

    # Both sides in IEEE float32 ("highest"): the tolerance below is float32's. Under TF32, the
    # GPU default for float32 matmuls (10-bit mantissa, ~5e-4 relative per product), the two
    # formulations sum different products and one gradient element differed by 8e-2 relative
    # on an H200. XLA:CPU computes float32 matmuls in float32 either way.
    with jax.default_matmul_precision("highest"):
        grads = jax.jit(jax.grad(loss(lambda p, x: moe_forward(p, x, plan)[0]), argnums=(0, 1)))(params, x)
        ref = jax.jit(jax.grad(loss(lambda p, x: dense_forward(p, x, config)), argnums=(0, 1)))(params, x)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref)):
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5 * float(np.abs(want).max()))


def test_nnx_module_jit_and_grad(rng):
    config = CONFIGS["kimi"]
    layer = moe_jax.MoE(config, rngs=nnx.Rngs(int(rng.integers(1 << 30))), training=True)
    x = jnp.asarray(rng.standard_normal((10, 64)), jnp.bfloat16)
    y, stats = nnx.jit(lambda m, x: m(x))(layer, x)
    y_fn, _ = FORWARD(layer.params(), x, layer.plan)
    np.testing.assert_array_equal(y, y_fn)
    assert set(stats) == {"tokens_per_expert", "load_balance_loss", "router_z_loss", "dropped", "nonfinite_tokens", "rows_sent"}

    def loss(m, x):
        y, stats = m(x)
        return jnp.mean(y.astype(jnp.float32) ** 2) + 0.01 * stats["load_balance_loss"]

    grads = nnx.jit(nnx.grad(loss))(layer, x)
    leaves = jax.tree.leaves(nnx.state(grads, nnx.Param))
    assert len(leaves) == 5 and all(np.isfinite(np.asarray(g, np.float32)).all() for g in leaves)
    assert any(float(jnp.abs(g).max()) > 0 for g in leaves)


def test_nnx_module_with_nvfp4_weights_keeps_them_out_of_the_gradient(rng):
    config = dataclasses.replace(CONFIGS["kimi"], weight_format="nvfp4")
    layer = moe_jax.MoE(config, rngs=nnx.Rngs(0), training=True)
    assert isinstance(layer.w_gate_up_egh.packed, moe_jax.module.QuantizedWeight)
    x = jnp.asarray(rng.standard_normal((10, 64)), jnp.bfloat16)
    grads = nnx.jit(nnx.grad(lambda m, x: jnp.sum(m(x)[0].astype(jnp.float32))))(layer, x)
    names = {str(path[0]) for path, _ in nnx.to_flat_state(nnx.state(grads, nnx.Param))}
    assert names == {"router_w_eh"}  # the shared expert is NVFP4 too; the bias is a CorrectionBias


def test_nnx_module_on_an_expert_parallel_mesh(rng, cpu_devices):
    config = CONFIGS["kimi"]
    mesh = jax.make_mesh((4,), ("expert",), devices=cpu_devices[:4])
    sharded = moe_jax.MoE(config, rngs=nnx.Rngs(3), mesh=mesh)
    single = moe_jax.MoE(config, rngs=nnx.Rngs(3), mesh=None)
    assert sharded.plan.target.expert_parallel == 4
    w = sharded.w_gate_up_egh.get_value()
    assert w.sharding.spec[0] == "expert"
    assert w.addressable_shards[0].data.shape[0] == config.num_experts // 4  # each device: its experts only
    x = jnp.asarray(rng.standard_normal((22, 64)), jnp.bfloat16)
    # On a GPU machine `single` runs on the GPU and `sharded` on the CPU devices: precision
    # "highest" keeps the GPU's float32 router logits IEEE float32 (not TF32, ~5e-4 relative per
    # product), so near-tied experts are chosen as on the CPU and the counts below match exactly.
    with jax.default_matmul_precision("highest"):
        y, stats = nnx.jit(lambda m, x: m(x))(sharded, x)
        y1, stats1 = nnx.jit(lambda m, x: m(x))(single, x)
    np.testing.assert_array_equal(stats["tokens_per_expert"], stats1["tokens_per_expert"])
    assert rel_err(y, np.asarray(y1, np.float64)) < 5e-3
