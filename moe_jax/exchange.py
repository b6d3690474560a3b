"""The token exchange stage's registry: which exchanges exist, where each can run, and the
order ``auto`` tries them in.

The exchanges themselves live in :mod:`sharding.exchange`, one module each, with the
signature they share; dispatch calls ``EXCHANGE[name].run`` inside the layer's
``shard_map`` body (or directly, without a mesh, for ``none``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moe_jax.registry import Implementation, Registry, Target
from moe_jax.traffic import RAGGED_COLLECTIVE, exchange_traffic
from sharding.exchange import (
    allgather_exchange, emulated, local_exchange, onecopy_exchange, padded_exchange, ragged_exchange,
)

if TYPE_CHECKING:
    from moe_jax.config import MoEConfig


def _none_cannot_run(target: Target, config: MoEConfig) -> str | None:
    del config
    if target.expert_parallel != 1:
        return f"the expert axis has {target.expert_parallel} devices; 'none' keeps all experts on one"
    return None


def _without_mesh(target: Target) -> str | None:
    if target.num_devices == 1:
        return "runs under shard_map over the expert axis; one device has no mesh (use 'none')"
    return None


def ragged_all_to_all_emulation(target: Target) -> str | None:
    """Why ``jax.lax.ragged_all_to_all`` runs as its twin (:mod:`sharding.exchange.emulated`)
    on ``target``, or None where the backend has it. Pure; resolution asks it once, before
    tracing, and the report prints the answer."""
    match target.platform:
        case "cpu":
            return "emulated on XLA:CPU: correct, not fast"
        case "cuda" | "tpu" | "rocm":
            return None
        case other:
            return f"unknown platform {other!r}"


def _ragged_cannot_run(target: Target, config: MoEConfig) -> str | None:
    del config
    if reason := _without_mesh(target):
        return reason
    match target.platform:
        case "rocm":
            return "not verified on ROCm"
        case "cuda" | "tpu" | "cpu":  # XLA:CPU through the twin (ragged_all_to_all_emulation)
            return None
        case other:
            return f"unknown platform {other!r}"


def _anywhere(target: Target, config: MoEConfig) -> str | None:
    del config  # dense all_to_all / all_gather / reduce-scatter lower on every backend
    return _without_mesh(target)


def run_options(plan) -> dict:
    """The keyword arguments the layer adds to ``EXCHANGE[plan.exchange].run``: the twin of
    ``ragged_all_to_all`` where :func:`ragged_all_to_all_emulation` said so at resolution."""
    if plan.exchange in RAGGED_COLLECTIVE and plan.exchange_emulation is not None:
        return {"ragged_all_to_all": emulated.ragged_all_to_all}
    return {}


#: Up to this many tokens per device, ``auto`` prefers ``allgather`` on GPUs: latency, not
#: bytes, decides there (benchmarks/NOTES.md, "Expert parallelism", "What the numbers say",
#: items 3 and 4).
ALLGATHER_MAX_TOKENS_PER_DEVICE = 64


def by_bytes(target: Target, config: MoEConfig) -> list[tuple[str, float]]:
    """The expert-parallel exchanges and their bytes per token per layer (dispatch +
    combine, :func:`moe_jax.traffic.exchange_traffic`) on ``target``, fewest first; ties keep
    the registry's order."""
    emulate = ragged_all_to_all_emulation(target) is not None
    names = [i.name for i in EXCHANGE.implementations if i.name != "none"]
    totals = [(n, exchange_traffic(config, n, target.expert_parallel,
                                   emulated=emulate and n in RAGGED_COLLECTIVE).total) for n in names]
    return sorted(totals, key=lambda item: item[1])


def _auto_order(target: Target, config: MoEConfig):
    if target.expert_parallel == 1:
        return ("none",), "the expert axis has one device, so no tokens move"
    ranked = by_bytes(target, config)
    order = tuple(n for n, _ in ranked)
    bytes_why = "fewest bytes per token per layer (moe_jax.traffic, expected under uniform routing: " + ", ".join(
        f"{n} {b / 1e3:.1f} KB" for n, b in ranked) + ")"
    if emulation := ragged_all_to_all_emulation(target):
        bytes_why += f"; ragged_all_to_all {emulation}"
    small = target.tokens_per_device is not None and target.tokens_per_device <= ALLGATHER_MAX_TOKENS_PER_DEVICE
    if target.platform == "cuda" and small:
        return ("allgather", *(n for n in order if n != "allgather")), (
            f"<= {ALLGATHER_MAX_TOKENS_PER_DEVICE} tokens/device: two collectives, no planning round trip, "
            "latency before bytes"
        )
    return order, bytes_why


EXCHANGE = Registry(
    stage="exchange",
    implementations=(
        Implementation(
            name="none",
            summary="no exchange: every expert is local (expert axis of size 1)",
            cannot_run=_none_cannot_run,
            run=local_exchange,
        ),
        Implementation(
            name="ragged",
            summary="jax.lax.ragged_all_to_all straight into an expert-major buffer, one row per (token, expert); "
                    "dropless; GPU and TPU (emulated on XLA:CPU)",
            cannot_run=_ragged_cannot_run,
            run=ragged_exchange,
        ),
        Implementation(
            name="onecopy",
            summary="ragged_all_to_all of one copy per (token, device), expanded to the experts there; float32 "
                    "partial sums back; dropless; GPU and TPU (emulated on XLA:CPU)",
            cannot_run=_ragged_cannot_run,
            run=onecopy_exchange,
        ),
        Implementation(
            name="padded",
            summary="dense all_to_all of per-peer buffers sized by lax.switch to the load; dropless; any backend",
            cannot_run=_anywhere,
            run=padded_exchange,
        ),
        Implementation(
            name="allgather",
            summary="all_gather tokens, local experts, reduce-scatter (float32); dropless; fewest bytes at small EP",
            cannot_run=_anywhere,
            run=allgather_exchange,
        ),
    ),
    auto_order=_auto_order,
)
