"""The native (Triton-language) bf16 weight gradient ``dW_e = dy_e^T x_e``
(``triton_weight_grad._kernel``: persistent programs over output tiles, expert by expert, the
rows of each loaded through tensor descriptors bounded at its expert's last row, a program's tiles
of an expert and their row steps one loop), executed in Triton's interpreter on CPU against
float64.

As the GPU gets it: ``make_spec``'s tile or the one under test, the experts' row bounds
``group_bounds`` computes, every load (the descriptors' too) and store bounds-checked. The output
is NaN-poisoned, so an element the kernel does not write fails; the padding rows past
``sum(group_sizes)`` hold NaN in both ``x`` and ``dy``, so a row step that reads one fails too.

Run by ``./run test`` with triton 3.9.0 from ``.triton-interpret`` (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import interpreted
from pallas_kernels.grouped_matmul import pallas_triton, triton_weight_grad
from pallas_kernels.grouped_matmul.tuning import TileConfig

CC = 90
#: A tile the interpreter runs quickly: 32-row steps, a 32 x 64 output tile.
SMALL = TileConfig(block_m=32, block_n=32, block_k=64, num_warps=4, num_stages=3, group_t=1)


def weight_grad(group_sizes, *, n: int, k: int, out_dtype=np.float32, tile=SMALL, num_programs=None,
                experts=None, padding: int = 5, seed: int = 0, bad_row: int | None = None) -> float:
    """Runs the kernel on random bf16 rows (the used experts are the last ones when ``experts``
    is larger); asserts and returns its relative error against float64. ``bad_row``: that row
    of ``x`` holds an infinity in column 1, which must reach its own expert's gradient exactly
    where float64 puts it and no other's."""
    rng = np.random.default_rng(seed)
    group_sizes = np.asarray(group_sizes, np.int32)
    experts = experts or len(group_sizes)
    group_sizes = np.concatenate([np.zeros(experts - len(group_sizes), np.int32), group_sizes])
    total = int(group_sizes.sum())
    m = total + padding
    x = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
    dy = rng.standard_normal((m, n)).astype(ml_dtypes.bfloat16)
    x[total:] = np.nan
    dy[total:] = np.nan
    if bad_row is not None:
        x[bad_row, 1] = np.inf
    spec = triton_weight_grad.make_spec(num_rows=m, num_experts=experts, n=n, k=k, compute_capability=CC,
                                        out_dtype=out_dtype, tile=tile, num_programs=num_programs)
    bounds = [np.asarray(a, np.int32) for a in pallas_triton.group_bounds(jnp.asarray(group_sizes), num_rows=m)]
    interpreted.reset()
    out = np.full((experts, n, k), np.nan, out_dtype)
    buffers = [interpreted.buffer(a, name) for a, name in zip(bounds, ("starts", "ends"), strict=True)]
    buffers += [interpreted.buffer(x, "x"), interpreted.buffer(dy, "dy"),
               interpreted.buffer(np.zeros(1, out_dtype), "out_in (unread)")]
    got = interpreted.launch(triton_weight_grad.kernel_function(), spec.num_programs, buffers, out, spec.constexprs())
    bounds = np.concatenate([[0], np.cumsum(group_sizes)])
    want = np.stack([dy[bounds[e]:bounds[e + 1]].astype(np.float64).T @ x[bounds[e]:bounds[e + 1]].astype(np.float64)
                     for e in range(experts)])
    bad_expert = None if bad_row is None else int(np.searchsorted(bounds, bad_row, side="right")) - 1
    if bad_expert is not None:
        assert np.array_equal(np.isfinite(got[bad_expert]), np.isfinite(want[bad_expert])), \
            "the bad row's expert: infinities not where float64 has them"
        got[bad_expert] = want[bad_expert] = 0.0
    assert np.isfinite(got).all(), f"{np.count_nonzero(~np.isfinite(got))} outputs not written or read padding"
    empty = group_sizes == 0
    assert (got[empty] == 0).all(), "an expert without rows has a nonzero gradient"
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    # bf16 output rounding alone is ~2e-3; float32 keeps the exact bf16 products' fp32 sums.
    assert err < (1e-2 if out_dtype == ml_dtypes.bfloat16 else 1e-5), f"relative error {err:.3g}"
    return err


@pytest.mark.parametrize("out_dtype", [np.float32, ml_dtypes.bfloat16], ids=["f32", "bf16"])
def test_every_row_count(out_dtype):
    """Experts of 0 rows (zeros written), one row, a partial step, whole steps, and one longer
    than a program's share, over fewer programs than tiles: a program's loop crosses tile and
    expert boundaries mid-flight."""
    weight_grad([0, 1, 31, 32, 0, 65, 200, 7], n=64, k=128, out_dtype=out_dtype, num_programs=5)


def test_a_non_finite_row_reaches_its_own_expert_only():
    """An infinity in a row within the reach of the previous expert's last row step (rows 32-63
    of 40, then 33 rows from 40), and in the row right after an expert of one row: the
    descriptors are bounded at each expert's last row, so neither step reads it."""
    weight_grad([40, 33, 1, 70], n=32, k=64, bad_row=45, num_programs=3)
    weight_grad([40, 33, 1, 70], n=32, k=64, bad_row=74, num_programs=3, seed=1)


def test_an_empty_first_expert_with_a_non_finite_row_after_it():
    """The first expert has no rows and the next one's first row holds an infinity: the first
    expert's descriptors cover one row, row 0, and it takes one step per tile there (so that
    its tiles are written): the stored value is selected to zero, not infinities."""
    weight_grad([0, 40, 33], n=32, k=64, bad_row=0, num_programs=3, seed=13)


def test_a_program_s_tiles_across_experts():
    """Tiles per expert not a multiple of the programs (4 tiles an expert; 3 programs, and 5, one
    more than an expert's tiles): a program walks the experts in order and takes the tiles of each
    congruent to its id, and every tile of every expert is written."""
    weight_grad([5, 0, 37, 64, 9], n=64, k=128, num_programs=3, seed=11)
    weight_grad([5, 0, 37, 64, 9], n=64, k=128, num_programs=5, seed=12)


def test_more_programs_than_tiles():
    """The grid is cut to one program per tile: no program without a tile."""
    spec = triton_weight_grad.make_spec(num_rows=10, num_experts=2, n=32, k=64, compute_capability=CC,
                                        out_dtype=np.float32, tile=SMALL, num_programs=1000)
    assert spec.num_programs == spec.num_tiles == 2
    weight_grad([3, 40], n=32, k=64, num_programs=1000)


def test_kimi_k2_s_last_experts():
    """384 experts with only the last three used: the tiles of the highest experts, written at
    the end of the output (a wrong expert offset lands outside it, which the bounds checks see)."""
    weight_grad([50, 0, 33], n=32, k=64, experts=384, num_programs=7, seed=3)


@pytest.mark.parametrize("rows", ["few", "many"])
def test_the_sm90_table_tiles(rows):
    """The capability's own tiles (64-row steps; 128 x 128 outputs at few rows per expert, 128 x
    256 at many), over fewer programs than tiles."""
    spec = triton_weight_grad.make_spec(num_rows=4096 if rows == "many" else 200, num_experts=2, n=128, k=256,
                                        compute_capability=CC, out_dtype=np.float32)
    tile = spec.config
    assert (tile.block_m, tile.block_n, tile.block_k) == ((64, 128, 256) if rows == "many" else (64, 128, 128))
    weight_grad([70, 130], n=128, k=256, tile=tile, num_programs=1 if rows == "many" else 3, seed=5)
