"""The routed experts' MLP as one differentiable op: gate/up projection, SwiGLU, down projection.

Public API::

    expert_mlp(x_mh, group_sizes_e, w_gate_up, w_down, *, backend, compute_capability, interpret=False,
               quantize=None, row_token_m=None, token_row_tk=None) -> y_mh

``y_mh = down(silu(x W_gate^T) * (x W_up^T))`` per expert, a ``jax.custom_vjp``:

* forward (no differentiation): the ``backend``'s fused kernels, gate/up + SwiGLU in one (the
  ``[M, 2F]`` product stays on chip), then the down projection;
* forward under differentiation: the gate/up product as the plain grouped matmul, kept as a
  residual (bf16 ``[M, 2F]``: one GEMM fewer than recomputing it, as torch's autograd keeps it
  too), SwiGLU in XLA, then the down projection;
* backward: the input-gradient kernel (``dy @ W_e``, NVFP4 dequantized in the kernel as in the
  forward, no dequantized copy) through both projections, and the weight-gradient kernel
  (``dy_e^T @ x_e`` per expert) for each trainable weight.

Arguments:

* ``x_mh``: ``[M, H]`` (cast to bf16), rows sorted by expert; rows past ``sum(group_sizes_e)``
  are padding: their outputs are unspecified and their gradient is zero.
* ``row_token_m``: None, or int32 ``[M]``: then ``x_mh`` is ``[T, H]`` (a layer's tokens, in any
  order) and row ``m`` of the op is ``x[row_token_m[m]]`` (indices clamped into ``[0, T)``). A
  backend whose kernels read rows by index (``Backend.forward_reads_rows_by_index``) never
  writes the ``[M, H]`` copy in expert order in the forward, with or without differentiation
  (the weight gradient gathers it); the others gather it in XLA. The gradient of ``x`` sums each
  token's rows in float32.
* ``token_row_tk``: None, or (with ``row_token_m``) int32 ``[T, k]``, the transpose of
  ``row_token_m``: token ``t``'s rows, every ``m`` with ``row_token_m[m] == t`` (padding rows,
  whose gradient is zero, may be left out), in any order; entries outside ``[0, M)`` are none
  (a token with fewer rows). The caller that sorted the rows has it (the inverse of its
  permutation). The gradient of ``x`` then sums each token's rows by a gather, not by a
  scatter-add into the tokens, whose duplicate indices a GPU adds one row at a time.
* ``group_sizes_e``: int32 ``[E]``.
* ``w_gate_up``: ``[E, 2F, H]`` (out, in; gate rows before up rows), ``w_down``: ``[E, H, F]``.
  Each is a bf16 array (trainable: it gets its gradient), or NVFP4 in ModelOpt's layout as a
  pytree with ``.packed/.scales/.global_scale`` (such as ``moe_jax.nvfp4.NVFP4Tensor``; frozen:
  no weight gradient is computed, its cotangent is zero). An NVFP4 ``w_gate_up`` may carry gate's
  and up's own global scales (``.global_scale`` ``[E, 2]``): the fused forward applies each to
  its half's accumulator; the plain matmul and the input gradient take the weight with a global
  scale of 1.0 per expert, and each row's two scales multiply, in float32, the halves of the kept
  gate/up product and of the gate/up gradient before its input gradient (:func:`_per_half`).
* ``backend``: a :class:`Backend`, the kernels of one family: ``pallas_kernels.grouped_matmul.PALLAS``
  (bf16 or NVFP4 weights; Pallas interpret mode on CPU) or ``triton_lang.W4A16_BACKEND`` (the
  Triton-language kernels, NVFP4 weights dequantized in registers, SM80-SM90; its weight
  gradient is the Pallas kernel's).
* ``compute_capability``: picks the kernels' tiles; ``interpret``: Pallas interpret mode.
* ``quantize``: None, or a function from a float ``[E, N, K]`` array to NVFP4 weights (for
  instance ``moe_jax.nvfp4.quantize``): the weights are then float masters (quantization-aware
  training) that the kernels read quantized, requantized every call, with the straight-through
  gradient: the masters get the gradient of their quantization (``dL/dW = dL/dW_q``).

Returns ``y_mh`` bf16 ``[M, H]``.

Under ``shard_map`` the rows vary over every mesh axis and a weight over fewer (the expert axis):
a weight's gradient is summed (``psum``) over the axes its rows vary over and it does not.

The float64 reference of the forward and of the gradients: :func:`.reference.expert_mlp` and
:func:`.reference.expert_mlp_vjp`.

Dimension letters: ``m`` rows, ``h`` hidden, ``e`` experts, ``f`` intermediate, ``g = 2f``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Backend", "check_row_token", "defined_rows", "expert_mlp", "is_nvfp4", "row_experts", "swiglu",
           "token_rows", "zero_padding_rows"]


class Backend(NamedTuple):
    """The kernels of one family that :func:`expert_mlp` is made of. Each takes the keyword
    arguments ``compute_capability`` and ``interpret``, and returns bf16 unless said otherwise.

    Attributes:
      name: the family, for messages.
      forward: ``(x_mh, group_sizes_e, w_gate_up, w_down) -> y_mh [M, H]``: the fused gate/up +
        SwiGLU kernel, then the down projection (the forward without differentiation).
      matmul: ``(x_mk, w, group_sizes_e) -> [M, N]``: ``x @ W_e^T``; where
        ``forward_reads_rows_by_index``, also ``row_token_m`` (keyword), as ``forward``.
      input_grad: ``(dy_mn, w, group_sizes_e) -> [M, K]``: ``dy @ W_e``, ``w`` with one global
        scale per expert.
      weight_grad: ``(x_mk, dy_mn, group_sizes_e, *, out_dtype) -> [E, N, K]`` in ``out_dtype``:
        ``dy_e^T x_e``.
      forward_reads_rows_by_index: whether ``forward`` and ``matmul`` also take ``row_token_m``
        (keyword): then ``x`` is ``[T, H]`` and row ``m`` reads ``x[row_token_m[m]]`` (see
        :func:`expert_mlp`).
      zero_padding_rows: ``(x_mh, group_sizes_e) -> [M, H]``: :func:`zero_padding_rows`'s result
        by a kernel that writes only the padding rows, in place; None: that function (XLA's
        select over every row).
    """

    name: str
    forward: Callable
    matmul: Callable
    input_grad: Callable
    weight_grad: Callable
    forward_reads_rows_by_index: bool = False
    zero_padding_rows: Callable | None = None


def defined_rows(group_sizes_e) -> jax.Array:
    """int32 scalar: the rows the experts own, ``sum(max(group_sizes_e, 0))``; from it on, rows
    are padding."""
    return jnp.sum(jnp.maximum(group_sizes_e, 0))


def zero_padding_rows(x_mh, group_sizes_e) -> jax.Array:
    """``x_mh`` ``[M, H]`` with its padding rows (:func:`defined_rows` on) set to zero: XLA's
    select over every row, fused into a consumer where there is one."""
    defined_m = jnp.arange(x_mh.shape[0]) < defined_rows(group_sizes_e)
    return jnp.where(defined_m[:, None], x_mh, 0)


class _NVFP4(NamedTuple):
    """NVFP4 weights as the kernels read them (a pytree)."""

    packed: jax.Array
    scales: jax.Array
    global_scale: jax.Array


def is_nvfp4(w) -> bool:
    """Whether ``w`` is NVFP4 weights (``.packed``, ``.scales``, ``.global_scale``): the kernels' duck test."""
    return all(hasattr(w, attr) for attr in ("packed", "scales", "global_scale"))


def check_row_token(row_token_m) -> None:
    """Raises unless ``row_token_m`` is int32 ``[M]`` (each row's index into the rows it reads)."""
    if not hasattr(row_token_m, "dtype") or np.dtype(row_token_m.dtype) != np.int32 or row_token_m.ndim != 1:
        found = f"{row_token_m.dtype}{list(row_token_m.shape)}" if hasattr(row_token_m, "dtype") else \
            type(row_token_m).__name__
        raise ValueError(f"row_token_m: {found}, expected int32 [M]")


def num_token_rows(x, row_token_m) -> int:
    """``M``: the rows an op reads, ``x``'s own or, if ``row_token_m`` is given, one per index."""
    return x.shape[0] if row_token_m is None else row_token_m.shape[0]


def check_token_row(token_row_tk, x, row_token_m) -> None:
    """Raises unless ``token_row_tk`` is int32 ``[T, k]`` for ``x``'s ``T`` rows, given with ``row_token_m``."""
    if token_row_tk is None:
        return
    if row_token_m is None:
        raise ValueError("token_row_tk: given without row_token_m, expected both (it is row_token_m's transpose)")
    if (not hasattr(token_row_tk, "dtype") or np.dtype(token_row_tk.dtype) != np.int32 or token_row_tk.ndim != 2
            or token_row_tk.shape[0] != x.shape[0]):
        found = f"{token_row_tk.dtype}{list(token_row_tk.shape)}" if hasattr(token_row_tk, "dtype") else \
            type(token_row_tk).__name__
        raise ValueError(f"token_row_tk: {found}, expected int32 [T, k] with T = {x.shape[0]} (x's rows)")


def token_rows(x, row_token_m, token_row_tk=None) -> jax.Array:
    """``[M, H]``: ``x`` as it is, or its rows ``row_token_m`` in that order, the indices clamped
    into ``[0, T)`` as the kernels that read rows by index clamp them. Differentiable; with
    ``token_row_tk`` (``row_token_m``'s transpose, see the module docstring) its gradient sums
    each token's rows by a gather (:func:`sum_token_rows`)."""
    if row_token_m is None:
        return x
    if token_row_tk is None:
        return jnp.take(x, row_token_m, axis=0, mode="clip")
    return _gather_rows(x, row_token_m, token_row_tk)


@jax.custom_vjp
def _gather_rows(x, row_token_m, token_row_tk):
    return jnp.take(x, row_token_m, axis=0, mode="clip")


def _gather_rows_fwd(x, row_token_m, token_row_tk):
    return _gather_rows(x, row_token_m, token_row_tk), (token_row_tk, jnp.zeros((0,), x.dtype))


def _gather_rows_bwd(residuals, d_mh):
    token_row_tk, x_dtype = residuals
    return sum_token_rows(d_mh, token_row_tk).astype(x_dtype.dtype), None, None


_gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


def sum_token_rows(d_mh, token_row_tk) -> jax.Array:
    """float32 ``[T, H]``: each token's rows of ``d_mh`` summed, the rows ``token_row_tk`` names
    (entries outside ``[0, M)``: none). One gather and a sum over ``k``, which XLA fuses with the
    padding select into one loop: each token's sum is written once, where a scatter-add into the
    tokens adds row by row."""
    num_rows = d_mh.shape[0]
    valid_tk = (token_row_tk >= 0) & (token_row_tk < num_rows)
    d_tkh = jnp.take(d_mh, jnp.clip(token_row_tk, 0, max(num_rows - 1, 0)), axis=0, mode="clip")
    return jnp.sum(jnp.where(valid_tk[..., None], d_tkh.astype(jnp.float32), 0.0), axis=1)


def swiglu(h_mg: jax.Array) -> jax.Array:
    """``silu(gate) * up`` for ``h_mg = [gate | up]`` along the last axis."""
    gate, up = jnp.split(h_mg, 2, axis=-1)
    return jax.nn.silu(gate) * up


def expert_mlp(x_mh, group_sizes_e, w_gate_up, w_down, *, backend: Backend, compute_capability: int,
               interpret: bool = False, quantize: Callable | None = None, row_token_m=None,
               token_row_tk=None) -> jax.Array:
    """bf16 ``[M, H]``: the expert MLP of each row's expert, differentiable (see the module docstring)."""
    if row_token_m is not None:
        check_row_token(row_token_m)
        if x_mh.ndim != 2 or (x_mh.shape[0] == 0 and row_token_m.shape[0]):
            raise ValueError(f"x_mh: {x_mh.dtype}{list(x_mh.shape)}, expected [T, H] with T >= 1 rows for "
                             f"row_token_m's {row_token_m.shape[0]} indices")
    check_token_row(token_row_tk, x_mh, row_token_m)
    if not isinstance(backend, Backend):
        raise ValueError(f"backend: {type(backend).__name__}, expected a Backend (pallas_kernels.grouped_matmul.PALLAS "
                         "or triton_lang.W4A16_BACKEND)")
    if quantize is not None:
        for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
            if is_nvfp4(w):
                raise ValueError(f"{name}: NVFP4 weights, expected float masters with quantize (they are quantized "
                                 "here every call); pass quantize=None for NVFP4 weights, which are frozen")
    return _expert_mlp(backend, compute_capability, interpret, quantize, x_mh, row_token_m, token_row_tk, group_sizes_e,
                       w_gate_up, w_down)


def _kernel_weight(w, quantize):
    """The weight the kernels read: ``w``, or the NVFP4 quantization of the float master."""
    return w if quantize is None else quantize(jax.lax.stop_gradient(w))


def _rows(x, row_token_m):
    """bf16 ``[M, H]``: :func:`token_rows` of ``x``."""
    return token_rows(x.astype(jnp.bfloat16), row_token_m)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _expert_mlp(backend: Backend, compute_capability: int, interpret: bool, quantize, x, row_token_m, token_row_tk,
                group_sizes_e, w_gate_up, w_down):
    del token_row_tk  # read by the backward only
    weights = (_kernel_weight(w_gate_up, quantize), _kernel_weight(w_down, quantize))
    kernel_args = dict(compute_capability=compute_capability, interpret=interpret)
    if row_token_m is not None and backend.forward_reads_rows_by_index:
        return backend.forward(x.astype(jnp.bfloat16), group_sizes_e, *weights, row_token_m=row_token_m, **kernel_args)
    return backend.forward(_rows(x, row_token_m), group_sizes_e, *weights, **kernel_args)


def row_experts(group_sizes_e, num_rows: int) -> jax.Array:
    """int32 ``[M]``: each row's expert (padding rows past ``sum(group_sizes_e)``: the last one)."""
    # Unrolled, as the kernels' tile schedule: the default method is a device-side while loop.
    expert_m = jnp.searchsorted(jnp.cumsum(jnp.maximum(group_sizes_e, 0)), jnp.arange(num_rows), side="right",
                                method="scan_unrolled")
    return jnp.minimum(expert_m, group_sizes_e.shape[0] - 1).astype(jnp.int32)


def _row_half_scales(global_scale_e2, group_sizes_e, num_rows: int) -> jax.Array:
    """float32 ``[M, 2]``: each row's expert's gate and up global scales (padding rows: the
    last expert's, harmless: their values are never used)."""
    return global_scale_e2[row_experts(group_sizes_e, num_rows)]


def _one_scale_per_expert(w_gate_up, group_sizes_e, num_rows: int):
    """``(w, half_scales_m2)``: the gate/up weight as the plain matmul and the input gradient
    take it (one global scale per expert), and None, or, for gate and up with their own global
    scales (``[E, 2]``), the weight with 1.0 and each row's ``[gate, up]`` scales to multiply instead."""
    if not (is_nvfp4(w_gate_up) and w_gate_up.global_scale.shape[1:] == (2,)):
        return w_gate_up, None
    ones = jnp.ones(w_gate_up.global_scale.shape[:1], jnp.float32)
    return (_NVFP4(packed=w_gate_up.packed, scales=w_gate_up.scales, global_scale=ones),
            _row_half_scales(w_gate_up.global_scale, group_sizes_e, num_rows))


def _per_half(h_mg, half_scales_m2):
    """float32 ``h_mg`` with its gate and up halves times their rows' scales (None: as is)."""
    h_mg = h_mg.astype(jnp.float32)
    if half_scales_m2 is None:
        return h_mg
    gate, up = jnp.split(h_mg, 2, axis=-1)
    return jnp.concatenate([gate * half_scales_m2[:, :1], up * half_scales_m2[:, 1:]], axis=-1)


def _trainable(w):
    """None for frozen (NVFP4) weights; else an empty slice, which carries the weight's dtype and,
    under ``shard_map``, the mesh axes it varies over (residuals must be arrays)."""
    return None if is_nvfp4(w) else w.reshape(-1)[:0]


def _expert_mlp_fwd(backend: Backend, compute_capability: int, interpret: bool, quantize, x, row_token_m,
                    token_row_tk, group_sizes_e, w_gate_up, w_down):
    kernel_args = dict(compute_capability=compute_capability, interpret=interpret)
    w_gate_up_k, w_down_k = _kernel_weight(w_gate_up, quantize), _kernel_weight(w_down, quantize)
    num_rows = num_token_rows(x, row_token_m)
    w_one, half_scales_m2 = _one_scale_per_expert(w_gate_up_k, group_sizes_e, num_rows)
    # h_mg: bf16, kept. A backend that reads rows by index takes the tokens: no [M, H] copy.
    if row_token_m is not None and backend.forward_reads_rows_by_index:
        h_mg = backend.matmul(x.astype(jnp.bfloat16), w_one, group_sizes_e, row_token_m=row_token_m, **kernel_args)
    else:
        h_mg = backend.matmul(_rows(x, row_token_m), w_one, group_sizes_e, **kernel_args)
    a_mf = swiglu(_per_half(h_mg, half_scales_m2)).astype(jnp.bfloat16)
    y_mh = backend.matmul(a_mf, w_down_k, group_sizes_e, **kernel_args)
    trainable = (_trainable(w_gate_up), _trainable(w_down))
    # Rows read by index keep x itself (T rows, not M): the weight gradient gathers them again.
    rows = (x.astype(jnp.bfloat16), row_token_m, token_row_tk)
    return y_mh, (rows, jnp.zeros((0,), x.dtype), group_sizes_e, w_gate_up_k, w_down_k, trainable, h_mg)


def _expert_mlp_bwd(backend: Backend, compute_capability: int, interpret: bool, quantize, residuals, dy_mh):
    del quantize  # the masters' gradient is their quantization's (straight-through)
    kernel_args = dict(compute_capability=compute_capability, interpret=interpret)
    ((x, row_token_m, token_row_tk), x_dtype, group_sizes_e, w_gate_up_k, w_down_k,
     (gate_up_trainable, down_trainable), h_mg) = residuals
    dy_mh = dy_mh.astype(jnp.bfloat16)
    num_rows = h_mg.shape[0]
    w_one, half_scales_m2 = _one_scale_per_expert(w_gate_up_k, group_sizes_e, num_rows)
    gate, up = jnp.split(_per_half(h_mg, half_scales_m2), 2, axis=-1)
    sig = jax.nn.sigmoid(gate)
    silu = gate * sig
    a_mf = (silu * up).astype(jnp.bfloat16)  # the forward's bf16 SwiGLU output, recomputed

    da_mf = backend.input_grad(dy_mh, w_down_k, group_sizes_e, **kernel_args).astype(jnp.float32)
    dh_mg = jnp.concatenate([da_mf * up * (sig * (1.0 + gate * (1.0 - sig))), da_mf * silu], axis=-1)
    # The input gradient reads the weight with one scale per expert: the rows carry the halves'.
    dx_mh = backend.input_grad(_per_half(dh_mg, half_scales_m2).astype(jnp.bfloat16), w_one, group_sizes_e,
                               **kernel_args)
    # Padding rows have no defined output, so no gradient: zero them rather than pass on
    # whatever the kernels left there. Rows read by index are summed into their tokens below,
    # where XLA fuses the select into the sum; else the backend's kernel where it has one.
    if row_token_m is None and backend.zero_padding_rows is not None:
        dx_mh = backend.zero_padding_rows(dx_mh, group_sizes_e, **kernel_args)
    else:
        dx_mh = zero_padding_rows(dx_mh, group_sizes_e)

    def weight_grad(trainable, rows_mk, dy_mn):
        if trainable is None:
            return None  # Frozen NVFP4 weights: nothing to compute, zero cotangent.
        dw = backend.weight_grad(rows_mk, dy_mn, group_sizes_e, out_dtype=trainable.dtype, **kernel_args)
        # Under shard_map the rows vary over every mesh axis and a weight over the expert axis
        # only: its gradient is the sum of every device's rows' contributions along the others.
        summed = jax.typeof(dw).manual_axis_type.varying - jax.typeof(trainable).manual_axis_type.varying
        return jax.lax.psum(dw, tuple(sorted(summed))) if summed else dw

    dw_gate_up = weight_grad(gate_up_trainable, _rows(x, row_token_m) if gate_up_trainable is not None else None,
                             dh_mg.astype(jnp.bfloat16))
    dw_down = weight_grad(down_trainable, a_mf, dy_mh)
    if row_token_m is None:
        return dx_mh, None, None, None, dw_gate_up, dw_down
    # Each token's rows summed (the transpose of the clamped gather), in float32: top-k terms.
    if token_row_tk is not None:
        dx = sum_token_rows(dx_mh, token_row_tk)
    else:
        token_m = jnp.clip(row_token_m, 0, x.shape[0] - 1)
        dx = jnp.zeros(x.shape, jnp.float32).at[token_m].add(dx_mh.astype(jnp.float32))
    return dx.astype(x_dtype.dtype), None, None, None, dw_gate_up, dw_down


_expert_mlp.defvjp(_expert_mlp_fwd, _expert_mlp_bwd)
