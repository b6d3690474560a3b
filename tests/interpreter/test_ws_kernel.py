"""The warp-specialized bf16 candidate (``triton_ws.ws_bf16_kernel``) in Triton's interpreter on CPU:
small shapes, the real tile schedule, NaN-poisoned output (padding rows must stay NaN), against
float64. The interpreter runs the loop unspecialized: this checks the indexing, the descriptors
(rows past an expert's end read and dropped, boxes past M filled with zeros) and the epilogue,
not the producer/consumer synchronization, which only the GPU exercises (benchmarks/ws_probe.py).

Run with triton 3.9.0 from ``.triton-interpret`` (``TRITON_INTERPRET=1``, see conftest.py).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import interpreted
from nvfp4_float64 import expert
from benchmarks import ws_probe_kernel as triton_ws
from pallas_kernels.grouped_matmul.tuning import Op


@pytest.mark.parametrize("op", [Op.MATMUL, Op.GATE_UP_SWIGLU], ids=lambda op: op.value)
@pytest.mark.parametrize("extra_m", [0, 16])
def test_ws_kernel_matches_float64(op, extra_m):
    rng = np.random.default_rng(0)
    group_sizes = np.array([0, 45, 3, 32, 17, 0], np.int32)  # multi-tile, tiny, exact-fit and empty experts
    e, k, n_out, padding = len(group_sizes), 64, 64, 5
    m = int(group_sizes.sum()) + padding
    n_w = 2 * n_out if op is Op.GATE_UP_SWIGLU else n_out
    x = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
    w = (rng.standard_normal((e, n_w, k)) / np.sqrt(k)).astype(ml_dtypes.bfloat16)
    spec = triton_ws.make_spec(op, num_rows=m, num_experts=e, k=k, n_out=n_out, block_m=32, extra_m=extra_m,
                               block_n=32, block_k=32, num_stages=2, group_t=2)
    interpreted.reset()
    out = np.full((m, n_out), np.nan, ml_dtypes.bfloat16)
    buffers = interpreted.schedule_buffers(group_sizes, m, spec.rows_per_tile, spec.max_tiles)
    buffers += [interpreted.buffer(x, "x"), interpreted.buffer(w, "w"),
                interpreted.buffer(np.zeros(1, ml_dtypes.bfloat16), "out_in (unread)")]
    got = interpreted.launch(triton_ws.ws_bf16_kernel, spec.num_programs, buffers, out, spec.constexprs())
    starts = np.concatenate([[0], np.cumsum(group_sizes)])
    want = np.full((m, n_out), np.nan)
    for i in range(e):
        rows = slice(starts[i], starts[i + 1])
        want[rows] = expert(op, x[rows].astype(np.float64), w[i].astype(np.float64))
    assert np.isnan(got[-padding:]).all(), "padding rows were written"
    valid = slice(0, m - padding)
    assert not np.isnan(got[valid]).any(), "rows left unwritten"
    rel = np.linalg.norm(got[valid] - want[valid]) / np.linalg.norm(want[valid])
    assert rel < 1e-2, rel
