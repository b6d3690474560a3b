"""Test set-up: 8 virtual CPU devices (before jax is imported) and the GPU markers."""

import os

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]
).strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402


def _cuda_devices():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


def pytest_collection_modifyitems(config, items):
    gpus = len(_cuda_devices())
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        needed = marker.kwargs.get("count", 1)
        if gpus < needed:
            item.add_marker(pytest.mark.skip(reason=f"needs {needed} CUDA GPU(s), found {gpus}"))


@pytest.fixture
def rng(request):
    """A fresh numpy Generator per test run; its seed is shown with a failure.

    Set MOE_JAX_SEED to replay a failure.
    """
    seed = int(os.environ.get("MOE_JAX_SEED") or np.random.SeedSequence().entropy % (2**32))
    request.node.add_report_section("call", "seed", f"MOE_JAX_SEED={seed}")
    return np.random.default_rng(seed)


@pytest.fixture
def cpu_devices():
    """The 8 virtual CPU devices (also on a GPU machine, where they are not the default)."""
    return jax.devices("cpu")
