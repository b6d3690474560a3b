"""Renders the record of one ``tools/gpu_check.sh`` run as markdown (stdlib only).

Reads what the shell script left in its output folder (``device.txt``, ``demo.txt``, one
junit XML and one log per pytest pass) and writes ``gpu_check.md`` there: commit, date,
device, versions and the exact command; the demo's exit status and key lines; per pass the
counts and a table of every test with its outcome (skips with their reason, failures with
the first line of their message, recorded properties such as per-block errors); and one
verdict line. Exits 1 when anything failed (a test, a pass that did not finish, the demo),
else 0.

Usage (the shell script calls it; by hand for a record already on disk)::

    python3 tools/gpu_check_record.py OUT --commit SHA [--dirty 1|0|unknown] --command CMD \\
        --demo-rc RC --pass "LABEL|RC|SECONDS|pytest_1gpu.xml|pytest_1gpu.txt|PYTEST COMMAND" \\
        [--pass ...] [--not-run "LABEL|REASON"] [--date ISO] [--seconds TOTAL] \\
        [--earlier-pass SPEC --collected FILE]

A pass that its time limit cut off (``timeout`` exit status 124) is reported as cut off, not as an
error: pytest-xdist may then write the SIGINT as an INTERNALERROR (``pytest::internal`` with a
KeyboardInterrupt), which is no test and no failure. ``--collected`` names the test ids the pass
collected (``tools/gpu_check.sh`` has the first worker write them), so the record says which tests
it did not reach. A second call at the same code (``GPU_CHECK_CONTINUE``) finishes such a pass:
the earlier call's pass comes in as ``--earlier-pass`` and the first call's collected ids as
``--collected``; the record passes only if the calls together ran every collected test and none
failed; a call that continues a continuation gets every earlier call's pass. ``--remaining
COLLECTED XML [XML ...]`` prints the collected ids that none of the XMLs holds (what the next call
runs).

Importable: :func:`parse_junit` and :func:`render` are what the tests exercise.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import os
import re
import sys
import xml.etree.ElementTree as ET

PASSED, FAILED, ERROR, SKIPPED = "passed", "failed", "error", "skipped"
# Not a test: pytest's own INTERNALERROR entry when the error is a KeyboardInterrupt, i.e. pytest
# was interrupted (by the SIGINT of the pass's time limit, when the pass's rc is 124).
INTERRUPTED = "interrupted"
CUT_OFF_RC = 124  # `timeout`'s exit status when the limit ran out (SIGINT sent)
_DEMO_KEYS = ("moe-jax demo on", "  target:", "  expert_gemm:", "  exchange:", "tokens:", "relative error",
              "NVFP4 quantization error", "expert load", "throughput", "FAILED")
_MESSAGE_CHARS = 240
#: How many tests the record's "Slowest tests" names.
_SLOWEST = 10


@dataclasses.dataclass(frozen=True)
class TestResult:
    """One test case of a junit XML file."""

    test_id: str  # path/to/test_file.py::Class::test_name[params]
    outcome: str  # PASSED, FAILED, ERROR or SKIPPED
    detail: str  # skip reason or first line of the failure message; "" when passed
    seconds: float
    properties: tuple[tuple[str, str], ...] = ()


@dataclasses.dataclass(frozen=True)
class PassResult:
    """One pytest pass: how it was run and what its junit XML holds."""

    label: str
    rc: int
    seconds: float
    command: str
    tests: tuple[TestResult, ...] | None  # None: no junit XML was written (killed, crashed)
    log_tail: str = ""  # the end of the pytest log, shown when the pass did not finish cleanly
    earlier: bool = False  # from an earlier call that a later one continues (GPU_CHECK_CONTINUE)

    @property
    def cut_off(self) -> bool:
        """Its time limit stopped it: it did not run to the end (which is no test's failure)."""
        return self.rc == CUT_OFF_RC

    def results(self) -> tuple[TestResult, ...]:
        """The tests it ran; pytest's interrupt entry is no test."""
        return tuple(t for t in self.tests or () if t.outcome != INTERRUPTED)

    def counts(self) -> collections.Counter:
        return collections.Counter(t.outcome for t in self.results())

    def problems(self) -> list[str]:
        """Why this pass is not a success; empty when it is."""
        out = []
        counts = self.counts()
        if self.tests is None:
            out.append(f"{self.label}: no junit XML (rc {self.rc}{_rc_meaning(self.rc)})")
            return out
        if counts[FAILED]:
            out.append(f"{self.label}: {counts[FAILED]} failed")
        if counts[ERROR]:
            out.append(f"{self.label}: {counts[ERROR]} errors")
        if not self.results():
            out.append(f"{self.label}: no tests ran")
        if self.cut_off:
            # An earlier call's pass is excused: the verdict checks that the later call ran every
            # collected test it did not reach. This call's own pass did not finish.
            if not self.earlier:
                out.append(f"{self.label}: cut off by its time limit after {len(self.results())} tests (rc {self.rc})")
        elif any(t.outcome == INTERRUPTED for t in self.tests):
            out.append(f"{self.label}: interrupted (KeyboardInterrupt) before its time limit (rc {self.rc})")
        elif self.rc != 0 and not (counts[FAILED] or counts[ERROR]):
            out.append(f"{self.label}: pytest exited with rc {self.rc}{_rc_meaning(self.rc)}")
        return out


@dataclasses.dataclass(frozen=True)
class NotRun:
    label: str
    reason: str


def _rc_meaning(rc: int) -> str:
    return {CUT_OFF_RC: ": cut off by its time limit", 137: ": killed", 2: ": interrupted or usage error",
            3: ": pytest internal error", 4: ": pytest usage error", 5: ": no tests collected"}.get(rc, "")


def _first_line(text: str | None) -> str:
    for line in (text or "").splitlines():
        if line.strip():
            line = line.strip()
            return line if len(line) <= _MESSAGE_CHARS else line[: _MESSAGE_CHARS - 3] + "..."
    return ""


def _test_id(case: ET.Element) -> str:
    """``path/file.py::Class::name`` from junit's ``file``/``classname``/``name``."""
    name = case.get("name", "?")
    parts = case.get("classname", "").split(".")
    module = max((i for i, p in enumerate(parts) if p.startswith("test_") or p.endswith("_test")), default=None)
    classes = parts[module + 1:] if module is not None else []
    if case.get("file"):
        path = case.get("file")
    elif module is not None:
        path = "/".join(parts[: module + 1]) + ".py"
    else:
        return "::".join(p for p in (case.get("classname"), name) if p)
    return "::".join([path, *classes, name])


def parse_junit(source: str | os.PathLike) -> tuple[TestResult, ...]:
    """Every ``testcase`` of a pytest junit XML file (a path, or the XML text itself)."""
    text = str(source)
    root = ET.fromstring(text) if text.lstrip().startswith("<") else ET.parse(source).getroot()
    results = []
    for case in root.iter("testcase"):
        if case.get("name") is None:
            # pytest-xdist can leave an empty <testcase time=".."/> beside the real entries when a
            # run is interrupted: it is no test, and counting it would inflate "passed".
            continue
        children = {child.tag: child for child in case}
        properties = tuple((p.get("name", ""), p.get("value", "")) for p in case.iter("property"))
        # A test can fail and then error in teardown: the worst outcome wins.
        for tag, outcome in (("error", ERROR), ("failure", FAILED), ("skipped", SKIPPED)):
            if tag in children:
                child = children[tag]
                detail = _first_line(child.get("message")) or _first_line(child.text)
                break
        else:
            outcome, detail = PASSED, ""
        if _is_interrupt(case, children):
            outcome, detail = INTERRUPTED, "pytest interrupted (KeyboardInterrupt), written as an internal error"
        results.append(TestResult(_test_id(case), outcome, detail, float(case.get("time") or 0.0), properties))
    return tuple(results)


def _is_interrupt(case: ET.Element, children: dict) -> bool:
    """pytest's own INTERNALERROR entry (``classname="pytest" name="internal"``) for a
    KeyboardInterrupt: pytest-xdist writes a SIGINT that reached its workers so (its text is the
    worker's traceback, inside an AssertionError of the controller)."""
    error = children.get("error")
    return (case.get("classname") == "pytest" and case.get("name") == "internal" and error is not None
            and "KeyboardInterrupt" in (error.text or "") + (error.get("message") or ""))


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ").strip()


def _demo_lines(demo_text: str, rc: int) -> list[str]:
    lines = [line.rstrip() for line in demo_text.replace("\r", "\n").splitlines()]
    lines = [line for line in lines if line.strip() and not line.startswith("demo rc=")]
    key = [line for line in lines if line.startswith(_DEMO_KEYS)]
    if rc != 0:  # the error is at the end
        key += ["..."] + [line for line in lines[-15:] if line not in key]
    return key or lines[-15:]


def _skip_summary(passes: list[PassResult]) -> str:
    reasons = collections.Counter(t.detail or "no reason given" for p in passes for t in p.results()
                                  if t.outcome == SKIPPED)
    return "; ".join(f"{reason}: {count}" for reason, count in reasons.most_common())


def remaining(collected: list[str], tests: tuple[TestResult, ...]) -> list[str]:
    """The collected test ids that ``tests`` holds no result for, in collection order."""
    done = {t.test_id for t in tests}
    return [test_id for test_id in collected if test_id not in done]


def verdict(passes: list[PassResult], demo_rc: int | None, gpus: int | None = None,
            collected: list[str] | None = None) -> tuple[str, bool]:
    """One line, and whether everything passed (``gpus``: how many GPUs JAX saw, if known;
    ``collected``: every test id the passes together must hold: what pass 1 collected, in one call
    or in the first of two)."""
    problems = ["JAX sees no GPU, so no GPU test ran"] if gpus == 0 else []
    problems += [problem for p in passes for problem in p.problems()]
    if any(p.earlier for p in passes) and collected is None:
        problems.append("an earlier call's pass is included, but not the collected tests it must cover")
    if collected is not None:
        missing = remaining(collected, tuple(t for p in passes for t in p.results()))
        if missing:
            where = "ran in no call" if any(p.earlier for p in passes) else "did not run"
            problems.append(f"{len(missing)} of {len(collected)} collected tests {where} ({', '.join(missing[:3])}"
                            f"{', ...' if len(missing) > 3 else ''})")
    if demo_rc is None:
        problems.append("the demo did not run")
    elif demo_rc != 0:
        problems.append(f"the demo exited with rc {demo_rc}{_rc_meaning(demo_rc)}")
    if not passes:
        problems.append("no pytest pass ran")
    if problems:
        failed = [t.test_id for p in passes for t in p.results() if t.outcome in (FAILED, ERROR)]
        named = f" ({', '.join(failed[:10])}{', ...' if len(failed) > 10 else ''})" if failed else ""
        return f"FAILED: {'; '.join(problems)}{named}", False
    passed = sum(p.counts()[PASSED] for p in passes)
    skipped = sum(p.counts()[SKIPPED] for p in passes)
    per_pass = ", ".join(f"{p.label}: {p.counts()[PASSED]}" for p in passes)
    skips = f" ({_skip_summary(passes)})" if skipped else ""
    return f"all {passed} tests passed ({per_pass}), {skipped} skipped{skips}; demo rc 0", True


def _summarize_device(device_text: str) -> tuple[str, str, int | None]:
    """(device line, versions line, GPU count seen by JAX or None) from ``device.txt``.

    ``device.txt`` holds ``key: value`` lines: ``gpu: index, name, driver, memory`` per GPU
    (nvidia-smi), package versions, ``jax_gpu_count: N``.
    """
    fields = collections.defaultdict(list)
    for row in device_text.splitlines():
        key, sep, value = row.partition(":")
        if sep:
            fields[key.strip()].append(value.strip())
    gpus = [[part.strip() for part in row.split(",")] for row in fields["gpu"]]
    named = [g for g in gpus if len(g) >= 3]
    if named:
        kinds = collections.Counter(f"{g[1]}" for g in named)
        device = ", ".join(f"{n} x {kind}" for kind, n in kinds.items()) + f", driver {named[0][2]}"
    else:
        device = fields["gpu"][0] if fields["gpu"] else "unknown"
    versions = ", ".join(f"{name} {fields[name][0]}" for name in
                         ("python", "jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "flax", "optax", "triton")
                         if fields[name])
    count = fields["jax_gpu_count"]
    return device, versions or "unknown", int(count[-1]) if count and count[-1].isdigit() else None


def render(*, commit: str, dirty: str, date: str, command: str, device_text: str, demo_text: str | None,
           demo_rc: int | None, passes: list[PassResult], not_run: list[NotRun] = (),
           seconds: float | None = None, collected: list[str] | None = None) -> tuple[str, bool]:
    """The markdown record and whether everything passed."""
    device_line, versions, gpus = _summarize_device(device_text)
    line, ok = verdict(passes, demo_rc, gpus, collected)
    dirty_note = {"0": "clean", "1": "with uncommitted changes"}.get(dirty, "uncommitted changes unknown")
    device = [row for row in device_text.splitlines() if row.strip()]
    out = [
        f"# GPU check: {'passed' if ok else 'FAILED'}",
        "",
        f"- commit: `{commit}` ({dirty_note})",
        f"- date (UTC): {date}",
        f"- device: {device_line}; GPUs visible to JAX: {'unknown' if gpus is None else gpus}",
        f"- versions: {versions}",
        f"- command: `{command}`",
    ]
    if seconds is not None:
        out.append(f"- wall time: {seconds:.0f} s" + " (this call)" * any(p.earlier for p in passes))
    if collected is not None and any(p.earlier for p in passes):
        first = ", ".join(p.label for p in passes if p.earlier)
        out.append(f"- continues an earlier call ({first}) whose pass was cut off by its time limit: this call "
                   f"ran the tests it did not reach ({len(collected)} collected in all)")
    out += ["", "## Device and versions", "", "```", *device, "```", "", "## moe-jax demo (no flags, one GPU)", ""]
    if demo_rc is None:
        out.append("not run")
    else:
        out += [f"rc {demo_rc}", "", "```", *_demo_lines(demo_text or "", demo_rc), "```"]
    out += _slowest(passes)
    for p in passes:
        counts = p.counts()
        out += ["", f"## pytest: {p.label}", "", f"`{p.command}`", "",
                f"rc {p.rc}{_rc_meaning(p.rc)}, {p.seconds:.0f} s"]
        if p.tests is None:
            out += ["", "No junit XML was written. End of the log:", "", "```", p.log_tail.rstrip(), "```"]
            continue
        out += [f"passed {counts[PASSED]}, failed {counts[FAILED]}, skipped {counts[SKIPPED]}, "
                f"errors {counts[ERROR]} (of {len(p.results())})", ""]
        if p.cut_off:
            interrupt = any(t.outcome == INTERRUPTED for t in p.tests)
            out += [f"Cut off by its time limit: it did not run to the end{'' if p.earlier else ' (a later call can finish it: GPU_CHECK_CONTINUE)'}."
                    + " pytest-xdist wrote the interrupt as an internal error (KeyboardInterrupt): no test, not counted."
                    * interrupt, ""]
        if p.rc != 0 and not (counts[FAILED] or counts[ERROR]) and p.log_tail:
            out += ["End of the log:", "", "```", p.log_tail.rstrip(), "```", ""]
        out += _crash_note(p)
        out += ["| test | outcome | s | detail |", "| --- | --- | --- | --- |"]
        for t in sorted(p.results(), key=lambda t: t.test_id):
            detail = "; ".join([t.detail] * bool(t.detail) + [f"{k}={v}" for k, v in t.properties])
            mark = t.outcome.upper() if t.outcome in (FAILED, ERROR) else t.outcome
            out.append(f"| `{_cell(t.test_id)}` | {mark} | {t.seconds:.1f} | {_cell(detail)} |")
    for n in not_run:
        out += ["", f"## pytest: {n.label}", "", f"not run: {n.reason}"]
    out += ["", "## Verdict", "", line, ""]
    return "\n".join(out), ok


def _slowest(passes: list[PassResult], count: int = _SLOWEST) -> list[str]:
    """The ``count`` longest tests of all passes with their share of the summed test time: a
    test-side cost (a host loop, a slow reference) shows here before it pushes the check into
    a second call."""
    timed = [(t.seconds, p.label, t.test_id) for p in passes for t in p.results() if t.outcome != SKIPPED]
    total = sum(seconds for seconds, _, _ in timed)
    if not timed or total <= 0:
        return []
    out = ["", "## Slowest tests", "",
           f"{len(timed)} tests took {total:.0f} s in all (summed over the workers); the {min(count, len(timed))} longest:",
           "", "| test | pass | s | share |", "| --- | --- | --- | --- |"]
    for seconds, label, test_id in sorted(timed, key=lambda row: -row[0])[:count]:
        out.append(f"| `{_cell(test_id)}` | {_cell(label)} | {seconds:.1f} | {seconds / total:.0%} |")
    return out


def _crash_note(p: PassResult) -> list[str]:
    """Why a crashed xdist worker may be a timeout: pytest-timeout's thread method stops a test
    past its limit by ending the worker's process, which xdist reports as a crash with no
    traceback, exactly as it reports a segfault or an abort."""
    limit = re.search(r"--timeout=(\d+)", p.command)
    crashed = [t.test_id for t in p.results() if "crashed while running" in t.detail]
    if not (crashed and limit and "--timeout-method=thread" in p.command):
        return []
    return [f"{len(crashed)} worker(s) crashed with no traceback. pytest-timeout's thread method ends a worker "
            f"so when its test runs past the per-test limit ({limit.group(1)} s here, GPU_CHECK_TEST_S, or "
            "the test's own timeout marker): run such a test alone to tell a timeout from a crash.", ""]


def _read(path: str, default: str | None = None) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return default


def _tail(text: str | None, lines: int = 40) -> str:
    return "\n".join((text or "(no log)").splitlines()[-lines:])


def load_pass(out_dir: str, spec: str) -> PassResult:
    """``LABEL|RC|SECONDS|XML|LOG|COMMAND`` (XML and LOG relative to ``out_dir``)."""
    label, rc, seconds, xml, log, command = spec.split("|", 5)
    xml_path = os.path.join(out_dir, xml)
    tests = None
    if os.path.exists(xml_path) and os.path.getsize(xml_path):
        try:
            tests = parse_junit(xml_path)
        except ET.ParseError as err:  # pytest killed while writing it
            print(f"gpu_check_record: {xml_path}: unreadable ({err})", file=sys.stderr)
    return PassResult(label=label, rc=int(rc), seconds=float(seconds), command=command, tests=tests,
                      log_tail=_tail(_read(os.path.join(out_dir, log))))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--remaining"]:
        if len(argv) < 3:
            print("usage: gpu_check_record.py --remaining COLLECTED_IDS_FILE JUNIT_XML [JUNIT_XML ...]",
                  file=sys.stderr)
            return 2
        collected = (_read(argv[1]) or "").split("\n")
        done = tuple(t for xml in argv[2:] for t in parse_junit(xml))
        # One id a line and nothing at all when none is left (a blank line would read as one id,
        # "", which pytest takes for its whole rootdir).
        for test_id in remaining([c.strip() for c in collected if c.strip()], done):
            print(test_id)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--dirty", default="unknown", help="1, 0 or unknown")
    parser.add_argument("--command", default="bash tools/gpu_check.sh OUT")
    parser.add_argument("--date", default=None, help="ISO date, UTC (default: now)")
    parser.add_argument("--seconds", type=float, default=None, help="wall time of the whole check")
    parser.add_argument("--demo-rc", type=int, default=None, help="the demo's exit status (omit: not run)")
    parser.add_argument("--pass", dest="passes", action="append", default=[], metavar="LABEL|RC|S|XML|LOG|CMD")
    parser.add_argument("--earlier-pass", dest="earlier", action="append", default=[],
                        metavar="LABEL|RC|S|XML|LOG|CMD", help="a pass of an earlier call that this one continues")
    parser.add_argument("--collected", default=None, help="file (in out_dir) of the test ids the passes must cover")
    parser.add_argument("--not-run", action="append", default=[], metavar="LABEL|REASON")
    parser.add_argument("--output", default="gpu_check.md", help="file name inside out_dir")
    args = parser.parse_args(argv)
    collected = None
    if args.collected is not None:
        text = _read(os.path.join(args.out_dir, args.collected)) or ""
        collected = [line.strip() for line in text.splitlines() if line.strip()]
        if not collected:  # an empty list would excuse every test that did not run
            parser.error(f"--collected {args.collected}: missing or empty in {args.out_dir}")
    date = args.date or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    text, ok = render(
        commit=args.commit, dirty=args.dirty, date=date, command=args.command,
        device_text=_read(os.path.join(args.out_dir, "device.txt"), "(device.txt missing)"),
        demo_text=_read(os.path.join(args.out_dir, "demo.txt"), ""), demo_rc=args.demo_rc,
        passes=[dataclasses.replace(load_pass(args.out_dir, spec), earlier=True) for spec in args.earlier]
        + [load_pass(args.out_dir, spec) for spec in args.passes],
        not_run=[NotRun(*spec.split("|", 1)) for spec in args.not_run], seconds=args.seconds,
        collected=collected,
    )
    with open(os.path.join(args.out_dir, args.output), "w", encoding="utf-8") as f:
        f.write(text)
    print(text.rsplit("## Verdict", 1)[1].strip())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
