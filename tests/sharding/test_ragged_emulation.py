"""The XLA:CPU twin of ``jax.lax.ragged_all_to_all`` (``sharding.exchange.emulated``) against
a numpy model written from the collective's docstring, on random offsets and sizes: empty
sends, overlapping input slices, gaps and a full output buffer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from sharding.exchange.emulated import ragged_all_to_all

D, U, N, M, H = 4, 3, 16, 16, 2  # N >= M: a full buffer may take one slice of M rows


def docstring_model(operands, outputs, input_offsets, send_sizes, output_offsets, recv_sizes):
    """The docstring's pseudo-code: each caller SENDs its slices; each receiver writes slice
    ``i`` of source ``i // U`` at that source's ``output_offsets`` with its own ``recv_sizes``."""
    results = [o.copy() for o in outputs]
    for dst in range(D):
        for i in range(D * U):
            src, j = divmod(i, U)
            sent = operands[src][input_offsets[src][dst * U + j]:][:send_sizes[src][dst * U + j]]
            at, n = output_offsets[src][dst * U + j], recv_sizes[dst][i]
            results[dst][at:at + n] = sent[:n]
    return results


def random_metadata(rng, full: bool):
    """Per device, the four ``[D * U]`` arrays. Each receiver's incoming slices are disjoint,
    in a random order with random gaps (none when ``full``: they fill all ``M`` rows); a third of
    the sizes are 0; input slices lie anywhere in the operand and may overlap."""
    sizes = rng.integers(0, 5, size=(D, D, U)) * (rng.random((D, D, U)) > 0.33)  # [source, dest, update]
    for dst in range(D):
        while sizes[:, dst].sum() > M:
            s, u = np.unravel_index(np.argmax(sizes[:, dst]), (D, U))
            sizes[s, dst, u] -= 1
        if full:
            sizes[D - 1, dst, U - 1] += M - sizes[:, dst].sum()
    out_offsets = np.zeros_like(sizes)
    for dst in range(D):
        order = rng.permutation(D * U)
        gaps = rng.multinomial(M - sizes[:, dst].sum(), np.ones(D * U + 1) / (D * U + 1))
        at = gaps[0]
        for g, i in enumerate(order):
            s, u = divmod(i, U)
            out_offsets[s, dst, u] = at
            at += sizes[s, dst, u] + gaps[g + 1]
    n_send = np.minimum(sizes, N)
    in_offsets = (rng.random(sizes.shape) * (N - n_send + 1)).astype(np.int64)
    flat = lambda a: [a[s].reshape(-1).astype(np.int32) for s in range(D)]
    recv = [sizes[:, dst].reshape(-1).astype(np.int32) for dst in range(D)]
    return flat(in_offsets), flat(sizes), flat(out_offsets), recv


@pytest.fixture(scope="module")
def emulated():
    mesh = jax.make_mesh((D,), ("x",), devices=jax.devices("cpu")[:D], axis_types=(jax.sharding.AxisType.Auto,))

    def body(operand, output, *metadata):
        metadata = [m.reshape(-1) for m in metadata]
        return ragged_all_to_all(operand.reshape(N, H), output.reshape(M, H), *metadata, axis_name="x")[None]

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))


@pytest.mark.parametrize("full", [False, True])
def test_twin_matches_the_docstring(rng, emulated, full):
    for _ in range(6):  # one compilation, several draws
        metadata = random_metadata(rng, full)
        operands = rng.standard_normal((D, N, H)).astype(np.float32)
        outputs = np.full((D, M, H), -7.0, np.float32)
        expected = docstring_model(list(operands), list(outputs), *metadata)
        got = emulated(operands, outputs, *(np.stack(a) for a in metadata))
        np.testing.assert_array_equal(np.asarray(got), np.stack(expected))
        if full:
            assert not (np.asarray(got) == -7.0).any()


def test_twin_gradient_is_the_transpose(rng, emulated):
    """The cotangent of each received row goes back to the operand row it came from."""
    metadata = random_metadata(rng, False)
    operands = rng.standard_normal((D, N, H)).astype(np.float32)
    outputs = rng.standard_normal((D, M, H)).astype(np.float32)
    r = rng.standard_normal((D, M, H)).astype(np.float32)
    stacked = [np.stack(a) for a in metadata]
    g_operand, g_output = jax.grad(lambda a, b: jnp.sum(emulated(a, b, *stacked) * r), argnums=(0, 1))(operands, outputs)
    # The model's linear map applied to unit vectors would be slow; its transpose row by row instead,
    # in float64: an operand row sent to several places sums their cotangents, in an order of
    # XLA's, so float32 may differ from this sum by its rounding (bounded below), no more.
    expected_operand = np.zeros(operands.shape)
    magnitude = np.zeros(operands.shape)
    expected_output = r.copy()
    in_off, send, out_off, recv = metadata
    for dst in range(D):
        for i in range(D * U):
            src, j = divmod(i, U)
            lo, at, n = in_off[src][dst * U + j], out_off[src][dst * U + j], recv[dst][i]
            expected_operand[src, lo:lo + n] += r[dst, at:at + n]
            magnitude[src, lo:lo + n] += np.abs(r[dst, at:at + n])
            expected_output[dst, at:at + n] = 0
    bound = D * U * 2.0**-24 * magnitude  # one float32 rounding per term added, at most D * U terms
    assert np.all(np.abs(np.asarray(g_operand, np.float64) - expected_operand) <= bound)
    np.testing.assert_array_equal(g_output, expected_output)  # kept or zeroed, never summed


def test_twin_rejects_what_the_collective_would_not_type():
    mesh = jax.make_mesh((D,), ("x",), devices=jax.devices("cpu")[:D], axis_types=(jax.sharding.AxisType.Auto,))
    meta = jnp.zeros((D * U,), jnp.int32)

    def invariant_output(operand):
        return ragged_all_to_all(operand, jnp.zeros((M, H)), meta, meta, meta, meta, axis_name="x")

    with pytest.raises(ValueError, match="output: varies over"):
        jax.jit(jax.shard_map(invariant_output, mesh=mesh, in_specs=P("x"), out_specs=P("x"))).trace(
            jax.ShapeDtypeStruct((D * N, H), jnp.float32))
    with pytest.raises(ValueError, match="axis_index_groups"):
        ragged_all_to_all(jnp.zeros((N, H)), jnp.zeros((M, H)), meta, meta, meta, meta, axis_name="x",
                          axis_index_groups=[[0, 1]])
