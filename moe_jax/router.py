"""Top-k routing: softmax (Mixtral, Qwen) and the DeepSeek-V3 / Kimi K2 sigmoid rule, and
what balances the load: the auxiliary losses' sums and DeepSeek-V3's correction-bias update.

Dimension letters: ``t`` tokens, ``e`` experts, ``k`` top-k slots, ``g`` expert groups.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, assert_never

import jax
import jax.numpy as jnp

from moe_jax.manual_axes import varying_alike

if TYPE_CHECKING:
    from moe_jax.config import MoEConfig


def logits(x_th: jax.Array, w_eh: jax.Array) -> jax.Array:
    """The router's logits ``x_th @ w_eh^T``, float32 ``[T, E]``, with float32's accuracy.

    A GPU's default for float32 matmuls (TF32, 10-bit mantissa) would flip the choice between
    near-tied experts, so the published models' float32 gates are honoured:

    * bf16 ``x_th`` (the serving case): ``w_eh`` is split exactly into as many bf16 parts as its
      significand needs (:func:`bf16_parts`: three for float32, ``w = hi + mid + lo``; two for
      float16; one for bf16 weights, as checkpoints store Kimi K2's and DeepSeek-V3's router and
      the loader keeps them), and one bf16 matmul of ``x`` against the ``[parts * E, H]`` stack
      runs on the tensor cores: every product of two bf16 values is exact in float32, the
      accumulation is float32's, so the error bound is float32's (measured on an H200 at 8192 x
      7168 x 384 with three parts: 0.18 ms against 0.99 ms for the float32 SIMT matmul;
      ``benchmarks/results/prefill_h200/``). HLO scope ``moe_jax.router.logits_bf16x{parts}``.
      Its gradients run on the tensor cores the same way (:func:`_bf16xn_logits_bwd`): the
      weights' to float32's accuracy, the tokens' to within bf16's rounding, which they get.
    * any other dtype: float32 at precision ``HIGHEST`` (IEEE float32), scope
      ``moe_jax.router.logits_float32``.

    Args:
      x_th: ``[T, H]`` floating.
      w_eh: ``[E, H]`` floating (float32 in the layer's parameters; as stored when loaded).
    """
    if x_th.dtype == jnp.bfloat16:
        parts = bf16_parts(w_eh.dtype)
        with jax.named_scope(f"moe_jax.router.logits_bf16x{parts}"):
            # inside shard_map: the custom VJP's gradients then have their primals' types
            return _bf16xn_logits(*varying_alike(x_th, w_eh.astype(jnp.float32)), parts)
    with jax.named_scope("moe_jax.router.logits_float32"):
        return _float32_logits(x_th, w_eh)


def bf16_parts(dtype) -> int:
    """How many bf16 values sum exactly to any value of ``dtype`` (8 significant bits each):
    1 for bfloat16, 2 for float16 (11 bits, inside bf16's exponent range), else 3 (float32's 24)."""
    return {jnp.dtype(jnp.bfloat16): 1, jnp.dtype(jnp.float16): 2}.get(jnp.dtype(dtype), 3)


def _float32_logits(x_th, w_eh):
    return jnp.matmul(x_th.astype(jnp.float32), w_eh.astype(jnp.float32).T, precision=jax.lax.Precision.HIGHEST)


def _bf16_parts(v: jax.Array, parts: int = 3) -> jax.Array:
    """float32 ``v`` -> bf16 ``[parts, *v.shape]`` whose sum is ``v`` exactly, where every value
    of ``v`` has at most ``8 * parts`` significant bits (:func:`bf16_parts` of its stored dtype;
    any float32 with three parts).

    Each part is the leading 8 significant bits of what the parts before it leave, cut by
    masking the float32 bits (not by rounding: a rounded conversion followed by the convert back
    is a pair XLA may drop under its excess-precision rule, which left the remainder 0 on an
    H200). A float32 significand has 24 bits, so the third remainder has at most 8: every part
    converts to bf16 exactly.
    """
    def leading(a):
        bits = jax.lax.bitcast_convert_type(a, jnp.uint32) & jnp.uint32(0xFFFF0000)
        return jax.lax.bitcast_convert_type(bits, jnp.float32)

    out, rest = [], v
    for _ in range(parts - 1):
        out.append(leading(rest))
        rest = rest - out[-1]
    return jnp.stack([*out, rest]).astype(jnp.bfloat16)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _bf16xn_logits(x_th, w_eh, parts: int):
    parts_pe = _bf16_parts(w_eh, parts).reshape(-1, w_eh.shape[1])
    y_tpe = jnp.dot(x_th, parts_pe.T, preferred_element_type=jnp.float32).reshape(x_th.shape[0], parts, -1)
    return _sum_smallest_first(y_tpe, axis=1)


def _sum_smallest_first(y, axis: int):
    """The parts' products summed along ``axis``, the last (smallest) first."""
    parts = jnp.moveaxis(y, axis, 0)
    total = parts[-1]
    for p in range(parts.shape[0] - 2, -1, -1):
        total = total + parts[p]
    return total


def _bf16xn_logits_fwd(x_th, w_eh, parts):
    return _bf16xn_logits(x_th, w_eh, parts), (x_th, w_eh)


def _bf16xn_logits_bwd(parts, residuals, g_te):
    """The gradients on the tensor cores too (float32 SIMT matmuls otherwise: two of the forward's
    cost), from exact bf16 parts of the float32 cotangent ``g_te = g0 + g1 + g2``:

    * ``dw = g^T x``: every part against ``x`` (bf16), each product exact in float32, float32
      accumulation: float32's accuracy, as the weights' gradient is kept;
    * ``dx = g w``: the products ``g_i w_j`` with ``i + j <= 1`` (each part is below ``2**-7``
      of the one before, so the dropped terms stay within about ``3 * 2**-14`` of
      ``sum_e |g_e| |w_eh|``), then rounded to bf16 (``2**-9``) as ``x`` is.
    """
    x_th, w_eh = residuals
    (num_tokens, num_experts), hidden = g_te.shape, w_eh.shape[1]
    g_pte = _bf16_parts(g_te, 3)
    w_peh = _bf16_parts(w_eh, parts)
    dw_peh = jnp.dot(g_pte.transpose(0, 2, 1).reshape(3 * num_experts, num_tokens), x_th,
                     preferred_element_type=jnp.float32).reshape(3, num_experts, hidden)
    terms = [(i, j) for i in range(3) for j in range(parts) if i + j <= 1]
    g_tn = jnp.concatenate([g_pte[i] for i, _ in terms], axis=1)
    w_nh = jnp.concatenate([w_peh[j] for _, j in terms], axis=0)
    dx_th = jnp.dot(g_tn, w_nh, preferred_element_type=jnp.float32)
    return dx_th.astype(x_th.dtype), _sum_smallest_first(dw_peh, axis=0)


_bf16xn_logits.defvjp(_bf16xn_logits_fwd, _bf16xn_logits_bwd)


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

    Ties go to the lower expert (or group) index, so routing is deterministic. A NaN
    selection score counts as +inf (its token's weights are NaN; its ids stay in ``[0, E)``).

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
    ids_tk = top_k_ids(choice_te, config.top_k)
    weights_tk = jnp.take_along_axis(scores_te, ids_tk, axis=-1)
    if config.normalize:
        weights_tk = weights_tk / (jnp.sum(weights_tk, axis=-1, keepdims=True) + 1e-20)
    weights_tk = weights_tk * jnp.float32(config.routed_scaling_factor)
    return ids_tk, weights_tk


#: XLA sorts rows narrower than 1024 entries whole for ``jax.lax.top_k``. At prefill sizes ``k``
#: row-wise argmaxes (:func:`_top_k_by_argmax`) are faster on a GPU; at decode sizes the sort is.
#: On one H100 (``benchmarks/results/layer_h100/77e571b/router_topk/``, us per call, k = 8), 384
#: experts: 2048 tokens sort 78.8, argmaxes 87.7; 8192 tokens 141.0 against 99.4; 32768 tokens
#: 528.4 against 172.3 (256 experts: 66.8 against 57.4 at 2048, 82.0 against 61.6 at 8192). The
#: rows padded to 1024 for XLA's TopK kernel, this module's earlier choice, took 286.3 at 8192.
TOPK_ARGMAX_MIN_TOKENS = 4096
#: Each argmax is one pass over the row; past this many the sort's one pass wins.
TOPK_ARGMAX_MAX_K = 16
#: Below this many experts a row is short enough that sorting it costs little (Mixtral's 8).
TOPK_ARGMAX_MIN_EXPERTS = 256
#: The key every chosen entry takes before the next argmax: below every float's key
#: (-inf's is -2139095041), so that no entry is chosen twice.
_BELOW_EVERY_FLOAT = -(2**31)


def top_k_method(tokens: int, experts: int, k: int, *, platform: str) -> str:
    """``"argmax"`` or ``"sort"``: how :func:`top_k_ids` chooses for these sizes on ``platform``
    (``"gpu"``, ``"cpu"``, ...): the argmaxes on GPUs from :data:`TOPK_ARGMAX_MIN_TOKENS` tokens,
    :data:`TOPK_ARGMAX_MIN_EXPERTS` experts and up to :data:`TOPK_ARGMAX_MAX_K` choices; else the
    sort (XLA:CPU's sort was never slower there)."""
    if (platform == "gpu" and tokens >= TOPK_ARGMAX_MIN_TOKENS and experts >= TOPK_ARGMAX_MIN_EXPERTS
            and k <= TOPK_ARGMAX_MAX_K):
        return "argmax"
    return "sort"


def _top_k_by_argmax(choice_te: jax.Array, k: int) -> jax.Array:
    """int32 ``[T, k]``: ``k`` argmaxes over an int32 key in the floats' total order; ``argmax``
    takes the first maximum, so ties go to the lower index, as the sort's do. NaN must already be
    mapped to +inf and -0.0 to +0.0."""
    bits_te = jax.lax.bitcast_convert_type(choice_te.astype(jnp.float32), jnp.int32)
    # Negative floats order backwards in their bits: flip all but the sign bit.
    key_te = bits_te ^ ((bits_te >> 31) & jnp.int32(0x7FFFFFFF))
    col_te = jax.lax.broadcasted_iota(jnp.int32, key_te.shape, 1)
    ids = []
    for _ in range(k):
        id_t = jnp.argmax(key_te, axis=-1).astype(jnp.int32)
        ids.append(id_t)
        key_te = jnp.where(col_te == id_t[:, None], jnp.int32(_BELOW_EVERY_FLOAT), key_te)
    return jnp.stack(ids, axis=-1)


def top_k_ids(choice_te: jax.Array, k: int, *, method: str | None = None) -> jax.Array:
    """int32 ``[T, k]``: each row's ``k`` largest entries, largest first, ties to the lower
    index; a NaN counts as +inf, and -0.0 ties with +0.0.

    ``method``: ``"sort"`` (``jax.lax.top_k``), ``"argmax"`` (``k`` row-wise argmaxes over the
    floats' total order, :func:`_top_k_by_argmax`), or None: :func:`top_k_method` for these sizes
    on JAX's default backend. Both choose the same ids in the same order. The HLO names it:
    ``moe_jax.router.top_k_<method>``.
    """
    if getattr(choice_te, "ndim", None) != 2 or not jnp.issubdtype(choice_te.dtype, jnp.floating):
        found = f"{choice_te.dtype}{list(choice_te.shape)}" if hasattr(choice_te, "shape") else type(choice_te).__name__
        raise ValueError(f"choice_te: {found}, expected a floating [T, E] array")
    t, e = choice_te.shape
    if type(k) is not int or not 1 <= k <= e:
        raise ValueError(f"k: {k!r}, expected an int in [1, E = {e}]")
    if method is None:
        method = top_k_method(t, e, k, platform=jax.default_backend())
    if method not in ("sort", "argmax"):
        raise ValueError(f"method: {method!r}, expected 'sort', 'argmax' or None")
    # One order on every backend: on GPUs XLA's TopK kernel for rows of 1024+ entries ties -0.0
    # with +0.0, while its sort of shorter rows and XLA:CPU's put -0.0 below.
    choice_te = jnp.where(jnp.isnan(choice_te), jnp.inf, jnp.where(choice_te == 0, 0.0, choice_te))
    with jax.named_scope(f"moe_jax.router.top_k_{method}"):
        if method == "argmax":
            return _top_k_by_argmax(choice_te, k)
        return jax.lax.top_k(choice_te, k)[1].astype(jnp.int32)


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


def z_loss_sum(logits_te: jax.Array, counted_t: jax.Array) -> jax.Array:
    """``sum_t logsumexp(logits_te[t])^2`` over the counted tokens: float32 ``[]``.

    The numerator of the ST-MoE router z-loss (:func:`router_z_loss`); additive over tokens,
    so it can be psum'd like :func:`load_statistics`' sums.

    Args:
      logits_te: ``[T, E]`` router logits, any float dtype (computed in float32).
      counted_t: bool ``[T]``, the tokens to cover (callers leave out padding and non-finite
        tokens, as for :func:`load_statistics`).
    """
    # Zeros in place of the tokens left out, not only a select of the result: a select's zero
    # cotangent times the non-finite derivative of a NaN token's logsumexp would still be NaN.
    logits_te = jnp.where(counted_t[:, None], logits_te.astype(jnp.float32), 0.0)
    lse_t = jax.nn.logsumexp(logits_te, axis=-1)
    return jnp.sum(jnp.where(counted_t, jnp.square(lse_t), 0.0))


def router_z_loss(z_sum: jax.Array, num_tokens: jax.Array) -> jax.Array:
    """ST-MoE's router z-loss ``mean_t logsumexp(logits_t)^2`` from :func:`z_loss_sum` and the
    token count; 0.0 when no token was counted. Float32 ``[]``. It penalizes large router
    logits, whose roundoff in the exponentials ST-MoE found to destabilize training."""
    return z_sum / jnp.maximum(num_tokens, 1)


def update_correction_bias(bias_e: jax.Array, tokens_per_expert_e: jax.Array, rate) -> jax.Array:
    """DeepSeek-V3's auxiliary-loss-free balancing step: ``bias_e + rate * sign(mean - load_e)``.

    Each expert whose load is above the mean loses ``rate`` of selection bias, each one below
    gains it, one exactly at the mean keeps its bias; an empty batch changes nothing. The bias
    enters only the selection (:func:`route`), so balancing this way leaves the combine
    weights, and the gradients, alone.

    Args:
      bias_e: float ``[E]`` correction bias (``params["router"]["bias_e"]``).
      tokens_per_expert_e: int or float ``[E]`` assignments per expert in the last step
        (``stats["tokens_per_expert"]``, summed over the mesh).
      rate: the step size ``gamma``, a finite number > 0 (DeepSeek-V3 used 1e-3), or a traced
        float scalar (then only its shape and dtype are checked).

    Returns:
      The new bias, float32 ``[E]``.

    Raises:
      ValueError: naming the argument, for a bad rate, shape or dtype.
    """
    _check_rate(rate)
    for name, a in (("bias_e", bias_e), ("tokens_per_expert_e", tokens_per_expert_e)):
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            raise ValueError(f"{name}: {type(a).__name__}, expected an array [E]")
        if len(a.shape) != 1:
            raise ValueError(f"{name}: shape {tuple(a.shape)}, expected [E]")
    if not jnp.issubdtype(bias_e.dtype, jnp.floating):
        raise ValueError(f"bias_e: dtype {bias_e.dtype}, expected a floating dtype")
    count_dtype = tokens_per_expert_e.dtype
    if not (jnp.issubdtype(count_dtype, jnp.integer) or jnp.issubdtype(count_dtype, jnp.floating)):
        raise ValueError(f"tokens_per_expert_e: dtype {tokens_per_expert_e.dtype}, expected an int or float dtype")
    if tokens_per_expert_e.shape != bias_e.shape:
        raise ValueError(f"tokens_per_expert_e: shape {tuple(tokens_per_expert_e.shape)}, expected "
                         f"{tuple(bias_e.shape)} like bias_e")
    load_e = tokens_per_expert_e.astype(jnp.float32)
    # load * E against the total rather than load against total / E: exact in float32 for
    # counts below 2**24, so an expert exactly at the mean gets sign 0, not a rounding's +-1.
    direction_e = jnp.sign(jnp.sum(load_e) - load_e * load_e.shape[0])
    return bias_e.astype(jnp.float32) + jnp.asarray(rate, jnp.float32) * direction_e


def _check_rate(rate) -> None:
    if isinstance(rate, jax.core.Tracer):
        if rate.shape != () or not jnp.issubdtype(rate.dtype, jnp.floating):
            raise ValueError(f"rate: a traced {rate.dtype} array of shape {rate.shape}, expected a float scalar")
        return
    if isinstance(rate, bool) or (not isinstance(rate, (int, float)) and getattr(rate, "shape", None) != ()):
        raise ValueError(f"rate: {rate!r}, expected a finite number > 0")
    value = float(rate)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"rate: {value}, expected a finite number > 0")


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
