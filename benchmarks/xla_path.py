"""The ``xla`` reference path's grouped matmul on this machine, and its memory at Kimi K2's size.

``--shapes``: for each ``E,M,K,N`` (experts, rows, K, N), one projection with uniformly routed
rows and bf16 operands: ``moe_jax.expert_gemm.grouped_matmul`` (the path; its tile rows ``c``
printed) against ``jnp.dot`` of the same FLOPs, the exact dequantization of every expert's NVFP4
weight (``--nvfp4``: the path runs it once per call), and, with ``--ragged-dot``,
``jax.lax.ragged_dot`` (what the path called before; slow on CPU). Median of ``--iters`` calls
after one compiling call.

``--memory``: the whole expert stage (``xla_expert_gemm``: dequantization, both projections)
at Kimi K2's size (384 experts, hidden 7168, intermediate 2048) with a GPU's tile sizes,
compiled for this machine from abstract shapes (nothing is allocated): XLA's buffer assignment
gives the arguments' and the temporaries' bytes.

Usage::

    python benchmarks/xla_path.py --shapes 64,4096,1024,512 384,2048,896,512 --nvfp4 --ragged-dot
    python benchmarks/xla_path.py --memory --rows 2048 65536
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import moe_jax  # noqa: E402
from moe_jax import expert_gemm, nvfp4  # noqa: E402

_ROWS_TIMES_OUT_IN = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


def median_ms(fn, *args, iters: int) -> float:
    fn = jax.jit(fn)
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def shapes(args) -> None:
    platform = jax.devices()[0].platform
    for spec in args.shapes:
        e, m, k, n = map(int, spec.split(","))
        rng = np.random.default_rng(0)
        g = jnp.asarray(rng.multinomial(m, np.full(e, 1 / e)), jnp.int32)
        a = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
        w_f32 = jax.random.normal(jax.random.key(1), (e, n, k), jnp.float32) * k**-0.5
        w = w_f32.astype(jnp.bfloat16)
        c = expert_gemm.tile_rows(m, e, platform)
        line = [f"E={e} M={m} K={k} N={n} (c={c}, max rows per expert {int(g.max())}):"]
        b = jax.random.normal(jax.random.key(2), (n, k), jnp.bfloat16)
        dense = median_ms(lambda a, b: jnp.dot(a, b.T, preferred_element_type=jnp.float32), a, b, iters=args.iters)
        line.append(f"jnp.dot {dense:.1f} ms")
        ours = median_ms(lambda a, w, g: expert_gemm.grouped_matmul(a, w, g, platform=platform), a, w, g,
                         iters=args.iters)
        line.append(f"grouped_matmul {ours:.1f} ms")
        if args.nvfp4:
            q = jax.jit(nvfp4.quantize)(w_f32)
            dequantize = median_ms(lambda q: nvfp4.dequantize(q, jnp.bfloat16), q, iters=args.iters)
            line.append(f"dequantize every expert {dequantize:.1f} ms")
        if args.ragged_dot:
            ms = median_ms(lambda a, w, g: jax.lax.ragged_dot_general(a, w, g, _ROWS_TIMES_OUT_IN,
                                                                      preferred_element_type=jnp.float32),
                           a, w, g, iters=max(1, args.iters // 5))
            line.append(f"jax.lax.ragged_dot {ms:.1f} ms")
        print("  ".join(line), flush=True)


def memory(args) -> None:
    for fmt in ("bf16", "nvfp4"):
        config = moe_jax.MoEConfig.kimi_k2(weight_format=fmt, expert_gemm="xla")
        plan = moe_jax.resolve(config, None)
        gpu = dataclasses.replace(plan.target, platform="cuda", device_kind="NVIDIA H200", compute_capability=90)
        plan = dataclasses.replace(plan, target=gpu)
        e, h, f = config.num_experts, config.hidden_size, config.expert_intermediate_size

        def weight(n, k, fmt=fmt):
            if fmt == "bf16":
                return jax.ShapeDtypeStruct((e, n, k), jnp.bfloat16)
            return nvfp4.NVFP4Tensor(jax.ShapeDtypeStruct((e, n, k // 2), jnp.uint8),
                                     jax.ShapeDtypeStruct((e, n, k // 16), jnp.float8_e4m3fn),
                                     jax.ShapeDtypeStruct((e,), jnp.float32))

        weights = {"w_gate_up_egh": weight(2 * f, h), "w_down_ehf": weight(h, f)}
        for rows in args.rows:
            x = jax.ShapeDtypeStruct((rows, h), jnp.bfloat16)
            g = jax.ShapeDtypeStruct((e,), jnp.int32)
            stage = jax.jit(lambda x, g, w, plan=plan: expert_gemm.xla_expert_gemm(x, g, w, plan))
            mem = stage.lower(x, g, weights).compile().memory_analysis()
            print(f"{fmt} {rows} rows (c={expert_gemm.tile_rows(rows, e, 'cuda')}): arguments "
                  f"{mem.argument_size_in_bytes / 1e9:.1f} GB, temporaries {mem.temp_size_in_bytes / 1e9:.1f} GB, "
                  f"output {mem.output_size_in_bytes / 1e9:.2f} GB", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=[], metavar="E,M,K,N")
    parser.add_argument("--nvfp4", action="store_true", help="also time the exact dequantization of every expert")
    parser.add_argument("--ragged-dot", action="store_true", help="also time jax.lax.ragged_dot (slow on CPU)")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--rows", type=int, nargs="+", default=[2048, 65536])
    args = parser.parse_args()
    if not (args.shapes or args.memory):
        parser.error("argument --shapes or --memory: give at least one")
    shapes(args)
    if args.memory:
        memory(args)


if __name__ == "__main__":
    main()
