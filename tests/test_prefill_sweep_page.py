"""benchmarks/prefill_sweep.py's part that runs without a GPU: its page (each row's fraction of
XLA's dense anchor and of its byte floor, and what the weights' bytes alone allow of the anchor)."""

from test_benchmark_results import _load


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
