"""The native (Triton-language) bf16 weight gradient (``triton_weight_grad``) without a GPU: the
kernel cross-compiled for each capability (the chip's bf16 MMA, its rows loaded by TMA and
nothing else loaded per element, its shared memory, no spills), the persistent grid, and its
argument checks. The kernel itself runs against float64 in
``tests/interpreter/test_weight_grad_kernel.py`` and on a GPU in
``tests/pallas_kernels/test_kimi_size_gpu.py``."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("triton")
from pallas_kernels import crosscompile as compile_any  # noqa: E402
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


def _probe():
    """``benchmarks/weight_grad_probe.py``, the candidates queued for a GPU."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    return importlib.import_module("weight_grad_probe")


def test_the_grid_is_one_program_per_sm_at_most_one_per_tile():
    spec = triton_weight_grad.make_spec(num_rows=10, num_experts=2, n=32, k=64, compute_capability=90,
                                        out_dtype=np.float32, tile=SMALL, num_programs=1000)
    assert spec.num_programs == spec.num_tiles == 2
    spec = triton_weight_grad.make_spec(num_rows=32768, num_experts=48, n=4096, k=7168, compute_capability=90,
                                        out_dtype=np.float32)
    assert spec.num_programs == triton_weight_grad.DEFAULT_PROGRAMS
    assert spec.config == tuning.NATIVE_WEIGHT_GRAD_TILES[90][1]


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


def test_descriptors_are_made_once_per_expert_not_per_tile():
    """A program walks the experts (outer loop), then its tiles of each (middle), then the tile's
    row steps (inner): the two descriptors are made between the first loop and the second, once
    per expert it visits; made per tile they cost 6-8% of the kernel on an H100."""
    ttgir = crosscompile.compile_weight_grad(90, n=4096, k=7168, rows=32768, experts=48).ttgir
    loops = [m.start() for m in re.finditer(r"scf\.for ", ttgir)]
    creates = [m.start() for m in re.finditer(r"ttng\.tensormap_create ", ttgir)]
    assert len(loops) >= 3 and len(creates) == 2, (len(loops), len(creates))
    assert loops[0] < creates[0] < creates[1] < loops[1]


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


@pytest.mark.parametrize("cc", sorted(MMA))
def test_the_flat_probe_candidate_stores_inside_its_pipelined_loop(cc):
    """``benchmarks/weight_grad_probe.py``'s ``flat`` candidate (queued for a GPU): two loops (the
    experts, then a program's tiles and row steps as one), the chip's MMA on TMA-loaded rows inside
    the second, and the store under its last-step ``if`` inside it too, so the next tile's loads
    can be in flight during it; within the shared memory, no spills (SM120: the one zero slot)."""
    probe = _probe()
    target, mma = MMA[cc]
    spec = triton_weight_grad.make_spec(num_rows=32768, num_experts=48, n=4096, k=7168, compute_capability=cc,
                                        out_dtype="bfloat16")
    kernel = compile_any.compile_jit(probe._flat_kernel, signature=triton_weight_grad.signature(spec),
                                       constexprs={**spec.constexprs(), "TMA_STORE": False}, capability=cc,
                                       num_warps=spec.config.num_warps, num_stages=spec.config.num_stages,
                                       name="flat_weight_grad")
    loops = [m.start() for m in re.finditer(r"scf\.for ", kernel.ttgir)]
    loads = [m.start() for m in re.finditer(r"ttng\.async_tma_copy_global_to_local", kernel.ttgir)]
    stores = [m.start() for m in re.finditer(r"tt\.store ", kernel.ttgir)]
    guards = [m.start() for m in re.finditer(r"scf\.if ", kernel.ttgir)]
    assert len(loops) == 2 and kernel.target == target and re.search(mma, kernel.ptx)
    assert any(at > loops[1] for at in loads) and stores and all(at > loops[1] for at in stores)
    assert any(loops[1] < at < stores[0] for at in guards)
    assert 0 < kernel.shared_bytes <= SHARED_MEMORY_BYTES[cc]
    assert kernel.spill_bytes <= (8 if cc == 120 else 0)


def test_the_flat_probe_candidate_s_tma_store_fits_the_shared_memory():
    """``flat`` storing through TMA on SM90: one bulk store from shared memory per tile (no
    per-thread ``st.global``) and, at the probe's tiles, the staging buffer beside the row stages
    within the 227 KB a block may have (at 4 stages of 64 rows it would need 256 KB)."""
    probe = _probe()
    for name, (bm, bn, bk, warps, stages, _) in probe.CANDIDATES:
        if not name.endswith("TMA store"):
            continue
        tile = TileConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages, group_t=1)
        spec = triton_weight_grad.make_spec(num_rows=32768, num_experts=48, n=4096, k=7168, compute_capability=90,
                                            out_dtype="bfloat16", tile=tile)
        compiled = triton_launch.compile_launch(probe.flat_launch(spec, tma_store=True))
        ptx = compiled.asm["ptx"]
        assert re.search(r"cp\.async\.bulk\.tensor\.2d\.global\.shared", ptx) and "st.global" not in ptx, tile
        assert compiled.metadata.shared <= SHARED_MEMORY_BYTES[90], (tile, compiled.metadata.shared)
