"""The full-size Kimi K2 MoE layer (384 experts, top-8, hidden 7168, NVFP4 experts and shared
expert) on one GPU with each GPU expert implementation (the Pallas kernels and the native
Triton-language ones), after the allocator has been disturbed, at decode (32 tokens) and prefill
(2048 tokens) sizes.

Why: on an H200 this layer died with ``CUDA_ERROR_ILLEGAL_ADDRESS`` whenever the process had
allocated and freed 4 GiB before creating its weights, and gave wrong outputs for every token
routed to an expert at or above about 292 (offsets past int32; benchmarks/NOTES.md, "Correct on
real GPUs"). Smaller layers and the CPU suite (the Pallas interpreter clamps out-of-range
indices) cannot show either.

What: the 4 GiB allocation is made and freed first, in this process, before any weight
exists. The NVFP4 weights are random codes and block scales generated on the device (no
quantization of 384 dense experts); the router is random with one extra direction ``u`` added
to the rows of experts 376..383, and a few chosen tokens carry a large component along ``u``,
so the router itself sends them to exactly those experts. Checked:

* the plan really runs the implementation asked for (``plan.expert_gemm``);
* every output is finite;
* the chosen tokens are routed to experts 376..383 by a float64 routing of the same logits,
  and the device's expert counts agree with that routing (up to tokens whose top-8 is tied
  within 1e-4, counted);
* for the chosen tokens and a few others (with a clear top-8 margin) the output is within
  1e-2 relative (per token) of a float64 reference built from exact dequantizations of only
  the experts those tokens use, plus the shared expert.

Router logits are computed at precision "highest" (IEEE float32), not TF32, so the device's
expert choice matches the float64 routing's away from near-ties (see the margin filter).
Memory: about 10 GB of weights on the device, deleted before the host reference runs.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from device_arrays import perturb_allocator, random_on_device

from moe_jax import MoEConfig, moe_forward, param_shapes, resolve, router
from moe_jax.nvfp4 import NVFP4Tensor
from pallas_kernels.grouped_matmul import reference

CONFIG = MoEConfig.kimi_k2(weight_format="nvfp4")
E, H, K = CONFIG.num_experts, CONFIG.hidden_size, CONFIG.top_k
HIGH = tuple(range(E - K, E))  # experts 376..383: the top of the range, where the kernels broke
FORCED_TOKENS = 4  # tokens sent to HIGH by the router
OTHER_TOKENS = 3  # further tokens checked against the reference, wherever the router sends them
FORCE = 12.0  # the forced tokens' component along u: logit ~12 for HIGH, ~N(0, 1.4) elsewhere
TIE = 1e-4  # top-8 margins (selection score) below this may legitimately route differently
MARGIN = 1e-3  # the other checked tokens have at least this margin
TOLERANCE = 1e-2  # relative, per token; bf16 rounding of the SwiGLU and expert outputs ~3e-3


def random_nvfp4(key, shape) -> NVFP4Tensor:
    """Random NVFP4 ``[..., N, K]``: all 16 codes, block scales in [0.5, 1.5], a global scale
    that gives outputs of order 0.1 for inputs of order 1."""
    *lead, n, k = shape
    k_w, k_s = jax.random.split(key)
    if lead:
        packed = random_on_device(k_w, (*lead, n, k // 2), lambda key, s: jax.random.bits(key, s, jnp.uint8), chunk=16)
        scales = random_on_device(k_s, (*lead, n, k // 16), lambda key, s: jax.random.uniform(
            key, s, jnp.float32, minval=0.5, maxval=1.5).astype(jnp.float8_e4m3fn), chunk=16)
    else:
        packed = jax.random.bits(k_w, (n, k // 2), jnp.uint8)
        scales = jax.random.uniform(k_s, (n, k // 16), jnp.float32, minval=0.5, maxval=1.5).astype(jnp.float8_e4m3fn)
    return NVFP4Tensor(packed=packed, scales=scales, global_scale=jnp.full(lead, 0.3 / (6 * math.sqrt(k)), jnp.float32))


def make_inputs(rng, tokens: int):
    """Parameters (in ``param_shapes`` layout), tokens ``x_th`` (bf16) and the forced token ids."""
    shapes = param_shapes(CONFIG)
    key = jax.random.key(int(rng.integers(1 << 31)))
    u_h = rng.standard_normal(H)
    u_h /= np.linalg.norm(u_h)
    w_eh = rng.standard_normal((E, H)) / math.sqrt(H)
    w_eh[list(HIGH)] += u_h  # HIGH's logits gain x . u
    # Sigmoid scores saturate at 1, so a forced token's HIGH experts beat the others (scores
    # <= sigmoid(~4) = 0.98) only if no other expert's bias makes up the difference: small
    # random biases (|b| < ~0.04), plus 0.1 for HIGH (which also draws other tokens there).
    bias_e = rng.standard_normal(E) * 0.01
    bias_e[list(HIGH)] += 0.1
    params = {
        "router": {"w_eh": jnp.asarray(w_eh, jnp.float32), "bias_e": jnp.asarray(bias_e, jnp.float32)},
        "experts": {name: random_nvfp4(jax.random.fold_in(key, i), shape)
                    for i, (name, shape) in enumerate(shapes["experts"].items())},
        "shared": {name: random_nvfp4(jax.random.fold_in(key, 10 + i), shape)
                   for i, (name, shape) in enumerate(shapes["shared"].items())},
    }
    assert set(params["router"]) == set(shapes["router"])
    x_th = rng.standard_normal((tokens, H))
    forced = np.sort(rng.choice(tokens, FORCED_TOKENS, replace=False))
    x_th[forced] += (FORCE - x_th[forced] @ u_h)[:, None] * u_h  # component along u exactly FORCE
    return params, jnp.asarray(x_th, jnp.bfloat16), forced


def host_routing(params, x_th: np.ndarray):
    """The float64 routing of every token (``moe_jax.router.route`` on float64 logits, as
    ``moe_jax.layer.reference_forward`` does) and each token's top-8 selection margin."""
    logits_te = x_th @ np.asarray(params["router"]["w_eh"], np.float64).T
    bias_e = np.asarray(params["router"]["bias_e"], np.float64)
    ids_tk, weights_tk = router.route(jnp.asarray(logits_te, jnp.float32), CONFIG,
                                      correction_bias_e=params["router"]["bias_e"])
    choice_te = np.sort(1 / (1 + np.exp(-logits_te)) + bias_e, axis=1)  # sigmoid scoring, one group
    return np.asarray(ids_tk), np.asarray(weights_tk, np.float64), choice_te[:, -K] - choice_te[:, -K - 1]


def dequantized(t) -> np.ndarray:
    """An NVFP4 ``[N, K]`` tensor (numpy fields) as exact float64."""
    return reference.dequantize(t.packed[None], t.scales[None], np.reshape(t.global_scale, (1,)))[0]


def swiglu_mlp(x_th: np.ndarray, w_gate_up: np.ndarray, w_down: np.ndarray) -> np.ndarray:
    h = x_th @ w_gate_up.T
    gate, up = np.split(h, 2, axis=-1)
    return (gate / (1 + np.exp(-gate)) * up) @ w_down.T


@pytest.mark.gpu
@pytest.mark.parametrize("expert_gemm", ["pallas", "triton"])
@pytest.mark.parametrize("tokens", [32, 2048], ids=["decode", "prefill"])
def test_full_size_kimi_k2_nvfp4_layer_after_allocator_perturbation(rng, record_property, tokens, expert_gemm):
    perturb_allocator()  # before any weight exists
    plan = resolve(dataclasses.replace(CONFIG, expert_gemm=expert_gemm), jax.devices()[:1])
    assert plan.target.platform == "cuda" and plan.expert_gemm == expert_gemm, plan.report
    params, x, forced = make_inputs(rng, tokens)

    with jax.default_matmul_precision("highest"):  # the router's float32 logits: IEEE, not TF32
        y, stats = jax.jit(moe_forward, static_argnums=2)(params, x, plan)
        y = np.asarray(y.astype(jnp.float32), np.float64)
    counts_e, dropped = np.asarray(stats["tokens_per_expert"]), int(stats["dropped"])

    x_th = np.asarray(x).astype(np.float64)
    ids_tk, weights_tk, margin_t = host_routing(params, x_th)
    pool = np.setdiff1d(np.flatnonzero(margin_t >= MARGIN), forced)
    assert len(pool), f"no token has a top-{K} margin >= {MARGIN}: margins {np.sort(margin_t)}"
    others = rng.choice(pool, min(OTHER_TOKENS, len(pool)), replace=False)
    checked = np.concatenate([forced, np.sort(others)])
    # The expert weights the checked tokens use, and the shared expert, to the host; then free the device.
    used = sorted({int(e) for e in ids_tk[checked].ravel()})
    experts = {e: jax.device_get({name: jax.tree.map(lambda a: a[e], w) for name, w in params["experts"].items()})
               for e in used}
    shared = jax.device_get(params["shared"])
    for leaf in jax.tree.leaves(params):
        leaf.delete()
    del params, x, stats

    assert np.isfinite(y).all(), f"{np.count_nonzero(~np.isfinite(y).all(axis=1))} of {tokens} tokens not finite"
    assert dropped == 0
    for t in forced:
        assert set(ids_tk[t].tolist()) == set(HIGH), f"token {t}: routed to {sorted(ids_tk[t])}, not {HIGH}"
    host_counts = np.bincount(ids_tk.ravel(), minlength=E)
    ties = int(np.sum(margin_t < TIE))
    moved = int(np.abs(counts_e - host_counts).sum())
    assert moved <= 2 * ties, f"device and float64 routing differ by {moved} assignments; {ties} near-tied tokens"
    assert counts_e[list(HIGH)].min() >= FORCED_TOKENS

    ref_th = swiglu_mlp(x_th[checked], dequantized(shared["w_gate_up_gh"]), dequantized(shared["w_down_hs"]))
    for e in used:
        rows, slots = np.nonzero(ids_tk[checked] == e)
        w_gate_up, w_down = dequantized(experts[e]["w_gate_up_egh"]), dequantized(experts[e]["w_down_ehf"])
        ref_th[rows] += weights_tk[checked[rows], slots][:, None] * swiglu_mlp(x_th[checked[rows]], w_gate_up, w_down)
        del w_gate_up, w_down
    err_t = np.linalg.norm(y[checked] - ref_th, axis=1) / np.linalg.norm(ref_th, axis=1)
    for t, err in zip(checked, err_t):
        record_property(f"token {t} ({'experts 376..383' if t in forced else 'random experts'})", f"{err:.2e}")
    report = ", ".join(f"token {t}: {err:.2e} (experts {sorted(ids_tk[t].tolist())})" for t, err in zip(checked, err_t))
    print(f"Kimi K2 NVFP4 layer, {tokens} tokens, relative error per checked token: {report}")
    assert err_t.max() < TOLERANCE, report
