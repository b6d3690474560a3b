"""Exchange ``allgather``: gather the tokens of the expert axis, run this device's experts on
them, reduce-scatter the partial outputs; runs on every backend."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sharding.exchange.common import ExpertFn, capacity_rows, expert_axis, switch_on_size
from sharding.exchange.layout import buffer_buckets, worst_case_received
from sharding.local import combine, dispatch_rows, inverse_order


def allgather_exchange(
    x_th, ids_tk, weights_tk, expert_fn: ExpertFn, *, num_experts: int, axis_name: str,
    capacity_factor: float | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Exchange by ``all_gather`` and ``psum_scatter`` (float32) (signature: :mod:`sharding.exchange`).

    Two collectives and no planning round trip: suits small (decode) batches. Moves
    ``(D - 1) * T * H`` activations in and ``(D - 1) * T * H`` float32 partial sums out;
    ``rows_sent``: its ``T`` rows to each of the ``D - 1`` others.
    """
    devices, e_l, me = expert_axis(num_experts, axis_name)
    t, k = ids_tk.shape
    x_all_th = jax.lax.all_gather(x_th, axis_name, tiled=True)
    ids_all_tk = jax.lax.all_gather(ids_tk, axis_name, tiled=True)
    weights_all_tk = jax.lax.all_gather(weights_tk, axis_name, tiled=True)
    local_tk = ids_all_tk - me * e_l
    mine_tk = (local_tk >= 0) & (local_tk < e_l)
    local_tk = jnp.where(mine_tk, local_tk, e_l)
    needed = jnp.sum(mine_tk)
    worst = worst_case_received(t, k, devices, e_l)
    capacity = capacity_rows(capacity_factor, t * k)
    if capacity is not None:
        worst = min(worst, capacity)
    buckets = buffer_buckets(t * k, worst)

    def branch(rows: int):
        row_token_m, group_sizes_e, order_m = dispatch_rows(local_tk, e_l, capacity=rows)
        received = jnp.sum(group_sizes_e)
        # Rows past the groups belong to other devices' experts: their outputs are unspecified.
        y_mh = jnp.where(jnp.arange(row_token_m.shape[0])[:, None] < received,
                         expert_fn(x_all_th, group_sizes_e, row_token_m,
                                   token_row_tk=inverse_order(order_m).reshape(local_tk.shape)), 0)
        return combine(y_mh, order_m, jnp.where(mine_tk, weights_all_tk, 0)), needed - received

    y_all_th, dropped = switch_on_size(needed, buckets, branch)
    rows_sent = jnp.int32((devices - 1) * t)
    return jax.lax.psum_scatter(y_all_th, axis_name, scatter_dimension=0, tiled=True), dropped, rows_sent
