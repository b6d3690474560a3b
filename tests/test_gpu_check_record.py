"""tools/gpu_check_record.py: the GPU check's record lists every test with its outcome, and its
verdict fails on a failed test, an unfinished pass or a failed demo (hand-written junit XML)."""

import dataclasses
import importlib.util
import os
import pathlib
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

TOOL = pathlib.Path(__file__).resolve().parents[1] / "tools" / "gpu_check_record.py"
_spec = importlib.util.spec_from_file_location("gpu_check_record", TOOL)
record = importlib.util.module_from_spec(_spec)
sys.modules["gpu_check_record"] = record  # dataclasses look their module up by name
_spec.loader.exec_module(record)

# What pytest writes with -o junit_family=xunit1: file attributes, properties per test case.
JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="0" failures="1" skipped="1" tests="3" time="12.5">
<testcase classname="tests.pallas_kernels.test_kimi_size_gpu" file="tests/pallas_kernels/test_kimi_size_gpu.py"
  line="10" name="test_kimi_size[nvfp4-down]" time="20.25">
  <properties><property name="rel_err_experts_376_383" value="1.7e-03"/></properties></testcase>
<testcase classname="tests.test_layer" file="tests/test_layer.py" line="120"
  name="test_gradients_match_a_dense_formulation" time="1.0">
  <failure message="AssertionError: Not equal to tolerance rtol=0.0002 | x&#10;second line">traceback
  </failure></testcase>
<testcase classname="tests.test_expert_parallel_gpu.TestSomething" name="test_exchange[4-ragged-bf16]" time="0.0">
  <skipped type="pytest.skip" message="needs 4 CUDA GPU(s), found 1">tests/x.py:3: needs 4</skipped></testcase>
</testsuite></testsuites>
"""

PASSING = JUNIT.replace('<failure message="AssertionError: Not equal to tolerance rtol=0.0002 | x&#10;second line">'
                        'traceback\n  </failure>', "")


def _pass(xml, rc, label="1 GPU"):
    return record.PassResult(label=label, rc=rc, seconds=30.0, command="python3 -m pytest -n 4 tests/x.py",
                             tests=record.parse_junit(xml) if xml is not None else None, log_tail="Killed\n")


def _render(passes, demo_rc=0, gpus=1):
    device = "".join(f"gpu: {i}, NVIDIA H200, 580.159.04, 143771 MiB\n" for i in range(gpus))
    return record.render(commit="abc123", dirty="1", date="2026-12-02 10:00:00 UTC", command="bash tools/gpu_check.sh OUT",
                         device_text=f"{device or 'gpu: none (nvidia-smi not found)'}\njax: 0.11.2\njax_gpu_count: {gpus}",
                         demo_text="moe-jax demo on 1 x NVIDIA H200 (gpu)\n  initializing [###] 2/2\n"
                                   "relative error vs float64 reference of the same NVFP4 weights: 3.34e-03\n",
                         demo_rc=demo_rc, passes=passes,
                         not_run=[record.NotRun("all GPUs (pass 2)", "JAX sees 1 GPU(s)")])


def test_parse_junit_reads_outcomes_reasons_messages_and_properties():
    tests = {t.test_id: t for t in record.parse_junit(JUNIT)}
    assert set(tests) == {
        "tests/pallas_kernels/test_kimi_size_gpu.py::test_kimi_size[nvfp4-down]",
        "tests/test_layer.py::test_gradients_match_a_dense_formulation",
        "tests/test_expert_parallel_gpu.py::TestSomething::test_exchange[4-ragged-bf16]",  # no file attribute
    }
    kimi = tests["tests/pallas_kernels/test_kimi_size_gpu.py::test_kimi_size[nvfp4-down]"]
    assert (kimi.outcome, kimi.seconds, kimi.properties) == ("passed", 20.25, (("rel_err_experts_376_383", "1.7e-03"),))
    failed = tests["tests/test_layer.py::test_gradients_match_a_dense_formulation"]
    assert (failed.outcome, failed.detail) == ("failed", "AssertionError: Not equal to tolerance rtol=0.0002 | x")
    skipped = tests["tests/test_expert_parallel_gpu.py::TestSomething::test_exchange[4-ragged-bf16]"]
    assert (skipped.outcome, skipped.detail) == ("skipped", "needs 4 CUDA GPU(s), found 1")


def test_an_empty_testcase_entry_is_no_test():
    tests = record.parse_junit(PASSING.replace("</testsuite>", '<testcase time="0.001" /></testsuite>'))
    assert [t.test_id for t in tests] == [t.test_id for t in record.parse_junit(PASSING)]


def test_a_failed_test_makes_the_verdict_fail_and_the_table_shows_every_test():
    text, ok = _render([_pass(JUNIT, rc=1)])
    assert not ok
    lines = text.splitlines()
    assert lines[0] == "# GPU check: FAILED"
    assert "- commit: `abc123` (with uncommitted changes)" in lines
    assert "- device: 1 x NVIDIA H200, driver 580.159.04; GPUs visible to JAX: 1" in lines
    assert "- versions: jax 0.11.2" in lines
    assert "passed 1, failed 1, skipped 1, errors 0 (of 3)" in lines
    # Every test has its row; the pipe inside the message is escaped, the second line dropped.
    assert ("| `tests/test_layer.py::test_gradients_match_a_dense_formulation` | FAILED | 1.0 | "
            "AssertionError: Not equal to tolerance rtol=0.0002 \\| x |") in lines
    assert ("| `tests/test_expert_parallel_gpu.py::TestSomething::test_exchange[4-ragged-bf16]` | skipped | 0.0 | "
            "needs 4 CUDA GPU(s), found 1 |") in lines
    assert ("| `tests/pallas_kernels/test_kimi_size_gpu.py::test_kimi_size[nvfp4-down]` | passed | 20.2 | "
            "rel_err_experts_376_383=1.7e-03 |") in lines
    assert "not run: JAX sees 1 GPU(s)" in lines
    assert lines[-1] == ("FAILED: 1 GPU: 1 failed (tests/test_layer.py::test_gradients_match_a_dense_formulation)")
    # The demo's key lines, not its progress bars.
    assert "relative error vs float64 reference of the same NVFP4 weights: 3.34e-03" in lines
    assert not any("initializing" in line for line in lines)


def test_all_passed_verdict_counts_and_gives_skip_reasons():
    text, ok = _render([_pass(PASSING, rc=0), _pass(PASSING, rc=0, label="all 2 GPUs")], gpus=2)
    assert "- device: 2 x NVIDIA H200, driver 580.159.04; GPUs visible to JAX: 2" in text.splitlines()
    assert ok
    assert text.splitlines()[0] == "# GPU check: passed"
    assert text.splitlines()[-1] == ("all 4 tests passed (1 GPU: 2, all 2 GPUs: 2), 2 skipped "
                                     "(needs 4 CUDA GPU(s), found 1: 2); demo rc 0")


def test_the_slowest_tests_are_named_longest_first_with_their_share():
    """Across passes, longest first; skipped tests left out, a failed pass's tests counted."""
    text, _ = _render([_pass(PASSING, rc=0), _pass(JUNIT, rc=1, label="all 2 GPUs")], gpus=2)
    lines = text.splitlines()
    start = lines.index("## Slowest tests")
    assert lines[start + 2] == "4 tests took 42 s in all (summed over the workers); the 4 longest:"
    rows = lines[start + 6:start + 10]
    assert [row.split(" | ")[1:3] for row in rows] == [["1 GPU", "20.2"], ["all 2 GPUs", "20.2"], ["1 GPU", "1.0"],
                                                       ["all 2 GPUs", "1.0"]], rows
    assert rows[0].startswith("| `tests/pallas_kernels/test_kimi_size_gpu.py::test_kimi_size[nvfp4-down]` |")
    assert rows[0].endswith("| 48% |") and rows[3].endswith("| 2% |")
    assert lines[start + 10] == ""  # nothing more: the skipped test is not named
    assert start < lines.index("## pytest: 1 GPU")
    assert "## Slowest tests" not in _render([_pass(None, rc=124)])[0]


@pytest.mark.parametrize("passes,demo_rc,gpus,expected", [
    pytest.param([("PASSING", 0)], 1, 1, "FAILED: the demo exited with rc 1", id="demo_failed"),
    pytest.param([("PASSING", 0)], None, 1, "FAILED: the demo did not run", id="demo_not_run"),
    pytest.param([(None, 124)], 0, 1, "FAILED: 1 GPU: no junit XML (rc 124: cut off by its time limit)",
                 id="killed_before_the_xml"),
    pytest.param([("PASSING", 124)], 0, 1, "FAILED: 1 GPU: cut off by its time limit after 3 tests (rc 124)",
                 id="cut_off_after_passing_tests"),
    pytest.param([("PASSING", 2)], 0, 1, "FAILED: 1 GPU: pytest exited with rc 2: interrupted or usage error",
                 id="interrupted_after_passing_tests"),
    pytest.param([], 0, 1, "FAILED: no pytest pass ran", id="no_pass"),
    pytest.param([("PASSING", 0)], 0, 0, "FAILED: JAX sees no GPU, so no GPU test ran", id="no_gpu"),
])
def test_anything_unfinished_fails_the_verdict(passes, demo_rc, gpus, expected):
    text, ok = _render([_pass(PASSING if xml else None, rc) for xml, rc in passes], demo_rc=demo_rc, gpus=gpus)
    assert not ok
    assert text.splitlines()[-1] == expected


def test_command_line_writes_the_record_and_exits_non_zero_on_failure(tmp_path):
    (tmp_path / "device.txt").write_text("gpu: 0, NVIDIA H200, 580.159.04, 143771 MiB\njax_gpu_count: 1\n")
    (tmp_path / "demo.txt").write_text("moe-jax demo on 1 x cpu (cpu)\ndemo rc=0\n")
    (tmp_path / "pytest_1gpu.xml").write_text(JUNIT)
    (tmp_path / "pytest_1gpu.txt").write_text("1 failed, 1 passed, 1 skipped\n")
    (tmp_path / "good.xml").write_text(PASSING)
    base = [sys.executable, str(TOOL), str(tmp_path), "--commit", "abc123", "--dirty", "0", "--demo-rc", "0"]
    bad = subprocess.run(base + ["--pass", "1 GPU|1|9|pytest_1gpu.xml|pytest_1gpu.txt|pytest a|b"],
                         capture_output=True, text=True)
    assert bad.returncode == 1, bad.stderr
    text = (tmp_path / "gpu_check.md").read_text()
    assert "`pytest a|b`" in text and "- commit: `abc123` (clean)" in text
    assert "gpu: 0, NVIDIA H200, 580.159.04, 143771 MiB" in text
    good = subprocess.run(base + ["--pass", "1 GPU|0|9|good.xml|pytest_1gpu.txt|pytest"], capture_output=True, text=True)
    assert good.returncode == 0, good.stderr
    assert good.stdout.strip().startswith("all 2 tests passed")


def _split(xml, keep):
    """The junit XML with only the test cases whose name holds one of ``keep``."""
    root = ET.fromstring(xml)
    for suite in root.iter("testsuite"):
        for case in list(suite):
            if not any(k in case.get("name", "") for k in keep):
                suite.remove(case)
    return ET.tostring(root, encoding="unicode")


COLLECTED = ["tests/pallas_kernels/test_kimi_size_gpu.py::test_kimi_size[nvfp4-down]",
             "tests/test_layer.py::test_gradients_match_a_dense_formulation",
             "tests/test_expert_parallel_gpu.py::TestSomething::test_exchange[4-ragged-bf16]"]


def test_a_cut_off_call_continued_by_a_second_passes_only_when_together_they_ran_everything():
    first = _split(PASSING, ["test_kimi_size", "test_exchange"])
    assert record.remaining(COLLECTED, record.parse_junit(first)) == [COLLECTED[1]]
    earlier = dataclasses.replace(_pass(first, rc=124, label="1 GPU, first call"), earlier=True)
    second = _pass(_split(PASSING, ["test_gradients"]), rc=0, label="1 GPU, second call")
    text, ok = record.render(commit="abc", dirty="0", date="d", command="c", device_text="gpu: 0, H200, 1, 1\njax_gpu_count: 1",
                             demo_text="", demo_rc=0, passes=[earlier, second], collected=COLLECTED)
    assert ok, text.splitlines()[-1]
    assert text.splitlines()[-1].startswith("all 2 tests passed (1 GPU, first call: 1, 1 GPU, second call: 1)")
    # Without the second call, or without the list it must cover, the cut-off call fails.
    for passes, collected, why in (([earlier], COLLECTED, "1 of 3 collected tests ran in no call "
                                     "(tests/test_layer.py::test_gradients_match_a_dense_formulation)"),
                                    ([earlier, second], None, "an earlier call's pass is included, but not the "
                                     "collected tests it must cover")):
        line, ok = record.verdict(passes, 0, 1, collected)
        assert not ok and why in line
    # A failure in the first call is not excused by the second.
    failed_first = dataclasses.replace(_pass(_split(JUNIT, ["test_gradients", "test_exchange"]), rc=124), earlier=True)
    line, ok = record.verdict([failed_first, _pass(_split(PASSING, ["test_kimi"]), rc=0)], 0, 1, COLLECTED)
    assert not ok and "1 failed" in line


def test_remaining_on_the_command_line(tmp_path):
    (tmp_path / "ids.txt").write_text("\n".join(COLLECTED) + "\n")
    (tmp_path / "a.xml").write_text(_split(PASSING, ["test_kimi_size"]))
    out = subprocess.run([sys.executable, str(TOOL), "--remaining", str(tmp_path / "ids.txt"), str(tmp_path / "a.xml")],
                         capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == COLLECTED[1:]


def test_nothing_remaining_prints_nothing(tmp_path):
    """No test left: no output at all (a blank line would reach pytest as one empty path, which
    it takes for its whole rootdir: a second call once ran the whole suite so)."""
    (tmp_path / "ids.txt").write_text("\n".join(COLLECTED) + "\n")
    (tmp_path / "a.xml").write_text(PASSING)
    out = subprocess.run([sys.executable, str(TOOL), "--remaining", str(tmp_path / "ids.txt"), str(tmp_path / "a.xml")],
                         capture_output=True, text=True, check=True)
    assert out.stdout == ""


CRASHED = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="0" skipped="0" tests="1" time="300.0">
<testcase classname="tests.test_serving_gpu" file="tests/test_serving_gpu.py" line="11"
  name="test_soak_on_gpu[nvfp4]" time="0.0">
  <error message="worker 'gw2' crashed while running 'tests/test_serving_gpu.py::test_soak_on_gpu[nvfp4]'">
  worker 'gw2' crashed</error></testcase>
</testsuite></testsuites>
"""


@pytest.mark.parametrize("method,noted", [("--timeout=240 --timeout-method=thread", True), ("", False)])
def test_a_crashed_worker_is_said_to_be_possibly_a_timeout_under_the_thread_method(method, noted):
    # xdist reports a worker that pytest-timeout's thread method ended exactly as a crash.
    crashed = dataclasses.replace(_pass(CRASHED, rc=1), command=f"python3 -m pytest -n 4 {method} tests/x.py")
    text, ok = _render([crashed])
    assert not ok
    note = [line for line in text.splitlines() if "crashed with no traceback" in line]
    assert len(note) == noted
    if noted:
        assert "per-test limit (240 s here" in note[0]


# What pytest-xdist's controller writes when the SIGINT of the pass's time limit reached a worker
# mid-hook: the worker's INTERNALERROR, re-raised as an AssertionError (xdist's dsession.py
# worker_internal_error), in the entry that pytest's junitxml keeps for internal errors.
INTERRUPT = """<testcase classname="pytest" name="internal" time="0.000"><error message="internal error">def worker_internal_error(
E       AssertionError: Traceback (most recent call last):
E           File "/opt/venv/lib/python3.12/site-packages/_pytest/main.py", line 289, in wrap_session
E             session.exitstatus = doit(config, session) or 0
E           File "/opt/venv/lib/python3.12/site-packages/jax/_src/lib/__init__.py", line 126, in _xla_gc_callback
E             _jax.collect_garbage()
E         KeyboardInterrupt
E       assert False

/opt/venv/lib/python3.12/site-packages/xdist/dsession.py:232: AssertionError</error></testcase>"""


def _with_interrupt(xml):
    return xml.replace("</testsuite>", INTERRUPT + "</testsuite>")


def test_the_interrupt_of_a_cut_off_pass_is_no_test_and_no_error():
    tests = record.parse_junit(_with_interrupt(PASSING))
    assert [t.outcome for t in tests if t.test_id == "pytest::internal"] == ["interrupted"]
    text, ok = _render([_pass(_with_interrupt(PASSING), rc=124)])
    lines = text.splitlines()
    assert not ok  # it did not run to the end
    assert lines[-1] == "FAILED: 1 GPU: cut off by its time limit after 3 tests (rc 124)"
    assert "rc 124: cut off by its time limit, 30 s" in lines
    assert "passed 2, failed 0, skipped 1, errors 0 (of 3)" in lines  # the interrupt is not counted
    assert any(line.startswith("Cut off by its time limit: it did not run to the end") and "KeyboardInterrupt" in line
               for line in lines)
    assert not any("pytest::internal" in line or "ERROR" in line for line in lines)


def test_an_interrupt_without_the_time_limit_fails_and_other_internal_errors_stay_errors():
    line, ok = record.verdict([_pass(_with_interrupt(PASSING), rc=2)], 0, 1)
    assert not ok and line == "FAILED: 1 GPU: interrupted (KeyboardInterrupt) before its time limit (rc 2)"
    crash = INTERRUPT.replace("KeyboardInterrupt", "RuntimeError: the scheduler broke")
    line, ok = record.verdict([_pass(PASSING.replace("</testsuite>", crash + "</testsuite>"), rc=124)], 0, 1)
    assert not ok and "1 GPU: 1 errors" in line and "(pytest::internal)" in line


def test_a_cut_off_pass_names_the_collected_tests_it_did_not_reach():
    first = _pass(_with_interrupt(_split(PASSING, ["test_kimi_size", "test_exchange"])), rc=124)
    line, ok = record.verdict([first], 0, 1, COLLECTED)
    assert not ok
    assert line == ("FAILED: 1 GPU: cut off by its time limit after 2 tests (rc 124); 1 of 3 collected tests did not "
                    "run (tests/test_layer.py::test_gradients_match_a_dense_formulation)")


def test_a_continuation_of_a_cut_off_pass_with_its_interrupt_passes(tmp_path):
    """Measured on a480f3c: the first call's interrupt was counted as an error (pytest::internal),
    so a second call that ran every remaining test still said FAILED."""
    (tmp_path / "device.txt").write_text("gpu: 0, NVIDIA H200, 580.159.04, 143771 MiB\njax_gpu_count: 1\n")
    (tmp_path / "demo.txt").write_text("demo rc=0\n")
    (tmp_path / "call1_pytest_1gpu.xml").write_text(_with_interrupt(_split(PASSING, ["test_kimi_size", "test_exchange"])))
    (tmp_path / "pytest_1gpu.xml").write_text(_split(PASSING, ["test_gradients"]))
    (tmp_path / "log.txt").write_text("1 passed\n")
    # The first call's collection, whatever this call's environment would collect.
    (tmp_path / "pass1_collected.txt").write_text("\n".join(COLLECTED) + "\n")
    remaining = subprocess.run([sys.executable, str(TOOL), "--remaining", str(tmp_path / "pass1_collected.txt"),
                                str(tmp_path / "call1_pytest_1gpu.xml")], capture_output=True, text=True, check=True)
    assert remaining.stdout.split() == [COLLECTED[1]]
    base = [sys.executable, str(TOOL), str(tmp_path), "--commit", "abc", "--demo-rc", "0",
            "--earlier-pass", "1 GPU, first call|124|450|call1_pytest_1gpu.xml|log.txt|pytest -m 'gpu or gpu_check' tests"]
    done = subprocess.run(base + ["--collected", "pass1_collected.txt", "--pass", f"1 GPU, second call|0|9|pytest_1gpu.xml|log.txt|pytest {COLLECTED[1]}"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().startswith("all 2 tests passed (1 GPU, first call: 1, 1 GPU, second call: 1), 1 skipped")
    text = (tmp_path / "gpu_check.md").read_text()
    assert "# GPU check: passed" in text and "pytest::internal" not in text
    # No collected list, or an empty one, cannot excuse the tests the first call did not reach.
    (tmp_path / "empty.txt").write_text("\n")
    for collected in ("missing.txt", "empty.txt"):
        refused = subprocess.run(base + ["--collected", collected, "--pass", "1 GPU, second call|0|9|pytest_1gpu.xml|log.txt|pytest"],
                                 capture_output=True, text=True)
        assert refused.returncode == 2 and f"--collected {collected}: missing or empty" in refused.stderr


# tools/gpu_check.sh end to end, with a stand-in for the interpreter: the device report, the demo
# and pytest are faked (no GPU, no jax); the record tool is the real one.
_FAKE_PYTHON = """#!/usr/bin/env bash
case "$1 $2" in
  "-m pytest") exec "$REAL_PYTHON" "$FAKE_PYTEST" "${@:3}" ;;
  "-m moe_jax.cli") echo "moe-jax demo on 1 x NVIDIA H200 (gpu)"; exit 0 ;;
esac
if [[ "$1" == "-" ]]; then cat > /dev/null; echo "python: 3.12.3"; echo "jax_gpu_count: 1"; exit 0; fi
exec "$REAL_PYTHON" "$@"
"""
_FAKE_PYTEST = """import os, sys, time
args = sys.argv[1:]
xml = next(a.split("=", 1)[1] for a in args if a.startswith("--junitxml="))
ids = [a for a in args if "::" in a]
def write(done):
    cases = "".join(f'<testcase classname="{i.split("::")[0][:-3].replace("/", ".")}" file="{i.split("::")[0]}" '
                    f'name="{i.split("::")[1]}" time="1.0"/>' for i in done)
    with open(xml, "w") as f:
        f.write(f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{cases}</testsuite></testsuites>')
if "MOE_JAX_COLLECTED_IDS" in os.environ:  # a first call: collects three tests, runs two, then hangs
    with open(os.environ["MOE_JAX_COLLECTED_IDS"], "w") as f:
        f.write("tests/test_a.py::test_1\\ntests/test_a.py::test_2\\ntests/test_b.py::test_3\\n")
    write(["tests/test_a.py::test_1", "tests/test_a.py::test_2"][:int(os.environ.get("FAKE_FIRST_RUN", 2))])
    time.sleep(120)
with open(os.environ["FAKE_ARGS"], "w") as f:  # a continuation: what it was asked to run
    f.write("\\n".join(ids))
if "FAKE_RUN" in os.environ:  # a continuation that is cut off in turn: runs that many, then hangs
    write(ids[:int(os.environ["FAKE_RUN"])])
    time.sleep(120)
write(ids)
"""


def _fake_check(tmp_path):
    """``call(name, **env)``: tools/gpu_check.sh into ``tmp_path / name`` with the stand-ins above
    (pass 1 limited to 3 s); what the stand-in pytest was asked to run goes to ``args.txt``."""
    root = TOOL.parents[1]
    (tmp_path / "python").write_text(_FAKE_PYTHON)
    (tmp_path / "python").chmod(0o755)
    (tmp_path / "pytest.py").write_text(_FAKE_PYTEST)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")},
           "PYTHON": str(tmp_path / "python"), "REAL_PYTHON": sys.executable, "FAKE_PYTEST": str(tmp_path / "pytest.py"),
           "FAKE_ARGS": str(tmp_path / "args.txt"), "GIT_COMMIT": "abc123", "GIT_DIRTY": "0", "GPU_CHECK_PASS1_S": "3"}

    def call(name, **extra):
        return subprocess.run(["bash", str(root / "tools" / "gpu_check.sh"), str(tmp_path / name)],
                              env={**env, **extra}, capture_output=True, text=True, timeout=120)

    return call


def test_the_script_records_a_cut_off_pass_and_continues_it_with_the_first_calls_list(tmp_path):
    call = _fake_check(tmp_path)
    first = call("call1")
    record1 = (tmp_path / "call1" / "gpu_check.md").read_text()
    assert first.returncode == 1, first.stdout + first.stderr
    assert "rc 124: cut off by its time limit" in record1 and "passed 2, failed 0, skipped 0, errors 0 (of 2)" in record1
    assert record1.rstrip().endswith("cut off by its time limit after 2 tests (rc 124); 1 of 3 collected tests did not "
                                     "run (tests/test_b.py::test_3)")
    second = call("call2", GPU_CHECK_CONTINUE=str(tmp_path / "call1"))
    assert second.returncode == 0, second.stdout + second.stderr
    assert (tmp_path / "args.txt").read_text() == "tests/test_b.py::test_3"  # only what the first call did not reach
    assert ((tmp_path / "call2" / "pass1_collected.txt").read_text()
            == (tmp_path / "call1" / "pass1_collected.txt").read_text())  # the first call's list
    record2 = (tmp_path / "call2" / "gpu_check.md").read_text()
    assert record2.startswith("# GPU check: passed") and "continues an earlier call" in record2


def test_a_continuation_cut_off_in_turn_is_continued_with_every_earlier_calls_pass(tmp_path):
    """Three calls: the first runs 1 of 3 tests, the second is cut off after the next one, the third
    runs the last; its record holds all three calls' passes. A continuation an older script made (its
    first call's files, no earlier_passes.spec) is refused rather than run again from the start."""
    call = _fake_check(tmp_path)
    assert call("call1", FAKE_FIRST_RUN="1").returncode == 1
    second = call("call2", GPU_CHECK_CONTINUE=str(tmp_path / "call1"), FAKE_RUN="1")
    assert second.returncode == 1, second.stdout + second.stderr
    assert (tmp_path / "call2" / "gpu_check.md").read_text().rstrip().endswith(
        "1 of 3 collected tests ran in no call (tests/test_b.py::test_3)")
    third = call("call3", GPU_CHECK_CONTINUE=str(tmp_path / "call2"))
    assert third.returncode == 0, third.stdout + third.stderr
    assert (tmp_path / "args.txt").read_text() == "tests/test_b.py::test_3"  # what neither call ran
    specs = (tmp_path / "call3" / "earlier_passes.spec").read_text().splitlines()
    assert [spec.split("|")[3] for spec in specs] == ["call1_pytest_1gpu.xml", "call2_pytest_1gpu.xml"]
    assert specs[0].startswith("1 GPU (CUDA_VISIBLE_DEVICES=0), first call (commit abc123)|124|")
    assert specs[1].startswith("1 GPU (CUDA_VISIBLE_DEVICES=0), second call (commit abc123)|124|")
    record3 = (tmp_path / "call3" / "gpu_check.md").read_text()
    assert record3.startswith("# GPU check: passed") and "## pytest: 1 GPU (CUDA_VISIBLE_DEVICES=0), third call" in record3
    assert record3.rstrip().endswith("all 3 tests passed (1 GPU (CUDA_VISIBLE_DEVICES=0), first call (commit abc123): 1, "
                                     "1 GPU (CUDA_VISIBLE_DEVICES=0), second call (commit abc123): 1, "
                                     "1 GPU (CUDA_VISIBLE_DEVICES=0), third call: 1), 0 skipped; demo rc 0")
    (tmp_path / "call2" / "earlier_passes.spec").unlink()
    older = call("call3b", GPU_CHECK_CONTINUE=str(tmp_path / "call2"))
    assert older.returncode == 2 and "without earlier_passes.spec" in older.stderr


_FAKE_NVIDIA_SMI = """#!/usr/bin/env bash
if [[ "$*" == *nounits* ]]; then echo "$FAKE_GPU_MIB"; else echo "0, $FAKE_GPU_NAME, 580.159.04, $FAKE_GPU_MIB MiB"; fi
"""


@pytest.mark.parametrize(("gpu", "mib", "override", "workers"),
                         [("NVIDIA H200", 143771, None, 4), ("NVIDIA H100 80GB HBM3", 81559, None, 2),
                          ("NVIDIA H100 80GB HBM3", 81559, "3", 3)])
def test_the_script_runs_fewer_workers_on_a_gpu_of_less_memory(tmp_path, gpu, mib, override, workers):
    """Four workers that have each run a Kimi K2-size bf16 test hold ~120 GB: an H200 has room, an
    80 GB H100 takes two unless told otherwise."""
    root = TOOL.parents[1]
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvidia-smi").write_text(_FAKE_NVIDIA_SMI)
    (tmp_path / "bin" / "nvidia-smi").chmod(0o755)
    (tmp_path / "python").write_text(_FAKE_PYTHON)
    (tmp_path / "python").chmod(0o755)
    (tmp_path / "pytest.py").write_text("import sys\nxml = next(a.split('=', 1)[1] for a in sys.argv if "
                                        "a.startswith('--junitxml='))\nopen(xml, 'w').write('<testsuites/>')\n")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")},
           "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "FAKE_GPU_MIB": str(mib), "FAKE_GPU_NAME": gpu,
           "PYTHON": str(tmp_path / "python"), "REAL_PYTHON": sys.executable, "FAKE_PYTEST": str(tmp_path / "pytest.py"),
           "GIT_COMMIT": "abc123", "GIT_DIRTY": "0", "GPU_CHECK_PASSES": "1", "GPU_CHECK_SKIP_DEMO": "1"}
    if override is not None:
        env["GPU_CHECK_WORKERS"] = override
    subprocess.run(["bash", str(root / "tools" / "gpu_check.sh"), str(tmp_path / "out")], env=env,
                   capture_output=True, text=True, timeout=120)
    spec = (tmp_path / "out" / "pass_1gpu.spec").read_text()
    assert f" -n {workers} " in spec, spec
    assert gpu in (tmp_path / "out" / "device.txt").read_text()


def test_the_demo_runs_beside_pass_1_and_its_status_reaches_the_record(tmp_path):
    """The demo starts in the background: pass 1 starts before it ends, and the record still
    gets its exit status (a failing demo fails the check) and says its throughput is no benchmark.
    GPU_CHECK_SKIP_DEMO=0 runs it, as leaving it unset does."""
    root = TOOL.parents[1]
    fake_python = _FAKE_PYTHON.replace(
        '"-m moe_jax.cli") echo "moe-jax demo on 1 x NVIDIA H200 (gpu)"; exit 0 ;;',
        '"-m moe_jax.cli") sleep 3; echo "moe-jax demo on 1 x NVIDIA H200 (gpu)"; echo "throughput: 9 tokens/s"; '
        'date +%s.%N > "$FAKE_DEMO_END"; exit "$FAKE_DEMO_RC" ;;')
    (tmp_path / "python").write_text(fake_python)
    (tmp_path / "python").chmod(0o755)
    (tmp_path / "pytest.py").write_text(
        "import sys, time\nopen(sys.argv[-1], 'w').write(repr(time.time()))\n"
        "xml = next(a.split('=', 1)[1] for a in sys.argv if a.startswith('--junitxml='))\n"
        "open(xml, 'w').write('<testsuites><testsuite name=\"pytest\"><testcase classname=\"tests.test_a\" "
        "file=\"tests/test_a.py\" name=\"test_1\" time=\"1.0\"/></testsuite></testsuites>')\n")
    for demo_rc, verdict in ((0, "# GPU check: passed"), (3, "# GPU check: FAILED")):
        out = tmp_path / f"out{demo_rc}"
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")},
               "PYTHON": str(tmp_path / "python"), "REAL_PYTHON": sys.executable,
               "FAKE_PYTEST": str(tmp_path / "pytest.py"), "FAKE_DEMO_END": str(tmp_path / f"demo_end{demo_rc}"),
               "FAKE_DEMO_RC": str(demo_rc), "GIT_COMMIT": "abc123", "GIT_DIRTY": "0", "GPU_CHECK_PASSES": "1",
               "GPU_CHECK_PASS1": str(tmp_path / f"pytest_start{demo_rc}"),
               **({"GPU_CHECK_SKIP_DEMO": "0"} if demo_rc == 0 else {})}
        done = subprocess.run(["bash", str(root / "tools" / "gpu_check.sh"), str(out)], env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == (demo_rc != 0), done.stdout + done.stderr
        started = float((tmp_path / f"pytest_start{demo_rc}").read_text())
        assert started < float((tmp_path / f"demo_end{demo_rc}").read_text()), "pass 1 waited for the demo"
        record = (out / "gpu_check.md").read_text()
        assert record.startswith(verdict), record[:300]
        assert f"rc {demo_rc}" in record and "throughput above: measured beside the GPU check's tests" in record
