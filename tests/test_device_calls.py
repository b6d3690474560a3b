"""``tools/device_calls.sh`` (the measurements queued for the next device session) names only
scripts that exist and flags they define: a typo would cost a device call."""

from __future__ import annotations

import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "device_calls.sh"


def _commands() -> list[tuple[str, str]]:
    """(benchmark script, the rest of its command line) for every ``python benchmarks/NAME.py``
    the script runs."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    return [(m.group(1), m.group(2)) for line in text.splitlines()
            if (m := re.search(r"python (benchmarks/\w+\.py)(.*)", line))]


def test_every_benchmark_flag_and_kernel_name_exists():
    """Each flag is one the benchmark defines, and each name after ``--kernels`` or
    ``--candidates`` one of its labels (a misspelt one would cost the step)."""
    commands = _commands()
    assert len(commands) >= 8, commands
    for script, args in commands:
        source = (ROOT / script).read_text()
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", args):
            assert f'"{flag}"' in source, f"{script} defines no {flag}"
        for names in re.findall(r"--(?:kernels|candidates)((?:\s+\"[^\"]+\")+)", args):
            for name in re.findall(r'"([^"]+)"', names):
                assert f'"{name}"' in source, f"{script} has no kernel or candidate {name!r}"


def test_the_script_parses_and_refuses_an_unknown_call(tmp_path):
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    out = subprocess.run(["bash", str(SCRIPT), "nonsense", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ""})
    assert out.returncode == 2 and "unknown call 'nonsense'" in out.stdout, out
    assert not any(tmp_path.iterdir())  # refused before anything ran


def test_the_base_layer_runs_from_the_base_tree():
    """``layer.py`` puts the tree it sits in first on ``sys.path``, so a base library run from main's
    tree measures main (2f15176's call did): the base's step runs from its own tree."""
    assert "sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))" in (
        ROOT / "benchmarks" / "layer.py").read_text()
    text = SCRIPT.read_text().replace("\\\n", " ")
    base = [line for line in text.splitlines() if "layer_base" in line and "benchmarks/layer.py" in line]
    assert base, "no base layer step"
    for line in base:
        assert "env -C /tmp/base" in line and "$PWD" not in line, line


def test_the_branch_call_measures_then_skips_a_check_that_cannot_finish(tmp_path):
    """On an H100 the branch call's A/B takes the bf16 weights only, and with less time left than the
    check takes it does not start one (cut off, it would be worth nothing) and says so."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "python_calls.txt"
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3'\n")
    (bin_dir / "python").write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    out = subprocess.run(["bash", str(SCRIPT), "branch", str(tmp_path / "out")], cwd=ROOT, capture_output=True,
                         text=True, env={"PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHONPATH": "", "BASE": "none",
                                         "CALL_S": "100", "GIT_COMMIT": "abc"})
    assert out.returncode == 1 and "gpu_check: not run" in out.stdout, out
    steps = [line for line in calls.read_text().splitlines() if "train_step.py" in line]
    assert len(steps) == 2 and all("--layer-weights bf16 --experts 48" in line for line in steps), steps
    assert not (tmp_path / "out" / "gc").exists()


def test_the_profile_ab_call_alternates_the_base_tree_and_this_one(tmp_path):
    """Base, tree, base, tree: each base profile runs from the base's own tree (profile_layer.py
    puts its tree first on ``sys.path``) and is stamped with the base's commit."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "python_calls.txt"
    (bin_dir / "python").write_text(f'#!/bin/sh\necho "$PWD $GIT_COMMIT $*" >> {calls}\n')
    (bin_dir / "python").chmod(0o755)
    out = subprocess.run(["bash", str(SCRIPT), "profile_ab", str(tmp_path / "out")], cwd=ROOT, capture_output=True,
                         text=True, env={"PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHONPATH": "", "BASE": "b0",
                                         "GIT_COMMIT": "t1"})
    steps = [line.split() for line in calls.read_text().splitlines() if "profile_layer.py" in line]
    assert [(cwd == "/tmp/base", commit) for cwd, commit, *_ in steps] == [(True, "b0"), (False, "t1")] * 2, out
    assert all("--tokens" in step and "8192" in step for step in steps)
