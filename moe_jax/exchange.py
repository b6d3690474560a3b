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
    return y_th, jnp.int32(rows - x_ch.shape[0])


def _none_cannot_run(target: Target, config: MoEConfig) -> str | None:
    del config
    if target.expert_parallel != 1:
        return f"the expert axis has {target.expert_parallel} devices; 'none' keeps all experts on one"
    return None


def _auto_order(target: Target, config: MoEConfig):
    del config
    if target.expert_parallel == 1:
        return ("none",), "the expert axis has one device, so no tokens move"
    return (), "no expert-parallel exchange is registered yet"


EXCHANGE = Registry(
    stage="exchange",
    implementations=(
        Implementation(
            name="none",
            summary="no exchange: every expert is local (expert axis of size 1)",
            cannot_run=_none_cannot_run,
            run=local_exchange,
        ),
    ),
    auto_order=_auto_order,
)
