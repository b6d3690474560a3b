"""The token exchange stage's registry: which exchanges exist, where each can run, and the
order ``auto`` tries them in.

The exchanges themselves live in :mod:`sharding.exchange`, one module each, with the
signature they share; dispatch calls ``EXCHANGE[name].run`` inside the layer's
``shard_map`` body (or directly, without a mesh, for ``none``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moe_jax.registry import Implementation, Registry, Target
from sharding.exchange import allgather_exchange, local_exchange, padded_exchange, ragged_exchange

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


def _ragged_cannot_run(target: Target, config: MoEConfig) -> str | None:
    del config
    if reason := _without_mesh(target):
        return reason
    match target.platform:
        case "cpu":
            return "XLA:CPU does not implement ragged_all_to_all (UNIMPLEMENTED: HLO opcode ragged-all-to-all)"
        case "rocm":
            return "not verified on ROCm"
        case "cuda" | "tpu":
            return None
        case other:
            return f"unknown platform {other!r}"


def _anywhere(target: Target, config: MoEConfig) -> str | None:
    del config  # dense all_to_all / all_gather / reduce-scatter lower on every backend
    return _without_mesh(target)


#: Up to this many tokens per device, ``auto`` prefers ``allgather`` on GPUs: latency, not
#: bytes, decides there (benchmarks/NOTES.md, "Expert parallelism", "What the numbers say",
#: items 3 and 4).
ALLGATHER_MAX_TOKENS_PER_DEVICE = 64


def _auto_order(target: Target, config: MoEConfig):
    if target.expert_parallel == 1:
        return ("none",), "the expert axis has one device, so no tokens move"
    d, k = target.expert_parallel, config.top_k
    small = target.tokens_per_device is not None and target.tokens_per_device <= ALLGATHER_MAX_TOKENS_PER_DEVICE
    # Per device and token, allgather moves (D-1)*H*(2 + 4) bytes (bf16 in, float32 partial
    # sums out), ragged 2 * k*(D-1)/D * H * 2 (bf16 rows, each way): fewer for D < 2k/3.
    fewer_bytes = 3 * d < 2 * k
    match target.platform:
        case "cpu":
            return ("padded", "allgather"), "XLA:CPU has no ragged_all_to_all; padded buffers follow the load"
        case "cuda" if small:
            return ("allgather", "ragged", "padded"), (
                f"<= {ALLGATHER_MAX_TOKENS_PER_DEVICE} tokens/device: two collectives, no planning round trip"
            )
        case "cuda" if fewer_bytes:
            return ("allgather", "ragged", "padded"), (
                f"expert axis {d} < 2k/3 = {2 * k / 3:.1f}: gathering each token once moves fewer bytes than "
                f"sending it to each of its k = {k} experts"
            )
        case "cuda":
            return ("ragged", "allgather", "padded"), (
                f"expert axis {d} >= 2k/3 = {2 * k / 3:.1f}: each (token, expert) row crossing once each way moves "
                "the fewest bytes"
            )
        case other:
            return ("ragged", "padded", "allgather"), f"{other}: ragged moves each row once each way"


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
            summary="jax.lax.ragged_all_to_all straight into an expert-major buffer; dropless; GPU and TPU",
            cannot_run=_ragged_cannot_run,
            run=ragged_exchange,
        ),
        Implementation(
            name="padded",
            summary="dense all_to_all of per-peer buffers sized by lax.switch to the load; dropless; any backend",
            cannot_run=_anywhere,
            run=padded_exchange,
        ),
        Implementation(
            name="allgather",
            summary="all_gather tokens, local experts, reduce-scatter (float32); dropless; fewest bytes for EP < 2k/3",
            cannot_run=_anywhere,
            run=allgather_exchange,
        ),
    ),
    auto_order=_auto_order,
)
