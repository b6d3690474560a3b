"""NVFP4 quantization inside ``jax.jit`` on a GPU gives the host's codes and scales, bit for bit.

Why: on an H200, XLA:GPU's excess-precision pass dropped the float32 -> E4M3 -> float32 round
trip of the block scale (12,453 of 262,144 codes off), and with that fixed the global scale
``amax / 2688`` still came out one float32 ulp off for a matrix with an outlier: XLA:GPU divides
float32 with PTX ``div.full.f32``. ``moe_jax.nvfp4`` now computes every quotient and product in
integer arithmetic on the float32 bits (benchmarks/NOTES.md, "Quantizing inside ``jit`` on a
GPU").
The CPU suite cannot show either failure; this is its twin on the GPU.

What: the weight kinds of ``tests/test_nvfp4.py`` (Gaussian, outliers, heavy-tailed, tiny block
scales, an all-zero matrix) at a realistic size, ``[4, 2048, 7168]``, as float32 and bfloat16,
plus the ``[2, 512, 512]`` case that failed before, quantized by ``jax.jit(quantize)`` on the GPU
and compared with the host's quantization of the same input: packed codes, block scales (as
uint8 bits) and global scales (as uint32 bits). A failure names how many of each differ and
shows the first few. Seeds come from the ``rng`` fixture (``MOE_JAX_SEED`` replays one).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from test_nvfp4 import WEIGHT_CASES, bit_mismatches, describe, modelopt_quantize_np, random_weights

from moe_jax import nvfp4

SHAPE = (4, 2048, 7168)  # four experts' gate/up-sized matrices of a Kimi K2-like model


def quantize_on_gpu_and_host(w: np.ndarray):
    gpu = jax.devices("gpu")[0]
    placed = jax.device_put(w, gpu)
    traced = jax.jit(nvfp4.quantize)(placed)
    assert traced.packed.devices() == {gpu}, traced.packed.devices()
    traced = jax.tree.map(np.asarray, traced)
    host = jax.tree.map(np.asarray, nvfp4.quantize(jax.device_put(w, jax.devices("cpu")[0])))
    return traced, host


def assert_same_bits(traced, host, w32: np.ndarray, skip_matrices=()) -> None:
    report = bit_mismatches(traced, host)
    # Also against the independent ModelOpt reference, so a failure says which side moved (the
    # all-zero matrix is left out: ModelOpt stores NaN scales there).
    keep = [i for i in range(w32.shape[0]) if i not in skip_matrices]
    reference = nvfp4.NVFP4Tensor(*modelopt_quantize_np(w32[keep]))
    against_reference = bit_mismatches(jax.tree.map(lambda a: a[keep], traced), reference)
    assert not report and not against_reference, (
        f"jit on the GPU vs the host: {describe(report) or 'equal'}. "
        f"jit on the GPU vs the ModelOpt reference (matrices {keep}): {describe(against_reference) or 'equal'}"
    )


@pytest.mark.gpu
# The first fix (float64 divisions) was not bit-exact here: on the H200, 9 of these 10 cases
# differed in 2 to 42,803 of 29,360,128 packed bytes. The integer version matched in all 10 at
# f63a2e1 (benchmarks/results/gpu_check.md).
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("case", WEIGHT_CASES)
def test_quantize_inside_jit_on_the_gpu_gives_the_hosts_bits(rng, case, dtype):
    w = random_weights(rng, case, SHAPE).astype(dtype)
    traced, host = quantize_on_gpu_and_host(w)
    assert_same_bits(traced, host, np.asarray(w, np.float32), skip_matrices=(1,) if case == "zero" else ())


@pytest.mark.gpu
@pytest.mark.parametrize("outlier", [False, True], ids=["gaussian", "one_outlier"])
def test_the_matrices_that_failed_on_the_h200(rng, outlier):
    """The reverted commit e056549's test: ``[2, 512, 512]`` Gaussian, and with one element of
    300 in the first matrix; its failing run had the second matrix's global scale one ulp off
    (``MOE_JAX_SEED=1376650495`` replays that run's draw)."""
    w = rng.standard_normal((2, 512, 512)).astype(np.float32)
    if outlier:
        w[0, 7, 11] = 300.0
    traced, host = quantize_on_gpu_and_host(w)
    assert_same_bits(traced, host, w)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["outliers", "zero"])
def test_a_large_array_on_the_gpu_is_quantized_there_with_the_hosts_bits(rng, monkeypatch, case):
    """A concrete array of more than ``DEVICE_MIN_ELEMENTS`` on the GPU (6 Kimi K2 down-sized
    matrices, 88 M elements) is quantized there, in chunks (at most 2 matrices: 3 chunks), with
    the bits of the host's quantization of the same values; the host path is not entered, and
    the result stays on the GPU. A NaN is the host path's one-line error."""
    w = random_weights(rng, case, (6, 7168, 2048))
    host = jax.tree.map(np.asarray, nvfp4.quantize(jax.device_put(w, jax.devices("cpu")[0])))
    gpu = jax.devices("gpu")[0]
    placed = jax.device_put(w, gpu)
    assert nvfp4.quantizes_on_device(placed)
    monkeypatch.setattr(nvfp4, "DEVICE_CHUNK_ELEMENTS", 2 * 7168 * 2048)
    monkeypatch.setattr(nvfp4, "_quantize_on_host", None)  # entering the host path fails
    on_gpu = nvfp4.quantize(placed)
    assert all(a.devices() == {gpu} for a in jax.tree.leaves(on_gpu))
    assert_same_bits(jax.tree.map(np.asarray, on_gpu), host, w, skip_matrices=(1,) if case == "zero" else ())
    with pytest.raises(ValueError, match=r"^w_down: 1 non-finite values \(NaN or Inf\); NVFP4 has no encoding"):
        nvfp4.quantize(placed.at[5, 7167, 2047].set(jnp.nan), name="w_down")
