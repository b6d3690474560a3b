"""The routed experts' MLP (gate/up projection, SwiGLU, down projection) and its registry.

Every implementation has the signature
``run(x_mh, group_sizes_e, weights, plan, *, row_token_m=None, token_row_tk=None) -> y_mh``:

* ``x_mh``: ``[M, H]`` rows sorted by expert, rows of expert ``e`` contiguous; or, with
  ``row_token_m`` (int32 ``[M]``), the tokens ``[T, H]`` in any order, row ``m`` being
  ``x[row_token_m[m]]``: the ``triton`` gate/up kernels read them in place, the other paths gather
  them first (:func:`token_rows`); ``token_row_tk`` (int32 ``[T, k]``, with ``row_token_m``, or
  None): each token's rows, ``row_token_m``'s transpose, from which every path's gradient of the
  tokens is a gather rather than a scatter-add (``pallas_kernels.grouped_matmul.expert_mlp``);
* ``group_sizes_e``: int32 ``[E_local]``; rows past ``sum(group_sizes_e)`` are padding, and
  their outputs are unspecified;
* ``weights``: ``{"w_gate_up_egh": [E_local, 2F, H], "w_down_ehf": [E_local, H, F]}``, each a
  bf16 array or an :class:`~moe_jax.nvfp4.NVFP4Tensor` (out, in; gate rows before up rows), and
  ``"input_scales": {"gate_e", "up_e", "down_e"}`` float32 ``[E_local]`` where the layer takes
  the checkpoint's static activation scales (``MoEConfig.activation_scale``): an implementation
  that quantizes activations (W4A4) quantizes against them, the others ignore them;
* ``plan``: the resolved :class:`~moe_jax.plan.Plan` (config and target);
* returns ``y_mh`` ``[M, H]`` in ``plan.config.dtype``.

Dimension letters: ``m`` rows, ``h`` hidden, ``e`` experts, ``f`` expert intermediate,
``g = 2f`` (gate and up stacked).
"""

from __future__ import annotations

import functools
import importlib.util
import math
from typing import TYPE_CHECKING, assert_never

import jax
import jax.numpy as jnp

import pallas_kernels.grouped_matmul as pallas_gmm
from moe_jax import nvfp4
from moe_jax.manual_axes import varying_alike
from moe_jax.registry import Implementation, Registry, Target
from pallas_kernels.grouped_matmul import tuning
from pallas_kernels.grouped_matmul.expert_mlp import swiglu, token_rows
from pallas_kernels.grouped_matmul.pallas_triton import group_bounds

if TYPE_CHECKING:
    from moe_jax.config import MoEConfig
    from moe_jax.plan import Plan

def dense_weight(w, dtype) -> jax.Array:
    """A bf16 array as is, or an NVFP4 tensor dequantized exactly (fp32), cast to ``dtype``."""
    if isinstance(w, nvfp4.NVFP4Tensor):
        return nvfp4.dequantize(w, dtype)
    return w.astype(dtype)


def _straight_through(master: jax.Array, dtype) -> jax.Array:
    """The NVFP4 quantization of ``master``, dequantized, with the identity as its derivative.

    The straight-through estimator (Bengio et al. 2013) treats rounding as the identity in the
    backward pass: ``dL/dmaster = dL/dW_q``. Alternatives, not taken: a clipped STE (zero
    gradient where a value saturates; NVFP4 derives its scales from the amax, so only the
    block-scale clamp at E4M3's range can saturate), learned step sizes (LSQ, extra parameters
    per block scale), and stochastic rounding (unbiased, noisier). The quantization runs inside
    ``jit`` every step and gives the host quantizer's codes (:func:`moe_jax.nvfp4.quantize`).
    """
    quantized = nvfp4.dequantize(nvfp4.quantize(jax.lax.stop_gradient(master)), jnp.float32)
    return (master.astype(jnp.float32) + jax.lax.stop_gradient(quantized - master.astype(jnp.float32))).astype(dtype)


def _static_scales(weights) -> tuple[jax.Array | None, jax.Array | None]:
    """``(gate_up_e, down_e)``: the static activation scales (float32 ``[E_local]``) the W4A4
    inputs of the two projections are quantized against, or ``(None, None)`` for per-row
    dynamic ones. The fused gate/up kernel reads one activation for both halves, so it takes the
    larger of gate's and up's ``input_scale``, as vLLM does: the smaller would saturate the
    half calibrated to the larger range."""
    scales = weights.get("input_scales")
    if scales is None:
        return None, None
    return jnp.maximum(scales["gate_e"], scales["up_e"]), scales["down_e"]


def _nvfp4_rows(a_mk, input_scale_e, group_sizes_e) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``a_mk [M, K]`` quantized as the W4A4 kernels take it (:func:`moe_jax.nvfp4.quantize_rows`):
    against each row's expert's static scale from ``input_scale_e [E_local]``, or, with None,
    against the row's own amax. Padding rows past ``sum(group_sizes_e)`` take the last expert's."""
    global_m = None
    if input_scale_e is not None:
        global_m = jnp.repeat(input_scale_e, group_sizes_e, total_repeat_length=a_mk.shape[0])
    return nvfp4.quantize_rows(a_mk, global_m)


# --- The reference's grouped matmul: work O(rows), not O(rows x experts) -------------------
#
# ``jax.lax.ragged_dot`` computes every row against every expert and masks wherever XLA has no
# native ragged dot (XLA:CPU; XLA:GPU as measured on an H200). Here the rows of expert ``e``
# (sorted, contiguous) go two ways, in tiles of ``c`` rows (:func:`tile_rows`):
#
# * its first ``c`` rows: one batched matmul over all experts, ``[E, c, K] x [E, N, K]``, which
#   reads the weights as they are (no copy);
# * the rest (experts with more than ``c`` rows): tiles of ``c`` rows, each with its expert's
#   weight gathered, ``[T, c, K] x [T, N, K]``, in scan steps of at most a budget of gathered
#   bytes (:data:`GATHER_BUDGET_BYTES`). A tile holds rows of one expert; there are fewer than
#   ``M / c`` tiles whatever the routing (:func:`overflow_tiles`).
#
# The rows reach that layout by one scatter and leave it by one gather (:func:`_slots`).
#
# Work: ``2 K N (E c + M)`` at most, so O(rows) plus ``E c`` rows of padding; weight copies:
# fewer than ``M / c`` matrices. Every output row is one dot of its row with its expert's
# weight over K, with float32 accumulation, as ``ragged_dot`` computes it.

#: Per platform, ``(R, fewest, most)`` for :func:`tile_rows`. ``R``: how many rows of matmul one
#: tile's weight copy (written, then read again) costs. CPU: measured on a 2-core EPYC
#: (benchmarks/NOTES.md, "The xla path"): tiles of 16-64 rows all within 10% at the demo's shape,
#: 16 best with few rows per expert. Accelerators: estimated, not measured: on an H200 (about
#: 500 TFLOP/s bf16, 4.3 TB/s) copying one bf16 ``[N, K]`` matrix twice over costs what about
#: 230 rows of its matmul do, and a batched matmul of fewer than ~128 rows per expert is bound by
#: reading the weights, so small tiles save nothing there.
TILE_ROWS_TUNING = {"cpu": (32, 8, 1024), "accelerator": (256, 64, 1024)}

#: Per platform, the most bytes of gathered expert weights one scan step of the overflow tiles
#: holds (the rest of a step's memory is rows: ``c`` rows per tile). CPU: 8 MiB (steps of 4-8
#: one-MiB tiles were fastest at the demo's shape, one step of 64 tiles 15% slower). Accelerators:
#: 1 GiB, which bounds the copies whatever the size (Kimi K2's gate/up matrix is 59 MB in bf16).
GATHER_BUDGET_BYTES = {"cpu": 8 << 20, "accelerator": 1 << 30}


def _tuning_key(platform: str) -> str:
    return "cpu" if platform == "cpu" else "accelerator"


def tile_rows(num_rows: int, num_experts: int, platform: str) -> int:
    """``c``, the rows per tile: the power of two nearest ``sqrt(R M / E)`` (the ``c`` that makes
    the padding of the first rows, ``E c``, and the weight copies of the rest, ``R M / c`` rows of
    work, equal), clamped to :data:`TILE_ROWS_TUNING`'s bounds and to ``M`` rounded up to a power
    of two (no expert has more rows than ``M``)."""
    r, fewest, most = TILE_ROWS_TUNING[_tuning_key(platform)]
    best = math.sqrt(r * num_rows / num_experts)
    c = 2 ** round(math.log2(best)) if best >= 1 else 1
    return min(max(fewest, min(c, most)), 1 << max(num_rows - 1, 0).bit_length())


def overflow_tiles(num_rows: int, c: int) -> int:
    """A static bound on the tiles past each expert's first ``c`` rows: ``sum_e ceil(max(g_e - c,
    0) / c) < sum_e g_e / c <= M / c`` (for an expert with more than ``c`` rows,
    ``ceil((g - c) / c) = ceil(g / c) - 1 < g / c``), so at most ``(M - 1) // c`` (none for no rows)."""
    return max(num_rows - 1, 0) // c


def _slots(group_sizes_e, num_rows: int, c: int):
    """Where each row goes in the padded layout, and which expert each overflow tile is of.

    The layout has ``E c + T c`` slots (``T = overflow_tiles(M, c)``): slots ``e c + i`` hold
    expert ``e``'s row ``i < c``; then, tile by tile, its rows past the first ``c`` (expert
    ``e``'s tiles after those of the experts before it). Returns ``(slot_m, tile_expert_t)``,
    int32 ``[M]`` and ``[T]``: rows past ``sum(group_sizes_e)`` (padding) get the slot
    ``E c + T c``, one past the end; unused tiles get expert ``E - 1`` (their rows are zeros).

    Built from compares and cumulative sums over the experts, not from the kernels'
    ``tile_schedule``, whose unrolled search alone took half of this module's first version's
    XLA:CPU compile time (benchmarks/NOTES.md, "The xla path").
    """
    num_experts = group_sizes_e.shape[0]
    num_tiles = overflow_tiles(num_rows, c)
    log2_c = c.bit_length() - 1  # c is a power of two: shifts, not signed divisions
    starts_e, ends_e = group_bounds(group_sizes_e, num_rows=num_rows)

    def owner(ends_g, size: int):
        """For each index below ``size``: how many of the (sorted) ``ends_g`` are at or before it,
        by comparing with all of them: ``size x E`` integer compares in one fused reduction, far
        below the router's ``T x E x H`` and cheaper to compile than a search or a cumulative sum
        of ``size`` elements (a scatter and a cumulative sum took 3x this one fusion's compile)."""
        count = jnp.sum(ends_g[None, :] <= jnp.arange(size, dtype=jnp.int32)[:, None], axis=1, dtype=jnp.int32)
        return jnp.minimum(count, num_experts - 1)

    expert_m = owner(ends_e, num_rows)
    offset_m = jnp.arange(num_rows, dtype=jnp.int32) - starts_e[expert_m]
    tiles_e = (jnp.maximum(ends_e - starts_e - c, 0) + c - 1) >> log2_c
    tile_ends_e = jnp.cumsum(tiles_e)
    over_slot_m = num_experts * c + ((tile_ends_e - tiles_e)[expert_m] << log2_c) + offset_m - c
    slot_m = jnp.where(offset_m < c, (expert_m << log2_c) + offset_m, over_slot_m)
    slot_m = jnp.where(jnp.arange(num_rows) < ends_e[-1], slot_m, (num_experts + num_tiles) * c)
    return slot_m, owner(tile_ends_e, num_tiles)


def _steps(num_tiles: int, tiles_per_step: int) -> tuple[int, int]:
    """``(steps, tiles per step)`` covering ``num_tiles`` with at most ``tiles_per_step`` a step,
    the steps as even as can be (fewer than ``steps`` unused slots)."""
    steps = -(-num_tiles // max(1, min(tiles_per_step, num_tiles)))
    return steps, -(-num_tiles // steps)


def _overflow_tiles_matmul(x_tck, w_enk, tile_expert_t, precision, platform: str) -> jax.Array:
    """float32 ``[T, c, N]``: tile ``t``'s rows times its expert's weight, gathered per tile, in
    scan steps of at most :data:`GATHER_BUDGET_BYTES` of gathered weights."""
    num_tiles, c, k = x_tck.shape
    per_matrix = w_enk.shape[1] * w_enk.shape[2] * jnp.dtype(w_enk.dtype).itemsize
    steps, per_step = _steps(num_tiles, GATHER_BUDGET_BYTES[_tuning_key(platform)] // per_matrix)

    def step(x_sck, expert_s):
        return jnp.einsum("sck,snk->scn", x_sck, w_enk[expert_s], precision=precision,
                          preferred_element_type=jnp.float32)

    if steps == 1:
        return step(x_tck, tile_expert_t)
    padded = steps * per_step
    x_tck = jnp.pad(x_tck, ((0, padded - num_tiles), (0, 0), (0, 0)))
    tile_expert_t = jnp.pad(tile_expert_t, (0, padded - num_tiles))
    # Rematerialized: autodiff would otherwise keep every step's gathered weights.
    _, y_sscn = jax.lax.scan(lambda carry, xs: (carry, jax.checkpoint(step)(*xs)), (),
                             (x_tck.reshape(steps, per_step, c, k), tile_expert_t.reshape(steps, per_step)))
    return y_sscn.reshape(padded, c, -1)[:num_tiles]


def grouped_matmul(a_mk, w_enk, group_sizes_e, *, platform: str, precision=None) -> jax.Array:
    """float32 ``[M, N]``: row ``m`` of expert ``e`` times ``w_enk[e]`` (out, in), accumulated in
    float32 from the operands' dtype, with work O(rows) (see the comment above
    :data:`TILE_ROWS_TUNING`). Rows past ``sum(group_sizes_e)`` give zeros, as
    ``jax.lax.ragged_dot`` does.

    The rows are scattered into the padded layout of :func:`_slots` (slots no row fills stay
    zero, so nothing but an expert's own rows reaches its products or gradients), multiplied
    there, and gathered back.

    Args:
      a_mk: ``[M, K]`` rows sorted by expert.
      w_enk: ``[E, N, K]``, the same dtype as ``a_mk``.
      group_sizes_e: int32 ``[E]``, read as the kernels read it (negative as 0, cut off at ``M``).
      platform: ``Target.platform``, which picks the tile size and the scan steps.
      precision: as for ``jnp.einsum``.
    """
    (m, k), num_experts = a_mk.shape, w_enk.shape[0]
    c = tile_rows(m, num_experts, platform)
    num_tiles = overflow_tiles(m, c)
    slot_m, tile_expert_t = _slots(group_sizes_e, m, c)
    x_sk = jnp.zeros(((num_experts + num_tiles) * c, k), a_mk.dtype).at[slot_m].set(
        a_mk, mode="drop", unique_indices=True)
    y_ecn = jnp.einsum("eck,enk->ecn", x_sk[:num_experts * c].reshape(num_experts, c, k), w_enk,
                       precision=precision, preferred_element_type=jnp.float32)
    y_sn = y_ecn.reshape(num_experts * c, -1)
    if num_tiles:
        y_tcn = _overflow_tiles_matmul(x_sk[num_experts * c:].reshape(num_tiles, c, k), w_enk, tile_expert_t,
                                       precision, platform)
        y_sn = jnp.concatenate([y_sn, y_tcn.reshape(num_tiles * c, -1)])
    return jnp.take(y_sn, slot_m, axis=0, mode="fill", fill_value=0)


# One program for the stage: a caller outside ``jit`` (tests and scripts that run the layer
# eagerly) compiles it once per shape instead of each of its few hundred small ops on its own.
@functools.partial(jax.jit, static_argnums=3)
def xla_expert_gemm(x_mh, group_sizes_e, weights, plan: Plan, *, row_token_m=None, token_row_tk=None):
    """Reference path: dequantize, then :func:`grouped_matmul` (fp32 accumulation, work O(rows)).

    The SwiGLU output is rounded to ``config.dtype`` before the down projection, as a
    fused kernel that writes it in bf16 would. Under ``config.qat`` the weights are float
    masters, used through their NVFP4 quantization (:func:`_straight_through`).

    ``config.reference_activations``: ``"bf16"`` multiplies the activations in ``config.dtype``
    with the weights rounded to it (W4A16). ``"nvfp4"`` (W4A4) quantizes the activations of
    both projections exactly as the W4A4 kernels' inputs are (:func:`_nvfp4_rows`, per
    ``config.activation_scale``; the down projection's from the bf16 SwiGLU output), dequantizes
    them and multiplies them with the exactly dequantized weights in float32 (full precision,
    no TF32). Gradients pass the activations' rounding straight through, as ``qat`` passes the
    weights'.
    """
    config = plan.config
    dtype = jnp.dtype(config.dtype)
    x_mh = token_rows(x_mh, row_token_m, token_row_tk)
    match config.reference_activations:
        case "bf16":
            quantized_rows, operand_dtype, precision = False, dtype, None
        case "nvfp4":
            quantized_rows, operand_dtype, precision = True, jnp.dtype(jnp.float32), jax.lax.Precision.HIGHEST
        case _ as unreachable:
            assert_never(unreachable)
    gate_up_scale_e, down_scale_e = _static_scales(weights)

    def rows(a_mk, input_scale_e):
        a_mk = a_mk.astype(operand_dtype)
        if not quantized_rows:
            return a_mk
        # One global scale per row: an [M, K] matrix of M row groups.
        quantized = nvfp4.dequantize(nvfp4.NVFP4Tensor(*_nvfp4_rows(jax.lax.stop_gradient(a_mk), input_scale_e,
                                                                     group_sizes_e)))
        return a_mk + jax.lax.stop_gradient(quantized - a_mk)

    dense = functools.partial(_straight_through, dtype=operand_dtype) if config.qat else (
        lambda w: dense_weight(w, operand_dtype))
    w_gate_up_egh, w_down_ehf = dense(weights["w_gate_up_egh"]), dense(weights["w_down_ehf"])
    matmul = functools.partial(grouped_matmul, group_sizes_e=group_sizes_e, platform=plan.target.platform,
                               precision=precision)
    h_mg = matmul(rows(x_mh.astype(dtype), gate_up_scale_e), w_gate_up_egh)
    a_mf = swiglu(h_mg).astype(dtype)
    y_mh = matmul(rows(a_mf, down_scale_e), w_down_ehf)
    return y_mh.astype(dtype)


def _fp8_elsewhere(config: MoEConfig) -> str | None:
    """The reason every implementation but ``triton`` gives for ``prefill_activations='fp8'``."""
    if config.prefill_activations == "fp8":
        return "prefill_activations='fp8' (W4A8) runs on the 'triton' kernels only (SM90)"
    return None


def _xla_cannot_run(target: Target, config: MoEConfig) -> str | None:
    del target  # gathers, einsums and a scan: every backend runs them, and JAX differentiates them.
    return _fp8_elsewhere(config)


# Interpreted on a machine without a GPU, the kernels use the tiles of this capability.
INTERPRET_CAPABILITY = 90


def _quantize(plan: Plan):
    """Under ``qat`` the weights are float masters, which the kernels read as their NVFP4
    quantization, made inside the trace every call (the straight-through gradient goes to the
    masters: :func:`pallas_kernels.grouped_matmul.expert_mlp`); else None."""
    return nvfp4.quantize if plan.config.qat else None


def pallas_expert_gemm(x_mh, group_sizes_e, weights, plan: Plan, *, row_token_m=None, token_row_tk=None):
    """The Pallas kernels (:func:`pallas_kernels.grouped_matmul.expert_mlp`, backend
    ``PALLAS``): fused gate/up + SwiGLU, then the down projection.

    NVFP4 weights are read in ModelOpt's layout and dequantized in the kernel; the
    ``[M, 2F]`` gate/up product never reaches memory. Rows past ``sum(group_sizes_e)`` are
    left unwritten (unspecified), as the stage contract allows. The kernels take bf16
    activations (W4A16): activation scales are not theirs to read.

    Differentiable (the op's ``jax.custom_vjp``): the backward pass runs the input-gradient and
    the weight-gradient kernels; bf16 weights and ``qat`` masters (through the straight-through
    estimator, see :func:`_straight_through`) get their gradients, NVFP4 weights stored as such
    are frozen.
    """
    return pallas_gmm.expert_mlp(
        x_mh, group_sizes_e, weights["w_gate_up_egh"], weights["w_down_ehf"], backend=pallas_gmm.PALLAS,
        compute_capability=plan.target.compute_capability or INTERPRET_CAPABILITY, interpret=plan.config.interpret,
        quantize=_quantize(plan), row_token_m=row_token_m, token_row_tk=token_row_tk)


def _pallas_cannot_run(target: Target, config: MoEConfig) -> str | None:
    # No condition on target.training: the kernels have a VJP (pallas_expert_gemm).
    if reason := _fp8_elsewhere(config):
        return reason
    if not config.interpret:
        if target.platform != "cuda":
            return (f"needs an NVIDIA GPU, found {target.platform}; MoEConfig.interpret=True runs the "
                    "kernels in the Pallas interpreter instead (slow: for tests)")
        if target.compute_capability not in pallas_gmm.tuning.TILE_TABLE:
            return (f"no tile configurations for {target.device_kind} (SM{target.compute_capability}); "
                    f"tuned for SM{', SM'.join(map(str, sorted(pallas_gmm.tuning.TILE_TABLE)))}")
    if config.dtype != "bfloat16":
        return f"activations are {config.dtype}; the kernels take bfloat16"
    for field in ("hidden_size", "expert_intermediate_size"):
        if getattr(config, field) % pallas_gmm.K_MULTIPLE:
            return f"{field} = {getattr(config, field)} is not a multiple of {pallas_gmm.K_MULTIPLE}"
    return None


def _triton_lang():
    from pallas_kernels.grouped_matmul import triton_lang  # noqa: PLC0415 (needs triton, loaded on use)

    return triton_lang


def triton_expert_gemm(x_mh, group_sizes_e, weights, plan: Plan, *, row_token_m=None, token_row_tk=None):
    """The Triton-language NVFP4 kernels (``pallas_kernels.grouped_matmul.triton_lang``, through
    jax-triton): fused gate/up + SwiGLU, then the down projection.

    Below SM100 (W4A16) the weights are dequantized in registers and bf16 tensor cores multiply:
    :func:`pallas_kernels.grouped_matmul.expert_mlp` with backend ``triton_lang.W4A16_BACKEND``,
    differentiable (the native input-gradient kernel for ``x``, frozen NVFP4 weights; under
    ``qat`` the weight gradient of the float masters, through the Pallas kernel). At many rows per
    expert the forward and the input gradient multiply exact bf16 copies of the weights made in
    the call instead (:func:`weight_copies` says where; the report names it).

    On SM100/SM120 (W4A4, inference only) each kernel's activations are quantized to NVFP4 just
    before it, one global scale per row (:func:`moe_jax.nvfp4.quantize_rows`): the checkpoint's
    static ``input_scale`` of the row's expert where ``weights`` carry them
    (``config.activation_scale``; the fused gate/up takes the larger of gate's and up's), else the
    row's own amax, computed on the fly (a token's rounding depends on that token alone, and never
    saturates). Then the FP4 tensor cores multiply.

    With ``config.prefill_activations="fp8"`` on SM90 (opt-in) the GEMMs at prefill sizes are
    W4A8 (``triton_lang.W4A8_BACKEND``: rows quantized to E4M3 per row, FP8 tensor cores).

    With ``row_token_m`` the gate/up kernel reads each row from the tokens by index (W4A16, W4A8,
    and bf16 weights at prefill sizes); bf16 decode sizes (the Pallas kernels) and W4A4 (whose
    activations are quantized per row, with the row's expert's scale) gather the rows first.
    """
    triton_lang = _triton_lang()
    cc = plan.target.compute_capability
    if plan.config.weight_format == "bf16":
        return pallas_gmm.expert_mlp(x_mh, group_sizes_e, weights["w_gate_up_egh"], weights["w_down_ehf"],
                                     backend=triton_lang.BF16_BACKEND, compute_capability=cc,
                                     row_token_m=row_token_m, token_row_tk=token_row_tk).astype(plan.config.dtype)
    match triton_lang.mode_for(cc):
        case triton_lang.Mode.W4A16:
            backend = (triton_lang.W4A8_BACKEND if plan.config.prefill_activations == "fp8"
                       else triton_lang.W4A16_BACKEND)
            y_mh = pallas_gmm.expert_mlp(x_mh, group_sizes_e, weights["w_gate_up_egh"], weights["w_down_ehf"],
                                         backend=backend, compute_capability=cc, quantize=_quantize(plan),
                                         row_token_m=row_token_m, token_row_tk=token_row_tk)
        case triton_lang.Mode.W4A4:
            x_mh = token_rows(x_mh, row_token_m, token_row_tk)
            gate_up_scale_e, down_scale_e = _static_scales(weights)
            a_mf = triton_lang.run(triton_lang.Op.GATE_UP_SWIGLU,
                                   triton_lang.NVFP4Rows(*_nvfp4_rows(x_mh, gate_up_scale_e, group_sizes_e)),
                                   weights["w_gate_up_egh"], group_sizes_e, compute_capability=cc)
            y_mh = triton_lang.run(triton_lang.Op.MATMUL,
                                   triton_lang.NVFP4Rows(*_nvfp4_rows(a_mf, down_scale_e, group_sizes_e)),
                                   weights["w_down_ehf"], group_sizes_e, compute_capability=cc)
        case _ as unreachable:
            assert_never(unreachable)
    return y_mh.astype(plan.config.dtype)


def _triton_cannot_run(target: Target, config: MoEConfig) -> str | None:
    if config.interpret:
        return ("the Triton-language kernels have no interpreter mode in the layer (Triton's own interpreter runs "
                "them in tests/interpreter only, with corrections); MoEConfig.interpret=True runs 'pallas' or 'xla'")
    if target.platform != "cuda":
        return f"needs an NVIDIA GPU, found {target.platform}"
    if config.dtype != "bfloat16":
        return f"activations are {config.dtype}; the kernels take bfloat16"
    for field in ("hidden_size", "expert_intermediate_size"):
        if getattr(config, field) % pallas_gmm.K_MULTIPLE:
            return f"{field} = {getattr(config, field)} is not a multiple of {pallas_gmm.K_MULTIPLE}"
    for package in ("triton", "jax_triton"):
        if importlib.util.find_spec(package) is None:
            return f"{package.replace('_', '-')} is not installed (pip install 'moe-jax[triton]')"
    triton_lang = _triton_lang()
    cc = target.compute_capability
    if config.weight_format == "bf16" and cc not in triton_lang.BF16_TILES:
        return (f"bf16 weights: native bf16 tiles for SM{', SM'.join(map(str, sorted(triton_lang.BF16_TILES)))} only, "
                f"found {target.device_kind} (SM{cc}); 'pallas' runs bf16 experts")
    if cc not in triton_lang.NATIVE_TILES:
        return (f"no native tile configurations for {target.device_kind} (SM{cc}); "
                f"tuned for SM{', SM'.join(map(str, sorted(triton_lang.NATIVE_TILES)))}")
    if config.prefill_activations == "fp8":
        if cc not in triton_lang.W4A8_CAPABILITIES:
            return ("prefill_activations='fp8' (W4A8): its MMA is SM90's FP8 wgmma, "
                    f"found {target.device_kind} (SM{cc})"
                    + ("; SM100/SM120 quantize activations to NVFP4 (W4A4) with the default" if cc >= 100 else ""))
        if target.training:
            return ("prefill_activations='fp8' (W4A8) is for inference; training multiplies bf16 activations "
                    "(prefill_activations='bf16')")
    if (target.training or config.qat) and cc not in triton_lang.INPUT_GRAD_TILES:
        return (f"training on SM{cc}: the native backward kernels are W4A16 (SM"
                f"{', SM'.join(map(str, sorted(triton_lang.INPUT_GRAD_TILES)))}); 'pallas' is differentiable here")
    return None


#: Results files that decide ``auto``'s order between the native and the Pallas kernels on SM90
#: (tests/test_auto_follows_measurements.py checks that they still say so).
LAYER_RESULTS = "benchmarks/results/layer_h200/layer.json"
TRAIN_STEP_RESULTS = "benchmarks/results/train_step_h200/train_step.json"
BF16_TRAIN_STEP_RESULTS = "benchmarks/results/train_step_h100/af45c6d/train_step.json"

#: Where ``auto`` puts the native kernels for bf16 weights in training, on the capabilities that
#: have native bf16 tiles (``triton_lang.BF16_TILES``), and the measurement that says so. Elsewhere,
#: and for bf16 inference (the layer within 2% either way), the Pallas kernels come first.
BF16_TRAINING_NATIVE_FIRST = {
    90: ("on one H100 the bf16 expert MLP's training step (forward, input and weight gradients) was faster "
         "with the Triton-language kernels than with the Pallas kernels at 8192 and 32768 rows "
         f"({BF16_TRAIN_STEP_RESULTS})"),
}

#: Where ``auto`` puts the native kernels (``triton``) against the Pallas ones for NVFP4 weights,
#: per capability, for inference (decode and prefill sizes alike) and for training, and the
#: measurement, or its absence, that says so.
NATIVE_VS_PALLAS = {
    90: {"inference": ("triton", "on one H200 the W4A16 Triton kernels ran the whole Kimi K2 NVFP4 layer faster than "
                                 "the Pallas kernels at decode sizes (32 and 256 tokens) and at prefill sizes (2048 "
                                 f"and 8192 tokens) ({LAYER_RESULTS})"),
         "training": ("triton", "on one H200 the expert MLP's step with frozen NVFP4 weights (forward and input "
                                "gradient) was faster with the W4A16 Triton kernels than with the Pallas kernels at "
                                f"8192 and 32768 rows ({TRAIN_STEP_RESULTS})")},
    # Never measured: the older path until a run there says otherwise.
    80: {"inference": ("pallas", "SM80 and SM89 were never measured; the Pallas kernels are the longer-tested path"),
         "training": ("pallas", "SM80 and SM89 were never measured; the Pallas kernels are the longer-tested path")},
    100: {"inference": ("triton", "SM100: the native W4A4 kernels use the FP4 tensor cores (cross-compiled and "
                                  "executed in Triton's interpreter, not run on SM100 hardware here: check with "
                                  "`moe-jax selftest`)"),
          "training": ("pallas", "SM100: the native W4A4 kernels have no backward kernels")},
    120: {"inference": ("triton", "SM120: the native W4A4 kernels use the FP4 tensor cores (cross-compiled and "
                                  "executed in Triton's interpreter, not run on SM120 hardware here: check with "
                                  "`moe-jax selftest`)"),
          "training": ("pallas", "SM120: the native W4A4 kernels have no backward kernels")},
}


def _auto_order(target: Target, config: MoEConfig):
    use = "training" if target.training or config.qat else "inference"
    if config.weight_format == "nvfp4" and target.compute_capability is not None:
        cc = target.compute_capability
        known = cc if cc in NATIVE_VS_PALLAS else (80 if cc < 90 else 90 if cc < 100 else 120)
        first, why = NATIVE_VS_PALLAS[known][use]
        if known != cc:
            why = f"SM{cc} was never measured; as on SM{known}: {why}"
        order = ("triton", "pallas", "xla") if first == "triton" else ("pallas", "triton", "xla")
        return order, f"NVFP4 {use}: {why}"
    if use == "training" and config.weight_format == "bf16" and \
            target.compute_capability in BF16_TRAINING_NATIVE_FIRST:
        return ("triton", "pallas", "xla"), f"bf16 training: {BF16_TRAINING_NATIVE_FIRST[target.compute_capability]}"
    if use == "training":
        return ("pallas", "xla", "triton"), ("the Pallas kernels where they can run (differentiable: their VJP runs "
                                             "the input- and weight-gradient kernels), else the reference")
    return ("pallas", "xla", "triton"), "the Pallas kernels where they can run, else the reference"


def activations_report(config: MoEConfig, target: Target, expert_gemm: str) -> str:
    """For the resolution report (``Plan.activations``): what the routed experts' GEMMs multiply
    the weights with, ``expert_gemm`` having been chosen, and, where the activations are
    quantized (W4A4), against which global scale."""
    cc = target.compute_capability
    match expert_gemm:
        case "triton":
            triton_lang = _triton_lang()
            w4a4 = triton_lang.mode_for(cc) is triton_lang.Mode.W4A4
            fp8 = config.prefill_activations == "fp8"
            copies = "" if w4a4 else _routed_copies(config, target, forward=not fp8)
            where = (f"W4A4 on the FP4 tensor cores of SM{cc}" if w4a4
                     else f"W4A16: triton dequantizes the weights on SM{cc}{copies}")
            if fp8 and not w4a4:
                return (f"{config.dtype} at decode sizes (W4A16, the weights dequantized on SM{cc}); at prefill "
                        "sizes (more than two 16-row tiles per expert) E4M3 per row against its own amax, the "
                        "weights' codes times their block scales placed into E4M3, FP8 tensor cores "
                        f"(W4A8, prefill_activations='fp8'; ~4-6% from W4A16's output){copies}")
        case "xla":
            w4a4 = config.reference_activations == "nvfp4"
            where = ("the reference's W4A4 mode, reference_activations='nvfp4'" if w4a4
                     else "W4A16 reference; reference_activations='nvfp4' quantizes them as W4A4 does")
        case "pallas":
            w4a4, where = False, f"W4A16: the pallas kernels dequantize the weights{_routed_copies(config, target)}"
        case other:
            raise ValueError(f"expert_gemm: {other!r}, expected one of {EXPERT_GEMM.names()}")
    if config.weight_format == "bf16":
        where = "bf16 weights"
    if not w4a4:
        return f"{config.dtype}, not quantized ({where}); activation_scale={config.activation_scale!r} has no effect"
    checkpoint = "global scale from the checkpoint's static input_scale of each expert"
    match config.activation_scale:
        case "checkpoint":
            scale = f"{checkpoint} (gate/up: the larger)"
        case "dynamic":
            scale = "dynamic per-row global scale, amax / (6 * 448)"
        case "auto":
            scale = f"{checkpoint} where the params carry them (gate/up: the larger), else dynamic per row"
        case _ as unreachable:
            assert_never(unreachable)
    shared = f"; the shared expert's stay {config.dtype}" if config.num_shared_experts else ""
    return f"NVFP4 per row, {scale} (activation_scale={config.activation_scale!r}; {where}){shared}"


def _size(num_bytes: int) -> str:
    for scale, unit, digits in ((1e9, "GB", 2), (1e6, "MB", 0), (1e3, "kB", 0)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.{digits}f} {unit}"
    return f"{num_bytes} bytes"


def _routed_copies(config: MoEConfig, target: Target, *, forward: bool = False) -> str:
    """:func:`weight_copies` of the routed experts on one device (``config.num_experts`` over the
    expert axis), as a clause of the activations' report line."""
    copies = weight_copies(config.num_experts // target.expert_parallel, config.hidden_size,
                           config.expert_intermediate_size, target, forward=forward)
    return f"; {copies}" if copies else ""


def weight_copies(num_experts: int, hidden: int, intermediate: int, target: Target, *, forward: bool,
                  per: str = "rows per expert") -> str:
    """Where W4A16 multiplies exact bf16 copies of NVFP4 expert weights (gate/up ``[E, 2F, H]``,
    down ``[E, H, F]``) made each call, as ``pallas_kernels.grouped_matmul.tuning`` decides it: the
    forward where ``forward`` (the ``triton`` kernels' W4A16) from
    ``DEQUANTIZED_FORWARD_ROWS_PER_EXPERT`` rows per expert on the target's capability, the input
    gradient in training from ``DEQUANTIZED_INPUT_GRAD_ROWS_PER_EXPERT``; a copy past
    ``DEQUANTIZED_COPY_MAX_BYTES`` never. A clause for the report (``per`` names the rows), or ""
    where neither applies.
    """
    budget, ehf = tuning.DEQUANTIZED_COPY_MAX_BYTES, num_experts * hidden * intermediate
    taken, refused = [], []
    rows = tuning.DEQUANTIZED_FORWARD_ROWS_PER_EXPERT.get(target.compute_capability)
    if forward and rows is not None:
        both = 6 * ehf  # gate/up's copy and down's, alive together
        if both <= budget:
            taken.append(f"the forward from {rows} {per} ({_size(both)})")
        else:
            refused.append(f"the forward's {_size(both)}")
    if target.training:
        copies = {"gate/up": 4 * ehf, "down": 2 * ehf}  # one at a time, each projection's own
        fits = [size for size in copies.values() if size <= budget]
        start = f"from {tuning.DEQUANTIZED_INPUT_GRAD_ROWS_PER_EXPERT} {per}"
        if len(fits) == len(copies):
            taken.append(f"the input gradient {start} ({' + '.join(map(_size, fits))})")
        elif fits:  # down's copy is half gate/up's
            taken.append(f"down's input gradient {start} ({_size(fits[0])})")
            refused.append(f"gate/up's input gradient's {_size(copies['gate/up'])}")
        else:
            refused.append(f"the input gradient's {' + '.join(map(_size, copies.values()))}")
    return "; ".join(
        ([f"exact bf16 copies of the weights made each call: {', '.join(taken)}"] if taken else [])
        + ([f"bf16 copies would exceed the {budget / 2**30:g} GiB budget: {', '.join(refused)}"] if refused else []))


#: Per implementation, the most tokens per device for which NVFP4 shared-expert weights go
#: through the routed experts' W4A16 kernels (one group holding every token), read as stored at
#: 4.5 bits a weight but where the kernels' own rule multiplies exact bf16 copies
#: (:func:`weight_copies`; on an H100 the ``triton`` forward's copies from 2048 tokens are 24-28%
#: faster, benchmarks/results/prefill_h100/13e8e4a_shared_expert/); None: at every size. Above it
#: they are dequantized once per call and multiplied by XLA's bf16 GEMM. On one H200 (Kimi K2's
#: shared expert, 8192 tokens) the ``triton`` kernels took 1.45 ms for it in a 20-call profile
#: under the board's power cap, against 1.51 ms for the dequantization (0.60 ms) and cuBLAS (0.91
#: ms) at boost clocks (benchmarks/NOTES.md, "The shared expert at every size"); the Pallas
#: kernels' prefill rate is below cuBLAS's by more than the dequantization costs above 1024 tokens.
SHARED_KERNEL_MAX_TOKENS = {"triton": None, "pallas": 1024}


def shared_expert_plan(config: MoEConfig, target: Target, expert_gemm: str) -> tuple[int | None, str]:
    """How the shared expert runs, ``expert_gemm`` having been chosen for the routed ones:
    ``(max tokens per device through the routed kernels (0: never, None: always), report line)``."""
    if not config.num_shared_experts:
        return 0, "none"
    # shared_expert_mlp's dense form multiplies its gradients in the weights' dtype, but for xla
    grads = f", gradients multiplied in {config.dtype}" if target.training and expert_gemm != "xla" else ""
    if config.shared_format != "nvfp4":
        return 0, f"{config.shared_format} weights, XLA dot{grads}"
    dense = "NVFP4 weights dequantized every call, then an XLA dot"
    if expert_gemm == "xla":
        return 0, f"{dense} (the xla reference path)"
    if config.qat:
        return 0, f"{dense}{grads} (under qat the {expert_gemm} kernels take the routed experts' float masters)"
    if expert_gemm == "triton":
        triton_lang = _triton_lang()
        if triton_lang.mode_for(target.compute_capability) is triton_lang.Mode.W4A4:
            return 0, (f"{dense} in {config.dtype} (triton quantizes activations to NVFP4 on "
                       f"SM{target.compute_capability}; the shared expert's stay {config.dtype})")
    dense += grads
    if config.shared_size % pallas_gmm.K_MULTIPLE:
        return 0, f"{dense} (its width {config.shared_size} is not a multiple of {pallas_gmm.K_MULTIPLE})"
    limit = SHARED_KERNEL_MAX_TOKENS[expert_gemm]
    through = f"NVFP4 weights through the {expert_gemm} kernels as one group, read as stored"
    if config.prefill_activations == "fp8":
        through += " (W4A8 at prefill sizes, as the routed experts)"
    copies = weight_copies(1, config.hidden_size, config.shared_size, target,
                           forward=expert_gemm == "triton" and config.prefill_activations != "fp8",
                           per="tokens per device")
    if limit is None:
        return None, f"{through}, at every size; {copies}" if copies else f"{through}, at every size (never dequantized)"
    copies = f"; {copies}" if copies else ""
    return limit, f"{through}, up to {limit} tokens per device{copies}; above, {dense}"


def shared_expert_mlp(x_th, w_gate_up_gh, w_down_hs, plan: Plan) -> jax.Array:
    """The shared expert on every token: ``x_th [T, H]`` -> float32 ``[T, H]``.

    Up to ``plan.shared_kernel_max_tokens`` tokens (None: any number; see :func:`shared_expert_plan`) through the
    routed experts' implementation as one expert holding all ``T`` rows (the output rounded to
    ``config.dtype``, as the routed experts' is); otherwise densely, with fp32 accumulation (and,
    but for ``xla``, gradients by :func:`matmul_f32_grads_in_operand_dtype`). The HLO says which:
    ``jax.named_scope`` ``moe_jax.shared_expert.<expert_gemm>`` or ``.dense``.
    """
    dtype = jnp.dtype(plan.config.dtype)
    tokens = x_th.shape[0]
    limit = plan.shared_kernel_max_tokens
    if tokens > 0 and (limit is None or tokens <= limit):
        one = {name: nvfp4.NVFP4Tensor(packed=w.packed[None], scales=w.scales[None], global_scale=w.global_scale[None])
               for name, w in (("w_gate_up_egh", w_gate_up_gh), ("w_down_ehf", w_down_hs))}
        with jax.named_scope(f"moe_jax.shared_expert.{plan.expert_gemm}"):  # which way it ran, in the HLO
            y_th = EXPERT_GEMM[plan.expert_gemm].run(x_th.astype(dtype), jnp.full((1,), tokens, jnp.int32), one, plan)
        return y_th.astype(jnp.float32)
    # The reference path keeps float32 cotangents; the others multiply them in the weights' dtype,
    # as the routed kernels do: bf16's tensor-core rate, not TF32's.
    matmul = _matmul_f32 if plan.expert_gemm == "xla" else matmul_f32_grads_in_operand_dtype
    with jax.named_scope("moe_jax.shared_expert.dense"):
        h_tg = matmul(x_th.astype(dtype), dense_weight(w_gate_up_gh, dtype))
        a_ts = swiglu(h_tg).astype(dtype)
        return matmul(a_ts, dense_weight(w_down_hs, dtype))


def _matmul_f32(a_tk: jax.Array, w_nk: jax.Array) -> jax.Array:
    return jnp.einsum("tk,nk->tn", a_tk, w_nk, preferred_element_type=jnp.float32)


def matmul_f32_grads_in_operand_dtype(a_tk: jax.Array, w_nk: jax.Array) -> jax.Array:
    """``a_tk @ w_nk^T`` -> float32 ``[T, N]``, whose gradients are multiplied in the operands' dtype.

    Differentiated as a plain einsum, a float32 output gets a float32 cotangent, and both its
    backward products run in float32 (TF32 on GPUs: the shared expert's dense gradients took ~0.9
    ms of a 4096-token Kimi-shaped layer step on an H100). Here the cotangent ``g_tn`` is rounded
    to ``a_tk.dtype`` first, then ``da = g w`` and ``dw = g^T a`` accumulate in float32 and return
    in their operands' dtypes. Where the output feeds a bf16 result, as the layer's down projection
    does (its sum is rounded to ``config.dtype``), the cotangent is a bf16 value already and the
    rounding is exact; inside the MLP (the gate/up product's cotangent, through SwiGLU's
    derivative) it rounds to bf16 as the routed kernels' backward does.

    Args:
      a_tk: ``[T, K]`` bf16 (or any float; the gradients are then multiplied in it).
      w_nk: ``[N, K]``, the same dtype.
    """
    # Inside shard_map the tokens vary over mesh axes the weights are replicated along.
    return _matmul_rounded_grads(*varying_alike(a_tk, w_nk))


@jax.custom_vjp
def _matmul_rounded_grads(a_tk, w_nk):
    return _matmul_f32(a_tk, w_nk)


def _matmul_fwd(a_tk, w_nk):
    return _matmul_f32(a_tk, w_nk), (a_tk, w_nk)


def _matmul_bwd(residuals, g_tn):
    a_tk, w_nk = residuals
    g_tn = g_tn.astype(a_tk.dtype)
    da_tk = jnp.einsum("tn,nk->tk", g_tn, w_nk, preferred_element_type=jnp.float32)
    dw_nk = jnp.einsum("tn,tk->nk", g_tn, a_tk, preferred_element_type=jnp.float32)
    return da_tk.astype(a_tk.dtype), dw_nk.astype(w_nk.dtype)


_matmul_rounded_grads.defvjp(_matmul_fwd, _matmul_bwd)


EXPERT_GEMM = Registry(
    stage="expert_gemm",
    implementations=(
        Implementation(
            name="pallas",
            summary=("Pallas/Triton grouped GEMMs, NVFP4 dequantized in-kernel, fused SwiGLU; SM80-SM120; "
                     "differentiable (input- and weight-gradient kernels)"),
            cannot_run=_pallas_cannot_run,
            run=pallas_expert_gemm,
        ),
        Implementation(
            name="triton",
            summary=("Triton-language NVFP4 kernels through jax-triton: W4A4 on the FP4 tensor cores (SM100, SM120), "
                     "W4A16 with in-register dequantization (SM80-SM90); differentiable on W4A16 (input-gradient "
                     "kernel; qat masters' weight gradients through the Pallas kernel); bf16 weights on SM90 "
                     "(native tiles at prefill sizes, the weight gradient by TMA from 128 rows per expert)"),
            cannot_run=_triton_cannot_run,
            run=triton_expert_gemm,
        ),
        Implementation(
            name="xla",
            summary=("reference: dequantize + a grouped matmul of XLA einsums over row tiles (fp32 accumulation, "
                     "work O(rows)); any backend, differentiable"),
            cannot_run=_xla_cannot_run,
            run=xla_expert_gemm,
        ),
    ),
    auto_order=_auto_order,
)
