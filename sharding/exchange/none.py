"""Exchange ``none``: every expert is on this device, so no row moves."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sharding.exchange.common import ExpertFn, capacity_rows
from sharding.local import combine, dispatch_rows, inverse_order


def local_exchange(
    x_th, ids_tk, weights_tk, expert_fn: ExpertFn, *, num_experts: int, axis_name: str | None,
    capacity_factor: float | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Dispatch to this device's experts, run them, combine; ``axis_name`` is unused.

    With a capacity this device keeps its first ``ceil(capacity_factor * T * k)`` rows in
    expert order. No row crosses a device: ``rows_sent`` is 0.
    """
    del axis_name
    rows = ids_tk.size
    row_token_c, group_sizes_e, order_m = dispatch_rows(ids_tk, num_experts,
                                                        capacity=capacity_rows(capacity_factor, rows))
    # The tokens as they are, with each row's token: no copy of them in expert order is made here.
    # Each token's rows too (rows past the capacity are none), for the gradient of the tokens.
    token_row_tk = inverse_order(order_m).reshape(ids_tk.shape)
    y_th = combine(expert_fn(x_th, group_sizes_e, row_token_c, token_row_tk=token_row_tk), order_m, weights_tk)
    # Padding tokens (id num_experts) sort last: only real rows past the capacity count.
    return y_th, (jnp.sum(ids_tk < num_experts) - jnp.sum(group_sizes_e)).astype(jnp.int32), jnp.int32(0)
