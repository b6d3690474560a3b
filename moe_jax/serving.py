"""Serving with bucketed token counts: one compilation per bucket, not one per batch size.

A server calls the layer with a different number of tokens almost every time, and JAX compiles
once per distinct shape. Pad each batch to the smallest of a few fixed sizes and tell the layer
how many tokens are real; padding routes nowhere, is left out of every statistic and gets zeros,
so the real tokens' outputs and the statistics are those of the unpadded batch::

    buckets = moe_jax.serving.token_buckets(8192)          # (16, 32, ..., 8192)
    step = nnx.jit(lambda layer, x, n: layer(x, num_valid_tokens=n))
    x_bh, n = moe_jax.serving.pad_to_bucket(x_th, buckets)  # [bucket, H], the real count
    y_bh, stats = step(layer, x_bh, n)                     # n is traced: no recompilation
    y_th = y_bh[:n]

Pad on the host (a NumPy ``x_th``): JAX compiles an operation on a device array once per shape,
so padding device arrays of ever new lengths compiles a pad per length (tens of milliseconds
each, as long as the layer call itself at small batches).

Powers of two waste at most half of a batch's rows (a quarter on average over uniform sizes)
for ``log2(max / smallest) + 1`` compilations; ``growth`` trades one for the other.
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np


def token_buckets(max_tokens: int, *, smallest: int = 16, growth: float = 2.0) -> tuple[int, ...]:
    """Bucket sizes ``smallest, smallest * growth, ...`` (rounded up), the last one >= ``max_tokens``.

    Raises:
      ValueError: a size below 1 or ``growth`` not above 1 (naming which).
    """
    for name, value in (("max_tokens", max_tokens), ("smallest", smallest)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: {value!r}, expected an int >= 1")
    if not (isinstance(growth, (int, float)) and math.isfinite(growth) and growth > 1):
        raise ValueError(f"growth: {growth!r}, expected a finite number > 1")
    sizes = [smallest]
    while sizes[-1] < max_tokens:
        sizes.append(max(sizes[-1] + 1, math.ceil(sizes[-1] * growth)))
    return tuple(sizes)


def bucket_for(num_tokens: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket that holds ``num_tokens``.

    Raises:
      ValueError: ``num_tokens`` negative or above the largest bucket.
    """
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, numbers.Integral) or num_tokens < 0:
        raise ValueError(f"num_tokens: {num_tokens!r}, expected an int >= 0")
    num_tokens = int(num_tokens)
    for size in sorted(buckets):
        if num_tokens <= size:
            return size
    raise ValueError(f"num_tokens: {num_tokens}, expected at most the largest bucket, {max(buckets)}")


def pad_to_bucket(x_th: np.ndarray | jax.Array, buckets: tuple[int, ...]) -> tuple[np.ndarray | jax.Array, int]:
    """``x_th`` ``[T, H]`` padded with zero rows to its bucket ``[B, H]``, and ``T``.

    A NumPy ``x_th`` is padded on the host and comes back as NumPy (the jitted call it feeds
    moves it to the device); a JAX array is padded where it lives, one compilation per new ``T``.
    """
    if getattr(x_th, "ndim", None) != 2:
        found = f"shape {tuple(x_th.shape)}" if hasattr(x_th, "shape") else type(x_th).__name__
        raise ValueError(f"x_th: {found}, expected [T, H]")
    num_tokens = x_th.shape[0]
    size = bucket_for(num_tokens, buckets)
    padding = ((0, size - num_tokens), (0, 0))
    return (np.pad(x_th, padding) if isinstance(x_th, np.ndarray) else jnp.pad(x_th, padding)), num_tokens
