"""What the exchanges move: ``stats["rows_sent"]`` against counts made from the routing alone,
the one-copy exchange's savings at EP = 8 (the targets of issue 32), its float32 error bound
on adversarial magnitudes, and the bytes model (``moe_jax.traffic``) against sampled routings."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import EP_EXCHANGES, FORWARD, make, mesh_for, names
from jax.sharding import PartitionSpec as P

import moe_jax
import sharding
from moe_jax import MoEConfig, resolve
from moe_jax.layer import shard_params
from moe_jax.traffic import exchange_traffic, expected_devices
from sharding.exchange.emulated import ragged_all_to_all as emulated
from sharding.exchange.layout import buffer_buckets

E, H, F, EP = 16, 32, 32, 4
TOKENS = 4 * 10 + 3
BASE = MoEConfig(num_experts=E, top_k=3, hidden_size=H, expert_intermediate_size=F, scoring="sigmoid",
                 router_bias=True)


def host_routing(params, x, config):
    """The layer's routing, recomputed on the host: expert ids ``[T, k]``."""
    logits = jnp.asarray(x, jnp.float32) @ params["router"]["w_eh"].astype(jnp.float32).T
    ids, _ = moe_jax.router.route(logits, config, correction_bias_e=params["router"].get("bias_e"))
    return np.asarray(ids)


def counted_rows(exchange: str, ids_tk: np.ndarray, devices: int, per_device: int, num_experts: int, k: int) -> int:
    """Rows ``exchange`` sends to other devices, from the routing alone (dropless): token ``t``
    lives on device ``t // per_device`` (the layer pads the tokens to ``devices * per_device``)."""
    e_l = num_experts // devices
    padded = np.full((devices * per_device, k), num_experts)
    padded[:len(ids_tk)] = ids_tk
    source = np.arange(len(padded))[:, None] // per_device
    dest = np.where(padded < num_experts, padded // e_l, -1)
    remote_pairs = (dest >= 0) & (dest != source)
    sent_sd = np.zeros((devices, devices), int)
    np.add.at(sent_sd, (np.broadcast_to(source, dest.shape)[dest >= 0], dest[dest >= 0]), 1)
    peer = max(int(sent_sd.max()), 0)
    counts = {
        "ragged": int(remote_pairs.sum()),
        # distinct remote devices per token
        "onecopy": sum(len({int(d) for d in dest[t] if d >= 0 and d != source[t, 0]}) for t in range(len(padded))),
        "allgather": devices * (devices - 1) * per_device,
        # the bucket above the most rows any device sends any peer, to each of the others
        "padded": devices * (devices - 1) * next(
            b for b in buffer_buckets(math.ceil(per_device * k / devices), per_device * k) if b >= peer),
    }
    return counts[exchange]


# padded's rows_sent counts its buffer, the bucket chosen at run time: with the buckets.
@pytest.mark.buffer_buckets
@pytest.mark.parametrize("exchange", names(EP_EXCHANGES))
def test_rows_sent_is_what_crosses_the_expert_axis(rng, cpu_devices, exchange):
    params, x = make(BASE, rng, TOKENS)
    plan = resolve(dataclasses.replace(BASE, exchange=exchange), mesh_for(EP, cpu_devices, 1))
    _, stats = FORWARD(shard_params(params, plan), x, plan)
    assert stats["rows_sent"].dtype == jnp.int32
    per_device = -(-TOKENS // EP)
    expected = counted_rows(exchange, host_routing(params, x, BASE), EP, per_device, E, BASE.top_k)
    assert int(stats["rows_sent"]) == expected


def test_rows_sent_is_zero_on_one_device(rng, cpu_devices):
    params, x = make(BASE, rng, TOKENS)
    _, stats = FORWARD(params, x, resolve(BASE, cpu_devices[:1]))
    assert int(stats["rows_sent"]) == 0 and stats["rows_sent"].dtype == jnp.int32


def run_exchange(exchange, mesh, x_th, ids_tk, weights_tk, expert_fn, num_experts):
    """``exchange`` under ``shard_map`` over ``mesh``'s ``"expert"`` axis; ``(y_th, dropped, rows_sent)``
    with the counts summed over the devices."""
    def body(x, ids, w):
        y, dropped, rows = exchange(x, ids, w, expert_fn, num_experts=num_experts, axis_name="expert",
                                    capacity_factor=None, **({} if exchange is sharding.padded_exchange
                                                             else {"ragged_all_to_all": emulated}))
        return y, jax.lax.psum(dropped, "expert"), jax.lax.psum(rows, "expert")

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("expert"), out_specs=(P("expert"), P(), P())))(
        x_th, ids_tk, weights_tk)


def expert_mesh(cpu_devices, ep):
    return jax.make_mesh((ep,), ("expert",), devices=cpu_devices[:ep], axis_types=(jax.sharding.AxisType.Auto,))


#: Kimi K2's routing (no group limit) and DeepSeek-V3's (the best 4 of 8 groups) at 64 experts,
#: so that at EP = 8 a device holds 8 experts (48 at full size: the model below covers 384).
ROUTINGS = {"kimi_k2": (dict(num_groups=1, topk_groups=1), 0.70), "deepseek_v3": (dict(num_groups=8, topk_groups=4), 0.55)}


@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_one_copy_per_device_sends_fewer_rows_at_ep8(rng, cpu_devices, routing):
    """Issue 32's targets: at EP = 8 under uniform random routing (random router logits),
    onecopy's rows_sent <= 0.70x ragged's for Kimi K2's routing, <= 0.55x for DeepSeek-V3's."""
    groups, target = ROUTINGS[routing]
    ep, e, tokens, h = 8, 64, 8 * 128, 8  # 1024 tokens: the ratio 0.68 +- 0.004 for Kimi K2
    config = MoEConfig(num_experts=e, top_k=8, hidden_size=h, expert_intermediate_size=8, scoring="sigmoid",
                       router_bias=True, **groups)
    logits = jnp.asarray(rng.standard_normal((tokens, e)), jnp.float32)
    ids_tk, weights_tk = moe_jax.router.route(logits, config, correction_bias_e=jnp.zeros((e,), jnp.float32))
    x_th = jnp.asarray(rng.standard_normal((tokens, h)), jnp.float32)
    mesh = expert_mesh(cpu_devices, ep)
    identity = lambda x_mh, group_sizes_e, row_token_m=None, token_row_tk=None: x_mh if row_token_m is None else x_mh[row_token_m]
    y_r, _, ragged_rows = run_exchange(sharding.ragged_exchange, mesh, x_th, ids_tk, weights_tk, identity, e)
    y_o, _, onecopy_rows = run_exchange(sharding.onecopy_exchange, mesh, x_th, ids_tk, weights_tk, identity, e)
    ids = np.asarray(ids_tk)
    assert int(ragged_rows) == counted_rows("ragged", ids, ep, tokens // ep, e, 8)
    assert int(onecopy_rows) == counted_rows("onecopy", ids, ep, tokens // ep, e, 8)
    ratio = int(onecopy_rows) / int(ragged_rows)
    assert ratio <= target, ratio
    np.testing.assert_allclose(y_o, y_r, rtol=1e-5, atol=1e-5)


def test_onecopy_within_the_float32_bound_on_adversarial_magnitudes(rng, cpu_devices):
    """Expert outputs spanning 2^-40..2^40 with signs that cancel: onecopy's sums differ from
    one device's (``none``) by at most ``(2k + D) 2^-24 sum_k |w_k y_k|`` per element, the bound
    ``sharding.exchange.onecopy`` states; exact cancellations stay within it too."""
    ep, e, k, tokens, h = 4, 16, 6, 4 * 12, 8
    x_th = jnp.asarray(rng.standard_normal((tokens, h)), jnp.float32)
    ids_tk = jnp.asarray(np.argsort(rng.random((tokens, e)), axis=1)[:, :k], jnp.int32)
    weights_tk = jnp.asarray(rng.uniform(0.5, 2, (tokens, k)) * rng.choice([-1, 1], (tokens, k)), jnp.float32)
    scale_e = jnp.asarray(2.0 ** rng.integers(-40, 41, e) * rng.choice([-1, 1], e), jnp.float32)

    def scaled(offset):
        def expert_fn(x_mh, group_sizes_e, row_token_m=None, token_row_tk=None):
            if row_token_m is not None:  # 'none' passes the tokens and each row's token
                x_mh = x_mh[row_token_m]
            local_m = jnp.searchsorted(jnp.cumsum(group_sizes_e), jnp.arange(x_mh.shape[0]), side="right")
            e_l = group_sizes_e.shape[0]
            return x_mh * scale_e[jnp.minimum(offset() * e_l + local_m, e - 1)][:, None]
        return expert_fn

    y_1, _, _ = sharding.local_exchange(x_th, ids_tk, weights_tk, scaled(lambda: 0), num_experts=e, axis_name=None,
                                        capacity_factor=None)
    y_d, _, _ = run_exchange(sharding.onecopy_exchange, expert_mesh(cpu_devices, ep), x_th, ids_tk, weights_tk,
                             scaled(lambda: jax.lax.axis_index("expert")), e)
    terms = np.abs(np.asarray(weights_tk, np.float64)[:, :, None] * np.asarray(x_th, np.float64)[:, None, :]
                   * np.asarray(scale_e, np.float64)[np.asarray(ids_tk)][:, :, None])
    bound = (2 * k + ep) * 2.0**-24 * terms.sum(axis=1)
    assert np.all(np.abs(np.asarray(y_d, np.float64) - np.asarray(y_1, np.float64)) <= bound)


@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("ep", [2, 8])
def test_expected_devices_matches_sampled_routings(rng, routing, ep):
    groups, _ = ROUTINGS[routing]
    e, k, tokens = 64, 8, 4000
    config = MoEConfig(num_experts=e, top_k=k, hidden_size=8, expert_intermediate_size=8, scoring="sigmoid", **groups)
    ids, _ = moe_jax.router.route(jnp.asarray(rng.standard_normal((tokens, e)), jnp.float32), config)
    sampled = np.mean([len(set((np.asarray(row) // (e // ep)).tolist())) for row in np.asarray(ids)])
    assert abs(expected_devices(e, k, ep, config.num_groups, config.topk_groups) - sampled) < 0.05


def test_bytes_model_at_the_seed_configuration():
    """Kimi K2 at EP = 8: ragged sends 7 of a token's 8 rows away, 2 bytes x 7168 each; onecopy
    4.62 copies (0.66x the rows) plus ids and weights, float32 partial sums back."""
    config = MoEConfig.kimi_k2(weight_format="nvfp4")
    ragged, onecopy = (exchange_traffic(config, n, 8) for n in ("ragged", "onecopy"))
    assert ragged.dispatch == ragged.combine == 7 * 7168 * 2
    n = expected_devices(384, 8, 8)
    assert n == pytest.approx(8 * (1 - math.comb(336, 8) / math.comb(384, 8)))
    assert onecopy.dispatch == pytest.approx(n * 7 / 8 * (7168 * 2 + 8 * 8))
    assert onecopy.combine == pytest.approx(n * 7 / 8 * 7168 * 4)
    assert 0.65 < onecopy.dispatch / ragged.dispatch < 0.67
