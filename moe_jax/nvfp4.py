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

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

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

    Matches ModelOpt's ``_cast_fp4``: ``-0.0`` encodes as 0, +-inf as +-6, NaN as code 7.
    """
    mag = jnp.abs(v)
    code = sum((mag > b).astype(jnp.uint8) for b in _E2M1_BOUNDS)
    code = code + sum((mag == b).astype(jnp.uint8) for b in _ROUND_UP_AT_TIE)
    code = jnp.where(jnp.isnan(v), jnp.uint8(7), code)
    return code | ((v < 0).astype(jnp.uint8) << 3)


def e2m1_decode(code: jax.Array) -> jax.Array:
    """E2M1 codes (any integer dtype, 0..15) to float32 values."""
    return jnp.asarray(E2M1_VALUES)[code.astype(jnp.int32)]


def pack_codes(code: jax.Array) -> jax.Array:
    """uint8 codes ``[..., K]`` to bytes ``[..., K/2]``, element ``2i`` in the low nibble."""
    return code[..., 0::2] | (code[..., 1::2] << 4)


def unpack_codes(packed: jax.Array) -> jax.Array:
    """Bytes ``[..., K/2]`` to uint8 codes ``[..., K]``; the inverse of :func:`pack_codes`."""
    lo, hi = packed & 0xF, packed >> 4
    return jnp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def _check_quantizable(w, name: str) -> None:
    if w.ndim < 2:
        raise ValueError(f"{name}: rank {w.ndim}, expected >= 2 ([..., N, K])")
    if w.shape[-1] % BLOCK:
        raise ValueError(f"{name}: K = shape[-1] = {w.shape[-1]}, expected a multiple of {BLOCK}")
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise ValueError(f"{name}: dtype {w.dtype}, expected a floating dtype")
    if not isinstance(w, jax.core.Tracer):
        bad = int(jnp.size(w) - jnp.count_nonzero(jnp.isfinite(w)))
        if bad:
            raise ValueError(f"{name}: {bad} non-finite values (NaN or Inf); NVFP4 has no encoding for them")


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

    Concrete inputs are quantized on the host CPU, where the result is verified bit for bit
    against an independent implementation of ModelOpt's recipe, and the result is put back where
    ``w`` was. On an H200, XLA:GPU's version of the same float32 arithmetic changed a few
    codes (benchmarks/NOTES.md, "NVFP4 quantization on a GPU"), so a one-time conversion does
    not run there. Traced inputs (inside ``jit``) run where the computation runs.

    ModelOpt itself usually runs on a GPU, where PyTorch computes ``amax / 2688`` as
    ``amax * fp32(1 / 2688)``; that rounds differently from the true division used here, so a
    checkpoint's ``weight_scale_2`` can be one ulp away from what this function computes for the
    same weights (and block scales and codes can follow it). The checkpoint is the truth: a
    loader must never re-quantize tensors a checkpoint already holds in NVFP4.

    Raises:
      ValueError: rank < 2, K not a multiple of 16, a non-floating dtype, or (for concrete
        inputs) any NaN/Inf.
    """
    _check_quantizable(w, name)
    if isinstance(w, jax.core.Tracer):
        return _quantize(w)
    w = jnp.asarray(w)
    t = _quantize(jax.device_put(w, jax.devices("cpu")[0]))
    # Back where w was: pinned there if w was, else uncommitted on the default device.
    if w.committed:
        return jax.device_put(t, w.sharding)
    return jax.tree.map(lambda a: jnp.asarray(np.asarray(a)), t)


def _true_divide(numerator: jax.Array, denominator: jax.Array) -> jax.Array:
    """IEEE float32 division, as ModelOpt's torch code does it.

    XLA rewrites ``a / broadcast(b)`` into ``a * broadcast(1 / b)``, which rounds differently;
    hiding the broadcast behind an optimization barrier keeps a true division.
    """
    denominator = jnp.broadcast_to(denominator, numerator.shape)
    return numerator / jax.lax.optimization_barrier(denominator)


@jax.jit
def _quantize(w: jax.Array) -> NVFP4Tensor:
    w = w.astype(jnp.float32)
    *lead, n, k = w.shape
    global_scale = _true_divide(jnp.max(jnp.abs(w), axis=(-2, -1)), jnp.float32(E2M1_MAX * E4M3_MAX))
    w_blocks = w.reshape(*lead, n, k // BLOCK, BLOCK)
    block_amax = jnp.max(jnp.abs(w_blocks), axis=-1)
    ratio = _true_divide(block_amax, jnp.float32(E2M1_MAX) * global_scale[..., None, None])
    # A zero matrix makes ratio 0/0; ModelOpt leaves that NaN, which would poison the scale.
    ratio = jnp.where((ratio == 0) | jnp.isnan(ratio), jnp.float32(1.0), ratio)
    # ModelOpt >= 0.45 clamps to E4M3's range, so a tiny block keeps the smallest subnormal
    # scale (2**-9) and real codes rather than rounding to scale 0.
    ratio = jnp.clip(ratio, jnp.float32(E4M3_MIN_SUBNORMAL), jnp.float32(E4M3_MAX))
    scales = ratio.astype(jnp.float8_e4m3fn)
    denom = scales.astype(jnp.float32) * global_scale[..., None, None]
    scaled = _true_divide(w_blocks, denom[..., None])
    # In an all-zero matrix (global scale 0) every element is 0/0; ModelOpt encodes that NaN
    # as code 7, which reads as 6 * scale if the global scale is ever replaced. Zero is code 0.
    scaled = jnp.where(w_blocks == 0, jnp.float32(0.0), scaled)
    codes = e2m1_encode(scaled.reshape(*lead, n, k))
    return NVFP4Tensor(packed=pack_codes(codes), scales=scales, global_scale=global_scale)


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
            scales=jax.random.uniform(k_scales, (*lead, n, k // BLOCK), minval=0.5, maxval=1.5).astype(jnp.float8_e4m3fn),
            global_scale=jnp.full(lead, 0.3 / (E2M1_MAX * np.sqrt(k)), jnp.float32),
        )

    return jax.jit(make, out_shardings=sharding)(key)
