"""The whole Kimi K2 MoE layer on one GPU, every expert implementation, against its byte floor.

One run measures, on the same token batches (uniform random ``x``, the layer's own router):

* ``moe_forward`` at Kimi K2's real size (384 experts, hidden 7168, intermediate 2048, top-8,
  one shared expert, all experts on this GPU) for NVFP4 experts with ``expert_gemm`` ``triton``,
  ``pallas`` and ``xla``, bf16 experts with ``pallas`` and ``xla`` (the reference path: XLA
  einsums over row tiles, ``moe_jax.expert_gemm.grouped_matmul``), at every size (and whatever
  ``auto`` picks, named);
* an eager PyTorch bf16 layer of the same shape on ``torch._grouped_mm`` (CUTLASS), the best
  bf16 peer we know (router, sort, grouped gate/up, SwiGLU, grouped down, weighted combine,
  shared expert);
* the copy bandwidth of this GPU in the same run, and from it each batch's byte floor: the
  bytes of the experts its tokens touch (counted from the layer's own ``tokens_per_expert``),
  the shared expert, the router and the activations read and written once, over that bandwidth.

Timing: after compiling and two warm-up calls, the median of 5 windows of ``--iters`` calls
(JAX dispatch is asynchronous), 4 GiB allocated and freed first so buffers do not sit where a
fresh process puts them. Results: ``layer.json``, ``layer.md`` and ``layer.png`` in ``--out``.

Usage::

    python benchmarks/layer.py --out DIR [--tokens 32 256 2048 8192] [--iters 20] [--skip-torch]
        [--impls "bf16 triton" "bf16 xla" ...]

Each JAX row is compiled first and its buffers (XLA's buffer assignment) checked against what the
GPU has free: a row that cannot fit is recorded as a MemoryError before it runs, never left to
fail inside XLA (whose GEMM autotuner drops the configurations it cannot allocate). Each row
records those bytes and the allocator's peak (``layer.md``, "Memory").
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import platform
import sys
import traceback

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import moe_jax  # noqa: E402
from benchmarks.expert_parallel import timed  # noqa: E402
from benchmarks.grouped_gemm import copy_bandwidth  # noqa: E402

#: (label, weight format, expert_gemm, shared expert's format) measured for every token count;
#: None: the routed experts' (``MoEConfig.kimi_k2``'s default, the headline rows). NVIDIA's NVFP4
#: export of Kimi K2 keeps the shared expert and the router in bf16: its row runs the layer as that
#: checkpoint loads (the loader keeps the router as stored), the shared expert through XLA's bf16
#: GEMM and the router's logits as one bf16 matmul (its floor counts both at 2 bytes a weight).
#: The ``xla`` rows' memory at 8192 tokens (65536 rows, 384 experts), from XLA's buffer
#: assignment of the whole layer on one H200 (``results/layer_h200/layer.md``, "Memory"): bf16
#: 34.0 + 6.2 GB of arguments and temporaries, NVFP4 9.7 + 28.0 GB (every expert
#: dequantized to bf16 each call): well within the 112.6 GB the allocator may hold.
#: (label, weight format, expert_gemm, shared expert's format, prefill activations). The opt-in W4A8
#: row (``MoEConfig.prefill_activations="fp8"``: FP8 tensor cores at prefill sizes, W4A16 at decode
#: sizes; SM90 only, its error bound in the config's docstring).
IMPLEMENTATIONS = (("nvfp4 triton", "nvfp4", "triton", None, "bf16"), ("nvfp4 pallas", "nvfp4", "pallas", None, "bf16"),
                   ("nvfp4 xla", "nvfp4", "xla", None, "bf16"), ("bf16 triton", "bf16", "triton", None, "bf16"),
                   ("bf16 pallas", "bf16", "pallas", None, "bf16"), ("bf16 xla", "bf16", "xla", None, "bf16"),
                   ("nvfp4 triton, bf16 shared (NVIDIA's export)", "nvfp4", "triton", "bf16", "bf16"),
                   ("nvfp4 triton, W4A8 at prefill (prefill_activations='fp8')", "nvfp4", "triton", None, "fp8"))


def expert_bytes(config: moe_jax.MoEConfig, fmt: str) -> int:
    """Bytes of one routed expert's three projections in ``fmt`` (NVFP4: codes + E4M3 scales)."""
    weights = 3 * config.hidden_size * config.expert_intermediate_size
    return weights * 2 if fmt == "bf16" else weights // 2 + weights // 16


def floor_bytes(config: moe_jax.MoEConfig, fmt: str, touched: int, tokens: int, *, router_itemsize: int = 4) -> int:
    """Bytes a layer call must move: touched experts, shared expert, router, x in, y out."""
    h, f = config.hidden_size, config.expert_intermediate_size
    shared = 3 * h * f * config.num_shared_experts * (2 if config.shared_format == "bf16" else 0.5625)
    router = config.num_experts * h * router_itemsize
    return int(touched * expert_bytes(config, fmt) + shared + router + 2 * tokens * h * 2)


def program_memory(compiled) -> dict:
    """Bytes of a compiled program's buffers, from XLA's buffer assignment."""
    m = compiled.memory_analysis()
    return {"argument_bytes": m.argument_size_in_bytes, "output_bytes": m.output_size_in_bytes,
            "temp_bytes": m.temp_size_in_bytes, "alias_bytes": m.alias_size_in_bytes}


def check_fits(memory: dict, device) -> dict:
    """What ``device``'s allocator holds and may hold; raises MemoryError (recorded as the row's
    error, before anything runs) where the program's temporaries and outputs exceed what is free
    beside the arguments, already resident. An allocation that fails at run time (XLA's GEMM
    autotuner's included, which otherwise drops the configurations it cannot fit) would leave the
    row's time, or the rows after it, in doubt. No check where the backend keeps no statistics
    (CPU)."""
    stats = device.memory_stats()
    if not stats or "bytes_limit" not in stats:
        return {}
    free = stats["bytes_limit"] - stats["bytes_in_use"]
    needed = memory["temp_bytes"] + memory["output_bytes"] - memory["alias_bytes"]
    if needed > free:
        raise MemoryError(f"the program needs {needed / 1e9:.1f} GB beside its arguments, "
                          f"{free / 1e9:.1f} GB of {stats['bytes_limit'] / 1e9:.1f} GB free")
    return {"bytes_limit": stats["bytes_limit"], "bytes_in_use_before": stats["bytes_in_use"]}


def jax_rows(tokens_list, iters: int, out: list, save, labels=None) -> None:
    auto = moe_jax.resolve(moe_jax.MoEConfig.kimi_k2(weight_format="nvfp4"), None)
    out.append({"impl": "auto (nvfp4)", "expert_gemm": auto.expert_gemm, "report": auto.report})
    device = jax.devices()[0]
    for label, fmt, gemm, shared_fmt, prefill_activations in IMPLEMENTATIONS:
        if labels is not None and label not in labels:
            continue
        try:
            config = moe_jax.MoEConfig.kimi_k2(weight_format=fmt, expert_gemm=gemm, shared_weight_format=shared_fmt,
                                               prefill_activations=prefill_activations)
            plan = moe_jax.resolve(config, None)
            params = moe_jax.random_params(config, jax.random.key(0), plan)
            if shared_fmt == "bf16":  # NVIDIA's export: the router as that checkpoint stores it
                params["router"]["w_eh"] = params["router"]["w_eh"].astype(jnp.bfloat16)
        except Exception as err:  # recorded, never hidden
            out.append({"impl": label, "error": f"{type(err).__name__}: {str(err)[:400]}"})
            save()
            continue
        for tokens in tokens_list:
            entry = {"impl": label, "format": fmt, "shared_format": str(config.shared_format),
                     "expert_gemm": plan.expert_gemm, "tokens": tokens}
            try:
                x = jax.random.normal(jax.random.key(tokens), (tokens, config.hidden_size), jnp.bfloat16)
                forward = jax.jit(lambda p, x: moe_jax.moe_forward(p, x, plan)).lower(params, x).compile()
                entry["memory"] = program_memory(forward)
                entry["memory"].update(check_fits(entry["memory"], device))
                _, stats = forward(params, x)
                touched = int(np.count_nonzero(np.asarray(stats["tokens_per_expert"])))
                del forward
                seconds, compile_s = timed(lambda p, x: moe_jax.moe_forward(p, x, plan)[0], params, x, iters=iters)
                entry.update(seconds=seconds, compile_seconds=compile_s, touched_experts=touched,
                             floor_bytes=floor_bytes(config, fmt, touched, tokens,
                                                     router_itemsize=params["router"]["w_eh"].dtype.itemsize))
                if (after := device.memory_stats()) and "peak_bytes_in_use" in after:
                    entry["memory"]["peak_bytes_in_use_so_far"] = after["peak_bytes_in_use"]
            except Exception as err:
                entry["error"] = f"{type(err).__name__}: {str(err)[:400]}"
            print(json.dumps(entry), flush=True)
            out.append(entry)
            save()
        del params


def anchor_rows(tokens_list, iters: int, out: list, save) -> None:
    """The dense anchor: the routed experts' FLOPs as two plain bf16 matmuls through XLA (cuBLAS),
    ``[T*k, H] x [H, 2F]`` then ``[T*k, F] x [F, H]``: what the tensor cores give the same work
    with no experts (and one weight matrix instead of the touched experts')."""
    c = moe_jax.MoEConfig.kimi_k2()
    h, f, k = c.hidden_size, c.expert_intermediate_size, c.top_k
    w_gu = jax.random.normal(jax.random.key(1), (h, 2 * f), jnp.bfloat16)
    w_d = jax.random.normal(jax.random.key(2), (f, h), jnp.bfloat16)
    for tokens in tokens_list:
        entry = {"impl": "dense anchor (XLA matmuls, routed FLOPs)", "format": "bf16", "tokens": tokens}
        x = jax.random.normal(jax.random.key(tokens), (tokens * k, h), jnp.bfloat16)
        seconds, _ = timed(lambda x, w_gu, w_d: jnp.dot(jnp.dot(x, w_gu)[:, :f], w_d), x, w_gu, w_d, iters=iters)
        entry.update(seconds=seconds, tflops=2 * tokens * k * 3 * h * f / seconds / 1e12)
        print(json.dumps(entry), flush=True)
        out.append(entry)
        save()


def torch_rows(tokens_list, iters: int, out: list, save) -> None:
    """The eager bf16 PyTorch layer on ``torch._grouped_mm``, same shapes and routing rule."""
    import torch  # noqa: PLC0415

    c = moe_jax.MoEConfig.kimi_k2()
    e, h, f, k = c.num_experts, c.hidden_size, c.expert_intermediate_size, c.top_k
    g = torch.Generator(device="cuda").manual_seed(0)
    w_gu = torch.randn(e, h, 2 * f, device="cuda", dtype=torch.bfloat16, generator=g) * h**-0.5
    w_d = torch.randn(e, f, h, device="cuda", dtype=torch.bfloat16, generator=g) * f**-0.5
    w_router = torch.randn(e, h, device="cuda", dtype=torch.float32, generator=g) * h**-0.5
    bias = torch.zeros(e, device="cuda", dtype=torch.float32)
    shared_gu = torch.randn(h, 2 * f, device="cuda", dtype=torch.bfloat16, generator=g) * h**-0.5
    shared_d = torch.randn(f, h, device="cuda", dtype=torch.bfloat16, generator=g) * f**-0.5

    def swiglu(a):
        gate, up = a.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    def layer(x):
        scores = torch.sigmoid(x.float() @ w_router.T)
        ids = torch.topk(scores + bias, k, dim=-1).indices
        weights = torch.gather(scores, 1, ids)
        weights = weights / weights.sum(-1, keepdim=True) * c.routed_scaling_factor
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        offs = torch.cumsum(torch.bincount(flat, minlength=e), 0).to(torch.int32)
        rows = x[order // k]
        hidden = swiglu(torch._grouped_mm(rows, w_gu, offs=offs))
        y_rows = torch._grouped_mm(hidden, w_d, offs=offs)
        y = torch.zeros(x.shape[0] * k, h, device="cuda", dtype=torch.float32)
        y[order] = y_rows.float()
        y = (y.view(-1, k, h) * weights[..., None]).sum(1)
        return (y + (swiglu(x @ shared_gu) @ shared_d).float()).to(torch.bfloat16)

    for tokens in tokens_list:
        entry = {"impl": "torch bf16 (_grouped_mm, eager)", "format": "bf16", "tokens": tokens}
        try:
            x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2):
                layer(x)
            torch.cuda.synchronize()
            windows = []
            for _ in range(5):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(iters):
                    layer(x)
                end.record()
                end.synchronize()
                windows.append(start.elapsed_time(end) * 1e-3 / iters)
            entry["seconds"] = float(np.median(windows))
        except Exception as err:
            entry["error"] = f"{type(err).__name__}: {str(err)[:400]}"
        print(json.dumps(entry), flush=True)
        out.append(entry)
        save()
    del w_gu, w_d
    torch.cuda.empty_cache()


def _headline_nvfp4(row: dict) -> bool:
    """An NVFP4 row with the shared expert in NVFP4 too: the rows the floor ratio compares (a bf16
    shared expert moves more bytes; its row keeps its own floor in the JSON)."""
    return row.get("format") == "nvfp4" and row.get("shared_format", "nvfp4") == "nvfp4"


def markdown(results: dict) -> str:
    meta, rows = results["meta"], results["rows"]
    bw = meta["copy_bandwidth_bytes_per_s"]
    tokens_list = sorted({r["tokens"] for r in rows if "tokens" in r})
    impls = list(dict.fromkeys(r["impl"] for r in rows if "tokens" in r))
    by = {(r["impl"], r.get("tokens")): r for r in rows}
    lines = [f"# Whole Kimi K2 MoE layer, one GPU ({meta['device']})", "",
             f"{meta['date']}, commit {meta['commit']}, `{meta['command']}`"
             + (f", library imported from `{meta['library']}`" if "library" in meta else "") + ".", "",
             f"384 experts on one GPU, top-8, hidden 7168, intermediate 2048, one shared expert in the routed "
             f"experts' format (MoEConfig.kimi_k2's default); "
             f"ms per call, median of 5 windows of {meta['iters']} calls. Copy bandwidth in this run: "
             f"{bw / 1e12:.2f} TB/s. Floor: the bytes of the experts the batch touches (NVFP4: codes + "
             "block scales), the shared expert, router and activations, at that bandwidth.", "",
             "| tokens | touched experts | " + " | ".join(impls) + " | NVFP4 floor (ms) | best NVFP4 / floor |",
             "|---:|---:|" + "---:|" * (len(impls) + 2)]
    for t in tokens_list:
        cells, best = [], math.inf
        floor = next((r["floor_bytes"] / bw for r in rows if r.get("tokens") == t and _headline_nvfp4(r)
                      and "floor_bytes" in r), None)
        touched = next((r["touched_experts"] for r in rows if r.get("tokens") == t and "touched_experts" in r), "-")
        for impl in impls:
            r = by.get((impl, t), {})
            if "seconds" in r:
                cells.append(f"{r['seconds'] * 1e3:.2f}")
                if _headline_nvfp4(r):
                    best = min(best, r["seconds"])
            else:
                cells.append("error" if "error" in r else "-")
        ratio = f"{best / floor:.2f}x" if floor and best < math.inf else "-"
        lines.append(f"| {t} | {touched} | " + " | ".join(cells) + f" | {floor * 1e3:.2f} | {ratio} |"
                     if floor else f"| {t} | {touched} | " + " | ".join(cells) + " | - | - |")
    export = [r for r in rows if r.get("format") == "nvfp4" and r.get("shared_format") == "bf16" and "seconds" in r]
    if export:
        ratios = ", ".join(f"{r['tokens']} tokens {r['floor_bytes'] / bw * 1e3:.2f} ms, "
                           f"{r['seconds'] * bw / r['floor_bytes']:.2f}x" for r in export)
        lines += ["", f"`{export[0]['impl']}`: the shared expert in bf16, as that checkpoint loads; its own floor "
                  f"(the shared expert's bf16 bytes) and ratio: {ratios}."]
    auto = [r for r in rows if r["impl"].startswith("auto") and "expert_gemm" in r]
    if auto:
        lines += ["", f"`auto` chose `{auto[0]['expert_gemm']}` for NVFP4 on this GPU."]
    measured = [r for r in rows if "memory" in r and "bytes_limit" in r["memory"]]
    if measured:
        lines += ["", "Memory (GB; XLA's buffer assignment of each program, its arguments resident; the allocator's "
                  "peak since the process started, after the row):", ""]
        lines += [f"- {r['impl']} at {r['tokens']} tokens: arguments {r['memory']['argument_bytes'] / 1e9:.1f}, "
                  f"temporaries {r['memory']['temp_bytes'] / 1e9:.1f}, outputs {r['memory']['output_bytes'] / 1e9:.1f}"
                  + (f", peak {r['memory']['peak_bytes_in_use_so_far'] / 1e9:.1f}"
                     if "peak_bytes_in_use_so_far" in r["memory"] else "")
                  + f" of {r['memory']['bytes_limit'] / 1e9:.1f}" for r in measured]
    errors = [r for r in rows if "error" in r]
    if errors:
        lines += ["", "Errors:", ""] + [f"- {r['impl']} at {r.get('tokens', '-')} tokens: {r['error']}" for r in errors]
    return "\n".join(lines) + "\n"


def plot(results: dict, path: pathlib.Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    rows, bw = results["rows"], results["meta"]["copy_bandwidth_bytes_per_s"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for impl in dict.fromkeys(r["impl"] for r in rows if "tokens" in r):
        pts = sorted((r["tokens"], r["seconds"] * 1e3) for r in rows if r["impl"] == impl and "seconds" in r)
        if pts:
            ax.plot(*zip(*pts), marker="o", label=impl)
    floor = sorted({(r["tokens"], r["floor_bytes"] / bw * 1e3) for r in rows
                    if r.get("format") == "nvfp4" and "floor_bytes" in r})
    if floor:
        ax.plot(*zip(*floor), "k--", label="NVFP4 byte floor")
    ax.set(xscale="log", yscale="log", xlabel="tokens", ylabel="ms per layer call",
           title="Kimi K2 MoE layer, 384 experts, one GPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--tokens", type=int, nargs="+", default=[32, 256, 2048, 8192])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--skip-torch", action="store_true")
    parser.add_argument("--impls", nargs="+", choices=[label for label, *_ in IMPLEMENTATIONS],
                        help="only these JAX rows (default: all)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = jax.devices()[0]
    results = {"meta": {"device": device.device_kind, "date": datetime.date.today().isoformat(),
                        "commit": os.environ.get("GIT_COMMIT", "unknown"), "iters": args.iters,
                        "python": platform.python_version(), "jax": jax.__version__,
                        "command": "python benchmarks/layer.py " + " ".join(sys.argv[1:]),
                        # where the measured library came from: a base tree beside this one must say so
                        "library": str(pathlib.Path(moe_jax.__file__).resolve().parent.parent)},
               "rows": []}

    def save():
        (args.out / "layer.json").write_text(json.dumps(results, indent=1))

    try:
        if not args.skip_torch:  # first, so that its 34 GB are given back before JAX allocates
            torch_rows(args.tokens, args.iters, results["rows"], save)
        jax.block_until_ready(jnp.zeros((1 << 30,), jnp.float32)).delete()  # 4 GiB in and out first
        results["meta"]["copy_bandwidth_bytes_per_s"] = copy_bandwidth(20)
        anchor_rows(args.tokens, args.iters, results["rows"], save)
        jax_rows(args.tokens, args.iters, results["rows"], save, args.impls)
    except Exception:
        traceback.print_exc()
    save()
    (args.out / "layer.md").write_text(markdown(results))
    plot(results, args.out / "layer.png")
    print(markdown(results))


if __name__ == "__main__":
    main()
