"""Load balancing: the router statistics on every expert-parallel mesh against a float64 numpy
reference, the auxiliary-loss-free bias update (DeepSeek-V3), and non-finite tokens.

The reference routes, counts and differentiates in float64 from the same float32 inputs; the
layer computes its router logits in IEEE float32 (precision "highest"), so routing must match
exactly (inputs whose top-k margin is below float32 rounding are redrawn), the losses and
their gradients to float32 rounding of sums over tokens.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from harness import FORWARD
from harness import mesh_for as harness_mesh_for

import moe_jax
from moe_jax import MoEConfig, init_params, moe_forward, resolve
from moe_jax.layer import shard_params
from moe_jax.module import CorrectionBias

E, H, F = 16, 32, 16
TOKENS = 8 * 5 + 3  # not a multiple of the devices: padding tokens must not count
CONFIGS = {
    "softmax": MoEConfig(num_experts=E, top_k=2, hidden_size=H, expert_intermediate_size=F, dtype="float32"),
    "sigmoid_bias": MoEConfig(num_experts=E, top_k=3, hidden_size=H, expert_intermediate_size=F, dtype="float32",
                              scoring="sigmoid", router_bias=True, routed_scaling_factor=2.5),
}
MESHES = {"1": (1, 1), "ep2": (2, 1), "ep4": (4, 1), "ep8": (8, 1), "ep2xdp4": (2, 4)}


def mesh_for(name, cpu_devices):
    ep, dp = MESHES[name]
    return None if ep * dp == 1 else harness_mesh_for(ep, cpu_devices, dp)


def reference(x_th, w_eh, bias_e, config):
    """float64 ``(tokens_per_expert, load_balance_loss, router_z_loss, d(aux + z)/d w_eh, margin)``.

    ``margin``: the smallest gap, over tokens, between the k-th and the (k+1)-th selection
    score, to tell a draw that float32 might route differently.
    """
    t, k = x_th.shape[0], config.top_k
    logits = x_th @ w_eh.T
    match config.scoring:
        case "softmax":
            scores = np.exp(logits - logits.max(1, keepdims=True))
            scores /= scores.sum(1, keepdims=True)
        case "sigmoid":
            scores = 1 / (1 + np.exp(-logits))
    choice = scores + (0 if bias_e is None else bias_e[None])
    order = np.argsort(-choice, axis=1, kind="stable")
    ranked = np.take_along_axis(choice, order, 1)
    margin = float(np.min(ranked[:, k - 1] - ranked[:, k]))
    counts = np.bincount(order[:, :k].reshape(-1), minlength=E)
    total = scores.sum(1, keepdims=True)
    probs = scores / total
    aux = E * np.sum(counts / (t * k) * probs.sum(0) / t)
    lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
    z = np.mean(lse**2)
    # Backward by hand: aux is linear in probs with coefficient a_e for every token.
    a_e = E * counts / (t * t * k)
    d_scores = (a_e[None] - (probs * a_e[None]).sum(1, keepdims=True)) / total
    match config.scoring:
        case "softmax":
            d_logits = scores * (d_scores - (d_scores * scores).sum(1, keepdims=True))
        case "sigmoid":
            d_logits = d_scores * scores * (1 - scores)
    softmax = np.exp(logits - lse[:, None])
    d_logits += 2 / t * lse[:, None] * softmax
    return counts, aux, z, d_logits.T @ x_th, margin


def draw(config, rng):
    """Fresh random float32 tokens and router (never zeros), redrawn on a near tie."""
    for _ in range(10):
        x_th = rng.standard_normal((TOKENS, H)).astype(np.float32)
        w_eh = (rng.standard_normal((E, H)) * 1.5 / math.sqrt(H)).astype(np.float32)
        bias_e = (rng.standard_normal(E) * 0.1).astype(np.float32) if config.router_bias else None
        ref = reference(x_th.astype(np.float64), w_eh.astype(np.float64),
                        None if bias_e is None else bias_e.astype(np.float64), config)
        if ref[-1] > 1e-5:
            return x_th, w_eh, bias_e, ref
    raise AssertionError("no draw without a near tie in 10 tries")


def losses_and_router_grad(params, x, plan):
    """``(stats, d(load_balance_loss + router_z_loss) / d w_eh)`` of the layer, jitted."""
    def loss(w_eh):
        _, stats = moe_forward({**params, "router": {**params["router"], "w_eh": w_eh}}, x, plan)
        return stats["load_balance_loss"] + stats["router_z_loss"], stats

    with jax.default_matmul_precision("highest"):
        (_, stats), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(params["router"]["w_eh"])
    return stats, grad


@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize("name", CONFIGS)
def test_statistics_and_their_gradients_match_float64_on_every_mesh(rng, cpu_devices, name, mesh_name):
    config = CONFIGS[name]
    x_th, w_eh, bias_e, (counts, aux, z, grad_ref, _) = draw(config, rng)
    params = init_params(config, jax.random.key(int(rng.integers(1 << 30))))
    params["router"]["w_eh"] = jnp.asarray(w_eh)
    if bias_e is not None:
        params["router"]["bias_e"] = jnp.asarray(bias_e)
    mesh = mesh_for(mesh_name, cpu_devices)
    plan = resolve(config, mesh if mesh is not None else cpu_devices[:1], training=True)
    if mesh is not None:
        params = shard_params(params, plan)
    stats, grad = losses_and_router_grad(params, jnp.asarray(x_th), plan)

    assert stats["tokens_per_expert"].dtype == jnp.int32
    np.testing.assert_array_equal(stats["tokens_per_expert"], counts)
    assert stats["router_z_loss"].dtype == jnp.float32
    np.testing.assert_allclose(float(stats["load_balance_loss"]), aux, rtol=1e-5)
    np.testing.assert_allclose(float(stats["router_z_loss"]), z, rtol=1e-5)
    assert grad.shape == (E, H) and grad.dtype == jnp.float32
    grad = np.asarray(grad, np.float64)
    assert np.linalg.norm(grad - grad_ref) <= 1e-5 * np.linalg.norm(grad_ref)
    np.testing.assert_allclose(grad, grad_ref, rtol=1e-4, atol=1e-6 * np.abs(grad_ref).max())


def test_an_empty_batch_has_zero_losses_and_zero_gradients(cpu_devices):
    config = CONFIGS["sigmoid_bias"]
    params = init_params(config, jax.random.key(0))
    for mesh in (None, mesh_for("ep4", cpu_devices)):
        plan = resolve(config, mesh if mesh is not None else cpu_devices[:1], training=True)
        placed = params if mesh is None else shard_params(params, plan)
        stats, grad = losses_and_router_grad(placed, jnp.zeros((0, H), jnp.float32), plan)
        assert float(stats["router_z_loss"]) == 0.0 and float(stats["load_balance_loss"]) == 0.0
        np.testing.assert_array_equal(grad, np.zeros((E, H)))


# --- auxiliary-loss-free balancing ---

def load_ratio(tokens_per_expert):
    """max / min load, the min clamped at one assignment so an unused expert stays finite."""
    load = np.asarray(tokens_per_expert)
    return load.max() / max(load.min(), 1)


@pytest.mark.parametrize("mesh_name", ["1", "ep4"])
def test_the_bias_update_balances_a_skewed_router(rng, cpu_devices, mesh_name):
    config = dataclasses.replace(CONFIGS["sigmoid_bias"], top_k=2)
    params = init_params(config, jax.random.key(int(rng.integers(1 << 30))))
    # Tokens share a mean direction u; four experts' router rows point along it, so their
    # logits are about 3 higher than the others' and they take nearly every assignment.
    u_h = np.ones(H, np.float32) / math.sqrt(H)
    w_eh = np.asarray(params["router"]["w_eh"]) + 3.0 / math.sqrt(H) * np.outer(np.arange(E) < 4, u_h)
    params["router"]["w_eh"] = jnp.asarray(w_eh, jnp.float32)
    layer = moe_jax.MoE(config, rngs=nnx.Rngs(0), mesh=mesh_for(mesh_name, cpu_devices), params=params,
                        training=True)
    assert isinstance(layer.router_bias_e, CorrectionBias)
    assert "router_bias_e" not in {str(path[0]) for path, _ in nnx.to_flat_state(nnx.state(layer, nnx.Param))}
    rate = 0.02

    @nnx.jit
    def step(layer, x):
        _, stats = layer(x)
        layer.update_load_balance(stats, rate)
        return stats

    loads, biases = [], []
    for _ in range(40):
        x = jnp.asarray(rng.standard_normal((256, H)) + math.sqrt(H) * u_h, jnp.float32)
        loads.append(np.asarray(step(layer, x)["tokens_per_expert"]))
        biases.append(np.asarray(layer.router_bias_e.get_value()))
    assert layer.router_bias_e.get_value().dtype == jnp.float32
    # Each step moves every expert's bias by -rate, 0 or +rate.
    steps = np.diff(np.stack([np.zeros(E), *biases]), axis=0) / rate
    np.testing.assert_allclose(steps, np.round(steps), atol=1e-3)
    assert set(np.round(steps).ravel()) <= {-1.0, 0.0, 1.0}
    # Loads summed over several steps: one batch's smallest load is mostly sampling noise.
    first, last = load_ratio(np.sum(loads[:5], 0)), load_ratio(np.sum(loads[-10:], 0))
    # skewed to start with (max / min 44-1152 over 41 seeds: a fresh router's own rows vary)...
    assert first > 10, first
    assert last < 3, (first, last)  # ...and balanced within a few dozen steps
    assert biases[-1][:4].mean() < biases[-1][4:].mean()  # the favoured experts lost bias


def test_update_load_balance_needs_a_correction_bias():
    config = CONFIGS["softmax"]
    layer = moe_jax.MoE(config, rngs=nnx.Rngs(0), training=True)
    _, stats = nnx.jit(lambda m, x: m(x))(layer, jnp.ones((4, H)))  # jitted: eagerly, each op compiles alone
    expected = r"^update_load_balance: this layer has no correction bias \(config.router_bias = False\); "
    with pytest.raises(ValueError, match=expected):
        layer.update_load_balance(stats, 1e-3)


def test_update_load_balance_rejects_bad_arguments():
    layer = moe_jax.MoE(CONFIGS["sigmoid_bias"], rngs=nnx.Rngs(0), training=True)
    _, stats = nnx.jit(lambda m, x: m(x))(layer, jnp.ones((4, H)))
    for bad in (0.0, -1e-3, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"^rate: .*, expected a finite number > 0$"):
            layer.update_load_balance(stats, bad)
    with pytest.raises(ValueError, match=r"^stats: \['dropped'\], expected the stats dict"):
        layer.update_load_balance({"dropped": stats["dropped"]}, 1e-3)
    with pytest.raises(ValueError, match=r"^tokens_per_expert_e: shape \(8,\), expected \(16,\) like bias_e$"):
        layer.update_load_balance({"tokens_per_expert": jnp.zeros(8, jnp.int32)}, 1e-3)
    np.testing.assert_array_equal(layer.router_bias_e.get_value(), np.zeros(E))  # nothing applied


# --- non-finite tokens ---

@pytest.mark.parametrize("mesh_name", ["1", "ep4"])
def test_a_non_finite_token_changes_neither_other_outputs_nor_the_statistics(rng, cpu_devices, mesh_name):
    config = CONFIGS["sigmoid_bias"]
    params = init_params(config, jax.random.key(int(rng.integers(1 << 30))))
    params["router"]["bias_e"] = jnp.asarray(rng.standard_normal(E) * 0.1, jnp.float32)
    mesh = mesh_for(mesh_name, cpu_devices)
    plan = resolve(config, mesh if mesh is not None else cpu_devices[:1], training=True)
    if mesh is not None:
        params = shard_params(params, plan)
    forward = FORWARD
    x = jnp.asarray(rng.standard_normal((TOKENS, H)), jnp.float32)
    bad = [3, 37]  # on different devices of the mesh
    poisoned = x.at[bad[0], 5].set(jnp.nan).at[bad[1], 0].set(jnp.inf)
    with jax.default_matmul_precision("highest"):
        y_clean, _ = forward(params, x, plan)
        y, stats = forward(params, poisoned, plan)
        _, stats_without = forward(params, jnp.delete(x, jnp.asarray(bad), axis=0), plan)
    others = ~np.isin(np.arange(TOKENS), bad)
    np.testing.assert_array_equal(np.asarray(y)[others], np.asarray(y_clean)[others])
    assert int(stats["nonfinite_tokens"]) == 2
    np.testing.assert_array_equal(stats["tokens_per_expert"], stats_without["tokens_per_expert"])
    for name in ("load_balance_loss", "router_z_loss"):
        assert np.isfinite(float(stats[name])), name
        np.testing.assert_allclose(float(stats[name]), float(stats_without[name]), rtol=1e-6, err_msg=name)


def test_a_token_whose_logits_overflow_leaves_the_loss_gradients_finite(rng, cpu_devices):
    """Finite activations whose router logits overflow: left out of the statistics, and, since
    its logits are replaced before any function of them, no NaN reaches the gradients."""
    config = CONFIGS["softmax"]
    params = init_params(config, jax.random.key(int(rng.integers(1 << 30))))
    plan = resolve(config, cpu_devices[:1], training=True)
    x = jnp.asarray(rng.standard_normal((TOKENS, H)), jnp.float32)
    big = x.at[5].set(3e38 * jnp.sign(params["router"]["w_eh"][0]))
    stats, grad = losses_and_router_grad(params, big, plan)
    stats_without, grad_without = losses_and_router_grad(params, jnp.delete(x, 5, axis=0), plan)
    assert int(stats["nonfinite_tokens"]) == 1
    np.testing.assert_allclose(float(stats["router_z_loss"]), float(stats_without["router_z_loss"]), rtol=1e-6)
    # The other tokens' terms are divided by the same count; only the summation order differs.
    np.testing.assert_allclose(grad, grad_without, rtol=1e-5, atol=1e-7)
