"""Grouped (ragged) matmul for MoE experts: bf16 or NVFP4 weights, optional fused SwiGLU.

Public API::

    grouped_matmul(x_mk, w, group_sizes_e, *, compute_capability, interpret=False, out=None)
    gate_up_swiglu(x_mk, w_gate_up, group_sizes_e, *, compute_capability, interpret=False, out=None)

the two products a backward pass needs::

    grouped_matmul_input_grad(dy_mn, w, group_sizes_e, *, compute_capability, interpret=False)
    dequantized_input_grad(dy_mn, w, group_sizes_e, *, compute_capability, interpret=False)
    grouped_matmul_weight_grad(x_mk, dy_mn, group_sizes_e, *, compute_capability, interpret=False,
                               out_dtype=jnp.float32)

and the routed experts' whole MLP (gate/up, SwiGLU, down) as one differentiable op
(:mod:`.expert_mlp`: a ``jax.custom_vjp`` over the kernels of one family, ``backend=PALLAS``
for these, ``triton_lang.W4A16_BACKEND`` for the Triton-language ones)::

    expert_mlp(x_mh, group_sizes_e, w_gate_up, w_down, *, backend, compute_capability,
               interpret=False, quantize=None)

Each has its float64 reference in :mod:`.reference`.

* ``x_mk``: bf16 ``[M, K]``, rows sorted by expert; rows at or past ``sum(group_sizes_e)`` are
  padding and their outputs are left unwritten.
* ``w``: bf16 ``[E, N, K]`` (out, in), or NVFP4 in NVIDIA ModelOpt's row-major layout as any
  object with ``.packed`` uint8 ``[E, N, K/2]`` (element ``2i`` in the low nibble),
  ``.scales`` float8_e4m3fn ``[E, N, K/16]`` and ``.global_scale`` float32 ``[E]``. The
  kernels read this layout as stored: no repacking, no ``prepare_weights`` step.
* ``w_gate_up``: ``[E, 2F, K]``, gate rows ``0..F-1`` then up rows ``F..2F-1``. As NVFP4 its
  ``.global_scale`` may also be ``[E, 2]``: gate's and up's own global scales (ModelOpt gives
  each projection a ``weight_scale_2``, and they can differ), each applied to its half's fp32
  accumulator, so the fused product is exact for either layout.
* ``group_sizes_e``: int32 ``[E]``.
* ``compute_capability``: the target's ``major * 10 + minor`` (90 for H200, 120 for an RTX PRO
  6000); it picks the tile table row (:mod:`.tuning`).
* ``interpret``: Pallas interpret mode (CPU tests). The kernel then dequantizes with normal
  floats only (:class:`.pallas_triton.Dequant`), since XLA:CPU flushes subnormals.
* ``out``: optional bf16 buffer of the output's shape, aliased into the kernel's output.

The first two return bf16 (``[M, N]`` and ``[M, F]``), accumulate in fp32 and raise ValueError naming
the argument for a bad shape, dtype or capability.

Constraints: K a multiple of 64; N (for the fused op, F) a multiple of 16. For the input
gradient the reduction is the weight's N (a multiple of 64) and the output its K; for the
weight gradient N and K are multiples of 16.
"""

from __future__ import annotations

import functools
from typing import assert_never

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.grouped_matmul import pallas_triton
from pallas_kernels.grouped_matmul import tuning
from pallas_kernels.grouped_matmul.expert_mlp import Backend, expert_mlp, is_nvfp4, row_experts
from pallas_kernels.grouped_matmul.pallas_triton import Dequant, Order
from pallas_kernels.grouped_matmul.tuning import Op, TileConfig, Variant, WeightFormat

__all__ = ["PALLAS", "Backend", "check_weight_grad_args", "dequantized_copy", "dequantized_copy_pays",
           "dequantized_input_grad",
           "expert_mlp", "gate_up_swiglu", "grouped_matmul", "grouped_matmul_input_grad", "grouped_matmul_weight_grad",
           "input_grad", "run"]

K_MULTIPLE = 64
N_MULTIPLE = 16
_FLOAT8_E4M3FN = np.dtype(jnp.float8_e4m3fn)
# The transposed NVFP4 tile is dequantized with EXACT, whose selects hold the whole [bk, bn]
# tile in registers: at the matmul's bk = 256 the SM100 decode kernel spilled 1,440 bytes.
_TRANSPOSED_NVFP4_MAX_BLOCK_K = 128


def grouped_matmul(x_mk, w, group_sizes_e, *, compute_capability: int, interpret: bool = False,
                   out=None) -> jax.Array:
    """bf16 ``[M, N]``: row ``m`` of expert ``e`` times ``W_e^T`` (see the module docstring)."""
    return run(Op.MATMUL, x_mk, w, group_sizes_e, compute_capability=compute_capability,
               interpret=interpret, out=out)


def gate_up_swiglu(x_mk, w_gate_up, group_sizes_e, *, compute_capability: int, interpret: bool = False,
                   out=None) -> jax.Array:
    """bf16 ``[M, F]``: ``silu(x W_gate^T) * (x W_up^T)``; the ``[M, 2F]`` product stays on chip."""
    return run(Op.GATE_UP_SWIGLU, x_mk, w_gate_up, group_sizes_e, compute_capability=compute_capability,
               interpret=interpret, out=out)


def grouped_matmul_input_grad(dy_mn, w, group_sizes_e, *, compute_capability: int, interpret: bool = False,
                              out=None) -> jax.Array:
    """bf16 ``[M, K]``: row ``m`` of expert ``e`` times ``W_e`` (not transposed): the gradient of
    :func:`grouped_matmul` with respect to ``x``, for ``dy_mn`` bf16 ``[M, N]``.

    ``w`` is the forward's ``[E, N, K]`` weight, read as stored (NVFP4 dequantized in the
    kernel, no transposed or dequantized copy). Its global scale must be ``[E]``: a fused
    gate/up weight with gate's and up's own scales is passed with the scales folded into
    ``dy_mn`` instead (:func:`.expert_mlp.expert_mlp` does).
    """
    return run(Op.MATMUL, dy_mn, w, group_sizes_e, compute_capability=compute_capability, interpret=interpret,
               out=out, transpose_w=True)


def dequantized_input_grad(dy_mn, w, group_sizes_e, *, compute_capability: int, interpret: bool = False,
                           out=None, multiply=None) -> jax.Array:
    """bf16 ``[M, K]``: :func:`grouped_matmul_input_grad` of NVFP4 weights through one bf16 copy of
    them: XLA dequantizes ``w`` once (``[E, N, K]`` bf16, ``code * scale``, exact:
    :func:`.pallas_triton.dequantize_copy`), and the bf16 kernel multiplies. Each row of ``dy_mn``
    is scaled by its expert's global scale in float32 before its bf16 rounding, where the NVFP4
    kernels scale the output row instead: one rounding of ``dy`` more, as small as the output's own.

    The copy takes ``2 E N K`` bytes for the duration of the call: a trade of memory for speed
    that :func:`input_grad` makes by :func:`.tuning.dequantize_for_input_grad`. Arguments as
    :func:`grouped_matmul_input_grad`'s; ``w`` must be NVFP4 with one global scale per expert.
    ``multiply``: the bf16 input gradient that multiplies the copy, ``(dy_mn, w_enk, group_sizes_e,
    *, compute_capability, interpret) -> [M, K]``; None: :func:`grouped_matmul_input_grad` (the only
    one that takes ``out``).
    """
    if np.dtype(dy_mn.dtype) != np.dtype(jnp.bfloat16) or dy_mn.ndim != 2:
        raise ValueError(f"dy_mn: {dy_mn.dtype}{list(dy_mn.shape)}, expected bfloat16 [M, N]")
    _check_group_sizes(group_sizes_e)
    num_experts, (m, n) = group_sizes_e.shape[0], dy_mn.shape
    if not is_nvfp4(w):
        raise ValueError(f"w: {type(w).__name__}, expected NVFP4 weights (.packed, .scales, .global_scale); "
                         "bf16 weights go to grouped_matmul_input_grad as they are")
    _, weight_arrays, _, _ = _weight_format(w, "w", Op.MATMUL, num_experts, n, transpose_w=True)
    if out is not None and multiply is not None:
        raise ValueError("out: given with multiply; only grouped_matmul_input_grad (multiply=None) writes into out")
    # One program: called eagerly, each step of the dequantization would materialize an int32
    # copy of every code (4 bytes a weight) instead of fusing into one pass.
    return _dequantized_input_grad_jit(compute_capability, interpret, multiply, dy_mn, weight_arrays, group_sizes_e,
                                       out)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _dequantized_input_grad_jit(compute_capability, interpret, multiply, dy_mn, weight_arrays, group_sizes_e, out):
    packed, scales_u8, global_scale = weight_arrays
    m = dy_mn.shape[0]
    with jax.named_scope("dequantized_input_grad"):
        w_enk = _dequantized_copy_jit(packed, scales_u8)
        scale_m = global_scale[row_experts(group_sizes_e, m)]
        dy_mn = (dy_mn.astype(jnp.float32) * scale_m[:, None]).astype(jnp.bfloat16)
        if multiply is not None:
            return multiply(dy_mn, w_enk, group_sizes_e, compute_capability=compute_capability, interpret=interpret)
        return grouped_matmul_input_grad(dy_mn, w_enk, group_sizes_e, compute_capability=compute_capability,
                                         interpret=interpret, out=out)


def dequantized_copy(w) -> jax.Array:
    """bf16 ``[E, N, K]``: NVFP4 weights ``w`` (``[E, N, K]``, ModelOpt's layout) dequantized
    exactly without their global scales, ``code * scale`` (at most 6 significant bits), in one XLA
    pass (:func:`.pallas_triton.dequantize_copy`: 2 bytes written a weight). The global scales stay
    with ``w``: the bf16 kernels apply them to their fp32 accumulators
    (:func:`.triton_lang.dequantized_forward`) or to ``dy`` (:func:`dequantized_input_grad`).
    Called eagerly it still runs as one program."""
    if not is_nvfp4(w):
        raise ValueError(f"w: {type(w).__name__}, expected NVFP4 weights (.packed, .scales, .global_scale)")
    num_experts, _, half = w.packed.shape if w.packed.ndim == 3 else (0, 0, 0)
    _, (packed, scales_u8, _), _, _ = _weight_format(w, "w", Op.GATE_UP_SWIGLU, num_experts, 2 * half)
    return _dequantized_copy_jit(packed, scales_u8)


@jax.jit
def _dequantized_copy_jit(packed_enj, scales_enb):
    num_experts, n, half = packed_enj.shape
    with jax.named_scope("dequantized_copy"):
        return pallas_triton.dequantize_copy(packed_enj.reshape(num_experts * n, half),
                                             scales_enb.reshape(num_experts * n, half // 8)).reshape(num_experts, n,
                                                                                                     2 * half)


def dequantized_copy_pays(dy_mn, w, group_sizes_e) -> bool:
    """Whether the input gradient ``dy_mn @ W_e`` goes through :func:`dequantized_input_grad`:
    NVFP4 ``w`` where :func:`.tuning.dequantize_for_input_grad` says so for these shapes."""
    return is_nvfp4(w) and tuning.dequantize_for_input_grad(
        num_rows=dy_mn.shape[0], num_experts=group_sizes_e.shape[0], n=w.packed.shape[1], k=2 * w.packed.shape[2])


def input_grad(dy_mn, w, group_sizes_e, *, compute_capability: int, interpret: bool = False) -> jax.Array:
    """:data:`PALLAS`' input gradient: through :func:`dequantized_input_grad` where
    :func:`dequantized_copy_pays`, else :func:`grouped_matmul_input_grad`."""
    if dequantized_copy_pays(dy_mn, w, group_sizes_e):
        return dequantized_input_grad(dy_mn, w, group_sizes_e, compute_capability=compute_capability,
                                      interpret=interpret)
    return grouped_matmul_input_grad(dy_mn, w, group_sizes_e, compute_capability=compute_capability,
                                     interpret=interpret)


def check_weight_grad_args(x_mk, dy_mn, group_sizes_e, *, out_dtype, compute_capability: int,
                           out=None) -> tuple[int, int, int, int]:
    """Validates a weight gradient's arguments (:func:`grouped_matmul_weight_grad`'s, and the
    native kernel's, ``triton_weight_grad.weight_grad``); returns ``(M, K, N, E)``."""
    tuning.check_capability(compute_capability)
    for name, a in (("x_mk", x_mk), ("dy_mn", dy_mn)):
        if np.dtype(a.dtype) != np.dtype(jnp.bfloat16) or a.ndim != 2 or a.shape[1] % N_MULTIPLE or not a.shape[1]:
            raise ValueError(f"{name}: {a.dtype}{list(a.shape)}, expected bfloat16 [M, C] with C a positive "
                             f"multiple of {N_MULTIPLE}")
    if dy_mn.shape[0] != x_mk.shape[0]:
        raise ValueError(f"dy_mn: {dy_mn.shape[0]} rows, expected M={x_mk.shape[0]} (x_mk)")
    _check_group_sizes(group_sizes_e)
    if np.dtype(out_dtype) not in (np.dtype(jnp.float32), np.dtype(jnp.bfloat16)):
        raise ValueError(f"out_dtype: {np.dtype(out_dtype).name}, expected float32 or bfloat16")
    (m, k), n, e = x_mk.shape, dy_mn.shape[1], group_sizes_e.shape[0]
    if out is not None and (tuple(out.shape) != (e, n, k) or np.dtype(out.dtype) != np.dtype(out_dtype)):
        raise ValueError(f"out: {out.dtype}{list(out.shape)}, expected {np.dtype(out_dtype).name} {[e, n, k]}")
    return m, k, n, e


def grouped_matmul_weight_grad(x_mk, dy_mn, group_sizes_e, *, compute_capability: int, interpret: bool = False,
                               out_dtype=jnp.float32, out=None, check_bounds: bool = False):
    """``[E, N, K]`` in ``out_dtype``: per expert ``dy_e^T @ x_e`` over its rows, the gradient of
    :func:`grouped_matmul` with respect to a dense ``w`` (accumulated in fp32).

    Args:
      x_mk: bf16 ``[M, K]``, the forward's input rows.
      dy_mn: bf16 ``[M, N]``, the output cotangent.
      group_sizes_e: int32 ``[E]``; rows past the sum (padding) do not contribute, and an
        expert without rows gets zeros.
      compute_capability: picks the tile (:func:`.tuning.choose_weight_grad_tile`).
      interpret: Pallas interpret mode.
      out_dtype: float32 or bfloat16.
      out: optional ``[E, N, K]`` buffer of ``out_dtype`` aliased into the output (every element
        is written: experts without rows get zeros).
      check_bounds: as for :func:`run`; the call then returns ``(dw, count)``.
    """
    if check_bounds and not interpret:
        raise ValueError("check_bounds: True, expected interpret=True (it instruments the interpreted kernel)")
    m, k, n, e = check_weight_grad_args(x_mk, dy_mn, group_sizes_e, out_dtype=out_dtype,
                                        compute_capability=compute_capability, out=out)
    if m == 0:
        zeros = jnp.zeros((e, n, k), out_dtype)
        return (zeros, jnp.zeros((1,), jnp.int32)) if check_bounds else zeros
    config = tuning.choose_weight_grad_tile(num_rows=m, num_experts=e, compute_capability=compute_capability)
    spec = pallas_triton.WeightGradSpec(
        config=config, num_experts=e, num_rows=m, n=n, k=k, block_n=tuning.fit_block(config.block_n, n, N_MULTIPLE),
        block_k=tuning.fit_block(config.block_k, k, N_MULTIPLE), out_dtype=np.dtype(out_dtype),
        check_bounds=check_bounds,
    )
    return _weight_grad_jit(spec, interpret, x_mk, dy_mn, group_sizes_e, out)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _weight_grad_jit(spec, interpret, x_mk, dy_mn, group_sizes_e, out):
    bounds = pallas_triton.group_bounds(group_sizes_e, num_rows=spec.num_rows)
    return pallas_triton.launch_weight_grad(spec, bounds, x_mk, dy_mn, out, interpret=interpret)


def _check_group_sizes(group_sizes_e) -> None:
    if np.dtype(group_sizes_e.dtype) != np.int32 or group_sizes_e.ndim != 1 or group_sizes_e.shape[0] == 0:
        raise ValueError(f"group_sizes_e: {group_sizes_e.dtype}{list(group_sizes_e.shape)}, expected int32 [E], E >= 1")


def _weight_format(w, name: str, op: Op, num_experts: int, k: int,
                   transpose_w: bool = False) -> tuple[WeightFormat, tuple, int, int]:
    """Validates ``w``; returns its format, the kernel's weight operands, the output width N
    (the weight's rows; its columns when ``transpose_w``) and the global scales per expert
    (1; or 2, gate's and up's, for the fused op)."""
    if is_nvfp4(w):
        packed, scales, global_scale = w.packed, w.scales, w.global_scale
        checks = (("packed", packed, np.uint8, (3,)), ("scales", scales, _FLOAT8_E4M3FN, (3,)),
                  ("global_scale", global_scale, np.float32, (1, 2)))
        for field, array, dtype, ranks in checks:
            if np.dtype(array.dtype) != dtype or array.ndim not in ranks:
                raise ValueError(f"{name}.{field}: {array.dtype}{list(array.shape)}, expected "
                                 f"{np.dtype(dtype).name} of rank {' or '.join(map(str, ranks))}")
        match op:
            case Op.MATMUL:
                scale_shapes = ((num_experts,),)
            case Op.GATE_UP_SWIGLU:
                scale_shapes = ((num_experts,), (num_experts, 2))
            case _:
                assert_never(op)
        if transpose_w:
            n = packed.shape[2] * 2
            expected = {"packed": (num_experts, k, n // 2), "scales": (num_experts, k, n // 16)}
            dims = f"N={k} (dy_mn) and K={n}"
        else:
            n = packed.shape[1]
            expected = {"packed": (num_experts, n, k // 2), "scales": (num_experts, n, k // 16)}
            dims = f"K={k} (x_mk) and N={n}"
        for field, array in (("packed", packed), ("scales", scales)):
            if tuple(array.shape) != expected[field]:
                raise ValueError(f"{name}.{field}: shape {tuple(array.shape)}, expected {expected[field]} "
                                 f"for E={num_experts} experts (group_sizes_e), {dims}")
        if tuple(global_scale.shape) not in scale_shapes:
            raise ValueError(f"{name}.global_scale: shape {tuple(global_scale.shape)}, expected "
                             f"{' or '.join(map(str, scale_shapes))} for E={num_experts} experts (group_sizes_e): "
                             f"one per expert{', or gate and up of each' if len(scale_shapes) > 1 else ''}")
        scales_u8 = jax.lax.bitcast_convert_type(scales, jnp.uint8)
        scale_groups = 1 if global_scale.ndim == 1 else global_scale.shape[1]
        return WeightFormat.NVFP4, (packed, scales_u8, global_scale), n, scale_groups
    if not hasattr(w, "dtype") or not hasattr(w, "shape"):
        raise ValueError(f"{name}: {type(w).__name__}, expected a bf16 array or an NVFP4 tensor "
                         "(.packed, .scales, .global_scale)")
    if np.dtype(w.dtype) != np.dtype(jnp.bfloat16) or w.ndim != 3:
        raise ValueError(f"{name}: {w.dtype}{list(w.shape)}, expected bfloat16 [E, N, K]")
    if transpose_w:
        if w.shape[0] != num_experts or w.shape[1] != k:
            raise ValueError(f"{name}: shape {tuple(w.shape)}, expected [E={num_experts} (group_sizes_e), "
                             f"N={k} (dy_mn), K]")
        return WeightFormat.BF16, (w,), w.shape[2], 1
    if w.shape[0] != num_experts or w.shape[2] != k:
        raise ValueError(f"{name}: shape {tuple(w.shape)}, expected [E={num_experts} (group_sizes_e), N, "
                         f"K={k} (x_mk)]")
    return WeightFormat.BF16, (w,), w.shape[1], 1


def run(op: Op, x_mk, w, group_sizes_e, *, compute_capability: int, interpret: bool = False, out=None,
        config: TileConfig | None = None, variant: Variant | None = None,
        dequant: Dequant | None = None, check_bounds: bool = False, transpose_w: bool = False):
    """The shared entry of both public functions.

    ``config``/``variant`` override the tile table (benchmark sweeps) and ``dequant`` the
    formulation (tests comparing the two on a GPU); left as None, the table, the heuristic
    and ``PTX`` (``EXACT`` under ``interpret`` and for ``transpose_w``) decide.

    ``check_bounds`` (with ``interpret`` only) makes the kernel count every load and store
    lane whose index falls outside its buffer, which the interpreter would otherwise clamp
    silently; the call then returns ``(out, out_of_bounds)``, the count an int32 ``[1]``.

    ``transpose_w`` (``Op.MATMUL`` only) computes ``x @ W_e`` with ``w`` ``[E, K, N]`` as
    stored (:func:`grouped_matmul_input_grad`), using the matmul's tile table entry.
    """
    weight_name = "w_gate_up" if op is Op.GATE_UP_SWIGLU else "w"
    if transpose_w and op is not Op.MATMUL:
        raise ValueError(f"transpose_w: True, expected op {Op.MATMUL.value}, found {op.value}")
    tuning.check_capability(compute_capability)
    x_name = "dy_mn" if transpose_w else "x_mk"
    if np.dtype(x_mk.dtype) != np.dtype(jnp.bfloat16) or x_mk.ndim != 2:
        raise ValueError(f"{x_name}: {x_mk.dtype}{list(x_mk.shape)}, expected bfloat16 [M, K]")
    m, k = x_mk.shape
    if k % K_MULTIPLE or k == 0:
        raise ValueError(f"{x_name}: {'N' if transpose_w else 'K'}={k}, expected a positive multiple of {K_MULTIPLE}")
    _check_group_sizes(group_sizes_e)
    num_experts = group_sizes_e.shape[0]
    weights, weight_arrays, n, scale_groups = _weight_format(w, weight_name, op, num_experts, k, transpose_w)
    match op:
        case Op.MATMUL:
            n_out = n
        case Op.GATE_UP_SWIGLU:
            if n % 2:
                raise ValueError(f"{weight_name}: N={n} rows, expected an even 2F (gate rows, then up rows)")
            n_out = n // 2
        case _:
            assert_never(op)
    if n_out % N_MULTIPLE or n_out == 0:
        raise ValueError(f"{weight_name}: {'F' if op is Op.GATE_UP_SWIGLU else 'N'}={n_out}, expected a "
                         f"positive multiple of {N_MULTIPLE}")
    if out is not None and (tuple(out.shape) != (m, n_out) or np.dtype(out.dtype) != np.dtype(jnp.bfloat16)):
        raise ValueError(f"out: {out.dtype}{list(out.shape)}, expected bfloat16 {[m, n_out]}")
    if check_bounds and not interpret:
        raise ValueError("check_bounds: True, expected interpret=True (it instruments the interpreted kernel)")
    if m == 0:
        empty = jnp.zeros((0, n_out), jnp.bfloat16) if out is None else out
        return (empty, jnp.zeros((1,), jnp.int32)) if check_bounds else empty

    if variant is None:
        variant = tuning.choose_variant(num_rows=m, num_experts=num_experts, compute_capability=compute_capability)
    if config is None:
        config = tuning.TILE_TABLE[compute_capability][(variant, weights, op)]
    elif config.tail_m or config.extra_m:
        raise ValueError(f"config: extra_m={config.extra_m}, tail_m={config.tail_m}, expected 0 (features of the "
                         "native Triton-language kernels, not of these Pallas ones)")
    if dequant is None:
        # The PTX formulation is right only in fragment order: on an H200 it gave a relative
        # error of 1.0 for the transposed (memory-order) tile, where EXACT gave 1.7e-3
        # (benchmarks/NOTES.md, "Kernel VJPs"), so the input gradient dequantizes with EXACT.
        dequant = Dequant.EXACT if interpret or transpose_w else Dequant.PTX
    spec = pallas_triton.KernelSpec(
        variant=variant, weights=weights, op=op, dequant=dequant, config=config, num_rows=m, k=k, n_out=n_out,
        block_k=tuning.fit_block(
            min(config.block_k, _TRANSPOSED_NVFP4_MAX_BLOCK_K) if transpose_w and weights is WeightFormat.NVFP4
            else config.block_k, k, K_MULTIPLE),
        block_n=tuning.fit_block(config.block_n, n_out, N_MULTIPLE),
        max_tiles=pallas_triton.max_tiles(m, num_experts, config.block_m), aliased=out is not None,
        scale_groups=scale_groups, check_bounds=check_bounds, transpose_w=transpose_w,
    )
    return _run_jit(spec, interpret, x_mk, weight_arrays, group_sizes_e, out)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _run_jit(spec, interpret, x_mk, weight_arrays, group_sizes_e, out):
    if spec.order is Order.FRAGMENT:
        x_mk = pallas_triton.permute_k(x_mk)
    schedule = pallas_triton.tile_schedule(group_sizes_e, num_rows=spec.num_rows, block_m=spec.config.block_m,
                                            num_tiles=spec.max_tiles)
    return pallas_triton.launch(spec, schedule, x_mk, weight_arrays, out, interpret=interpret)


def _expert_mlp_forward(x_mh, group_sizes_e, w_gate_up, w_down, *, compute_capability: int,
                        interpret: bool) -> jax.Array:
    """:func:`gate_up_swiglu`, then :func:`grouped_matmul`: the ``[M, 2F]`` gate/up product
    never reaches memory."""
    a_mf = gate_up_swiglu(x_mh, w_gate_up, group_sizes_e, compute_capability=compute_capability, interpret=interpret)
    return grouped_matmul(a_mf, w_down, group_sizes_e, compute_capability=compute_capability, interpret=interpret)


#: These kernels as :func:`expert_mlp`'s backend: bf16 or NVFP4 weights, interpret mode on CPU.
PALLAS = Backend(name="pallas", forward=_expert_mlp_forward, matmul=grouped_matmul, input_grad=input_grad,
                 weight_grad=grouped_matmul_weight_grad)
