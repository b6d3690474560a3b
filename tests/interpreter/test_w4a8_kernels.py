"""The W4A8 branch of the native kernels (SM90, opt-in: NVFP4 weights placed into E4M3 in
registers, activations quantized to E4M3 per row, FP8 tensor cores), executed in Triton's
interpreter on CPU.

The placement is inline PTX, which the interpreter evaluates through ``ptx_emulator``
(``interpreted.install``); everything else is the kernel as the GPU gets it: ``triton_lang.make_spec``'s
tile, the real tile schedule, the rows quantized by ``triton_lang.quantize_fp8_rows`` (columns in
``permute_k_w4a8``'s order), NaN-poisoned outputs whose padding rows must stay NaN, every load and
store bounds-checked. The float64 references are written here from the definitions: each row
quantized to E4M3 against its own amax, each weight ``code * scale * 2**-3`` rounded to E4M3
(ml_dtypes' round to nearest even), times the global scales and ``2**3``.

Run by ``./run test`` with triton 3.9.0 from ``.triton-interpret`` (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import interpreted
from nvfp4_float64 import PATTERNS, compare, e2m1, e4m3, expert, random_problem, reference
from pallas_kernels.grouped_matmul import triton_lang
from pallas_kernels.grouped_matmul.tuning import Op, Variant, decode_tile
from w4a8_float64 import e4m3_round, rows_as_multiplied

CC = 90
#: A sanity bound on the error against float64 of the same NVFP4 weights and unquantized rows:
#: the activations' E4M3 rounding and the weights' one rounding (3-10% here, where a fifth of the
#: random block scales are as small as E4M3 goes and flush in ``code * scale * 2**-3``; realistic
#: weights: ``benchmarks/results/w4a8_numerics_cpu/`` and the GPU layer test).
W4A8_BOUND = 0.15


def _weights_as_multiplied(packed, scales, global_scale) -> np.ndarray:
    """float64 ``[N_W, K]`` of one expert: ``code * scale * 2**-3`` rounded to E4M3, times
    ``2**3`` and the global scale (per gate/up half where there are two)."""
    g = np.atleast_1d(global_scale)
    rows = np.repeat(g, packed.shape[0] // g.size)[:, None]
    return e4m3_round(e2m1(packed) * np.repeat(e4m3(scales), 16, axis=-1) / 8) * 8 * rows


def _launch(spec, group_sizes, x_tokens, row_token, packed, scales, global_scale) -> np.ndarray:
    """The W4A8 kernel on ``x_tokens`` quantized by ``quantize_fp8_rows`` (read by ``row_token``
    where ``spec.gather_rows``), into a NaN-poisoned output; every access bounds-checked."""
    m, experts = spec.num_rows, len(packed)
    values, row_scale = triton_lang.quantize_fp8_rows(jnp.asarray(x_tokens), spec.block_k)
    interpreted.reset()
    out = np.full((m, spec.n_out), np.nan, ml_dtypes.bfloat16)
    buffers = interpreted.schedule_buffers(group_sizes, m, spec.tile.rows_per_tile, spec.max_tiles)
    buffers += [interpreted.buffer(np.asarray(values), "x (E4M3, permute_k_w4a8)"),
                interpreted.buffer(np.zeros(1, np.uint8), "x_scales (unread)"),
                interpreted.buffer(np.asarray(row_scale), "x_global (row scales)"),
                interpreted.buffer(row_token, "row_token" if spec.gather_rows else "row_token (unread)"),
                interpreted.buffer(packed, "w.packed"), interpreted.buffer(scales, "w.scales"),
                interpreted.buffer(global_scale.reshape(experts, spec.scale_groups), "w.global_scale"),
                interpreted.buffer(np.zeros(1, ml_dtypes.bfloat16), "out_in (unread)")]
    return interpreted.launch(triton_lang.kernel_function(), spec.num_programs, buffers, out, spec.constexprs())


def forward(op: Op, group_sizes, *, k: int, n_out: int, tile=None, variant=None, scale_groups: int = 1,
            experts=None, used=None, seed: int = 0, padding: int = 3, tokens: int = 0) -> tuple[float, float]:
    """Runs the W4A8 kernel on random bf16 rows; asserts it against float64 of what it multiplies
    and returns ``(that error, the error against unquantized rows and exact weights)``. With
    ``tokens`` the kernel reads its rows, and their scales, by index from that many token rows."""
    rng = np.random.default_rng(seed)
    group_sizes, packed, scales, global_scale = random_problem(rng, op, group_sizes, k=k, n_out=n_out,
                                                               scale_groups=scale_groups, experts=experts, used=used)
    experts = len(packed)
    total = int(group_sizes.sum())
    m = total + padding
    # Rows of very different sizes (the per-row scale must follow each), one of zeros.
    x_tokens = (rng.standard_normal((tokens or m, k)) * np.exp(rng.uniform(-4, 4, (tokens or m, 1))))
    x_tokens[min(2, len(x_tokens) - 1)] = 0
    x_tokens = x_tokens.astype(ml_dtypes.bfloat16)
    if tokens:
        row_token = np.concatenate([rng.integers(0, tokens, total), np.full(padding, 1 << 30)]).astype(np.int32)
        x = x_tokens[np.minimum(row_token, tokens - 1)]
    else:
        row_token, x = np.zeros(1, np.int32), x_tokens
    if variant is not None:
        tile = triton_lang.NATIVE_TILES[CC][(variant, op)]
    spec = triton_lang.make_spec(op, triton_lang.Mode.W4A8, num_rows=m, num_experts=experts, k=k, n_out=n_out,
                                 scale_groups=scale_groups, compute_capability=CC, tile=tile, gather_rows=tokens)
    got = _launch(spec, group_sizes, x_tokens, row_token, packed, scales, global_scale)
    a = rows_as_multiplied(x)
    want, start = [], 0
    for e, size in enumerate(group_sizes):
        if size:
            want.append(expert(op, a[start:start + size], _weights_as_multiplied(packed[e], scales[e],
                                                                                 global_scale[e])))
        start += size
    err = compare(got, np.concatenate(want), total, spec.tile)
    exact = reference(op, x.astype(np.float64), packed, scales, global_scale, group_sizes)
    bound = np.linalg.norm(got[:total] - exact) / np.linalg.norm(exact)
    assert bound < W4A8_BOUND, f"error against unquantized rows and exact weights {bound:.3g}"
    return err, bound


@pytest.mark.parametrize("op", [Op.MATMUL, Op.GATE_UP_SWIGLU], ids=lambda op: op.value)
@pytest.mark.parametrize("variant", [Variant.DECODE, Variant.PREFILL], ids=lambda v: v.value)
def test_every_sm90_tile_of_the_table(op, variant):
    """The table's tiles (decode: block_k 256; prefill: extra rows and tails, block_k 128)."""
    forward(op, [70, 0, 130, 9], k=1024, n_out=128, variant=variant)


def test_the_many_rows_down_tile():
    """``W4A8_MANY_ROWS_TILES``' down tile (half the weight rows, 4 warps) with each row path: a
    64-row tail, 128 rows, 128 + 64 in two MMAs, and an expert of more than one tile."""
    forward(Op.MATMUL, [64, 0, 65, 128, 0, 192, 250, 1], k=256, n_out=128,
            tile=triton_lang.W4A8_MANY_ROWS_TILES[CC][Op.MATMUL], seed=9)


@pytest.mark.parametrize("op", [Op.MATMUL, Op.GATE_UP_SWIGLU], ids=lambda op: op.value)
@pytest.mark.parametrize("pattern", PATTERNS, ids=str)
def test_group_size_patterns(op, pattern):
    forward(op, PATTERNS[pattern], k=512, n_out=64, tile=decode_tile(16, 32, 128, 4, 2),
            seed=list(PATTERNS).index(pattern))


@pytest.mark.parametrize("op", [Op.MATMUL, Op.GATE_UP_SWIGLU], ids=lambda op: op.value)
def test_rows_and_their_scales_read_by_index(op):
    """As the layer calls the gate/up kernel: fewer token rows than rows, repeated and unordered,
    each row's scale read by its token too; padding rows' indices far out of range, never read."""
    forward(op, [70, 0, 130, 9], k=1024, n_out=128, variant=Variant.PREFILL, tokens=37, seed=5)


@pytest.mark.parametrize("block_k", [64, 128, 256])
def test_each_stage_width_and_its_column_order(block_k):
    """Stages of 64 to 256 columns (2 to 8 FP8 MMA slabs of 32): ``permute_k_w4a8``'s digits
    change with the stage's width."""
    forward(Op.MATMUL, [9, 0, 21], k=1024, n_out=64, tile=decode_tile(16, 32, block_k, 4, 2), seed=block_k)


def test_gate_and_up_with_their_own_global_scales():
    forward(Op.GATE_UP_SWIGLU, [11, 0, 25, 4], k=512, n_out=64, scale_groups=2, tile=decode_tile(16, 32, 128, 4, 2))


def test_kimi_k2_down_at_its_highest_experts():
    """Kimi K2's down projection at all 384 experts (expert 293 starts past 2**31 bytes), rows for
    experts 0, 292, 293 and 383 only."""
    sizes = np.zeros(384, np.int64)
    sizes[[0, 292, 293, 383]] = [2, 1, 3, 2]
    forward(Op.MATMUL, sizes, k=2048, n_out=7168, tile=decode_tile(16, 1024, 128, 4, 2), experts=384,
            used=(0, 292, 293, 383), padding=1)


def test_a_row_with_a_non_finite_value_spoils_only_its_own_outputs():
    """A NaN in one row: its scale is NaN and its outputs NaN; every other row as without it."""
    rng = np.random.default_rng(3)
    group_sizes, packed, scales, global_scale = random_problem(rng, Op.MATMUL, [6, 5], k=256, n_out=64)
    x = rng.standard_normal((11, 256)).astype(ml_dtypes.bfloat16)
    x[4, 17] = np.nan
    spec = triton_lang.make_spec(Op.MATMUL, triton_lang.Mode.W4A8, num_rows=11, num_experts=2, k=256, n_out=64,
                                 scale_groups=1, compute_capability=CC, tile=decode_tile(16, 32, 128, 4, 2))
    got = _launch(spec, group_sizes, x, np.zeros(1, np.int32), packed, scales, global_scale)
    assert np.isnan(got[4]).all()
    others = [r for r in range(11) if r != 4]
    assert np.isfinite(got[others]).all()
    exact = reference(Op.MATMUL, np.where(np.isnan(x), 0, x).astype(np.float64), packed, scales, global_scale,
                      group_sizes)
    err = np.linalg.norm(got[others] - exact[others]) / np.linalg.norm(exact[others])
    assert err < W4A8_BOUND, err
