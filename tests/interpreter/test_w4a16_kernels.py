"""The W4A16 branch of the native kernels (SM80-SM90: weights dequantized in registers, bf16
tensor cores), executed in Triton's interpreter on CPU.

The E2M1 placement is inline PTX, which the interpreter evaluates through ``ptx_emulator``
(``interpreted.install``); everything else is the kernel as the GPU gets it: ``triton_lang.make_spec``'s
tile (or the one under test), the real tile schedule, ``x``'s columns in ``permute_k``'s order,
NaN-poisoned outputs whose padding rows must stay NaN, every load and store bounds-checked.
Both the forward kernels (plain and fused gate/up + SwiGLU) and the input-gradient kernel
(``dy @ W_e``) are compared with float64 references written from the NVFP4 definition
(``nvfp4_float64``).

Run by ``./run test`` with triton 3.9.0 from ``.triton-interpret`` (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import functools
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import interpreted
from nvfp4_float64 import PATTERNS, compare, dequantized, random_problem, random_weights, reference
from pallas_kernels.grouped_matmul import triton_lang
from pallas_kernels.grouped_matmul.tuning import Op, Variant, decode_tile, prefill_tile

CC = 90


def _bf16(rng, shape) -> np.ndarray:
    return rng.standard_normal(shape).astype(ml_dtypes.bfloat16)


def forward(op: Op, group_sizes, *, k: int, n_out: int, tile=None, variant=None, scale_groups: int = 1,
            out_k_order: int = 0, experts=None, used=None, seed: int = 0, padding: int = 3,
            tokens: int = 0) -> float:
    """Runs the forward kernel on random bf16 rows; asserts and returns its relative error. With
    ``tokens``, the kernel reads its rows by index from that many token rows (``row_token``, the
    padding rows' indices out of range, so a read of them would be seen)."""
    rng = np.random.default_rng(seed)
    group_sizes, packed, scales, global_scale = random_problem(rng, op, group_sizes, k=k, n_out=n_out,
                                                               scale_groups=scale_groups, experts=experts, used=used)
    experts = len(packed)
    total = int(group_sizes.sum())
    m = total + padding
    if tokens:
        x_tokens = _bf16(rng, (tokens, k))
        row_token = np.concatenate([rng.integers(0, tokens, total), np.full(padding, 1 << 30)]).astype(np.int32)
        x = x_tokens[np.minimum(row_token, tokens - 1)]
    else:
        x_tokens, row_token = _bf16(rng, (m, k)), np.zeros(1, np.int32)
        x = x_tokens
    if variant is not None:
        tile = triton_lang.NATIVE_TILES[CC][(variant, op)]
    spec = triton_lang.make_spec(op, triton_lang.Mode.W4A16, num_rows=m, num_experts=experts, k=k, n_out=n_out,
                                 scale_groups=scale_groups, compute_capability=CC, tile=tile, out_k_order=out_k_order,
                                 gather_rows=tokens)
    x_perm = np.asarray(triton_lang.permute_k(jnp.asarray(x_tokens), spec.block_k))
    interpreted.reset()
    out = np.full((m, n_out), np.nan, ml_dtypes.bfloat16)
    buffers = interpreted.schedule_buffers(group_sizes, m, spec.tile.rows_per_tile, spec.max_tiles)
    buffers += [interpreted.buffer(x_perm, "x (permute_k)"),
                interpreted.buffer(np.zeros(1, np.uint8), "x_scales (unread)"),
                interpreted.buffer(np.zeros(1, np.float32), "x_global (unread)"),
                interpreted.buffer(row_token, "row_token" if tokens else "row_token (unread)"),
                interpreted.buffer(packed, "w.packed"), interpreted.buffer(scales, "w.scales"),
                interpreted.buffer(global_scale.reshape(experts, scale_groups), "w.global_scale"),
                interpreted.buffer(np.zeros(1, ml_dtypes.bfloat16), "out_in (unread)")]
    got = interpreted.launch(triton_lang.kernel_function(), spec.num_programs, buffers, out, spec.constexprs())
    want = reference(op, x.astype(np.float64), packed, scales, global_scale, group_sizes)
    if out_k_order:
        want = np.asarray(triton_lang.permute_k(jnp.asarray(want), out_k_order))
    return compare(got, want, total, spec.tile)


def input_grad(group_sizes, *, n: int, k: int, tile=None, experts=None, used=None, seed: int = 0,
               padding: int = 3) -> float:
    """Runs the input-gradient kernel on a random bf16 cotangent; asserts and returns its error."""
    rng = np.random.default_rng(seed)
    group_sizes = np.asarray(group_sizes)
    experts = experts or len(group_sizes)
    packed, scales, global_scale = random_weights(rng, experts, n, k, 1, used)
    total = int(group_sizes.sum())
    m = total + padding
    dy = _bf16(rng, (m, n))
    spec = triton_lang.make_input_grad_spec(num_rows=m, num_experts=experts, n=n, k=k, compute_capability=CC, tile=tile)
    interpreted.reset()
    out = np.full((m, k), np.nan, ml_dtypes.bfloat16)
    buffers = interpreted.schedule_buffers(group_sizes, m, spec.tile.block_m, spec.max_tiles)
    buffers += [interpreted.buffer(dy, "dy"), interpreted.buffer(packed, "w.packed"),
                interpreted.buffer(scales, "w.scales"), interpreted.buffer(global_scale, "w.global_scale"),
                interpreted.buffer(np.zeros(1, ml_dtypes.bfloat16), "out_in (unread)")]
    got = interpreted.launch(triton_lang.input_grad_kernel_function(), spec.num_programs, buffers, out, spec.constexprs())
    want, start = [], 0
    for e, size in enumerate(group_sizes):
        if size:
            want.append(dy[start:start + size].astype(np.float64) @ dequantized(packed[e], scales[e], global_scale[e]))
        start += size
    return compare(got, np.concatenate(want), total, spec.tile)


def test_environment():
    assert interpreted.check_environment() is None


@pytest.mark.parametrize("op", [Op.MATMUL, Op.GATE_UP_SWIGLU], ids=lambda op: op.value)
@pytest.mark.parametrize("variant", [Variant.DECODE, Variant.PREFILL], ids=lambda v: v.value)
def test_every_sm90_tile_of_the_table(op, variant):
    """The table's tiles as they run on an H200 (decode; prefill with extra rows and tails)."""
    forward(op, [70, 0, 130, 9], k=1024, n_out=128, variant=variant)


@pytest.mark.parametrize("op", [Op.MATMUL, Op.GATE_UP_SWIGLU], ids=lambda op: op.value)
@pytest.mark.parametrize("pattern", PATTERNS, ids=str)
def test_group_size_patterns(op, pattern):
    forward(op, PATTERNS[pattern], k=512, n_out=64, tile=decode_tile(16, 32, 256, 4, 2), seed=hash(pattern) % 1000)


@pytest.mark.parametrize("op", [Op.MATMUL, Op.GATE_UP_SWIGLU], ids=lambda op: op.value)
@pytest.mark.parametrize("variant", [Variant.DECODE, Variant.PREFILL], ids=lambda v: v.value)
def test_rows_read_by_index(op, variant):
    """``x`` read in place by each row's token (``GATHER_ROWS``), as the layer calls the gate/up
    kernel: fewer token rows than rows, repeated and unordered tokens, every tile kind (extra
    rows and tails at prefill); the padding rows' indices lie far out of range and are never
    read, so their outputs stay NaN and no load leaves ``x``."""
    forward(op, [70, 0, 130, 9], k=1024, n_out=128, variant=variant, tokens=37, seed=5)


@pytest.mark.parametrize("block_k", [64, 128, 512])
def test_each_stage_width_and_its_column_order(block_k):
    """Stages of 64 to 512 columns over K = 2048: ``x`` permuted per stage, pointers advanced per
    stage (``permute_k``'s digits change with the stage's width)."""
    forward(Op.MATMUL, [9, 0, 21], k=2048, n_out=64, tile=decode_tile(16, 32, block_k, 4, 2), seed=block_k)


@pytest.mark.parametrize("order", [64, 128])
def test_fused_output_in_the_next_kernels_column_order(order):
    """``out_k_order`` = the reading kernel's ``block_k`` (``k_order``): each column lands where
    ``permute_k`` for that width puts it, from tiles of 32 columns."""
    forward(Op.GATE_UP_SWIGLU, [16, 40, 0, 7], k=512, n_out=256, tile=decode_tile(16, 32, 256, 4, 2),
            out_k_order=order, seed=order)


def test_gate_and_up_with_their_own_global_scales():
    forward(Op.GATE_UP_SWIGLU, [11, 0, 25, 4], k=512, n_out=64, scale_groups=2, tile=decode_tile(16, 32, 256, 4, 2))


def test_the_sm90_wide_tile_from_its_rows_per_expert():
    """``WIDE_TILES``' 256-row down-projection tile, taken by ``make_spec`` from
    ``WIDE_ROWS_PER_EXPERT`` rows per expert on average: experts of 255, 0, 1, 257 and 2049 rows
    (eight whole row tiles and one of a row), the padding rows NaN-poisoned; several output tiles
    and K steps. The fused gate/up keeps its tiles."""
    sizes = [255, 0, 1, 257, 2049]
    spec = functools.partial(triton_lang.make_spec, mode=triton_lang.Mode.W4A16, num_rows=sum(sizes) + 3,
                             num_experts=len(sizes), k=512, n_out=256, scale_groups=1, compute_capability=CC)
    assert spec(Op.MATMUL).tile == triton_lang.WIDE_TILES[CC][Op.MATMUL], spec(Op.MATMUL).tile
    assert spec(Op.GATE_UP_SWIGLU).tile.block_m < 256
    forward(Op.MATMUL, sizes, k=512, n_out=256, seed=11)


def test_kimi_k2_down_at_its_highest_experts():
    """Kimi K2's down projection at all 384 experts (expert 293 starts past 2**31 bytes), rows for
    experts 0, 292, 293 and 383 only; a tile as wide as the interpreter runs quickly (the
    offsets do not depend on it)."""
    sizes = np.zeros(384, np.int64)
    sizes[[0, 292, 293, 383]] = [2, 1, 3, 2]
    forward(Op.MATMUL, sizes, k=2048, n_out=7168, tile=decode_tile(16, 1024, 256, 4, 2), experts=384,
            used=(0, 292, 293, 383), padding=1)


@pytest.mark.parametrize("pattern", PATTERNS, ids=str)
def test_input_gradient_group_size_patterns(pattern):
    input_grad(PATTERNS[pattern], n=256, k=256, tile=prefill_tile(16, 64, 64, 4, 2), seed=hash(pattern) % 1000)


@pytest.mark.parametrize("many", [False, True], ids=["few rows", "many rows"])
def test_input_gradient_with_the_table_tiles(many):
    """Both SM90 table tiles (chosen by rows per expert), several reduction steps and output tiles."""
    sizes = [700, 0, 650, 800] if many else [3, 0, 1, 5]
    spec = triton_lang.make_input_grad_spec(num_rows=sum(sizes) + 3, num_experts=4, n=256, k=256, compute_capability=CC)
    assert spec.tile == triton_lang.INPUT_GRAD_TILES[CC][many]
    input_grad(sizes, n=256, k=256)


def test_input_gradient_of_kimi_k2_down_at_its_highest_experts():
    """``dy @ W_e`` for Kimi K2's down projection (``[384, 7168, 2048]``): 64-bit expert offsets."""
    sizes = np.zeros(384, np.int64)
    sizes[[0, 293, 383]] = [2, 3, 1]
    input_grad(sizes, n=7168, k=2048, experts=384, used=(0, 293, 383), padding=1,
               tile=prefill_tile(16, 256, 512, 4, 2))
