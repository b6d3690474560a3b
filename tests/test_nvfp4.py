"""NVFP4 against an independent float32 re-implementation of ModelOpt's recipe.

The reference below follows NVIDIA ModelOpt 0.47.0's NVFP4QTensor.quantize step by step
(searchsorted on the E2M1 midpoints, the zero-scale rule, the clamp of block scales to
E4M3's range, the fp32 products) in numpy + ml_dtypes; it shares no code with moe_jax.nvfp4.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from moe_jax import nvfp4

# The published E2M1 table: codes 0..7 are these magnitudes, bit 3 is the sign.
MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def modelopt_quantize_np(w: np.ndarray):
    w = np.asarray(w, np.float32)
    *lead, n, k = w.shape
    g = (np.abs(w).max(axis=(-2, -1)) / np.float32(6.0 * 448.0)).astype(np.float32)
    blocks = w.reshape(*lead, n, k // 16, 16)
    per_block = (np.abs(blocks).max(-1) / (np.float32(6.0) * g[..., None, None])).astype(np.float32)
    per_block[per_block == 0] = 1.0
    # ModelOpt >= 0.45 clamps to [smallest subnormal, largest normal] of E4M3 before the cast
    # (_cast_per_block_scale_to_fp8); torch's clamp keeps NaN, and so does np.clip.
    e4m3 = ml_dtypes.finfo(ml_dtypes.float8_e4m3fn)
    per_block = np.clip(per_block, np.float32(e4m3.smallest_subnormal), np.float32(e4m3.max))
    scale = per_block.astype(ml_dtypes.float8_e4m3fn)
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = blocks / (scale.astype(np.float32) * g[..., None, None])[..., None]
    scaled = scaled.reshape(*lead, n, k).astype(np.float32)
    bounds = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5], np.float32)
    mag = np.abs(scaled)
    ordinal = np.searchsorted(bounds, mag, side="left").astype(np.uint8)
    tie_up = np.isin(mag, bounds[[1, 3, 5]]).astype(np.uint8)
    code = ((scaled < 0).astype(np.uint8) << 3) + ordinal + tie_up
    packed = (code[..., 1::2] << 4) | code[..., 0::2]
    return packed, scale, g


def decode_np(packed, scale, g):
    lo, hi = packed & 0xF, packed >> 4
    code = np.stack([lo, hi], -1).reshape(*packed.shape[:-1], -1)
    values = np.where(code & 8, -1.0, 1.0) * np.array(MAGNITUDES)[code & 7]
    *lead, n, k = values.shape
    s = scale.astype(np.float64) * np.asarray(g, np.float64)[..., None, None]
    return (values.reshape(*lead, n, k // 16, 16) * s[..., None]).reshape(*lead, n, k)


def test_all_sixteen_codes_decode_to_the_published_values():
    codes = np.arange(16, dtype=np.uint8)
    expected = [m for m in MAGNITUDES] + [-m for m in MAGNITUDES]
    np.testing.assert_array_equal(np.asarray(nvfp4.e2m1_decode(jnp.asarray(codes))), expected)
    # And every code survives encode(decode(code)), except -0 which encodes as +0.
    again = np.asarray(nvfp4.e2m1_encode(nvfp4.e2m1_decode(jnp.asarray(codes))))
    np.testing.assert_array_equal(again, [*range(8), 0, *range(9, 16)])


def test_every_rounding_tie_goes_to_the_even_code():
    # Midpoint -> the neighbour whose code is even (its mantissa bit is 0).
    ties = {0.25: 0.0, 0.75: 1.0, 1.25: 1.0, 1.75: 2.0, 2.5: 2.0, 3.5: 4.0, 5.0: 4.0}
    v = np.array(list(ties) + [-t for t in ties], np.float32)
    want = np.array(list(ties.values()) + [-x for x in ties.values()], np.float32)
    got = np.asarray(nvfp4.e2m1_decode(nvfp4.e2m1_encode(jnp.asarray(v))))
    np.testing.assert_array_equal(got, want)
    # Just off the tie rounds to the nearer neighbour.
    eps = np.float32(1e-3)
    up = np.array([t + eps for t in ties], np.float32)
    nearest = [min(MAGNITUDES, key=lambda m: abs(m - u)) for u in up]
    np.testing.assert_array_equal(np.asarray(nvfp4.e2m1_decode(nvfp4.e2m1_encode(jnp.asarray(up)))), nearest)


def test_ties_inside_a_quantized_matrix():
    # One block with amax 2688 makes global = 1; a second block with amax 6 gets scale
    # exactly 1, so its elements are encoded as they are: ties must round half to even.
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0], np.float32)
    row = np.concatenate([np.full(16, 2688.0, np.float32), ties, -ties])
    t = nvfp4.quantize(jnp.asarray(row[None, :]))
    assert float(t.global_scale) == 1.0
    assert float(t.scales[0, 1].astype(jnp.float32)) == 1.0
    got = np.asarray(nvfp4.dequantize(t))[0, 16:]
    want = np.array([0, 1, 1, 2, 2, 4, 4, 6], np.float32)
    np.testing.assert_array_equal(got, np.concatenate([want, -want]))


def test_zero_blocks_get_scale_one_and_code_zero(rng):
    w = rng.standard_normal((4, 64)).astype(np.float32)
    w[1, 16:32] = 0.0
    t = nvfp4.quantize(jnp.asarray(w))
    assert float(t.scales[1, 1].astype(jnp.float32)) == 1.0
    np.testing.assert_array_equal(np.asarray(nvfp4.unpack_codes(t.packed))[1, 16:32], 0)
    np.testing.assert_array_equal(np.asarray(nvfp4.dequantize(t))[1, 16:32], 0.0)


def test_an_all_zero_matrix_gets_scale_one_where_modelopt_stores_nan():
    # The documented convention: ModelOpt's global scale is 0 there, its block ratio 0/0 = NaN
    # survives both the zero rule and the clamp, and it stores NaN scales; moe-jax stores 1.0.
    w = np.zeros((4, 32), np.float32)
    t = nvfp4.quantize(jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(t.scales.astype(jnp.float32)), 1.0)
    np.testing.assert_array_equal(np.asarray(nvfp4.unpack_codes(t.packed)), 0)
    np.testing.assert_array_equal(np.asarray(nvfp4.dequantize(t)), 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        packed, scale, g = modelopt_quantize_np(w)
    assert float(g) == 0.0 and np.isnan(scale.astype(np.float32)).all()


def test_tiny_blocks_keep_real_codes_at_the_smallest_scale(rng):
    # One outlier of 300 makes global = 300 / 2688; Gaussian blocks with std 3e-4 then have
    # block_amax / (6 * global) around 2**-10. ModelOpt <= 0.44 (and moe-jax, until it followed
    # 0.47) rounded those scales to E4M3 zero and stored code 7: the blocks read as zero. Since
    # 0.45 the scale is clamped to 2**-9 and the blocks keep real codes.
    w = (rng.standard_normal((128, 256)) * 3e-4).astype(np.float32)
    w[5, 37] = 300.0
    t = nvfp4.quantize(jnp.asarray(w))
    packed, scale, g = modelopt_quantize_np(w)
    np.testing.assert_array_equal(np.asarray(t.packed), packed)
    np.testing.assert_array_equal(np.asarray(t.scales).view(np.uint8), scale.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(t.global_scale), g)

    blocks = w.reshape(128, 16, 16)
    ratio = np.abs(blocks).max(-1) / (6 * np.float64(g))
    tiny = ratio <= 2.0**-10  # the blocks that underflowed to scale 0 before the clamp
    assert tiny.mean() > 0.2, tiny.mean()  # about 40% with this std
    scales = np.asarray(t.scales.astype(jnp.float32))
    assert (scales > 0).all()
    np.testing.assert_array_equal(scales[tiny], 2.0**-9)
    deq = np.asarray(nvfp4.dequantize(t)).reshape(128, 16, 16)
    assert (np.abs(deq[tiny]).max(-1) > 0).all()
    codes = np.asarray(nvfp4.unpack_codes(t.packed)).reshape(128, 16, 16)
    assert not (codes[tiny] == 7).all(-1).any()
    # Close to the input: the step at scale 2**-9 is coarse, yet far from the 100% error of zero.
    rel = np.linalg.norm(deq[tiny] - blocks[tiny]) / np.linalg.norm(blocks[tiny])
    assert rel < 0.3, rel
    np.testing.assert_allclose(deq.reshape(w.shape), decode_np(packed, scale, g), rtol=1e-6, atol=0)


def test_saturates_at_six_when_the_block_scale_rounds_down():
    # block_amax / (6 * global) = 1.0625 is an E4M3 tie that rounds to 1.0, so the block's
    # amax scales to 6.375 and must saturate to code 7 (6.0), not overflow.
    row = np.concatenate([np.full(16, 2688.0, np.float32), np.full(16, 6.375, np.float32)])
    t = nvfp4.quantize(jnp.asarray(row[None, :]))
    assert float(t.scales[0, 1].astype(jnp.float32)) == 1.0
    codes = np.asarray(nvfp4.unpack_codes(t.packed))[0, 16:]
    np.testing.assert_array_equal(codes, 7)


@pytest.mark.parametrize("shape", [(16, 32), (3, 8, 64), (2, 3, 4, 48)])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_bit_exact_against_independent_modelopt_recipe(rng, shape, dtype):
    # Heavy tails and a wide dynamic range, so small blocks hit tiny E4M3 scales.
    w = (rng.standard_t(3, size=shape) * np.exp(rng.uniform(-6, 2, size=shape[:-1] + (1,)))).astype(dtype)
    t = nvfp4.quantize(jnp.asarray(w))
    packed, scale, g = modelopt_quantize_np(np.asarray(w, np.float32))
    np.testing.assert_array_equal(np.asarray(t.packed), packed)
    np.testing.assert_array_equal(np.asarray(t.scales).view(np.uint8), scale.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(t.global_scale), g)
    np.testing.assert_allclose(np.asarray(nvfp4.dequantize(t)), decode_np(packed, scale, g), rtol=1e-6, atol=0)


def test_batched_experts_equal_per_matrix_quantization(rng):
    w = rng.standard_normal((5, 32, 48)).astype(np.float32) * rng.uniform(0.1, 10, (5, 1, 1)).astype(np.float32)
    batched = nvfp4.quantize(jnp.asarray(w))
    assert batched.global_scale.shape == (5,)
    for e in range(5):
        single = nvfp4.quantize(jnp.asarray(w[e]))
        np.testing.assert_array_equal(np.asarray(batched.packed[e]), np.asarray(single.packed))
        np.testing.assert_array_equal(np.asarray(batched.global_scale[e]), np.asarray(single.global_scale))


def test_packing_puts_element_2i_in_the_low_nibble():
    codes = jnp.asarray(np.array([[1, 2, 15, 8]], np.uint8))
    np.testing.assert_array_equal(np.asarray(nvfp4.pack_codes(codes)), [[0x21, 0x8F]])
    np.testing.assert_array_equal(np.asarray(nvfp4.unpack_codes(nvfp4.pack_codes(codes))), codes)


def test_quantization_error_is_nvfp4_sized(rng):
    w = rng.standard_normal((8, 256, 512)).astype(np.float32)
    deq = np.asarray(nvfp4.dequantize(nvfp4.quantize(jnp.asarray(w))))
    rel = np.linalg.norm(deq - w) / np.linalg.norm(w)
    # 4-bit E2M1 with 16-element E4M3 scales on Gaussian data: about 9-10%.
    assert 0.05 < rel < 0.13, rel


def test_shapes_and_dtypes():
    t = nvfp4.quantize(jnp.ones((3, 8, 32), jnp.bfloat16))
    assert t.shape == (3, 8, 32)
    assert t.packed.shape == (3, 8, 16) and t.packed.dtype == jnp.uint8
    assert t.scales.shape == (3, 8, 2) and t.scales.dtype == jnp.float8_e4m3fn
    assert t.global_scale.shape == (3,) and t.global_scale.dtype == jnp.float32
    assert nvfp4.dequantize(t, jnp.bfloat16).dtype == jnp.bfloat16
    # A pytree: jit sees three arrays.
    assert len(jax.tree.leaves(t)) == 3
    np.testing.assert_array_equal(jax.jit(nvfp4.dequantize)(t), nvfp4.dequantize(t))


@pytest.mark.parametrize(
    "w, message",
    [
        (np.ones((4, 24), np.float32), "K = shape\\[-1\\] = 24, expected a multiple of 16"),
        (np.ones((32,), np.float32), "rank 1, expected >= 2"),
        (np.ones((4, 32), np.int32), "expected a floating dtype"),
        (np.where(np.eye(4, 32) > 0, np.nan, 1.0).astype(np.float32), "4 non-finite values"),
        (np.where(np.eye(4, 32) > 0, np.inf, 1.0).astype(np.float32), "non-finite"),
    ],
)
def test_bad_input_raises_naming_the_argument(w, message):
    with pytest.raises(ValueError, match=f"w_test: .*{message}"):
        nvfp4.quantize(jnp.asarray(w), name="w_test")


def test_validate_names_the_broken_field():
    t = nvfp4.quantize(jnp.ones((2, 8, 32)))
    with pytest.raises(ValueError, match="w.scales: shape"):
        nvfp4.NVFP4Tensor(t.packed, t.scales[:, :, :1], t.global_scale).validate("w")
    with pytest.raises(ValueError, match="w.global_scale: shape"):
        nvfp4.NVFP4Tensor(t.packed, t.scales, t.global_scale[:1]).validate("w")
    with pytest.raises(ValueError, match="w.packed: dtype int8"):
        nvfp4.NVFP4Tensor(t.packed.astype(jnp.int8), t.scales, t.global_scale).validate("w")


# --- global scales per row group ----------------------------------------------------------------


def test_grouped_global_scales_apply_to_their_rows(rng):
    """``global_scale [..., G]``: rows ``i*N/G .. (i+1)*N/G - 1`` use scale ``i``."""
    t = nvfp4.quantize(jnp.asarray(rng.standard_normal((3, 12, 32)), jnp.float32))
    assert t.row_groups == 1
    factors = np.array([0.5, 4.0, 2.0 ** -3], np.float32)  # powers of two: the products stay exact
    grouped = nvfp4.NVFP4Tensor(t.packed, t.scales, t.global_scale[:, None] * factors).validate("w")
    assert grouped.row_groups == 3 and grouped.shape == t.shape
    want = np.asarray(nvfp4.dequantize(t)) * np.repeat(factors, 4)[None, :, None]
    np.testing.assert_array_equal(np.asarray(nvfp4.dequantize(grouped)), want)
    np.testing.assert_array_equal(np.asarray(jax.jit(nvfp4.dequantize)(grouped)), want)
    # One matrix (no leading axes), two groups.
    single = nvfp4.NVFP4Tensor(t.packed[0], t.scales[0], jnp.stack([t.global_scale[0], 2 * t.global_scale[0]]))
    got = np.asarray(nvfp4.dequantize(single.validate("w")))
    np.testing.assert_array_equal(got[:6], np.asarray(nvfp4.dequantize(t))[0, :6])
    np.testing.assert_array_equal(got[6:], 2 * np.asarray(nvfp4.dequantize(t))[0, 6:])


def test_validate_grouped_global_scales():
    t = nvfp4.quantize(jnp.ones((2, 12, 32)))
    for g in (1, 2, 3, 4, 6, 12):
        nvfp4.NVFP4Tensor(t.packed, t.scales, jnp.ones((2, g), jnp.float32)).validate("w")
    for shape in [(2, 5), (2, 0), (3, 2), (2, 2, 1), (1,)]:
        with pytest.raises(ValueError, match=rf"^w\.global_scale: shape \({', '.join(map(str, shape))},?\), "
                                             r"expected \(2,\) \(one per matrix\) or \(2, 'G'\) with G dividing N=12 "
                                             r"\(one per group of N/G rows\)$"):
            nvfp4.NVFP4Tensor(t.packed, t.scales, jnp.ones(shape, jnp.float32)).validate("w")


def test_concat_rows_is_exact(rng):
    """Gate and up quantized on their own (global scales about 5x apart) and fused: the result
    dequantizes to the parts' dequantizations bit for bit, codes and block scales untouched."""
    gate = nvfp4.quantize(jnp.asarray(rng.standard_normal((4, 16, 64)), jnp.float32))
    up = nvfp4.quantize(jnp.asarray(rng.standard_normal((4, 16, 64)) * 5, jnp.float32))
    fused = nvfp4.concat_rows(gate, up).validate("fused")
    assert fused.shape == (4, 32, 64) and fused.row_groups == 2
    np.testing.assert_array_equal(np.asarray(fused.global_scale),
                                  np.stack([np.asarray(gate.global_scale), np.asarray(up.global_scale)], axis=-1))
    for field in ("packed", "scales"):
        np.testing.assert_array_equal(np.asarray(getattr(fused, field)).view(np.uint8),
                                      np.concatenate([np.asarray(getattr(p, field)) for p in (gate, up)], 1).view(np.uint8))
    got = np.asarray(nvfp4.dequantize(fused))
    want = np.concatenate([np.asarray(nvfp4.dequantize(gate)), np.asarray(nvfp4.dequantize(up))], axis=1)
    assert got.tobytes() == want.tobytes()
    # Grouped parts keep their groups: three parts of equal group size give G = 1 + 2 + 1.
    three = nvfp4.concat_rows(gate, fused, up)
    assert three.global_scale.shape == (4, 4)
    assert np.asarray(nvfp4.dequantize(three)).tobytes() == np.concatenate([want[:, :16], want, want[:, 16:]], 1).tobytes()


def test_concat_rows_errors_name_the_part():
    a = nvfp4.quantize(jnp.ones((2, 16, 32)))
    with pytest.raises(ValueError, match=r"^parts: no tensors"):
        nvfp4.concat_rows(name="parts")
    with pytest.raises(ValueError, match=r"^parts\[1\]: shape \(2, 16, 64\) in 1 row groups, expected \[2, N, 32\] "
                                         r"in groups of 16 rows \(as parts\[0\]\)$"):
        nvfp4.concat_rows(a, nvfp4.quantize(jnp.ones((2, 16, 64))), name="parts")
    with pytest.raises(ValueError, match=r"^parts\[1\]: shape \(2, 8, 32\) in 1 row groups, expected .*groups of 16 rows"):
        nvfp4.concat_rows(a, nvfp4.quantize(jnp.ones((2, 8, 32))), name="parts")
    with pytest.raises(ValueError, match=r"^parts\[1\]\.global_scale: shape"):
        nvfp4.concat_rows(a, nvfp4.NVFP4Tensor(a.packed, a.scales, a.global_scale[:1]), name="parts")
