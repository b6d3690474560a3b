"""Candidate: a warp-specialized (producer/consumer) bf16 grouped GEMM for SM90, triton 3.6.

A probe, not a backend: it lives beside its benchmark, outside the library, and nothing dispatches
to it. ``benchmarks/ws_probe.py`` times it against ``triton_lang.bf16_matmul`` on an H200; there
(``benchmarks/results/ws_probe_h200/``) the variants with 64 extra rows per tile, and the fused
128-row one, left rows unwritten: a defect not seen in the interpreter, which runs the loop
unspecialized (benchmarks/NOTES.md, "Prefill at 384 experts", 2026-12-04).

What triton 3.6's Hopper warp specialization (``NVGPUWarpSpecialization``, run for capability
9x in ``make_ttgir`` as ``add_hopper_warpspec``) takes, found by cross-compiling small kernels:

* the loop ``tl.range(..., warp_specialize=True)``;
* loads through tensor descriptors (``tl.make_tensor_descriptor``, TMA): the same loop with
  pointer ``tl.load``s fails in that pass (``PassManager::run failed``);
* ``num_warps=4``: the pass then builds one producer warp group (TMA, 40 registers after
  ``setmaxnreg.dec``) and two consumer warp groups (``setmaxnreg.inc`` 232) that split the
  dot's M (here the weight rows) between them: 12 warps, 384 threads. With ``num_warps=8`` the
  same source compiles unspecialized (256 threads, no ``setmaxnreg``), which is what the earlier
  session saw;
* a non-persistent loop (one tile per program). The persistent tutorial form (outer
  ``tl.range(..., flatten=True, warp_specialize=True)``) compiled unspecialized;
* no reshape of a descriptor-loaded tile: gate and up stacked by a 3D descriptor and reshaped
  to one ``[2 * BLOCK_N, BLOCK_K]`` operand failed in the pass; two 2D loads and two dots (two
  accumulators) specialize;
* not the W4A16 kernel's shape: the same loop with the packed words and E4M3 scales loaded by
  descriptors (block_k 256: a descriptor's last block dimension needs 16 bytes, the scales of
  block_k 128 have 8) and dequantized in registers (``triton_lang._dequantize_w4a16``) before
  ``tl.dot`` fails in ``NVGPUWarpSpecialization`` (``PassManager::run failed``): the pass
  partitions TMA loads feeding dots from shared memory, not a register-A operand computed by
  the consumer. NVFP4 on SM90 needs Gluon's ``gl.warp_specialize`` (explicit partitions).

Two things jax-triton 0.3.1 cannot do for such a kernel, so it is launched by :func:`_ws_call`,
a primitive of this module around ``triton.compile`` and jaxlib's ``triton_kernel_call``:

* warp specialization changes the kernel's warp count (``metadata.num_warps`` 12, the PTX's
  ``.reqntid 384``), but jax-triton launches with the call's ``num_warps`` (4);
* device-side descriptors live in Triton's global scratch (``metadata.global_scratch_size``
  bytes per program), and jaxlib passes a null pointer for it. Here the scratch is one more
  output buffer, the last array parameter: the kernel's parameters are the user's pointers, then
  global scratch, then profile scratch, so that buffer lands in the global-scratch slot (jaxlib's
  own two trailing null pointers fill the profile slot and one that the kernel does not read).

The schedule is ``triton_lang``'s swap-AB one without its 192-row path: each tile is at most
``BLOCK_M`` rows of one expert (``pallas_triton.tile_schedule``), the weight tile is the MMA's
M operand, the token rows its N. Rows past an expert's end are loaded (they are the next
expert's, or zeros past M: TMA fills out-of-bounds boxes with zeros) and never stored.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl
from jax.extend.core import Primitive
from jax.interpreters import mlir

from pallas_kernels.grouped_matmul import pallas_triton
from pallas_kernels.grouped_matmul.triton_lang import _program_tile  # noqa: F401 (called by the kernel)
from pallas_kernels.grouped_matmul.tuning import Op


@triton.jit
def ws_bf16_kernel(tile_expert_ptr, tile_start_ptr, tile_end_ptr, x_ptr, w_ptr, out_in_ptr, out_ptr,
                   M: tl.constexpr,
                   E: tl.constexpr, K: tl.constexpr, N_OUT: tl.constexpr, FUSED: tl.constexpr,
                   NUM_TILES: tl.constexpr, BLOCK_M: tl.constexpr, EXTRA_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, GROUP_T: tl.constexpr, NUM_STAGES: tl.constexpr):
    """One tile: rows ``[row_start, min(row_end, row_start + BLOCK_M + EXTRA_M))`` of one expert x output
    columns ``[j BLOCK_N, (j + 1) BLOCK_N)``. ``x`` bf16 ``[M, K]``, ``w`` bf16 ``[E, N_W, K]``
    (``N_W = 2 N_OUT`` for the fused gate/up: gate rows, then up rows), ``out`` bf16 ``[M, N_OUT]``
    (``out_in_ptr`` is the same buffer, aliased: never read). ``EXTRA_M > 0``: a second dot of
    ``EXTRA_M`` rows against the same weight tile, always run (no branch inside the specialized
    loop): ~170 rows per expert fill 192 MMA rows in one tile, not two tiles' 256."""
    t, j = _program_tile(NUM_TILES, N_OUT // BLOCK_N, GROUP_T)
    row_start = tl.load(tile_start_ptr + t)
    row_end = tl.load(tile_end_ptr + t)
    expert = tl.load(tile_expert_ptr + t)
    H: tl.constexpr = 2 if FUSED else 1
    x_d = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    w_d = tl.make_tensor_descriptor(w_ptr, shape=[E * H * N_OUT, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    # An unused tile slot (start == end == 0) runs no K step and stores nothing: a branch around
    # the loop is not needed (and the warp-specialized loop stays the kernel's only loop).
    n_k = tl.where(row_start < row_end, K // BLOCK_K, 0)
    w_row = expert * (H * N_OUT) + j * BLOCK_N
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    XM: tl.constexpr = EXTRA_M if EXTRA_M > 0 else 16  # placeholder shape when there are no extra rows
    acc2 = tl.zeros((BLOCK_N, XM), tl.float32)
    acc2_u = tl.zeros((BLOCK_N, XM), tl.float32)
    if EXTRA_M > 0:
        x2_d = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[K, 1], block_shape=[EXTRA_M, BLOCK_K])
    for i in tl.range(0, n_k, num_stages=NUM_STAGES, warp_specialize=True):
        x = x_d.load([row_start, i * BLOCK_K])
        w_g = w_d.load([w_row, i * BLOCK_K])
        acc = tl.dot(w_g, x.T, acc)
        if FUSED:
            w_u = w_d.load([w_row + N_OUT, i * BLOCK_K])
            acc_u = tl.dot(w_u, x.T, acc_u)
        if EXTRA_M > 0:
            x2 = x2_d.load([row_start + BLOCK_M, i * BLOCK_K])
            acc2 = tl.dot(w_g, x2.T, acc2)
            if FUSED:
                acc2_u = tl.dot(w_u, x2.T, acc2_u)
    _store(acc, acc_u, out_ptr, row_start, row_end, 0, j, N_OUT, FUSED, BLOCK_M, BLOCK_N)
    if EXTRA_M > 0:
        _store(acc2, acc2_u, out_ptr, row_start, row_end, BLOCK_M, j, N_OUT, FUSED, EXTRA_M, BLOCK_N)


@triton.jit
def _store(acc, acc_u, out_ptr, row_start, row_end, first: tl.constexpr, j, N_OUT: tl.constexpr, FUSED: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """SwiGLU (fused op) and the masked store of rows ``row_start + first + [0, BLOCK_M)``."""
    if FUSED:
        y = acc / (1.0 + tl.exp(-acc)) * acc_u
    else:
        y = acc
    local_m = first + tl.arange(0, BLOCK_M)
    ok_m = row_start + local_m < row_end
    cols_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
    out_at = out_ptr + (row_start + local_m)[None, :].to(tl.int64) * N_OUT + cols_n[:, None]
    tl.store(out_at, y.to(tl.bfloat16), mask=ok_m[None, :])


@dataclasses.dataclass(frozen=True, kw_only=True)
class WsSpec:
    """Everything static about one launch (hashable)."""

    op: Op
    num_rows: int
    num_experts: int
    k: int
    n_out: int
    block_m: int = 128
    extra_m: int = 0
    block_n: int = 128
    block_k: int = 64
    num_stages: int = 4
    group_t: int = 8
    num_warps: int = 4  # per warp group: 4 is what the Hopper pass specializes

    @property
    def max_tiles(self) -> int:
        return pallas_triton.max_tiles(self.num_rows, self.num_experts, self.rows_per_tile)

    @property
    def rows_per_tile(self) -> int:
        return self.block_m + self.extra_m

    @property
    def num_programs(self) -> int:
        return self.max_tiles * (self.n_out // self.block_n)

    def constexprs(self) -> dict:
        return dict(M=self.num_rows, E=self.num_experts, K=self.k, N_OUT=self.n_out, FUSED=self.op is Op.GATE_UP_SWIGLU,
                    NUM_TILES=self.max_tiles, BLOCK_M=self.block_m, EXTRA_M=self.extra_m, BLOCK_N=self.block_n, BLOCK_K=self.block_k,
                    GROUP_T=min(self.group_t, self.max_tiles), NUM_STAGES=self.num_stages)


SIGNATURE = dict(tile_expert_ptr="*i32", tile_start_ptr="*i32", tile_end_ptr="*i32", x_ptr="*bf16", w_ptr="*bf16",
                 out_in_ptr="*bf16", out_ptr="*bf16")


def source(spec: WsSpec):
    """The ``triton.compile`` source (every pointer 16-byte aligned, as XLA's buffers are)."""
    from triton.compiler import ASTSource  # noqa: PLC0415

    fn = ws_bf16_kernel
    constexprs = spec.constexprs()
    return ASTSource(fn=fn, signature={**SIGNATURE, **{name: "constexpr" for name in constexprs}},
                     constexprs={(fn.arg_names.index(name),): value for name, value in constexprs.items()},
                     attrs={(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in SIGNATURE})


@functools.cache
def compile_kernel(spec: WsSpec, capability: int = 90):
    """``triton.compile`` for ``capability`` (works without a GPU: cross-compilation)."""
    from pallas_kernels.crosscompile import _triton_compile  # noqa: PLC0415

    return _triton_compile(source(spec), capability, {"num_warps": spec.num_warps, "num_stages": spec.num_stages})


def kernel_facts(kernel) -> dict:
    """Whether the compiled kernel is warp-specialized, and its resources as triton reports them."""
    ptx, ttgir = kernel.asm["ptx"], kernel.asm["ttgir"]
    threads = re.search(r"\.reqntid\s+(\d+)", ptx)
    return dict(
        warp_specialized="ttg.warp_specialize" in ttgir,
        setmaxnreg=sorted(set(re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx))),
        num_warps=int(kernel.metadata.num_warps), threads=int(threads.group(1)) if threads else None,
        shared_bytes=int(kernel.metadata.shared), global_scratch_bytes=int(kernel.metadata.global_scratch_size),
        global_scratch_align=int(kernel.metadata.global_scratch_align), tma="cp.async.bulk.tensor" in ptx,
        wgmma="wgmma.mma_async" in ptx)


# --- the launch: a primitive around triton.compile and jaxlib's triton_kernel_call ----------------

_ws_call_p = Primitive("moe_jax_ws_triton_call")
_ws_call_p.multiple_results = True


def _scratch_bytes(spec: WsSpec, kernel) -> int:
    return max(1, int(kernel.metadata.global_scratch_size) * spec.num_programs)


@_ws_call_p.def_abstract_eval
def _ws_call_abstract(*avals, spec: WsSpec, scratch_bytes: int):
    del avals
    return (jax.core.ShapedArray((spec.num_rows, spec.n_out), jnp.bfloat16),
            jax.core.ShapedArray((scratch_bytes,), jnp.uint8))


def _ws_call_lowering(ctx, *args, spec: WsSpec, scratch_bytes: int):
    from jax._src.lib import gpu_triton  # noqa: PLC0415 (CUDA plugin only)

    kernel = compile_kernel(spec, 90)
    meta = kernel.metadata
    # The launch's block is the kernel's total warps after specialization, not the 4 asked for.
    tk = gpu_triton.TritonKernel(meta.name, int(meta.num_warps), 1, int(meta.shared), kernel.asm["ptx"],
                                 kernel.asm["ttir"], 90)
    # Seven user pointers (6 inputs, the last aliased to the output; the output), then the
    # scratch buffer (the global-scratch slot); Triton aligns each program's scratch slice to
    # global_scratch_align from the base, so the base is checked for it.
    params = [gpu_triton.create_array_parameter(0, 16) for _ in range(7)]
    params.append(gpu_triton.create_array_parameter(0, int(meta.global_scratch_align) if meta.global_scratch_size
                                                    else 0))
    call = gpu_triton.TritonKernelCall(tk, spec.num_programs, 1, 1, params)
    proto = call.to_proto(f"ws_bf16_{spec.op.value}", b"")
    rule = jax.ffi.ffi_lowering("triton_kernel_call", api_version=2, backend_config=zlib.compress(proto),
                                operand_output_aliases={5: 0})
    return rule(ctx, *args)


mlir.register_lowering(_ws_call_p, _ws_call_lowering, platform="cuda")


def make_spec(op: Op, *, num_rows: int, num_experts: int, k: int, n_out: int, **tile) -> WsSpec:
    spec = WsSpec(op=op, num_rows=num_rows, num_experts=num_experts, k=k, n_out=n_out, **tile)
    if k % spec.block_k or n_out % spec.block_n:
        raise ValueError(f"k={k}, n_out={n_out}: expected multiples of block_k={spec.block_k}, "
                         f"block_n={spec.block_n}")
    return spec


@functools.partial(jax.jit, static_argnums=(0,))
def launch(spec: WsSpec, group_sizes_e, x_mk, w, out=None):
    """bf16 ``[M, n_out]``, written into ``out`` (aliased) where given, else into zeros; rows past
    ``sum(group_sizes_e)`` keep its values."""
    kernel = compile_kernel(spec, 90)
    schedule = pallas_triton.tile_schedule(group_sizes_e, num_rows=spec.num_rows, block_m=spec.rows_per_tile,
                                            num_tiles=spec.max_tiles)
    if out is None:
        out = jnp.zeros((spec.num_rows, spec.n_out), jnp.bfloat16)
    y, _ = _ws_call_p.bind(*schedule, x_mk, w, out, spec=spec, scratch_bytes=_scratch_bytes(spec, kernel))
    return y


def bf16_matmul(op: Op, x_mk, w, group_sizes_e, *, out=None, **tile) -> jax.Array:
    """``triton_lang.bf16_matmul``'s contract (``transpose_w`` False, SM90), warp-specialized."""
    m, k = x_mk.shape
    if np.dtype(x_mk.dtype) != np.dtype(jnp.bfloat16) or np.dtype(w.dtype) != np.dtype(jnp.bfloat16):
        raise ValueError(f"x_mk {x_mk.dtype}, w {w.dtype}: expected bfloat16")
    e, n_w, k_w = w.shape
    if k_w != k or e != group_sizes_e.shape[0]:
        raise ValueError(f"w: {list(w.shape)}, expected [E={group_sizes_e.shape[0]}, N, K={k}]")
    n_out = n_w // 2 if op is Op.GATE_UP_SWIGLU else n_w
    return launch(make_spec(op, num_rows=m, num_experts=e, k=k, n_out=n_out, **tile), group_sizes_e, x_mk, w, out)


__all__ = ["WsSpec", "bf16_matmul", "compile_kernel", "kernel_facts", "launch", "make_spec", "ws_bf16_kernel"]
