"""What the expert-parallel exchanges share, called inside ``shard_map`` over the expert axis:
the expert axis's shape, the all-gather of row counts, and the run-time choice of a buffer
size among static buckets (:func:`sharding.exchange.layout.buffer_buckets`)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax

from sharding.exchange.layout import bucket_index

#: ``expert_fn(x_mh, group_sizes_e, row_token_m=None, token_row_tk=None) -> y_mh``: this device's
#: experts on rows sorted by local expert; with ``row_token_m`` (int32 ``[M]``) ``x`` is ``[T, H]``
#: and row ``m`` is ``x[row_token_m[m]]``, which a kernel may read in place instead of a gathered
#: copy; ``token_row_tk`` (int32 ``[T, k]``, with it) is its transpose, each token's rows (entries
#: outside ``[0, M)``: none), from which the gradient of ``x`` is a gather, not a scatter-add.
ExpertFn = Callable[..., jax.Array]


def capacity_rows(capacity_factor: float | None, rows: int) -> int | None:
    """Rows a device keeps under ``capacity_factor`` (at least one), or None for dropless."""
    return None if capacity_factor is None else max(1, math.ceil(capacity_factor * rows))


def switch_on_size(needed: jax.Array, buckets: tuple[int, ...], branch: Callable[[int], tuple]) -> tuple:
    """``branch(size)`` for the first bucket size that holds ``needed`` rows; ``needed`` must
    be the same on every device whose collectives the branch runs. The exchanges gather it over
    the expert axis, so a branch may communicate over that axis only, in its gradient too:
    devices of two data-parallel groups can take different branches (the caller sums gradients
    over other axes outside the exchange)."""
    if len(buckets) == 1:
        return branch(buckets[0])
    return jax.lax.switch(bucket_index(needed, buckets), [functools.partial(branch, b) for b in buckets])


def expert_axis(num_experts: int, axis_name: str) -> tuple[int, int, jax.Array]:
    """The expert axis's size ``D``, the experts per device ``E_l``, this device's index."""
    devices = jax.lax.axis_size(axis_name)
    if num_experts % devices:
        raise ValueError(f"num_experts: {num_experts}, which the expert axis {axis_name!r} of {devices} devices "
                         "does not divide")
    return devices, num_experts // devices, jax.lax.axis_index(axis_name)


def gather_counts(group_sizes_e: jax.Array, devices: int, experts_per_device: int, axis_name: str) -> jax.Array:
    """Every device's rows per (destination, local expert): int32 ``[D (source), D, E_l]``."""
    counts_de = group_sizes_e.reshape(devices, experts_per_device)
    return jax.lax.all_gather(counts_de, axis_name)
