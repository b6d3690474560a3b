"""The kernel that zeroes the padding rows in place (``triton_padding_rows``): cross-compiled for
every capability the native backends run on, its grid and argument checks on CPU, and on a GPU
against the select at a size past 2**31 elements. It runs in Triton's interpreter against the
select in ``tests/interpreter/test_padding_rows_kernel.py``, and inside the native backends' VJP
in ``test_expert_mlp.py`` (padding rows, zeros required)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("triton")
from pallas_kernels.grouped_matmul import crosscompile, triton_padding_rows  # noqa: E402
from test_grouped_matmul import _gpu_capability  # noqa: E402


@pytest.mark.parametrize("capability", [80, 89, 90, 100, 120])
def test_it_compiles_to_stores_only_with_64_bit_row_offsets(capability):
    """At the largest buffer EP makes (8 x 65536 rows of Kimi K2's 7168, past 2**31 elements), in
    bf16 and float32: global stores and one load (the row count), no shared memory, no spills;
    the row offsets are 64-bit."""
    for dtype in (jnp.bfloat16, jnp.float32):
        kernel = crosscompile.compile_launch(triton_padding_rows.launch_for((8 * 65536, 7168), dtype,
                                                                             compute_capability=capability))
        assert kernel.shared_bytes == 0 and kernel.spill_bytes == 0, (dtype, kernel.shared_bytes, kernel.spill_bytes)
        assert len(re.findall(r"\bld\.global", kernel.ptx)) == 1, dtype
        assert re.search(r"\bst\.global", kernel.ptx), dtype
        assert re.search(r"tt\.addptr .*, tensor<\d+x1xi64", kernel.ttgir), dtype  # each row's offset
    assert 8 * 65536 * 7168 > 2**31


def test_the_grid_is_one_program_per_row_tile_at_most_max_programs():
    assert triton_padding_rows.grid(1) == 1
    assert triton_padding_rows.grid(33) == 3
    assert triton_padding_rows.grid(8 * 65536) == triton_padding_rows.MAX_PROGRAMS


def test_bad_input_gets_one_line_naming_the_argument():
    x, sizes = jnp.ones((10, 64), jnp.bfloat16), jnp.asarray([4, 3], jnp.int32)
    cases = [
        (dict(x_mh=jnp.ones((10,), jnp.bfloat16)), r"^x_mh: bfloat16\[10\], expected \[M, H\] of bfloat16"),
        (dict(x_mh=jnp.ones((10, 64), jnp.int32)), r"^x_mh: int32\[10, 64\], expected \[M, H\] of bfloat16"),
        (dict(group_sizes_e=sizes.astype(jnp.float32)), r"^group_sizes_e: float32\[2\], expected int32 \[E\]$"),
        (dict(interpret=True), r"^interpret: True, expected False"),
    ]
    for change, message in cases:
        args = dict(x_mh=x, group_sizes_e=sizes, compute_capability=90) | change
        with pytest.raises(ValueError, match=message):
            triton_padding_rows.zero_padding_rows(**args)
    empty = jnp.ones((0, 64), jnp.bfloat16)  # no rows: nothing to zero, no launch
    assert triton_padding_rows.zero_padding_rows(empty, sizes, compute_capability=90) is empty


def _bit_patterns(rows: int, cols: int) -> jax.Array:
    """``[rows, cols]`` uint16 patterns from a multiplicative hash of each element's index (every
    exponent, NaNs and infinities among them): computed where used, so a check past 2**31 elements
    holds one copy of the rows, not three."""
    index = (jax.lax.broadcasted_iota(jnp.uint32, (rows, cols), 0) * np.uint32(cols)
             + jax.lax.broadcasted_iota(jnp.uint32, (rows, cols), 1))
    mixed = index * np.uint32(2654435761)
    return ((mixed ^ (mixed >> 15)) >> 8).astype(jnp.uint16)


def test_the_bit_patterns_cover_nan_infinity_and_every_exponent():
    bits = np.asarray(_bit_patterns(4096, 512))
    exponent = (bits >> 7) & 0xFF
    assert len(np.unique(exponent)) == 256
    assert np.any(bits == 0x7F80) and np.any(bits == 0xFF80)  # +inf, -inf
    assert np.any((exponent == 0xFF) & (bits & 0x7F != 0))  # NaN


@pytest.mark.gpu
def test_gpu_past_2_31_elements_only_the_padding_rows_change():
    """300000 rows of 7168 bf16 bit patterns (NaN and infinities among them), 384 experts owning
    all but the last 995 (from mid-tile, the rows past 2**31 elements among them): those rows come
    out +0.0, every other element bit for bit as it was. One jit, the rows' one copy in place (an
    H100 running the GPU check beside another worker has no room for more)."""
    capability = _gpu_capability()
    m, h = 300_000, 7168
    sizes = np.zeros(384, np.int32)
    sizes[:383] = (m - 995) // 383
    sizes[383] = m - 995 - sizes[:383].sum()
    total = int(sizes.sum())
    assert total % triton_padding_rows.BLOCK_M and (total + 1) * h < 2**31 < m * h < 2**32

    @jax.jit
    def padding_nonzero_and_owned_changed(sizes_e):
        rows = jax.lax.bitcast_convert_type(_bit_patterns(m, h), jnp.bfloat16)
        out_bits = jax.lax.bitcast_convert_type(
            triton_padding_rows.zero_padding_rows(rows, sizes_e, compute_capability=capability), jnp.uint16)
        return jnp.any(out_bits[total:] != 0), jnp.any(out_bits[:total] != _bit_patterns(total, h))

    padding_nonzero, owned_changed = padding_nonzero_and_owned_changed(jnp.asarray(sizes))
    assert not bool(padding_nonzero), "a padding row is not +0.0 everywhere"
    assert not bool(owned_changed), "a row the experts own changed"


@pytest.mark.gpu
def test_gpu_in_a_jit_without_padding_rows_it_changes_nothing():
    """Inside a jit that uses the rows after (so XLA keeps a copy): no padding rows, nothing
    written; every row padding, all zeros."""
    capability = _gpu_capability()
    x = jax.random.normal(jax.random.key(3), (4096 + 5, 512), jnp.bfloat16)

    @jax.jit
    def both(x, sizes):
        return x, triton_padding_rows.zero_padding_rows(x * 2, sizes, compute_capability=capability)

    kept, out = both(x, jnp.asarray([4096, 5], jnp.int32))
    assert bool(jnp.array_equal(out, kept * 2))
    _, out = both(x, jnp.asarray([0, 0], jnp.int32))
    assert not bool(jnp.any(out))
