"""``MoE``: the layer as a Flax NNX module.

Resolution happens in ``__init__`` (once, before any tracing); the plan is a static
attribute, so ``nnx.jit`` compiles exactly the implementations the report names.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractMesh, Mesh

from moe_jax import router
from moe_jax.config import MoEConfig
from moe_jax.layer import Params, check_params, init_params, moe_forward, shard_params
from moe_jax.nvfp4 import NVFP4Tensor
from moe_jax.plan import Plan
from moe_jax.resolve import resolve


class QuantizedWeight(nnx.Variable):
    """An NVFP4 projection: stored, used, never differentiated (it is not an ``nnx.Param``)."""


class CorrectionBias(nnx.Variable):
    """The router's per-expert selection bias (DeepSeek-V3's ``e_score_correction_bias``),
    float32 ``[E]``: state that :meth:`MoE.update_load_balance` moves, not a trainable
    ``nnx.Param``. It enters only the top-k choice, so it has no gradient to follow; an
    optimizer over ``nnx.Param`` leaves it alone, while ``nnx.state(layer)`` (checkpoints)
    includes it."""


class InputScale(nnx.Variable):
    """A calibrated activation scale of an NVFP4 checkpoint (ModelOpt's ``input_scale``),
    float32 ``[E]`` or ``[]``: read by W4A4 (``MoEConfig.activation_scale``), never trained."""


def _variable(w):
    return QuantizedWeight(w) if isinstance(w, NVFP4Tensor) else nnx.Param(w)


class MoE(nnx.Module):
    """A Mixture-of-Experts layer: router, routed experts, optional shared experts.

    ``__call__(x [..., H]) -> (y [..., H], stats)``; ``stats`` as in :func:`moe_forward`.
    bf16 weights and the router weights are ``nnx.Param`` (trainable); NVFP4 weights are
    :class:`QuantizedWeight` variables, so ``nnx.grad`` over ``nnx.Param`` skips them. With
    ``config.router_bias`` the selection bias is a :class:`CorrectionBias` variable, balanced
    by :meth:`update_load_balance` after each step (auxiliary-loss-free, as DeepSeek-V3). A
    checkpoint's ``params["input_scales"]`` are kept as :class:`InputScale` variables.

    Args:
      config: the layer.
      rngs: initializes random parameters (ignored when ``params`` is given).
      mesh: a mesh with ``config.expert_axis`` for expert parallelism (the parameters are
        placed on it with :func:`moe_jax.shard_params`), or None for one device.
      training: resolve for training (only implementations with a VJP qualify).
      params: existing parameters in :func:`moe_jax.init_params`' layout, e.g. from a checkpoint.
    """

    def __init__(
        self,
        config: MoEConfig,
        *,
        rngs: nnx.Rngs,
        mesh: Mesh | AbstractMesh | None = None,
        training: bool = False,
        params: Params | None = None,
    ):
        self.plan: Plan = resolve(config, mesh, training=training)
        if params is None:
            params = init_params(config, rngs.params())
        check_params(params, config)
        if isinstance(mesh, Mesh):
            params = shard_params(params, self.plan)  # each device holds its experts only
        self.router_w_eh = nnx.Param(params["router"]["w_eh"])
        # float32 whatever a checkpoint stored: the update rule returns float32, and a variable
        # whose dtype changed after the first step would make nnx.jit compile a second time.
        self.router_bias_e = (CorrectionBias(params["router"]["bias_e"].astype(jnp.float32))
                              if config.router_bias else None)
        self.w_gate_up_egh = _variable(params["experts"]["w_gate_up_egh"])
        self.w_down_ehf = _variable(params["experts"]["w_down_ehf"])
        shared = params.get("shared")
        self.shared_w_gate_up_gh = _variable(shared["w_gate_up_gh"]) if shared else None
        self.shared_w_down_hs = _variable(shared["w_down_hs"]) if shared else None
        self.input_scales = (nnx.Dict({name: InputScale(v) for name, v in params["input_scales"].items()})
                             if "input_scales" in params else None)

    @property
    def config(self) -> MoEConfig:
        return self.plan.config

    def params(self) -> Params:
        """The parameters as the pytree :func:`moe_forward` takes."""
        params = {
            "router": {"w_eh": self.router_w_eh.get_value()},
            "experts": {
                "w_gate_up_egh": self.w_gate_up_egh.get_value(),
                "w_down_ehf": self.w_down_ehf.get_value(),
            },
        }
        if self.router_bias_e is not None:
            params["router"]["bias_e"] = self.router_bias_e.get_value()
        if self.shared_w_gate_up_gh is not None:
            params["shared"] = {
                "w_gate_up_gh": self.shared_w_gate_up_gh.get_value(),
                "w_down_hs": self.shared_w_down_hs.get_value(),
            }
        if self.input_scales is not None:
            params["input_scales"] = {name: v.get_value() for name, v in self.input_scales.items()}
        return params

    def __call__(self, x: jax.Array, *, num_valid_tokens=None) -> tuple[jax.Array, dict]:
        """:func:`moe_forward` with this layer's parameters (``num_valid_tokens``: the real
        tokens of a bucket-padded batch, :mod:`moe_jax.serving`)."""
        return moe_forward(self.params(), x, self.plan, num_valid_tokens=num_valid_tokens)

    def update_load_balance(self, stats: Mapping[str, jax.Array], rate) -> None:
        """One auxiliary-loss-free balancing step: ``bias_e += rate * sign(mean load - load_e)``.

        Call it after each training step with that step's statistics
        (:func:`moe_jax.router.update_correction_bias` is the rule); works eagerly and inside
        ``nnx.jit`` (the variable is updated in place).

        Args:
          stats: the ``stats`` of :meth:`__call__`; its ``"tokens_per_expert"`` int32 ``[E]``
            counts the whole mesh's tokens, so every device applies the same update.
          rate: the step size, a finite number > 0 (DeepSeek-V3: 1e-3), or a traced float scalar.

        Raises:
          ValueError: the layer has no correction bias (``config.router_bias`` is False), or
            ``stats`` or ``rate`` is malformed (naming which).
        """
        if self.router_bias_e is None:
            raise ValueError("update_load_balance: this layer has no correction bias (config.router_bias = False); "
                             "balance it with stats['load_balance_loss'] instead")
        if not isinstance(stats, Mapping) or "tokens_per_expert" not in stats:
            found = sorted(stats) if isinstance(stats, Mapping) else type(stats).__name__
            raise ValueError(f"stats: {found}, expected the stats dict of MoE.__call__ with 'tokens_per_expert'")
        self.router_bias_e.set_value(
            router.update_correction_bias(self.router_bias_e.get_value(), stats["tokens_per_expert"], rate))
