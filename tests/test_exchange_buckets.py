"""The exchanges' run-time choice of a buffer size, for every expert-parallel exchange: each
branch of ``sharding.exchange.common.switch_on_size`` over
``sharding.exchange.layout.buffer_buckets`` taken, by a load on each bucket's edge and one token
per device past it, up to the worst case (dropless) or past the capacity (drops counted), with
the two data-parallel groups of one call in different branches; outputs, drop counts and
gradients against a float64 model of the routing, and which bucket each device took.

The other tests compile the worst-case buffer alone (``tests/conftest.py``); these, marked
``buffer_buckets``, compile every bucket. The exchanges run on a toy expert (a row times one
plus its global expert), so a row that reached the wrong expert, was dropped or came back twice
shows in the output.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import EP_EXCHANGES, names
from jax.sharding import PartitionSpec as P

import moe_jax
from moe_jax.traffic import RAGGED_COLLECTIVE
from sharding.exchange.common import switch_on_size
from sharding.exchange.emulated import ragged_all_to_all as emulated

pytestmark = pytest.mark.buffer_buckets

EP, DATA, E, K, H = 4, 2, 8, 2, 4
E_L = E // EP
T = 32  # tokens per device: the dropless buckets are 80, 128, 256 received rows (24, 32, 64 per peer for padded)
CAPACITY_FACTOR = 1.5  # 96 received rows per device: buckets 80, 96

#: Per data-parallel group: how many tokens of each device route both slots to device 0's
#: experts; the others route nowhere (padding), or with ``spread`` to two experts of device
#: ``1 + t % 3``. Device 0 then receives ``8 h`` rows (padded: ``2 h`` from each peer), so the
#: loads sit on the edges of the buckets above and one token per device past them.
DROPLESS_CALLS = [((10, False), (11, False)), ((12, False), (13, False)), ((16, False), (17, False)),
                  ((32, False), (0, True))]
CAPACITY_CALLS = [((10, False), (0, True)), ((32, False), (12, True))]


def expert_by_id(x_mh, group_sizes_e, row_token_m=None, token_row_tk=None):
    """Each row times one plus its global expert; rows past the groups are padding. With
    ``row_token_m`` (the exchanges that gather locally) row ``m`` is ``x[row_token_m[m]]``."""
    x_mh = x_mh if row_token_m is None else x_mh[row_token_m]
    local_m = jnp.searchsorted(jnp.cumsum(group_sizes_e), jnp.arange(x_mh.shape[0]), side="right")
    return x_mh * (1.0 + jax.lax.axis_index("expert") * group_sizes_e.shape[0] + local_m)[:, None]


def routing(call) -> np.ndarray:
    """Expert ids ``[DATA * EP * T, K]`` for one call's two groups (see :data:`DROPLESS_CALLS`)."""
    ids_gstk = np.full((DATA, EP, T, K), E)
    for g, (hot, spread) in enumerate(call):
        for t in range(T):
            if t < hot:
                ids_gstk[g, :, t] = (0, 1)
            elif spread:
                ids_gstk[g, :, t] = (2 * (1 + t % 3), 2 * (1 + t % 3) + 1)
    return ids_gstk.reshape(-1, K)


def kept_rows(ids_tk: np.ndarray, capacity: int | None) -> np.ndarray:
    """Which assignments a receiver keeps: the first ``capacity`` rows of its expert-major order
    (local expert, source device, token), as ``sharding.exchange.layout`` defines it."""
    ids_gstk = ids_tk.reshape(DATA, EP, T, K)
    kept = np.zeros(ids_gstk.shape, bool)
    for g in range(DATA):
        for receiver in range(EP):
            rows = sorted((ids_gstk[g, s, t, j] % E_L, s, t, j) for s in range(EP) for t in range(T) for j in range(K)
                          if ids_gstk[g, s, t, j] < E and ids_gstk[g, s, t, j] // E_L == receiver)
            for _, s, t, j in rows[:capacity]:
                kept[g, s, t, j] = True
    return kept.reshape(ids_tk.shape)


@pytest.mark.parametrize("capacity_factor", [None, CAPACITY_FACTOR], ids=["dropless", "capacity"])
@pytest.mark.parametrize("exchange", names(EP_EXCHANGES))
def test_every_bucket_matches_the_model(rng, cpu_devices, monkeypatch, exchange, capacity_factor):
    run = moe_jax.EXCHANGE[exchange].run
    options = {"ragged_all_to_all": emulated} if exchange in RAGGED_COLLECTIVE else {}
    buckets_traced, taken = [], []  # taken: (group, device, needed, bucket) per device and call

    def recording_switch(needed, buckets, branch):
        buckets_traced.append(buckets)

        def recorded(size):
            jax.debug.callback(lambda g, d, n: taken.append((int(g), int(d), int(n), size)),
                               jax.lax.axis_index("data"), jax.lax.axis_index("expert"), needed)
            return branch(size)

        return switch_on_size(needed, buckets, recorded)

    monkeypatch.setattr(sys.modules[run.__module__], "switch_on_size", recording_switch)
    mesh = jax.make_mesh((DATA, EP), ("data", "expert"), devices=cpu_devices[:EP * DATA],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    tokens = P(("data", "expert"))

    def body(x_th, ids_tk, weights_tk):
        y_th, dropped, _ = run(x_th, ids_tk, weights_tk, expert_by_id, num_experts=E, axis_name="expert",
                               capacity_factor=capacity_factor, **options)
        return y_th, jax.lax.psum(dropped, ("data", "expert"))

    layer = jax.shard_map(body, mesh=mesh, in_specs=tokens, out_specs=(tokens, P()))

    def loss(x_th, weights_tk, ids_tk, r_th):
        y_th, dropped = layer(x_th, ids_tk, weights_tk)
        return jnp.sum(y_th * r_th), (y_th, dropped)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    capacity = None if capacity_factor is None else int(np.ceil(capacity_factor * T * K))
    split_calls = dropping_calls = 0
    for call in DROPLESS_CALLS if capacity is None else CAPACITY_CALLS:
        ids_tk = routing(call)
        x_th = rng.standard_normal((len(ids_tk), H)).astype(np.float32)
        weights_tk = rng.uniform(0.5, 1.5, ids_tk.shape).astype(np.float32)
        r_th = rng.standard_normal(x_th.shape).astype(np.float32)
        first = len(taken)
        (_, (y_th, dropped)), (dx_th, dw_tk) = step(x_th, weights_tk, jnp.asarray(ids_tk, jnp.int32), r_th)
        jax.effects_barrier()

        kept_tk = kept_rows(ids_tk, capacity)
        factor_tk = np.where(kept_tk, 1.0 + ids_tk, 0.0)  # the toy expert's; 0 where dropped
        np.testing.assert_allclose(y_th, np.einsum("tk,th->th", weights_tk * factor_tk, x_th), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(dx_th, np.einsum("tk,th->th", weights_tk * factor_tk, r_th), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(dw_tk, factor_tk * np.sum(x_th * r_th, axis=1)[:, None], rtol=1e-5, atol=1e-5)
        assert int(dropped) == int(np.sum((ids_tk < E) & ~kept_tk)), call
        dropping_calls += int(dropped) > 0
        assert len(taken) - first == EP * DATA, taken[first:]
        sizes_g = [{size for g, _, _, size in taken[first:] if g == group} for group in range(DATA)]
        split_calls += sizes_g[0] != sizes_g[1]

    (buckets,) = set(buckets_traced)
    assert len(buckets) > 1, buckets
    # Each device took the first bucket that holds what it needs, the last if none does.
    for _, _, needed, size in taken:
        assert size == next((b for b in buckets if b >= needed), buckets[-1]), (needed, size, buckets)
    # Two data-parallel groups of one call in different branches: a branch may communicate over
    # the expert axis only (switch_on_size), or the devices wait in different collectives.
    assert split_calls > 0
    loads = {(needed, size) for _, _, needed, size in taken}
    if capacity is None:
        # Every bucket taken; each but the last on its edge and overflowing into the next.
        assert {size for _, size in loads} == set(buckets)
        for b, above in zip(buckets, buckets[1:]):
            assert (b, b) in loads and any(needed > b and size == above for needed, size in loads), (b, loads)
    else:
        # Under a capacity: more than one bucket taken, and rows dropped (and counted) in some call.
        assert len({size for _, size in loads}) > 1 and dropping_calls > 0, loads
