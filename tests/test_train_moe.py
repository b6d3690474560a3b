"""``examples/train_moe.py``: the loss falls, the plot is written, and a run resumed from a
checkpoint repeats the uninterrupted run bit for bit (on CPU, where XLA is deterministic and
the resumed run's first step runs the same executable on the same bits).

Runs on the 8 virtual CPU devices (expert axis of 8), tiny so that CI's 2 cores take well
under a minute: two compilations of the step and 45 steps in all.
"""

import importlib.util
import pathlib

import numpy as np
import pytest

EXAMPLE = pathlib.Path(__file__).parent.parent / "examples" / "train_moe.py"
TINY = ["--steps", "30", "--batch", "16", "--seq-len", "32", "--lr", "1e-2", "--seed", "0"]


@pytest.fixture(scope="module")
def train_moe():
    spec = importlib.util.spec_from_file_location("train_moe", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_loss_falls_and_a_resumed_run_repeats_the_uninterrupted_one(train_moe, tmp_path, capsys):
    plot, checkpoints = tmp_path / "loss.png", tmp_path / "checkpoints"
    full = train_moe.main(TINY + ["--plot", str(plot), "--checkpoint-dir", str(checkpoints), "--save-every", "15"])
    out = capsys.readouterr().out
    assert out.count("moe-jax plan:") == 1 and "expert axis of 8" in out and "training" in out
    assert len(full) == 30 and all(np.isfinite(full))
    # A first-order chain with 3 successors per token: from log(32) = 3.47 towards its
    # entropy rate (about 0.8); with this seed the last 10 steps average about 0.44x the first 10.
    assert np.mean(full[-10:]) < 0.6 * np.mean(full[:10]), full
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Pre-empted after the checkpoint at step 15: the one at 30 never happened.
    with train_moe.checkpoint_manager(checkpoints) as manager:
        assert manager.all_steps() == [15, 30]
        manager.delete(30)
    resumed = train_moe.main(TINY + ["--checkpoint-dir", str(checkpoints), "--save-every", "15", "--resume"])
    assert "resumed at step 15" in capsys.readouterr().out
    assert resumed == full  # bitwise: the same float32 losses, the first 15 read from the checkpoint

    # A checkpoint resumes only a run of the same model and data.
    with pytest.raises(SystemExit) as exit_info:
        train_moe.main(TINY + ["--checkpoint-dir", str(checkpoints), "--resume", "--vocab", "16"])
    assert exit_info.value.code == 2
    assert f"--resume: the checkpoint in {checkpoints} has --vocab 32, this run 16" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "argument --steps: 0, expected an int >= 1"),
    (["--lr", "-1"], "argument --lr: -1.0, expected a finite float > 0"),
    (["--batch", "12"], "--batch: 12, expected a multiple of the 8 devices"),
    (["--devices", "99"], "--devices: 99, but only 8 devices are visible"),
    (["--heads", "3"], "--heads: 3 does not divide --hidden 64"),
    (["--top-k", "9"], "--top-k: 9, expected at most --experts = 8"),
    (["--seq-len", "1"], "--seq-len: 1, expected more than --order = 1"),
    (["--resume"], "--save-every and --resume need --checkpoint-dir"),
])
def test_bad_flags_are_one_line_errors(train_moe, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        train_moe.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_resume_needs_a_checkpoint(train_moe, tmp_path, capsys):
    with pytest.raises(SystemExit):
        train_moe.main(["--checkpoint-dir", str(tmp_path / "empty"), "--resume"])
    assert f"--resume: no checkpoint in {tmp_path / 'empty'}" in capsys.readouterr().err


@pytest.mark.slow
def test_qat_loss_falls(train_moe, capsys):
    """``--qat``: the experts' bf16 masters train through their NVFP4 quantization."""
    losses = train_moe.main(TINY[:1] + ["20"] + TINY[2:] + ["--qat", "--devices", "2"])
    out = capsys.readouterr().out
    assert "nvfp4 weights" in out and "training" in out, out
    assert np.isfinite(losses).all() and np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5]), losses
