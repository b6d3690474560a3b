"""The serving soak of ``test_serving.py`` on one GPU, with the implementations ``auto`` picks
there (a file of its own, so that the GPU check runs it): 1,000 bucketed calls of the NNX module
at a layer of Kimi K2's routing (sigmoid, correction bias, one shared expert), 64 experts, up to
8192 tokens padded to the buckets of ``test_serving.GPU_BUCKETS`` (16, 64, 256, 512, 2048 and 8192
tokens)."""

import jax
import pytest
from test_serving import GPU_BUCKETS, soak

from moe_jax import MoEConfig


# When it padded device arrays (a pad compiled per length) the NVFP4 soak took 203 s alone on an
# H200 and 291 s beside three other pytest workers: past the GPU check's default per-test limit
# (240 s), whose thread method ends the worker as if it crashed. The limit keeps that margin.
@pytest.mark.gpu
@pytest.mark.timeout(540)
@pytest.mark.parametrize("weight_format", ["bf16", "nvfp4"])
def test_soak_on_gpu(rng, weight_format, record_property):
    config = MoEConfig(num_experts=64, top_k=8, hidden_size=1024, expert_intermediate_size=512, num_shared_experts=1,
                       scoring="sigmoid", router_bias=True, weight_format=weight_format)
    device = jax.devices("gpu")[0]
    figures = soak(config, device, rng, buckets=GPU_BUCKETS)
    figures["device bytes in use at the end"] = (device.memory_stats() or {}).get("bytes_in_use")
    for name, value in figures.items():
        record_property(name, value)
