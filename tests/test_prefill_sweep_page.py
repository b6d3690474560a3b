"""benchmarks/prefill_sweep.py's parts that run without a GPU: its page (each row's fraction of
XLA's dense anchor and of its byte floor, and what the weights' bytes alone allow of the anchor)
and the bf16 copy its NVFP4 weights are multiplied through in one of its rows."""

import jax.numpy as jnp
import numpy as np
from test_benchmark_results import _load

from moe_jax import nvfp4
from pallas_kernels.grouped_matmul import reference


def _row(group, projection, impl, ms, note=""):
    return {"group": group, "projection": projection, "impl": impl, "tile": "table", "ms": ms,
            "tflops": None if ms is None else 1.0, "rel_err": None, "note": note}


def test_the_page_gives_each_row_its_fraction_of_the_anchor_and_of_its_byte_floor():
    bench = _load("prefill_sweep")
    meta = {"device": "NVIDIA H100 80GB HBM3", "rows": 1024, "experts": 8, "runs": 10, "copy_bandwidth_tbs": 2.0}
    rows = [_row("anchor", "down", "xla dense", 1.0), _row("bf16", "down", "native bf16", 2.0),
            _row("nvfp4", "down", "native w4a16", None, "wrong against the table's tile"),
            _row("router", "logits", "f32 highest", 0.5)]
    lines = bench.markdown({"meta": meta, "rows": rows}).splitlines()
    # down: K 2048, weight rows 7168, output 7168. bf16: 8 experts' weights, x read, y written, at 2 TB/s.
    bf16_bytes = 8 * 7168 * 2048 * 2 + 1024 * (2048 + 7168) * 2
    nvfp4_bytes = 8 * (7168 * 2048 // 2 + 7168 * 2048 // 16) + 1024 * (2048 + 7168) * 2
    bf16_ms, nvfp4_ms = bf16_bytes / 2e12 * 1e3, nvfp4_bytes / 2e12 * 1e3
    assert ("What the weights' bytes allow at the copy bandwidth, as a fraction of the anchor: "
            f"bf16 {1.0 / bf16_ms:.2f}, nvfp4 {1.0 / nvfp4_ms:.2f} (a kernel streaming every byte at the copy "
            "bandwidth, its MMAs hidden).") in lines
    assert "| anchor | xla dense | table | 1.000 | 1 | 1.00 | - | - |  |" in lines
    assert f"| bf16 | native bf16 | table | 2.000 | 1 | 0.50 | {bf16_ms:.3f} | {bf16_ms / 2.0:.2f} |  |" in lines
    assert (f"| nvfp4 | native w4a16 | table | - | - | - | {nvfp4_ms:.3f} | - | wrong against the table's tile |"
            in lines)
    assert not any(line.startswith("## gate_up") for line in lines)  # no rows of it
    assert "| router | logits | f32 highest | table | 0.500 | 1 | - |  |" in lines


def test_the_bf16_copy_is_each_weight_times_its_rows_global_scale(rng):
    """Per-matrix global scales, and gate's and up's own (the up half 1000x smaller: a scale
    applied to the wrong half would be off by that much), against float64 within bf16's rounding."""
    bench = _load("prefill_sweep")
    w = rng.standard_normal((3, 64, 128)) * np.exp(rng.uniform(-4, 4, (3, 64, 1)))
    w32 = jnp.asarray(w * np.array([1.0] * 32 + [1e-3] * 32)[:, None], jnp.float32)
    halves = nvfp4.concat_rows(nvfp4.quantize(w32[:, :32]), nvfp4.quantize(w32[:, 32:]))  # gate's and up's scales
    for q in (nvfp4.quantize(w32), halves):
        want = reference.dequantize(np.asarray(q.packed), np.asarray(q.scales), np.asarray(q.global_scale))
        got = np.asarray(bench.bf16_copy(q).astype(jnp.float32), np.float64)
        assert got.shape == want.shape == (3, 64, 128)
        np.testing.assert_array_less(np.abs(got - want), 2.0 ** -8 * np.abs(want) + 1e-30)
