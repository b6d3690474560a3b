"""Implementation registries: one per stage, read by both resolution (the schema) and dispatch.

Each :class:`Implementation` declares what it can run on as a pure function of a
:class:`Target` and the config that returns ``None`` when it can run and a reason when it
cannot. :func:`moe_jax.resolve` accepts exactly ``("auto", *registry.names())`` for a stage,
and dispatch calls ``registry[name].run``: the schema and the dispatch table are one object,
so they cannot drift.

The registries themselves live with their stages (``moe_jax.expert_gemm``, ``moe_jax.exchange``);
this module imports the config for type checking only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from moe_jax.auto import AUTO

if TYPE_CHECKING:
    from moe_jax.config import MoEConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
    """Where a layer will run, as resolution sees it. Hashable, so plans can be static.

    Attributes:
      platform: ``"cpu"``, ``"cuda"``, ``"rocm"`` or ``"tpu"``.
      device_kind: the device's own name, e.g. ``"NVIDIA H200"``.
      compute_capability: ``major * 10 + minor`` on CUDA (90 for SM90, 120 for SM120), else None.
      num_devices: devices in the mesh (1 without a mesh).
      expert_parallel: size of the expert mesh axis (1 without a mesh).
      training: whether gradients will be taken through the layer.
      tokens_per_device: a size hint for ``auto`` (rows each device routes per call), or None.
    """

    platform: str
    device_kind: str
    compute_capability: int | None
    num_devices: int = 1
    expert_parallel: int = 1
    training: bool = False
    tokens_per_device: int | None = None

    def describe(self) -> str:
        cc = f", SM{self.compute_capability}" if self.compute_capability is not None else ""
        ep = f", expert axis of {self.expert_parallel}" if self.num_devices > 1 else ""
        hint = f", ~{self.tokens_per_device} tokens/device" if self.tokens_per_device else ""
        mode = "training" if self.training else "inference"
        return f"{self.num_devices} x {self.device_kind} ({self.platform}{cc}{ep}{hint}), {mode}"


CannotRun = Callable[[Target, "MoEConfig"], "str | None"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Implementation:
    """One way to perform a stage.

    Attributes:
      name: the value users put in the config.
      summary: one line for the report.
      cannot_run: pure ``(target, config) -> reason | None``.
      run: the function dispatch calls; its signature is the stage's (see the stage's module).
    """

    name: str
    summary: str
    cannot_run: CannotRun
    run: Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class Registry:
    """The implementations of one stage, and how ``auto`` orders them for a target.

    ``auto_order(target, config)`` returns the names in order of preference and a sentence
    saying why that order; ``auto`` picks the first that can run.
    """

    stage: str
    implementations: tuple[Implementation, ...]
    auto_order: Callable[[Target, "MoEConfig"], tuple[Sequence[str], str]]

    def __post_init__(self):
        names = [i.name for i in self.implementations]
        if len(set(names)) != len(names) or AUTO in names:
            raise ValueError(f"registry {self.stage!r}: names must be unique and not {AUTO!r}: {names}")

    def names(self) -> tuple[str, ...]:
        return tuple(i.name for i in self.implementations)

    def __getitem__(self, name: str) -> Implementation:
        for impl in self.implementations:
            if impl.name == name:
                return impl
        raise KeyError(f"{self.stage}: no implementation {name!r}; registered: {', '.join(self.names())}")
