"""The Kimi K2-size fault's reproduction, standalone: Kimi K2's NVFP4 down projection (384 experts, N=7168,
K=2048) after perturbing the allocator, checked against float64 for the top expert ids.

On main at 25b06c3 this faulted (``CUDA_ERROR_ILLEGAL_ADDRESS``) or, without the perturbation,
returned relative errors of 0.85 and 1.34 for experts 288..295 and 376..383. It is small
enough to run under ``compute-sanitizer --tool memcheck``, which sees any access outside an
allocation even where nothing faults (a whole test process can be too much for the sanitizer).

Usage (on a GPU)::

    python3 tools/kimi_down_check.py [--tokens 32]
    compute-sanitizer --tool memcheck --error-exitcode 9 python3 tools/kimi_down_check.py

Exits 1 if any block's error is >= 1e-2 or an output is not finite.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

E, N, K, TOP_K = 384, 7168, 2048, 8
BLOCKS = ((0, 8), (144, 152), (288, 296), (376, 384))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from moe_jax.nvfp4 import NVFP4Tensor
    from pallas_kernels.grouped_matmul import grouped_matmul, reference

    a = jnp.ones((1 << 30,), jnp.float32)  # perturb the allocator, as in the issue
    a.block_until_ready()
    del a
    k1, k2, k3 = jax.random.split(jax.random.key(args.seed), 3)
    w = NVFP4Tensor(packed=jax.random.bits(k1, (E, N, K // 2), jnp.uint8),
                    scales=jax.random.uniform(k2, (E, N, K // 16), minval=0.5, maxval=1.5).astype(jnp.float8_e4m3fn),
                    global_scale=jnp.full((E,), 0.3 / (6 * math.sqrt(K)), jnp.float32))
    rng = np.random.default_rng(args.seed)
    ids = np.stack([rng.choice(E, TOP_K, replace=False) for _ in range(args.tokens)])
    for slot, (lo, hi) in enumerate(BLOCKS):  # every block's experts get rows, whatever the routing did
        count = min(hi - lo, args.tokens)
        ids[:count, slot] = np.arange(lo, lo + count)
    sizes = np.bincount(ids.ravel(), minlength=E).astype(np.int32)
    x = jax.random.normal(k3, (args.tokens * TOP_K, K), jnp.bfloat16)
    cc = jax.devices()[0].compute_capability.split(".")
    y = jax.jit(lambda x, w, g: grouped_matmul(x, w, g, compute_capability=10 * int(cc[0]) + int(cc[1])))(
        x, w, jnp.asarray(sizes))
    y = np.asarray(y.astype(jnp.float32), np.float64)
    x = np.asarray(x.astype(jnp.float32), np.float64)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    failed = not np.isfinite(y).all()
    print(f"device: {jax.devices()[0].device_kind}; rows {len(x)}; outputs finite: {not failed}")
    for lo, hi in BLOCKS:
        err = ref = 0.0
        for e in range(lo, hi):
            rows = slice(int(starts[e]), int(starts[e + 1]))
            w_nk = reference.dequantize(np.asarray(w.packed[e:e + 1]), np.asarray(w.scales[e:e + 1]),
                                        np.asarray(w.global_scale[e:e + 1]))[0]
            want = x[rows] @ w_nk.T
            err += float(np.sum((y[rows] - want) ** 2))
            ref += float(np.sum(want**2))
        rel = math.sqrt(err / ref)
        failed |= not rel < 1e-2
        print(f"experts {lo}..{hi - 1}: relative error {rel:.2e}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
