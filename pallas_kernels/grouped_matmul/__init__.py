"""Grouped (ragged) matmul for MoE experts: bf16 or NVFP4 weights, optional fused SwiGLU.

Public API::

    grouped_matmul(x_mk, w, group_sizes_e, *, compute_capability, interpret=False, out=None)
    gate_up_swiglu(x_mk, w_gate_up, group_sizes_e, *, compute_capability, interpret=False, out=None)

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
  floats only (:class:`.triton.Dequant`), since XLA:CPU flushes subnormals.
* ``out``: optional bf16 buffer of the output's shape, aliased into the kernel's output.

Both return bf16 (``[M, N]`` and ``[M, F]``), accumulate in fp32 and raise ValueError naming
the argument for a bad shape, dtype or capability.

Constraints: K a multiple of 64; N (for the fused op, F) a multiple of 16.
"""

from __future__ import annotations

import functools
from typing import assert_never

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.grouped_matmul import triton as triton_backend
from pallas_kernels.grouped_matmul import tuning
from pallas_kernels.grouped_matmul.triton import Dequant, Order
from pallas_kernels.grouped_matmul.tuning import Op, TileConfig, Variant, WeightFormat

__all__ = ["gate_up_swiglu", "grouped_matmul", "run"]

K_MULTIPLE = 64
N_MULTIPLE = 16
_FLOAT8_E4M3FN = np.dtype(jnp.float8_e4m3fn)


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


def _weight_format(w, name: str, op: Op, num_experts: int, k: int) -> tuple[WeightFormat, tuple, int, int]:
    """Validates ``w``; returns its format, the kernel's weight operands, N and the global
    scales per expert (1; or 2, gate's and up's, for the fused op)."""
    if all(hasattr(w, attr) for attr in ("packed", "scales", "global_scale")):
        packed, scales, global_scale = w.packed, w.scales, w.global_scale
        checks = (("packed", packed, np.uint8, (3,)), ("scales", scales, _FLOAT8_E4M3FN, (3,)),
                  ("global_scale", global_scale, np.float32, (1, 2)))
        for field, array, dtype, ranks in checks:
            if np.dtype(array.dtype) != dtype or array.ndim not in ranks:
                raise ValueError(f"{name}.{field}: {array.dtype}{list(array.shape)}, expected "
                                 f"{np.dtype(dtype).name} of rank {' or '.join(map(str, ranks))}")
        e, n, k_half = packed.shape
        match op:
            case Op.MATMUL:
                scale_shapes = ((num_experts,),)
            case Op.GATE_UP_SWIGLU:
                scale_shapes = ((num_experts,), (num_experts, 2))
            case _:
                assert_never(op)
        expected = {"packed": (num_experts, n, k // 2), "scales": (num_experts, n, k // 16)}
        for field, array in (("packed", packed), ("scales", scales)):
            if tuple(array.shape) != expected[field]:
                raise ValueError(f"{name}.{field}: shape {tuple(array.shape)}, expected {expected[field]} "
                                 f"for E={num_experts} experts (group_sizes_e), K={k} (x_mk) and N={n}")
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
    if w.shape[0] != num_experts or w.shape[2] != k:
        raise ValueError(f"{name}: shape {tuple(w.shape)}, expected [E={num_experts} (group_sizes_e), N, "
                         f"K={k} (x_mk)]")
    return WeightFormat.BF16, (w,), w.shape[1], 1


def run(op: Op, x_mk, w, group_sizes_e, *, compute_capability: int, interpret: bool = False, out=None,
        config: TileConfig | None = None, variant: Variant | None = None,
        dequant: Dequant | None = None, check_bounds: bool = False):
    """The shared entry of both public functions.

    ``config``/``variant`` override the tile table (benchmark sweeps) and ``dequant`` the
    formulation (tests comparing the two on a GPU); left as None, the table, the heuristic
    and ``PTX`` (``EXACT`` under ``interpret``) decide.

    ``check_bounds`` (with ``interpret`` only) makes the kernel count every load and store
    lane whose index falls outside its buffer, which the interpreter would otherwise clamp
    silently; the call then returns ``(out, out_of_bounds)``, the count an int32 ``[1]``.
    """
    weight_name = "w_gate_up" if op is Op.GATE_UP_SWIGLU else "w"
    tuning.check_capability(compute_capability)
    if np.dtype(x_mk.dtype) != np.dtype(jnp.bfloat16) or x_mk.ndim != 2:
        raise ValueError(f"x_mk: {x_mk.dtype}{list(x_mk.shape)}, expected bfloat16 [M, K]")
    m, k = x_mk.shape
    if k % K_MULTIPLE or k == 0:
        raise ValueError(f"x_mk: K={k}, expected a positive multiple of {K_MULTIPLE}")
    if np.dtype(group_sizes_e.dtype) != np.int32 or group_sizes_e.ndim != 1 or group_sizes_e.shape[0] == 0:
        raise ValueError(f"group_sizes_e: {group_sizes_e.dtype}{list(group_sizes_e.shape)}, expected int32 [E], E >= 1")
    num_experts = group_sizes_e.shape[0]
    weights, weight_arrays, n, scale_groups = _weight_format(w, weight_name, op, num_experts, k)
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
    if dequant is None:
        dequant = Dequant.EXACT if interpret else Dequant.PTX
    spec = triton_backend.KernelSpec(
        variant=variant, weights=weights, op=op, dequant=dequant, config=config, num_rows=m, k=k, n_out=n_out,
        block_k=tuning.fit_block(config.block_k, k, K_MULTIPLE),
        block_n=tuning.fit_block(config.block_n, n_out, N_MULTIPLE),
        max_tiles=triton_backend.max_tiles(m, num_experts, config.block_m), aliased=out is not None,
        scale_groups=scale_groups, check_bounds=check_bounds,
    )
    return _run_jit(spec, interpret, x_mk, weight_arrays, group_sizes_e, out)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _run_jit(spec, interpret, x_mk, weight_arrays, group_sizes_e, out):
    if spec.order is Order.FRAGMENT:
        x_mk = triton_backend.permute_k(x_mk)
    schedule = triton_backend.tile_schedule(group_sizes_e, num_rows=spec.num_rows, block_m=spec.config.block_m,
                                            num_tiles=spec.max_tiles)
    return triton_backend.launch(spec, schedule, x_mk, weight_arrays, out, interpret=interpret)
