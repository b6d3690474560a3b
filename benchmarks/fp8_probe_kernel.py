"""Probe: how much would Hopper's FP8 tensor cores give the routed grouped GEMMs (W4A8)?

A probe beside its benchmark (``benchmarks/fp8_probe.py``), outside the library; nothing
dispatches to it. One kernel with ``triton_lang``'s prefill schedule (swap-AB: the weight tile is
the MMA's M operand, 64 + 64 weight rows per warp group pair, token rows on N in tiles of 64, 128
or 128 + 64 of one expert, ``pallas_triton.tile_schedule``), in four modes that differ only in
what the MMA multiplies:

* ``BF16``: bf16 weights ``[E, N_W, K]`` and bf16 rows from memory (both ``wgmma`` operands in
  shared memory): the same schedule's bf16 rate;
* ``FP8``: E4M3 weights and E4M3 rows from memory: the FP8 tensor cores' rate on this schedule
  with nothing dequantized, the ceiling of any W4A8 kernel built on it;
* ``W4A16``: NVFP4 weights as stored, dequantized to bf16 by ``triton_lang``'s own code (the
  table kernel's inner loop in this skeleton: the baseline the W4A8 mode differs from only in its
  dequantization and MMA), bf16 rows in ``triton_lang.permute_k``'s order for block_k 128;
* ``W4A8``: NVFP4 weights as stored (ModelOpt's packed codes, E4M3 block scales), each word of 8
  codes placed into E4M3 and scaled in registers by :data:`triton_lang._WORD_TO_E4M3_PTX`, E4M3 rows; the
  register operand of ``wgmma ... k32 .e4m3``. The rows' columns are in :func:`permute_k`'s order.

W4A8 numerics (``benchmarks/w4a8_numerics.py``, NOTES section 1): a code ``c`` (E2M1) placed bit for
bit into an E4M3 byte is ``c * 2**-6``; converted to f16 and multiplied by ``scale * 2**3`` (the
block scale, exact in f16) it is ``c * scale * 2**-3`` exactly (at most 6 significant bits), and
its conversion back to E4M3 rounds it to 4 (satfinite; ``6 * 448 * 2**-3 = 336`` fits). The
epilogue multiplies by ``2**3``; global scales are left out (the probe's weights have none), as is
each row's activation scale (the harness's rows are E4M3 values as they are).

Not the library's kernel: no checks, one block_k (128, the table's prefill tile), no rows by index.
"""

from __future__ import annotations

import dataclasses
import enum
import functools

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from pallas_kernels.grouped_matmul import pallas_triton
from pallas_kernels.grouped_matmul.triton_lang import (
    _dequantize_w4a8, _dequantize_w4a16, _epilogue, _program_tile, permute_k_w4a8,
)
from pallas_kernels.grouped_matmul.tuning import Op


class Mode(enum.Enum):
    BF16 = 0
    FP8 = 1
    W4A8 = 2
    W4A16 = 3


#: Columns per K step: a thread's 4 words of codes per row are one 16-byte load.
BLOCK_K = tl.constexpr(128)
ROWS = 192  # token rows per tile at most: 128 + 64


def permute_k(x_mk):
    """``x [M, K]`` -> its columns in the order of the W4A8 tiles for block_k 128
    (``triton_lang.permute_k_w4a8``)."""
    return permute_k_w4a8(x_mk, BLOCK_K.value)


@triton.jit
def _kernel(tile_expert_ptr, tile_start_ptr, tile_end_ptr, x_ptr, w_ptr, w_scale_ptr, out_in_ptr, out_ptr,
            K: tl.constexpr, N_OUT: tl.constexpr, N_W: tl.constexpr, FUSED: tl.constexpr, MODE: tl.constexpr,
            NUM_TILES: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_T: tl.constexpr, NUM_STAGES: tl.constexpr):
    """One tile of up to 128 + 64 token rows of one expert x ``BLOCK_N`` output columns.
    ``out_in_ptr`` is ``out_ptr``'s buffer (aliased: the harness poisons it), never read."""
    t, j = _program_tile(NUM_TILES, N_OUT // BLOCK_N, GROUP_T)
    row_start = tl.load(tile_start_ptr + t)
    row_end = tl.load(tile_end_ptr + t)
    if row_start < row_end:
        expert = tl.load(tile_expert_ptr + t).to(tl.int64)
        rows = row_end - row_start
        if rows <= 64:
            _tile(row_start, row_end, expert, j, x_ptr, w_ptr, w_scale_ptr, out_ptr, K, N_OUT, N_W, FUSED, MODE, 64,
                  0, BLOCK_N, NUM_STAGES)
        elif rows <= 128:
            _tile(row_start, row_end, expert, j, x_ptr, w_ptr, w_scale_ptr, out_ptr, K, N_OUT, N_W, FUSED, MODE, 128,
                  0, BLOCK_N, NUM_STAGES)
        else:
            _tile(row_start, row_end, expert, j, x_ptr, w_ptr, w_scale_ptr, out_ptr, K, N_OUT, N_W, FUSED, MODE, 128,
                  64, BLOCK_N, NUM_STAGES)


@triton.jit
def _tile(row_start, row_end, expert, j, x_ptr, w_ptr, w_scale_ptr, out_ptr, K: tl.constexpr, N_OUT: tl.constexpr,
          N_W: tl.constexpr, FUSED: tl.constexpr, MODE: tl.constexpr, BLOCK_M: tl.constexpr, EXTRA_M: tl.constexpr,
          BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr):
    first_row = row_start.to(tl.int64)
    R: tl.constexpr = 2 * BLOCK_N if FUSED else BLOCK_N
    r = tl.arange(0, R)
    half_r = r // BLOCK_N
    w_row_r = half_r * N_OUT + j * BLOCK_N + r % BLOCK_N
    if MODE >= 2:  # packed NVFP4 words and their E4M3 block scales
        w_at = (w_ptr.to(tl.pointer_type(tl.int32)) + expert * (N_W * (K // 8))
                + (w_row_r[:, None] * (K // 8) + tl.arange(0, BLOCK_K // 8)[None, :]))
        ws_at = (w_scale_ptr + expert * (N_W * (K // 16))
                 + (w_row_r[:, None] * (K // 16) + tl.arange(0, BLOCK_K // 16)[None, :]))
    else:
        w_at = w_ptr + expert * (N_W * K) + (w_row_r[:, None] * K + tl.arange(0, BLOCK_K)[None, :])
        ws_at = w_scale_ptr
    local_m = tl.arange(0, BLOCK_M)
    row_ok_m = row_start + local_m < row_end
    x_at = x_ptr + first_row * K + (local_m[:, None] * K + tl.arange(0, BLOCK_K)[None, :])
    acc = tl.zeros((R, BLOCK_M), tl.float32)
    if EXTRA_M > 0:
        local_x = BLOCK_M + tl.arange(0, EXTRA_M)
        row_ok_x = row_start + local_x < row_end
        x2_at = x_ptr + first_row * K + (local_x[:, None] * K + tl.arange(0, BLOCK_K)[None, :])
        acc2 = tl.zeros((R, EXTRA_M), tl.float32)
    for i in tl.range(0, K // BLOCK_K, num_stages=NUM_STAGES):
        x_mk = tl.load(x_at + i * BLOCK_K, mask=row_ok_m[:, None], other=0.0)
        if MODE == 2:
            w_rk = _dequantize_w4a8(tl.load(w_at + i * (BLOCK_K // 8)), tl.load(ws_at + i * (BLOCK_K // 16)), R,
                                     BLOCK_K)
        elif MODE == 3:  # triton_lang's W4A16 dequantization: value * scale * 2**-7 in bf16
            w_rk = _dequantize_w4a16(tl.load(w_at + i * (BLOCK_K // 8)), tl.load(ws_at + i * (BLOCK_K // 16)), R,
                                     BLOCK_K)
        else:
            w_rk = tl.load(w_at + i * BLOCK_K)
        acc = tl.dot(w_rk, tl.trans(x_mk), acc)
        if EXTRA_M > 0:
            x2_mk = tl.load(x2_at + i * BLOCK_K, mask=row_ok_x[:, None], other=0.0)
            acc2 = tl.dot(w_rk, tl.trans(x2_mk), acc2)
    # triton_lang's epilogue as its bf16 mode runs it (no global scales, G = 0: the pointers are
    # not read), after the 2**3 the E4M3 weights were scaled down by (W4A16's operand: 2**7).
    factor: tl.constexpr = 8.0 if MODE == 2 else 128.0 if MODE == 3 else 1.0
    _epilogue(acc * factor, local_m, row_ok_m, first_row, expert, j, half_r, out_ptr, out_ptr, out_ptr, N_OUT, 0,
              FUSED, False, False, True, BLOCK_M, BLOCK_N, 0)
    if EXTRA_M > 0:
        _epilogue(acc2 * factor, local_x, row_ok_x, first_row, expert, j, half_r, out_ptr, out_ptr, out_ptr, N_OUT, 0,
                  FUSED, False, False, True, EXTRA_M, BLOCK_N, 0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProbeSpec:
    """One launch (hashable: it keys the jit cache)."""

    mode: Mode
    op: Op
    num_rows: int
    num_experts: int
    k: int
    n_out: int
    block_n: int = 64
    num_warps: int = 8
    #: None: 2 for bf16 (3 stages of 128 x 128 weights and 192 x 128 rows would need 240 KB), else 3.
    stages: int | None = None
    group_t: int = 8

    @property
    def num_stages(self) -> int:
        return self.stages or (2 if self.mode is Mode.BF16 else 3)

    @property
    def kernel(self):
        return _kernel

    @property
    def weight_rows(self) -> int:
        return 2 * self.n_out if self.op is Op.GATE_UP_SWIGLU else self.n_out

    @property
    def max_tiles(self) -> int:
        return pallas_triton.max_tiles(self.num_rows, self.num_experts, ROWS)

    @property
    def num_programs(self) -> int:
        return self.max_tiles * (self.n_out // self.block_n)

    def constexprs(self) -> dict:
        return dict(K=self.k, N_OUT=self.n_out, N_W=self.weight_rows, FUSED=self.op is Op.GATE_UP_SWIGLU,
                    MODE=self.mode.value, BLOCK_N=self.block_n, GROUP_T=min(self.group_t, self.max_tiles),
                    NUM_STAGES=self.num_stages, NUM_TILES=self.max_tiles)

    def signature(self) -> dict[str, str]:
        """Argument types for ``triton.compile`` (cross-compilation, no GPU)."""
        x = "*bf16" if self.mode in (Mode.BF16, Mode.W4A16) else "*fp8e4nv"
        w = {Mode.BF16: "*bf16", Mode.FP8: "*fp8e4nv", Mode.W4A8: "*u8", Mode.W4A16: "*u8"}[self.mode]
        types = ["*i32", "*i32", "*i32", x, w, "*u8", "*bf16", "*bf16"]
        return {**dict(zip(self.kernel.arg_names, types, strict=False)),
                **dict.fromkeys(self.constexprs(), "constexpr")}


@functools.partial(jax.jit, static_argnums=(0,))
def launch(spec: ProbeSpec, group_sizes_e, x_mk, w, w_scales_u8, out=None):
    """bf16 ``[M, n_out]``. ``x_mk``: bf16 (BF16; W4A16 in ``triton_lang.permute_k``'s column order
    for block_k 128) or float8_e4m3fn ``[M, K]`` (W4A8: in :func:`permute_k`'s column order).
    ``w``: bf16 or float8_e4m3fn ``[E, N_W, K]``, or (W4A8, W4A16) uint8 ``[E, N_W, K/2]`` packed
    codes with ``w_scales_u8`` uint8 ``[E, N_W, K/16]`` (E4M3 bits; else any uint8 array).
    ``out``: None, or a bf16 buffer written into (aliased: rows past ``sum(group_sizes_e)`` keep
    its values, else they are unspecified)."""
    import jax_triton  # noqa: PLC0415 (needs a GPU jaxlib)

    schedule = pallas_triton.tile_schedule(group_sizes_e, num_rows=spec.num_rows, block_m=ROWS,
                                            num_tiles=spec.max_tiles)
    # jax-triton passes the operands in order, then the output: the kernel's last two pointers.
    operands = (*schedule, x_mk, w, w_scales_u8, jnp.zeros((1,), jnp.bfloat16) if out is None else out)
    aliases = None if out is None else {len(operands) - 1: 0}
    return jax_triton.triton_call(
        *operands, kernel=spec.kernel, out_shape=jax.ShapeDtypeStruct((spec.num_rows, spec.n_out), jnp.bfloat16),
        grid=(spec.num_programs,), num_warps=spec.num_warps, num_stages=spec.num_stages,
        name=f"fp8_probe_{spec.mode.name.lower()}",
        input_output_aliases=aliases, **spec.constexprs())


__all__ = ["BLOCK_K", "Mode", "ProbeSpec", "launch", "permute_k"]
