"""Expert-parallel token exchanges, called inside ``shard_map`` over the expert axis.

Every exchange has the signature::

    exchange(x_th, ids_tk, weights_tk, expert_fn, *, num_experts, axis_name, capacity_factor)
        -> (y_th float32 [T, H], dropped int32 [])

* ``x_th`` ``[T, H]``: this device's tokens; ``ids_tk`` int32 ``[T, k]``: their global
  expert ids, distinct within a token (top-k), ``num_experts`` for padding tokens (routed
  nowhere: never sent, never counted); ``weights_tk`` ``[T, k]``: combine weights.
* ``expert_fn(x_mh, group_sizes_e) -> y_mh`` runs this device's ``E_l = E / D`` experts on
  rows sorted by local expert; rows past ``sum(group_sizes_e)`` are padding whose outputs
  are never used.
* ``capacity_factor``: None for dropless; else each device keeps at most
  ``ceil(capacity_factor * T * k)`` received rows (the first in its expert-major order, see
  :mod:`sharding.plan`), and ``dropped`` counts the rows it dropped.

Dropless buffers are sized at run time: each exchange compiles a few buffer sizes
(:func:`sharding.plan.buffer_buckets`, the last the proven worst case) and picks one with
``lax.switch`` on a size every device of the expert axis computes identically, so compute
and memory follow the actual load while no routing can overflow.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from sharding.local import combine, dispatch, sort_by_expert
from sharding.plan import (
    bucket_index,
    buffer_buckets,
    exclusive_cumsum,
    plan_exchange,
    segment_gather_index,
    split_updates,
    worst_case_received,
)

ExpertFn = Callable[[jax.Array, jax.Array], jax.Array]

#: Buffer sizes compiled besides the worst case, as multiples of the balanced load.
BUCKET_FACTORS = (1.25, 2.0)


def _capacity(capacity_factor: float | None, rows: int) -> int | None:
    return None if capacity_factor is None else max(1, math.ceil(capacity_factor * rows))


def _switch(needed: jax.Array, buckets: tuple[int, ...], branch: Callable[[int], tuple]) -> tuple:
    """``branch(size)`` for the first bucket size that holds ``needed`` rows; ``needed`` must
    be the same on every device whose collectives the branch runs."""
    if len(buckets) == 1:
        return branch(buckets[0])
    return jax.lax.switch(bucket_index(needed, buckets), [functools.partial(branch, b) for b in buckets])


def _axis(num_experts: int, axis_name: str) -> tuple[int, int, jax.Array]:
    """The expert axis's size ``D``, the experts per device ``E_l``, this device's index."""
    devices = jax.lax.axis_size(axis_name)
    if num_experts % devices:
        raise ValueError(f"num_experts: {num_experts}, which the expert axis {axis_name!r} of {devices} devices does not divide")
    experts_per_device = num_experts // devices
    return devices, experts_per_device, jax.lax.axis_index(axis_name)


def _receive_buffer(operand, rows: int):
    """Zeros of ``rows`` rows for ``ragged_all_to_all``'s ``output``, typed to vary over the
    axes ``operand`` varies over.

    ``ragged_all_to_all`` types its result like ``output``: a plain ``jnp.zeros`` would make
    the received rows look identical on every device, and differentiation would then sum
    their cotangents over the devices (wrong gradients, seen on 2 H200s).
    """
    return jnp.zeros_like(operand, shape=(rows, *operand.shape[1:]))


def _gather_counts(group_sizes_e, devices: int, experts_per_device: int, axis_name: str) -> jax.Array:
    """Every device's rows per (destination, local expert): int32 ``[D (source), D, E_l]``."""
    counts_de = group_sizes_e.reshape(devices, experts_per_device)
    return jax.lax.all_gather(counts_de, axis_name)


def ragged_exchange(
    x_th, ids_tk, weights_tk, expert_fn: ExpertFn, *, num_experts: int, axis_name: str,
    capacity_factor: float | None, min_updates_per_peer: int = 1,
):
    """Exchange with ``jax.lax.ragged_all_to_all``: each row crosses the axis exactly once
    each way, straight into the receiver's expert-major buffer.

    One ragged update per (peer, local expert), each cut into slices (see
    :func:`sharding.plan.split_updates`) until there are at least ``min_updates_per_peer``
    updates per peer. The receive buffer is a bucket of at most
    :func:`sharding.plan.worst_case_received` rows (or the capacity).
    """
    devices, e_l, me = _axis(num_experts, axis_name)
    t, k = ids_tk.shape
    split = max(1, math.ceil(min_updates_per_peer / e_l))
    x_mh_sorted, group_sizes_e, order_m = dispatch(x_th, ids_tk, num_experts)
    counts_sde = _gather_counts(group_sizes_e, devices, e_l, axis_name)
    worst = worst_case_received(t, k, devices, e_l)
    capacity = _capacity(capacity_factor, t * k)
    if capacity is not None:
        worst = min(worst, capacity)
    buckets = buffer_buckets(t * k, worst, BUCKET_FACTORS)
    needed = jnp.max(jnp.sum(counts_sde, axis=(0, 2)))

    def branch(rows: int):
        plan = plan_exchange(counts_sde, me, capacity=rows)
        forward = split_updates(plan.input_offsets_de, plan.send_sizes_de, plan.output_offsets_de, plan.recv_sizes_se, split)
        x_mh = jax.lax.ragged_all_to_all(x_mh_sorted, _receive_buffer(x_mh_sorted, rows), *forward, axis_name=axis_name)
        y_mh = expert_fn(x_mh, plan.group_sizes_e)
        back = split_updates(plan.recv_offsets_se, plan.recv_sizes_se, plan.return_offsets_se, plan.send_sizes_de, split)
        # Rows never returned (padding tokens, dropped rows) stay zero.
        y_mh_sorted = jax.lax.ragged_all_to_all(y_mh, _receive_buffer(y_mh, t * k), *back, axis_name=axis_name)
        return y_mh_sorted, plan.dropped

    y_mh_sorted, dropped = _switch(needed, buckets, branch)
    return combine(y_mh_sorted, order_m, weights_tk), dropped


def padded_exchange(
    x_th, ids_tk, weights_tk, expert_fn: ExpertFn, *, num_experts: int, axis_name: str,
    capacity_factor: float | None,
):
    """Exchange with dense ``jax.lax.all_to_all`` of per-peer buffers ``[D, C, H]``.

    ``C`` is a bucket of at most ``min(T * k, capacity)`` rows (a device has no more rows
    to send to one peer) chosen from the largest number any device sends to any peer, so
    the bytes moved follow the load. Runs on every backend.
    """
    devices, e_l, me = _axis(num_experts, axis_name)
    t, k = ids_tk.shape
    h = x_th.shape[1]
    order_m, group_sizes_e = sort_by_expert(ids_tk, num_experts)
    counts_sde = _gather_counts(group_sizes_e, devices, e_l, axis_name)
    capacity = _capacity(capacity_factor, t * k)
    plan = plan_exchange(counts_sde, me, capacity=capacity)
    worst = t * k if capacity is None else min(t * k, capacity)
    buckets = buffer_buckets(math.ceil(t * k / devices), worst, BUCKET_FACTORS)
    counts_de = counts_sde[me]

    def branch(per_peer: int):
        index_dc, valid_dc = jax.vmap(segment_gather_index, in_axes=(0, 0, 0, None))(
            plan.send_sizes_de, plan.send_sizes_de, plan.input_offsets_de, per_peer
        )
        x_dch = jnp.where(valid_dc[..., None], x_th[order_m[index_dc] // k], 0)
        x_sch = jax.lax.all_to_all(x_dch, axis_name, 0, 0, tiled=True)
        # Source s packed its rows for this device expert by expert; lay them out expert-major.
        slot_se = exclusive_cumsum(plan.recv_sizes_se, axis=1) + per_peer * jnp.arange(devices, dtype=jnp.int32)[:, None]
        recv_es = plan.recv_sizes_se.T.reshape(-1)
        index_m, valid_m = segment_gather_index(recv_es, recv_es, slot_se.T.reshape(-1), devices * per_peer)
        x_mh = jnp.where(valid_m[:, None], x_sch.reshape(-1, h)[index_m], 0)
        y_mh = expert_fn(x_mh, plan.group_sizes_e)
        index_sc, valid_sc = jax.vmap(segment_gather_index, in_axes=(0, 0, 0, None))(
            plan.recv_sizes_se, plan.recv_sizes_se, plan.recv_offsets_se, per_peer
        )
        y_sch = jnp.where(valid_sc[..., None], y_mh[index_sc], 0)
        y_dch = jax.lax.all_to_all(y_sch, axis_name, 0, 0, tiled=True)
        # Back to this device's sorted rows; rows dropped or of padding tokens stay zero.
        slot_de = exclusive_cumsum(plan.send_sizes_de, axis=1) + per_peer * jnp.arange(devices, dtype=jnp.int32)[:, None]
        index_m, valid_m = segment_gather_index(counts_de.reshape(-1), plan.send_sizes_de.reshape(-1), slot_de.reshape(-1), t * k)
        return (jnp.where(valid_m[:, None], y_dch.reshape(-1, h)[index_m], 0),)

    (y_mh_sorted,) = _switch(plan.max_sent_per_peer, buckets, branch)
    return combine(y_mh_sorted, order_m, weights_tk), plan.dropped


def allgather_exchange(
    x_th, ids_tk, weights_tk, expert_fn: ExpertFn, *, num_experts: int, axis_name: str,
    capacity_factor: float | None,
):
    """Exchange by all-gathering the tokens of the expert axis, computing this device's
    experts on them, and reduce-scattering the partial outputs (float32).

    Two collectives and no planning round trip: suits small (decode) batches. Moves
    ``(D - 1) * T * H`` activations in and ``(D - 1) * T * H`` float32 partial sums out.
    """
    devices, e_l, me = _axis(num_experts, axis_name)
    t, k = ids_tk.shape
    x_all_th = jax.lax.all_gather(x_th, axis_name, tiled=True)
    ids_all_tk = jax.lax.all_gather(ids_tk, axis_name, tiled=True)
    weights_all_tk = jax.lax.all_gather(weights_tk, axis_name, tiled=True)
    local_tk = ids_all_tk - me * e_l
    mine_tk = (local_tk >= 0) & (local_tk < e_l)
    local_tk = jnp.where(mine_tk, local_tk, e_l)
    needed = jnp.sum(mine_tk)
    worst = worst_case_received(t, k, devices, e_l)
    capacity = _capacity(capacity_factor, t * k)
    if capacity is not None:
        worst = min(worst, capacity)
    buckets = buffer_buckets(t * k, worst, BUCKET_FACTORS)

    def branch(rows: int):
        x_mh, group_sizes_e, order_m = dispatch(x_all_th, local_tk, e_l, capacity=rows)
        received = jnp.sum(group_sizes_e)
        # Rows past the groups belong to other devices' experts: their outputs are unspecified.
        y_mh = jnp.where(jnp.arange(x_mh.shape[0])[:, None] < received, expert_fn(x_mh, group_sizes_e), 0)
        return combine(y_mh, order_m, jnp.where(mine_tk, weights_all_tk, 0)), needed - received

    y_all_th, dropped = _switch(needed, buckets, branch)
    return jax.lax.psum_scatter(y_all_th, axis_name, scatter_dimension=0, tiled=True), dropped
