"""Sort-based token dispatch to experts on one device, and its inverse.

Dimension letters: ``t`` tokens, ``k`` top-k slots, ``h`` hidden, ``e`` experts,
``m`` rows after permutation (``m = t * k``), ``c`` rows kept under a capacity.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sort_by_expert(ids_tk: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """Orders the T*k (token, slot) assignments by expert.

    Returns:
      ``order_m`` int32 ``[T*k]``: flat assignment index (``t * k + slot``) of each sorted row,
        stable, so rows of one expert keep token order;
      ``group_sizes_e`` int32 ``[E]``: rows per expert; they sum to T*k.
    """
    flat_m = ids_tk.reshape(-1)
    order_m = jnp.argsort(flat_m, stable=True).astype(jnp.int32)
    group_sizes_e = jnp.bincount(flat_m, length=num_experts).astype(jnp.int32)
    return order_m, group_sizes_e


def clip_group_sizes(group_sizes_e: jax.Array, capacity: int) -> jax.Array:
    """Group sizes after keeping only the first ``capacity`` rows in expert order."""
    ends_e = jnp.minimum(jnp.cumsum(group_sizes_e), capacity)
    return jnp.diff(ends_e, prepend=0).astype(jnp.int32)


def dispatch_rows(
    ids_tk: jax.Array, num_experts: int, *, capacity: int | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Expert order of the token rows, without moving them: :func:`dispatch` before its gather.

    Returns:
      ``(row_token_c [C], group_sizes_e [E], order_m [T*k])`` with ``C = min(capacity, T*k)``:
      row ``i`` in expert order is token ``row_token_c[i] = order_m[i] // k``.
    """
    top_k = ids_tk.shape[1]
    order_m, group_sizes_e = sort_by_expert(ids_tk, num_experts)
    kept = order_m.shape[0] if capacity is None else min(capacity, order_m.shape[0])
    if kept < order_m.shape[0]:
        group_sizes_e = clip_group_sizes(group_sizes_e, kept)
    return order_m[:kept] // top_k, group_sizes_e, order_m


def dispatch(
    x_th: jax.Array, ids_tk: jax.Array, num_experts: int, *, capacity: int | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gathers token rows into expert order.

    Args:
      x_th: ``[T, H]`` tokens.
      ids_tk: int32 ``[T, k]`` chosen experts.
      num_experts: E.
      capacity: keep at most this many rows (in expert order; the rest are dropped), or None
        to keep all T*k.

    Returns:
      ``(x_ch [C, H], group_sizes_e [E], order_m [T*k])`` with ``C = min(capacity, T*k)``:
      row ``i`` of ``x_ch`` is token ``order_m[i] // k``; rows of expert ``e`` are contiguous.
    """
    row_token_c, group_sizes_e, order_m = dispatch_rows(ids_tk, num_experts, capacity=capacity)
    return x_th[row_token_c], group_sizes_e, order_m


def inverse_order(order_m: jax.Array) -> jax.Array:
    """int32 ``[T*k]``: each assignment's sorted position, ``order_m`` inverted by one scatter (it
    is a permutation: unique indices), not by a second sort. ``position_m.reshape(T, k)`` lists
    each token's rows in expert order (those ``>= C`` dropped by a capacity)."""
    return jnp.zeros_like(order_m).at[order_m].set(jnp.arange(order_m.shape[0], dtype=order_m.dtype),
                                                   unique_indices=True)


def combine(y_ch: jax.Array, order_m: jax.Array, weights_tk: jax.Array) -> jax.Array:
    """Inverse of :func:`dispatch` plus the weighted sum over the k slots.

    Rows dropped by a capacity contribute zero. A gather (not a one-hot matmul) puts rows
    back, so a non-finite row reaches only its own token. Returns float32 ``[T, H]``.
    Differentiable; the gradient of ``y_ch`` is a gather too (each kept row's weight times its
    token's cotangent), where differentiating the gather would scatter-add into the rows.
    """
    return _combine(y_ch, order_m, weights_tk)


def _combined_rows(y_ch, order_m, position_m, t: int, k: int) -> jax.Array:
    """float32 ``[T, k, H]``: each assignment's row of ``y_ch``, zero where a capacity dropped it."""
    kept = y_ch.shape[0]
    # The hidden size spelled out: ``-1`` cannot be inferred from an empty array (T = 0).
    y_tkh = y_ch[jnp.minimum(position_m, kept - 1)].reshape(t, k, y_ch.shape[-1]).astype(jnp.float32)
    if kept < order_m.shape[0]:
        y_tkh = jnp.where((position_m < kept).reshape(t, k, 1), y_tkh, 0.0)
    return y_tkh


@jax.custom_vjp
def _combine(y_ch, order_m, weights_tk):
    t, k = weights_tk.shape
    y_tkh = _combined_rows(y_ch, order_m, inverse_order(order_m), t, k)
    return jnp.einsum("tk,tkh->th", weights_tk.astype(jnp.float32), y_tkh)


def _combine_fwd(y_ch, order_m, weights_tk):
    return _combine(y_ch, order_m, weights_tk), (y_ch, order_m, weights_tk)


def _combine_bwd(residuals, dy_th):
    y_ch, order_m, weights_tk = residuals
    t, k = weights_tk.shape
    dy_th = dy_th.astype(jnp.float32)
    # Kept row i is assignment order_m[i]: token order_m[i] // k, weight weights_tk.flat[order_m[i]].
    assignment_c = order_m[:y_ch.shape[0]]
    weight_c = weights_tk.reshape(-1)[assignment_c].astype(jnp.float32)
    dy_ch = (weight_c[:, None] * dy_th[assignment_c // k]).astype(y_ch.dtype)
    y_tkh = _combined_rows(y_ch, order_m, inverse_order(order_m), t, k)
    dweights_tk = jnp.einsum("th,tkh->tk", dy_th, y_tkh).astype(weights_tk.dtype)
    return dy_ch, None, dweights_tk


_combine.defvjp(_combine_fwd, _combine_bwd)
