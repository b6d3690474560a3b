"""Exchange ``onecopy``: each token crosses once to each device that holds one of its
experts, with its expert ids and weights; the receiver expands it to its experts and sends
back one weighted partial sum per (token, device).

Against ``ragged`` (one row per (token, expert)): a token whose ``k`` experts fall on ``n``
devices moves ``n`` rows, not ``k``. The partial sums return in float32, so the result equals
one device's up to float32 summation order (see :func:`onecopy_exchange`), and each returned
row weighs twice a bf16 row.

Capacity and drops keep ``ragged``'s meaning: the receiver's rows are those ``ragged`` would
keep (:func:`sharding.exchange.layout.exchange_layout`), and a token is sent to a device
only for its kept assignments there, so a token with none is not sent at all.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sharding.exchange.common import ExpertFn, capacity_rows, expert_axis, gather_counts, switch_on_size
from sharding.exchange.layout import (
    buffer_buckets, exchange_layout, kept_assignments, split_updates, token_layout, worst_case_received,
    worst_case_tokens_received, worst_case_tokens_sent,
)
from sharding.exchange.ragged import default_min_updates_per_peer
from sharding.local import combine, dispatch_rows, inverse_order, sort_by_expert


def _send_rows(present_td: jax.Array, input_offsets_d: jax.Array, rows: int):
    """The send buffer's layout: destination-major, token order within.

    Returns ``(position_td int32 [T, D], token_n int32 [rows], dest_n int32 [rows])``: where
    each (token, destination) copy sits (meaningful where ``present_td``), and which token and
    destination each of the ``rows`` positions holds (0 and ``D`` past the copies).
    """
    t, d = present_td.shape
    position_td = input_offsets_d[None, :] + jnp.cumsum(present_td, axis=0, dtype=jnp.int32) - 1
    slot = jnp.where(present_td, position_td, rows).reshape(-1)
    token_n = jnp.zeros((rows,), jnp.int32).at[slot].set(jnp.repeat(jnp.arange(t, dtype=jnp.int32), d), mode="drop")
    dest_n = jnp.full((rows,), d, jnp.int32).at[slot].set(jnp.tile(jnp.arange(d, dtype=jnp.int32), t), mode="drop")
    return position_td, token_n, dest_n


def _like(operand, rows: int, fill=0):
    """A ``ragged_all_to_all`` output buffer of ``rows`` rows filled with ``fill``, typed to
    vary like ``operand`` (see :func:`sharding.exchange.ragged._receive_buffer`)."""
    return jnp.full_like(operand, fill, shape=(rows, *operand.shape[1:]))


def onecopy_exchange(
    x_th, ids_tk, weights_tk, expert_fn: ExpertFn, *, num_experts: int, axis_name: str,
    capacity_factor: float | None, min_updates_per_peer: int | None = None,
    ragged_all_to_all=jax.lax.ragged_all_to_all,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Exchange one copy of each token per destination device (signature: :mod:`sharding.exchange`).

    Dispatch: three ``ragged_all_to_all`` of the same layout
    (:func:`~sharding.exchange.layout.token_layout`): the rows ``[*, H]``, the local expert
    ids int32 ``[*, k]`` (``E_l`` for slots of other devices or dropped) and the weights
    float32 ``[*, k]`` (0 there). The receiver sorts its copies' slots by local expert (stably:
    expert, then source, then token, the expert-major order of
    :mod:`sharding.exchange.layout`), runs its experts, and sums each copy's weighted outputs in
    float32; one ``ragged_all_to_all`` returns those partial sums, and the sender adds a token's
    partial sums in destination order.

    Error bound against one device (whose combine sums the same float32 products ``w_k y_k``
    over ``k``): both are float32 sums of the same ``k`` products, in another order and
    grouping, so ``|y - y_1| <= (2k + D) * 2**-24 * sum_k |w_k y_k|`` per element (each of the
    two sums errs by at most ``(k + D - 1) u`` resp. ``(k - 1) u`` times the sum of magnitudes).

    Buffers: a send buffer of :func:`~sharding.exchange.layout.worst_case_tokens_sent` rows;
    a receive buffer of at most :func:`~sharding.exchange.layout.worst_case_tokens_received`
    rows and at most the expanded rows' bucket (a bucket of at most
    :func:`~sharding.exchange.layout.worst_case_received` rows, or the capacity), chosen at run
    time as ``ragged`` chooses its receive buffer.

    Args:
      min_updates_per_peer: as :func:`sharding.exchange.ragged.ragged_exchange` (one update
        per peer here, cut into that many slices).
      ragged_all_to_all: the collective, or its twin (:mod:`sharding.exchange.emulated`) where
        the backend has none; resolution decides which (:mod:`moe_jax.exchange`).

    Returns:
      ``(y_th float32 [T, H], dropped int32 [], rows_sent int32 [])``; ``rows_sent``: token
      copies this device sends to other devices.
    """
    if min_updates_per_peer is None:
        min_updates_per_peer = default_min_updates_per_peer()
    devices, e_l, me = expert_axis(num_experts, axis_name)
    t, k = ids_tk.shape
    split = max(1, min_updates_per_peer)
    order_m, group_sizes_e = sort_by_expert(ids_tk, num_experts)
    counts_sde = gather_counts(group_sizes_e, devices, e_l, axis_name)
    capacity = capacity_rows(capacity_factor, t * k)
    rows_layout = exchange_layout(counts_sde, me, capacity=capacity)
    kept_tk = kept_assignments(order_m, group_sizes_e, rows_layout.send_sizes_de.reshape(-1)).reshape(t, k)
    dest_tk = jnp.where(kept_tk, ids_tk // e_l, devices)
    present_td = jnp.any(dest_tk[:, :, None] == jnp.arange(devices, dtype=jnp.int32), axis=1)
    tokens_sd = jax.lax.all_gather(jnp.sum(present_td, axis=0, dtype=jnp.int32), axis_name)
    layout = token_layout(tokens_sd, me)

    n_send = worst_case_tokens_sent(t, k, devices)
    position_td, token_n, dest_n = _send_rows(present_td, layout.input_offsets_d, n_send)
    mine_nk = dest_tk[token_n] == dest_n[:, None]
    x_nh = x_th[token_n]
    local_nk = jnp.where(mine_nk, ids_tk[token_n] - dest_n[:, None] * e_l, e_l).astype(jnp.int32)
    w_nk = jnp.where(mine_nk, weights_tk[token_n].astype(jnp.float32), 0.0)
    one = lambda a: a[:, None]  # one update per peer, as [D, 1]
    forward = split_updates(one(layout.input_offsets_d), one(layout.send_sizes_d), one(layout.output_offsets_d),
                            one(layout.recv_sizes_s), split)
    back = split_updates(one(layout.recv_offsets_s), one(layout.recv_sizes_s), one(layout.return_offsets_s),
                         one(layout.send_sizes_d), split)
    move = lambda operand, output, meta: ragged_all_to_all(operand, output, *meta, axis_name=axis_name)

    worst = worst_case_received(t, k, devices, e_l)
    if capacity is not None:
        worst = min(worst, capacity)
    buckets = buffer_buckets(t * k, worst)

    def branch(rows: int):
        # Each copy received carries a kept row here, so ``rows`` (>= the rows received) bounds them.
        recv = min(worst_case_tokens_received(t, devices), rows)
        x_rh = move(x_nh, _like(x_nh, recv), forward)
        local_rk = move(local_nk, _like(local_nk, recv, e_l), forward)
        w_rk = move(w_nk, _like(w_nk, recv), forward)
        row_copy_m, group_sizes_l, order_r = dispatch_rows(local_rk, e_l, capacity=rows)
        received = jnp.sum(group_sizes_l)
        # Rows past the groups are padding: their outputs are unspecified (and weigh 0).
        y_mh = jnp.where(jnp.arange(row_copy_m.shape[0])[:, None] < received,
                         expert_fn(x_rh, group_sizes_l, row_copy_m,
                                   token_row_tk=inverse_order(order_r).reshape(local_rk.shape)), 0)
        partial_rh = combine(y_mh, order_r, w_rk)
        return (move(partial_rh, _like(partial_rh, n_send), back),)

    (partial_nh,) = switch_on_size(rows_layout.max_received, buckets, branch)
    # A token's partial sums, added in destination order (deterministic, unlike a scatter-add;
    # one [T, H] gather at a time, not a [T, D, H] one).
    y_th = jnp.zeros(x_th.shape, jnp.float32)
    for d in range(devices):
        y_th = y_th + jnp.where(present_td[:, d, None], partial_nh[jnp.clip(position_td[:, d], 0, n_send - 1)], 0.0)
    rows_sent = jnp.sum(layout.send_sizes_d) - layout.send_sizes_d[me]
    return y_th, rows_layout.dropped, rows_sent.astype(jnp.int32)
