"""The non-finite-token gradient check of ``test_nonfinite_gradients.py`` on a GPU, with the
Pallas kernels and their VJP (a file of its own, so that the GPU check runs only these)."""

import jax
import pytest
from test_nonfinite_gradients import check


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4", "qat"])
def test_pallas_on_gpu(rng, fmt):
    check(fmt, rng, jax.devices("gpu"), expert_gemm="pallas")
