"""Inputs at the edges of what the layer takes: no tokens, any leading shape on every mesh the
library makes (Explicit axes), one token as ``[H]``, and non-finite tokens in the statistics.

Expert-parallel outputs are compared with the single-device layer at the tolerance
``tests/test_expert_parallel.py`` explains (a couple of bf16 ulps of a token's largest
element); statistics must match exactly, the loss to float32 rounding.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import (
    EP_EXCHANGES, FORWARD, assert_same_output, assert_same_stats, names, random_tokens, swap_exchange,
)
from harness import mesh_for as harness_mesh_for
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_jax import MoEConfig, ResolutionError, init_params, moe_forward, resolve
from moe_jax.layer import shard_params
from sharding.local import combine, dispatch

E, H, F = 16, 32, 32
CONFIG = MoEConfig(num_experts=E, top_k=2, hidden_size=H, expert_intermediate_size=F, num_shared_experts=1,
                   expert_gemm="xla")
MESHES = {  # (expert_parallel, data_parallel): 2, 4 and 8 devices
    "ep2": (2, 1), "ep4": (4, 1), "ep8": (8, 1), "ep2xdp4": (2, 4), "ep4xdp2": (4, 2),
}


def mesh_for(name, cpu_devices):
    ep, dp = MESHES[name]
    return harness_mesh_for(ep, cpu_devices, dp)


@pytest.fixture(scope="module")
def params():
    return init_params(CONFIG, jax.random.key(0))


def single_device(params, x, cpu_devices):
    return FORWARD(params, x, resolve(CONFIG, cpu_devices[:1]))


def on_mesh(params, x, mesh):
    plan = resolve(CONFIG, mesh)
    assert plan.exchange == "padded"  # auto on CPU
    return FORWARD(shard_params(params, plan), x, plan)


def assert_empty_stats(stats):
    assert stats["tokens_per_expert"].dtype == jnp.int32
    np.testing.assert_array_equal(stats["tokens_per_expert"], np.zeros(E))
    assert float(stats["load_balance_loss"]) == 0.0
    assert int(stats["dropped"]) == 0 and int(stats["nonfinite_tokens"]) == 0


# --- no tokens ---

@pytest.mark.parametrize("shape", [(0, H), (2, 0, H), (0, 3, H)])
def test_no_tokens_on_one_device(params, cpu_devices, shape):
    y, stats = single_device(params, jnp.zeros(shape, jnp.bfloat16), cpu_devices)
    assert y.shape == shape and y.dtype == jnp.bfloat16
    assert_empty_stats(stats)


@pytest.mark.parametrize("mesh_name,shape", [("ep2", (0, H)), ("ep8", (2, 0, H)), ("ep2xdp4", (0, H))])
def test_no_tokens_on_a_mesh(params, cpu_devices, mesh_name, shape):
    y, stats = on_mesh(params, jnp.zeros(shape, jnp.bfloat16), mesh_for(mesh_name, cpu_devices))
    assert y.shape == shape and y.dtype == jnp.bfloat16
    assert_empty_stats(stats)


@pytest.mark.parametrize("exchange", names(EP_EXCHANGES))
def test_no_tokens_with_each_exchange(params, cpu_devices, exchange):
    """Where the exchange cannot run here (ragged on XLA:CPU), the layer is traced and lowered
    only, which is where the empty batch failed ("buffer_buckets: typical = 0"): resolution never
    picks it here, so its decision is swapped in, as tests/test_expert_parallel.py does."""
    mesh = mesh_for("ep4xdp2", cpu_devices)
    x = jnp.zeros((0, H), jnp.bfloat16)
    try:
        plan = resolve(dataclasses.replace(CONFIG, exchange=exchange), mesh)
    except ResolutionError:
        plan = swap_exchange(resolve(CONFIG, mesh), exchange)
        y_type, _ = FORWARD.lower(shard_params(params, plan), x, plan).out_info
        assert y_type.shape == (0, H)
        return
    y, stats = FORWARD(shard_params(params, plan), x, plan)
    assert y.shape == (0, H) and y.dtype == jnp.bfloat16
    assert_empty_stats(stats)


def test_local_dispatch_and_combine_take_no_tokens():
    x_ch, group_sizes_e, order_m = dispatch(jnp.zeros((0, H)), jnp.zeros((0, 2), jnp.int32), E)
    assert x_ch.shape == (0, H) and int(group_sizes_e.sum()) == 0
    assert combine(x_ch, order_m, jnp.zeros((0, 2))).shape == (0, H)


# --- any leading shape, on every mesh the library makes ---

def test_make_mesh_axes_are_explicit(cpu_devices):
    # The premise of the tests below: shardings are part of the types, so reshapes must keep
    # them expressible (jax 0.11's jax.make_mesh defaults to Explicit axes).
    assert set(mesh_for("ep4xdp2", cpu_devices).axis_types) == {jax.sharding.AxisType.Explicit}


# Each mesh with a shape whose token count its devices divide and one they do not, each shape on
# at least two meshes (the reshapes are the same code on every mesh; the split of the tokens is
# what differs). ep4xdp2's shapes are also those of the output-sharding test below: one compilation.
LEADING = [("ep2", (4, 16, H)), ("ep2", (H,)), ("ep4", (2, 4, 8, H)), ("ep4", (3, 5, H)), ("ep8", (16, 4, H)),
           ("ep8", (H,)), ("ep2xdp4", (2, 4, 8, H)), ("ep2xdp4", (3, 5, H)), ("ep4xdp2", (4, 16, H)),
           ("ep4xdp2", (16, 4, H)), ("ep4xdp2", (3, 5, H)), ("ep4xdp2", (H,))]


@pytest.mark.parametrize("mesh_name,shape", LEADING)
def test_any_leading_shape_matches_one_device(rng, params, cpu_devices, mesh_name, shape):
    x = random_tokens(rng, shape)
    y_ref, stats_ref = single_device(params, x, cpu_devices)
    y, stats = on_mesh(params, x, mesh_for(mesh_name, cpu_devices))
    assert y.shape == shape and y.dtype == jnp.bfloat16
    assert_same_output(y.reshape(-1, H), y_ref.reshape(-1, H))
    assert_same_stats(stats, stats_ref)


@pytest.mark.parametrize("shape,spec", [
    ((4, 16, H), P(None, ("data", "expert"))),  # split along a later leading dimension
    ((2, 4, 8, H), P("data", "expert")),
    ((16, 4, H), P(("data", "expert"))),  # split along the first: kept, no gather
    ((8, H), P(None, "expert")),  # split along H
])
def test_x_may_come_with_any_sharding(rng, params, cpu_devices, shape, spec):
    mesh = mesh_for("ep4xdp2", cpu_devices)
    x = random_tokens(rng, shape)
    y_ref, _ = single_device(params, x, cpu_devices)
    y, _ = on_mesh(params, jax.device_put(x, NamedSharding(mesh, spec)), mesh)
    assert_same_output(y.reshape(-1, H), y_ref.reshape(-1, H))


@pytest.mark.parametrize("shape,split", [((16, 4, H), True), ((64, H), True), ((4, 16, H), False), ((3, 5, H), False)])
def test_the_output_is_split_along_its_first_dimension_when_it_divides(rng, params, cpu_devices, shape, split):
    mesh = mesh_for("ep4xdp2", cpu_devices)
    y, _ = on_mesh(params, random_tokens(rng, shape), mesh)
    expected = P(("data", "expert") if split else None, *(None,) * (len(shape) - 1))
    assert y.sharding.spec == expected


def test_one_token_as_a_vector(rng, params, cpu_devices):
    x = random_tokens(rng, (H,))
    y, stats = single_device(params, x, cpu_devices)
    y_row, stats_row = single_device(params, x[None], cpu_devices)
    assert y.shape == (H,)
    np.testing.assert_array_equal(y, y_row[0])
    assert int(stats["tokens_per_expert"].sum()) == CONFIG.top_k


@pytest.mark.parametrize("x", [jnp.zeros(()), np.float32(1.0), [0.0] * H])
def test_no_hidden_dimension_is_an_error(params, x):
    expected = rf"^x: .*, expected (an array )?\[\.\.\., H\] with H = config.hidden_size = {H}$"
    with pytest.raises(ValueError, match=expected):
        moe_forward(params, x, resolve(CONFIG))


# --- non-finite tokens in the statistics ---

def poison(x, rows, value):
    return x.at[jnp.asarray(rows), 3].set(value)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_a_non_finite_token_is_left_out_of_the_statistics(rng, params, cpu_devices, value):
    x = random_tokens(rng, (32, H))
    clean, _ = single_device(params, x, cpu_devices)
    y, stats = single_device(params, poison(x, [7], value), cpu_devices)
    _, stats_without = single_device(params, jnp.delete(x, 7, axis=0), cpu_devices)
    assert int(stats["nonfinite_tokens"]) == 1 and stats["nonfinite_tokens"].dtype == jnp.int32
    assert np.isfinite(float(stats["load_balance_loss"]))
    np.testing.assert_array_equal(stats["tokens_per_expert"], stats_without["tokens_per_expert"])
    np.testing.assert_allclose(stats["load_balance_loss"], stats_without["load_balance_loss"], rtol=1e-6)
    others = np.arange(32) != 7
    np.testing.assert_array_equal(np.asarray(y)[others], np.asarray(clean)[others])


def test_a_token_whose_router_logits_overflow_is_left_out(rng, params, cpu_devices):
    # Finite activations whose logit for expert 0 exceeds float32: sign-matched to that
    # expert's router row, every product adds up.
    x = random_tokens(rng, (16, H), jnp.float32)
    big_h = 3e38 * jnp.sign(params["router"]["w_eh"][0])
    y, stats = single_device(params, x.at[5].set(big_h), cpu_devices)
    _, stats_without = single_device(params, jnp.delete(x, 5, axis=0), cpu_devices)
    assert int(stats["nonfinite_tokens"]) == 1
    np.testing.assert_array_equal(stats["tokens_per_expert"], stats_without["tokens_per_expert"])
    np.testing.assert_allclose(stats["load_balance_loss"], stats_without["load_balance_loss"], rtol=1e-6)


@pytest.mark.parametrize("mesh_name", ["ep2", "ep4xdp2"])
def test_non_finite_tokens_on_a_mesh(rng, params, cpu_devices, mesh_name):
    # Tokens 3 and 37 of 43 land on different devices: the count is summed over the mesh.
    x = random_tokens(rng, (43, H))
    mesh = mesh_for(mesh_name, cpu_devices)
    clean, _ = on_mesh(params, x, mesh)
    y, stats = on_mesh(params, poison(x, [3, 37], np.nan), mesh)
    _, stats_without = single_device(params, jnp.delete(x, jnp.asarray([3, 37]), axis=0), cpu_devices)
    assert int(stats["nonfinite_tokens"]) == 2
    np.testing.assert_array_equal(stats["tokens_per_expert"], stats_without["tokens_per_expert"])
    np.testing.assert_allclose(stats["load_balance_loss"], stats_without["load_balance_loss"], rtol=1e-5)
    others = ~np.isin(np.arange(43), [3, 37])
    np.testing.assert_array_equal(np.asarray(y)[others], np.asarray(clean)[others])

