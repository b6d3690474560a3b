"""Routing against independent float64 numpy implementations of the published rules.

* Mixtral (HF MixtralSparseMoeBlock): softmax over all experts, top-k, renormalize.
* DeepSeek-V3 / Kimi K2 (DeepSeek's inference code): sigmoid scores, bias for selection,
  groups scored by the sum of their top-2 biased scores, weights from unbiased scores,
  normalized, times routed_scaling_factor.
* Load balancing: the Switch-Transformer auxiliary loss, ST-MoE's router z-loss, and
  DeepSeek-V3's auxiliary-loss-free correction-bias update.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import dot_operands

from moe_jax import MoEConfig, router

# On a GPU machine the routing runs there: XLA:GPU's top-k, float32 matmuls (TF32 by default)
# and transcendentals decide which experts are chosen and how ties break.
pytestmark = pytest.mark.gpu_check


def mixtral_route_np(logits, k, normalize=True):
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(p, ids, -1)
    if normalize:
        w = w / w.sum(-1, keepdims=True)
    return ids, w


def deepseek_route_np(logits, bias, k, n_group, topk_group, scaling, normalize=True):
    scores = 1 / (1 + np.exp(-logits))
    choice = scores + bias[None]
    t, e = choice.shape
    grouped = choice.reshape(t, n_group, e // n_group)
    group_scores = np.sort(grouped, -1)[:, :, -2:].sum(-1)
    ids = np.zeros((t, k), np.int64)
    for i in range(t):
        best = np.argsort(-group_scores[i], kind="stable")[:topk_group]
        masked = np.full((n_group, e // n_group), -np.inf)
        masked[best] = grouped[i, best]
        ids[i] = np.argsort(-masked.reshape(-1), kind="stable")[:k]
    w = np.take_along_axis(scores, ids, -1)
    if normalize:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return ids, w * scaling


def assert_same_routing(ids, w, ref_ids, ref_w):
    # Selection order may differ within equal scores only; compare as sets plus weights.
    order = np.argsort(ids, -1)
    ref_order = np.argsort(ref_ids, -1)
    np.testing.assert_array_equal(np.take_along_axis(ids, order, -1), np.take_along_axis(ref_ids, ref_order, -1))
    np.testing.assert_allclose(np.take_along_axis(w, order, -1), np.take_along_axis(ref_w, ref_order, -1), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (8, 1), (64, 6)])
@pytest.mark.parametrize("normalize", [True, False])
def test_softmax_matches_mixtral(rng, num_experts, top_k, normalize):
    cfg = MoEConfig(num_experts=num_experts, top_k=top_k, hidden_size=16, expert_intermediate_size=16,
                    scoring="softmax", normalize=normalize)
    logits = rng.standard_normal((97, num_experts)) * 3
    ids, w = router.route(jnp.asarray(logits, jnp.float32), cfg)
    assert ids.dtype == jnp.int32 and w.dtype == jnp.float32 and ids.shape == (97, top_k)
    assert_same_routing(np.asarray(ids), np.asarray(w), *mixtral_route_np(logits.astype(np.float32), top_k, normalize))


@pytest.mark.parametrize("preset", ["kimi_k2", "deepseek_v3"])
def test_sigmoid_matches_deepseek_rule(rng, preset):
    cfg = getattr(MoEConfig, preset)()
    logits = rng.standard_normal((64, cfg.num_experts)).astype(np.float32) * 2
    bias = (rng.standard_normal(cfg.num_experts) * 0.5).astype(np.float32)
    ids, w = router.route(jnp.asarray(logits), cfg, correction_bias_e=jnp.asarray(bias))
    ref = deepseek_route_np(logits.astype(np.float64), bias.astype(np.float64), cfg.top_k, cfg.num_groups,
                            cfg.topk_groups, cfg.routed_scaling_factor)
    assert_same_routing(np.asarray(ids), np.asarray(w), *ref)


def test_group_limit_excludes_experts_outside_the_best_groups(rng):
    cfg = MoEConfig.deepseek_v3(num_experts=32, top_k=4)  # 8 groups of 4, best 4 groups
    logits = rng.standard_normal((200, 32)).astype(np.float32)
    ids = np.asarray(router.route(jnp.asarray(logits), cfg)[0])
    groups_used = {len(set(row // 4)) for row in ids}
    assert max(groups_used) <= 4
    # Without the limit some token would have used a fifth group.
    free = dataclasses.replace(cfg, num_groups=1, topk_groups=1)
    free_ids = np.asarray(router.route(jnp.asarray(logits), free)[0])
    assert (free_ids != ids).any()


def test_bias_changes_selection_but_not_the_weights(rng):
    cfg = MoEConfig.kimi_k2(num_experts=16, normalize=False, routed_scaling_factor=1.0)
    logits = rng.standard_normal((50, 16)).astype(np.float32)
    bias = np.zeros(16, np.float32)
    bias[3] = 10.0  # expert 3 always selected...
    ids, w = router.route(jnp.asarray(logits), cfg, correction_bias_e=jnp.asarray(bias))
    ids, w = np.asarray(ids), np.asarray(w)
    assert (ids == 3).any(axis=1).all()
    # ...but weighted by its unbiased sigmoid score.
    slot = np.argmax(ids == 3, axis=1)
    np.testing.assert_allclose(w[np.arange(50), slot], 1 / (1 + np.exp(-logits[:, 3])), rtol=1e-6)


def test_ties_are_broken_toward_the_lower_index():
    cfg = MoEConfig.deepseek_v3(num_experts=16, top_k=3, num_groups=4, topk_groups=2)
    ids = np.asarray(router.route(jnp.zeros((5, 16)), cfg)[0])  # every score equal
    np.testing.assert_array_equal(ids, np.tile([0, 1, 2], (5, 1)))
    ids2 = np.asarray(router.route(jnp.zeros((5, 16)), cfg)[0])
    np.testing.assert_array_equal(ids, ids2)


def test_scaling_and_normalization(rng):
    cfg = MoEConfig.kimi_k2(num_experts=32)
    w = np.asarray(router.route(jnp.asarray(rng.standard_normal((10, 32)), jnp.float32), cfg)[1])
    np.testing.assert_allclose(w.sum(-1), 2.827, rtol=1e-5)


def test_a_nan_token_does_not_disturb_the_others(rng):
    cfg = MoEConfig.kimi_k2(num_experts=32)
    logits = rng.standard_normal((8, 32)).astype(np.float32)
    ids, w = router.route(jnp.asarray(logits), cfg)
    logits[2] = np.nan
    ids_nan, w_nan = router.route(jnp.asarray(logits), cfg)
    keep = np.arange(8) != 2
    np.testing.assert_array_equal(np.asarray(ids_nan)[keep], np.asarray(ids)[keep])
    np.testing.assert_array_equal(np.asarray(w_nan)[keep], np.asarray(w)[keep])
    assert ((np.asarray(ids_nan) >= 0) & (np.asarray(ids_nan) < 32)).all()  # ids stay valid


def test_bad_input_names_the_argument():
    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=16, expert_intermediate_size=16)
    with pytest.raises(ValueError, match=r"logits_te: rank 1"):
        router.route(jnp.zeros(8), cfg)
    with pytest.raises(ValueError, match=r"logits_te: 7 experts .* expected config.num_experts = 8"):
        router.route(jnp.zeros((4, 7)), cfg)
    with pytest.raises(ValueError, match=r"logits_te: dtype int32"):
        router.route(jnp.zeros((4, 8), jnp.int32), cfg)
    with pytest.raises(ValueError, match=r"correction_bias_e: shape \(7,\), expected \(8,\)"):
        router.route(jnp.zeros((4, 8)), cfg, correction_bias_e=jnp.zeros(7))


def test_load_balance_loss_is_one_when_balanced_and_k_when_collapsed():
    valid = jnp.ones(16, bool)
    balanced = jnp.asarray(np.arange(64).reshape(16, 4) % 8)
    sums = router.load_statistics(jnp.ones((16, 8)), balanced, valid, 8)
    assert float(router.load_balance_loss(*sums, top_k=4)) == pytest.approx(1.0)
    # Every token on experts 0..3 with all its probability there: E * 4 * (1/4 * 1/4) = 2.
    collapsed = jnp.tile(jnp.arange(4), (16, 1))
    scores = jnp.concatenate([jnp.ones((16, 4)), jnp.zeros((16, 4))], axis=1)
    sums = router.load_statistics(scores, collapsed, valid, 8)
    np.testing.assert_array_equal(sums[0], [16] * 4 + [0] * 4)
    assert float(router.load_balance_loss(*sums, top_k=4)) == pytest.approx(2.0)
    # Padding tokens (id E, invalid) are not counted.
    sums = router.load_statistics(jnp.ones((2, 8)), jnp.asarray([[0], [8]]), jnp.asarray([True, False]), 8)
    assert int(sums[0].sum()) == 1 and int(sums[2]) == 1


def test_tokens_left_out_of_the_statistics_cannot_poison_them():
    # Token 1's scores are NaN (a NaN activation): left out, it changes no sum.
    scores = jnp.asarray([[0.5, 0.5, 0.0], [np.nan] * 3, [0.25, 0.25, 0.5]])
    ids = jnp.asarray([[0], [1], [2]])
    counts, prob_sum, num = router.load_statistics(scores, ids, jnp.asarray([True, False, True]), 3)
    np.testing.assert_array_equal(counts, [1, 0, 1])
    np.testing.assert_allclose(prob_sum, [0.75, 0.75, 0.5])
    assert int(num) == 2
    assert np.isfinite(float(router.load_balance_loss(counts, prob_sum, num, top_k=1)))


def test_underflowed_sigmoid_scores_and_no_tokens_give_finite_statistics():
    cfg = MoEConfig.kimi_k2(num_experts=4, top_k=1)
    scores = router.expert_scores(jnp.full((2, 4), -200.0), cfg)  # sigmoid underflows to 0
    assert float(jnp.max(scores)) == 0.0
    sums = router.load_statistics(scores, jnp.zeros((2, 1), jnp.int32), jnp.ones(2, bool), 4)
    assert np.isfinite(np.asarray(sums[1])).all()
    empty = router.load_statistics(jnp.zeros((0, 4)), jnp.zeros((0, 1), jnp.int32), jnp.zeros(0, bool), 4)
    assert int(empty[2]) == 0 and float(router.load_balance_loss(*empty, top_k=1)) == 0.0


def test_router_z_loss_matches_numpy_and_leaves_tokens_out(rng):
    logits = rng.standard_normal((9, 6)) * 4
    counted = np.ones(9, bool)
    counted[[2, 7]] = False
    logits[2] = np.nan  # left out: must not poison the sum
    z_sum = router.z_loss_sum(jnp.asarray(logits, jnp.float32), jnp.asarray(counted))
    kept = logits[counted]
    lse = np.log(np.exp(kept - kept.max(1, keepdims=True)).sum(1)) + kept.max(1)
    assert z_sum.dtype == jnp.float32 and z_sum.shape == ()
    np.testing.assert_allclose(float(router.router_z_loss(z_sum, jnp.int32(7))), np.mean(lse**2), rtol=1e-5)
    # Differentiable, and the NaN token's logits get a zero (not NaN) gradient.
    grad = jax.grad(lambda l: router.z_loss_sum(l, jnp.asarray(counted)))(jnp.asarray(logits, jnp.float32))
    softmax = np.exp(kept - lse[:, None])
    np.testing.assert_allclose(np.asarray(grad)[counted], 2 * lse[:, None] * softmax, rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(grad)[~counted], 0.0)
    empty = router.z_loss_sum(jnp.zeros((0, 6)), jnp.zeros(0, bool))
    assert float(router.router_z_loss(empty, jnp.int32(0))) == 0.0


def test_correction_bias_moves_by_the_sign_of_the_load_gap():
    bias = jnp.asarray([0.5, 0.0, -0.25, 0.0], jnp.bfloat16)
    load = jnp.asarray([7, 1, 4, 4], jnp.int32)  # mean 4: over, under, at, at
    new = router.update_correction_bias(bias, load, 0.125)
    assert new.dtype == jnp.float32 and new.shape == (4,)
    np.testing.assert_array_equal(new, [0.375, 0.125, -0.25, 0.0])
    # No tokens: nothing to balance.
    zeros = router.update_correction_bias(bias, jnp.zeros(4, jnp.int32), 0.125)
    np.testing.assert_array_equal(zeros, np.asarray(bias, np.float32))
    # Under jit, with a traced rate.
    traced = jax.jit(router.update_correction_bias)(bias, load, jnp.float32(0.125))
    np.testing.assert_array_equal(traced, new)


@pytest.mark.parametrize("args, message", [
    ((jnp.zeros(4), jnp.zeros(4, jnp.int32), 0.0), r"^rate: 0.0, expected a finite number > 0$"),
    ((jnp.zeros(4), jnp.zeros(4, jnp.int32), -1), r"^rate: -1.0, expected a finite number > 0$"),
    ((jnp.zeros(4), jnp.zeros(4, jnp.int32), float("nan")), r"^rate: nan, expected a finite number > 0$"),
    ((jnp.zeros(4), jnp.zeros(4, jnp.int32), "fast"), r"^rate: 'fast', expected a finite number > 0$"),
    ((jnp.zeros(4), jnp.zeros(4, jnp.int32), True), r"^rate: True, expected a finite number > 0$"),
    ((jnp.zeros(4), jnp.zeros(4, jnp.int32), jnp.ones(2)), r"^rate: .*, expected a finite number > 0$"),
    ((jnp.zeros((4, 1)), jnp.zeros(4, jnp.int32), 1e-3), r"^bias_e: shape \(4, 1\), expected \[E\]$"),
    ((jnp.zeros(4, jnp.int32), jnp.zeros(4, jnp.int32), 1e-3), r"^bias_e: dtype int32, expected a floating dtype$"),
    ((jnp.zeros(4), jnp.zeros(5, jnp.int32), 1e-3),
     r"^tokens_per_expert_e: shape \(5,\), expected \(4,\) like bias_e$"),
    ((jnp.zeros(4), jnp.zeros(4, bool), 1e-3), r"^tokens_per_expert_e: dtype bool, expected an int or float dtype$"),
    ((jnp.zeros(4), [1, 2, 3, 4], 1e-3), r"^tokens_per_expert_e: list, expected an array \[E\]$"),
])
def test_correction_bias_update_rejects_bad_input(args, message):
    with pytest.raises(ValueError, match=message):
        router.update_correction_bias(*args)


# --- the logits ------------------------------------------------------------------------------


def _float64_logits(x, w):
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    return x64 @ w64.T, np.abs(x64) @ np.abs(w64).T


def test_bf16_parts_sum_to_the_float32_weights_exactly(rng):
    # Magnitudes over many binades, and values a rounded split would round up (all low bits set).
    w = (rng.standard_normal((48, 640)) * np.exp2(rng.integers(-30, 30, (48, 640)))).astype(np.float32)
    w[0, :8] = np.frombuffer(np.uint32(0x3FFFFFFF).tobytes() * 8, np.float32)
    parts = np.asarray(router._bf16_parts(jnp.asarray(w)), np.float64)
    np.testing.assert_array_equal(parts.sum(0), w.astype(np.float64))


@pytest.mark.parametrize("w_dtype,parts", [(jnp.float32, 3), (jnp.float16, 2), (jnp.bfloat16, 1)])
def test_bf16_parts_are_as_many_as_the_stored_weights_need(rng, w_dtype, parts):
    # Weights stored in float16 or bf16 (a checkpoint's router, kept as stored) need fewer parts;
    # the sum of those is still the weights exactly, subnormal and extreme float16 values included.
    w = (rng.standard_normal((16, 256)) * np.exp2(rng.integers(-20, 14, (16, 256)))).astype(w_dtype)
    if w_dtype == jnp.float16:
        w[0, :4] = np.array([6.0e-8, -6.1e-5, 65504.0, np.float16(1) + np.finfo(np.float16).eps], np.float16)
    assert router.bf16_parts(w.dtype) == parts
    got = np.asarray(router._bf16_parts(jnp.asarray(w, jnp.float32), parts), np.float64)
    assert got.shape == (parts, 16, 256)
    np.testing.assert_array_equal(got.sum(0), np.asarray(w, np.float64))


@pytest.mark.parametrize("dtype,w_dtype,parts", [(jnp.bfloat16, jnp.float32, 3), (jnp.bfloat16, jnp.float16, 2),
                                                 (jnp.bfloat16, jnp.bfloat16, 1), (jnp.float32, jnp.float32, None)])
def test_logits_have_float32_accuracy(rng, dtype, w_dtype, parts):
    # Against float64: each logit within a few float32 roundings of sum |x_h w_h| (a TF32 or bf16
    # product would be ~1e-3 of it), and no worse than a float32 matmul at HIGHEST; one bf16
    # matmul of bf16 x against as many bf16 parts of w as its stored dtype needs.
    x = jnp.asarray(rng.standard_normal((64, 2048)), dtype)
    w = jnp.asarray(rng.standard_normal((96, 2048)) / np.sqrt(2048), w_dtype)
    exact, scale = _float64_logits(x, w)
    y = np.asarray(jax.jit(router.logits)(x, w), np.float64)
    highest = np.asarray(jnp.matmul(x.astype(jnp.float32), w.astype(jnp.float32).T, precision="highest"), np.float64)
    err, err_highest = np.max(np.abs(y - exact) / scale), np.max(np.abs(highest - exact) / scale)
    assert err < 2e-6 and err <= 4 * err_highest + 1e-7, (err, err_highest)
    scope = f"logits_bf16x{parts}" if dtype == jnp.bfloat16 else "logits_float32"
    hlo = jax.jit(router.logits).lower(x, w).compile().as_text()
    assert f"moe_jax.router.{scope}" in hlo
    if dtype == jnp.bfloat16 and jax.default_backend() == "cpu":
        # The matmul's output has parts x 96 columns (XLA:CPU leaves it whole; a GPU's GEMM
        # fusion may fold the parts' sum into its epilogue).
        assert re.search(rf"f32\[(64,{96 * parts}|{96 * parts},64)\]", hlo), scope


def test_bf16_weights_give_the_float32_weights_logits(rng):
    # The same values stored in bf16 and in float32: one part against three (two of them zero).
    # The same sums of exact products; a GPU's GEMM may order them differently for 24 and 72
    # columns, so equal within float32's rounding of sum |x w|.
    x = jnp.asarray(rng.standard_normal((32, 512)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((24, 512)) / 20, jnp.bfloat16)
    one, three = (np.asarray(jax.jit(router.logits)(x, v), np.float64) for v in (w, w.astype(jnp.float32)))
    _, scale = _float64_logits(x, w.astype(jnp.float32))
    assert np.max(np.abs(one - three) / scale) < 8 * np.finfo(np.float32).eps


def test_logits_choose_the_float64_top_k_between_near_ties(rng):
    # Pairs of experts whose float64 logits differ by a few float32 ulps of the row: a TF32 or
    # bf16 matmul flips many of them; the bf16x3 logits order each pair as float64 does whenever
    # the gap exceeds float32's error bound.
    t, h, e = 256, 1024, 16
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
    w = rng.standard_normal((e, h)) / np.sqrt(h)
    w[1::2] = w[0::2] + rng.standard_normal((e // 2, h)) * 1e-3 / np.sqrt(h)  # near-twins: gaps ~1e-4 of the row
    w = w.astype(np.float32)
    exact, scale = _float64_logits(x, w)
    y = np.asarray(router.logits(x, jnp.asarray(w)), np.float64)
    gap = exact[:, 0::2] - exact[:, 1::2]
    resolvable = np.abs(gap) > 64 * np.finfo(np.float32).eps * scale[:, 0::2]
    assert resolvable.sum() > t  # the draw has decisions to get right
    np.testing.assert_array_equal(np.sign(y[:, 0::2] - y[:, 1::2])[resolvable], np.sign(gap)[resolvable])


@pytest.mark.parametrize("w_dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_logits_gradients_against_float64_and_on_the_tensor_cores(rng, w_dtype):
    """The bf16 path's VJP: the weights' gradient ``probe^T x`` to float32's accuracy, the tokens'
    ``probe w`` to within one bf16 rounding of float64 (it is returned in bf16, as ``x`` is),
    every product of the backward in bf16 (a float32 matmul there ran on the SIMT cores)."""
    x = jnp.asarray(rng.standard_normal((96, 256)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((12, 256)) / 16, w_dtype)
    # Cotangents of every magnitude, so that the lower bf16 parts matter.
    probe = jnp.asarray(rng.standard_normal((96, 12)) * np.exp2(rng.integers(-16, 6, (96, 12))), jnp.float32)
    grad = jax.jit(jax.grad(lambda x, w: jnp.sum(router.logits(x, w) * probe), argnums=(0, 1)))
    dx, dw = grad(x, w)
    assert (dx.dtype, dw.dtype) == (jnp.bfloat16, jnp.dtype(w_dtype))
    p64, w64, x64 = (np.asarray(v, np.float64) for v in (probe, w, x))
    want_dx, want_dw = p64 @ w64, p64.T @ x64
    bound = np.abs(p64) @ np.abs(w64)  # what the float32 rounding of each sum is relative to
    assert np.all(np.abs(np.asarray(dx, np.float64) - want_dx) <= 2.0**-8 * np.abs(want_dx) + 2.0**-12 * bound)
    if w_dtype == jnp.float32:  # the gradient is float32: float32's accuracy
        np.testing.assert_array_less(np.abs(np.asarray(dw, np.float64) - want_dw),
                                     2.0**-16 * (np.abs(p64).T @ np.abs(x64)) + 1e-30)
    else:  # rounded to the weights' dtype
        eps = float(jnp.finfo(w_dtype).eps)
        assert np.all(np.abs(np.asarray(dw, np.float64) - want_dw) <= eps * np.abs(want_dw) + 1e-6 * np.abs(want_dw).max())
    dots = dot_operands(grad.lower(x, w).as_text())
    assert dots and {dtype for dot in dots for _, dtype in dot} == {"bf16"}, dots


def stable_top_k_np(values, k):
    """The reference order: largest first, ties to the lower index, NaN as +inf, -0.0 tied with
    +0.0 (float64, a stable sort)."""
    v = np.where(np.isnan(values), np.inf, values.astype(np.float64))
    return np.argsort(-v, axis=-1, kind="stable")[:, :k]


@pytest.mark.parametrize(("width", "k"), [(width, k) for width in (8, 255, 256, 384, 1023, 1024, 1500)
                                          for k in (1, 8, 16, 17) if k <= width])
@pytest.mark.parametrize("method", ["sort", "argmax"])
def test_top_k_ids_is_the_stable_order_at_every_width(rng, width, k, method):
    """Both methods choose the same ids in the same order as a stable float64 sort: ties (a few
    levels), -inf and +inf entries, a row of -inf only, NaN (as +inf), and -0.0 tied with +0.0
    (on GPUs ``jax.lax.top_k`` puts -0.0 below +0.0 in rows under 1024 entries, not in longer
    ones: 230b69d's check, H100) included."""
    values = rng.integers(0, 6, (40, width)).astype(np.float32) * 0.25  # many exact ties
    values[1] = -np.inf
    values[2, ::3] = -np.inf
    values[3, 5] = np.inf
    values[4, [7, 2]] = np.nan
    values[5, -1] = np.inf
    values[6] = np.where(np.arange(width) % 2, -0.0, 0.0)  # signed zeros alternating
    values[7, :] = -1.0
    values[7, ::4] = -0.0
    ids = np.asarray(router.top_k_ids(jnp.asarray(values), k, method=method))
    assert ids.dtype == np.int32 and ids.shape == (40, k)
    np.testing.assert_array_equal(ids, stable_top_k_np(values, k))
    assert ((ids >= 0) & (ids < width)).all()


@pytest.mark.parametrize(("values", "k", "message"), [
    (np.zeros((4, 8), np.int32), 2, r"choice_te: int32\[4, 8\], expected a floating \[T, E\]"),
    (np.zeros((8,), np.float32), 2, r"choice_te: float32\[8\], expected a floating \[T, E\]"),
    (np.zeros((4, 8), np.float32), 9, r"k: 9, expected an int in \[1, E = 8\]"),
    (np.zeros((4, 8), np.float32), 0, r"k: 0, expected an int in \[1, E = 8\]"),
])
def test_top_k_ids_names_a_bad_argument(values, k, message):
    with pytest.raises(ValueError, match=message):
        router.top_k_ids(jnp.asarray(values), k)


def test_top_k_ids_names_a_bad_method():
    with pytest.raises(ValueError, match=r"method: 'padded', expected 'sort', 'argmax' or None"):
        router.top_k_ids(jnp.zeros((4, 8)), 2, method="padded")


@pytest.mark.parametrize(("tokens", "experts", "k", "platform", "want"), [
    (8192, 384, 8, "gpu", "argmax"), (4096, 256, 8, "gpu", "argmax"), (4095, 384, 8, "gpu", "sort"),
    (8192, 8, 2, "gpu", "sort"), (8192, 384, 17, "gpu", "sort"), (8192, 384, 8, "cpu", "sort"),
])
def test_top_k_method_follows_the_measured_crossover(tokens, experts, k, platform, want):
    assert router.top_k_method(tokens, experts, k, platform=platform) == want


@pytest.mark.gpu
def test_kimi_size_top_k_runs_as_argmaxes_with_the_sorts_choice(rng):
    """At Kimi K2's [8192, 384] a GPU takes the argmaxes by default (named in the HLO, no sort in
    the compiled program), and their choice is the sort's: ``jax.lax.top_k`` on the same GPU (of
    the zeros made one sign) and the stable float64 order, with exact ties, -inf entries and
    signed zeros."""
    values = rng.integers(0, 50, (8192, 384)).astype(np.float32) / 49
    values[::97, ::5] = -np.inf
    values[1::89] = np.where(np.arange(384) % 3, -0.0, 0.0)
    x = jax.device_put(jnp.asarray(values), jax.devices("gpu")[0])
    chosen = jax.jit(lambda v: router.top_k_ids(v, 8))
    assert "moe_jax.router.top_k_argmax" in chosen.lower(x).as_text(debug_info=True)
    hlo = chosen.lower(x).compile().as_text()
    assert " sort(" not in hlo, [line for line in hlo.splitlines() if "sort" in line][:3]
    ids = np.asarray(chosen(x))
    np.testing.assert_array_equal(ids, np.asarray(jax.jit(lambda v: jax.lax.top_k(v, 8)[1])(
        jax.device_put(np.where(values == 0, np.float32(0), values), jax.devices("gpu")[0]))))
    np.testing.assert_array_equal(ids, stable_top_k_np(values, 8))
