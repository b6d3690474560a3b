"""``MoEConfig.prefill_activations="fp8"`` (W4A8, opt-in): what it needs, who can run it, what the
report says. Pure functions of a target and a config: no GPU needed."""

from __future__ import annotations

import importlib.util

import pytest

from moe_jax import EXPERT_GEMM, MoEConfig
from moe_jax.expert_gemm import activations_report, shared_expert_plan
from moe_jax.registry import Target

KIMI = MoEConfig.kimi_k2(weight_format="nvfp4")


def _gpu(cc: int, *, training: bool = False) -> Target:
    return Target(platform="cuda", device_kind=f"SM{cc} GPU", compute_capability=cc, training=training)


@pytest.mark.parametrize(("change", "message"), [
    (dict(weight_format="bf16"), r"MoEConfig.prefill_activations = 'fp8': needs weight_format='nvfp4' without qat "
                                 r"\(found 'bf16', qat=False\)"),
    (dict(qat=True), r"MoEConfig.prefill_activations = 'fp8': needs weight_format='nvfp4' without qat "
                     r"\(found 'nvfp4', qat=True\)"),
])
def test_fp8_needs_nvfp4_weights_as_stored(change, message):
    with pytest.raises(ValueError, match=message):
        MoEConfig.kimi_k2(**({"weight_format": "nvfp4", "prefill_activations": "fp8"} | change))


def test_an_unknown_value_is_named():
    with pytest.raises(ValueError, match=r"MoEConfig.prefill_activations = 'int8': must be one of 'bf16', 'fp8'"):
        MoEConfig.kimi_k2(weight_format="nvfp4", prefill_activations="int8")


def test_only_triton_on_sm90_for_inference_runs_it():
    config = MoEConfig.kimi_k2(weight_format="nvfp4", prefill_activations="fp8")
    for name in ("pallas", "xla"):
        assert EXPERT_GEMM[name].cannot_run(_gpu(90), config) == (
            "prefill_activations='fp8' (W4A8) runs on the 'triton' kernels only (SM90)")
    if importlib.util.find_spec("triton") and importlib.util.find_spec("jax_triton"):
        assert EXPERT_GEMM["triton"].cannot_run(_gpu(90), config) is None
    for cc in (80, 89, 100, 120):
        reason = EXPERT_GEMM["triton"].cannot_run(_gpu(cc), config)
        assert reason and "SM90's FP8 wgmma" in reason or "not installed" in reason, reason
    reason = EXPERT_GEMM["triton"].cannot_run(_gpu(90, training=True), config)
    assert reason and ("for inference" in reason or "not installed" in reason), reason
    # The default is untouched by it.
    assert EXPERT_GEMM["pallas"].cannot_run(_gpu(90), KIMI) is None


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the report names triton's modes")
def test_the_report_says_w4a8_at_prefill_and_w4a16_at_decode():
    config = MoEConfig.kimi_k2(weight_format="nvfp4", prefill_activations="fp8")
    line = activations_report(config, _gpu(90), "triton")
    assert "at decode sizes (W4A16" in line and "W4A8, prefill_activations='fp8'" in line, line
    assert "W4A8" not in activations_report(KIMI, _gpu(90), "triton")
    _, shared = shared_expert_plan(config, _gpu(90), "triton")
    assert "W4A8 at prefill sizes" in shared, shared
