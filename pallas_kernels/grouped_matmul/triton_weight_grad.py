"""The bf16 weight gradient ``dW_e = dy_e^T x_e`` as a persistent Triton-language kernel, called
from JAX through ``jax_triton``: the native twin of the Pallas kernel
(:func:`pallas_kernels.grouped_matmul.grouped_matmul_weight_grad`), same contract.

Why persistent. The reduction of a weight gradient runs over one expert's rows: ~683 at 32768
rows over 48 experts, 11 steps of 64, so each ``[block_n, block_k]`` output tile is a short
K loop between a pipeline fill and an epilogue that stores 64-128 KB. One program per tile (the
Pallas kernel) waits for both at every tile; the Pallas kernel reached 475-481 TFLOP/s there
against ``torch._grouped_mm``'s 571-580 (``benchmarks/results/train_step_h200/``). Here each
program walks every ``num_programs``-th tile in one flat loop of row steps (:func:`_kernel`), and
a tile's last step stores it and clears the accumulator. What step ``s`` of program ``p`` does
(its tile, first row and the end of its expert's rows) is read from a plan XLA computes before the
launch (:func:`plan`), by the loop index alone: no scalar is carried from one step to the next
(a tile counter advanced by the expert's row count would be, through a load, and Triton's
pipeliner then waits for every step's loads in the step itself). So the software pipeline runs
over tile boundaries: the next tile's first rows are in flight while this one's last MMAs and its
store run. (``tl.range(flatten=True)`` builds such a loop from a nest only for inner loops whose
trip count does not depend on the outer one; here it is the expert's row count.)

Tiles are numbered expert-major, so the programs that run at once work on one or two experts and
share their rows in L2 (Kimi K2's gate/up at 683 rows: 15 MB of ``x_e`` and ``dy_e``). An expert
without rows still takes one step of masked loads: its tiles are written as zeros, so every
output element is written. Row offsets are 64-bit scalars plus 32-bit tile offsets; the output
offset of an expert is 64-bit (384 experts x 4096 x 7168 elements pass 2**31).

Dimension letters: ``m`` rows, ``n`` the cotangent's columns (the weight's rows), ``k`` the
input's columns, ``e`` experts, ``p`` programs.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

from pallas_kernels.grouped_matmul import N_MULTIPLE, check_weight_grad_args, pallas_triton, triton_lang, tuning
from pallas_kernels.grouped_matmul.tuning import TileConfig

#: Programs when the GPU's SM count is unknown (that of an H100 or H200).
DEFAULT_PROGRAMS = 132
#: Pipeline stages the plan's indirection takes on top of a plain loop's: Triton's pipeliner gives
#: the plan's loads a stage of their own and the row loads that depend on them the next, so the
#: Pallas kernel's 3 stages would leave the rows one step ahead of the MMA; 5 keep them two ahead
#: (three row buffers; cross-compiled for SM90: 180 KB, 220 registers, no spills). The tiles
#: (``tuning.NATIVE_WEIGHT_GRAD_TILES``) include them.
PLAN_STAGES = 2


@triton.jit
def _kernel(plan_tile_ptr, plan_row_ptr, plan_end_ptr, steps_ptr, x_ptr, dy_ptr, out_in_ptr, out_ptr,
            K: tl.constexpr, N: tl.constexpr, MAX_STEPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Program ``p`` takes ``steps_ptr[p]`` row steps of ``BLOCK_M`` rows; step ``s`` is entry
    ``p * MAX_STEPS + s`` of the plan (:func:`plan`): its output tile (expert ``tile // (N/BLOCK_N
    * K/BLOCK_K)``'s ``[BLOCK_N, BLOCK_K]`` tile, column tiles innermost), its first row and the
    end of the expert's rows. A step whose rows reach that end is its tile's last: it stores the
    tile and clears the accumulator.

    ``x_ptr`` bf16 ``[M, K]``; ``dy_ptr`` bf16 ``[M, N]``; ``out_ptr`` ``[E, N, K]`` (bf16 or
    float32), every element written (``out_in_ptr`` is the same buffer when the caller passed one
    to write into, else a placeholder: never read).
    """
    K_TILES: tl.constexpr = K // BLOCK_K
    PER_EXPERT: tl.constexpr = (N // BLOCK_N) * K_TILES
    program = tl.program_id(0)
    total = tl.load(steps_ptr + program)
    local_m = tl.arange(0, BLOCK_M)
    local_n = tl.arange(0, BLOCK_N)
    local_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    # The plan is read by the loop index alone (no value carried from one step to the next but
    # the accumulator), so the software pipeline loads steps ahead across tile boundaries.
    for s in tl.range(0, total, num_stages=NUM_STAGES):
        at = program * MAX_STEPS + s
        tile = tl.load(plan_tile_ptr + at)
        first_row = tl.load(plan_row_ptr + at)
        row_end = tl.load(plan_end_ptr + at)
        expert = tile // PER_EXPERT
        n_start = ((tile % PER_EXPERT) // K_TILES) * BLOCK_N
        k_start = (tile % K_TILES) * BLOCK_K
        row_ok = first_row + local_m < row_end
        base = first_row.to(tl.int64)
        dy_mn = tl.load(dy_ptr + base * N + (local_m[:, None] * N + (n_start + local_n)[None, :]),
                        mask=row_ok[:, None], other=0.0)
        x_mk = tl.load(x_ptr + base * K + (local_m[:, None] * K + (k_start + local_k)[None, :]),
                       mask=row_ok[:, None], other=0.0)
        acc = tl.dot(tl.trans(dy_mn), x_mk, acc)
        if first_row + BLOCK_M >= row_end:
            out_at = (out_ptr + expert.to(tl.int64) * (N * K)
                      + ((n_start + local_n)[:, None] * K + (k_start + local_k)[None, :]))
            tl.store(out_at, acc.to(out_ptr.dtype.element_ty))
            acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Spec(pallas_triton.WeightGradSpec):
    """Everything static about one launch (hashable: it keys the jit cache): the Pallas kernel's
    description (``config`` is the tile) and the persistent grid."""

    num_programs: int

    @property
    def num_tiles(self) -> int:
        return self.num_experts * (self.n // self.block_n) * (self.k // self.block_k)

    @property
    def max_steps(self) -> int:
        """A bound on any program's row steps, whatever the routing: the tiles of one expert are
        consecutive, so they fall in at most ``ceil(per_expert / P) + 1`` rounds of ``P`` tiles,
        and a program takes at most one tile a round; an expert's tiles take ``max(1, ceil(rows /
        block_m)) <= 1 + rows / block_m`` steps each, which sum to at most ``E + M / block_m``."""
        per_expert = self.num_tiles // self.num_experts
        rounds_per_expert = -(-per_expert // self.num_programs) + 1
        return rounds_per_expert * (self.num_experts + -(-self.num_rows // self.config.block_m))

    def constexprs(self) -> dict:
        return dict(K=self.k, N=self.n, MAX_STEPS=self.max_steps, BLOCK_M=self.config.block_m, BLOCK_N=self.block_n,
                    BLOCK_K=self.block_k, NUM_STAGES=self.config.num_stages)


def make_spec(*, num_rows: int, num_experts: int, n: int, k: int, compute_capability: int, out_dtype,
              tile: TileConfig | None = None, num_programs: int | None = None) -> Spec:
    """The launch for these shapes: the capability's tile (``tuning.NATIVE_WEIGHT_GRAD_TILES``)
    unless ``tile``; ``num_programs`` programs (:func:`sm_count` when not given), at most one per
    output tile."""
    if tile is None:
        tile = tuning.choose_weight_grad_tile(num_rows=num_rows, num_experts=num_experts,
                                              compute_capability=compute_capability,
                                              table=tuning.NATIVE_WEIGHT_GRAD_TILES)
    if num_programs is not None and (type(num_programs) is not int or num_programs < 1):
        raise ValueError(f"num_programs: {num_programs!r}, expected a positive int (programs of the persistent grid)")
    block_n = tuning.fit_block(tile.block_n, n, N_MULTIPLE)
    block_k = tuning.fit_block(tile.block_k, k, N_MULTIPLE)
    tiles = num_experts * (n // block_n) * (k // block_k)
    return Spec(config=tile, num_experts=num_experts, num_rows=num_rows, n=n, k=k, block_n=block_n, block_k=block_k,
                num_programs=min(num_programs or sm_count(), tiles), out_dtype=np.dtype(out_dtype))


def sm_count() -> int:
    """The SMs of JAX's first device where it is a GPU that says (``core_count``: 132 on an H200,
    188 on an RTX PRO 6000), else :data:`DEFAULT_PROGRAMS`: one persistent program per SM."""
    device = jax.devices()[0]
    count = getattr(device, "core_count", None) if device.platform == "gpu" else None
    return count if isinstance(count, int) and count > 0 else DEFAULT_PROGRAMS


def plan(spec: Spec, starts_e, ends_e) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """What each program does, step by step (:func:`_kernel`'s operands, computed by XLA before
    the launch): program ``p`` takes tiles ``p, p + P, ...``, each in ``max(1, ceil(rows_e /
    block_m))`` steps.

    Returns:
      ``(tile_ps, row_ps, end_ps)`` int32 ``[P, spec.max_steps]``: step ``s`` of program ``p``
      multiplies the ``block_m`` rows from ``row_ps[p, s]`` (those before ``end_ps[p, s]``, the
      end of the expert's rows) into tile ``tile_ps[p, s]``; and ``steps_p`` int32 ``[P]``, the
      steps each program takes (entries past them are never read).
    """
    p_count, s_count = spec.num_programs, spec.max_steps
    per_expert = spec.num_tiles // spec.num_experts
    rounds = -(-spec.num_tiles // p_count)
    tile_pr = jnp.arange(p_count, dtype=jnp.int32)[:, None] + p_count * jnp.arange(rounds, dtype=jnp.int32)[None, :]
    valid_pr = tile_pr < spec.num_tiles
    expert_pr = jnp.minimum(tile_pr, spec.num_tiles - 1) // per_expert
    steps_e = jnp.maximum(-(-(ends_e - starts_e) // spec.config.block_m), 1)
    steps_pr = jnp.where(valid_pr, steps_e[expert_pr], 0)
    first_pr = jnp.cumsum(steps_pr, axis=1) - steps_pr  # a tile's first step in its program
    # Each step's round: mark every tile's first step with its round, then carry it forward.
    rows_p = jnp.arange(p_count)[:, None]
    at_pr = jnp.where(valid_pr, first_pr, s_count)  # past the end: dropped
    round_ps = jnp.zeros((p_count, s_count), jnp.int32).at[rows_p, at_pr].max(
        jnp.broadcast_to(jnp.arange(rounds, dtype=jnp.int32), (p_count, rounds)), mode="drop")
    round_ps = jax.lax.cummax(round_ps, axis=1)
    step_ps = jnp.arange(s_count, dtype=jnp.int32)[None, :] - jnp.take_along_axis(first_pr, round_ps, axis=1)
    tile_ps = jnp.minimum(rows_p + p_count * round_ps, spec.num_tiles - 1).astype(jnp.int32)
    expert_ps = tile_ps // per_expert
    row_ps = starts_e[expert_ps] + step_ps * spec.config.block_m
    return tile_ps, row_ps, ends_e[expert_ps], jnp.sum(steps_pr, axis=1, dtype=jnp.int32)


def weight_grad(x_mk, dy_mn, group_sizes_e, *, compute_capability: int, out_dtype=jnp.float32, out=None,
                tile: TileConfig | None = None, num_programs: int | None = None, interpret: bool = False) -> jax.Array:
    """``[E, N, K]`` in ``out_dtype``: per expert ``dy_e^T @ x_e`` over its rows, accumulated in
    float32 (:func:`pallas_kernels.grouped_matmul.grouped_matmul_weight_grad`'s contract).

    Args:
      x_mk: bf16 ``[M, K]``, the forward's input rows, sorted by expert.
      dy_mn: bf16 ``[M, N]``, the output cotangent.
      group_sizes_e: int32 ``[E]``; rows past the sum do not contribute, and an expert without
        rows gets zeros.
      compute_capability: picks the tile (the Pallas kernel's table).
      out_dtype: float32 or bfloat16.
      out: optional ``[E, N, K]`` buffer of ``out_dtype`` aliased into the output (every element
        is written).
      tile: overrides the table (benchmark sweeps).
      num_programs: the persistent grid (default: :func:`sm_count`, one program per SM).
      interpret: must be False (a ``Backend``'s ``weight_grad`` takes it): the kernel runs on a
        GPU; Triton's interpreter runs it in ``tests/interpreter/``.

    Raises:
      ValueError: naming the argument, for a bad shape, dtype or capability.
    """
    triton_lang._not_interpreted(interpret)
    m, k, n, e = check_weight_grad_args(x_mk, dy_mn, group_sizes_e, out_dtype=out_dtype,
                                        compute_capability=compute_capability, out=out)
    if m == 0:
        return jnp.zeros((e, n, k), out_dtype)
    spec = make_spec(num_rows=m, num_experts=e, n=n, k=k, compute_capability=compute_capability,
                     out_dtype=out_dtype, tile=tile, num_programs=num_programs)
    return launch(spec, x_mk, dy_mn, group_sizes_e, out)


@functools.partial(jax.jit, static_argnums=(0,))
def launch(spec: Spec, x_mk, dy_mn, group_sizes_e, out=None) -> jax.Array:
    """Runs the kernel: ``[E, N, K]`` in ``spec.out_dtype`` (written into ``out``, aliased, if given)."""
    import jax_triton  # noqa: PLC0415 (needs a GPU jaxlib; optional dependency)

    starts_e, ends_e = pallas_triton.group_bounds(group_sizes_e, num_rows=spec.num_rows)
    aliased = out is not None
    out_in = out if aliased else jnp.zeros((1,), spec.out_dtype)  # a placeholder the kernel never reads
    operands = (*plan(spec, starts_e, ends_e), x_mk, dy_mn, out_in)
    name = f"native_weight_grad_{spec.out_dtype.name}"
    with jax.named_scope(name):
        dw = jax_triton.triton_call(
            *operands, kernel=_kernel,
            out_shape=jax.ShapeDtypeStruct((spec.num_experts, spec.n, spec.k), spec.out_dtype),
            grid=(spec.num_programs,), num_warps=spec.config.num_warps, num_stages=spec.config.num_stages, name=name,
            input_output_aliases={len(operands) - 1: 0} if aliased else None, **spec.constexprs())
    return triton_lang._same_varying_axes([dw], operands)[0]


def kernel_function():
    """The ``@triton.jit`` kernel itself (for cross-compilation and the interpreter)."""
    return _kernel


def signature(spec: Spec) -> dict[str, str]:
    """The kernel's argument types for ``triton.compile`` (cross-compilation, no GPU)."""
    out = "*bf16" if spec.out_dtype == np.dtype(jnp.bfloat16) else "*fp32"
    types = ["*i32", "*i32", "*i32", "*i32", "*bf16", "*bf16", out, out]
    return {**dict(zip(_kernel.arg_names, types, strict=False)), **{name: "constexpr" for name in spec.constexprs()}}


__all__ = ["DEFAULT_PROGRAMS", "PLAN_STAGES", "Spec", "kernel_function", "launch", "make_spec", "plan", "signature",
           "sm_count", "weight_grad"]
