"""The native (Triton-language) bf16 weight gradient (``triton_weight_grad``) without a GPU: the
kernel cross-compiled for each capability (the chip's bf16 MMA, its rows loaded by TMA and
nothing else loaded per element, its shared memory, no spills), the persistent grid, and its
argument checks. The kernel itself runs against float64 in
``tests/interpreter/test_weight_grad_kernel.py`` and on a GPU in
``tests/pallas_kernels/test_kimi_size_gpu.py``."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("triton")
from pallas_kernels.grouped_matmul import (  # noqa: E402
    crosscompile, triton_launch, triton_weight_grad, tuning,
)
from pallas_kernels.grouped_matmul.tuning import SHARED_MEMORY_BYTES, TileConfig  # noqa: E402

SMALL = TileConfig(block_m=32, block_n=32, block_k=64, num_warps=4, num_stages=3, group_t=1)
MMA = {
    120: ("sm_120a", r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32"),
    100: ("sm_100a", r"tcgen05\.mma\.cta_group::1\.kind::f16"),
    90: ("sm_90a", r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.bf16\.bf16"),
}


def test_the_grid_is_the_tile_s_programs_per_sm_at_most_one_per_tile():
    spec = triton_weight_grad.make_spec(num_rows=10, num_experts=2, n=32, k=64, compute_capability=90,
                                        out_dtype=np.float32, tile=SMALL, num_programs=1000)
    assert spec.num_programs == spec.num_tiles == 2
    for rows, tile, per_sm in ((32768, 1, 1), (8192, 0, 2)):  # 683 and 171 rows per expert
        spec = triton_weight_grad.make_spec(num_rows=rows, num_experts=48, n=4096, k=7168, compute_capability=90,
                                            out_dtype=np.float32)
        assert spec.config == tuning.NATIVE_WEIGHT_GRAD_TILES[90][tile]
        assert spec.num_programs == per_sm * triton_weight_grad.DEFAULT_PROGRAMS
    spec = triton_weight_grad.make_spec(num_rows=8192, num_experts=48, n=4096, k=7168, compute_capability=90,
                                        out_dtype=np.float32, tile=SMALL)
    assert spec.num_programs == triton_weight_grad.DEFAULT_PROGRAMS  # a tile of one's own: one per SM


def test_two_programs_of_the_few_rows_tile_fit_an_sm():
    """The few-rows tile runs two programs per SM on SM90 and SM100: both blocks' shared memory
    within the SM's 228 KB (1 KB of it reserved per block), and registers for both (4 warps)."""
    for cc in (90, 100):
        assert tuning.NATIVE_WEIGHT_GRAD_PROGRAMS_PER_SM[cc] == (2, 1)
        kernel = crosscompile.compile_weight_grad(cc, n=7168, k=2048, rows=8192, experts=48)
        assert 2 * (kernel.shared_bytes + 1024) <= 228 * 1024, (cc, kernel.shared_bytes)
        warps = tuning.NATIVE_WEIGHT_GRAD_TILES[cc][0].num_warps
        assert 0 < 2 * warps * 32 * kernel.registers <= 65536, (cc, warps, kernel.registers)


@pytest.mark.parametrize("cc", sorted(MMA))
def test_the_kernel_compiles_to_the_chip_s_bf16_mma_and_tma_loads_without_spills(cc):
    """Both tiles of each capability (fewer and more than ``WEIGHT_GRAD_MANY_ROWS`` rows per
    expert) at Kimi K2's projections, 48 and 384 experts, bf16 and float32 out: the rows arrive
    by TMA (``cp.async.bulk.tensor``) through descriptors made on the device, no row is loaded
    per thread (no ``cp.async`` of 16 bytes, no ``ld.global`` of bf16 vectors), and nothing
    spills in the row loop. SM120's ptxas keeps one 8-byte stack slot it only ever stores zero to
    (``STL.64 [R1], RZ``, no load back); SM100's spills two registers (8 bytes) at its few-rows
    tile with float32 out, reloaded once per expert before the row loop: neither reloads between
    the loop's first and last MMA."""
    target, mma = MMA[cc]
    for n, k, rows, experts, out in ((4096, 7168, 32768, 48, "bfloat16"), (7168, 2048, 8192, 48, "float32"),
                                     (7168, 2048, 65536, 384, "bfloat16")):
        kernel = crosscompile.compile_weight_grad(cc, n=n, k=k, rows=rows, experts=experts, out_dtype=out,
                                                  with_sass=cc != 90)
        assert kernel.target == target and re.search(mma, kernel.ptx), (n, k, rows)
        assert re.search(r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global", kernel.ptx), (cc, n, k)
        assert re.search(r"tensormap\.replace|tensormap\.cp_fenceproxy", kernel.ptx), (cc, n, k)
        assert not re.search(r"cp\.async\.c[ag]\.shared\.global", kernel.ptx), (cc, n, k)
        assert 0 < kernel.shared_bytes <= SHARED_MEMORY_BYTES[cc], (n, k, rows)
        if cc == 90:
            assert kernel.spill_bytes == 0, (n, k, rows)
        else:
            sass = kernel.sass.splitlines()
            at = [i for i, line in enumerate(sass) if re.search(r"\b(UTCHMMA|HMMA)\b", line)]
            assert kernel.spill_bytes <= 8 and at, (cc, n, k, rows)
            assert not any(re.search(r"\bLDL\b", line) for line in sass[at[0]:at[-1]]), (cc, n, k, rows)


def test_sm90_pipelines_the_row_loads_around_the_asynchronous_mma():
    """The table tile's row loop on SM90: one buffer per stage for each operand, filled by TMA
    copies that complete on mbarriers, and the MMA issued asynchronously."""
    spec = triton_weight_grad.make_spec(num_rows=32768, num_experts=48, n=4096, k=7168, compute_capability=90,
                                        out_dtype="bfloat16")
    kernel = crosscompile.compile_weight_grad(90, n=4096, k=7168, rows=32768, experts=48)
    stages = spec.config.num_stages
    assert re.findall(r"local_alloc : \(\) -> !ttg\.memdesc<(\d+)x64x(\d+)xbf16", kernel.ttgir) == [
        (str(stages), "128"), (str(stages), "256")]
    assert "ttng.async_tma_copy_global_to_local" in kernel.ttgir and "ttng.wait_barrier" in kernel.ttgir
    assert re.search(r"ttng\.warp_group_dot .*isAsync = true", kernel.ttgir)


def test_descriptors_are_made_once_per_expert_and_the_store_is_inside_the_pipelined_loop():
    """Two loops: the experts, then a program's tiles of the expert and their row steps as one.
    The two descriptors are made between them, once per expert a program visits (made per tile
    they cost 6-8% of the kernel on an H100); the rows' TMA loads and the store, under the
    last-step ``if``, are inside the second, so the next tile's loads can be in flight while a
    tile is stored."""
    for cc in sorted(MMA):
        ttgir = crosscompile.compile_weight_grad(cc, n=4096, k=7168, rows=32768, experts=48).ttgir
        loops = [m.start() for m in re.finditer(r"scf\.for ", ttgir)]
        creates = [m.start() for m in re.finditer(r"ttng\.tensormap_create ", ttgir)]
        loads = [m.start() for m in re.finditer(r"ttng\.async_tma_copy_global_to_local|tt\.descriptor_load", ttgir)]
        stores = [m.start() for m in re.finditer(r"tt\.store ", ttgir)]
        guards = [m.start() for m in re.finditer(r"scf\.if ", ttgir)]
        assert len(loops) == 2 and len(creates) == 2, (cc, len(loops), len(creates))
        assert loops[0] < creates[0] < creates[1] < loops[1], cc
        assert any(at > loops[1] for at in loads), cc  # the first stages load before it (the prologue)
        assert stores and all(at > loops[1] for at in stores), cc
        assert any(loops[1] < at < stores[0] for at in guards), cc


def test_offsets_past_int32_use_64_bit_bases():
    """The expert's output offset is 64-bit; rows are TMA coordinates (32-bit, and the largest
    published shapes have ~2**19), and a tile's offsets stay 32-bit."""
    kernel = crosscompile.compile_weight_grad(90, n=7168, k=2048, rows=65536, experts=384)
    assert len(re.findall(r"arith\.extsi %\S+ : i32 to i64", kernel.ttgir)) >= 1
    assert 384 * 7168 * 2048 > 2**31  # what the 64-bit base is for
    assert 8 * 65536 < 2**31 and 128 * 7168 + 256 < 2**31  # rows 8 devices send one (EP); a tile's offsets


def test_bad_input_gets_one_line_naming_the_argument():
    x, dy, sizes = jnp.ones((10, 128), jnp.bfloat16), jnp.ones((10, 64), jnp.bfloat16), jnp.asarray([4, 6], jnp.int32)
    cases = [
        (dict(x_mk=x.astype(jnp.float32)), r"^x_mk: float32\[10, 128\], expected bfloat16 \[M, C\] with C a positive"),
        (dict(dy_mn=jnp.ones((9, 64), jnp.bfloat16)), r"^dy_mn: 9 rows, expected M=10 \(x_mk\)$"),
        (dict(dy_mn=jnp.ones((10, 24), jnp.bfloat16)), r"^dy_mn: bfloat16\[10, 24\], expected bfloat16 \[M, C\]"),
        (dict(group_sizes_e=sizes.astype(jnp.float32)), r"^group_sizes_e: float32\[2\], expected int32 \[E\], E >= 1$"),
        (dict(out_dtype=jnp.float16), r"^out_dtype: float16, expected float32 or bfloat16$"),
        (dict(compute_capability=75), r"^compute_capability: 75"),
        (dict(compute_capability=80), r"^compute_capability: 80, expected one of \[90, 100, 120\] \(the kernel loads"),
        (dict(out=jnp.zeros((2, 64, 64), jnp.float32)),
         r"^out: float32\[2, 64, 64\], expected float32 \[2, 64, 128\]$"),
        (dict(num_programs=0), r"^num_programs: 0, expected a positive int"),
        (dict(interpret=True), r"^interpret: True, expected False"),
    ]
    for change, message in cases:
        args = dict(x_mk=x, dy_mn=dy, group_sizes_e=sizes, compute_capability=90) | change
        with pytest.raises(ValueError, match=message):
            triton_weight_grad.weight_grad(**args)


def test_the_launch_passes_a_global_scratch_and_checks_its_operands():
    """The table kernel keeps its two descriptors in Triton's global scratch (128 bytes each, per
    program), which ``triton_launch.call`` allocates (jax-triton passes a null pointer there);
    a launch given the wrong number of operands says so."""
    spec = triton_weight_grad.make_spec(num_rows=32768, num_experts=48, n=4096, k=7168, compute_capability=90,
                                        out_dtype="bfloat16", num_programs=132)
    assert triton_launch.compile_launch(spec.launch()).metadata.global_scratch_size == 256
    assert triton_launch.scratch_bytes(spec.launch()) == 256 * 132
    x = jnp.ones((8, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"^operands: 2, expected 4 \(the kernel's pointer arguments before its output\)$"):
        triton_launch.call(spec.launch(), x, x, out_shape=jax.ShapeDtypeStruct((1, 1), jnp.bfloat16))
