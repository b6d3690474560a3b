"""The layer with the Pallas expert kernels: in the interpreter on CPU, natively on a GPU."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax import MoEConfig, init_params, moe_forward, quantize_params, reference_forward, resolve

SHAPE = dict(num_experts=8, top_k=3, hidden_size=128, expert_intermediate_size=64)


def make(config, rng, tokens):
    params = init_params(dataclasses.replace(config, weight_format="bf16"), jax.random.key(int(rng.integers(1 << 30))))
    params["router"]["bias_e"] = jnp.asarray(rng.standard_normal(config.num_experts) * 0.3, jnp.float32)
    if config.weight_format == "nvfp4":
        params = quantize_params(params)
    return params, jnp.asarray(rng.standard_normal((tokens, config.hidden_size)), jnp.bfloat16)


def check_against_reference(config, devices, rng, tokens=40):
    plan = resolve(config, devices)
    assert plan.expert_gemm == "pallas"
    params, x = make(config, rng, tokens)
    forward = jax.jit(moe_forward, static_argnums=2)
    hlo = forward.lower(params, x, plan).compile().as_text()
    assert set(re.findall(r"moe_jax\.expert_gemm\.[a-z_]+", hlo)) == {"moe_jax.expert_gemm.pallas"}
    y, stats = forward(params, x, plan)
    ref = reference_forward(params, np.asarray(x, np.float64), config)
    y64 = np.asarray(y, np.float64)
    assert np.isfinite(y64).all()
    assert np.linalg.norm(y64 - ref) / np.linalg.norm(ref) < 1e-2
    # A non-finite token changes no other token.
    y_nan, _ = forward(params, x.at[5].set(jnp.nan), plan)
    keep = np.arange(tokens) != 5
    np.testing.assert_array_equal(np.asarray(y_nan)[keep], np.asarray(y)[keep])


@pytest.mark.parametrize("weight_format", ["bf16", "nvfp4"])
def test_pallas_in_the_interpreter_matches_the_reference(rng, cpu_devices, weight_format):
    config = MoEConfig.kimi_k2(**SHAPE, weight_format=weight_format, expert_gemm="pallas", interpret=True)
    check_against_reference(config, cpu_devices[:1], rng)


def test_pallas_on_cpu_without_the_interpreter_raises(cpu_devices):
    config = MoEConfig.kimi_k2(**SHAPE, expert_gemm="pallas")
    with pytest.raises(ValueError, match="expert_gemm = 'pallas' cannot run on .*needs an NVIDIA GPU, found cpu"):
        resolve(config, cpu_devices[:1])


@pytest.mark.gpu
@pytest.mark.parametrize("weight_format", ["bf16", "nvfp4"])
def test_pallas_on_gpu_matches_the_reference(rng, weight_format):
    config = MoEConfig.kimi_k2(**SHAPE, weight_format=weight_format)  # auto must choose pallas
    check_against_reference(config, jax.devices("gpu")[:1], rng, tokens=300)
