"""The kernel that zeroes the padding rows in place (``triton_padding_rows._kernel``: rows from
``sum(max(group_sizes, 0))`` on), executed in Triton's interpreter on CPU, every store
bounds-checked.

The buffer holds random bit patterns (NaN and infinities among them) and is the kernel's output
as the GPU gets it (aliased: what the kernel does not write stays): the padding rows must come out
+0.0 and every other element bit for bit as it was, against XLA's select
(``expert_mlp.zero_padding_rows``).

Run by ``./run test`` with triton 3.9.0 from ``.triton-interpret`` (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import interpreted
from pallas_kernels.grouped_matmul import triton_padding_rows
from pallas_kernels.grouped_matmul.expert_mlp import zero_padding_rows

# ``interpreted.launch`` returns the buffer as float64 too, which the random NaN patterns warn about.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")


def zeroed(group_sizes, *, m: int, h: int, dtype=ml_dtypes.bfloat16, num_programs=None, seed: int = 0) -> None:
    """Runs the kernel on an ``[m, h]`` buffer of random bits; asserts it matches the select bit
    for bit."""
    rng = np.random.default_rng(seed)
    group_sizes = np.asarray(group_sizes, np.int32)
    bits = np.uint16 if np.dtype(dtype).itemsize == 2 else np.uint32
    x = rng.integers(0, np.iinfo(bits).max, (m, h), dtype=bits, endpoint=True).view(dtype)
    want = np.asarray(zero_padding_rows(jnp.asarray(x), jnp.asarray(group_sizes)))
    total = np.asarray([np.maximum(group_sizes, 0).sum()], np.int32)
    launch = triton_padding_rows.launch_for((m, h), dtype, compute_capability=90)
    interpreted.reset()
    out = x.copy()
    buffers = [interpreted.buffer(total, "total"), interpreted.buffer(np.zeros(1, dtype), "out_in (unread)")]
    interpreted.launch(launch.kernel, num_programs or launch.grid, buffers, out, dict(launch.constexprs))
    padding = np.arange(m) >= total[0]
    assert not out[padding].view(bits).any(), "a padding row is not +0.0 everywhere"
    assert np.array_equal(out[~padding].view(bits), x[~padding].view(bits)), "a row the experts own changed"
    assert np.array_equal(out.view(bits), want.view(bits)), "differs from XLA's select"


@pytest.mark.parametrize("group_sizes", [[5, 0, 20], [16, 16], [0, 0], [40, 0], [3, -2, 30], [60, 1]],
                         ids=["mid_tile", "tile_aligned", "all_padding", "no_padding", "negative_size", "sum_past_m"])
def test_the_rows_past_the_experts_rows_and_only_those(group_sizes):
    """Padding from mid-tile, from a tile boundary, every row, none; a negative size counts as
    zero (as the select's ``max(size, 0)``); sizes summing past ``M`` leave no padding row."""
    zeroed(group_sizes, m=40, h=96)


def test_columns_past_a_store_s_width_and_float32():
    """``H`` not a multiple of the store's 512 columns (the last chunk masked), and float32."""
    zeroed([7, 30], m=45, h=700, seed=1)
    zeroed([7, 30], m=45, h=700, dtype=np.float32, seed=2)


def test_fewer_programs_than_row_tiles():
    """Programs stride over the row tiles from the one holding row ``total``: 3 and 5 programs
    for 9 tiles of padding, and more programs than tiles."""
    zeroed([10, 3], m=150, h=64, num_programs=3, seed=3)
    zeroed([10, 3], m=150, h=64, num_programs=5, seed=4)
    zeroed([100, 30], m=150, h=64, num_programs=50, seed=5)


def test_kimi_k2_s_experts():
    """384 experts' sizes, the highest ones used last: the total from all of them."""
    sizes = np.zeros(384, np.int32)
    sizes[380:] = [3, 0, 17, 9]
    zeroed(sizes, m=64, h=64, seed=6)
