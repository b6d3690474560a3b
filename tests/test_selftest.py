"""`moe-jax selftest`: its float64 layer reference (against hand-computed values), the layer cases
on one and on 8 CPU devices, and that a wrong layer fails it, in the JSON document (the human
output: tests/test_cli.py)."""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
from harness import PROBE_CONFIG, exchanges_that_run, mesh_for

from moe_jax import MoEConfig, cli, float64_reference, moe_forward, nvfp4, selftest
from pallas_kernels.grouped_matmul import reference

LN3 = math.log(3.0)  # sigmoid(ln 3) = 3/4, sigmoid(-ln 3) = 1/4

# --- the float64 reference, by hand -----------------------------------------------------------


def test_route_sigmoid_with_selection_bias_and_scaling():
    config = MoEConfig(num_experts=4, top_k=2, hidden_size=2, expert_intermediate_size=1, scoring="sigmoid",
                       router_bias=True, routed_scaling_factor=2.0)
    # Scores 3/4, 1/2, 1/4, 1/2; the bias makes expert 2 (the lowest score) the first choice.
    routing = float64_reference.route(np.array([[LN3, 0.0, -LN3, 0.0]]), config, np.array([0.0, 0.0, 1.0, 0.0]))
    assert routing.ids_tk.tolist() == [[2, 0]]
    # The weights are the unbiased scores 1/4 and 3/4, normalized (sum 1), times 2.
    np.testing.assert_allclose(routing.weights_tk, [[0.5, 1.5]], rtol=1e-12)
    np.testing.assert_allclose(routing.margin_t, [0.75 - 0.5], rtol=1e-12)


def test_route_keeps_the_best_groups_and_measures_the_group_margin():
    config = MoEConfig(num_experts=4, top_k=2, hidden_size=2, expert_intermediate_size=1, scoring="sigmoid",
                       num_groups=2, topk_groups=1, normalize=False)
    scores = np.array([[0.9, 0.1, 0.6, 0.6], [0.5, 0.5, 0.5, 0.5]])
    routing = float64_reference.route(np.log(scores / (1 - scores)), config)
    # Group {0, 1} scores 1.0, group {2, 3} 1.2: the best expert, 0, is not eligible.
    assert routing.ids_tk.tolist() == [[2, 3], [0, 1]]  # ties go to the lower index
    np.testing.assert_allclose(routing.weights_tk, [[0.6, 0.6], [0.5, 0.5]], rtol=1e-12)
    # Token 0 is decided by the groups' gap (both experts of its group are chosen); token 1 is tied.
    np.testing.assert_allclose(routing.margin_t, [0.2, 0.0], atol=1e-12)


def test_layer_by_hand():
    """Two tokens, four experts of width 1 with gate 30 (silu(30) = 30 to 1e-12), one shared expert."""
    config = MoEConfig(num_experts=4, top_k=2, hidden_size=2, expert_intermediate_size=1, num_shared_experts=1,
                       scoring="sigmoid", router_bias=True, routed_scaling_factor=2.0)
    up_e = np.array([0.5, 1.0, 0.25, 1.0])
    params = {
        "router": {"w_eh": np.array([[LN3, 0], [0, 0], [-LN3, 0], [0, 0]], np.float32),
                   "bias_e": np.array([0, 0, 1, 0], np.float32)},
        "experts": {"w_gate_up_egh": np.stack([[[30.0, 0.0], [u, 0.0]] for u in up_e]).astype(np.float32),
                    "w_down_ehf": np.array([[[1], [2]], [[9], [9]], [[2], [-1]], [[9], [9]]], np.float32)},
        "shared": {"w_gate_up_gh": np.array([[30, 0], [0.125, 0]], np.float32), "w_down_hs": np.array([[1], [0]], np.float32)},
    }
    ys, routing = float64_reference.layer(params, np.array([[1.0, 0.0], [0.0, 1.0]]), config)
    # Token 0: experts 2 and 0 (as in the routing test) with weights 0.5 and 1.5; expert 0 gives
    # 15 * [1, 2], expert 2 7.5 * [2, -1], the shared expert 3.75 * [1, 0].
    # Token 1 has gate 0 everywhere: zero output; all its scores are 1/2, so it is tied.
    np.testing.assert_allclose(ys[False], [[1.5 * 15 + 0.5 * 15 + 3.75, 1.5 * 30 - 0.5 * 7.5], [0, 0]], rtol=1e-6)
    assert routing.ids_tk.tolist() == [[2, 0], [2, 0]] and routing.margin_t[1] == 0


def test_bf16_rounds_to_nearest_even():
    ulp = 2.0**-7  # bf16 keeps 8 significant bits: the spacing above 1
    assert reference.bf16(np.array([1 + ulp / 2, 1 + 1.5 * ulp, 1 + 0.75 * ulp])).tolist() == [
        1.0, 1 + 2 * ulp, 1 + ulp]


def test_nvfp4_rows_quantizes_each_row_alone(rng):
    a_mk = rng.standard_normal((13, 64)) * rng.uniform(0.1, 10, (13, 1))
    got = float64_reference.nvfp4_rows(a_mk)
    for m in (0, 12):  # the first row, and the last of the 13 (padded to 16 for the quantizer)
        packed, scales, g = jax.device_get(nvfp4.quantize_rows(jnp.asarray(a_mk[m:m + 1], jnp.float32)))
        np.testing.assert_array_equal(got[m], reference.dequantize(packed[:, None], scales[:, None], g)[0, 0])
    # NVFP4's rounding of Gaussian rows: 9.4% relative error on average, standard deviation 0.34%
    # over 300 seeds (largest 10.4%); 0.12 is far outside that spread yet far below a wrong scale.
    assert np.linalg.norm(got - a_mk) / np.linalg.norm(a_mk) < 0.12


# --- the layer cases --------------------------------------------------------------------------


def test_nvfp4_stage_and_layer_on_one_device_and_expert_parallel_on_eight(cpu_devices, rng):
    meshes, notes = selftest.expert_parallel_meshes(cpu_devices, [selftest.SMALL])
    assert notes == [] and meshes[selftest.SMALL].size == 8
    mesh = meshes[selftest.SMALL]
    params = selftest.random_layer_params(selftest.SMALL, "nvfp4", cpu_devices[0], rng)
    stage = selftest.check("xla", selftest.SMALL, "nvfp4", params["experts"], cpu_devices[0], rng, iters=1)
    assert stage.passed and stage.mode == "dequantize + tiled einsum", stage
    cases = [selftest.LayerCase("xla", "none"), *(selftest.LayerCase("xla", e, mesh) for e in ("padded", "ragged"))]
    results, not_run = selftest.check_layer(selftest.SMALL, "nvfp4", params, cases, cpu_devices[0], rng, iters=1)
    # ragged runs on XLA:CPU through the twin of ragged_all_to_all (sharding.exchange.emulated).
    assert [(r.exchange, r.devices) for r in results] == [("none", 1), ("padded", 8), ("ragged", 8)]
    for r in results:
        assert r.passed, r
        assert r.compared + r.excluded == selftest.SMALL.tokens and r.compared >= selftest.SMALL.tokens // 2
    assert not_run == []


def test_expert_parallel_cases_need_devices_that_divide_the_experts(cpu_devices):
    meshes, notes = selftest.expert_parallel_meshes(cpu_devices[:1], [selftest.SMALL, selftest.KIMI])
    assert meshes == {} and notes == ["expert-parallel layer cases: one cpu device here; they run on a mesh of all "
                                      "devices where there are several"]
    meshes, notes = selftest.expert_parallel_meshes(cpu_devices[:3], [selftest.SMALL, selftest.KIMI])
    assert list(meshes) == [selftest.KIMI]  # 384 experts split over 3 devices, 16 do not
    assert notes == ["expert-parallel small layer cases: the 3 devices here do not divide its 16 experts"]


def test_a_wrong_routed_scaling_fails(monkeypatch, cpu_devices, rng):
    def wrong_forward(params, x, plan):
        return moe_forward(params, x, dataclasses.replace(
            plan, config=dataclasses.replace(plan.config, routed_scaling_factor=2.5)))  # Kimi K2's is 2.827

    monkeypatch.setattr(selftest, "moe_forward", wrong_forward)
    params = selftest.random_layer_params(selftest.SMALL, "bf16", cpu_devices[0], rng)
    (result,), _ = selftest.check_layer(selftest.SMALL, "bf16", params, [selftest.LayerCase("xla", "none")],
                                        cpu_devices[0], rng, iters=1)
    assert not result.passed and result.error > 3 * result.tolerance, result


def test_a_batch_mostly_near_routing_ties_fails(monkeypatch, cpu_devices, rng):
    monkeypatch.setattr(selftest, "TIE", 10.0)  # every selection margin is below that
    params = selftest.random_layer_params(selftest.SMALL, "bf16", cpu_devices[0], rng)
    (result,), _ = selftest.check_layer(selftest.SMALL, "bf16", params, [selftest.LayerCase("xla", "none")],
                                        cpu_devices[0], rng, iters=1)
    assert (result.compared, result.excluded) == (0, selftest.SMALL.tokens)
    assert result.failure == "64 of 64 tokens within 10 of a routing tie; expected at most half" and not result.passed


# --- the command ------------------------------------------------------------------------------


def test_the_json_document_reports_a_wrong_expert_and_the_exit_code_is_nonzero(monkeypatch, capsys, cpu_devices):
    def wrong_forward(params, x, plan):
        w_down_ehf = params["experts"]["w_down_ehf"]
        # Expert 3's output doubled (a product, not a scatter, so that it also works sharded).
        twice_3_e = jnp.where(jnp.arange(w_down_ehf.shape[0]) == 3, 2, 1).astype(w_down_ehf.dtype)
        experts = dict(params["experts"], w_down_ehf=w_down_ehf * twice_3_e[:, None, None])
        return moe_forward(dict(params, experts=experts), x, plan)

    monkeypatch.setattr(selftest, "moe_forward", wrong_forward)
    monkeypatch.setattr(selftest, "FORMATS", ("bf16",))  # the nvfp4 cases: above
    assert cli.main(["selftest", "--quick", "--seed", "7", "--json"]) == 1
    captured = capsys.readouterr()
    doc = json.loads(captured.out)  # stdout is the document alone; the verdict goes to stderr
    # The layer runs with every exchange XLA:CPU runs: without a mesh on one device, else on all 8.
    layers = [("layer", e, 1, False) for e in exchanges_that_run(cpu_devices[:1], PROBE_CONFIG)] + [
        ("layer", e, 8, False) for e in exchanges_that_run(mesh_for(8, cpu_devices, 1), PROBE_CONFIG)]
    summary = f"FAILED: {len(layers)} of {len(layers) + 1} checks"
    assert captured.err.strip().endswith(summary)
    assert doc["device_kind"] == "cpu" and doc["platform"] == "cpu" and doc["compute_capability"] is None
    assert doc["num_devices"] == 8 and doc["seed"] == 7 and doc["full_size"] is False
    assert set(doc["versions"]) == {"python", "jax", "jaxlib", "flax", "triton", "jax-triton", "moe-jax"}
    assert doc["versions"]["jax"] == jax.__version__
    assert doc["resolution_report"].startswith("moe-jax plan: 384 experts, top-8") and "exchange: padded" in doc[
        "resolution_report"]
    fields = {f.name for f in dataclasses.fields(selftest.Result)}
    assert all(set(r) == fields | {"passed"} for r in doc["results"])
    assert [(r["check"], r["exchange"], r["devices"], r["passed"]) for r in doc["results"]] == [
        ("experts", "-", 1, True), *layers]  # the stage is right: the layer's weights are wrong
    for r in doc["results"][1:]:
        assert r["failure"] == "" and r["error"] > 3 * r["tolerance"], r
        assert r["compared"] + r["excluded"] == selftest.SMALL.tokens and r["ms"] > 0
    assert doc["passed"] is False and doc["summary"] == summary
    assert doc["notes"] == ["full-size (kimi_k2) cases: skipped (--quick)"]
    why = {n["case"]: n["why"] for n in doc["not_run"]}
    assert "needs an NVIDIA GPU, found cpu" in why["layer pallas bf16 small, exchange none"]
