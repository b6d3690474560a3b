"""Token exchanges: how rows reach the experts that own them, and come back. One module per
exchange (``none``, ``ragged``, ``onecopy``, ``padded``, ``allgather``);
:mod:`sharding.exchange.layout` holds the pure functions of row counts they share, and
:mod:`sharding.exchange.emulated` a twin of ``jax.lax.ragged_all_to_all`` for backends
without it.

Every exchange has the signature::

    exchange(x_th, ids_tk, weights_tk, expert_fn, *, num_experts, axis_name, capacity_factor)
        -> (y_th float32 [T, H], dropped int32 [], rows_sent int32 [])

and, except ``none``, is called inside ``shard_map`` over the expert axis ``axis_name``.

* ``x_th`` ``[T, H]``: this device's tokens; ``ids_tk`` int32 ``[T, k]``: their global
  expert ids, distinct within a token (top-k), ``num_experts`` for padding tokens (routed
  nowhere: never sent, never counted); ``weights_tk`` ``[T, k]``: combine weights.
* ``expert_fn(x_mh, group_sizes_e, row_token_m=None, token_row_tk=None) -> y_mh`` runs this
  device's ``E_l = E / D`` experts on rows sorted by local expert; rows past
  ``sum(group_sizes_e)`` are padding whose outputs are never used. ``none``, ``allgather`` and
  ``onecopy`` pass the rows they hold (tokens, or the token copies received) and each row's
  index into them (``row_token_m``) instead of a copy of them in expert order, and for each
  row they hold the expert-ordered rows that read it (``token_row_tk``, the inverse of their
  sort), from which the gradient of what they hold is a gather, not a scatter-add.
* ``capacity_factor``: None for dropless; else each device keeps at most
  ``ceil(capacity_factor * T * k)`` received rows (the first in its expert-major order, see
  :mod:`sharding.exchange.layout`), and ``dropped`` counts the rows it dropped.
* ``rows_sent``: rows this device sends across the expert axis (to other devices) in the
  dispatch of this call; each exchange's docstring says what one of its rows is.

Dropless buffers are sized at run time: each exchange compiles a few buffer sizes
(:func:`sharding.exchange.layout.buffer_buckets`, the last the proven worst case) and picks
one with ``lax.switch`` on a size every device of the expert axis computes identically, so
compute and memory follow the actual load while no routing can overflow.
"""

from sharding.exchange.allgather import allgather_exchange
from sharding.exchange.layout import ExchangeLayout, exchange_layout
from sharding.exchange.none import local_exchange
from sharding.exchange.onecopy import onecopy_exchange
from sharding.exchange.padded import padded_exchange
from sharding.exchange.ragged import ragged_exchange

__all__ = [
    "ExchangeLayout", "allgather_exchange", "exchange_layout", "local_exchange", "onecopy_exchange", "padded_exchange",
    "ragged_exchange",
]
