"""The layer with the Triton-language NVFP4 kernels (``expert_gemm="triton"``): how resolution
treats them everywhere (CPU), and the layer on GPUs against the float64 reference.

The GPU tests run the mode of the GPU they find: W4A16 below SM100 (the H200 here), W4A4 on
SM100/SM120, whose activation quantization (NVFP4, one scale per row) adds its own error: the
tolerance is then the one measured for W4A4's numerics on CPU (``W4A4_TOLERANCE``).
"""

import importlib.util

import jax
import pytest
from harness import EP_EXCHANGES, W4A4_TOLERANCE, check_against_reference, names
from test_layer_pallas import SHAPE

import sharding
from moe_jax import MoEConfig, ResolutionError, resolve

GPU_TOLERANCE = {"w4a16": 1e-2, "w4a4": W4A4_TOLERANCE}


def _needs_native_installed():
    """Resolution offers the native kernels only where triton and jax-triton are installed (CI
    installs both; jax_triton itself imports only with a GPU jaxlib, and is not imported here)."""
    for package in ("triton", "jax_triton"):
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"{package} is not installed")


def _abstract_mesh(device_kind: str):
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform="cuda")
    return jax.sharding.AbstractMesh((1, 1), ("data", "expert"), abstract_device=device)


def test_triton_cannot_run_on_cpu_and_says_why(cpu_devices):
    config = MoEConfig.kimi_k2(**SHAPE, weight_format="nvfp4", expert_gemm="triton")
    with pytest.raises(ResolutionError, match="expert_gemm = 'triton' cannot run on .*needs an NVIDIA GPU, found cpu"):
        resolve(config, cpu_devices[:1])
    with pytest.raises(ResolutionError, match="no interpreter mode"):
        resolve(MoEConfig.kimi_k2(**SHAPE, weight_format="nvfp4", expert_gemm="triton", interpret=True),
                cpu_devices[:1])


@pytest.mark.parametrize("device_kind,chosen,why", [
    ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "triton", "executed in Triton's interpreter, not run on SM"),
    ("NVIDIA B200", "triton", "executed in Triton's interpreter, not run on SM"),
    ("NVIDIA H200", "triton", "at decode sizes (32 and 256 tokens) and at prefill sizes (2048 and 8192 tokens) "
                              "(benchmarks/results/layer_h200/layer.json)"),
    ("NVIDIA A100-SXM4-80GB", "pallas", "SM80 and SM89 were never measured"),
    ("NVIDIA L40S", "pallas", "SM89 was never measured; as on SM80"),
])
def test_auto_picks_per_architecture_and_cites_why(device_kind, chosen, why):
    _needs_native_installed()
    plan = resolve(MoEConfig.kimi_k2(**SHAPE, weight_format="nvfp4"), _abstract_mesh(device_kind))
    assert plan.expert_gemm == chosen
    assert why in plan.report


def test_triton_trains_on_w4a16_only_and_takes_nvfp4_only():
    _needs_native_installed()
    mesh = _abstract_mesh("NVIDIA RTX PRO 6000 Blackwell Workstation Edition")
    training = resolve(MoEConfig.kimi_k2(**SHAPE, weight_format="nvfp4"), mesh, training=True)
    assert training.expert_gemm == "pallas"
    assert "SM120: the native W4A4 kernels have no backward kernels" in training.report
    with pytest.raises(ResolutionError, match=r"training on SM120: the native backward kernels are W4A16 \(SM80, SM89, "
                                              r"SM90\); 'pallas' is differentiable here"):
        resolve(MoEConfig.kimi_k2(**SHAPE, weight_format="nvfp4", expert_gemm="triton"), mesh, training=True)
    h200 = resolve(MoEConfig.kimi_k2(**SHAPE, weight_format="nvfp4"), _abstract_mesh("NVIDIA H200"), training=True)
    assert h200.expert_gemm == "triton", h200.report
    with pytest.raises(ResolutionError, match=r"bf16 weights: native bf16 tiles for SM90 only, found NVIDIA RTX PRO "
                                              r"6000 .* \(SM120\); 'pallas' runs bf16 experts"):
        resolve(MoEConfig.kimi_k2(**SHAPE, weight_format="bf16", expert_gemm="triton"), mesh)
    assert resolve(MoEConfig.kimi_k2(**SHAPE, weight_format="bf16"), mesh).expert_gemm == "pallas"
    bf16_h200 = resolve(MoEConfig.kimi_k2(**SHAPE, weight_format="bf16", expert_gemm="triton"),
                        _abstract_mesh("NVIDIA H200"), training=True)
    assert bf16_h200.expert_gemm == "triton", bf16_h200.report


def _mode() -> str:
    from pallas_kernels.grouped_matmul import triton_lang  # noqa: PLC0415

    major, minor = jax.devices("gpu")[0].compute_capability.split(".")[:2]
    return triton_lang.mode_for(10 * int(major) + int(minor)).value


@pytest.mark.gpu
@pytest.mark.parametrize("own_scales", [False, True])
def test_triton_on_gpu_matches_the_reference(rng, own_scales):
    config = MoEConfig.kimi_k2(**SHAPE, weight_format="nvfp4", expert_gemm="triton")
    check_against_reference(config, jax.devices("gpu")[:1], rng, tokens=300, own_scales=own_scales,
                            tolerance=GPU_TOLERANCE[_mode()])


@pytest.mark.gpu(count=2)
@pytest.mark.parametrize("exchange", names(EP_EXCHANGES))
def test_triton_on_two_gpus_under_an_expert_parallel_mesh(rng, exchange):
    config = MoEConfig.kimi_k2(**{**SHAPE, "top_k": 2}, weight_format="nvfp4", expert_gemm="triton",
                               exchange=exchange)
    mesh = sharding.make_mesh(2, devices=jax.devices("gpu")[:2])
    check_against_reference(config, mesh, rng, tokens=300, tolerance=GPU_TOLERANCE[_mode()])


#: W4A8's layer against the float64 W4A16 reference: the activations' E4M3 rounding (~4-6% of the
#: expert MLP's output on Gaussian rows, ``benchmarks/results/w4a8_numerics_cpu/``).
W4A8_LAYER_TOLERANCE = 0.08


@pytest.mark.gpu
def test_triton_w4a8_on_gpu_is_within_its_bound_of_the_reference(rng):
    """``prefill_activations="fp8"`` on SM90 at a prefill size (~110 rows per expert): the compiled
    program runs the W4A8 kernels (their names in the HLO) and no W4A16 one, and the layer is
    within the documented bound of the float64 reference; a NaN token changes no other token."""
    if _mode() != "w4a16":
        pytest.skip(f"W4A8 is SM90's; this GPU runs {_mode()}")
    config = MoEConfig.kimi_k2(**SHAPE, weight_format="nvfp4", expert_gemm="triton", prefill_activations="fp8")
    plan = check_against_reference(config, jax.devices("gpu")[:1], rng, tokens=300, tolerance=W4A8_LAYER_TOLERANCE)
    from harness import FORWARD, make  # noqa: PLC0415

    params, x = make(plan.config, rng, 300)
    text = FORWARD.lower(params, x, plan).compile().as_text()
    assert "native_gate_up_swiglu_w4a8" in text and "native_matmul_w4a8" in text
    assert "_w4a16" not in text
