"""``benchmarks/dequant_probe.py``: its formulations give ``dequantize_tile``'s bits (times 2**7)
for every byte and every E4M3 scale bit pattern that is a finite positive or negative value."""

from __future__ import annotations

import importlib.util
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

_PATH = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "dequant_probe.py"
_spec = importlib.util.spec_from_file_location("dequant_probe", _PATH)
probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe)


@pytest.mark.parametrize("name", ["bits", "lut"])
def test_formulation_matches_exact(rng, name):
    # Every byte value in each 8-byte block row, every E4M3 pattern but NaN (0x7f, 0xff) as a scale.
    scale_bits = np.array([b for b in range(256) if b & 0x7F != 0x7F], np.uint8)
    rows = len(scale_bits)
    packed = np.stack([rng.permutation(256).astype(np.uint8) for _ in range(rows)])  # [rows, 256]
    scales = np.repeat(scale_bits[:, None], 256 // 8, axis=1)  # one block = 8 bytes
    got = np.asarray(getattr(probe, name)(jnp.asarray(packed), jnp.asarray(scales)).astype(jnp.float32))
    want = np.asarray(probe.exact(jnp.asarray(packed), jnp.asarray(scales)).astype(jnp.float32)) * 2.0**7
    np.testing.assert_array_equal(got, want)
    assert np.array_equal(np.signbit(got), np.signbit(want))
