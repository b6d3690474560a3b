"""Weight-gradient tile sweep on one H200: the candidates below at Kimi K2's two projections (48
experts), 8192 and 32768 rows; wall time per synchronized call, median of 10 after 2 warm-ups.

    python3 benchmarks/weight_grad_sweep.py OUT.json                    # the Pallas kernel
    python3 benchmarks/weight_grad_sweep.py OUT.json --kernel native    # the native one (rows by TMA)
    ncu ... python3 benchmarks/weight_grad_sweep.py OUT.json --once     # for Nsight Compute, below

``--once``: no sweep; at 32768 rows, for each projection the Pallas kernel and the native one on
their table tiles and ``torch._grouped_mm`` (``x^T dy`` per group, as torch's backward computes
it), each called twice (the first call compiles); OUT.json lists the calls in order, so the
second launch of each in an ``ncu`` report is the one to read.

The Pallas pair in ``pallas_kernels.grouped_matmul.tuning.WEIGHT_GRAD_TILES[90]`` was picked from
its output (benchmarks/results/train_step_h200/weight_grad_sweep.json); the native kernel's
(``NATIVE_WEIGHT_GRAD_TILES``, rows loaded by TMA) are sized to the shared memory, its candidates
below; ``torch._grouped_mm`` is timed beside them.
Each candidate's output is checked against the Pallas table tile's first (relative Frobenius
error < 1e-2); one that differs gets no time.
"""
import argparse
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from pallas_kernels.grouped_matmul import grouped_matmul_weight_grad, triton_weight_grad, tuning  # noqa: E402
from pallas_kernels.grouped_matmul.tuning import TileConfig  # noqa: E402

E, H, F = 48, 7168, 2048
PALLAS_CONFIGS = [(64, 128, 128, 8, 3), (128, 128, 128, 8, 3), (64, 128, 256, 8, 3), (64, 256, 128, 8, 3),
                  (128, 256, 128, 8, 2), (64, 128, 128, 4, 4), (128, 128, 64, 8, 4), (32, 128, 128, 4, 4),
                  (128, 128, 128, 8, 4), (64, 256, 64, 8, 4)]
# (block_m, block_n, block_k, num_warps, num_stages, programs per SM): a stage holds 64 rows of dy
# and x (48 KB at 128 + 256 columns); two programs per SM where two fit the SM's 228 KB. The
# kernel has no warp-specialized row loop (triton_weight_grad's docstring).
NATIVE_CONFIGS = [(64, 128, 256, 8, 4, 1), (64, 128, 256, 8, 3, 1), (32, 128, 256, 8, 6, 1), (64, 128, 128, 4, 3, 2),
                  (32, 128, 128, 4, 5, 2), (64, 128, 128, 8, 5, 1), (64, 256, 128, 8, 4, 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="JSON file to write")
    parser.add_argument("--kernel", choices=["pallas", "native"], default="pallas")
    parser.add_argument("--once", action="store_true", help="one launch of each kernel, for Nsight Compute")
    args = parser.parse_args()
    if args.once:
        return once(args.out)
    rng = np.random.default_rng(0)
    table = tuning.WEIGHT_GRAD_TILES[90]
    rows = []
    for m in (32768, 8192):  # the training shape first
        gs = jnp.asarray(rng.multinomial(m, np.full(E, 1 / E)), jnp.int32)
        for proj, (k, n) in {"gate_up": (H, 2 * F), "down": (F, H)}.items():
            x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
            dy = jax.random.normal(jax.random.key(2), (m, n), jnp.bfloat16)
            tuning.WEIGHT_GRAD_TILES[90] = table  # the reference: the Pallas table tile
            jax.clear_caches()
            ref = grouped_matmul_weight_grad(x, dy, gs, compute_capability=90, out_dtype=jnp.float32)
            peers = {}
            if args.kernel == "native":  # the same run's bars: the Pallas table tile and torch
                import torch  # noqa: PLC0415

                tx, tdy = torch.from_dlpack(x), torch.from_dlpack(dy)
                offs = torch.as_tensor(np.cumsum(np.asarray(gs)).astype(np.int32), device="cuda")
                peers = {"pallas table": lambda: grouped_matmul_weight_grad(  # noqa: E731
                             x, dy, gs, compute_capability=90, out_dtype=jnp.bfloat16).block_until_ready(),  # noqa: B023
                         "torch": lambda: (torch._grouped_mm(tx.t(), tdy, offs=offs),  # noqa: B023
                                           torch.cuda.synchronize())}
            for name, f in peers.items():
                ms = median_ms(f)
                rows.append(dict(m=m, proj=proj, kernel=name, ms=ms, tflops=2 * m * n * k / ms / 1e9))
                print(m, proj, name, f"{ms:.3f} ms {2 * m * n * k / ms / 1e9:.0f} TFLOP/s", flush=True)
            for c in PALLAS_CONFIGS if args.kernel == "pallas" else NATIVE_CONFIGS:
                cfg = TileConfig(block_m=c[0], block_n=c[1], block_k=c[2], num_warps=c[3], num_stages=c[4], group_t=1)
                if args.kernel == "pallas":
                    if tuning.weight_grad_shared_memory(cfg) > tuning.SHARED_MEMORY_BYTES[90]:
                        continue
                    tuning.WEIGHT_GRAD_TILES[90] = (cfg, cfg)
                    jax.clear_caches()
                    f = lambda: grouped_matmul_weight_grad(x, dy, gs, compute_capability=90,  # noqa: B023, E731
                                                           out_dtype=jnp.bfloat16)
                else:
                    programs = c[5] * triton_weight_grad.sm_count()
                    f = lambda: triton_weight_grad.weight_grad(x, dy, gs, compute_capability=90,  # noqa: B023, E731
                                                               out_dtype=jnp.bfloat16, tile=cfg,  # noqa: B023
                                                               num_programs=programs)  # noqa: B023
                try:
                    got = f()
                    err = float(jnp.linalg.norm(got.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
                    del got
                    if not err < 1e-2:
                        raise AssertionError(f"relative error {err:.3g} against the Pallas table tile")
                    ms = median_ms(lambda: f().block_until_ready())  # noqa: B023
                    tf = 2 * m * n * k / ms / 1e9
                    rows.append(dict(m=m, proj=proj, kernel=args.kernel, cfg=c, ms=ms, tflops=tf, err=err))
                    print(m, proj, args.kernel, c, f"{ms:.3f} ms {tf:.0f} TFLOP/s err {err:.1e}", flush=True)
                except Exception as e:  # noqa: BLE001 -- recorded, never hidden
                    rows.append(dict(m=m, proj=proj, kernel=args.kernel, cfg=c, error=str(e)[:300]))
                    print(m, proj, args.kernel, c, "EXC", str(e)[:200], flush=True)
            del ref
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


def median_ms(f, warmups: int = 1, runs: int = 10) -> float:
    """Median wall time in ms of ``runs`` synchronized calls of ``f`` after ``warmups`` more."""
    for _ in range(warmups):
        f()
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) * 1e3


def once(out: str) -> None:
    """One launch each (after a first call) of the three weight gradients at 32768 rows."""
    import torch  # noqa: PLC0415

    m = 32768
    gs = jnp.asarray(np.random.default_rng(0).multinomial(m, np.full(E, 1 / E)), jnp.int32)
    offs = torch.as_tensor(np.cumsum(np.asarray(gs)).astype(np.int32), device="cuda")
    launches = []
    for proj, (k, n) in {"gate_up": (H, 2 * F), "down": (F, H)}.items():
        x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
        dy = jax.random.normal(jax.random.key(2), (m, n), jnp.bfloat16)
        tx, tdy = (torch.from_dlpack(a) for a in (x, dy))
        for name, f in (
                ("pallas", lambda: grouped_matmul_weight_grad(x, dy, gs, compute_capability=90,  # noqa: B023
                                                              out_dtype=jnp.bfloat16).block_until_ready()),
                ("native", lambda: triton_weight_grad.weight_grad(x, dy, gs, compute_capability=90,  # noqa: B023
                                                                  out_dtype=jnp.bfloat16).block_until_ready()),
                ("torch", lambda: (torch._grouped_mm(tx.t(), tdy, offs=offs), torch.cuda.synchronize()))):  # noqa: B023
            for call in ("first", "measured"):
                f()
                launches.append(dict(m=m, proj=proj, kernel=name, call=call))
                print(proj, name, call, flush=True)
        del x, dy, tx, tdy
    with open(out, "w") as f:
        json.dump(launches, f, indent=1)


if __name__ == "__main__":
    main()
