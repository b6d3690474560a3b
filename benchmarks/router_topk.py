"""The router's top-k by formulation: which is fastest on a GPU for Kimi K2's and DeepSeek-V3's
rows (the library's ``router.top_k_ids`` takes ``sort`` or ``argmax`` by its ``method``, by size:
``router.top_k_method``, from this probe's run at 77e571b on an H100).

At 8192 tokens on one H100 (2f15176, ``benchmarks/results/layer_h100/2f15176/``) XLA's TopK
kernel took 0.28 ms of the layer for the ``[8192, 384]`` scores padded to ``[8192, 1024]``; the
sort it replaced took 0.12-0.13 ms on an H200 and was not timed on the H100. Three formulations of
the same choice (each row's ``k`` largest, largest first, ties to the lower index, NaN as +inf):

* ``sort``: ``jax.lax.top_k`` of the rows as they are (XLA sorts rows narrower than 1024 whole);
* ``padded``: the rows padded with -inf to 1024, so XLA runs its TopK kernel (the library's
  choice on GPUs from 2f15176 until this probe measured it: the slowest at prefill sizes);
* ``argmax``: ``k`` row-wise argmaxes over an int32 key in the floats' total order, each chosen
  entry's key set below every float's before the next (a chosen entry can never be taken twice,
  even where the rest of the row is -inf).

``router.top_k_ids`` (``sort`` and ``argmax``) ties -0.0 with +0.0: on GPUs ``jax.lax.top_k`` puts
-0.0 below +0.0 in rows under 1024 entries and not in longer ones (XLA's TopK kernel compares with
``>``). Each formulation's choice is compared with a stable float64 sort on the host, zeros of
either sign tied (random scores; scores with ties, infinities and NaN), before it is timed; a
mismatch gets no time. Rows with signed zeros are checked apart and only noted (``padded`` keeps
the signs).

Usage::

    python benchmarks/router_topk.py --out OUT [--tokens 32 256 2048 8192 32768] [--experts 384 256]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import expert_parallel  # noqa: E402  (timed)
from moe_jax import router  # noqa: E402

def top_k_padded(choice_te: jax.Array, k: int) -> jax.Array:
    """The rows padded with -inf to 1024 entries, so that XLA runs its TopK kernel (``router``'s
    choice on GPUs from 2f15176 to 9310cc2; NaN as +inf first: that kernel compares with ``>``)."""
    x_te = jnp.where(jnp.isnan(choice_te), jnp.inf, choice_te)
    x_te = jnp.pad(x_te, ((0, 0), (0, max(0, 1024 - x_te.shape[1]))), constant_values=-jnp.inf)
    return jax.lax.top_k(x_te, k)[1].astype(jnp.int32)


FORMULATIONS = {
    "sort": lambda s, k: router.top_k_ids(s, k, method="sort"),
    "padded": top_k_padded,
    "argmax": lambda s, k: router.top_k_ids(s, k, method="argmax"),
}


def stable_reference(scores_te: np.ndarray, k: int) -> np.ndarray:
    """The choice by a stable float64 sort on the host: largest first, ties to the lower index,
    NaN as +inf, -0.0 tied with +0.0."""
    x = np.asarray(scores_te, np.float64)
    x = np.where(np.isnan(x), np.inf, x)
    return np.argsort(-x, axis=1, kind="stable")[:, :k].astype(np.int32)


def hard_scores(rng: np.random.Generator, tokens: int, experts: int, *, signed_zeros: bool = False) -> np.ndarray:
    """float32 scores with many ties, infinities and NaN: row ``r`` draws from the ``1 + r % 7``
    smallest of 7 values, so that in some rows the top k are all -inf, in others all zeros, and so
    on up to NaN (which counts as +inf). With ``signed_zeros`` each zero is -0.0 or +0.0 at random."""
    values = np.array([-np.inf, -1.5, 0.0, 0.25, 1.0, np.inf, np.nan], np.float32)
    limit_t1 = 1 + np.arange(tokens)[:, None] % len(values)
    scores = values[rng.integers(0, limit_t1, (tokens, experts))]
    if signed_zeros:
        scores = np.where((scores == 0) & (rng.random(scores.shape) < 0.5), np.float32(-0.0), scores)
    return scores


def differs(name: str, scores_te: np.ndarray, k: int) -> str | None:
    """None if ``name`` chooses as :func:`stable_reference` on ``scores_te``, else where not."""
    got = np.asarray(jax.jit(FORMULATIONS[name], static_argnums=1)(jnp.asarray(scores_te), k))
    want = stable_reference(scores_te, k)
    if np.array_equal(got, want):
        return None
    rows = np.flatnonzero((got != want).any(axis=1))
    return f"{len(rows)} of {len(got)} rows differ (first: row {rows[0]}, {got[rows[0]]} against {want[rows[0]]})"


def check(name: str, tokens: int, experts: int, k: int, seed: int) -> str | None:
    """None if ``name`` chooses as the stable sort on random scores and on scores with ties,
    infinities and NaN, else why not."""
    rng = np.random.default_rng(seed)
    cases = {"random": rng.standard_normal((tokens, experts)).astype(np.float32),
             "ties, infinities, NaN": hard_scores(rng, tokens, experts)}
    for label, scores in cases.items():
        if why := differs(name, scores, k):
            return f"{label}: {why}"
    return None


def run(tokens_list, experts_list, k: int, iters: int, windows: int) -> list[dict]:
    rows = []
    check_tokens = min(max(tokens_list), 512)
    for experts in experts_list:
        for name in FORMULATIONS:
            error = check(name, check_tokens, experts, k, seed=experts)
            zeros = differs(name, hard_scores(np.random.default_rng(experts), check_tokens, experts,
                                              signed_zeros=True), k)
            for tokens in tokens_list:
                row = {"formulation": name, "tokens": tokens, "experts": experts, "k": k}
                if zeros:
                    row["signed_zeros"] = zeros
                if error:
                    row["error"] = error
                else:
                    scores = jax.random.normal(jax.random.key(tokens + experts), (tokens, experts), jnp.float32)
                    fn = functools.partial(FORMULATIONS[name], k=k)
                    row["seconds"], _ = expert_parallel.timed(fn, scores, iters=iters, windows=windows)
                    row["hlo_has_sort"] = " sort(" in jax.jit(fn).lower(scores).compile().as_text()
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def markdown(results: dict) -> str:
    meta, rows = results["meta"], results["rows"]
    names = list(FORMULATIONS)
    lines = [f"# The router's top-k by formulation ({meta['device']})", "",
             f"{meta['date']}, commit {meta['commit']}, `{meta['command']}`; us per call, median of "
             f"{meta['windows']} windows of {meta['iters']} calls; k = {meta['k']}. Every formulation's "
             "choice was first compared with a stable float64 sort, -0.0 tied with +0.0 (random scores; "
             "ties, infinities and NaN; signed zeros apart).", "",
             "| experts | tokens | " + " | ".join(names) + " |", "|---:|---:|" + "---:|" * len(names)]
    keys = sorted({(r["experts"], r["tokens"]) for r in rows}, key=lambda e_t: (-e_t[0], e_t[1]))
    by = {(r["formulation"], r["experts"], r["tokens"]): r for r in rows}
    for experts, tokens in keys:
        cells = []
        for name in names:
            r = by.get((name, experts, tokens), {})
            cells.append(f"{r['seconds'] * 1e6:.1f}" if "seconds" in r else ("wrong" if "error" in r else "-"))
        lines.append(f"| {experts} | {tokens} | " + " | ".join(cells) + " |")
    errors = sorted({f"- {r['formulation']} at {r['experts']} experts: {r['error']}" for r in rows if "error" in r})
    if errors:
        lines += ["", "Not timed (chose differently from the stable sort):", ""] + errors
    zeros = sorted({f"- {r['formulation']} at {r['experts']} experts: {r['signed_zeros']}" for r in rows
                    if "signed_zeros" in r})
    if zeros:
        lines += ["", "Ordered -0.0 and +0.0 otherwise than the sort (timed):", ""] + zeros
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--tokens", type=int, nargs="+", default=[32, 256, 2048, 8192, 32768])
    parser.add_argument("--experts", type=int, nargs="+", default=[384, 256])
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--windows", type=int, default=5)
    args = parser.parse_args(argv)
    for name in ("tokens", "experts", "iters", "windows"):
        values = getattr(args, name)
        if min(values if isinstance(values, list) else [values]) < 1:
            parser.error(f"--{name}: {values}, expected every value >= 1")
    if not 1 <= args.k <= min(args.experts):
        parser.error(f"--k: {args.k}, expected 1 <= k <= the fewest experts ({min(args.experts)})")
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"meta": {"device": jax.devices()[0].device_kind, "date": datetime.date.today().isoformat(),
                        "commit": os.environ.get("GIT_COMMIT", "unknown"), "k": args.k, "iters": args.iters,
                        "windows": args.windows,
                        "command": "python benchmarks/router_topk.py " + " ".join(argv if argv is not None
                                                                                  else sys.argv[1:])},
               "rows": run(args.tokens, args.experts, args.k, args.iters, args.windows)}
    (args.out / "router_topk.json").write_text(json.dumps(results, indent=1))
    (args.out / "router_topk.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
