"""The example scripts run and do what they say."""

import importlib.util
import pathlib

EXAMPLES = pathlib.Path(__file__).parent.parent / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_training_example_reduces_the_loss():
    first, last = load("train").main(["--steps", "60", "--tokens", "256"])
    assert last < 0.85 * first, (first, last)
