"""Pallas-Triton grouped matmul kernels: bf16 or NVFP4 weights, optional fused SwiGLU.

Dimension letters: ``m`` rows (tokens), ``k`` reduction, ``n`` output columns, ``e`` experts,
``t`` row tiles, ``f`` the fused op's output columns (``n = 2f``: gate rows, then up rows).

Work split. The rows of expert ``e`` are cut into tiles of ``block_m`` rows that start at the
expert's first row (:func:`tile_schedule`, plain XLA ops on ``group_sizes_e``); a tile never
straddles two experts, so each tile reads one expert's weights and a masked store writes only
its own rows (padding rows are never written). The 1-D grid covers ``(max_tiles, n_tiles)``;
programs whose tile slot is unused (there are fewer tiles than the static bound) return at once.

Orientation (``KernelSpec.swap_ab``). Swap-AB makes the weight tile the MMA's M operand and the
token rows its N operand: decode uses it (16 token rows still feed 64-row wgmma), and NVFP4 uses
it always, so the dequantized tile goes from registers straight into the MMA (wgmma with A in
registers on SM90, mma.sync on SM80/SM89/SM120) in :attr:`Order.FRAGMENT` column order. bf16
prefill uses the usual ``x @ W^T`` with both operands staged in shared memory.

NVFP4 dequantization inside the K loop (:class:`Dequant`):

* ``PTX`` places each E2M1 code's bits straight into a bf16's sign, exponent and mantissa
  fields (Marlin's trick; inline PTX on four packed bytes at a time), which gives
  ``value * 2**-126``; the block scale, converted to bf16 with ``2**119`` folded in, multiplies
  it to ``value * scale * 2**-7``, which bf16 holds exactly (at most 6 significant bits, far
  from both ends of the range); the epilogue multiplies by ``global_scale * 2**7`` in fp32
  (for the fused op with per-half global scales, ``KernelSpec.scale_groups == 2``, the gate
  accumulator by gate's and the up accumulator by up's).
  Code 1 (0.5) becomes a bf16 subnormal, which the GPU's bf16 multiply keeps (PTX has no
  flush-to-zero for bf16), but XLA:CPU would flush.
* ``EXACT`` computes the same bf16 operand with normal floats only (selects for the
  subnormal codes); it is what interpret mode runs, and a GPU test checks both agree bit
  for bit.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import assert_never

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import pallas_offsets
from pallas_kernels.grouped_matmul.tuning import Op, TileConfig, Variant, WeightFormat

#: log2 of the factor the dequantized bf16 operand is short of ``value * scale``.
OPERAND_EXPONENT_DEFICIT = 7
_BLOCK = 16  # NVFP4 elements per block scale.


class Dequant(enum.Enum):
    PTX = "ptx"
    EXACT = "exact"


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelSpec:
    """Everything static about one launch (hashable: it keys the jit cache)."""

    variant: Variant
    weights: WeightFormat
    op: Op
    dequant: Dequant
    config: TileConfig
    num_rows: int
    k: int
    n_out: int  # Output columns: n for MATMUL, f for GATE_UP_SWIGLU; the weight's K when transposed.
    block_k: int
    block_n: int
    max_tiles: int
    aliased: bool
    # NVFP4 global scales per expert: 1 (``[E]``), or 2 (``[E, 2]``: gate's and up's, fused op only).
    scale_groups: int = 1
    check_bounds: bool = False  # Count out-of-range accesses (interpret mode only; see _Memory).
    # ``x @ W_e`` instead of ``x @ W_e^T`` (MATMUL only): the input gradient of the forward
    # matmul, reading the weights as stored. ``k`` is then the weight's N and ``n_out`` its K.
    transpose_w: bool = False

    def __post_init__(self):
        if self.transpose_w and self.op is not Op.MATMUL:
            raise ValueError(f"KernelSpec.transpose_w: True, expected op {Op.MATMUL.value}, found {self.op.value}")
        allowed = (1, 2) if self.weights is WeightFormat.NVFP4 and self.op is Op.GATE_UP_SWIGLU else (1,)
        if self.scale_groups not in allowed:
            raise ValueError(f"KernelSpec.scale_groups: {self.scale_groups}, expected one of {allowed} for "
                             f"{self.op.value} with {self.weights.value} weights")

    @property
    def swap_ab(self) -> bool:
        """Weights as the MMA's M operand (acc is ``[n, m]``).

        Decode needs it (a few rows per expert still fill 64-row MMAs); NVFP4 always takes it,
        so the dequantized tile goes from registers straight into the MMA in fragment order.
        (NVFP4 staged through shared memory as the B operand gave wrong results on an H200:
        benchmarks/NOTES.md, "A correctness problem found on the H200".)
        """
        return self.variant is Variant.DECODE or self.weights is WeightFormat.NVFP4

    @property
    def scales_first(self) -> bool:
        """Whether each K step loads the NVFP4 block scales before ``x`` and the codes.

        XLA's Triton keeps this small load in registers (no cp.async stage) and issues it where
        the kernel body does. Issued after x and the codes, it is waited for at the top of every
        step; issued first, the step's other work covers it. That was faster on an H200 for every
        NVFP4 kernel but the fused prefill (two weight halves), which keeps the old order
        (benchmarks/NOTES.md, "Scale loads: what changed in this round, measured").
        """
        return self.weights is WeightFormat.NVFP4 and not (
            self.variant is Variant.PREFILL and self.op is Op.GATE_UP_SWIGLU)

    @property
    def order(self) -> Order:
        """The column order of dequantized NVFP4 tiles, and of ``x`` (bf16 keeps memory order).

        Transposed, the packed dimension is the output's, not the reduction's, so the tile keeps
        memory order and ``x`` is not permuted.
        """
        if self.weights is WeightFormat.NVFP4 and not self.transpose_w:
            return Order.FRAGMENT
        return Order.MODELOPT


def max_tiles(num_rows: int, num_experts: int, block_m: int) -> int:
    """A static bound on the number of row tiles: ``sum_e ceil(g_e / bm) <= M // bm + #nonempty``."""
    return num_rows // block_m + min(num_experts, num_rows)


def tile_schedule(group_sizes_e: jax.Array, *, num_rows: int, block_m: int, num_tiles: int):
    """Row tiles of ``block_m`` rows, each inside one expert's rows.

    Groups are read as ``max(g, 0)``, and rows at or past ``num_rows`` are cut off, so a
    malformed ``group_sizes_e`` can never make the kernel touch memory outside ``x``/``out``.

    Args:
      group_sizes_e: int32 ``[E]``.
      num_rows: M, the rows of ``x``.
      block_m: rows per tile.
      num_tiles: the static number of tile slots (:func:`max_tiles`).

    Returns:
      ``(tile_expert_t, tile_start_t, tile_end_t)``, int32 ``[num_tiles]`` each: the expert,
      the first row, and the end of that expert's rows (exclusive). Unused slots have
      ``start == end == 0``.
    """
    starts_e, ends_e = group_bounds(group_sizes_e, num_rows=num_rows)
    tiles_e = (ends_e - starts_e + block_m - 1) // block_m
    tile_ends_e = jnp.cumsum(tiles_e)
    t = jnp.arange(num_tiles, dtype=jnp.int32)
    # Unrolled: the default method is a while loop of log2(E) steps, and on a GPU each step is
    # a few tiny kernel launches (a jax.profiler trace of the 384-expert decode layer showed 9
    # steps of select, add and two copies in every call).
    expert_t = jnp.searchsorted(tile_ends_e, t, side="right", method="scan_unrolled").astype(jnp.int32)
    used_t = expert_t < group_sizes_e.shape[0]
    expert_t = jnp.minimum(expert_t, group_sizes_e.shape[0] - 1)
    first_tile_t = tile_ends_e[expert_t] - tiles_e[expert_t]
    start_t = starts_e[expert_t] + (t - first_tile_t) * block_m
    zero = jnp.zeros_like(t)
    return (
        jnp.where(used_t, expert_t, zero),
        jnp.where(used_t, start_t, zero),
        jnp.where(used_t, ends_e[expert_t], zero),
    )


# --- NVFP4 dequantization -------------------------------------------------------------------

def nibbles_to_bf16_ptx(word: str, nibbles: str, out_01: str, out_23: str) -> str:
    """PTX that turns the ``"low"`` or ``"high"`` nibbles of the four packed bytes b0..b3 in
    register ``word`` (element 2i in the low nibble of byte i) into bf16 ``value * 2**-126``:
    those of (b0, b1) as a pair into ``out_01``, of (b2, b3) into ``out_23``. Uses registers
    ``q``, ``t``, ``s``, which the caller declares.

    prmt moves byte i to the top byte of a 16-bit lane, so a high nibble sits at lane bits
    12..15: its sign (bit 3) is then the bf16 sign bit, and its magnitude bits shift down by 6
    into exponent bits 7..8 and mantissa bit 6. Low nibbles first move up by 4.
    """
    lines = [f"shl.b32 q, {word}, 4;" if nibbles == "low" else f"mov.b32 q, {word};"]
    for out, selector in ((out_01, "0x1404"), (out_23, "0x3424")):
        lines += [f"prmt.b32 t, q, 0, {selector};", "and.b32 s, t, 0x70007000;", "shr.b32 s, s, 6;",
                  "and.b32 t, t, 0x80008000;", f"or.b32 {out}, t, s;"]
    return "\n".join(lines) + "\n"


# The Pallas lowering of elementwise_inline_asm takes one result, hence one asm per nibble:
# bytes in $2, the pairs out in $0 and $1.
_LOW_NIBBLES_PTX, _HIGH_NIBBLES_PTX = (
    "{\n.reg .b32 q, t, s;\n" + nibbles_to_bf16_ptx("$2", nibbles, "$0", "$1") + "}\n" for nibbles in ("low", "high"))


def _e2m1_halves_ptx(packed):
    """uint8 ``[..., j]`` -> (low nibbles, high nibbles) as bf16 ``value * 2**-126``."""
    bf16 = jax.ShapeDtypeStruct(packed.shape, jnp.bfloat16)
    return tuple(
        plgpu.elementwise_inline_asm(asm, args=[packed], constraints="=r,=r,r", pack=4, result_shape_dtypes=[bf16])[0]
        for asm in (_LOW_NIBBLES_PTX, _HIGH_NIBBLES_PTX)
    )


def _scales_ptx(scales_u8):
    """uint8 E4M3 bits ``[...]`` -> bf16 ``scale * 2**119`` (exact; subnormal E4M3 included)."""
    bits = ((scales_u8.astype(jnp.uint16) & 0x7F) << 4) | ((scales_u8.astype(jnp.uint16) & 0x80) << 8)
    placed = jax.lax.bitcast_convert_type(bits, jnp.bfloat16)  # scale * 2**-120
    # Two exact power-of-two steps: 2**239 does not fit one bf16 constant.
    return placed * jnp.bfloat16(2.0**127) * jnp.bfloat16(2.0**112)


def _e2m1_exact(codes_u8):
    """uint8 codes 0..15 -> float32 E2M1 values, normal floats only."""
    codes = codes_u8.astype(jnp.int32)
    exponent, mantissa = (codes >> 1) & 3, codes & 1
    normal = jax.lax.bitcast_convert_type(((exponent + 126) << 23) | (mantissa << 22), jnp.float32)
    magnitude = jnp.where(exponent == 0, mantissa.astype(jnp.float32) * 0.5, normal)
    return jnp.where((codes & 8) != 0, -magnitude, magnitude)


def _e4m3_exact(scales_u8):
    """uint8 E4M3 bits -> float32 values, normal floats only (E4M3 has no Inf; NaN unsupported)."""
    bits = scales_u8.astype(jnp.int32)
    exponent, mantissa = (bits >> 3) & 15, bits & 7
    normal = jax.lax.bitcast_convert_type(((exponent + 120) << 23) | (mantissa << 20), jnp.float32)
    magnitude = jnp.where(exponent == 0, mantissa.astype(jnp.float32) * 2.0**-9, normal)
    return jnp.where((bits & 0x80) != 0, -magnitude, magnitude)


def dequantize_copy(packed_rj, scales_rb):
    """NVFP4 rows -> a bf16 copy: uint8 codes ``[R, K/2]`` and E4M3 bits ``[R, K/16]`` -> bf16
    ``[R, K]`` ``value * scale`` (exact: at most 6 significant bits; the global scale left out).

    For XLA, not a kernel: each byte's two values are gathered from 256-entry tables and packed
    into one uint32, which XLA fuses into one pass at the copy bandwidth (2.98 TB/s written on an
    H200, benchmarks/results/dequant_probe_h200/), where :func:`dequantize_tile`'s ``EXACT``
    formulation, a stack of float32 values, ran at 0.82 TB/s.
    """
    rows, half = packed_rj.shape
    byte = jnp.arange(256, dtype=jnp.int32)
    scale_rj = jnp.repeat(_e4m3_exact(scales_rb).astype(jnp.bfloat16), 8, axis=1)  # 8 bytes a block
    index = packed_rj.astype(jnp.int32)
    lo, hi = (jax.lax.bitcast_convert_type(_e2m1_exact(nibbles).astype(jnp.bfloat16)[index] * scale_rj, jnp.uint16)
              .astype(jnp.uint32) for nibbles in (byte & 15, byte >> 4))
    return jax.lax.bitcast_convert_type(lo | (hi << 16), jnp.bfloat16).reshape(rows, 2 * half)


class Order(enum.Enum):
    """Column order of a dequantized weight tile (and of the ``x`` columns it meets).

    ``MODELOPT``: memory order. ``FRAGMENT``: within each 32-element block, column
    ``16t + 8n + 2q + s`` holds element ``8q + 4t + 2s + n`` (:func:`permute_k`). That puts
    the 4 packed bytes a thread's MMA A-fragment needs (mma.m16n8k16 and wgmma with A in
    registers: columns ``2q, 2q+1, 2q+8, 2q+9`` of each k16 step) next to each other, and
    pairs the two bf16 an asm output register holds as the fragment pairs them. In memory
    order Triton gathers those bytes one at a time and re-pairs every register (the SASS
    counts are in benchmarks/NOTES.md, "What was built").
    """

    MODELOPT = "modelopt"
    FRAGMENT = "fragment"


def permute_k(x_mk):
    """``x [M, K]`` -> its columns in :attr:`Order.FRAGMENT` order (K a multiple of 32)."""
    m, k = x_mk.shape
    blocks = x_mk.reshape(m, k // 32, 4, 2, 2, 2)  # (m, b, q, t, s, n)
    return blocks.transpose(0, 1, 3, 5, 2, 4).reshape(m, k)


def dequantize_tile(packed_nj, scales_nb, dequant: Dequant, order: Order):
    """One NVFP4 weight tile -> bf16 ``value * scale * 2**-7`` (global scale left out).

    Args:
      packed_nj: uint8 ``[bn, bk/2]``.
      scales_nb: uint8 ``[bn, bk/16]`` (E4M3 bits).
      dequant: the formulation; both give the same bits.
      order: the column order of the result.

    Returns:
      bf16 ``[bn, bk]``.
    """
    rows, half = packed_nj.shape
    blocks = scales_nb.shape[1]
    match dequant:
        case Dequant.PTX:
            lo, hi = _e2m1_halves_ptx(packed_nj)
            scale_nb = _scales_ptx(scales_nb)
        case Dequant.EXACT:
            lo, hi = (_e2m1_exact(nibbles) for nibbles in (packed_nj & 0xF, packed_nj >> 4))
            scale_nb = _e4m3_exact(scales_nb) * 2.0**-OPERAND_EXPONENT_DEFICIT
        case _:
            assert_never(dequant)
    match order:
        case Order.MODELOPT:
            w_nk = jnp.stack([lo, hi], axis=-1).reshape(rows, 2 * half)
            w_nbk = w_nk.reshape(rows, blocks, _BLOCK) * scale_nb[:, :, None].astype(w_nk.dtype)
        case Order.FRAGMENT:
            # Byte 16b + 4q + 2t + s holds elements 32b + 8q + 4t + 2s + {0, 1}; its scale is
            # block 2b + q // 2.
            scale_nbq = jnp.broadcast_to(scale_nb.reshape(rows, blocks // 2, 2, 1), (rows, blocks // 2, 2, 2))
            scale_nbq = scale_nbq.reshape(rows, blocks // 2, 4)[:, :, :, None, None].astype(lo.dtype)
            lo, hi = (v.reshape(rows, blocks // 2, 4, 2, 2) * scale_nbq for v in (lo, hi))
            w_nbk = jnp.stack([lo, hi], axis=-1).transpose(0, 1, 3, 5, 2, 4)
        case _:
            assert_never(order)
    return w_nbk.reshape(rows, 2 * half).astype(jnp.bfloat16)


# --- the kernel --------------------------------------------------------------------------------


def _raster(pid, *, num_tiles: int, num_n_tiles: int, group_t: int):
    """Program id -> (row tile, column tile), ``group_t`` row tiles per column sweep."""
    group_t = min(group_t, num_tiles)
    per_group = group_t * num_n_tiles
    first_t = (pid // per_group) * group_t
    rows_here = jnp.minimum(num_tiles - first_t, group_t)
    local = pid % per_group
    return first_t + local % rows_here, local // rows_here


class _Memory:
    """The kernel's loads and stores, optionally counting those that leave their buffer.

    Pallas' interpreter clamps out-of-range indices the way ``dynamic_slice`` does, so an
    interpreted kernel that reads past a buffer still gives plausible numbers while the
    compiled one reads foreign memory or faults. With ``KernelSpec.check_bounds`` every access
    first adds to a one-element output the number of its lanes whose index lies outside the
    ref's shape in any dimension, masked-off lanes excluded, using the very index and mask it
    then accesses with. Without it, :meth:`read` and :meth:`write` are the plain accesses.
    """

    def __init__(self, count_ref):
        self.count_ref = count_ref

    def read(self, ref, *index, mask=None, other=None):
        """``ref[index]``; ``index`` has one scalar or ``pl.ds`` per dimension of ``ref``."""
        self._count(ref, index, mask)
        if mask is None:
            return ref[index]
        return plgpu.load(ref.at[index], mask=mask, other=other)

    def write(self, ref, *index, value, mask):
        self._count(ref, index, mask)
        plgpu.store(ref.at[index], value, mask=mask)

    def _count(self, ref, index, mask):
        if self.count_ref is None:
            return
        lanes = [i.size for i in index if isinstance(i, pl.Slice)]
        outside = jnp.zeros((), bool)
        position = 0
        for dim, i in zip(ref.shape, index, strict=True):
            if isinstance(i, pl.Slice):
                shape = [1] * len(lanes)
                shape[position] = i.size
                at = (i.start + jnp.arange(i.size, dtype=jnp.int32)).reshape(shape)
                position += 1
            else:
                at = jnp.asarray(i, jnp.int32)
            outside = outside | (at < 0) | (at >= dim)
        outside = jnp.broadcast_to(outside, tuple(lanes))
        if mask is not None:
            outside = outside & mask
        self.count_ref[0] += jnp.sum(outside, dtype=jnp.int32)


def _kernel(tile_expert_ref, tile_start_ref, tile_end_ref, x_ref, *refs, spec: KernelSpec):
    match spec.weights:
        case WeightFormat.BF16:
            w_ref, *rest = refs
            weight_refs = (w_ref,)
        case WeightFormat.NVFP4:
            packed_ref, scales_ref, global_scale_ref, *rest = refs
            weight_refs = (packed_ref, scales_ref)
        case _:
            assert_never(spec.weights)
    # Outputs come last; aliased inputs before them are the same buffers.
    out_ref, count_ref = (rest[-2], rest[-1]) if spec.check_bounds else (rest[-1], None)
    memory = _Memory(count_ref)

    cfg = spec.config
    bm, bn, bk = cfg.block_m, spec.block_n, spec.block_k
    num_n_tiles = spec.n_out // bn
    t, j = _raster(pl.program_id(0), num_tiles=spec.max_tiles, num_n_tiles=num_n_tiles, group_t=cfg.group_t)
    expert, row_start, row_end = (memory.read(ref, t) for ref in (tile_expert_ref, tile_start_ref, tile_end_ref))
    n_start = pl.multiple_of(j * bn, bn)
    halves = (0, spec.n_out) if spec.op is Op.GATE_UP_SWIGLU else (0,)

    def weight_tile(half, i):
        """(row start, rows, column-tile index, columns) of the weight tile of K step ``i``.

        Forward, rows are output columns and columns the reduction; transposed, the reverse.
        Column offsets are formed as index * width (not start // 2): Triton cannot see the
        alignment of a floor division.
        """
        if spec.transpose_w:
            return pl.multiple_of(i * bk, bk), bk, j, bn
        return n_start + half, bn, i, bk

    def load_scales(half, i):
        row0, rows, c, cols = weight_tile(half, i)
        k_blocks = pl.multiple_of(c * (cols // _BLOCK), cols // _BLOCK)
        return memory.read(weight_refs[1], expert, pl.ds(row0, rows), pl.ds(k_blocks, cols // _BLOCK))

    def load_weight(half, i, scales):
        row0, rows, c, cols = weight_tile(half, i)
        match spec.weights:
            case WeightFormat.BF16:
                return memory.read(weight_refs[0], expert, pl.ds(row0, rows),
                                   pl.ds(pl.multiple_of(c * cols, cols), cols))
            case WeightFormat.NVFP4:
                k_bytes = pl.multiple_of(c * (cols // 2), cols // 2)
                packed = memory.read(weight_refs[0], expert, pl.ds(row0, rows), pl.ds(k_bytes, cols // 2))
                if scales is None:  # Not loaded first (KernelSpec.scales_first).
                    scales = load_scales(half, i)
                return dequantize_tile(packed, scales, spec.dequant, spec.order)
            case _:
                assert_never(spec.weights)

    @pl.when(row_start < row_end)
    def _():
        row_ok_m = row_start + jnp.arange(bm, dtype=jnp.int32) < row_end
        acc_shape = (bn, bm) if spec.swap_ab else (bm, bn)

        def body(i, accs):
            scales = [load_scales(half, i) if spec.scales_first else None for half in halves]
            k0 = pl.multiple_of(i * bk, bk)
            x_mk = memory.read(x_ref, pl.ds(row_start, bm), pl.ds(k0, bk), mask=row_ok_m[:, None], other=0.0)
            new = []
            for acc, half, scales_nb in zip(accs, halves, scales):
                w_tile = load_weight(half, i, scales_nb)  # [bn, bk], or [bk, bn] transposed
                w_k = 0 if spec.transpose_w else 1  # the tile's reduction axis
                lhs, rhs, dims = (w_tile, x_mk, (w_k, 1)) if spec.swap_ab else (x_mk, w_tile, (1, w_k))
                new.append(acc + jax.lax.dot_general(lhs, rhs, (((dims[0],), (dims[1],)), ((), ())),
                                                     preferred_element_type=jnp.float32))
            return tuple(new)

        accs = tuple(jnp.zeros(acc_shape, jnp.float32) for _ in halves)
        accs = jax.lax.fori_loop(0, spec.k // bk, body, accs)
        if spec.weights is WeightFormat.NVFP4:
            deficit = jnp.float32(2.0**OPERAND_EXPONENT_DEFICIT)
            if spec.scale_groups == 1:
                factor = memory.read(global_scale_ref, expert) * deficit
                accs = tuple(acc * factor for acc in accs)
            else:
                # Gate and up have their own global scales (KernelSpec.__post_init__ allows two
                # only for the fused op): each half's accumulator takes its own, in fp32 as above.
                accs = tuple(acc * (memory.read(global_scale_ref, expert, half) * deficit)
                             for half, acc in enumerate(accs))
        match spec.op:
            case Op.MATMUL:
                (y,) = accs
            case Op.GATE_UP_SWIGLU:
                gate, up = accs
                y = gate / (1.0 + jnp.exp(-gate)) * up
            case _:
                assert_never(spec.op)
        if spec.swap_ab:
            y = y.T
        memory.write(out_ref, pl.ds(row_start, bm), pl.ds(n_start, bn), value=y.astype(out_ref.dtype),
                     mask=row_ok_m[:, None])


def _same_varying_axes(operands):
    """Types every operand as varying over the union of their ``shard_map`` axes (a no-op
    cast) and returns them with that set, which the output then carries.

    Under ``shard_map(check_vma=True)`` a ``pallas_call`` must say how its outputs vary: wherever
    any input does (the expert weights vary over the expert axis only, the rows over every
    axis). Outside ``shard_map`` the set is empty and nothing is cast.
    """
    varying = frozenset().union(*(jax.typeof(a).manual_axis_type.varying for a in operands))
    cast = tuple(
        jax.lax.pcast(a, tuple(sorted(missing)), to="varying")
        if (missing := varying - jax.typeof(a).manual_axis_type.varying) else a
        for a in operands
    )
    return cast, varying


def launch(spec: KernelSpec, schedule, x_mk, weight_arrays, out_mn, *, interpret: bool):
    """Runs the kernel described by ``spec``.

    Args:
      spec: the static description.
      schedule: :func:`tile_schedule`'s three int32 ``[max_tiles]`` arrays.
      x_mk: bf16 ``[M, K]``.
      weight_arrays: ``(w_enk,)`` bf16, or ``(packed_enj uint8, scales_enb uint8, global_scale
        float32)``, the global scale ``[E]`` or, with ``spec.scale_groups == 2``, ``[E, 2]``.
        Transposed (``spec.transpose_w``), the weights are ``[E, K, n_out]`` (as stored).
      out_mn: None, or a bf16 ``[M, n_out]`` buffer aliased to the output.
      interpret: run in Pallas interpret mode.

    Returns:
      bf16 ``[M, n_out]``; with ``spec.check_bounds``, also the int32 ``[1]`` count of accesses
      outside their buffers (:class:`_Memory`).
    """
    op = f"{spec.op.value}_input_grad" if spec.transpose_w else spec.op.value
    return _call(
        functools.partial(_kernel, spec=spec), (*schedule, x_mk, *weight_arrays), (spec.num_rows, spec.n_out),
        jnp.bfloat16, out=out_mn, num_programs=spec.max_tiles * (spec.n_out // spec.block_n), config=spec.config,
        name=f"grouped_{op}_{spec.weights.value}_{spec.variant.value}", interpret=interpret,
        check_bounds=spec.check_bounds,
    )


def _call(kernel, operands, out_shape, out_dtype, *, out, num_programs: int, config: TileConfig, name: str,
          interpret: bool, check_bounds: bool):
    """One ``pallas_call`` on a 1-D grid: the output (aliased to ``out`` when given), typed
    for ``shard_map``, and the out-of-bounds count when ``check_bounds``."""
    if check_bounds and not interpret:
        raise ValueError("check_bounds: True needs interpret=True (the count is an interpreter check)")
    out_shapes = [(out_shape, out_dtype)]
    aliases = {}
    if out is not None:
        aliases[len(operands)] = 0
        operands = (*operands, out)
    if check_bounds:
        aliases[len(operands)] = 1  # The count starts at zero.
        operands = (*operands, jnp.zeros((1,), jnp.int32))
        out_shapes.append(((1,), jnp.int32))
    operands, varying = _same_varying_axes(operands)
    if not interpret:
        pallas_offsets.prepare(name, [op.shape for op in operands] + [shape for shape, _ in out_shapes])
    manual = jax.sharding.ManualAxisType(varying=varying)
    call = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=manual) for shape, dtype in out_shapes],
        grid=(num_programs,),
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        name=name,
    )
    with jax.named_scope(name):
        outs = call(*operands)
    return tuple(outs) if check_bounds else outs[0]


# --- the weight gradient -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class WeightGradSpec:
    """Everything static about one weight-gradient launch (hashable).

    ``config.block_m`` is the rows per reduction step, ``block_n``/``block_k`` the output tile.
    """

    config: TileConfig
    num_experts: int
    num_rows: int
    n: int
    k: int
    block_n: int
    block_k: int
    out_dtype: jnp.dtype
    check_bounds: bool = False


def group_bounds(group_sizes_e: jax.Array, *, num_rows: int):
    """``(starts_e, ends_e)`` int32 ``[E]``: each expert's rows, read as in :func:`tile_schedule`
    (``max(g, 0)``, cut off at ``num_rows``), so no row index can leave ``x``."""
    sizes_e = jnp.maximum(group_sizes_e.astype(jnp.int32), 0)
    ends_e = jnp.minimum(jnp.cumsum(sizes_e), num_rows)
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), ends_e[:-1]]), ends_e


def _weight_grad_kernel(starts_ref, ends_ref, x_ref, dy_ref, *refs, spec: WeightGradSpec):
    out_ref, count_ref = (refs[-2], refs[-1]) if spec.check_bounds else (refs[-1], None)
    memory = _Memory(count_ref)
    bm, bn, bk = spec.config.block_m, spec.block_n, spec.block_k
    n_tiles, k_tiles = spec.n // bn, spec.k // bk
    pid = pl.program_id(0)
    # Experts outermost: the programs of one expert run together and share its rows in L2.
    expert, tile = pid // (n_tiles * k_tiles), pid % (n_tiles * k_tiles)
    n_start = pl.multiple_of((tile // k_tiles) * bn, bn)
    k_start = pl.multiple_of((tile % k_tiles) * bk, bk)
    row_start, row_end = memory.read(starts_ref, expert), memory.read(ends_ref, expert)

    def body(i, acc_nk):
        rows = row_start + i * bm
        row_ok_m = rows + jnp.arange(bm, dtype=jnp.int32) < row_end
        dy_mn = memory.read(dy_ref, pl.ds(rows, bm), pl.ds(n_start, bn), mask=row_ok_m[:, None], other=0.0)
        x_mk = memory.read(x_ref, pl.ds(rows, bm), pl.ds(k_start, bk), mask=row_ok_m[:, None], other=0.0)
        return acc_nk + jax.lax.dot_general(dy_mn, x_mk, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)

    # An expert without rows gets zeros: its gradient, and every output element is written.
    steps = (row_end - row_start + bm - 1) // bm
    acc_nk = jax.lax.fori_loop(0, steps, body, jnp.zeros((bn, bk), jnp.float32))
    memory.write(out_ref, expert, pl.ds(n_start, bn), pl.ds(k_start, bk), value=acc_nk.astype(out_ref.dtype),
                 mask=None)


def launch_weight_grad(spec: WeightGradSpec, bounds, x_mk, dy_mn, out_enk, *, interpret: bool):
    """``dW [E, N, K]``: per expert ``dy_e^T @ x_e`` over its rows (:func:`group_bounds`).

    Args:
      spec: the static description.
      bounds: :func:`group_bounds`'s ``(starts_e, ends_e)``.
      x_mk: bf16 ``[M, K]``, the forward input.
      dy_mn: bf16 ``[M, N]``, the output cotangent.
      out_enk: None, or a ``[E, N, K]`` buffer of ``spec.out_dtype`` aliased to the output.
      interpret: run in Pallas interpret mode.

    Returns:
      ``spec.out_dtype`` ``[E, N, K]``, accumulated in fp32; with ``spec.check_bounds`` also
      the out-of-bounds count.
    """
    return _call(
        functools.partial(_weight_grad_kernel, spec=spec), (*bounds, x_mk, dy_mn), (spec.num_experts, spec.n, spec.k),
        spec.out_dtype, out=out_enk,
        num_programs=spec.num_experts * (spec.n // spec.block_n) * (spec.k // spec.block_k), config=spec.config,
        name=f"grouped_weight_grad_{jnp.dtype(spec.out_dtype).name}", interpret=interpret,
        check_bounds=spec.check_bounds,
    )
