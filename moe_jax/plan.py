"""``Plan``: what :func:`moe_jax.resolve` decided, the static argument of the layer.

A module of its own so that the stages can name the type without importing resolution, which
imports their registries.
"""

from __future__ import annotations

import dataclasses

from jax.sharding import AbstractMesh, Mesh

from moe_jax.config import MoEConfig
from moe_jax.registry import Target

#: The stages, in the order the report lists them; each is a ``MoEConfig`` field and the
#: ``stage`` of its registry.
EXPERT_GEMM_STAGE, EXCHANGE_STAGE = "expert_gemm", "exchange"


@dataclasses.dataclass(frozen=True)
class Decision:
    """What resolution decided for one stage."""

    stage: str
    requested: str
    chosen: str
    why: str
    rejected: tuple[tuple[str, str], ...]  # (name, reason) for every implementation not chosen
    note: str | None = None  # how the chosen one runs here, where that is not the obvious way

    def lines(self) -> list[str]:
        chosen = self.chosen if self.note is None else f"{self.chosen} ({self.note})"
        out = [f"  {self.stage}: {chosen}  (requested {self.requested!r}; {self.why})"]
        out += [f"      not {name}: {reason}" for name, reason in self.rejected]
        return out


@dataclasses.dataclass(frozen=True)
class Plan:
    """The resolved layer: its config, the chosen implementation of each stage, and where.

    Hashable, so it can be a static argument of ``jax.jit``. ``str(plan)`` is the report.
    """

    config: MoEConfig
    target: Target
    decisions: tuple[Decision, ...]
    activations: str  # what the routed experts multiply their weights with (moe_jax.expert_gemm.activations_report)
    mesh: Mesh | AbstractMesh | None = None
    # How the shared expert runs (moe_jax.expert_gemm.shared_expert_plan): up to this many tokens per
    # device through the routed experts' kernels (0: never, None: at every size), and the report's line.
    shared_kernel_max_tokens: int | None = 0
    shared: str = "none"
    # Why the exchange's ragged_all_to_all runs as its twin (moe_jax.exchange.ragged_all_to_all_emulation),
    # or None: the backend's own collective, or an exchange without it.
    exchange_emulation: str | None = None

    def chosen(self, stage: str) -> str:
        for decision in self.decisions:
            if decision.stage == stage:
                return decision.chosen
        raise KeyError(stage)

    @property
    def expert_gemm(self) -> str:
        return self.chosen(EXPERT_GEMM_STAGE)

    @property
    def exchange(self) -> str:
        return self.chosen(EXCHANGE_STAGE)

    def scope(self, stage: str) -> str:
        """The ``jax.named_scope`` that marks this stage's chosen implementation in the HLO."""
        return f"moe_jax.{stage}.{self.chosen(stage)}"

    @property
    def report(self) -> str:
        cfg = self.config
        weights = f"{cfg.weight_format} weights"
        if cfg.num_shared_experts and cfg.shared_format != cfg.weight_format:
            weights = f"{cfg.weight_format} expert weights, {cfg.shared_format} shared-expert weights"
        head = (
            f"moe-jax plan: {cfg.num_experts} experts, top-{cfg.top_k}, hidden {cfg.hidden_size}, "
            f"expert intermediate {cfg.expert_intermediate_size}, {weights}\n"
            f"  target: {self.target.describe()}"
        )
        decisions = (line for d in self.decisions for line in d.lines())
        shared = [f"  shared expert: {self.shared}"] if cfg.num_shared_experts else []
        return "\n".join([head, *decisions, f"  activations: {self.activations}", *shared])

    def __str__(self) -> str:
        return self.report
