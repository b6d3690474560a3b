"""Candidates: the W4A16 NVFP4 grouped GEMM for SM90 in Gluon (triton 3.6's explicit-layout
language), two designs; measured slower than the table kernel on an H200
(``benchmarks/results/gluon_probe_h200/``, ``benchmarks/NOTES.md`` section 1, "Gluon candidates").

A probe, not a backend: it lives beside its benchmark (``benchmarks/gluon_probe.py``), outside the
library, and nothing dispatches to it. Kept because it is the base of the next step, the
warp-specialized candidate in ``benchmarks/gluon_ws_kernel.py`` (``gl.warp_specialize``), which
takes its dequantization, tile order, spec and launch from here: Gluon kernels compiled here run
through jaxlib's ``triton_kernel_call`` (with Triton's global scratch for device-side TMA
descriptors) and match the table kernel and float64 at Kimi K2's size.

Candidate 1 (:func:`_kernel`, swap-AB): the dequantization overlapped with the previous K step's
MMAs.

Why: ``triton_lang._kernel`` (plain Triton) splits each K step's ``tl.dot`` into eight k16
``wgmma``s and keeps at most seven in flight (``warp_group_dot_wait {pendings = 7}`` after each),
so when a K step's last MMA issues, nine of its sixteen have finished and only the rest overlap
the next step's dequantization (Nsight Compute, 2026-12-03: tensor pipe 57%, 33% of issue slots,
0.47 eligible warps per scheduler). Here each K step is one asynchronous ``warpgroup_mma`` over
the whole step, and the wait after it (``warpgroup_mma_wait(1)``) lets it run while the next
step's weights are loaded from shared memory and dequantized; the register operand of the MMA in
flight is kept alive through the wait's ``deps`` so that the next one is dequantized into other
registers.

Same contract, schedule and numerics as ``triton_lang``'s W4A16 path: swap-AB (the dequantized
weight tile ``[R, BLOCK_K]`` is the MMA's register A operand, the token rows its N from shared
memory), ``x``'s columns in ``triton_lang.permute_k`` order, tiles of at most ``ROWS`` rows of one
expert (``pallas_triton.tile_schedule``) multiplied as 64, 128 or 192 MMA columns by the rows a tile
holds, the global scales and SwiGLU in float32 on the accumulator. Loads are ``cp.async`` into a
ring of ``NUM_STAGES`` buffers, ``NUM_STAGES - 2`` K steps ahead: a step's buffer is refilled only
after a CTA barrier that every warp group passes after its wait for that step's MMA.

Candidate 2 (:func:`_ss_kernel`): dequantized into shared memory, tokens on the MMA's M and 256
weight rows on its N, both operands from shared memory (see its section below).

jax-triton 0.3.1 cannot launch a Gluon kernel (it builds its own TTIR pipeline from a
``triton.jit`` function), so each is launched by a primitive of this module around
``triton.compile`` and jaxlib's ``triton_kernel_call``, like ``benchmarks/ws_probe_kernel.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.experimental.gluon as gluon
import triton.experimental.gluon.language as gl
from jax.extend.core import Primitive
from jax.interpreters import mlir
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from pallas_kernels.grouped_matmul import pallas_triton, triton_lang
from pallas_kernels.grouped_matmul.tuning import Op

#: Rows of one tile at most; the MMA takes 64, 128 or 192 of them by what the tile holds.
ROWS = gl.constexpr(192)
NUM_WARPS = gl.constexpr(8)  # two warp groups: weight rows [0, 64) and [64, 128) of the tile


@gluon.jit
def _program_tile(pid, NUM_TILES: gl.constexpr, NUM_COLUMN_TILES: gl.constexpr, GROUP_T: gl.constexpr):
    """``triton_lang._program_tile`` of work item ``pid``: GROUP_T row tiles per column tile,
    back to back."""
    per_group: gl.constexpr = GROUP_T * NUM_COLUMN_TILES
    first_t = (pid // per_group) * GROUP_T
    rows_here = gl.minimum(NUM_TILES - first_t, GROUP_T)
    local = pid % per_group
    return first_t + local % rows_here, local // rows_here


@gluon.jit
def _scales_per_word(scales_rb, R: gl.constexpr, BLOCK_K: gl.constexpr, WORDS: gl.constexpr,
                     TRIVIAL: gl.constexpr):
    """uint8 ``[R, BK/16]`` E4M3 bits -> bf16 ``[R, BK/8]`` ``scale * 2**119``, one per packed word
    (two words per block scale), in ``WORDS`` (``TRIVIAL``: asserted a free conversion).
    ``triton_lang._dequantize_w4a16``'s placement, restated because a Gluon kernel cannot call a
    ``triton.jit`` function."""
    bits = scales_rb.to(gl.uint16)
    placed = (((bits & 0x7F) << 4) | ((bits & 0x80) << 8)).to(gl.bfloat16, bitcast=True)
    scale_rb = placed * 1.7014118346046923e38 * 5.192296858534828e33  # 2**127, 2**112
    return gl.convert_layout(gl.reshape(gl.join(scale_rb, scale_rb), (R, BLOCK_K // 8)), WORDS,
                             assert_trivial=TRIVIAL)


@gluon.jit
def _rows_pointers(ptr, rows, row_stride, WIDTH: gl.constexpr, LAYOUT: gl.constexpr):
    """``[R, WIDTH]`` pointers ``ptr + rows * row_stride + [0, WIDTH)`` in ``LAYOUT`` (``rows`` in
    its row slice): a tile of rows of packed words or of scales."""
    return ptr + (rows[:, None] * row_stride + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, LAYOUT))[None, :])


@gluon.jit
def _packed_pointers(w_ptr, w_scale_ptr, expert, j, R: gl.constexpr, K: gl.constexpr, N_OUT: gl.constexpr,
                     N_W: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, W_LOAD: gl.constexpr,
                     S_LOAD: gl.constexpr):
    """The first K step's ``[R, BLOCK_K / 8]`` word and ``[R, BLOCK_K / 16]`` scale pointers of
    output tile ``j``'s ``R`` weight rows: ``BLOCK_N`` rows of the first half (gate), then of the
    second (up, ``N_OUT`` further) for a fused tile of ``2 BLOCK_N``."""
    wr = gl.arange(0, R, layout=gl.SliceLayout(1, W_LOAD))
    sr = gl.arange(0, R, layout=gl.SliceLayout(1, S_LOAD))
    w_at = _rows_pointers(w_ptr.to(gl.pointer_type(gl.int32), bitcast=True) + expert * (N_W * (K // 8)),
                          (wr // BLOCK_N) * N_OUT + j * BLOCK_N + wr % BLOCK_N, K // 8, BLOCK_K // 8, W_LOAD)
    s_at = _rows_pointers(w_scale_ptr + expert * (N_W * (K // 16)),
                          (sr // BLOCK_N) * N_OUT + j * BLOCK_N + sr % BLOCK_N, K // 16, BLOCK_K // 16, S_LOAD)
    return w_at, s_at


@gluon.jit
def _dequantize(words_rw, scales_rb, R: gl.constexpr, BLOCK_K: gl.constexpr, WORDS: gl.constexpr,
                A_LAYOUT: gl.constexpr):
    """``triton_lang._dequantize_w4a16`` with explicit layouts: int32 ``[R, BK/8]`` words in
    ``WORDS`` and uint8 ``[R, BK/16]`` E4M3 bits -> bf16 ``[R, BK]`` in the MMA's A layout."""
    scale_rw = _scales_per_word(scales_rb, R, BLOCK_K, WORDS, False)
    o = gl.inline_asm_elementwise(triton_lang._WORD_TO_BF16_PTX, "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [words_rw, scale_rw],
                                  dtype=(gl.bfloat16,) * 8, is_pure=True, pack=1)
    q = gl.join(gl.join(gl.join(o[0], o[1]), gl.join(o[2], o[3])), gl.join(gl.join(o[4], o[5]), gl.join(o[6], o[7])))
    q = gl.reshape(q, (R, 4, BLOCK_K // 32, 2, 2, 2))  # [n, c, g, t, h, g0]
    w_rk = gl.reshape(gl.permute(q, (0, 2, 5, 4, 1, 3)), (R, BLOCK_K))  # [n, g, g0, h, c, t]
    return gl.convert_layout(w_rk, A_LAYOUT)


@gluon.jit
def _issue_loads(step, stage, x_smem, x2_smem, w_smem, s_smem, x_base, x_at, x_ok, x2_at, x2_ok, w_at, s_at,
                 BLOCK_K: gl.constexpr, EXTRA_M: gl.constexpr, ABLATE: gl.constexpr):
    """``cp.async`` of K step ``step`` (activations, packed words, scales) into buffer ``stage``."""
    if ABLATE != 1:
        cp.async_copy_global_to_shared(x_smem.index(stage), x_base + x_at + step * BLOCK_K, mask=x_ok)
        if EXTRA_M > 0:
            cp.async_copy_global_to_shared(x2_smem.index(stage), x_base + x2_at + step * BLOCK_K, mask=x2_ok)
    cp.async_copy_global_to_shared(w_smem.index(stage), w_at + step * (BLOCK_K // 8))
    cp.async_copy_global_to_shared(s_smem.index(stage), s_at + step * (BLOCK_K // 16))


@gluon.jit
def _kernel(tile_expert_ptr, tile_start_ptr, tile_end_ptr, x_ptr, w_ptr, w_scale_ptr, w_global_ptr, out_in_ptr,
            out_ptr, K: gl.constexpr, N_OUT: gl.constexpr, N_W: gl.constexpr, G: gl.constexpr, FUSED: gl.constexpr,
            NUM_TILES: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_T: gl.constexpr,
            NUM_STAGES: gl.constexpr, OUT_K_ORDER: gl.constexpr, WORDS: gl.constexpr, SCALES: gl.constexpr,
            X_LOAD: gl.constexpr, W_LOAD: gl.constexpr, S_LOAD: gl.constexpr, X_SMEM: gl.constexpr,
            PLAIN_SMEM: gl.constexpr, STORE: gl.constexpr, ABLATE: gl.constexpr):
    t, j = _program_tile(gl.program_id(0), NUM_TILES, N_OUT // BLOCK_N, GROUP_T)
    row_start = gl.load(tile_start_ptr + t)
    row_end = gl.load(tile_end_ptr + t)
    if row_start < row_end:
        expert = gl.load(tile_expert_ptr + t).to(gl.int64)
        rows = row_end - row_start  # the expert's rows from here on (more than the tile holds, but in its last)
        if rows <= 64:
            _tile(row_start, row_end, expert, j, x_ptr, w_ptr, w_scale_ptr, w_global_ptr, out_ptr, K, N_OUT, N_W, G,
                  FUSED, 64, 0, BLOCK_N, BLOCK_K, NUM_STAGES, OUT_K_ORDER, WORDS, SCALES, X_LOAD, W_LOAD, S_LOAD,
                  X_SMEM, PLAIN_SMEM, STORE, ABLATE)
        elif rows <= 128:
            _tile(row_start, row_end, expert, j, x_ptr, w_ptr, w_scale_ptr, w_global_ptr, out_ptr, K, N_OUT, N_W, G,
                  FUSED, 128, 0, BLOCK_N, BLOCK_K, NUM_STAGES, OUT_K_ORDER, WORDS, SCALES, X_LOAD, W_LOAD, S_LOAD,
                  X_SMEM, PLAIN_SMEM, STORE, ABLATE)
        else:
            _tile(row_start, row_end, expert, j, x_ptr, w_ptr, w_scale_ptr, w_global_ptr, out_ptr, K, N_OUT, N_W, G,
                  FUSED, 128, 64, BLOCK_N, BLOCK_K, NUM_STAGES, OUT_K_ORDER, WORDS, SCALES, X_LOAD, W_LOAD, S_LOAD,
                  X_SMEM, PLAIN_SMEM, STORE, ABLATE)


@gluon.jit
def _tile(row_start, row_end, expert, j, x_ptr, w_ptr, w_scale_ptr, w_global_ptr, out_ptr, K: gl.constexpr,
          N_OUT: gl.constexpr, N_W: gl.constexpr, G: gl.constexpr, FUSED: gl.constexpr, BLOCK_M: gl.constexpr,
          EXTRA_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, NUM_STAGES: gl.constexpr,
          OUT_K_ORDER: gl.constexpr, WORDS: gl.constexpr, SCALES: gl.constexpr, X_LOAD: gl.constexpr,
          W_LOAD: gl.constexpr, S_LOAD: gl.constexpr, X_SMEM: gl.constexpr, PLAIN_SMEM: gl.constexpr,
          STORE: gl.constexpr, ABLATE: gl.constexpr):
    """Rows ``[row_start, min(row_end, row_start + BLOCK_M + EXTRA_M))`` of one expert x output
    tile ``j``; the ``EXTRA_M`` rows (if any) in a second accumulator against the same operand."""
    R: gl.constexpr = 2 * BLOCK_N if FUSED else BLOCK_N
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                   instr_shape=[16, BLOCK_M, 16])
    A_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    STEPS: gl.constexpr = K // BLOCK_K
    AHEAD: gl.constexpr = NUM_STAGES - 2
    MMAS: gl.constexpr = 2 if EXTRA_M > 0 else 1  # commit groups per K step

    # 64-bit scalar bases, 32-bit offsets inside one expert's matrix and one row tile.
    first_row = row_start.to(gl.int64)
    x_base = x_ptr + first_row * K
    xm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, X_LOAD))
    xk = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, X_LOAD))
    x_at = xm[:, None] * K + xk[None, :]
    # Rows past this expert's end are not read (zero-filled): their MMA columns are never stored.
    x_ok = (row_start + xm < row_end)[:, None] & (xk < BLOCK_K)[None, :]
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES, BLOCK_M, BLOCK_K], X_SMEM)
    if EXTRA_M > 0:
        xm2 = BLOCK_M + gl.arange(0, EXTRA_M, layout=gl.SliceLayout(1, X_LOAD))
        x2_at = xm2[:, None] * K + xk[None, :]
        x2_ok = (row_start + xm2 < row_end)[:, None] & (xk < BLOCK_K)[None, :]
        x2_smem = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES, EXTRA_M, BLOCK_K], X_SMEM)
    else:
        x2_at = x_at
        x2_ok = x_ok
        x2_smem = x_smem
    w_at, s_at = _packed_pointers(w_ptr, w_scale_ptr, expert, j, R, K, N_OUT, N_W, BLOCK_N, BLOCK_K, W_LOAD, S_LOAD)
    w_smem = gl.allocate_shared_memory(gl.int32, [NUM_STAGES, R, BLOCK_K // 8], PLAIN_SMEM)
    s_smem = gl.allocate_shared_memory(gl.uint8, [NUM_STAGES, R, BLOCK_K // 16], PLAIN_SMEM)

    for s in gl.static_range(AHEAD):
        if s < STEPS:
            _issue_loads(s, s, x_smem, x2_smem, w_smem, s_smem, x_base, x_at, x_ok, x2_at, x2_ok, w_at, s_at,
                         BLOCK_K, EXTRA_M, ABLATE)
        cp.commit_group()

    acc = gl.zeros((R, BLOCK_M), gl.float32, layout=MMA)
    MMA2: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                    instr_shape=[16, EXTRA_M if EXTRA_M > 0 else BLOCK_M, 16])
    acc2 = gl.zeros((R, EXTRA_M if EXTRA_M > 0 else BLOCK_M), gl.float32, layout=MMA2)
    a_prev = gl.zeros((R, BLOCK_K), gl.bfloat16, layout=A_LAYOUT)
    for i in range(STEPS):
        cp.wait_group(AHEAD - 1)  # step i has landed (this thread's copies) ...
        gl.thread_barrier()  # ... every thread's; and every warp group has waited for step i - 1's MMA
        ahead = i + AHEAD
        if ahead < STEPS:  # into the buffer of step i - 2, whose MMAs are done
            _issue_loads(ahead, ahead % NUM_STAGES, x_smem, x2_smem, w_smem, s_smem, x_base, x_at, x_ok, x2_at,
                         x2_ok, w_at, s_at, BLOCK_K, EXTRA_M, ABLATE)
        cp.commit_group()
        stage = i % NUM_STAGES
        if ABLATE == 2:  # timing only: no weight read from shared memory, nothing dequantized
            a = gl.full((R, BLOCK_K), 1.0, gl.bfloat16, layout=A_LAYOUT)
        else:
            a = _dequantize(w_smem.index(stage).load(WORDS), s_smem.index(stage).load(SCALES), R, BLOCK_K, WORDS,
                            A_LAYOUT)
        acc = warpgroup_mma(a, x_smem.index(stage).permute((1, 0)), acc, is_async=True)
        if EXTRA_M > 0:
            a2 = gl.convert_layout(a, gl.DotOperandLayout(operand_index=0, parent=MMA2, k_width=2),
                                   assert_trivial=True)
            acc2 = warpgroup_mma(a2, x2_smem.index(stage).permute((1, 0)), acc2, is_async=True)
            # Step i - 1's MMAs are done after this; their register operand lived until here.
            acc, acc2, a_prev = warpgroup_mma_wait(2, deps=[acc, acc2, a_prev])
        else:
            acc, a_prev = warpgroup_mma_wait(1, deps=[acc, a_prev])
        a_prev = a
    acc = warpgroup_mma_wait(0, deps=[acc])
    if EXTRA_M > 0:
        acc2 = warpgroup_mma_wait(0, deps=[acc2])
    cp.wait_group(0)
    _epilogue(acc, row_start, row_end, first_row, 0, expert, j, w_global_ptr, out_ptr, N_OUT, G, FUSED, BLOCK_M,
              BLOCK_N, OUT_K_ORDER, MMA, PLAIN_SMEM, STORE)
    if EXTRA_M > 0:
        _epilogue(acc2, row_start, row_end, first_row, BLOCK_M, expert, j, w_global_ptr, out_ptr, N_OUT, G, FUSED,
                  EXTRA_M, BLOCK_N, OUT_K_ORDER, MMA2, PLAIN_SMEM, STORE)


@gluon.jit
def _epilogue(acc, row_start, row_end, first_row, m0: gl.constexpr, expert, j, w_global_ptr, out_ptr,
              N_OUT: gl.constexpr, G: gl.constexpr, FUSED: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, OUT_K_ORDER: gl.constexpr, MMA: gl.constexpr, PLAIN_SMEM: gl.constexpr,
              STORE: gl.constexpr):
    """Scales the ``[R, BLOCK_M]`` accumulator of rows ``row_start + m0 + [0, BLOCK_M)``, applies
    SwiGLU (fused op) and stores the rows before ``row_end``."""
    R: gl.constexpr = 2 * BLOCK_N if FUSED else BLOCK_N
    # The global scales (per expert, per half of the fused op) and the 2**7 the operand is short of.
    half_r = gl.arange(0, R, layout=gl.SliceLayout(1, MMA)) // BLOCK_N
    w_global_r = gl.load(w_global_ptr + expert * G + half_r * (G - 1)) * 128.0
    acc = acc * w_global_r[:, None]
    if FUSED:  # gate's rows are one warp group's, up's the other's: they meet in shared memory
        both = gl.allocate_shared_memory(gl.float32, [R, BLOCK_M], PLAIN_SMEM, value=acc)
        gate = both.slice(0, BLOCK_N, dim=0).load(STORE)
        up = both.slice(BLOCK_N, BLOCK_N, dim=0).load(STORE)
        y = (gate / (1.0 + gl.exp(-gate)) * up).to(gl.bfloat16)
    else:
        y = gl.convert_layout(acc.to(gl.bfloat16), STORE)
    cols_n = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, STORE))
    if OUT_K_ORDER > 0:  # where permute_k(out, OUT_K_ORDER) puts each column
        o = cols_n % OUT_K_ORDER
        cols_n = _k_order(cols_n - o, o, OUT_K_ORDER)
    local_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, STORE))
    out_at = out_ptr + first_row * N_OUT + (local_m[None, :] * N_OUT + cols_n[:, None])
    gl.store(out_at, y, mask=(row_start + local_m < row_end)[None, :])


@gluon.jit
def _k_order(chunk_start, i, BLOCK_K: gl.constexpr):
    """``triton_lang._k_order`` (not inverted)."""
    G: gl.constexpr = BLOCK_K // 32
    c = i // (8 * G)
    g = (i // 8) % G
    t = (i // 4) % 2
    g0 = (i // 2) % 2
    h = i % 2
    return chunk_start + (32 * g + 16 * g0 + 8 * h + 2 * c + t)


# --- layouts -------------------------------------------------------------------------------------

def _bits(n: int) -> list[int]:
    return [1 << b for b in range(n.bit_length() - 1)]


def layouts(*, r: int, block_k: int, block_n: int) -> dict:
    """The kernel's layout constexprs for ``r`` weight rows (two warp groups of 64 rows each, so
    ``r == 128``) and ``block_k``.

    ``WORDS``: a thread holds, for weight rows ``l/4 + {0, 8}`` of its warp's 16, the ``G =
    block_k / 32`` consecutive words ``c G + g`` (``c = l % 4``) that ``_WORD_TO_BF16_PTX`` turns
    into exactly its registers of the MMA's A fragment (``triton_lang.permute_k``); ``SCALES`` the
    same rows and every block scale of those words (two words per scale)."""
    assert r == 128, r
    g = block_k // 32
    warp = [[16, 0], [32, 0], [64, 0]]
    words = gl.DistributedLinearLayout(
        reg_bases=[[8, 0]] + [[0, b] for b in _bits(g)], lane_bases=[[0, g], [0, 2 * g], [1, 0], [2, 0], [4, 0]],
        warp_bases=warp, block_bases=[], shape=[r, block_k // 8])
    scales = gl.DistributedLinearLayout(
        reg_bases=[[8, 0]] + [[0, b] for b in _bits(g // 2)],
        lane_bases=[[0, g // 2], [0, g], [1, 0], [2, 0], [4, 0]], warp_bases=warp, block_bases=[],
        shape=[r, block_k // 16])
    k_vectors = block_k // 8  # 16-byte vectors of bf16 per row
    x_load = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[32 // k_vectors, k_vectors],
                              warps_per_cta=[NUM_WARPS.value, 1], order=[1, 0])
    w_vectors = block_k // 32  # 16-byte vectors of words per row
    w_load = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[32 // w_vectors, w_vectors],
                              warps_per_cta=[NUM_WARPS.value, 1], order=[1, 0])
    s_vectors = block_k // 64  # 4-byte chunks of scales per row
    s_load = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[32 // s_vectors, s_vectors],
                              warps_per_cta=[NUM_WARPS.value, 1], order=[1, 0])
    x_smem = gl.NVMMASharedLayout(swizzle_byte_width=128 if block_k >= 64 else 2 * block_k, element_bitwidth=16,
                                  rank=2)
    plain = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    # Output columns (the weight rows) contiguous in a thread: 16-byte stores.
    store = gl.BlockedLayout(size_per_thread=[8, 1], threads_per_warp=[8, 4], warps_per_cta=[1, NUM_WARPS.value],
                             order=[0, 1])
    return dict(WORDS=words, SCALES=scales, X_LOAD=x_load, W_LOAD=w_load, S_LOAD=s_load, X_SMEM=x_smem,
                PLAIN_SMEM=plain, STORE=store)


# --- candidate 2: dequantized into shared memory, tokens on the MMA's M, 256 weight rows on N ----
#
# Each K step: every thread dequantizes words of the step's 256 x BLOCK_K weight tile (natural K
# order: no permute_k of x) and stores them into one of two swizzled bf16 buffers; after a fence
# and a barrier both warp groups multiply their 64 token rows (the 128-row part; the 64-row part
# splits N between them) by the whole tile from shared memory (``wgmma`` m64n256 / m64n128, both
# operands in shared memory), asynchronously, while the next step is dequantized into the other
# buffer. x is re-read from L2 once per 256 weight rows (the swap-AB kernels: per 128).

SS_N = gl.constexpr(256)


@gluon.jit
def _dequantize_natural(words_rw, scales_rb, R: gl.constexpr, BLOCK_K: gl.constexpr, WORDS: gl.constexpr):
    """int32 ``[R, BK/8]`` words and uint8 ``[R, BK/16]`` E4M3 bits -> bf16 ``[R, BK]``
    (``value * scale * 2**-7``) in natural K order."""
    scale_rw = _scales_per_word(scales_rb, R, BLOCK_K, WORDS, True)
    o = gl.inline_asm_elementwise(triton_lang._WORD_TO_BF16_PTX, "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [words_rw, scale_rw],
                                  dtype=(gl.bfloat16,) * 8, is_pure=True, pack=1)
    # Output j holds element _OUTPUT_NIBBLE[j] = (0, 4, 1, 5, 2, 6, 3, 7)[j] of the word: element
    # 4a + 2b + c is o[2(2b + c) + a]; joined innermost c, then b, then a, and put back in order.
    q = gl.join(gl.join(gl.join(o[0], o[2]), gl.join(o[4], o[6])), gl.join(gl.join(o[1], o[3]), gl.join(o[5], o[7])))
    return gl.reshape(gl.permute(q, (0, 1, 4, 3, 2)), (R, BLOCK_K))


@gluon.jit
def _ss_kernel(tile_expert_ptr, tile_start_ptr, tile_end_ptr, x_ptr, w_ptr, w_scale_ptr, w_global_ptr, out_in_ptr,
               out_ptr, K: gl.constexpr, N_OUT: gl.constexpr, N_W: gl.constexpr, G: gl.constexpr,
               FUSED: gl.constexpr, NUM_TILES: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_T: gl.constexpr,
               NUM_STAGES: gl.constexpr, WORDS: gl.constexpr, SCALES: gl.constexpr, X_LOAD: gl.constexpr,
               W_LOAD: gl.constexpr, S_LOAD: gl.constexpr, X_SMEM: gl.constexpr, W_SMEM: gl.constexpr,
               PLAIN_SMEM: gl.constexpr, STORE: gl.constexpr):
    BLOCK_N: gl.constexpr = SS_N // 2 if FUSED else SS_N  # output columns per tile
    t, j = _program_tile(gl.program_id(0), NUM_TILES, N_OUT // BLOCK_N, GROUP_T)
    row_start = gl.load(tile_start_ptr + t)
    row_end = gl.load(tile_end_ptr + t)
    if row_start < row_end:
        expert = gl.load(tile_expert_ptr + t).to(gl.int64)
        rows = row_end - row_start
        if rows <= 64:
            _ss_tile(row_start, row_end, expert, j, x_ptr, w_ptr, w_scale_ptr, w_global_ptr, out_ptr, K, N_OUT, N_W,
                     G, FUSED, 0, BLOCK_N, BLOCK_K, NUM_STAGES, WORDS, SCALES, X_LOAD, W_LOAD, S_LOAD, X_SMEM,
                     W_SMEM, PLAIN_SMEM, STORE)
        elif rows <= 128:
            _ss_tile(row_start, row_end, expert, j, x_ptr, w_ptr, w_scale_ptr, w_global_ptr, out_ptr, K, N_OUT, N_W,
                     G, FUSED, 1, BLOCK_N, BLOCK_K, NUM_STAGES, WORDS, SCALES, X_LOAD, W_LOAD, S_LOAD, X_SMEM,
                     W_SMEM, PLAIN_SMEM, STORE)
        else:
            _ss_tile(row_start, row_end, expert, j, x_ptr, w_ptr, w_scale_ptr, w_global_ptr, out_ptr, K, N_OUT, N_W,
                     G, FUSED, 2, BLOCK_N, BLOCK_K, NUM_STAGES, WORDS, SCALES, X_LOAD, W_LOAD, S_LOAD, X_SMEM,
                     W_SMEM, PLAIN_SMEM, STORE)


@gluon.jit
def _ss_tile(row_start, row_end, expert, j, x_ptr, w_ptr, w_scale_ptr, w_global_ptr, out_ptr, K: gl.constexpr,
             N_OUT: gl.constexpr, N_W: gl.constexpr, G: gl.constexpr, FUSED: gl.constexpr, PARTS: gl.constexpr,
             BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, NUM_STAGES: gl.constexpr, WORDS: gl.constexpr,
             SCALES: gl.constexpr, X_LOAD: gl.constexpr, W_LOAD: gl.constexpr, S_LOAD: gl.constexpr,
             X_SMEM: gl.constexpr, W_SMEM: gl.constexpr, PLAIN_SMEM: gl.constexpr, STORE: gl.constexpr):
    """Rows ``[row_start, min(row_end, row_start + 192))`` of one expert x output tile ``j``.
    ``PARTS``: 0 the 64-row part only (rows 0..63), 1 the 128-row part only, 2 both (the
    64-row part then holds rows 128..191)."""
    MAIN: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                    instr_shape=[16, SS_N, 16])  # 128 rows: one warp group per 64
    SMALL: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, NUM_WARPS // 4],
                                                     instr_shape=[16, SS_N // 2, 16])  # 64 rows: N split
    STEPS: gl.constexpr = K // BLOCK_K
    AHEAD: gl.constexpr = NUM_STAGES - 2
    HAS_MAIN: gl.constexpr = PARTS >= 1
    HAS_SMALL: gl.constexpr = PARTS != 1
    M_SMALL: gl.constexpr = 128 if PARTS == 2 else 0  # the 64-row part's first row in the tile

    first_row = row_start.to(gl.int64)
    x_base = x_ptr + first_row * K
    xk = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, X_LOAD))
    xm = gl.arange(0, 128, layout=gl.SliceLayout(1, X_LOAD))
    x_at = xm[:, None] * K + xk[None, :]
    x_ok = (row_start + xm < row_end)[:, None] & (xk < BLOCK_K)[None, :]
    xs = M_SMALL + gl.arange(0, 64, layout=gl.SliceLayout(1, X_LOAD))
    xs_at = xs[:, None] * K + xk[None, :]
    xs_ok = (row_start + xs < row_end)[:, None] & (xk < BLOCK_K)[None, :]
    w_at, s_at = _packed_pointers(w_ptr, w_scale_ptr, expert, j, SS_N, K, N_OUT, N_W, BLOCK_N, BLOCK_K, W_LOAD, S_LOAD)

    x_smem = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES, 128, BLOCK_K], X_SMEM)
    xs_smem = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES, 64, BLOCK_K], X_SMEM)
    w_smem = gl.allocate_shared_memory(gl.int32, [NUM_STAGES, SS_N, BLOCK_K // 8], PLAIN_SMEM)
    s_smem = gl.allocate_shared_memory(gl.uint8, [NUM_STAGES, SS_N, BLOCK_K // 16], PLAIN_SMEM)
    wb_smem = gl.allocate_shared_memory(gl.bfloat16, [2, SS_N, BLOCK_K], W_SMEM)

    for s in gl.static_range(AHEAD):
        if s < STEPS:
            _ss_issue(s, s, x_smem, xs_smem, w_smem, s_smem, x_base, x_at, x_ok, xs_at, xs_ok, w_at, s_at, BLOCK_K,
                      HAS_MAIN, HAS_SMALL)
        cp.commit_group()

    acc = gl.zeros((128, SS_N), gl.float32, layout=MAIN)
    acc_s = gl.zeros((64, SS_N), gl.float32, layout=SMALL)
    for i in range(STEPS):
        cp.wait_group(AHEAD - 1)
        # Step i's copies are every thread's now; every warp group has waited for step i - 1's MMAs,
        # so step i - 2's buffers and the bf16 buffer step i writes are free.
        gl.thread_barrier()
        ahead = i + AHEAD
        if ahead < STEPS:
            _ss_issue(ahead, ahead % NUM_STAGES, x_smem, xs_smem, w_smem, s_smem, x_base, x_at, x_ok, xs_at, xs_ok,
                      w_at, s_at, BLOCK_K, HAS_MAIN, HAS_SMALL)
        cp.commit_group()
        stage = i % NUM_STAGES
        wb = wb_smem.index(i % 2)
        wb.store(_dequantize_natural(w_smem.index(stage).load(WORDS), s_smem.index(stage).load(SCALES), SS_N,
                                     BLOCK_K, WORDS))
        fence_async_shared()
        gl.thread_barrier()
        if HAS_MAIN:
            acc = warpgroup_mma(x_smem.index(stage), wb.permute((1, 0)), acc, is_async=True)
        if HAS_SMALL:
            acc_s = warpgroup_mma(xs_smem.index(stage), wb.permute((1, 0)), acc_s, is_async=True)
        if PARTS == 2:
            acc, acc_s = warpgroup_mma_wait(2, deps=[acc, acc_s])
        elif HAS_MAIN:
            acc = warpgroup_mma_wait(1, deps=[acc])
        else:
            acc_s = warpgroup_mma_wait(1, deps=[acc_s])
    cp.wait_group(0)
    if HAS_MAIN:
        acc = warpgroup_mma_wait(0, deps=[acc])
        _ss_epilogue(acc, row_start, row_end, first_row, 0, expert, j, w_global_ptr, out_ptr, N_OUT, G, FUSED, 128,
                     BLOCK_N, MAIN, STORE)
    if HAS_SMALL:
        acc_s = warpgroup_mma_wait(0, deps=[acc_s])
        _ss_epilogue(acc_s, row_start, row_end, first_row, M_SMALL, expert, j, w_global_ptr, out_ptr, N_OUT, G,
                     FUSED, 64, BLOCK_N, SMALL, STORE)


@gluon.jit
def _ss_issue(step, stage, x_smem, xs_smem, w_smem, s_smem, x_base, x_at, x_ok, xs_at, xs_ok, w_at, s_at,
              BLOCK_K: gl.constexpr, HAS_MAIN: gl.constexpr, HAS_SMALL: gl.constexpr):
    if HAS_MAIN:
        cp.async_copy_global_to_shared(x_smem.index(stage), x_base + x_at + step * BLOCK_K, mask=x_ok)
    if HAS_SMALL:
        cp.async_copy_global_to_shared(xs_smem.index(stage), x_base + xs_at + step * BLOCK_K, mask=xs_ok)
    cp.async_copy_global_to_shared(w_smem.index(stage), w_at + step * (BLOCK_K // 8))
    cp.async_copy_global_to_shared(s_smem.index(stage), s_at + step * (BLOCK_K // 16))


@gluon.jit
def _ss_epilogue(acc, row_start, row_end, first_row, m0: gl.constexpr, expert, j, w_global_ptr, out_ptr,
                 N_OUT: gl.constexpr, G: gl.constexpr, FUSED: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, MMA: gl.constexpr, STORE: gl.constexpr):
    """``[BLOCK_M, 256]`` (token rows x weight rows) scaled, SwiGLU'd (fused: gate's 128 weight
    rows then up's), stored at rows ``row_start + m0 + [0, BLOCK_M)`` before ``row_end``."""
    # Each thread's 8 consecutive columns, gate's and up's in its registers (in the 64-row MMA
    # layout they are in different warp groups).
    acc = gl.convert_layout(acc, STORE)
    half_n = gl.arange(0, SS_N, layout=gl.SliceLayout(0, STORE)) // BLOCK_N
    acc = acc * (gl.load(w_global_ptr + expert * G + half_n * (G - 1)) * 128.0)[None, :]
    if FUSED:
        gate, up = gl.split(gl.permute(gl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
        y = gate / (1.0 + gl.exp(-gate)) * up
    else:
        y = acc
    y = gl.convert_layout(y.to(gl.bfloat16), STORE)
    local_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, STORE))
    cols_n = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, STORE))
    out_at = out_ptr + first_row * N_OUT + (local_m[:, None] * N_OUT + cols_n[None, :])
    gl.store(out_at, y, mask=(row_start + local_m < row_end)[:, None])


def ss_layouts(*, block_k: int) -> dict:
    """Layout constexprs of :func:`_ss_kernel` (8 warps, 256 weight rows)."""
    nw = NUM_WARPS.value
    scale_cols = block_k // 16  # a thread: one block scale and its two words
    words = gl.BlockedLayout(size_per_thread=[1, 2], threads_per_warp=[32 // scale_cols, scale_cols],
                             warps_per_cta=[nw, 1], order=[1, 0])
    scales = gl.BlockedLayout(size_per_thread=[1, 1], threads_per_warp=[32 // (block_k // 16), block_k // 16],
                              warps_per_cta=[nw, 1], order=[1, 0])
    x_load = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[32 // (block_k // 8), block_k // 8],
                              warps_per_cta=[nw, 1], order=[1, 0])
    w_load = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[32 // (block_k // 32), block_k // 32],
                              warps_per_cta=[nw, 1], order=[1, 0])
    s_load = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[32 // (block_k // 64), block_k // 64],
                              warps_per_cta=[nw, 1], order=[1, 0])
    swizzle = min(128, 2 * block_k)
    x_smem = gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=16, rank=2)
    w_smem = gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=16, rank=2)
    plain = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    store = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[2, 16], warps_per_cta=[nw, 1], order=[1, 0])
    return dict(WORDS=words, SCALES=scales, X_LOAD=x_load, W_LOAD=w_load, S_LOAD=s_load, X_SMEM=x_smem,
                W_SMEM=w_smem, PLAIN_SMEM=plain, STORE=store)


# --- the launch: one spec per candidate, a primitive around triton.compile and jaxlib's ----------
# --- triton_kernel_call ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, kw_only=True)
class _Spec:
    """Everything static about one launch (hashable: it keys the jit and compile caches)."""

    op: Op
    num_rows: int
    num_experts: int
    k: int
    n_out: int
    block_k: int
    num_stages: int
    group_t: int = 8
    scale_groups: int = 1

    @property
    def fused(self) -> bool:
        return self.op is Op.GATE_UP_SWIGLU

    @property
    def max_tiles(self) -> int:
        return pallas_triton.max_tiles(self.num_rows, self.num_experts, ROWS.value)

    @property
    def num_programs(self) -> int:
        return self.max_tiles * (self.n_out // self.block_n)  # block_n: output columns per tile, per candidate

    @property
    def num_warps(self) -> int:
        return NUM_WARPS.value

    def compile_options(self) -> dict:
        return {"num_warps": self.num_warps, "num_stages": 1}

    def constexprs(self) -> dict:
        """The constexprs every kernel takes."""
        return dict(K=self.k, N_OUT=self.n_out, N_W=2 * self.n_out if self.fused else self.n_out,
                    G=self.scale_groups, FUSED=self.fused, NUM_TILES=self.max_tiles, BLOCK_K=self.block_k,
                    GROUP_T=min(self.group_t, self.max_tiles), NUM_STAGES=self.num_stages)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GluonSpec(_Spec):
    """One launch of :func:`_kernel` (swap-AB)."""

    block_k: int = 128
    num_stages: int = 3
    out_k_order: int = 0
    #: Timing ablations, wrong results: 1 no activation loads, 2 no dequantization.
    ablate: int = 0
    kernel = _kernel

    @property
    def block_n(self) -> int:
        return 64 if self.fused else 128

    def constexprs(self) -> dict:
        r = 2 * self.block_n if self.fused else self.block_n
        return dict(super().constexprs(), BLOCK_N=self.block_n, OUT_K_ORDER=self.out_k_order, ABLATE=self.ablate,
                    **layouts(r=r, block_k=self.block_k, block_n=self.block_n))


@dataclasses.dataclass(frozen=True, kw_only=True)
class SsSpec(_Spec):
    """One launch of :func:`_ss_kernel`."""

    block_k: int = 64
    num_stages: int = 4
    kernel = _ss_kernel

    @property
    def block_n(self) -> int:
        return SS_N.value // 2 if self.fused else SS_N.value

    def constexprs(self) -> dict:
        return dict(super().constexprs(), **ss_layouts(block_k=self.block_k))


_POINTERS = {"tile_expert_ptr": "*i32", "tile_start_ptr": "*i32", "tile_end_ptr": "*i32", "x_ptr": "*bf16",
             "w_ptr": "*u8", "w_scale_ptr": "*u8", "w_global_ptr": "*fp32", "out_in_ptr": "*bf16",
             "out_ptr": "*bf16"}


@functools.cache
def compile_kernel(spec: _Spec, capability: int = 90):
    """``triton.compile`` of ``spec``'s kernel for ``capability`` (no GPU needed)."""
    from triton.experimental.gluon._runtime import GluonASTSource  # noqa: PLC0415

    from pallas_kernels.crosscompile import _triton_compile  # noqa: PLC0415

    fn, constexprs = spec.kernel, spec.constexprs()
    signature = {**_POINTERS, **{name: "constexpr" for name in constexprs}}
    aligned = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(fn.arg_names) if arg in _POINTERS}
    source = GluonASTSource(fn=fn, signature=signature, attrs=aligned,
                            constexprs={(fn.arg_names.index(a),): v for a, v in constexprs.items()})
    return _triton_compile(source, capability, spec.compile_options())


_gluon_call_p = Primitive("moe_jax_gluon_w4a16_call")
_gluon_call_p.multiple_results = True


def _scratch_bytes(spec: _Spec) -> int:
    """Triton's global scratch for the launch (device-side TMA descriptors): per program, all of them."""
    return max(1, int(compile_kernel(spec, 90).metadata.global_scratch_size) * spec.num_programs)


@_gluon_call_p.def_abstract_eval
def _gluon_call_abstract(*avals, spec: _Spec):
    del avals
    return (jax.core.ShapedArray((spec.num_rows, spec.n_out), jnp.bfloat16),
            jax.core.ShapedArray((_scratch_bytes(spec),), jnp.uint8))


def _gluon_call_lowering(ctx, *args, spec: _Spec):
    from jax._src.lib import gpu_triton  # noqa: PLC0415 (CUDA plugin only)

    kernel = compile_kernel(spec, 90)
    meta = kernel.metadata
    # A Gluon module has no TTIR (it is written at the TTGIR level); jaxlib loads the PTX. The
    # block is the kernel's warps after warp specialization, not the warps it was written for.
    tk = gpu_triton.TritonKernel(meta.name, int(meta.num_warps), 1, int(meta.shared), kernel.asm["ptx"], "", 90)
    # The user's pointers, then the scratch output in the kernel's global-scratch slot (jaxlib's
    # two trailing null pointers fill the profile-scratch slot and one the kernel does not read);
    # Triton aligns each program's slice to global_scratch_align from the base.
    params = [gpu_triton.create_array_parameter(0, 16) for _ in range(len(_POINTERS))]
    params.append(gpu_triton.create_array_parameter(0, int(meta.global_scratch_align) if meta.global_scratch_size
                                                    else 0))
    call = gpu_triton.TritonKernelCall(tk, spec.num_programs, 1, 1, params)
    proto = call.to_proto(f"gluon_{type(spec).__name__}_{spec.op.value}", b"")
    rule = jax.ffi.ffi_lowering("triton_kernel_call", api_version=2, backend_config=zlib.compress(proto),
                                operand_output_aliases={len(_POINTERS) - 2: 0})
    return rule(ctx, *args)


mlir.register_lowering(_gluon_call_p, _gluon_call_lowering, platform="cuda")


@functools.partial(jax.jit, static_argnums=(0,))
def launch(spec: _Spec, group_sizes_e, x_mk, packed, scales_u8, global_scale_eg, out):
    """bf16 ``[M, n_out]`` written into ``out`` (aliased); rows past ``sum(group_sizes_e)`` keep
    its values. ``x_mk``'s columns in ``triton_lang.permute_k(x, spec.block_k)`` order for
    :class:`GluonSpec` and :class:`WsSpec` (``gluon_ws_kernel``), natural for :class:`SsSpec`."""
    schedule = pallas_triton.tile_schedule(group_sizes_e, num_rows=spec.num_rows, block_m=ROWS.value,
                                            num_tiles=spec.max_tiles)
    y, _ = _gluon_call_p.bind(*schedule, x_mk, packed, scales_u8, global_scale_eg, out, spec=spec)
    return y


def _matmul(spec_type, op: Op, x_mk, w, group_sizes_e, out, **tile) -> jax.Array:
    m, k = x_mk.shape
    e, n_w, half_k = w.packed.shape
    # Weights read as their transpose (an input gradient): the output is their packed columns.
    n_out = 2 * half_k if tile.get("transpose_w") else n_w // 2 if op is Op.GATE_UP_SWIGLU else n_w
    g = w.global_scale.reshape(e, -1).astype(jnp.float32)
    spec = spec_type(op=op, num_rows=m, num_experts=e, k=k, n_out=n_out, scale_groups=g.shape[1], **tile)
    if out is None:
        out = jnp.zeros((m, n_out), jnp.bfloat16)
    return launch(spec, group_sizes_e, x_mk, w.packed, jax.lax.bitcast_convert_type(w.scales, jnp.uint8), g, out)


def w4a16_matmul(op: Op, x_mk, w, group_sizes_e, *, out=None, permuted: bool = False, **tile) -> jax.Array:
    """``triton_lang.run``'s W4A16 contract on SM90 through :func:`_kernel` (``x_mk`` in natural
    column order unless ``permuted``); ``tile``: :class:`GluonSpec`'s fields."""
    if not permuted:
        x_mk = triton_lang.permute_k(x_mk, tile.get("block_k", GluonSpec.block_k))
    return _matmul(GluonSpec, op, x_mk, w, group_sizes_e, out, **tile)


def ss_matmul(op: Op, x_mk, w, group_sizes_e, *, out=None, **tile) -> jax.Array:
    """``triton_lang.run``'s W4A16 contract on SM90 through :func:`_ss_kernel` (x in natural order);
    ``tile``: :class:`SsSpec`'s fields."""
    return _matmul(SsSpec, op, x_mk, w, group_sizes_e, out, **tile)


__all__ = ["GluonSpec", "ROWS", "SsSpec", "compile_kernel", "launch", "layouts", "ss_layouts", "ss_matmul",
           "w4a16_matmul"]
