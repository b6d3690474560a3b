"""64-bit pointer offsets for this library's Pallas-Triton operands of 2**31 elements or more.

JAX's Pallas Triton lowering (``jax._src.pallas.triton.lowering``, jax 0.11.2 and 0.12)
computes each load's and store's element offsets in 32-bit integers unless the operand is
larger than 2**32 *bytes*. Triton's ``tt.addptr`` sign-extends a 32-bit offset, so an operand
of one-byte elements between 2 and 4 GiB is addressed wrongly past its first 2**31 bytes: the
offset wraps to a negative number, and the kernel reads (or faults) before the buffer. That
is exactly the NVFP4 down projection of Kimi K2 (384 experts x 7168 x 1024 packed bytes,
2.8 GB): every expert from 293 on was read from the wrong place, and depending on where the
allocator put the buffer the read faulted (``CUDA_ERROR_ILLEGAL_ADDRESS``). Operands of two
or more bytes per element cannot hit this: below 2**32 bytes they have fewer than 2**31
elements.

The fix touches nothing until this library launches a kernel, and then only this library's
kernels: :func:`prepare`, called for every ``pallas_call`` the kernels make, records the
kernel's name and installs (once) two wrappers into the lowering. One marks the lowering of a
recorded kernel; the other, the lowering's offset computation, gives an operand of 2**31
elements or more 64-bit offsets while a recorded kernel is lowered, and passes every other
call through untouched, so no other library's kernel lowers differently
(``tests/pallas_kernels/test_offsets.py`` checks both, and the lowered Triton IR of every
kernel at the largest published shapes). The wrappers are verified for the JAX versions in
:data:`VERIFIED_JAX`; on another, a kernel that needs them raises instead of running with
32-bit offsets. The patch goes away with the kernels written against ``jax_triton`` (where
offsets are the kernel's own).
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

#: The most elements a 32-bit (signed) offset can address.
MAX_INT32_ELEMENTS = 2**31
#: JAX versions whose lowering these wrappers were checked against (the IR test, the H200).
VERIFIED_JAX = ("0.11.2",)

_OWN_KERNELS: set[str] = set()
_LOWERING_OWN = contextvars.ContextVar("pallas_kernels_lowering_own_kernel", default=False)


def needs_64_bit_offsets(shape: tuple[int, ...]) -> bool:
    """Whether an operand of ``shape`` has elements a signed 32-bit offset cannot reach."""
    return math.prod(shape) > MAX_INT32_ELEMENTS


def prepare(name: str, shapes) -> None:
    """Called before this library's ``pallas_call`` named ``name`` with operand ``shapes``:
    records the kernel for the 64-bit-offset fix and installs it on first use.

    Raises:
      RuntimeError: an operand needs 64-bit offsets and this JAX is not one the fix was
        verified for (it would be addressed with wrapping 32-bit offsets).
    """
    _OWN_KERNELS.add(name)
    if not any(needs_64_bit_offsets(tuple(shape)) for shape in shapes):
        return
    if jax.__version__ not in VERIFIED_JAX:
        raise RuntimeError(
            f"pallas_kernels: kernel {name!r} has an operand of more than 2**31 elements, which JAX's Pallas "
            f"Triton lowering addresses with 32-bit offsets; the fix (pallas_kernels/pallas_offsets.py) is verified "
            f"for jax {', '.join(VERIFIED_JAX)}, found {jax.__version__}. Use expert_gemm='triton' or 'xla', or "
            "a verified jax")
    _install()


@functools.cache
def _install() -> None:
    from jax._src.pallas.triton import lowering  # noqa: PLC0415 (private; touched only on use)

    offsets = getattr(lowering, "_compute_offsets_from_indices", None)
    lower = getattr(lowering, "lower_jaxpr_to_triton_module", None)
    if offsets is None or lower is None:
        raise RuntimeError("jax._src.pallas.triton.lowering has no _compute_offsets_from_indices or "
                           "lower_jaxpr_to_triton_module; pallas_kernels/pallas_offsets.py must be revisited for "
                           f"jax {jax.__version__}")

    @functools.wraps(lower)
    def lower_marked(jaxpr, *args, **kwargs):
        token = _LOWERING_OWN.set(getattr(jaxpr.debug_info, "func_name", None) in _OWN_KERNELS)
        try:
            return lower(jaxpr, *args, **kwargs)
        finally:
            _LOWERING_OWN.reset(token)

    @functools.wraps(offsets)
    def compute_offsets(block_info, nd_indexer):
        full = block_info.full_shape_dtype
        if (_LOWERING_OWN.get() and needs_64_bit_offsets(full.shape)
                and math.prod(full.shape) * full.dtype.itemsize <= 2**32):
            # The lowering sizes its offsets by the operand's bytes; an int64 operand of the
            # same shape is over 2**32 bytes, so it gets 64-bit offsets. Strides come from the
            # shape alone, so the offsets themselves are unchanged.
            block_info = dataclasses.replace(block_info, full_shape_dtype=full.update(dtype=jnp.dtype(jnp.int64)))
        return offsets(block_info, nd_indexer)

    lowering.lower_jaxpr_to_triton_module = lower_marked
    lowering._compute_offsets_from_indices = compute_offsets
