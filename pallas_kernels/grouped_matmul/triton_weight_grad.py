"""The bf16 weight gradient ``dW_e = dy_e^T x_e`` as a Triton-language kernel whose rows arrive by
TMA, launched through :func:`.triton_launch.call`: the native twin of the Pallas kernel
(:func:`pallas_kernels.grouped_matmul.grouped_matmul_weight_grad`), same contract.

Why TMA. At the training shape (48 experts x 32768 rows, ~683 rows per expert) the Pallas kernel
and a persistent pointer-loading twin reached 495-512 TFLOP/s against ``torch._grouped_mm``'s
570-588 (``benchmarks/results/train_step_h100/2f15176/``), and the twin showed that per-tile
fixed costs (pipeline fill, epilogue) were not the gap: the steady-state loop was, where every
thread computes and masks its ``cp.async`` addresses and a CTA barrier ends each row step. Here
each expert's rows are read through two device-side tensor descriptors bounded at its last row, so
TMA reads zeros past it: no mask, no address arithmetic per element, and no row of another
expert is read (a non-finite row reaches its own expert's gradient only).

Work split. Persistent programs (one or two per SM, ``tuning.NATIVE_WEIGHT_GRAD_PROGRAMS_PER_SM``)
walk output tiles ``p, p + P, ...``, numbered expert-major with the column tiles innermost, so the
programs that run at once share an expert's rows in L2. A program walks them expert by expert and
makes each expert's two descriptors once: made per tile (as first built; each is written to
global memory with a fence, between CTA barriers) they cost 6-8% of the kernel's time at 683 rows
per expert. Within an expert, the program's tiles and their row steps are one software-pipelined
loop (Triton 3.6 cannot pipeline a loop that makes descriptors, nor fuse a tile loop with a row
loop whose bounds are the expert's rows, so it is written out by hand), the epilogue under ``if``
on a tile's last step: the next tile's first rows load while a tile's result is stored, where a
loop per tile drains and refills its pipeline (~11 row steps at 683 rows per expert). On one H100
at 48 experts that is 5% under the Pallas kernel at 683 rows per expert (gate/up 3.81 against
3.99 ms, down 2.09 against 2.20), where a loop per tile was 3% under it and 1% over, and at
171 rows per expert, with 128 x 128 output tiles on 4 warps two programs per SM, 8% and 2% under
it (1.79 against 1.94, 1.11 against 1.13), where a loop per tile was 1% under and 6% over
(``benchmarks/results/weight_grad_h100/0045dd2_probe/``; ``torch._grouped_mm`` 3.08/1.63 and
1.36/0.79 in the same run). An expert without rows takes one step per tile and stores zeros, so
every output element is written. Descriptor coordinates are 32-bit rows (the largest published
shapes have ~2**19); the output offset of an expert is 64-bit (384 experts x 4096 x 7168 elements
pass 2**31).

No TMA store: through a descriptor over the output, with its 64 KB staging buffer, it was 3-10%
slower at every tile tried (same results). No warp-specialized row loop: Triton 3.6's
(``tl.range(warp_specialize=True)``) compiled for the loop per tile failed on an H100, with an
illegal instruction through :func:`.triton_launch.call`, and through Triton's own launcher with
wrong output or an illegal memory access (``benchmarks/results/weight_grad_h100/``); on this loop
it does not specialize at all (the same 4 warps, no ``setmaxnreg``).

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

from pallas_kernels.grouped_matmul import N_MULTIPLE, check_weight_grad_args, pallas_triton, triton_launch, tuning
from pallas_kernels.grouped_matmul.tuning import TileConfig

#: Programs when the GPU's SM count is unknown (that of an H100 or H200).
DEFAULT_PROGRAMS = 132


@triton.jit
def _kernel(starts_ptr, ends_ptr, x_ptr, dy_ptr, out_in_ptr, out_ptr, K: tl.constexpr, N: tl.constexpr,
            NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            NUM_STAGES: tl.constexpr):
    """Program ``p`` takes output tiles ``t = p mod P``: tile ``t`` is expert ``t // (N/BLOCK_N *
    K/BLOCK_K)``'s ``[BLOCK_N, BLOCK_K]`` tile (column tiles innermost), summed over the expert's
    rows ``[starts_ptr[e], ends_ptr[e])`` in steps of ``BLOCK_M``. Experts in order, each one's
    descriptors made once; then the program's tiles of the expert and their row steps as one
    pipelined loop: step ``i`` is row step ``i % steps`` of the program's tile ``i // steps``, and
    on a tile's last step its result is stored and the accumulator restarts.

    ``x_ptr`` bf16 ``[M, K]``; ``dy_ptr`` bf16 ``[M, N]``; ``out_ptr`` ``[E, N, K]`` (bf16 or
    float32), every element written (``out_in_ptr`` is the same buffer when the caller passed one
    to write into, else a placeholder: never read).
    """
    K_TILES: tl.constexpr = K // BLOCK_K
    PER_EXPERT: tl.constexpr = (N // BLOCK_N) * K_TILES
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    local_n = tl.arange(0, BLOCK_N)
    local_k = tl.arange(0, BLOCK_K)
    for expert in range(NUM_EXPERTS):
        start = tl.load(starts_ptr + expert)
        end = tl.load(ends_ptr + expert)
        # Bounded at the expert's last row, so TMA reads zeros past it; at least one row, as a
        # descriptor needs.
        rows = tl.maximum(end, 1)
        dy_desc = tl.make_tensor_descriptor(dy_ptr, shape=[rows, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N])
        x_desc = tl.make_tensor_descriptor(x_ptr, shape=[rows, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
        first = (pid + programs - (expert * PER_EXPERT) % programs) % programs  # tile t is program t mod P's
        tiles = (PER_EXPERT - first + programs - 1) // programs
        # An expert without rows still takes one step per tile, so every tile is written: its rows
        # read as zeros past the bound, except when it ends at row 0, where the descriptor's one
        # row is another expert's; the stored value is selected to zero (not multiplied: a
        # non-finite row there stays out).
        steps = tl.maximum((end - start + BLOCK_M - 1) // BLOCK_M, 1)
        acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
        for i in tl.range(0, tiles * steps, num_stages=NUM_STAGES):
            tile = i // steps
            step = i - tile * steps
            local = first + tile * programs
            n_start = (local // K_TILES) * BLOCK_N
            k_start = (local % K_TILES) * BLOCK_K
            row = start + step * BLOCK_M
            acc = tl.dot(tl.trans(dy_desc.load([row, n_start])), x_desc.load([row, k_start]), acc)
            if step == steps - 1:
                out_at = (out_ptr + tl.cast(expert, tl.int64) * (N * K)
                          + ((n_start + local_n)[:, None] * K + (k_start + local_k)[None, :]))
                tl.store(out_at, tl.where(end > start, acc, 0.0).to(out_ptr.dtype.element_ty))
                acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Spec(pallas_triton.WeightGradSpec):
    """Everything static about one launch (hashable: it keys the jit cache): the Pallas kernel's
    description (``config`` is the tile) and the persistent grid."""

    num_programs: int
    capability: int = 90

    @property
    def num_tiles(self) -> int:
        return self.num_experts * (self.n // self.block_n) * (self.k // self.block_k)

    def constexprs(self) -> dict:
        return dict(K=self.k, N=self.n, NUM_EXPERTS=self.num_experts, BLOCK_M=self.config.block_m,
                    BLOCK_N=self.block_n, BLOCK_K=self.block_k, NUM_STAGES=self.config.num_stages)

    @property
    def name(self) -> str:
        return f"native_weight_grad_{self.out_dtype.name}"

    def launch(self) -> triton_launch.Launch:
        """What :func:`.triton_launch.call` compiles and launches."""
        return triton_launch.Launch(kernel=_kernel, signature=tuple(_pointer_types(self).items()),
                                    constexprs=tuple(self.constexprs().items()), num_warps=self.config.num_warps,
                                    num_stages=self.config.num_stages, grid=self.num_programs,
                                    capability=self.capability, name=self.name)


def make_spec(*, num_rows: int, num_experts: int, n: int, k: int, compute_capability: int, out_dtype,
              tile: TileConfig | None = None, num_programs: int | None = None) -> Spec:
    """The launch for these shapes: the capability's tile and programs per SM
    (:func:`.tuning.native_weight_grad_tile`) unless ``tile`` (then one program per SM);
    ``num_programs`` programs when given, else that many per SM (:func:`sm_count`); at most one
    per output tile."""
    if compute_capability not in tuning.NATIVE_WEIGHT_GRAD_TILES:
        raise ValueError(f"compute_capability: {compute_capability}, expected one of "
                         f"{sorted(tuning.NATIVE_WEIGHT_GRAD_TILES)} (the kernel loads its rows by TMA, SM90 and "
                         "above; below, the Pallas kernel grouped_matmul_weight_grad)")
    per_sm = 1
    if tile is None:
        tile, per_sm = tuning.native_weight_grad_tile(num_rows=num_rows, num_experts=num_experts,
                                                      compute_capability=compute_capability)
    if num_programs is not None and (type(num_programs) is not int or num_programs < 1):
        raise ValueError(f"num_programs: {num_programs!r}, expected a positive int (programs of the persistent grid)")
    block_n = tuning.fit_block(tile.block_n, n, N_MULTIPLE)
    block_k = tuning.fit_block(tile.block_k, k, N_MULTIPLE)
    tiles = num_experts * (n // block_n) * (k // block_k)
    return Spec(config=tile, num_experts=num_experts, num_rows=num_rows, n=n, k=k, block_n=block_n, block_k=block_k,
                num_programs=min(num_programs or per_sm * sm_count(), tiles), out_dtype=np.dtype(out_dtype),
                capability=compute_capability)


def sm_count() -> int:
    """The SMs of JAX's first device where it is a GPU that says (``core_count``: 132 on an H200,
    188 on an RTX PRO 6000), else :data:`DEFAULT_PROGRAMS`: one persistent program per SM."""
    device = jax.devices()[0]
    count = getattr(device, "core_count", None) if device.platform == "gpu" else None
    return count if isinstance(count, int) and count > 0 else DEFAULT_PROGRAMS


def weight_grad(x_mk, dy_mn, group_sizes_e, *, compute_capability: int, out_dtype=jnp.float32, out=None,
                tile: TileConfig | None = None, num_programs: int | None = None, interpret: bool = False) -> jax.Array:
    """``[E, N, K]`` in ``out_dtype``: per expert ``dy_e^T @ x_e`` over its rows, accumulated in
    float32 (:func:`pallas_kernels.grouped_matmul.grouped_matmul_weight_grad`'s contract).

    Args:
      x_mk: bf16 ``[M, K]``, the forward's input rows, sorted by expert.
      dy_mn: bf16 ``[M, N]``, the output cotangent.
      group_sizes_e: int32 ``[E]``; rows past the sum do not contribute, and an expert without
        rows gets zeros.
      compute_capability: picks the tile; 90, 100 or 120 (TMA).
      out_dtype: float32 or bfloat16.
      out: optional ``[E, N, K]`` buffer of ``out_dtype`` aliased into the output (every element
        is written).
      tile: overrides the table (benchmark sweeps).
      num_programs: the persistent grid (default: the tile's programs per SM times :func:`sm_count`).
      interpret: must be False (a ``Backend``'s ``weight_grad`` takes it): the kernel runs on a
        GPU; Triton's interpreter runs it in ``tests/interpreter/``.

    Raises:
      ValueError: naming the argument, for a bad shape, dtype or capability.
    """
    triton_launch.not_interpreted(interpret)
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
    starts_e, ends_e = pallas_triton.group_bounds(group_sizes_e, num_rows=spec.num_rows)
    return triton_launch.call(spec.launch(), starts_e, ends_e, x_mk, dy_mn, out=out,
                              out_shape=jax.ShapeDtypeStruct((spec.num_experts, spec.n, spec.k), spec.out_dtype))


def kernel_function():
    """The ``@triton.jit`` kernel itself (for cross-compilation and the interpreter)."""
    return _kernel


def _pointer_types(spec: Spec) -> dict[str, str]:
    """The kernel's pointer arguments and their Triton types, in order."""
    out = "*bf16" if spec.out_dtype == np.dtype(jnp.bfloat16) else "*fp32"
    return dict(zip(_kernel.arg_names, ["*i32", "*i32", "*bf16", "*bf16", out, out], strict=False))


__all__ = ["DEFAULT_PROGRAMS", "Spec", "kernel_function", "launch", "make_spec", "sm_count", "weight_grad"]
