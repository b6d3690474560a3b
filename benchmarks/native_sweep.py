"""Tile sweep of the Triton-language NVFP4 kernels (``triton_lang.py``) at Kimi K2's real size.

384 experts on one GPU, uniform routing, the fused gate/up + SwiGLU (``[E, 4096, 7168]``) and the
down projection (``[E, 7168, 2048]``), at the row counts of 32, 256 and 8192 tokens (x 8) by default.
Each configuration's output is first compared with the Pallas kernel's on the same inputs (a
tile that computes something else is recorded as wrong, never timed as a winner); then the
median CUPTI kernel time over ``--runs`` calls rotating over two input sets. TB/s counts the
packed codes and block scales of the experts the rows touch; the copy bandwidth of the same run
bounds it.

Usage::

    python benchmarks/native_sweep.py --out DIR [--rows 256 2048 65536] [--runs 20]
    python benchmarks/native_sweep.py --out DIR --one-group --rows 32 256 1024
    python benchmarks/native_sweep.py --out DIR --mid --rows 8192 12288
    python benchmarks/native_sweep.py --out DIR --input-grad --rows 8192 32768
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.grouped_gemm import copy_bandwidth, group_sizes, time_jax  # noqa: E402
from moe_jax import nvfp4  # noqa: E402
from pallas_kernels.grouped_matmul import run as pallas_run  # noqa: E402
from pallas_kernels.grouped_matmul import triton_lang  # noqa: E402
from pallas_kernels.grouped_matmul.tuning import Op, decode_tile, prefill_tile  # noqa: E402

EXPERTS, HIDDEN, INTERMEDIATE = 384, 7168, 2048
G, M = Op.GATE_UP_SWIGLU, Op.MATMUL
# Per (variant, op); the first of each list is the table's entry when this list was written.
# Prefill: tiles with extra rows (``extra_m``: a second MMA against the same dequantized weights)
# and tail paths (``tail_m``: an expert's last tile of at most that many rows runs as a narrower
# MMA); the 4-warp ones fit two programs per SM.
# Decode candidates: the table's entries and their closest neighbours (earlier sweeps:
# results/native_h200/native_sweep_*.json).
CANDIDATES = {
    ("decode", G): [decode_tile(16, 64, 256, 4, 4), decode_tile(16, 64, 256, 4, 3), decode_tile(16, 32, 256, 4, 3),
                    decode_tile(16, 128, 256, 8, 3)],
    ("decode", M): [decode_tile(16, 64, 256, 4, 3), decode_tile(16, 128, 256, 4, 3), decode_tile(16, 128, 256, 4, 4),
                    decode_tile(16, 64, 512, 4, 2)],
    ("prefill", G): [prefill_tile(128, 64, 128, 8, 3, extra_m=64, tail_m=64),
                     prefill_tile(128, 64, 128, 8, 3, tail_m=64),
                     prefill_tile(128, 64, 64, 8, 3, extra_m=64, tail_m=64), prefill_tile(64, 64, 64, 4, 3, extra_m=64),
                     prefill_tile(64, 64, 64, 4, 3, extra_m=64, tail_m=32),
                     prefill_tile(128, 64, 128, 8, 4, extra_m=64, tail_m=64)],
    ("prefill", M): [prefill_tile(64, 128, 128, 4, 3), prefill_tile(128, 128, 128, 8, 3, extra_m=64, tail_m=64),
                     prefill_tile(128, 256, 64, 8, 3, tail_m=64),
                     prefill_tile(128, 128, 64, 8, 3, extra_m=64, tail_m=64),
                     prefill_tile(64, 128, 64, 4, 3, extra_m=64), prefill_tile(64, 128, 64, 4, 4, extra_m=64),
                     prefill_tile(64, 128, 64, 4, 3, extra_m=64, tail_m=32)],
}
# Between decode and prefill (``--mid``: 16-32 rows per expert, Kimi K2 at 1024-1536 tokens on one
# GPU): the decode tile takes two 16-row tiles per expert, so each weight tile is dequantized twice;
# one 32-row tile per expert dequantizes it once and its MMA is 32 rows wide, not 64 or 128.
MID_CANDIDATES = {
    G: [decode_tile(32, 64, 256, 4, 4), decode_tile(32, 64, 128, 4, 4), decode_tile(32, 128, 128, 4, 3),
        decode_tile(32, 32, 256, 4, 4), prefill_tile(32, 64, 256, 4, 4)],
    M: [decode_tile(32, 64, 256, 4, 3), decode_tile(32, 128, 256, 4, 3), decode_tile(32, 128, 128, 4, 4),
        decode_tile(32, 64, 128, 4, 4), prefill_tile(32, 128, 256, 4, 3)],
}


# One group holding every row (Kimi K2's shared expert, intermediate 2048 like a routed one);
# None is the tile the kernel picks by itself.
ONE_GROUP_CANDIDATES = [None, decode_tile(32, 32, 256, 4, 3), decode_tile(64, 64, 128, 4, 3),
                        prefill_tile(64, 32, 128, 4, 3), prefill_tile(128, 32, 128, 4, 2),
                        prefill_tile(128, 64, 128, 8, 3)]


# The W4A16 input gradient (``triton_lang.input_grad``, ``dy @ W_e``) at the training shape (48 local
# experts: EP 8 of 384); block_n is its output tile (the weight's K), block_k its reduction step.
INPUT_GRAD_EXPERTS = 48
INPUT_GRAD_CANDIDATES = [None, prefill_tile(128, 128, 64, 8, 3), prefill_tile(128, 128, 64, 8, 4),
                         prefill_tile(128, 256, 64, 8, 3), prefill_tile(128, 128, 128, 8, 3),
                         prefill_tile(64, 128, 64, 4, 3), prefill_tile(128, 64, 64, 4, 3),
                         prefill_tile(64, 256, 64, 4, 3)]


def kimi_weights(experts: int = EXPERTS):
    """NVFP4 weights at Kimi K2's real size: fused gate/up ``[E, 2F, H]`` and down ``[E, H, F]``."""
    return {G: nvfp4.random(jax.random.key(1), (experts, 2 * INTERMEDIATE, HIDDEN)),
            M: nvfp4.random(jax.random.key(2), (experts, HIDDEN, INTERMEDIATE))}


def sweep(weights, rows, candidates, *, runs: int, mid: bool = False):
    """Times each candidate tile (``candidates[(variant, op)]``; None: the kernel's own choice) at
    each row count, after checking its output against the Pallas kernel's; yields the records."""
    cc = 90
    rng = np.random.default_rng(0)
    experts = weights[G].packed.shape[0]
    for m in rows:
        g = jnp.asarray(group_sizes(m, "uniform", rng, experts=experts))
        touched = int(np.count_nonzero(np.asarray(g)))
        variant = "decode" if m <= 2 * 16 * experts else "prefill"
        for op, w in weights.items():
            n_w, k = w.packed.shape[1], 2 * w.packed.shape[2]
            xs = [jax.random.normal(jax.random.key(10 * m + i), (m, k), jnp.bfloat16) for i in range(2)]
            ref = np.asarray(pallas_run(op, xs[0], w, g, compute_capability=cc), np.float32)
            bytes_ = touched * n_w * (k // 2 + k // 16)
            for tile in candidates[(variant, op)] + (MID_CANDIDATES[op] if mid else []):
                entry = {"op": op.value, "rows": m, "tile": "own choice" if tile is None else dataclasses.asdict(tile),
                         "weight_bytes": bytes_}
                fn = jax.jit(lambda x, w, g, tile=tile, op=op: triton_lang.run(op, x, w, g, compute_capability=cc, tile=tile))
                checked_and_timed(entry, fn, [(x, w, g) for x in xs], ref, runs,
                                  lambda us: {"tb_per_s": bytes_ / (us * 1e-6) / 1e12})
                yield entry


def checked_and_timed(entry: dict, fn, arg_sets, ref, runs: int, rate) -> None:
    """Fills ``entry``: ``fn``'s relative error against ``ref`` on the first argument set, then,
    if below 2e-2, its time (``us``) and ``rate(us)``; any failure as ``error``, never hidden."""
    try:
        got = np.asarray(fn(*arg_sets[0]), np.float32)
        err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
        entry["relative_error_vs_pallas"] = err
        if not err < 2e-2:
            entry["error"] = f"wrong output: relative error {err:.3g} against the Pallas kernel"
        else:
            us = time_jax(fn, arg_sets, runs) * 1e3
            entry.update(us=us, **rate(us))
    except Exception as e:  # recorded, never hidden
        entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    print(json.dumps(entry), flush=True)


def sweep_input_grad(weights, rows, candidates, *, runs: int):
    """Times each input-gradient tile (None: the table's) on each projection's weights at each row
    count, after checking it against the Pallas input-gradient kernel; the Pallas kernel's own
    time is recorded beside them (``"tile": "pallas"``)."""
    from pallas_kernels.grouped_matmul import grouped_matmul_input_grad  # noqa: PLC0415

    cc = 90
    rng = np.random.default_rng(0)
    experts = weights[G].packed.shape[0]
    for m in rows:
        g = jnp.asarray(group_sizes(m, "uniform", rng, experts=experts))
        for op, w in weights.items():
            n_w, k = w.packed.shape[1], 2 * w.packed.shape[2]
            dys = [jax.random.normal(jax.random.key(10 * m + i), (m, n_w), jnp.bfloat16) for i in range(2)]
            pallas = jax.jit(lambda dy, w, g: grouped_matmul_input_grad(dy, w, g, compute_capability=cc))
            ref = np.asarray(pallas(dys[0], w, g), np.float32)
            flops = 2.0 * m * n_w * k
            entries = [("pallas", pallas)] + [
                (tile, jax.jit(lambda dy, w, g, tile=tile: triton_lang.input_grad(dy, w, g, compute_capability=cc,
                                                                            tile=tile)))
                for tile in candidates]
            for tile, fn in entries:
                entry = {"op": f"input_grad_{op.value}", "rows": m,
                         "tile": tile if isinstance(tile, str) else "own choice" if tile is None
                         else dataclasses.asdict(tile), "flops": flops}
                checked_and_timed(entry, fn, [(dy, w, g) for dy in dys], ref, runs,
                                  lambda us: {"tflops": flops / (us * 1e-6) / 1e12})
                yield entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--rows", type=int, nargs="+", default=[256, 2048, 65536])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--one-group", action="store_true",
                        help="one expert holding every row (a shared expert): ONE_GROUP_CANDIDATES at --rows")
    parser.add_argument("--input-grad", action="store_true",
                        help=f"the input-gradient kernel at {INPUT_GRAD_EXPERTS} experts: INPUT_GRAD_CANDIDATES at --rows")
    parser.add_argument("--mid", action="store_true", help="also MID_CANDIDATES (32-row tiles) at --rows")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    bandwidth = copy_bandwidth(args.runs)
    results = {"device": jax.devices()[0].device_kind, "copy_bandwidth_bytes_per_s": bandwidth, "rows": []}
    if args.input_grad:
        name = "input_grad_sweep.json"
        entries = sweep_input_grad(kimi_weights(INPUT_GRAD_EXPERTS), args.rows, INPUT_GRAD_CANDIDATES, runs=args.runs)
    else:
        if args.one_group:
            weights = kimi_weights(1)
            candidates = {(v, op): ONE_GROUP_CANDIDATES for v in ("decode", "prefill") for op in (G, M)}
        else:
            weights, candidates = kimi_weights(), CANDIDATES
        name = "one_group_sweep.json" if args.one_group else "native_sweep.json"
        entries = sweep(weights, args.rows, candidates, runs=args.runs, mid=args.mid)
    for entry in entries:
        results["rows"].append(entry)
        (args.out / name).write_text(json.dumps(results, indent=1))
    best = {}
    for r in results["rows"]:
        if "us" in r and ((r["op"], r["rows"]) not in best or r["us"] < best[(r["op"], r["rows"])]["us"]):
            best[(r["op"], r["rows"])] = r
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    for (op, m), r in sorted(best.items()):
        t = r["tile"]
        tile = t if isinstance(t, str) else (f"{t['block_m']}x{t['block_n']}x{t['block_k']} "
                                             f"w{t['num_warps']} s{t['num_stages']}"
                                             f" extra {t['extra_m']} tail {t['tail_m']}")
        rate = f"{r['tflops']:.0f} TFLOP/s" if "tflops" in r else f"{r['tb_per_s']:.2f} TB/s"
        print(f"best {op} rows={m}: {r['us']:.1f} us, {rate}, tile {tile}")


if __name__ == "__main__":
    main()
