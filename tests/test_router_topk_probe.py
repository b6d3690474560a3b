"""``benchmarks/router_topk.py``: the ``argmax`` formulation (``router.top_k_ids(method="argmax")``)
chooses as a stable float64 sort, and the probe's check refuses a formulation that does not (a
wrong one would otherwise be timed)."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax import router

_PATH = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "router_topk.py"
_spec = importlib.util.spec_from_file_location("router_topk", _PATH)
probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe)


def _float64_stable_choice(scores_te: np.ndarray, k: int) -> np.ndarray:
    """Written here, not taken from the probe: a row's k largest by Python's stable sort, NaN as
    +inf, -0.0 tied with +0.0 (as ``router.top_k_ids`` chooses)."""
    out = []
    for row in scores_te.astype(np.float64).tolist():
        # largest first; sorted() keeps ties, -0.0 == 0.0 among them, in index order
        key = [np.inf if np.isnan(v) else v for v in row]
        out.append(sorted(range(len(row)), key=lambda i: -key[i])[:k])
    return np.asarray(out, np.int32)


@pytest.mark.parametrize("experts,k", [(384, 8), (256, 8), (9, 9), (5, 1)])
def test_argmax_chooses_as_a_stable_sort(rng, experts, k):
    random = rng.standard_normal((16, experts)).astype(np.float32)
    hard = probe.hard_scores(rng, 64, experts, signed_zeros=True)
    hard[0] = -np.inf  # a row with nothing above -inf: k distinct ids all the same
    hard[1] = np.where(rng.random(experts) < 0.5, -0.0, 0.0)  # only signed zeros
    for scores in (random, hard):
        got = np.asarray(jax.jit(router.top_k_ids, static_argnums=1, static_argnames='method')(
            jnp.asarray(scores), k, method="argmax"))
        np.testing.assert_array_equal(got, _float64_stable_choice(scores, k))
        assert all(len(set(row)) == k for row in got.tolist())


def test_the_check_refuses_a_formulation_that_chooses_differently(monkeypatch):
    def chosen_set_to_minus_inf(choice_te, k):  # a chosen entry ties with a real -inf again
        x_te, ids = jnp.where(jnp.isnan(choice_te), jnp.inf, choice_te), []
        col_te = jax.lax.broadcasted_iota(jnp.int32, x_te.shape, 1)
        for _ in range(k):
            ids.append(jnp.argmax(x_te, axis=-1).astype(jnp.int32))
            x_te = jnp.where(col_te == ids[-1][:, None], -jnp.inf, x_te)
        return jnp.stack(ids, axis=-1)

    monkeypatch.setitem(probe.FORMULATIONS, "argmax", chosen_set_to_minus_inf)
    error = probe.check("argmax", 256, 384, 8, seed=0)
    assert error is not None and error.startswith("ties, infinities, NaN:"), error
    for name in ("sort", "padded"):  # on XLA:CPU both sort
        assert probe.check(name, 256, 384, 8, seed=0) is None


def test_a_run_writes_every_formulation(tmp_path):
    probe.main(["--out", str(tmp_path), "--tokens", "8", "--experts", "16", "--k", "2", "--iters", "1",
                "--windows", "1"])
    rows = json.loads((tmp_path / "router_topk.json").read_text())["rows"]
    assert sorted(r["formulation"] for r in rows) == sorted(probe.FORMULATIONS)
    assert all(r["seconds"] > 0 and "error" not in r for r in rows)
    assert "| 16 | 8 |" in (tmp_path / "router_topk.md").read_text()


@pytest.mark.parametrize("flags,message", [(["--k", "0"], "--k: 0"), (["--iters", "0"], "--iters: 0")])
def test_bad_flags_are_refused_in_one_line(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit):
        probe.main(["--out", str(tmp_path), "--experts", "16", *flags])
    assert message in capsys.readouterr().err
