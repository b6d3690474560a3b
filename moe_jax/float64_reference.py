"""The MoE layer in float64 NumPy, written from the model definitions: the oracle of ``moe-jax selftest``.

Nothing here calls the layer's JAX code (:mod:`moe_jax.router`, :mod:`moe_jax.layer`): routing
(softmax or sigmoid scores; a correction bias that enters the selection only; DeepSeek-V3's
group-limited top-k, a group scored by the sum of its two best biased scores; the chosen scores
normalized, plus 1e-20, and times the routed scaling factor), the routed SwiGLU experts and the
shared expert are written out again from those definitions (one expert's MLP is the kernels'
float64 reference, :func:`pallas_kernels.grouped_matmul.reference.mlp`). Weights are read exactly: bf16 as
is, NVFP4 dequantized in float64 from its stored bits
(:func:`pallas_kernels.grouped_matmul.reference.dequantize`).

What a path rounds by declaration is rounded here too, since a float64 value that no path can
produce is not a fair reference: the SwiGLU output is rounded to bf16 between the projections
(every path writes it in bf16), and with ``w4a4`` (the native kernels on SM100/SM120) each
routed projection's input rows are quantized to NVFP4 one row at a time by
:func:`moe_jax.nvfp4.quantize_rows`, as those kernels' inputs are. The shared expert is a dense
bf16 MLP in every path. Nothing else is rounded.

Dimension letters: ``t`` tokens, ``h`` hidden, ``e`` experts, ``k`` top-k slots, ``g`` expert
groups (in :func:`route`) or ``2F`` (gate and up stacked, in weights), ``f`` intermediate, ``m``
rows.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, assert_never

import jax
import numpy as np

from moe_jax import nvfp4
from pallas_kernels.grouped_matmul import reference

if TYPE_CHECKING:
    from moe_jax.config import MoEConfig


@dataclasses.dataclass(frozen=True)
class Routing:
    """What :func:`route` chose.

    Attributes:
      ids_tk: int ``[T, k]``, the chosen experts by selection score (ties to the lower index).
      weights_tk: float64 ``[T, k]``, their combine weights.
      margin_t: float64 ``[T]``, the smallest gap in selection score that decided the token's
        experts: between its k-th and (k+1)-th eligible expert and, with groups, between its
        ``topk_groups``-th and next group (inf where there is no alternative). A token whose
        margin is below the rounding of an implementation's router may route differently there.
    """

    ids_tk: np.ndarray
    weights_tk: np.ndarray
    margin_t: np.ndarray


def _gap(sorted_desc_tn: np.ndarray, n: int) -> np.ndarray:
    """``sorted[:, n-1] - sorted[:, n]`` (inf where there is no n-th alternative)."""
    if n >= sorted_desc_tn.shape[1]:
        return np.full(sorted_desc_tn.shape[0], np.inf)
    with np.errstate(invalid="ignore"):  # -inf - -inf: both ineligible, never a deciding gap
        gap = sorted_desc_tn[:, n - 1] - sorted_desc_tn[:, n]
    return np.where(np.isnan(gap), np.inf, gap)


def route(logits_te: np.ndarray, config: MoEConfig, bias_e: np.ndarray | None = None) -> Routing:
    """Top-k routing of float64 logits ``[T, E]`` by ``config``'s rule (see the module docstring)."""
    logits_te = np.asarray(logits_te, np.float64)
    match config.scoring:
        case "softmax":
            z_te = np.exp(logits_te - logits_te.max(axis=1, keepdims=True))
            scores_te = z_te / z_te.sum(axis=1, keepdims=True)
        case "sigmoid":
            scores_te = 1.0 / (1.0 + np.exp(-logits_te))
        case _ as unreachable:
            assert_never(unreachable)
    choice_te = scores_te if bias_e is None else scores_te + np.asarray(bias_e, np.float64)[None, :]
    t, e = choice_te.shape
    margin_t = np.full(t, np.inf)
    if config.num_groups > 1:
        per_group = e // config.num_groups
        choice_tgx = choice_te.reshape(t, config.num_groups, per_group)
        group_score_tg = -np.sort(-choice_tgx, axis=2)[:, :, :2].sum(axis=2)
        best_tg = np.argsort(-group_score_tg, axis=1, kind="stable")[:, :config.topk_groups]
        eligible_tg = np.zeros((t, config.num_groups), bool)
        np.put_along_axis(eligible_tg, best_tg, True, axis=1)
        choice_te = np.where(np.repeat(eligible_tg, per_group, axis=1), choice_te, -np.inf)
        margin_t = _gap(-np.sort(-group_score_tg, axis=1), config.topk_groups)
    order_te = np.argsort(-choice_te, axis=1, kind="stable")
    margin_t = np.minimum(margin_t, _gap(np.take_along_axis(choice_te, order_te, axis=1), config.top_k))
    ids_tk = order_te[:, :config.top_k]
    weights_tk = np.take_along_axis(scores_te, ids_tk, axis=1)
    if config.normalize:
        weights_tk = weights_tk / (weights_tk.sum(axis=1, keepdims=True) + 1e-20)
    return Routing(ids_tk, weights_tk * config.routed_scaling_factor, margin_t)


_quantize_rows = jax.jit(nvfp4.quantize_rows)


def nvfp4_rows(a_mk: np.ndarray) -> np.ndarray:
    """float64 rows ``[M, K]`` quantized to NVFP4 one row at a time (:func:`moe_jax.nvfp4.quantize_rows`,
    the W4A4 kernels' quantizer, on the host CPU), dequantized exactly."""
    m = a_mk.shape[0]
    # Rows are quantized independently (an all-zero row stays zero), so padding M to a power of
    # two costs nothing and compiles one quantizer per size class, not per expert's row count.
    padded = np.zeros((max(8, 1 << (m - 1).bit_length()), a_mk.shape[1]), np.float32)
    padded[:m] = a_mk
    packed, scales, global_scale = jax.device_get(_quantize_rows(jax.device_put(padded, jax.devices("cpu")[0])))
    return reference.dequantize(packed[:m, None], scales[:m, None], global_scale[:m])[:, 0]


def expert_mlp(x_mh: np.ndarray, w_gate_up_gh: np.ndarray, w_down_hf: np.ndarray, *, w4a4: bool) -> np.ndarray:
    """One SwiGLU expert on float64 rows ``[M, H]``: ``down(bf16(silu(x W_gate^T) * (x W_up^T)))``
    (:func:`pallas_kernels.grouped_matmul.reference.mlp`), weights float64 (out, in), gate rows
    before up rows; with ``w4a4`` both projections' inputs quantized to NVFP4 per row first."""
    return reference.mlp(x_mh, w_gate_up_gh, w_down_hf, quantize_rows=nvfp4_rows if w4a4 else None)


def dense(w) -> np.ndarray:
    """A bf16 or float32 matrix, or an :class:`~moe_jax.nvfp4.NVFP4Tensor` ``[N, K]``, as float64."""
    if isinstance(w, nvfp4.NVFP4Tensor):
        packed, scales, global_scale = jax.device_get((w.packed, w.scales, w.global_scale))
        return reference.dequantize(packed[None], scales[None], np.asarray(global_scale)[None])[0]
    return np.asarray(jax.device_get(w)).astype(np.float64)


def layer(params: dict, x_th: np.ndarray, config: MoEConfig, *,
          w4a4: tuple[bool, ...] = (False,)) -> tuple[dict[bool, np.ndarray], Routing]:
    """The layer ``y = sum_k w_k expert_k(x) + shared(x)`` in float64.

    Only the experts the tokens route to are read, one at a time, and each once for all entries
    of ``w4a4`` (dequantizing a full-size NVFP4 expert is what costs time here).

    Args:
      params: :func:`moe_jax.init_params`' layout (host or device arrays, bf16 or NVFP4).
      x_th: float64 ``[T, H]`` tokens (the values the layer is given).
      config: the layer.
      w4a4: the routed experts' numerics to compute: False for bf16 activations, True for
        activations quantized to NVFP4 per row.

    Returns:
      ``({w4a4: float64 y_th [T, H]}, routing)``.
    """
    router = params["router"]
    logits_te = x_th @ dense(router["w_eh"]).T
    routing = route(logits_te, config, None if "bias_e" not in router else np.asarray(jax.device_get(router["bias_e"])))
    y_th = {mode: np.zeros_like(x_th) for mode in w4a4}
    experts = params["experts"]
    for e in np.unique(routing.ids_tk).tolist():
        t, slot = np.nonzero(routing.ids_tk == e)  # a token chooses an expert at most once
        w_gate_up_gh = reference.expert_weight(experts["w_gate_up_egh"], e)
        w_down_hf = reference.expert_weight(experts["w_down_ehf"], e)
        for mode in w4a4:
            y_th[mode][t] += routing.weights_tk[t, slot, None] * expert_mlp(x_th[t], w_gate_up_gh, w_down_hf, w4a4=mode)
    if "shared" in params:
        shared = expert_mlp(x_th, dense(params["shared"]["w_gate_up_gh"]), dense(params["shared"]["w_down_hs"]),
                            w4a4=False)
        for mode in w4a4:
            y_th[mode] += shared
    return y_th, routing
