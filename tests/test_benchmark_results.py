"""The committed benchmark pages are what the committed scripts render from the committed data.

A results page edited by hand, or a script changed so that it would no longer produce the page
(its tables, targets or verdicts), fails here.
"""

import importlib.util
import json
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up while the file runs)
    spec.loader.exec_module(module)
    return module


def test_grouped_gemm_page_is_rendered_from_its_json():
    bench = _load("grouped_gemm")
    for folder in (RESULTS, RESULTS / "native_h200", RESULTS / "grouped_gemm_48_experts_2026-11-29"):
        data = json.loads((folder / "grouped_gemm.json").read_text())
        cases = [bench.Case(**case) for case in data["cases"]]
        goals = bench.targets(cases, data["mlp"])
        assert goals == data["targets"]
        assert bench.markdown(data, cases, data["mlp"], goals) == (folder / "grouped_gemm.md").read_text()


def test_ncu_pages_are_rendered_from_their_exports():
    for page, raw, sass in (
        ("ncu_grouped_gemm.md", "ncu_grouped_gemm_raw.csv", "ncu_grouped_gemm_nvfp4_decode_sass.csv"),
        ("ncu_grouped_gemm_before.md", "ncu_grouped_gemm_before_raw.csv",
         "ncu_grouped_gemm_before_nvfp4_decode_sass.csv"),
    ):
        committed = (RESULTS / "ncu_pallas_kernels_h200" / page).read_text()
        note = committed.splitlines()[2].strip("*")
        rendered = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ncu_summary.py"), raw, sass, note],
                                  cwd=RESULTS / "ncu_pallas_kernels_h200", check=True, capture_output=True, text=True).stdout
        assert rendered == committed, page


def test_readme_grouped_gemm_table_matches_the_results():
    data = json.loads((RESULTS / "grouped_gemm.json").read_text())
    uniform = {(c["projection"], c["rows"]): c for c in data["cases"] if c["routing"] == "uniform"}
    columns = ("ours_bf16", "ours_nvfp4", "native_nvfp4", "native_swiglu_nvfp4", "jax_ragged_dot",
               "torch_grouped_mm", "tokamax_bf16", "tokamax_int4")
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("**Grouped GEMM**"):readme.index("**Expert parallelism**")]
    assert f"{data['copy_bandwidth_tbps']:.2f} TB/s copy bandwidth" in section
    rows = [line.split("|")[1:-1] for line in section.splitlines()
            if line.startswith("| gate_up |") or line.startswith("| down |")]
    assert len(rows) == len(uniform)
    for projection, m, *cells, floor in (map(str.strip, row) for row in rows):
        case = uniform[(projection, int(m))]
        for impl, cell in zip(columns, cells, strict=True):
            result = case["results"].get(impl, {})
            expected = f"{result['ms'] * 1e3:.1f}" if "ms" in result else ""
            assert cell == expected, (projection, m, impl)
        assert floor == f"{case['nvfp4_floor_ms'] * 1e3:.1f}", (projection, m)
    mlp = data["mlp"]
    assert f"takes {mlp['native_ms'] * 1e3:.1f} us with the `triton` kernels" in section
    assert f"{mlp['native_ms'] / mlp['byte_floor_ms']:.2f}x its byte floor" in section
    assert f"({mlp['byte_floor_ms'] * 1e3:.1f} us for\n{mlp['bytes'] / 1e9:.3f} GB)" in section
    assert f"{mlp['ms'] * 1e3:.1f} us with the Pallas kernels ({mlp['ratio_to_floor']:.2f}x)" in section


def test_ncu_durations_follow_the_exports_unit(tmp_path):
    summary = _load("ncu_summary")
    metrics = [metric for _, metric, _ in summary.METRICS]
    for unit, value, expected in (("us", "909.6", "909.60"), ("ms", "0.4", "400.00"), ("ns", "2500", "2.50")):
        raw = tmp_path / f"{unit}.csv"
        rest = len(metrics) - 1
        raw.write_text("\n".join([",".join(["ID", "Kernel Name", *metrics]), ",".join(["", "", unit, *[""] * rest]),
                                  ",".join(["0", "k", value, *["1"] * rest])]) + "\n")
        table = summary.kernels_section(str(raw))
        assert table[2] == f"| duration (us) | {expected} |", (unit, table[2])


def test_layer_page_and_the_readme_layer_table_come_from_the_results():
    """``layer_h200/layer.md`` is what ``benchmarks/layer.py`` renders from its JSON, and the
    README's whole-layer table has that page's rows (its columns in the README's order)."""
    bench = _load("layer")
    data = json.loads((RESULTS / "layer_h200" / "layer.json").read_text())
    page = bench.markdown(data)
    assert page == (RESULTS / "layer_h200" / "layer.md").read_text()
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("**Whole layer, one GPU**"):readme.index("**Training step**")]
    assert f"at\n{data['meta']['commit']};" in section or f"at {data['meta']['commit']};" in section
    assert f"{data['meta']['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s" in section
    page_rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]]
                 for line in page.splitlines() if re.match(r"^\| \d+ \|", line)}
    readme_rows = [[c.strip() for c in line.split("|")[1:-1]] for line in section.splitlines()
                   if re.match(r"^\| \d+ \|", line)]
    assert [row[0] for row in readme_rows] == list(page_rows)
    for row in readme_rows:
        assert row == page_rows[row[0]], row  # same columns in the same order as the page


def test_readme_training_table_comes_from_the_results():
    data = json.loads((RESULTS / "train_step_h200" / "train_step.json").read_text())
    ms = {(s["weights"], s["rows"], s["impl"]): s["ms"] for s in data["steps"] if "ms" in s}
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("**Training step**"):readme.index("## When to use which implementation")]
    assert f"at\n{data['meta']['commit']};" in section or f"at {data['meta']['commit']};" in section
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in section.splitlines()
            if line.startswith("| bf16 |") or line.startswith("| NVFP4 frozen")]
    assert len(rows) == 4
    for weights, m, pallas, triton, torch, ratio in rows:
        fmt, m = ("bf16" if weights == "bf16" else "nvfp4"), int(m)
        assert pallas == f"{ms[(fmt, m, 'pallas')]:.3f}"
        assert triton == (f"{ms[(fmt, m, 'triton')]:.3f}" if (fmt, m, "triton") in ms else "-")
        assert torch == f"{ms[(fmt, m, 'torch')]:.3f}"
        best = min(ms[(fmt, m, impl)] for impl in ("pallas", "triton") if (fmt, m, impl) in ms)
        assert ratio == f"{ms[(fmt, m, 'torch')] / best:.2f}"
