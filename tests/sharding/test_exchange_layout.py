"""The exchange layout against a numpy model of expert-major receive buffers, and the
layout replayed through a numpy model of ``jax.lax.ragged_all_to_all``'s documented semantics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sharding.exchange.layout import (
    BUCKET_FACTORS,
    bucket_index,
    buffer_buckets,
    exchange_layout,
    kept_assignments,
    segment_gather_index,
    split_updates,
    token_layout,
    worst_case_received,
    worst_case_tokens_received,
    worst_case_tokens_sent,
)


def random_counts(rng, devices, experts_per_device, skew):
    """[D, D, E_l] counts; ``skew`` sends most rows to device 0's first expert."""
    counts = rng.integers(0, 7, size=(devices, devices, experts_per_device))
    if skew:
        counts[:, 0, 0] += rng.integers(20, 40, size=devices)
    return counts


def model_layout(counts_sde, capacity):
    """Row by row: each receiver lists its rows in (expert, source, row) order and keeps a prefix."""
    d, _, e_l = counts_sde.shape
    kept = np.zeros_like(counts_sde)
    pos = np.zeros_like(counts_sde)
    for r in range(d):
        position = 0
        for e in range(e_l):
            for s in range(d):
                pos[s, r, e] = position
                n = counts_sde[s, r, e]
                kept[s, r, e] = n if capacity is None else max(0, min(n, capacity - position))
                position += n
    start = np.zeros_like(counts_sde)
    for s in range(d):
        start[s] = (np.cumsum(counts_sde[s].reshape(-1)) - counts_sde[s].reshape(-1)).reshape(d, e_l)
    return kept, pos, start


@pytest.mark.parametrize("devices,experts_per_device", [(1, 3), (2, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("capacity", [None, 0, 9, 40])
@pytest.mark.parametrize("skew", [False, True])
def test_layout_matches_row_model(rng, devices, experts_per_device, capacity, skew):
    counts = random_counts(rng, devices, experts_per_device, skew)
    kept, pos, start = model_layout(counts, capacity)
    received = kept.sum(axis=(0, 2))
    for me in range(devices):
        layout = exchange_layout(jnp.asarray(counts), me, capacity=capacity)
        np.testing.assert_array_equal(layout.send_sizes_de, kept[me])
        np.testing.assert_array_equal(layout.input_offsets_de, start[me])
        np.testing.assert_array_equal(layout.recv_sizes_se, kept[:, me])
        np.testing.assert_array_equal(layout.group_sizes_e, kept[:, me].sum(0))
        np.testing.assert_array_equal(layout.return_offsets_se, start[:, me])
        # Offsets of segments that keep rows; empty segments may point anywhere.
        some = kept[me] > 0
        np.testing.assert_array_equal(np.asarray(layout.output_offsets_de)[some], pos[me][some])
        some = kept[:, me] > 0
        np.testing.assert_array_equal(np.asarray(layout.recv_offsets_se)[some], pos[:, me][some])
        assert int(layout.received) == received[me]
        assert int(layout.dropped) == counts[:, me].sum() - received[me]
        assert int(layout.max_received) == received.max()
        assert int(layout.max_sent_per_peer) == kept.sum(axis=2).max()


def numpy_ragged_all_to_all(operands, outputs, input_offsets, send_sizes, output_offsets, recv_sizes):
    """``jax.lax.ragged_all_to_all`` as its docstring defines it, for all devices at once.

    Also checks what the GPU kernel would not: sizes agree at both ends and every slice, empty
    ones included, lies inside its buffer.
    """
    d = len(operands)
    results = [o.copy() for o in outputs]
    updates = len(input_offsets[0]) // d
    for src in range(d):
        for i in range(d * updates):
            dst, j = divmod(i, updates)
            n = send_sizes[src][i]
            assert n == recv_sizes[dst][src * updates + j], "send and receive sizes disagree"
            lo, at = input_offsets[src][i], output_offsets[src][i]
            assert 0 <= lo and lo + n <= len(operands[src])
            assert 0 <= at and at + n <= len(results[dst]), "slice outside the receive buffer"
            results[dst][at:at + n] = operands[src][lo:lo + n]
    return results


@pytest.mark.parametrize("devices,experts_per_device", [(2, 4), (4, 2), (3, 1)])
@pytest.mark.parametrize("capacity", [None, 12])
@pytest.mark.parametrize("split", [1, 3])
def test_ragged_round_trip(rng, devices, experts_per_device, capacity, split):
    """Rows reach their expert's owner expert-major, and come back to where they started."""
    counts = random_counts(rng, devices, experts_per_device, skew=True)
    kept, _, _ = model_layout(counts, capacity)
    rows = counts.sum(axis=(1, 2)).max()
    buffer = int(kept.sum(axis=(0, 2)).max()) if capacity is None else capacity
    # Row value = (source, destination, expert, index) encoded, so placement is checkable.
    sorted_rows = []
    for s in range(devices):
        tags = [(s * 1000 + dd * 100 + e * 10) * 1000 + j
                for dd in range(devices) for e in range(experts_per_device) for j in range(counts[s, dd, e])]
        sorted_rows.append(np.array(tags + [-1] * (rows - len(tags)), np.int64))
    layouts = [exchange_layout(jnp.asarray(counts), me, capacity=capacity) for me in range(devices)]
    fwd = [split_updates(p.input_offsets_de, p.send_sizes_de, p.output_offsets_de, p.recv_sizes_se, split) for p in layouts]
    received = numpy_ragged_all_to_all(
        sorted_rows, [np.full(buffer, -2, np.int64)] * devices, *[[np.asarray(f[i]) for f in fwd] for i in range(4)]
    )
    for r in range(devices):
        expected = [(s * 1000 + r * 100 + e * 10) * 1000 + j
                    for e in range(experts_per_device) for s in range(devices) for j in range(kept[s, r, e])]
        np.testing.assert_array_equal(received[r][:len(expected)], expected)
        assert (received[r][len(expected):] == -2).all()
    back = [split_updates(p.recv_offsets_se, p.recv_sizes_se, p.return_offsets_se, p.send_sizes_de, split) for p in layouts]
    returned = numpy_ragged_all_to_all(
        received, [np.full(rows, -3, np.int64)] * devices, *[[np.asarray(b[i]) for b in back] for i in range(4)]
    )
    for s in range(devices):
        row = 0
        for dd in range(devices):
            for e in range(experts_per_device):
                n, k = counts[s, dd, e], kept[s, dd, e]
                np.testing.assert_array_equal(returned[s][row:row + k], sorted_rows[s][row:row + k])
                assert (returned[s][row + k:row + n] == -3).all(), "a dropped row came back"
                row += n


def test_split_updates_cuts_consistently():
    sizes = jnp.array([[0, 5], [7, 1]])
    offsets = jnp.array([[0, 0], [5, 12]])
    in_off, send, out_off, recv = split_updates(offsets, sizes, offsets + 100, sizes, 3)
    np.testing.assert_array_equal(send, [0, 0, 0, 1, 2, 2, 2, 2, 3, 0, 0, 1])
    np.testing.assert_array_equal(in_off, [0, 0, 0, 0, 1, 3, 5, 7, 9, 12, 12, 12])
    np.testing.assert_array_equal(out_off, np.asarray(in_off) + 100)
    np.testing.assert_array_equal(recv, send)


def test_segment_gather_index():
    index, valid = segment_gather_index(jnp.array([3, 0, 2]), jnp.array([2, 0, 2]), jnp.array([10, 99, 20]), 7)
    np.testing.assert_array_equal(valid, [True, True, False, True, True, False, False])
    np.testing.assert_array_equal(np.where(valid, index, -1), [10, 11, -1, 20, 21, -1, -1])


def test_worst_case_received_is_reached():
    """Every token picking k experts of one device sends min(k, E_l) rows each: the bound is tight."""
    assert worst_case_received(tokens=5, top_k=8, devices=4, experts_per_device=2) == 4 * 5 * 2
    assert worst_case_received(tokens=5, top_k=2, devices=4, experts_per_device=8) == 4 * 5 * 2


def test_buffer_buckets_and_choice():
    buckets = buffer_buckets(100, 1000, (1.25, 2.0))
    assert buckets == (128, 200, 1000)
    assert buffer_buckets(100, 1000) == buffer_buckets(100, 1000, BUCKET_FACTORS)
    assert buffer_buckets(100, 150, (1.25, 2.0)) == (128, 150)
    assert buffer_buckets(3, 3, (1.25, 2.0)) == (3,)
    np.testing.assert_array_equal([bucket_index(jnp.int32(n), buckets) for n in (0, 128, 129, 200, 201, 1000)],
                                  [0, 0, 1, 1, 2, 2])
    with pytest.raises(ValueError, match="typical = 0"):
        buffer_buckets(0, 10, (1.0,))


def test_the_ragged_slicing_default_follows_the_mesh_platform():
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType
    from jax.sharding import PartitionSpec as P

    from sharding.exchange.ragged import RAGGED_MIN_UPDATES_PER_PEER, default_min_updates_per_peer

    assert default_min_updates_per_peer("cuda") == RAGGED_MIN_UPDATES_PER_PEER
    assert default_min_updates_per_peer("cpu") == 1
    seen = {}
    for platform, kind in (("cuda", "NVIDIA H200"), ("cpu", "cpu")):
        device = AbstractDevice(device_kind=kind, num_cores=None, platform=platform)
        mesh = AbstractMesh((2,), ("expert",), abstract_device=device, axis_types=(AxisType.Auto,))

        def f(x, platform=platform):
            seen[platform] = default_min_updates_per_peer()
            return x

        with jax.sharding.use_abstract_mesh(mesh):
            jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("expert"), out_specs=P("expert"))).trace(
                jax.ShapeDtypeStruct((4,), jnp.float32))
    assert seen == {"cuda": RAGGED_MIN_UPDATES_PER_PEER, "cpu": 1}  # this process's backend is cpu


@pytest.mark.parametrize("devices", [1, 2, 5])
def test_token_layout_round_trip(rng, devices):
    """Token copies reach their receivers source-major and come back where they started."""
    tokens_sd = rng.integers(0, 6, size=(devices, devices)) * (rng.random((devices, devices)) > 0.3)
    layouts = [token_layout(jnp.asarray(tokens_sd), me) for me in range(devices)]
    rows = int(tokens_sd.sum(axis=1).max())
    buffer = int(tokens_sd.sum(axis=0).max())
    sent = [np.array([s * 1000 + d * 100 + j for d in range(devices) for j in range(tokens_sd[s, d])]
                     + [-1] * (rows - tokens_sd[s].sum()), np.int64) for s in range(devices)]
    forward = [split_updates(*(a[:, None] for a in (p.input_offsets_d, p.send_sizes_d, p.output_offsets_d,
                                                    p.recv_sizes_s)), 1) for p in layouts]
    received = numpy_ragged_all_to_all(sent, [np.full(buffer, -2, np.int64)] * devices,
                                       *[[np.asarray(f[i]) for f in forward] for i in range(4)])
    for r in range(devices):
        expected = [s * 1000 + r * 100 + j for s in range(devices) for j in range(tokens_sd[s, r])]
        np.testing.assert_array_equal(received[r][:len(expected)], expected)
        assert int(layouts[r].received) == len(expected)
        assert int(layouts[r].max_received) == tokens_sd.sum(axis=0).max()
    back = [split_updates(*(a[:, None] for a in (p.recv_offsets_s, p.recv_sizes_s, p.return_offsets_s,
                                                 p.send_sizes_d)), 1) for p in layouts]
    returned = numpy_ragged_all_to_all(received, [np.full(rows, -3, np.int64)] * devices,
                                       *[[np.asarray(b[i]) for b in back] for i in range(4)])
    for s in range(devices):
        np.testing.assert_array_equal(returned[s][:tokens_sd[s].sum()], sent[s][:tokens_sd[s].sum()])


def test_kept_assignments_keep_each_experts_first_rows():
    ids_tk = np.array([[0, 2], [2, 3], [0, 4], [2, 0], [4, 4]])  # 4: no expert (padding)
    ids_tk[4] = 4
    flat = ids_tk.reshape(-1)
    order_m = np.argsort(flat, kind="stable")
    group_sizes_e = np.bincount(flat, minlength=5)[:4]
    kept_e = np.array([2, 0, 1, 5])  # expert 0 keeps 2 of 3, expert 2 one of 3, expert 3 all
    kept = np.asarray(kept_assignments(jnp.asarray(order_m), jnp.asarray(group_sizes_e), jnp.asarray(kept_e)))
    np.testing.assert_array_equal(kept.reshape(5, 2), [[True, True], [False, True], [True, False], [False, False],
                                                       [False, False]])


def test_token_bounds_are_reached():
    """Every token with k experts on k different devices, all of them on device 0's peers."""
    assert worst_case_tokens_sent(tokens=5, top_k=8, devices=4) == 5 * 4
    assert worst_case_tokens_sent(tokens=5, top_k=2, devices=4) == 5 * 2
    assert worst_case_tokens_received(tokens=5, devices=4) == 20
