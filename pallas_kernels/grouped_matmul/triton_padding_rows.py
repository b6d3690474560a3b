"""Zeroing the padding rows of ``[M, H]`` rows in place: the rows past ``sum(group_sizes)``, which
the grouped kernels leave unwritten (their contract), and which the input gradient must return as
zeros (a padding row has no defined output, so no gradient).

Why a kernel. XLA's formulation, ``expert_mlp.zero_padding_rows`` (a select), reads and writes
every row: at the training shape (48 experts x 32768 rows, H 7168) that is 0.94 GB and 0.34-0.35
ms of the bf16 step on an H100, 2% of it, where there are no padding rows at all
(``benchmarks/results/train_step_h100/c17e5d3_profile/``). This kernel writes only the padding
rows, in the buffer it is given (aliased, so XLA makes no copy when the rows are not used after),
and reads one number: without padding rows its programs load it and return.

Programs ``p = 0..P-1`` take the row tiles from the one holding row ``total`` on, ``p, p + P, ...``,
each ``BLOCK_M`` rows by every ``BLOCK_H`` column chunk, stores masked at ``total``, ``M`` and ``H``.
Row offsets are 64-bit: EP's receive buffers reach ``8 x 65536`` rows of 7168 (past 2**31
elements).

Dimension letters: ``m`` rows, ``h`` columns, ``e`` experts.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

from pallas_kernels.grouped_matmul import triton_launch
from pallas_kernels.grouped_matmul.expert_mlp import defined_rows

#: Rows a program zeroes at a time, and the columns of one store.
BLOCK_M, BLOCK_H = 16, 512
#: The most programs (each loops over its row tiles).
MAX_PROGRAMS = 1024
_TRITON_TYPES = {np.dtype(jnp.bfloat16): "*bf16", np.dtype(jnp.float16): "*fp16", np.dtype(jnp.float32): "*fp32"}


@triton.jit
def _kernel(total_ptr, out_in_ptr, out_ptr, M: tl.constexpr, H: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_H: tl.constexpr):
    """Rows ``[total, M)`` of ``out_ptr`` (``[M, H]``, row-major) set to zero; every other element
    untouched. ``total_ptr``: one int32, at least 0 (``out_in_ptr`` is ``out_ptr``'s buffer as
    passed in: never read)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    total = tl.load(total_ptr)
    local_m = tl.arange(0, BLOCK_M)
    local_h = tl.arange(0, BLOCK_H)
    zeros = tl.zeros((BLOCK_M, BLOCK_H), out_ptr.dtype.element_ty)
    for tile in range(total // BLOCK_M + pid, tl.cdiv(M, BLOCK_M), programs):
        row_m = tile * BLOCK_M + local_m
        pad_m = (row_m >= total) & (row_m < M)
        row_at = out_ptr + row_m.to(tl.int64)[:, None] * H
        for h_start in tl.static_range(0, H, BLOCK_H):
            col_h = h_start + local_h
            tl.store(row_at + col_h[None, :], zeros, mask=pad_m[:, None] & (col_h < H)[None, :])


def grid(num_rows: int) -> int:
    """Programs for ``num_rows`` rows: one per row tile, at most :data:`MAX_PROGRAMS`."""
    return max(1, min(-(-num_rows // BLOCK_M), MAX_PROGRAMS))


def launch_for(shape: tuple[int, int], dtype, *, compute_capability: int) -> triton_launch.Launch:
    """What :func:`.triton_launch.call` compiles and launches for ``[M, H]`` rows of ``dtype``."""
    m, h = shape
    out = _TRITON_TYPES[np.dtype(dtype)]
    signature = (("total_ptr", "*i32"), ("out_in_ptr", out), ("out_ptr", out))
    return triton_launch.Launch(kernel=_kernel, signature=signature,
                                constexprs=(("M", m), ("H", h), ("BLOCK_M", BLOCK_M), ("BLOCK_H", BLOCK_H)),
                                num_warps=4, num_stages=1, grid=grid(m), capability=compute_capability,
                                name=f"zero_padding_rows_{np.dtype(dtype).name}")


def zero_padding_rows(x_mh, group_sizes_e, *, compute_capability: int, interpret: bool = False) -> jax.Array:
    """``x_mh`` (``[M, H]``, bf16, float16 or float32) with rows ``sum(max(group_sizes_e, 0))``
    and on set to zero, written in place (the input buffer is the output's; XLA copies it first
    only where the input is used afterwards). Other rows are returned bit for bit.

    ``interpret`` must be False (a ``Backend``'s kernels take it): the kernel runs on a GPU;
    Triton's interpreter runs it in ``tests/interpreter/``.

    Raises:
      ValueError: naming the argument, for a bad shape or dtype.
    """
    triton_launch.not_interpreted(interpret)
    if x_mh.ndim != 2 or np.dtype(x_mh.dtype) not in _TRITON_TYPES:
        raise ValueError(f"x_mh: {x_mh.dtype}{list(x_mh.shape)}, expected [M, H] of bfloat16, float16 or float32")
    if group_sizes_e.ndim != 1 or group_sizes_e.dtype != jnp.int32:
        raise ValueError(f"group_sizes_e: {group_sizes_e.dtype}{list(group_sizes_e.shape)}, expected int32 [E]")
    if x_mh.size == 0:  # no rows (a device without any under EP) or no columns: nothing to zero
        return x_mh
    return _launch(x_mh, defined_rows(group_sizes_e).reshape(1), compute_capability)


@functools.partial(jax.jit, static_argnums=(2,))
def _launch(x_mh, total_1, compute_capability: int) -> jax.Array:
    launch = launch_for(x_mh.shape, x_mh.dtype, compute_capability=compute_capability)
    return triton_launch.call(launch, total_1, out=x_mh, out_shape=jax.ShapeDtypeStruct(x_mh.shape, x_mh.dtype))


__all__ = ["BLOCK_H", "BLOCK_M", "MAX_PROGRAMS", "grid", "launch_for", "zero_padding_rows"]
