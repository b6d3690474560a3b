"""moe-jax: Mixture-of-Experts layers for JAX, correct and expert-parallel from SM80 to SM120.

Start with :class:`MoEConfig`, :func:`resolve` and :func:`moe_forward` (or the Flax NNX
module :class:`MoE`). ``moe-jax explain --preset kimi_k2`` prints what would run where.
"""

from moe_jax import nvfp4, router
from moe_jax.config import MoEConfig
from moe_jax.exchange import EXCHANGE
from moe_jax.experts import EXPERT_GEMM
from moe_jax.layer import (
    check_params, init_params, moe_forward, param_shapes, param_shardings, quantize_params,
    reference_forward, shard_params,
)
from moe_jax.module import MoE
from moe_jax.nvfp4 import NVFP4Tensor
from moe_jax.registry import Implementation, Registry, Target
from moe_jax.resolve import Plan, ResolutionError, resolve

__all__ = [
    "EXCHANGE", "EXPERT_GEMM", "Implementation", "MoE", "MoEConfig", "NVFP4Tensor", "Plan", "Registry",
    "ResolutionError", "Target", "check_params", "init_params", "moe_forward", "nvfp4",
    "param_shapes", "param_shardings", "quantize_params", "reference_forward", "resolve", "router",
    "shard_params",
]
