"""Float64 NumPy reference for the grouped matmul kernels (exact NVFP4 dequantization) and for
the expert MLP op built on them (:mod:`.expert_mlp`), its forward and its gradients.

Shapes follow the kernels': ``x_mk [M, K]``, weights ``[E, N, K]`` (out, in), ``group_sizes_e
[E]`` with the rows of expert ``e`` contiguous and in expert order. Only the first
``min(sum(group_sizes_e), M)`` rows are defined; the functions return just those rows.
"""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np

#: The value of each E2M1 code 0..15; bit 3 is the sign.
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)
#: The two values of each packed byte 0..255: low nibble first.
E2M1_PAIRS = E2M1_VALUES[np.stack([np.arange(256) & 0xF, np.arange(256) >> 4], axis=-1)]
BLOCK = 16


def dequantize(packed_enj, scales_enb, global_scale) -> np.ndarray:
    """NVFP4 in ModelOpt's layout -> float64 ``[E, N, K]``, exactly.

    Args:
      packed_enj: uint8 ``[E, N, K/2]``, element ``2i`` in the low nibble of byte ``i``.
      scales_enb: float8_e4m3fn ``[E, N, K/16]``.
      global_scale: float32 ``[E]`` (one per expert) or ``[E, G]`` (one per group of ``N/G``
        consecutive rows: gate and up of a fused ``[2F, K]`` with ``G = 2``).
    """
    packed = np.asarray(packed_enj)
    e, n, k = *packed.shape[:-1], 2 * packed.shape[-1]
    global_scale = np.asarray(global_scale, np.float64)
    if (global_scale.ndim not in (1, 2) or global_scale.shape[0] != e
            or (global_scale.ndim == 2 and not (global_scale.shape[1] and n % global_scale.shape[1] == 0))):
        raise ValueError(f"global_scale: shape {global_scale.shape}, expected [{e}] or [{e}, G] with G dividing N={n}")
    global_scale_eg = global_scale.reshape(e, -1)
    global_scale_en = np.repeat(global_scale_eg, n // global_scale_eg.shape[1], axis=1)
    scales = np.asarray(scales_enb).astype(np.float64) * global_scale_en[:, :, None]
    # One gather of both values per byte, scaled in place: 6x faster than decoding the nibbles
    # apart (a Kimi K2 expert's [4096, 7168] in 0.2 s), the same float64 values.
    values = E2M1_PAIRS[packed.astype(np.uint8, copy=False)].reshape(e, n, k // BLOCK, BLOCK)
    values *= scales[..., None]
    return values.reshape(e, n, k)


# The expert index traced, so that one compilation serves every expert of a device array.
_take = jax.jit(lambda a, e: a[e])


def _entry(a, e: int) -> np.ndarray:
    return np.asarray(_take(a, e)) if isinstance(a, jax.Array) else np.asarray(a[e])


def expert_weight(w, e: int) -> np.ndarray:
    """Expert ``e`` of a bf16 ``[E, N, K]`` array, or of any object with
    ``.packed/.scales/.global_scale``, as float64 ``[N, K]``. Only that expert is read (and
    copied from a device): at Kimi K2's size all experts in float64 would be tens of GB."""
    if hasattr(w, "packed"):
        return dequantize(_entry(w.packed, e)[None], _entry(w.scales, e)[None], _entry(w.global_scale, e)[None])[0]
    return _entry(w, e).astype(np.float64)


def _shape(w) -> tuple[int, int, int]:
    """``(E, N, K)`` of a bf16 weight or an NVFP4 one (two codes per byte)."""
    if hasattr(w, "packed"):
        e, n, half_k = w.packed.shape
        return e, n, 2 * half_k
    return tuple(w.shape)


def valid_rows(group_sizes_e, num_rows: int) -> int:
    """The number of leading rows whose output is defined."""
    return int(min(int(np.maximum(np.asarray(group_sizes_e), 0).sum()), num_rows))


def grouped_matmul(x_mk, w, group_sizes_e) -> np.ndarray:
    """float64 ``[S, N]``: row ``m`` of expert ``e`` times ``W_e^T``, for the ``S`` defined rows."""
    return _per_expert_rows(x_mk, group_sizes_e, _shape(w)[1], lambda rows, e: rows @ expert_weight(w, e).T)


def swiglu(h_mg: np.ndarray) -> np.ndarray:
    """``silu(gate) * up`` for ``h_mg = [gate | up]`` along the last axis."""
    gate, up = np.split(h_mg, 2, axis=-1)
    return gate / (1.0 + np.exp(-gate)) * up


def gate_up_swiglu(x_mk, w_gate_up, group_sizes_e) -> np.ndarray:
    """float64 ``[S, F]``: ``silu(x W_gate^T) * (x W_up^T)`` with ``W_gate_up = [gate; up]``."""
    return swiglu(grouped_matmul(x_mk, w_gate_up, group_sizes_e))


def bf16(a: np.ndarray) -> np.ndarray:
    """float64 values rounded as the kernels round their float32 values to bf16 (nearest even)."""
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def mlp(x_mh: np.ndarray, w_gate_up_gh: np.ndarray, w_down_hf: np.ndarray, *, quantize_rows=None) -> np.ndarray:
    """One SwiGLU expert on float64 rows ``[M, H]``: ``down(bf16(silu(x W_gate^T) * (x W_up^T)))``,
    weights float64 (out, in), gate rows before up rows. The SwiGLU output is rounded to bf16,
    as every kernel writes it; nothing else is rounded. ``quantize_rows``: None, or a function
    of float64 rows ``[M, K]`` applied to both projections' inputs (the rounding of kernels
    that quantize their activations)."""
    rows = (lambda a: a) if quantize_rows is None else quantize_rows
    a_mf = bf16(swiglu(rows(x_mh) @ w_gate_up_gh.T))
    return rows(a_mf) @ w_down_hf.T


def expert_mlp(x_mh, w_gate_up, w_down, group_sizes_e) -> np.ndarray:
    """float64 ``[S, H]``: :func:`mlp` of each defined row's expert (the forward of
    :func:`pallas_kernels.grouped_matmul.expert_mlp`), weights as for :func:`expert_weight`."""
    return _per_expert_rows(x_mh, group_sizes_e, _shape(w_down)[1],
                            lambda rows, e: mlp(rows, expert_weight(w_gate_up, e), expert_weight(w_down, e)))


def expert_mlp_vjp(x_mh, w_gate_up, w_down, group_sizes_e, dy_mh) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The gradients of :func:`expert_mlp` for the output cotangent ``dy_mh`` ``[M, H]``, by the
    chain rule on the dequantized weights, float64.

    The SwiGLU output enters the down projection rounded to bf16 (:func:`mlp`), so ``W_down``'s
    gradient takes the rounded value; the rounding passes the gradient straight through.

    Returns:
      ``(dx [S, H], dW_gate_up [E, 2F, H], dW_down [E, H, F])``: the gradient of the ``S``
      defined rows (padding rows have none), and of each expert's weights (zeros for an
      expert without rows).
    """
    x = np.asarray(x_mh).astype(np.float64)
    dy = np.asarray(dy_mh).astype(np.float64)
    rows = valid_rows(group_sizes_e, x.shape[0])
    e_count, g, h = _shape(w_gate_up)
    dx = np.zeros((rows, h))
    dw_gate_up, dw_down = np.zeros((e_count, g, h)), np.zeros((e_count, h, g // 2))
    for e, start, end in _groups(group_sizes_e, rows):
        if end == start:
            continue
        w_gate_up_gh, w_down_hf = expert_weight(w_gate_up, e), expert_weight(w_down, e)
        x_e, dy_e = x[start:end], dy[start:end]
        gate, up = np.split(x_e @ w_gate_up_gh.T, 2, axis=-1)
        sig = 1.0 / (1.0 + np.exp(-gate))
        silu = gate * sig
        da = dy_e @ w_down_hf
        dh = np.concatenate([da * up * sig * (1.0 + gate * (1.0 - sig)), da * silu], axis=-1)
        dx[start:end] = dh @ w_gate_up_gh
        dw_gate_up[e] = dh.T @ x_e
        dw_down[e] = dy_e.T @ bf16(silu * up)
    return dx, dw_gate_up, dw_down


def _groups(group_sizes_e, rows: int):
    """``(e, start, end)`` of each expert's defined rows."""
    start = 0
    for e, size in enumerate(np.maximum(np.asarray(group_sizes_e), 0)):
        end = min(start + int(size), rows)
        yield e, start, end
        start = end


def grouped_matmul_input_grad(dy_mn, w, group_sizes_e) -> np.ndarray:
    """float64 ``[S, K]``: row ``m`` of expert ``e`` times ``W_e`` (the gradient with respect to x)."""
    return _per_expert_rows(dy_mn, group_sizes_e, _shape(w)[2], lambda rows, e: rows @ expert_weight(w, e))


def _per_expert_rows(a_mc, group_sizes_e, out_columns: int, product) -> np.ndarray:
    """float64 ``[S, out_columns]``: ``product(rows, e)`` of each expert's defined rows of ``a_mc``."""
    a = np.asarray(a_mc).astype(np.float64)
    rows = valid_rows(group_sizes_e, a.shape[0])
    out = np.zeros((rows, out_columns))
    for e, start, end in _groups(group_sizes_e, rows):
        if end > start:  # an expert without rows is never read
            out[start:end] = product(a[start:end], e)
    return out


def grouped_matmul_weight_grad(x_mk, dy_mn, group_sizes_e) -> np.ndarray:
    """float64 ``[E, N, K]``: per expert ``dy_e^T @ x_e`` over its defined rows (zeros without rows)."""
    x = np.asarray(x_mk).astype(np.float64)
    dy = np.asarray(dy_mn).astype(np.float64)
    rows = valid_rows(group_sizes_e, x.shape[0])
    out = np.zeros((len(np.asarray(group_sizes_e)), dy.shape[1], x.shape[1]))
    for e, start, end in _groups(group_sizes_e, rows):
        out[e] = dy[start:end].T @ x[start:end]
    return out
