"""Expert parallelism on real GPUs (2 and 4): every exchange, ``ragged`` on XLA's own
``ragged_all_to_all``, against the layer on one GPU. Skipped where there are fewer GPUs.

The forward tests resolve with ``auto`` and assert that it chose the Pallas kernels, so the
kernels run under ``shard_map`` for every exchange (``ragged``, ``padded``, ``allgather``)
and both weight formats. Gradients resolve with ``training=True``, which also picks the kernels
(their VJP runs the backward kernels); ``tests/test_gradients_pallas.py`` compares them with the
``xla`` reference under every exchange.

Tolerance: as on CPU (see tests/test_expert_parallel.py), plus the kernels' tiles and
cuBLAS's algorithm may change with the row count (another float32 summation order), so
outputs are compared per token in relative norm against bf16's 2^-8 rounding, and routing
statistics exactly. Precision: the float32 router logits are computed at "highest" (IEEE
float32) on both sides. Under the GPU default, TF32 (10-bit mantissa, ~5e-4 relative per
product), a near-tied expert could be chosen differently by the two sides whenever XLA or
cuBLAS picks a TF32 kernel for one shape and an FP32 one for the other, and routing is
compared exactly; in IEEE float32 the sides differ by summation order only (~1e-7).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import EP_EXCHANGES, WEIGHT_FORMATS, make, names

import sharding
from moe_jax import MoEConfig, moe_forward, resolve
from moe_jax.layer import shard_params

CONFIG = MoEConfig(num_experts=32, top_k=4, hidden_size=256, expert_intermediate_size=128, num_shared_experts=1,
                   scoring="sigmoid", router_bias=True)
EP = [pytest.param(2, marks=pytest.mark.gpu(count=2)), pytest.param(4, marks=pytest.mark.gpu(count=4))]
WITNESS = "allgather"  # drops counted by the exchange that moves whole tokens, not rows


def mesh(ep):
    return sharding.make_mesh(ep, devices=jax.devices()[:ep])


def run_both(config, params, x, ep, exchange):
    """The layer over ``ep`` GPUs with ``exchange`` and the Pallas kernels, and on one GPU."""
    forward = jax.jit(moe_forward, static_argnums=2)
    single = resolve(dataclasses.replace(config, exchange="auto"), jax.devices()[:1])
    plan = resolve(dataclasses.replace(config, exchange=exchange), mesh(ep))
    assert plan.target.platform == "cuda" and plan.exchange == exchange
    assert plan.expert_gemm == "pallas" and single.expert_gemm == "pallas", (plan.report, single.report)
    with jax.default_matmul_precision("highest"):  # router logits: see the module docstring
        return forward(shard_params(params, plan), x, plan), forward(params, x, single)


def assert_close(result, reference, dropped=0):
    (y, stats), (y_ref, stats_ref) = result, reference
    y, y_ref = np.asarray(y, np.float64), np.asarray(y_ref, np.float64)
    assert np.isfinite(y).all()
    err = np.linalg.norm(y - y_ref, axis=1) / np.linalg.norm(y_ref, axis=1)
    assert err.max() < 2.0**-6, err.max()
    np.testing.assert_array_equal(stats["tokens_per_expert"], stats_ref["tokens_per_expert"])
    assert int(stats["dropped"]) == dropped


@pytest.mark.parametrize("ep", EP)
@pytest.mark.parametrize("weight_format", WEIGHT_FORMATS)
@pytest.mark.parametrize("exchange", names(EP_EXCHANGES))
def test_exchange_matches_one_gpu(rng, ep, exchange, weight_format):
    """Each exchange with the Pallas kernels under shard_map equals the layer on one GPU."""
    config = dataclasses.replace(CONFIG, weight_format=weight_format)
    params, x = make(config, rng, tokens=61 * ep + 3)
    assert_close(*run_both(config, params, x, ep, exchange))


@pytest.mark.parametrize("ep", EP)
def test_ragged_under_skew(rng, ep):
    """Every token on the experts of the last device: the largest receive bucket."""
    params, x = make(CONFIG, rng, tokens=64 * ep)
    e_l = CONFIG.num_experts // ep
    params["router"]["bias_e"] = params["router"]["bias_e"].at[-e_l:].add(100.0)
    assert_close(*run_both(CONFIG, params, x, ep, "ragged"))


@pytest.mark.parametrize("ep", EP)
def test_ragged_gradients(rng, ep):
    """Gradients through the ragged exchange equal those on one GPU; both plans are resolved
    with training=True and run the kernels' VJP."""
    params, x = make(CONFIG, rng, tokens=32 * ep)
    r = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)

    def loss(params, x, plan):
        return jnp.sum(moe_forward(params, x, plan)[0].astype(jnp.float32) * r)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
    plan = resolve(dataclasses.replace(CONFIG, exchange="ragged"), mesh(ep), training=True)
    assert plan.exchange == "ragged" and plan.target.training
    with jax.default_matmul_precision("highest"):  # same routing on both sides: see the module docstring
        g_ref = grad(params, x, resolve(CONFIG, jax.devices()[:1], training=True))
        g = grad(shard_params(params, plan), x, plan)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.isfinite(a).all()
        assert np.linalg.norm(a - b) <= 2e-2 * np.linalg.norm(b)


@pytest.mark.parametrize("ep", EP)
@pytest.mark.parametrize("exchange", names(tuple(e for e in EP_EXCHANGES if e != WITNESS)))
def test_capacity_drops_match_across_exchanges(rng, ep, exchange):
    """Drops are a property of the routing, not of the exchange: allgather is the witness."""
    config = dataclasses.replace(CONFIG, capacity_factor=0.5)
    params, x = make(config, rng, tokens=48 * ep)
    params["router"]["bias_e"] = params["router"]["bias_e"].at[:3].add(100.0)
    forward = jax.jit(moe_forward, static_argnums=2)
    witness = resolve(dataclasses.replace(config, exchange=WITNESS), mesh(ep))
    plan = resolve(dataclasses.replace(config, exchange=exchange), mesh(ep))
    assert plan.expert_gemm == "pallas" and witness.expert_gemm == "pallas", plan.report
    with jax.default_matmul_precision("highest"):  # same routing on both sides: see the module docstring
        y_witness, stats_witness = forward(shard_params(params, witness), x, witness)
        y, stats = forward(shard_params(params, plan), x, plan)
    assert int(stats_witness["dropped"]) > 0
    assert int(stats["dropped"]) == int(stats_witness["dropped"])
    err = np.linalg.norm(np.asarray(y, np.float64) - np.asarray(y_witness, np.float64), axis=1)
    assert err.max() <= 2.0**-6 * np.linalg.norm(np.asarray(y_witness, np.float64), axis=1).max()
