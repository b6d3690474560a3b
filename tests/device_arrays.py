"""Helpers of the GPU tests that build full-size weights on the device."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def perturb_allocator() -> None:
    """Allocate and free 4 GiB, so later buffers land where the runs that found the Kimi K2-size
    out-of-bounds read had them (it faulted only then)."""
    a = jnp.ones((1 << 30,), jnp.float32)
    a.block_until_ready()
    del a


def random_on_device(key, shape, make, chunk: int = 8) -> jax.Array:
    """``make(key, chunk_shape)`` over chunks of ``chunk`` entries of the leading axis, written
    in place into one ``shape`` array: the peak is the array plus one chunk, never a float32
    copy of it all."""
    make_chunk = jax.jit(make, static_argnums=1)
    update = jax.jit(lambda buf, part, start: jax.lax.dynamic_update_slice_in_dim(buf, part, start, axis=0),
                     donate_argnums=0)
    buf = None
    for i, start in enumerate(range(0, shape[0], chunk)):
        part = make_chunk(jax.random.fold_in(key, i), (min(chunk, shape[0] - start), *shape[1:]))
        buf = jnp.zeros(shape, part.dtype) if buf is None else buf
        buf = update(buf, part, start)
    buf.block_until_ready()
    return buf
