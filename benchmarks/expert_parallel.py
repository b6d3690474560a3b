"""Expert-parallel exchange and layer throughput on 2 and 4 GPUs, Kimi K2 layer (NVFP4).

Measures, in one run:

* NCCL's all-to-all through ``torch.distributed`` (one process per GPU, spawned in a child
  process before JAX touches the GPUs) and XLA's dense ``all_to_all`` moving the same rows
  per device, ``T * k`` rows of ``H = 7168`` bf16, split evenly over the devices;
* raw ``jax.lax.ragged_all_to_all`` on the same rows with 1 and 128 updates per peer,
  and with 1 update per peer under XLA's decomposer flag (per-function ``compiler_options``);
* each registered exchange (``ragged``, ``padded``, ``allgather``) doing dispatch and combine
  around an identity expert function, on uniform top-8 routing over 384 experts: the time of
  the whole exchange (planning, local sort, both collectives, combine);
* the whole layer (router, exchange, expert MLPs, shared expert) at EP = 1, 2, 4 with
  ``exchange="auto"`` (told the tokens per device), in tokens/s, and the expert weight bytes
  each device holds.

Bandwidth is bytes sent to *other* devices per device over the time: for an exchange the
payload rows of dispatch plus combine; for the references their rows times ``(D - 1) / D``.

Timing: each program is compiled and run twice, then timed in 5 windows of ``--iters`` calls
back to back (JAX dispatch is asynchronous), each blocked on once; the time per call is the
median window's wall time over its calls.

Usage::

    python benchmarks/expert_parallel.py --out DIR            # GPUs (2 and 4 needed)
    python benchmarks/expert_parallel.py --smoke --out DIR    # CPU, tiny shapes: the script runs
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import pathlib
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

DECOMPOSER = {"xla_gpu_unsupported_enable_ragged_all_to_all_decomposer": True}


# --- NCCL through torch.distributed (child process; no JAX) -------------------------------------


def _nccl_rank(rank: int, world: int, port: int, rows_list: list[int], hidden: int, iters: int, result: str):
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    out = []
    for rows in rows_list:
        x = torch.randn(rows, hidden, dtype=torch.bfloat16, device="cuda")
        y = torch.empty_like(x)
        for _ in range(3):
            dist.all_to_all_single(y, x)
        torch.cuda.synchronize()
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            dist.all_to_all_single(y, x)
        end.record()
        torch.cuda.synchronize()
        seconds = torch.tensor([start.elapsed_time(end) / 1e3 / iters], device="cuda")
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        out.append({"rows_per_device": rows, "seconds": float(seconds)})
    if rank == 0:
        pathlib.Path(result).write_text(json.dumps(out))
    dist.destroy_process_group()


def nccl_worker(args):
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_nccl_rank, args=(args.world, port, args.rows, args.hidden, args.iters, args.result), nprocs=args.world)


def measure_nccl(world: int, rows_list: list[int], hidden: int, iters: int) -> list[dict]:
    """NCCL all-to-all times, or one entry saying why there are none."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(world))), "NCCL_NVLS_ENABLE": "0",
           "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        result = pathlib.Path(tmp) / "nccl.json"
        cmd = [sys.executable, __file__, "--nccl-worker", "--world", str(world), "--hidden", str(hidden),
               "--iters", str(iters), "--result", str(result), "--rows", *map(str, rows_list)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
        if proc.returncode or not result.exists():
            return [{"error": (proc.stdout + proc.stderr)[-2000:]}]
        return json.loads(result.read_text())


# --- JAX -------------------------------------------------------------------------------------------


def timed(fn, *args, iters: int, compiler_options=None, windows: int = 5):
    """(seconds per call, compile seconds) of ``jax.jit(fn)`` on ``args``.

    After two warm-up calls, ``windows`` windows of ``iters`` back-to-back calls (JAX dispatch
    is asynchronous, so the device never waits for the host inside a window) are each blocked
    on once; the time is the median window over ``iters``.
    """
    import jax

    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile(compiler_options or {})
    compile_s = time.perf_counter() - start
    for _ in range(2):
        jax.block_until_ready(compiled(*args))
    per_call = []
    for _ in range(windows):
        start = time.perf_counter()
        for _ in range(iters):
            out = compiled(*args)
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - start) / iters)
    return statistics.median(per_call), compile_s


def uniform_routing(key, tokens: int, num_experts: int, top_k: int):
    """Distinct top-k ids per token, uniformly at random, and normalized weights."""
    import jax
    import jax.numpy as jnp

    k1, k2 = jax.random.split(key)
    ids_tk = jnp.argsort(jax.random.uniform(k1, (tokens, num_experts)), axis=1)[:, :top_k].astype(jnp.int32)
    w_tk = jax.random.uniform(k2, (tokens, top_k), minval=0.1)
    return ids_tk, w_tk / w_tk.sum(1, keepdims=True)


def exchange_benchmarks(ep: int, tokens: int, shape: dict, iters: int, smoke: bool, raw_updates: list[int],
                        ragged_min_updates: list[int], names: list[str]) -> list[dict]:
    """Every exchange and reference at one expert-parallel size and token count per device."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import sharding
    from sharding.exchange.layout import BUCKET_FACTORS, buffer_buckets
    from sharding.exchange.ragged import RAGGED_MIN_UPDATES_PER_PEER

    e, k, h = shape["experts"], shape["top_k"], shape["hidden"]
    mesh = sharding.make_mesh(ep, devices=jax.devices()[:ep])
    spec = P("expert")
    put = lambda a: jax.device_put(a, NamedSharding(mesh, spec))
    key = jax.random.key(ep * 7919 + tokens)
    x_th = put(jax.random.normal(key, (ep * tokens, h), jnp.bfloat16))
    ids_tk, w_tk = uniform_routing(jax.random.fold_in(key, 1), ep * tokens, e, k)
    ids_tk, w_tk = put(ids_tk), put(w_tk)
    rows = tokens * k  # per device
    e_l = e // ep

    # Payload: rows each device sends to other devices (mean over devices), per direction.
    owner = np.asarray(ids_tk).reshape(ep, tokens * k) // e_l
    to_peers = float(np.mean([(owner[s] != s).sum() for s in range(ep)]))
    payload = to_peers * h * 2
    counts = np.stack([np.bincount(owner[s], minlength=ep) for s in range(ep)])
    # onecopy: distinct other devices per token (mean over devices)
    copies = float(np.mean([sum(len(set(t.tolist()) - {s}) for t in owner[s].reshape(tokens, k)) for s in range(ep)]))
    per_peer = buffer_buckets(math.ceil(rows / ep), rows, BUCKET_FACTORS)
    chosen = next(b for b in per_peer if b >= counts.max())
    ref_bytes = rows * (ep - 1) / ep * h * 2

    def shmap(body, out_spec=spec):
        return jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=out_spec)

    identity = lambda x_mh, group_sizes_e: x_mh
    out = []

    def record(name, fn, args, bytes_to_peers, wire_bytes, **extra):
        entry = {"ep": ep, "tokens_per_device": tokens, "name": name, "bytes_to_peers": bytes_to_peers,
                 "wire_bytes": wire_bytes, **extra}
        try:
            seconds, compile_s = timed(fn, *args, iters=iters, compiler_options=extra.pop("compiler_options", None))
            entry.update(seconds=seconds, compile_seconds=compile_s, gb_per_s=bytes_to_peers / seconds / 1e9)
        except Exception as err:  # recorded in the results, never hidden
            entry["error"] = f"{type(err).__name__}: {str(err)[:600]}"
        entry.pop("compiler_options", None)
        print(json.dumps(entry), flush=True)
        out.append(entry)

    x_rows = put(jax.random.normal(jax.random.fold_in(key, 2), (ep * rows, h), jnp.bfloat16))
    dense = shmap(lambda x: jax.lax.all_to_all(x.reshape(ep, rows // ep, h), "expert", 0, 0, tiled=True).reshape(rows, h))
    record("xla_dense_all_to_all", dense, (x_rows,), ref_bytes, ref_bytes)

    if not smoke:
        for updates, options in [*((u, None) for u in raw_updates), (1, DECOMPOSER)]:
            u = max(1, min(updates, rows // ep))
            chunk = rows // ep // u
            size = jnp.full((ep * u,), chunk, jnp.int32)
            index = jnp.arange(ep * u, dtype=jnp.int32)

            def raw(x, u=u, chunk=chunk, size=size, index=index):
                # Update j to peer d is rows (d*u + j)*chunk here and lands at (me*u + j)*chunk there.
                at = (jax.lax.axis_index("expert") * u + index % u) * chunk
                return jax.lax.ragged_all_to_all(x, jnp.zeros_like(x), index * chunk, size, at, size, axis_name="expert")

            name = f"raw_ragged_all_to_all_{u}_updates" + ("_decomposer" if options else "")
            record(name, shmap(raw), (x_rows,), ref_bytes, ref_bytes, compiler_options=options)

    exchanges = {}
    for name in names:
        match name:
            case "ragged" if not smoke:  # XLA:CPU has no ragged_all_to_all
                for minimum in ragged_min_updates:
                    label = "ragged" if minimum == RAGGED_MIN_UPDATES_PER_PEER else f"ragged_min_updates_{minimum}"
                    exchanges[label] = (name, minimum, functools.partial(sharding.ragged_exchange, min_updates_per_peer=minimum))
            case "ragged":
                pass
            case "onecopy" if not smoke:  # XLA:CPU has no ragged_all_to_all
                exchanges[name] = (name, None, sharding.onecopy_exchange)
            case "onecopy":
                pass
            case "padded":
                exchanges[name] = (name, None, sharding.padded_exchange)
            case "allgather":
                exchanges[name] = (name, None, sharding.allgather_exchange)
            case other:
                raise ValueError(f"--exchanges: {other!r}, expected ragged, onecopy, padded or allgather")
    for label, (name, minimum, exchange) in exchanges.items():
        def body(x, ids, w, exchange=exchange):
            return exchange(x, ids, w, identity, num_experts=e, axis_name="expert", capacity_factor=None)[0]

        fn = jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)
        match name:
            case "ragged":
                wire = 2 * payload
                extra = {"updates_per_peer": e_l * max(1, math.ceil(minimum / e_l))}
            case "padded":
                wire = 2 * (ep - 1) * chosen * h * 2
                extra = {"per_peer_buffer_rows": chosen, "max_rows_to_one_peer": int(counts.max())}
            case "onecopy":  # copies out (row, int32 ids, float32 weights), float32 partial sums back
                wire = copies * (h * 2 + k * 8) + copies * h * 4
                extra = {"copies_per_device": copies}
            case "allgather":
                wire = (ep - 1) * tokens * h * (2 + 4)
                extra = {}
        record(label, fn, (x_th, ids_tk, w_tk), 2 * payload, wire, **extra)
    return out


def layer_benchmarks(eps: list[int], tokens_list: list[int], config, iters: int, out: list[dict], save) -> None:
    """Tokens/s of the whole layer at each expert-parallel size and global token count,
    appended to ``out`` (and saved) as they come."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import sharding
    from moe_jax import moe_forward, random_params, resolve

    for ep in eps:
        devices = jax.devices()[:ep]
        mesh = sharding.make_mesh(ep, devices=devices) if ep > 1 else None
        target = mesh if mesh is not None else devices
        key = jax.random.key(ep)
        params = random_params(config, key, resolve(config, target))
        expert_bytes = sum(a.addressable_shards[0].data.nbytes for a in jax.tree.leaves(params["experts"]))
        for tokens in tokens_list:
            entry = {"ep": ep, "tokens": tokens, "expert_weight_bytes_per_device": expert_bytes}
            try:
                plan = resolve(config, target, tokens_per_device=tokens // ep)
                entry.update(exchange=plan.exchange, expert_gemm=plan.expert_gemm)
                x = jax.random.normal(jax.random.fold_in(key, tokens), (tokens, config.hidden_size), jnp.bfloat16)
                if mesh is not None:
                    x = jax.device_put(x, NamedSharding(mesh, P("expert")))
                seconds, compile_s = timed(lambda p, x: moe_forward(p, x, plan)[0], params, x, iters=iters)
                entry.update(seconds=seconds, compile_seconds=compile_s, tokens_per_s=tokens / seconds)
            except Exception as err:  # recorded in the results, never hidden
                entry["error"] = f"{type(err).__name__}: {str(err)[:600]}"
            print(json.dumps(entry), flush=True)
            out.append(entry)
            save()
        del params


# --- report ----------------------------------------------------------------------------------------


EXCHANGE_NAMES = ("ragged", "onecopy", "padded", "allgather")


def summarize(results: dict) -> list[dict]:
    """Per exchange measured: its bandwidth over the faster reference's of the same run.

    Effective bandwidth counts the rows an expert-level exchange must deliver (each
    (token, expert) row to its owner and back); wire bandwidth counts what it moved.
    """
    rows = []
    hidden, top_k = results["shape"]["hidden"], results["shape"]["top_k"]
    for r in results["exchange"]:
        if not r["name"].startswith(EXCHANGE_NAMES) or "seconds" not in r:
            continue
        same = lambda o: (o["ep"], o["tokens_per_device"], o.get("run")) == (r["ep"], r["tokens_per_device"], r.get("run"))
        refs = {o["name"]: o["gb_per_s"] for o in results["exchange"] if o["name"] == "xla_dense_all_to_all" and same(o)
                and "gb_per_s" in o}
        for n in results.get("nccl", {}).get(str(r["ep"]), []):
            if n.get("rows_per_device") == r["tokens_per_device"] * top_k and n.get("run") == r.get("run") \
                    and "seconds" in n:
                refs["nccl_all_to_all"] = n["rows_per_device"] * (r["ep"] - 1) / r["ep"] * hidden * 2 / n["seconds"] / 1e9
        if not refs:
            continue
        best_name, best = max(refs.items(), key=lambda kv: kv[1])
        wire = r["wire_bytes"] / r["seconds"] / 1e9
        rows.append({"ep": r["ep"], "tokens_per_device": r["tokens_per_device"], "exchange": r["name"],
                     "run": r.get("run", 1), "gb_per_s": r["gb_per_s"], "wire_gb_per_s": wire,
                     "reference": best_name, "reference_gb_per_s": best, "ratio": r["gb_per_s"] / best,
                     "wire_ratio": wire / best})
    return rows


def markdown(results: dict) -> str:
    runs = results.get("runs") or [{"date": results["date"], "command": results["command"]}]
    lines = [f"# Expert parallelism: {results['device']}", "", f"- jax {results['jax']}; shape: {results['shape']}"]
    lines += [f"- run {i + 1}: {r['date']}, {r.get('device') or results['device']}: `{r['command']}`"
              + (f" ({r['notes']})" if r.get("notes") else "") for i, r in enumerate(runs)] + [""]
    lines += ["## Exchange (dispatch + combine) and collectives", "",
              "| run | EP | tokens/device | what | time (ms) | to peers (MB) | on the wire (MB) | GB/s to peers | note |",
              "|---|---|---|---|---|---|---|---|---|"]
    nccl = results.get("nccl", {})
    run_of = lambda r: r.get("run", 1)
    for r in results["exchange"]:
        note = r.get("error", "")[:120] or ", ".join(f"{k}={v}" for k, v in r.items()
                                                        if k in ("updates_per_peer", "per_peer_buffer_rows", "max_rows_to_one_peer"))
        ms = f"{r['seconds'] * 1e3:.3f}" if "seconds" in r else "-"
        gbs = f"{r['gb_per_s']:.1f}" if "gb_per_s" in r else "-"
        lines.append(f"| {run_of(r)} | {r['ep']} | {r['tokens_per_device']} | {r['name']} | {ms} | {r['bytes_to_peers'] / 1e6:.2f} | "
                     f"{r['wire_bytes'] / 1e6:.2f} | {gbs} | {note} |")
    for ep, entries in nccl.items():
        for n in entries:
            if "seconds" in n:
                b = n["rows_per_device"] * (int(ep) - 1) / int(ep) * results["shape"]["hidden"] * 2
                lines.append(f"| {run_of(n)} | {ep} | {n['rows_per_device'] // results['shape']['top_k']} | nccl_all_to_all (torch) | "
                             f"{n['seconds'] * 1e3:.3f} | {b / 1e6:.2f} | {b / 1e6:.2f} | {b / n['seconds'] / 1e9:.1f} | |")
            else:
                lines.append(f"| {run_of(n)} | {ep} | - | nccl_all_to_all (torch) | - | - | - | - | {n.get('error', '')[-200:]!r} |")
    lines += ["", "## Exchange bandwidth against the faster reference of the same run (target >= 0.70)", "",
              "Effective: the (token, expert) rows an exchange must deliver, both ways, over its time; "
              "wire: what it moved.", "",
              "| run | EP | tokens/device | exchange | effective GB/s | wire GB/s | reference | reference GB/s | "
              "effective ratio | wire ratio |", "|---|---|---|---|---|---|---|---|---|---|"]
    for s in results["summary"]:
        lines.append(f"| {s['run']} | {s['ep']} | {s['tokens_per_device']} | {s['exchange']} | {s['gb_per_s']:.1f} | "
                     f"{s['wire_gb_per_s']:.1f} | {s['reference']} | {s['reference_gb_per_s']:.1f} | {s['ratio']:.2f} | "
                     f"{s['wire_ratio']:.2f} |")
    lines += ["", "## Whole layer", "",
              "| EP | tokens | exchange | expert GEMM | time (ms) | tokens/s | vs EP=1 | expert weights per device (GB) | note |",
              "|---|---|---|---|---|---|---|---|---|"]
    base = {r["tokens"]: r.get("tokens_per_s") for r in results["layer"] if r["ep"] == 1}
    for r in results["layer"]:
        speed = f"{r['tokens_per_s'] / base[r['tokens']]:.2f}x" if base.get(r["tokens"]) and "tokens_per_s" in r else "-"
        ms = f"{r['seconds'] * 1e3:.2f}" if "seconds" in r else "-"
        tps = f"{r['tokens_per_s']:.0f}" if "tokens_per_s" in r else "-"
        lines.append(f"| {r['ep']} | {r['tokens']} | {r.get('exchange', '-')} | {r.get('expert_gemm', '-')} | {ms} | {tps} | "
                     f"{speed} | {r['expert_weight_bytes_per_device'] / 1e9:.2f} | {r.get('error', '')[:120]} |")
    return "\n".join(lines) + "\n"


def _plot_exchanges(ax1, results: dict):
    """Left panel: GB/s of every exchange at the largest tokens per device, NCCL as lines."""
    largest = max(r["tokens_per_device"] for r in results["exchange"])
    names = [n for n in dict.fromkeys(r["name"] for r in results["exchange"])]
    eps = sorted({r["ep"] for r in results["exchange"]})
    width = 0.8 / max(1, len(eps))
    for i, ep in enumerate(eps):
        vals = [next((r.get("gb_per_s", 0) for r in results["exchange"]
                      if r["ep"] == ep and r["name"] == n and r["tokens_per_device"] == largest), 0) for n in names]
        ax1.barh([j + i * width for j in range(len(names))], vals, height=width, label=f"EP={ep}")
    for ep, entries in results.get("nccl", {}).items():
        for n in entries:
            if "seconds" in n and n["rows_per_device"] == largest * results["shape"]["top_k"]:
                b = n["rows_per_device"] * (int(ep) - 1) / int(ep) * results["shape"]["hidden"] * 2
                ax1.axvline(b / n["seconds"] / 1e9, ls="--", color="k" if ep == "2" else "gray", label=f"NCCL EP={ep}")
    ax1.set_yticks([j + width * (len(eps) - 1) / 2 for j in range(len(names))], names, fontsize=7)
    ax1.set_xlabel("GB/s sent to other devices, per device")
    ax1.set_title(f"{largest} tokens/device")
    ax1.legend(fontsize=7)


def plot(results: dict, path: pathlib.Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    if not results["exchange"]:
        ax1.set_axis_off()
        ax1.text(0.5, 0.5, "no exchange measured in this run", ha="center", va="center")
    else:
        _plot_exchanges(ax1, results)
    for tokens in sorted({r["tokens"] for r in results["layer"]}):
        pts = [(r["ep"], r["tokens_per_s"]) for r in results["layer"] if r["tokens"] == tokens and "tokens_per_s" in r]
        if pts:
            ax2.plot(*zip(*pts), marker="o", label=f"{tokens} tokens")
    ax2.set_xlabel("expert-parallel devices")
    ax2.set_ylabel("layer tokens/s")
    ax2.set_yscale("log")
    ax2.legend(fontsize=7)
    ax2.set_title(f"whole layer ({results['layer_expert_gemm']})")
    fig.suptitle(f"{results['device']}, {results['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=pathlib.Path)
    parser.add_argument("--ep", type=int, nargs="+", default=[2, 4],
                        help="expert-parallel sizes beside EP=1 (--ep 1: the EP=1 layer rows alone)")
    parser.add_argument("--exchange-tokens", type=int, nargs="+", default=[16, 4096], help="tokens per device")
    parser.add_argument("--layer-tokens", type=int, nargs="+", default=[32, 512, 8192], help="tokens in all")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--layer-iters", type=int, default=5)
    parser.add_argument("--exchanges", nargs="+", default=["ragged", "onecopy", "padded", "allgather"])
    parser.add_argument("--raw-updates", type=int, nargs="+", default=[1, 128], help="raw ragged updates per peer")
    parser.add_argument("--ragged-min-updates", type=int, nargs="+", default=None,
                        help="ragged exchange variants (default: the registered setting)")
    parser.add_argument("--skip-nccl", action="store_true")
    parser.add_argument("--skip-layer", action="store_true")
    parser.add_argument("--merge", type=pathlib.Path, nargs="+",
                        help="no measuring: one report from these result JSONs (later runs add rows)")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, no NCCL: checks the script")
    parser.add_argument("--nccl-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rows", type=int, nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--hidden", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.nccl_worker:
        return nccl_worker(args)
    if args.out is None:
        parser.error("--out is required")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.merge:
        return report(merge([json.loads(p.read_text()) for p in args.merge]), args.out)

    from moe_jax import MoEConfig

    config = MoEConfig.kimi_k2(weight_format="nvfp4")
    if args.smoke:
        config = MoEConfig.kimi_k2(weight_format="nvfp4", num_experts=16, hidden_size=64, expert_intermediate_size=32)
    shape = {"experts": config.num_experts, "top_k": config.top_k, "hidden": config.hidden_size,
             "intermediate": config.expert_intermediate_size}
    results = {"command": shlex.join([sys.executable.split("/")[-1], *sys.argv]),
               "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "shape": shape,
               "nccl": {}, "exchange": [], "layer": []}
    save = lambda: (args.out / "expert_parallel.json").write_text(json.dumps(results, indent=1))

    parallel = sorted(set(args.ep) - {1})
    if not (args.smoke or args.skip_nccl):  # before JAX allocates GPU memory
        for ep in parallel:
            results["nccl"][str(ep)] = measure_nccl(ep, [t * config.top_k for t in args.exchange_tokens],
                                                     config.hidden_size, args.iters)
            print("nccl", ep, results["nccl"][str(ep)], flush=True)
    import jax

    import moe_jax
    from sharding.exchange.ragged import RAGGED_MIN_UPDATES_PER_PEER

    devices = jax.devices()
    results.update(device=f"{len(devices)} x {devices[0].device_kind}", jax=jax.__version__,
                   layer_expert_gemm=", ".join(moe_jax.EXPERT_GEMM.names()))
    save()
    for ep in parallel:
        for tokens in args.exchange_tokens:
            try:
                results["exchange"] += exchange_benchmarks(
                    ep, tokens, shape, args.iters, args.smoke, args.raw_updates,
                    args.ragged_min_updates or [RAGGED_MIN_UPDATES_PER_PEER], args.exchanges)
            except Exception:  # recorded in the results, never hidden
                results["exchange"].append({"ep": ep, "tokens_per_device": tokens, "name": "setup", "bytes_to_peers": 0,
                                            "wire_bytes": 0, "error": traceback.format_exc()[-600:]})
            save()
    if not args.skip_layer:
        layer_benchmarks([1, *parallel], args.layer_tokens, config, args.layer_iters, results["layer"], save)
    save()
    report(results, args.out)


def merge(runs: list[dict]) -> dict:
    """One result from several runs of this script: the first run's header, every run's rows
    (each tagged with its run's number)."""
    merged = {**runs[0], "runs": [{"date": r["date"], "command": r["command"], "device": r.get("device"),
                                   "notes": r.get("notes", "")} for r in runs],
              "nccl": {}, "exchange": [], "layer": []}
    for i, run in enumerate(runs):
        tag = {"run": i + 1}
        for ep, entries in run.get("nccl", {}).items():
            merged["nccl"].setdefault(ep, []).extend({**n, **tag} for n in entries)
        merged["exchange"] += [{**r, **tag} for r in run["exchange"]]
        merged["layer"] += [{**r, **tag} for r in run["layer"]]
    return merged


def report(results: dict, out: pathlib.Path):
    results["summary"] = summarize(results)
    (out / "expert_parallel.json").write_text(json.dumps(results, indent=1))
    (out / "expert_parallel.md").write_text(markdown(results))
    plot(results, out / "expert_parallel.png")
    print(markdown(results))


if __name__ == "__main__":
    main()
