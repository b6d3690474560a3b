"""The seed configuration's exchanges executed (issue 32): Kimi-K2-shaped routing (sigmoid
scores, a correction bias, top-8, no group limit, scaling 2.827, a shared expert) at a small
hidden size, over expert axes of 2, 4 and 8 CPU devices, through ``ragged`` and ``onecopy``
on the twin of ``ragged_all_to_all``. Each case compares outputs, statistics and gradients
with one device; the bias skews the load so that some experts are empty and a few take most
rows. One compilation per case: the output and the gradients come from one program.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import assert_same_output, assert_same_stats, make, mesh_for

from moe_jax import MoEConfig, moe_forward, resolve
from moe_jax.layer import shard_params
from moe_jax.traffic import RAGGED_COLLECTIVE

#: Kimi K2 at 64 experts and hidden 32 (a device holds 8 experts at EP = 8, 48 at full size).
SEED = MoEConfig.kimi_k2(num_experts=64, hidden_size=32, expert_intermediate_size=32)
TOKENS = 8 * 6 + 5
#: (expert-parallel size, the expert format, the xla path's activations): bf16; NVFP4 weights
#: as W4A4's reference (activations quantized to NVFP4, as the seed's triton kernels do); NVFP4
#: weights with bf16 activations.
CASES = [(2, "bf16", "bf16"), (4, "nvfp4", "nvfp4"), (8, "nvfp4", "bf16")]


def loss(trained, fixed, x, r, plan):
    y, stats = moe_forward({**fixed, **trained}, x, plan)
    return jnp.sum(y.astype(jnp.float32) * r) + stats["load_balance_loss"], (y, stats)


_RUN = jax.jit(jax.value_and_grad(loss, argnums=(0, 2), has_aux=True), static_argnums=4)


def run(params, x, r, plan):
    """Output, statistics and gradients (router, input, and the bf16 projections: NVFP4 ones
    are integer codes) from one program."""
    trained = {g: v for g, v in params.items() if g == "router" or plan.config.expert_param_format == "bf16"}
    (_, (y, stats)), g = _RUN(trained, {g: v for g, v in params.items() if g not in trained}, x, r, plan)
    return y, stats, g


def skewed_params(config, rng):
    """Random parameters whose correction bias sends most choices to experts 0-5 and 40-41,
    and none to 48-63 (device 7's at EP = 8, device 3's second half at EP = 4)."""
    params, x = make(config, rng, TOKENS)
    bias = params["router"]["bias_e"].at[jnp.array([0, 1, 2, 3, 4, 5, 40, 41])].add(3.0)
    params["router"]["bias_e"] = bias.at[48:].add(-100.0)
    return params, x


@pytest.mark.parametrize("exchange", RAGGED_COLLECTIVE)
@pytest.mark.parametrize("ep,weight_format,activations", CASES)
def test_seed_exchange_matches_one_device(rng, cpu_devices, exchange, ep, weight_format, activations):
    config = dataclasses.replace(SEED, weight_format=weight_format, reference_activations=activations,
                                 expert_gemm="xla")
    params, x = skewed_params(config, rng)
    r = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
    y_ref, stats_ref, g_ref = run(params, x, r, resolve(config, cpu_devices[:1]))
    counts = np.asarray(stats_ref["tokens_per_expert"])
    assert (counts[48:] == 0).all() and counts[[0, 1, 2, 3, 4, 5, 40, 41]].sum() > counts.sum() / 2

    plan = resolve(dataclasses.replace(config, exchange=exchange), mesh_for(ep, cpu_devices, 1))
    assert plan.exchange == exchange and plan.exchange_emulation == "emulated on XLA:CPU: correct, not fast"
    y, stats, g = run(shard_params(params, plan), x, r, plan)
    assert_same_output(y, y_ref)
    assert_same_stats(stats, stats_ref)
    assert int(stats["dropped"]) == 0 and int(stats["rows_sent"]) > 0
    # Weight gradients sum over tokens in another order (per device, then psum) and round to
    # bf16: norms within 1%, elements within 5% of the largest.
    for path, a, b in zip(jax.tree_util.tree_leaves_with_path(g), jax.tree.leaves(g), jax.tree.leaves(g_ref)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.linalg.norm(a - b) <= 1e-2 * np.linalg.norm(b) + 1e-30, jax.tree_util.keystr(path[0])
        np.testing.assert_allclose(a, b, rtol=0.05, atol=0.05 * np.abs(b).max())
