"""One non-finite token changes nothing but its own output, forward and backward.

The loss is ``sum over the other tokens of y * r + 0.1 * load_balance_loss + 0.01 *
router_z_loss``: the bad token's output is masked out, as a training loss over padded or
corrupted batches would. A NaN (or Inf) row would still make ``x^T dy`` NaN under a zero
cotangent; the layer reads such a token as zeros everywhere. Checked against the same batch
with the token removed: every parameter gradient finite and equal (to float rounding of sums
over a different number of tokens), the other tokens' input gradients and outputs equal, the
bad token's output NaN and its input gradient zero. On ``xla`` (bf16, frozen NVFP4, QAT) on one
device and on expert-parallel meshes, and on ``pallas`` in the interpreter (on a GPU:
``test_nonfinite_gradients_gpu.py``).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sharding
from moe_jax import MoEConfig, init_params, moe_forward, quantize_params, resolve, shard_params

CONFIG = MoEConfig(num_experts=4, top_k=2, hidden_size=64, expert_intermediate_size=64, num_shared_experts=1,
                   scoring="sigmoid", router_bias=True, expert_gemm="xla")
TOKENS, BAD = 12, 5
RTOL = 2e-2  # relative Frobenius per leaf: bf16 sums over 11 or 12 tokens in another order


def _setup(fmt: str, rng, **overrides):
    config = dataclasses.replace(CONFIG, weight_format="bf16" if fmt == "bf16" else "nvfp4", qat=fmt == "qat",
                                 **overrides)
    if fmt == "qat":
        config = dataclasses.replace(config, shared_weight_format="bf16")
    dense = dataclasses.replace(config, weight_format="bf16", qat=False)
    params = init_params(dense, jax.random.key(int(rng.integers(1 << 30))))
    params["router"]["bias_e"] = jnp.asarray(rng.standard_normal(config.num_experts) * 0.3, jnp.float32)
    if fmt == "nvfp4":
        params = quantize_params(params, config)
    x = jnp.asarray(rng.standard_normal((TOKENS, config.hidden_size)), jnp.bfloat16)
    r = jnp.asarray(rng.standard_normal((TOKENS, config.hidden_size)), jnp.float32)
    return config, params, x, r


def _loss(params, x, r, keep, plan):
    y, stats = moe_forward(params, x, plan)
    kept = jnp.where(keep[:, None], y.astype(jnp.float32) * r, 0.0)
    return jnp.sum(kept) + 0.1 * stats["load_balance_loss"] + 0.01 * stats["router_z_loss"], y


# One jit for the module: a batch's shapes and plan compile once, for every value checked.
_value_and_grads = jax.jit(jax.value_and_grad(_loss, argnums=(0, 1), has_aux=True, allow_int=True),
                           static_argnums=4)


def _grads(params, x, r, keep, plan):
    with jax.default_matmul_precision("highest"):
        (_, y), grads = _value_and_grads(params, x, r, keep, plan)
    return y, grads


def check(fmt, rng, devices, *, mesh=None, values=(np.nan, np.inf), **overrides):
    """Each of ``values`` in one token (one compilation of the batch serves all of them)."""
    config, params, x, r = _setup(fmt, rng, **overrides)
    plan = resolve(config, mesh if mesh is not None else devices[:1])
    if mesh is not None:
        params = shard_params(params, plan)
    keep = np.arange(TOKENS) != BAD
    y_ref, (g_ref, gx_ref) = _grads(params, x[keep], r[keep], jnp.ones(TOKENS - 1, bool), plan)
    for value in values:
        _check_one_bad_token(_grads(params, x.at[BAD, 7].set(value), r, jnp.asarray(keep), plan),
                             (y_ref, (g_ref, gx_ref)), keep)


def _check_one_bad_token(bad, ref, keep):
    y_bad, (g_bad, gx_bad) = bad
    y_ref, (g_ref, gx_ref) = ref
    for path, leaf in jax.tree_util.tree_leaves_with_path(g_bad):
        if leaf.dtype == jax.dtypes.float0:  # NVFP4 codes and scales: integers, no gradient
            continue
        assert np.isfinite(np.asarray(leaf, np.float32)).all(), f"gradient {jax.tree_util.keystr(path)} not finite"
    got = jax.tree_util.tree_leaves_with_path(g_bad)
    want = jax.tree_util.tree_leaves(g_ref)
    assert any(a.dtype != jax.dtypes.float0 for _, a in got)
    for (path, a), b in zip(got, want, strict=True):
        if a.dtype == jax.dtypes.float0:
            continue
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        err = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
        assert err < RTOL, f"gradient {jax.tree_util.keystr(path)}: relative difference {err:.3g}"
    np.testing.assert_array_equal(np.asarray(gx_bad)[BAD], 0)
    np.testing.assert_allclose(np.asarray(gx_bad, np.float32)[keep], np.asarray(gx_ref, np.float32),
                               rtol=RTOL, atol=1e-3 * float(np.abs(np.asarray(gx_ref, np.float32)).max()))
    assert np.isnan(np.asarray(y_bad, np.float32)[BAD]).all()
    np.testing.assert_allclose(np.asarray(y_bad, np.float32)[keep], np.asarray(y_ref, np.float32),
                               rtol=RTOL, atol=1e-2 * float(np.abs(np.asarray(y_ref, np.float32)).max()))


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4", "qat"])
def test_xla_one_device(rng, cpu_devices, fmt):
    check(fmt, rng, cpu_devices)


@pytest.mark.parametrize("ep,dp", [(2, 1), (4, 2)])
def test_xla_on_expert_parallel_meshes(rng, cpu_devices, ep, dp):
    check("bf16", rng, cpu_devices, mesh=sharding.make_mesh(ep, data_parallel=dp, devices=cpu_devices[:ep * dp]))


@pytest.mark.parametrize("fmt", ["bf16", "qat"])
def test_pallas_in_the_interpreter(rng, cpu_devices, fmt):
    check(fmt, rng, cpu_devices, expert_gemm="pallas", interpret=True)
