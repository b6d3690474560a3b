"""Launching Triton-language kernels from JAX, and what every launch shares.

Most kernels go through ``jax_triton.triton_call``. It cannot launch two kinds, which
:func:`call` does, with the same jaxlib custom call (``triton_kernel_call``) underneath:

* kernels that make TMA descriptors on the device (``tl.make_tensor_descriptor``): Triton keeps
  them in a global scratch buffer whose pointer the launcher passes, and jax-triton 0.3.1 passes
  none (jaxlib fills that slot with a null pointer);
* kernels whose compiled warp count differs from the one the call names (Triton's
  ``tl.range(warp_specialize=True)`` adds a producer warp group): jax-triton launches the warps
  the call names, :func:`call` the compiled kernel's. (No kernel here is warp-specialized: the
  weight gradient's was wrong under Triton 3.6, ``triton_weight_grad``.)

:func:`call` compiles with ``triton.compile`` for the capability the caller names (so the same
kernel cross-compiles on a CPU, :mod:`pallas_kernels.crosscompile`), allocates the scratch as a
second output of the custom call, and types the outputs for ``shard_map`` as
:func:`same_varying_axes` does for jax-triton's.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import mlir


def not_interpreted(interpret: bool) -> None:
    """Raises for ``interpret=True``: the Triton-language kernels run on a GPU only."""
    if interpret:
        raise ValueError("interpret: True, expected False (the Triton-language kernels have no interpret mode under "
                         "JAX; Triton's own interpreter runs them in tests/interpreter)")


def same_varying_axes(outputs, operands):
    """Types the kernel's outputs as varying over every ``shard_map`` axis its operands vary over.

    Neither ``jax_triton``'s primitive nor :func:`call`'s has a rule for this (their abstract
    values drop the axes), so under ``shard_map(check_vma=True)`` an output would claim to be the
    same on every device.
    """
    varying = frozenset().union(*(jax.typeof(a).manual_axis_type.varying for a in operands))
    return [jax.lax.pcast(o, tuple(sorted(varying)), to="varying") if varying else o for o in outputs]


@dataclasses.dataclass(frozen=True)
class Launch:
    """Everything static about one :func:`call` (hashable: it keys the compile cache).

    ``signature``: the kernel's pointer arguments in order, as ``(name, triton type)``: the
    operands, then the output twice (the buffer passed in, which the kernel never reads, and the
    one it writes: the same memory when the caller passes ``out``); ``constexprs``: ``(name,
    value)`` pairs; ``num_warps`` as written (the launch reads the compiled count); ``grid``:
    programs in one dimension.
    """

    kernel: object  # a triton.JITFunction
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, object], ...]
    num_warps: int
    num_stages: int
    grid: int
    capability: int
    name: str


@functools.cache
def compile_launch(launch: Launch):
    """``triton.compile`` of the launch's kernel for its capability (no GPU needed), every pointer
    declared 16-byte aligned as jax-triton declares XLA's buffers."""
    from pallas_kernels.crosscompile import jit_source, triton_compile  # noqa: PLC0415

    constexprs = dict(launch.constexprs)
    signature = {**dict(launch.signature), **{name: "constexpr" for name in constexprs}}
    return triton_compile(jit_source(launch.kernel, signature=signature, constexprs=constexprs), launch.capability,
                          {"num_warps": launch.num_warps, "num_stages": launch.num_stages})


def scratch_bytes(launch: Launch) -> int:
    """The global scratch the launch needs: the compiled kernel's bytes per program, times the
    programs (at least one byte: XLA has no empty buffers to pass)."""
    return max(1, int(compile_launch(launch).metadata.global_scratch_size) * launch.grid)


_call_p = Primitive("moe_jax_triton_call")
_call_p.multiple_results = True


@_call_p.def_abstract_eval
def _abstract(*avals, launch: Launch, out_shape: jax.ShapeDtypeStruct, aliased: bool):
    del avals, aliased
    return (jax.core.ShapedArray(out_shape.shape, out_shape.dtype),
            jax.core.ShapedArray((scratch_bytes(launch),), jnp.uint8))


def _lowering(ctx, *operands, launch: Launch, out_shape: jax.ShapeDtypeStruct, aliased: bool):
    del out_shape
    from jax._src.lib import gpu_triton  # noqa: PLC0415 (CUDA plugin only)

    compiled = compile_launch(launch)
    meta = compiled.metadata
    kernel = gpu_triton.TritonKernel(meta.name, int(meta.num_warps), 1, int(meta.shared), compiled.asm["ptx"], "",
                                     launch.capability)
    # The kernel's pointers (the operands, the output passed in, the output), then the scratch
    # output in the slot Triton appends for its global scratch (jaxlib appends null pointers for
    # the slots after it).
    params = [gpu_triton.create_array_parameter(0, 16) for _ in launch.signature]
    params.append(gpu_triton.create_array_parameter(0, int(meta.global_scratch_align) if meta.global_scratch_size
                                                    else 0))
    kernel_call = gpu_triton.TritonKernelCall(kernel, launch.grid, 1, 1, params)
    rule = jax.ffi.ffi_lowering("triton_kernel_call", api_version=2,
                                backend_config=zlib.compress(kernel_call.to_proto(launch.name, b"")),
                                operand_output_aliases={len(operands) - 1: 0} if aliased else None)
    return rule(ctx, *operands)


mlir.register_lowering(_call_p, _lowering, platform="cuda")


def call(launch: Launch, *operands, out_shape: jax.ShapeDtypeStruct, out=None) -> jax.Array:
    """Runs ``launch``'s kernel on ``operands`` (its pointer arguments before the output, in
    order) and returns its output, written into ``out`` (aliased) when given, else into a fresh
    buffer the kernel must write whole."""
    if len(operands) + 2 != len(launch.signature):
        raise ValueError(f"operands: {len(operands)}, expected {len(launch.signature) - 2} (the kernel's pointer "
                         "arguments before its output)")
    # The output's first pointer: the caller's buffer, or a placeholder the kernel never reads.
    operands = (*operands, jnp.zeros((1,), out_shape.dtype) if out is None else out)
    with jax.named_scope(launch.name):
        result, _ = _call_p.bind(*operands, launch=launch, out_shape=out_shape, aliased=out is not None)
    return same_varying_axes([result], operands)[0]


__all__ = ["Launch", "call", "compile_launch", "not_interpreted", "same_varying_axes", "scratch_bytes"]
