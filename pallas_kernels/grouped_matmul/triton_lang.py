"""Triton-language NVFP4 grouped matmul kernels, called from JAX through ``jax_triton``.

Two paths from one kernel source, one tiling and one indexing (:func:`_kernel`):

* ``Mode.W4A4`` (compute capability >= 100): activations arrive quantized to NVFP4 (packed
  E2M1 codes along K, one E4M3 scale per 16 elements, one float32 global scale per row) and the
  inner product is ``tl.dot_scaled(..., "e2m1", ..., "e2m1")`` with float8e4nv scales, which
  triton 3.6 lowers to ``mma.sync ... kind::mxf4nvf4.block_scale.scale_vec::4`` on SM120 and
  ``tcgen05.mma ... kind::mxf4nvf4`` on SM100: the FP4 tensor cores, nothing dequantized.
* ``Mode.W4A16`` (below 100; triton 3.6 cannot compile that ``dot_scaled`` for SM90): bf16
  activations, the weight tile dequantized in registers by :data:`_WORD_TO_BF16_PTX`: each thread
  loads whole 32-bit words of packed codes (one vector load), places each code's bits straight
  into a bf16 (Marlin's trick: a shift, two masks and a shift per pair of values) and applies the
  block scale with one bf16x2 multiply per pair; each pair is one register of the MMA's A operand
  as it is (``x``'s columns are permuted to match, :func:`permute_k`), so nothing is re-paired.
  Then ``tl.dot`` (wgmma on SM90, A from registers). Triton's software pipeline (``num_stages``)
  keeps the next tiles' loads in flight while a tile is dequantized and multiplied.

Both are swap-AB: the weight tile is the MMA's M operand (``[block_n, block_k]``) and the token
rows its N operand, so 16 token rows still feed 128-row MMAs. Weights are read in ModelOpt's
layout as stored (packed along K, which is the packing ``dot_scaled`` is verified for on SM120).

Work split, as in the Pallas kernels: the rows of each expert are cut into tiles that never
straddle two experts (:func:`pallas_kernels.grouped_matmul.pallas_triton.tile_schedule`); a tile reads
one expert's weights; rows past the expert's end are masked on load and store. Offsets into the
weights are 64-bit (one Kimi K2 down projection is 7 MiB packed: expert 293 starts past 2**31
bytes), and so are row offsets.

Dimension letters: ``m`` rows, ``k`` reduction, ``n`` weight rows / output columns, ``e``
experts, ``f`` the fused op's output columns (``n = 2f``: gate rows, then up rows).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import assert_never

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

from pallas_kernels.grouped_matmul import (
    PALLAS, dequantized_copy, dequantized_copy_pays, dequantized_input_grad, grouped_matmul_weight_grad, pallas_triton,
)
from pallas_kernels.grouped_matmul import triton_launch, triton_padding_rows, triton_weight_grad, tuning
from pallas_kernels.grouped_matmul.expert_mlp import Backend, check_row_token, num_token_rows, token_rows
from pallas_kernels.grouped_matmul.tuning import Op, TileConfig, Variant

K_MULTIPLE = 64
_FLOAT8_E4M3FN = np.dtype(jnp.float8_e4m3fn)
#: The row-index operand of a launch that reads ``x`` in order (a placeholder, never read).
_NO_ROW_TOKENS = np.zeros((1,), np.int32)

#: log2 of the factor the W4A16 operand is short of ``value * scale`` (as in the Pallas kernels).
OPERAND_EXPONENT_DEFICIT = pallas_triton.OPERAND_EXPONENT_DEFICIT


class Mode(enum.Enum):
    """How the kernel multiplies: the FP4 tensor cores (``W4A4``), the FP8 ones with the weights
    placed into E4M3 and the activations quantized to E4M3 per row (``W4A8``, SM90, opt-in), bf16
    ones after dequantizing (``W4A16``), or bf16 weights as they are (``BF16``: the same tiling and
    schedule, nothing dequantized)."""

    W4A4 = "w4a4"
    W4A8 = "w4a8"
    W4A16 = "w4a16"
    BF16 = "bf16"


def mode_for(compute_capability: int) -> Mode:
    """W4A4 where the GPU has block-scaled FP4 MMA (SM100, SM120), else W4A16."""
    return Mode.W4A4 if compute_capability >= 100 else Mode.W4A16


_TileKey = tuple[Variant, Op]


def _tiles(decode_mm, decode_fused, prefill_mm, prefill_fused) -> dict[_TileKey, TileConfig]:
    return {(Variant.DECODE, Op.MATMUL): decode_mm, (Variant.DECODE, Op.GATE_UP_SWIGLU): decode_fused,
            (Variant.PREFILL, Op.MATMUL): prefill_mm, (Variant.PREFILL, Op.GATE_UP_SWIGLU): prefill_fused}


_d, _p = tuning.decode_tile, tuning.prefill_tile


# Per capability. SM90: the fastest of sweeps on an H200 at Kimi K2's real size (384 experts,
# benchmarks/native_sweep.py): decode at 256 and 2048 rows (results/native_h200/native_sweep.json;
# after the 15-instruction dequantization, native_sweep_9acbcda_dequant.json: the fused gate/up
# 928 and 2008 us with 4 stages against 951 and 2085 with 3; down 16x64x256 and 16x128x256 within 2%);
# prefill at 16384 and 65536 (native_sweep_4bd90d1_extra_rows.json: the fused gate/up 4.24 and
# 9.30 ms against 5.82 and 11.93 for the 128-row tile without extra rows or tail). SM100 and
# SM120 are sized to the chips (tcgen05 wants 128 MMA rows; SM120 has about 99 KB of shared
# memory per block) and cross-compiled in CI
# (tests/pallas_kernels/test_triton_lang_crosscompile.py), never run. SM80/SM89 take earlier SM90 shapes
# with fewer stages (mma.sync, less shared memory), not run.
NATIVE_TILES: dict[int, dict[_TileKey, TileConfig]] = {
    80: _tiles(_d(16, 128, 128, 4, 3), _d(16, 64, 128, 4, 3), _p(64, 128, 64, 8, 3), _p(64, 64, 64, 8, 3)),
    89: _tiles(_d(16, 128, 128, 4, 3), _d(16, 64, 128, 4, 3), _p(64, 128, 64, 8, 2), _p(64, 64, 64, 8, 2)),
    90: _tiles(_d(16, 64, 256, 4, 3), _d(16, 64, 256, 4, 4), _p(64, 128, 128, 4, 3),
               _p(128, 64, 128, 8, 4, extra_m=64, tail_m=64)),
    100: _tiles(_d(16, 128, 256, 4, 4), _d(16, 64, 256, 4, 3), _p(128, 128, 128, 8, 3),
                _p(128, 64, 128, 8, 3)),
    120: _tiles(_d(16, 128, 256, 4, 3), _d(16, 64, 256, 4, 3), _p(64, 128, 256, 4, 2), _p(64, 64, 256, 4, 2)),
}


# One group holding every row (a shared expert: every token in one expert), per capability:
# (at most this many rows, the tile of each op that takes them), narrowest first; an op without
# a tile there takes the table's. The decode tile would read each weight tile once per 16 rows,
# over few programs. Measured on an H200 at Kimi K2's shared expert: at 32 rows one 32-row tile
# over narrower weight tiles (results/native_h200/shared_expert_tiles.json: gate/up 26.5 us
# against 34.2 for the decode tile, down 13.7 against 17.0); at 256 rows the gate/up on
# 64-row x 32-column tiles (one_group_sweep.json: 61.8 us against 88.4 for the prefill tile;
# the down projection's many-rows tile was fastest there, 30.8 us); at 1024 rows the table's
# tiles were as fast or faster.
ONE_GROUP_TILES: dict[int, tuple[tuple[int, dict[Op, TileConfig]], ...]] = {
    90: ((32, {Op.GATE_UP_SWIGLU: _d(32, 32, 256, 4, 3), Op.MATMUL: _d(64, 64, 128, 4, 3)}),
         (256, {Op.GATE_UP_SWIGLU: _p(64, 32, 128, 4, 3)})),
}


def one_group_tile(op: Op, *, num_rows: int, compute_capability: int) -> TileConfig | None:
    """The :data:`ONE_GROUP_TILES` tile for one group of ``num_rows`` rows, or None (the table's)."""
    for max_rows, tiles in ONE_GROUP_TILES.get(compute_capability, ()):
        if num_rows <= max_rows:
            return tiles.get(op)
    return None


# Prefill with many rows per expert (at least MANY_ROWS_PER_EXPERT on average; Kimi K2 at 8192
# tokens has ~170): wider tiles whose extra rows share one dequantization, where the table's
# prefill tile is faster at fewer rows. SM90 down projection (native_sweep_4bd90d1_extra_rows.json):
# 4.77 ms against 5.80 for the table's tile at 65536 rows; 2.42 against 1.92 at 16384.
MANY_ROWS_PER_EXPERT = 128
MANY_ROWS_TILES: dict[int, dict[Op, TileConfig]] = {
    90: {Op.MATMUL: _p(128, 128, 128, 8, 3, extra_m=64, tail_m=64)},
}


# W4A16's down projection with at least WIDE_ROWS_PER_EXPERT rows per expert on average (the
# training shape, 48 experts x 32768 rows, ~680 per expert; Mixtral-style prefill; a shared expert
# of 512+ tokens): 256-row tiles (BF16_MANY_ROWS_TILES' shape, m64n256k16 MMAs), each weight tile
# dequantized once per 256 rows rather than once per 192; cross-compiled for SM90 without spills.
# On an H100 at 65536 rows of Kimi K2's down projection (results/prefill_h100/58c6118_many_rows/):
# 3.75 ms against MANY_ROWS_TILES' 4.00 at 96 experts (683 rows each), 3.43 against 3.83 at 24,
# 3.37 against 3.79 at 6. The gate/up's 256-row tile (256 x 64 x 64) was 3% slower at 96 experts
# and 1-3% faster at 24 and 6: not taken.
WIDE_ROWS_PER_EXPERT = 512
WIDE_TILES: dict[int, dict[Op, TileConfig]] = {
    90: {Op.MATMUL: _p(256, 128, 64, 8, 3)},
}


# Between decode and prefill: more than one decode row tile per expert on average, at most two
# (``tuning.choose_variant`` still says decode; Kimi K2 at 769-1536 tokens on one GPU). The decode
# tile then reads and dequantizes each weight tile twice (an expert's 16-row tiles); one 32-row
# tile per expert does it once, as a 32-row MMA. SM90 at 384 experts, CUPTI kernel time
# (results/native_h200/native_sweep_mid_rows.json): 8192 rows gate/up 2946 us against 3873 for the
# decode tile, down 1282 against 1972-2155; 12288 rows 4126 against 5097 and 1826 against 2737.
MID_TILES: dict[int, dict[Op, TileConfig]] = {
    90: {Op.GATE_UP_SWIGLU: _p(32, 64, 256, 4, 4), Op.MATMUL: _p(32, 128, 256, 4, 3)},
}


# The W4A16 input gradient (``dy @ W_e``, :func:`input_grad`): block_m rows, block_n output
# columns (the weight's K), block_k the reduction step (the weight's N); (fewer than, at least)
# INPUT_GRAD_MANY_ROWS rows per expert on average. SM90: the fastest of a sweep on an H200 at
# 48 experts (EP 8 of Kimi K2) of both projections (benchmarks/results/native_h200/
# input_grad_sweep.json): at 8192 rows (170 per expert) the 64-row tile (gate/up 2074 us, down
# 922; the 128-row tile 2337 and 1043), at 32768 rows (682 per expert) the 128-row one (7354
# and 3072 us; the 64-row tile 7485 and 3161). SM80/SM89 take SM90's shapes with mma.sync's
# stages, not run.
INPUT_GRAD_MANY_ROWS = 512
INPUT_GRAD_TILES: dict[int, tuple[TileConfig, TileConfig]] = {
    80: (_p(64, 128, 64, 4, 3), _p(64, 128, 64, 4, 3)),
    89: (_p(64, 128, 64, 4, 2), _p(64, 128, 64, 4, 2)),
    90: (_p(64, 128, 64, 4, 3), _p(128, 128, 64, 8, 3)),
}


# BF16 weights (``Mode.BF16``, :func:`bf16_matmul`): prefill tiles per capability and op, the
# NVFP4 prefill schedule (swap-AB, 128 + 64 rows and a 64-row tail, so ~170 rows per expert fill
# 192 MMA rows rather than two 128-row tiles' 256) with the weight tile read as it is. SM90: the
# fastest of a sweep on an H200 at Kimi K2's size, 65536 rows over 384 experts
# (results/prefill_h200/exploration_a480f3c_dirty/prefill_sweep.json): fused gate/up on 256 weight
# rows (block_n 128 per half) 7.70 ms, 500 TFLOP/s (128 weight rows: 8.13 ms; the Pallas kernel
# 9.95, torch._grouped_mm 7.98 without SwiGLU); down 4.09 ms, 470 TFLOP/s (Pallas 4.52, torch 4.15).
# Wider weight tiles re-read each token tile from L2 fewer times: at 128 rows ncu measured the L2
# at 92% of its throughput and the DRAM at 74%.
BF16_TILES: dict[int, dict[Op, TileConfig]] = {
    90: {Op.MATMUL: _p(128, 128, 64, 8, 4, extra_m=64, tail_m=64),
         Op.GATE_UP_SWIGLU: _p(128, 128, 64, 8, 3, extra_m=64, tail_m=64)},
}


# BF16 weights with many rows per expert (at least BF16_MANY_ROWS_PER_EXPERT on average: the
# training shape, 48 experts (Kimi K2 at EP 8) x 32768 rows, ~680 per expert), keyed by op and
# ``transpose_w`` (the input gradient): 256-row tiles, one weight tile read for twice the rows,
# where ~170 rows per expert would waste a third of them. SM90, the fastest of a sweep on an H100
# at the training shape (results/prefill_h100/8ee55c6_training_tiles/prefill_sweep.json): the
# fused gate/up 3.03 ms against 3.21 for BF16_TILES' tile, the down projection 1.56 against 1.72
# (torch._grouped_mm 1.49), the input gradients 3.09 and 1.50 ms against the Pallas kernel's 3.24
# and 1.58 (which BF16_BACKEND takes below).
BF16_MANY_ROWS_PER_EXPERT = 512
BF16_MANY_ROWS_TILES: dict[int, dict[tuple[Op, bool], TileConfig]] = {
    90: {(Op.MATMUL, False): _p(256, 128, 64, 8, 4), (Op.MATMUL, True): _p(256, 128, 64, 8, 3),
         (Op.GATE_UP_SWIGLU, False): _p(256, 64, 64, 8, 4)},
}


def bf16_many_rows_tile(op: Op, *, num_rows: int, num_experts: int, compute_capability: int,
                        transpose_w: bool = False) -> TileConfig | None:
    """The :data:`BF16_MANY_ROWS_TILES` tile for ``num_rows`` rows over ``num_experts``, or None
    (fewer than :data:`BF16_MANY_ROWS_PER_EXPERT` per expert on average, or none measured)."""
    if num_rows < BF16_MANY_ROWS_PER_EXPERT * num_experts:
        return None
    return BF16_MANY_ROWS_TILES.get(compute_capability, {}).get((op, transpose_w))


# W4A8 with many rows per expert (MANY_ROWS_PER_EXPERT), where it differs from W4A16's: the down
# projection on half the weight rows with 4 warps, so that two programs share an SM (W4A8 issues
# fewer instructions a weight than W4A16, and one 8-warp program left the SM idle under its
# placement). SM90, on an H100 at 384 experts x 65536 rows (results/fp8_probe_h100/8ee55c6_two_per_sm/):
# 3.25 ms against 3.48 for MANY_ROWS_TILES' tile (0.77 and 0.72 of the dense anchor); the gate/up on
# half its columns with 4 warps took the same time as on its own tile (6.21 ms), so it keeps that.
W4A8_MANY_ROWS_TILES: dict[int, dict[Op, TileConfig]] = {
    90: {Op.MATMUL: _p(128, 64, 128, 4, 3, extra_m=64, tail_m=64)},
}


def check_capability(compute_capability: int) -> None:
    if compute_capability not in NATIVE_TILES:
        raise ValueError(f"compute_capability: {compute_capability!r} has no native tile configurations; "
                         f"known: {sorted(NATIVE_TILES)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class NativeSpec:
    """Everything static about one launch (hashable: it keys the jit cache)."""

    mode: Mode
    op: Op
    tile: TileConfig
    num_rows: int
    k: int
    n_out: int
    block_k: int
    block_n: int
    max_tiles: int
    # Weight global scales per expert: 1, or 2 (gate's and up's; fused op only); bf16 weights 0
    # (as they are), or 1 or 2 for an exact bf16 copy of NVFP4 weights (bf16_matmul's global_scale).
    scale_groups: int = 1
    out_k_order: int = 0  # 0, or the block_k whose permute_k order the output's columns are written in.
    trans_w: bool = False  # BF16 only: the weight is stored [E, K, N_OUT] (an input gradient's W_e).
    gather_rows: int = 0  # W4A16 and BF16: 0, or x has this many rows and row m reads x[row_token[m]].

    @property
    def weight_rows(self) -> int:
        return 2 * self.n_out if self.op is Op.GATE_UP_SWIGLU else self.n_out

    @property
    def num_programs(self) -> int:
        return self.max_tiles * (self.n_out // self.block_n)

    def constexprs(self) -> dict:
        """The kernel's ``tl.constexpr`` arguments."""
        return dict(
            K=self.k, N_OUT=self.n_out, N_W=self.weight_rows, G=self.scale_groups,
            FUSED=self.op is Op.GATE_UP_SWIGLU, W4A4=self.mode is Mode.W4A4, W4A8=self.mode is Mode.W4A8,
            BF16=self.mode is Mode.BF16,
            TRANS_W=self.trans_w, NUM_TILES=self.max_tiles,
            BLOCK_M=self.tile.block_m, EXTRA_M=self.tile.extra_m, TAIL_M=self.tile.tail_m,
            BLOCK_N=self.block_n, BLOCK_K=self.block_k,
            GROUP_T=min(self.tile.group_t, self.max_tiles), NUM_STAGES=self.tile.num_stages,
            OUT_K_ORDER=self.out_k_order, GATHER_ROWS=self.gather_rows,
        )


# One packed word (bytes b0..b3, element 2i in the low nibble of byte i) in $8 and its block
# scale (bf16, ``scale * 2**119``) in $9; out: eight bf16 ``value * scale * 2**-7``, as four
# pairs ($0, $1) .. ($6, $7), each pair one 32-bit register that goes into the MMA as it is.
# A pair is two codes 16 bits apart, sign at bits 15 and 31, magnitude at 6..8 and 22..24
# (exponent bits 7..8, mantissa bit 6): ``value * 2**-126``; one bf16x2 FMA with -0
# (``mul.bf16x2`` needs SM90) then applies the scale exactly. In a code the sign sits 1 bit
# above the magnitude, in a bf16 7 bits above, so two words first set that distance for four
# codes each: v1 moves the signs of codes 0, 1, 4, 5 up by 6, v2 the magnitudes of codes 2, 3,
# 6, 7 down by 6 (the bits no pair reads are left as they fall). Then each pair is one shift of
# v1 or v2 and one mask: (v1 << 6) codes 0 and 4, (v1 << 2) 1 and 5, (v2 << 4) 2 and 6, v2 3
# and 7.
def _pair_ptx(word: str, shift: int, out_lo: str, out_hi: str) -> str:
    placed = (f"shl.b32 p, {word}, {shift};\nand.b32 p, p, 0x81c081c0;\n" if shift
              else f"and.b32 p, {word}, 0x81c081c0;\n")
    return placed + f"fma.rn.bf16x2 p, p, s2, z;\nmov.b32 {{{out_lo}, {out_hi}}}, p;\n"


_WORD_TO_BF16_PTX = tl.constexpr(
    "{\n.reg .b32 t, v1, v2, p, s2, z;\nmov.b32 s2, {$9, $9};\nmov.b32 z, 0x80008000;\n"
    "shl.b32 t, $8, 6;\nlop3.b32 v1, $8, t, 0x00770077, 0xe4;\n"
    "shr.b32 t, $8, 6;\nlop3.b32 v2, t, $8, 0x01dc01dc, 0xe4;\n"
    + _pair_ptx("v1", 6, "$0", "$1") + _pair_ptx("v1", 2, "$2", "$3") + _pair_ptx("v2", 4, "$4", "$5")
    + _pair_ptx("v2", 0, "$6", "$7") + "}\n")

#: The nibble (element ``8w + n`` of word ``w``) that asm output ``j`` holds: pairs
#: (lo b0, lo b2), (hi b0, hi b2), (lo b1, lo b3), (hi b1, hi b3).
_OUTPUT_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)


def permute_k(x_mk, block_k: int):
    """``x [M, K]`` -> its columns in the order of the dequantized W4A16 tiles (:func:`_dequantize_w4a16`).

    Within each ``block_k`` chunk, thread column ``c`` (of 4) of the MMA fragment reads ``G =
    block_k / 32`` consecutive packed words (``G * 4`` bytes in one load); the word ``w = c G + g``
    and output ``j = 2p + t`` (pair ``p = h + 2 g0``) of :data:`_WORD_TO_BF16_PTX` feed MMA column
    ``t + 2c + 8h + 16 g0 + 32 g``, which holds element ``8w + _OUTPUT_NIBBLE[j]`` of the chunk.
    """
    m, k = x_mk.shape
    g = block_k // 32
    # Element digits within a chunk (most significant first): c, g, t, g0, h.
    blocks = x_mk.reshape(m, k // block_k, 4, g, 2, 2, 2)
    return blocks.transpose(0, 1, 3, 5, 6, 2, 4).reshape(m, k)


@triton.jit
def _dequantize_w4a16(words_rw, scales_rb, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """int32 ``[bn, bk/8]`` packed words and uint8 ``[bn, bk/16]`` E4M3 bits -> bf16 ``[bn, bk]``
    holding ``value * scale * 2**-7`` exactly (at most 6 significant bits, far from both ends of
    bf16), its columns in :func:`permute_k`'s order.

    Each thread dequantizes whole words it loaded with one vector load, and each asm output pair
    is one MMA operand register: no byte gathering, no re-pairing.
    """
    # The E4M3 bits placed into a bf16 give scale * 2**-120; two exact power-of-two steps
    # (2**239 does not fit one bf16) make it scale * 2**119.
    bits = scales_rb.to(tl.uint16)
    placed = (((bits & 0x7F) << 4) | ((bits & 0x80) << 8)).to(tl.bfloat16, bitcast=True)
    scale_rb = placed * 1.7014118346046923e38 * 5.192296858534828e33  # 2**127, 2**112
    # Two words per block scale.
    scale_rw = tl.reshape(tl.join(scale_rb, scale_rb), (BLOCK_N, BLOCK_K // 8))
    o = tl.inline_asm_elementwise(_WORD_TO_BF16_PTX, "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [words_rw, scale_rw],
                                  dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
    # [n, w, t, h, g0] from pair p = h + 2 g0 and half t; w = c G + g.
    q = tl.join(tl.join(tl.join(o[0], o[1]), tl.join(o[2], o[3])), tl.join(tl.join(o[4], o[5]), tl.join(o[6], o[7])))
    q = tl.reshape(q, (BLOCK_N, 4, BLOCK_K // 32, 2, 2, 2))  # [n, c, g, t, h, g0]
    return tl.reshape(tl.permute(q, (0, 2, 5, 4, 1, 3)), (BLOCK_N, BLOCK_K))  # [n, g, g0, h, c, t]


# W4A8: one packed word ($2; byte i holds codes 2i (low nibble) and 2i + 1) and its block scale
# as f16x2 {s, s} times 2**3 ($6). The asm runs with pack=4 over four copies of each (a thread's
# register dimension, so the four elements of a pack are one word's): $3..$5 and $7..$9 are the
# same values, unread. Out: $0 = E4M3 bytes of codes 0, 2, 4, 6, $1 = of codes 1, 3, 5, 7, each
# ``code * scale * 2**-3`` rounded to E4M3, each one register of the MMA's A operand. A code's
# bits s e1 e0 m go to E4M3 bits 7 and 4..2 (``code * 2**-6`` exactly): l = the low nibbles so
# placed, h the high ones; then each 16-bit half converts to f16x2, is multiplied by the scale
# (exact: at most 6 significant bits) and converts back, rounding to E4M3's 4 (satfinite:
# ``6 * 448 * 2**-3 = 336`` fits).
def _e4m3_half_ptx(half: str, out: str) -> str:
    return f"cvt.rn.f16x2.e4m3x2 f, {half};\nmul.rn.f16x2 f, f, $6;\ncvt.rn.satfinite.e4m3x2.f16x2 {out}, f;\n"


_WORD_TO_E4M3_PTX = tl.constexpr(
    "{\n.reg .b32 t, u, f, l, h;\n.reg .b16 a, b, c, d;\n"
    "shl.b32 t, $2, 4;\nshl.b32 u, $2, 2;\nand.b32 u, u, 0x1C1C1C1C;\nand.b32 t, t, 0x80808080;\nor.b32 l, t, u;\n"
    "shr.b32 t, $2, 2;\nand.b32 t, t, 0x1C1C1C1C;\nlop3.b32 h, $2, 0x80808080, t, 0xEA;\n"
    "mov.b32 {a, b}, l;\n" + _e4m3_half_ptx("a", "c") + _e4m3_half_ptx("b", "d") + "mov.b32 $0, {c, d};\n"
    "mov.b32 {a, b}, h;\n" + _e4m3_half_ptx("a", "c") + _e4m3_half_ptx("b", "d") + "mov.b32 $1, {c, d};\n}\n")


def permute_k_w4a8(x_mk, block_k: int):
    """``x [M, K]`` -> its columns in the order of :func:`_dequantize_w4a8`'s tiles: within each
    ``block_k`` chunk, element ``8 w + 2 b + s`` (code ``2 b + s`` of word ``w = c G + g``, ``G =
    block_k / 32``, of thread column ``c``) goes to MMA column ``32 g + 16 s + 4 c + b``: the
    ``k32`` FP8 operand's fragment, where thread column ``c`` holds columns ``4 c .. 4 c + 3`` of
    each 16-column half ``s`` of slab ``g``."""
    m, k = x_mk.shape
    return x_mk.reshape(m, k // block_k, 4, block_k // 32, 4, 2).transpose(0, 1, 3, 5, 2, 4).reshape(m, k)


@triton.jit
def _dequantize_w4a8(words_rw, scales_rb, R: tl.constexpr, BLOCK_K: tl.constexpr):
    """int32 ``[R, bk/8]`` packed words and uint8 ``[R, bk/16]`` E4M3 block scales -> float8e4nv
    ``[R, bk]``, ``code * scale * 2**-3`` rounded to E4M3 (one rounding: a code has 2 significant
    bits and a scale 4), columns in :func:`permute_k_w4a8`'s order."""
    s16 = scales_rb.to(tl.float8e4nv, bitcast=True).to(tl.float16) * 8.0
    s32 = s16.to(tl.uint16, bitcast=True).to(tl.uint32)
    s2_rb = s32 | (s32 << 16)  # f16x2 {s, s}
    s2_rw = tl.reshape(tl.join(s2_rb, s2_rb), (R, BLOCK_K // 8))  # two words per block
    words4 = tl.join(tl.join(words_rw, words_rw), tl.join(words_rw, words_rw))  # [r, w, i1, i0]
    s4 = tl.join(tl.join(s2_rw, s2_rw), tl.join(s2_rw, s2_rw))
    lo, hi = tl.inline_asm_elementwise(_WORD_TO_E4M3_PTX, "=r,=r,r,r,r,r,r,r,r,r", [words4, s4],
                                       dtype=(tl.uint8, tl.uint8), is_pure=True, pack=4)
    # lo[r, w, i1, i0] is byte b = i0 + 2 i1 of $0: code 2b; hi: code 2b + 1.
    q = tl.reshape(tl.join(lo, hi), (R, 4, BLOCK_K // 32, 2, 2, 2))  # [r, c, g, i1, i0, s]
    q = tl.reshape(tl.permute(q, (0, 2, 5, 1, 3, 4)), (R, BLOCK_K))  # [r, g, s, c, i1, i0]
    return q.to(tl.float8e4nv, bitcast=True)


@triton.jit
def _program_tile(NUM_TILES: tl.constexpr, NUM_COLUMN_TILES: tl.constexpr, GROUP_T: tl.constexpr):
    """``(t, j)``: the row tile and the output column tile of this program. Programs visit
    ``GROUP_T`` row tiles (fewer in the last group) for one column tile before the next, so that
    the row tiles sharing a weight tile run back to back and re-read it from L2."""
    per_group: tl.constexpr = GROUP_T * NUM_COLUMN_TILES
    pid = tl.program_id(0)
    first_t = (pid // per_group) * GROUP_T
    rows_here = tl.minimum(NUM_TILES - first_t, GROUP_T)
    local = pid % per_group
    return first_t + local % rows_here, local // rows_here


@triton.jit
def _kernel(tile_expert_ptr, tile_start_ptr, tile_end_ptr, x_ptr, x_scale_ptr, x_global_ptr, row_token_ptr, w_ptr,
            w_scale_ptr, w_global_ptr, out_in_ptr, out_ptr, K: tl.constexpr, N_OUT: tl.constexpr, N_W: tl.constexpr,
            G: tl.constexpr, FUSED: tl.constexpr, W4A4: tl.constexpr,
            W4A8: tl.constexpr, BF16: tl.constexpr, TRANS_W: tl.constexpr,
            NUM_TILES: tl.constexpr, BLOCK_M: tl.constexpr, EXTRA_M: tl.constexpr, TAIL_M: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_T: tl.constexpr, NUM_STAGES: tl.constexpr,
            OUT_K_ORDER: tl.constexpr, GATHER_ROWS: tl.constexpr):
    """One output tile of ``BLOCK_M + EXTRA_M`` rows (one expert's) x ``BLOCK_N`` columns (see
    the module docstring).

    ``x_ptr``: W4A16 bf16 ``[M, K]``; W4A4 uint8 ``[M, K/2]`` with ``x_scale_ptr`` uint8 E4M3
    ``[M, K/16]`` and ``x_global_ptr`` float32 ``[M]`` (both unused by W4A16). ``w_ptr`` uint8
    ``[E, N_W, K/2]``, ``w_scale_ptr`` uint8 ``[E, N_W, K/16]``, ``w_global_ptr`` float32
    ``[E, G]`` (BF16: ``w_ptr`` bf16 ``[E, N_W, K]``, ``w_scale_ptr`` never read, and with
    ``G = 0`` neither is ``w_global_ptr``); ``out_ptr`` bf16 ``[M, N_OUT]`` (``out_in_ptr`` is
    the same buffer when the caller passed one to write into, else a placeholder: never read).
    ``GATHER_ROWS > 0``
    (W4A16, BF16): ``x_ptr`` is ``[GATHER_ROWS, K]`` and ``row_token_ptr`` int32 ``[M]`` names the
    row of it each output row reads (the layer's tokens, never copied into expert order); else
    ``row_token_ptr`` is a placeholder, never read.

    By the rows a tile holds (an expert's last tile holds fewer), the narrowest of three paths
    that covers them, so that the MMAs skip most padding rows: at most ``TAIL_M`` (0: no such
    path), at most ``BLOCK_M``, or (``EXTRA_M > 0``) up to ``BLOCK_M + EXTRA_M`` as two MMAs per
    K step against the same dequantized weights (paid once for both).
    """
    t, j = _program_tile(NUM_TILES, N_OUT // BLOCK_N, GROUP_T)
    row_start = tl.load(tile_start_ptr + t)
    row_end = tl.load(tile_end_ptr + t)
    if row_start < row_end:
        expert = tl.load(tile_expert_ptr + t).to(tl.int64)
        rows = row_end - row_start  # the expert's rows from here on (more than the tile holds, but in its last)
        if TAIL_M > 0:
            if rows <= TAIL_M:
                _tile(row_start, row_end, expert, j, x_ptr, x_scale_ptr, x_global_ptr, row_token_ptr, w_ptr,
                      w_scale_ptr, w_global_ptr, out_ptr, K, N_OUT, N_W, G, FUSED, W4A4, W4A8, BF16, TRANS_W, TAIL_M, 0,
                      BLOCK_N, BLOCK_K, NUM_STAGES, OUT_K_ORDER, GATHER_ROWS)
            else:
                _full_tile(rows, row_start, row_end, expert, j, x_ptr, x_scale_ptr, x_global_ptr, row_token_ptr,
                           w_ptr, w_scale_ptr, w_global_ptr, out_ptr, K, N_OUT, N_W, G,
                           FUSED, W4A4, W4A8, BF16, TRANS_W,
                           BLOCK_M, EXTRA_M, BLOCK_N, BLOCK_K, NUM_STAGES, OUT_K_ORDER, GATHER_ROWS)
        else:
            _full_tile(rows, row_start, row_end, expert, j, x_ptr, x_scale_ptr, x_global_ptr, row_token_ptr, w_ptr,
                       w_scale_ptr, w_global_ptr, out_ptr, K, N_OUT, N_W, G, FUSED, W4A4, W4A8, BF16, TRANS_W, BLOCK_M,
                       EXTRA_M, BLOCK_N, BLOCK_K, NUM_STAGES, OUT_K_ORDER, GATHER_ROWS)


@triton.jit
def _full_tile(rows, row_start, row_end, expert, j, x_ptr, x_scale_ptr, x_global_ptr, row_token_ptr, w_ptr,
               w_scale_ptr, w_global_ptr, out_ptr, K: tl.constexpr, N_OUT: tl.constexpr, N_W: tl.constexpr,
               G: tl.constexpr, FUSED: tl.constexpr, W4A4: tl.constexpr,
               W4A8: tl.constexpr, BF16: tl.constexpr, TRANS_W: tl.constexpr,
               BLOCK_M: tl.constexpr, EXTRA_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               NUM_STAGES: tl.constexpr, OUT_K_ORDER: tl.constexpr, GATHER_ROWS: tl.constexpr):
    """A tile of more than ``TAIL_M`` rows: ``BLOCK_M`` rows, or ``BLOCK_M + EXTRA_M`` if it holds more."""
    if EXTRA_M > 0:
        if rows > BLOCK_M:
            _tile(row_start, row_end, expert, j, x_ptr, x_scale_ptr, x_global_ptr, row_token_ptr, w_ptr, w_scale_ptr,
                  w_global_ptr, out_ptr, K, N_OUT, N_W, G, FUSED, W4A4, W4A8, BF16, TRANS_W, BLOCK_M, EXTRA_M, BLOCK_N,
                  BLOCK_K, NUM_STAGES, OUT_K_ORDER, GATHER_ROWS)
        else:
            _tile(row_start, row_end, expert, j, x_ptr, x_scale_ptr, x_global_ptr, row_token_ptr, w_ptr, w_scale_ptr,
                  w_global_ptr, out_ptr, K, N_OUT, N_W, G,
                  FUSED, W4A4, W4A8, BF16, TRANS_W, BLOCK_M, 0, BLOCK_N, BLOCK_K,
                  NUM_STAGES, OUT_K_ORDER, GATHER_ROWS)
    else:
        _tile(row_start, row_end, expert, j, x_ptr, x_scale_ptr, x_global_ptr, row_token_ptr, w_ptr, w_scale_ptr,
              w_global_ptr, out_ptr, K, N_OUT, N_W, G, FUSED, W4A4, W4A8, BF16, TRANS_W, BLOCK_M, 0, BLOCK_N, BLOCK_K,
              NUM_STAGES, OUT_K_ORDER, GATHER_ROWS)


@triton.jit
def _tile(row_start, row_end, expert, j, x_ptr, x_scale_ptr, x_global_ptr, row_token_ptr, w_ptr, w_scale_ptr,
          w_global_ptr, out_ptr, K: tl.constexpr, N_OUT: tl.constexpr, N_W: tl.constexpr, G: tl.constexpr,
          FUSED: tl.constexpr, W4A4: tl.constexpr, W4A8: tl.constexpr,
          BF16: tl.constexpr, TRANS_W: tl.constexpr, BLOCK_M: tl.constexpr,
          EXTRA_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
          OUT_K_ORDER: tl.constexpr, GATHER_ROWS: tl.constexpr):
    """Rows ``[row_start, min(row_end, row_start + BLOCK_M + EXTRA_M))`` of one expert x output
    tile ``j``; the ``EXTRA_M`` rows (if any) in a second accumulator."""
    # 64-bit scalar bases (one Kimi K2 down projection is 7 MiB packed: expert 293 starts
    # past 2**31 bytes), 32-bit offsets inside one expert's matrix and one row tile.
    first_row = row_start.to(tl.int64)
    local_m = tl.arange(0, BLOCK_M)
    row_ok_m = row_start + local_m < row_end
    # The fused op stacks gate's and up's tiles into one MMA operand of 2 * BLOCK_N rows:
    # one accumulator, split in the epilogue (two accumulators sharing one activation tile
    # broke triton 3.6's tensor-memory pass for SM100).
    R: tl.constexpr = 2 * BLOCK_N if FUSED else BLOCK_N
    r = tl.arange(0, R)
    half_r = r // BLOCK_N
    w_row_r = half_r * N_OUT + j * BLOCK_N + r % BLOCK_N
    if BF16:
        if TRANS_W:  # W_e stored [K, N_W]: the tile's weight rows are contiguous, its K steps strided
            w_at = w_ptr + expert * (K * N_W) + (tl.arange(0, BLOCK_K)[None, :] * N_W + w_row_r[:, None])
        else:
            w_at = w_ptr + expert * (N_W * K) + (w_row_r[:, None] * K + tl.arange(0, BLOCK_K)[None, :])
        ws_at = w_scale_ptr
    else:
        if W4A4:
            w_at = (w_ptr + expert * (N_W * (K // 2))
                    + (w_row_r[:, None] * (K // 2) + tl.arange(0, BLOCK_K // 2)[None, :]))
        else:  # whole 32-bit words (the buffer is 16-byte aligned and K // 2 a multiple of 32)
            w_at = (w_ptr.to(tl.pointer_type(tl.int32)) + expert * (N_W * (K // 8))
                    + (w_row_r[:, None] * (K // 8) + tl.arange(0, BLOCK_K // 8)[None, :]))
        ws_at = (w_scale_ptr + expert * (N_W * (K // 16))
                 + (w_row_r[:, None] * (K // 16) + tl.arange(0, BLOCK_K // 16)[None, :]))
    acc = tl.zeros((R, BLOCK_M), tl.float32)
    x_at, xs_at, xg_at = _row_pointers(x_ptr, x_scale_ptr, x_global_ptr, row_token_ptr, first_row, local_m, row_ok_m,
                                       K, BLOCK_K, W4A4, W4A8, GATHER_ROWS)
    if EXTRA_M > 0:
        local_x = BLOCK_M + tl.arange(0, EXTRA_M)
        row_ok_x = row_start + local_x < row_end
        acc2 = tl.zeros((R, EXTRA_M), tl.float32)
        x2_at, xs2_at, xg2_at = _row_pointers(x_ptr, x_scale_ptr, x_global_ptr, row_token_ptr, first_row, local_x,
                                              row_ok_x, K, BLOCK_K, W4A4, W4A8, GATHER_ROWS)
    for i in tl.range(0, K // BLOCK_K, num_stages=NUM_STAGES, warp_specialize=False):
        if W4A4:
            w_rj = tl.load(w_at + i * (BLOCK_K // 2))
            s_rb = tl.load(ws_at + i * (BLOCK_K // 16))
            x_mj = tl.load(x_at + i * (BLOCK_K // 2), mask=row_ok_m[:, None], other=0)
            # A masked row's scales read as 0: its products vanish whatever its codes.
            xs_mb = tl.load(xs_at + i * (BLOCK_K // 16), mask=row_ok_m[:, None], other=0)
            acc = tl.dot_scaled(w_rj, s_rb.to(tl.float8e4nv, bitcast=True), "e2m1", tl.trans(x_mj),
                                xs_mb.to(tl.float8e4nv, bitcast=True), "e2m1", acc)
            if EXTRA_M > 0:
                x2_mj = tl.load(x2_at + i * (BLOCK_K // 2), mask=row_ok_x[:, None], other=0)
                xs2_mb = tl.load(xs2_at + i * (BLOCK_K // 16), mask=row_ok_x[:, None], other=0)
                acc2 = tl.dot_scaled(w_rj, s_rb.to(tl.float8e4nv, bitcast=True), "e2m1", tl.trans(x2_mj),
                                     xs2_mb.to(tl.float8e4nv, bitcast=True), "e2m1", acc2)
        else:
            x_mk = tl.load(x_at + i * BLOCK_K, mask=row_ok_m[:, None], other=0.0)
            if BF16:
                if TRANS_W:
                    w_rk = tl.load(w_at + i * (BLOCK_K * N_W))
                else:
                    w_rk = tl.load(w_at + i * BLOCK_K)
            else:
                w_rw = tl.load(w_at + i * (BLOCK_K // 8))
                s_rb = tl.load(ws_at + i * (BLOCK_K // 16))
                if W4A8:
                    w_rk = _dequantize_w4a8(w_rw, s_rb, R, BLOCK_K)
                else:
                    w_rk = _dequantize_w4a16(w_rw, s_rb, R, BLOCK_K)
            acc = tl.dot(w_rk, tl.trans(x_mk), acc)
            if EXTRA_M > 0:
                x2_mk = tl.load(x2_at + i * BLOCK_K, mask=row_ok_x[:, None], other=0.0)
                acc2 = tl.dot(w_rk, tl.trans(x2_mk), acc2)
    _epilogue(acc, local_m, row_ok_m, first_row, expert, j, half_r, xg_at, w_global_ptr, out_ptr, N_OUT, G,
              FUSED, W4A4, W4A8, BF16, BLOCK_M, BLOCK_N, OUT_K_ORDER)
    if EXTRA_M > 0:
        _epilogue(acc2, local_x, row_ok_x, first_row, expert, j, half_r, xg2_at, w_global_ptr, out_ptr, N_OUT,
                  G, FUSED, W4A4, W4A8, BF16, EXTRA_M, BLOCK_N, OUT_K_ORDER)


@triton.jit
def _row_pointers(x_ptr, x_scale_ptr, x_global_ptr, row_token_ptr, first_row, local, row_ok, K: tl.constexpr,
                  BLOCK_K: tl.constexpr, W4A4: tl.constexpr, W4A8: tl.constexpr, GATHER_ROWS: tl.constexpr):
    """Rows ``first_row + local``: their first K step's activation pointers (W4A4 the packed codes
    and their block scales; W4A16, W4A8 and BF16 the values, ``x_scale_ptr`` as it is, never
    read) and their global scales' (W4A4, W4A8; else ``x_global_ptr`` as it is, never read).
    With ``GATHER_ROWS`` (W4A16, W4A8, BF16) row ``m`` is row ``row_token[m]`` of an ``x`` of
    ``GATHER_ROWS`` rows, clamped into it, and so is its scale; rows ``row_ok`` does not mark read
    no index."""
    if GATHER_ROWS > 0:
        token = tl.load(row_token_ptr + first_row + local, mask=row_ok, other=0)
        token = tl.minimum(tl.maximum(token, 0), GATHER_ROWS - 1).to(tl.int64)
        x_at = x_ptr + (token[:, None] * K + tl.arange(0, BLOCK_K)[None, :])
        xs_at = x_scale_ptr
        xg_at = x_global_ptr + token if W4A8 else x_global_ptr
    elif W4A4:
        x_at = x_ptr + first_row * (K // 2) + (local[:, None] * (K // 2) + tl.arange(0, BLOCK_K // 2)[None, :])
        xs_at = (x_scale_ptr + first_row * (K // 16)
                 + (local[:, None] * (K // 16) + tl.arange(0, BLOCK_K // 16)[None, :]))
        xg_at = x_global_ptr + first_row + local
    else:
        x_at = x_ptr + first_row * K + (local[:, None] * K + tl.arange(0, BLOCK_K)[None, :])
        xs_at = x_scale_ptr
        xg_at = x_global_ptr + first_row + local if W4A8 else x_global_ptr
    return x_at, xs_at, xg_at


@triton.jit
def _epilogue(acc, local_m, row_ok_m, first_row, expert, j, half_r, xg_at, w_global_ptr, out_ptr,
              N_OUT: tl.constexpr, G: tl.constexpr, FUSED: tl.constexpr, W4A4: tl.constexpr, W4A8: tl.constexpr,
              BF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, OUT_K_ORDER: tl.constexpr):
    """Scales the ``[R, BLOCK_M]`` accumulator of rows ``first_row + local_m`` (W4A4, W4A8: by
    their global scales at ``xg_at``, :func:`_row_pointers`), applies SwiGLU (fused op) and stores
    the rows ``row_ok_m`` marks, columns in :func:`permute_k`'s order for ``block_k = OUT_K_ORDER``
    if that is not 0."""
    # The global scales, in fp32 on the accumulator: the weight's per expert (per half),
    # W4A4 also each row's activation scale, W4A8 each row's and the 2**3 its weight operand is
    # short of, W4A16 the 2**7 its operand is short of. BF16 weights carry none (G = 0) unless
    # they are NVFP4 weights' exact copy, whose global scales then apply as W4A16's do.
    if G > 0:
        w_global_r = tl.load(w_global_ptr + expert * G + half_r * (G - 1))
        if BF16:
            acc = acc * w_global_r[:, None]
        else:
            if W4A4:
                row_factor = tl.load(xg_at, mask=row_ok_m, other=0.0)
            elif W4A8:
                row_factor = tl.load(xg_at, mask=row_ok_m, other=0.0) * 8.0
            else:
                row_factor = tl.full((BLOCK_M,), 128.0, tl.float32)
            acc = acc * w_global_r[:, None] * row_factor[None, :]
    if FUSED:
        gate, up = tl.split(tl.permute(tl.reshape(acc, (2, BLOCK_N, BLOCK_M)), (1, 2, 0)))
        y = gate / (1.0 + tl.exp(-gate)) * up
    else:
        y = acc
    cols_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
    if OUT_K_ORDER > 0:  # where permute_k(out, OUT_K_ORDER) puts each column
        o = cols_n % OUT_K_ORDER
        cols_n = _k_order(cols_n - o, o, OUT_K_ORDER, False)
    out_at = out_ptr + first_row * N_OUT + (local_m[None, :] * N_OUT + cols_n[:, None])
    tl.store(out_at, y.to(tl.bfloat16), mask=row_ok_m[None, :])


@triton.jit
def _k_order(chunk_start, i, BLOCK_K: tl.constexpr, INVERSE: tl.constexpr):
    """:func:`permute_k`'s column order within one ``BLOCK_K`` chunk as index arithmetic:
    ``chunk_start`` plus the position of the element at offset ``i``; with ``INVERSE``, plus the
    element at position ``i``. An element's digits (most significant first) are c (4 values),
    g (``BLOCK_K / 32``), t, g0, h (2 each); its position's are g, g0, h, c, t."""
    G: tl.constexpr = BLOCK_K // 32
    if INVERSE:
        c, g, t, g0, h = (i // 2) % 4, i // 32, i % 2, (i // 16) % 2, (i // 8) % 2
        return chunk_start + c * (8 * G) + g * 8 + t * 4 + g0 * 2 + h
    else:
        c, g, t, g0, h = i // (8 * G), (i // 8) % G, (i // 4) % 2, (i // 2) % 2, i % 2
        return chunk_start + (32 * g + 16 * g0 + 8 * h + 2 * c + t)


@triton.jit
def _input_grad_kernel(tile_expert_ptr, tile_start_ptr, tile_end_ptr, dy_ptr, w_ptr, w_scale_ptr, w_global_ptr,
                       out_in_ptr, out_ptr, N: tl.constexpr, K: tl.constexpr,
                       NUM_TILES: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_O: tl.constexpr, BLOCK_R: tl.constexpr, GROUP_T: tl.constexpr,
                       NUM_STAGES: tl.constexpr):
    """W4A16 input gradient: ``out[m, :] = dy[m, :] @ W_e`` for the rows ``m`` of expert ``e``, one
    tile of ``BLOCK_M`` rows x ``BLOCK_O`` output columns (the weight's K) per program, reducing
    over the weight's N rows ``BLOCK_R`` at a time.

    ``dy_ptr`` bf16 ``[M, N]``; ``w_ptr`` uint8 ``[E, N, K/2]`` read as whole 32-bit words,
    ``w_scale_ptr`` uint8 ``[E, N, K/16]`` (E4M3 bits), ``w_global_ptr`` float32 ``[E]``;
    ``out_ptr`` bf16 ``[M, K]``, rows past an expert's end left unwritten (``out_in_ptr`` is the
    same buffer when the caller passed one to write into, else a placeholder: never read). The weight tile is
    dequantized as the forward kernels do (:func:`_dequantize_w4a16`), so its columns come in
    :func:`permute_k`'s order; each output column is stored where it belongs instead.
    """
    t, j = _program_tile(NUM_TILES, K // BLOCK_O, GROUP_T)
    row_start = tl.load(tile_start_ptr + t)
    row_end = tl.load(tile_end_ptr + t)
    if row_start < row_end:
        # 64-bit scalar bases, 32-bit offsets inside one expert's matrix and one row tile.
        expert = tl.load(tile_expert_ptr + t).to(tl.int64)
        first_row = row_start.to(tl.int64)
        local_m = tl.arange(0, BLOCK_M)
        row_ok_m = row_start + local_m < row_end
        n_r = tl.arange(0, BLOCK_R)
        w_at = (w_ptr.to(tl.pointer_type(tl.int32)) + expert * (N * (K // 8))
                + (n_r[:, None] * (K // 8) + (j * (BLOCK_O // 8) + tl.arange(0, BLOCK_O // 8))[None, :]))
        ws_at = (w_scale_ptr + expert * (N * (K // 16))
                 + (n_r[:, None] * (K // 16) + (j * (BLOCK_O // 16) + tl.arange(0, BLOCK_O // 16))[None, :]))
        dy_at = dy_ptr + first_row * N + (local_m[:, None] * N + n_r[None, :])
        acc = tl.zeros((BLOCK_M, BLOCK_O), tl.float32)
        for i in tl.range(0, N // BLOCK_R, num_stages=NUM_STAGES, warp_specialize=False):
            dy_mr = tl.load(dy_at + i * BLOCK_R, mask=row_ok_m[:, None], other=0.0)
            w_rw = tl.load(w_at + i * (BLOCK_R * (K // 8)))
            s_rb = tl.load(ws_at + i * (BLOCK_R * (K // 16)))
            acc = tl.dot(dy_mr, _dequantize_w4a16(w_rw, s_rb, BLOCK_R, BLOCK_O), acc)
        # The weight's global scale, and the 2**7 the dequantized operand is short of.
        acc = acc * (tl.load(w_global_ptr + expert) * 128.0)
        # Tile column p holds weight column e(p) of this tile (permute_k's order, inverted).
        cols_o = _k_order(j * BLOCK_O, tl.arange(0, BLOCK_O), BLOCK_O, True)
        out_at = out_ptr + first_row * K + (local_m[:, None] * K + cols_o[None, :])
        tl.store(out_at, acc.to(tl.bfloat16), mask=row_ok_m[:, None])


def make_spec(op: Op, mode: Mode, *, num_rows: int, num_experts: int, k: int, n_out: int, scale_groups: int,
              compute_capability: int, tile: TileConfig | None = None, out_k_order: int = 0,
              trans_w: bool = False, gather_rows: int = 0) -> NativeSpec:
    """The launch for these shapes: the capability's tile for the variant the row count implies
    (:func:`one_group_tile` for one group, W4A16's :data:`WIDE_TILES` from
    :data:`WIDE_ROWS_PER_EXPERT` rows per expert, :data:`MANY_ROWS_TILES` from
    :data:`MANY_ROWS_PER_EXPERT` (W4A8: :data:`W4A8_MANY_ROWS_TILES` first),
    :data:`MID_TILES` between one and two decode row tiles per expert; bf16 weights:
    :data:`BF16_TILES`, or :func:`bf16_many_rows_tile`)."""
    check_capability(compute_capability)
    groups = (0, 1, 2) if mode is Mode.BF16 else (1, 2)
    if scale_groups not in groups or (scale_groups == 2 and op is not Op.GATE_UP_SWIGLU):
        raise ValueError(f"scale_groups: {scale_groups!r}, expected one of {groups} ({mode.name} {op.value}; 2 only "
                         "for the fused gate/up)")
    if mode is Mode.BF16 and tile is None:
        if compute_capability not in BF16_TILES:
            raise ValueError(f"compute_capability: {compute_capability!r} has no bf16 tile configurations; known: "
                             f"{sorted(BF16_TILES)}")
        tile = (bf16_many_rows_tile(op, num_rows=num_rows, num_experts=num_experts,
                                    compute_capability=compute_capability, transpose_w=trans_w)
                or BF16_TILES[compute_capability][op])
    if tile is None and num_experts == 1:
        tile = one_group_tile(op, num_rows=num_rows, compute_capability=compute_capability)
    many_rows = MANY_ROWS_TILES.get(compute_capability, {})
    if mode is Mode.W4A8:
        many_rows = many_rows | W4A8_MANY_ROWS_TILES.get(compute_capability, {})
    wide = WIDE_TILES.get(compute_capability, {}) if mode is Mode.W4A16 else {}
    if tile is None and num_rows >= WIDE_ROWS_PER_EXPERT * num_experts and op in wide:
        tile = wide[op]
    elif tile is None and num_rows >= MANY_ROWS_PER_EXPERT * num_experts and op in many_rows:
        tile = many_rows[op]
    elif tile is None:
        variant = tuning.choose_variant(num_rows=num_rows, num_experts=num_experts,
                                        compute_capability=compute_capability)
        tile = NATIVE_TILES[compute_capability][(variant, op)]
        mid = MID_TILES.get(compute_capability, {}).get(op)
        if variant is Variant.DECODE and mid is not None and num_rows > tile.block_m * num_experts:
            tile = mid
    block_k = tuning.fit_block(tile.block_k, k, K_MULTIPLE)
    # No more pipeline stages than K steps: a layer with K = 64 gave 5% error on an H200 with the
    # 4-stage prefill tile (one K step) while every longer K matched; one stage per step is what
    # such a short loop can use anyway.
    tile = dataclasses.replace(tile, num_stages=max(1, min(tile.num_stages, k // block_k)))
    if tile.extra_m and compute_capability == 100:
        raise ValueError(f"tile.extra_m: {tile.extra_m}, expected 0 on SM100 (a second accumulator sharing one "
                         "operand broke triton 3.6's tensor-memory pass there)")
    return NativeSpec(
        mode=mode, op=op, tile=tile, num_rows=num_rows, k=k, n_out=n_out,
        block_k=block_k, block_n=tuning.fit_block(tile.block_n, n_out, 16),
        max_tiles=pallas_triton.max_tiles(num_rows, num_experts, tile.rows_per_tile), scale_groups=scale_groups,
        out_k_order=out_k_order, trans_w=trans_w, gather_rows=gather_rows,
    )


#: W4A8's capabilities: its MMA is Hopper's ``wgmma ... .e4m3`` with the weights in registers.
W4A8_CAPABILITIES = frozenset({90})
#: E4M3's largest finite value: a row's amax maps to it.
FP8_MAX = 448.0


def quantize_fp8_rows(x_mk, block_k: int) -> tuple[jax.Array, jax.Array]:
    """W4A8's activations: ``x [M, K]`` quantized per row to E4M3 against its own amax.

    Returns ``(values_mk, scale_m)``: float8_e4m3fn ``[M, K]``, round to nearest even of ``x *
    (448 / amax(|row|))`` (float32) with the columns in :func:`permute_k_w4a8`'s order for
    ``block_k``, and float32 ``[M]`` ``scale = amax(|row|) * float32(1 / 448)`` (both 1 for a row of
    zeros), so that a row is ``values * scale`` within E4M3's rounding (2**-4 of each value,
    relative). Written as XLA computes it (it turns a division by a constant into this product),
    so that every backend rounds alike. A row with a non-finite value gets a non-finite scale and
    NaN values: its own outputs only.
    """
    x_mk = x_mk.astype(jnp.float32)
    amax_m = jnp.max(jnp.abs(x_mk), axis=1)
    zero_m = amax_m == 0
    inverse_m = FP8_MAX / jnp.where(zero_m, 1.0, amax_m)  # a zero row's values stay zero whatever it is
    scale_m = jnp.where(zero_m, 1.0, amax_m * np.float32(1 / FP8_MAX))
    values_mk = jnp.clip(x_mk * inverse_m[:, None], -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return permute_k_w4a8(values_mk, block_k), scale_m


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NVFP4Rows:
    """Activations quantized to NVFP4 for the W4A4 kernels, one global scale per row.

    Attributes:
      packed: uint8 ``[M, K/2]``, element ``2i`` in the low nibble of byte ``i``.
      scales: float8_e4m3fn ``[M, K/16]``.
      global_scale: float32 ``[M]``.
    """

    packed: jax.Array
    scales: jax.Array
    global_scale: jax.Array


def _check_rows(x, mode: Mode, name: str, columns: str = "K") -> tuple[int, int]:
    """Validates the activations for ``mode``; returns ``(M, C)``, C their reduced dimension
    (``columns``: ``K`` for the forward, ``N`` for the input gradient's ``dy``)."""
    match mode:
        case Mode.W4A16 | Mode.W4A8 | Mode.BF16:
            if not hasattr(x, "dtype") or np.dtype(x.dtype) != np.dtype(jnp.bfloat16) or x.ndim != 2:
                found = f"{x.dtype}{list(x.shape)}" if hasattr(x, "dtype") else type(x).__name__
                raise ValueError(f"{name}: {found}, expected bfloat16 [M, {columns}] ({mode.name})")
            m, k = x.shape
        case Mode.W4A4:
            if not isinstance(x, NVFP4Rows):
                raise ValueError(f"{name}: {type(x).__name__}, expected NVFP4Rows (W4A4 quantized activations)")
            m, k = x.packed.shape[0], 2 * x.packed.shape[-1]
            expected = {"packed": (np.uint8, (m, k // 2)), "scales": (_FLOAT8_E4M3FN, (m, k // 16)),
                        "global_scale": (np.float32, (m,))}
            for field, (dtype, shape) in expected.items():
                a = getattr(x, field)
                if np.dtype(a.dtype) != np.dtype(dtype) or tuple(a.shape) != shape:
                    raise ValueError(f"{name}.{field}: {a.dtype}{list(a.shape)}, expected {np.dtype(dtype).name} "
                                     f"{list(shape)}")
        case _:
            assert_never(mode)
    if k % K_MULTIPLE or k == 0:
        raise ValueError(f"{name}: {columns}={k}, expected a positive multiple of {K_MULTIPLE}")
    return m, k


def _check_group_sizes(group_sizes_e) -> int:
    """Validates ``group_sizes_e``; returns E."""
    if np.dtype(group_sizes_e.dtype) != np.int32 or group_sizes_e.ndim != 1 or group_sizes_e.shape[0] == 0:
        raise ValueError(f"group_sizes_e: {group_sizes_e.dtype}{list(group_sizes_e.shape)}, expected int32 [E], E >= 1")
    return group_sizes_e.shape[0]


def _check_weights(w, name: str, op: Op, num_experts: int, *, k: int | None = None, n: int | None = None,
                   rows_name: str = "x") -> tuple[int, int, int]:
    """Validates an NVFP4 weight ``[E, N, K]`` against the activations ``rows_name``, which fix
    its K (``k``: the forward multiplies by ``W_e^T``) or its N (``n``: the input gradient
    multiplies by ``W_e``); the other dimension is the weight's own. Returns ``(N, K, G)``, G the
    global scales per expert: 1, or 2 (gate's and up's) for the fused op."""
    if not all(hasattr(w, attr) for attr in ("packed", "scales", "global_scale")):
        raise ValueError(f"{name}: {type(w).__name__}, expected an NVFP4 tensor (.packed, .scales, .global_scale); "
                         "the native kernels take NVFP4 weights only")
    if w.packed.ndim != 3:
        raise ValueError(f"{name}.packed: {w.packed.dtype}{list(w.packed.shape)}, expected uint8 [E={num_experts} "
                         "(group_sizes_e), N, K/2]")
    n_w = w.packed.shape[1] if n is None else n
    k_w = 2 * w.packed.shape[2] if k is None else k
    fixed = "" if k is None and n is None else f", K={k} ({rows_name})" if n is None else f", N={n} ({rows_name})"
    expected = {"packed": (np.uint8, (num_experts, n_w, k_w // 2)),
                "scales": (_FLOAT8_E4M3FN, (num_experts, n_w, k_w // 16))}
    for field, (dtype, shape) in expected.items():
        a = getattr(w, field)
        if np.dtype(a.dtype) != np.dtype(dtype) or tuple(a.shape) != shape:
            raise ValueError(f"{name}.{field}: {a.dtype}{list(a.shape)}, expected {np.dtype(dtype).name} "
                             f"[{', '.join(map(str, shape))}] for E={num_experts} (group_sizes_e){fixed}")
    scale_shapes = [[num_experts]] + ([[num_experts, 2]] if op is Op.GATE_UP_SWIGLU else [])
    g = w.global_scale
    if np.dtype(g.dtype) != np.float32 or list(g.shape) not in scale_shapes:
        folded = f"; gate's and up's own global scales are folded into {rows_name} instead" if n is not None else ""
        raise ValueError(f"{name}.global_scale: {g.dtype}{list(g.shape)}, expected float32 "
                         f"{' or '.join(map(str, scale_shapes))}{folded}")
    return n_w, k_w, 1 if g.ndim == 1 else 2


def run(op: Op, x, w, group_sizes_e, *, compute_capability: int, mode: Mode | None = None,
        tile: TileConfig | None = None, out=None, out_k_order: int = 0, x_k_order: int = 0,
        row_token_m=None) -> jax.Array:
    """One native kernel: ``op`` on the rows of ``x`` with NVFP4 weights ``w``.

    Args:
      op: ``Op.MATMUL`` (``w`` ``[E, N, K]``, out bf16 ``[M, N]``) or ``Op.GATE_UP_SWIGLU``
        (``w`` ``[E, 2F, K]``, gate rows then up rows, global scale ``[E]`` or ``[E, 2]``; out
        bf16 ``[M, F]``).
      x: bf16 ``[M, K]`` for W4A16 and W4A8 (which quantizes it per row,
        :func:`quantize_fp8_rows`), :class:`NVFP4Rows` for W4A4; rows sorted by expert. With
        ``row_token_m``, bf16 ``[T, K]`` in any order.
      w: NVFP4 weights in ModelOpt's layout (``.packed`` uint8 ``[E, N, K/2]``, ``.scales``
        float8_e4m3fn ``[E, N, K/16]``, ``.global_scale`` float32).
      group_sizes_e: int32 ``[E]``; rows past the sum are padding, left unwritten.
      compute_capability: picks the tiles and, unless ``mode`` is given, the mode (:func:`mode_for`).
      mode: W4A4 needs capability >= 100 (triton 3.6 compiles ``dot_scaled`` e2m1 for no other);
        W4A8 (never :func:`mode_for`'s: opt-in) one of :data:`W4A8_CAPABILITIES`.
      tile: overrides the tile table (benchmark sweeps).
      out: optional bf16 ``[M, n_out]`` buffer the output is written into (aliased); rows the
        kernel does not write keep its values.
      out_k_order: W4A16 only; 0, or the ``block_k`` of a W4A16 kernel that reads this output
        next (:func:`k_order`): the columns are written in its :func:`permute_k` order, so that
        it takes them as they are (``x_k_order``) instead of permuting them in a pass of its own.
      x_k_order: W4A16 only; 0, or ``x``'s columns are already in :func:`permute_k` order for
        ``block_k = x_k_order``, which must be this launch's (:func:`k_order`).
      row_token_m: W4A16 and W4A8 (bf16: :func:`bf16_matmul`'s); None, or int32 ``[M]``: row ``m`` of the product is row
        ``row_token_m[m]`` of ``x`` (values outside ``[0, T)`` are clamped into it), read by the
        kernel where it is: the ``[M, K]`` copy of ``x`` in expert order is never written.

    Raises:
      ValueError: naming the argument, for a bad shape, dtype, capability or mode.
    """
    check_capability(compute_capability)
    mode = mode_for(compute_capability) if mode is None else mode
    if mode is Mode.BF16:
        raise ValueError("mode: BF16, expected W4A4 or W4A16 (bf16 weights go through bf16_matmul)")
    if mode is Mode.W4A4 and compute_capability < 100:
        raise ValueError(f"mode: W4A4 on compute capability {compute_capability}, expected >= 100 (block-scaled "
                         "FP4 MMA: SM100, SM120)")
    if mode is Mode.W4A8 and compute_capability not in W4A8_CAPABILITIES:
        raise ValueError(f"mode: W4A8 on compute capability {compute_capability}, expected one of "
                         f"{sorted(W4A8_CAPABILITIES)} (its MMA is SM90's FP8 wgmma)")
    m, k = _check_rows(x, mode, "x")
    if row_token_m is not None and mode is Mode.W4A4:
        raise ValueError("row_token_m: given for w4a4, expected None (its rows are quantized per row before the "
                         "kernel, so they are a copy anyway)")
    gather_rows, m, row_token = _rows_by_index(row_token_m, m)
    num_experts = _check_group_sizes(group_sizes_e)
    name = "w_gate_up" if op is Op.GATE_UP_SWIGLU else "w"
    n_w, _, groups = _check_weights(w, name, op, num_experts, k=k)
    n_out = n_w // 2 if op is Op.GATE_UP_SWIGLU else n_w
    if n_out % 16 or n_out == 0 or (op is Op.GATE_UP_SWIGLU and n_w % 2):
        raise ValueError(f"{name}: {n_w} rows, expected a positive multiple of "
                         f"{32 if op is Op.GATE_UP_SWIGLU else 16}")
    if out is not None and (tuple(out.shape) != (m, n_out) or np.dtype(out.dtype) != np.dtype(jnp.bfloat16)):
        raise ValueError(f"out: {out.dtype}{list(out.shape)}, expected bfloat16 {[m, n_out]}")
    if m == 0:
        return jnp.zeros((0, n_out), jnp.bfloat16) if out is None else out
    if (out_k_order or x_k_order) and mode is not Mode.W4A16:
        raise ValueError(f"out_k_order={out_k_order}, x_k_order={x_k_order}: expected 0 for {mode.value} (the "
                         "column orders are those of the W4A16 kernels)")
    if out_k_order and (out_k_order < K_MULTIPLE or out_k_order & (out_k_order - 1) or n_out % out_k_order):
        raise ValueError(f"out_k_order: {out_k_order}, expected 0 or a power of two >= {K_MULTIPLE} dividing the "
                         f"output's {n_out} columns")
    spec = make_spec(op, mode, num_rows=m, num_experts=num_experts, k=k, n_out=n_out, scale_groups=groups,
                     compute_capability=compute_capability, tile=tile, out_k_order=out_k_order,
                     gather_rows=gather_rows)
    if x_k_order and x_k_order != spec.block_k:
        raise ValueError(f"x_k_order: {x_k_order}, expected this launch's block_k {spec.block_k} (k_order())")
    match mode:
        case Mode.W4A4:
            rows = (x.packed, jax.lax.bitcast_convert_type(x.scales, jnp.uint8), x.global_scale)
        case Mode.W4A16:
            # x's columns in the dequantized tiles' order (a pass over its T rows, not the M it
            # feeds, when it is read by index); the one-element placeholders (unread by W4A16)
            # keep a single kernel signature.
            x_perm = x if x_k_order else permute_k(x, spec.block_k)
            rows = (x_perm, jnp.zeros((1,), jnp.uint8), jnp.zeros((1,), jnp.float32))
        case Mode.W4A8:
            # Quantized per row (of the T rows, when they are read by index) in the same pass
            # that puts the columns in the tiles' order.
            values_mk, scale_m = quantize_fp8_rows(x, spec.block_k)
            rows = (values_mk, jnp.zeros((1,), jnp.uint8), scale_m)
        case _:
            assert_never(mode)
    return launch(spec, group_sizes_e, *rows, row_token, w.packed, jax.lax.bitcast_convert_type(w.scales, jnp.uint8),
                  w.global_scale.reshape(num_experts, groups), out)


def _rows_by_index(row_token_m, x_rows: int) -> tuple[int, int, jax.Array]:
    """``(gather_rows, M, row_token operand)``: ``(0, x_rows, placeholder)`` without indices; else
    ``x``'s rows, the indices' count and the indices, after checking them (int32 ``[M]``, and rows
    for them to read)."""
    if row_token_m is None:
        return 0, x_rows, _NO_ROW_TOKENS
    check_row_token(row_token_m)
    if x_rows == 0 and row_token_m.shape[0]:
        raise ValueError(f"x: 0 rows, expected at least one for row_token_m's {row_token_m.shape[0]} indices")
    return x_rows, row_token_m.shape[0], row_token_m


def bf16_matmul(op: Op, x_mk, w, group_sizes_e, *, compute_capability: int, tile: TileConfig | None = None,
                transpose_w: bool = False, out=None, row_token_m=None, global_scale=None) -> jax.Array:
    """The native schedule with bf16 weights (``Mode.BF16``): ``op`` on the rows of ``x_mk``.

    Args:
      op: ``Op.MATMUL`` (out bf16 ``[M, N]``, ``out[m] = x[m] @ W_e^T``) or ``Op.GATE_UP_SWIGLU``
        (``w`` ``[E, 2F, K]``, gate rows then up rows; out bf16 ``[M, F]``).
      x_mk: bf16 ``[M, K]``, rows sorted by expert; with ``row_token_m``, ``[T, K]`` in any order.
      w: bf16 ``[E, N, K]``; with ``transpose_w`` (``Op.MATMUL`` only) ``[E, K, N]`` read as its
        transpose, so ``out[m] = x[m] @ W_e``: the input gradient of a forward that read ``W_e``.
      group_sizes_e: int32 ``[E]``; rows past the sum are padding, left unwritten.
      compute_capability: picks the tile (:data:`BF16_TILES`, :func:`bf16_many_rows_tile`).
      tile: overrides the table (benchmark sweeps).
      out: optional bf16 ``[M, n_out]`` buffer the output is written into (aliased).
      row_token_m: None, or int32 ``[M]``: row ``m`` reads row ``row_token_m[m]`` of ``x_mk`` in
        place (as :func:`run`'s).
      global_scale: None, or float32 ``[E]`` (the fused op: ``[E]`` or ``[E, 2]``, gate's and
        up's): each expert's fp32 accumulator times its scale before SwiGLU and the bf16 rounding,
        so that ``w``, the exact bf16 copy of NVFP4 weights (:func:`.dequantized_copy`), multiplies
        as they do (:func:`dequantized_forward`). Not with ``transpose_w``.

    Raises:
      ValueError: naming the argument, for a bad shape, dtype or capability.
    """
    m, k = _check_rows(x_mk, Mode.BF16, "x_mk")
    gather_rows, m, row_token = _rows_by_index(row_token_m, m)
    num_experts = _check_group_sizes(group_sizes_e)
    if op is Op.GATE_UP_SWIGLU and transpose_w:
        raise ValueError("transpose_w: True, expected False for the fused gate/up (an input gradient is a matmul)")
    if (not hasattr(w, "dtype") or np.dtype(w.dtype) != np.dtype(jnp.bfloat16) or w.ndim != 3
            or w.shape[0] != num_experts or w.shape[1 if transpose_w else 2] != k):
        found = f"{w.dtype}{list(w.shape)}" if hasattr(w, "dtype") else type(w).__name__
        layout = f"[E={num_experts}, K={k}, N]" if transpose_w else f"[E={num_experts}, N, K={k}]"
        raise ValueError(f"w: {found}, expected bfloat16 {layout} (group_sizes_e, x_mk)")
    n_w = w.shape[2 if transpose_w else 1]
    n_out = n_w // 2 if op is Op.GATE_UP_SWIGLU else n_w
    if n_out % 16 or n_out == 0 or (op is Op.GATE_UP_SWIGLU and n_w % 2):
        raise ValueError(f"w: N={n_w}, expected a positive multiple of {32 if op is Op.GATE_UP_SWIGLU else 16}")
    if out is not None and (tuple(out.shape) != (m, n_out) or np.dtype(out.dtype) != np.dtype(jnp.bfloat16)):
        raise ValueError(f"out: {out.dtype}{list(out.shape)}, expected bfloat16 {[m, n_out]}")
    global_scale_eg = _check_global_scale(global_scale, op, num_experts, transpose_w)
    if m == 0:
        return jnp.zeros((0, n_out), jnp.bfloat16) if out is None else out
    spec = make_spec(op, Mode.BF16, num_rows=m, num_experts=num_experts, k=k, n_out=n_out,
                     scale_groups=global_scale_eg.shape[1] if global_scale is not None else 0,
                     compute_capability=compute_capability, tile=tile, trans_w=transpose_w, gather_rows=gather_rows)
    # One-element placeholders for the scales BF16 never reads keep a single kernel signature.
    u8, f32 = jnp.zeros((1,), jnp.uint8), jnp.zeros((1,), jnp.float32)
    return launch(spec, group_sizes_e, x_mk, u8, f32, row_token, w, u8, global_scale_eg, out)


def _check_global_scale(global_scale, op: Op, num_experts: int, transpose_w: bool) -> jax.Array:
    """:func:`bf16_matmul`'s ``global_scale`` as float32 ``[E, G]`` (a ``[1, 1]`` placeholder for None)."""
    if global_scale is None:
        return jnp.zeros((1, 1), jnp.float32)
    shapes = [(num_experts,), (num_experts, 1)] + ([(num_experts, 2)] if op is Op.GATE_UP_SWIGLU else [])
    found = f"{global_scale.dtype}{list(global_scale.shape)}" if hasattr(global_scale, "shape") else type(
        global_scale).__name__
    if transpose_w:
        raise ValueError(f"global_scale: {found}, expected None with transpose_w (an input gradient scales dy instead)")
    if (not hasattr(global_scale, "shape") or np.dtype(global_scale.dtype) != np.dtype(jnp.float32)
            or tuple(global_scale.shape) not in shapes):
        raise ValueError(f"global_scale: {found}, expected float32 of shape {' or '.join(map(str, shapes))}")
    return global_scale.reshape(num_experts, -1)


def k_order(op: Op, *, num_rows: int, num_experts: int, k: int, n_out: int, compute_capability: int,
            tile: TileConfig | None = None) -> int:
    """The ``block_k`` whose :func:`permute_k` column order a W4A16 launch of these shapes reads
    ``x`` in (for ``out_k_order`` of the kernel that writes ``x``)."""
    return make_spec(op, Mode.W4A16, num_rows=num_rows, num_experts=num_experts, k=k, n_out=n_out, scale_groups=1,
                     compute_capability=compute_capability, tile=tile).block_k


@dataclasses.dataclass(frozen=True, kw_only=True)
class InputGradSpec:
    """Everything static about one input-gradient launch (hashable: it keys the jit cache)."""

    tile: TileConfig
    num_rows: int
    n: int  # the reduction: the weight's rows
    k: int  # the output's columns: the weight's K
    block_o: int
    block_r: int
    max_tiles: int

    @property
    def num_programs(self) -> int:
        return self.max_tiles * (self.k // self.block_o)

    def constexprs(self) -> dict:
        return dict(N=self.n, K=self.k, NUM_TILES=self.max_tiles, BLOCK_M=self.tile.block_m, BLOCK_O=self.block_o,
                    BLOCK_R=self.block_r, GROUP_T=min(self.tile.group_t, self.max_tiles),
                    NUM_STAGES=self.tile.num_stages)


def make_input_grad_spec(*, num_rows: int, num_experts: int, n: int, k: int, compute_capability: int,
                         tile: TileConfig | None = None) -> InputGradSpec:
    """The input-gradient launch for these shapes (:data:`INPUT_GRAD_TILES` unless ``tile``)."""
    if compute_capability not in INPUT_GRAD_TILES:
        raise ValueError(f"compute_capability: {compute_capability!r} has no W4A16 input-gradient tiles; known: "
                         f"{sorted(INPUT_GRAD_TILES)} (W4A4 capabilities train through 'pallas')")
    if tile is None:
        few, many = INPUT_GRAD_TILES[compute_capability]
        tile = many if num_rows >= INPUT_GRAD_MANY_ROWS * num_experts else few
    if tile.extra_m or tile.tail_m:
        raise ValueError(f"tile: extra_m={tile.extra_m}, tail_m={tile.tail_m}, expected 0 (forward-kernel features)")
    block_r = tuning.fit_block(tile.block_k, n, K_MULTIPLE)
    tile = dataclasses.replace(tile, num_stages=max(1, min(tile.num_stages, n // block_r)))
    return InputGradSpec(tile=tile, num_rows=num_rows, n=n, k=k, block_o=tuning.fit_block(tile.block_n, k, K_MULTIPLE),
                         block_r=block_r, max_tiles=pallas_triton.max_tiles(num_rows, num_experts, tile.block_m))


def input_grad(dy_mn, w, group_sizes_e, *, compute_capability: int, tile: TileConfig | None = None,
               out=None) -> jax.Array:
    """The gradient of :func:`run`'s ``Op.MATMUL`` with respect to ``x``: bf16 ``[M, K]``, row
    ``m`` of expert ``e`` times ``W_e`` (not transposed), W4A16 (weights dequantized in registers
    as the forward kernels do, bf16 tensor cores).

    Args:
      dy_mn: bf16 ``[M, N]``, rows sorted by expert (the output cotangent).
      w: the forward's NVFP4 weight in ModelOpt's layout (``.packed`` uint8 ``[E, N, K/2]``,
        ``.scales`` float8_e4m3fn ``[E, N, K/16]``, ``.global_scale`` float32 ``[E]``: a fused
        gate/up weight whose halves have their own global scales is passed with them folded into
        ``dy_mn``'s columns instead).
      group_sizes_e: int32 ``[E]``; rows past the sum are padding, left unwritten.
      compute_capability: picks the tile (:data:`INPUT_GRAD_TILES`: SM80-SM90).
      tile: overrides the table (benchmark sweeps).
      out: optional bf16 ``[M, K]`` buffer the output is written into (aliased); rows the kernel
        does not write keep its values.

    Raises:
      ValueError: naming the argument, for a bad shape, dtype or capability.
    """
    m, n = _check_rows(dy_mn, Mode.W4A16, "dy_mn", columns="N")
    num_experts = _check_group_sizes(group_sizes_e)
    _, k, _ = _check_weights(w, "w", Op.MATMUL, num_experts, n=n, rows_name="dy_mn")
    if k % K_MULTIPLE or k <= 0:
        raise ValueError(f"w.packed: K={k}, expected a positive multiple of {K_MULTIPLE}")
    if out is not None and (tuple(out.shape) != (m, k) or np.dtype(out.dtype) != np.dtype(jnp.bfloat16)):
        raise ValueError(f"out: {out.dtype}{list(out.shape)}, expected bfloat16 {[m, k]}")
    if m == 0:
        return jnp.zeros((0, k), jnp.bfloat16) if out is None else out
    spec = make_input_grad_spec(num_rows=m, num_experts=num_experts, n=n, k=k, compute_capability=compute_capability,
                                tile=tile)
    return launch_input_grad(spec, group_sizes_e, dy_mn, w.packed, jax.lax.bitcast_convert_type(w.scales, jnp.uint8),
                             w.global_scale, out)


@functools.partial(jax.jit, static_argnums=(0,))
def launch_input_grad(spec: InputGradSpec, group_sizes_e, dy_mn, packed, scales_u8, global_scale_e, out=None):
    """Runs the input-gradient kernel: bf16 ``[M, K]``, rows past ``sum(group_sizes_e)`` unwritten
    (``out``'s, where it is given: aliased)."""
    import jax_triton  # noqa: PLC0415 (needs a GPU jaxlib; optional dependency)

    schedule = pallas_triton.tile_schedule(group_sizes_e, num_rows=spec.num_rows, block_m=spec.tile.block_m,
                                            num_tiles=spec.max_tiles)
    aliased = out is not None
    out_in = out if aliased else jnp.zeros((1,), jnp.bfloat16)  # a placeholder the kernel never reads
    operands = (*schedule, dy_mn, packed, scales_u8, global_scale_e, out_in)
    name = "native_input_grad_w4a16"
    with jax.named_scope(name):
        dx = jax_triton.triton_call(
            *operands, kernel=_input_grad_kernel, out_shape=jax.ShapeDtypeStruct((spec.num_rows, spec.k), jnp.bfloat16),
            grid=(spec.num_programs,), num_warps=spec.tile.num_warps, num_stages=spec.tile.num_stages, name=name,
            input_output_aliases={len(operands) - 1: 0} if aliased else None, **spec.constexprs())
    return triton_launch.same_varying_axes([dx], operands)[0]


def input_grad_signature(spec: InputGradSpec) -> dict[str, str]:
    """The input-gradient kernel's argument types for ``triton.compile`` (cross-compilation)."""
    types = ["*i32", "*i32", "*i32", "*bf16", "*u8", "*u8", "*fp32", "*bf16", "*bf16"]
    return {**dict(zip(_input_grad_kernel.arg_names, types, strict=False)),
            **{name: "constexpr" for name in spec.constexprs()}}


@functools.partial(jax.jit, static_argnums=(0,))
def launch(spec: NativeSpec, group_sizes_e, x, x_scales, x_global, row_token, packed, scales_u8, global_scale_eg,
           out=None):
    """Runs one kernel.

    Args:
      spec: the static description (:func:`make_spec`).
      group_sizes_e: int32 ``[E]``.
      x: W4A16 bf16 ``[M, K]`` (``[spec.gather_rows, K]`` when it is read by index); W4A8
        float8_e4m3fn, the same shape (:func:`quantize_fp8_rows`); W4A4 uint8 ``[M, K/2]``
        (packed codes).
      x_scales: W4A4 uint8 ``[M, K/16]`` (E4M3 bits); else any uint8 array (unread).
      x_global: W4A4 float32 ``[M]``; W4A8 float32, one per row of ``x``; W4A16 any float32
        array (unread).
      row_token: int32 ``[M]``, the row of ``x`` each row reads, if ``spec.gather_rows``; else any
        int32 array (unread).
      packed: uint8 ``[E, N_W, K/2]``.
      scales_u8: uint8 ``[E, N_W, K/16]`` (E4M3 bits).
      global_scale_eg: float32 ``[E, G]``.
      out: None, or a bf16 ``[M, n_out]`` buffer aliased to the output.

    Returns:
      bf16 ``[M, n_out]``; rows past ``sum(group_sizes_e)`` are left unwritten.
    """
    import jax_triton  # noqa: PLC0415 (needs a GPU jaxlib; optional dependency)

    schedule = pallas_triton.tile_schedule(group_sizes_e, num_rows=spec.num_rows, block_m=spec.tile.rows_per_tile,
                                            num_tiles=spec.max_tiles)
    aliased = out is not None
    out_in = out if aliased else jnp.zeros((1,), jnp.bfloat16)  # a placeholder the kernel never reads
    operands = (*schedule, x, x_scales, x_global, row_token, packed, scales_u8, global_scale_eg, out_in)
    # The name is the kernel's in profiles and the HLO: rows read by index say so.
    name = f"native_{spec.op.value}_{spec.mode.value}" + ("_rows_by_index" if spec.gather_rows else "")
    with jax.named_scope(name):
        y = jax_triton.triton_call(
            *operands, kernel=_kernel, out_shape=jax.ShapeDtypeStruct((spec.num_rows, spec.n_out), jnp.bfloat16),
            grid=(spec.num_programs,), num_warps=spec.tile.num_warps, num_stages=spec.tile.num_stages, name=name,
            input_output_aliases={len(operands) - 1: 0} if aliased else None, **spec.constexprs(),
        )
    return triton_launch.same_varying_axes([y], operands)[0]


def kernel_function():
    """The ``@triton.jit`` kernel itself (for cross-compilation)."""
    return _kernel


def input_grad_kernel_function():
    """The input-gradient ``@triton.jit`` kernel (for cross-compilation and the interpreter)."""
    return _input_grad_kernel


def signature(spec: NativeSpec) -> dict[str, str]:
    """The kernel's argument types for ``triton.compile`` (cross-compilation, no GPU)."""
    x = {Mode.W4A4: "*u8", Mode.W4A8: "*fp8e4nv"}.get(spec.mode, "*bf16")
    w = "*bf16" if spec.mode is Mode.BF16 else "*u8"
    types = ["*i32", "*i32", "*i32", x, "*u8", "*fp32", "*i32", w, "*u8", "*fp32", "*bf16", "*bf16"]
    constexprs = spec.constexprs()
    return {**dict(zip(_kernel.arg_names, types, strict=False)), **{name: "constexpr" for name in constexprs}}


def _w4a16_matmul(x_mk, w, group_sizes_e, *, compute_capability: int, interpret: bool, row_token_m=None) -> jax.Array:
    triton_launch.not_interpreted(interpret)
    return run(Op.MATMUL, x_mk, w, group_sizes_e, compute_capability=compute_capability, mode=Mode.W4A16,
               row_token_m=row_token_m)


def _w4a16_input_grad(dy_mn, w, group_sizes_e, *, compute_capability: int, interpret: bool) -> jax.Array:
    """:func:`input_grad`, or through one bf16 copy of the weights where
    :func:`tuning.dequantize_for_input_grad` says so (many rows per expert), the copy multiplied as
    bf16 weights' input gradient is (:func:`_bf16_input_grad`: the native 256-row tiles from
    :data:`BF16_MANY_ROWS_PER_EXPERT` rows per expert)."""
    triton_launch.not_interpreted(interpret)
    if dequantized_copy_pays(dy_mn, w, group_sizes_e):
        return dequantized_input_grad(dy_mn, w, group_sizes_e, compute_capability=compute_capability,
                                      multiply=_bf16_input_grad)
    return input_grad(dy_mn, w, group_sizes_e, compute_capability=compute_capability)


def w4a16_forward(x_mh, group_sizes_e, w_gate_up, w_down, *, compute_capability: int,
                  row_token_m=None) -> jax.Array:
    """The routed experts' MLP through the W4A16 kernels: the fused gate/up + SwiGLU kernel, then
    the down projection. The gate/up kernel reads its rows from ``x`` by ``row_token_m`` if given
    (:func:`run`), and writes its output's columns in the order the down kernel reads them
    (:func:`permute_k`, ``out_k_order``), which saves a pass over the intermediate activations.

    Args:
      x_mh: bf16 ``[M, H]`` rows sorted by expert, or with ``row_token_m`` (int32 ``[M]``) ``[T, H]``
        in any order, row ``m`` reading ``x_mh[row_token_m[m]]``.
      group_sizes_e: int32 ``[E]``; rows past the sum are padding, left unwritten.
      w_gate_up: NVFP4 ``[E, 2F, H]`` (global scale ``[E]`` or ``[E, 2]``); w_down: NVFP4 ``[E, H, F]``.

    Returns:
      bf16 ``[M, H]``.
    """
    h, f, _ = _check_weights(w_down, "w_down", Op.MATMUL, _check_group_sizes(group_sizes_e))
    num_rows = num_token_rows(x_mh, row_token_m)
    order = k_order(Op.MATMUL, num_rows=num_rows, num_experts=group_sizes_e.shape[0], k=f, n_out=h,
                    compute_capability=compute_capability)
    a_mf = run(Op.GATE_UP_SWIGLU, x_mh, w_gate_up, group_sizes_e, compute_capability=compute_capability,
               mode=Mode.W4A16, out_k_order=order, row_token_m=row_token_m)
    return run(Op.MATMUL, a_mf, w_down, group_sizes_e, compute_capability=compute_capability, mode=Mode.W4A16,
               x_k_order=order)


def dequantized_forward(x_mh, group_sizes_e, w_gate_up, w_down, *, compute_capability: int,
                        row_token_m=None) -> jax.Array:
    """:func:`w4a16_forward`'s product through one bf16 copy of each weight
    (:func:`.dequantized_copy`: ``code * scale``, exact) and the bf16 kernels
    (:func:`bf16_matmul`), which apply the weights' global scales to their fp32 accumulators as
    the W4A16 kernels do: the same products, summed in another order. The copies (``6 E H F``
    bytes) live for the call. Arguments and result as :func:`w4a16_forward`'s; a capability with
    bf16 tiles (:data:`BF16_TILES`). :func:`_w4a16_expert_mlp_forward` takes this path where
    :func:`.tuning.dequantize_for_forward` says so (many rows per expert).
    """
    num_experts = _check_group_sizes(group_sizes_e)
    h, f, _ = _check_weights(w_down, "w_down", Op.MATMUL, num_experts)
    _check_weights(w_gate_up, "w_gate_up", Op.GATE_UP_SWIGLU, num_experts, k=h, rows_name="w_down's N")
    if 2 * f != w_gate_up.packed.shape[1]:
        raise ValueError(f"w_gate_up.packed: {list(w_gate_up.packed.shape)}, expected [{num_experts}, {2 * f}, "
                         f"{h // 2}] for w_down's K={f}")
    with jax.named_scope("dequantized_forward"):
        a_mf = bf16_matmul(Op.GATE_UP_SWIGLU, x_mh, dequantized_copy(w_gate_up), group_sizes_e,
                           compute_capability=compute_capability, row_token_m=row_token_m,
                           global_scale=w_gate_up.global_scale)
        return bf16_matmul(Op.MATMUL, a_mf, dequantized_copy(w_down), group_sizes_e,
                           compute_capability=compute_capability, global_scale=w_down.global_scale)


def _w4a16_expert_mlp_forward(x_mh, group_sizes_e, w_gate_up, w_down, *, compute_capability: int,
                              interpret: bool, row_token_m=None) -> jax.Array:
    """:func:`dequantized_forward` where :func:`.tuning.dequantize_for_forward` says so (many rows
    per expert), else :func:`w4a16_forward`."""
    triton_launch.not_interpreted(interpret)
    if _dequantize_for_forward(x_mh, group_sizes_e, w_down, compute_capability, row_token_m):
        return dequantized_forward(x_mh, group_sizes_e, w_gate_up, w_down, compute_capability=compute_capability,
                                   row_token_m=row_token_m)
    return w4a16_forward(x_mh, group_sizes_e, w_gate_up, w_down, compute_capability=compute_capability,
                         row_token_m=row_token_m)


def _dequantize_for_forward(x_mh, group_sizes_e, w_down, compute_capability: int, row_token_m) -> bool:
    """:func:`.tuning.dequantize_for_forward` for these operands (``w_down`` ``[E, H, F]`` as stored)."""
    packed = getattr(w_down, "packed", None)
    if packed is None or packed.ndim != 3:
        return False  # not NVFP4: w4a16_forward names what is wrong
    return tuning.dequantize_for_forward(num_rows=num_token_rows(x_mh, row_token_m),
                                         num_experts=group_sizes_e.shape[0], hidden=packed.shape[1],
                                         intermediate=2 * packed.shape[2], compute_capability=compute_capability)


#: These kernels, W4A16, as :func:`pallas_kernels.grouped_matmul.expert_mlp`'s backend (SM80-SM90,
#: NVFP4 weights): the forward reads the rows by index, and at many rows per expert goes through one
#: bf16 copy of each weight (:func:`_w4a16_expert_mlp_forward`); so does the input gradient, from fewer
#: rows per expert, multiplied as bf16 weights' is (:func:`_w4a16_input_grad`); the
#: weight gradient (of ``qat`` masters) is a dense product, the Pallas kernel's, the one there is;
#: the input gradient's padding rows zeroed by a kernel that writes only them.
W4A16_BACKEND = Backend(name="triton_lang W4A16", forward=_w4a16_expert_mlp_forward, matmul=_w4a16_matmul,
                        input_grad=_w4a16_input_grad, weight_grad=grouped_matmul_weight_grad,
                        forward_reads_rows_by_index=True,
                        zero_padding_rows=triton_padding_rows.zero_padding_rows)


def _prefill(num_rows: int, group_sizes_e, compute_capability: int) -> bool:
    """Whether ``num_rows`` rows over these experts are a prefill size (:func:`tuning.choose_variant`):
    more than two decode row tiles per expert on average. Below, the GEMMs stream the weights'
    bytes, which neither the native bf16 tiles nor FP8 tensor cores make fewer."""
    return tuning.choose_variant(num_rows=num_rows, num_experts=group_sizes_e.shape[0],
                                 compute_capability=compute_capability) is Variant.PREFILL


def _bf16_expert_mlp_forward(x_mh, group_sizes_e, w_gate_up, w_down, *, compute_capability: int,
                             interpret: bool, row_token_m=None) -> jax.Array:
    """The native bf16 tiles at prefill sizes, their gate/up kernel reading rows by index if
    ``row_token_m`` is given; decode sizes through the Pallas kernels (rows gathered first)."""
    triton_launch.not_interpreted(interpret)
    num_rows = num_token_rows(x_mh, row_token_m)
    if not _prefill(num_rows, group_sizes_e, compute_capability):
        return PALLAS.forward(token_rows(x_mh, row_token_m), group_sizes_e, w_gate_up, w_down,
                              compute_capability=compute_capability, interpret=False)
    a_mf = bf16_matmul(Op.GATE_UP_SWIGLU, x_mh.astype(jnp.bfloat16), w_gate_up, group_sizes_e,
                       compute_capability=compute_capability, row_token_m=row_token_m)
    return bf16_matmul(Op.MATMUL, a_mf, w_down, group_sizes_e, compute_capability=compute_capability)


def _bf16_matmul(x_mk, w, group_sizes_e, *, compute_capability: int, interpret: bool, row_token_m=None) -> jax.Array:
    """``x @ W_e^T`` of bf16 weights: :func:`bf16_matmul` at prefill sizes (rows read by index if
    ``row_token_m`` is given), the Pallas kernel below (rows gathered first)."""
    triton_launch.not_interpreted(interpret)
    num_rows = num_token_rows(x_mk, row_token_m)
    if not _prefill(num_rows, group_sizes_e, compute_capability):
        return PALLAS.matmul(token_rows(x_mk, row_token_m), w, group_sizes_e, compute_capability=compute_capability,
                             interpret=False)
    return bf16_matmul(Op.MATMUL, x_mk.astype(jnp.bfloat16), w, group_sizes_e, compute_capability=compute_capability,
                       row_token_m=row_token_m)


def _w4a8_expert_mlp_forward(x_mh, group_sizes_e, w_gate_up, w_down, *, compute_capability: int,
                             interpret: bool, row_token_m=None) -> jax.Array:
    """W4A8 at prefill sizes (:func:`_prefill`): the gate/up kernel on the rows quantized per row
    to E4M3 (of the tokens, read by index if ``row_token_m`` is given), then the down kernel on
    its bf16 SwiGLU output quantized the same way; decode sizes W4A16
    (:func:`_w4a16_expert_mlp_forward`)."""
    triton_launch.not_interpreted(interpret)
    num_rows = num_token_rows(x_mh, row_token_m)
    if not _prefill(num_rows, group_sizes_e, compute_capability):
        return _w4a16_expert_mlp_forward(x_mh, group_sizes_e, w_gate_up, w_down, compute_capability=compute_capability,
                                         interpret=interpret, row_token_m=row_token_m)
    a_mf = run(Op.GATE_UP_SWIGLU, x_mh, w_gate_up, group_sizes_e, compute_capability=compute_capability,
               mode=Mode.W4A8, row_token_m=row_token_m)
    return run(Op.MATMUL, a_mf, w_down, group_sizes_e, compute_capability=compute_capability, mode=Mode.W4A8)


def _w4a8_matmul(x_mk, w, group_sizes_e, *, compute_capability: int, interpret: bool, row_token_m=None) -> jax.Array:
    triton_launch.not_interpreted(interpret)
    num_rows = num_token_rows(x_mk, row_token_m)
    mode = Mode.W4A8 if _prefill(num_rows, group_sizes_e, compute_capability) else Mode.W4A16
    return run(Op.MATMUL, x_mk, w, group_sizes_e, compute_capability=compute_capability, mode=mode,
               row_token_m=row_token_m)


#: W4A8 (opt-in, SM90) as :func:`pallas_kernels.grouped_matmul.expert_mlp`'s backend: the forward
#: GEMMs at prefill sizes on the FP8 tensor cores (activations quantized to E4M3 per row, the
#: weights' codes times their block scales placed into E4M3 in registers), decode sizes W4A16;
#: the gradients are W4A16's (the activations' rounding passes straight through).
W4A8_BACKEND = Backend(name="triton_lang W4A8", forward=_w4a8_expert_mlp_forward, matmul=_w4a8_matmul,
                       input_grad=_w4a16_input_grad, weight_grad=grouped_matmul_weight_grad,
                       forward_reads_rows_by_index=True,
                       zero_padding_rows=triton_padding_rows.zero_padding_rows)


def _bf16_input_grad(dy_mn, w, group_sizes_e, *, compute_capability: int, interpret: bool) -> jax.Array:
    """``dy @ W_e`` of bf16 weights: :func:`bf16_matmul` reading ``W_e`` transposed where
    :func:`bf16_many_rows_tile` has a tile for these rows, else the Pallas kernel."""
    if interpret or bf16_many_rows_tile(Op.MATMUL, num_rows=dy_mn.shape[0], num_experts=group_sizes_e.shape[0],
                                        compute_capability=compute_capability, transpose_w=True) is None:
        return PALLAS.input_grad(dy_mn, w, group_sizes_e, compute_capability=compute_capability, interpret=interpret)
    return bf16_matmul(Op.MATMUL, dy_mn.astype(jnp.bfloat16), w, group_sizes_e, compute_capability=compute_capability,
                       transpose_w=True)


def _bf16_weight_grad(x_mk, dy_mn, group_sizes_e, *, out_dtype, compute_capability: int,
                      interpret: bool) -> jax.Array:
    """``dy_e^T x_e``: :func:`.triton_weight_grad.weight_grad` (rows by TMA) from
    :data:`.tuning.NATIVE_WEIGHT_GRAD_ROWS_PER_EXPERT` rows per expert on average, else the Pallas
    kernel (the native kernel runs on a GPU only; Triton's interpreter runs it in
    ``tests/interpreter/``)."""
    if interpret or x_mk.shape[0] < tuning.NATIVE_WEIGHT_GRAD_ROWS_PER_EXPERT * group_sizes_e.shape[0]:
        return PALLAS.weight_grad(x_mk, dy_mn, group_sizes_e, out_dtype=out_dtype,
                                  compute_capability=compute_capability, interpret=interpret)
    return triton_weight_grad.weight_grad(x_mk, dy_mn, group_sizes_e, out_dtype=out_dtype,
                                          compute_capability=compute_capability)


#: bf16 weights as :func:`pallas_kernels.grouped_matmul.expert_mlp`'s backend (SM90, the
#: capabilities of :data:`BF16_TILES`): the forward GEMMs at prefill sizes through
#: :func:`bf16_matmul` (~170 rows per expert fill 192 MMA rows, not two 128-row tiles; rows read
#: by index; 256-row tiles from :data:`BF16_MANY_ROWS_PER_EXPERT`), decode sizes through the
#: Pallas kernels; the input gradient through :func:`bf16_matmul` at many rows per expert, else
#: the Pallas kernel (as fast as the native table tiles at the training shape: 609 and 612 TFLOP/s
#: against 594-601, benchmarks/results/prefill_h200/); the weight gradient by
#: :func:`_bf16_weight_grad` (rows by TMA from 128 rows per expert on average); the input
#: gradient's padding rows zeroed by a kernel that writes only them.
BF16_BACKEND = Backend(name="triton_lang BF16", forward=_bf16_expert_mlp_forward, matmul=_bf16_matmul,
                       input_grad=_bf16_input_grad, weight_grad=_bf16_weight_grad,
                       forward_reads_rows_by_index=True,
                       zero_padding_rows=triton_padding_rows.zero_padding_rows)


__all__ = ["BF16_BACKEND", "BF16_MANY_ROWS_PER_EXPERT", "BF16_MANY_ROWS_TILES", "BF16_TILES", "FP8_MAX",
           "INPUT_GRAD_TILES", "InputGradSpec", "MANY_ROWS_TILES", "Mode", "NATIVE_TILES", "NVFP4Rows", "NativeSpec",
           "ONE_GROUP_TILES", "W4A16_BACKEND", "W4A8_BACKEND", "W4A8_CAPABILITIES", "W4A8_MANY_ROWS_TILES",
           "WIDE_ROWS_PER_EXPERT", "WIDE_TILES", "bf16_many_rows_tile", "bf16_matmul", "dequantized_forward",
           "input_grad", "k_order", "launch", "launch_input_grad", "make_input_grad_spec", "make_spec", "mode_for",
           "one_group_tile", "permute_k_w4a8", "quantize_fp8_rows", "run", "w4a16_forward"]
