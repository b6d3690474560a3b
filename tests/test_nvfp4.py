"""NVFP4 against an independent float32 re-implementation of ModelOpt's recipe.

The reference below follows NVIDIA ModelOpt 0.47.0's NVFP4QTensor.quantize step by step
(searchsorted on the E2M1 midpoints, the zero-scale rule, the clamp of block scales to
E4M3's range, the fp32 products) in numpy + ml_dtypes; it shares no code with moe_jax.nvfp4.

On a GPU machine most of this file still computes on the CPU (``quantize`` of a concrete array
runs on the host), and its traced quantization has a full-size twin there
(``tests/test_nvfp4_gpu.py``). The tests marked ``gpu_check`` run the exact float32 arithmetic on
the default backend: ``tools/gpu_check.sh`` runs them on the GPU too.
"""

import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from moe_jax import exact_float32, nvfp4

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


@pytest.mark.gpu_check  # XLA:GPU's float32 arithmetic (excess precision, division, subnormals) differs from XLA:CPU's
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
        (np.ones((0, 32), np.float32), "shape \\(0, 32\\), expected no zero-size dimension"),
        (np.ones((3, 0, 32), np.float32), "shape \\(3, 0, 32\\), expected no zero-size dimension"),
        (np.ones((3, 8, 0), np.float32), "shape \\(3, 8, 0\\), expected no zero-size dimension"),
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


# --- quantizing traced inputs: the host's bits on any backend ------------------------------------

#: Kinds of weights for the traced-versus-host checks (also used by tests/test_nvfp4_gpu.py).
WEIGHT_CASES = ("gaussian", "outliers", "heavy_tailed", "tiny", "zero")


def random_weights(rng, case: str, shape) -> np.ndarray:
    """float32 ``[E, N, K]`` weights of one kind (``E >= 2``), fresh from ``rng``.

    * ``gaussian``: standard normal.
    * ``outliers``: standard normal with one element of +-300 in every matrix, so most blocks sit
      far below the matrix amax (the case whose global scale came out one ulp off on the H200).
    * ``heavy_tailed``: Student-t (3 degrees of freedom), each row scaled by ``exp(U(-6, 2))``.
    * ``tiny``: one element of 300 per matrix; every other block has
      ``block_amax / (6 * global) = 2**U(-12, -4)``: block scales clamped to 2**-9, E4M3
      subnormals (below 2**-6) and small normals.
    * ``zero``: standard normal, with matrix 1 all zero and one all-zero block in matrix 0.
    """
    e, n, k = shape
    if case == "gaussian":
        w = rng.standard_normal(shape)
    elif case == "outliers":
        w = rng.standard_normal(shape)
        for i in range(e):
            w[i, rng.integers(n), rng.integers(k)] = 300.0 if i % 2 == 0 else -300.0
    elif case == "heavy_tailed":
        w = rng.standard_t(3, size=shape) * np.exp(rng.uniform(-6, 2, size=(e, n, 1)))
    elif case == "tiny":
        blocks = rng.uniform(-1, 1, (e, n, k // 16, 16))
        blocks /= np.abs(blocks).max(-1, keepdims=True)
        ratio = np.exp2(rng.uniform(-12, -4, (e, n, k // 16, 1)))
        w = (blocks * ratio * 6 * (300.0 / 2688.0)).reshape(shape)
        w[:, rng.integers(n), rng.integers(k)] = 300.0
    elif case == "zero":
        w = rng.standard_normal(shape)
        w[1] = 0.0
        w[0, 3, 16:32] = 0.0
    else:
        raise ValueError(case)
    return w.astype(np.float32)


def bit_mismatches(got: nvfp4.NVFP4Tensor, want: nvfp4.NVFP4Tensor) -> dict:
    """How many packed bytes, codes, block scales (E4M3 bits) and global scales (float32 bits)
    of ``got`` differ from ``want``, and the first few of each as (index, got, want)."""
    fields = {
        "packed bytes": (np.asarray(got.packed), np.asarray(want.packed)),
        "codes": (np.asarray(nvfp4.unpack_codes(got.packed)), np.asarray(nvfp4.unpack_codes(want.packed))),
        "block scales": (np.asarray(got.scales).view(np.uint8), np.asarray(want.scales).view(np.uint8)),
        "global scales": (np.asarray(got.global_scale).view(np.uint32), np.asarray(want.global_scale).view(np.uint32)),
    }
    report = {}
    for name, (a, b) in fields.items():
        assert a.shape == b.shape, (name, a.shape, b.shape)
        bad = np.argwhere(a != b)
        if len(bad):
            report[name] = (len(bad), a.size, [(tuple(int(i) for i in ix), a[tuple(ix)], b[tuple(ix)]) for ix in bad[:3]])
    return report


def describe(report: dict) -> str:
    return "; ".join(f"{n} of {size} {name} differ, e.g. (index, got, want) {examples}"
                     for name, (n, size, examples) in report.items())


def as_numpy_tensor(packed, scale, g) -> nvfp4.NVFP4Tensor:
    return nvfp4.NVFP4Tensor(packed=packed, scales=scale, global_scale=np.asarray(g, np.float32))


def assert_bit_exact(got, host, w32, case):
    """``got`` equals the host's quantization and, except for the all-zero matrix (ModelOpt
    stores NaN scales there), the independent ModelOpt reference, bit for bit."""
    report = bit_mismatches(got, host)
    assert not report, f"traced vs host: {describe(report)}"
    keep = [i for i in range(w32.shape[0]) if not (case == "zero" and i == 1)]
    reference = as_numpy_tensor(*modelopt_quantize_np(w32[keep]))
    report = bit_mismatches(jax.tree.map(lambda a: np.asarray(a)[keep], got), reference)
    assert not report, f"traced vs ModelOpt reference: {describe(report)}"


def test_no_xla_flag_is_needed():
    # The traced checks below run with XLA's defaults: no excess-precision or fast-math switch.
    assert "excess_precision" not in os.environ.get("XLA_FLAGS", "")
    assert "fast_math" not in os.environ.get("XLA_FLAGS", "")


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("case", WEIGHT_CASES)
def test_quantize_traced_inside_jit_gives_the_hosts_bits(rng, case, dtype):
    """``quantize`` of a traced input, inside a user's ``jit`` (alone, next to other work, and
    under ``vmap``), equals the host's quantization of the same concrete input bit for bit."""
    w = random_weights(rng, case, (3, 64, 256)).astype(dtype)
    w32 = np.asarray(w, np.float32)
    host = nvfp4.quantize(jnp.asarray(w))

    alone = jax.jit(nvfp4.quantize)(jnp.asarray(w))
    assert_bit_exact(alone, host, w32, case)

    @jax.jit
    def with_other_work(x):
        t = nvfp4.quantize(x * jnp.asarray(1, x.dtype) + jnp.asarray(0, x.dtype))
        return t, nvfp4.dequantize(t), jnp.sum(x.astype(jnp.float32) ** 2)

    inside, deq, _ = with_other_work(jnp.asarray(w))
    assert_bit_exact(inside, host, w32, case)
    np.testing.assert_array_equal(np.asarray(deq), np.asarray(nvfp4.dequantize(host)))

    mapped = jax.jit(jax.vmap(nvfp4.quantize))(jnp.asarray(w))
    assert_bit_exact(mapped, host, w32, case)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("case", WEIGHT_CASES)
def test_the_host_s_chunks_give_the_whole_tensor_s_bits(rng, monkeypatch, case, dtype):
    """A concrete tensor is quantized in padded chunks of blocks: with chunks of at most 16
    blocks (here 90 blocks in 3 matrices: matrices straddle chunks, the last chunk is padded),
    the bits are those of the whole tensor quantized traced in one program, and ModelOpt's."""
    monkeypatch.setattr(nvfp4, "_HOST_CHUNK_BLOCKS", (4, 16))
    w = random_weights(rng, case, (3, 10, 48)).astype(dtype)
    chunked = nvfp4.quantize(jnp.asarray(w))
    whole = jax.jit(nvfp4.quantize)(jnp.asarray(w))
    assert_bit_exact(chunked, whole, np.asarray(w, np.float32), case)


def test_the_host_s_programs_do_not_grow_with_the_shapes(rng):
    """Concrete tensors of different shapes but the same block-count bucket and dtype share the
    host quantizer's compiled programs (one per shape took ~0.4 s to trace and compile)."""
    nvfp4.quantize(jnp.asarray(rng.standard_normal((2, 8, 32)), jnp.float32))
    programs = nvfp4._host_encode._cache_size(), nvfp4._host_block_amax._cache_size()
    for shape in [(16, 32), (3, 8, 64), (5, 4, 16, 16), (7, 40, 48)]:
        nvfp4.quantize(jnp.asarray(rng.standard_normal(shape), jnp.float32))
    assert (nvfp4._host_encode._cache_size(), nvfp4._host_block_amax._cache_size()) == programs


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("case", WEIGHT_CASES)
def test_the_device_path_s_chunks_give_the_hosts_bits(rng, monkeypatch, case, dtype):
    """The path a large concrete array on an accelerator takes (here on the CPU, which runs the
    same program): 6 matrices of 1024 elements in chunks of at most 2048 (3 chunks of 2), and 5
    in 5 chunks of 1, equal the host's quantization and ModelOpt's, bit for bit."""
    monkeypatch.setattr(nvfp4, "DEVICE_CHUNK_ELEMENTS", 2048)
    for matrices in (6, 5):
        w = random_weights(rng, case, (matrices, 16, 64)).astype(dtype)
        on_device = nvfp4._quantize_on_device(jnp.asarray(w))
        assert_bit_exact(on_device, nvfp4.quantize(jnp.asarray(w)), np.asarray(w, np.float32), case)


def test_the_device_path_keeps_the_leading_axes_and_the_placement(rng, cpu_devices):
    """No leading axis, two of them; the result on ``w``'s device, committed as ``w`` was."""
    for shape in [(32, 64), (2, 3, 16, 32)]:
        w = jnp.asarray(rng.standard_normal(shape), jnp.float32)
        on_device, host = nvfp4._quantize_on_device(w), nvfp4.quantize(w)
        assert not bit_mismatches(on_device, host) and on_device.global_scale.shape == shape[:-2]
        assert not on_device.packed.committed
    placed = jax.device_put(jnp.asarray(rng.standard_normal((3, 16, 32)), jnp.float32), cpu_devices[3])
    t = nvfp4._quantize_on_device(placed)
    assert all(a.committed and a.devices() == {cpu_devices[3]} for a in jax.tree.leaves(t))


def test_the_device_path_s_chunks():
    """Equal chunks of whole matrices, the fewest of at most 2**28 elements where the matrices
    divide so (48 Kimi K2 gate/up matrices of 4096 x 7168: 9 would fit a chunk, 8 divide 48)."""
    assert nvfp4._chunk_count(48, 4096 * 7168) == 6
    assert nvfp4._chunk_count(48, 2048 * 7168) == 3  # 18 fit, 16 divide
    assert nvfp4._chunk_count(384, 7168 * 2048) == 24  # 18 fit, 16 divide
    assert nvfp4._chunk_count(7, 2**27) == 7  # 2 fit, 7 is prime
    assert nvfp4._chunk_count(2, 2**29) == 2  # a matrix alone is more than a chunk
    assert nvfp4._chunk_count(1, 2**20) == 1


def test_the_device_path_names_non_finite_values_as_the_host_does(rng):
    w = rng.standard_normal((3, 16, 32)).astype(np.float32)
    w[1, 2, 3], w[2, 0, 0] = np.nan, -np.inf
    messages = []
    for quantize in (nvfp4.quantize, nvfp4._quantize_on_device):
        with pytest.raises(ValueError, match=r"^params\['experts'\]: 2 non-finite values \(NaN or Inf\)") as error:
            quantize(jnp.asarray(w), name="params['experts']")
        messages.append(str(error.value))
    assert messages[0] == messages[1]


def test_only_large_arrays_on_an_accelerator_are_quantized_there(rng, monkeypatch):
    """NumPy input and arrays on a CPU stay on the host path at any size; below the threshold
    every input does (the accelerator case runs in tests/test_nvfp4_gpu.py)."""
    w = rng.standard_normal((2, 16, 32)).astype(np.float32)
    monkeypatch.setattr(nvfp4, "DEVICE_MIN_ELEMENTS", 1)
    assert not nvfp4.quantizes_on_device(w) and not nvfp4.quantizes_on_device(jnp.asarray(w))
    monkeypatch.setattr(nvfp4, "DEVICE_MIN_ELEMENTS", w.size + 1)
    assert not nvfp4.quantizes_on_device(jnp.asarray(w))


@pytest.mark.parametrize("case", WEIGHT_CASES)
def test_quantize_under_shard_map_gives_the_hosts_bits(rng, cpu_devices, case):
    """Experts sharded over the 8 CPU devices (two matrices each), each device quantizing its
    own: equal to the host's quantization of the whole batch, bit for bit."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(cpu_devices[:8]), ("expert",))
    w = random_weights(rng, case, (16, 32, 128))
    host = nvfp4.quantize(jnp.asarray(w))
    placed = jax.device_put(w, NamedSharding(mesh, P("expert")))
    sharded = jax.jit(jax.shard_map(nvfp4.quantize, mesh=mesh, in_specs=P("expert"), out_specs=P("expert")))(placed)
    assert len(sharded.packed.sharding.device_set) == 8
    assert_bit_exact(sharded, host, w, case)


def test_float64_input_rounds_to_float32_first(rng):
    """With x64 on, a float64 input quantizes as its float32 rounding (numpy's, IEEE) does,
    traced or not (the rounding must survive XLA's folding of conversion chains), including
    values whose float32 rounding is subnormal (XLA:CPU's float64 -> float32 conversion flushes
    those to zero; quantize rounds the bits itself)."""
    w = rng.standard_normal((3, 32, 64)) * (1 + 2.0**-30)  # far from float32 values
    w[2] *= 1e-41  # float32 subnormals (and zeros), and a subnormal global scale
    w[1, :, 16:48] *= 1e-42
    w32 = w.astype(np.float32)
    assert ((np.abs(w32) < np.finfo(np.float32).tiny) & (w32 != 0)).sum() > 1000
    with jax.enable_x64(True):
        want = nvfp4.quantize(jnp.asarray(w32))
        for got in (nvfp4.quantize(jnp.asarray(w)), jax.jit(nvfp4.quantize)(jnp.asarray(w))):
            report = bit_mismatches(got, want)
            assert not report, describe(report)
    report = bit_mismatches(want, as_numpy_tensor(*modelopt_quantize_np(w32)))
    assert not report, describe(report)


@pytest.mark.gpu_check  # XLA:GPU's float32 arithmetic (excess precision, division, subnormals) differs from XLA:CPU's
def test_round_to_e4m3_is_the_e4m3_cast(rng):
    """The exact float32 rounding of block scales equals the float8_e4m3fn cast on every E4M3
    value in [2**-9, 448], the midpoints between neighbours (ties to even), one float32 ulp on
    either side of each, and random values in the range. (All 148,897,793 float32 values of the
    range were checked once, offline.)"""
    grid = np.unique(np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32))
    grid = grid[(grid >= 2.0**-9) & (grid <= 448)]
    mid = ((grid[:-1].astype(np.float64) + grid[1:]) / 2).astype(np.float32)  # exact in float32
    near = np.concatenate([grid, mid])
    r = np.concatenate([near, np.nextafter(near, 0), np.nextafter(near, np.inf),
                        np.exp2(rng.uniform(-9, np.log2(448), 1 << 20))]).astype(np.float32)
    r = r[(r >= 2.0**-9) & (r <= 448)]
    got = np.asarray(jax.jit(nvfp4._round_to_e4m3)(r))
    want = r.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(got, want)


# --- exact float32 division and multiplication on the bits -----------------------------------------


def f32(sign, biased, significand) -> np.ndarray:
    """float32 from sign (0/1), biased exponent (1..254) and a 23-bit fraction, or subnormal when
    ``biased`` is 0."""
    return ((np.asarray(sign, np.uint32) << 31) | (np.asarray(biased, np.uint32) << 23)
            | np.asarray(significand, np.uint32)).view(np.float32)


def any_finite(rng, n) -> np.ndarray:
    """Uniform over the bit patterns of finite float32 values, both signs: every exponent,
    subnormals and zeros included."""
    bits = rng.integers(0, 0x7F800000, n, dtype=np.uint32) | (rng.integers(0, 2, n, dtype=np.uint32) << 31)
    return bits.view(np.float32)


def near_midpoint_quotients(rng, n):
    """Pairs ``(a, b)`` of float32 significands (``A``, ``B`` in ``[2**23, 2**24)``) whose quotient
    is within ``7 / (B * 2**s)`` (relative at most 2**-44) of a rounding midpoint ``T / 2**s``
    (``T`` odd, 25 bits): ``A * 2**s - B * T = d`` for a small odd ``d``, solved with the inverse of
    ``B`` modulo ``2**s`` (``s = 24``: quotients in [1, 2); ``s = 25``: in [1/2, 1))."""
    b = rng.integers(1 << 22, 1 << 23, n, dtype=np.uint64) * 2 + 1  # odd
    inverse = b.copy()  # b * b = 1 (mod 8); each Newton step doubles the correct bits
    for _ in range(5):
        inverse = inverse * (np.uint64(2) - b * inverse)
    d = rng.choice(np.array([-7, -5, -3, -1, 1, 3, 5, 7]), n)
    pairs = []
    for s in (24, 25):
        modulus = np.uint64(1 << s)
        t = ((-d).astype(np.int64).astype(np.uint64) * inverse) % modulus
        t = t + (np.uint64(1 << 24) if s == 24 else np.uint64(0))
        numerator = b * t + d.astype(np.int64).astype(np.uint64)  # b * t < 2**49: no wrap
        a = numerator >> np.uint64(s)
        ok = (t >= (1 << 24)) & (t < (1 << 25)) & (a >= (1 << 23)) & (a < (1 << 24))
        assert np.all((numerator[ok] & (modulus - np.uint64(1))) == 0)
        pairs.append((a[ok], b[ok]))
    a = np.concatenate([p[0] for p in pairs]).astype(np.uint32) - np.uint32(1 << 23)
    b = np.concatenate([p[1] for p in pairs]).astype(np.uint32) - np.uint32(1 << 23)
    return a, b  # as 23-bit fractions


def assert_same_float_bits(got, want, *inputs):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    bad = np.flatnonzero(got.view(np.uint32)[~nan] != want.view(np.uint32)[~nan])
    examples = [(tuple(float(x[~nan][i]) for x in inputs), float(got[~nan][i]), float(want[~nan][i])) for i in bad[:5]]
    assert not len(bad), f"{len(bad)} of {got.size} differ, e.g. (inputs, got, want) {examples}"


def division_cases(rng):
    """(name, a, b) float32 arrays for the division tests, 4.6M pairs in all."""
    n = 1 << 20
    cases = [("any finite", any_finite(rng, n), any_finite(rng, n))]
    # The quantizer's ranges: weights over 2**-60..2**20 by denominators 2**-70..2**10.
    sig = lambda m: rng.integers(0, 1 << 23, m, dtype=np.uint32)
    cases.append(("quantizer range", f32(0, rng.integers(127 - 60, 127 + 20, n), sig(n)),
                  f32(0, rng.integers(127 - 70, 127 + 10, n), sig(n))))
    # Quotients within 2**-44 (relative) of a rounding midpoint, at random scales (some results subnormal).
    a_frac, b_frac = near_midpoint_quotients(rng, n)
    m = len(a_frac)
    ea = rng.integers(1, 255, m)
    eb = np.clip(ea - rng.integers(-40, 40, m), 1, 254)
    cases.append(("near midpoint", f32(0, ea, a_frac), f32(0, eb, b_frac)))
    deep = rng.integers(1, 40, m)  # quotient exponent about -126 - deep: subnormal results
    cases.append(("near midpoint, subnormal result", f32(0, np.clip(deep, 1, 254), a_frac),
                  f32(0, np.clip(deep + 126 + rng.integers(0, 24, m), 1, 254), b_frac)))
    # Exact quotients: a = q * b with 12-bit significands, so a is exact.
    q = (rng.integers(1 << 11, 1 << 12, n) * np.exp2(rng.integers(-30, 30, n) - 11.0))
    b = (rng.integers(1 << 11, 1 << 12, n) * np.exp2(rng.integers(-30, 30, n) - 11.0))
    cases.append(("exact", (q * b).astype(np.float32), b.astype(np.float32)))
    # E2M1 boundaries: a within 4 ulp of fl32(bound * d), for quantizer-like denominators d.
    d = f32(0, rng.integers(127 - 40, 127 + 5, n), sig(n))
    bound = rng.choice(np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]), n) * np.exp2(rng.integers(-2, 3, n))
    a = ((bound * d.astype(np.float64)).astype(np.float32).view(np.uint32) + rng.integers(-4, 5, n).astype(np.uint32))
    cases.append(("E2M1 boundaries", a.view(np.float32), d))
    # Subnormal operands and results, exact subnormal ties included (odd * 2**-149 / 2**k).
    odd = (rng.integers(0, 1 << 22, n, dtype=np.uint32) * 2 + 1)
    cases.append(("subnormal / power of two", odd.view(np.float32), np.exp2(rng.integers(-5, 6, n)).astype(np.float32)))
    cases.append(("subnormal by subnormal", f32(0, 0, sig(n)), f32(0, 0, sig(n))))
    cases.append(("zeros", np.zeros(4, np.float32), np.array([1.0, 0.0, 1e-45, -3.0], np.float32)))
    return cases


@pytest.mark.gpu_check  # XLA:GPU's float32 arithmetic (excess precision, division, subnormals) differs from XLA:CPU's
def test_divide_f32_exact_is_ieee_division(rng):
    """``exact_float32.divide`` (integer arithmetic on the bits) against numpy's float32 division,
    which is IEEE 754's (round half to even, subnormals kept), bit for bit: every finite exponent
    (overflow to inf, subnormal and zero results), the quantizer's ranges, quotients within
    2**-44 (relative) of a rounding midpoint, exact quotients, E2M1 boundaries, subnormal
    operands and exact subnormal ties, and division by zero (inf, or NaN for 0/0)."""
    divide = jax.jit(exact_float32.divide)
    for name, a, b in division_cases(rng):
        with np.errstate(all="ignore"):
            want = a / b
        try:
            assert_same_float_bits(divide(a, b), want, a, b)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None
    # A scalar denominator broadcasts (the global scale's 2688).
    a = any_finite(rng, 1 << 16)
    assert_same_float_bits(jax.jit(lambda x: exact_float32.divide(x, jnp.float32(2688.0)))(a),
                           a / np.float32(2688.0), a)


@pytest.mark.gpu_check  # XLA:GPU's float32 arithmetic (excess precision, division, subnormals) differs from XLA:CPU's
def test_multiply_f32_exact_is_ieee_multiplication(rng):
    """``exact_float32.multiply`` against numpy's float32 product bit for bit: every finite exponent,
    the quantizer's products (6 * global scale, E4M3 value * global scale), exact ties (12- and
    13-bit significands) and subnormal results."""
    n = 1 << 20
    e4m3 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    e4m3 = e4m3[np.isfinite(e4m3) & (e4m3 > 0)]
    global_scale = any_finite(rng, n)
    global_scale = np.abs(global_scale) * np.float32(2.0**-10)  # where amax / 2688 lands
    ties = lambda bits: (rng.integers(1 << (bits - 1), 1 << bits, n) * np.exp2(rng.integers(-100, 90, n) - bits + 1.0))
    cases = [
        ("any finite", any_finite(rng, n), any_finite(rng, n)),
        ("6 * global scale", np.float32(6.0) * np.ones(n, np.float32), global_scale),
        ("E4M3 * global scale", rng.choice(e4m3, n), global_scale),
        ("ties", ties(12).astype(np.float32), ties(14).astype(np.float32)),
        ("subnormal results", f32(0, rng.integers(1, 100, n), rng.integers(0, 1 << 23, n)),
         f32(0, rng.integers(1, 60, n), rng.integers(0, 1 << 23, n))),
    ]
    multiply = jax.jit(exact_float32.multiply)
    for name, a, b in cases:
        with np.errstate(all="ignore"):
            want = a * b
        try:
            assert_same_float_bits(multiply(a, b), want, a, b)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


@pytest.mark.gpu_check  # XLA:GPU's float32 arithmetic (excess precision, division, subnormals) differs from XLA:CPU's
def test_e2m1_encode_reads_subnormals_as_nonzero():
    # XLA:CPU's float comparisons read subnormals as zero; the encoder decides on the bits, as
    # ModelOpt (torch on IEEE floats) does: a negative subnormal is code 8 (-0.0 in E2M1).
    v = np.array([1e-40, -1e-40, -0.0, 0.0, np.inf, -np.inf, np.nan, -np.nan, 0.25, -0.75], np.float32)
    np.testing.assert_array_equal(np.asarray(nvfp4.e2m1_encode(jnp.asarray(v))), [0, 8, 0, 0, 7, 15, 7, 7, 0, 10])


def subnormal_weights(rng) -> np.ndarray:
    """float32 ``[4, 32, 64]`` in the corners where XLA:CPU's float arithmetic would flush
    subnormals to zero and IEEE (numpy, torch) does not.

    0. amax about 1e-36: the global scale (amax / 2688) and its products are subnormal.
    1. amax 1, with blocks of subnormal elements (about 1e-42): block ratios below 2**-126, which
       are not zero and clamp to 2**-9; their negative elements are code 8 (``scaled < 0``).
    2. Every element subnormal (amax about 1e-39): a global scale of a few subnormal steps.
    3. Gaussian, with single subnormal elements sprinkled in.
    """
    w = rng.standard_normal((4, 32, 64))
    w[0] *= 1e-36
    w[1, :, 16:48] *= 1e-42
    w[2] *= 3e-40
    w[3].flat[rng.integers(0, 32 * 64, 50)] = rng.standard_normal(50) * 1e-40
    return w.astype(np.float32)


@pytest.mark.gpu_check  # XLA:GPU's float32 arithmetic (excess precision, division, subnormals) differs from XLA:CPU's
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["float32", "bfloat16"])
def test_subnormal_corner_cases_follow_ieee_like_numpy(rng, dtype):
    """Where IEEE 754 and XLA:CPU's flush-to-zero float arithmetic disagree (subnormal global
    scales, block ratios, quotients and elements), quantize follows IEEE, as the numpy ModelOpt
    reference computes it (and torch on a GPU): bit for bit, on the host and traced."""
    w = np.asarray(subnormal_weights(rng).astype(dtype), np.float32)
    assert (np.abs(w[[0, 2, 3]]) < np.finfo(np.float32).tiny).any(axis=(1, 2)).all()
    reference = as_numpy_tensor(*modelopt_quantize_np(w))
    g = np.asarray(reference.global_scale)
    assert 0 < g[0] < np.finfo(np.float32).tiny and 0 < g[2] < np.finfo(np.float32).tiny
    if dtype == np.float32:  # bfloat16's smallest subnormal (2**-133) is too large for this one
        ratio = np.abs(w[1].reshape(32, 4, 16)).max(-1) / (np.float32(6) * g[1])
        assert ((ratio > 0) & (ratio < np.finfo(np.float32).tiny)).any()  # XLA:CPU floats read these as 0 (scale 1.0)
    x = jnp.asarray(w.astype(dtype))
    host = nvfp4.quantize(x)
    for got in (host, jax.jit(nvfp4.quantize)(x), jax.jit(jax.vmap(nvfp4.quantize))(x)):
        report = bit_mismatches(got, reference)
        assert not report, describe(report)
    # Negative elements of the tiny blocks (float32 only: bfloat16 rounds them to zero) have
    # nonzero negative quotients rounding to E2M1's 0: code 8, -0.0.
    codes = np.asarray(nvfp4.unpack_codes(host.packed))[1, :, 16:48]
    if dtype == np.float32:
        assert (codes[w[1, :, 16:48] < 0] == 8).all() and (w[1, :, 16:48] < 0).any()


@pytest.mark.gpu_check  # XLA:GPU's float32 arithmetic (excess precision, division, subnormals) differs from XLA:CPU's
def test_global_scale_zero_keeps_code_zero_for_zero_elements(rng):
    """A matrix whose amax is at most 2688 * 2**-150 (all elements tiny subnormals) has global
    scale 0, as in ModelOpt: every block ratio is x / 0 = inf (clamped to 448) and every nonzero
    element's quotient inf (code +-7), as in the reference. Where ModelOpt has 0 / 0 it differs as
    for an all-zero matrix: an all-zero block's ratio (NaN there) gives scale 1.0, a zero element
    (code 7 there) code 0."""
    w = f32(rng.integers(0, 2, (2, 16, 32)), 0, rng.integers(0, 1 << 10, (2, 16, 32))).copy()
    w[:, 0, :16] = 0.0  # an all-zero block in each matrix
    w[:, 3, 5] = 0.0  # a zero element in a nonzero block
    t = nvfp4.quantize(jnp.asarray(w))
    with np.errstate(divide="ignore", invalid="ignore"):
        packed, scale, g = modelopt_quantize_np(w)
    np.testing.assert_array_equal(np.asarray(t.global_scale), 0.0)
    np.testing.assert_array_equal(np.asarray(g), 0.0)
    got_scale, want_scale = np.asarray(t.scales.astype(jnp.float32)), scale.astype(np.float32)
    zero_block = (w.reshape(2, 16, 2, 16) == 0).all(-1)
    np.testing.assert_array_equal(got_scale[~zero_block], want_scale[~zero_block])
    np.testing.assert_array_equal(want_scale[~zero_block], 448.0)
    np.testing.assert_array_equal(got_scale[zero_block], 1.0)
    assert np.isnan(want_scale[zero_block]).all()
    got, want = np.asarray(nvfp4.unpack_codes(t.packed)), np.asarray(nvfp4.unpack_codes(packed))
    zero = w == 0
    np.testing.assert_array_equal(got[~zero], want[~zero])
    np.testing.assert_array_equal(got[zero], 0)
    np.testing.assert_array_equal(want[zero], 7)
    report = bit_mismatches(jax.jit(nvfp4.quantize)(jnp.asarray(w)), t)
    assert not report, describe(report)


@pytest.mark.gpu_check  # XLA:GPU's float32 arithmetic (excess precision, division, subnormals) differs from XLA:CPU's
def test_compiled_quantizer_has_no_float_division_and_no_conversion_round_trip():
    """What XLA:GPU got wrong, checked in XLA:CPU's optimized HLO: no division at all (the
    quotients are integer arithmetic on the bits; XLA:GPU's float32 division is
    ``div.full.f32`` and some of its fusions did not keep float64 divisions exact), nothing in
    float64, and no chain of conversions that narrows a value and widens it again (XLA:GPU's
    excess-precision pass would fold it away)."""
    import re

    bits = {"f8e4m3fn": 8, "bf16": 16, "f16": 16, "f32": 32, "f64": 64}
    for dtype in (jnp.float32, jnp.bfloat16):
        hlo = jax.jit(nvfp4.quantize).lower(jnp.ones((3, 32, 64), dtype)).compile().as_text()
        ops = {}
        for line in hlo.splitlines():
            m = re.match(r"\s*(?:ROOT )?%(\S+) = (\w+)\[[^\]]*\]\S* ([\w-]+)\((.*?)\)", line)
            if m:
                ops[m.group(1)] = (m.group(3), m.group(2), re.findall(r"%([\w.-]+)", m.group(4)))
        assert len(ops) > 50, hlo[:2000]  # the pattern still reads this HLO
        divides = [(name, t) for name, (op, t, _) in ops.items() if op in ("divide", "remainder")]
        assert not divides, divides
        assert "f64" not in hlo
        for name, (op, t, args) in ops.items():
            if op != "convert" or t not in bits or not args or ops.get(args[0], ("",))[0] != "convert":
                continue
            middle = ops[args[0]]
            source = ops.get(middle[2][0], ("", "?"))[1] if middle[2] else "?"
            if middle[1] in bits and source in bits:
                assert bits[middle[1]] >= min(bits[source], bits[t]), (name, source, middle[1], t)


def test_quantize_rows_gives_each_row_its_own_scale_and_a_bad_row_changes_no_other(rng):
    """W4A4 activations: row m quantized exactly as the one-row matrix ``x[m]`` would be, so a
    non-finite or huge token leaves every other token's codes and scales alone."""
    x = jnp.asarray(rng.standard_normal((6, 64)) * rng.uniform(0.01, 100, (6, 1)), jnp.float32)
    packed, scales, g = nvfp4.quantize_rows(x)
    assert packed.shape == (6, 32) and scales.shape == (6, 4) and g.shape == (6,)
    for m in range(6):
        row = nvfp4.quantize(x[m:m + 1])
        np.testing.assert_array_equal(np.asarray(packed[m]), np.asarray(row.packed[0]))
        np.testing.assert_array_equal(np.asarray(scales[m]).view(np.uint8), np.asarray(row.scales[0]).view(np.uint8))
        assert np.asarray(g[m]) == np.asarray(row.global_scale)
    bad = x.at[2, 5].set(jnp.inf).at[4].multiply(1e6)
    packed_b, scales_b, g_b = nvfp4.quantize_rows(bad)
    keep = np.array([0, 1, 3, 5])
    np.testing.assert_array_equal(np.asarray(packed_b)[keep], np.asarray(packed)[keep])
    np.testing.assert_array_equal(np.asarray(g_b)[keep], np.asarray(g)[keep])
