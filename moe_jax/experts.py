"""The routed experts' MLP (gate/up projection, SwiGLU, down projection) and its registry.

Every implementation has the signature ``run(x_mh, group_sizes_e, weights, plan) -> y_mh``:

* ``x_mh``: ``[M, H]`` rows sorted by expert, rows of expert ``e`` contiguous;
* ``group_sizes_e``: int32 ``[E_local]``; rows past ``sum(group_sizes_e)`` are padding, and
  their outputs are unspecified;
* ``weights``: ``{"w_gate_up_egh": [E_local, 2F, H], "w_down_ehf": [E_local, H, F]}``, each a
  bf16 array or an :class:`~moe_jax.nvfp4.NVFP4Tensor` (out, in; gate rows before up rows);
* ``plan``: the resolved :class:`~moe_jax.plan.Plan` (config and target);
* returns ``y_mh`` ``[M, H]`` in ``plan.config.dtype``.

Dimension letters: ``m`` rows, ``h`` hidden, ``e`` experts, ``f`` expert intermediate,
``g = 2f`` (gate and up stacked).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

import pallas_kernels.grouped_matmul as pallas_gmm
from moe_jax import nvfp4
from moe_jax.registry import Implementation, Registry, Target

if TYPE_CHECKING:
    from moe_jax.config import MoEConfig
    from moe_jax.plan import Plan

# Contract x's dim 1 with w's dim 2: weights stay (out, in), as checkpoints store them.
_ROWS_TIMES_OUT_IN = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
)


def dense_weight(w, dtype) -> jax.Array:
    """A bf16 array as is, or an NVFP4 tensor dequantized exactly (fp32), cast to ``dtype``."""
    if isinstance(w, nvfp4.NVFP4Tensor):
        return nvfp4.dequantize(w, dtype)
    return w.astype(dtype)


def swiglu(h_mg: jax.Array) -> jax.Array:
    """``silu(gate) * up`` for ``h_mg = [gate | up]`` along the last axis."""
    gate, up = jnp.split(h_mg, 2, axis=-1)
    return jax.nn.silu(gate) * up


def xla_expert_mlp(x_mh, group_sizes_e, weights, plan: Plan):
    """Reference path: dequantize, then ``jax.lax.ragged_dot_general`` (fp32 accumulation).

    The SwiGLU output is rounded to ``config.dtype`` before the down projection, as a
    fused kernel that writes it in bf16 would.
    """
    dtype = jnp.dtype(plan.config.dtype)
    w_gate_up_egh = dense_weight(weights["w_gate_up_egh"], dtype)
    w_down_ehf = dense_weight(weights["w_down_ehf"], dtype)
    h_mg = jax.lax.ragged_dot_general(
        x_mh.astype(dtype), w_gate_up_egh, group_sizes_e, _ROWS_TIMES_OUT_IN,
        preferred_element_type=jnp.float32,
    )
    a_mf = swiglu(h_mg).astype(dtype)
    y_mh = jax.lax.ragged_dot_general(
        a_mf, w_down_ehf, group_sizes_e, _ROWS_TIMES_OUT_IN, preferred_element_type=jnp.float32
    )
    return y_mh.astype(dtype)


def _xla_cannot_run(target: Target, config: MoEConfig) -> str | None:
    del target, config  # XLA's ragged_dot lowers on every backend and has a VJP.
    return None


# Interpreted on a machine without a GPU, the kernels use the tiles of this capability.
INTERPRET_CAPABILITY = 90


@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def pallas_expert_mlp(x_mh, group_sizes_e, weights, plan: Plan):
    """The Pallas kernels: fused gate/up + SwiGLU, then the down projection.

    NVFP4 weights are read in ModelOpt's layout and dequantized in the kernel; the
    ``[M, 2F]`` gate/up product never reaches memory. Rows past ``sum(group_sizes_e)`` are
    left unwritten (unspecified), as the stage contract allows.

    The kernels have no derivative rule: differentiating through them raises a ValueError
    that says how to resolve a differentiable plan, where Pallas itself would fail inside its
    own JVP rule with an internal assertion.
    """
    config, target = plan.config, plan.target
    kernel_args = dict(
        compute_capability=target.compute_capability or INTERPRET_CAPABILITY, interpret=config.interpret
    )
    a_mf = pallas_gmm.gate_up_swiglu(x_mh.astype(jnp.bfloat16), weights["w_gate_up_egh"], group_sizes_e, **kernel_args)
    return pallas_gmm.grouped_matmul(a_mf, weights["w_down_ehf"], group_sizes_e, **kernel_args)


@pallas_expert_mlp.defjvp
def _pallas_expert_mlp_jvp(plan: Plan, primals, tangents):
    # Resolution never picks 'pallas' for training, so a plan that gets here is an inference plan.
    del plan, primals, tangents
    raise ValueError(
        "expert_gemm 'pallas' has no gradient yet: this plan was resolved for inference; resolve with "
        "training=True (moe_jax.resolve(config, mesh, training=True), or MoE(..., training=True)) to get a "
        "differentiable implementation"
    )


def _pallas_cannot_run(target: Target, config: MoEConfig) -> str | None:
    if target.training:
        return "the kernels have no VJP yet (kernel VJPs are on the roadmap); 'xla' is differentiable"
    if not config.interpret:
        if target.platform != "cuda":
            return (f"needs an NVIDIA GPU, found {target.platform}; MoEConfig.interpret=True runs the "
                    "kernels in the Pallas interpreter instead (slow: for tests)")
        if target.compute_capability not in pallas_gmm.tuning.TILE_TABLE:
            return (f"no tile configurations for {target.device_kind} (SM{target.compute_capability}); "
                    f"tuned for SM{', SM'.join(map(str, sorted(pallas_gmm.tuning.TILE_TABLE)))}")
    if config.dtype != "bfloat16":
        return f"activations are {config.dtype}; the kernels take bfloat16"
    for field in ("hidden_size", "expert_intermediate_size"):
        if getattr(config, field) % pallas_gmm.K_MULTIPLE:
            return f"{field} = {getattr(config, field)} is not a multiple of {pallas_gmm.K_MULTIPLE}"
    return None


def _auto_order(target: Target, config: MoEConfig):
    del target, config
    return ("pallas", "xla"), "the Pallas kernels where they can run, else the reference"


EXPERT_GEMM = Registry(
    stage="expert_gemm",
    implementations=(
        Implementation(
            name="pallas",
            summary="Pallas/Triton grouped GEMMs, NVFP4 dequantized in-kernel, fused SwiGLU; SM80-SM120",
            cannot_run=_pallas_cannot_run,
            run=pallas_expert_mlp,
        ),
        Implementation(
            name="xla",
            summary="reference: dequantize + jax.lax.ragged_dot (fp32 accumulation); any backend, differentiable",
            cannot_run=_xla_cannot_run,
            run=xla_expert_mlp,
        ),
    ),
    auto_order=_auto_order,
)
