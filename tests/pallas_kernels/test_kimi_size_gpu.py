"""Both expert GEMM kernels at Kimi K2's real size (384 experts, hidden 7168, intermediate 2048),
both weight formats, on a GPU, checked for experts at the top of the range.

Why: every other kernel test uses 48 experts or fewer, and at 384 experts one down-projection
expert's packed NVFP4 weights (7168 x 1024 bytes) put expert 293 past 2**31 bytes, the bf16
gate/up weights (384 x 4096 x 7168) pass 2**31 elements at expert 73, so offsets that
overflow int32 are invisible below this size. An H200 measured relative errors of 0.85
(experts 288..295) and 1.34 (376..383) for the NVFP4 down projection, and illegal memory
accesses once the allocator had been disturbed. The CPU suite
cannot see this: weights of this size do not fit its budget, and the Pallas interpreter
clamps out-of-range indices.

What: weights are random on the device (bf16 normal / sqrt(K); NVFP4 random codes, block
scales in [0.5, 1.5] and a global scale that keeps outputs O(0.1..1)), built after a 4 GiB
allocation has been made and freed, as in the failing runs. Each test runs one projection in
one format over several routings of fresh random rows (never zeros) into a NaN-poisoned
``out=`` buffer:

* ``blocks``: 16 rows for each expert of the blocks 0..7, 144..151, 288..295, 376..383
  (expert 383 included), all other experts empty, 512 padding rows after the last;
* ``last_expert_empty``: the same without expert 383;
* ``last_expert_hottest``: the same, with 301 rows (several row tiles, not a tile multiple)
  for expert 383;
* ``decode_top8`` / ``prefill_top8``: 32 / 2048 tokens, each sent to 8 distinct random
  experts (the issue's reproduction), rows of the blocks above checked; ``mid_top8`` (where a
  test asks for it): 1024 tokens, between one and two decode row tiles per expert.

Each defined row must be written and finite, each padding row must keep its poison, and per
expert block the relative Frobenius error against a float64 reference must be below 1e-2
(bf16 output rounding alone is ~3e-3). The reference runs on the host for the experts of the
blocks only, one expert at a time (dequantizing all 384 experts would take 45 GB). The
per-block errors are recorded as junit properties (``tools/gpu_check.sh`` lists them).

Memory: the largest cases (bf16 gate/up weights, and the bf16 copy of the NVFP4 ones that
``dequantized_input_grad`` makes) hold 22.5 GB on the device, the weights built in place 8
experts at a time (about 1.4 GB of temporaries); the device weights are deleted before the
host reference runs. Time: three kernel compilations (row counts 320, 1024, 16448) and the
float64 reference of 32 experts on the host, about 30 s.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from device_arrays import perturb_allocator, random_on_device

from moe_jax.nvfp4 import NVFP4Tensor
from pallas_kernels.grouped_matmul import (
    dequantized_input_grad,
    gate_up_swiglu,
    grouped_matmul,
    grouped_matmul_input_grad,
    grouped_matmul_weight_grad,
    reference,
)

E, H, F = 384, 7168, 2048
BLOCKS = ((0, 8), (144, 152), (288, 296), (376, 384))  # [first, last + 1) expert of each block
ROWS = 16
HOT_ROWS = 301
PADDED_ROWS = 1024  # rows of x for the block patterns: the defined rows, then padding
TOLERANCE = 1e-2
DECODE_TOKENS, PREFILL_TOKENS, MID_TOKENS = 32, 2048, 1024

# op name -> (kernel, weight rows N, contraction K, output columns)
OPS = {
    "gate_up_swiglu": (gate_up_swiglu, 2 * F, H, F),
    "down": (grouped_matmul, H, F, H),
}


def _capability() -> int:
    """``major * 10 + minor`` of the first GPU, as moe_jax.resolve derives it (90 for an H200)."""
    major, minor = jax.devices("gpu")[0].compute_capability.split(".")[:2]
    return 10 * int(major) + int(minor)


def random_weights(key, fmt: str, n: int, k: int):
    """``[E, N, K]`` random weights on the device: bf16, or NVFP4 in ModelOpt's layout."""
    k_w, k_s = jax.random.split(key)
    match fmt:
        case "bf16":
            return random_on_device(
                k_w, (E, n, k), lambda key, s: (jax.random.normal(key, s, jnp.float32) / math.sqrt(k)).astype(jnp.bfloat16))
        case "nvfp4":
            packed = random_on_device(k_w, (E, n, k // 2), lambda key, s: jax.random.bits(key, s, jnp.uint8))
            scales = random_on_device(k_s, (E, n, k // 16), lambda key, s: jax.random.uniform(
                key, s, jnp.float32, minval=0.5, maxval=1.5).astype(jnp.float8_e4m3fn))
            return NVFP4Tensor(packed=packed, scales=scales,
                               global_scale=jnp.full((E,), 0.3 / (6 * math.sqrt(k)), jnp.float32))
    raise AssertionError(fmt)


def _block_experts() -> list[int]:
    return [e for lo, hi in BLOCKS for e in range(lo, hi)]


def patterns(rng, mid_rows: bool = False) -> dict[str, tuple[np.ndarray, int]]:
    """name -> (group sizes int32 [E], rows of x); rows past the sizes' sum are padding."""
    blocks = np.zeros(E, np.int32)
    blocks[_block_experts()] = ROWS
    last_empty, hot = blocks.copy(), blocks.copy()
    last_empty[E - 1] = 0
    hot[E - 1] = HOT_ROWS
    out = {"blocks": (blocks, PADDED_ROWS), "last_expert_empty": (last_empty, PADDED_ROWS),
           "last_expert_hottest": (hot, PADDED_ROWS)}
    top8 = (("decode_top8", DECODE_TOKENS), ("prefill_top8", PREFILL_TOKENS))
    for name, tokens in top8 + ((("mid_top8", MID_TOKENS),) if mid_rows else ()):
        ids_tk = np.stack([rng.choice(E, 8, replace=False) for _ in range(tokens)])
        out[name] = (np.bincount(ids_tk.ravel(), minlength=E).astype(np.int32), tokens * 8 + 64)
    return out


def expert_reference(op: str, x_mk: np.ndarray, w_nk: np.ndarray) -> np.ndarray:
    """One expert's rows in float64, by the formulas of ``pallas_kernels.grouped_matmul.reference``
    (inlined: its functions copy the [N, K] weights once per call)."""
    h = x_mk @ w_nk.T
    if op == "down":
        return h
    gate, up = np.split(h, 2, axis=-1)
    return gate / (1.0 + np.exp(-gate)) * up


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [pytest.param("bf16", marks=pytest.mark.large_gpu_memory), "nvfp4"])
@pytest.mark.parametrize("op", list(OPS))
def test_kimi_size_top_experts_match_float64_reference(rng, record_property, op, fmt):
    kernel, n, k, n_out = OPS[op]
    _check_top_experts(rng, record_property, f"{op} {fmt}", kernel, fmt, (n, k), k, n_out,
                       lambda x_mk, w_nk: expert_reference(op, x_mk, w_nk))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [pytest.param("bf16", marks=pytest.mark.large_gpu_memory), "nvfp4"])
@pytest.mark.parametrize("op", list(OPS))
def test_kimi_size_input_grad_top_experts_match_float64_reference(rng, record_property, op, fmt):
    """The backward pass's ``dy @ W_e``, reading the same stored weights (NVFP4 down codes past
    2**31 bytes) in the transposed direction."""
    _, n, k, _ = OPS[op]
    _check_top_experts(rng, record_property, f"{op} input_grad {fmt}", grouped_matmul_input_grad, fmt, (n, k), n, k,
                       lambda dy_mn, w_nk: dy_mn @ w_nk)


@pytest.mark.gpu
@pytest.mark.large_gpu_memory
@pytest.mark.parametrize("op", list(OPS))
def test_kimi_size_dequantized_input_grad_top_experts_match_float64_reference(rng, record_property, op):
    """The NVFP4 input gradient through one bf16 copy of the weights (``dequantized_input_grad``,
    the path of many rows per expert): each copy has more than 2**31 elements."""
    _, n, k, _ = OPS[op]
    _check_top_experts(rng, record_property, f"{op} dequantized input_grad", dequantized_input_grad, "nvfp4", (n, k),
                       n, k, lambda dy_mn, w_nk: dy_mn @ w_nk)


def _check_top_experts(rng, record_property, label: str, kernel, fmt: str, w_shape, x_cols: int, n_out: int,
                       expert_fn, mid_rows: bool = False):
    """Runs ``kernel(x [m, x_cols], w [E, *w_shape], sizes) -> [m, n_out]`` over every routing of
    :func:`patterns` (``mid_rows``: with ``mid_top8``) and checks the top expert blocks against
    ``expert_fn(x_rows, w_nk)``."""
    cc = _capability()
    perturb_allocator()
    key = jax.random.key(int(rng.integers(1 << 31)))
    w = random_weights(jax.random.fold_in(key, 0), fmt, *w_shape)

    # Run every routing, keep inputs and outputs on the host.
    runs = {}
    for i, (name, (sizes, m)) in enumerate(patterns(rng, mid_rows).items()):
        x = jax.random.normal(jax.random.fold_in(key, i + 1), (m, x_cols), jnp.bfloat16)
        poisoned = jnp.full((m, n_out), jnp.nan, jnp.bfloat16)
        y = kernel(x, w, jnp.asarray(sizes), compute_capability=cc, out=poisoned)
        runs[name] = (sizes, np.asarray(x), np.asarray(y.astype(jnp.float32)))  # bf16, float32
        del x, y, poisoned

    # Expert weights of the blocks to the host, then free the device copy.
    weights = {e: (w.packed[e:e + 1], w.scales[e:e + 1], w.global_scale[e:e + 1]) if fmt == "nvfp4"
               else w[e] for e in _block_experts()}
    weights = jax.device_get(weights)
    for leaf in jax.tree.leaves(w):
        leaf.delete()
    del w

    problems, errors = [], {}
    for name, (sizes, x, y) in runs.items():
        starts = np.concatenate([[0], np.cumsum(sizes)])
        defined = int(starts[-1])
        unwritten = np.count_nonzero(~np.isfinite(y[:defined]).all(axis=1))
        if unwritten:
            problems.append(f"{name}: {unwritten} of {defined} defined rows not finite (unwritten: NaN poison)")
        overwritten = np.count_nonzero(~np.isnan(y[defined:]).all(axis=1))
        if overwritten:
            problems.append(f"{name}: {overwritten} padding rows past sum(group_sizes) = {defined} were written")
    for lo, hi in BLOCKS:
        for name in runs:
            errors[name, lo, hi] = [0.0, 0.0]  # squared error, squared reference
        for e in range(lo, hi):
            stored = weights[e]
            w_nk = (reference.dequantize(*stored)[0] if fmt == "nvfp4" else np.asarray(stored).astype(np.float64))
            for name, (sizes, x, y) in runs.items():
                start, size = int(np.sum(sizes[:e])), int(sizes[e])
                if size == 0:
                    continue
                ref = expert_fn(x[start:start + size].astype(np.float64), w_nk)
                got = np.nan_to_num(y[start:start + size].astype(np.float64), nan=1e30)
                acc = errors[name, lo, hi]
                acc[0] += float(np.sum((got - ref) ** 2))
                acc[1] += float(np.sum(ref ** 2))
            del w_nk
    for (name, lo, hi), (sq_err, sq_ref) in errors.items():
        if sq_ref == 0.0:
            continue  # no rows routed to this block in this pattern (random routing)
        rel = math.sqrt(sq_err / sq_ref)
        record_property(f"{name} experts {lo}..{hi - 1}", f"{rel:.2e}")
        if not rel < TOLERANCE:
            problems.append(f"{name}: experts {lo}..{hi - 1}: relative Frobenius error {rel:.3g} >= {TOLERANCE}")
    table = "; ".join(f"{name} {lo}..{hi - 1}: {math.sqrt(a / b):.2e}" for (name, lo, hi), (a, b) in errors.items() if b)
    print(f"{label} (SM{cc}) relative errors per expert block: {table}")
    assert not problems, f"{label} at Kimi K2 size (SM{cc}):\n" + "\n".join(problems) + f"\nall blocks: {table}"
    checked = sum(1 for _, sq_ref in errors.values() if sq_ref > 0)
    assert checked >= 3 * len(BLOCKS), f"only {checked} (pattern, block) pairs had rows"  # the fixed patterns did


def _native_weight_grad(x, dy, sizes, **kwargs):
    from pallas_kernels.grouped_matmul import triton_weight_grad  # noqa: PLC0415 (needs triton)

    return triton_weight_grad.weight_grad(x, dy, sizes, **kwargs)


@pytest.mark.gpu
@pytest.mark.large_gpu_memory
@pytest.mark.parametrize("kernel", [grouped_matmul_weight_grad, _native_weight_grad], ids=["pallas", "triton"])
def test_kimi_size_weight_grad_top_experts_match_float64_reference(rng, record_property, kernel):
    """``dy_e^T @ x_e`` into a NaN-poisoned bf16 ``[384, H, F]`` (5.6e9 elements, past 2**31):
    the top expert blocks against float64, and experts without rows written as zeros; the Pallas
    kernel and the persistent native one (``triton_weight_grad``). The padding rows of ``x`` and
    ``dy`` hold NaN: a row step that reads one poisons its tile."""
    cc = _capability()
    perturb_allocator()
    key = jax.random.key(int(rng.integers(1 << 31)))
    sizes, m = patterns(rng)["last_expert_hottest"]
    defined = jnp.arange(m)[:, None] < int(sizes.sum())
    x = jnp.where(defined, jax.random.normal(jax.random.fold_in(key, 0), (m, F), jnp.bfloat16), jnp.nan)
    dy = jnp.where(defined, jax.random.normal(jax.random.fold_in(key, 1), (m, H), jnp.bfloat16), jnp.nan)
    poisoned = jnp.full((E, H, F), jnp.nan, jnp.bfloat16)
    dw = kernel(x, dy, jnp.asarray(sizes), compute_capability=cc, out_dtype=jnp.bfloat16, out=poisoned)
    del poisoned
    empty = [e for e in (1, 143, 200, 292, 375) if sizes[e] == 0]
    got = {e: np.asarray(dw[e].astype(jnp.float32), np.float64) for e in (*_block_experts(), *empty)}
    x, dy = np.asarray(x).astype(np.float64), np.asarray(dy).astype(np.float64)
    del dw
    problems, starts = [], np.concatenate([[0], np.cumsum(sizes)])
    for e in empty:
        if np.any(got[e] != 0):
            problems.append(f"expert {e} has no rows but {np.count_nonzero(got[e] != 0)} nonzero (or NaN) elements")
    for lo, hi in BLOCKS:
        sq_err = sq_ref = 0.0
        for e in range(lo, hi):
            ref = dy[starts[e]:starts[e + 1]].T @ x[starts[e]:starts[e + 1]]
            sq_err += float(np.sum((np.nan_to_num(got[e], nan=1e30) - ref) ** 2))
            sq_ref += float(np.sum(ref**2))
        rel = math.sqrt(sq_err / sq_ref)
        record_property(f"weight_grad ({kernel.__name__}) experts {lo}..{hi - 1}", f"{rel:.2e}")
        if not rel < TOLERANCE:
            problems.append(f"experts {lo}..{hi - 1}: relative Frobenius error {rel:.3g} >= {TOLERANCE}")
    assert not problems, f"{kernel.__name__} at Kimi K2 size (SM{cc}):\n" + "\n".join(problems)


@pytest.mark.gpu
@pytest.mark.large_gpu_memory
@pytest.mark.parametrize("kernel", [grouped_matmul_weight_grad, _native_weight_grad], ids=["pallas", "triton"])
def test_kimi_size_weight_grad_a_non_finite_row_reaches_its_own_expert_only(rng, kernel):
    """384 experts of 0 to ~40 rows (one of 1 row, the last of 65), an infinity in the row right
    after the one-row expert and in expert 383's first row: each reaches its own expert's
    gradient where float64 has it (column 1) and no other expert's, though the row steps of the
    experts before them end past them (the native kernel's TMA loads are bounded at each expert's
    last row). Every other expert against float64; the padding rows hold NaN."""
    cc = _capability()
    n, k = 256, 512
    sizes = rng.multinomial(8192, np.full(E, 1 / E)).astype(np.int32) // 6
    sizes[199], sizes[200], sizes[201], sizes[382], sizes[E - 1] = 0, 1, 3, 1, 65
    m = int(sizes.sum()) + 100
    starts = np.concatenate([[0], np.cumsum(sizes)])
    key = jax.random.key(int(rng.integers(1 << 31)))
    x = np.asarray(jax.random.normal(jax.random.fold_in(key, 0), (m, k), jnp.bfloat16)).astype(np.float32)
    dy = np.asarray(jax.random.normal(jax.random.fold_in(key, 1), (m, n), jnp.bfloat16)).astype(np.float32)
    x[starts[-1]:], dy[starts[-1]:] = np.nan, np.nan
    bad = {201: int(starts[201]), E - 1: int(starts[E - 1])}  # expert -> its row holding the infinity
    for row in bad.values():
        x[row, 1] = np.inf
    dw = kernel(jnp.asarray(x, jnp.bfloat16), jnp.asarray(dy, jnp.bfloat16), jnp.asarray(sizes),
                compute_capability=cc, out_dtype=jnp.float32)
    got = np.asarray(dw, np.float64)
    x, dy = x.astype(np.float64), dy.astype(np.float64)
    problems = []
    for e in range(E):
        ref = dy[starts[e]:starts[e + 1]].T @ x[starts[e]:starts[e + 1]]
        if e in bad or sizes[e] == 0:
            if not np.array_equal(np.isfinite(got[e]), np.isfinite(ref)):
                problems.append(f"expert {e}: non-finite elements where float64 has none, or the reverse")
            continue
        if not np.isfinite(got[e]).all():
            problems.append(f"expert {e}: {np.count_nonzero(~np.isfinite(got[e]))} non-finite elements")
        elif not np.max(np.abs(got[e] - ref)) <= 1e-3 * max(1.0, np.max(np.abs(ref))):
            problems.append(f"expert {e}: max error {np.max(np.abs(got[e] - ref)):.3g}")
    assert not problems, f"{kernel.__name__} (SM{cc}):\n" + "\n".join(problems[:20])
