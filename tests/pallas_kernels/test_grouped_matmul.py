"""Grouped matmul kernels against a float64 reference: interpret mode on CPU, native on GPU.

Every case draws fresh random inputs (the ``rng`` fixture), compares only the rows whose
output is defined, and passes a NaN-poisoned ``out=`` buffer so an unwritten tile fails.
In interpret mode the kernels also count every load and store lane outside its buffer
(``check_bounds``), which must be zero: the interpreter itself would clamp such an index.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from moe_jax import nvfp4
from pallas_kernels.grouped_matmul import Dequant, Op, Variant, gate_up_swiglu, grouped_matmul, reference, run, tuning
from pallas_kernels.grouped_matmul import pallas_triton

TOLERANCE = 1e-2  # Relative Frobenius error; bf16 output rounding alone is ~3e-3.


@dataclasses.dataclass(frozen=True)
class Case:
    m: int  # rows of x (padding rows included)
    k: int
    n: int  # output columns (F for the fused op)
    groups: tuple[int, ...]


# In the interpreter each distinct shape costs seconds of compilation per kernel (and per input
# generator), while the group sizes are read at run time: so the cases share one shape, which
# has rows that are not a tile multiple, two K steps for the prefill tiles, three N tiles and five
# experts, and differ in their group sizes; "minimum_k_and_n" is the one smallest shape.
CASES = {
    "empty_and_one_row_groups": Case(m=37, k=128, n=48, groups=(0, 1, 17, 0, 5)),
    "m_not_a_tile_multiple": Case(m=37, k=128, n=48, groups=(20, 9, 0, 0, 8)),
    "all_rows_in_one_group": Case(m=37, k=128, n=48, groups=(0, 37, 0, 0, 0)),
    "minimum_k_and_n": Case(m=5, k=64, n=16, groups=(3, 0, 2)),
    "last_expert_empty_and_padding_rows": Case(m=37, k=128, n=48, groups=(9, 20, 0, 3, 0)),
    # Malformed group sizes must not move any access out of bounds either.
    "groups_sum_past_the_rows": Case(m=37, k=128, n=48, groups=(30, 30, 0, 0, 0)),
    "negative_group_size": Case(m=37, k=128, n=48, groups=(-5, 12, 7, 0, 3)),
}
# On a GPU (compilation is cheap there) each case has a shape of its own, and multi-step K loops
# with several tiles per expert run natively only (interpret mode is too slow).
GPU_CASES = {
    "empty_and_one_row_groups": Case(m=24, k=128, n=32, groups=(0, 1, 17, 0, 5)),
    "m_not_a_tile_multiple": Case(m=37, k=64, n=48, groups=(20, 9, 8)),
    "all_rows_in_one_group": Case(m=40, k=128, n=32, groups=(0, 40, 0)),
    "minimum_k_and_n": Case(m=5, k=64, n=16, groups=(3, 0, 2)),
    "last_expert_empty_and_padding_rows": Case(m=37, k=64, n=32, groups=(9, 20, 0)),
    "groups_sum_past_the_rows": Case(m=40, k=64, n=32, groups=(30, 30)),
    "negative_group_size": Case(m=24, k=64, n=32, groups=(-5, 12, 7)),
    "several_k_steps_and_row_tiles": Case(m=700, k=2048, n=512, groups=(0, 300, 1, 0, 250, 33, 100, 16)),
}


def _normal(rng, shape, scale: float = 0.05) -> jax.Array:
    """float32 normal draws made on the default device (at Kimi K2's 48-expert size NumPy's
    float64 draws and their copy to the GPU took most of a test's minutes), seeded from ``rng``."""
    return jax.random.normal(jax.random.key(int(rng.integers(1 << 31))), shape, jnp.float32) * scale


def _weights(rng, fmt: str, e: int, rows: int, k: int):
    w = _normal(rng, (e, rows, k)).astype(jnp.bfloat16)
    match fmt:
        case "bf16":
            return w
        case "nvfp4":
            return nvfp4.quantize(w.astype(jnp.float32))
    raise AssertionError(fmt)


def _gate_up_own_scales(rng, e: int, f: int, k: int):
    """NVFP4 ``[E, 2F, K]`` with global scales ``[E, 2]``: gate and up quantized separately, up
    3-10x larger than gate, so applying either half's scale to both would be far off."""
    gate = _normal(rng, (e, f, k))
    up = _normal(rng, (e, f, k)) * jnp.asarray(rng.uniform(3, 10, (e, 1, 1)), jnp.float32)
    w = nvfp4.concat_rows(nvfp4.quantize(gate), nvfp4.quantize(up))
    ratio = np.asarray(w.global_scale[:, 1] / w.global_scale[:, 0])
    assert w.global_scale.shape == (e, 2) and (ratio > 2).all(), ratio
    return w


def _inputs(rng, case: Case, fmt: str, op: Op, *, own_scales: bool = False):
    """``own_scales``: NVFP4 gate/up with a global scale per half (:func:`_gate_up_own_scales`)."""
    x = jnp.asarray(rng.standard_normal((case.m, case.k)), jnp.bfloat16)
    rows = 2 * case.n if op is Op.GATE_UP_SWIGLU else case.n
    if own_scales:
        w = _gate_up_own_scales(rng, len(case.groups), case.n, case.k)
    else:
        w = _weights(rng, fmt, len(case.groups), rows, case.k)
    return x, w, jnp.asarray(case.groups, jnp.int32)


def _reference(op: Op, x, w, group_sizes):
    match op:
        case Op.MATMUL:
            return reference.grouped_matmul(x, w, group_sizes)
        case Op.GATE_UP_SWIGLU:
            return reference.gate_up_swiglu(x, w, group_sizes)
    raise AssertionError(op)


def _check(out, ref, *, padding_poisoned: bool):
    out = np.asarray(out.astype(jnp.float32), np.float64)
    defined = out[: ref.shape[0]]
    assert np.isfinite(defined).all(), f"{np.count_nonzero(~np.isfinite(defined))} outputs left unwritten (NaN)"
    error = np.linalg.norm(defined - ref) / np.linalg.norm(ref)
    assert error <= TOLERANCE, f"relative Frobenius error {error:.3g}"
    if padding_poisoned:  # The kernel skips padding rows, so their poison stays.
        assert np.isnan(out[ref.shape[0]:]).all()


def _run_case(rng, case: Case, fmt: str, op: Op, variant: Variant, *, compute_capability: int, interpret: bool,
              own_scales: bool = False):
    x, w, group_sizes = _inputs(rng, case, fmt, op, own_scales=own_scales)
    poisoned = jnp.full((case.m, case.n), jnp.nan, jnp.bfloat16)
    out = run(op, x, w, group_sizes, compute_capability=compute_capability, interpret=interpret, out=poisoned,
              variant=variant, check_bounds=interpret)
    if interpret:
        out, out_of_bounds = out
        assert int(out_of_bounds[0]) == 0, f"{int(out_of_bounds[0])} load/store lanes outside their buffers"
    _check(out, _reference(op, x, w, group_sizes), padding_poisoned=True)


@pytest.mark.parametrize("variant", list(Variant), ids=lambda v: v.value)
@pytest.mark.parametrize("op", list(Op), ids=lambda o: o.value)
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_interpret_matches_float64_reference(rng, case, fmt, op, variant):
    _run_case(rng, case, fmt, op, variant, compute_capability=90, interpret=True)


# Cases for gate/up with a global scale per half, in the interpreter (the GPU runs all of GPU_CASES).
OWN_SCALE_CASES = {name: CASES[name] for name in ("empty_and_one_row_groups", "m_not_a_tile_multiple",
                                                   "groups_sum_past_the_rows")}


@pytest.mark.parametrize("variant", list(Variant), ids=lambda v: v.value)
@pytest.mark.parametrize("case", OWN_SCALE_CASES.values(), ids=OWN_SCALE_CASES.keys())
def test_interpret_gate_up_with_own_global_scales(rng, case, variant):
    _run_case(rng, case, "nvfp4", Op.GATE_UP_SWIGLU, variant, compute_capability=90, interpret=True,
              own_scales=True)


def test_own_global_scales_matter(rng):
    """The check above can tell: one global scale for both halves misses the reference by far."""
    case = OWN_SCALE_CASES["empty_and_one_row_groups"]
    x, w, group_sizes = _inputs(rng, case, "nvfp4", Op.GATE_UP_SWIGLU, own_scales=True)
    gate_scale_only = dataclasses.replace(w, global_scale=w.global_scale[:, 0])
    wrong = reference.gate_up_swiglu(x, gate_scale_only, group_sizes)
    with pytest.raises(AssertionError, match="relative Frobenius error"):
        _check(jnp.asarray(wrong, jnp.bfloat16), reference.gate_up_swiglu(x, w, group_sizes), padding_poisoned=False)


def _gpu_capability() -> int:
    major, minor = jax.devices("gpu")[0].compute_capability.split(".")
    return 10 * int(major) + int(minor)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(Variant), ids=lambda v: v.value)
@pytest.mark.parametrize("op", list(Op), ids=lambda o: o.value)
@pytest.mark.parametrize("fmt", ["bf16", "nvfp4"])
@pytest.mark.parametrize("case", GPU_CASES.values(), ids=GPU_CASES.keys())
def test_gpu_matches_float64_reference(rng, case, fmt, op, variant):
    _run_case(rng, case, fmt, op, variant, compute_capability=_gpu_capability(), interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(Variant), ids=lambda v: v.value)
@pytest.mark.parametrize("case", GPU_CASES.values(), ids=GPU_CASES.keys())
def test_gpu_gate_up_with_own_global_scales(rng, case, variant):
    _run_case(rng, case, "nvfp4", Op.GATE_UP_SWIGLU, variant, compute_capability=_gpu_capability(),
              interpret=False, own_scales=True)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(Variant), ids=lambda v: v.value)
@pytest.mark.parametrize("op, own_scales", [(Op.MATMUL, False), (Op.GATE_UP_SWIGLU, False),
                                            (Op.GATE_UP_SWIGLU, True)],
                         ids=["matmul", "gate_up_swiglu", "gate_up_swiglu_own_scales"])
def test_gpu_ptx_and_exact_dequantization_agree(rng, op, own_scales, variant):
    """Both NVFP4 formulations build the same bf16 operand, so the outputs match bit for bit."""
    case = GPU_CASES["several_k_steps_and_row_tiles"]
    x, w, group_sizes = _inputs(rng, case, "nvfp4", op, own_scales=own_scales)
    outs = [run(op, x, w, group_sizes, compute_capability=_gpu_capability(), variant=variant, dequant=d)
            for d in (Dequant.PTX, Dequant.EXACT)]
    rows = reference.valid_rows(group_sizes, case.m)
    np.testing.assert_array_equal(np.asarray(outs[0][:rows]), np.asarray(outs[1][:rows]))


def _check_experts(out, x, w, group_sizes, oracle, experts):
    """:func:`_check` of every defined row (written, finite) and every padding row (poisoned),
    and of the float64 error on the rows of ``experts`` only: ``oracle`` (a ``reference``
    function) then dequantizes only those experts' weights."""
    sizes = np.maximum(np.asarray(group_sizes), 0)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    out64 = np.asarray(out.astype(jnp.float32), np.float64)
    defined = reference.valid_rows(group_sizes, out64.shape[0])
    assert np.isfinite(out64[:defined]).all(), f"{np.count_nonzero(~np.isfinite(out64[:defined]))} outputs unwritten"
    assert np.isnan(out64[defined:]).all()
    rows = np.concatenate([np.arange(starts[e], min(starts[e + 1], defined)) for e in experts])
    only = np.where(np.isin(np.arange(len(sizes)), experts), sizes, 0).astype(np.int32)
    ref = oracle(np.asarray(x)[rows], w, only)
    error = np.linalg.norm(out64[rows] - ref) / np.linalg.norm(ref)
    assert error <= TOLERANCE, f"relative Frobenius error {error:.3g} (experts {list(experts)})"


@pytest.mark.gpu
def test_gpu_public_functions_kimi_decode_shape(rng):
    """The public entries with the tile table's choice, at a Kimi K2 decode size (48 experts).

    Every output row is checked for being written, the float64 error on the rows of 12 experts
    (the first two, the last two, eight drawn): the host reference dequantizes one expert at a
    time, and all 48 of the three weights took most of the test's ~110 s in the GPU check
    (79698bd), for experts that run the same tiles (test_kimi_size_gpu.py checks the top of the
    expert range at Kimi K2's 384 experts)."""
    e, k, f, m = 48, 7168, 2048, 256
    experts = sorted({0, 1, e - 2, e - 1, *rng.choice(np.arange(2, e - 2), 8, replace=False).tolist()})
    group_sizes = jnp.asarray(rng.multinomial(m, np.full(e, 1 / e)), jnp.int32)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w_gate_up = _weights(rng, "nvfp4", e, 2 * f, k)
    cc = _gpu_capability()
    h = gate_up_swiglu(x, w_gate_up, group_sizes, compute_capability=cc,
                       out=jnp.full((m, f), jnp.nan, jnp.bfloat16))
    _check_experts(h, x, w_gate_up, group_sizes, reference.gate_up_swiglu, experts)
    own = _gate_up_own_scales(rng, e, f, k)
    h_own = gate_up_swiglu(x, own, group_sizes, compute_capability=cc, out=jnp.full((m, f), jnp.nan, jnp.bfloat16))
    _check_experts(h_own, x, own, group_sizes, reference.gate_up_swiglu, experts)
    w_down = _weights(rng, "nvfp4", e, k, f)
    y = grouped_matmul(h, w_down, group_sizes, compute_capability=cc, out=jnp.full((m, k), jnp.nan, jnp.bfloat16))
    _check_experts(y, h, w_down, group_sizes, reference.grouped_matmul, experts)


def test_poisoned_output_detects_an_unwritten_tile(rng):
    """The poison check itself: skipping the last row tile leaves NaN that the check reports."""
    case = CASES["all_rows_in_one_group"]
    x, w, group_sizes = _inputs(rng, case, "bf16", Op.MATMUL)
    short = jnp.asarray([0, case.m - 8, 0, 0, 0], jnp.int32)  # The kernel sees 8 fewer rows ...
    out = grouped_matmul(x, w, short, compute_capability=90, interpret=True,
                         out=jnp.full((case.m, case.n), jnp.nan, jnp.bfloat16))
    with pytest.raises(AssertionError, match="unwritten"):
        _check(out, reference.grouped_matmul(x, w, group_sizes), padding_poisoned=False)  # ... than the reference.


def test_bounds_check_sees_a_broken_schedule(rng, monkeypatch):
    """The bounds check itself: a tile schedule that forgets to cut rows at M makes the kernel
    read x and write out past their last row, which the interpreter alone would clamp."""
    case = CASES["groups_sum_past_the_rows"]
    x, w, group_sizes = _inputs(rng, case, "nvfp4", Op.MATMUL)
    schedule = pallas_triton.tile_schedule

    def unclipped(group_sizes_e, *, num_rows, block_m, num_tiles):
        return schedule(group_sizes_e, num_rows=2**30, block_m=block_m, num_tiles=num_tiles)

    monkeypatch.setattr(pallas_triton, "tile_schedule", unclipped)
    jax.clear_caches()  # The kernel is jit-cached by its spec: retrace with the broken schedule.
    try:
        _, out_of_bounds = run(Op.MATMUL, x, w, group_sizes, compute_capability=90, interpret=True,
                               check_bounds=True)
    finally:
        jax.clear_caches()
    # Expert 1 now owns rows 30..59 of a 37-row x: storing its rows 37..59 alone is 23 x N lanes
    # outside out (the reads of x add more, as many as the tiling makes).
    assert case.groups[:2] == (30, 30) and case.m == 37
    assert int(out_of_bounds[0]) >= 23 * case.n


def test_bounds_check_needs_interpret_mode(rng):
    x, w, group_sizes = _inputs(rng, CASES["minimum_k_and_n"], "bf16", Op.MATMUL)
    with pytest.raises(ValueError, match="check_bounds"):
        run(Op.MATMUL, x, w, group_sizes, compute_capability=90, check_bounds=True)


def test_public_functions_interpret(rng):
    case = CASES["empty_and_one_row_groups"]
    for fn, op in ((grouped_matmul, Op.MATMUL), (gate_up_swiglu, Op.GATE_UP_SWIGLU)):
        x, w, group_sizes = _inputs(rng, case, "nvfp4", op)
        out = fn(x, w, group_sizes, compute_capability=120, interpret=True)
        assert out.shape == (case.m, case.n) and out.dtype == jnp.bfloat16
        _check(out, _reference(op, x, w, group_sizes), padding_poisoned=False)


# --- the pieces the kernel is built from --------------------------------------------------------


def test_tile_schedule_covers_each_row_once(rng):
    for _ in range(8):
        e, m, bm = int(rng.integers(1, 9)), int(rng.integers(1, 200)), int(rng.choice([16, 32, 64]))
        sizes = rng.integers(0, 2 * m // e + 2, size=e)
        sizes[rng.random(e) < 0.3] = 0
        num_tiles = pallas_triton.max_tiles(m, e, bm)
        expert, start, end = (np.asarray(a) for a in pallas_triton.tile_schedule(
            jnp.asarray(sizes, jnp.int32), num_rows=m, block_m=bm, num_tiles=num_tiles))
        owner = np.full(m, -1)
        for t in range(num_tiles):
            rows = np.arange(start[t], min(start[t] + bm, end[t]))
            assert (owner[rows] == -1).all(), "a row is covered twice"
            owner[rows] = expert[t]
        expected = np.full(m, -1)
        bounds = np.minimum(np.concatenate([[0], np.cumsum(sizes)]), m)
        for i in range(e):
            expected[bounds[i]:bounds[i + 1]] = i
        np.testing.assert_array_equal(owner, expected)


def test_tile_schedule_at_kimi_size_covers_the_last_expert_and_has_no_loop(rng):
    """384 experts, rows on the last ones: the schedule is exact there, and is straight-line HLO
    (a device-side while loop would cost launches on every layer call)."""
    e, m, bm = 384, 256, 16
    sizes = np.zeros(e, np.int64)
    sizes[rng.choice(e - 8, 24, replace=False)] = 8
    sizes[-8:] = 8  # experts 376..383
    schedule = jax.jit(functools.partial(pallas_triton.tile_schedule, num_rows=m, block_m=bm,
                                         num_tiles=pallas_triton.max_tiles(m, e, bm)))
    assert "stablehlo.while" not in schedule.lower(jnp.asarray(sizes, jnp.int32)).as_text()
    expert, start, end = (np.asarray(a) for a in schedule(jnp.asarray(sizes, jnp.int32)))
    used = end > start
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    np.testing.assert_array_equal(expert[used], np.flatnonzero(sizes))  # one tile of 8 rows each
    np.testing.assert_array_equal(start[used], bounds[:-1][sizes > 0])
    np.testing.assert_array_equal(end[used], bounds[1:][sizes > 0])


def test_exact_dequantization_matches_reference(rng):
    e, n, k = 2, 16, 64
    t = nvfp4.quantize(jnp.asarray(rng.standard_normal((e, n, k)), jnp.float32))
    scales_u8 = jax.lax.bitcast_convert_type(t.scales, jnp.uint8)
    want = reference.dequantize(t.packed, t.scales, t.global_scale)
    dequantize_tile = jax.jit(pallas_triton.dequantize_tile, static_argnums=(2, 3))  # one compilation, not one per op
    for i in range(e):
        tile = dequantize_tile(t.packed[i], scales_u8[i], Dequant.EXACT, pallas_triton.Order.MODELOPT)
        got = np.asarray(tile.astype(jnp.float32), np.float64) * 2.0**pallas_triton.OPERAND_EXPONENT_DEFICIT
        np.testing.assert_array_equal(got * float(t.global_scale[i]), want[i])


def test_fragment_order_is_a_consistent_permutation_of_k(rng):
    n, k = 16, 128
    t = nvfp4.quantize(jnp.asarray(rng.standard_normal((1, n, k)), jnp.float32))
    scales_u8 = jax.lax.bitcast_convert_type(t.scales, jnp.uint8)
    dequantize_tile = jax.jit(pallas_triton.dequantize_tile, static_argnums=(2, 3))  # one compilation, not one per op
    tiles = {order: dequantize_tile(t.packed[0], scales_u8[0], Dequant.EXACT, order)
             for order in pallas_triton.Order}
    np.testing.assert_array_equal(np.asarray(tiles[pallas_triton.Order.FRAGMENT]),
                                  np.asarray(pallas_triton.permute_k(tiles[pallas_triton.Order.MODELOPT])))
    perm = np.asarray(pallas_triton.permute_k(jnp.arange(k)[None]))[0]
    assert sorted(perm.tolist()) == list(range(k))
    assert (perm // 32 == np.arange(k) // 32).all()  # It stays inside 32-element blocks.
    x = jnp.asarray(rng.standard_normal((3, k)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(pallas_triton.permute_k(x)), np.asarray(x)[:, perm])


# --- argument checking -------------------------------------------------------------------------


def _valid(rng):
    x, w, group_sizes = _inputs(rng, CASES["minimum_k_and_n"], "nvfp4", Op.MATMUL)
    return x, w, group_sizes


@pytest.mark.parametrize("mutate, name", [
    (lambda x, w, g: (x.astype(jnp.float32), w, g), "x_mk"),
    (lambda x, w, g: (x[:, :48], w, g), "x_mk"),
    (lambda x, w, g: (x, w, g[None]), "group_sizes_e"),
    (lambda x, w, g: (x, w, g.astype(jnp.int16)), "group_sizes_e"),
    (lambda x, w, g: (x, w, g[:2]), "w.packed"),
    (lambda x, w, g: (x, dataclasses.replace(w, scales=w.scales.astype(jnp.float32)), g), "w.scales"),
    (lambda x, w, g: (x, dataclasses.replace(w, packed=w.packed[:, :, :16]), g), "w.packed"),
    (lambda x, w, g: (x, dataclasses.replace(w, global_scale=w.global_scale[:1]), g), "w.global_scale"),
    (lambda x, w, g: (x, nvfp4.dequantize(w, jnp.float32), g), "w"),
    (lambda x, w, g: (x, nvfp4.dequantize(w, jnp.bfloat16)[:, :8], g), "w"),
], ids=["x_dtype", "k_not_multiple_of_64", "group_sizes_rank", "group_sizes_dtype", "mismatched_experts", "scales_dtype",
        "packed_k", "global_scale_shape", "w_float32", "n_not_multiple_of_16"])
def test_bad_arguments_raise_naming_the_argument(rng, mutate, name):
    x, w, g = mutate(*_valid(rng))
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        grouped_matmul(x, w, g, compute_capability=90, interpret=True)


def test_global_scale_shapes_each_op_takes(rng):
    """grouped_matmul: ``[E]`` only; gate_up_swiglu: ``[E]`` or ``[E, 2]`` (gate's, up's)."""
    x, w, g = _valid(rng)
    e = w.global_scale.shape[0]
    per_half = dataclasses.replace(w, global_scale=jnp.stack([w.global_scale, w.global_scale], axis=1))
    with pytest.raises(ValueError, match=rf"^w\.global_scale: shape \({e}, 2\), expected \({e},\) for E={e} "
                                         r"experts \(group_sizes_e\): one per expert$"):
        grouped_matmul(x, per_half, g, compute_capability=90, interpret=True)
    xg, w_gate_up, gg = _inputs(rng, CASES["minimum_k_and_n"], "nvfp4", Op.GATE_UP_SWIGLU)
    for bad, expected in ((w_gate_up.global_scale[:, None, None], "float32 of rank 1 or 2"),
                          (jnp.ones((e, 3), jnp.float32), f"({e},) or ({e}, 2)"),
                          (w_gate_up.global_scale[:1], f"({e},) or ({e}, 2)"),
                          (jnp.ones((e + 1, 2), jnp.float32), f"({e},) or ({e}, 2)")):
        with pytest.raises(ValueError, match=r"^w_gate_up\.global_scale: .*expected " + re.escape(expected)):
            gate_up_swiglu(xg, dataclasses.replace(w_gate_up, global_scale=bad), gg, compute_capability=90,
                           interpret=True)
    with pytest.raises(ValueError, match=r"^KernelSpec\.scale_groups: 2, expected one of \(1,\) for matmul"):
        dataclasses.replace(pallas_triton.KernelSpec(
            variant=Variant.DECODE, weights=tuning.WeightFormat.NVFP4, op=Op.MATMUL, dequant=Dequant.EXACT,
            config=tuning.TILE_TABLE[90][(Variant.DECODE, tuning.WeightFormat.NVFP4, Op.MATMUL)], num_rows=16, k=64,
            n_out=16, block_k=64, block_n=16, max_tiles=2, aliased=False), scale_groups=2)


def test_reference_dequantize_decodes_every_byte_at_every_scale():
    """Each packed byte, both nibbles, at each finite E4M3 block scale, against E2M1 decoded from
    its bits here (sign, two exponent bits, one mantissa bit), times the scale and a global one."""

    def e2m1(code: int) -> float:
        exponent, mantissa = (code >> 1) & 3, code & 1
        magnitude = mantissa * 0.5 if exponent == 0 else (1 + mantissa / 2) * 2.0 ** (exponent - 1)
        return -magnitude if code & 8 else magnitude

    scale_bits = np.array([b for b in range(256) if b & 0x7F != 0x7F], np.uint8)  # 0x7F, 0xFF: NaN
    packed = np.broadcast_to(np.arange(256, dtype=np.uint8), (1, len(scale_bits), 256))
    scales = np.broadcast_to(scale_bits[None, :, None], (1, len(scale_bits), 32)).view(ml_dtypes.float8_e4m3fn)
    global_scale = np.float32(0.37)
    pairs = np.array([[e2m1(byte & 0xF), e2m1(byte >> 4)] for byte in range(256)]).reshape(-1)
    want = pairs[None, None, :] * scales[..., :1].astype(np.float64) * np.float64(global_scale)
    got = reference.dequantize(packed, scales, np.asarray([global_scale]))
    assert got.dtype == np.float64 and got.shape == (1, len(scale_bits), 512)
    np.testing.assert_array_equal(got, want)


def test_reference_dequantize_applies_each_groups_scale(rng):
    t = nvfp4.quantize(jnp.asarray(rng.standard_normal((3, 32, 64)), jnp.float32))
    per_matrix = reference.dequantize(t.packed, t.scales, t.global_scale)
    factors = np.asarray([[1.0, 2.0, 4.0, 0.5]], np.float32)
    grouped = reference.dequantize(t.packed, t.scales, np.asarray(t.global_scale)[:, None] * factors)
    np.testing.assert_array_equal(grouped, per_matrix * np.repeat(factors, 8, axis=1)[:, :, None])
    with pytest.raises(ValueError, match=r"^global_scale: shape \(3, 3\), expected \[3\] or \[3, G\] with G "
                                         r"dividing N=32$"):
        reference.dequantize(t.packed, t.scales, np.ones((3, 3), np.float32))


def test_bad_out_capability_and_fused_rows_raise(rng):
    x, w, g = _valid(rng)
    with pytest.raises(ValueError, match="compute_capability"):
        grouped_matmul(x, w, g, compute_capability=75, interpret=True)
    with pytest.raises(ValueError, match="out"):
        grouped_matmul(x, w, g, compute_capability=90, interpret=True, out=jnp.zeros((x.shape[0], 8), jnp.bfloat16))
    with pytest.raises(ValueError, match="w_gate_up"):
        gate_up_swiglu(x, w, g, compute_capability=90, interpret=True)  # F = 8: not a multiple of 16.


# --- tuning ------------------------------------------------------------------------------------


def test_every_table_row_has_every_kernel_and_fits_shared_memory():
    keys = {(v, f, o) for v in tuning.Variant for f in tuning.WeightFormat for o in tuning.Op}
    for capability, row in tuning.TILE_TABLE.items():
        assert set(row) == keys, capability
        for key, cfg in row.items():
            assert cfg.shared_memory_estimate(*key) <= tuning.SHARED_MEMORY_BYTES[capability], (capability, key, cfg)


def test_variant_heuristic():
    def pick(m, e=48, cc=90):
        return tuning.choose_variant(num_rows=m, num_experts=e, compute_capability=cc)

    assert pick(128) is pick(512) is Variant.DECODE
    assert pick(8192) is pick(32768) is Variant.PREFILL
    assert pick(512, e=2) is Variant.PREFILL  # 256 rows an expert: weight tiles are reused anyway.
    with pytest.raises(ValueError, match="compute_capability"):
        pick(128, cc=70)


def test_fit_block():
    assert tuning.fit_block(256, 7168, 64) == 256
    assert tuning.fit_block(256, 192, 64) == 64
    assert tuning.fit_block(128, 48, 16) == 16
