"""64-bit pointer offsets for every Pallas-Triton operand of 2**31 elements or more.

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

:func:`install` wraps the lowering's offset computation so that an operand of 2**31 elements
or more always gets 64-bit offsets; nothing else about the lowering changes, and operands JAX
already handles are passed through untouched. It is installed when :mod:`pallas_kernels` is
imported, and ``tests/pallas_kernels/test_offsets.py`` checks the lowered Triton IR of every
kernel at the largest published shapes (and twice those), so a JAX upgrade that changes the
lowering fails CI instead of silently reintroducing the bug. The patch goes away with the
kernels written against ``jax_triton`` (where offsets are the kernel's own).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax.numpy as jnp
from jax._src.pallas.triton import lowering as _lowering

#: The most elements a 32-bit (signed) offset can address.
MAX_INT32_ELEMENTS = 2**31


def needs_64_bit_offsets(shape: tuple[int, ...]) -> bool:
    """Whether an operand of ``shape`` has elements a signed 32-bit offset cannot reach."""
    return math.prod(shape) > MAX_INT32_ELEMENTS


def install() -> None:
    """Makes the Pallas Triton lowering use 64-bit offsets for operands of >= 2**31 elements.

    Idempotent. Raises RuntimeError if this JAX's lowering has no function to wrap (the test
    of the lowered IR would then fail too: check whether the JAX bug is fixed upstream).
    """
    original = getattr(_lowering, "_compute_offsets_from_indices", None)
    if original is None:
        raise RuntimeError("jax._src.pallas.triton.lowering._compute_offsets_from_indices is gone; "
                           "pallas_kernels.pallas_offsets must be revisited for this JAX version")
    if getattr(original, "_moe_jax_64_bit", False):
        return

    @functools.wraps(original)
    def compute_offsets(block_info, nd_indexer):
        full = block_info.full_shape_dtype
        if needs_64_bit_offsets(full.shape) and math.prod(full.shape) * full.dtype.itemsize <= 2**32:
            # The lowering sizes its offsets by the operand's bytes; an int64 operand of the
            # same shape is over 2**32 bytes, so it gets 64-bit offsets. Strides come from the
            # shape alone, so the offsets themselves are unchanged.
            block_info = dataclasses.replace(block_info, full_shape_dtype=full.update(dtype=jnp.dtype(jnp.int64)))
        return original(block_info, nd_indexer)

    compute_offsets._moe_jax_64_bit = True
    _lowering._compute_offsets_from_indices = compute_offsets
