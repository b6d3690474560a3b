"""Exact float32 division and multiplication in integer arithmetic on the bits: the same result
on every backend.

XLA may compute a float division any way it likes: XLA:GPU divides float32 with PTX
``div.full.f32`` (up to 2 ulp off), rewrites ``a / broadcast(b)`` into ``a * (1 / b)``, and
some of its fusions did not keep even a float64 division exact on an H200 (benchmarks/NOTES.md,
"Quantizing inside ``jit`` on a GPU"); XLA:CPU flushes float32 subnormals to zero in float
arithmetic and comparisons. Integer arithmetic has one meaning on every backend, so the NVFP4
quantizer's products and quotients (:mod:`moe_jax.nvfp4`) are computed here from the bits,
correctly rounded to float32 (round half to even, subnormal results and inputs as IEEE 754 has
them: as numpy computes, and as ModelOpt's quantizer does in PyTorch), and it gives identical
bits on XLA:CPU and GPU alike. All of it is elementwise uint32/int32 arithmetic that fuses; no
loop runs over data.

:func:`divide` and :func:`multiply` take and return float32 values; :func:`divide_bits` and
:func:`multiply_bits` work on the bits of non-negative values (uint32, as :func:`f32_bits`
gives them), and :func:`divisor` precomputes a denominator's reciprocal for many divisions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

INF_BITS = 0x7F800000
NAN_BITS = 0x7FC00000


def u32(x) -> jax.Array:
    return jnp.asarray(x, jnp.uint32)


def f32_bits(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)


def bits_f32(bits: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def as_float32_bits(w: jax.Array) -> jax.Array:
    """The bits (uint32) of ``w`` rounded to float32 (half to even), subnormals kept: float32 as
    it is, bfloat16 by a shift, float64 by integer rounding of its bits (XLA:CPU's conversion
    flushes float32 subnormals to zero), other dtypes by XLA's conversion (exact: float16's
    values are all float32 normals)."""
    if w.dtype == jnp.bfloat16:
        return jax.lax.bitcast_convert_type(w, jnp.uint16).astype(jnp.uint32) << 16
    if w.dtype == jnp.float64:  # only exists with x64 on, so uint64 arithmetic is there too
        bits = jax.lax.bitcast_convert_type(w, jnp.uint64)
        biased = ((bits >> 52) & 0x7FF).astype(jnp.int32)
        fraction = bits & ((1 << 52) - 1)
        m = jnp.where(biased == 0, fraction, fraction | (1 << 52))  # a float64 subnormal rounds to 0
        q = (m >> 28).astype(jnp.uint32)  # the leading one at bit 24 (normal inputs)
        rounded = _round_and_pack(q, jnp.int32(24), jnp.maximum(biased, 1) - 896, (m & ((1 << 28) - 1)) != 0)
        rounded = jnp.where((biased == 0x7FF) & (fraction != 0), u32(NAN_BITS), rounded)
        return rounded | ((bits >> 63).astype(jnp.uint32) << 31)
    return f32_bits(w.astype(jnp.float32))


def _unpack(bits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Finite non-negative float32 bits to ``(m, e)``: uint32 ``m`` in ``[2**23, 2**24)`` and int32
    ``e`` with value ``m * 2**e``; subnormals are normalized. Zero gives ``m = 0``."""
    biased = (bits >> 23).astype(jnp.int32)
    fraction = bits & u32(0x7FFFFF)
    m = jnp.where(biased == 0, fraction, fraction | u32(1 << 23))
    shift = jax.lax.clz(m) - u32(8)  # 0 when normal; 1..23 for a subnormal (24 for zero)
    return m << shift, jnp.maximum(biased, 1) - 150 - shift.astype(jnp.int32)


def _round_and_pack(q: jax.Array, top: jax.Array, biased: jax.Array, inexact: jax.Array) -> jax.Array:
    """Float32 bits of ``(q + f) * 2**(biased - 127 - top)`` rounded half to even, where uint32
    ``q`` has its leading one at bit ``top`` (int32, 24 or 25), ``0 <= f < 1`` and ``inexact``
    says ``f > 0``. ``biased`` is the biased exponent of the value; at or below 0 the result is
    subnormal (more bits of ``q`` are dropped) or zero, from 255 up infinity."""
    drop = jnp.minimum(top - 23 + jnp.maximum(1 - biased, 0), 31).astype(jnp.uint32)  # >= 1
    kept = q >> drop
    rest = q & ((u32(1) << drop) - u32(1))
    half = u32(1) << (drop - u32(1))
    up = (rest > half) | ((rest == half) & (inexact | ((kept & u32(1)) == 1)))
    kept = kept + up.astype(jnp.uint32)
    # kept holds the implicit bit: [2**23, 2**24] when normal (2**24 carries into the exponent),
    # [0, 2**23] when subnormal (2**23 is the smallest normal).
    bits = (jnp.maximum(biased, 1) - 1).astype(jnp.uint32) << 23
    return jnp.where(biased >= 255, u32(INF_BITS), bits + kept)


def _split12(m: jax.Array) -> tuple[jax.Array, jax.Array]:
    return m >> 12, m & u32(0xFFF)


def multiply_bits(a: jax.Array, b: jax.Array) -> jax.Array:
    """Float32 bits of ``a * b`` correctly rounded, for the bits (uint32, broadcast together) of
    finite ``a, b >= 0``.

    The 48-bit product of the significands is taken in 12-bit pieces: its bits from 22 up
    (``q``, 25 or 26 bits) from the high pieces, and whether bits 0..21 are zero from the product
    modulo 2**32 (uint32 multiplication wraps)."""
    ma, ea = _unpack(a)
    mb, eb = _unpack(b)
    a_hi, a_lo = _split12(ma)
    b_hi, b_lo = _split12(mb)
    low = a_lo * b_lo  # < 2**24
    middle = a_hi * b_lo + a_lo * b_hi + (low >> 12)  # < 2**25 + 2**12
    q = ((a_hi * b_hi) << 2) + (middle >> 10)  # floor(ma * mb / 2**22), in [2**24, 2**26)
    inexact = ((ma * mb) & u32((1 << 22) - 1)) != 0
    top = 24 + (q >> 25).astype(jnp.int32)
    bits = _round_and_pack(q, top, top + ea + eb + 149, inexact)
    return jnp.where((a == 0) | (b == 0), u32(0), bits)


def _reciprocal(mb: jax.Array) -> jax.Array:
    """``floor((2**48 - 1) / mb)`` for uint32 ``mb`` in ``[2**23, 2**24)``: in ``(2**24, 2**25)``.

    Restoring long division, one quotient bit per step (24 steps): the remainder stays below
    ``mb``, so ``2 * remainder + 1`` fits in 25 bits."""
    remainder = u32((1 << 24) - 1) - mb  # the top 24 bits of the numerator, less one mb
    quotient = jnp.ones_like(mb)
    for _ in range(24):
        remainder = (remainder << 1) | u32(1)  # the next numerator bit is a one
        bit = remainder >= mb
        remainder = jnp.where(bit, remainder - mb, remainder)
        quotient = (quotient << 1) | bit.astype(jnp.uint32)
    return quotient


def divisor(b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(b, R)``: a denominator's float32 bits ``b`` (finite, >= 0) with ``R``, the reciprocal of
    its significand that :func:`divide_bits` needs, computed at ``b``'s own shape. A caller
    dividing many numerators by one denominator (a block's 16 elements) materializes this pair
    (behind ``jax.lax.optimization_barrier``, as :func:`moe_jax.nvfp4.quantize` does), so that
    XLA does not fuse the 24-step reciprocal into the numerators' loop and repeat it for every
    element."""
    return b, _reciprocal(_unpack(b)[0])


def divide_bits(a: jax.Array, b: jax.Array | tuple[jax.Array, jax.Array]) -> jax.Array:
    """Float32 bits of ``a / b`` correctly rounded (IEEE 754 division, round half to even), for
    the bits (uint32, broadcast together) of finite ``a >= 0`` and ``b >= 0``, or ``b`` given
    as ``divisor(b)``. ``b = 0`` gives infinity, or NaN for ``0 / 0``; results past the
    float32 range give infinity.

    With significands ``ma``, ``mb`` in ``[2**23, 2**24)`` the quotient bits
    ``Q = floor(ma * 2**25 / mb)`` (in ``(2**24, 2**26)``: 25 or 26 bits, enough for the 24 kept and
    the rounding bit) are estimated as ``floor(ma * R / 2**23)`` with ``R = floor((2**48 - 1) / mb)``
    (``_reciprocal``), the 49-bit product taken in 12-bit pieces. ``R`` is at most one below
    ``2**48 / mb``, so the estimate is ``Q``, ``Q - 1`` or ``Q - 2``; the remainder
    ``ma * 2**25 - estimate * mb`` is then below ``3 * mb < 2**26``, exact in uint32 arithmetic
    modulo 2**32, and two compare-and-subtract steps make the estimate ``Q`` and the remainder
    smaller than ``mb``; the remainder being nonzero is the sticky bit of the rounding."""
    b, reciprocal = b if isinstance(b, tuple) else divisor(b)
    mb, eb = _unpack(b)
    r_hi, r_lo = _split12(reciprocal)  # r_hi < 2**13
    ma, ea = _unpack(a)
    a_hi, a_lo = _split12(ma)
    low = a_lo * r_lo  # < 2**24
    middle = a_hi * r_lo + a_lo * r_hi + (low >> 12)  # < 2**26
    q = ((a_hi * r_hi) << 1) + (middle >> 11)  # floor(ma * R / 2**23)
    remainder = (ma << 25) - q * mb
    for _ in range(2):
        over = remainder >= mb
        q = q + over.astype(jnp.uint32)
        remainder = jnp.where(over, remainder - mb, remainder)
    top = 24 + (q >> 25).astype(jnp.int32)
    bits = _round_and_pack(q, top, top + ea - eb + 102, remainder != 0)
    bits = jnp.where(a == 0, u32(0), bits)
    return jnp.where(b == 0, jnp.where(a == 0, u32(NAN_BITS), u32(INF_BITS)), bits)


def _signed(op, a: jax.Array, b: jax.Array) -> jax.Array:
    a_bits, b_bits = f32_bits(jnp.asarray(a, jnp.float32)), f32_bits(jnp.asarray(b, jnp.float32))
    magnitude = u32(0x7FFFFFFF)
    bits = op(a_bits & magnitude, b_bits & magnitude)
    return bits_f32(bits | ((a_bits ^ b_bits) & u32(0x80000000)))


def divide(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a / b`` for finite float32 ``a``, ``b`` (broadcast together), IEEE 754 (round half to
    even, subnormals kept; ``x / 0`` is a signed infinity, ``0 / 0`` NaN) with the same bits on
    every backend: integer arithmetic on the bits, no float division."""
    return _signed(divide_bits, a, b)


def multiply(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a * b`` for finite float32 ``a``, ``b``, IEEE 754 (round half to even, subnormals kept),
    by integer arithmetic on the bits: no flush to zero, no contraction into a fused multiply-add."""
    return _signed(multiply_bits, a, b)

