"""Differentiating through a plan resolved for inference with the Pallas kernels raises an
error that says how to get a differentiable plan, never an assertion from inside Pallas."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from moe_jax import MoE, MoEConfig, init_params, moe_forward, resolve

CONFIG = MoEConfig(num_experts=4, top_k=2, hidden_size=64, expert_intermediate_size=64, expert_gemm="pallas",
                   interpret=True)
NO_GRADIENT = r"^expert_gemm 'pallas' has no gradient yet: this plan was resolved for inference; resolve with training=True"


def loss(params, x, plan):
    y, stats = moe_forward(params, x, plan)
    return jnp.sum(y.astype(jnp.float32) ** 2) + stats["load_balance_loss"]


@pytest.mark.parametrize("argnums", [0, 1])
def test_grad_through_moe_forward_names_the_stage_and_the_fix(cpu_devices, argnums):
    plan = resolve(CONFIG, cpu_devices[:1])
    assert plan.expert_gemm == "pallas"
    params = init_params(CONFIG, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (8, CONFIG.hidden_size), jnp.bfloat16)
    with pytest.raises(ValueError, match=NO_GRADIENT) as err:
        jax.jit(jax.grad(loss, argnums=argnums), static_argnums=2)(params, x, plan)
    assert "MoE(..., training=True)" in str(err.value) and "\n" not in str(err.value)


def test_nnx_grad_through_the_module_names_the_stage_and_the_fix(cpu_devices):
    with jax.default_device(cpu_devices[0]):
        layer = MoE(CONFIG, rngs=nnx.Rngs(0))
        x = jax.random.normal(jax.random.key(1), (8, CONFIG.hidden_size), jnp.bfloat16)
    assert layer.plan.expert_gemm == "pallas"

    def module_loss(layer, x):
        y, _ = layer(x)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    with pytest.raises(ValueError, match=NO_GRADIENT):
        nnx.grad(module_loss)(layer, x)


def test_training_resolves_to_a_differentiable_implementation(cpu_devices):
    plan = resolve(dataclasses.replace(CONFIG, expert_gemm="auto"), cpu_devices[:1], training=True)
    assert plan.expert_gemm == "xla"
    assert "not pallas: the kernels have no VJP yet" in plan.report
