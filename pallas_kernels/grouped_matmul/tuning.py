"""Tile configurations per compute capability, and the pure heuristic that picks one.

One table, :data:`TILE_TABLE`, keyed by compute capability (80, 89, 90, 100, 120). Each row
holds a :class:`TileConfig` for every :class:`Variant` (decode or prefill), weight format
(bf16 or NVFP4) and :class:`Op` (plain grouped matmul or the fused gate/up + SwiGLU, whose two
accumulators double the register footprint). :func:`choose` is a pure function of shapes and
capability; it never looks at a device.

Variants:

* ``DECODE`` (swap-AB): the weight tile is the MMA's M operand and the few token rows of an
  expert its N operand, so a tile of 16-32 rows still feeds 64-row MMA instructions and each
  weight byte is streamed from memory once per N-tile. Bandwidth-bound.
* ``PREFILL``: large row tiles; compute-bound. bf16 uses the usual ``x @ W^T``; NVFP4 keeps
  swap-AB so the dequantized tile feeds the MMA from registers (see ``pallas_triton.py``).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import assert_never

from pallas_kernels.weight_format import WeightFormat

#: Shared memory per block available to a kernel, per capability, in bytes.
SHARED_MEMORY_BYTES = {80: 166_912, 89: 101_376, 90: 232_448, 100: 232_448, 120: 101_376}


class Variant(enum.Enum):
    DECODE = "decode"
    PREFILL = "prefill"


class Op(enum.Enum):
    MATMUL = "matmul"
    GATE_UP_SWIGLU = "gate_up_swiglu"


@dataclasses.dataclass(frozen=True, kw_only=True)
class TileConfig:
    """One Pallas-Triton launch configuration.

    Attributes:
      block_m: token rows per tile (the MMA's N operand under swap-AB).
      block_n: output columns per tile (for the fused op: per half, gate and up each).
      block_k: reduction depth per pipeline stage; a power of two >= 64.
      num_warps: warps per program.
      num_stages: software-pipeline depth of the K loop.
      group_t: row tiles visited before moving to the next output-column tile (L2 raster).
      extra_m: Triton-language NVFP4 kernels only (``native.py``, not on SM100; 0 elsewhere): a tile
        spans ``block_m + extra_m`` rows, and one holding more than ``block_m`` multiplies the
        last ``extra_m`` in a second MMA against the same dequantized weights (dequantized once
        for both). 0: tiles of ``block_m`` rows.
      tail_m: native kernels only (0 elsewhere): a tile holding at most ``tail_m`` rows (an
        expert's last) runs as a ``tail_m``-row tile, so its MMAs do not multiply the padding
        rows of a wider one. 0: no such path.
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_t: int
    extra_m: int = 0
    tail_m: int = 0

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"TileConfig.{name}: {value}, expected a power of two")
        if self.block_m < 16 or self.block_n < 16 or self.block_k < 64:
            raise ValueError(f"TileConfig: {self}, expected block_m, block_n >= 16 and block_k >= 64")
        if self.num_stages < 1 or self.group_t < 1:
            raise ValueError(f"TileConfig: {self}, expected num_stages >= 1 and group_t >= 1")
        if self.extra_m and (self.extra_m & (self.extra_m - 1) or not 16 <= self.extra_m <= self.block_m):
            raise ValueError(f"TileConfig.extra_m: {self.extra_m}, expected 0 or a power of two in "
                             f"[16, block_m={self.block_m}]")
        if self.tail_m and (self.tail_m & (self.tail_m - 1) or not 16 <= self.tail_m < self.block_m):
            raise ValueError(f"TileConfig.tail_m: {self.tail_m}, expected 0 or a power of two in "
                             f"[16, block_m={self.block_m})")

    @property
    def rows_per_tile(self) -> int:
        """Rows one tile spans (``block_m + extra_m``)."""
        return self.block_m + self.extra_m

    def shared_memory_estimate(self, variant: Variant, weights: WeightFormat, op: Op) -> int:
        """Bytes of operand tiles held in flight by the K pipeline (a lower bound on Triton's)."""
        halves = 2 if op is Op.GATE_UP_SWIGLU else 1
        x_bytes = self.block_m * self.block_k * 2
        match weights:
            case WeightFormat.BF16:
                w_bytes = self.block_n * self.block_k * 2
            case WeightFormat.NVFP4:
                w_bytes = self.block_n * (self.block_k // 2 + self.block_k // 16)
            case _:
                assert_never(weights)
        del variant  # Both variants stage the same operand tiles.
        return self.num_stages * (x_bytes + halves * w_bytes)


Key = tuple[Variant, WeightFormat, Op]


def _row(decode_bf16, decode_nvfp4, prefill_bf16, prefill_nvfp4, *, decode_bf16_fused, decode_nvfp4_fused,
         prefill_bf16_fused, prefill_nvfp4_fused) -> dict[Key, TileConfig]:
    d, p = Variant.DECODE, Variant.PREFILL
    b, f = WeightFormat.BF16, WeightFormat.NVFP4
    mm, sw = Op.MATMUL, Op.GATE_UP_SWIGLU
    return {
        (d, b, mm): decode_bf16, (d, f, mm): decode_nvfp4,
        (p, b, mm): prefill_bf16, (p, f, mm): prefill_nvfp4,
        (d, b, sw): decode_bf16_fused, (d, f, sw): decode_nvfp4_fused,
        (p, b, sw): prefill_bf16_fused, (p, f, sw): prefill_nvfp4_fused,
    }


# Decode tiles raster rows fastest (group_t covers every tile) so the row tiles of one expert
# that share a weight tile run back to back and the re-read hits L2.
_ALL_ROWS = 1 << 20


def decode_tile(m, n, k, warps, stages) -> TileConfig:
    return TileConfig(block_m=m, block_n=n, block_k=k, num_warps=warps, num_stages=stages, group_t=_ALL_ROWS)


def prefill_tile(m, n, k, warps, stages, group_t=8, *, extra_m=0, tail_m=0) -> TileConfig:
    return TileConfig(block_m=m, block_n=n, block_k=k, num_warps=warps, num_stages=stages, group_t=group_t,
                      extra_m=extra_m, tail_m=tail_m)


# The SM90 row was picked from sweeps on an H200 (benchmarks/results/pallas_tile_sweeps_h200/,
# benchmarks/NOTES.md "Grouped GEMM kernels"). The others are sized to each chip's shared memory
# and MMA, not measured: SM80/SM89/SM120 have mma.sync only, SM89 and SM120 about 99 KB of
# shared memory per block; the SM100 and SM120 rows are cross-compiled in CI
# (tests/pallas_kernels/test_crosscompile.py). For NVFP4, block_m counts token rows (the MMA's
# N under swap-AB) and block_n weight rows, in both variants.
TILE_TABLE: dict[int, dict[Key, TileConfig]] = {
    80: _row(
        decode_tile(16, 64, 256, 4, 4), decode_tile(16, 128, 256, 4, 4),
        prefill_tile(128, 128, 64, 8, 4), prefill_tile(128, 128, 64, 8, 3),
        decode_bf16_fused=decode_tile(16, 64, 128, 4, 4), decode_nvfp4_fused=decode_tile(16, 64, 256, 4, 4),
        prefill_bf16_fused=prefill_tile(128, 64, 64, 8, 4), prefill_nvfp4_fused=prefill_tile(128, 64, 64, 8, 3),
    ),
    89: _row(
        decode_tile(16, 64, 128, 4, 4), decode_tile(16, 64, 256, 4, 4),
        prefill_tile(128, 128, 64, 8, 3), prefill_tile(128, 128, 64, 8, 3),
        decode_bf16_fused=decode_tile(16, 64, 64, 4, 4), decode_nvfp4_fused=decode_tile(16, 64, 256, 4, 3),
        prefill_bf16_fused=prefill_tile(128, 64, 64, 8, 3), prefill_nvfp4_fused=prefill_tile(128, 64, 64, 8, 3),
    ),
    90: _row(
        decode_tile(16, 128, 128, 4, 5), decode_tile(16, 128, 128, 4, 3),
        prefill_tile(128, 256, 64, 8, 3), prefill_tile(128, 128, 64, 4, 4),
        decode_bf16_fused=decode_tile(16, 64, 128, 4, 5), decode_nvfp4_fused=decode_tile(16, 64, 128, 4, 3),
        prefill_bf16_fused=prefill_tile(128, 128, 64, 8, 3), prefill_nvfp4_fused=prefill_tile(128, 128, 64, 8, 3),
    ),
    100: _row(
        decode_tile(16, 128, 128, 4, 5), decode_tile(16, 128, 256, 4, 4),
        prefill_tile(128, 256, 64, 8, 3), prefill_tile(128, 256, 64, 8, 3),
        decode_bf16_fused=decode_tile(16, 64, 128, 4, 5), decode_nvfp4_fused=decode_tile(16, 64, 256, 4, 4),
        prefill_bf16_fused=prefill_tile(128, 128, 64, 8, 3), prefill_nvfp4_fused=prefill_tile(128, 128, 64, 8, 3),
    ),
    120: _row(
        decode_tile(16, 64, 128, 4, 4), decode_tile(16, 64, 256, 4, 4),
        prefill_tile(128, 128, 64, 8, 3), prefill_tile(128, 128, 64, 8, 3),
        decode_bf16_fused=decode_tile(16, 64, 64, 4, 4), decode_nvfp4_fused=decode_tile(16, 64, 256, 4, 3),
        prefill_bf16_fused=prefill_tile(128, 64, 64, 8, 3), prefill_nvfp4_fused=prefill_tile(128, 64, 64, 8, 3),
    ),
}


# The weight gradient ``dW_e = dy_e^T x_e``: block_m rows per reduction step, a block_n x block_k
# output tile (its fp32 accumulator); (few rows per expert, many rows per expert). The SM90 pair
# was picked from a sweep on an H200 (benchmarks/results/train_step_h200/weight_grad_sweep.json:
# 48 experts, Kimi K2's projections, 8192 and 32768 rows); the others are sized to each chip's
# shared memory and registers, not measured (SM100/SM120 are cross-compiled in CI).
WEIGHT_GRAD_TILES: dict[int, tuple[TileConfig, TileConfig]] = {
    80: (prefill_tile(32, 128, 128, 4, 4, group_t=1), prefill_tile(64, 128, 128, 8, 3, group_t=1)),
    89: (prefill_tile(32, 64, 128, 4, 3, group_t=1), prefill_tile(32, 64, 128, 4, 3, group_t=1)),
    90: (prefill_tile(32, 128, 128, 4, 4, group_t=1), prefill_tile(64, 128, 256, 8, 3, group_t=1)),
    100: (prefill_tile(32, 128, 128, 4, 4, group_t=1), prefill_tile(64, 128, 256, 8, 3, group_t=1)),
    120: (prefill_tile(32, 64, 128, 4, 3, group_t=1), prefill_tile(32, 64, 128, 4, 3, group_t=1)),
}
# The same for the Triton-language kernel whose rows arrive by TMA (``triton_weight_grad``, SM90
# and above), with the programs per SM of each (its persistent grid): its pipeline keeps
# ``num_stages`` row buffers (48 KB a stage at 64 x (128 + 256)) beside the epilogue's layout
# change (64 KB at a 128 x 256 bf16 tile), so the SM90/SM100 many-rows tile has 4 stages (229 KB of
# the 232 KB a block may have) and one program per SM; the few-rows tile, 128 x 128 outputs on 4
# warps with 3 stages (106 KB), runs two per SM in the 228 KB an SM has, so one program's loads and
# MMAs run while the other stores. Measured on an H100 at 48 experts, the fastest of the tiles tried at
# 683 and at 171 rows per expert respectively: 5% and 2-8% under the Pallas kernel's table tile
# (benchmarks/results/weight_grad_h100/0045dd2_probe/); SM100's and SM120's cross-compiled in CI
# only (SM120's fits its 99 KB).
NATIVE_WEIGHT_GRAD_TILES: dict[int, tuple[TileConfig, TileConfig]] = {
    90: (prefill_tile(64, 128, 128, 4, 3, group_t=1), prefill_tile(64, 128, 256, 8, 4, group_t=1)),
    100: (prefill_tile(64, 128, 128, 4, 3, group_t=1), prefill_tile(64, 128, 256, 8, 4, group_t=1)),
    120: (prefill_tile(32, 64, 128, 4, 4, group_t=1), prefill_tile(32, 64, 128, 4, 4, group_t=1)),
}
NATIVE_WEIGHT_GRAD_PROGRAMS_PER_SM: dict[int, tuple[int, int]] = {90: (2, 1), 100: (2, 1), 120: (1, 1)}
#: Rows per expert (on average) from which the weight gradient takes the second tile of its pair.
WEIGHT_GRAD_MANY_ROWS = 512
#: Rows per expert (on average) from which the bf16 backend (``triton_lang.BF16_BACKEND``) takes
#: the native weight gradient over the Pallas kernel: it was faster at 171 and 683
#: (benchmarks/results/weight_grad_h100/0045dd2_probe/); with fewer, a tile is one or two row
#: steps, unmeasured, so the Pallas kernel keeps them.
NATIVE_WEIGHT_GRAD_ROWS_PER_EXPERT = 128


def _many_weight_grad_rows(num_rows: int, num_experts: int) -> bool:
    """Whether each expert has about :data:`WEIGHT_GRAD_MANY_ROWS` rows (32768 rows over 48
    experts): then the weight gradients take the second tile of their pairs."""
    return num_rows >= WEIGHT_GRAD_MANY_ROWS * num_experts


def choose_weight_grad_tile(*, num_rows: int, num_experts: int, compute_capability: int) -> TileConfig:
    """The Pallas weight-gradient tile (:data:`WEIGHT_GRAD_TILES`): deeper row steps and a wider
    output tile at many rows per expert (:func:`_many_weight_grad_rows`), else the smaller one."""
    check_capability(compute_capability)
    return WEIGHT_GRAD_TILES[compute_capability][_many_weight_grad_rows(num_rows, num_experts)]


def native_weight_grad_tile(*, num_rows: int, num_experts: int, compute_capability: int) -> tuple[TileConfig, int]:
    """``(tile, programs per SM)`` of the native weight gradient (``triton_weight_grad``): the
    second of :data:`NATIVE_WEIGHT_GRAD_TILES`' pair and of
    :data:`NATIVE_WEIGHT_GRAD_PROGRAMS_PER_SM`'s at many rows per expert
    (:func:`_many_weight_grad_rows`), else the first."""
    check_capability(compute_capability)
    many = _many_weight_grad_rows(num_rows, num_experts)
    return (NATIVE_WEIGHT_GRAD_TILES[compute_capability][many],
            NATIVE_WEIGHT_GRAD_PROGRAMS_PER_SM[compute_capability][many])


# The NVFP4 input gradient ``dy @ W_e`` through one bf16 copy of the weights: an XLA pass
# dequantizes them once (reading 0.56 bytes a weight, writing 2), then the bf16 kernel runs. The
# kernels that read NVFP4 dequantize every weight tile once per row tile they meet and run at
# 0.4-0.67x their forward's rate (benchmarks/NOTES.md, "Training"), so from a few hundred rows per
# expert the copy's pass costs less than the difference. SM90, measured on an H200 at 48 experts
# (benchmarks/results/train_step_h200/): see :func:`dequantize_for_input_grad`.
#: Rows per expert (on average) from which the input gradient goes through the bf16 copy.
DEQUANTIZED_INPUT_GRAD_ROWS_PER_EXPERT = 256
#: The most bytes a call's bf16 copies may take (beyond it, the kernels that read NVFP4 run): 48
#: experts of Kimi K2's gate/up (EP 8) take 2.8 GB, 96 take 5.6; all 384 on one GPU would take 22.5.
DEQUANTIZED_COPY_MAX_BYTES = 6 << 30


def dequantize_for_input_grad(*, num_rows: int, num_experts: int, n: int, k: int) -> bool:
    """Whether the NVFP4 input gradient of ``[E, N, K]`` weights over ``num_rows`` rows goes
    through one bf16 copy of the weights (at least :data:`DEQUANTIZED_INPUT_GRAD_ROWS_PER_EXPERT`
    rows per expert on average, a copy of at most :data:`DEQUANTIZED_COPY_MAX_BYTES`)."""
    return (num_rows >= DEQUANTIZED_INPUT_GRAD_ROWS_PER_EXPERT * num_experts
            and 2 * num_experts * n * k <= DEQUANTIZED_COPY_MAX_BYTES)


# The NVFP4 forward (the fused gate/up, then the down projection) through one bf16 copy of each
# weight (``triton_lang.dequantized_forward``), the global scales applied to the accumulators as
# W4A16 applies them. W4A16's main loop stays near 0.6 of the dense anchor at every group size,
# where the bf16 kernels reach 0.8-0.85 once the groups are large (benchmarks/NOTES.md, section
# 1), so from enough rows per expert the bf16 kernels' lead pays for the copies' pass (0.56 bytes
# read and 2 written a weight). On an H100 at Kimi K2's projections, 65536 rows
# (results/prefill_h100/f236c82_copied_forward/): 11.52 ms against the W4A16 kernels' 11.74 at 48
# experts (1365 rows each), 10.16 against 12.03 at 32 (2048), 9.46 against 11.00 at 16, 8.73
# against 11.56 at 6. Not yet measured on an H200, whose copies cost less.
#: Rows per expert (on average), per capability with bf16 tiles, from which the NVFP4 forward
#: goes through bf16 copies.
DEQUANTIZED_FORWARD_ROWS_PER_EXPERT: dict[int, int] = {90: 2048}


def dequantize_for_forward(*, num_rows: int, num_experts: int, hidden: int, intermediate: int,
                           compute_capability: int) -> bool:
    """Whether the NVFP4 expert MLP over ``num_rows`` rows goes through bf16 copies of its weights
    (gate/up ``[E, 2F, H]``, down ``[E, H, F]``): on a capability of
    :data:`DEQUANTIZED_FORWARD_ROWS_PER_EXPERT`, from its rows per expert on average, the two
    copies (``6 E H F`` bytes) within :data:`DEQUANTIZED_COPY_MAX_BYTES`."""
    rows = DEQUANTIZED_FORWARD_ROWS_PER_EXPERT.get(compute_capability)
    return (rows is not None and num_rows >= rows * num_experts
            and 6 * num_experts * hidden * intermediate <= DEQUANTIZED_COPY_MAX_BYTES)


def weight_grad_shared_memory(config: TileConfig) -> int:
    """Bytes of the ``dy`` and ``x`` row tiles the weight-gradient pipeline holds in flight."""
    return config.num_stages * config.block_m * (config.block_n + config.block_k) * 2


def check_capability(compute_capability: int) -> None:
    """Raises ValueError naming ``compute_capability`` if the table has no row for it."""
    if compute_capability not in TILE_TABLE:
        raise ValueError(
            f"compute_capability: {compute_capability!r} has no tile configurations; "
            f"known: {sorted(TILE_TABLE)}"
        )


def choose_variant(*, num_rows: int, num_experts: int, compute_capability: int) -> Variant:
    """Decode when the average expert gets at most two decode row tiles, else prefill.

    At that point the decode kernel still reads each weight tile about once (an expert's row
    tiles run back to back and share it through L2) while the prefill kernel's 128-row tiles
    would be mostly padding.
    """
    check_capability(compute_capability)
    decode_rows = TILE_TABLE[compute_capability][(Variant.DECODE, WeightFormat.BF16, Op.MATMUL)].block_m
    return Variant.DECODE if num_rows <= 2 * decode_rows * num_experts else Variant.PREFILL


def fit_block(block: int, extent: int, minimum: int) -> int:
    """The largest power of two <= ``block`` that divides ``extent`` (at least ``minimum``).

    Callers validate that ``extent`` is a multiple of ``minimum``, so the result exists.
    """
    size = block
    while extent % size:
        size //= 2
    assert size >= minimum, (block, extent, minimum)
    return size
