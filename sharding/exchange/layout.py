"""The layout of an expert-parallel exchange: pure functions of row counts, shared by the
exchanges and unit-tested on their own.

Dimension letters: ``s`` source device and ``d`` destination device (both along the expert
axis, ``D`` devices), ``e`` local expert (``E_l = E / D`` per device; global expert
``d * E_l + e`` lives on device ``d``), ``u`` update (slice) per peer, ``p`` buffer
position, ``g`` segment.

Layouts. A sender holds its ``T * k`` (token, slot) rows sorted by global expert, so its
rows for device ``d`` are contiguous and, within them, sorted by local expert. A receiver
lays out what it receives *expert-major*: all rows for its local expert 0 (from device 0,
then 1, ...), then expert 1, and so on, so the local expert MLP sees contiguous groups
without another sort, and the layout (hence which rows a capacity drops) does not depend on
how the exchange moves the rows.

Capacity. A receiver buffer of ``capacity`` rows keeps the first ``capacity`` rows in its
expert-major order and drops the rest. Kept rows form a prefix of that order, so each
(source, expert) segment keeps a prefix of its rows and kept rows sit exactly where they
would sit without a capacity: no gaps, and the local expert groups stay contiguous.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp


def exclusive_cumsum(x: jax.Array, axis: int = -1) -> jax.Array:
    """``cumsum - x`` along ``axis``, in int32."""
    x = x.astype(jnp.int32)
    return jnp.cumsum(x, axis=axis, dtype=jnp.int32) - x


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class ExchangeLayout:
    """One device's view of an exchange; all int32.

    Forward (tokens to experts), this device as sender, per destination ``d`` and its local
    expert ``e``:
      send_sizes_de ``[D, E_l]``: rows sent (after the capacity);
      input_offsets_de ``[D, E_l]``: where they start in this device's sorted rows;
      output_offsets_de ``[D, E_l]``: where they land in ``d``'s receive buffer.
    This device as receiver, per source ``s`` and this device's local expert ``e``:
      recv_sizes_se ``[D, E_l]``: rows received;
      recv_offsets_se ``[D, E_l]``: where they land in this device's receive buffer;
      return_offsets_se ``[D, E_l]``: where they came from in ``s``'s sorted rows, which
        is where their expert outputs go back to.
    Totals:
      group_sizes_e ``[E_l]``: received rows per local expert (the expert MLP's groups);
      received ``[]``: rows received; dropped ``[]``: rows dropped by the capacity here;
      max_received ``[]``: the most rows any device receives;
      max_sent_per_peer ``[]``: the most rows any device sends to any one device.
    """

    send_sizes_de: jax.Array
    input_offsets_de: jax.Array
    output_offsets_de: jax.Array
    recv_sizes_se: jax.Array
    recv_offsets_se: jax.Array
    return_offsets_se: jax.Array
    group_sizes_e: jax.Array
    received: jax.Array
    dropped: jax.Array
    max_received: jax.Array
    max_sent_per_peer: jax.Array


def exchange_layout(counts_sde: jax.Array, device: jax.Array | int, capacity: int | None = None) -> ExchangeLayout:
    """Where every row of the exchange goes, from every device's row counts.

    Args:
      counts_sde: int ``[D, D, E_l]``: rows device ``s`` routes to local expert ``e`` of
        device ``d`` (the same array on every device: an all-gather of each device's
        ``[D, E_l]`` counts).
      device: this device's index along the expert axis (may be traced).
      capacity: each device keeps at most this many received rows, the first in its
        expert-major order (see the module docstring); None keeps all.

    Returns:
      this device's :class:`ExchangeLayout`. Every device computes the same global
      quantities, so senders and receivers agree on sizes and offsets without more
      communication.
    """
    counts_sde = counts_sde.astype(jnp.int32)
    d, _, e_l = counts_sde.shape
    # Receiver d's expert-major order is (e, s): flatten that way, then prefix-sum.
    counts_des = jnp.transpose(counts_sde, (1, 2, 0))
    pos_des = exclusive_cumsum(counts_des.reshape(d, e_l * d), axis=1).reshape(d, e_l, d)
    pos_sde = jnp.transpose(pos_des, (2, 0, 1))
    if capacity is None:
        kept_sde = counts_sde
    else:
        kept_sde = jnp.clip(capacity - pos_sde, 0, counts_sde)
        # Segments dropped whole keep an offset inside the buffer: an empty slice, still in bounds.
        pos_sde = jnp.minimum(pos_sde, capacity)
    # Sender s's rows are sorted by (d, e).
    start_sde = exclusive_cumsum(counts_sde.reshape(d, d * e_l), axis=1).reshape(d, d, e_l)
    received_d = jnp.sum(kept_sde, axis=(0, 2))
    recv_sizes_se = kept_sde[:, device]
    return ExchangeLayout(
        send_sizes_de=kept_sde[device],
        input_offsets_de=start_sde[device],
        output_offsets_de=pos_sde[device],
        recv_sizes_se=recv_sizes_se,
        recv_offsets_se=pos_sde[:, device],
        return_offsets_se=start_sde[:, device],
        group_sizes_e=jnp.sum(recv_sizes_se, axis=0),
        received=received_d[device],
        dropped=jnp.sum(counts_sde[:, device]) - received_d[device],
        max_received=jnp.max(received_d),
        max_sent_per_peer=jnp.max(jnp.sum(kept_sde, axis=2)),
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenLayout:
    """One device's view of a token exchange (one copy of a token per destination device,
    :mod:`sharding.exchange.onecopy`); all int32, one update per peer.

    This device as sender, per destination ``d``: send_sizes_d ``[D]`` tokens sent;
    input_offsets_d ``[D]`` where they start in its send buffer (destination-major, token
    order within); output_offsets_d ``[D]`` where they land in ``d``'s receive buffer
    (source-major, token order within). As receiver, per source ``s``: recv_sizes_s,
    recv_offsets_s ``[D]`` (where they land here), return_offsets_s ``[D]`` (where they came
    from in ``s``'s send buffer: where their partial sums go back to). received ``[]``: tokens
    received here; max_received ``[]``: the most any device receives.
    """

    send_sizes_d: jax.Array
    input_offsets_d: jax.Array
    output_offsets_d: jax.Array
    recv_sizes_s: jax.Array
    recv_offsets_s: jax.Array
    return_offsets_s: jax.Array
    received: jax.Array
    max_received: jax.Array


def token_layout(tokens_sd: jax.Array, device: jax.Array | int) -> TokenLayout:
    """Where every token copy goes, from every device's token counts.

    Args:
      tokens_sd: int ``[D, D]``: tokens device ``s`` sends to device ``d`` (the same array on
        every device: an all-gather of each device's ``[D]`` counts).
      device: this device's index along the expert axis (may be traced).
    """
    tokens_sd = tokens_sd.astype(jnp.int32)
    at_sd = exclusive_cumsum(tokens_sd, axis=0)  # receiver d: source-major
    start_sd = exclusive_cumsum(tokens_sd, axis=1)  # sender s: destination-major
    received_d = jnp.sum(tokens_sd, axis=0)
    return TokenLayout(
        send_sizes_d=tokens_sd[device], input_offsets_d=start_sd[device], output_offsets_d=at_sd[device],
        recv_sizes_s=tokens_sd[:, device], recv_offsets_s=at_sd[:, device], return_offsets_s=start_sd[:, device],
        received=received_d[device], max_received=jnp.max(received_d),
    )


def kept_assignments(order_m: jax.Array, group_sizes_e: jax.Array, kept_e: jax.Array) -> jax.Array:
    """Which of a sender's ``T * k`` (token, slot) assignments a capacity keeps: in its rows
    sorted by expert (``order_m``, stable), the first ``kept_e[e]`` of expert ``e``'s
    ``group_sizes_e[e]``, as :func:`exchange_layout`'s ``send_sizes_de`` counts them.

    Returns bool ``[T * k]`` in assignment order (``t * k + slot``); assignments to no expert
    (ids past the last expert, sorted last) are never kept.
    """
    m = order_m.shape[0]
    ends_e = jnp.cumsum(group_sizes_e.astype(jnp.int32))
    position_m = jnp.arange(m, dtype=jnp.int32)
    e_m = jnp.searchsorted(ends_e, position_m, side="right").astype(jnp.int32)
    in_group = e_m < group_sizes_e.shape[0]
    e_m = jnp.minimum(e_m, group_sizes_e.shape[0] - 1)
    rank_m = position_m - (ends_e[e_m] - group_sizes_e[e_m])
    kept_sorted = in_group & (rank_m < kept_e.astype(jnp.int32)[e_m])
    return jnp.zeros((m,), bool).at[order_m].set(kept_sorted)


def split_updates(offsets_xe, sizes_xe, peer_offsets_xe, peer_sizes_xe, split: int):
    """The four ``jax.lax.ragged_all_to_all`` metadata arrays, one update per (peer, expert),
    each cut into ``split`` nearly equal consecutive slices.

    Cutting only adds parallelism: XLA's single-process GPU kernel gives each update its own
    thread blocks. Both ends cut a segment of ``n`` rows at the same points
    ``(j * n) // split``, so the sizes they compute agree.

    Args:
      offsets_xe: where each segment starts in this device's operand (``input_offsets``).
      sizes_xe: its rows (``send_sizes``).
      peer_offsets_xe: where it lands in the peer's output (``output_offsets``).
      peer_sizes_xe: rows this device receives from each peer per segment (``recv_sizes``).
      split: slices per segment, >= 1.

    Returns:
      ``(input_offsets_u, send_sizes_u, output_offsets_u, recv_sizes_u)``, int32
      ``[D * E_l * split]``, peer-major as ``ragged_all_to_all`` requires.
    """
    def cut(sizes):
        j = jnp.arange(split + 1, dtype=jnp.int32)
        bounds = (sizes[..., None] * j) // split  # [D, E_l, split + 1]
        return bounds[..., :-1], jnp.diff(bounds, axis=-1)

    starts, sizes = cut(sizes_xe.astype(jnp.int32))
    _, peer_sizes = cut(peer_sizes_xe.astype(jnp.int32))
    flat = lambda a: a.reshape(-1).astype(jnp.int32)
    return (
        flat(offsets_xe[..., None] + starts),
        flat(sizes),
        flat(peer_offsets_xe[..., None] + starts),
        flat(peer_sizes),
    )


def segment_gather_index(out_sizes_g, take_sizes_g, src_starts_g, length: int):
    """Indices that lay segments of a source array out back to back.

    Segment ``g`` occupies ``out_sizes_g[g]`` positions of the output, in order of ``g``;
    its first ``take_sizes_g[g]`` positions take consecutive source rows from
    ``src_starts_g[g]``; the rest, and positions past all segments, are invalid.

    Returns:
      ``(index_p int32 [length], valid_p bool [length])``; invalid positions index 0.
    """
    out_sizes_g = out_sizes_g.astype(jnp.int32)
    ends_g = jnp.cumsum(out_sizes_g)
    p = jnp.arange(length, dtype=jnp.int32)
    g = jnp.searchsorted(ends_g, p, side="right", method="scan_unrolled").astype(jnp.int32)
    in_range = g < out_sizes_g.shape[0]
    g = jnp.minimum(g, out_sizes_g.shape[0] - 1)
    within = p - (ends_g[g] - out_sizes_g[g])
    valid = in_range & (within < take_sizes_g[g])
    return jnp.where(valid, src_starts_g[g] + within, 0).astype(jnp.int32), valid


def worst_case_received(tokens: int, top_k: int, devices: int, experts_per_device: int) -> int:
    """The most rows one device can receive, dropless: ``D * T * min(k, E_l)``.

    Proof: each of the ``D`` devices on the expert axis routes ``T`` tokens; a token's
    ``k`` experts are distinct (top-k picks distinct indices), and at most ``E_l`` of them
    live on any one device, so a token sends at most ``min(k, E_l)`` rows to it. Padding
    tokens send none. Should ids ever repeat within a token, the layout still never writes
    past the buffer: the surplus is dropped and counted.
    """
    return devices * tokens * min(top_k, experts_per_device)


def worst_case_tokens_sent(tokens: int, top_k: int, devices: int) -> int:
    """The most token copies one device sends in a token exchange: ``T * min(k, D)``.

    Proof: a token's ``k`` distinct experts live on at most ``min(k, D)`` devices, and it is
    sent once to each.
    """
    return tokens * min(top_k, devices)


def worst_case_tokens_received(tokens: int, devices: int) -> int:
    """The most token copies one device receives in a token exchange: ``D * T``.

    Proof: each of the ``D`` devices sends each of its ``T`` tokens at most once to it. A
    token sent carries at least one kept assignment for it, so the copies received are also at
    most the (token, expert) rows received there (:func:`worst_case_received`, or a capacity).
    """
    return devices * tokens


#: Buffer sizes compiled besides the worst case, as multiples of the balanced load.
BUCKET_FACTORS = (1.25, 2.0)


def buffer_buckets(
    typical: int, worst: int, factors: tuple[float, ...] = BUCKET_FACTORS, multiple: int = 8
) -> tuple[int, ...]:
    """Increasing static buffer sizes to choose from at run time, the last ``worst``.

    Each ``factor * typical`` is rounded up to a multiple of ``multiple`` and capped at
    ``worst``; duplicates are removed. With ``worst`` last, the largest bucket always fits.
    """
    if worst < 1 or typical < 1:
        raise ValueError(f"buffer_buckets: typical = {typical}, worst = {worst}; expected both >= 1")
    sizes = {min(worst, multiple * math.ceil(f * typical / multiple)) for f in factors}
    return tuple(sorted(sizes | {worst}))


def bucket_index(needed: jax.Array, buckets: tuple[int, ...]) -> jax.Array:
    """The first bucket holding ``needed`` rows (the last one if none does)."""
    index = jnp.searchsorted(jnp.asarray(buckets, jnp.int32), needed.astype(jnp.int32), side="left")
    return jnp.minimum(index, len(buckets) - 1).astype(jnp.int32)
