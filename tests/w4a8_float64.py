"""W4A8's operands in float64, written from their definition: the reference side of the W4A8
kernel tests (Triton's interpreter and the GPU), independent of the code under test."""

from __future__ import annotations

import ml_dtypes
import numpy as np


def e4m3_round(values: np.ndarray) -> np.ndarray:
    """float64 -> the nearest E4M3 value (ties to even), as float64."""
    return values.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


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
