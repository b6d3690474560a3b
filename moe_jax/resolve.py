"""Resolution: config + devices -> one implementation per stage, with a readable report.

Resolution happens once, before tracing, in plain Python. A name no registry holds, or an
explicit choice that cannot run, raises :class:`ResolutionError` (the latter with the
implementation's own reason); ``auto`` picks exactly one and says why; nothing falls back.

The registries (hence the kernels and the collectives) are imported when :func:`resolve` first
runs, not with this module, so that ``import moe_jax`` and the config stay light.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
from jax.sharding import AbstractMesh, Mesh

from moe_jax.auto import AUTO
from moe_jax.config import MoEConfig
from moe_jax.plan import EXCHANGE_STAGE, EXPERT_GEMM_STAGE, Decision, Plan
from moe_jax.registry import Registry, Target

# device_kind -> compute capability, for devices that do not report one (abstract devices
# used to cross-compile, e.g. for an RTX PRO 6000 on a machine without it).
_KNOWN_CAPABILITIES = (
    ("RTX PRO 6000", 120), ("RTX 50", 120), ("B200", 100), ("B100", 100), ("GB200", 100),
    ("H200", 90), ("H100", 90), ("H800", 90), ("GH200", 90), ("L40", 89), ("L4", 89),
    ("RTX 40", 89), ("RTX 6000 Ada", 89), ("A100", 80), ("A800", 80), ("A10", 86), ("A40", 86),
    ("RTX 30", 86),
)


class ResolutionError(ValueError):
    """An explicit choice cannot run on the target, or ``auto`` found nothing that can."""


def compute_capability(device_kind: str, reported: str | None = None) -> int | None:
    """``major * 10 + minor`` from a device's reported capability (``"9.0"``) or its name."""
    if reported:
        major, minor = reported.split(".")[:2]
        return int(major) * 10 + int(minor)
    for needle, cc in _KNOWN_CAPABILITIES:
        if needle in device_kind:
            return cc
    return None


def _platform(platform: str, device_kind: str) -> str:
    if platform in ("gpu", "cuda"):
        return "rocm" if "AMD" in device_kind or "Instinct" in device_kind else "cuda"
    return platform


def target_for(
    devices_or_mesh: Mesh | AbstractMesh | Sequence[jax.Device] | None,
    config: MoEConfig,
    *,
    training: bool = False,
    tokens_per_device: int | None = None,
) -> Target:
    """Describes where the layer will run. ``None`` means ``jax.devices()[0]`` alone."""
    if isinstance(devices_or_mesh, (Mesh, AbstractMesh)):
        mesh = devices_or_mesh
        if config.expert_axis not in mesh.axis_names:
            raise ResolutionError(
                f"mesh: axes {tuple(mesh.axis_names)} have no expert axis {config.expert_axis!r} "
                f"(MoEConfig.expert_axis)"
            )
        expert_parallel = mesh.shape[config.expert_axis]
        if isinstance(mesh, AbstractMesh):
            device = mesh.abstract_device
            if device is None:
                raise ResolutionError("mesh: an AbstractMesh needs an abstract_device to resolve for")
            platform, kind, reported = device.platform, device.device_kind, None
        else:
            first = mesh.devices.flat[0]
            platform, kind = first.platform, first.device_kind
            reported = getattr(first, "compute_capability", None)
        num_devices = mesh.size
    else:
        devices = list(devices_or_mesh) if devices_or_mesh is not None else jax.devices()[:1]
        if len(devices) != 1:
            raise ResolutionError(
                f"devices: {len(devices)} devices without a mesh; pass a jax.sharding.Mesh with an "
                f"{config.expert_axis!r} axis for expert parallelism, or a single device"
            )
        first = devices[0]
        platform, kind = first.platform, first.device_kind
        reported = getattr(first, "compute_capability", None)
        expert_parallel = num_devices = 1
    if config.num_experts % expert_parallel:
        raise ResolutionError(
            f"mesh: expert axis {config.expert_axis!r} has {expert_parallel} devices, which does not "
            f"divide num_experts = {config.num_experts}"
        )
    platform = _platform(platform, kind)
    return Target(
        platform=platform,
        device_kind=kind,
        compute_capability=compute_capability(kind, reported) if platform == "cuda" else None,
        num_devices=num_devices,
        expert_parallel=expert_parallel,
        training=training,
        tokens_per_device=tokens_per_device,
    )


def stages() -> tuple[Registry, ...]:
    """The registry of every stage, in report order (see :mod:`moe_jax.plan` for the names)."""
    # Imported here, not with this module: the registries load the kernels and the collectives.
    from moe_jax.exchange import EXCHANGE
    from moe_jax.expert_gemm import EXPERT_GEMM

    return EXPERT_GEMM, EXCHANGE


def _check_registered(registry: Registry, requested: str) -> None:
    if requested != AUTO and requested not in registry.names():
        registered = ", ".join(map(repr, (AUTO, *registry.names())))
        raise ResolutionError(
            f"MoEConfig.{registry.stage} = {requested!r}: not a registered implementation; registered: {registered}"
        )


def _decide(registry: Registry, requested: str, target: Target, config: MoEConfig) -> Decision:
    reasons = {impl.name: impl.cannot_run(target, config) for impl in registry.implementations}
    if requested != AUTO:
        if reasons[requested] is not None:
            raise ResolutionError(
                f"MoEConfig.{registry.stage} = {requested!r} cannot run on {target.describe()}: "
                f"{reasons[requested]}"
            )
        rejected = tuple((n, "not requested" if reasons[n] is None else f"not requested; cannot run here: {reasons[n]}")
                         for n in registry.names() if n != requested)
        return Decision(registry.stage, requested, requested, "explicit choice", rejected)
    order, why_order = registry.auto_order(target, config)
    capable = [name for name in order if reasons[name] is None]
    if not capable:
        detail = "; ".join(f"{n}: {r}" for n, r in reasons.items() if r is not None)
        raise ResolutionError(
            f"MoEConfig.{registry.stage} = 'auto': nothing can run on {target.describe()} "
            f"({why_order}; {detail})"
        )
    chosen = capable[0]
    why = f"auto: {why_order}"
    if chosen != order[0]:  # say why the preferred one is not what runs
        skipped = "; ".join(f"{n!r} cannot run ({reasons[n]})" for n in order[:order.index(chosen)])
        why = f"auto: {skipped}; next in the order ({why_order})"
    rejected = tuple(
        (name, reasons[name] or f"can run, but {chosen!r} comes first ({why_order})")
        for name in registry.names()
        if name != chosen
    )
    return Decision(registry.stage, AUTO, chosen, why, rejected)


def _note_emulation(decisions: tuple[Decision, ...], target: Target) -> tuple[tuple[Decision, ...], str | None]:
    """The decisions, the exchange's noting that its ragged_all_to_all is emulated here (and
    why), and that reason (None where the collective is the backend's or not used)."""
    from moe_jax.exchange import ragged_all_to_all_emulation  # noqa: PLC0415 (loaded with the registries)
    from moe_jax.traffic import RAGGED_COLLECTIVE  # noqa: PLC0415

    exchange = next(d for d in decisions if d.stage == EXCHANGE_STAGE)
    reason = ragged_all_to_all_emulation(target) if exchange.chosen in RAGGED_COLLECTIVE else None
    if reason is None:
        return decisions, None
    noted = dataclasses.replace(exchange, note=reason)
    return tuple(noted if d is exchange else d for d in decisions), reason


def resolve(
    config: MoEConfig,
    devices_or_mesh: Mesh | AbstractMesh | Sequence[jax.Device] | None = None,
    *,
    training: bool = False,
    tokens_per_device: int | None = None,
) -> Plan:
    """Chooses one implementation per stage for ``config`` on the given devices.

    Args:
      config: the layer.
      devices_or_mesh: a ``Mesh`` (with ``config.expert_axis``), an ``AbstractMesh`` (for
        cross-compilation), one device, or None for ``jax.devices()[0]``.
      training: gradients will be taken (rules out implementations without a VJP).
      tokens_per_device: a size hint that lets ``auto`` pick by size.

    Raises:
      ResolutionError: a name no registry holds, an explicit choice that cannot run (with its
        reason), ``auto`` finding nothing, or a mesh that does not fit the config.
    """
    from moe_jax.expert_gemm import activations_report, shared_expert_plan  # noqa: PLC0415 (loaded with the registries)

    registries = stages()
    for registry in registries:
        _check_registered(registry, getattr(config, registry.stage))
    target = target_for(devices_or_mesh, config, training=training, tokens_per_device=tokens_per_device)
    decisions = tuple(_decide(r, getattr(config, r.stage), target, config) for r in registries)
    decisions, emulation = _note_emulation(decisions, target)
    expert_gemm = next(d.chosen for d in decisions if d.stage == EXPERT_GEMM_STAGE)
    mesh = devices_or_mesh if isinstance(devices_or_mesh, (Mesh, AbstractMesh)) else None
    shared_max_tokens, shared = shared_expert_plan(config, target, expert_gemm)
    return Plan(config=config, target=target, decisions=decisions, mesh=mesh,
                activations=activations_report(config, target, expert_gemm),
                shared_kernel_max_tokens=shared_max_tokens, shared=shared, exchange_emulation=emulation)
