"""The bf16 branch of the native kernels (``Mode.BF16``: the W4A16 schedule with bf16 weights read
as they are), executed in Triton's interpreter on CPU.

The kernel as the GPU gets it: ``triton_lang.make_spec``'s tile for ``Mode.BF16`` (or the one
under test), the real tile schedule, NaN-poisoned outputs whose padding rows must stay NaN, every
load and store bounds-checked; the forward kernels (plain and fused gate/up + SwiGLU) and the
transposed-weight matmul (an input gradient's ``dy @ W_e``) against float64.

Run by ``./run test`` with triton 3.9.0 from ``.triton-interpret`` (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import interpreted
from nvfp4_float64 import compare, expert
from pallas_kernels.grouped_matmul import triton_lang
from pallas_kernels.grouped_matmul.tuning import Op, prefill_tile

CC = 90


def _bf16(rng, shape) -> np.ndarray:
    return rng.standard_normal(shape).astype(ml_dtypes.bfloat16)


def forward(op: Op, group_sizes, *, k: int, n_out: int, tile=None, transpose_w: bool = False, experts=None,
            seed: int = 0, padding: int = 3, tokens: int = 0, scale_groups: int = 0) -> float:
    """Runs the kernel on random bf16 rows and weights; asserts and returns its relative error.
    With ``tokens``, the kernel reads its rows by index from that many token rows (the padding
    rows' indices out of range, never read). With ``scale_groups`` (1, or 2 for the fused op),
    each expert's accumulator is multiplied by its global scales (per half), as for an exact bf16
    copy of NVFP4 weights: the reference multiplies the weights' rows instead."""
    rng = np.random.default_rng(seed)
    group_sizes = np.asarray(group_sizes, np.int32)
    experts = experts or len(group_sizes)
    if len(group_sizes) < experts:  # the used experts are the last ones
        group_sizes = np.concatenate([np.zeros(experts - len(group_sizes), np.int32), group_sizes])
    n_w = 2 * n_out if op is Op.GATE_UP_SWIGLU else n_out
    w_enk = (rng.standard_normal((experts, n_w, k)) / np.sqrt(k)).astype(ml_dtypes.bfloat16)
    stored = np.ascontiguousarray(np.swapaxes(w_enk, 1, 2)) if transpose_w else w_enk
    # Scales far from 1 and unlike each other (per expert, per half), so that one applied to the
    # wrong expert, half or row is far off.
    global_eg = (2.0 ** rng.integers(-6, 4, (experts, max(scale_groups, 1)))
                 * rng.uniform(1, 2, (experts, max(scale_groups, 1)))).astype(np.float32)
    total = int(group_sizes.sum())
    m = total + padding
    if tokens:
        x_in = _bf16(rng, (tokens, k))
        row_token = np.concatenate([rng.integers(0, tokens, total), np.full(padding, -(1 << 30))]).astype(np.int32)
        x = x_in[np.maximum(row_token, 0)]
    else:
        x_in = x = _bf16(rng, (m, k))
        row_token = np.zeros(1, np.int32)
    spec = triton_lang.make_spec(op, triton_lang.Mode.BF16, num_rows=m, num_experts=experts, k=k, n_out=n_out,
                                 scale_groups=scale_groups, compute_capability=CC, tile=tile, trans_w=transpose_w,
                                 gather_rows=tokens)
    interpreted.reset()
    out = np.full((m, n_out), np.nan, ml_dtypes.bfloat16)
    buffers = interpreted.schedule_buffers(group_sizes, m, spec.tile.rows_per_tile, spec.max_tiles)
    buffers += [interpreted.buffer(x_in, "x"),
                interpreted.buffer(np.zeros(1, np.uint8), "x_scales (unread)"),
                interpreted.buffer(np.zeros(1, np.float32), "x_global (unread)"),
                interpreted.buffer(row_token, "row_token" if tokens else "row_token (unread)"),
                interpreted.buffer(stored, "w"), interpreted.buffer(np.zeros(1, np.uint8), "w.scales (unread)"),
                (interpreted.buffer(global_eg, "w.global_scale") if scale_groups
                 else interpreted.buffer(np.zeros((1, 1), np.float32), "w.global_scale (unread)")),
                interpreted.buffer(np.zeros(1, ml_dtypes.bfloat16), "out_in (unread)")]
    got = interpreted.launch(triton_lang.kernel_function(), spec.num_programs, buffers, out, spec.constexprs())
    starts = np.concatenate([[0], np.cumsum(group_sizes)])
    row_scale_en = np.repeat(global_eg.astype(np.float64), n_w // global_eg.shape[1], axis=1) if scale_groups else 1.0
    w_ref = w_enk.astype(np.float64) * (row_scale_en[:, :, None] if scale_groups else 1.0)
    want = np.concatenate([expert(op, x[starts[e]:starts[e + 1]].astype(np.float64), w_ref[e])
                           for e in range(experts)])
    return compare(got, want, total, spec.tile)


@pytest.mark.parametrize("op", [Op.MATMUL, Op.GATE_UP_SWIGLU], ids=lambda op: op.value)
def test_the_sm90_table_tiles(op):
    """The table's tiles with each of their row paths: a 64-row tail, 128 rows, 128 + 64 in two
    MMAs, and an expert of more than one tile, among empty experts."""
    forward(op, [64, 0, 65, 128, 0, 192, 250, 1], k=256, n_out=128 if op is Op.MATMUL else 128)


@pytest.mark.parametrize("op", [Op.MATMUL, Op.GATE_UP_SWIGLU], ids=lambda op: op.value)
def test_rows_read_by_index(op):
    """The table's tiles reading their rows in place by index from fewer, unordered tokens; the
    padding rows' indices are negative and never read."""
    forward(op, [64, 0, 65, 128, 0, 192, 250, 1], k=256, n_out=128, tokens=97, seed=11)


def test_the_transposed_weight_matmul():
    """``transpose_w``: ``W_e`` stored ``[K, N]`` (an input gradient's weight as the forward stores it)."""
    forward(Op.MATMUL, [70, 0, 130, 9], k=192, n_out=128, transpose_w=True)


@pytest.mark.parametrize("transpose_w", [False, True], ids=["stored", "transposed"])
def test_kimi_k2_s_last_experts(transpose_w):
    """384 experts with only the last four used: the 64-bit expert offsets of the weights reach
    the end of the buffer (a wrong stride lands outside it, which the bounds checks see)."""
    forward(Op.MATMUL, [3, 70, 0, 200], k=128, n_out=64, experts=384, transpose_w=transpose_w,
            tile=prefill_tile(64, 64, 64, 4, 2, extra_m=64, tail_m=32))


@pytest.mark.parametrize("op,transpose_w", [(Op.MATMUL, False), (Op.MATMUL, True), (Op.GATE_UP_SWIGLU, False)],
                         ids=["matmul", "matmul_transposed_w", "gate_up_swiglu"])
def test_the_sm90_many_rows_tiles(op, transpose_w):
    """``BF16_MANY_ROWS_TILES`` (256 rows a tile) as the GPU gets them: experts of one row, a tile
    less one, one tile, a tile and one, and several tiles, among empty experts."""
    tile = triton_lang.BF16_MANY_ROWS_TILES[CC][op, transpose_w]
    block = tile.block_m
    forward(op, [1, 0, block - 1, block, block + 1, 0, 2 * block + 3], k=128, n_out=64 if op is Op.GATE_UP_SWIGLU else 128,
            tile=tile, transpose_w=transpose_w, seed=17)


@pytest.mark.parametrize("op", [Op.MATMUL, Op.GATE_UP_SWIGLU], ids=lambda op: op.value)
def test_the_sm90_many_rows_tiles_reading_rows_by_index(op):
    """``BF16_MANY_ROWS_TILES`` reading their rows in place by index, as the forward under
    differentiation gives them a layer's tokens (the plain matmul there, the fused gate/up
    without differentiation): fewer, unordered tokens, padding rows' indices never read."""
    tile = triton_lang.BF16_MANY_ROWS_TILES[CC][op, False]
    block = tile.block_m
    forward(op, [1, 0, block - 1, block, block + 1, 0, 2 * block + 3], k=128, n_out=64 if op is Op.GATE_UP_SWIGLU else 128,
            tile=tile, tokens=301, seed=19)


@pytest.mark.parametrize("op,scale_groups,tile", [
    (Op.MATMUL, 1, None), (Op.GATE_UP_SWIGLU, 1, None), (Op.GATE_UP_SWIGLU, 2, None),
    (Op.MATMUL, 1, "many_rows"), (Op.GATE_UP_SWIGLU, 2, "many_rows")],
    ids=["matmul", "gate_up_swiglu", "gate_up_swiglu_own_scales", "matmul_many_rows", "gate_up_swiglu_many_rows"])
def test_global_scales_of_an_exact_copy_of_nvfp4_weights(op, scale_groups, tile):
    """``scale_groups`` > 0 (``bf16_matmul(global_scale=)``, ``dequantized_forward``): each
    expert's accumulator times its global scale, or gate's and up's own before SwiGLU, in the
    table's tiles and the many-rows tiles the copied forward takes; rows by index too."""
    if tile == "many_rows":
        tile = triton_lang.BF16_MANY_ROWS_TILES[CC][op, False]
        block = tile.block_m
        sizes = [1, 0, block - 1, block + 1, 2 * block + 3]
    else:
        sizes = [64, 0, 65, 128, 0, 192, 250, 1]
    forward(op, sizes, k=128, n_out=64, tile=tile, scale_groups=scale_groups, tokens=211, seed=23)
