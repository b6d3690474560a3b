"""``tools/device_calls.sh`` (the measurements queued for the next device session) names only
scripts that exist and flags they define: a typo would cost a device call."""

from __future__ import annotations

import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "device_calls.sh"


def _commands() -> list[tuple[str, list[str]]]:
    """(benchmark script, its flags) for every ``python benchmarks/NAME.py`` the script runs."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    found = []
    for line in text.splitlines():
        match = re.search(r"python (benchmarks/\w+\.py)(.*)", line)
        if match:
            found.append((match.group(1), re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", match.group(2))))
    return found


def test_every_benchmark_and_flag_exists():
    commands = _commands()
    assert len(commands) >= 8, commands
    for script, flags in commands:
        source = (ROOT / script).read_text()
        for flag in flags:
            assert f'"{flag}"' in source, f"{script} defines no {flag}"


def test_the_script_parses_and_refuses_an_unknown_call(tmp_path):
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    out = subprocess.run(["bash", str(SCRIPT), "nonsense", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ""})
    assert out.returncode == 2 and "unknown call 'nonsense'" in out.stdout, out
    assert not any(tmp_path.iterdir())  # refused before anything ran
