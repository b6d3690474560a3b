"""Resolution: exactly one implementation per stage, explicit choices run or raise, and the
choice is visible in the report and in the compiled HLO."""

import importlib.util
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

import moe_jax
from moe_jax import EXCHANGE, EXPERT_GEMM, MoEConfig, ResolutionError, resolve
from moe_jax.plan import EXCHANGE_STAGE, EXPERT_GEMM_STAGE
from moe_jax.resolve import compute_capability, stages
from pallas_kernels.grouped_matmul import tuning

SMALL = dict(num_experts=8, top_k=2, hidden_size=32, expert_intermediate_size=16)
RTX_PRO_6000 = "NVIDIA RTX PRO 6000 Blackwell Workstation Edition"


def abstract_mesh(kind, ep=1, platform="cuda"):
    device = AbstractDevice(device_kind=kind, num_cores=None, platform=platform)
    return AbstractMesh((ep,), ("expert",), abstract_device=device)


def test_auto_on_cpu_picks_one_implementation_per_stage_and_says_why(cpu_devices):
    plan = resolve(MoEConfig(**SMALL), cpu_devices[:1])
    assert plan.target.platform == "cpu" and plan.target.compute_capability is None
    assert plan.expert_gemm == "xla" and plan.exchange == "none"
    assert "not pallas: needs an NVIDIA GPU, found cpu; MoEConfig.interpret=True" in plan.report
    report = plan.report
    assert f"expert_gemm: {plan.expert_gemm}  (requested 'auto'" in report
    assert "exchange: none  (requested 'auto'; auto: the expert axis has one device" in report
    # Every other registered implementation is listed with its reason.
    for registry in (EXPERT_GEMM, EXCHANGE):
        for name in registry.names():
            if name != plan.chosen(registry.stage):
                assert re.search(rf"not {name}: \S", report), (name, report)


def test_an_explicit_choice_that_cannot_run_raises_with_its_reason(cpu_devices):
    mesh = jax.make_mesh((2,), ("expert",), devices=cpu_devices[:2])
    with pytest.raises(ResolutionError, match="MoEConfig.exchange = 'none' cannot run on .*: the expert axis has 2 devices"):
        resolve(MoEConfig(**SMALL, exchange="none"), mesh)


def test_the_plan_names_each_registered_stage():
    """``Plan.expert_gemm`` / ``Plan.exchange`` read the stages the registries declare."""
    assert tuple(r.stage for r in stages()) == (EXPERT_GEMM_STAGE, EXCHANGE_STAGE) == (EXPERT_GEMM.stage, EXCHANGE.stage)
    plan = resolve(MoEConfig(**SMALL))
    assert (plan.expert_gemm, plan.exchange) == tuple(d.chosen for d in plan.decisions)


def test_an_unregistered_name_raises_before_the_devices_are_looked_at():
    # The message, naming every registered name, for each registry: test_config's
    # test_allowed_values_are_exactly_the_registries. Here: the name is wrong wherever the layer
    # would run, so a mesh that fits nothing (an expert axis of 3) is not what is reported.
    with pytest.raises(ResolutionError, match="MoEConfig.exchange = 'nccl': not a registered implementation"):
        resolve(MoEConfig(**SMALL, exchange="nccl"), abstract_mesh("NVIDIA H200", ep=3))


@pytest.mark.gpu_check  # "here": the GPU on a GPU machine, where the kernels resolve and run natively
def test_every_implementation_that_can_run_here_runs_when_asked_and_is_stamped_in_the_hlo(rng):
    """For each registered expert GEMM that can run on this machine, an explicit choice
    resolves to it and the compiled HLO carries its named scope (and no other's)."""
    ran = []
    for name in EXPERT_GEMM.names():
        cfg = MoEConfig(**SMALL, expert_gemm=name)
        try:
            plan = resolve(cfg)
        except ResolutionError as err:
            assert EXPERT_GEMM[name].cannot_run(moe_jax.resolve(MoEConfig(**SMALL)).target, cfg) in str(err)
            continue
        params = moe_jax.init_params(cfg, jax.random.key(int(rng.integers(1 << 30))))
        x = jnp.asarray(rng.standard_normal((6, 32)), jnp.bfloat16)
        hlo = jax.jit(moe_jax.moe_forward, static_argnums=2).lower(params, x, plan).compile().as_text()
        scopes = set(re.findall(r"moe_jax\.expert_gemm\.[a-z_0-9]+", hlo))
        assert scopes == {f"moe_jax.expert_gemm.{name}"}, scopes
        assert "moe_jax.exchange.none" in hlo
        ran.append(name)
    assert "xla" in ran


def test_resolves_for_an_rtx_pro_6000_without_one():
    plan = resolve(MoEConfig.kimi_k2(weight_format="nvfp4"), abstract_mesh(RTX_PRO_6000, ep=4))
    assert plan.target.platform == "cuda" and plan.target.compute_capability == 120
    assert plan.target.expert_parallel == 4
    # NVFP4 inference on SM120 takes the native FP4 kernels where jax-triton is installed (CI
    # installs it: pyproject's test extra), and says they were cross-compiled and interpreted,
    # never run on that hardware here.
    native = importlib.util.find_spec("jax_triton") is not None
    assert plan.expert_gemm == ("triton" if native else "pallas") and plan.exchange != "none"
    assert "SM120" in plan.report
    if native:
        assert "cross-compiled and executed in Triton's interpreter, not run on SM120 hardware" in plan.report


@pytest.mark.parametrize(
    "kind, reported, cc",
    [(RTX_PRO_6000, None, 120), ("NVIDIA H200", None, 90), ("NVIDIA B200", None, 100),
     ("NVIDIA A100-SXM4-80GB", None, 80), ("NVIDIA L40S", None, 89), ("anything", "12.0", 120),
     ("NVIDIA H100 80GB HBM3", "9.0", 90), ("Unknown accelerator", None, None)],
)
def test_compute_capability(kind, reported, cc):
    assert compute_capability(kind, reported) == cc


def test_mesh_errors_name_what_is_wrong(cpu_devices):
    no_expert_axis = jax.make_mesh((2,), ("data",), devices=cpu_devices[:2])
    with pytest.raises(ResolutionError, match=r"no expert axis 'expert'"):
        resolve(MoEConfig(**SMALL), no_expert_axis)
    three = jax.make_mesh((3,), ("expert",), devices=cpu_devices[:3])
    with pytest.raises(ResolutionError, match=r"3 devices, which does not divide num_experts = 8"):
        resolve(MoEConfig(**SMALL), three)
    with pytest.raises(ResolutionError, match=r"2 devices without a mesh"):
        resolve(MoEConfig(**SMALL), cpu_devices[:2])


def test_plan_is_hashable_and_static():
    plan = resolve(MoEConfig(**SMALL))
    assert hash(plan) == hash(resolve(MoEConfig(**SMALL)))
    assert str(plan) == plan.report


def test_an_explicit_choice_keeps_the_reasons_of_the_others(cpu_devices):
    plan = resolve(MoEConfig(**SMALL, expert_gemm="xla"), cpu_devices[:1])
    assert plan.expert_gemm == "xla"
    assert "not pallas: not requested; cannot run here: needs an NVIDIA GPU, found cpu" in plan.report


def test_the_chosen_line_says_why_the_preferred_implementation_is_not_what_runs(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "jax_triton" else find_spec(name, *a))
    config = MoEConfig(**{**SMALL, "hidden_size": 64, "expert_intermediate_size": 64}, weight_format="nvfp4")
    plan = resolve(config, abstract_mesh(RTX_PRO_6000))
    assert plan.expert_gemm == "pallas"
    line = next(line for line in plan.report.splitlines() if line.strip().startswith("expert_gemm: pallas"))
    assert "auto: 'triton' cannot run (jax-triton is not installed" in line, line
    assert "next in the order (NVFP4 inference: SM120" in line, line


@pytest.mark.parametrize("kind, expert_gemm, expected", [
    (RTX_PRO_6000, "triton", "NVFP4 per row, global scale from the checkpoint's static input_scale of each expert "
                             "where the params carry them (gate/up: the larger), else dynamic per row "
                             "(activation_scale='auto'; W4A4 on the FP4 tensor cores of SM120)"),
    ("NVIDIA B200", "triton", "(activation_scale='auto'; W4A4 on the FP4 tensor cores of SM100)"),
    ("NVIDIA H200", "triton", "bfloat16, not quantized (W4A16: triton dequantizes the weights on SM90; exact bf16 "
                              "copies of the weights made each call: the forward from 2048 rows per expert (197 kB)); "
                              "activation_scale='auto' has no effect"),
    (RTX_PRO_6000, "pallas", "bfloat16, not quantized (W4A16: the pallas kernels dequantize the weights)"),
])
def test_the_report_says_where_activations_are_quantized_and_against_which_scale(kind, expert_gemm, expected):
    if expert_gemm == "triton" and importlib.util.find_spec("jax_triton") is None:
        pytest.skip("the triton implementation needs jax-triton installed to resolve")
    config = MoEConfig(**{**SMALL, "hidden_size": 64, "expert_intermediate_size": 64}, weight_format="nvfp4",
                       expert_gemm=expert_gemm)
    line = resolve(config, abstract_mesh(kind)).report.splitlines()[-1]
    assert line.startswith("  activations: ") and expected in line, line
    bf16 = resolve(MoEConfig(**SMALL, activation_scale="checkpoint")).report.splitlines()[-1]
    assert bf16 == "  activations: bfloat16, not quantized (bf16 weights); activation_scale='checkpoint' has no effect"


KIMI_PROJECTIONS = dict(hidden_size=7168, expert_intermediate_size=2048)


@pytest.mark.parametrize("kind, expert_gemm, experts, ep, training, expected", [
    # 8 experts of Kimi K2's projections, Mixtral-style: 6 * 8 * 7168 * 2048 bytes both copies, 4/6 and 2/6 of it
    # the input gradient's (one projection at a time)
    ("NVIDIA H200", "triton", 8, 1, False, "on SM90; exact bf16 copies of the weights made each call: the forward from "
                                           "2048 rows per expert (705 MB))"),
    ("NVIDIA H200", "triton", 8, 1, True, "the forward from 2048 rows per expert (705 MB), the input gradient from 256 "
                                          "rows per expert (470 MB + 235 MB))"),
    # the Pallas kernels make no copies for the forward
    ("NVIDIA A100-SXM4-80GB", "pallas", 8, 1, True, "the pallas kernels dequantize the weights; exact bf16 copies of the "
                                                    "weights made each call: the input gradient from 256 rows per expert "
                                                    "(470 MB + 235 MB))"),
    ("NVIDIA A100-SXM4-80GB", "pallas", 8, 1, False, "the pallas kernels dequantize the weights); "),
    # all of Kimi K2's 384 experts on one GPU: every copy past the 6 GiB budget
    ("NVIDIA H200", "triton", 384, 1, True, "on SM90; bf16 copies would exceed the 6 GiB budget: the forward's 33.82 GB, "
                                            "the input gradient's 22.55 GB + 11.27 GB)"),
    # 128 experts: down's copy (3.76 GB) within the budget, gate/up's (7.52 GB) and both together (11.27 GB) past it
    ("NVIDIA H200", "triton", 128, 1, True, "exact bf16 copies of the weights made each call: down's input gradient from "
                                            "256 rows per expert (3.76 GB); bf16 copies would exceed the 6 GiB budget: "
                                            "the forward's 11.27 GB, gate/up's input gradient's 7.52 GB)"),
    # Kimi K2 over an expert axis of 8: 48 experts a device
    ("NVIDIA H200", "triton", 384, 8, False, "the forward from 2048 rows per expert (4.23 GB))"),
])
def test_the_report_says_where_nvfp4_weights_are_copied_to_bf16(kind, expert_gemm, experts, ep, training, expected):
    if expert_gemm == "triton" and importlib.util.find_spec("jax_triton") is None:
        pytest.skip("the triton implementation needs jax-triton installed to resolve")
    config = MoEConfig(num_experts=experts, top_k=8, **KIMI_PROJECTIONS, weight_format="nvfp4", expert_gemm=expert_gemm)
    plan = resolve(config, abstract_mesh(kind, ep), training=training)
    line = plan.report.splitlines()[-1]
    assert line.startswith("  activations: ") and expected in line, line
    # What the line says is what the kernels' dispatch rules decide at the sizes it names.
    local, h, f = experts // ep, KIMI_PROJECTIONS["hidden_size"], KIMI_PROJECTIONS["expert_intermediate_size"]
    forward = expert_gemm == "triton" and tuning.dequantize_for_forward(
        num_rows=2048 * local, num_experts=local, hidden=h, intermediate=f, compute_capability=plan.target.compute_capability)
    assert ("the forward from 2048 rows per expert" in line) == forward, line
    grads = {name: training and tuning.dequantize_for_input_grad(num_rows=256 * local, num_experts=local, n=n, k=k)
             for name, n, k in (("gate/up", 2 * f, h), ("down", h, f))}
    says = "the input gradient from 256" in line, "down's input gradient from 256" in line
    assert says == (all(grads.values()), grads["down"] and not grads["gate/up"]), line


@pytest.mark.parametrize("kind, expert_gemm, config_args, expected", [
    ("NVIDIA H200", "triton", {}, "NVFP4 weights through the triton kernels as one group, read as stored, at every "
                                  "size; exact bf16 copies of the weights made each call: the forward from 2048 tokens "
                                  "per device (25 kB)"),
    ("NVIDIA H200", "triton", {"prefill_activations": "fp8"}, "NVFP4 weights through the triton kernels as one group, "
                                                              "read as stored (W4A8 at prefill sizes, as the routed "
                                                              "experts), at every size (never dequantized)"),
    (RTX_PRO_6000, "pallas", {}, "NVFP4 weights through the pallas kernels as one group, read as stored, up to 1024 "
                                 "tokens per device; above, NVFP4 weights dequantized every call, then an XLA dot"),
    (RTX_PRO_6000, "triton", {}, "NVFP4 weights dequantized every call, then an XLA dot in bfloat16 (triton quantizes "
                                 "activations to NVFP4 on SM120; the shared expert's stay bfloat16)"),
    ("NVIDIA H200", "xla", {}, "(the xla reference path)"),
    ("NVIDIA H200", "pallas", {"qat": True}, "(under qat the pallas kernels take the routed experts' float masters)"),
    ("NVIDIA H200", "pallas", {"shared_weight_format": "bf16"}, "bf16 weights, XLA dot"),
])
def test_the_report_says_how_the_shared_expert_runs(kind, expert_gemm, config_args, expected):
    if expert_gemm == "triton" and importlib.util.find_spec("jax_triton") is None:
        pytest.skip("the triton implementation needs jax-triton installed to resolve")
    config = MoEConfig(**{**SMALL, "hidden_size": 64, "expert_intermediate_size": 64}, weight_format="nvfp4",
                       num_shared_experts=1, expert_gemm=expert_gemm, **config_args)
    plan = resolve(config, abstract_mesh(kind), training=config.qat)
    line = plan.report.splitlines()[-1]
    assert line.startswith("  shared expert: ") and expected in line, line
    limits = {"through the triton": None, "through the pallas": 1024}
    assert plan.shared_kernel_max_tokens == next((v for k, v in limits.items() if k in expected), 0)
    assert "shared expert" not in resolve(MoEConfig(**SMALL)).report
