"""Candidate 3: warp-specialized grouped GEMMs for SM90 in Gluon (``gl.warp_specialize``): NVFP4
W4A16 and bf16 weights, forward and input gradient.

A probe beside its benchmark (``benchmarks/gluon_probe.py``), outside the library; nothing
dispatches to it. It is the design ``benchmarks/NOTES.md`` section 1 ("Gluon candidates") names
after measuring the two lockstep candidates of ``gluon_probe_kernel``: there all 8 warps load,
dequantize and multiply, and the CTA barriers of every K step stall all of them (Nsight Compute:
1.83 barrier stalls per issued instruction, 0.46 eligible warps per scheduler).

Here no CTA barrier is in the K loop. Three partitions share a ring of ``NUM_STAGES`` buffers, and
each walks the same work items (tile x output columns): one per program, or, with
``WsSpec(persistent=...)``, every ``num_programs``-th from its own, so the producer loads the next
tile while the consumers write the last:

* a **producer** warp: per K step, the activation tile by TMA (``[N, BLOCK_K]`` token rows,
  128-byte swizzle, zero-filled past the last row) and the packed words and E4M3 scales of the
  tile's 128 weight rows by ``cp.async``, in the order the consumers' MMA rows want them; the
  step's ``full`` mbarrier completes when the TMA bytes have landed and every lane's copies have
  arrived (``cp.async.mbarrier.arrive.noinc``). It waits on the stage's ``empty`` mbarrier
  first, so it runs up to ``NUM_STAGES`` steps ahead.
* two **consumer** warp groups, each its own partition with 64 weight rows (the MMA's M, the
  register-A operand) of the tile: wait for ``full``, dequantize the words into the A fragment
  (``triton_lang``'s exact PTX), issue one asynchronous ``wgmma`` over the step against the token
  tile in shared memory (the MMA's N: 64, 128 or 192 token rows by what the tile holds), then
  ``warpgroup_mma_wait(1)`` retires the previous step's MMA, whose stage is released on
  ``empty``. The two groups never wait for each other: while one dequantizes, the other's MMAs
  run.

For the fused gate/up op each consumer holds 32 output columns as 64 MMA rows, ordered so that a
thread's two accumulator rows (``lane / 4`` and ``lane / 4 + 8`` of its warp's 16) are the gate
and the up row of one column: SwiGLU is computed in registers, with nothing exchanged between
warps. Same contract and numerics as ``triton_lang``'s W4A16 path and the other candidates: ``x``
sorted by expert in ``triton_lang.permute_k`` column order, tiles of at most 192 rows of one
expert (``pallas_triton.tile_schedule``), float32 accumulation, the global scales and SwiGLU on the
accumulator, bf16 out. The x descriptor is made on the device, in Triton's global scratch, which
``gluon_probe_kernel``'s launch primitive passes.

``WsSpec(bf16=True)`` is the same schedule for bf16 weights (``triton_lang.bf16_matmul``'s
contract, x in natural column order): the producer loads the weight tile by TMA too, and each
consumer multiplies its 64 rows from shared memory (both ``wgmma`` operands there).
``WsSpec(transpose_w=True)`` is an input gradient, ``dy @ W_e`` with ``W_e`` stored ``[K, N]``:
the weight tile is the ``wgmma``'s transposed A operand, by TMA for bf16, and for NVFP4
(``triton_lang.input_grad``'s contract) dequantized by each consumer in natural order into one of
two shared buffers (the packed dimension runs along the MMA's M there, so the register fragment
of the forward does not apply).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import triton.experimental.gluon as gluon
import triton.experimental.gluon.language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

from benchmarks.gluon_probe_kernel import (_bits, _dequantize, _dequantize_natural, _program_tile, _rows_pointers,
                                           _Spec)
from pallas_kernels.grouped_matmul.tuning import Op

#: Weight rows per consumer warp group (one ``wgmma`` M); two groups per tile.
WG_ROWS = gl.constexpr(64)
#: ``WEIGHTS``: NVFP4 (the register operand dequantized), bf16 ``[E, N_W, K]`` as stored, bf16
#: ``[E, K, N]`` read as its transpose (``out[m] = x[m] @ W_e``: an input gradient), or NVFP4
#: ``[E, K, N]`` read as its transpose (each consumer dequantizes into shared memory).
NVFP4, BF16, BF16_T, NVFP4_T = gl.constexpr(0), gl.constexpr(1), gl.constexpr(2), gl.constexpr(3)
CONSUMER_WARPS = gl.constexpr(4)


@gluon.jit
def _ws_kernel(tile_expert_ptr, tile_start_ptr, tile_end_ptr, x_ptr, w_ptr, w_scale_ptr, w_global_ptr, out_in_ptr,
               out_ptr, NUM_ROWS: gl.constexpr, NUM_EXPERTS: gl.constexpr, K: gl.constexpr, N_OUT: gl.constexpr,
               N_W: gl.constexpr, G: gl.constexpr, FUSED: gl.constexpr, WEIGHTS: gl.constexpr, NUM_TILES: gl.constexpr,
               BLOCK_K: gl.constexpr, GROUP_T: gl.constexpr, NUM_STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
               PRODUCER_REGS: gl.constexpr, WORDS: gl.constexpr, SCALES: gl.constexpr, T_WORDS: gl.constexpr,
               T_SCALES: gl.constexpr, W_COPY: gl.constexpr, S_COPY: gl.constexpr, X_SMEM: gl.constexpr,
               PLAIN_SMEM: gl.constexpr, STORE: gl.constexpr, X2_IN_X: gl.constexpr, X2_ROWS: gl.constexpr):
    """One ring and three partitions per program; each partition walks the same work items
    (``program_id``, then every ``num_programs``-th: one item when the grid has one program per
    item, persistent when it has one per SM), so the producer loads the next tile while the
    consumers finish the last one."""
    if X2_IN_X:  # the extra 64 rows as rows 128..191 of a 256-row stage (WsSpec.x2_in_x, _extra_rows)
        x_smem = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES, 256, BLOCK_K], X_SMEM)
        x2_smem = x_smem
    else:
        x_smem = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES, 128, BLOCK_K], X_SMEM)
        x2_smem = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES, 64, BLOCK_K], X_SMEM)
    if WEIGHTS == BF16:  # the weight tile as stored, swizzled for wgmma; no scales
        w_smem = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES, 2 * WG_ROWS, BLOCK_K], X_SMEM)
        s_smem = gl.allocate_shared_memory(gl.uint8, [1, 16], PLAIN_SMEM)
    elif WEIGHTS == BF16_T:  # per consumer a [BLOCK_K, 64] box of W_e, its output columns contiguous
        w_smem = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES, 2 * BLOCK_K, WG_ROWS], X_SMEM)
        s_smem = gl.allocate_shared_memory(gl.uint8, [1, 16], PLAIN_SMEM)
    else:  # packed words and E4M3 scales: NVFP4 K steps of the tile's 128 rows, NVFP4_T 64 rows x 128 columns
        w_smem = gl.allocate_shared_memory(gl.int32, [NUM_STAGES, 2 * WG_ROWS, BLOCK_K // 8], PLAIN_SMEM)
        s_smem = gl.allocate_shared_memory(gl.uint8, [NUM_STAGES, 2 * WG_ROWS, BLOCK_K // 16], PLAIN_SMEM)
    if WEIGHTS == NVFP4_T:  # each consumer's dequantized [BLOCK_K, 64] tile, double-buffered
        a_smem = gl.allocate_shared_memory(gl.bfloat16, [2, 2 * BLOCK_K, WG_ROWS], X_SMEM)
    else:
        a_smem = gl.allocate_shared_memory(gl.bfloat16, [1, 8, 64], X_SMEM)
    full = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NUM_STAGES):
        # full: the TMA's expect-arrive (and for W4A16 the producer warp's 32 cp.async arrivals);
        # empty: both consumers.
        mbarrier.init(full.index(s), count=1 if WEIGHTS == BF16 or WEIGHTS == BF16_T else 33)
        mbarrier.init(empty.index(s), count=2)
    # (Tuples written out: a tuple of constexpr layouts built in a jit function would become tensors.)
    gl.warp_specialize([
        (_consumer, (x_smem, x2_smem, w_smem, s_smem, a_smem, full, empty, tile_expert_ptr, tile_start_ptr,
                     tile_end_ptr, w_global_ptr, out_ptr, K, N_OUT, G, FUSED, WEIGHTS, NUM_TILES, BLOCK_K, GROUP_T,
                     NUM_STAGES, WORDS, SCALES, T_WORDS, T_SCALES, STORE, 0, X2_IN_X, X2_ROWS)),
        (_consumer, (x_smem, x2_smem, w_smem, s_smem, a_smem, full, empty, tile_expert_ptr, tile_start_ptr,
                     tile_end_ptr, w_global_ptr, out_ptr, K, N_OUT, G, FUSED, WEIGHTS, NUM_TILES, BLOCK_K, GROUP_T,
                     NUM_STAGES, WORDS, SCALES, T_WORDS, T_SCALES, STORE, 1, X2_IN_X, X2_ROWS)),
        (_producer, (x_smem, x2_smem, w_smem, s_smem, full, empty, tile_expert_ptr, tile_start_ptr, tile_end_ptr,
                     x_ptr, w_ptr, w_scale_ptr, NUM_ROWS, NUM_EXPERTS, K, N_OUT, N_W, FUSED, WEIGHTS, NUM_TILES,
                     BLOCK_K, GROUP_T, NUM_STAGES, W_COPY, S_COPY, X2_IN_X, X2_ROWS)),
    ], [CONSUMER_WARPS, 1], [CONSUMER_REGS, PRODUCER_REGS])


@gluon.jit
def _extra_rows(x_smem, x2_smem, stage, X2_IN_X: gl.constexpr, X2_ROWS: gl.constexpr = 64):
    """Stage ``stage``'s extra token rows of a 192-row tile: rows 128..191 of the token ring's
    stage (``WsSpec.x2_in_x``; 128..255 with ``X2_ROWS`` 128, ``WsSpec.x2_as_128``), or the stage
    of their own ring."""
    if X2_IN_X:
        return x_smem.index(stage).slice(128, X2_ROWS, dim=0)
    else:
        return x2_smem.index(stage)


@gluon.jit
def _item(item, tile_expert_ptr, tile_start_ptr, tile_end_ptr, N_OUT: gl.constexpr, FUSED: gl.constexpr,
          NUM_TILES: gl.constexpr, GROUP_T: gl.constexpr):
    """Work item ``item``: its expert (int64), first row, the end of the expert's rows, column tile."""
    # Output columns per tile: 2 x 32 (fused: 64 MMA rows per group hold 32 gate and 32 up rows) or 2 x 64.
    TILE_N: gl.constexpr = WG_ROWS if FUSED else 2 * WG_ROWS
    t, j = _program_tile(item, NUM_TILES, N_OUT // TILE_N, GROUP_T)
    return (gl.load(tile_expert_ptr + t).to(gl.int64), gl.load(tile_start_ptr + t), gl.load(tile_end_ptr + t), j)


@gluon.jit
def _num_items(N_OUT: gl.constexpr, FUSED: gl.constexpr, NUM_TILES: gl.constexpr):
    TILE_N: gl.constexpr = WG_ROWS if FUSED else 2 * WG_ROWS
    return NUM_TILES * (N_OUT // TILE_N)


@gluon.jit
def _weight_row(r, j, N_OUT: gl.constexpr, FUSED: gl.constexpr):
    """The weight row (of the expert's ``[N_W, K]``) that MMA row ``r`` (``[0, 128)``: consumer
    ``r // 64``, its row ``r % 64``) of output tile ``j`` multiplies. Fused: in each 16-row warp
    slab, 8 gate rows then the 8 up rows of the same 8 output columns."""
    if FUSED:
        rr = r % WG_ROWS
        column = j * WG_ROWS + (r // WG_ROWS) * (WG_ROWS // 2) + (rr // 16) * 8 + rr % 8
        return ((rr // 8) % 2) * N_OUT + column
    else:
        return j * (2 * WG_ROWS) + r


# --- the producer ----------------------------------------------------------------------------

@gluon.jit
def _producer(x_smem, x2_smem, w_smem, s_smem, full, empty, tile_expert_ptr, tile_start_ptr, tile_end_ptr, x_ptr,
              w_ptr, w_scale_ptr, NUM_ROWS: gl.constexpr, NUM_EXPERTS: gl.constexpr, K: gl.constexpr,
              N_OUT: gl.constexpr, N_W: gl.constexpr, FUSED: gl.constexpr, WEIGHTS: gl.constexpr,
              NUM_TILES: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_T: gl.constexpr, NUM_STAGES: gl.constexpr,
              W_COPY: gl.constexpr, S_COPY: gl.constexpr, X2_IN_X: gl.constexpr, X2_ROWS: gl.constexpr):
    # Token tiles of 64 rows (the 64-row tile and the extra 64 of a 192-row one) and of 128.
    x64_desc = tma.make_tensor_descriptor(x_ptr, shape=[NUM_ROWS, K], strides=[K, 1], block_shape=[64, BLOCK_K],
                                          layout=x2_smem.type.layout)
    x128_desc = tma.make_tensor_descriptor(x_ptr, shape=[NUM_ROWS, K], strides=[K, 1], block_shape=[128, BLOCK_K],
                                           layout=x_smem.type.layout)
    if WEIGHTS == BF16_T:  # W_e [K, N_OUT] of expert e at rows e K
        w_desc = tma.make_tensor_descriptor(w_ptr.to(gl.pointer_type(gl.bfloat16), bitcast=True),
                                            shape=[NUM_EXPERTS * K, N_OUT], strides=[N_OUT, 1],
                                            block_shape=[BLOCK_K, WG_ROWS], layout=w_smem.type.layout)
    elif WEIGHTS == BF16:
        SLAB: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)
        w_bf16 = w_ptr.to(gl.pointer_type(gl.bfloat16), bitcast=True)
        if FUSED:  # rows of half h of expert e at 2 e + h
            w_desc = tma.make_tensor_descriptor(w_bf16, shape=[NUM_EXPERTS * 2, N_OUT, K], strides=[N_OUT * K, K, 1],
                                                block_shape=[2, 8, BLOCK_K], layout=SLAB)
        else:
            w_desc = tma.make_tensor_descriptor(w_bf16, shape=[NUM_EXPERTS * N_W, K], strides=[K, 1],
                                                block_shape=[WG_ROWS, BLOCK_K], layout=w_smem.type.layout)
    else:
        w_desc = x64_desc  # unused
    it = 0  # K steps issued so far: the ring's position
    for item in range(gl.program_id(0), _num_items(N_OUT, FUSED, NUM_TILES), gl.num_programs(0)):
        expert, row_start, row_end, j = _item(item, tile_expert_ptr, tile_start_ptr, tile_end_ptr, N_OUT, FUSED,
                                              NUM_TILES, GROUP_T)
        rows = row_end - row_start  # the expert's rows from here on (more than the tile holds, but in its last)
        if rows > 0:
            if rows <= 64:
                it = _produce_tile(x64_desc, x64_desc, w_desc, x_smem, x2_smem, w_smem, s_smem, full, empty, it,
                                   row_start, expert, j, w_ptr, w_scale_ptr, K, N_OUT, N_W, FUSED, WEIGHTS, 64, 0,
                                   BLOCK_K, NUM_STAGES, W_COPY, S_COPY, X2_IN_X)
            elif rows <= 128:
                it = _produce_tile(x128_desc, x64_desc, w_desc, x_smem, x2_smem, w_smem, s_smem, full, empty, it,
                                   row_start, expert, j, w_ptr, w_scale_ptr, K, N_OUT, N_W, FUSED, WEIGHTS, 128, 0,
                                   BLOCK_K, NUM_STAGES, W_COPY, S_COPY, X2_IN_X)
            elif X2_ROWS == 128:  # the extra rows loaded as 128 (the tile's next 128 rows, masked on store)
                it = _produce_tile(x128_desc, x128_desc, w_desc, x_smem, x2_smem, w_smem, s_smem, full, empty, it,
                                   row_start, expert, j, w_ptr, w_scale_ptr, K, N_OUT, N_W, FUSED, WEIGHTS, 128, 128,
                                   BLOCK_K, NUM_STAGES, W_COPY, S_COPY, X2_IN_X)
            else:
                it = _produce_tile(x128_desc, x64_desc, w_desc, x_smem, x2_smem, w_smem, s_smem, full, empty, it,
                                   row_start, expert, j, w_ptr, w_scale_ptr, K, N_OUT, N_W, FUSED, WEIGHTS, 128, 64,
                                   BLOCK_K, NUM_STAGES, W_COPY, S_COPY, X2_IN_X)


@gluon.jit
def _produce_tile(x_desc, x2_desc, w_desc, x_smem, x2_smem, w_smem, s_smem, full, empty, it, row_start, expert, j,
                  w_ptr, w_scale_ptr, K: gl.constexpr, N_OUT: gl.constexpr, N_W: gl.constexpr, FUSED: gl.constexpr,
                  WEIGHTS: gl.constexpr, BLOCK_M: gl.constexpr, EXTRA_M: gl.constexpr, BLOCK_K: gl.constexpr,
                  NUM_STAGES: gl.constexpr, W_COPY: gl.constexpr, S_COPY: gl.constexpr, X2_IN_X: gl.constexpr):
    """Every K step of one tile into the ring from position ``it``; returns the position after."""
    TMA_WEIGHTS: gl.constexpr = WEIGHTS == BF16 or WEIGHTS == BF16_T
    W_BYTES: gl.constexpr = 2 * WG_ROWS * BLOCK_K * 2 if TMA_WEIGHTS else 0  # the weights' TMA bytes
    if WEIGHTS == NVFP4:  # the words' and scales' addresses, in the consumers' MMA row order
        W_STEP: gl.constexpr = BLOCK_K // 8
        S_STEP: gl.constexpr = BLOCK_K // 16
        w_at = _rows_pointers(w_ptr.to(gl.pointer_type(gl.int32), bitcast=True) + expert * (N_W * (K // 8)),
                              _weight_row(gl.arange(0, 2 * WG_ROWS, layout=gl.SliceLayout(1, W_COPY)), j, N_OUT,
                                          FUSED), K // 8, BLOCK_K // 8, W_COPY)
        s_at = _rows_pointers(w_scale_ptr + expert * (N_W * (K // 16)),
                              _weight_row(gl.arange(0, 2 * WG_ROWS, layout=gl.SliceLayout(1, S_COPY)), j, N_OUT,
                                          FUSED), K // 16, BLOCK_K // 16, S_COPY)
    elif WEIGHTS == NVFP4_T:
        # W_e [K, N_OUT] (K: this product's reduction): per step BLOCK_K rows, and per consumer
        # its 64 columns of the tile's 128.
        W_STEP: gl.constexpr = BLOCK_K * (N_OUT // 8)
        S_STEP: gl.constexpr = BLOCK_K * (N_OUT // 16)
        w_at = _transposed_pointers(w_ptr.to(gl.pointer_type(gl.int32), bitcast=True) + expert * (K * (N_OUT // 8)),
                                    j, N_OUT // 8, 8, BLOCK_K, W_COPY)
        s_at = _transposed_pointers(w_scale_ptr + expert * (K * (N_OUT // 16)), j, N_OUT // 16, 16, BLOCK_K, S_COPY)
    for i in range(K // BLOCK_K):
        stage = it % NUM_STAGES
        # A fresh barrier counts as having completed the phase before its first: the first lap passes.
        mbarrier.wait(empty.index(stage), ((it // NUM_STAGES) & 1) ^ 1)
        bar = full.index(stage)
        mbarrier.expect(bar, (BLOCK_M + EXTRA_M) * BLOCK_K * 2 + W_BYTES)
        tma.async_copy_global_to_shared(x_desc, [row_start, i * BLOCK_K], bar,
                                        x_smem.index(stage).slice(0, BLOCK_M, dim=0))
        if EXTRA_M > 0:
            tma.async_copy_global_to_shared(x2_desc, [row_start + BLOCK_M, i * BLOCK_K], bar,
                                            _extra_rows(x_smem, x2_smem, stage, X2_IN_X, EXTRA_M))
        if WEIGHTS == BF16_T:
            for wg in gl.static_range(2):
                tma.async_copy_global_to_shared(w_desc, [expert.to(gl.int32) * K + i * BLOCK_K,
                                                         j * (2 * WG_ROWS) + wg * WG_ROWS], bar,
                                                w_smem.index(stage).slice(wg * BLOCK_K, BLOCK_K, dim=0))
        elif WEIGHTS == BF16:
            _bf16_weight_loads(w_desc, w_smem.index(stage), bar, expert, j, i, N_W, FUSED, BLOCK_K)
        else:
            cp.async_copy_global_to_shared(w_smem.index(stage), w_at + i * W_STEP)
            cp.async_copy_global_to_shared(s_smem.index(stage), s_at + i * S_STEP)
            cp.mbarrier_arrive(bar, increment_count=False)
        it += 1
    return it


@gluon.jit
def _transposed_pointers(ptr, j, row_stride, PER: gl.constexpr, BLOCK_K: gl.constexpr, LAYOUT: gl.constexpr):
    """The ring's ``[2 BLOCK_K, 64 / PER]`` pointers for ``W_e [K, N_OUT]`` packed ``PER`` columns
    to an element (words 8, scales 16) at ``ptr``: ring row ``r`` is consumer ``r // BLOCK_K``'s
    row ``r % BLOCK_K`` of the step, at that consumer's first column of output tile ``j``."""
    r = gl.arange(0, 2 * BLOCK_K, layout=gl.SliceLayout(1, LAYOUT))
    first_column = j * (2 * WG_ROWS) + (r // BLOCK_K) * WG_ROWS
    return _rows_pointers(ptr + first_column[:, None] // PER, r % BLOCK_K, row_stride, WG_ROWS // PER, LAYOUT)


@gluon.jit
def _bf16_weight_loads(w_desc, w_stage, bar, expert, j, i, N_W: gl.constexpr, FUSED: gl.constexpr,
                       BLOCK_K: gl.constexpr):
    """K step ``i`` of the tile's 128 bf16 weight rows by TMA, in the consumers' MMA row order.
    Fused: each 16-row slab is 8 gate rows and the 8 up rows of the same output columns, one
    ``[2, 8, BLOCK_K]`` box of the ``[E * 2, N_OUT, K]`` view; the 128-byte swizzle repeats every
    8 rows, so the slabs land as the rows of one swizzled ``[128, BLOCK_K]`` tile."""
    if FUSED:
        SLAB: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=3)
        for slab in gl.static_range(2 * WG_ROWS // 16):  # 4 per consumer, consumer-major
            column = j * WG_ROWS + (slab // 4) * (WG_ROWS // 2) + (slab % 4) * 8
            dst = w_stage.slice(slab * 16, 16, dim=0)._reinterpret(gl.bfloat16, [2, 8, BLOCK_K], SLAB)
            tma.async_copy_global_to_shared(w_desc, [expert.to(gl.int32) * 2, column, i * BLOCK_K], bar, dst)
    else:
        for wg in gl.static_range(2):
            row = expert.to(gl.int32) * N_W + j * (2 * WG_ROWS) + wg * WG_ROWS
            tma.async_copy_global_to_shared(w_desc, [row, i * BLOCK_K], bar, w_stage.slice(wg * WG_ROWS, WG_ROWS,
                                                                                           dim=0))


# --- the consumers ---------------------------------------------------------------------------

@gluon.jit
def _consumer(x_smem, x2_smem, w_smem, s_smem, a_smem, full, empty, tile_expert_ptr, tile_start_ptr, tile_end_ptr,
              w_global_ptr, out_ptr, K: gl.constexpr, N_OUT: gl.constexpr, G: gl.constexpr, FUSED: gl.constexpr,
              WEIGHTS: gl.constexpr, NUM_TILES: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_T: gl.constexpr,
              NUM_STAGES: gl.constexpr, WORDS: gl.constexpr, SCALES: gl.constexpr, T_WORDS: gl.constexpr,
              T_SCALES: gl.constexpr, STORE: gl.constexpr, WG: gl.constexpr, X2_IN_X: gl.constexpr,
              X2_ROWS: gl.constexpr):
    it = 0  # K steps consumed so far: the ring's position
    for item in range(gl.program_id(0), _num_items(N_OUT, FUSED, NUM_TILES), gl.num_programs(0)):
        expert, row_start, row_end, j = _item(item, tile_expert_ptr, tile_start_ptr, tile_end_ptr, N_OUT, FUSED,
                                              NUM_TILES, GROUP_T)
        rows = row_end - row_start
        if rows > 0:
            if rows <= 64:
                it = _consume_tile(x_smem, x2_smem, w_smem, s_smem, a_smem, full, empty, it, row_start, row_end,
                                   expert, j, w_global_ptr, out_ptr, K, N_OUT, G, FUSED, WEIGHTS, 64, 0, BLOCK_K,
                                   NUM_STAGES, WORDS, SCALES, T_WORDS, T_SCALES, STORE, WG, X2_IN_X)
            elif rows <= 128:
                it = _consume_tile(x_smem, x2_smem, w_smem, s_smem, a_smem, full, empty, it, row_start, row_end,
                                   expert, j, w_global_ptr, out_ptr, K, N_OUT, G, FUSED, WEIGHTS, 128, 0, BLOCK_K,
                                   NUM_STAGES, WORDS, SCALES, T_WORDS, T_SCALES, STORE, WG, X2_IN_X)
            else:  # 128 + 64 rows; with X2_ROWS 128 the extra 64 multiplied as 128 (those past 192 not stored)
                it = _consume_tile(x_smem, x2_smem, w_smem, s_smem, a_smem, full, empty, it, row_start,
                                   gl.minimum(row_end, row_start + 192), expert, j, w_global_ptr, out_ptr, K, N_OUT, G,
                                   FUSED, WEIGHTS, 128, X2_ROWS, BLOCK_K, NUM_STAGES, WORDS, SCALES, T_WORDS,
                                   T_SCALES, STORE, WG, X2_IN_X)


@gluon.jit
def _consume_tile(x_smem, x2_smem, w_smem, s_smem, a_smem, full, empty, it, row_start, row_end, expert, j,
                  w_global_ptr, out_ptr, K: gl.constexpr, N_OUT: gl.constexpr, G: gl.constexpr, FUSED: gl.constexpr,
                  WEIGHTS: gl.constexpr, BLOCK_M: gl.constexpr, EXTRA_M: gl.constexpr, BLOCK_K: gl.constexpr,
                  NUM_STAGES: gl.constexpr, WORDS: gl.constexpr, SCALES: gl.constexpr, T_WORDS: gl.constexpr,
                  T_SCALES: gl.constexpr, STORE: gl.constexpr, WG: gl.constexpr, X2_IN_X: gl.constexpr):
    """Token rows ``[row_start, min(row_end, row_start + BLOCK_M + EXTRA_M))`` of one expert x this
    consumer's 64 weight rows of output tile ``j``, from ring position ``it``; the ``EXTRA_M``
    rows (if any) are a second MMA against the same weight operand (shapes are powers of two).
    Returns the position after the tile."""
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1],
                                                   instr_shape=[16, BLOCK_M, 16])
    A_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    M2: gl.constexpr = EXTRA_M if EXTRA_M > 0 else BLOCK_M
    MMA2: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1],
                                                    instr_shape=[16, M2, 16])
    acc = gl.zeros((WG_ROWS, BLOCK_M), gl.float32, layout=MMA)
    acc2 = gl.zeros((WG_ROWS, M2), gl.float32, layout=MMA2)
    a_prev = gl.zeros((WG_ROWS, BLOCK_K), gl.bfloat16, layout=A_LAYOUT)
    for i in range(K // BLOCK_K):
        stage = it % NUM_STAGES
        mbarrier.wait(full.index(stage), (it // NUM_STAGES) & 1)
        if WEIGHTS == BF16_T:  # the transposed view of this consumer's [BLOCK_K, 64] box
            a = w_smem.index(stage).slice(WG * BLOCK_K, BLOCK_K, dim=0).permute((1, 0))
        elif WEIGHTS == NVFP4_T:
            # Dequantized in natural column order into this step's buffer (the other one may still
            # feed the previous step's MMA, which the last wait left in flight), then its
            # transposed view. The stores reach the MMA's proxy through the fence, and every
            # warp's through the barrier.
            tile = _dequantize_natural(w_smem.index(stage).slice(WG * BLOCK_K, BLOCK_K, dim=0).load(T_WORDS),
                                       s_smem.index(stage).slice(WG * BLOCK_K, BLOCK_K, dim=0).load(T_SCALES),
                                       BLOCK_K, WG_ROWS, T_WORDS)
            a_buf = a_smem.index(it % 2).slice(WG * BLOCK_K, BLOCK_K, dim=0)
            a_buf.store(tile)
            fence_async_shared()
            gl.thread_barrier()
            a = a_buf.permute((1, 0))
        elif WEIGHTS == BF16:  # the weight tile from shared memory
            a = w_smem.index(stage).slice(WG * WG_ROWS, WG_ROWS, dim=0)
        else:  # dequantized into the register operand
            a = _dequantize(w_smem.index(stage).slice(WG * WG_ROWS, WG_ROWS, dim=0).load(WORDS),
                            s_smem.index(stage).slice(WG * WG_ROWS, WG_ROWS, dim=0).load(SCALES), WG_ROWS, BLOCK_K,
                            WORDS, A_LAYOUT)
        acc = warpgroup_mma(a, x_smem.index(stage).slice(0, BLOCK_M, dim=0).permute((1, 0)), acc, is_async=True)
        # The previous step's MMAs are done after the wait (a register operand lived until here):
        # its stage is free.
        if EXTRA_M > 0:
            if WEIGHTS != NVFP4:  # an operand in shared memory
                a2 = a
            else:
                a2 = gl.convert_layout(a, gl.DotOperandLayout(operand_index=0, parent=MMA2, k_width=2),
                                       assert_trivial=True)
            acc2 = warpgroup_mma(a2, _extra_rows(x_smem, x2_smem, stage, X2_IN_X, EXTRA_M).permute((1, 0)), acc2,
                                 is_async=True)
            acc, acc2, a_prev = warpgroup_mma_wait(2, deps=[acc, acc2, a_prev])
        else:
            acc, a_prev = warpgroup_mma_wait(1, deps=[acc, a_prev])
        mbarrier.arrive(empty.index((it + NUM_STAGES - 1) % NUM_STAGES), pred=i > 0)
        if WEIGHTS == NVFP4:
            a_prev = a
        it += 1
    acc = warpgroup_mma_wait(0, deps=[acc])
    if EXTRA_M > 0:
        acc2 = warpgroup_mma_wait(0, deps=[acc2])
    # The tile's last stage is free: the producer may fill it with the next tile's first step
    # while this epilogue runs.
    mbarrier.arrive(empty.index((it + NUM_STAGES - 1) % NUM_STAGES))
    _epilogue(acc, row_start, row_end, 0, expert, j, w_global_ptr, out_ptr, N_OUT, G, FUSED, WEIGHTS, BLOCK_M, MMA,
              STORE, WG)
    if EXTRA_M > 0:
        _epilogue(acc2, row_start, row_end, BLOCK_M, expert, j, w_global_ptr, out_ptr, N_OUT, G, FUSED, WEIGHTS,
                  EXTRA_M, MMA2, STORE, WG)
    return it


@gluon.jit
def _epilogue(acc, row_start, row_end, m0: gl.constexpr, expert, j, w_global_ptr, out_ptr, N_OUT: gl.constexpr,
              G: gl.constexpr, FUSED: gl.constexpr, WEIGHTS: gl.constexpr, N: gl.constexpr, MMA: gl.constexpr,
              STORE: gl.constexpr, WG: gl.constexpr):
    """Scales the ``[64, N]`` accumulator (weight rows x token rows ``m0 + [0, N)`` of the
    tile), applies SwiGLU (fused) and stores the token rows before ``row_end``."""
    if WEIGHTS == NVFP4 or WEIGHTS == NVFP4_T:
        r = gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, MMA))
        half_r = (r // 8) % 2 if FUSED else r * 0  # gate 0, up 1
        # The global scales (per expert, per half of the fused op) and the 2**7 the operand is short of.
        acc = acc * (gl.load(w_global_ptr + expert * G + half_r * (G - 1)) * 128.0)[:, None]
    if FUSED:
        # [slab, half, 8, N] -> gate and up [slab, 8, N]: the half is a register bit of each thread.
        gate, up = gl.split(gl.permute(gl.reshape(acc, (4, 2, 8, N)), (0, 2, 3, 1)))
        gate = gl.reshape(gate, (WG_ROWS // 2, N))
        up = gl.reshape(up, (WG_ROWS // 2, N))
        y = gate / (1.0 + gl.exp(-gate)) * up
        COLS: gl.constexpr = WG_ROWS // 2
    else:
        y = acc
        COLS: gl.constexpr = WG_ROWS
    y = gl.convert_layout(y.to(gl.bfloat16), STORE)
    cols_n = j * (2 * COLS) + WG * COLS + gl.arange(0, COLS, layout=gl.SliceLayout(1, STORE))
    local_m = m0 + gl.arange(0, N, layout=gl.SliceLayout(0, STORE))
    out_at = out_ptr + row_start.to(gl.int64) * N_OUT + (local_m[None, :] * N_OUT + cols_n[:, None])
    gl.store(out_at, y, mask=(row_start + local_m < row_end)[None, :])


def ws_layouts(*, block_k: int, fused: bool) -> dict:
    """Layout constexprs of :func:`_ws_kernel` for ``block_k``.

    ``WORDS``/``SCALES``: a consumer's 64 rows as ``gluon_probe_kernel.layouts`` places 128 over
    8 warps (a thread's words are exactly its registers of the MMA's A fragment), here over 4.
    ``T_WORDS``/``T_SCALES`` (transposed NVFP4): a consumer's ``block_k`` rows of 64 columns, a
    thread's two words and their one block scale, dequantized in natural order.
    ``W_COPY``/``S_COPY``: the producer warp's 16-byte (words) and 4-byte (scales) copies of both
    consumers' 128 rows."""
    g = block_k // 32
    warp = [[16, 0], [32, 0]]
    words = gl.DistributedLinearLayout(
        reg_bases=[[8, 0]] + [[0, b] for b in _bits(g)], lane_bases=[[0, g], [0, 2 * g], [1, 0], [2, 0], [4, 0]],
        warp_bases=warp, block_bases=[], shape=[WG_ROWS.value, block_k // 8])
    scales = gl.DistributedLinearLayout(
        reg_bases=[[8, 0]] + [[0, b] for b in _bits(g // 2)],
        lane_bases=[[0, g // 2], [0, g], [1, 0], [2, 0], [4, 0]], warp_bases=warp, block_bases=[],
        shape=[WG_ROWS.value, block_k // 16])
    t_words = gl.BlockedLayout(size_per_thread=[1, 2], threads_per_warp=[8, 4], warps_per_cta=[CONSUMER_WARPS.value, 1],
                               order=[1, 0])
    t_scales = gl.BlockedLayout(size_per_thread=[1, 1], threads_per_warp=[8, 4],
                                warps_per_cta=[CONSUMER_WARPS.value, 1], order=[1, 0])
    w_vectors = block_k // 32  # 16-byte vectors of words per row
    w_copy = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[32 // w_vectors, w_vectors],
                              warps_per_cta=[1, 1], order=[1, 0])
    s_vectors = block_k // 64  # 4-byte chunks of scales per row
    s_copy = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[32 // s_vectors, s_vectors],
                              warps_per_cta=[1, 1], order=[1, 0])
    x_smem = gl.NVMMASharedLayout(swizzle_byte_width=min(128, 2 * block_k), element_bitwidth=16, rank=2)
    plain = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    # Output columns (the weight rows) contiguous in a thread: 16-byte stores.
    cols = WG_ROWS.value // 2 if fused else WG_ROWS.value
    store = gl.BlockedLayout(size_per_thread=[8, 1], threads_per_warp=[cols // 8, 256 // cols],
                             warps_per_cta=[1, CONSUMER_WARPS.value], order=[0, 1])
    return dict(WORDS=words, SCALES=scales, T_WORDS=t_words, T_SCALES=t_scales, W_COPY=w_copy, S_COPY=s_copy,
                X_SMEM=x_smem, PLAIN_SMEM=plain, STORE=store)


@dataclasses.dataclass(frozen=True, kw_only=True)
class WsSpec(_Spec):
    """One launch of :func:`_ws_kernel`."""

    block_k: int = 64
    num_stages: int = 4
    #: setmaxnreg of each consumer warp group and of the producer's; the kernel's ``maxnreg``
    #: follows (3 warp groups share the 64K registers). The producer spills at 40.
    consumer_regs: int = 224
    producer_regs: int = 56
    #: bf16 weights ``[E, N_W, K]`` read as stored (``triton_lang.bf16_matmul``'s contract), not NVFP4.
    bf16: bool = False
    #: ``Op.MATMUL`` only: weights ``[E, K, N]`` read as their transpose (an input gradient).
    transpose_w: bool = False
    #: Programs to launch: 0 for one per work item (tile x output columns), else a persistent grid
    #: of this many (the H200's 132 SMs: one program each), every program walking its items.
    persistent: int = 0
    #: The extra 64 token rows of a 192-row tile in rows 128..191 of a 256-row stage of the token
    #: ring, as the 64-row tiles (correct on the H200) use rows 0..63 of the 128-row one, instead of
    #: a ring of their own (whose rows the H200 run of b2fdced left NaN at block_k 64; the cause is
    #: not found): one experiment, 8 KB more shared memory a stage at block_k 64.
    x2_in_x: bool = False
    #: With ``x2_in_x``: the extra rows' MMA over 128 rows (128..255 of the ring, those past the
    #: tile's 192 not stored) instead of 64: a diagnostic for the same NaN rows. If these rows come
    #: out right where the 64-row MMA's do not, the defect is in the N = 64 ``wgmma`` of a 128 + 64
    #: tile (the 64-row tiles' own N = 64 MMA is right); 64 more rows of MMA per 192-row tile.
    x2_as_128: bool = False
    kernel = _ws_kernel

    @property
    def block_n(self) -> int:
        return WG_ROWS.value if self.fused else 2 * WG_ROWS.value

    @property
    def num_programs(self) -> int:
        items = super().num_programs
        return min(self.persistent, items) if self.persistent else items

    @property
    def num_warps(self) -> int:
        return CONSUMER_WARPS.value

    @property
    def weights(self) -> int:
        if self.transpose_w and self.op is not Op.MATMUL:
            raise ValueError("transpose_w: Op.MATMUL only (an input gradient)")
        if self.transpose_w and not self.bf16 and self.block_k != WG_ROWS.value:
            raise ValueError(f"block_k: {self.block_k}, expected {WG_ROWS.value} for the NVFP4 input gradient (its "
                             "ring holds 2 x block_k rows of one consumer's 64 columns where the forward's holds "
                             "128 rows of block_k)")
        if self.transpose_w:
            return (BF16_T if self.bf16 else NVFP4_T).value
        return (BF16 if self.bf16 else NVFP4).value

    def compile_options(self) -> dict:
        # The default partition (consumer 0) gets what the others leave of maxnreg x 12 warps.
        return dict(super().compile_options(), maxnreg=(2 * self.consumer_regs + self.producer_regs) // 3)

    def constexprs(self) -> dict:
        if self.x2_as_128 and not self.x2_in_x:
            raise ValueError("x2_as_128: True, expected x2_in_x=True as well (the 128 rows are 128..255 of the ring)")
        return dict(super().constexprs(), NUM_ROWS=self.num_rows, NUM_EXPERTS=self.num_experts, WEIGHTS=self.weights,
                    CONSUMER_REGS=self.consumer_regs, PRODUCER_REGS=self.producer_regs, X2_IN_X=self.x2_in_x,
                    X2_ROWS=128 if self.x2_as_128 else 64,
                    **ws_layouts(block_k=self.block_k, fused=self.fused))


def ws_matmul(op: Op, x_mk, w, group_sizes_e, *, out=None, permuted: bool = False, transpose_w: bool = False,
              **tile):
    """``triton_lang.run``'s W4A16 contract on SM90 through :func:`_ws_kernel` (``x_mk`` in natural
    column order unless ``permuted``), or with ``transpose_w`` ``triton_lang.input_grad``'s (NVFP4
    ``w`` ``[E, K, N]`` read as its transpose, ``x_mk`` in natural order); ``tile``:
    :class:`WsSpec`'s fields."""
    from benchmarks.gluon_probe_kernel import _matmul  # noqa: PLC0415
    from pallas_kernels.grouped_matmul import triton_lang  # noqa: PLC0415

    if not (permuted or transpose_w):
        x_mk = triton_lang.permute_k(x_mk, tile.get("block_k", WsSpec.block_k))
    return _matmul(WsSpec, op, x_mk, w, group_sizes_e, out, transpose_w=transpose_w, **tile)


def ws_bf16_matmul(op: Op, x_mk, w, group_sizes_e, *, out=None, transpose_w: bool = False, **tile):
    """``triton_lang.bf16_matmul``'s contract (SM90) through :func:`_ws_kernel` with bf16 weights
    ``[E, N_W, K]``, or with ``transpose_w`` ``[E, K, N]`` read as their transpose; ``tile``:
    :class:`WsSpec`'s fields."""
    from benchmarks.gluon_probe_kernel import launch  # noqa: PLC0415

    m, k = x_mk.shape
    e = w.shape[0]
    n_w = w.shape[2 if transpose_w else 1]
    n_out = n_w // 2 if op is Op.GATE_UP_SWIGLU else n_w
    spec = WsSpec(op=op, num_rows=m, num_experts=e, k=k, n_out=n_out, bf16=True, transpose_w=transpose_w, **tile)
    if out is None:
        out = jnp.zeros((m, n_out), jnp.bfloat16)
    # One-element placeholders for the scales bf16 never reads keep one kernel signature.
    return launch(spec, group_sizes_e, x_mk, w, jnp.zeros((1,), jnp.uint8), jnp.ones((e, 1), jnp.float32), out)


__all__ = ["WsSpec", "ws_bf16_matmul", "ws_layouts", "ws_matmul"]
