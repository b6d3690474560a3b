"""Expert parallelism on 8 virtual CPU devices: the layer under ``shard_map`` equals the
layer on one device, for every exchange, expert-parallel size, top-k and weight format.

XLA:CPU has no ``ragged_all_to_all``: ``ragged`` and ``onecopy`` execute here on its twin
(``sharding.exchange.emulated``, tested against the collective's docstring in
``tests/sharding/test_ragged_emulation.py``), as resolution arranges and reports.

Tolerances. Both paths compute every row from the same bf16 inputs with float32
accumulation and round at the same two points (the SwiGLU output and the layer output);
only XLA's blocking of float32 sums may differ with the number of rows, which can move a
value across a bf16 rounding boundary. Outputs may therefore differ by a couple of bf16
ulps (2^-8 relative each) of a token's largest element; routing and statistics must match
exactly.
"""

import dataclasses
import math

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np
import pytest
from harness import (
    EP_EXCHANGES, FORWARD, LOCAL_EXCHANGES, assert_same_output, assert_same_stats, make, mesh_for, names,
    swap_exchange,
)
from jax.sharding import PartitionSpec as P

import moe_jax
import sharding
from moe_jax import MoEConfig, ResolutionError, moe_forward, resolve
from moe_jax.layer import param_shardings, shard_params
from sharding.exchange.emulated import ragged_all_to_all as emulated

E, H, F = 16, 32, 32
TOKENS = 8 * 5 + 3  # not a multiple of the 8 devices: the layer pads
BASE = MoEConfig(num_experts=E, top_k=2, hidden_size=H, expert_intermediate_size=F, num_shared_experts=1)


@pytest.fixture
def plan_for():
    """``plan_for(config, mesh, exchange)``: the plan that runs ``exchange`` (``"auto"``: what
    resolution picks); ``ragged`` and ``onecopy`` run on XLA:CPU through the twin of
    ``ragged_all_to_all`` (``sharding.exchange.emulated``), which resolution notes in the plan."""
    def make_plan(config, mesh, exchange):
        try:
            return resolve(dataclasses.replace(config, exchange=exchange), mesh)
        except ResolutionError as err:
            pytest.skip(str(err))

    return make_plan


def single_device(params, x, config, cpu_devices):
    """The reference: ``config`` with the exchange ``auto`` picks on one device, so that the cases
    of one (top-k, format) share its compilation."""
    return FORWARD(params, x, resolve(dataclasses.replace(config, exchange="auto"), cpu_devices[:1]))


# Every pair of (expert-parallel size, top-k) with the exchange auto picks here (padded on CPU),
# each size and top-k with both weight formats; every registered exchange on each size, top-k
# and format (the formats the other way round, so that no case repeats one of the grid's).
AUTO_GRID = [(2, 1, "bf16"), (2, 2, "nvfp4"), (2, 8, "bf16"), (4, 1, "nvfp4"), (4, 2, "bf16"), (4, 8, "nvfp4"),
             (8, 1, "bf16"), (8, 2, "nvfp4"), (8, 8, "nvfp4")]
EACH = [(2, 1, "nvfp4"), (4, 8, "bf16"), (8, 2, "bf16")]
CASES = [pytest.param(ep, "auto", k, fmt, id=f"{ep}-auto-{k}-{fmt}") for ep, k, fmt in AUTO_GRID]
CASES += [pytest.param(ep, exchange, k, fmt, id=f"{ep}-{exchange}-{k}-{fmt}")
          for exchange in EP_EXCHANGES for ep, k, fmt in EACH]
CASES += [pytest.param(1, exchange, k, fmt, id=f"1-{exchange}-{k}-{fmt}")
          for exchange in LOCAL_EXCHANGES for k, fmt in ((1, "nvfp4"), (2, "bf16"), (8, "nvfp4"))]


@pytest.mark.parametrize("ep,exchange,top_k,weight_format", CASES)
def test_matches_single_device(rng, cpu_devices, plan_for, ep, exchange, top_k, weight_format):
    config = dataclasses.replace(BASE, top_k=top_k, weight_format=weight_format)
    params, x = make(config, rng, TOKENS)
    y_ref, stats_ref = single_device(params, x, config, cpu_devices)
    plan = plan_for(config, mesh_for(ep, cpu_devices), exchange)
    assert exchange in ("auto", plan.exchange)
    y, stats = FORWARD(shard_params(params, plan), x, plan)
    assert y.shape == x.shape and y.dtype == jnp.bfloat16
    assert_same_output(y, y_ref)
    assert_same_stats(stats, stats_ref)


@pytest.mark.parametrize("min_updates_per_peer", [1, 24])
def test_sliced_ragged_updates_match_padded(rng, cpu_devices, min_updates_per_peer):
    """GPUs slice each (peer, expert) update for parallelism; slices must reassemble exactly."""
    ep, e, k, tokens = 4, 8, 3, 6
    mesh = jax.make_mesh((ep,), ("expert",), devices=cpu_devices[:ep], axis_types=(jax.sharding.AxisType.Auto,))
    x_th = jnp.asarray(rng.standard_normal((ep * tokens, H)), jnp.float32)
    ids_tk = jnp.asarray(np.argsort(rng.random((ep * tokens, e)), axis=1)[:, :k], jnp.int32)
    weights_tk = jnp.asarray(rng.random((ep * tokens, k)), jnp.float32)

    def by_local_expert(x_mh, group_sizes_e, row_token_m=None, token_row_tk=None):
        x_mh = x_mh if row_token_m is None else x_mh[row_token_m]
        expert_m = jnp.searchsorted(jnp.cumsum(group_sizes_e), jnp.arange(x_mh.shape[0]), side="right")
        return x_mh * (1.0 + expert_m[:, None] + 10.0 * jax.lax.axis_index("expert"))

    def run(exchange, **kwargs):
        body = lambda x, ids, w: exchange(x, ids, w, by_local_expert, num_experts=e, axis_name="expert",
                                          capacity_factor=None, **kwargs)[0]
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("expert"), out_specs=P("expert")))(x_th, ids_tk, weights_tk)

    expected = np.einsum("tk,tkh->th", weights_tk, x_th[:, None, :] * (1.0 + (ids_tk % (e // ep)) + 10.0 * (ids_tk // (e // ep)))[..., None])
    np.testing.assert_allclose(run(sharding.padded_exchange), expected, rtol=1e-6)
    for exchange in (sharding.ragged_exchange, sharding.onecopy_exchange):
        np.testing.assert_allclose(run(exchange, min_updates_per_peer=min_updates_per_peer, ragged_all_to_all=emulated),
                                   expected, rtol=1e-6)


def skewed(config, rng, chosen):
    """Sigmoid routing whose correction bias forces every token onto ``chosen`` experts."""
    config = dataclasses.replace(config, scoring="sigmoid", router_bias=True)
    params, x = make(config, rng, TOKENS)
    params["router"]["bias_e"] = params["router"]["bias_e"].at[jnp.asarray(chosen)].add(100.0)
    return config, params, x


@pytest.mark.parametrize("exchange", names(EP_EXCHANGES))
@pytest.mark.parametrize("skew", ["one_expert", "one_device"])
def test_skewed_routing(rng, cpu_devices, plan_for, exchange, skew):
    ep = 4
    top_k, chosen = {"one_expert": (1, [5]), "one_device": (3, [4, 5, 6, 7])}[skew]
    config, params, x = skewed(dataclasses.replace(BASE, top_k=top_k), rng, chosen)
    y_ref, stats_ref = single_device(params, x, config, cpu_devices)
    assert set(np.flatnonzero(stats_ref["tokens_per_expert"])) <= set(chosen)
    plan = plan_for(config, mesh_for(ep, cpu_devices), exchange)
    y, stats = FORWARD(shard_params(params, plan), x, plan)
    assert_same_output(y, y_ref)
    assert_same_stats(stats, stats_ref)
    assert int(stats["dropped"]) == 0


def probed_loss(params, x, r, plan):
    """The output against a random probe ``r``, plus the load-balance loss."""
    y, stats = moe_forward(params, x, plan)
    return jnp.sum(y.astype(jnp.float32) * r) + stats["load_balance_loss"]


#: Jitted once: every exchange's test shares the single-device gradient's compilation.
GRAD = jax.jit(jax.grad(probed_loss, argnums=(0, 1)), static_argnums=3)


# With the buckets: the gradient through the switch on a 4 x 2 mesh, whose two data-parallel groups
# can take different branches (where this test hung before the layer's fix, benchmarks/NOTES.md 7).
@pytest.mark.buffer_buckets
@pytest.mark.parametrize("exchange", names(EP_EXCHANGES))
def test_gradients_match_single_device(rng, cpu_devices, plan_for, exchange):
    config = BASE
    params, x = make(config, rng, TOKENS)
    r = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
    g_ref = GRAD(params, x, r, resolve(config, cpu_devices[:1]))
    plan = plan_for(config, mesh_for(4, cpu_devices), exchange)
    g = GRAD(shard_params(params, plan), x, r, plan)
    # bf16 gradients of weights sum over tokens, here in another order (per device, then a
    # psum), so they differ by bf16 roundings of partial sums: compare norms, then elements.
    for path, a, b in zip(jax.tree_util.tree_leaves_with_path(g), jax.tree.leaves(g), jax.tree.leaves(g_ref)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.linalg.norm(a - b) <= 1e-2 * np.linalg.norm(b), jax.tree_util.keystr(path[0])
        np.testing.assert_allclose(a, b, rtol=0.05, atol=0.05 * np.abs(b).max())


#: Primitives that name mesh axes without communicating over them.
_LOCAL_AXIS_PRIMITIVES = ("axis_index", "pvary")


def _collectives_in_switches(jaxpr, in_branch: bool = False):
    """``(primitive, mesh axes)`` of every collective inside a ``cond`` (``lax.switch``), and
    ``("cond", ())`` for each ``cond``, recursively."""
    for eqn in jaxpr.eqns:
        axes = eqn.params.get("axes", eqn.params.get("axis_name", ()))
        # Mesh axes are names; a reduction's positional axes are ints.
        named = tuple(a for a in (axes if isinstance(axes, (tuple, list)) else (axes,)) if isinstance(a, str))
        if in_branch and named and eqn.primitive.name not in _LOCAL_AXIS_PRIMITIVES:
            yield eqn.primitive.name, named
        if eqn.primitive.name == "cond":
            yield "cond", ()
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, (jex_core.ClosedJaxpr, jex_core.Jaxpr)):
                    yield from _collectives_in_switches(getattr(sub, "jaxpr", sub),
                                                        in_branch or eqn.primitive.name == "cond")


@pytest.mark.buffer_buckets
@pytest.mark.parametrize("exchange", names(EP_EXCHANGES))
def test_gradient_communicates_over_the_expert_axis_only_inside_the_switch(rng, cpu_devices, plan_for, exchange):
    """The exchanges pick a buffer size at run time (``switch_on_size``) from counts gathered over
    the expert axis, so devices of different data-parallel groups can take different branches.
    A branch must therefore communicate over the expert axis only, in the gradient too: the
    expert weights' gradient is summed over the data axis outside the switch
    (``moe_jax.layer``). Summed inside it, the two groups ran different all-reduces (the xla
    path's branches differ in their number) and XLA:CPU deadlocked (benchmarks/NOTES.md,
    section 7). Checked on the jaxpr: the deadlock needs a routing whose groups pick different
    buckets."""
    params, x = make(BASE, rng, TOKENS)
    r = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
    plan = plan_for(BASE, mesh_for(4, cpu_devices), exchange)
    jaxpr = jax.make_jaxpr(jax.grad(probed_loss, argnums=(0, 1)), static_argnums=3)(
        shard_params(params, plan), x, r, plan)
    found = list(_collectives_in_switches(jaxpr.jaxpr))
    assert ("cond", ()) in found, "no switch found: the check would pass vacuously"
    assert {axis for _, axes in found for axis in axes} <= {BASE.expert_axis}, found


def expected_with_capacity(params, x, config, ep, data):
    """float64 layer output and drop count when each device keeps its first ``C`` received rows.

    Receiver order is expert-major: local expert, then source device, then token (the
    stable sort keeps token order), as :mod:`sharding.exchange.layout` defines it.
    """
    x64 = np.asarray(x, np.float64)
    tokens = x64.shape[0]
    per_device = -(-tokens // (ep * data))
    capacity = math.ceil(config.capacity_factor * per_device * config.top_k)
    logits = jnp.asarray(x, jnp.float32) @ params["router"]["w_eh"].astype(jnp.float32).T
    ids, weights = moe_jax.router.route(logits, config, correction_bias_e=params["router"].get("bias_e"))
    ids, weights = np.asarray(ids), np.asarray(weights, np.float64)
    e_l = config.num_experts // ep
    kept = np.zeros(ids.shape, bool)
    dropped = 0
    for group in range(data):
        first, last = group * ep * per_device, (group + 1) * ep * per_device
        for receiver in range(ep):
            rows = sorted((ids[t, s], t, s) for t in range(first, min(last, tokens)) for s in range(config.top_k)
                          if ids[t, s] // e_l == receiver)
            for _, t, s in rows[:capacity]:
                kept[t, s] = True
            dropped += max(0, len(rows) - capacity)
    w_gu = np.asarray(params["experts"]["w_gate_up_egh"], np.float64)
    w_dn = np.asarray(params["experts"]["w_down_ehf"], np.float64)
    silu = lambda v: v / (1 + np.exp(-v))
    y = np.zeros_like(x64)
    for t in range(tokens):
        for s in np.flatnonzero(kept[t]):
            h = w_gu[ids[t, s]] @ x64[t]
            y[t] += weights[t, s] * (w_dn[ids[t, s]] @ (silu(h[:F]) * h[F:]))
    sh_gu, sh_dn = (np.asarray(params["shared"][n], np.float64) for n in ("w_gate_up_gh", "w_down_hs"))
    h = x64 @ sh_gu.T
    return y + (silu(h[:, :F]) * h[:, F:]) @ sh_dn.T, dropped


# Each exchange where it runs; ragged also on a 2-device axis, where each device receives from
# one peer only.
@pytest.mark.parametrize("exchange,ep", [*(pytest.param(e, 1, id=f"{e}-1") for e in LOCAL_EXCHANGES),
                                         *(pytest.param(e, 4, id=f"{e}-4") for e in EP_EXCHANGES),
                                         pytest.param("ragged", 2, id="ragged-2")])
def test_capacity_drops_are_counted_exactly(rng, cpu_devices, plan_for, exchange, ep):
    config, params, x = skewed(dataclasses.replace(BASE, top_k=2, capacity_factor=0.75), rng, [4, 5, 9])
    data = len(cpu_devices) // ep
    y_expected, dropped = expected_with_capacity(params, x, config, ep, data)
    assert dropped > 0
    plan = plan_for(config, mesh_for(ep, cpu_devices), exchange)
    y, stats = FORWARD(shard_params(params, plan), x, plan)
    assert int(stats["dropped"]) == dropped
    err = np.linalg.norm(np.asarray(y, np.float64) - y_expected, axis=1) / np.linalg.norm(y_expected, axis=1)
    assert err.max() < 3e-2  # bf16 rounding of the SwiGLU output and of y, per token


def test_shard_params_splits_expert_memory(rng, cpu_devices):
    config = dataclasses.replace(BASE, weight_format="nvfp4")
    params, _ = make(config, rng, TOKENS)
    plan = resolve(config, mesh_for(4, cpu_devices))
    placed = shard_params(params, plan)
    for leaf, host in zip(jax.tree.leaves(placed["experts"]), jax.tree.leaves(params["experts"])):
        assert leaf.sharding.spec[0] == "expert"
        assert leaf.addressable_shards[0].data.nbytes * 4 == host.nbytes
    for leaf in jax.tree.leaves((placed["router"], placed["shared"])):
        assert leaf.sharding.is_fully_replicated
    assert jax.tree.map(lambda s: s.spec, param_shardings(params, plan))["experts"]["w_down_ehf"].packed == P("expert", None, None)
    with pytest.raises(ValueError, match="plan: .* expected a Plan resolved for a jax.sharding.Mesh"):
        shard_params(params, resolve(config, cpu_devices[:1]))


def test_auto_and_explicit_choices(cpu_devices):
    mesh = mesh_for(4, cpu_devices)
    plan = resolve(BASE, mesh)
    assert plan.exchange == "padded" and plan.exchange_emulation is None
    assert "fewest bytes per token per layer" in plan.report
    for exchange in ("ragged", "onecopy"):
        plan = resolve(dataclasses.replace(BASE, exchange=exchange), mesh)
        assert plan.exchange_emulation == "emulated on XLA:CPU: correct, not fast"
        assert f"  exchange: {exchange} (emulated on XLA:CPU: correct, not fast)  (requested {exchange!r}" in plan.report
    with pytest.raises(moe_jax.ResolutionError, match="'none' cannot run"):
        resolve(dataclasses.replace(BASE, exchange="none"), mesh)
    with pytest.raises(moe_jax.ResolutionError, match="'padded' cannot run .* one device has no mesh"):
        resolve(dataclasses.replace(BASE, exchange="padded"), cpu_devices[:1])
    assert resolve(BASE, mesh_for(1, cpu_devices)).exchange == "none"


# Kimi K2 (bytes per token per layer, moe_jax.traffic): at EP 4 onecopy 116 KB < allgather 129 KB
# < ragged 172 KB; at EP 8 onecopy 199.0 KB < ragged 200.7 KB (its float32 partial sums cost what
# its single copies save); at EP 16 ragged 215 KB < onecopy 262 KB. DeepSeek-V3's group limit puts
# a token on at most 4 devices at EP 8: onecopy 137 KB < ragged 201 KB.
@pytest.mark.parametrize("preset,ep,tokens,expected", [
    ("kimi_k2", 4, 16, "allgather"), ("kimi_k2", 4, 4096, "onecopy"), ("kimi_k2", 8, 16, "allgather"),
    ("kimi_k2", 8, 4096, "onecopy"), ("kimi_k2", 8, None, "onecopy"), ("kimi_k2", 16, None, "ragged"),
    ("deepseek_v3", 8, None, "onecopy")])
def test_auto_on_gpus_picks_by_bytes(preset, ep, tokens, expected):
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="cuda")
    mesh = jax.sharding.AbstractMesh((ep,), ("expert",), abstract_device=device)
    plan = resolve(getattr(MoEConfig, preset)(weight_format="nvfp4"), mesh, tokens_per_device=tokens)
    assert plan.exchange == expected and plan.exchange_emulation is None
    assert f"exchange: {expected}  (requested 'auto'; auto: " in plan.report


def test_the_chosen_exchange_is_stamped_into_the_hlo(rng, cpu_devices):
    params, x = make(BASE, rng, TOKENS)
    plan = resolve(dataclasses.replace(BASE, exchange="allgather"), mesh_for(4, cpu_devices))
    text = FORWARD.lower(params, x, plan).as_text(debug_info=True)
    assert "moe_jax.exchange.allgather" in text and "moe_jax.exchange.padded" not in text
