"""NVFP4 weights in NVIDIA ModelOpt's layout: the format, the quantizer, the dequantizer.

An NVFP4 matrix ``W [N, K]`` (out, in) is stored as

* ``packed``       uint8          ``[..., N, K/2]``  two E2M1 codes a byte, element ``2i`` in the low nibble;
* ``scales``       float8_e4m3fn  ``[..., N, K/16]`` one scale per 16 consecutive elements along K;
* ``global_scale`` float32        ``[...]``          one per matrix (ModelOpt's ``weight_scale_2``),
                                  or ``[..., G]``    one per row group: ``G`` equal consecutive groups of rows;

and ``W ~= e2m1(code) * fp32(scale) * global_scale`` (a row's group's global scale when grouped).
Leading axes (experts) batch; the rank of ``global_scale`` tells the two layouts apart. Grouped
scales hold matrices fused along N exactly: gate and up of an expert as ``[2F, K]`` with
``G = 2`` (rows ``0..F-1`` gate, ``F..2F-1`` up), where ModelOpt gave each its own
``weight_scale_2`` (:func:`concat_rows`).

The quantizer follows the recipe of ModelOpt 0.47.0's ``NVFP4QTensor.quantize`` to the bit,
including its corner cases: a block whose amax is zero gets the scale 1.0, and every other
block scale is clamped to ``[2**-9, 448]`` (E4M3's smallest subnormal and largest normal)
before the E4M3 cast, so a block far below the matrix's amax keeps real codes instead of
underflowing to scale 0. ModelOpt added that clamp in 0.45.0; up to 0.44 it stored scale 0
and code 7 for blocks with ``block_amax / (6 * global) <= 2**-10``. Checkpoints made that way
still dequantize exactly as stored (those blocks read as zero).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from moe_jax.exact_float32 import (
    INF_BITS, as_float32_bits, bits_f32, divide_bits, divisor, f32_bits, multiply_bits, u32,
)

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0**-9

#: The value of each E2M1 code 0..15; bit 3 is the sign.
E2M1_VALUES = np.array(
    [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32
)
# Midpoints between neighbouring magnitudes; a tie rounds to the even code.
_E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_ROUND_UP_AT_TIE = (0.75, 1.75, 3.5)  # the midpoints whose upper neighbour has the even code
_E2M1_BOUND_BITS = tuple(int(b) for b in np.array(_E2M1_BOUNDS, np.float32).view(np.uint32))
_ROUND_UP_AT_TIE_BITS = tuple(int(b) for b in np.array(_ROUND_UP_AT_TIE, np.float32).view(np.uint32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NVFP4Tensor:
    """A batch of NVFP4 matrices ``[..., N, K]`` in ModelOpt's row-major layout.

    Attributes:
      packed: uint8 ``[..., N, K/2]``; element ``2i`` of a row in the low nibble of byte ``i``.
      scales: float8_e4m3fn ``[..., N, K/16]``.
      global_scale: float32 ``[...]``, one per matrix, or ``[..., G]``, one per group of
        ``N/G`` consecutive rows (see the module docstring).
    """

    packed: jax.Array
    scales: jax.Array
    global_scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical (dequantized) shape ``[..., N, K]``."""
        *lead, n, k_half = self.packed.shape
        return (*lead, n, 2 * k_half)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def row_groups(self) -> int:
        """G, the global scales per matrix: 1 for ``global_scale [...]``, else its last dimension."""
        if self.global_scale.ndim == self.packed.ndim - 2:
            return 1
        return self.global_scale.shape[-1]

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in (self.packed, self.scales, self.global_scale))

    def validate(self, name: str = "tensor") -> NVFP4Tensor:
        """Raises ValueError naming ``name`` if dtypes or shapes disagree with the layout."""
        expected = {"packed": np.uint8, "scales": ml_dtypes.float8_e4m3fn, "global_scale": np.float32}
        for field, dtype in expected.items():
            found = getattr(self, field).dtype
            if found != dtype:
                raise ValueError(f"{name}.{field}: dtype {found}, expected {np.dtype(dtype).name}")
        *lead, n, k = self.shape
        if self.packed.ndim < 2:
            raise ValueError(f"{name}.packed: rank {self.packed.ndim}, expected >= 2 ([..., N, K/2])")
        if self.scales.shape != (*lead, n, k // BLOCK) or k % BLOCK:
            raise ValueError(
                f"{name}.scales: shape {self.scales.shape} for packed {self.packed.shape}, "
                f"expected {(*lead, n, k // BLOCK)} with K={k} a multiple of {BLOCK}"
            )
        per_matrix = self.global_scale.shape == tuple(lead)
        grouped = (self.global_scale.ndim == len(lead) + 1 and self.global_scale.shape[:-1] == tuple(lead)
                   and self.global_scale.shape[-1] >= 1 and n % self.global_scale.shape[-1] == 0)
        if not (per_matrix or grouped):
            raise ValueError(
                f"{name}.global_scale: shape {self.global_scale.shape}, expected {tuple(lead)} (one per matrix) "
                f"or {(*lead, 'G')} with G dividing N={n} (one per group of N/G rows)"
            )
        return self


def e2m1_encode(v: jax.Array) -> jax.Array:
    """Rounds float32 values to E2M1 codes (uint8 0..15), half to even, saturating at +-6.

    Matches ModelOpt's ``_cast_fp4``: ``-0.0`` encodes as 0, +-inf as +-6, NaN as code 7. Decided
    on the bits, so subnormals count as the nonzero numbers they are on every backend (XLA:CPU's
    float comparisons read them as zero): a negative subnormal is code 8, as in ModelOpt.
    """
    bits = f32_bits(jnp.asarray(v, jnp.float32))
    magnitude = bits & u32(0x7FFFFFFF)
    negative = ((bits >> 31) == 1) & (magnitude != 0) & (magnitude <= INF_BITS)
    return _e2m1_magnitude_code(magnitude) | (negative.astype(jnp.uint8) << 3)


def _e2m1_magnitude_code(magnitude: jax.Array) -> jax.Array:
    """Codes 0..7 of non-negative float32 values given as bits (NaN bits give 7): the bits of
    non-negative floats are ordered as the floats are, so the comparisons are integer ones."""
    code = sum((magnitude > b).astype(jnp.uint8) for b in _E2M1_BOUND_BITS)
    return code + sum((magnitude == b).astype(jnp.uint8) for b in _ROUND_UP_AT_TIE_BITS)


def e2m1_decode(code: jax.Array) -> jax.Array:
    """E2M1 codes (any integer dtype, 0..15) to float32 values (:data:`E2M1_VALUES`).

    By bit placement rather than a table: XLA:GPU lowers a lookup in a 16-entry table to a
    gather and concatenations of its own, where these few integer ops fuse with their neighbours.
    Magnitude code ``q`` (bits e1 e0 m): ``q < 2`` is ``q / 2``; else ``(1 + m/2) 2**(e - 1)``,
    whose float32 bits are ``(q << 22) + (126 << 23)``.
    """
    c = code.astype(jnp.uint32)
    q = c & 7
    normal = jax.lax.bitcast_convert_type((q << 22) + jnp.uint32(126 << 23), jnp.float32)
    magnitude = jnp.where(q < 2, q.astype(jnp.float32) * 0.5, normal)
    return jnp.where((c & 8) != 0, -magnitude, magnitude)


def pack_codes(code: jax.Array) -> jax.Array:
    """uint8 codes ``[..., K]`` to bytes ``[..., K/2]``, element ``2i`` in the low nibble."""
    return code[..., 0::2] | (code[..., 1::2] << 4)


def unpack_codes(packed: jax.Array) -> jax.Array:
    """Bytes ``[..., K/2]`` to uint8 codes ``[..., K]``; the inverse of :func:`pack_codes`.

    Each byte repeated, then shifted by 0 or 4 by column parity (a broadcast XLA fuses into the
    consumer, where interleaving two halves would be a concatenation of its own)."""
    k = 2 * packed.shape[-1]
    shift = (jnp.arange(k, dtype=jnp.uint8) & 1) * 4
    return (jnp.repeat(packed, 2, axis=-1, total_repeat_length=k) >> shift) & 0xF


def _check_quantizable(w, name: str) -> None:
    if w.ndim < 2:
        raise ValueError(f"{name}: rank {w.ndim}, expected >= 2 ([..., N, K])")
    if w.shape[-1] % BLOCK:
        raise ValueError(f"{name}: K = shape[-1] = {w.shape[-1]}, expected a multiple of {BLOCK}")
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise ValueError(f"{name}: dtype {w.dtype}, expected a floating dtype")
    if 0 in w.shape:
        raise ValueError(f"{name}: shape {tuple(w.shape)}, expected no zero-size dimension")


def _check_finite(nonfinite: int, name: str) -> None:
    if nonfinite:
        raise ValueError(f"{name}: {nonfinite} non-finite values (NaN or Inf); NVFP4 has no encoding for them")


def quantize(w: jax.Array, *, name: str = "w") -> NVFP4Tensor:
    """Quantizes ``w [..., N, K]`` with ModelOpt 0.47.0's NVFP4 recipe, one global scale per matrix.

    ``global = amax(|W|) / (6 * 448)``;
    ``block = e4m3(clamp(block_amax / (6 * global), 2**-9, 448))``, with the ratio replaced by 1.0
    where it is 0 (an all-zero block) before the clamp;
    ``code = e2m1_rne(W / (fp32(block) * global))``. All arithmetic in float32. This is
    ``NVFP4QTensor.quantize`` of ModelOpt 0.47.0 (``get_weights_scaling_factor`` and
    ``_cast_per_block_scale_to_fp8``), with one deliberate difference: an all-zero matrix makes
    ModelOpt's ratio 0/0 = NaN, stored as a NaN scale, and its elements 0/0, stored as code 7;
    here those scales are 1.0 and the codes 0, as for any all-zero block.

    The arithmetic is written so that every backend gives the same bits, with no XLA flag:
    every quotient and product of the recipe is correctly rounded IEEE float32, subnormals
    included, computed in integer arithmetic on the bits (:mod:`moe_jax.exact_float32` says
    why), the codes are decided by integer comparisons, and the E4M3 rounding of the block
    scales needs no float32 -> E4M3 -> float32 round trip, which XLA:GPU's excess-precision pass
    drops (:func:`_round_to_e4m3`). Traced inputs
    (inside ``jit``, ``shard_map``) are quantized where the computation runs; tests check them
    bit for bit against the host's result and an independent numpy implementation of ModelOpt's
    recipe (``tests/test_nvfp4.py``) and on a GPU (``tests/test_nvfp4_gpu.py``). A concrete array
    of at least :data:`DEVICE_MIN_ELEMENTS` on one accelerator is quantized there, in chunks of
    whole matrices (:func:`_quantize_on_device`); other concrete inputs on the host CPU, in
    chunks of blocks whose compiled programs every shape shares (:func:`_quantize_on_host`), the
    result put back where ``w`` was. Both give the same bits.

    ModelOpt itself usually runs on a GPU, where PyTorch computes ``amax / 2688`` as
    ``amax * fp32(1 / 2688)``; that rounds differently from the true division used here, so a
    checkpoint's ``weight_scale_2`` can be one ulp away from what this function computes for the
    same weights (and block scales and codes can follow it). The checkpoint is the truth: a
    loader must never re-quantize tensors a checkpoint already holds in NVFP4.

    Raises:
      ValueError: rank < 2, K not a multiple of 16, a zero-size dimension, a non-floating dtype,
        or (for concrete inputs) any NaN/Inf.
    """
    _check_quantizable(w, name)
    if isinstance(w, jax.core.Tracer):
        return _quantize(w)
    if quantizes_on_device(w):
        return _quantize_on_device(w, name)
    # A numpy input goes straight to the host computation (no round trip through a device), in
    # the dtype jnp.asarray would give it (float64 is float32 without x64).
    w_host = np.asarray(w, jax.dtypes.canonicalize_dtype(w.dtype))
    _check_finite(int(w_host.size - np.count_nonzero(np.isfinite(w_host))), name)
    t = _quantize_on_host(w_host)
    # Back where w was: pinned there if w was, else uncommitted on the default device.
    if isinstance(w, jax.Array) and w.committed:
        return jax.device_put(t, w.sharding)
    return jax.tree.map(jnp.asarray, t)


def _round_to_e4m3(ratio: jax.Array) -> jax.Array:
    """float32 values in ``[2**-9, 448]`` rounded half to even to E4M3's grid, as float32.

    The result is exactly representable in float8_e4m3fn, so its conversion to E4M3 is exact and
    the codes can divide by this float32 value: there is no float32 -> E4M3 -> float32 round
    trip, which XLA:GPU's excess-precision pass deletes (it then divided by the unrounded ratio
    and changed ~5% of the codes). E4M3's spacing near ``r`` is ``2**(e - 3)`` for
    ``r = 1.m * 2**e`` with ``e >= -6``, and ``2**-9`` (subnormals) below; scaling by powers of
    two, read off the exponent bits, and rounding to an integer are exact on every backend.
    """
    biased = (jax.lax.bitcast_convert_type(ratio, jnp.uint32) >> 23) & 0xFF  # ratio > 0, normal
    step_biased = jnp.maximum(biased, jnp.uint32(127 - 6)) - 3
    step = jax.lax.bitcast_convert_type(step_biased << 23, jnp.float32)
    inverse_step = jax.lax.bitcast_convert_type((254 - step_biased) << 23, jnp.float32)
    units = jax.lax.round(ratio * inverse_step, jax.lax.RoundingMethod.TO_NEAREST_EVEN)  # 1..16
    return units * step


def _materialized(x):
    """``x`` (a pytree of arrays), unchanged, behind an optimization barrier: XLA computes it once
    and stores it instead of fusing its computation into every consumer. Used for what is
    computed per block or per matrix and then read by many elements (fused, XLA repeats the
    24-step reciprocal of :func:`moe_jax.exact_float32.divisor` and the per-block arithmetic
    before it for each element), and for the
    codes before packing. For [4, 2048, 7168] float32 on two CPU cores: 0.10 s with the five
    barriers of :func:`_quantize`, 3.1 s with none, 0.25 s with only the one on the codes."""
    return jax.lax.optimization_barrier(x)


def _blocks(w: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``w [..., N, K]`` as the bits of its 16-element blocks: ``(magnitude, negative)`` uint32
    ``[..., N, K/16, 16]`` and each block's largest magnitude ``[..., N, K/16]``."""
    bits = as_float32_bits(w)
    *lead, n, k = w.shape
    magnitude = (bits & u32(0x7FFFFFFF)).reshape(*lead, n, k // BLOCK, BLOCK)
    negative = (bits >> 31).reshape(*lead, n, k // BLOCK, BLOCK)
    return magnitude, negative, _materialized(jnp.max(magnitude, axis=-1))


def _global_bits(amax: jax.Array) -> jax.Array:
    """A matrix's global scale ``amax / (6 * 448)``, as bits, from the bits of its amax."""
    return divide_bits(amax, f32_bits(jnp.float32(E2M1_MAX * E4M3_MAX)))


def _encode_blocks(magnitude: jax.Array, negative: jax.Array, block_amax: jax.Array,
                   global_bits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The recipe of each block against its matrix's global scale: ``(codes uint8 [..., 16],
    block scales float32 [...])``, exactly the stored E4M3 values. ``magnitude`` and ``negative``
    as :func:`_blocks` gives them, ``global_bits`` broadcasting against ``block_amax``; a block
    whose amax exceeds ``6 * 448 * global`` gets the clamped scale 448 and saturated codes."""
    # Everything on float32 bits (uint32): the quotients and products are divide_bits and
    # multiply_bits, the E2M1 thresholds are integer comparisons. The only float arithmetic is
    # _round_to_e4m3's, exact and on normal numbers.
    six_global = multiply_bits(global_bits, f32_bits(jnp.float32(E2M1_MAX)))
    ratio = divide_bits(block_amax, _materialized(divisor(six_global)))
    # A zero matrix makes ratio 0/0; ModelOpt leaves that NaN, which would poison the scale.
    ratio = jnp.where((ratio == 0) | (ratio > INF_BITS), f32_bits(jnp.float32(1.0)), ratio)
    # ModelOpt >= 0.45 clamps to E4M3's range, so a tiny block keeps the smallest subnormal
    # scale (2**-9) and real codes rather than rounding to scale 0. (The bits of non-negative
    # floats are ordered as the floats are.)
    ratio = jnp.clip(ratio, f32_bits(jnp.float32(E4M3_MIN_SUBNORMAL)), f32_bits(jnp.float32(E4M3_MAX)))
    block_scale = _round_to_e4m3(bits_f32(ratio))  # float32, exactly the stored E4M3 value
    denominator = multiply_bits(f32_bits(block_scale), global_bits)
    block_scale, denominator = _materialized((block_scale, denominator))
    scaled = divide_bits(magnitude, _materialized(divisor(denominator[..., None])))
    # In an all-zero matrix (global scale 0) every element is 0/0; ModelOpt encodes that NaN
    # as code 7, which reads as 6 * scale if the global scale is ever replaced. Zero is code 0.
    scaled = jnp.where(magnitude == 0, u32(0), scaled)
    # ModelOpt's sign is scaled < 0: a negative element whose quotient rounds to zero is +0.
    codes = _e2m1_magnitude_code(scaled) | ((negative & (scaled != 0)).astype(jnp.uint8) << 3)
    # Materialized before packing: fused with pack_codes' strided pairs, XLA:CPU's loop over the
    # elements no longer vectorizes (the codes took 5x as long).
    return _materialized(codes), block_scale


@jax.jit
def _quantize(w: jax.Array, global_scale: jax.Array | None = None) -> NVFP4Tensor:
    """``w [..., N, K]`` against its own global scale ``amax / (6 * 448)`` per matrix, or against
    ``global_scale`` (float32 ``[...]``, finite, > 0) when given: then a block whose amax exceeds
    ``6 * 448 * global_scale`` gets the clamped scale 448 and its codes saturate at +-6."""
    *lead, n, k = w.shape
    magnitude, negative, block_amax = _blocks(w)
    global_bits = _global_bits(jnp.max(block_amax, axis=(-2, -1))) if global_scale is None else f32_bits(global_scale)
    codes, block_scale = _encode_blocks(magnitude, negative, block_amax, global_bits[..., None, None])
    return NVFP4Tensor(
        packed=pack_codes(codes.reshape(*lead, n, k)),
        scales=block_scale.astype(jnp.float8_e4m3fn),
        global_scale=bits_f32(global_bits),
    )


#: The host quantizer's chunk sizes, in blocks: a concrete tensor goes through the recipe in
#: chunks of at most the largest, each padded to a power of two from the smallest, so that
#: every tensor shape runs through the same few compiled programs. (One program per shape
#: cost ~0.4 s of tracing and compiling each; the test suite quantizes ~100 shapes.)
_HOST_CHUNK_BLOCKS = (1 << 10, 1 << 20)


def _bucket(size: int) -> int:
    return max(_HOST_CHUNK_BLOCKS[0], 1 << (size - 1).bit_length())


_host_global_bits = jax.jit(_global_bits)


@jax.jit
def _host_block_amax(w_c16: jax.Array) -> jax.Array:
    return _blocks(w_c16)[2][:, 0]


@jax.jit
def _host_encode(w_c16: jax.Array, global_bits_c: jax.Array) -> tuple[jax.Array, jax.Array]:
    magnitude, negative, block_amax = _blocks(w_c16)
    codes, block_scale = _encode_blocks(magnitude, negative, block_amax, global_bits_c[:, None])
    return pack_codes(codes.reshape(-1, BLOCK)), block_scale[:, 0].astype(jnp.float8_e4m3fn)


def _on_host_chunks(fn, *arrays: np.ndarray) -> list[np.ndarray]:
    """``fn`` over the rows of ``arrays`` (equal first dimensions: blocks) on the host CPU, in
    padded chunks of :data:`_HOST_CHUNK_BLOCKS`; its outputs concatenated, padding removed."""
    cpu = jax.devices("cpu")[0]
    total = arrays[0].shape[0]
    parts = []
    for start in range(0, total, _HOST_CHUNK_BLOCKS[1]):
        pieces = [a[start:start + _HOST_CHUNK_BLOCKS[1]] for a in arrays]
        size = pieces[0].shape[0]
        # Only a short chunk is padded: np.pad copies even when it adds nothing.
        padded = [p if size == _bucket(size) else np.pad(p, [(0, _bucket(size) - size)] + [(0, 0)] * (p.ndim - 1))
                  for p in pieces]
        out = fn(*(jax.device_put(p, cpu) for p in padded))
        parts.append([np.asarray(o)[:size] for o in (out if isinstance(out, tuple) else (out,))])
    return [np.concatenate(column) for column in zip(*parts)]


def _quantize_on_host(w_host: np.ndarray) -> NVFP4Tensor:
    """:func:`_quantize` of a concrete ``w [..., N, K]`` (numpy, finite) on the host CPU, through
    the same recipe (:func:`_blocks`, :func:`_global_bits`, :func:`_encode_blocks`) on
    chunks of blocks: each block's result depends only on its 16 values and its matrix's global
    scale, which the amax of the matrix's blocks gives first."""
    *lead, n, k = w_host.shape
    matrices, blocks_per_matrix = int(np.prod(lead, dtype=np.int64)), n * k // BLOCK
    w_c16 = w_host.reshape(-1, BLOCK)
    (block_amax,) = _on_host_chunks(_host_block_amax, w_c16)
    amax_m = block_amax.reshape(matrices, blocks_per_matrix).max(axis=1)
    (global_bits_m,) = _on_host_chunks(_host_global_bits, amax_m)
    packed, scales = _on_host_chunks(_host_encode, w_c16, np.repeat(global_bits_m, blocks_per_matrix))
    return NVFP4Tensor(
        packed=packed.reshape(*lead, n, k // 2),
        scales=scales.reshape(*lead, n, k // BLOCK),
        global_scale=global_bits_m.view(np.float32).reshape(lead),
    )


#: A concrete array on an accelerator is quantized there from this many elements: below it, the
#: host's shared programs cost less than compiling one for the shape. Above it the host pays a copy
#: to and from the device and its own passes over the values: 48 Kimi K2-sized gate/up matrices
#: (1.4 G elements) took 12 s of an H100 machine's host, where the device needs one compilation.
DEVICE_MIN_ELEMENTS = 1 << 26
#: The device path's chunks, in elements (whole matrices, at least one): the recipe's temporaries
#: are a few times one chunk, and a chunk's count of non-finite values fits in int32.
DEVICE_CHUNK_ELEMENTS = 1 << 28


def quantizes_on_device(w) -> bool:
    """Whether :func:`quantize` quantizes a concrete ``w`` on its device rather than on the host:
    a ``jax.Array`` on one device that is not a CPU, of at least :data:`DEVICE_MIN_ELEMENTS`."""
    if not isinstance(w, jax.Array) or w.size < DEVICE_MIN_ELEMENTS:
        return False
    devices = w.devices()
    return len(devices) == 1 and next(iter(devices)).platform != "cpu"


def _chunk_count(matrices: int, matrix_elements: int) -> int:
    """The fewest equal chunks of whole matrices with at most :data:`DEVICE_CHUNK_ELEMENTS` each
    (one matrix a chunk if it alone is more): equal, so that one program maps over them."""
    most = max(1, DEVICE_CHUNK_ELEMENTS // matrix_elements)
    return next(c for c in range(-(-matrices // most), matrices + 1) if matrices % c == 0)


@functools.partial(jax.jit, static_argnames="chunks")
def _quantize_chunks(w: jax.Array, *, chunks: int) -> tuple[NVFP4Tensor, jax.Array]:
    """:func:`_quantize` of ``w [..., N, K]`` one chunk of matrices after another (``lax.map``:
    the temporaries of one chunk at a time), and each chunk's count of non-finite values."""
    *lead, n, k = w.shape
    w_cmnk = w.reshape(chunks, -1, n, k)
    t, nonfinite_c = jax.lax.map(lambda w_mnk: (_quantize(w_mnk), jnp.sum(~jnp.isfinite(w_mnk), dtype=jnp.int32)),
                                 w_cmnk)
    return NVFP4Tensor(packed=t.packed.reshape(*lead, n, k // 2), scales=t.scales.reshape(*lead, n, k // BLOCK),
                       global_scale=t.global_scale.reshape(lead)), nonfinite_c


def _quantize_on_device(w: jax.Array, name: str = "w") -> NVFP4Tensor:
    """:func:`_quantize` of a concrete ``w [..., N, K]`` where it lives, in equal chunks of whole
    matrices (a matrix's global scale is its own, so the chunks give the whole tensor's bits) of
    at most :data:`DEVICE_CHUNK_ELEMENTS` where the matrices divide so; one program per shape.
    Non-finite values are a one-line error, as on the host. The result stays on ``w``'s device,
    committed if ``w`` was."""
    *lead, n, k = w.shape
    t, nonfinite_c = _quantize_chunks(w, chunks=_chunk_count(int(np.prod(lead, dtype=np.int64)), n * k))
    _check_finite(int(np.asarray(nonfinite_c, np.int64).sum()), name)
    return t


def quantize_rows(x_mk: jax.Array, global_scale_m: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Activations ``[M, K]`` to NVFP4 with one global scale per row, for W4A4 kernels.

    Dynamic (``global_scale_m`` None): each row is quantized as :func:`quantize` quantizes a
    matrix (``global = amax(|row|) / 2688``, the same exact integer arithmetic), so a row's codes
    depend on that row alone: one token's magnitude (or a non-finite value) cannot change how
    another is rounded, which a per-tensor scale would. An all-zero row (padding) gets zero
    codes, block scales 1 and a global scale 0.

    Static (``global_scale_m`` float32 ``[M]``, finite, > 0): each row against its given global
    scale, as TensorRT-LLM and vLLM quantize W4A4 activations against a checkpoint's calibrated
    ``input_scale`` (a per-expert scale is a per-row one, rows being sorted by expert):
    ``block = e4m3(clamp(block_amax / (6 * global), 2**-9, 448))`` (a zero block: 1.0),
    ``code = e2m1_rne(x / (block * global))`` saturating at +-6, with the same exact arithmetic
    as the dynamic case. A row whose amax exceeds the calibrated ``6 * 448 * global`` is
    clipped there. A block below ``2**-9 * 6 * global`` gets the smallest scale, ``2**-9``, and
    keeps real codes (the clamp of :func:`quantize`); an unclamped E4M3 cast would store scale 0
    below ``2**-10 * 6 * global``, and such a block would read as zeros.

    Returns:
      ``(packed uint8 [M, K/2], scales float8_e4m3fn [M, K/16], global_scale float32 [M])``:
      the global scales computed, or those given.

    Raises:
      ValueError: ``x_mk`` not ``[M, K]`` with K a multiple of 16, or ``global_scale_m`` not
        float32 ``[M]`` or (when concrete) not finite and positive.
    """
    if x_mk.ndim != 2 or x_mk.shape[1] % BLOCK:
        raise ValueError(f"x_mk: shape {tuple(x_mk.shape)}, expected [M, K] with K a multiple of {BLOCK}")
    m, k = x_mk.shape
    if global_scale_m is not None:
        if getattr(global_scale_m, "dtype", None) != jnp.float32 or tuple(global_scale_m.shape) != (m,):
            dtype = getattr(global_scale_m, "dtype", type(global_scale_m).__name__)
            found = f"{dtype} {tuple(jnp.shape(global_scale_m))}"
            raise ValueError(f"global_scale_m: {found}, expected float32 ({m},), one per row of x_mk")
        if not isinstance(global_scale_m, jax.core.Tracer):
            bad = int(m - jnp.count_nonzero(jnp.isfinite(global_scale_m) & (global_scale_m > 0)))
            if bad:
                raise ValueError(f"global_scale_m: {bad} of {m} not finite and > 0, expected finite positive scales")
    t = _quantize(x_mk.astype(jnp.float32)[:, None, :], global_scale_m)
    return t.packed.reshape(m, k // 2), t.scales.reshape(m, k // BLOCK), t.global_scale


def dequantize(t: NVFP4Tensor, dtype=jnp.float32) -> jax.Array:
    """NVFP4 ``[..., N, K]`` to ``dtype``: ``e2m1(code) * (fp32(scale) * global_scale)``, each row
    with its group's global scale when ``global_scale`` is ``[..., G]``."""
    values = e2m1_decode(unpack_codes(t.packed))
    *lead, n, k = values.shape
    g = t.row_groups
    global_scale = t.global_scale.reshape(*lead, g, 1, 1)
    block_scale = t.scales.astype(jnp.float32).reshape(*lead, g, n // g, k // BLOCK) * global_scale
    w = values.reshape(*lead, n, k // BLOCK, BLOCK) * block_scale.reshape(*lead, n, k // BLOCK, 1)
    return w.reshape(*lead, n, k).astype(dtype)


def concat_rows(*tensors: NVFP4Tensor, name: str = "tensors") -> NVFP4Tensor:
    """Matrices ``[..., N_i, K]`` stacked along N into one ``[..., sum N_i, K]`` with grouped
    global scales ``[..., sum G_i]``, each part's own, exactly as given.

    Codes and block scales are concatenated untouched, so dequantizing the result equals
    concatenating the parts' dequantizations bit for bit (no block scale is re-expressed
    against another part's global scale, which would re-round it). Gate and up of an expert:
    ``concat_rows(gate, up)`` gives ``[..., 2F, K]`` with ``global_scale [..., 2]``.

    Args:
      tensors: at least one, with equal leading shapes and K; every row group of every part
        (a per-matrix part is one group) must have the same number of rows.
      name: for error messages.

    Raises:
      ValueError: naming ``name``, for no parts, or parts whose leading shapes, K or group sizes
        disagree.
    """
    if not tensors:
        raise ValueError(f"{name}: no tensors, expected at least one NVFP4Tensor")
    for i, t in enumerate(tensors):
        t.validate(f"{name}[{i}]")
    *lead, _, k = tensors[0].shape
    group_rows = tensors[0].shape[-2] // tensors[0].row_groups
    for i, t in enumerate(tensors):
        if (*t.shape[:-2], t.shape[-1]) != (*lead, k) or t.shape[-2] // t.row_groups != group_rows:
            raise ValueError(
                f"{name}[{i}]: shape {t.shape} in {t.row_groups} row groups, expected [{', '.join(map(str, lead))}"
                f"{', ' if lead else ''}N, {k}] in groups of {group_rows} rows (as {name}[0])"
            )
    return NVFP4Tensor(
        packed=jnp.concatenate([t.packed for t in tensors], axis=-2),
        scales=jnp.concatenate([t.scales for t in tensors], axis=-2),
        global_scale=jnp.concatenate([t.global_scale.reshape(*lead, t.row_groups) for t in tensors], axis=-1),
    )


def random(key: jax.Array, shape: tuple[int, ...], *, sharding=None) -> NVFP4Tensor:
    """Random NVFP4 ``[..., N, K]`` drawn in the stored format, made where it will live.

    Uniform codes (all 16), block scales uniform in [0.5, 1.5] before their E4M3 rounding, and a
    global scale ``0.3 / (6 sqrt(K))`` that keeps a product with unit-variance inputs of order
    0.1. For benchmarks, examples and tests at full size, where quantizing dense random
    weights would cost minutes and a dense float32 copy (Kimi K2's experts: 45 GB).

    Args:
      key: a JAX PRNG key.
      shape: the logical shape ``[..., N, K]``, K a multiple of 16.
      sharding: where to make the arrays: one ``jax.sharding.Sharding`` for all three, an
        ``NVFP4Tensor`` of shardings, or None for the default device.
    """
    *lead, n, k = shape
    if k % BLOCK:
        raise ValueError(f"shape: K = {k}, expected a multiple of {BLOCK}")
    lead = tuple(lead)

    def make(key):
        k_codes, k_scales = jax.random.split(key)
        return NVFP4Tensor(
            packed=jax.random.bits(k_codes, (*lead, n, k // 2), jnp.uint8),
            scales=jax.random.uniform(k_scales, (*lead, n, k // BLOCK), minval=0.5,
                                      maxval=1.5).astype(jnp.float8_e4m3fn),
            global_scale=jnp.full(lead, 0.3 / (E2M1_MAX * np.sqrt(k)), jnp.float32),
        )

    return jax.jit(make, out_shardings=sharding)(key)
