"""Exchange ``ragged``: ``jax.lax.ragged_all_to_all`` straight into an expert-major buffer.

Each row crosses the expert axis exactly once each way. XLA:CPU does not implement the
collective; GPUs and TPUs do. Where it is missing, resolution passes the twin of
:mod:`sharding.exchange.emulated` as ``ragged_all_to_all`` (and says so in its report).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from sharding.exchange.common import ExpertFn, capacity_rows, expert_axis, gather_counts, switch_on_size
from sharding.exchange.layout import buffer_buckets, exchange_layout, split_updates, worst_case_received
from sharding.local import combine, dispatch

#: Ragged updates per peer that XLA's single-process GPU kernel needs to spread a transfer
#: over enough thread blocks: it gives each update its own blocks, so a few large updates
#: leave most of the chip idle. The throughput per update count, and where it levels off,
#: are in benchmarks/NOTES.md ("Expert parallelism", "What the numbers say", item 1).
RAGGED_MIN_UPDATES_PER_PEER = 512


def default_min_updates_per_peer(platform: str | None = None) -> int:
    """:data:`RAGGED_MIN_UPDATES_PER_PEER` where XLA runs ``ragged_all_to_all`` as one copy
    kernel (GPUs in one process), else 1.

    Across processes XLA issues one NCCL send/receive per update, and TPUs have their own
    implementation: slicing would only add messages there (neither measured).

    Args:
      platform: the mesh's platform (``"cuda"``, ``"cpu"``, ...); None: that of the mesh being
        traced (``jax.sharding.get_abstract_mesh()``, so a cross-compiled GPU mesh counts as
        one), else the default backend's.
    """
    if platform is None:
        device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
        platform = device.platform if device is not None else jax.default_backend()
    one_kernel = platform in ("cuda", "rocm", "gpu") and jax.process_count() == 1
    return RAGGED_MIN_UPDATES_PER_PEER if one_kernel else 1


def _receive_buffer(operand, rows: int):
    """Zeros of ``rows`` rows for ``ragged_all_to_all``'s ``output``, typed to vary over the
    axes ``operand`` varies over.

    ``ragged_all_to_all`` types its result like ``output``: a plain ``jnp.zeros`` would make
    the received rows look identical on every device, and differentiation would then sum
    their cotangents over the devices (wrong gradients; benchmarks/NOTES.md, "Expert
    parallelism", item 6).
    """
    return jnp.zeros_like(operand, shape=(rows, *operand.shape[1:]))


def ragged_exchange(
    x_th, ids_tk, weights_tk, expert_fn: ExpertFn, *, num_experts: int, axis_name: str,
    capacity_factor: float | None, min_updates_per_peer: int | None = None,
    ragged_all_to_all=jax.lax.ragged_all_to_all,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Exchange with ``jax.lax.ragged_all_to_all`` (signature: :mod:`sharding.exchange`).

    One ragged update per (peer, local expert), each cut into slices (see
    :func:`~sharding.exchange.layout.split_updates`) until there are at least
    ``min_updates_per_peer`` updates per peer (None: :func:`default_min_updates_per_peer`).
    The receive buffer is a bucket of at most
    :func:`~sharding.exchange.layout.worst_case_received` rows (or the capacity).
    ``ragged_all_to_all``: the collective, or its twin where the backend has none.
    ``rows_sent``: the (token, expert) rows this device sends to other devices.
    """
    if min_updates_per_peer is None:
        min_updates_per_peer = default_min_updates_per_peer()
    devices, e_l, me = expert_axis(num_experts, axis_name)
    t, k = ids_tk.shape
    split = max(1, math.ceil(min_updates_per_peer / e_l))
    x_mh_sorted, group_sizes_e, order_m = dispatch(x_th, ids_tk, num_experts)
    counts_sde = gather_counts(group_sizes_e, devices, e_l, axis_name)
    worst = worst_case_received(t, k, devices, e_l)
    capacity = capacity_rows(capacity_factor, t * k)
    if capacity is not None:
        worst = min(worst, capacity)
    buckets = buffer_buckets(t * k, worst)
    needed = jnp.max(jnp.sum(counts_sde, axis=(0, 2)))

    def branch(rows: int):
        layout = exchange_layout(counts_sde, me, capacity=rows)
        forward = split_updates(layout.input_offsets_de, layout.send_sizes_de, layout.output_offsets_de,
                                layout.recv_sizes_se, split)
        x_mh = ragged_all_to_all(x_mh_sorted, _receive_buffer(x_mh_sorted, rows), *forward, axis_name=axis_name)
        y_mh = expert_fn(x_mh, layout.group_sizes_e)
        back = split_updates(layout.recv_offsets_se, layout.recv_sizes_se, layout.return_offsets_se,
                             layout.send_sizes_de, split)
        # Rows never returned (padding tokens, dropped rows) stay zero.
        y_mh_sorted = ragged_all_to_all(y_mh, _receive_buffer(y_mh, t * k), *back, axis_name=axis_name)
        rows_sent = jnp.sum(layout.send_sizes_de) - jnp.sum(layout.send_sizes_de[me])
        return y_mh_sorted, layout.dropped, rows_sent.astype(jnp.int32)

    y_mh_sorted, dropped, rows_sent = switch_on_size(needed, buckets, branch)
    return combine(y_mh_sorted, order_m, weights_tk), dropped, rows_sent
