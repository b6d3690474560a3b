"""``MoE``: the layer as a Flax NNX module.

Resolution happens in ``__init__`` (once, before any tracing); the plan is a static
attribute, so ``nnx.jit`` compiles exactly the implementations the report names.

Built for a mesh, every variable carries its ``PartitionSpec`` as NNX sharding metadata
(``out_sharding``, the key ``nnx.with_partitioning`` sets), taken from
:func:`moe_jax.layer.param_specs`, the same table :func:`moe_jax.shard_params` places by. So
``nnx.get_partition_spec(nnx.state(layer))`` gives each array's spec, and
``nnx.get_abstract_model`` an abstract state that orbax restores onto another mesh (README). An
NVFP4 projection is an :class:`NVFP4Weight` node of three variables (codes, block scales, global
scales), so that each array has its own spec: the global scales ``[E]`` shard as the experts do.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractMesh, Mesh
from jax.sharding import PartitionSpec as P

from moe_jax import router
from moe_jax.config import MoEConfig
from moe_jax.layer import Params, check_params, init_params, moe_forward, param_specs, shard_params
from moe_jax.nvfp4 import NVFP4Tensor
from moe_jax.plan import Plan
from moe_jax.resolve import resolve


class QuantizedWeight(nnx.Variable):
    """One array of an NVFP4 projection (codes, block scales or global scales): stored, used,
    never differentiated (it is not an ``nnx.Param``)."""


class CorrectionBias(nnx.Variable):
    """The router's per-expert selection bias (DeepSeek-V3's ``e_score_correction_bias``),
    float32 ``[E]``: state that :meth:`MoE.update_load_balance` moves, not a trainable
    ``nnx.Param``. It enters only the top-k choice, so it has no gradient to follow; an
    optimizer over ``nnx.Param`` leaves it alone, while ``nnx.state(layer)`` (checkpoints)
    includes it."""


class InputScale(nnx.Variable):
    """A calibrated activation scale of an NVFP4 checkpoint (ModelOpt's ``input_scale``),
    float32 ``[E]`` or ``[]``: read by W4A4 (``MoEConfig.activation_scale``), never trained."""


def _sharding(spec: P | None) -> dict:
    """A variable's sharding metadata: ``spec`` as ``out_sharding`` (nothing without a mesh).

    Flax's eager sharding is off: the array is where :func:`shard_params` put it (and checked
    it), or, for an ``AbstractMesh``, nowhere yet; Flax would place it again, from a global mesh.
    An ``nnx.Optimizer``'s state copies the metadata, so it too says where its arrays go.
    """
    return {} if spec is None else {"out_sharding": tuple(spec), "eager_sharding": False}


class NVFP4Weight(nnx.Pytree):
    """An NVFP4 projection as three :class:`QuantizedWeight` variables, one per array of its
    :class:`~moe_jax.nvfp4.NVFP4Tensor` (``packed``, ``scales``, ``global_scale``), each with
    its own sharding metadata (``specs``: an ``NVFP4Tensor`` of ``PartitionSpec`` s, or None)."""

    def __init__(self, w: NVFP4Tensor, specs: NVFP4Tensor | None):
        def spec(field):
            return None if specs is None else getattr(specs, field)

        self.packed = QuantizedWeight(w.packed, **_sharding(spec("packed")))
        self.scales = QuantizedWeight(w.scales, **_sharding(spec("scales")))
        self.global_scale = QuantizedWeight(w.global_scale, **_sharding(spec("global_scale")))

    def get_value(self) -> NVFP4Tensor:
        """The projection as the ``NVFP4Tensor`` :func:`moe_forward` takes."""
        return NVFP4Tensor(packed=self.packed.get_value(), scales=self.scales.get_value(),
                           global_scale=self.global_scale.get_value())


def _variable(w, spec):
    return NVFP4Weight(w, spec) if isinstance(w, NVFP4Tensor) else nnx.Param(w, **_sharding(spec))


class MoE(nnx.Module):
    """A Mixture-of-Experts layer: router, routed experts, optional shared experts.

    ``__call__(x [..., H]) -> (y [..., H], stats)``; ``stats`` as in :func:`moe_forward`.
    bf16 weights and the router weights are ``nnx.Param`` (trainable); NVFP4 weights are
    :class:`NVFP4Weight` nodes of :class:`QuantizedWeight` variables, so ``nnx.grad`` over
    ``nnx.Param`` skips them. With
    ``config.router_bias`` the selection bias is a :class:`CorrectionBias` variable, balanced
    by :meth:`update_load_balance` after each step (auxiliary-loss-free, as DeepSeek-V3). A
    checkpoint's ``params["input_scales"]`` are kept as :class:`InputScale` variables.

    Args:
      config: the layer.
      rngs: initializes random parameters (ignored when ``params`` is given).
      mesh: a mesh with ``config.expert_axis`` for expert parallelism (the parameters are
        placed on it with :func:`moe_jax.shard_params`, an ``AbstractMesh`` places nothing),
        or one device as :func:`moe_jax.resolve` takes it (None: ``jax.devices()[0]``). With a
        mesh every variable records its ``PartitionSpec`` as ``out_sharding`` metadata (see the
        module docstring); without, none.
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
        specs = param_specs(params, self.plan) if self.plan.mesh is not None else None

        def spec(group, name):
            return None if specs is None else specs[group][name]

        self.router_w_eh = nnx.Param(params["router"]["w_eh"], **_sharding(spec("router", "w_eh")))
        # float32 whatever a checkpoint stored: the update rule returns float32, and a variable
        # whose dtype changed after the first step would make nnx.jit compile a second time.
        self.router_bias_e = (CorrectionBias(params["router"]["bias_e"].astype(jnp.float32),
                                             **_sharding(spec("router", "bias_e")))
                              if config.router_bias else None)
        self.w_gate_up_egh = _variable(params["experts"]["w_gate_up_egh"], spec("experts", "w_gate_up_egh"))
        self.w_down_ehf = _variable(params["experts"]["w_down_ehf"], spec("experts", "w_down_ehf"))
        shared = params.get("shared")
        self.shared_w_gate_up_gh = _variable(shared["w_gate_up_gh"], spec("shared", "w_gate_up_gh")) if shared else None
        self.shared_w_down_hs = _variable(shared["w_down_hs"], spec("shared", "w_down_hs")) if shared else None
        self.input_scales = (nnx.Dict({name: InputScale(v, **_sharding(spec("input_scales", name)))
                                       for name, v in params["input_scales"].items()})
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
