"""The example scripts run and do what they say (``examples/train_moe.py``: tests/test_train_moe.py)."""

import importlib.util
import pathlib

import pytest

EXAMPLES = pathlib.Path(__file__).parent.parent / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_inference_example_with_random_weights_on_a_mesh():
    """The reduced Kimi-shaped layer over the 8 CPU devices (EP with the padded exchange)."""
    result = load("infer_kimi_layer").main(["--reduced", "--tokens", "16", "64", "--iters", "1"])
    assert result["error"] < 2e-2
    assert set(result["tokens_per_s"]) == {16, 64} and all(r > 0 for r in result["tokens_per_s"].values())


def test_inference_example_from_a_checkpoint(tmp_path):
    """A layer of a synthetic ModelOpt NVFP4 checkpoint (bf16 shared expert), loaded onto a mesh."""
    import synthetic_checkpoint

    synthetic = synthetic_checkpoint.build(seed=3)
    synthetic_checkpoint.write(tmp_path, synthetic.tensors, synthetic.config)
    result = load("infer_kimi_layer").main(["--checkpoint", str(tmp_path), "--layer", "1", "--tokens", "32",
                                            "--iters", "1", "--devices", "4"])
    assert result["error"] < 2e-2


@pytest.mark.parametrize("argv, message", [
    (["--tokens", "0"], "argument --tokens: 0, expected an int >= 1"),
    (["--devices", "99"], "--devices: 99, but only 8 devices are visible"),
    (["--layer", "3"], "--checkpoint and --layer go together"),
    (["--checkpoint", "/nonexistent", "--layer", "1"], "--checkpoint: /nonexistent is not a directory"),
])
def test_inference_example_rejects_bad_flags(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        load("infer_kimi_layer").main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
