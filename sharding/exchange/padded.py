"""Exchange ``padded``: dense ``jax.lax.all_to_all`` of per-peer buffers; runs on every backend."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from sharding.exchange.common import ExpertFn, capacity_rows, expert_axis, gather_counts, switch_on_size
from sharding.exchange.layout import buffer_buckets, exchange_layout, exclusive_cumsum, segment_gather_index
from sharding.local import combine, sort_by_expert


def padded_exchange(
    x_th, ids_tk, weights_tk, expert_fn: ExpertFn, *, num_experts: int, axis_name: str,
    capacity_factor: float | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Exchange with dense ``jax.lax.all_to_all`` of per-peer buffers ``[D, C, H]``
    (signature: :mod:`sharding.exchange`).

    ``C`` is a bucket of at most ``min(T * k, capacity)`` rows (a device has no more rows
    to send to one peer) chosen from the largest number any device sends to any peer, so
    the bytes moved follow the load. ``rows_sent``: the ``(D - 1) * C`` buffer rows sent to
    the others, padding included (the dense all_to_all moves them all).
    """
    devices, e_l, me = expert_axis(num_experts, axis_name)
    t, k = ids_tk.shape
    h = x_th.shape[1]
    order_m, group_sizes_e = sort_by_expert(ids_tk, num_experts)
    counts_sde = gather_counts(group_sizes_e, devices, e_l, axis_name)
    capacity = capacity_rows(capacity_factor, t * k)
    layout = exchange_layout(counts_sde, me, capacity=capacity)
    worst = t * k if capacity is None else min(t * k, capacity)
    buckets = buffer_buckets(math.ceil(t * k / devices), worst)
    counts_de = counts_sde[me]
    gather_per_peer = jax.vmap(segment_gather_index, in_axes=(0, 0, 0, None))

    def branch(per_peer: int):
        index_dc, valid_dc = gather_per_peer(layout.send_sizes_de, layout.send_sizes_de, layout.input_offsets_de,
                                             per_peer)
        x_dch = jnp.where(valid_dc[..., None], x_th[order_m[index_dc] // k], 0)
        x_sch = jax.lax.all_to_all(x_dch, axis_name, 0, 0, tiled=True)
        # Source s packed its rows for this device expert by expert; lay them out expert-major.
        peer_start_s = per_peer * jnp.arange(devices, dtype=jnp.int32)
        slot_se = exclusive_cumsum(layout.recv_sizes_se, axis=1) + peer_start_s[:, None]
        recv_es = layout.recv_sizes_se.T.reshape(-1)
        index_m, valid_m = segment_gather_index(recv_es, recv_es, slot_se.T.reshape(-1), devices * per_peer)
        x_mh = jnp.where(valid_m[:, None], x_sch.reshape(-1, h)[index_m], 0)
        y_mh = expert_fn(x_mh, layout.group_sizes_e)
        index_sc, valid_sc = gather_per_peer(layout.recv_sizes_se, layout.recv_sizes_se, layout.recv_offsets_se,
                                             per_peer)
        y_sch = jnp.where(valid_sc[..., None], y_mh[index_sc], 0)
        y_dch = jax.lax.all_to_all(y_sch, axis_name, 0, 0, tiled=True)
        # Back to this device's sorted rows; rows dropped or of padding tokens stay zero.
        slot_de = exclusive_cumsum(layout.send_sizes_de, axis=1) + peer_start_s[:, None]
        index_m, valid_m = segment_gather_index(counts_de.reshape(-1), layout.send_sizes_de.reshape(-1),
                                                slot_de.reshape(-1), t * k)
        return jnp.where(valid_m[:, None], y_dch.reshape(-1, h)[index_m], 0), jnp.int32((devices - 1) * per_peer)

    y_mh_sorted, rows_sent = switch_on_size(layout.max_sent_per_peer, buckets, branch)
    return combine(y_mh_sorted, order_m, weights_tk), layout.dropped, rows_sent
