"""MoEConfig: validation, presets, hashability, and implementation names checked against the
registries when the config is resolved."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

from moe_jax import EXCHANGE, EXPERT_GEMM, MoEConfig, ResolutionError, resolve

SMALL = dict(num_experts=8, top_k=2, hidden_size=32, expert_intermediate_size=16)


# mistralai/Mixtral-8x7B-v0.1 config.json, the MoE keys (Kimi K2's and DeepSeek-V3's presets are
# checked against their config.json in tests/test_checkpoint.py, through MoEConfig.from_hf_config).
MIXTRAL_CONFIG = {"num_local_experts": 8, "num_experts_per_tok": 2, "hidden_size": 4096, "intermediate_size": 14336}


def test_the_mixtral_preset_carries_its_config_json():
    mx = MoEConfig.mixtral_8x7b()
    assert (mx.num_experts, mx.top_k, mx.hidden_size, mx.expert_intermediate_size) == tuple(
        MIXTRAL_CONFIG[key] for key in ("num_local_experts", "num_experts_per_tok", "hidden_size", "intermediate_size"))
    # Mixtral's router: softmax over all experts, renormalized over the chosen two; no shared expert.
    assert (mx.scoring, mx.normalize, mx.num_shared_experts, mx.router_bias) == ("softmax", True, 0, False)


def test_every_listed_preset_builds_a_config():
    for name in MoEConfig.PRESETS:
        assert isinstance(getattr(MoEConfig, name)(), MoEConfig), name


def test_frozen_keyword_only_and_hashable_as_a_static_jit_argument():
    cfg = MoEConfig(**SMALL)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.top_k = 3
    with pytest.raises(TypeError):
        MoEConfig(8, 2, 32, 16)
    assert hash(cfg) == hash(MoEConfig(**SMALL))
    f = jax.jit(lambda x, c: x * c.top_k, static_argnums=1)
    assert float(f(jnp.float32(2), cfg)) == 4.0


@pytest.mark.parametrize(
    "overrides, field, rule",
    [
        (dict(num_experts=0), "num_experts", "int >= 1"),
        (dict(top_k=9), "top_k", "<= num_experts = 8"),
        (dict(hidden_size=32.0), "hidden_size", "int >= 1"),
        (dict(num_shared_experts=-1), "num_shared_experts", "int >= 0"),
        (dict(shared_intermediate_size=64), "shared_intermediate_size", "needs num_shared_experts >= 1"),
        (dict(scoring="relu"), "scoring", "one of 'softmax', 'sigmoid'"),
        (dict(num_groups=3), "num_groups", "must divide num_experts = 8"),
        (dict(num_groups=8), "num_groups", ">= 2 experts per group"),
        (dict(num_groups=4, topk_groups=5), "topk_groups", "<= num_groups = 4"),
        (dict(num_groups=4, topk_groups=1, top_k=3), "top_k", "<= topk_groups \\* experts per group = 2"),
        (dict(normalize=1), "normalize", "must be a bool"),
        (dict(routed_scaling_factor=float("nan")), "routed_scaling_factor", "finite number > 0"),
        (dict(routed_scaling_factor=0.0), "routed_scaling_factor", "finite number > 0"),
        (dict(weight_format="int4"), "weight_format", "one of 'bf16', 'nvfp4'"),
        (dict(weight_format="nvfp4", hidden_size=40), "hidden_size", "multiple of 16 for NVFP4"),
        (dict(dtype="float16"), "dtype", "one of 'bfloat16', 'float32'"),
        (dict(activation_scale="static"), "activation_scale", "one of 'auto', 'checkpoint', 'dynamic'"),
        (dict(reference_activations="fp8"), "reference_activations", "one of 'bf16', 'nvfp4'"),
        (dict(reference_activations="nvfp4"), "reference_activations", "needs weight_format='nvfp4' \\(found 'bf16'\\)"),
        (dict(expert_gemm=""), "expert_gemm", "must be a non-empty string: 'auto' or a registered name"),
        (dict(exchange=None), "exchange", "must be a non-empty string: 'auto' or a registered name"),
        (dict(expert_axis=""), "expert_axis", "non-empty mesh axis name"),
        (dict(capacity_factor=-1.0), "capacity_factor", "None \\(dropless\\) or a finite number > 0"),
    ],
)
def test_invalid_values_name_the_field_the_value_and_the_rule(overrides, field, rule):
    with pytest.raises(ValueError, match=rf"MoEConfig\.{field} = .*: .*{rule}"):
        MoEConfig(**{**SMALL, **overrides})


def test_replace_revalidates():
    cfg = MoEConfig(**SMALL)
    with pytest.raises(ValueError, match="MoEConfig.top_k"):
        dataclasses.replace(cfg, top_k=100)
    assert dataclasses.replace(cfg, top_k=3).top_k == 3


def test_allowed_values_are_exactly_the_registries(cpu_devices):
    """Schema and dispatch read one table: ``resolve`` accepts every registered name (it runs,
    or says why it cannot run here) and rejects every other, listing the registered ones."""
    for registry, field in ((EXPERT_GEMM, "expert_gemm"), (EXCHANGE, "exchange")):
        for name in registry.names():
            config = MoEConfig(**SMALL, **{field: name})
            assert callable(registry[name].run) and callable(registry[name].cannot_run)
            try:
                assert resolve(config, cpu_devices[:1]).chosen(field) == name
            except ResolutionError as err:
                assert f"MoEConfig.{field} = {name!r} cannot run on" in str(err)
        registered = ", ".join(map(repr, ("auto", *registry.names())))
        for unregistered in ("AUTO", "Xla", "fallback"):
            config = MoEConfig(**SMALL, **{field: unregistered})  # a name: the registries judge it
            message = f"MoEConfig.{field} = {unregistered!r}: not a registered implementation; registered: {registered}"
            with pytest.raises(ResolutionError, match=f"^{re.escape(message)}$"):
                resolve(config, cpu_devices[:1])
        with pytest.raises(KeyError, match="no implementation"):
            registry["not-registered"]
