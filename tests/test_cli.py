"""The console script: `moe-jax explain`, `moe-jax demo` and `moe-jax selftest`'s output."""

import os
import subprocess
import sys

import pytest
from harness import PROBE_CONFIG, exchanges_that_run, mesh_for, xla_flags_without

from moe_jax import cli


def test_explain_prints_the_report(capsys):
    assert cli.main(["explain", "--preset", "kimi_k2"]) == 0
    out = capsys.readouterr().out
    assert "moe-jax plan: 384 experts, top-8, hidden 7168" in out
    assert "expert_gemm:" in out and "exchange: none" in out


def test_explain_for_an_abstract_rtx_pro_6000(capsys):
    code = cli.main(["explain", "--preset", "deepseek_v3", "--weight-format", "nvfp4",
                     "--device-kind", "NVIDIA RTX PRO 6000 Blackwell Workstation Edition"])
    assert code == 0
    assert "SM120" in capsys.readouterr().out


def test_explain_prints_bytes_buffers_and_link_time_for_the_seed_configuration(capsys):
    """The seed user's 8 RTX PRO 6000 over PCIe (~55 GB/s): per exchange, bytes per token per
    layer, buffers and time (moe_jax.traffic; tests/test_exchange_traffic.py checks the numbers)."""
    assert cli.main(["explain", "--preset", "kimi_k2", "--weight-format", "nvfp4", "--ep", "8", "--device-kind",
                     "NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "--link-gbps", "55"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("  exchange: onecopy  (requested 'auto'; auto: fewest bytes per token per layer")
               for line in lines)
    assert "  ragged     dispatch  100.4 KB  combine  100.4 KB  buffers 7.52 GB  at 55 GB/s: 7.47 + 7.47 ms" in lines
    assert " *onecopy    dispatch   66.5 KB  combine  132.5 KB  buffers 8.93 GB  at 55 GB/s: 4.95 + 9.87 ms" in lines
    assert sum(line.startswith(("  ", " *")) and " dispatch " in line for line in lines) == 4  # all but none


def test_explain_reports_an_invalid_choice(capsys):
    assert cli.main(["explain", "--expert-gemm", "cutlass"]) == 1
    assert "MoEConfig.expert_gemm = 'cutlass'" in capsys.readouterr().err


def test_demo_runs_and_checks_itself():
    # As a user runs it: the installed console script's module, in a fresh process, with XLA's
    # own code generation (the suite's cheapest one slows the demo's quantizer and calls by more
    # than it saves compiling: 17 against 12 s of CPU).
    flags = xla_flags_without("--xla_backend_optimization_level")
    out = subprocess.run(
        [sys.executable, "-m", "moe_jax.cli", "demo", "--tokens", "64", "--iters", "2"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "XLA_FLAGS": " ".join(flags)},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "relative error vs float64 reference of the same NVFP4 weights" in out.stdout
    assert "tokens/s" in out.stdout
    # No terminal, so no progress bars: what a log or a pipe gets is the results alone.
    assert "it/s" not in out.stderr and "%|" not in out.stderr and "\r" not in out.stdout


def test_demo_without_flags_runs_with_its_defaults(monkeypatch):
    seen = []
    monkeypatch.setattr(cli, "demo", lambda args: seen.append(args) or 0)
    assert cli.main(["demo"]) == 0
    assert (seen[0].tokens, seen[0].iters, seen[0].max_error) == (512, 5, 2e-2)


@pytest.mark.parametrize("argv,message", [
    (["demo", "--tokens", "0"], "argument --tokens: 0, expected an int >= 1"),
    (["demo", "--tokens", "-8"], "argument --tokens: -8, expected an int >= 1"),
    (["demo", "--tokens", "many"], "argument --tokens: 'many', expected an int >= 1"),
    (["demo", "--iters", "0"], "argument --iters: 0, expected an int >= 1"),
    (["demo", "--max-error", "-1"], "argument --max-error: -1.0, expected a finite float > 0"),
    (["explain", "--ep", "0"], "argument --ep: 0, expected an int >= 1"),
    (["explain", "--ep", "-4"], "argument --ep: -4, expected an int >= 1"),
    (["explain", "--tokens-per-device", "-5"], "argument --tokens-per-device: -5, expected an int >= 1"),
    # The experts first: no number of devices would make 7 work for 384 experts.
    (["explain", "--ep", "7"],
     "argument --ep: 7 does not divide the 384 experts of preset 'kimi_k2'; expected one of [1, 2, 3"),
    (["explain", "--ep", "7", "--device-kind", "NVIDIA H200"], "argument --ep: 7 does not divide the 384 experts"),
    (["explain", "--preset", "deepseek_v3", "--ep", "5"],
     "argument --ep: 5 does not divide the 256 experts of preset 'deepseek_v3'"),
    # conftest gives this process 8 CPU devices.
    (["explain", "--ep", "16"],
     "argument --ep: 16, but this machine has 8 cpu device(s); expected at most 8, or --device-kind"),
    (["selftest", "--full", "--quick"], "argument --quick/--no-full: not allowed with argument --full"),
])
def test_bad_flags_are_one_line_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"moe-jax {argv[0]}: error: {message}"), lines[0]


def test_ep_that_divides_and_fits_resolves(capsys):
    assert cli.main(["explain", "--ep", "8"]) == 0
    assert "8 x cpu" in capsys.readouterr().out


def test_selftest_prints_the_header_then_the_table(monkeypatch, capsys, cpu_devices):
    import jax  # noqa: PLC0415
    import moe_jax.selftest as selftest  # noqa: PLC0415

    monkeypatch.setattr(selftest, "FORMATS", ("bf16",))  # the nvfp4 cases: tests/test_selftest.py
    assert cli.main(["selftest", "--quick", "--seed", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # The header: device, seed, versions, and what auto resolves here (a mesh of the 8 CPU devices).
    assert lines[0] == "moe-jax selftest on 8 x cpu (cpu), seed 3"
    assert lines[1].startswith(f"versions: python {sys.version.split()[0]}, jax {jax.__version__}, jaxlib ")
    assert lines[3] == "moe-jax plan: 384 experts, top-8, hidden 7168, expert intermediate 2048, nvfp4 weights"
    assert any(line.startswith("  exchange: padded  (requested 'auto'; auto: fewest bytes per token per layer")
               for line in lines)
    table = lines.index("| check | implementation | mode | exchange | devices | capability | shape | weights | compared "
                        "| rel. error | tolerance | result | time (ms) |")
    # The layer with every exchange XLA:CPU runs: without a mesh on one device, else on all 8.
    layers = [[e, "1"] for e in exchanges_that_run(cpu_devices[:1], PROBE_CONFIG)] + [
        [e, "8"] for e in exchanges_that_run(mesh_for(8, cpu_devices, 1), PROBE_CONFIG)]
    end = table + 3 + len(layers)
    rows = [line.split(" | ")[:9] for line in lines[table + 2:end]]
    assert [row[:8] for row in rows] == [["| experts", "xla", "tiled einsum", "-", "1", "cpu", "small", "bf16"]] + [
        ["| layer", "xla", "tiled einsum", *exchange_devices, "cpu", "small", "bf16"] for exchange_devices in layers]
    assert all("| PASS |" in line for line in lines[table + 2:end])
    assert lines[end:end + 3] == ["", "Not run here:", "- full-size (kimi_k2) cases: skipped (--quick)"]
    assert ["ragged", "8"] in layers and ["onecopy", "8"] in layers  # on the twin of ragged_all_to_all
    assert lines[-1] == f"all {len(layers) + 1} checks passed"
