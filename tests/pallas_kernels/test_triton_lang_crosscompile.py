"""The Triton-language NVFP4 kernels (``triton_lang.py``) cross-compiled for every capability, no GPU.

This is the standing proof that the SM120 path exists and is the native one: every tile entry
compiles for ``sm_120a`` to the block-scaled FP4 ``mma.sync ... kind::mxf4nvf4`` and for
``sm_100a`` to ``tcgen05.mma ... kind::mxf4nvf4``, within the chip's shared memory and without
register spills; the W4A16 branch compiles to ``wgmma`` on SM90 and ``mma.sync`` bf16 on SM80/89.
Nothing here ran on SM100/SM120 hardware. Also: the input checks, and the offsets' widths.
"""

from __future__ import annotations

import os
import re

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("triton")
import ptx_emulator  # noqa: E402
from moe_jax.nvfp4 import NVFP4Tensor  # noqa: E402
from pallas_kernels.grouped_matmul import crosscompile  # noqa: E402
from pallas_kernels.grouped_matmul import triton_lang  # noqa: E402
from pallas_kernels.grouped_matmul.tuning import SHARED_MEMORY_BYTES, Op  # noqa: E402

EXPECTED = {
    120: ("sm_120a", r"mma\.sync\.aligned\.m16n8k64\.row\.col\.kind::mxf4nvf4\.block_scale\.scale_vec::4X"),
    100: ("sm_100a", r"tcgen05\.mma\.cta_group::1\.kind::mxf4nvf4\.block_scale\.scale_vec::4X"),
    90: ("sm_90a", r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.bf16\.bf16"),
    89: ("sm_89", r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32"),
    80: ("sm_80", r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32"),
}
CASES = [(cc, key) for cc in EXPECTED for key in crosscompile.native_keys(cc)]


@pytest.mark.parametrize("cc,key", CASES, ids=[f"sm{cc}-{v.value}-{op.value}" for cc, (v, op) in CASES])
def test_every_native_tile_compiles_to_the_native_instruction(cc, key):
    record, kernel = crosscompile.compile_native(cc, key, experts=384)
    target, mma = EXPECTED[cc]
    assert record.target == target
    assert record.mma and all(re.match(mma, m) for m in record.mma), record.mma
    assert re.search(mma, kernel.ptx)
    if cc >= 100:  # the FP4 operands are never widened to bf16 MMA
        assert "bf16.bf16" not in kernel.ptx
        assert triton_lang.mode_for(cc) is triton_lang.Mode.W4A4
    assert record.spill_bytes == 0, f"{record.spill_bytes} bytes of register spills"
    assert 0 < record.shared_bytes <= record.shared_limit


@pytest.mark.parametrize("op", [Op.GATE_UP_SWIGLU, Op.MATMUL], ids=lambda op: op.value)
def test_one_group_gets_the_one_group_tiles_which_compile_to_wgmma(op):
    """A Kimi K2 shared expert (one group) on SM90 takes ``ONE_GROUP_TILES``' tile for its row
    count where the op has one there (each range up to its last row), else what it would take
    without them; so do more groups and unmeasured capabilities."""
    from pallas_kernels import crosscompile as compiler  # noqa: PLC0415
    from pallas_kernels.grouped_matmul import tuning  # noqa: PLC0415

    h, f = crosscompile.HIDDEN, crosscompile.INTERMEDIATE
    k, n_out = (h, f) if op is Op.GATE_UP_SWIGLU else (f, h)

    def spec(rows, experts, cc):
        return triton_lang.make_spec(op, triton_lang.Mode.W4A16, num_rows=rows, num_experts=experts, k=k, n_out=n_out,
                                scale_groups=1, compute_capability=cc)

    def without_one_group_tiles(rows, experts, cc):
        if rows >= triton_lang.MANY_ROWS_PER_EXPERT * experts and op in triton_lang.MANY_ROWS_TILES.get(cc, {}):
            return triton_lang.MANY_ROWS_TILES[cc][op]
        variant = tuning.choose_variant(num_rows=rows, num_experts=experts, compute_capability=cc)
        return triton_lang.NATIVE_TILES[cc][(variant, op)]

    def blocks(tile):
        return tile.block_m, tile.block_n, tile.block_k, tile.num_warps, tile.extra_m, tile.tail_m

    low = 1
    for max_rows, tiles in triton_lang.ONE_GROUP_TILES[90]:
        for rows in (low, max_rows):
            expected = tiles.get(op) or without_one_group_tiles(rows, 1, 90)
            assert blocks(spec(rows, 1, 90).tile) == blocks(expected), (rows, op)
        low = max_rows + 1
    for rows, experts, cc in ((low, 1, 90), (32, 2, 90), (32, 1, 80), (256, 1, 80)):
        assert blocks(spec(rows, experts, cc).tile) == blocks(without_one_group_tiles(rows, experts, cc))
    for max_rows, tiles in triton_lang.ONE_GROUP_TILES[90]:
        if op not in tiles:
            continue
        one = spec(max_rows, 1, 90)
        kernel = compiler.compile_jit(triton_lang.kernel_function(), signature=triton_lang.signature(one),
                                      constexprs=one.constexprs(), capability=90, num_warps=one.tile.num_warps,
                                      num_stages=one.tile.num_stages, name=f"native_one_group_{op.value}")
        assert re.search(EXPECTED[90][1], kernel.ptx)
        assert kernel.spill_bytes == 0 and 0 < kernel.shared_bytes <= tuning.SHARED_MEMORY_BYTES[90]


@pytest.mark.parametrize("op", [Op.GATE_UP_SWIGLU, Op.MATMUL], ids=lambda op: op.value)
def test_many_rows_per_expert_get_the_many_rows_tile_which_compiles_without_spills(op):
    """From ``MANY_ROWS_PER_EXPERT`` rows per expert on SM90 an op in ``MANY_ROWS_TILES`` takes
    that tile (tiles with extra rows and a tail path: three loops, one kernel); below, and on
    other capabilities, the table's prefill tile."""
    from pallas_kernels import crosscompile as compiler  # noqa: PLC0415
    from pallas_kernels.grouped_matmul import tuning  # noqa: PLC0415

    h, f = crosscompile.HIDDEN, crosscompile.INTERMEDIATE
    k, n_out = (h, f) if op is Op.GATE_UP_SWIGLU else (f, h)

    def tile(rows, cc):
        return triton_lang.make_spec(op, triton_lang.Mode.W4A16, num_rows=rows, num_experts=384, k=k, n_out=n_out,
                                scale_groups=1, compute_capability=cc).tile

    many = triton_lang.MANY_ROWS_PER_EXPERT * 384
    prefill = triton_lang.NATIVE_TILES[90][(tuning.Variant.PREFILL, op)]
    expected = triton_lang.MANY_ROWS_TILES[90].get(op, prefill)
    assert tile(many, 90).block_m == expected.block_m and tile(many, 90).extra_m == expected.extra_m
    assert tile(many - 1, 90).extra_m == prefill.extra_m and tile(many - 1, 90).block_n == prefill.block_n
    assert tile(many, 80).extra_m == triton_lang.NATIVE_TILES[80][(tuning.Variant.PREFILL, op)].extra_m == 0
    spec = triton_lang.make_spec(op, triton_lang.Mode.W4A16, num_rows=many, num_experts=384, k=k, n_out=n_out, scale_groups=1,
                            compute_capability=90)
    kernel = compiler.compile_jit(triton_lang.kernel_function(), signature=triton_lang.signature(spec),
                                  constexprs=spec.constexprs(), capability=90, num_warps=spec.tile.num_warps,
                                  num_stages=spec.tile.num_stages, name=f"native_many_rows_{op.value}")
    assert len(re.findall(EXPECTED[90][1], kernel.ptx)) >= 2
    assert kernel.spill_bytes == 0 and 0 < kernel.shared_bytes <= tuning.SHARED_MEMORY_BYTES[90]


def test_w4a16_down_from_its_wide_rows_per_expert_gets_the_wide_tile_which_compiles_without_spills():
    """From ``WIDE_ROWS_PER_EXPERT`` rows per expert on SM90 W4A16's down projection takes
    ``WIDE_TILES``' 256-row tile (one group too), below it the many-rows rule's; the fused gate/up
    and W4A8 keep their tiles. At Kimi K2's down projection over 384 experts it compiles to
    m64n256k16 MMAs, without spills, within the shared memory."""
    from pallas_kernels import crosscompile as compiler  # noqa: PLC0415
    from pallas_kernels.grouped_matmul import tuning  # noqa: PLC0415

    h, f = crosscompile.HIDDEN, crosscompile.INTERMEDIATE
    wide = triton_lang.WIDE_TILES[90][Op.MATMUL]

    def spec(rows, experts=384, mode=triton_lang.Mode.W4A16, op=Op.MATMUL):
        k, n_out = (h, f) if op is Op.GATE_UP_SWIGLU else (f, h)
        return triton_lang.make_spec(op, mode, num_rows=rows, num_experts=experts, k=k, n_out=n_out, scale_groups=1,
                                     compute_capability=90)

    rows = triton_lang.WIDE_ROWS_PER_EXPERT * 384
    assert spec(rows).tile.block_m == wide.block_m == 256 and spec(rows).tile.extra_m == 0
    assert spec(rows - 1).tile.block_m == 128 and spec(rows - 1).tile.extra_m == 64
    assert spec(triton_lang.WIDE_ROWS_PER_EXPERT, experts=1).tile.block_m == 256
    assert spec(rows, mode=triton_lang.Mode.W4A8).tile.block_m == 128
    assert spec(rows, op=Op.GATE_UP_SWIGLU).tile.block_m < 256
    one = spec(rows)
    kernel = compiler.compile_jit(triton_lang.kernel_function(), signature=triton_lang.signature(one),
                                  constexprs=one.constexprs(), capability=90, num_warps=one.tile.num_warps,
                                  num_stages=one.tile.num_stages, name="native_wide_matmul")
    assert set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16", kernel.ptx)) == {
        "wgmma.mma_async.sync.aligned.m64n256k16"}
    assert kernel.spill_bytes == 0 and 0 < kernel.shared_bytes <= tuning.SHARED_MEMORY_BYTES[90]


@pytest.mark.parametrize("rows", [256, 8192 * 8], ids=["decode", "prefill"])
def test_rows_read_by_index_compile_for_sm90_like_rows_in_order(rows):
    """The gate/up kernel that reads its rows by index (``gather_rows``, Kimi K2's shape at 384
    experts) compiles for SM90 with the same MMAs, no spills, the same shared memory and at most
    a few registers more than the one that reads rows in expert order."""
    from pallas_kernels import crosscompile as compiler  # noqa: PLC0415

    h, f = crosscompile.HIDDEN, crosscompile.INTERMEDIATE
    compiled = {}
    for gather_rows in (0, rows // 8):
        spec = triton_lang.make_spec(Op.GATE_UP_SWIGLU, triton_lang.Mode.W4A16, num_rows=rows, num_experts=384, k=h,
                                     n_out=f, scale_groups=1, compute_capability=90, gather_rows=gather_rows)
        assert spec.constexprs()["GATHER_ROWS"] == gather_rows
        compiled[gather_rows] = compiler.compile_jit(
            triton_lang.kernel_function(), signature=triton_lang.signature(spec), constexprs=spec.constexprs(),
            capability=90, num_warps=spec.tile.num_warps, num_stages=spec.tile.num_stages,
            name=f"native_gather_{gather_rows}")
    in_order, by_index = compiled[0], compiled[rows // 8]
    assert by_index.spill_bytes == 0 and by_index.shared_bytes == in_order.shared_bytes
    assert len(re.findall(EXPECTED[90][1], by_index.ptx)) == len(re.findall(EXPECTED[90][1], in_order.ptx)) > 0
    assert by_index.registers <= in_order.registers + 16, (by_index.registers, in_order.registers)


@pytest.mark.parametrize("mode", ["w4a16", "bf16"])
def test_the_plain_matmul_reading_rows_by_index_compiles_for_sm90_like_rows_in_order(mode):
    """The gate/up product as the forward under differentiation takes it (``Op.MATMUL`` reading a
    layer's tokens by index), at the training shape (48 experts x 32768 rows: the bf16 many-rows
    tile): the same MMAs and shared memory as in expert order, no spills."""
    from pallas_kernels import crosscompile as compiler  # noqa: PLC0415

    h, f = crosscompile.HIDDEN, crosscompile.INTERMEDIATE
    compiled = {}
    for gather_rows in (0, 32768 // 8):
        spec = triton_lang.make_spec(Op.MATMUL, triton_lang.Mode(mode), num_rows=32768, num_experts=48, k=h,
                                     n_out=2 * f, scale_groups=1, compute_capability=90, gather_rows=gather_rows)
        assert spec.constexprs()["GATHER_ROWS"] == gather_rows
        compiled[gather_rows] = compiler.compile_jit(
            triton_lang.kernel_function(), signature=triton_lang.signature(spec), constexprs=spec.constexprs(),
            capability=90, num_warps=spec.tile.num_warps, num_stages=spec.tile.num_stages,
            name=f"native_matmul_{mode}_gather_{gather_rows}")
    in_order, by_index = compiled[0], compiled[32768 // 8]
    assert by_index.spill_bytes == 0 and by_index.shared_bytes == in_order.shared_bytes
    assert len(re.findall(EXPECTED[90][1], by_index.ptx)) == len(re.findall(EXPECTED[90][1], in_order.ptx)) > 0


def test_offsets_past_int32_use_64_bit_bases():
    """Per expert and per row tile the kernel adds 64-bit bases; what stays 32-bit (offsets inside
    one expert's matrix and one row tile) fits at the largest published shapes."""
    _, kernel = crosscompile.compile_native(120, crosscompile.native_keys(120)[0], experts=384)
    assert re.search(r"arith\.extsi %\S+ : i32 to i64", kernel.ttgir)
    assert re.search(r"arith\.muli %\S+, %\S+ : i64", kernel.ttgir)
    # Kimi K2 / DeepSeek-V3 projections (N_W, K), and 2x Kimi's hidden size for headroom.
    for n_w, k in ((4096, 7168), (7168, 2048), (2 * 2 * 2048, 2 * 7168)):
        tile = max((t for table in triton_lang.NATIVE_TILES.values() for t in table.values()), key=lambda t: t.block_m)
        assert n_w * (k // 2) < 2**31 and tile.block_m * k < 2**31 and tile.block_m * n_w < 2**31
    # ... while the whole 384-expert tensor does not (the reason for the 64-bit bases).
    assert 384 * 7168 * (2048 // 2) > 2**31


def test_compiles_after_jax_triton_emptied_the_triton_cache_dir(monkeypatch):
    """Importing jax_triton sets TRITON_CACHE_DIR to "" (a GPU test process has imported it by
    the time these tests run), which left triton.compile without a cache directory."""
    monkeypatch.setenv("TRITON_CACHE_DIR", "")
    record, kernel = crosscompile.compile_native(90, crosscompile.native_keys(90)[0], experts=8)
    assert record.target == "sm_90a" and record.mma and kernel.ptx, record
    assert os.environ["TRITON_CACHE_DIR"] == ""  # the process's setting is left as it was


def _nvfp4(e=4, n=64, k=128):
    return NVFP4Tensor(packed=jnp.zeros((e, n, k // 2), jnp.uint8), scales=jnp.ones((e, n, k // 16), jnp.float8_e4m3fn),
                       global_scale=jnp.ones((e,), jnp.float32))


def test_bad_input_gets_one_line_naming_the_argument():
    w, sizes, x = _nvfp4(), jnp.asarray([1, 2, 3, 4], jnp.int32), jnp.ones((10, 128), jnp.bfloat16)
    rows = triton_lang.NVFP4Rows(packed=jnp.zeros((10, 64), jnp.uint8), scales=jnp.ones((10, 8), jnp.float8_e4m3fn),
                            global_scale=jnp.ones((10,), jnp.float32))
    cases = [
        (dict(x=x.astype(jnp.float32)), r"^x: float32\[10, 128\], expected bfloat16 \[M, K\] \(W4A16\)$"),
        (dict(w=np.zeros((4, 64, 128))), r"^w: ndarray, expected an NVFP4 tensor"),
        (dict(w=_nvfp4(e=3)),
         r"^w\.packed: uint8\[3, 64, 64\], expected uint8 \[4, 64, 64\] for E=4 \(group_sizes_e\), K=128 \(x\)$"),
        (dict(cc=90, mode=triton_lang.Mode.W4A4), r"^mode: W4A4 on compute capability 90, expected >= 100"),
        (dict(cc=75), r"^compute_capability: 75 has no native tile configurations"),
        (dict(x=jnp.ones((10, 96), jnp.bfloat16), w=_nvfp4(k=96)), r"^x: K=96, expected a positive multiple of 64$"),
        (dict(sizes=sizes.astype(jnp.float32)), r"^group_sizes_e: float32\[4\], expected int32 \[E\], E >= 1$"),
        (dict(out=jnp.zeros((9, 64), jnp.bfloat16)), r"^out: bfloat16\[9, 64\], expected bfloat16 \[10, 64\]$"),
        (dict(mode=triton_lang.Mode.W4A4, cc=120), r"^x: ArrayImpl, expected NVFP4Rows"),
        (dict(out_k_order=96), r"^out_k_order: 96, expected 0 or a power of two >= 64 dividing the output's 64 "),
        (dict(x_k_order=64), r"^x_k_order: 64, expected this launch's block_k 128 \(k_order\(\)\)$"),
        (dict(cc=120, x=rows, out_k_order=64), r"^out_k_order=64, x_k_order=0: expected 0 for w4a4"),
    ]
    for change, message in cases:
        args = dict(x=x, w=w, sizes=sizes, cc=90, mode=None, out=None, out_k_order=0, x_k_order=0) | change
        with pytest.raises(ValueError, match=message):
            triton_lang.run(Op.MATMUL, args["x"], args["w"], args["sizes"], compute_capability=args["cc"],
                       mode=args["mode"], out=args["out"], out_k_order=args["out_k_order"],
                       x_k_order=args["x_k_order"])


def test_input_grad_bad_input_gets_one_line_naming_the_argument():
    w, sizes, dy = _nvfp4(), jnp.asarray([1, 2, 3, 4], jnp.int32), jnp.ones((10, 64), jnp.bfloat16)
    halves = NVFP4Tensor(packed=w.packed, scales=w.scales, global_scale=jnp.ones((4, 2), jnp.float32))
    cases = [
        (dict(dy=dy.astype(jnp.float32)), r"^dy_mn: float32\[10, 64\], expected bfloat16 \[M, N\] \(W4A16\)$"),
        (dict(dy=jnp.ones((10, 96), jnp.bfloat16)), r"^dy_mn: N=96, expected a positive multiple of 64$"),
        (dict(w=np.zeros((4, 64, 128))), r"^w: ndarray, expected an NVFP4 tensor"),
        (dict(w=_nvfp4(n=128)), r"^w\.packed: uint8\[4, 128, 64\], expected uint8 \[4, 64, 64\] for E=4"),
        (dict(w=halves), r"^w\.global_scale: float32\[4, 2\], expected float32 \[4\]; .*folded into dy_mn instead$"),
        (dict(sizes=sizes[:0]), r"^group_sizes_e: int32\[0\], expected int32 \[E\], E >= 1$"),
        (dict(cc=120), r"^compute_capability: 120 has no W4A16 input-gradient tiles; known: \[80, 89, 90\]"),
        (dict(out=jnp.zeros((10, 64), jnp.bfloat16)), r"^out: bfloat16\[10, 64\], expected bfloat16 \[10, 128\]$"),
    ]
    for change, message in cases:
        args = dict(dy=dy, w=w, sizes=sizes, cc=90, out=None) | change
        with pytest.raises(ValueError, match=message):
            triton_lang.input_grad(args["dy"], args["w"], args["sizes"], compute_capability=args["cc"], out=args["out"])


@pytest.mark.parametrize("cc", sorted(triton_lang.INPUT_GRAD_TILES))
def test_input_grad_tiles_compile_to_the_bf16_mma_without_spills(cc):
    """Both input-gradient tiles of each capability at Kimi K2's projections (fewer and more
    than INPUT_GRAD_MANY_ROWS rows per expert): the bf16 MMA of the chip, within its shared
    memory, no spills (the dequantized tile reaches the MMA through shared memory)."""
    for n, k in ((4096, 7168), (7168, 2048)):
        for rows in (48 * triton_lang.INPUT_GRAD_MANY_ROWS - 1, 48 * triton_lang.INPUT_GRAD_MANY_ROWS):
            kernel = crosscompile.compile_input_grad(cc, n=n, k=k, rows=rows, experts=48)
            assert kernel.target == EXPECTED[cc][0] and re.search(EXPECTED[cc][1], kernel.ptx), (n, k, rows)
            assert kernel.spill_bytes == 0 and kernel.shared_bytes <= SHARED_MEMORY_BYTES[cc], (n, k, rows)


def test_w4a4_activation_rows_are_checked_field_by_field():
    w, sizes = _nvfp4(), jnp.asarray([1, 2, 3, 4], jnp.int32)
    rows = triton_lang.NVFP4Rows(packed=jnp.zeros((10, 64), jnp.uint8), scales=jnp.ones((10, 8), jnp.float8_e4m3fn),
                            global_scale=jnp.ones((9,), jnp.float32))
    with pytest.raises(ValueError, match=r"^x\.global_scale: float32\[9\], expected float32 \[10\]$"):
        triton_lang.run(Op.MATMUL, rows, w, sizes, compute_capability=120)


@pytest.mark.parametrize("block_k", [64, 128, 256])
def test_w4a16_word_pairs_and_column_order(block_k):
    """The W4A16 asm block (``_WORD_TO_BF16_PTX``) evaluated instruction by instruction: asm
    output ``j`` of word ``w`` is element ``8w + _OUTPUT_NIBBLE[j]`` times the block scale times
    ``2**-7``, exactly, for every code at every position; the kernel's join/reshape/permute of
    the outputs puts element ``permute_k(arange)[k]`` in MMA column ``k``; and MMA thread column
    ``c`` (column bits 1-2) reads contiguous words (one vector load)."""
    rng = np.random.default_rng(block_k)
    codes = rng.integers(0, 16, size=(8, block_k))
    codes[0, :16] = np.arange(16)  # every code in the first two words
    codes[1, :16] = np.arange(16)[::-1]
    words = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8).view("<u4").astype(np.uint64)
    values = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    # Block scales as the kernel feeds them: E4M3 (positive, normal and subnormal) times 2**119, in bf16.
    scale = np.asarray(jnp.asarray(rng.uniform(2.0**-9, 448, words.shape), jnp.float8_e4m3fn).astype(jnp.float32),
                       np.float64)
    scale_bits = (np.asarray(jnp.asarray(scale * 2.0**119, jnp.bfloat16)).view(np.uint16)).astype(np.uint64)
    regs = ptx_emulator.run(triton_lang._WORD_TO_BF16_PTX.value.replace("$", "r"), {"r8": words, "r9": scale_bits})
    outputs = [regs[f"r{j}"].astype(np.uint16).view(jnp.bfloat16).astype(np.float64) / scale * 128 for j in range(8)]
    expected = np.where(codes & 8, -1.0, 1.0) * values[codes & 7]
    for j, nibble in enumerate(triton_lang._OUTPUT_NIBBLE):
        np.testing.assert_array_equal(outputs[j], expected[:, nibble::8])

    def join(a, b):
        return np.stack([a, b], axis=-1)

    o = outputs
    tile = join(join(join(o[0], o[1]), join(o[2], o[3])), join(join(o[4], o[5]), join(o[6], o[7])))
    tile = tile.reshape(8, 4, block_k // 32, 2, 2, 2).transpose(0, 2, 5, 4, 1, 3).reshape(8, block_k)
    perm = np.asarray(triton_lang.permute_k(jnp.arange(block_k)[None], block_k))[0]
    np.testing.assert_array_equal(tile, expected[:, perm])
    thread = (np.arange(block_k) >> 1) & 3
    np.testing.assert_array_equal(perm // 8 // (block_k // 32), thread)
    assert sorted(perm) == list(range(block_k))


BF16_CASES = [(Op.GATE_UP_SWIGLU, False), (Op.MATMUL, False), (Op.MATMUL, True)]
BF16_IDS = ["gate_up_swiglu", "matmul", "matmul_transposed_w"]


@pytest.mark.parametrize("rows,experts", [(65536, 384), (32768, 48)], ids=["kimi_prefill", "training"])
@pytest.mark.parametrize("op,transpose_w", BF16_CASES, ids=BF16_IDS)
def test_bf16_tiles_compile_to_wgmma_without_spills(op, transpose_w, rows, experts):
    """``Mode.BF16``'s SM90 tiles at Kimi K2's projections (the table's at 384 experts, the
    many-rows tiles at the training shape), the fused gate/up reading its rows by index as the
    layer calls it: ``wgmma`` for every row path, no spills, within the shared memory."""
    from pallas_kernels import crosscompile as compiler  # noqa: PLC0415

    h, f = crosscompile.HIDDEN, crosscompile.INTERMEDIATE
    k, n_out = (h, f) if op is Op.GATE_UP_SWIGLU else (f, h)
    spec = triton_lang.make_spec(op, triton_lang.Mode.BF16, num_rows=rows, num_experts=experts, k=k, n_out=n_out,
                                 scale_groups=0, compute_capability=90, trans_w=transpose_w,
                                 gather_rows=rows // 8 if op is Op.GATE_UP_SWIGLU else 0)
    many = rows >= triton_lang.BF16_MANY_ROWS_PER_EXPERT * experts
    assert spec.tile == (triton_lang.BF16_MANY_ROWS_TILES[90][op, transpose_w] if many else triton_lang.BF16_TILES[90][op])
    kernel = compiler.compile_jit(triton_lang.kernel_function(), signature=triton_lang.signature(spec),
                                  constexprs=spec.constexprs(), capability=90, num_warps=spec.tile.num_warps,
                                  num_stages=spec.tile.num_stages, name=f"native_bf16_{op.value}")
    mma = set(re.findall(EXPECTED[90][1], kernel.ptx))
    paths = {spec.tile.block_m, spec.tile.extra_m, spec.tile.tail_m} - {0}
    assert {f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16" for n in paths} <= mma, (mma, spec.tile)
    assert kernel.spill_bytes == 0 and 0 < kernel.shared_bytes <= SHARED_MEMORY_BYTES[90]


@pytest.mark.parametrize("op,scale_groups", [(Op.GATE_UP_SWIGLU, 2), (Op.MATMUL, 1)], ids=["gate_up_swiglu", "matmul"])
def test_the_copied_forwards_kernels_compile_to_wgmma_without_spills(op, scale_groups):
    """The bf16 kernels of ``dequantized_forward`` (exact copies of NVFP4 weights, the global
    scales on the accumulators: gate's and up's own) at Kimi K2's projections over 24 experts
    (65536 rows, where the copies are taken), the gate/up reading its rows by index: the
    many-rows tiles' ``wgmma``, no spills, within the shared memory; the scales are read."""
    from pallas_kernels import crosscompile as compiler  # noqa: PLC0415
    from pallas_kernels.grouped_matmul import tuning  # noqa: PLC0415

    h, f = crosscompile.HIDDEN, crosscompile.INTERMEDIATE
    k, n_out = (h, f) if op is Op.GATE_UP_SWIGLU else (f, h)
    rows, experts = 65536, 24
    assert tuning.dequantize_for_forward(num_rows=rows, num_experts=experts, hidden=h, intermediate=f,
                                         compute_capability=90)
    spec = triton_lang.make_spec(op, triton_lang.Mode.BF16, num_rows=rows, num_experts=experts, k=k, n_out=n_out,
                                 scale_groups=scale_groups, compute_capability=90,
                                 gather_rows=rows // 8 if op is Op.GATE_UP_SWIGLU else 0)
    assert spec.tile == triton_lang.BF16_MANY_ROWS_TILES[90][op, False]
    kernel = compiler.compile_jit(triton_lang.kernel_function(), signature=triton_lang.signature(spec),
                                  constexprs=spec.constexprs(), capability=90, num_warps=spec.tile.num_warps,
                                  num_stages=spec.tile.num_stages, name=f"native_bf16_scaled_{op.value}")
    assert set(re.findall(EXPECTED[90][1], kernel.ptx)) == {"wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16"}
    assert kernel.spill_bytes == 0 and 0 < kernel.shared_bytes <= SHARED_MEMORY_BYTES[90]
    unscaled = compiler.compile_jit(triton_lang.kernel_function(),
                                    signature=triton_lang.signature(spec),
                                    constexprs=spec.constexprs() | {"G": 0}, capability=90,
                                    num_warps=spec.tile.num_warps, num_stages=spec.tile.num_stages,
                                    name=f"native_bf16_{op.value}")
    # The scales' loads: one more global load than the kernel without them.
    loads = [len(re.findall(r"ld\.global", k.ptx)) for k in (kernel, unscaled)]
    assert loads[0] > loads[1], loads


def test_scale_groups_are_checked_per_mode_and_op():
    def spec(mode, op, groups):
        return triton_lang.make_spec(op, mode, num_rows=64, num_experts=4, k=128, n_out=64, scale_groups=groups,
                                     compute_capability=90)

    assert spec(triton_lang.Mode.BF16, Op.MATMUL, 0).scale_groups == 0
    assert spec(triton_lang.Mode.BF16, Op.GATE_UP_SWIGLU, 2).scale_groups == 2
    for mode, op, groups in ((triton_lang.Mode.W4A16, Op.MATMUL, 0), (triton_lang.Mode.BF16, Op.MATMUL, 2),
                             (triton_lang.Mode.W4A16, Op.GATE_UP_SWIGLU, 3)):
        with pytest.raises(ValueError, match=rf"^scale_groups: {groups}, expected one of "):
            spec(mode, op, groups)


@pytest.mark.parametrize("op,transpose_w", BF16_CASES, ids=BF16_IDS)
def test_bf16_many_rows_tiles_from_their_threshold_on_sm90_only(op, transpose_w):
    """From ``BF16_MANY_ROWS_PER_EXPERT`` rows per expert on average the many-rows tile; a row
    fewer, and on capabilities without one, the table's; an explicit tile always wins."""
    h, f = crosscompile.HIDDEN, crosscompile.INTERMEDIATE
    k, n_out = (h, f) if op is Op.GATE_UP_SWIGLU else (f, h)
    threshold = triton_lang.BF16_MANY_ROWS_PER_EXPERT * 48

    def tile(rows, cc=90, **kwargs):
        return triton_lang.make_spec(op, triton_lang.Mode.BF16, num_rows=rows, num_experts=48, k=k, n_out=n_out,
                                     scale_groups=0, compute_capability=cc, trans_w=transpose_w, **kwargs).tile

    many = triton_lang.BF16_MANY_ROWS_TILES[90][op, transpose_w]
    assert many.block_m == 256 and not many.extra_m
    assert tile(threshold) == many
    assert tile(threshold - 1) == triton_lang.BF16_TILES[90][op]
    assert tile(threshold, tile=triton_lang.BF16_TILES[90][op]) == triton_lang.BF16_TILES[90][op]
    for cc in (80, 120):
        assert triton_lang.bf16_many_rows_tile(op, num_rows=threshold, num_experts=48, compute_capability=cc,
                                               transpose_w=transpose_w) is None


def test_bf16_bad_input_gets_one_line_naming_the_argument():
    sizes, x = jnp.asarray([1, 2, 3, 4], jnp.int32), jnp.ones((10, 128), jnp.bfloat16)
    w = jnp.ones((4, 64, 128), jnp.bfloat16)
    cases = [
        (dict(x=x.astype(jnp.float32)), r"^x_mk: float32\[10, 128\], expected bfloat16 \[M, K\]"),
        (dict(w=w.astype(jnp.float32)), r"^w: float32\[4, 64, 128\], expected bfloat16 \[E=4, N, K=128\]"),
        (dict(w=w[:3]), r"^w: bfloat16\[3, 64, 128\], expected bfloat16 \[E=4, N, K=128\]"),
        (dict(transpose_w=True), r"^w: bfloat16\[4, 64, 128\], expected bfloat16 \[E=4, K=128, N\]"),
        (dict(op=Op.GATE_UP_SWIGLU, transpose_w=True, w=jnp.ones((4, 128, 64), jnp.bfloat16)),
         r"^transpose_w: True, expected False for the fused gate/up"),
        (dict(cc=120), r"^compute_capability: 120 has no bf16 tile configurations; known: \[90\]$"),
        (dict(out=jnp.zeros((10, 32), jnp.bfloat16)), r"^out: bfloat16\[10, 32\], expected bfloat16 \[10, 64\]$"),
        (dict(scale=jnp.ones((4, 2), jnp.float32)),
         r"^global_scale: float32\[4, 2\], expected float32 of shape \(4,\) or \(4, 1\)$"),
        (dict(scale=jnp.ones((4,), jnp.bfloat16)), r"^global_scale: bfloat16\[4\], expected float32 of shape"),
        (dict(scale=jnp.ones((3,), jnp.float32), op=Op.GATE_UP_SWIGLU),
         r"^global_scale: float32\[3\], expected float32 of shape \(4,\) or \(4, 1\) or \(4, 2\)$"),
        (dict(scale=jnp.ones((4,), jnp.float32), transpose_w=True, w=jnp.ones((4, 128, 64), jnp.bfloat16)),
         r"^global_scale: float32\[4\], expected None with transpose_w"),
    ]
    for change, message in cases:
        args = dict(op=Op.MATMUL, x=x, w=w, sizes=sizes, cc=90, out=None, transpose_w=False, scale=None) | change
        with pytest.raises(ValueError, match=message):
            triton_lang.bf16_matmul(args["op"], args["x"], args["w"], args["sizes"], compute_capability=args["cc"],
                                    out=args["out"], transpose_w=args["transpose_w"], global_scale=args["scale"])
    with pytest.raises(ValueError, match=r"^mode: BF16, expected W4A4 or W4A16 \(bf16 weights go through bf16_matmul\)$"):
        triton_lang.run(Op.MATMUL, x, _nvfp4(), sizes, compute_capability=90, mode=triton_lang.Mode.BF16)


@pytest.mark.parametrize("op", [Op.GATE_UP_SWIGLU, Op.MATMUL], ids=lambda op: op.value)
def test_between_one_and_two_decode_tiles_per_expert_get_the_mid_tile_which_compiles_without_spills(op):
    """On SM90, above one decode row tile per expert (16 rows) and up to two (where
    ``choose_variant`` still says decode), an op takes ``MID_TILES``' 32-row tile; at the bounds'
    other sides the decode and the prefill tiles; other capabilities keep the decode tile."""
    from pallas_kernels import crosscompile as compiler  # noqa: PLC0415
    from pallas_kernels.grouped_matmul import tuning  # noqa: PLC0415

    h, f = crosscompile.HIDDEN, crosscompile.INTERMEDIATE
    k, n_out = (h, f) if op is Op.GATE_UP_SWIGLU else (f, h)

    def spec(rows, cc=90):
        return triton_lang.make_spec(op, triton_lang.Mode.W4A16, num_rows=rows, num_experts=384, k=k, n_out=n_out,
                                     scale_groups=1, compute_capability=cc)

    decode = triton_lang.NATIVE_TILES[90][(tuning.Variant.DECODE, op)]
    prefill = triton_lang.NATIVE_TILES[90][(tuning.Variant.PREFILL, op)]
    mid = triton_lang.MID_TILES[90][op]
    assert mid.block_m == 2 * decode.block_m
    assert spec(decode.block_m * 384).tile == decode
    assert spec(decode.block_m * 384 + 1).tile == mid and spec(2 * decode.block_m * 384).tile == mid
    assert spec(2 * decode.block_m * 384 + 1).tile.block_m == prefill.block_m
    assert spec(8192, cc=80).tile.block_m == triton_lang.NATIVE_TILES[80][(tuning.Variant.DECODE, op)].block_m
    one = spec(8192)
    kernel = compiler.compile_jit(triton_lang.kernel_function(), signature=triton_lang.signature(one),
                                  constexprs=one.constexprs(), capability=90, num_warps=one.tile.num_warps,
                                  num_stages=one.tile.num_stages, name=f"native_mid_{op.value}")
    assert re.search(EXPECTED[90][1], kernel.ptx)
    assert kernel.spill_bytes == 0 and 0 < kernel.shared_bytes <= tuning.SHARED_MEMORY_BYTES[90]


@pytest.mark.parametrize("op", [Op.GATE_UP_SWIGLU, Op.MATMUL], ids=lambda op: op.value)
@pytest.mark.parametrize("rows", [2048 * 8, 8192 * 8], ids=["2048 tokens", "8192 tokens"])
def test_w4a8_prefill_tiles_compile_to_fp8_wgmma_without_spills(op, rows):
    """``Mode.W4A8`` at Kimi K2's projections over 384 experts, rows read by index for the gate/up
    as the layer calls it: FP8 ``wgmma`` (``k32 .e4m3``, the weights from registers) for every row
    path, no bf16 MMA, no spills, within the shared memory."""
    from pallas_kernels import crosscompile as compiler  # noqa: PLC0415

    h, f = crosscompile.HIDDEN, crosscompile.INTERMEDIATE
    k, n_out = (h, f) if op is Op.GATE_UP_SWIGLU else (f, h)
    spec = triton_lang.make_spec(op, triton_lang.Mode.W4A8, num_rows=rows, num_experts=384, k=k, n_out=n_out,
                                 scale_groups=1, compute_capability=90,
                                 gather_rows=rows // 8 if op is Op.GATE_UP_SWIGLU else 0)
    w4a16 = triton_lang.make_spec(op, triton_lang.Mode.W4A16, num_rows=rows, num_experts=384, k=k, n_out=n_out,
                                  scale_groups=1, compute_capability=90).tile
    if rows >= triton_lang.MANY_ROWS_PER_EXPERT * 384 and op in triton_lang.W4A8_MANY_ROWS_TILES[90]:
        assert spec.tile == triton_lang.W4A8_MANY_ROWS_TILES[90][op] != w4a16
    else:
        assert spec.tile == w4a16
    assert triton_lang.signature(spec)["x_ptr"] == "*fp8e4nv"
    kernel = compiler.compile_jit(triton_lang.kernel_function(), signature=triton_lang.signature(spec),
                                  constexprs=spec.constexprs(), capability=90, num_warps=spec.tile.num_warps,
                                  num_stages=spec.tile.num_stages, name=f"native_w4a8_{op.value}")
    mma = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k32\.f32\.e4m3\.e4m3", kernel.ptx))
    paths = {spec.tile.block_m, spec.tile.extra_m, spec.tile.tail_m} - {0}
    assert {str(n) for n in paths} <= mma, (mma, spec.tile)
    assert "bf16.bf16" not in kernel.ptx
    assert kernel.spill_bytes == 0 and 0 < kernel.shared_bytes <= SHARED_MEMORY_BYTES[90]


def test_w4a8_bad_input_gets_one_line_naming_the_argument():
    sizes, w = jnp.asarray([1, 2, 3, 4], jnp.int32), _nvfp4()
    x = jnp.ones((10, 128), jnp.bfloat16)
    cases = [
        (dict(compute_capability=120), r"^mode: W4A8 on compute capability 120, expected one of \[90\]"),
        (dict(x=x.astype(jnp.float32)), r"^x: float32\[10, 128\], expected bfloat16 \[M, K\] \(W4A8\)$"),
        (dict(out_k_order=64), r"^out_k_order=64, x_k_order=0: expected 0 for w4a8"),
    ]
    for change, message in cases:
        args = dict(x=x, compute_capability=90) | change
        with pytest.raises(ValueError, match=message):
            triton_lang.run(Op.MATMUL, args.pop("x"), w, sizes, mode=triton_lang.Mode.W4A8, **args)


@pytest.mark.parametrize("block_k", [64, 128, 256])
def test_fp8_rows_are_quantized_per_row_and_permuted_as_the_tiles_read_them(rng, block_k):
    """``quantize_fp8_rows`` against float32 arithmetic written here: each row's amax maps to 448,
    a zero row stays zero with scale 1, a NaN spoils its own row only; ``permute_k_w4a8`` puts
    element ``8 w + 2 b + s`` (word ``w = c G + g``) at column ``32 g + 16 s + 4 c + b``."""
    import ml_dtypes  # noqa: PLC0415

    x = (rng.standard_normal((6, 512)) * np.exp(rng.uniform(-6, 6, (6, 1)))).astype(np.float32)
    x[2] = 0
    x[4, 9] = np.nan
    values, scale = triton_lang.quantize_fp8_rows(jnp.asarray(x, jnp.bfloat16), block_k)
    xb = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)
    amax = np.abs(xb).max(axis=1, keepdims=True)
    safe = np.where(amax == 0, np.float32(1), amax)
    want_scale = np.where(amax == 0, np.float32(1), amax * np.float32(1 / 448))[:, 0]
    want = (xb * np.where(amax == 0, np.float32(1), np.float32(448) / safe)).astype(ml_dtypes.float8_e4m3fn)
    g = block_k // 32
    columns = np.empty(512, np.int64)  # columns[position] = the element there
    for chunk in range(512 // block_k):
        for c in range(4):
            for gg in range(g):
                for b in range(4):
                    for s in range(2):
                        columns[chunk * block_k + 32 * gg + 16 * s + 4 * c + b] = chunk * block_k + 8 * (c * g + gg) + 2 * b + s
    got = np.asarray(values).astype(np.float32)
    ok = [0, 1, 2, 3, 5]
    np.testing.assert_array_equal(np.asarray(scale)[ok], want_scale[ok])
    np.testing.assert_array_equal(got[ok], want.astype(np.float32)[ok][:, columns])
    assert np.abs(got[ok]).max() == 448 and (got[2] == 0).all() and np.asarray(scale)[2] == 1
    assert np.isnan(got[4]).all() or not np.isfinite(np.asarray(scale)[4])


@pytest.mark.gpu_check  # the copies run on the default backend; the launches are recorded, not run
@pytest.mark.parametrize("cc,rows_less,copied", [(90, 0, True), (90, 1, False), (89, 0, False)],
                         ids=["sm90-enough_rows", "sm90-a_row_short", "sm89"])
def test_the_w4a16_forward_goes_through_bf16_copies_from_its_rows_per_expert(monkeypatch, rng, cc, rows_less, copied):
    """``W4A16_BACKEND.forward``: from ``tuning.DEQUANTIZED_FORWARD_ROWS_PER_EXPERT`` rows per expert
    on a capability that has it, both projections launch the bf16 kernels on the exact copies
    (``code * scale``: ``moe_jax.nvfp4.dequantize`` with the global scales set to 1) with the
    weights' global scales (gate's and up's own); else the W4A16 kernels (host logic: the launch
    recorded, not run)."""
    from test_triton_lang_gpu import _random_nvfp4  # noqa: PLC0415

    from moe_jax import nvfp4  # noqa: PLC0415
    from pallas_kernels.grouped_matmul import tuning  # noqa: PLC0415

    launched = []

    def record(spec, group_sizes_e, x, x_scales, x_global, row_token, w, scales_u8, global_scale_eg, out=None):
        launched.append((spec, w, global_scale_eg))
        return jnp.zeros((spec.num_rows, spec.n_out), jnp.bfloat16)

    monkeypatch.setattr(triton_lang, "launch", record)
    e, h, f = 4, 128, 64
    per_expert = tuning.DEQUANTIZED_FORWARD_ROWS_PER_EXPERT[90]
    sizes = jnp.asarray([per_expert - 3, 2 * per_expert, 0, per_expert - 5], jnp.int32)
    w_gate_up, w_down = _random_nvfp4(rng, e, 2 * f, h, groups=2), _random_nvfp4(rng, e, h, f)
    x = jnp.zeros((per_expert * e - rows_less, h), jnp.bfloat16)  # the rule counts padding rows too
    y = triton_lang.W4A16_BACKEND.forward(x, sizes, w_gate_up, w_down, compute_capability=cc, interpret=False)
    assert y.shape == x.shape and y.dtype == jnp.bfloat16
    want_mode = triton_lang.Mode.BF16 if copied else triton_lang.Mode.W4A16
    assert [(s.mode, s.op) for s, _, _ in launched] == [(want_mode, Op.GATE_UP_SWIGLU), (want_mode, Op.MATMUL)]
    if not copied:
        return
    assert [s.scale_groups for s, _, _ in launched] == [2, 1]
    for (_, copy, global_eg), w in zip(launched, (w_gate_up, w_down), strict=True):
        unscaled = NVFP4Tensor(packed=w.packed, scales=w.scales, global_scale=jnp.ones(w.global_scale.shape, jnp.float32))
        np.testing.assert_array_equal(np.asarray(copy, np.float32), np.asarray(nvfp4.dequantize(unscaled)))
        np.testing.assert_array_equal(np.asarray(global_eg), np.asarray(w.global_scale).reshape(e, -1))


def test_the_copied_forwards_rule():
    """``tuning.dequantize_for_forward``: from its rows per expert on SM90 (Mixtral 8x7B's 8
    experts: 2.8 GB of copies), never past the copies' budget (Kimi K2's 384 experts: 33.8 GB),
    never where no bf16 tiles are (SM89, SM120)."""
    from pallas_kernels.grouped_matmul import tuning  # noqa: PLC0415

    per_expert = tuning.DEQUANTIZED_FORWARD_ROWS_PER_EXPERT[90]
    assert set(tuning.DEQUANTIZED_FORWARD_ROWS_PER_EXPERT) <= set(triton_lang.BF16_TILES)

    def take(rows, experts=8, hidden=4096, intermediate=14336, cc=90):
        return tuning.dequantize_for_forward(num_rows=rows, num_experts=experts, hidden=hidden,
                                             intermediate=intermediate, compute_capability=cc)

    assert take(per_expert * 8) and not take(per_expert * 8 - 1)
    assert not take(per_expert * 8, cc=89) and not take(per_expert * 8, cc=120)
    assert not take(per_expert * 384 * 4, experts=384, hidden=7168, intermediate=2048)
    assert 6 * 8 * 4096 * 14336 <= tuning.DEQUANTIZED_COPY_MAX_BYTES < 6 * 384 * 7168 * 2048
