"""The backward-pass kernels against float64 references: interpret mode on CPU, native on GPU.

* ``grouped_matmul_input_grad(dy, w, g)``: ``dy_e @ W_e`` with ``W`` read as stored (bf16 or
  NVFP4 dequantized in the kernel), the gradient of ``grouped_matmul`` with respect to ``x``;
* ``dequantized_input_grad(dy, w, g)``: the same product of NVFP4 weights through one bf16 copy
  of them (the input gradient ``PALLAS`` and the W4A16 backend take at many rows per expert);
* ``grouped_matmul_weight_grad(x, dy, g)``: ``dy_e^T @ x_e`` per expert, its gradient with
  respect to a dense ``W``.

As in ``test_grouped_matmul.py``: fresh random inputs, NaN-poisoned ``out=`` buffers (padding
rows of the input gradient must keep their poison; every element of the weight gradient must
be written, experts without rows as zeros), and in interpret mode zero load/store lanes outside
their buffers (``check_bounds``), which the interpreter would otherwise clamp.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_grouped_matmul import CASES, GPU_CASES, TOLERANCE, Case, _check, _gpu_capability, _weights

from pallas_kernels.grouped_matmul import (
    PALLAS,
    Op,
    Variant,
    dequantized_input_grad,
    grouped_matmul_input_grad,
    grouped_matmul_weight_grad,
    reference,
    run,
    tuning,
)


def _run_input_grad(rng, case: Case, fmt: str, variant: Variant, *, compute_capability: int, interpret: bool):
    # The forward weight is [E, N=case.k, K=case.n]: dy has the forward's N columns (the
    # reduction here, a multiple of 64) and the result its K (case.n).
    dy = jnp.asarray(rng.standard_normal((case.m, case.k)), jnp.bfloat16)
    w = _weights(rng, fmt, len(case.groups), case.k, case.n)
    group_sizes = jnp.asarray(case.groups, jnp.int32)
    poisoned = jnp.full((case.m, case.n), jnp.nan, jnp.bfloat16)
    out = run(Op.MATMUL, dy, w, group_sizes, compute_capability=compute_capability, interpret=interpret,
              out=poisoned, variant=variant, check_bounds=interpret, transpose_w=True)
    if interpret:
        out, out_of_bounds = out
        assert int(out_of_bounds[0]) == 0, f"{int(out_of_bounds[0])} load/store lanes outside their buffers"
    _check(out, reference.grouped_matmul_input_grad(dy, w, group_sizes), padding_poisoned=True)


def _run_dequantized_input_grad(rng, case: Case, *, compute_capability: int, interpret: bool):
    dy = jnp.asarray(rng.standard_normal((case.m, case.k)), jnp.bfloat16)
    w = _weights(rng, "nvfp4", len(case.groups), case.k, case.n)
    group_sizes = jnp.asarray(case.groups, jnp.int32)
    poisoned = jnp.full((case.m, case.n), jnp.nan, jnp.bfloat16)
    out = dequantized_input_grad(dy, w, group_sizes, compute_capability=compute_capability, interpret=interpret,
                                 out=poisoned)
    _check(out, reference.grouped_matmul_input_grad(dy, w, group_sizes), padding_poisoned=True)


def _run_weight_grad(rng, case: Case, out_dtype, *, compute_capability: int, interpret: bool):
    x = jnp.asarray(rng.standard_normal((case.m, case.k)), jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((case.m, case.n)), jnp.bfloat16)
    group_sizes = jnp.asarray(case.groups, jnp.int32)
    poisoned = jnp.full((len(case.groups), case.n, case.k), jnp.nan, out_dtype)
    out = grouped_matmul_weight_grad(x, dy, group_sizes, compute_capability=compute_capability, interpret=interpret,
                                     out_dtype=out_dtype, out=poisoned, check_bounds=interpret)
    if interpret:
        out, out_of_bounds = out
        assert int(out_of_bounds[0]) == 0, f"{int(out_of_bounds[0])} load/store lanes outside their buffers"
    assert out.dtype == out_dtype
    got = np.asarray(out.astype(jnp.float32), np.float64)
    assert np.isfinite(got).all(), f"{np.count_nonzero(~np.isfinite(got))} elements left unwritten (NaN)"
    ref = reference.grouped_matmul_weight_grad(x, dy, group_sizes)
    empty = [e for e in range(len(case.groups)) if not np.any(ref[e])]
    assert not np.any(got[empty]), f"experts without rows {empty} got a nonzero gradient"
    error = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert error <= TOLERANCE, f"relative Frobenius error {error:.3g}"


@pytest.mark.parametrize("variant", list(Variant), ids=lambda v: v.value)
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_interpret_input_grad_matches_float64_reference(rng, case, fmt, variant):
    _run_input_grad(rng, case, fmt, variant, compute_capability=90, interpret=True)


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_interpret_weight_grad_matches_float64_reference(rng, case, out_dtype):
    _run_weight_grad(rng, case, out_dtype, compute_capability=90, interpret=True)


@pytest.mark.parametrize("capability", [80, 89, 100, 120])
def test_interpret_backward_kernels_with_every_tile_table_row(rng, capability):
    """Each capability's tiles (the weight gradient's are smaller where shared memory is)."""
    case = CASES["m_not_a_tile_multiple"]
    _run_input_grad(rng, case, "nvfp4", Variant.DECODE, compute_capability=capability, interpret=True)
    _run_weight_grad(rng, case, jnp.float32, compute_capability=capability, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(Variant), ids=lambda v: v.value)
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("case", GPU_CASES.values(), ids=GPU_CASES.keys())
def test_gpu_input_grad_matches_float64_reference(rng, case, fmt, variant):
    _run_input_grad(rng, case, fmt, variant, compute_capability=_gpu_capability(), interpret=False)


# Each expert's rows take their own global scale (NVFP4 quantization gives every expert its own).
DEQUANTIZED_CASES = {name: CASES[name] for name in ("empty_and_one_row_groups", "last_expert_empty_and_padding_rows",
                                                    "groups_sum_past_the_rows", "negative_group_size")}


@pytest.mark.parametrize("case", DEQUANTIZED_CASES.values(), ids=DEQUANTIZED_CASES.keys())
def test_interpret_dequantized_input_grad_matches_float64_reference(rng, case):
    _run_dequantized_input_grad(rng, case, compute_capability=90, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES.values(), ids=GPU_CASES.keys())
def test_gpu_dequantized_input_grad_matches_float64_reference(rng, case):
    _run_dequantized_input_grad(rng, case, compute_capability=_gpu_capability(), interpret=False)


#: What the test's input gradient writes in the padding rows (past ``sum(group_sizes)``): none of
#: the library's kernels writes it there, so it shows whose result came back.
_PADDING_MARK = 7.0


def _ragged_input_grad(dy_mn, w_enk, group_sizes_e, *, compute_capability, interpret):
    """A bf16 input gradient by XLA (``dy_e @ W_e``, float32 sums), padding rows set to
    :data:`_PADDING_MARK`; it checks what it is given (at trace time)."""
    assert (dy_mn.dtype, w_enk.dtype, compute_capability, interpret) == (jnp.bfloat16, jnp.bfloat16, 90, True)
    assert w_enk.shape == (group_sizes_e.shape[0], dy_mn.shape[1], w_enk.shape[2]), w_enk.shape
    m = dy_mn.shape[0]
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes_e, 0)), m)  # rows in [0, M), as the kernels take them
    sizes = jnp.diff(ends, prepend=0)
    out = jax.lax.ragged_dot(dy_mn, w_enk, sizes, preferred_element_type=jnp.float32)
    return jnp.where((jnp.arange(m) < ends[-1])[:, None], out, _PADDING_MARK).astype(jnp.bfloat16)


@pytest.mark.parametrize("case", DEQUANTIZED_CASES.values(), ids=DEQUANTIZED_CASES.keys())
def test_dequantized_input_grad_multiplies_with_the_given_kernel(rng, case):
    """``multiply``: the bf16 copy ``[E, N, K]`` and the rows scaled by their experts' global
    scales go to the given input gradient, whose result is the op's (the W4A16 backend passes its
    native bf16 one); against float64 on every defined row, the mark on the padding rows."""
    dy = jnp.asarray(rng.standard_normal((case.m, case.k)), jnp.bfloat16)
    w = _weights(rng, "nvfp4", len(case.groups), case.k, case.n)
    group_sizes = jnp.asarray(case.groups, jnp.int32)
    out = dequantized_input_grad(dy, w, group_sizes, compute_capability=90, interpret=True,
                                 multiply=_ragged_input_grad)
    ref = reference.grouped_matmul_input_grad(dy, w, group_sizes)
    _check(out, ref, padding_poisoned=False)
    assert (np.asarray(out[ref.shape[0]:].astype(jnp.float32)) == _PADDING_MARK).all()
    with pytest.raises(ValueError, match=r"^out: given with multiply"):
        dequantized_input_grad(dy, w, group_sizes, compute_capability=90, multiply=_ragged_input_grad,
                               out=jnp.zeros((case.m, case.n), jnp.bfloat16))


def test_the_copy_holds_the_exact_tile_s_values(rng):
    """``pallas_triton.dequantize_copy`` (the copy's formulation) against ``dequantize_tile``'s
    EXACT one: every byte value, every E4M3 scale bit pattern but NaN, signs of zeros included."""
    from pallas_kernels.grouped_matmul import pallas_triton

    scale_bits = np.array([b for b in range(256) if b & 0x7F != 0x7F], np.uint8)
    packed = np.stack([rng.permutation(256).astype(np.uint8) for _ in scale_bits])  # [rows, 256]
    scales = np.repeat(scale_bits[:, None], 256 // 8, axis=1)  # one block = 8 bytes
    got = np.asarray(pallas_triton.dequantize_copy(jnp.asarray(packed), jnp.asarray(scales)).astype(jnp.float32))
    want = np.asarray(pallas_triton.dequantize_tile(jnp.asarray(packed), jnp.asarray(scales), pallas_triton.Dequant.EXACT,
                                                    pallas_triton.Order.MODELOPT).astype(jnp.float32)) * 2.0**7
    np.testing.assert_array_equal(got, want)
    assert np.array_equal(np.signbit(got), np.signbit(want))


@pytest.mark.parametrize("groups", [1, 2], ids=["one_global_scale", "gate_and_up_scales"])
def test_dequantized_copy_is_each_weight_without_its_global_scale(rng, groups):
    """``dequantized_copy(w)``: ``[E, N, K]`` bf16, each weight's ``code * scale`` exactly (the
    float64 dequantization with the global scales set to 1), whatever the global scales; a
    one-line error for weights that are not NVFP4 or not ``[E, N, K]``."""
    from moe_jax.nvfp4 import NVFP4Tensor

    from pallas_kernels.grouped_matmul import dequantized_copy

    e, n, k = 3, 64, 128
    w = NVFP4Tensor(packed=jnp.asarray(rng.integers(0, 256, (e, n, k // 2)), jnp.uint8),
                    scales=jnp.asarray(rng.uniform(2.0**-9, 448, (e, n, k // 16)), jnp.float8_e4m3fn),
                    global_scale=jnp.asarray(rng.uniform(0.1, 10, (e,) if groups == 1 else (e, groups)), jnp.float32))
    got = dequantized_copy(w)
    assert got.dtype == jnp.bfloat16 and got.shape == (e, n, k)
    want = reference.dequantize(np.asarray(w.packed), np.asarray(w.scales), np.ones((e,), np.float32))
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32), np.float64), want)
    with pytest.raises(ValueError, match=r"^w: ArrayImpl, expected NVFP4 weights"):
        dequantized_copy(got)
    flat = NVFP4Tensor(packed=w.packed[0], scales=w.scales[0], global_scale=w.global_scale)
    with pytest.raises(ValueError, match=r"^w\.packed: uint8\[64, 64\], expected uint8 of rank 3$"):
        dequantized_copy(flat)
    short = NVFP4Tensor(packed=w.packed, scales=w.scales[:, :, :4], global_scale=w.global_scale)
    with pytest.raises(ValueError, match=r"^w\.scales: shape \(3, 64, 4\), expected \(3, 64, 8\)"):
        dequantized_copy(short)


def test_input_grad_goes_through_a_bf16_copy_from_many_rows_per_expert():
    """The rule (:func:`tuning.dequantize_for_input_grad`) at Kimi K2's gate/up: 48 experts (EP 8)
    from 256 rows per expert; never for a copy past the budget (all 384 experts: 22.5 GB)."""
    rows = tuning.DEQUANTIZED_INPUT_GRAD_ROWS_PER_EXPERT
    take = functools.partial(tuning.dequantize_for_input_grad, n=4096, k=7168)
    assert take(num_rows=rows * 48, num_experts=48) and take(num_rows=32768, num_experts=48)
    assert not take(num_rows=rows * 48 - 1, num_experts=48) and not take(num_rows=8192, num_experts=48)
    assert not take(num_rows=rows * 384 * 4, num_experts=384)
    assert 2 * 384 * 4096 * 7168 > tuning.DEQUANTIZED_COPY_MAX_BYTES >= 2 * 96 * 4096 * 7168


@pytest.mark.parametrize("copied", [False, True])
def test_pallas_backend_input_grad_follows_the_rule(rng, copied):
    """``PALLAS.input_grad`` of NVFP4 weights: the bf16 copy at many rows per expert, visible in
    the HLO by its scope, and the float64 product either way; bf16 weights never copied."""
    rows = tuning.DEQUANTIZED_INPUT_GRAD_ROWS_PER_EXPERT
    sizes = np.array([2 * rows, 0, rows + 20] if copied else [8, 0, 5], np.int32)
    m, n, k = int(sizes.sum()) + 4, 64, 32
    dy = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
    w = _weights(rng, "nvfp4", len(sizes), n, k)
    g = jnp.asarray(sizes)

    def call(dy, w, g):
        return PALLAS.input_grad(dy, w, g, compute_capability=90, interpret=True)

    hlo = jax.jit(call).lower(dy, w, g).as_text(debug_info=True)
    assert ("dequantized_input_grad" in hlo) == copied
    _check(call(dy, w, g), reference.grouped_matmul_input_grad(dy, w, g), padding_poisoned=False)
    bf16_hlo = jax.jit(call).lower(dy, _weights(rng, "bf16", len(sizes), n, k), g).as_text(debug_info=True)
    assert "dequantized_input_grad" not in bf16_hlo


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", GPU_CASES.values(), ids=GPU_CASES.keys())
def test_gpu_weight_grad_matches_float64_reference(rng, case, out_dtype):
    _run_weight_grad(rng, case, out_dtype, compute_capability=_gpu_capability(), interpret=False)


def test_public_input_grad_is_the_transposed_run(rng):
    case = CASES["empty_and_one_row_groups"]
    dy = jnp.asarray(rng.standard_normal((case.m, case.k)), jnp.bfloat16)
    w = _weights(rng, "nvfp4", len(case.groups), case.k, case.n)
    group_sizes = jnp.asarray(case.groups, jnp.int32)
    out = grouped_matmul_input_grad(dy, w, group_sizes, compute_capability=120, interpret=True)
    assert out.shape == (case.m, case.n) and out.dtype == jnp.bfloat16
    _check(out, reference.grouped_matmul_input_grad(dy, w, group_sizes), padding_poisoned=False)


def test_weight_grad_of_no_rows_is_zero(rng):
    x, dy = jnp.zeros((0, 64), jnp.bfloat16), jnp.zeros((0, 32), jnp.bfloat16)
    out = grouped_matmul_weight_grad(x, dy, jnp.asarray([0, 0], jnp.int32), compute_capability=90, interpret=True)
    assert out.shape == (2, 32, 64) and out.dtype == jnp.float32 and not np.any(np.asarray(out))


@pytest.mark.parametrize("call, match", [
    (lambda x, dy, g, w: grouped_matmul_weight_grad(x.astype(jnp.float32), dy, g, compute_capability=90),
     r"^x_mk: float32\[40, 64\], expected bfloat16"),
    (lambda x, dy, g, w: grouped_matmul_weight_grad(x, dy[:3], g, compute_capability=90),
     r"^dy_mn: 3 rows, expected M=40 \(x_mk\)"),
    (lambda x, dy, g, w: grouped_matmul_weight_grad(x, dy, g, compute_capability=90, out_dtype=jnp.int32),
     r"^out_dtype: int32, expected float32 or bfloat16"),
    (lambda x, dy, g, w: grouped_matmul_weight_grad(x, dy, g.astype(jnp.int8), compute_capability=90),
     r"^group_sizes_e: int8\[3\], expected int32"),
    (lambda x, dy, g, w: grouped_matmul_weight_grad(x, dy, g, compute_capability=75),
     r"^compute_capability: 75 has no tile configurations"),
    (lambda x, dy, g, w: grouped_matmul_weight_grad(x, dy, g, compute_capability=90,
                                                    out=jnp.zeros((3, 32, 64), jnp.bfloat16)),
     r"^out: bfloat16\[3, 32, 64\], expected float32 \[3, 32, 64\]"),
    (lambda x, dy, g, w: grouped_matmul_input_grad(x, w, g, compute_capability=90),
     r"^w: shape \(3, 32, 64\), expected \[E=3 \(group_sizes_e\), N=64 \(dy_mn\), K\]"),
    (lambda x, dy, g, w: grouped_matmul_input_grad(dy, w, g, compute_capability=90),
     r"^dy_mn: N=32, expected a positive multiple of 64"),
    (lambda x, dy, g, w: dequantized_input_grad(x, w, g, compute_capability=90),
     r"^w: \w+, expected NVFP4 weights"),
    (lambda x, dy, g, w: dequantized_input_grad(x.astype(jnp.float32), w, g, compute_capability=90),
     r"^dy_mn: float32\[40, 64\], expected bfloat16"),
])
def test_bad_arguments_raise_naming_the_argument(rng, call, match):
    x = jnp.asarray(rng.standard_normal((40, 64)), jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((40, 32)), jnp.bfloat16)
    w = _weights(rng, "bf16", 3, 32, 64)
    with pytest.raises(ValueError, match=match):
        call(x, dy, jnp.asarray([10, 20, 10], jnp.int32), w)


def test_transposed_nvfp4_tile_keeps_memory_order():
    """Transposed, the packed dimension is the output's, so neither the tile nor x is permuted."""
    from pallas_kernels.grouped_matmul import pallas_triton, tuning

    config = tuning.TILE_TABLE[90][(Variant.DECODE, tuning.WeightFormat.NVFP4, Op.MATMUL)]
    spec = pallas_triton.KernelSpec(
        variant=Variant.DECODE, weights=tuning.WeightFormat.NVFP4, op=Op.MATMUL, dequant=pallas_triton.Dequant.EXACT,
        config=config, num_rows=16, k=64, n_out=64, block_k=64, block_n=64, max_tiles=1, aliased=False,
        transpose_w=True)
    assert spec.order is pallas_triton.Order.MODELOPT
    with pytest.raises(ValueError, match="transpose_w"):
        pallas_triton.KernelSpec(
            variant=Variant.DECODE, weights=tuning.WeightFormat.NVFP4, op=Op.GATE_UP_SWIGLU,
            dequant=pallas_triton.Dequant.EXACT, config=config, num_rows=16, k=64, n_out=64, block_k=64, block_n=64,
            max_tiles=1, aliased=False, transpose_w=True)


def test_weight_grad_tiles_fit_shared_memory():
    from pallas_kernels.grouped_matmul import tuning

    assert set(tuning.WEIGHT_GRAD_TILES) == set(tuning.TILE_TABLE)
    for capability, configs in tuning.WEIGHT_GRAD_TILES.items():
        for config in configs:
            assert tuning.weight_grad_shared_memory(config) <= tuning.SHARED_MEMORY_BYTES[capability], capability
    few, many = tuning.WEIGHT_GRAD_TILES[90]
    assert tuning.choose_weight_grad_tile(num_rows=8192, num_experts=48, compute_capability=90) == few
    assert tuning.choose_weight_grad_tile(num_rows=32768, num_experts=48, compute_capability=90) == many


def test_bounds_check_sees_unclipped_groups_in_the_weight_grad(rng, monkeypatch):
    """The weight gradient's bounds check itself: group bounds not cut at M read past x and dy."""
    from pallas_kernels.grouped_matmul import pallas_triton

    case = CASES["groups_sum_past_the_rows"]
    bounds = pallas_triton.group_bounds

    def unclipped(group_sizes_e, *, num_rows):
        return bounds(group_sizes_e, num_rows=2**30)

    monkeypatch.setattr(pallas_triton, "group_bounds", unclipped)
    jax.clear_caches()
    try:
        x = jnp.asarray(rng.standard_normal((case.m, case.k)), jnp.bfloat16)
        dy = jnp.asarray(rng.standard_normal((case.m, case.n)), jnp.bfloat16)
        _, out_of_bounds = grouped_matmul_weight_grad(x, dy, jnp.asarray(case.groups, jnp.int32), compute_capability=90,
                                                      interpret=True, check_bounds=True)
    finally:
        jax.clear_caches()
    assert int(out_of_bounds[0]) > 0
