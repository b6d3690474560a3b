"""The console script: `moe-jax explain` and `moe-jax demo`."""

import subprocess
import sys

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


def test_explain_reports_an_invalid_choice(capsys):
    assert cli.main(["explain", "--expert-gemm", "cutlass"]) == 1
    assert "MoEConfig.expert_gemm = 'cutlass'" in capsys.readouterr().err


def test_demo_runs_and_checks_itself():
    # As a user runs it: the installed console script's module, in a fresh process.
    out = subprocess.run(
        [sys.executable, "-m", "moe_jax.cli", "demo", "--tokens", "64", "--iters", "2"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "relative error vs float64 reference of the same NVFP4 weights" in out.stdout
    assert "tokens/s" in out.stdout
