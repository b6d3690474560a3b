"""Randomized equivalence: drawn layers, batches, meshes and routings against a float64 NumPy
layer written here from the model definitions (not moe_jax's own reference).

Each draw (a seeded generator, a fixed budget of :data:`DRAWS`) picks: softmax or sigmoid
scoring, a correction bias or none, group-limited selection, top-k, shared experts, bf16 or
NVFP4 experts (one global scale per expert or per gate/up half), dropless or a generous
capacity; 0, 1 or more tokens under a leading shape; 1, 2, 4 or 8 CPU devices with every
exchange that runs there; and a routing left as it falls or skewed to one hot expert (then
other experts are empty). Tokens whose top-k is tied within :data:`TIE` in float64 may
legitimately route differently in float32 and are left out of the comparison (never most of
a batch). A draw that ever fails goes into :data:`REGRESSIONS` and runs for good.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from harness import FORWARD, PROBE_CONFIG, exchanges_that_run, mesh_for

import sharding
from moe_jax import EXCHANGE, MoEConfig, init_params, nvfp4, quantize_params, resolve, shard_params

DRAWS = 24
REGRESSIONS: list[int] = []  # seeds of draws that once failed
TOLERANCE = 2.5e-2  # relative per token, Frobenius: bf16 activations, weights and SwiGLU rounding
TIE = 1e-3
# The exchanges a draw may pick: every registered one that runs on XLA:CPU, under a mesh or without.
MESH_EXCHANGES = exchanges_that_run(mesh_for(2, jax.devices("cpu"), 1), PROBE_CONFIG)
LOCAL_EXCHANGES = exchanges_that_run(jax.devices("cpu")[:1], PROBE_CONFIG)
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


@dataclasses.dataclass(frozen=True)
class Draw:
    config: MoEConfig
    own_scales: bool
    tokens: int
    lead: tuple[int, ...]
    devices: int
    exchange: str
    hot_expert: int | None


def draw(seed: int) -> Draw:
    r = np.random.default_rng(seed)
    num_experts = int(r.choice([4, 8, 16]))
    num_groups = int(r.choice([g for g in (1, 2, 4) if num_experts % g == 0 and num_experts // g >= 2]))
    topk_groups = int(r.integers(1, num_groups + 1))
    top_k = int(r.integers(1, min(4, topk_groups * (num_experts // num_groups)) + 1))
    fmt = str(r.choice(["bf16", "nvfp4"]))
    hot = bool(r.random() < 0.25)
    config = MoEConfig(
        num_experts=num_experts, top_k=top_k, hidden_size=int(r.choice([32, 64])), expert_intermediate_size=32,
        num_shared_experts=int(r.integers(0, 2)), scoring=str(r.choice(["softmax", "sigmoid"])),
        num_groups=num_groups, topk_groups=topk_groups, normalize=bool(r.random() < 0.7),
        routed_scaling_factor=float(r.choice([1.0, 2.5])), router_bias=hot or bool(r.random() < 0.5),
        weight_format=fmt, capacity_factor=None if hot or r.random() < 0.6 else float(r.choice([4.0, 8.0])),
        expert_gemm="xla")
    devices = int(r.choice([1, 2, 4, 8]))
    tokens = int(r.choice([0, 1, 3, 17, 40]))
    lead = (tokens,) if r.random() < 0.5 or tokens in (0, 1) else (1, tokens)
    exchanges = list(MESH_EXCHANGES if devices > 1 else LOCAL_EXCHANGES)
    return Draw(config=config, own_scales=fmt == "nvfp4" and bool(r.random() < 0.5), tokens=tokens, lead=lead,
                devices=devices, exchange=str(r.choice(exchanges)), hot_expert=int(r.integers(num_experts)) if hot else None)


def make_params(d: Draw, seed: int):
    config = d.config
    params = init_params(dataclasses.replace(config, weight_format="bf16"), jax.random.key(seed))
    if config.router_bias:
        bias = np.random.default_rng(seed).standard_normal(config.num_experts) * 0.2
        if d.hot_expert is not None:
            bias[d.hot_expert] += 10.0  # chosen by every token
        params["router"]["bias_e"] = jnp.asarray(bias, jnp.float32)
    if config.weight_format == "nvfp4":
        params = quantize_params(params, config)
        if d.own_scales:
            gate, up = jnp.split(nvfp4.dequantize(params["experts"]["w_gate_up_egh"]), 2, axis=1)
            params["experts"]["w_gate_up_egh"] = nvfp4.concat_rows(nvfp4.quantize(gate), nvfp4.quantize(up * 5.0))
    return params


# --- the float64 layer ------------------------------------------------------------------------


def dense(w) -> np.ndarray:
    """A bf16 array, or NVFP4 decoded from its bits: E2M1 codes x E4M3 block scales x global scale."""
    if not isinstance(w, nvfp4.NVFP4Tensor):
        return np.asarray(w, np.float64)
    packed = np.asarray(w.packed)
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
    scales = np.asarray(w.scales).view(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    g = np.asarray(w.global_scale, np.float64)
    n = packed.shape[-2]
    g_rows = np.repeat(g.reshape(*g.shape[:1], -1), n // (g.size // g.shape[0] if g.ndim else 1), axis=-1)
    return E2M1[codes] * np.repeat(scales, 16, axis=-1) * g_rows[..., None]


def swiglu(h):
    gate, up = np.split(h, 2, axis=-1)
    return gate / (1 + np.exp(-gate)) * up


def route(logits, config: MoEConfig, bias):
    """(ids [T, k], weights [T, k], margin [T]) in float64, ties to the lower index."""
    if config.scoring == "softmax":
        z = np.exp(logits - logits.max(axis=1, keepdims=True))
        scores = z / z.sum(axis=1, keepdims=True)
    else:
        scores = 1 / (1 + np.exp(-logits))
    choice = scores + (bias if bias is not None else 0)
    t, e = scores.shape
    allowed = np.ones((t, e), bool)
    if config.num_groups > 1:
        per = e // config.num_groups
        grouped = choice.reshape(t, config.num_groups, per)
        group_score = -np.sort(-grouped, axis=2)[:, :, : min(2, per)].sum(axis=2)
        best = np.argsort(-group_score, axis=1, kind="stable")[:, : config.topk_groups]
        allowed = np.zeros((t, config.num_groups), bool)
        np.put_along_axis(allowed, best, True, axis=1)
        allowed = np.repeat(allowed, per, axis=1)
    masked = np.where(allowed, choice, -np.inf)
    order = np.argsort(-masked, axis=1, kind="stable")
    ids = order[:, : config.top_k]
    ranked = np.take_along_axis(masked, order, axis=1)
    margin = ranked[:, config.top_k - 1] - ranked[:, config.top_k] if config.top_k < e else np.full(t, np.inf)
    w = np.take_along_axis(scores, ids, axis=1)
    if config.normalize:
        w = w / (w.sum(axis=1, keepdims=True) + 1e-20)
    return ids, w * config.routed_scaling_factor, margin


def layer64(params, x, config: MoEConfig):
    logits = x @ np.asarray(params["router"]["w_eh"], np.float64).T
    bias = np.asarray(params["router"]["bias_e"], np.float64) if "bias_e" in params["router"] else None
    ids, w, margin = route(logits, config, bias)
    gu, dn = dense(params["experts"]["w_gate_up_egh"]), dense(params["experts"]["w_down_ehf"])
    y = np.zeros_like(x)
    for slot in range(config.top_k):
        for e in np.unique(ids[:, slot]):
            rows = ids[:, slot] == e
            y[rows] += w[rows, slot, None] * (swiglu(x[rows] @ gu[e].T) @ dn[e].T)
    if "shared" in params:
        y += swiglu(x @ dense(params["shared"]["w_gate_up_gh"]).T) @ dense(params["shared"]["w_down_hs"]).T
    return y, ids, margin


# --- the test ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", list(range(DRAWS)) + REGRESSIONS)
def test_drawn_layer_matches_float64(seed, cpu_devices):
    d = draw(seed)
    config = dataclasses.replace(d.config, exchange=d.exchange)
    assert d.exchange in EXCHANGE.names()
    params = make_params(d, seed)
    x = jnp.asarray(np.random.default_rng(seed + 1).standard_normal((*d.lead, config.hidden_size)), jnp.bfloat16)
    if d.devices == 1:
        plan = resolve(config, cpu_devices[:1])
    else:
        ep = d.devices if config.num_experts % d.devices == 0 else 2
        mesh = sharding.make_mesh(ep, data_parallel=d.devices // ep, devices=cpu_devices[: d.devices])
        plan = resolve(config, mesh)
        params = shard_params(params, plan)
    assert plan.exchange == d.exchange, plan.report
    with jax.default_matmul_precision("highest"):
        y, stats = FORWARD(params, x, plan)
    y = np.asarray(y, np.float64).reshape(-1, config.hidden_size)
    assert y.shape == (d.tokens, config.hidden_size) and np.asarray(stats["tokens_per_expert"]).sum() == (
        d.tokens * config.top_k - int(stats["dropped"]))
    if d.tokens == 0:
        return
    ref, ids, margin = layer64(jax.device_get(params), np.asarray(x, np.float64).reshape(-1, config.hidden_size), config)
    if d.hot_expert is not None:
        assert (ids == d.hot_expert).any(axis=1).all()  # the skew took: every token uses the hot expert
    assert int(stats["dropped"]) == 0, d  # capacities are generous; skewed draws are dropless
    clear = margin >= TIE
    assert clear.mean() >= 0.5, f"{np.count_nonzero(~clear)} of {d.tokens} tokens near a tie: {d}"
    counts = np.bincount(ids[clear].ravel(), minlength=config.num_experts)
    assert counts.sum() == clear.sum() * config.top_k
    err = np.linalg.norm(y[clear] - ref[clear], axis=1) / np.maximum(np.linalg.norm(ref[clear], axis=1), 1e-30)
    assert err.max() < TOLERANCE, f"relative error {err.max():.3g} (token {np.argmax(err)}): {d}"
