"""The SM100/SM120 (W4A4) branch of the native kernels, executed in Triton's interpreter on CPU.

The W4A4 kernels multiply on the FP4 tensor cores (``tl.dot_scaled`` e2m1 x e2m1 with E4M3
scales); no SM100/SM120 GPU is available to this project, so this is where that branch runs:
the kernel as the GPU would get it (``triton_lang.make_spec``'s tile for SM100 or SM120, the real
tile schedule and the activations quantized by ``nvfp4.quantize_rows``), against a float64
reference written here from the NVFP4 definition (E2M1 codes x E4M3 block scales x global
scales, activations and weights alike), with NaN-poisoned outputs whose padding rows must stay
NaN, and every load and store bounds-checked (``interpreted.VIOLATIONS``).

Run by ``./run test`` with triton 3.9.0 from ``.triton-interpret`` (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import interpreted
from nvfp4_float64 import compare, dequantized, random_problem, reference
from moe_jax import nvfp4
from pallas_kernels.grouped_matmul import triton_lang
from pallas_kernels.grouped_matmul.tuning import Op, Variant, decode_tile, prefill_tile

def run_interpreted(op: Op, x_mk: np.ndarray, packed, scales, global_scale, group_sizes: np.ndarray, *,
                    cc: int, variant: Variant | None = None, tile=None, input_scale_e: np.ndarray | None = None,
                    out_k_order: int = 0):
    """The kernel on ``x_mk`` (float32, quantized per row first, as the layer does: against each
    row's expert's static ``input_scale_e`` float32 ``[E]`` when given, padding rows the last
    expert's, else dynamically); returns (bf16 output as float64 with NaN where unwritten, the
    quantized rows as float64)."""
    m, k = x_mk.shape
    experts, n_w = packed.shape[:2]
    n_out = n_w // 2 if op is Op.GATE_UP_SWIGLU else n_w
    groups = 1 if global_scale.ndim == 1 else 2
    if variant is not None:
        tile = triton_lang.NATIVE_TILES[cc][(variant, op)]
    spec = triton_lang.make_spec(op, triton_lang.Mode.W4A4, num_rows=m, num_experts=experts, k=k, n_out=n_out,
                            scale_groups=groups, compute_capability=cc, tile=tile, out_k_order=out_k_order)
    global_m = None
    if input_scale_e is not None:
        global_m = jnp.asarray(np.repeat(input_scale_e, group_sizes)[np.minimum(np.arange(m), group_sizes.sum() - 1)])
    x_packed, x_scales, x_global = (np.asarray(a) for a in nvfp4.quantize_rows(jnp.asarray(x_mk), global_m))
    if input_scale_e is not None:
        np.testing.assert_array_equal(x_global, global_m)
    interpreted.reset()
    out = np.full((m, n_out), np.nan, ml_dtypes.bfloat16)
    buffers = interpreted.schedule_buffers(group_sizes, m, spec.tile.rows_per_tile, spec.max_tiles)
    buffers += [interpreted.buffer(x_packed, "x.packed"), interpreted.buffer(x_scales.view(np.uint8), "x.scales"),
                interpreted.buffer(x_global.astype(np.float32), "x.global_scale"),
                interpreted.buffer(np.zeros(1, np.int32), "row_token (unread)"),
                interpreted.buffer(packed, "w.packed"), interpreted.buffer(scales, "w.scales"),
                interpreted.buffer(global_scale.reshape(experts, groups), "w.global_scale"),
                interpreted.buffer(np.zeros(1, ml_dtypes.bfloat16), "out_in (unread)")]
    got = interpreted.launch(triton_lang.kernel_function(), spec.num_programs, buffers, out, spec.constexprs())
    a_mk = dequantized(x_packed, x_scales.view(np.uint8), x_global.astype(np.float64)[:, None])
    return got, a_mk, spec


def check(op, group_sizes, *, cc, k, n_out, scale_groups=1, variant=None, tile=None, experts=None, used=None,
          seed=0, padding=3, input_scale_e=None, out_k_order=0):
    rng = np.random.default_rng(seed)
    group_sizes, packed, scales, global_scale = random_problem(rng, op, group_sizes, k=k, n_out=n_out,
                                                               scale_groups=scale_groups, experts=experts, used=used)
    total = int(group_sizes.sum())
    x = rng.standard_normal((total + padding, k)).astype(np.float32)
    got, a_mk, spec = run_interpreted(op, x, packed, scales, global_scale, group_sizes, cc=cc, variant=variant,
                                      tile=tile, input_scale_e=input_scale_e, out_k_order=out_k_order)
    want = reference(op, a_mk, packed, scales, global_scale, group_sizes)
    if out_k_order:
        want = triton_lang.permute_k(want, out_k_order)
    return compare(got, want, total, spec.tile)


def test_environment():
    assert interpreted.check_environment() is None


PATTERNS = {
    "empty experts": [5, 0, 17, 0, 3, 9],
    "one hot expert": [0, 0, 40, 0, 0, 1],
    "last expert empty": [7, 12, 1, 30, 2, 0],
    "first expert empty, odd totals": [0, 33, 15, 1, 1, 19],
}


@pytest.mark.parametrize("cc", [100, 120])
@pytest.mark.parametrize("op", [Op.MATMUL, Op.GATE_UP_SWIGLU], ids=lambda op: op.value)
@pytest.mark.parametrize("pattern", PATTERNS, ids=str)
def test_group_size_patterns(cc, op, pattern):
    check(op, PATTERNS[pattern], cc=cc, k=512, n_out=128, seed=hash(pattern) % 1000)


@pytest.mark.parametrize("cc", [100, 120])
@pytest.mark.parametrize("op", [Op.MATMUL, Op.GATE_UP_SWIGLU], ids=lambda op: op.value)
@pytest.mark.parametrize("variant", [Variant.DECODE, Variant.PREFILL], ids=lambda v: v.value)
def test_every_tile_of_the_table(cc, op, variant):
    check(op, [70, 0, 130, 9], cc=cc, k=1024, n_out=256, variant=variant)


@pytest.mark.parametrize("op", [Op.MATMUL, Op.GATE_UP_SWIGLU], ids=lambda op: op.value)
def test_tail_tiles_at_their_boundaries(op):
    """A tile of at most ``tail_m`` rows runs as a ``tail_m``-row tile, the others as ``block_m``
    rows: experts of exactly ``tail_m``, one more, a full tile, a full tile and a tail, and one
    row more than that, among empty and one-row experts; the tail path must read and write
    only its own rows."""
    tile = prefill_tile(32, 64, 256, 4, 2, tail_m=16)
    check(op, [16, 17, 0, 32, 48, 1, 49, 0, 15], cc=120, k=512, n_out=128, tile=tile, seed=11)


@pytest.mark.parametrize("op", [Op.MATMUL, Op.GATE_UP_SWIGLU], ids=lambda op: op.value)
def test_extended_tiles_at_their_boundaries(op):
    """Tiles of ``block_m + extra_m`` rows (the extra ones in a second accumulator) beside tail
    and ``block_m``-row tiles: experts of each path's size, one row more and one row less."""
    tile = prefill_tile(32, 64, 256, 4, 2, extra_m=16, tail_m=16)
    check(op, [16, 17, 32, 33, 48, 0, 49, 1, 47, 96, 97, 0], cc=120, k=512, n_out=128, tile=tile, seed=12)


@pytest.mark.parametrize("op", [Op.MATMUL, Op.GATE_UP_SWIGLU], ids=lambda op: op.value)
@pytest.mark.parametrize("order", [64, 128])
def test_output_columns_in_the_next_kernels_order(op, order):
    """``out_k_order``: each column lands where ``permute_k`` (the W4A16 kernels' order for
    that ``block_k``) puts it, from tiles of 32 columns (the order's chunks span several)."""
    tile = prefill_tile(32, 32, 256, 4, 2, extra_m=16, tail_m=16)
    check(op, [16, 40, 0, 7], cc=120, k=512, n_out=256, tile=tile, seed=13 + order, out_k_order=order)


@pytest.mark.parametrize("cc", [100, 120])
def test_gate_and_up_with_their_own_global_scales(cc):
    check(Op.GATE_UP_SWIGLU, [11, 0, 25, 4], cc=cc, k=512, n_out=128, scale_groups=2)


# Kimi K2's sizes in the interpreter, whose cost grows with the programs it runs: 1024 columns a
# program, not the table's 64-128 (the same kernel code, 3x faster here).
WIDE_DECODE_TILE = decode_tile(16, 1024, 256, 4, 2)


@pytest.mark.parametrize("cc", [100, 120])
def test_kimi_k2_gate_up_at_a_few_experts(cc):
    """Kimi K2's gate/up projection (K = 7168, 2 x 2048 rows), three experts, on a decode tile as
    wide as the interpreter runs quickly (the table's tiles: test_every_tile_of_the_table)."""
    check(Op.GATE_UP_SWIGLU, [3, 0, 2], cc=cc, k=7168, n_out=2048, padding=1, tile=WIDE_DECODE_TILE)


def test_kimi_k2_down_at_its_highest_experts():
    """Kimi K2's down projection at all 384 experts (2.8 GB of codes: expert 293 starts past
    2**31 bytes), rows only for experts 0, 292, 293 and 383: 32-bit expert offsets would land
    outside the buffer (a bounds violation) or on another expert's weights (wrong values). The
    wide tile: the offsets do not depend on it."""
    sizes = np.zeros(384, np.int64)
    sizes[[0, 292, 293, 383]] = [2, 1, 3, 2]
    check(Op.MATMUL, sizes, cc=120, k=2048, n_out=7168, experts=384, used=(0, 292, 293, 383), padding=1,
          tile=WIDE_DECODE_TILE)


@pytest.mark.parametrize("cc", [100, 120])
@pytest.mark.parametrize("op", [Op.MATMUL, Op.GATE_UP_SWIGLU], ids=lambda op: op.value)
def test_activations_quantized_against_a_static_input_scale_per_expert(cc, op):
    """A checkpoint's calibrated ``input_scale`` per expert (``MoEConfig.activation_scale``): the
    rows' global scales differ by expert, one expert's 4x too small (its rows saturate), and
    the kernel must apply each row's."""
    rng = np.random.default_rng(7)
    group_sizes = np.array([9, 0, 21, 6, 13])
    input_scale_e = (rng.uniform(0.5, 2.0, len(group_sizes)) * 4.5 / (6 * 448)).astype(np.float32)
    input_scale_e[3] /= 4
    check(op, group_sizes, cc=cc, k=512, n_out=128, input_scale_e=input_scale_e)
