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
#: over enough thread blocks (it gives each update its own blocks; see benchmarks/NOTES.md).
RAGGED_MIN_UPDATES_PER_PEER = 128


def ragged_exchange(x_th, ids_tk, weights_tk, expert_fn, *, num_experts, axis_name, capacity_factor):
    """``jax.lax.ragged_all_to_all`` (see :func:`sharding.expert_parallel.ragged_exchange`).

    With every device in this process, XLA runs the exchange as one copy kernel whose
    thread blocks are split by update, so updates are sliced up to
    :data:`RAGGED_MIN_UPDATES_PER_PEER` per peer; across processes XLA issues one NCCL
    send/receive per update, so there they are not sliced.
    """
    single_process = jax.process_count() == 1
    return sharding.ragged_exchange(
        x_th, ids_tk, weights_tk, expert_fn, num_experts=num_experts, axis_name=axis_name,
        capacity_factor=capacity_factor,
        min_updates_per_peer=RAGGED_MIN_UPDATES_PER_PEER if single_process else 1,
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


#: Up to this many tokens per device, ``auto`` prefers ``allgather`` on GPUs (measured in
#: benchmarks/results/expert_parallel.md: decode-sized batches).
ALLGATHER_MAX_TOKENS_PER_DEVICE = 64


def _auto_order(target: Target, config: MoEConfig):
    del config
    if target.expert_parallel == 1:
        return ("none",), "the expert axis has one device, so no tokens move"
    small = target.tokens_per_device is not None and target.tokens_per_device <= ALLGATHER_MAX_TOKENS_PER_DEVICE
    match target.platform:
        case "cpu":
            return ("padded", "allgather"), "XLA:CPU has no ragged_all_to_all; padded buffers follow the load"
        case "cuda" if small:
            return ("allgather", "ragged", "padded"), (
                f"<= {ALLGATHER_MAX_TOKENS_PER_DEVICE} tokens/device: two collectives and no planning round trip win"
            )
        case "cuda":
            return ("ragged", "padded", "allgather"), (
                "each row crosses NVLink once each way, with no padding and no receive-side sort"
                if target.tokens_per_device is not None
                else "no tokens_per_device hint: assumes prefill-sized batches, where ragged moves the fewest bytes"
            )
    return ("ragged", "padded", "allgather"), f"{target.platform}: ragged moves the fewest bytes"


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
            summary="all_gather tokens, local experts, reduce-scatter (float32); dropless; small batches",
            cannot_run=_anywhere,
            run=sharding.allgather_exchange,
        ),
    ),
    auto_order=_auto_order,
)
