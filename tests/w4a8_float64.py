"""W4A8's operands in float64, written from their definition: the reference side of the W4A8
kernel tests (Triton's interpreter and the GPU), independent of the code under test."""

from __future__ import annotations

import ml_dtypes
import numpy as np


# Every E4M3 byte's value (NaN for 0x7f and 0xff), in float64.
_E4M3_VALUES = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def e4m3_round(values: np.ndarray) -> np.ndarray:
    """float64 -> the nearest E4M3 value (ties to even), as float64.

    Values that float32 holds exactly (the callers' are: codes times block scales, float32
    products) are rounded from float32, the same single rounding: ml_dtypes converts float32
    faster than float64, and the table decodes the bytes faster than a cast (2x in all on this
    machine; the Kimi-size GPU test rounds ~10**9 values)."""
    values = np.asarray(values, np.float64)
    as_float32 = values.astype(np.float32)
    exact = np.array_equal(as_float32, values)
    return _E4M3_VALUES[(as_float32 if exact else values).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)]


def rows_as_multiplied(x_mk: np.ndarray) -> np.ndarray:
    """float64 of what W4A8 multiplies each row by: quantized to E4M3 against its own amax in
    float32 arithmetic as defined (``x * (448 / amax)``, rounded to nearest even, times
    ``amax * float32(1 / 448)``; a row of zeros stays zeros)."""
    x = x_mk.astype(np.float32)
    amax = np.abs(x).max(axis=1, keepdims=True)
    safe = np.where(amax == 0, np.float32(1), amax)
    inverse = np.where(amax == 0, np.float32(1), np.float32(448) / safe).astype(np.float32)
    scale = np.where(amax == 0, np.float32(1), amax * np.float32(1 / 448)).astype(np.float32)
    return e4m3_round((x * inverse).astype(np.float64)) * scale.astype(np.float64)
