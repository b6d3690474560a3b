"""benchmarks/grouped_gemm.py's pieces that run without a GPU: the weights quantized a few experts
at a time are the weights quantized at once, and the page's NVFP4 floor columns."""

import jax
import jax.numpy as jnp
import numpy as np
from test_benchmark_results import _load

from moe_jax import nvfp4


def test_weights_quantized_in_chunks_of_experts_are_the_weights_quantized_at_once():
    bench = _load("grouped_gemm")
    w_enk, w_ekn, q = bench.weights(64, 32, 1, 21)  # 16 + 5 experts
    np.testing.assert_array_equal(np.asarray(w_ekn), np.swapaxes(np.asarray(w_enk), 1, 2))
    whole = nvfp4.quantize(w_enk.astype(jnp.float32))
    for got, want in zip(jax.tree.leaves(q), jax.tree.leaves(whole), strict=True):
        assert got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert bench.nvfp4_bytes_per_expert(64, 32) * 21 == q.packed.nbytes + q.scales.nbytes


def test_the_page_gives_each_case_its_nvfp4_floor_and_the_best_nvfp4_over_it():
    bench = _load("grouped_gemm")
    meta = {"device": "NVIDIA H200", "date": "2026-12-02", "copy_bandwidth_tbps": 4.3, "command": "c",
            "versions": "v", "timing": "t", "experts": 384}
    cases = [bench.Case("down", "uniform", 128, 110, {"ours_nvfp4": {"ms": 0.5}, "native_nvfp4": {"ms": 0.25},
                                                       "tokamax_int4": {"error": "ImportError: tokamax"}}, 0.125),
             bench.Case("down", "uniform", 512, 300, {"ours_nvfp4": {"ms": 0.6}}, None)]
    lines = bench.markdown(meta, cases, None, []).splitlines()
    assert lines[0] == "# Grouped GEMM on one GPU (MoE experts, Kimi K2 shapes, 384 local experts)"
    assert ("| projection | routing | M | ours_nvfp4 | native_nvfp4 | tokamax_int4 | NVFP4 floor "
            "| best NVFP4 / floor |") in lines
    flops = 2.0 * 128 * 7168 * 2048
    assert (f"| down | uniform | 128 | 500.0 ({flops / 0.5e-3 / 1e12:.0f}) | 250.0 ({flops / 0.25e-3 / 1e12:.0f}) "
            "| err | 125.0 | 2.00x |") in lines
    assert any(line.startswith("| down | uniform | 512 | 600.0") and line.endswith("|  |  |  |  |") for line in lines)


def test_the_dense_anchor_is_one_matmul_and_the_page_gives_our_kernels_over_it():
    bench = _load("grouped_gemm")
    x = jax.random.normal(jax.random.key(0), (8, 32), jnp.bfloat16)
    sets = [(x, None, None, None, None), (x + 1, None, None, None, None), (x, None, None, None, None)]
    anchor_sets = bench.anchor_arg_sets(sets, 64, 32)
    assert [a[1].shape for a in anchor_sets] == [(32, 64)] * 3 and anchor_sets[0][1] is anchor_sets[2][1]
    assert anchor_sets[0][1] is not anchor_sets[1][1]  # two copies, alternating
    got = bench.dense_anchor(*anchor_sets[1])
    want = np.asarray(anchor_sets[1][0], np.float32) @ np.asarray(anchor_sets[1][1], np.float32)
    assert got.dtype == jnp.bfloat16 and got.shape == (8, 64)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2e-2, atol=2e-2)

    meta = {"device": "NVIDIA H200", "date": "2026-12-02", "copy_bandwidth_tbps": 4.3, "command": "c",
            "versions": "v", "timing": "t", "experts": 48}
    cases = [bench.Case("down", "uniform", 128, 40, {"dense_anchor": {"ms": 0.1}, "ours_bf16": {"ms": 0.2},
                                                      "ours_nvfp4": {"ms": 0.05}, "jax_ragged_dot": {"ms": 1.0}}),
             bench.Case("down", "uniform", 512, 48, {"dense_anchor": {"error": "X"}, "ours_bf16": {"ms": 0.3}})]
    lines = bench.markdown(meta, cases, None, []).splitlines()
    assert "| projection | routing | M | dense_anchor | ours_bf16 | ours_nvfp4 | jax_ragged_dot |" in lines
    assert "| projection | routing | M | dense_anchor TFLOP/s | ours_bf16 of anchor | ours_nvfp4 of anchor |" in lines
    flops = 2.0 * 128 * 7168 * 2048
    assert f"| down | uniform | 128 | {flops / 0.1e-3 / 1e12:.0f} | 0.50 | 2.00 |" in lines
    assert "| down | uniform | 512 |  |  |  |" in lines
    # Without the anchor (results from before it), no such table.
    del cases[0].results["dense_anchor"], cases[1].results["dense_anchor"]
    assert not any("of anchor" in line for line in bench.markdown(meta, cases, None, []).splitlines())
