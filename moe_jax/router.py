"""Top-k routing: softmax (Mixtral, Qwen) and the DeepSeek-V3 / Kimi K2 sigmoid rule.

Dimension letters: ``t`` tokens, ``e`` experts, ``k`` top-k slots, ``g`` expert groups.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, assert_never

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
    from moe_jax.config import MoEConfig


def expert_scores(logits_te: jax.Array, config: MoEConfig) -> jax.Array:
    """Per-expert scores in float32 ``[T, E]``: softmax or sigmoid of the router logits."""
    logits_te = logits_te.astype(jnp.float32)
    match config.scoring:
        case "softmax":
            return jax.nn.softmax(logits_te, axis=-1)
        case "sigmoid":
            return jax.nn.sigmoid(logits_te)
        case _ as unreachable:
            assert_never(unreachable)


def route(
    logits_te: jax.Array, config: MoEConfig, *, correction_bias_e: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Chooses ``config.top_k`` experts per token and their combine weights.

    1. scores = softmax or sigmoid of ``logits_te`` (float32);
    2. selection uses ``scores + correction_bias_e`` (the bias never enters the weights);
    3. with ``num_groups > 1`` only experts in the ``topk_groups`` best groups are eligible,
       a group's score being the sum of its two best biased scores (DeepSeek-V3);
    4. weights are the unbiased scores of the chosen experts, divided by their sum when
       ``normalize`` (plus 1e-20, as DeepSeek-V3 does), then times ``routed_scaling_factor``.

    Ties go to the lower expert (or group) index, so routing is deterministic.

    Args:
      logits_te: ``[T, E]`` router logits, any float dtype.
      config: the layer config (scoring, top_k, groups, normalize, scaling).
      correction_bias_e: optional float ``[E]`` selection bias (DeepSeek-V3's
        ``e_score_correction_bias``).

    Returns:
      ``(ids_tk int32 [T, k], weights_tk float32 [T, k])``, ids ordered by selection score.
    """
    num_tokens, num_experts = _check_logits(logits_te, config)
    scores_te = expert_scores(logits_te, config)
    choice_te = scores_te
    if correction_bias_e is not None:
        if correction_bias_e.shape != (num_experts,):
            raise ValueError(
                f"correction_bias_e: shape {correction_bias_e.shape}, expected ({num_experts},)"
            )
        choice_te = scores_te + correction_bias_e.astype(jnp.float32)[None, :]
    if config.num_groups > 1:
        choice_te = _keep_best_groups(choice_te, config.num_groups, config.topk_groups)
    _, ids_tk = jax.lax.top_k(choice_te, config.top_k)
    weights_tk = jnp.take_along_axis(scores_te, ids_tk, axis=-1)
    if config.normalize:
        weights_tk = weights_tk / (jnp.sum(weights_tk, axis=-1, keepdims=True) + 1e-20)
    weights_tk = weights_tk * jnp.float32(config.routed_scaling_factor)
    return ids_tk.astype(jnp.int32), weights_tk


def _keep_best_groups(choice_te: jax.Array, num_groups: int, topk_groups: int) -> jax.Array:
    """Sets the scores of experts outside the ``topk_groups`` best groups to -inf."""
    t, e = choice_te.shape
    choice_tgx = choice_te.reshape(t, num_groups, e // num_groups)
    group_score_tg = jnp.sum(jax.lax.top_k(choice_tgx, 2)[0], axis=-1)
    _, best_groups = jax.lax.top_k(group_score_tg, topk_groups)
    keep_tg = jnp.zeros((t, num_groups), bool).at[jnp.arange(t)[:, None], best_groups].set(True)
    return jnp.where(keep_tg[:, :, None], choice_tgx, -jnp.inf).reshape(t, e)


def load_statistics(scores_te: jax.Array, ids_tk: jax.Array, counted_t: jax.Array, num_experts: int):
    """Sums that the load-balance loss needs; additive over tokens, so they can be psum'd.

    Args:
      scores_te: float32 ``[T, E]`` expert scores (:func:`expert_scores`).
      ids_tk: int32 ``[T, k]`` chosen experts; ``num_experts`` means routed nowhere.
      counted_t: bool ``[T]``, the tokens the statistics cover. Callers leave out padding
        and non-finite tokens: one NaN score would otherwise make every sum NaN.
      num_experts: E.

    Returns:
      ``(counts_e int32 [E], prob_sum_e float32 [E], num_tokens int32 [])``: assignments per
      expert, per-token-normalized scores summed, and the number of tokens, each over the
      counted tokens only.
    """
    counts_e = jnp.bincount(jnp.where(counted_t[:, None], ids_tk, num_experts).reshape(-1),
                            length=num_experts).astype(jnp.int32)
    # Sigmoid scores of a token whose logits all sit below about -104 underflow to zero: its
    # normalized scores are then zero rather than 0 / 0.
    total_t1 = jnp.sum(scores_te, axis=-1, keepdims=True)
    probs_te = scores_te / jnp.maximum(total_t1, jnp.finfo(jnp.float32).tiny)
    # A select, not a product: NaN scores of tokens left out must not reach the sums.
    prob_sum_e = jnp.sum(jnp.where(counted_t[:, None], probs_te, 0.0), axis=0)
    return counts_e, prob_sum_e, jnp.sum(counted_t).astype(jnp.int32)


def load_balance_loss(counts_e: jax.Array, prob_sum_e: jax.Array, num_tokens: jax.Array, top_k: int) -> jax.Array:
    """Switch-Transformer auxiliary loss ``E * sum_e f_e * p_e``; 1.0 when perfectly balanced.

    ``f_e = counts_e / (T * k)`` is the fraction of assignments that went to expert e and
    ``p_e = prob_sum_e / T`` its mean normalized score, from :func:`load_statistics`.
    0.0 when no token was counted (an empty batch): every sum is then zero.
    """
    # Divide by at least one token so an empty batch gives 0.0, not 0 / 0.
    num_tokens = jnp.maximum(num_tokens, 1)
    f_e = counts_e / (num_tokens * top_k)
    return counts_e.shape[0] * jnp.sum(f_e * prob_sum_e / num_tokens)


def _check_logits(logits_te: jax.Array, config: MoEConfig) -> tuple[int, int]:
    if logits_te.ndim != 2:
        raise ValueError(f"logits_te: rank {logits_te.ndim} (shape {logits_te.shape}), expected 2 ([T, E])")
    if not jnp.issubdtype(logits_te.dtype, jnp.floating):
        raise ValueError(f"logits_te: dtype {logits_te.dtype}, expected a floating dtype")
    if logits_te.shape[1] != config.num_experts:
        raise ValueError(
            f"logits_te: {logits_te.shape[1]} experts (shape {logits_te.shape}), "
            f"expected config.num_experts = {config.num_experts}"
        )
    return logits_te.shape
