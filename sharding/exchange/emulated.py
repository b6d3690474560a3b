"""A twin of ``jax.lax.ragged_all_to_all`` for backends without the collective (XLA:CPU:
"UNIMPLEMENTED: HLO opcode ragged-all-to-all"), built from collectives every backend has.

Same arguments, same result as the collective's docstring defines them: the caller sends
``operand[input_offsets[i]:input_offsets[i] + send_sizes[i]]`` to device
``i // (N / D)``; a receiver writes what device ``s`` sends in its ``j``-th update to
``result[o:o + recv_sizes[s * U + j]]``, ``o`` being the sender's ``output_offsets`` entry for
that update; every other row of ``result`` is ``output``'s.

How: an ``all_gather`` of the operands and an ``all_to_all`` of the senders' offsets, then one
gather: each output row looks up the update that covers it. Every device receives every
operand, ``(D - 1) * N`` rows per device: correct, not fast. The docstring leaves the order of
overlapping writes open; here the last update (in source, then update order) wins.
Differentiable by composition (the gather's and ``all_gather``'s transposes).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _varying(a) -> frozenset:
    manual = getattr(jax.typeof(a), "manual_axis_type", None)
    return frozenset(getattr(manual, "varying", ()) or ())


def _check(operand, output, metadata, devices: int) -> int:
    """Raises ValueError naming the first argument the collective would reject; returns the
    updates per peer."""
    if operand.shape[1:] != output.shape[1:] or operand.dtype != output.dtype:
        raise ValueError(f"output: {output.dtype}{list(output.shape)}, expected {operand.dtype}[M, "
                         f"{', '.join(map(str, operand.shape[1:]))}] like operand")
    names = ("input_offsets", "send_sizes", "output_offsets", "recv_sizes")
    length = metadata[0].shape
    for name, a in zip(names, metadata):
        if a.ndim != 1 or a.shape != length or not jnp.issubdtype(a.dtype, jnp.integer):
            raise ValueError(f"{name}: {a.dtype}{list(a.shape)}, expected integers of one shape [N] like input_offsets")
    if length[0] % devices:
        raise ValueError(f"input_offsets: {length[0]} updates, not a multiple of the {devices} devices of the axis")
    # The collective types its result like ``output``: an ``output`` that does not vary where the
    # operand does would, on a GPU, make differentiation sum the received rows' cotangents over
    # the devices. The twin cannot reproduce that silently wrong typing, so it refuses it.
    if not _varying(operand) <= _varying(output):
        raise ValueError(f"output: varies over {sorted(_varying(output))}, expected at least the operand's "
                         f"{sorted(_varying(operand))} (the collective types its result like output)")
    return length[0] // devices


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name,
                      axis_index_groups=None):
    """``jax.lax.ragged_all_to_all`` from ``all_gather`` + ``all_to_all`` + a gather.

    Args and result: as ``jax.lax.ragged_all_to_all`` (``operand [N, ...]``, ``output [M,
    ...]`` of its dtype, four integer ``[D * U]`` arrays, peer-major); call it inside
    ``shard_map`` over ``axis_name``.

    Raises:
      ValueError: an argument of the wrong shape or dtype, or ``axis_index_groups``.
    """
    if axis_index_groups is not None:
        raise ValueError(f"axis_index_groups: {axis_index_groups!r}, expected None (the emulation has no groups)")
    devices = jax.lax.axis_size(axis_name)
    updates = _check(operand, output, (input_offsets, send_sizes, output_offsets, recv_sizes), devices)
    n, m = operand.shape[0], output.shape[0]
    if m == 0 or n == 0:  # nothing to write, or nothing any device can send (operands share a shape)
        return output
    operands_sn = jax.lax.all_gather(operand, axis_name)  # [D (source), N, ...]

    def from_sources(a):  # [D * U] per sender -> what each source's updates to this device say, flat [D * U]
        return jax.lax.all_to_all(a.astype(jnp.int32).reshape(devices, updates), axis_name, 0, 0,
                                  tiled=True).reshape(-1)

    start_g, at_g = from_sources(input_offsets), from_sources(output_offsets)
    size_g = recv_sizes.astype(jnp.int32)  # the receiver's sizes, as the docstring's RECEIVE writes them
    p = jnp.arange(m, dtype=jnp.int32)
    covered_pg = (p[:, None] >= at_g) & (p[:, None] < at_g + size_g)
    groups = covered_pg.shape[1]
    last_p = groups - 1 - jnp.argmax(covered_pg[:, ::-1], axis=1).astype(jnp.int32)
    row_p = start_g[last_p] + p - at_g[last_p]
    # Out-of-range rows are the caller's error (the collective's result is unspecified there); clamp.
    values = operands_sn[last_p // updates, jnp.clip(row_p, 0, n - 1)]
    written = jnp.any(covered_pg, axis=1).reshape((m,) + (1,) * (operand.ndim - 1))
    return jnp.where(written, values, output)
