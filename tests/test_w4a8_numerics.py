"""``benchmarks/w4a8_numerics.py``: its FP8 roundings, and the order of the variants' errors at a
small shape (the full-size figures are in ``benchmarks/results/w4a8_numerics_cpu/``)."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import w4a8_numerics  # noqa: E402

from moe_jax import nvfp4  # noqa: E402


def test_e4m3_rounding_keeps_its_values_and_rounds_to_the_nearest(rng):
    exact = np.array([0.0, 2.0**-9, 0.875, 1.0, 1.125, 6.0, 240.0, 448.0, -3.5])  # E4M3 values
    np.testing.assert_array_equal(w4a8_numerics.round_e4m3(exact), exact)
    a = rng.uniform(1.0, 2.0, 1000)  # spacing 1/8 in [1, 2)
    assert np.all(np.abs(w4a8_numerics.round_e4m3(a) - a) <= 1 / 16)


def test_folded_weights_are_within_one_e4m3_rounding_of_the_exact_ones(rng):
    w = nvfp4.quantize(jax.random.normal(jax.random.key(int(rng.integers(1 << 30))), (64, 256)))
    exact, folded = w4a8_numerics.weights(w)
    big = np.abs(exact) > 2.0**-6 * np.abs(exact).max()  # E4M3's normal range after the shift
    assert np.all(np.abs(folded - exact)[big] <= 2.0**-4 * np.abs(exact)[big])
    assert np.any(folded != exact)  # one bit of code * scale's five is rounded somewhere


def test_fp8_rows_are_within_one_rounding_of_each_row(rng):
    a = rng.standard_normal((8, 128)) * rng.uniform(0.1, 100, (8, 1))
    q = w4a8_numerics.fp8_rows(a)
    amax = np.abs(a).max(axis=1, keepdims=True)
    normal = np.abs(a) >= 2.0**-6 * amax / 448  # E4M3's smallest normal times the row's scale
    assert np.all(np.abs(q - a)[normal] <= 2.0**-4 * np.abs(a)[normal] * (1 + 1e-6))


def test_errors_grow_as_the_activations_lose_bits():
    errors = {(r["activations"], r["variant"]): r["relative_error"]
              for r in w4a8_numerics.measure(experts=2, rows=16, seed=3, hidden=256, intermediate=128)}
    for kind in ("gaussian", "outlier channels"):
        order = [errors[kind, v] for v in w4a8_numerics.VARIANTS]
        assert order == sorted(order), (kind, order)
        assert order[0] < 5e-3 < order[1], (kind, order)  # bf16 against FP8 activations
