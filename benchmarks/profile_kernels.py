"""Runs a few grouped-GEMM cases once each, for Nsight Compute to read their counters.

Each case is our kernel at a Kimi K2 shape (48 local experts, uniform routing) with its
tile-table configuration, called once after compiling. Run under ``ncu`` on a GPU::

    ncu --clock-control none --set full --kernel-name regex:grouped -o OUT/kernels \\
        python benchmarks/profile_kernels.py

then export and summarize the report as ``benchmarks/ncu_summary.py`` describes.

(``--clock-control none``: leave the clocks as the benchmark sees them.)
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import jax  # noqa: E402

import grouped_gemm as bench  # noqa: E402
from pallas_kernels.grouped_matmul import Op  # noqa: E402

# (label, op, weight format, projection, rows)
CASES = (
    ("nvfp4 decode gate_up M=512", Op.MATMUL, "nvfp4", "gate_up", 512),
    ("bf16 decode gate_up M=512", Op.MATMUL, "bf16", "gate_up", 512),
    ("nvfp4 prefill gate_up M=32768", Op.MATMUL, "nvfp4", "gate_up", 32768),
)


def main():
    cc = bench.capability(jax.devices()[0])
    for label, op, fmt, projection, rows in CASES:
        n, k = bench.PROJECTIONS[projection]
        [args], _ = bench.jax_arg_sets(rows, n, k, "uniform", rows, 1)
        fn = jax.jit(bench.ours(op, fmt, cc))
        compiled = fn.lower(*args).compile()
        jax.block_until_ready(compiled(*args))
        print(f"ran {label}", flush=True)


if __name__ == "__main__":
    main()
