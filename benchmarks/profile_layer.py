"""Where one Kimi K2 layer call spends its GPU time: every kernel, from a ``jax.profiler`` trace.

The whole-layer benchmark (``benchmarks/layer.py``) gives one number per call; at decode sizes
it is ~0.4 ms above the two expert kernels timed alone. This script splits it: it builds the
layer at Kimi K2's real size (384 experts on one GPU) as ``layer.py`` does, times it the same
way, then records a few calls with ``jax.profiler.trace`` (CUPTI activity records: kernels run
as they do unprofiled, unlike under Nsight Compute) and reads the trace's GPU kernels back.

Per token count it reports, per layer call: the wall time (timed, no profiler), the span of the
call's kernels on the GPU, the time some kernel runs (the union of kernel intervals; span minus
busy = gaps between kernels), and a table of kernels by total time with the HLO op each belongs
to and, for XLA's fusions, the JAX op each came from (the compiled module's metadata, named scopes
included: which part of the layer a fusion between the expert kernels is). Results:
``profile_layer.json`` and ``profile_layer.md`` in ``--out``; with ``--keep-trace`` the raw
Perfetto trace files too.

Usage::

    python benchmarks/profile_layer.py --out DIR [--tokens 32 256] [--format nvfp4] [--expert-gemm triton]
        [--calls 5] [--preset kimi_k2|small]

``--preset small`` (a few experts, hidden 256) runs anywhere, the CPU included, to check the
script itself; on the CPU the trace has no GPU kernels and the tables say so.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import glob
import gzip
import json
import os
import pathlib
import re
import shutil
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import moe_jax  # noqa: E402
from benchmarks.expert_parallel import timed  # noqa: E402


def config_for(preset: str, fmt: str, gemm: str, shared_fmt: str | None = None,
               prefill_activations: str = "bf16") -> moe_jax.MoEConfig:
    """``shared_fmt`` None: the shared expert in the routed experts' format; ``"bf16"``: as
    NVIDIA's NVFP4 export of Kimi K2 keeps it. ``prefill_activations="fp8"``: W4A8 at prefill
    sizes (SM90, ``triton``)."""
    config = moe_jax.MoEConfig.kimi_k2(weight_format=fmt, expert_gemm=gemm, shared_weight_format=shared_fmt,
                                       prefill_activations=prefill_activations)
    if preset == "kimi_k2":
        return config
    return dataclasses.replace(config, num_experts=16, hidden_size=256, expert_intermediate_size=128, top_k=4)


def _named(trace: dict) -> tuple[list, dict, dict]:
    """``(events, process name by pid, thread name by (pid, tid))`` of a Chrome/Perfetto trace."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    return events, procs, threads


def gpu_kernels(trace: dict) -> list[dict]:
    """The kernel events of a Chrome/Perfetto trace: ``X`` events on a GPU device's stream lines.

    XLA's trace puts each GPU in a process named ``/device:GPU:N`` and gives its CUDA streams
    thread lines named ``Stream #...``; the other lines of that process (``XLA Modules``,
    ``XLA Ops``) summarize the same time and are left out so nothing is counted twice.
    """
    events, procs, threads = _named(trace)
    gpu = {pid for pid, name in procs.items() if "GPU" in name or "gpu" in name}
    out = []
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in gpu:
            continue
        if "stream" not in threads.get((e["pid"], e.get("tid")), "").lower():
            continue
        out.append({"name": e.get("name", "?"), "ts": float(e["ts"]), "dur": float(e.get("dur", 0.0)),
                    "hlo_op": (e.get("args") or {}).get("hlo_op", "")})
    return out


def thread_lines(trace: dict) -> dict[str, int]:
    """How many ``X`` events each ``process / thread`` line holds (to see the trace's layout)."""
    events, procs, threads = _named(trace)
    counts = collections.Counter(f"{procs.get(e.get('pid'), e.get('pid'))} / {threads.get((e.get('pid'), e.get('tid')), e.get('tid'))}"
                                 for e in events if e.get("ph") == "X")
    return dict(counts.most_common(30))


def busy_us(kernels: list[dict]) -> float:
    """Microseconds during which at least one kernel runs (the union of their intervals)."""
    total, end = 0.0, -np.inf
    for k in sorted(kernels, key=lambda k: k["ts"]):
        start, stop = k["ts"], k["ts"] + k["dur"]
        if start > end:
            total += k["dur"]
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def summarize(kernels: list[dict], calls: int) -> dict:
    """Per-call span, busy time and a table of kernels (by name and HLO op), in microseconds."""
    if not kernels:
        return {"kernels_per_call": 0, "span_us": None, "busy_us": None, "table": []}
    span = (max(k["ts"] + k["dur"] for k in kernels) - min(k["ts"] for k in kernels)) / calls
    by = collections.defaultdict(lambda: [0, 0.0])
    for k in kernels:
        row = by[(k["name"], k["hlo_op"])]
        row[0] += 1
        row[1] += k["dur"]
    table = sorted(({"kernel": name, "hlo_op": op, "launches_per_call": n / calls, "us_per_call": t / calls}
                    for (name, op), (n, t) in by.items()), key=lambda r: -r["us_per_call"])
    return {"kernels_per_call": len(kernels) / calls, "span_us": span, "busy_us": busy_us(kernels) / calls,
            "table": table}


def profile(fn, args, calls: int, keep: pathlib.Path | None) -> tuple[list[dict], dict[str, int]]:
    """Runs ``fn(*args)`` ``calls`` times under ``jax.profiler.trace``; its GPU kernels and lines."""
    tmp = tempfile.mkdtemp(prefix="moe_jax_trace_")
    try:
        jax.block_until_ready(fn(*args))
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            for _ in range(calls):
                out = fn(*args)
            jax.block_until_ready(out)
        paths = sorted(glob.glob(os.path.join(tmp, "**", "*.trace.json.gz"), recursive=True))
        if not paths:
            raise RuntimeError(f"jax.profiler.trace wrote no *.trace.json.gz under {tmp}")
        with gzip.open(paths[-1]) as f:
            trace = json.load(f)
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            shutil.copy(paths[-1], keep / os.path.basename(paths[-1]))
        return gpu_kernels(trace), thread_lines(trace)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


_FUSION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+) fusion\(.*?kind=(\w+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def fusion_sources(hlo_text: str) -> dict[str, dict]:
    """Each XLA fusion of a compiled module's text (``compiled.as_text()``), by the name its GPU
    kernel has in a trace (the instruction's name, ``.`` as ``_``): its result shape, kind and the
    JAX op it came from (``metadata={op_name=...}``, which carries the ``jax.named_scope`` path)."""
    sources = {}
    for line in hlo_text.splitlines():
        m = _FUSION.match(line)
        if m:
            op = _OP_NAME.search(line)
            sources[m.group(1).replace(".", "_")] = {"shape": m.group(2), "kind": m.group(3),
                                                      "op_name": op.group(1) if op else ""}
    return sources


def _shared_kernel_limit(limit) -> str:
    """``Plan.shared_kernel_max_tokens`` in words (None: every size; 0: never)."""
    if limit is None:
        return "through the kernels at every size"
    return "dense (never through the kernels)" if limit == 0 else f"through the kernels up to {limit} tokens"


def markdown(results: dict) -> str:
    meta = results["meta"]
    lines = [f"# Where a layer call spends its GPU time ({meta['device']})", "",
             f"{meta['date']}, commit {meta['commit']}, `{meta['command']}`.", "",
             f"{meta['preset']} layer, {meta['format']} experts on `{meta['expert_gemm']}` (plan: "
             f"`{meta['resolved_expert_gemm']}`; "
             + ("shared expert in bf16, an XLA dot" if meta.get("shared_format") == "bf16" else
                f"shared expert {_shared_kernel_limit(meta.get('shared_kernel_max_tokens', '?'))}")
             + ("; W4A8 at prefill sizes, `prefill_activations='fp8'`"
                if meta.get("prefill_activations") == "fp8" else "")
             + "), all experts on one device. Wall: median of 5 windows of "
             f"{meta['iters']} calls, no profiler. Span, busy and the kernel table: {meta['calls']} calls under "
             "`jax.profiler.trace`, per call; busy = time at least one kernel runs, so span - busy is the "
             "time between kernels.", ""]
    for r in results["rows"]:
        s = r["summary"]
        lines += [f"## {r['tokens']} tokens", ""]
        if "error" in r:
            lines += [f"error: {r['error']}", ""]
            continue
        if not s["table"]:
            lines += [f"wall {r['wall_us']:.0f} us; the trace holds no GPU kernels (lines: "
                      f"{', '.join(r['lines'])[:300]})", ""]
            continue
        lines += [f"wall {r['wall_us']:.0f} us; kernels: span {s['span_us']:.0f} us, busy {s['busy_us']:.0f} us, "
                  f"{s['kernels_per_call']:.0f} launches", "",
                  "| kernel | HLO op | launches | us per call | share of busy | XLA fusion: shape, JAX op |",
                  "|---|---|---:|---:|---:|---|"]
        sources = r.get("fusions", {})
        for row in s["table"][:25]:
            source = sources.get(row["kernel"])
            where = f"`{source['shape']}` `{source['op_name'][-90:]}`" if source else ""
            lines.append(f"| `{row['kernel'][:70]}` | `{row['hlo_op'][:50]}` | {row['launches_per_call']:.0f} | "
                         f"{row['us_per_call']:.1f} | {row['us_per_call'] / s['busy_us']:.1%} | {where} |")
        if len(s["table"]) > 25:
            rest = sum(row["us_per_call"] for row in s["table"][25:])
            lines.append(f"| {len(s['table']) - 25} more | | | {rest:.1f} | {rest / s['busy_us']:.1%} | |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--tokens", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--format", default="nvfp4", choices=["nvfp4", "bf16"])
    parser.add_argument("--expert-gemm", default="auto")
    parser.add_argument("--preset", default="kimi_k2", choices=["kimi_k2", "small"])
    parser.add_argument("--shared-format", default=None, choices=["bf16", "nvfp4"],
                        help="the shared expert's weights (default: the routed experts' format; NVIDIA's NVFP4 "
                             "export of Kimi K2 keeps them in bf16)")
    parser.add_argument("--calls", type=int, default=5, help="calls recorded in each trace")
    parser.add_argument("--iters", type=int, default=10, help="calls per timing window (no profiler)")
    parser.add_argument("--shared-kernel-max-tokens", type=int, default=None,
                        help="override the plan's limit for the shared expert through the kernels (0: never), "
                             "to time both ways in one run")
    parser.add_argument("--router-dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the router's weights (checkpoints of Kimi K2 and DeepSeek-V3 store them in bf16, "
                             "and the loader keeps them so: one bf16 matmul for the logits instead of three)")
    parser.add_argument("--prefill-activations", default="bf16", choices=["bf16", "fp8"],
                        help="fp8: W4A8 at prefill sizes (MoEConfig.prefill_activations; SM90, 'triton')")
    parser.add_argument("--keep-trace", action="store_true", help="copy the raw trace files into --out")
    args = parser.parse_args()
    if args.calls < 1 or args.iters < 1:
        parser.error(f"--calls {args.calls}, --iters {args.iters}: expected >= 1")
    args.out.mkdir(parents=True, exist_ok=True)
    config = config_for(args.preset, args.format, args.expert_gemm, args.shared_format, args.prefill_activations)
    plan = moe_jax.resolve(config, None)
    if args.shared_kernel_max_tokens is not None:
        plan = dataclasses.replace(plan, shared_kernel_max_tokens=args.shared_kernel_max_tokens)
    print(plan.report, flush=True)
    results = {"meta": {"device": jax.devices()[0].device_kind, "date": datetime.date.today().isoformat(),
                        "commit": os.environ.get("GIT_COMMIT", "unknown"), "preset": args.preset,
                        "format": args.format, "shared_format": str(config.shared_format),
                        "router_dtype": args.router_dtype, "expert_gemm": args.expert_gemm,
                        "prefill_activations": config.prefill_activations,
                        "resolved_expert_gemm": plan.expert_gemm, "calls": args.calls,
                        "shared_kernel_max_tokens": plan.shared_kernel_max_tokens, "iters": args.iters,
                        "jax": jax.__version__, "report": plan.report,
                        "command": "python benchmarks/profile_layer.py " + " ".join(sys.argv[1:])},
               "rows": []}
    params = moe_jax.random_params(config, jax.random.key(0), plan)
    params["router"]["w_eh"] = params["router"]["w_eh"].astype(args.router_dtype)
    fn = jax.jit(lambda p, x: moe_jax.moe_forward(p, x, plan)[0])
    for tokens in args.tokens:
        row = {"tokens": tokens}
        try:
            x = jax.random.normal(jax.random.key(tokens), (tokens, config.hidden_size), jnp.bfloat16)
            seconds, _ = timed(lambda p, x: moe_jax.moe_forward(p, x, plan)[0], params, x, iters=args.iters)
            # one program, profiled and read: its fusions are the kernels the trace names
            compiled = fn.lower(params, x).compile()
            kernels, lines = profile(compiled, (params, x), args.calls,
                                     args.out / "traces" if args.keep_trace else None)
            summary = summarize(kernels, args.calls)
            # which JAX op each of the timed XLA fusions comes from: the gaps between the kernels named
            sources = fusion_sources(compiled.as_text())
            row.update(wall_us=seconds * 1e6, summary=summary, lines=list(lines),
                       fusions={k["kernel"]: sources[k["kernel"]] for k in summary["table"] if k["kernel"] in sources})
        except Exception as err:  # recorded, never hidden
            row.update(error=f"{type(err).__name__}: {str(err)[:400]}", summary={"table": []})
        print(json.dumps({k: v for k, v in row.items() if k != "summary"}), flush=True)
        results["rows"].append(row)
        (args.out / "profile_layer.json").write_text(json.dumps(results, indent=1))
        (args.out / "profile_layer.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
