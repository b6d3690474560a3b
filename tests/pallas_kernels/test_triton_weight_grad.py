"""The native (Triton-language) bf16 weight gradient (``triton_weight_grad``) without a GPU: its
plan against a direct count, the plan's static bound under every routing, the kernel
cross-compiled for each capability (the chip's bf16 MMA, its shared memory, no spills, and on
SM90 the rows loaded two steps ahead of the MMA), and its argument checks. The kernel itself runs
against float64 in ``tests/interpreter/test_weight_grad_kernel.py`` and on a GPU in
``tests/pallas_kernels/test_kernels_gpu.py``."""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("triton")
from pallas_kernels.grouped_matmul import crosscompile, pallas_triton, triton_weight_grad, tuning  # noqa: E402
from pallas_kernels.grouped_matmul.tuning import SHARED_MEMORY_BYTES, TileConfig  # noqa: E402

SMALL = TileConfig(block_m=32, block_n=32, block_k=64, num_warps=4, num_stages=3, group_t=1)
MMA = {
    120: ("sm_120a", r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32"),
    100: ("sm_100a", r"tcgen05\.mma\.cta_group::1\.kind::f16"),
    90: ("sm_90a", r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.bf16\.bf16"),
    89: ("sm_89", r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32"),
    80: ("sm_80", r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32"),
}


def _plan(sizes, *, rows: int, programs: int, n: int = 64, k: int = 128):
    spec = triton_weight_grad.make_spec(num_rows=rows, num_experts=len(sizes), n=n, k=k, compute_capability=90,
                                        out_dtype=np.float32, tile=SMALL, num_programs=programs)
    starts, ends = pallas_triton.group_bounds(jnp.asarray(sizes, jnp.int32), num_rows=rows)
    return spec, [np.asarray(a) for a in triton_weight_grad.plan(spec, starts, ends)]


def test_the_plan_is_each_program_s_tiles_in_row_steps():
    """Program ``p`` takes tiles ``p, p + P, ...`` in order, each in ``max(1, ceil(rows /
    block_m))`` steps from the expert's first row, with the end of the expert's rows."""
    sizes = np.array([0, 1, 64, 65, 300], np.int32)
    spec, (tile_ps, row_ps, end_ps, steps_p) = _plan(sizes, rows=500, programs=3)
    first = np.concatenate([[0], np.cumsum(sizes)])
    per_expert = spec.num_tiles // 5  # 2 x 2
    for p in range(3):
        want = [(t, first[t // per_expert] + 32 * j, first[t // per_expert + 1])
                for t in range(p, spec.num_tiles, 3) for j in range(max(1, -(-sizes[t // per_expert] // 32)))]
        got = list(zip(tile_ps[p, :steps_p[p]], row_ps[p, :steps_p[p]], end_ps[p, :steps_p[p]], strict=True))
        assert steps_p[p] == len(want) and got == want


@pytest.mark.parametrize("sizes", [[500, 0, 0, 0, 0], [0, 0, 0, 0, 500], [100] * 5, [0] * 5, [1, 0, 499, 0, 0]],
                         ids=["first", "last", "even", "none", "uneven"])
def test_every_program_s_steps_fit_the_plan_s_width(sizes):
    """``max_steps`` bounds every program's steps, one expert taking every row included, for
    grids of one program to one per tile; and rows past ``num_rows`` are not planned."""
    for programs in (1, 3, 7, 20):
        spec, (_, row_ps, end_ps, steps_p) = _plan(sizes, rows=500, programs=programs)
        assert steps_p.max() <= spec.max_steps, (programs, steps_p.max(), spec.max_steps)
        for p in range(spec.num_programs):
            assert (end_ps[p, :steps_p[p]] <= 500).all() and (row_ps[p, :steps_p[p]] >= 0).all()


def test_the_grid_is_one_program_per_sm_at_most_one_per_tile():
    spec = triton_weight_grad.make_spec(num_rows=10, num_experts=2, n=32, k=64, compute_capability=90,
                                        out_dtype=np.float32, tile=SMALL, num_programs=1000)
    assert spec.num_programs == spec.num_tiles == 2
    spec = triton_weight_grad.make_spec(num_rows=32768, num_experts=48, n=4096, k=7168, compute_capability=90,
                                        out_dtype=np.float32)
    assert spec.num_programs == triton_weight_grad.DEFAULT_PROGRAMS
    assert spec.config == tuning.NATIVE_WEIGHT_GRAD_TILES[90][1]
    # The Pallas kernel's tile with the plan's two stages.
    assert spec.config.num_stages == tuning.WEIGHT_GRAD_TILES[90][1].num_stages + triton_weight_grad.PLAN_STAGES


@pytest.mark.parametrize("cc", sorted(MMA))
def test_the_kernel_compiles_to_the_chip_s_bf16_mma_without_spills(cc):
    """Both tiles of each capability (fewer and more than ``WEIGHT_GRAD_MANY_ROWS`` rows per
    expert) at Kimi K2's projections, 48 and 384 experts, bf16 and float32 out."""
    target, mma = MMA[cc]
    for n, k, rows, experts, out in ((4096, 7168, 32768, 48, "bfloat16"), (7168, 2048, 8192, 48, "float32"),
                                     (7168, 2048, 65536, 384, "bfloat16")):
        kernel = crosscompile.compile_weight_grad(cc, n=n, k=k, rows=rows, experts=experts, out_dtype=out)
        assert kernel.target == target and re.search(mma, kernel.ptx), (n, k, rows)
        assert kernel.spill_bytes == 0 and 0 < kernel.shared_bytes <= SHARED_MEMORY_BYTES[cc], (n, k, rows)


def test_sm90_loads_the_rows_two_steps_ahead_of_the_asynchronous_mma():
    """What the persistence is for: three buffers for each row tile (the step the MMA reads and
    two in flight), the MMA issued asynchronously with one left outstanding, and its only full
    wait in the loop inside the tile's last step (the store)."""
    kernel = crosscompile.compile_weight_grad(90, n=4096, k=7168, rows=32768, experts=48)
    assert re.findall(r"local_alloc : \(\) -> !ttg\.memdesc<(\d+)x64x(\d+)xbf16", kernel.ttgir) == [
        ("3", "128"), ("3", "256")]
    assert re.search(r"ttng\.warp_group_dot .*isAsync = true", kernel.ttgir)
    loop = kernel.ttgir[kernel.ttgir.index("scf.for"):kernel.ttgir.index("scf.yield")]
    assert "{pendings = 1 : i32}" in loop
    assert loop.count("{pendings = 0 : i32}") == 1 and loop.index("scf.if") < loop.index("{pendings = 0 : i32}")


def test_offsets_past_int32_use_64_bit_bases():
    """The expert's output offset and the rows' base are 64-bit; a tile's offsets stay 32-bit
    and fit at the largest published shapes."""
    kernel = crosscompile.compile_weight_grad(90, n=7168, k=2048, rows=65536, experts=384)
    assert len(re.findall(r"arith\.extsi %\S+ : i32 to i64", kernel.ttgir)) >= 2
    # What the 64-bit bases are for: 384 experts' output, and the rows 8 devices send one (EP).
    assert 384 * 7168 * 2048 > 2**31 and 8 * 65536 * 7168 > 2**31
    assert 64 * 7168 + 256 * 7168 < 2**31  # a row step's offsets from its base


def test_bad_input_gets_one_line_naming_the_argument():
    x, dy, sizes = jnp.ones((10, 128), jnp.bfloat16), jnp.ones((10, 64), jnp.bfloat16), jnp.asarray([4, 6], jnp.int32)
    cases = [
        (dict(x_mk=x.astype(jnp.float32)), r"^x_mk: float32\[10, 128\], expected bfloat16 \[M, C\] with C a positive"),
        (dict(dy_mn=jnp.ones((9, 64), jnp.bfloat16)), r"^dy_mn: 9 rows, expected M=10 \(x_mk\)$"),
        (dict(dy_mn=jnp.ones((10, 24), jnp.bfloat16)), r"^dy_mn: bfloat16\[10, 24\], expected bfloat16 \[M, C\]"),
        (dict(group_sizes_e=sizes.astype(jnp.float32)), r"^group_sizes_e: float32\[2\], expected int32 \[E\], E >= 1$"),
        (dict(out_dtype=jnp.float16), r"^out_dtype: float16, expected float32 or bfloat16$"),
        (dict(compute_capability=75), r"^compute_capability: 75"),
        (dict(out=jnp.zeros((2, 64, 64), jnp.float32)),
         r"^out: float32\[2, 64, 64\], expected float32 \[2, 64, 128\]$"),
        (dict(num_programs=0), r"^num_programs: 0, expected a positive int"),
        (dict(interpret=True), r"^interpret: True, expected False"),
    ]
    for change, message in cases:
        args = dict(x_mk=x, dy_mn=dy, group_sizes_e=sizes, compute_capability=90) | change
        with pytest.raises(ValueError, match=message):
            triton_weight_grad.weight_grad(**args)
