"""moe-jax: Mixture-of-Experts layers for JAX, correct and expert-parallel from SM80 to SM120.

Start with :class:`MoEConfig`, :func:`resolve` and :func:`moe_forward` (or the Flax NNX
module :class:`MoE`); :func:`load_moe_layer` reads a layer of a ModelOpt NVFP4 checkpoint.
``moe-jax explain --preset kimi_k2`` prints what would run where.
"""

import importlib

from moe_jax import nvfp4, router
from moe_jax.config import MoEConfig
from moe_jax.nvfp4 import NVFP4Tensor
from moe_jax.plan import Plan
from moe_jax.registry import Implementation, Registry, Target
from moe_jax.resolve import ResolutionError, resolve
from pallas_kernels.weight_format import WeightFormat

# The registries, the layer and the module load the kernels, the collectives and Flax: they
# are imported on first use (PEP 562), so that importing the package or its config does not.
_LAZY = {
    "CheckpointError": "moe_jax.checkpoint",
    "load_moe_layer": "moe_jax.checkpoint",
    "save_moe_layer": "moe_jax.checkpoint",
    "EXCHANGE": "moe_jax.exchange",
    "EXPERT_GEMM": "moe_jax.expert_gemm",
    "MoE": "moe_jax.module",
    **dict.fromkeys(
        ("check_params", "init_params", "moe_forward", "param_shapes", "param_shardings", "quantize_params",
         "random_params", "reference_forward", "shard_params"),
        "moe_jax.layer",
    ),
}
_SUBMODULES = ("checkpoint", "exchange", "expert_gemm", "layer", "module", "serving")


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"moe_jax.{name}")
    else:
        raise AttributeError(f"module 'moe_jax' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted({*globals(), *_LAZY, *_SUBMODULES})


__all__ = [
    "CheckpointError", "EXCHANGE", "EXPERT_GEMM", "Implementation", "MoE", "MoEConfig", "NVFP4Tensor", "Plan",
    "Registry", "ResolutionError", "Target", "check_params", "init_params", "load_moe_layer", "moe_forward", "nvfp4",
    "param_shapes", "param_shardings", "quantize_params", "random_params", "reference_forward", "resolve", "router",
    "save_moe_layer", "shard_params", "WeightFormat",
]
