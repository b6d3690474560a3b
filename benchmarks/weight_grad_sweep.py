"""Weight-gradient tile sweep on one H200: the candidates below at Kimi K2's two projections (48
experts), 8192 and 32768 rows; wall time per synchronized call, median of 10 after 2 warm-ups.

    python3 benchmarks/weight_grad_sweep.py OUT.json

The pair in ``pallas_kernels.grouped_matmul.tuning.WEIGHT_GRAD_TILES[90]`` was picked from its
output (benchmarks/results/train_step_h200/weight_grad_sweep.json).
"""
import sys, time, json, numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, ".")
from pallas_kernels.grouped_matmul import grouped_matmul_weight_grad, tuning
from pallas_kernels.grouped_matmul.tuning import TileConfig

E, H, F = 48, 7168, 2048
configs = [(64,128,128,8,3),(128,128,128,8,3),(64,128,256,8,3),(64,256,128,8,3),(128,256,128,8,2),
           (64,128,128,4,4),(128,128,64,8,4),(32,128,128,4,4),(128,128,128,8,4),(64,256,64,8,4)]
rng = np.random.default_rng(0)
rows = []
for m in (8192, 32768):
    gs = jnp.asarray(rng.multinomial(m, np.full(E, 1 / E)), jnp.int32)
    for proj, (k, n) in {"gate_up": (H, 2 * F), "down": (F, H)}.items():
        x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
        dy = jax.random.normal(jax.random.key(2), (m, n), jnp.bfloat16)
        for c in configs:
            cfg = TileConfig(block_m=c[0], block_n=c[1], block_k=c[2], num_warps=c[3], num_stages=c[4], group_t=1)
            if tuning.weight_grad_shared_memory(cfg) > tuning.SHARED_MEMORY_BYTES[90]:
                continue
            tuning.WEIGHT_GRAD_TILES[90] = (cfg, cfg)
            jax.clear_caches()
            f = lambda: grouped_matmul_weight_grad(x, dy, gs, compute_capability=90, out_dtype=jnp.bfloat16)
            try:
                for _ in range(2): f().block_until_ready()
                ts = []
                for _ in range(10):
                    t0 = time.perf_counter(); f().block_until_ready(); ts.append(time.perf_counter() - t0)
                ms = float(np.median(ts)) * 1e3
                tf = 2 * m * n * k / ms / 1e9
                rows.append(dict(m=m, proj=proj, cfg=c, ms=ms, tflops=tf))
                print(m, proj, c, f"{ms:.3f} ms {tf:.0f} TFLOP/s", flush=True)
            except Exception as e:
                print(m, proj, c, "EXC", str(e)[:200], flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
