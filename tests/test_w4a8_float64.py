"""The W4A8 tests' float64 side (``w4a8_float64``) against ml_dtypes' own float64 rounding."""

import ml_dtypes
import numpy as np

from w4a8_float64 import e4m3_round


def _cast(values: np.ndarray) -> np.ndarray:
    return values.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def test_e4m3_round_matches_the_float64_cast_at_every_value_midpoint_and_edge():
    every = np.unique(np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64))  # sorted
    finite = every[np.isfinite(every)]
    mids = (finite[1:] + finite[:-1]) / 2  # ties: to even
    edges = np.concatenate([finite, mids, np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf),
                            [448.5, 464.0, 465.0, 1e6, -1e6, np.nan, -0.0, np.inf, -np.inf, 1e-30, -1e-30]])
    # Exact in float32 (the fast path) and not (1 + 2**-40 is float64's alone).
    for values in (edges, edges * (1 + 2.0 ** -40)):
        got, want = e4m3_round(values), _cast(values)
        np.testing.assert_array_equal(got, want)
        assert np.array_equal(np.signbit(got), np.signbit(want))


def test_e4m3_round_matches_the_float64_cast_on_random_products():
    rng = np.random.default_rng()
    codes = rng.choice([0, 0.5, 1, 1.5, 2, 3, 4, 6], size=(64, 512)) * rng.choice([-1, 1], size=(64, 512))
    scales = _cast(rng.uniform(2.0 ** -9, 448, size=(64, 32))).repeat(16, axis=1)
    for values in (codes * scales / 8, rng.standard_normal((64, 512)) * np.exp(rng.uniform(-12, 6, (64, 1)))):
        np.testing.assert_array_equal(e4m3_round(values), _cast(values))
