"""Runs the Triton-language NVFP4 kernels once each at Kimi K2's real size, for Nsight Compute.

384 experts on one GPU, uniform routing: the fused gate/up + SwiGLU and the down projection at
256 rows (32 tokens x 8) and 2048 rows (256 tokens x 8), each with its tile-table
configuration, called once after compiling. ``--module`` profiles another copy of
``triton_lang.py`` (an earlier version, for a before/after pair). On a GPU::

    ncu --clock-control none --set full --kernel-name regex:^_kernel -o OUT/native \\
        python benchmarks/profile_native.py

then ``ncu --import OUT/triton_lang.ncu-rep --page raw --csv`` and ``benchmarks/ncu_summary.py``.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.grouped_gemm import group_sizes  # noqa: E402
from moe_jax import nvfp4  # noqa: E402
from pallas_kernels.grouped_matmul.tuning import Op  # noqa: E402

EXPERTS, HIDDEN, INTERMEDIATE = 384, 7168, 2048


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--module", type=pathlib.Path, help="another triton_lang.py to profile instead")
    parser.add_argument("--rows", type=int, nargs="+", default=[256, 2048])
    args = parser.parse_args()
    if args.module:
        spec = importlib.util.spec_from_file_location("native_other", args.module)
        triton_lang = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = triton_lang  # (dataclasses look their module up while the file runs)
        spec.loader.exec_module(triton_lang)
    else:
        from pallas_kernels.grouped_matmul import triton_lang  # noqa: PLC0415
    weights = {Op.GATE_UP_SWIGLU: nvfp4.random(jax.random.key(1), (EXPERTS, 2 * INTERMEDIATE, HIDDEN)),
               Op.MATMUL: nvfp4.random(jax.random.key(2), (EXPERTS, HIDDEN, INTERMEDIATE))}
    rng = np.random.default_rng(0)
    for m in args.rows:
        g = jnp.asarray(group_sizes(m, "uniform", rng, experts=EXPERTS))
        for op, w in weights.items():
            x = jax.random.normal(jax.random.key(m), (m, 2 * w.packed.shape[2]), jnp.bfloat16)
            fn = jax.jit(lambda x, w, g, op=op: triton_lang.run(op, x, w, g, compute_capability=90))
            jax.block_until_ready(fn(x, w, g))
            print(f"ran {op.value} rows={m}", flush=True)


if __name__ == "__main__":
    main()
