"""Grouped GEMM for MoE experts on one GPU: our Pallas kernels against every peer.

Times, in one run:

* ours: ``grouped_matmul`` with bf16 and NVFP4 weights (both projections) and
  ``gate_up_swiglu`` (bf16, NVFP4);
* ours, native: the Triton-language NVFP4 kernels (``triton_lang.py``, through jax-triton) in the
  mode this GPU runs (W4A16 below SM100), plain and fused, when jax-triton is importable;
* ours, reference: the ``xla`` path's grouped matmul (``moe_jax.expert_gemm.grouped_matmul``, bf16,
  XLA einsums over row tiles, work O(rows)), at every size;
* ``jax.lax.ragged_dot`` (bf16);
* JAX's Mosaic GPU ``ragged_dot_mgpu`` (bf16), after a small tuning sweep like its ``main()``;
* ``torch._grouped_mm`` (bf16, CUTLASS) when torch is importable;
* the dense anchor (``dense_anchor``): the same FLOPs as one plain XLA matmul (cuBLAS)
  ``[M, K] x [K, N]``, bf16 operands and output, float32 accumulation, no experts; our kernels'
  TFLOP/s over it are the page's "of anchor" table;
* tokamax's ``ragged_dot`` with ``implementation="mosaic"`` (its Pallas Mosaic GPU kernels) in
  bf16 and with int4 weights (``qwix.quantize``, one scale per 128 of K), when tokamax is
  importable (a failure, an import error included, is recorded as that peer's result);

at Kimi K2 shapes: gate_up N=4096 K=7168, down N=7168 K=2048, with ``--experts`` experts on the
GPU (384: Kimi K2 on one GPU, the default; 48: EP 8's local share), M in {128, 512, 2048, 8192,
32768}, uniform and Zipf-skewed routing. Each case has its NVFP4 byte floor (the codes and block
scales of the experts that get rows, x read, y written) at the copy bandwidth measured in the
same run; then the full NVFP4 expert MLP (gate_up_swiglu + down) at M=512 against its floor.

Timing: JAX ops with CUPTI kernel time (``jax.experimental.mosaic.gpu.profiler.measure``),
torch with CUDA events. Every timed run executes the op on several input sets in turn (x and
group sizes rotate; weights alternate between two copies) so L2 never holds the next call's
operands; a run's time is its total over the number of calls. Reported: the median of
``--runs`` (>= 20) runs after a warm-up run.

Usage::

    python benchmarks/grouped_gemm.py --out DIR          # the benchmark (JSON, markdown, PNG)
    python benchmarks/grouped_gemm.py --sweep --out DIR  # tile sweep for our kernels
    python benchmarks/grouped_gemm.py --out DIR --routings uniform --no-mgpu --rows 128 32768  # shorter
    python benchmarks/grouped_gemm.py --out DIR --experts 48             # EP 8's local experts
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import pathlib
import platform
import shlex
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from moe_jax import expert_gemm, nvfp4  # noqa: E402
from pallas_kernels.grouped_matmul import Op, Variant, run, tuning  # noqa: E402

EXPERTS = 384  # the default of --experts
PROJECTIONS = {"gate_up": (4096, 7168), "down": (7168, 2048)}  # (N, K)
ROWS = (128, 512, 2048, 8192, 32768)
ROUTINGS = ("uniform", "zipf")
ZIPF_EXPONENT = 1.0
MLP_ROWS = 512

# Mosaic GPU compiles take ~8 s a configuration, so the sweep is small and runs at one M per
# projection; on 2026-11-29 block_m=64, block_n=256 won at M=512 and at M=32768 for both.
MGPU_SWEEP = [dict(block_m=bm, block_n=bn, block_k=64, max_concurrent_steps=4, grid_block_n=1)
              for bm, bn in ((64, 256), (128, 256), (64, 128))]
MGPU_SWEEP_ROWS = 32768


# ``jax.lax.ragged_dot`` is timed where rows x experts is at most this (XLA:GPU lowers it densely,
# every expert for every row: ~0.1 s a call at 48 experts and M=8192).
RAGGED_DOT_MAX_ROW_EXPERTS = 48 * 32768
TOKAMAX_INT4_TILE_K = 128


# --- inputs ------------------------------------------------------------------------------------


def group_sizes(rows: int, routing: str, rng, *, experts: int = EXPERTS) -> np.ndarray:
    """int32 [experts] summing to ``rows``: multinomial over uniform or Zipf expert probabilities."""
    match routing:
        case "uniform":
            p = np.full(experts, 1.0 / experts)
        case "zipf":
            p = 1.0 / np.arange(1, experts + 1) ** ZIPF_EXPONENT
            p = rng.permutation(p / p.sum())
        case _:
            raise ValueError(f"routing: {routing!r}")
    return rng.multinomial(rows, p).astype(np.int32)


def weight_copies(experts: int) -> int:
    """How many copies of each weight the timed calls alternate between: two at 48 experts, where
    they fit beside every peer; one above (Kimi K2's gate_up is 22.5 GB per bf16 copy at 384
    experts, and one projection's weights are hundreds of times the 50 MB L2 either way)."""
    return 2 if experts <= 48 else 1


@functools.cache
def weights(n: int, k: int, copy: int, experts: int):
    """bf16 ``w_enk`` ``[E, N, K]``, its transpose ``w_ekn`` ``[E, K, N]`` and the NVFP4
    quantization of ``w_enk`` (on device). Drawn and quantized 16 experts at a time: at once, Kimi
    K2's gate_up would pass through 45 GB of float32 at 384 experts."""
    key = jax.random.key(1000 * n + k + copy)
    normal = jax.jit(lambda key, e: (jax.random.normal(key, (e, n, k), jnp.float32) * 0.02).astype(jnp.bfloat16),
                     static_argnums=1)
    w_enk = _concatenate([normal(jax.random.fold_in(key, e), min(16, experts - e)) for e in range(0, experts, 16)])
    w_ekn = jnp.swapaxes(w_enk, 1, 2)  # a new array: eager swapaxes materializes the transpose
    quantize = jax.jit(lambda v: nvfp4.quantize(v.astype(jnp.float32)))
    q = _concatenate([quantize(w_enk[e:e + 16]) for e in range(0, experts, 16)])
    return jax.block_until_ready((w_enk, w_ekn, q))


def _concatenate(chunks):
    """Pytrees of arrays (bf16 weights, NVFP4 or qwix quantizations) joined along the expert axis."""
    return jax.tree.map(lambda *parts: jnp.concatenate(parts), *chunks) if len(chunks) > 1 else chunks[0]


@functools.cache
def int4_weights(n: int, k: int, copy: int, experts: int):
    """``w_ekn`` of :func:`weights` as qwix int4 (one bf16 scale per :data:`TOKAMAX_INT4_TILE_K` of K
    and column), the layout tokamax's quantized ``ragged_dot`` takes."""
    import qwix  # noqa: PLC0415 (optional: tokamax's quantization library)

    w_ekn = weights(n, k, copy, experts)[1]
    quantize = jax.jit(lambda v: qwix.quantize(v, jnp.int4, tiled_axes={0: 1, 1: TOKAMAX_INT4_TILE_K, 2: 1}))
    return jax.block_until_ready(_concatenate([quantize(w_ekn[e:e + 16]) for e in range(0, experts, 16)]))


def nvfp4_bytes_per_expert(n: int, k: int) -> int:
    """E2M1 codes (half a byte per weight) and E4M3 block scales (one per 16 weights)."""
    return n * k // 2 + n * k // 16


ANCHOR_COPIES = 2  # the dense anchor's weight alternates between two copies (58 MB each at most)


@functools.cache
def dense_weight(n: int, k: int, copy: int):
    """The dense anchor's bf16 ``w_kn`` ``[K, N]`` (one matrix, no experts)."""
    key = jax.random.key(7 * (1000 * n + k) + copy)
    return jax.block_until_ready((jax.random.normal(key, (k, n), jnp.float32) * 0.02).astype(jnp.bfloat16))


def x_sets(rows: int, k: int, count: int, seed: int):
    keys = jax.random.split(jax.random.key(seed), count)
    return [jax.random.normal(key, (rows, k), jnp.bfloat16) for key in keys]


# --- timing ------------------------------------------------------------------------------------


def time_jax(fn, arg_sets, runs: int) -> float:
    """Median over ``runs`` of the CUPTI kernel time of one call, calls rotating over ``arg_sets``."""
    from jax.experimental.mosaic.gpu import profiler  # noqa: PLC0415 (GPU only)

    rotated = jax.jit(lambda sets: [fn(*args) for args in sets])
    _, per_run = profiler.measure(rotated, iterations=runs)(arg_sets)
    return float(np.median(per_run)) / len(arg_sets)


def time_torch(fn, arg_sets, runs: int) -> float:
    import torch  # noqa: PLC0415

    for args in arg_sets:
        fn(*args)
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for args in arg_sets:
            fn(*args)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(arg_sets))
    return float(np.median(times))


def copy_bandwidth(runs: int) -> float:
    """Device copy bandwidth (bytes read + written per second) over 1 GiB buffers.

    (CUPTI keeps every run's output alive until the end, so the buffers stay modest.)
    """
    a = jnp.zeros((1 << 28,), jnp.uint32) + 1
    b = jnp.zeros((1 << 28,), jnp.uint32) + 2
    ms = time_jax(lambda v: v + 1, [(a,), (b,)], runs)
    return 2 * a.nbytes / (ms * 1e-3)


# --- the implementations -----------------------------------------------------------------------


def ours(op: Op, fmt: str, cc: int, *, config=None, variant=None):
    def fn(x, w, w_t, q, g):
        del w_t
        weight = w if fmt == "bf16" else q
        return run(op, x, weight, g, compute_capability=cc, config=config, variant=variant)
    return fn


def native_fn(op: Op, cc: int):
    from pallas_kernels.grouped_matmul import triton_lang  # noqa: PLC0415 (needs triton and jax-triton)

    def fn(x, w, w_t, q, g):
        del w, w_t
        return triton_lang.run(op, x, q, g, compute_capability=cc)
    return fn


def _native_available() -> bool:
    try:
        import jax_triton  # noqa: F401, PLC0415
    except ImportError:
        return False
    return True


def xla_grouped_matmul(x, w, w_t, q, g):
    """The ``xla`` reference path's grouped matmul (bf16 operands, float32 accumulation), with the
    tile sizes of a GPU; its output rounded to bf16 as the other rows' are."""
    del w_t, q
    return expert_gemm.grouped_matmul(x, w, g, platform="cuda").astype(jnp.bfloat16)


def dense_anchor(x, w_kn):
    """The dense anchor: ``[M, K] x [K, N]`` as one XLA dot (cuBLAS on GPU), bf16 operands and
    output; XLA:GPU accumulates bf16 GEMMs in float32."""
    return jnp.dot(x, w_kn)


def anchor_arg_sets(sets, n, k):
    """``(x, w_kn)`` for :func:`dense_anchor`: the same x as ``sets`` in the same order, the weight
    alternating between :data:`ANCHOR_COPIES` copies."""
    return [(x, dense_weight(n, k, i % ANCHOR_COPIES)) for i, (x, *_) in enumerate(sets)]


def ragged_dot(x, w, w_t, q, g):
    del w, q
    return jax.lax.ragged_dot(x, w_t, g, preferred_element_type=jnp.bfloat16)


def tokamax_fn():
    """tokamax's ``ragged_dot`` on its Mosaic GPU kernels; ``fn(x, w_ekn, g)``, ``w_ekn`` bf16 or a
    qwix int4 QArray (:func:`int4_weights`)."""
    import tokamax  # noqa: PLC0415 (optional peer)

    def fn(x, w_ekn, g):
        return tokamax.ragged_dot(x, w_ekn, g, preferred_element_type=jnp.bfloat16, implementation="mosaic")
    return fn


def mgpu(config):
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu  # noqa: PLC0415 (Hopper only)

    def fn(x, w, w_t, q, g):
        del w, q
        return ragged_dot_mgpu.ragged_dot(x, w_t, group_sizes=g, **config)
    return fn


def torch_grouped_mm():
    import torch  # noqa: PLC0415

    def fn(x, w, offs):
        return torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
    return fn


@dataclasses.dataclass
class Case:
    projection: str
    routing: str
    rows: int
    active_experts: int
    results: dict  # impl -> {"ms": float} or {"error": str}
    nvfp4_floor_ms: float | None = None  # the NVFP4 GEMM's bytes at the run's copy bandwidth


def jax_arg_sets(rows, n, k, routing, seed, count, experts):
    rng = np.random.default_rng(seed)
    sets, sizes = [], []
    for i, x in enumerate(x_sets(rows, k, count, seed)):
        g = group_sizes(rows, routing, rng, experts=experts)
        sizes.append(g)
        w, w_t, q = weights(n, k, i % weight_copies(experts), experts)
        sets.append((x, w, w_t, q, jnp.asarray(g)))
    return sets, sizes


def int4_arg_sets(sets, n, k, experts):
    """``(x, w_ekn as int4, g)`` for :func:`tokamax_fn`, the weights' copy as in ``sets``."""
    return [(x, int4_weights(n, k, i % weight_copies(experts), experts), g) for i, (x, _, _, _, g) in enumerate(sets)]


def torch_arg_sets(sets):
    import torch  # noqa: PLC0415

    out = []
    for x, w, _, _, g in sets:
        offs = torch.from_dlpack(jnp.cumsum(g).astype(jnp.int32))
        out.append((torch.from_dlpack(x), torch.from_dlpack(w), offs))
    return out


def measure(label, fn, results):
    start = time.time()
    try:
        ms = fn()
        results[label] = {"ms": ms}
        status = f"{ms * 1e3:9.1f} us"
    except Exception as e:  # noqa: BLE001 -- a peer's failure is a result, recorded as such.
        results[label] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
        status = "ERROR " + results[label]["error"]
    print(f"    {label:<24} {status}   ({time.time() - start:.1f}s)", flush=True)


def mgpu_sweep(n, k, rows, runs, experts):
    sets, _ = jax_arg_sets(rows, n, k, "uniform", 7, 2, experts)
    best, log = None, []
    for config in MGPU_SWEEP:
        if n % (config["grid_block_n"] * config["block_n"]):
            continue
        try:
            ms = time_jax(mgpu(config), sets, max(3, runs // 4))
        except Exception as e:  # noqa: BLE001 -- e.g. shared memory overflow: not a candidate.
            log.append({**config, "error": str(e).splitlines()[0][:200]})
            continue
        log.append({**config, "ms": ms})
        if best is None or ms < best[1]:
            best = (config, ms)
    print(f"  mgpu sweep N={n} K={k} M={rows}: best {best}", flush=True)
    return (best[0] if best else None), log


# --- the benchmark -----------------------------------------------------------------------------


def benchmark(args, cc: int, have_torch: bool, bandwidth: float, partial: pathlib.Path | None = None):
    runs, experts = args.runs, args.experts
    cases: list[Case] = []
    sweeps = {}
    best_mgpu = {}
    native = _native_available()
    for projection, (n, k) in PROJECTIONS.items():
        if args.mgpu:
            best_mgpu[projection], sweeps[f"{projection}_M{MGPU_SWEEP_ROWS}"] = mgpu_sweep(
                n, k, MGPU_SWEEP_ROWS, runs, experts)
            weights.cache_clear()
    for projection, (n, k) in PROJECTIONS.items():
        for routing in args.routings:
            for rows in args.rows:
                count = 4 if rows <= 2048 else 2
                sets, sizes = jax_arg_sets(rows, n, k, routing, rows + 17, count, experts)
                touched = float(np.mean([np.count_nonzero(s) for s in sizes]))
                active = int(touched)
                floor_ms = (touched * nvfp4_bytes_per_expert(n, k) + rows * (k + n) * 2) / bandwidth * 1e3
                print(f"{projection} {routing} M={rows} (active experts ~{active}, "
                      f"NVFP4 floor {floor_ms * 1e3:.1f} us)", flush=True)
                results: dict = {}
                measure("dense_anchor", lambda: time_jax(dense_anchor, anchor_arg_sets(sets, n, k), runs), results)
                measure("ours_bf16", lambda: time_jax(ours(Op.MATMUL, "bf16", cc), sets, runs), results)
                measure("ours_nvfp4", lambda: time_jax(ours(Op.MATMUL, "nvfp4", cc), sets, runs), results)
                if native:
                    measure("native_nvfp4", lambda: time_jax(native_fn(Op.MATMUL, cc), sets, runs), results)
                    if projection == "gate_up":
                        measure("native_swiglu_nvfp4", lambda: time_jax(native_fn(Op.GATE_UP_SWIGLU, cc), sets, runs),
                                results)
                if projection == "gate_up":
                    measure("ours_swiglu_bf16", lambda: time_jax(ours(Op.GATE_UP_SWIGLU, "bf16", cc), sets, runs),
                            results)
                    measure("ours_swiglu_nvfp4", lambda: time_jax(ours(Op.GATE_UP_SWIGLU, "nvfp4", cc), sets, runs),
                            results)
                measure("ours_xla", lambda: time_jax(xla_grouped_matmul, sets, runs), results)
                slow_sets = sets[:1] if rows >= 8192 else sets  # ragged_dot takes ~0.1 s a call there.
                if rows * experts <= RAGGED_DOT_MAX_ROW_EXPERTS:
                    measure("jax_ragged_dot", lambda: time_jax(ragged_dot, slow_sets, runs), results)
                config = best_mgpu.get(projection)
                if args.mgpu and config is None:
                    results["ragged_dot_mgpu"] = {"error": "no configuration of the sweep compiled"}
                elif args.mgpu:
                    measure("ragged_dot_mgpu", lambda: time_jax(mgpu(config), sets, runs), results)
                    results["ragged_dot_mgpu"]["config"] = config
                if have_torch:
                    measure("torch_grouped_mm",
                            lambda: time_torch(torch_grouped_mm(), torch_arg_sets(sets), runs), results)
                if args.tokamax:
                    measure("tokamax_bf16", lambda: time_jax(tokamax_fn(), [(x, w_t, g) for x, _, w_t, _, g in sets],
                                                             runs), results)
                    measure("tokamax_int4", lambda: time_jax(tokamax_fn(), int4_arg_sets(sets, n, k, experts), runs),
                            results)
                anchor_ms = results["dense_anchor"].get("ms")
                for impl in OURS:
                    if anchor_ms is not None and "ms" in results.get(impl, {}):
                        results[impl]["of_anchor"] = anchor_ms / results[impl]["ms"]
                cases.append(Case(projection, routing, rows, active, results, floor_ms))
                del sets
                if partial is not None:  # Keep what is done if the run is cut short.
                    partial.write_text(json.dumps([dataclasses.asdict(c) for c in cases], indent=1, default=str))
        weights.cache_clear()  # one projection's weights at a time (they are tens of GB at 384 experts)
        dense_weight.cache_clear()
        int4_weights.cache_clear()
    return cases, sweeps


def full_mlp(cc: int, runs: int, bandwidth: float, experts: int):
    """NVFP4 gate_up_swiglu + down at M=512 (uniform) against its byte floor."""
    (n_gu, k_gu), (n_d, k_d) = PROJECTIONS["gate_up"], PROJECTIONS["down"]
    rng = np.random.default_rng(512)
    sets, active_bytes = [], []
    copies = weight_copies(experts)
    for i, x in enumerate(x_sets(MLP_ROWS, k_gu, 4, 99)):
        g = group_sizes(MLP_ROWS, "uniform", rng, experts=experts)
        q_gu, q_d = weights(n_gu, k_gu, i % copies, experts)[2], weights(n_d, k_d, i % copies, experts)[2]
        sets.append((x, q_gu, q_d, jnp.asarray(g)))
        per_expert = sum(a.nbytes for a in (q_gu.packed, q_gu.scales, q_d.packed, q_d.scales)) / experts
        # Weights of the experts that get rows, x read, h [M, F] written and read back, y written.
        hidden_bytes = MLP_ROWS * (n_gu // 2) * 2
        active_bytes.append(np.count_nonzero(g) * per_expert + x.nbytes + 2 * hidden_bytes + MLP_ROWS * n_d * 2)

    def mlp(x, q_gu, q_d, g):
        h = run(Op.GATE_UP_SWIGLU, x, q_gu, g, compute_capability=cc)
        return run(Op.MATMUL, h, q_d, g, compute_capability=cc)

    ms = time_jax(mlp, sets, runs)
    floor_ms = float(np.mean(active_bytes)) / bandwidth * 1e3
    out = {"rows": MLP_ROWS, "ms": ms, "byte_floor_ms": floor_ms, "bytes": float(np.mean(active_bytes)),
           "ratio_to_floor": ms / floor_ms}
    if _native_available():
        from pallas_kernels.grouped_matmul import triton_lang  # noqa: PLC0415 (needs triton and jax-triton)

        def native_mlp(x, q_gu, q_d, g):
            h = triton_lang.run(Op.GATE_UP_SWIGLU, x, q_gu, g, compute_capability=cc)
            return triton_lang.run(Op.MATMUL, h, q_d, g, compute_capability=cc)

        out["native_ms"] = time_jax(native_mlp, sets, runs)
    weights.cache_clear()
    return out


# --- targets, tables, plot ---------------------------------------------------------------------


def flops(case: Case) -> float:
    n, k = PROJECTIONS[case.projection]
    return 2.0 * case.rows * n * k


def targets(cases: list[Case], mlp: dict) -> list[dict]:
    out = []

    def ms(case, impl):
        return case.results.get(impl, {}).get("ms")

    def add(name, value, goal, detail):
        met = value is not None and value >= goal
        out.append({"target": name, "value": value, "goal": goal, "met": met, "detail": detail})

    for case in cases:
        tag = f"{case.projection} {case.routing} M={case.rows}"
        peers = [ms(case, p) for p in ("jax_ragged_dot", "ragged_dot_mgpu", "torch_grouped_mm", "tokamax_bf16")]
        peers = [p for p in peers if p is not None]
        for impl, label in (("ours_nvfp4", "NVFP4"), ("native_nvfp4", "native NVFP4")):
            if case.rows <= 512 and peers and ms(case, impl):
                add(f"{label} >= 3.0x fastest bf16 peer (M<=512)", min(peers) / ms(case, impl), 3.0, tag)
            if case.rows == 32768 and ms(case, "torch_grouped_mm") and ms(case, impl):
                add(f"{label} >= 0.85x torch._grouped_mm (M=32768)", ms(case, "torch_grouped_mm") / ms(case, impl),
                    0.85, tag)
        if case.rows == 32768 and ms(case, "ragged_dot_mgpu") and ms(case, "ours_bf16"):
            add("bf16 >= 1.0x ragged_dot_mgpu (M=32768)", ms(case, "ragged_dot_mgpu") / ms(case, "ours_bf16"), 1.0, tag)
        for impl in ("ours_bf16", "ours_nvfp4"):
            if ms(case, "jax_ragged_dot") and ms(case, impl):
                add(f"{impl} >= 20x jax.lax.ragged_dot", ms(case, "jax_ragged_dot") / ms(case, impl), 20.0, tag)
    if mlp is None:
        add("NVFP4 MLP within 1.3x byte floor (M=512)", None, 1.0, "not measured in this run")
    else:
        add("NVFP4 MLP within 1.3x byte floor (M=512)", 1.3 / mlp["ratio_to_floor"], 1.0,
            f"{mlp['ms'] * 1e3:.1f} us vs floor {mlp['byte_floor_ms'] * 1e3:.1f} us (value = 1.3 / ratio)")
        if "native_ms" in mlp:
            ratio = mlp["native_ms"] / mlp["byte_floor_ms"]
            add("native NVFP4 MLP within 1.3x byte floor (M=512)", 1.3 / ratio, 1.0,
                f"{mlp['native_ms'] * 1e3:.1f} us vs floor {mlp['byte_floor_ms'] * 1e3:.1f} us (value = 1.3 / ratio)")
    return out


IMPLS = ("dense_anchor", "ours_bf16", "ours_nvfp4", "ours_swiglu_bf16", "ours_swiglu_nvfp4", "native_nvfp4",
         "native_swiglu_nvfp4",
         "ours_xla", "jax_ragged_dot", "ragged_dot_mgpu", "torch_grouped_mm", "tokamax_bf16", "tokamax_int4")
NVFP4_IMPLS = ("ours_nvfp4", "native_nvfp4")  # the plain GEMMs the floor is for
OURS = ("ours_bf16", "ours_nvfp4", "ours_swiglu_bf16", "ours_swiglu_nvfp4", "native_nvfp4", "native_swiglu_nvfp4",
        "ours_xla")  # our kernels (and the xla path): their TFLOP/s over the dense anchor's


def markdown(meta, cases, mlp, goals) -> str:
    impls = [impl for impl in IMPLS if any(impl in case.results for case in cases)]  # measured in this run
    lines = [
        f"# Grouped GEMM on one GPU (MoE experts, Kimi K2 shapes, {meta.get('experts', 48)} local experts)",
        "",
        f"- device: {meta['device']}; date: {meta['date']}; copy bandwidth: {meta['copy_bandwidth_tbps']:.2f} TB/s",
        f"- command: `{meta['command']}`",
        f"- versions: {meta['versions']}",
        f"- timing: {meta['timing']}",
        "",
        "Time per call in microseconds (TFLOP/s in parentheses; the fused gate_up_swiglu counts the gate and "
        "up products, like the plain gate_up GEMM). `err` = the peer failed (see JSON).",
    ]
    floors = any(case.nvfp4_floor_ms is not None for case in cases)
    if floors:
        lines[-1] += (" NVFP4 floor: the NVFP4 GEMM's bytes (codes and block scales of the experts that get "
                      "rows, x read, y written) at the copy bandwidth; best / floor: the faster of "
                      + " and ".join(NVFP4_IMPLS) + " over it.")
    lines += [
        "",
        "| projection | routing | M | " + " | ".join(impls) + " |" + " NVFP4 floor | best NVFP4 / floor |" * floors,
        "|---|---|---:|" + "---:|" * (len(impls) + 2 * floors),
    ]
    for case in cases:
        cells = []
        for impl in impls:
            r = case.results.get(impl)
            if r is None:
                cells.append("")
            elif "ms" in r:
                cells.append(f"{r['ms'] * 1e3:.1f} ({flops(case) / (r['ms'] * 1e-3) / 1e12:.0f})")
            else:
                cells.append("err")
        if floors:
            best = min((case.results[i]["ms"] for i in NVFP4_IMPLS if "ms" in case.results.get(i, {})), default=None)
            floor = case.nvfp4_floor_ms
            cells.append("" if floor is None else f"{floor * 1e3:.1f}")
            cells.append("" if None in (best, floor) else f"{best / floor:.2f}x")
        lines.append(f"| {case.projection} | {case.routing} | {case.rows} | " + " | ".join(cells) + " |")
    anchored = [impl for impl in OURS if impl in impls]
    if "dense_anchor" in impls and anchored:  # (results from before the anchor have none: the page they had)
        lines += [
            "",
            "## Of anchor",
            "",
            "dense_anchor: the same FLOPs as one plain XLA matmul (cuBLAS) `[M, K] x [K, N]`, bf16 operands and "
            "output, float32 accumulation, no experts, timed as the other JAX rows (same x rotation, its weight "
            f"alternating between {ANCHOR_COPIES} copies). of anchor: each kernel's TFLOP/s over the anchor's "
            "(the anchor's time over the kernel's) in the same run.",
            "",
            "| projection | routing | M | dense_anchor TFLOP/s | " + " | ".join(f"{i} of anchor" for i in anchored)
            + " |",
            "|---|---|---:|---:|" + "---:|" * len(anchored),
        ]
        for case in cases:
            anchor = case.results.get("dense_anchor", {}).get("ms")
            cells = ["" if anchor is None else f"{flops(case) / (anchor * 1e-3) / 1e12:.0f}"]
            for impl in anchored:
                ms = case.results.get(impl, {}).get("ms")
                cells.append("" if None in (anchor, ms) else f"{anchor / ms:.2f}")
            lines.append(f"| {case.projection} | {case.routing} | {case.rows} | " + " | ".join(cells) + " |")
    if mlp is None:
        lines += ["", "Full NVFP4 expert MLP: not measured in this run."]
    else:
        lines += [
            "",
            f"Full NVFP4 expert MLP (gate_up_swiglu + down), M={mlp['rows']} uniform: {mlp['ms'] * 1e3:.1f} us; "
            f"byte floor {mlp['byte_floor_ms'] * 1e3:.1f} us ({mlp['bytes'] / 1e9:.3f} GB at the copy bandwidth); "
            f"ratio {mlp['ratio_to_floor']:.2f}."
            + (f" Native (Triton-language) kernels: {mlp['native_ms'] * 1e3:.1f} us, ratio "
               f"{mlp['native_ms'] / mlp['byte_floor_ms']:.2f}." if "native_ms" in mlp else ""),
        ]
    lines += [
        "",
        "## Targets",
        "",
        "| target | case | value | goal | met |",
        "|---|---|---:|---:|---|",
    ]
    for g in goals:
        value = "n/a" if g["value"] is None else f"{g['value']:.2f}"
        lines.append(f"| {g['target']} | {g['detail']} | {value} | {g['goal']} | {'yes' if g['met'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def plot(cases, path):
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(2, 2, figsize=(12, 9), sharex=True)
    for ax, (projection, routing) in zip(axes.flat, [(p, r) for p in PROJECTIONS for r in ROUTINGS]):
        sel = [c for c in cases if c.projection == projection and c.routing == routing]
        for impl in IMPLS:
            pts = [(c.rows, flops(c) / (c.results[impl]["ms"] * 1e-3) / 1e12) for c in sel
                   if "ms" in c.results.get(impl, {})]
            if pts:
                ax.plot(*zip(*pts), marker="o", ls=":" if impl == "dense_anchor" else "-", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{projection} ({routing} routing)")
        ax.set_xlabel("rows M")
        ax.set_ylabel("TFLOP/s (bf16-equivalent)")
        ax.grid(True, which="both", alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# --- the tile sweep (our kernels only) ---------------------------------------------------------


def _cfg(variant, m, n, k, w, s, g=8):
    return tuning.TileConfig(block_m=m, block_n=n, block_k=k, num_warps=w, num_stages=s,
                             group_t=(1 << 20) if variant is Variant.DECODE else g)


SWEEP = {
    # (variant, fmt, op, rows, projections): candidate (block_m, block_n, block_k, warps, stages);
    # None = the tile table's entry. Earlier sweeps: benchmarks/results/pallas_tile_sweeps_h200/.
    # Call 4 ran this on two versions of the kernel's block-scale loading (benchmarks/NOTES.md).
    (Variant.DECODE, "nvfp4", Op.MATMUL, 512, ("gate_up", "down")): [None],
    (Variant.DECODE, "nvfp4", Op.MATMUL, 128, ("gate_up",)): [None],
    (Variant.DECODE, "nvfp4", Op.GATE_UP_SWIGLU, 512, ("gate_up",)): [None],
    (Variant.PREFILL, "nvfp4", Op.MATMUL, 8192, ("gate_up", "down")): [None],
    (Variant.PREFILL, "nvfp4", Op.MATMUL, 32768, ("gate_up",)): [None],
    (Variant.PREFILL, "nvfp4", Op.GATE_UP_SWIGLU, 8192, ("gate_up",)): [None],
}


def sweep(args, cc):
    log = []
    for (variant, fmt, op, rows, projections), candidates in SWEEP.items():
        for projection in projections:
            n, k = PROJECTIONS[projection]
            sets, _ = jax_arg_sets(rows, n, k, "uniform", rows, 2, args.experts)
            for cand in candidates:
                config = None if cand is None else _cfg(variant, *cand)
                start = time.time()
                entry = {"variant": variant.value, "fmt": fmt, "op": op.value, "rows": rows, "projection": projection,
                         "config": None if cand is None else list(cand)}
                try:
                    entry["ms"] = time_jax(ours(op, fmt, cc, config=config, variant=variant), sets, args.runs)
                    status = f"{entry['ms'] * 1e3:8.1f} us"
                except Exception as e:  # noqa: BLE001 -- a candidate that fails is recorded, not fatal.
                    entry["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                    status = "ERROR " + entry["error"]
                print(f"{variant.value:8} {fmt:6} {op.value:15} {projection:8} M={rows:<6} {cand}: {status} "
                      f"({time.time() - start:.1f}s)", flush=True)
                log.append(entry)
    return log


def _torch_available() -> bool:
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        return False
    return torch.cuda.is_available()


def capability(device) -> int:
    """``major * 10 + minor`` of a CUDA device (the tile table's key)."""
    major, minor = device.compute_capability.split(".")
    return 10 * int(major) + int(minor)


# --- main ----------------------------------------------------------------------------------------


TIMING = ("median of {runs} runs after a warm-up; each run rotates over 4 input sets (M<=2048) or 2 (larger; "
          "jax.lax.ragged_dot: 1 at M>=8192), {weights} (the dense anchor's [K, N] weight: 2 copies); JAX: CUPTI "
          "kernel time, torch: CUDA events")


def write_results(out: pathlib.Path, meta: dict, cases: list[Case], mlp: dict | None, mgpu_sweeps, tile_table):
    """grouped_gemm.json, .md and .png under ``out``; returns the markdown."""
    goals = targets(cases, mlp)
    (out / "grouped_gemm.json").write_text(json.dumps(
        {**meta, "cases": [dataclasses.asdict(c) for c in cases], "mlp": mlp, "targets": goals,
         "mgpu_sweeps": mgpu_sweeps, "tile_table": tile_table}, indent=1, default=str))
    table = markdown(meta, cases, mlp, goals)
    (out / "grouped_gemm.md").write_text(table)
    plot(cases, out / "grouped_gemm.png")
    return table


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    parser.add_argument("--runs", type=int, default=20, help="timed runs per case (>= 20 for the benchmark)")
    parser.add_argument("--sweep", action="store_true", help="sweep our tile configurations instead")
    parser.add_argument("--routings", nargs="+", choices=ROUTINGS, default=list(ROUTINGS))
    parser.add_argument("--rows", nargs="+", type=int, default=list(ROWS), help="row counts M (default: all)")
    parser.add_argument("--no-mgpu", dest="mgpu", action="store_false",
                        help="skip JAX's Mosaic ragged_dot_mgpu (its tuning sweep takes minutes)")
    parser.add_argument("--no-tokamax", dest="tokamax", action="store_false", help="skip tokamax's ragged_dot")
    parser.add_argument("--experts", type=int, default=EXPERTS,
                        help=f"experts on the GPU (default {EXPERTS}, Kimi K2 on one GPU; 48: EP 8's local share)")
    args = parser.parse_args()
    if args.experts < 1:
        parser.error(f"--experts: {args.experts}, expected an int >= 1")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = jax.devices()[0]
    cc = capability(device)
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    started = time.time()
    if args.sweep:
        log = sweep(args, cc)
        (out / "grouped_gemm_sweep.json").write_text(json.dumps(
            {"device": device.device_kind, "date": datetime.date.today().isoformat(), "command": command,
             "runs": args.runs, "results": log}, indent=1))
        print(f"sweep done in {time.time() - started:.0f}s")
        return
    if args.runs < 20:
        parser.error("--runs: the benchmark reports medians of at least 20 runs")
    have_torch = _torch_available()
    torch_version = __import__("torch").__version__ if have_torch else None
    import triton  # noqa: PLC0415

    bandwidth = copy_bandwidth(args.runs)
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    mlp = full_mlp(cc, args.runs, bandwidth, args.experts)
    print(f"NVFP4 MLP M={MLP_ROWS}: {mlp}", flush=True)
    cases, mgpu_sweeps = benchmark(args, cc, have_torch, bandwidth, out / "grouped_gemm_partial.json")
    meta = {
        "device": device.device_kind, "compute_capability": cc, "date": datetime.date.today().isoformat(),
        "command": command, "copy_bandwidth_tbps": bandwidth / 1e12,
        "versions": f"python {platform.python_version()}, jax {jax.__version__}, triton {triton.__version__}, "
                    f"torch {torch_version}",
        "timing": TIMING.format(runs=args.runs, weights="weights alternating between 2 copies"
                                if weight_copies(args.experts) == 2 else "one copy of the weights"),
        "experts": args.experts, "zipf_exponent": ZIPF_EXPONENT, "wall_s": time.time() - started,
    }
    tile_table = {"/".join(part.value for part in key): dataclasses.asdict(config)
                  for key, config in tuning.TILE_TABLE[cc].items()}
    table = write_results(out, meta, cases, mlp, mgpu_sweeps, tile_table)
    (out / "grouped_gemm_partial.json").unlink()
    print(table)
    print(f"done in {time.time() - started:.0f}s")


if __name__ == "__main__":
    main()
