"""benchmarks/train_step.py runs end to end on CPU (``--smoke``: tiny shapes, interpreted kernels)
and writes what its GPU runs will: every row checked against the dense reference, timed, finite."""

import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from harness import xla_flags

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "train_step.py"


def _load():
    spec = importlib.util.spec_from_file_location("benchmarks_train_step", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up while the file runs)
    spec.loader.exec_module(module)
    return module


def _run(out: pathlib.Path, *flags: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("GIT_COMMIT", "GIT_DIRTY")}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(2))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out), "--commit", "c0ffee", *flags],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in ("train_step.json", "train_step.md", "train_step.png"):
        assert (out / name).stat().st_size > 0, name
    return json.loads((out / "train_step.json").read_text())


def _check_timed(row: dict, bound: float) -> None:
    assert "error" not in row, row
    assert math.isfinite(row["ms"]) and row["ms"] > 0, row
    if row.get("reference") == "is the reference":  # the layer's xla rows
        return
    assert math.isfinite(row["err"]) and row["err"] < bound, row


@pytest.mark.slow
def test_smoke_steps_and_gemms(tmp_path):
    """bf16 and NVFP4 (frozen) expert MLP steps and every GEMM alone; provenance; the page."""
    data = _run(tmp_path, "--nvfp4")
    meta, bound = data["meta"], data["meta"]["max_err"]
    assert meta["commit"] == "c0ffee" and meta["dirty"] == "unknown"
    assert meta["smoke"] and meta["interpret"] and meta["platform"] == "cpu" and meta["device"] == "2 x cpu"
    assert "--smoke" in meta["command"] and "train_step.py" in meta["command"]
    assert "jax 0.11" in meta["versions"] and "torch not run" in meta["versions"]
    # The page is what markdown() renders from the JSON (so committed results can be re-checked).
    assert _load().markdown(data) == (tmp_path / "train_step.md").read_text()

    xla = [row for row in data["steps"] if row["impl"] == "xla"]
    assert [row["weights"] for row in xla] == ["bf16", "nvfp4"]
    for row in xla:
        _check_timed(row, bound)
        assert row["reference"] == "dense"
        assert set(row["errs"]) == ({"y", "dx", "dw_gate_up", "dw_down"} if row["weights"] == "bf16" else {"y", "dx"})

    for row in data["steps"] + data["gemms"]:
        _check_timed(row, bound)
    pallas = [row for row in data["steps"] if row["impl"] == "pallas"]
    assert [row["weights"] for row in pallas] == ["bf16", "nvfp4"]
    for row in pallas:
        assert math.isfinite(row["err_vs_xla"]) and row["err_vs_xla"] < bound, row
    # NVFP4 input gradients twice: the kernel reading NVFP4, and through one bf16 copy of the weights.
    assert [(r["projection"], r["weights"], r["op"], r["impl"]) for r in data["gemms"]] == [
        *((p, "bf16", op, "pallas") for p in ("gate_up", "down") for op in ("forward", "input_grad", "weight_grad")),
        *(row for p in ("gate_up", "down") for row in (
            (p, "nvfp4", "forward", "pallas"), (p, "nvfp4", "input_grad", "pallas"),
            (p, "nvfp4", "input_grad", "dequantized")))]
    # The dense anchor: once per rows and gradients, timed; each step row's TFLOP/s over it.
    anchors = data["anchors"]
    assert [(a["impl"], a["grads"], a["rows"]) for a in anchors] == [
        ("dense anchor (XLA)", "x, w", 64), ("dense anchor (XLA)", "x (frozen weights)", 64)]
    for anchor in anchors:
        assert "error" not in anchor and math.isfinite(anchor["ms"]) and anchor["ms"] > 0, anchor
        assert anchor["flops"] == next(r["flops"] for r in data["steps"] if r["grads"] == anchor["grads"])
    for row in data["steps"]:
        anchor = next(a for a in anchors if a["grads"] == row["grads"])
        assert row["of_anchor"] == pytest.approx(anchor["ms"] / row["ms"]), row
    page = (tmp_path / "train_step.md").read_text()
    assert "| TFLOP/s | of anchor |" in page and "| dense anchor (XLA) |" in page
    # Both targets are evaluated for every configuration (torch's ratio is None without torch).
    backward = [g for g in data["targets"] if g["target"].startswith("backward GEMM")]
    assert len(backward) == 6 and all(g["value"] > 0 and g["goal"] == 0.9 for g in backward)
    versus_torch = [g for g in data["targets"] if g["target"].startswith("step >=")]
    assert len(versus_torch) == 2 and all(g["value"] is None and not g["met"] for g in versus_torch)
    versus_anchor = [g for g in data["targets"] if g["target"].startswith("full bf16 step")]
    assert len(versus_anchor) == 1 and versus_anchor[0]["value"] == pytest.approx(pallas[0]["of_anchor"])


@pytest.mark.slow
def test_smoke_skewed_steps_and_the_layer_with_expert_parallelism(tmp_path):
    data = _run(tmp_path, "--skewed", "--skip-gemms", "--layer", "--ep", "1", "2", "--layer-weights", "bf16", "nvfp4",
                "--profile", "1")
    bound = data["meta"]["max_err"]
    assert not data["gemms"]
    # --profile: each timed pallas step recorded once under jax.profiler (the CPU's trace has no GPU
    # kernels, so its table is empty and the page says so); the slow xla steps are never profiled.
    for row in data["steps"]:
        assert (row["impl"] == "pallas") == ("profile" in row), row
        if "profile" in row:
            assert row["profile"]["calls"] == 1 and row["profile"]["table"] == [], row["profile"]
    page = (tmp_path / "train_step.md").read_text()
    assert "## Where each step's GPU time goes" in page
    assert {(r["impl"], r["routing"]) for r in data["steps"]} == {
        (i, r) for i in ("xla", "pallas") for r in ("uniform", "zipf")}
    layers = data["layers"]
    assert [(r["weights"], r["ep"], r["impl"]) for r in layers] == [
        (w, ep, impl) for w in ("bf16", "nvfp4") for ep in (1, 2) for impl in ("xla", "pallas")]
    # Trained bf16 experts: every weight's gradient compared; frozen NVFP4 experts: x and the router's.
    assert [set(r["errs"]) for r in layers if r["impl"] == "pallas"] == [
        {"y", "dx", "dw_gate_up", "dw_down", "dw_router"}] * 2 + [{"y", "dx", "dw_router"}] * 2
    for row in data["steps"] + layers:
        if row["impl"] == "xla":
            _check_timed(row, bound)
    # The layer steps are profiled as the expert-MLP steps are (pallas, not the slow xla path).
    for row in layers:
        assert (row["impl"] == "pallas") == ("profile" in row), row
    assert "### Where each layer step's GPU time goes" in page
    assert "#### layer nvfp4 pallas EP=2 M=" in page
    assert layers[2]["exchange"] == layers[6]["exchange"] == "padded"
    assert all(r["tokens"] == r["ep"] * r["rows"] // data["meta"]["shape"]["top_k"] for r in layers)
    for row in data["steps"] + layers:
        _check_timed(row, bound)


def test_profile_renders_the_kernels_by_time():
    """A profiled step's kernels on the page: shares of the busy time, the rest summed."""
    bench = _load()
    row = {"impl": "triton", "weights": "bf16", "routing": "uniform", "rows": 32768, "ms": 16.0, "grads": "x, w",
           "profile": {"calls": 3, "span_us": 15900.0, "busy_us": 15000.0, "kernels_per_call": 40,
                       "table": [{"kernel": "_kernel", "hlo_op": "custom-call.3", "launches_per_call": 2,
                                  "us_per_call": 6000.0}],
                       "rest_us": 9000.0, "rest_kernels": 30}}
    data = {"meta": {"device": "1 x GPU", "date": "d", "commit": "c", "dirty": "0", "command": "x", "versions": "v",
                     "shape": bench.KIMI, "timing": "t", "correctness": "c"},
            "steps": [row], "gemms": [], "layers": [], "targets": []}
    page = bench.markdown(data)
    assert "### triton, bf16 uniform M=32768" in page
    assert "wall 16000 us; kernels: span 15900 us, busy 15000 us, 40 launches (3 calls)" in page
    assert "| `_kernel` | `custom-call.3` | 2 | 6000.0 | 40.0% |" in page
    assert "| 30 more | | | 9000.0 | 60.0% |" in page
    # A layer step's profile: its own subsection under the layer table.
    layer = {"weights": "nvfp4", "ep": 1, "rows": 32768, "tokens": 4096, "impl": "triton", "exchange": "none",
             "ms": 19.3, "tokens_per_s": 212000.0, "temp_gb": 4.2, "profile": row["profile"]}
    page = bench.markdown({**data, "steps": [], "layers": [layer]})
    assert "## Where each step's GPU time goes" not in page
    assert "### Where each layer step's GPU time goes (`--profile`)" in page
    assert "#### layer nvfp4 triton EP=1 M=32768/device" in page
    assert "wall 19300 us; kernels: span 15900 us, busy 15000 us, 40 launches (3 calls)" in page


def test_profile_calls_must_not_be_negative(capsys):
    with pytest.raises(SystemExit):
        _load().parse_args(["--out", "x", "--profile", "-1"])
    assert "--profile: -1 calls, expected >= 0" in capsys.readouterr().err


def test_experts_sets_the_local_experts_of_every_row(tmp_path):
    """``--experts`` (384: Kimi K2's on one GPU): the layer's config and the page take it."""
    data = _run(tmp_path, "--skip-gemms", "--skip-bf16-steps", "--layer", "--layer-weights", "nvfp4",
                "--experts", "6")
    assert data["meta"]["shape"]["experts"] == 6
    assert [(r["experts_per_device"], r["impl"]) for r in data["layers"]] == [(6, "xla"), (6, "pallas")]
    for row in data["layers"]:
        _check_timed(row, data["meta"]["max_err"])
    assert "- shape: 6 local experts" in (tmp_path / "train_step.md").read_text()


def test_experts_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        _load().parse_args(["--out", "x", "--experts", "0"])
    assert "--experts: 0, expected >= 1" in capsys.readouterr().err


def test_group_sizes_and_padded_layout():
    bench = _load()
    rng = np.random.default_rng(0)
    for routing in ("uniform", "zipf"):
        sizes = bench.grouped_gemm.group_sizes(8192, routing, rng, experts=48)
        assert sizes.dtype == np.int32 and sizes.shape == (48,) and sizes.sum() == 8192
    sizes = np.array([3, 0, 5, 1], np.int32)
    layout = bench.padded_layout(sizes)
    x = np.arange(9, dtype=np.float32)[:, None] * np.ones((1, 2), np.float32)
    padded = np.asarray(bench.to_padded(x, layout))
    assert padded.shape == (4, 5, 2)
    np.testing.assert_array_equal(padded[0, :3, 0], [0, 1, 2])
    np.testing.assert_array_equal(padded[1], 0)
    np.testing.assert_array_equal(padded[2, :, 0], [3, 4, 5, 6, 7])
    np.testing.assert_array_equal(padded[3, :, 0], [8, 0, 0, 0, 0])
    np.testing.assert_array_equal(np.asarray(bench.from_padded(padded, layout)), x)


def test_commit_comes_from_the_flag_then_the_environment(monkeypatch):
    bench = _load()
    monkeypatch.setenv("GIT_COMMIT", "envsha")
    monkeypatch.setenv("GIT_DIRTY", "0")
    assert bench.provenance("flagsha") == ("flagsha", "0")
    assert bench.provenance(None) == ("envsha", "0")
    monkeypatch.delenv("GIT_DIRTY")
    assert bench.provenance(None) == ("envsha", "unknown")


def test_results_from_before_the_anchor_render_as_they_did():
    """A results JSON without the dense anchor renders the page it was committed with (no
    "of anchor" column)."""
    bench = _load()
    results = ROOT / "benchmarks" / "results" / "train_step_h200"
    old = results / "9636c45"  # the run before the anchor
    data = json.loads((old / "train_step.json").read_text())
    assert "anchors" not in data
    page = bench.markdown(data)
    assert page == (old / "train_step.md").read_text()
    assert "of anchor" not in page
    # The headline run has it, and its page is what the script renders.
    data = json.loads((results / "train_step.json").read_text())
    assert data["anchors"] and bench.markdown(data) == (results / "train_step.md").read_text()
