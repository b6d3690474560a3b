"""The token exchange stage: how rows reach the experts that own them, and come back.

Every implementation has the signature::

    run(x_th, ids_tk, weights_tk, expert_fn, *, num_experts, axis_name, capacity_factor)
        -> (y_th float32 [T, H], dropped int32 [])

and is called inside the layer's ``shard_map`` body (or directly, without a mesh, for
``none``). ``expert_fn(x_mh, group_sizes_e) -> y_mh`` runs this device's experts on rows
sorted by local expert. ``weights_tk`` are the combine weights; ``dropped`` counts the
(token, slot) assignments a capacity dropped on this device.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

import sharding
from moe_jax.registry import Implementation, Registry, Target

if TYPE_CHECKING:
    from moe_jax.config import MoEConfig


def local_exchange(x_th, ids_tk, weights_tk, expert_fn, *, num_experts, axis_name, capacity_factor):
    """No exchange: all experts are on this device."""
    del axis_name
    rows = ids_tk.size
    capacity = None if capacity_factor is None else math.ceil(capacity_factor * rows)
    x_ch, group_sizes_e, order_m = sharding.dispatch(x_th, ids_tk, num_experts, capacity=capacity)
    y_th = sharding.combine(expert_fn(x_ch, group_sizes_e), order_m, weights_tk)
    # Padding tokens (id num_experts) sort last: only real rows past the capacity count.
    return y_th, (jnp.sum(ids_tk < num_experts) - jnp.sum(group_sizes_e)).astype(jnp.int32)


def _none_cannot_run(target: Target, config: MoEConfig) -> str | None:
    del config
    if target.expert_parallel != 1:
        return f"the expert axis has {target.expert_parallel} devices; 'none' keeps all experts on one"
    return None


#: Ragged updates per peer that XLA's single-process GPU kernel needs to spread a transfer
#: over enough thread blocks (it gives each update its own blocks). 2 H200s, 235 MB per peer:
#: 1 update 2.7 GB/s, 128 updates 172-174, 512 and 2048 updates 191-192 (benchmarks/NOTES.md).
RAGGED_MIN_UPDATES_PER_PEER = 512


def ragged_exchange(x_th, ids_tk, weights_tk, expert_fn, *, num_experts, axis_name, capacity_factor):
    """``jax.lax.ragged_all_to_all`` (see :func:`sharding.expert_parallel.ragged_exchange`).

    On GPUs in one process XLA runs ``ragged_all_to_all`` as one copy kernel whose thread
    blocks are split by update, so updates are sliced up to
    :data:`RAGGED_MIN_UPDATES_PER_PEER` per peer. Across processes XLA issues one NCCL
    send/receive per update, and TPUs have their own implementation: there they are not
    sliced (neither measured here).
    """
    one_kernel = jax.default_backend() == "gpu" and jax.process_count() == 1
    return sharding.ragged_exchange(
        x_th, ids_tk, weights_tk, expert_fn, num_experts=num_experts, axis_name=axis_name,
        capacity_factor=capacity_factor,
        min_updates_per_peer=RAGGED_MIN_UPDATES_PER_PEER if one_kernel else 1,
    )


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
#: bytes, decides there (measured: benchmarks/results/expert_parallel.md).
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
            run=sharding.padded_exchange,
        ),
        Implementation(
            name="allgather",
            summary="all_gather tokens, local experts, reduce-scatter (float32); dropless; fewest bytes for EP < 2k/3",
            cannot_run=_anywhere,
            run=sharding.allgather_exchange,
        ),
    ),
    auto_order=_auto_order,
)
