"""The GPU check's selection (``tools/gpu_check.sh``, pass 1: ``-m "gpu or gpu_check" tests``) drops
no test that can run natively on a GPU.

The rule: every test file is collected; a test runs on the GPU when it carries a ``gpu`` marker
(it needs a GPU; any count) or a ``gpu_check`` marker (it runs on the default backend and can
behave differently on a GPU). The rest runs the same code on the GPU machine as in CI: the
Pallas interpreter, lowering or cross-compiling for abstract GPUs, argument checks, host logic,
tests on the 8 virtual CPU devices. One collection of the whole suite, in a subprocess with the
script's marker expression, shows what the rule selects; a test it leaves out must not name a
GPU device, nor ask for a kernel without the interpreter unless it runs on the CPU devices
(then it only traces or lowers, for an abstract GPU).
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = (ROOT / "tools" / "gpu_check.sh").read_text()

# Written as a plugin file: the collection runs in its own pytest process.
_PLUGIN = '''
import inspect, json, os

_deselected = []


def pytest_deselected(items):
    _deselected.extend(items)


def _row(item, selected):
    try:
        source = inspect.getsource(item.function)
    except (OSError, TypeError, AttributeError):
        source = ""
    return {"id": item.nodeid, "selected": selected, "marks": sorted({m.name for m in item.iter_markers()}),
            "fixtures": sorted(getattr(item, "fixturenames", ())), "source": source}


def pytest_collection_finish(session):
    rows = [_row(i, True) for i in session.items] + [_row(i, False) for i in _deselected]
    with open(os.environ["GPU_CHECK_SELECTION_DUMP"], "w") as f:
        json.dump(rows, f)
'''

# What running natively on a GPU looks like in a test's own source.
_NATIVE = re.compile(r'devices\("gpu"\)|interpret=False|_gpu_capability\(')


def script_default(name: str) -> str:
    """The default of ``name="${GPU_CHECK_...-default}"`` (or ``:-``) in tools/gpu_check.sh."""
    match = re.search(rf'^{name}="\$\{{GPU_CHECK_[A-Z0-9_]+:?-([^}}]*)\}}"$', SCRIPT, re.M)
    assert match, f"tools/gpu_check.sh: no {name}=\"${{GPU_CHECK_...-...}}\" line"
    return match.group(1)


@pytest.fixture(scope="module")
def collected(tmp_path_factory):
    """Every test of the suite, whether pass 1 selects it, its markers, fixtures and source."""
    tmp = tmp_path_factory.mktemp("selection")
    (tmp / "gpu_check_selection_plugin.py").write_text(_PLUGIN)
    dump = tmp / "items.json"
    env = {**os.environ, "GPU_CHECK_SELECTION_DUMP": str(dump),
           "PYTHONPATH": os.pathsep.join([str(tmp), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("PYTEST_XDIST_WORKER", None)
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "gpu_check_selection_plugin", "-p", "no:cacheprovider",
                           "-q", "--collect-only", "-n", "0", "-m", script_default("marks"), script_default("pass1")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(dump.read_text())


def test_pass_one_collects_every_test_file_and_selects_by_marker():
    assert script_default("pass1") == "tests"
    assert script_default("marks") == "gpu or gpu_check"
    assert '-m "$marks" $pass1' in SCRIPT and '-m "$marks" "${pass1_left[@]}"' in SCRIPT


def test_every_gpu_test_of_any_count_is_selected(collected):
    gpu = [row for row in collected if "gpu" in row["marks"]]
    assert len(gpu) > 200  # the suite's GPU tests were collected at all
    assert [row["id"] for row in gpu if not row["selected"]] == []
    assert [row["id"] for row in collected if "gpu_check" in row["marks"] and not row["selected"]] == []
    # Only these two markers select: the rest of the suite stays with CI.
    assert all("gpu" in row["marks"] or "gpu_check" in row["marks"] for row in collected if row["selected"])


def test_no_test_left_to_ci_runs_natively_on_a_gpu(collected):
    native = [row["id"] for row in collected if not row["selected"] and _NATIVE.search(row["source"])
              and "cpu_devices" not in row["fixtures"]]
    assert native == [], "mark these gpu (they need a GPU) or gpu_check (they run on the default backend)"
    # The check sees what it looks for: the selected GPU tests show it, so do the CPU-device
    # tests that lower the native path for an abstract H200.
    assert any(_NATIVE.search(row["source"]) for row in collected if row["selected"])
    assert any(_NATIVE.search(row["source"]) and "cpu_devices" in row["fixtures"]
               for row in collected if not row["selected"])


@pytest.mark.parametrize("suite", ["tests/test_layer.py", "tests/test_router.py"])
def test_the_default_backend_suites_run_whole_on_the_gpu(collected, suite):
    """The layer (``auto`` picks the GPU kernels there) and the router (XLA:GPU's top-k and
    float32 matmuls decide the experts) have no GPU twin: every test of theirs runs there."""
    rows = [row for row in collected if row["id"].startswith(f"{suite}::")]
    assert rows and all(row["selected"] for row in rows)


def test_the_large_gpu_memory_tests_run_on_one_worker():
    """Under the script's ``--dist loadgroup`` (tests/conftest.py's scheduler), the tests marked
    ``large_gpu_memory`` all go to one xdist worker and the rest are shared out: two of them on two
    workers of one 80 GB card run out of memory. On this machine they are skipped, and the workers
    they went to are what is checked."""
    pytest.importorskip("xdist")
    assert re.search(r"pytest_opts\+=\(-n \"\$workers\" --dist loadgroup\)", SCRIPT)
    files = ["tests/pallas_kernels/test_kimi_size_gpu.py", "tests/pallas_kernels/test_triton_lang_gpu.py"]
    marked = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--collect-only",
                             "-m", "large_gpu_memory", *files], cwd=ROOT, capture_output=True, text=True, check=True)
    large = {line for line in marked.stdout.splitlines() if "::" in line}
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", "-n", "2", "--dist",
                          "loadgroup", "-m", "gpu or gpu_check", *files], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    worker_of = {test: worker for worker, test in re.findall(r"^\[(gw\d+)\] \[ *\d+%\] \w+ (\S+)", run.stdout, re.M)}
    assert len(large) >= 10 and large <= worker_of.keys(), sorted(large - worker_of.keys())[:3]
    assert len({worker_of[t] for t in large}) == 1, sorted((worker_of[t], t) for t in large)
    assert len(set(worker_of.values())) == 2, "one worker ran everything: the check says nothing"
