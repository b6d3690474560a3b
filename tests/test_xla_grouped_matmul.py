"""The ``xla`` reference path's grouped matmul (:func:`moe_jax.expert_gemm.grouped_matmul`):
its work grows with the rows, not rows x experts, and it computes what a float64 grouped matmul
does, for every routing (empty experts, one expert with every row, padding rows), both
platforms' tile sizes, and the scan over tiles that large sizes take.

The cost is read from XLA's own count of the compiled program (``cost_analysis()["flops"]``),
not from timing. ``jax.lax.ragged_dot``, which the path called before, counts
``2 K N M E`` there on XLA:CPU (every row against every expert): 22x the bound below at these
shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_jax
import moe_jax.expert_gemm as expert_gemm
from moe_jax.expert_gemm import grouped_matmul, overflow_tiles, tile_rows

M, K, N = 512, 64, 32
_SLOTS = jax.jit(expert_gemm._slots, static_argnums=(1, 2))  # one program per shape, not one per op


def _flops(fn, *shapes) -> float:
    return jax.jit(fn).lower(*shapes).compile().cost_analysis()["flops"]


def _work_bound(num_rows: int, num_experts: int) -> int:
    """``2 K N (M + E c)``: every row once, plus each expert's first tile padded to ``c`` rows."""
    return 2 * K * N * (num_rows + num_experts * tile_rows(num_rows, num_experts, "cpu"))


@pytest.mark.parametrize("num_experts", [8, 64])
def test_work_grows_with_rows_not_experts(num_experts):
    """Forward and VJP within a small factor of :func:`_work_bound` (``jax.lax.ragged_dot``:
    4.3x and 23x it in the forward pass, at 8 and 64 experts)."""
    a = jax.ShapeDtypeStruct((M, K), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((num_experts, N, K), jnp.bfloat16)
    g = jax.ShapeDtypeStruct((num_experts,), jnp.int32)
    ct = jax.ShapeDtypeStruct((M, N), jnp.float32)
    bound = _work_bound(M, num_experts)
    forward = _flops(lambda a, w, g: grouped_matmul(a, w, g, platform="cpu"), a, w, g)
    # The rest of the count is elementwise: selects on the gathered rows and outputs.
    assert forward <= 1.25 * bound, (forward, bound)
    # The VJP: the input and the weight gradient, each one more pass of the same size.
    backward = _flops(jax.grad(lambda a, w, g, ct: jnp.sum(grouped_matmul(a, w, g, platform="cpu") * ct), (0, 1)),
                      a, w, g, ct)
    assert backward <= 3 * 1.25 * bound, (backward, bound)


def test_the_xla_stage_calls_no_ragged_dot(rng):
    """The whole stage, NVFP4 dequantization and both projections, through the registry: no op
    that XLA expands over every expert."""
    config = moe_jax.MoEConfig(num_experts=8, top_k=2, hidden_size=64, expert_intermediate_size=32,
                               weight_format="nvfp4", expert_gemm="xla")
    plan = moe_jax.resolve(config, None)
    e, h, f = config.num_experts, config.hidden_size, config.expert_intermediate_size
    key = jax.random.key(int(rng.integers(1 << 30)))
    # Shapes are all a trace needs.
    weights = {"w_gate_up_egh": jax.eval_shape(lambda: moe_jax.nvfp4.random(key, (e, 2 * f, h))),
               "w_down_ehf": jax.eval_shape(lambda: moe_jax.nvfp4.random(key, (e, h, f)))}
    x_mh = jax.ShapeDtypeStruct((40, h), jnp.bfloat16)
    group_sizes_e = jax.ShapeDtypeStruct((e,), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda x, g, w: moe_jax.EXPERT_GEMM["xla"].run(x, g, w, plan))(x_mh, group_sizes_e, weights)
    assert "ragged_dot" not in str(jaxpr)


def _routings(rng, num_experts: int, num_rows: int):
    """Group sizes: uniform, skewed, all rows on one expert, and with padding rows past the sum."""
    uniform = rng.multinomial(num_rows, np.ones(num_experts) / num_experts)
    skewed = rng.multinomial(num_rows - min(7, num_rows // 4), rng.dirichlet(np.full(num_experts, 0.05)))
    one = np.zeros(num_experts, np.int64)
    one[num_experts // 2] = num_rows
    return {"uniform": uniform, "skewed+padding": skewed, "one expert": one}


def _float64_grouped_matmul(a_mk, w_enk, group_sizes_e):
    a, w = np.asarray(a_mk, np.float64), np.asarray(w_enk, np.float64)
    y = np.zeros((a.shape[0], w.shape[1]))
    ends = np.cumsum(group_sizes_e)
    for e, (start, end) in enumerate(zip(ends - group_sizes_e, ends)):
        y[start:end] = a[start:end] @ w[e].T
    return y


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
@pytest.mark.parametrize("tiles_per_step", [None, 2])
def test_matches_a_float64_grouped_matmul_with_its_gradients(rng, monkeypatch, platform, tiles_per_step):
    """Values and both gradients against float64, for CPU's and accelerators' tile sizes, in one
    batch of overflow tiles or in scan steps of two (``GATHER_BUDGET_BYTES`` cut to two tiles)."""
    num_experts, num_rows, k, n = 6, 300, 32, 16
    if tiles_per_step is not None:
        for key in expert_gemm.GATHER_BUDGET_BYTES:
            monkeypatch.setitem(expert_gemm.GATHER_BUDGET_BYTES, key, tiles_per_step * n * k * 4)
    a_mk = jnp.asarray(rng.standard_normal((num_rows, k)), jnp.float32)
    w_enk = jnp.asarray(rng.standard_normal((num_experts, n, k)), jnp.float32)
    ct_mn = rng.standard_normal((num_rows, n))
    for name, sizes in _routings(rng, num_experts, num_rows).items():
        group_sizes_e = jnp.asarray(sizes, jnp.int32)

        def loss(a, w, group_sizes_e=group_sizes_e):
            y = grouped_matmul(a, w, group_sizes_e, platform=platform, precision=jax.lax.Precision.HIGHEST)
            return jnp.sum(y * ct_mn), y

        (_, y_mn), (da_mk, dw_enk) = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(a_mk, w_enk)
        y64 = _float64_grouped_matmul(a_mk, w_enk, sizes)
        # d/da = ct @ w_e over each expert's rows (zero past them); d/dw_e = ct_e^T a_e.
        da64 = _float64_grouped_matmul(ct_mn, np.swapaxes(w_enk, 1, 2), sizes)
        ends = np.cumsum(sizes)
        dw64 = np.stack([ct_mn[s:t].T @ np.asarray(a_mk, np.float64)[s:t] for s, t in zip(ends - sizes, ends)])
        for label, got, want in (("y", y_mn, y64), ("da", da_mk, da64), ("dw", dw_enk, dw64)):
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4, err_msg=f"{name}: {label}")


def test_the_slots_hold_every_row_once_inside_the_static_bound(rng):
    """For any routing, the padded layout (``_slots``) puts each row in its own slot, inside the
    ``E c + T c`` slots of the static tile bound, in a slot of its own expert (a first-rows slot
    ``e c + i``, or an overflow tile of expert ``e``), and padding rows one past the end."""
    for num_experts, num_rows in ((4, 300), (64, 512), (384, 2048), (3, 1)):
        c = tile_rows(num_rows, num_experts, "cpu")
        first, end = num_experts * c, (num_experts + overflow_tiles(num_rows, c)) * c
        for sizes in [*_routings(rng, num_experts, num_rows).values(), np.full(num_experts, num_rows // num_experts)]:
            slot_m, tile_expert_t = map(np.asarray, _SLOTS(jnp.asarray(sizes, jnp.int32), num_rows, c))
            valid = int(sizes.sum())
            expert_m = np.repeat(np.arange(num_experts), sizes)
            rows = slot_m[:valid]
            assert len(set(rows.tolist())) == valid and rows.max(initial=0) < end, (num_experts, num_rows, sizes)
            in_first = rows < first
            np.testing.assert_array_equal(rows[in_first] // c, expert_m[in_first])
            np.testing.assert_array_equal(tile_expert_t[(rows[~in_first] - first) // c], expert_m[~in_first])
            assert (slot_m[valid:] == end).all()


def test_no_rows():
    y_mn = grouped_matmul(jnp.zeros((0, K), jnp.bfloat16), jnp.ones((4, N, K), jnp.bfloat16),
                          jnp.zeros((4,), jnp.int32), platform="cpu")
    assert y_mn.shape == (0, N) and y_mn.dtype == jnp.float32
