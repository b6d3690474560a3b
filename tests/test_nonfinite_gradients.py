"""One non-finite token changes nothing but its own output, forward and backward.

The loss is ``sum over the other tokens of y * r + 0.1 * load_balance_loss + 0.01 *
router_z_loss``: the bad token's output is masked out, as a training loss over padded or
corrupted batches would. A NaN (or Inf) row would still make ``x^T dy`` NaN under a zero
cotangent; the layer reads such a token as zeros everywhere. Checked against the same batch
with the token removed: every parameter gradient finite and equal (to float rounding of sums
over a different number of tokens), the other tokens' input gradients and outputs equal, the
bad token's output NaN and its input gradient zero (the others' element by element within the
bf16 rounding error of the values each element is computed from, :func:`_rounding_scale`, not
within a fraction of the element itself, which can be a small difference of larger terms). On
``xla`` (bf16, frozen NVFP4, QAT) on one device and on expert-parallel meshes, and on ``pallas``
in the interpreter (on a GPU: ``test_nonfinite_gradients_gpu.py``).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sharding
from moe_jax import MoEConfig, init_params, moe_forward, nvfp4, quantize_params, resolve, router, shard_params
from pallas_kernels.grouped_matmul import reference

CONFIG = MoEConfig(num_experts=4, top_k=2, hidden_size=64, expert_intermediate_size=64, num_shared_experts=1,
                   scoring="sigmoid", router_bias=True, expert_gemm="xla")
TOKENS, BAD = 12, 5
RTOL = 2e-2  # relative Frobenius per leaf: bf16 sums over 11 or 12 tokens in another order
U = 2.0**-8  # bf16's unit roundoff: rounding to nearest moves a value by at most U of itself
GX_BOUND = 4  # the kept tokens' input gradients agree within GX_BOUND * U * _rounding_scale(...)


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


# --- How far the input gradient may move under bf16 rounding -------------------------------------


def _float64_weights(w, *, quantize: bool = False) -> np.ndarray:
    """float64 of what the layer multiplies by: bf16 as is, NVFP4 dequantized exactly, and with
    ``quantize`` (``qat`` masters) the NVFP4 quantization of ``w``; ``[N, K]`` or ``[E, N, K]``."""
    if quantize:
        w = nvfp4.quantize(jnp.asarray(w))
    if not isinstance(w, nvfp4.NVFP4Tensor):
        return np.asarray(jax.device_get(w), np.float64)
    packed, scales, global_scale = jax.device_get((w.packed, w.scales, w.global_scale))
    if packed.ndim == 2:
        return reference.dequantize(packed[None], scales[None], np.asarray(global_scale)[None])[0]
    return reference.dequantize(packed, scales, global_scale)


def _swiglu_roundings(x_h, dy_h, w_gate_up_gh, w_down_hf):
    """One token through one SwiGLU expert in float64: ``(y [H], dx [H], sq [H])``, its output,
    the input gradient for the output cotangent ``dy_h``, and the sum over every intermediate
    ``v`` that the path rounds to bf16 of ``(v * d dx / d v)^2``."""
    f = w_down_hf.shape[1]
    gate, up = np.split(w_gate_up_gh @ x_h, 2)
    w_gate, w_up = w_gate_up_gh[:f], w_gate_up_gh[f:]
    sig = 1 / (1 + np.exp(-gate))
    silu, dsilu = gate * sig, sig * (1 + gate * (1 - sig))
    d2silu = sig * (1 - sig) * (2 + gate * (1 - 2 * sig))
    da = w_down_hf.T @ dy_h  # the down projection's input gradient [F]
    dh = np.concatenate([da * up * dsilu, da * silu])  # the SwiGLU's [2F]
    dx = dh @ w_gate_up_gh
    d_da = (up * dsilu)[:, None] * w_gate + silu[:, None] * w_up  # d dx / d da [F, H]
    effects = (dy_h[:, None] * (w_down_hf @ d_da),  # the cotangent rows (bf16)
               da[:, None] * d_da,  # kernel output (bf16)
               dh[:, None] * w_gate_up_gh,  # cast to bf16 for the kernel
               dx[None],  # kernel output (bf16)
               (gate * da)[:, None] * ((up * d2silu)[:, None] * w_gate + dsilu[:, None] * w_up),  # kept gate (bf16)
               (up * da * dsilu)[:, None] * w_gate)  # kept up (bf16)
    return w_down_hf @ (silu * up), dx, sum(np.square(e).sum(axis=0) for e in effects)


def _rounding_scale(params, x_th, r_th, config: MoEConfig) -> np.ndarray:
    """float64 ``[T, H]``: ``Q``, the scale of the bf16 rounding error of each element of the
    input gradient of ``_loss``, from the float64 inputs (``x_th``, ``r_th``: the kept tokens).

    An element is the sum of the routed experts' terms, the shared expert's and the router's,
    each the end of a chain of values rounded to bf16: the cotangent rows, the down projection's
    input gradient, the SwiGLU's, the kept gate/up product, each projection's output, the
    router's float32 term cast to bf16, and the adds of the terms. A rounding moves its value
    ``v`` by at most ``U |v|``, and the element, to first order, by at most ``U |c|`` with
    ``c = v * d(element)/dv``. ``Q`` is the root-sum-square of ``c`` over those roundings, the
    scale of a sum of independent rounding errors. (The sum of ``|c|``, where every rounding goes
    the same way, is 6-19 times ``Q`` here, too loose to see a dropped router term.) Left out: the
    rounding of the router's forward outputs (0.2% of ``Q^2``) and the auxiliary losses' share of
    the router's term (float32, ~1% of it).

    ``GX_BOUND``: two runs whose roundings differ (a kernel or a fusion that rounds or sums in
    another order for 11 rows than for 12) differ by at most one ulp, ``2 U |c|``, per rounding
    that differs; for up to four of them ``2 U (|c1| + .. + |c4|) <= 4 U Q`` (Cauchy-Schwarz).
    On CPU (21 seeds per format) ``xla`` and ``pallas`` each stay within 2.0 U Q of float64 and
    within 2.3 U Q of each other. The bound still fails a sign flip of ~98.5% of the elements,
    one expert's, the shared expert's or (for ~90% of tokens) the router's term dropped, a
    doubled token, and a 3% error on the largest element (not 1%: that element's own rounding
    error against float64 reaches 0.75%).
    """
    x_th, r_th = np.asarray(x_th, np.float64), np.asarray(r_th, np.float64)
    w_router = _float64_weights(params["router"]["w_eh"])
    bias = params["router"].get("bias_e")
    logits_te = jnp.asarray(x_th @ w_router.T, jnp.float32)
    ids_tk, weights_tk = router.route(logits_te, config, correction_bias_e=bias)

    def token_weights_k(logits_e):
        return router.route(logits_e[None], config, correction_bias_e=bias)[1][0]

    # d weights_k / d logits_e of each token, by the layer's own routing rule.
    jac_tke = np.asarray(jax.vmap(jax.jacobian(token_weights_k))(logits_te), np.float64)
    ids_tk, weights_tk = np.asarray(ids_tk), np.asarray(weights_tk, np.float64)
    experts = params["experts"]
    w_gate_up = _float64_weights(experts["w_gate_up_egh"], quantize=config.qat)
    w_down = _float64_weights(experts["w_down_ehf"], quantize=config.qat)
    shared_gate_up = _float64_weights(params["shared"]["w_gate_up_gh"])
    shared_down = _float64_weights(params["shared"]["w_down_hs"])
    t, h = x_th.shape
    sq_th, routed_th, shared_th, router_th = np.zeros((t, h)), np.zeros((t, h)), np.zeros((t, h)), np.zeros((t, h))
    for i in range(t):
        d_weights_k = np.zeros(len(ids_tk[i]))
        for k, e in enumerate(ids_tk[i]):
            y, dx, sq = _swiglu_roundings(x_th[i], weights_tk[i, k] * r_th[i], w_gate_up[e], w_down[e])
            routed_th[i] += dx
            sq_th[i] += sq
            d_weights_k[k] = y @ r_th[i]
        _, shared_th[i], sq = _swiglu_roundings(x_th[i], r_th[i], shared_gate_up, shared_down)
        sq_th[i] += sq
        router_th[i] = (d_weights_k @ jac_tke[i]) @ w_router
    sq_th += np.square(routed_th)  # the adds, and the router's term cast to bf16
    sq_th += np.square(routed_th + shared_th) + np.square(routed_th + shared_th + router_th) + np.square(router_th)
    return np.sqrt(sq_th)


def check(fmt, rng, devices, *, mesh=None, values=(np.nan, np.inf), **overrides):
    """Each of ``values`` in one token (one compilation of the batch serves all of them)."""
    config, params, x, r = _setup(fmt, rng, **overrides)
    plan = resolve(config, mesh if mesh is not None else devices[:1])
    if mesh is not None:
        params = shard_params(params, plan)
    keep = np.arange(TOKENS) != BAD
    y_ref, (g_ref, gx_ref) = _grads(params, x[keep], r[keep], jnp.ones(TOKENS - 1, bool), plan)
    gx_tolerance = GX_BOUND * U * _rounding_scale(params, x[keep], r[keep], config)
    for value in values:
        _check_one_bad_token(_grads(params, x.at[BAD, 7].set(value), r, jnp.asarray(keep), plan),
                             (y_ref, (g_ref, gx_ref)), keep, gx_tolerance)


def _assert_input_gradients_agree(gx, gx_ref, tolerance):
    """``|gx - gx_ref| <= tolerance`` element by element, else an error naming the worst element."""
    gx, gx_ref = np.asarray(gx, np.float64), np.asarray(gx_ref, np.float64)
    assert gx.shape == gx_ref.shape == tolerance.shape
    ratio = np.abs(gx - gx_ref) / tolerance
    if not ratio.max() <= 1:  # also NaN
        worst = np.unravel_index(np.argmax(np.where(np.isnan(ratio), np.inf, ratio)), ratio.shape)
        worst = tuple(int(i) for i in worst)
        raise AssertionError(
            f"input gradient {worst}: {gx[worst]:.6g} against {gx_ref[worst]:.6g}, apart by {ratio[worst]:.3g} x the "
            f"tolerance {tolerance[worst]:.3g} (= {GX_BOUND} U Q, Q = {tolerance[worst] / (GX_BOUND * U):.3g}); "
            f"{int((ratio > 1).sum())} of {ratio.size} elements outside")


def _check_one_bad_token(bad, ref, keep, gx_tolerance):
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
    _assert_input_gradients_agree(np.asarray(gx_bad, np.float32)[keep], gx_ref, gx_tolerance)
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
