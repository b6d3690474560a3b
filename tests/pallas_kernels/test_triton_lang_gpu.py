"""The Triton-language NVFP4 kernels (``pallas_kernels.grouped_matmul.triton_lang``) on a GPU.

W4A16 runs below SM100 (the H200 here), W4A4 on SM100/SM120; each test runs the mode of the
GPU it finds; the W4A16 input-gradient kernel (``triton_lang.input_grad``) runs below SM100. Their
CPU twins execute the same kernels in Triton's interpreter (``tests/interpreter/``), and the
CPU suite cross-compiles every tile configuration (``test_triton_lang_crosscompile.py``).

Every test compares against a float64 reference of the same NVFP4 weights (and, for W4A4, of
the same quantized activations), writes into NaN-poisoned ``out`` buffers and checks that
padding rows keep their poison. The Kimi K2-size test reuses the harness of
``test_kimi_size_gpu.py`` (384 experts, the top expert ids, offsets past 2**31 bytes).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_kimi_size_gpu import F, H, _capability, _check_top_experts, expert_reference

from moe_jax import nvfp4
from moe_jax.nvfp4 import NVFP4Tensor
from pallas_kernels.grouped_matmul import dequantized_copy, reference
from pallas_kernels.grouped_matmul.tuning import Op, Variant
from w4a8_float64 import e4m3_round, rows_as_multiplied

triton_lang = pytest.importorskip("pallas_kernels.grouped_matmul.triton_lang", reason="needs triton")
TOLERANCE = 1e-2


def _random_nvfp4(rng, e: int, n: int, k: int, groups: int = 1) -> NVFP4Tensor:
    scales = rng.uniform(0.5, 1.5, (e, n, k // 16)).astype(jnp.float8_e4m3fn)
    global_scale = rng.uniform(0.5, 2.0, (e, groups) if groups > 1 else (e,)) / (6 * np.sqrt(k))
    return NVFP4Tensor(packed=jnp.asarray(rng.integers(0, 256, (e, n, k // 2), np.uint8)),
                       scales=jnp.asarray(scales), global_scale=jnp.asarray(global_scale, jnp.float32))


def _rows_for(mode, x_mk):
    """The kernel's activation operand for ``mode`` and the float64 rows it stands for."""
    match mode:
        case triton_lang.Mode.W4A16:
            return x_mk, np.asarray(x_mk, np.float64)
        case triton_lang.Mode.W4A4:
            packed, scales, global_m = nvfp4.quantize_rows(x_mk)
            exact = reference.dequantize(np.asarray(packed)[:, None], np.asarray(scales)[:, None], np.asarray(global_m))
            return triton_lang.NVFP4Rows(packed, scales, global_m), exact[:, 0]
    raise AssertionError(mode)


def _check(rng, op: Op, num_experts: int, k: int, n_out: int, sizes: np.ndarray, padding: int, groups: int = 1,
           wrap=lambda f: f, tile=None):
    cc = _capability()
    mode = triton_lang.mode_for(cc)
    n_w = 2 * n_out if op is Op.GATE_UP_SWIGLU else n_out
    w = _random_nvfp4(rng, num_experts, n_w, k, groups)
    m = int(sizes.sum()) + padding
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    rows, x64 = _rows_for(mode, x)
    poisoned = jnp.full((m, n_out), jnp.nan, jnp.bfloat16)
    call = wrap(jax.jit(functools.partial(triton_lang.run, op, compute_capability=cc, tile=tile)))
    y = np.asarray(call(rows, w, jnp.asarray(sizes, jnp.int32), out=poisoned).astype(jnp.float32), np.float64)
    defined = int(sizes.sum())
    ref = (reference.gate_up_swiglu if op is Op.GATE_UP_SWIGLU else reference.grouped_matmul)(x64, w, sizes)
    assert np.isfinite(y[:defined]).all(), f"{np.count_nonzero(~np.isfinite(y[:defined]))} defined elements unwritten"
    assert np.isnan(y[defined:]).all(), "padding rows were written"
    rel = np.linalg.norm(y[:defined] - ref) / np.linalg.norm(ref)
    assert rel < TOLERANCE, f"{mode.value} {op.value} SM{cc}: relative Frobenius error {rel:.3g}"
    return rel


@pytest.mark.gpu
@pytest.mark.parametrize("op,groups", [(Op.MATMUL, 1), (Op.GATE_UP_SWIGLU, 1), (Op.GATE_UP_SWIGLU, 2)])
@pytest.mark.parametrize("rows_per_expert", [3, 150])  # the decode and the prefill tiles
def test_native_matches_float64_reference(rng, op, groups, rows_per_expert):
    e = 12
    sizes = rng.integers(0, 2 * rows_per_expert, e).astype(np.int32)
    sizes[[0, 5, e - 1]] = [0, rows_per_expert, 0]  # empty first and last experts
    _check(rng, op, e, 512, 384, sizes, padding=37, groups=groups)


@pytest.mark.gpu
@pytest.mark.parametrize("op", [Op.MATMUL, Op.GATE_UP_SWIGLU], ids=lambda op: op.value)
def test_native_row_paths_at_their_boundaries(rng, op):
    """The SM90 prefill tiles' three row paths (tail, ``block_m`` and ``block_m + extra_m`` rows
    in two MMAs sharing one dequantization): experts of each path's size, one row more and one
    less, among empty ones, at 384 experts with the last ones used."""
    if _capability() not in triton_lang.MANY_ROWS_TILES:
        pytest.skip(f"SM{_capability()} has no many-rows tiles (measured on SM90 only)")
    e, tail, block, extra = 384, 64, 128, 64
    sizes = np.zeros(e, np.int32)
    sizes[[0, 1, 2, 3, 5, 7, 100, 380, 381, 382, 383]] = [
        tail, tail + 1, block, block + 1, block + extra, block + extra + 1, tail - 1, 1, block + extra - 1,
        2 * (block + extra) + tail, 3 * (block + extra) + tail + 1]
    tile = triton_lang.MANY_ROWS_TILES[90][Op.MATMUL] if op is Op.MATMUL else triton_lang.NATIVE_TILES[90][(Variant.PREFILL, op)]
    assert (tile.tail_m, tile.block_m, tile.extra_m) == (tail, block, extra), tile
    _check(rng, op, e, 256, 128, sizes, padding=29, tile=tile)


@pytest.mark.gpu
@pytest.mark.parametrize("experts", [64, 1], ids=["routed", "shared"])
@pytest.mark.parametrize("op", [Op.MATMUL, Op.GATE_UP_SWIGLU], ids=lambda op: op.value)
def test_native_at_the_serving_soaks_shapes(rng, op, experts):
    """Every bucket of ``test_serving_gpu.py``'s soak (``test_serving.GPU_BUCKETS``: 16, 64, 256,
    512, 2048 and 8192 tokens, top-8 of 64 experts at H=1024, F=512, and its shared expert as one
    group of all tokens), part-filled as a bucket is: each tile family (decode, one group, between
    decode and prefill, prefill with tails and extra rows, many rows, wide) at row counts the layer
    gives it, with the unfilled rows NaN-poisoned. Each bucket is a compilation of its own (the
    tile count is a constant of the kernel): the soak's six give every tile that
    ``token_buckets(8192)``'s ten would (the test below checks that)."""
    from test_serving import GPU_BUCKETS

    h, f, top_k = 1024, 512, 8
    k, n_out = (h, f) if op is Op.GATE_UP_SWIGLU else (f, h)
    rows_per_token = top_k if experts > 1 else 1
    for i, bucket in enumerate(GPU_BUCKETS):  # a token count that lands in each bucket, the last one full
        fewest = GPU_BUCKETS[i - 1] + 1 if i else 1
        tokens = bucket if i == len(GPU_BUCKETS) - 1 else int(rng.integers(fewest, bucket + 1))
        sizes = rng.multinomial(tokens * rows_per_token, rng.dirichlet(np.ones(experts))).astype(np.int32)
        _check(rng, op, experts, k, n_out, sizes, padding=(bucket - tokens) * rows_per_token)


@pytest.mark.parametrize("experts", [64, 1], ids=["routed", "shared"])
@pytest.mark.parametrize("op", [Op.MATMUL, Op.GATE_UP_SWIGLU], ids=lambda op: op.value)
@pytest.mark.parametrize("capability", sorted(triton_lang.NATIVE_TILES))
def test_the_soaks_buckets_reach_every_tile_of_every_bucket_size(op, experts, capability):
    """The soak's buckets (``test_serving.GPU_BUCKETS``) give each op the same tiles as every
    size of ``token_buckets(8192)`` would: the GPU soak and the test above lose no tile by
    compiling six buckets instead of ten (host logic, on the CPU)."""
    from test_serving import GPU_BUCKETS

    from moe_jax.serving import token_buckets

    h, f, top_k = 1024, 512, 8
    k, n_out = (h, f) if op is Op.GATE_UP_SWIGLU else (f, h)
    rows_per_token = top_k if experts > 1 else 1

    def tiles(buckets):
        return {triton_lang.make_spec(op, triton_lang.mode_for(capability), num_rows=b * rows_per_token,
                                      num_experts=experts, k=k, n_out=n_out, scale_groups=1,
                                      compute_capability=capability).tile for b in buckets}

    assert set(GPU_BUCKETS) <= set(token_buckets(8192)) and GPU_BUCKETS[-1] == 8192
    assert tiles(GPU_BUCKETS) == tiles(token_buckets(8192))


@pytest.mark.gpu
@pytest.mark.parametrize("rows_per_expert", [3, 150])
def test_native_gate_up_writes_the_down_kernels_column_order(rng, rows_per_expert):
    """``out_k_order``/``x_k_order`` (W4A16): the gate/up output in the down kernel's column
    order is the natural output permuted (bit for bit), and the down kernel reading it so gives
    the same rows as reading the natural output."""
    cc = _capability()
    if triton_lang.mode_for(cc) is not triton_lang.Mode.W4A16:
        pytest.skip(f"SM{cc} runs W4A4: the column orders are the W4A16 kernels'")
    e, k, f, h = 12, 512, 256, 384
    sizes = rng.integers(0, 2 * rows_per_expert, e).astype(np.int32)
    sizes[-1] = 0
    m, defined = int(sizes.sum()) + 7, int(sizes.sum())
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w_gu, w_d, g = _random_nvfp4(rng, e, 2 * f, k), _random_nvfp4(rng, e, h, f), jnp.asarray(sizes)
    order = triton_lang.k_order(Op.MATMUL, num_rows=m, num_experts=e, k=f, n_out=h, compute_capability=cc)
    run = jax.jit(triton_lang.run, static_argnums=0, static_argnames=("compute_capability", "out_k_order", "x_k_order"))
    natural = run(Op.GATE_UP_SWIGLU, x, w_gu, g, compute_capability=cc)
    ordered = run(Op.GATE_UP_SWIGLU, x, w_gu, g, compute_capability=cc, out_k_order=order)
    np.testing.assert_array_equal(np.asarray(triton_lang.permute_k(natural, order)[:defined]), np.asarray(ordered[:defined]))
    y_natural = run(Op.MATMUL, natural, w_d, g, compute_capability=cc)
    y_ordered = run(Op.MATMUL, ordered, w_d, g, compute_capability=cc, x_k_order=order)
    np.testing.assert_array_equal(np.asarray(y_natural[:defined]), np.asarray(y_ordered[:defined]))
    assert np.isfinite(np.asarray(y_ordered[:defined], np.float32)).all()


@pytest.mark.gpu
def test_native_under_shard_map_with_vma_checks(rng):
    """Inside ``shard_map(check_vma=True)`` on a one-device mesh: the output must carry the
    operands' varying axes (jax_triton's primitive drops them; ``triton_lang`` casts them back)."""
    mesh = jax.make_mesh((1,), ("expert",), devices=jax.devices("gpu")[:1])
    spec = jax.sharding.PartitionSpec("expert")

    def wrap(call):
        sharded = jax.jit(jax.shard_map(lambda r, w, s, o: call(r, w, s, out=o), mesh=mesh,
                                        in_specs=(spec, spec, spec, spec), out_specs=spec, check_vma=True))

        def placed(*args, out):
            return sharded(*jax.device_put((*args, out), jax.sharding.NamedSharding(mesh, spec)))
        return placed

    sizes = rng.integers(1, 40, 8).astype(np.int32)
    _check(rng, Op.GATE_UP_SWIGLU, 8, 256, 128, sizes, padding=5, wrap=wrap)


@pytest.mark.gpu(count=2)
def test_native_on_two_gpus_each_with_its_own_experts(rng):
    """Expert parallelism's local step: each of 2 GPUs runs its half of the experts on its rows."""
    cc = _capability()
    mode = triton_lang.mode_for(cc)
    e_local, k, n = 6, 256, 192
    mesh = jax.make_mesh((2,), ("expert",), devices=jax.devices("gpu")[:2])
    spec = jax.sharding.PartitionSpec("expert")
    w = _random_nvfp4(rng, 2 * e_local, n, k)
    sizes = rng.integers(0, 30, 2 * e_local).astype(np.int32)
    m = int(max(sizes[:e_local].sum(), sizes[e_local:].sum())) + 3
    x = jnp.asarray(rng.standard_normal((2 * m, k)), jnp.bfloat16)
    rows, x64 = _rows_for(mode, x)

    @jax.jit
    def run(rows, w, sizes):
        return jax.shard_map(lambda r, w, s: triton_lang.run(Op.MATMUL, r, w, s, compute_capability=cc), mesh=mesh,
                             in_specs=(spec, spec, spec), out_specs=spec, check_vma=True)(rows, w, sizes)

    placed = jax.device_put((rows, w, jnp.asarray(sizes)), jax.sharding.NamedSharding(mesh, spec))
    y = np.asarray(run(*placed).astype(jnp.float32), np.float64)
    for d in range(2):
        local = sizes[d * e_local:(d + 1) * e_local]
        w_local = jax.tree.map(lambda a: a[d * e_local:(d + 1) * e_local], w)
        ref = reference.grouped_matmul(x64[d * m:(d + 1) * m], w_local, local)
        got = y[d * m:d * m + len(ref)]
        rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        assert rel < TOLERANCE, f"device {d}: relative Frobenius error {rel:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["gate_up_swiglu", "down"])
def test_native_kimi_size_top_experts_match_float64_reference(rng, record_property, op):
    """384 experts, the top expert ids (down projection codes past 2**31 bytes), NaN-poisoned
    outputs: the harness of ``test_kimi_size_gpu.py`` with the native kernel, and its
    ``mid_top8`` routing (``triton_lang.MID_TILES``' row counts)."""
    cc = _capability()
    mode = triton_lang.mode_for(cc)
    kernel_op, n, k, n_out = {"gate_up_swiglu": (Op.GATE_UP_SWIGLU, 2 * F, H, F), "down": (Op.MATMUL, H, F, H)}[op]

    def kernel(x, w, sizes, *, compute_capability, out):
        return triton_lang.run(kernel_op, _rows_for(mode, x)[0], w, sizes, compute_capability=compute_capability, out=out)

    def expert_fn(x_mk, w_nk):
        if mode is triton_lang.Mode.W4A4:  # the rows the kernel saw: quantized per row, as on the device
            x_mk = _rows_for(mode, jnp.asarray(x_mk, jnp.bfloat16))[1]
        return expert_reference(op, x_mk, w_nk)

    _check_top_experts(rng, record_property, f"native {mode.value} {op}", kernel, "nvfp4", (n, k), k, n_out, expert_fn,
                       mid_rows=True)


@pytest.mark.gpu
def test_native_wide_tile_at_kimi_size_top_experts_matches_float64_reference(rng, record_property):
    """``WIDE_TILES``' 256-row W4A16 down-projection tile (taken from ``WIDE_ROWS_PER_EXPERT`` rows
    per expert) on the Kimi-size harness: 384 experts, the top expert ids (codes past 2**31
    bytes), every routing, NaN-poisoned outputs."""
    cc = _capability()
    if cc not in triton_lang.WIDE_TILES:
        pytest.skip(f"SM{cc} has no wide tiles (W4A16 on SM{sorted(triton_lang.WIDE_TILES)})")
    tile = triton_lang.WIDE_TILES[cc][Op.MATMUL]

    def kernel(x, w, sizes, *, compute_capability, out):
        return triton_lang.run(Op.MATMUL, x, w, sizes, compute_capability=compute_capability, out=out, tile=tile)

    _check_top_experts(rng, record_property, "native wide down", kernel, "nvfp4", (H, F), F, H,
                       lambda x_mk, w_nk: expert_reference("down", x_mk, w_nk))


@pytest.mark.gpu
@pytest.mark.large_gpu_memory
@pytest.mark.parametrize("op", ["gate_up_swiglu", "down"])
def test_native_bf16_through_a_copy_at_kimi_size_top_experts_matches_float64_reference(rng, record_property, op):
    """The products of ``dequantized_forward`` (many rows per expert): the bf16 kernels on the
    exact bf16 copy of all 384 NVFP4 experts (``dequantized_copy``: each copy past 2**31
    elements), the global scales on the accumulators; the top expert ids, every routing,
    NaN-poisoned outputs."""
    cc = _capability()
    if cc not in triton_lang.BF16_TILES:
        pytest.skip(f"SM{cc} has no native bf16 tiles (measured on SM90 only)")
    kernel_op, n, k, n_out = {"gate_up_swiglu": (Op.GATE_UP_SWIGLU, 2 * F, H, F), "down": (Op.MATMUL, H, F, H)}[op]

    def kernel(x, w, sizes, *, compute_capability, out):
        return triton_lang.bf16_matmul(kernel_op, x, dequantized_copy(w), sizes, compute_capability=compute_capability,
                                       out=out, global_scale=w.global_scale)

    _check_top_experts(rng, record_property, f"native bf16 copy {op}", kernel, "nvfp4", (n, k), k, n_out,
                       lambda x_mk, w_nk: expert_reference(op, x_mk, w_nk))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", pytest.param("bf16", marks=pytest.mark.large_gpu_memory)])
def test_native_kimi_size_rows_read_by_index_match_float64_reference(rng, record_property, fmt):
    """The native gate/up kernel reading its rows in place by index (``row_token_m``, as the layer
    calls it), W4A16 and bf16: the tokens are the rows in a random order, so every row's index is
    far from its position; 384 experts, the top expert ids, NaN-poisoned outputs."""
    cc = _capability()
    if fmt == "nvfp4" and triton_lang.mode_for(cc) is not triton_lang.Mode.W4A16:
        pytest.skip(f"SM{cc} runs W4A4, whose rows are quantized per row before the kernel: never read by index")
    if fmt == "bf16" and cc not in triton_lang.BF16_TILES:
        pytest.skip(f"SM{cc} has no native bf16 tiles")
    order = np.random.default_rng(int(rng.integers(1 << 31)))

    def kernel(x, w, sizes, *, compute_capability, out):
        row_token = order.permutation(x.shape[0]).astype(np.int32)
        tokens = jnp.zeros_like(x).at[jnp.asarray(row_token)].set(x)  # tokens[row_token[m]] = x[m]
        if fmt == "bf16":
            return triton_lang.bf16_matmul(Op.GATE_UP_SWIGLU, tokens, w, sizes, compute_capability=compute_capability,
                                           out=out, row_token_m=jnp.asarray(row_token))
        return triton_lang.run(Op.GATE_UP_SWIGLU, tokens, w, sizes, compute_capability=compute_capability, out=out,
                               row_token_m=jnp.asarray(row_token))

    _check_top_experts(rng, record_property, f"native {fmt} gate_up_swiglu by index", kernel, fmt, (2 * F, H), H, F,
                       lambda x_mk, w_nk: expert_reference("gate_up_swiglu", x_mk, w_nk), mid_rows=fmt == "nvfp4")


def _input_grad_capability() -> int:
    cc = _capability()
    if cc not in triton_lang.INPUT_GRAD_TILES:
        pytest.skip(f"SM{cc} has no W4A16 input-gradient tiles")
    return cc


@pytest.mark.gpu
@pytest.mark.parametrize("rows_per_expert", [3, 150])  # both tiles of the table
def test_native_input_grad_matches_float64_reference(rng, rows_per_expert):
    """``dy @ W_e`` into a NaN-poisoned buffer: defined rows against float64, padding rows kept."""
    cc = _input_grad_capability()
    e, n, k = 12, 384, 512
    sizes = rng.integers(0, 2 * rows_per_expert, e).astype(np.int32)
    sizes[[0, 5, e - 1]] = [0, rows_per_expert, 0]
    w = _random_nvfp4(rng, e, n, k)
    m, defined = int(sizes.sum()) + 37, int(sizes.sum())
    dy = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
    poisoned = jnp.full((m, k), jnp.nan, jnp.bfloat16)
    call = jax.jit(functools.partial(triton_lang.input_grad, compute_capability=cc))
    got = np.asarray(call(dy, w, jnp.asarray(sizes), out=poisoned).astype(jnp.float32), np.float64)
    dense = reference.dequantize(np.asarray(w.packed), np.asarray(w.scales), np.asarray(w.global_scale))
    starts = np.concatenate([[0], np.cumsum(sizes)])
    want = np.concatenate([np.asarray(dy[starts[i]:starts[i + 1]], np.float64) @ dense[i] for i in range(e)])
    assert np.isfinite(got[:defined]).all(), f"{np.count_nonzero(~np.isfinite(got[:defined]))} elements unwritten"
    assert np.isnan(got[defined:]).all(), "padding rows were written"
    rel = np.linalg.norm(got[:defined] - want) / np.linalg.norm(want)
    assert rel < TOLERANCE, f"input_grad SM{cc}: relative Frobenius error {rel:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["gate_up_swiglu", "down"])
def test_native_input_grad_kimi_size_top_experts_match_float64_reference(rng, record_property, op):
    """``dy @ W_e`` at 384 experts, the top expert ids (down codes past 2**31 bytes), NaN-poisoned."""
    _input_grad_capability()
    n, k = {"gate_up_swiglu": (2 * F, H), "down": (H, F)}[op]
    _check_top_experts(rng, record_property, f"native input_grad {op}", triton_lang.input_grad, "nvfp4", (n, k), n, k,
                       lambda dy_mn, w_nk: dy_mn @ w_nk)


# --- bf16 weights (Mode.BF16: the native schedule, nothing dequantized) -----------------------


def _bf16_capability() -> int:
    cc = _capability()
    if cc not in triton_lang.BF16_TILES:
        pytest.skip(f"SM{cc} has no native bf16 tiles (measured on SM90 only)")
    return cc


def _row_path_sizes(tile) -> np.ndarray:
    """Group sizes at 384 experts, the last ones used, one row either side of each row path of
    ``tile`` (a tail, ``block_m``, ``block_m + extra_m``, several tiles), empty experts between."""
    tail, block, full = tile.tail_m, tile.block_m, tile.block_m + tile.extra_m
    sizes = np.zeros(384, np.int32)
    paths = ([tail, tail + 1, block, block + 1, full, full + 1, tail - 1, 1, full - 1, 2 * full + tail,
              3 * full + tail + 1] if tail else
             [1, block - 1, block, block + 1, 2 * block - 1, 2 * block, 2 * block + 1, block // 2, 7, 3 * block + 1,
              4 * block - 1])
    sizes[[0, 1, 2, 3, 5, 7, 100, 380, 381, 382, 383]] = paths
    return sizes


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", ["table", "many_rows"])
@pytest.mark.parametrize("op,transpose_w", [(Op.MATMUL, False), (Op.MATMUL, True), (Op.GATE_UP_SWIGLU, False)],
                         ids=["matmul", "matmul_transposed_w", "gate_up_swiglu"])
def test_native_bf16_row_paths_at_their_boundaries(rng, op, transpose_w, tiles):
    """The bf16 prefill tiles' row paths (``BF16_TILES``: tail, ``block_m``, ``block_m +
    extra_m``; ``BF16_MANY_ROWS_TILES``: 256-row tiles) with experts one row either side of each,
    empty ones between, 384 experts with the last used; a NaN-poisoned output whose padding rows
    must keep their poison; float64 reference."""
    cc = _bf16_capability()
    tile = triton_lang.BF16_TILES[cc][op] if tiles == "table" else triton_lang.BF16_MANY_ROWS_TILES[cc][op, transpose_w]
    e, k, n_out = 384, 256, 128
    sizes = _row_path_sizes(tile)
    n_w = 2 * n_out if op is Op.GATE_UP_SWIGLU else n_out
    w64 = rng.standard_normal((e, n_w, k)) / np.sqrt(k)
    w = jnp.asarray(np.swapaxes(w64, 1, 2) if transpose_w else w64, jnp.bfloat16)
    w64 = np.asarray(w.astype(jnp.float32), np.float64)
    w64 = np.swapaxes(w64, 1, 2) if transpose_w else w64  # [E, N_W, K] either way
    m, defined = int(sizes.sum()) + 29, int(sizes.sum())
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    poisoned = jnp.full((m, n_out), jnp.nan, jnp.bfloat16)
    call = jax.jit(functools.partial(triton_lang.bf16_matmul, op, compute_capability=cc, transpose_w=transpose_w,
                                     tile=tile))
    y = np.asarray(call(x, w, jnp.asarray(sizes), out=poisoned).astype(jnp.float32), np.float64)
    x64, starts = np.asarray(x, np.float64), np.concatenate([[0], np.cumsum(sizes)])
    want = np.concatenate([expert_reference("gate_up_swiglu" if op is Op.GATE_UP_SWIGLU else "down",
                                            x64[starts[i]:starts[i + 1]], w64[i]) for i in range(e)])
    assert np.isfinite(y[:defined]).all(), f"{np.count_nonzero(~np.isfinite(y[:defined]))} defined elements unwritten"
    assert np.isnan(y[defined:]).all(), "padding rows were written"
    rel = np.linalg.norm(y[:defined] - want) / np.linalg.norm(want)
    assert rel < TOLERANCE, f"bf16 {op.value} transpose_w={transpose_w} {tile}: relative Frobenius error {rel:.3g}"


@pytest.mark.gpu
@pytest.mark.large_gpu_memory
@pytest.mark.parametrize("op", ["gate_up_swiglu", "down"])
def test_native_bf16_kimi_size_top_experts_match_float64_reference(rng, record_property, op):
    """384 experts of Kimi K2's bf16 projections (the down weights end past 2**33 bytes), the top
    expert ids, NaN-poisoned outputs: the harness of ``test_kimi_size_gpu.py``."""
    _bf16_capability()
    kernel_op, n, k, n_out = {"gate_up_swiglu": (Op.GATE_UP_SWIGLU, 2 * F, H, F), "down": (Op.MATMUL, H, F, H)}[op]

    def kernel(x, w, sizes, *, compute_capability, out):
        return triton_lang.bf16_matmul(kernel_op, x, w, sizes, compute_capability=compute_capability, out=out)

    _check_top_experts(rng, record_property, f"native bf16 {op}", kernel, "bf16", (n, k), k, n_out,
                       lambda x_mk, w_nk: expert_reference(op, x_mk, w_nk))


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["gate_up_swiglu", "down"])
def test_native_w4a8_kimi_size_top_experts_match_float64_of_what_it_multiplies(rng, record_property, op):
    """``Mode.W4A8`` (SM90) at 384 experts, the top expert ids, NaN-poisoned outputs, every routing
    of the Kimi-size harness (decode, mid and prefill row counts: every tile kind); the gate/up
    reads its rows, and their scales, by index in a random order. The reference multiplies in
    float64 what the kernel multiplies: each row quantized to E4M3 per row, each weight's code times
    its block scale over 8 rounded to E4M3, times 8 and the global scale."""
    cc = _capability()
    if cc not in triton_lang.W4A8_CAPABILITIES:
        pytest.skip(f"W4A8 runs on SM{sorted(triton_lang.W4A8_CAPABILITIES)}, found SM{cc}")
    kernel_op, n, k, n_out = {"gate_up_swiglu": (Op.GATE_UP_SWIGLU, 2 * F, H, F), "down": (Op.MATMUL, H, F, H)}[op]
    order = np.random.default_rng(int(rng.integers(1 << 31)))

    def kernel(x, w, sizes, *, compute_capability, out):
        if kernel_op is Op.MATMUL:
            return triton_lang.run(kernel_op, x, w, sizes, compute_capability=compute_capability, out=out,
                                   mode=triton_lang.Mode.W4A8)
        row_token = order.permutation(x.shape[0]).astype(np.int32)
        tokens = jnp.zeros_like(x).at[jnp.asarray(row_token)].set(x)  # tokens[row_token[m]] = x[m]
        return triton_lang.run(kernel_op, tokens, w, sizes, compute_capability=compute_capability, out=out,
                               mode=triton_lang.Mode.W4A8, row_token_m=jnp.asarray(row_token))

    rounded = {}  # the harness calls expert_fn once per routing with each expert's w_nk

    def expert_fn(x_mk, w_nk):
        # The harness's weights (test_kimi_size_gpu.random_weights) have one global scale, this
        # float32 constant: w_nk / g is code * scale exactly (few significant bits in float64).
        if rounded.get("of") is not w_nk:
            g = np.float64(np.float32(0.3 / (6 * np.sqrt(w_nk.shape[1]))))
            rounded.update(of=w_nk, w=e4m3_round(w_nk / g / 8) * 8 * g)
        return expert_reference(op, rows_as_multiplied(x_mk), rounded["w"])

    _check_top_experts(rng, record_property, f"native w4a8 {op}", kernel, "nvfp4", (n, k), k, n_out, expert_fn,
                       mid_rows=True)


@pytest.mark.gpu
def test_native_w4a8_many_rows_down_tile_row_paths_match_float64_of_what_it_multiplies(rng):
    """``W4A8_MANY_ROWS_TILES``' down tile (half the weight rows, 4 warps) with experts one row
    either side of each row path, 384 experts with the last used, a NaN-poisoned output; the
    reference multiplies in float64 what the kernel multiplies (rows quantized to E4M3 per row,
    each code times its block scale over 8 rounded to E4M3, times 8 and the global scale)."""
    cc = _capability()
    if cc not in triton_lang.W4A8_MANY_ROWS_TILES:
        pytest.skip(f"SM{cc} has no W4A8 many-rows tiles (W4A8 runs on SM{sorted(triton_lang.W4A8_CAPABILITIES)})")
    tile = triton_lang.W4A8_MANY_ROWS_TILES[cc][Op.MATMUL]
    e, k, n_out = 384, 256, 192
    sizes = _row_path_sizes(tile)
    w = _random_nvfp4(rng, e, n_out, k)
    m, defined = int(sizes.sum()) + 29, int(sizes.sum())
    x = jnp.asarray(rng.standard_normal((m, k)) * np.exp(rng.uniform(-3, 3, (m, 1))), jnp.bfloat16)
    poisoned = jnp.full((m, n_out), jnp.nan, jnp.bfloat16)
    call = jax.jit(functools.partial(triton_lang.run, Op.MATMUL, compute_capability=cc, mode=triton_lang.Mode.W4A8,
                                     tile=tile))
    y = np.asarray(call(x, w, jnp.asarray(sizes), out=poisoned).astype(jnp.float32), np.float64)
    dense = reference.dequantize(np.asarray(w.packed), np.asarray(w.scales), np.asarray(w.global_scale))
    g = np.asarray(w.global_scale, np.float64)[:, None, None]
    as_multiplied = e4m3_round(dense / g / 8) * 8 * g  # code * scale is exact in float64, so is / g
    rows, starts = rows_as_multiplied(np.asarray(x, np.float64)), np.concatenate([[0], np.cumsum(sizes)])
    want = np.concatenate([rows[starts[i]:starts[i + 1]] @ as_multiplied[i].T for i in range(e)])
    assert np.isfinite(y[:defined]).all(), f"{np.count_nonzero(~np.isfinite(y[:defined]))} defined elements unwritten"
    assert np.isnan(y[defined:]).all(), "padding rows were written"
    rel = np.linalg.norm(y[:defined] - want) / np.linalg.norm(want)
    assert rel < TOLERANCE, f"W4A8 many-rows down {tile}: relative Frobenius error {rel:.3g}"
