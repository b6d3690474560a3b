"""One-GPU-call probe: the Gluon W4A16 candidates (``gluon_probe_kernel``, ``gluon_ws_kernel``)
against the table kernel (``triton_lang.run``, W4A16) and the dense cuBLAS anchor at Kimi K2's
prefill sizes on one H200.

Per shape (rows over 384 experts, uniform routing or ``--routing irregular``; gate/up K 7168 N
2x2048 with SwiGLU, down K 2048 N 7168): random NVFP4 weights (codes, E4M3 block scales,
per-expert global scales), the table kernel's output and each candidate's written into
NaN-poisoned buffers; per candidate the relative Frobenius difference from the table kernel, the
rows more than 1% off it (the first as expert and row within it), the relative error of sampled
rows (the highest expert among them) against float64 on the host, the NaN rows; the median of timed calls (x rotated
over 3 copies, already in each kernel's ``permute_k`` order) after a warm-up; the dense anchor
``[M, K] x [K, N]`` bf16 through XLA in the same run. ``--weights bf16``: random bf16 weights, the
warp-specialized candidates' bf16 mode against ``triton_lang.bf16_matmul``. ``--transpose-w``: the
input gradients' products (``dY @ W_e``, weights read transposed) against ``triton_lang.input_grad``
(NVFP4) or ``bf16_matmul(transpose_w=True)``. ``--budget-s`` bounds the run.

    PYTHONPATH=$PWD python benchmarks/gluon_probe.py --out DIR [--budget-s 200] [--iters 10]
        [--routing irregular] [--weights bf16] [--transpose-w]
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback

import numpy as np

T0 = time.monotonic()
E, H, F = 384, 7168, 2048
SHAPES = {"gate_up": (H, F), "down": (F, H)}  # (K, n_out)
INPUT_GRAD_SHAPES = {"gate_up": (2 * F, H), "down": (H, F)}  # dX = dY @ W_e: (K, n_out), --transpose-w
CANDIDATES = [("ws bk64 s4", dict(kind="ws", block_k=64, num_stages=4)),
              ("ws bk64 s4 persistent", dict(kind="ws", block_k=64, num_stages=4, persistent=132)),
              ("ws bk64 s4 group_t 4", dict(kind="ws", block_k=64, num_stages=4, group_t=4)),
              ("ws bk64 s4 x2 in x", dict(kind="ws", block_k=64, num_stages=4, x2_in_x=True)),
              ("ws bk64 s4 persistent x2 in x",
               dict(kind="ws", block_k=64, num_stages=4, persistent=132, x2_in_x=True)),
              ("ws bk64 s4 x2 as 128", dict(kind="ws", block_k=64, num_stages=4, x2_in_x=True, x2_as_128=True)),
              ("ss bk64 s4", dict(kind="ss", block_k=64, num_stages=4)),
              ("ss bk64 s4 group_t 4", dict(kind="ss", block_k=64, num_stages=4, group_t=4)),
              ("gluon bk128 s3", dict(block_k=128, num_stages=3)),
              ("ablate: no x loads", dict(block_k=128, num_stages=3, ablate=1)),
              ("ablate: no dequant", dict(block_k=128, num_stages=3, ablate=2)),
              ("gluon bk128 s3 group_t 16", dict(block_k=128, num_stages=3, group_t=16)),
              ("gluon bk64 s6", dict(block_k=64, num_stages=6))]
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)


def irregular_sizes(m: int) -> np.ndarray:
    """Group sizes summing to ``m``: a cycle through each tile kind's edges, scaled down if it sums
    past ``m``, the remainder on expert ``E - 1``."""
    cycle = np.array([0, 1, 63, 64, 65, 127, 128, 129, 191, 192, 193, 384, 17, 250], np.int64)
    sizes = np.resize(cycle, E)
    if sizes.sum() > m:
        sizes = sizes * m // sizes.sum()
    sizes[-1] += m - sizes.sum()
    return sizes.astype(np.int32)


def nvfp4_weights(jax, jnp, kw, ks, kg, n_w: int, k: int):
    """Random NVFP4 weights ``[E, n_w, k]`` in ModelOpt's layout, generated on the device in 16
    jitted chunks (the generators' 32-bit intermediates of one 5.6 GB draw do not fit). Codes as
    ModelOpt's quantizer gives them for Gaussian weights (about 2 sigma per block at the top
    code), not uniform bits: uniform codes toggle more bits, and on this board's power cap that
    alone cost ~15% (the table kernel at 378 against 430-460 TFLOP/s)."""
    from types import SimpleNamespace  # noqa: PLC0415

    bounds = jnp.asarray([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], jnp.float32)

    def gen_codes(key):
        v = jax.random.normal(key, (E // 16, n_w, k // 2, 2), jnp.float32) * 2.0
        code = (jnp.sum(jnp.abs(v)[..., None] > bounds, axis=-1).astype(jnp.uint8)
                | jnp.where(v < 0, 8, 0).astype(jnp.uint8))
        return code[..., 0] | (code[..., 1] << 4)

    gen_w = jax.jit(gen_codes)
    # E4M3 bits 0x30..0x3f: 2**-1 .. 2**0 * 1.875, positive, never NaN.
    gen_s = jax.jit(lambda key: jax.random.randint(key, (E // 16, n_w, k // 16), 0x30, 0x40).astype(jnp.uint8))
    packed = jnp.concatenate([gen_w(jax.random.fold_in(kw, c)) for c in range(16)])  # peak ~4 GB per chunk
    scales_u8 = jnp.concatenate([gen_s(jax.random.fold_in(ks, c)) for c in range(16)])
    global_e = jax.random.uniform(kg, (E,), jnp.float32, 0.5, 1.5) / np.sqrt(k)
    jax.block_until_ready((packed, scales_u8))
    return SimpleNamespace(packed=packed, scales=jax.lax.bitcast_convert_type(scales_u8, jnp.float8_e4m3fn),
                           global_scale=global_e)


def left(budget):
    return budget - (time.monotonic() - T0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=200.0)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rows", type=int, nargs="*", default=[65536, 8192])
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--weights", choices=("nvfp4", "bf16"), default="nvfp4",
                    help="bf16: the ws candidates with bf16 weights against triton_lang.bf16_matmul")
    ap.add_argument("--transpose-w", action="store_true",
                    help="the input gradients' products (weights [E, K, N] read as their transpose: gate/up's dX "
                         "K 4096 N 7168, down's K 7168 N 2048) against triton_lang.input_grad (NVFP4) or "
                         "bf16_matmul(transpose_w=True)")
    ap.add_argument("--routing", choices=("uniform", "irregular"), default="uniform",
                    help="irregular: experts of 0, 1, 63-65, 127-129, 191-193, 384 ... rows (every tile kind and "
                         "tiles past one per expert), the remainder on the last expert")
    ap.add_argument("--candidates", nargs="*", default=None, help="labels to run (default: all)")
    ap.add_argument("--once", action="store_true",
                    help="no anchor, no timing: each kernel launched once after its checked run (for ncu, which "
                         "then sees the table kernel's launches first, then each candidate's)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows_out = []

    def record(**row):
        row["t_s"] = round(time.monotonic() - T0, 1)
        rows_out.append(row)
        print(json.dumps(row), flush=True)
        with open(os.path.join(args.out, "gluon_probe.json"), "w") as f:
            json.dump(rows_out, f, indent=1)

    try:
        import jax
        import jax.numpy as jnp

        from benchmarks import gluon_probe_kernel as gk
        from benchmarks import gluon_ws_kernel as wk
        from pallas_kernels.grouped_matmul import triton_lang
        from pallas_kernels.grouped_matmul.tuning import Op
    except Exception as e:  # noqa: BLE001
        record(shape="-", kernel="-", error=f"import: {type(e).__name__}: {e}")
        return
    record(shape="-", kernel="env", device=str(jax.devices()[0].device_kind), jax=jax.__version__)
    candidates = [c for c in CANDIDATES if args.candidates is None or c[0] in args.candidates]

    for shape in args.shapes:
        k, n_out = (INPUT_GRAD_SHAPES if args.transpose_w else SHAPES)[shape]
        op = Op.GATE_UP_SWIGLU if shape == "gate_up" and not args.transpose_w else Op.MATMUL
        n_w = 2 * n_out if op is Op.GATE_UP_SWIGLU else n_out
        tw = args.transpose_w
        key = jax.random.key(0 if shape == "gate_up" else 1)
        kw, ks, kg, kx = jax.random.split(key, 4)
        if args.weights == "bf16":
            # In 8 jitted chunks, bf16 written directly (11-22 GB); the 1/sqrt(K) goes on x.
            chunk = (E // 8, k, n_w) if tw else (E // 8, n_w, k)
            gen = jax.jit(lambda key: jax.random.normal(key, chunk, jnp.bfloat16))
            w = jnp.concatenate([gen(jax.random.fold_in(kw, c)) for c in range(8)])
            jax.block_until_ready(w)
            x_scale = 1.0 / np.sqrt(k)

            def dense_e(e):
                w_e = np.asarray(w[e].astype(jnp.float32), np.float64)
                return w_e.T if tw else w_e  # [n_w, k]
        else:
            rows_w, cols_w = (k, n_w) if tw else (n_w, k)  # W_e as stored
            w = nvfp4_weights(jax, jnp, kw, ks, kg, rows_w, cols_w)
            x_scale = 1.0

            def dense_e(e):
                codes = np.asarray(w.packed[e])
                vals = np.stack([E2M1[codes & 15], E2M1[codes >> 4]], axis=-1).reshape(rows_w, cols_w)
                sc = np.asarray(w.scales[e].astype(jnp.float32), np.float64)
                w_e = vals * np.repeat(sc, 16, axis=1) * float(w.global_scale[e])
                return w_e.T if tw else w_e  # [n_w, k]

        for m in args.rows:
            if left(args.budget_s) < 30:
                record(shape=shape, rows=m, kernel="-", error="skipped: budget")
                continue
            flops = 2.0 * m * k * n_w
            base = m // E
            if args.routing == "uniform":
                sizes = np.full(E, base, np.int32)
                sizes[: m - base * E] += 1
                samples = list(zip((0, 1, E // 2 - 1, E - 1), (0, 169, 85, 100)))
            else:
                sizes = irregular_sizes(m)
                # The last row of each kind of tile and of the largest expert (the highest id).
                samples = [(e, int(sizes[e]) - 1) for e in (1, 3, 4, 6, 7, 10, 11, E - 1) if sizes[e]]
            group_sizes = jnp.asarray(sizes)
            starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
            sample_experts = [e for e, _ in samples]
            sample_rows = [int(starts[e] + min(o, sizes[e] - 1)) for e, o in samples]
            xs = [(jax.random.normal(jax.random.fold_in(kx, i), (m, k), jnp.float32) * x_scale).astype(jnp.bfloat16)
                  for i in range(3)]
            poison = jnp.full((m, n_out), jnp.nan, jnp.bfloat16)

            x0 = np.asarray(xs[0][np.array(sample_rows)].astype(jnp.float32), np.float64)
            exact = []
            for r, e in enumerate(sample_experts):
                y = dense_e(e) @ x0[r]
                if op is Op.GATE_UP_SWIGLU:
                    g, u = y[:n_out], y[n_out:]
                    y = g / (1.0 + np.exp(-g)) * u
                exact.append(y)
            exact = np.stack(exact)

            def bad_rows(y, ref):
                """Rows of ``y`` that are NaN or more than 1% (relative) off the table kernel's,
                as (expert, row within it) for the first 8: where a tile's boundary bug shows."""
                yf, rf = y.astype(jnp.float32), ref.astype(jnp.float32)
                err = jnp.linalg.norm(yf - rf, axis=1) / (jnp.linalg.norm(rf, axis=1) + 1e-30)
                bad = np.flatnonzero(np.asarray(jnp.isnan(err) | (err > 1e-2))[: int(sizes.sum())])
                experts = np.searchsorted(np.cumsum(sizes), bad, side="right")
                return int(bad.size), [(int(e), int(r - starts[e])) for e, r in zip(experts[:8], bad[:8])]

            def sampled_err(y):
                got = np.asarray(y[np.array(sample_rows)].astype(jnp.float32), np.float64)
                return float(np.linalg.norm(got - exact) / np.linalg.norm(exact))

            def timed(fn, xs_in):
                if args.once:
                    jax.block_until_ready(fn(xs_in[1]))
                    return float("nan"), 1
                for i in range(2):
                    jax.block_until_ready(fn(xs_in[i % 3]))
                times = []
                i = 0
                while len(times) < max(5, args.iters) and (len(times) < 3 or left(args.budget_s) > 20):
                    t = time.perf_counter()
                    jax.block_until_ready(fn(xs_in[i % 3]))
                    times.append(time.perf_counter() - t)
                    i += 1
                return float(np.median(times)), len(times)

            anchor = None
            if not args.once:
                try:
                    wd = jax.random.normal(kw, (k, n_w), jnp.bfloat16)
                    dense = jax.jit(lambda x: jnp.dot(x, wd, preferred_element_type=jnp.bfloat16))
                    med, n = timed(dense, xs)
                    record(shape=shape, rows=m, kernel="dense anchor (XLA bf16)", ms=round(med * 1e3, 3),
                           tflops=round(flops / med / 1e12, 1), iters=n)
                    anchor = flops / med
                    del wd
                except Exception as e:  # noqa: BLE001 (recorded as the anchor's row, never hidden)
                    record(shape=shape, rows=m, kernel="dense anchor", error=f"{type(e).__name__}: {str(e)[:300]}")

            ref = None
            try:
                if args.weights == "bf16":
                    bk, xs_t = 0, xs

                    def table(x, out=None):
                        return triton_lang.bf16_matmul(op, x, w, group_sizes, compute_capability=90, out=out,
                                                       transpose_w=tw)
                elif tw:  # the native input gradient, x (dY) in natural order
                    xs_t = xs

                    def table(x, out=None):
                        return triton_lang.input_grad(x, w, group_sizes, compute_capability=90, out=out)
                else:
                    bk = triton_lang.k_order(op, num_rows=m, num_experts=E, k=k, n_out=n_out, compute_capability=90)
                    xs_t = [jax.jit(triton_lang.permute_k, static_argnums=1)(x, bk) for x in xs]

                    def table(x, out=None, bk=bk):
                        return triton_lang.run(op, x, w, group_sizes, compute_capability=90, out=out, x_k_order=bk)

                ref = jax.block_until_ready(table(xs_t[0], out=poison.copy()))
                nan_rows = int(jnp.sum(jnp.any(jnp.isnan(ref), axis=1)))
                err64 = sampled_err(ref)
                med, n = timed(table, xs_t)
                record(shape=shape, rows=m, kernel=f"table (triton_lang {args.weights})", ms=round(med * 1e3, 3),
                       tflops=round(flops / med / 1e12, 1), of_anchor=round(flops / med / anchor, 3) if anchor else None,
                       iters=n, nan_rows=nan_rows, sampled_rel_err_f64=err64)
                del xs_t
            except Exception as e:  # noqa: BLE001
                record(shape=shape, rows=m, kernel="table", error=f"{type(e).__name__}: {str(e)[:400]}",
                       trace=traceback.format_exc()[-1200:])

            for label, tile in candidates:
                if left(args.budget_s) < 20:
                    record(shape=shape, rows=m, kernel=label, error="skipped: budget")
                    continue
                try:
                    t0 = time.monotonic()
                    kind = tile.get("kind", "swap_ab")
                    tile = {key: v for key, v in tile.items() if key != "kind"}
                    if args.weights == "bf16":
                        if kind != "ws":
                            raise ValueError(f"{kind}: an NVFP4 candidate (--weights bf16 runs the ws ones)")
                        spec = wk.WsSpec(op=op, num_rows=m, num_experts=E, k=k, n_out=n_out, bf16=True,
                                         transpose_w=tw, **tile)
                        xs_g = xs

                        def cand(x, out=None, tile=tile):
                            return wk.ws_bf16_matmul(op, x, w, group_sizes, out=out, transpose_w=tw, **tile)
                    else:
                        spec_type, matmul = {"ss": (gk.SsSpec, gk.ss_matmul), "ws": (wk.WsSpec, wk.ws_matmul),
                                             "swap_ab": (gk.GluonSpec, gk.w4a16_matmul)}[kind]
                        if tw and kind != "ws":
                            raise ValueError(f"{kind}: a forward candidate (--transpose-w runs the ws ones)")
                        spec = spec_type(op=op, num_rows=m, num_experts=E, k=k, n_out=n_out,
                                         **(dict(tile, transpose_w=True) if tw else tile))
                        # The ss kernel and the input gradient read x in natural column order, the
                        # others in permute_k's.
                        natural = kind == "ss" or tw
                        xs_g = xs if natural else [jax.jit(triton_lang.permute_k, static_argnums=1)(x, spec.block_k)
                                                   for x in xs]

                        def cand(x, out=None, tile=tile, matmul=matmul, natural=natural):
                            if tw:
                                return matmul(op, x, w, group_sizes, out=out, transpose_w=True, **tile)
                            if natural:
                                return matmul(op, x, w, group_sizes, out=out, **tile)
                            return matmul(op, x, w, group_sizes, out=out, permuted=True, **tile)
                    kern = gk.compile_kernel(spec)
                    compile_s = time.monotonic() - t0

                    y = jax.block_until_ready(cand(xs_g[0], out=poison.copy()))
                    nan_rows = int(jnp.sum(jnp.any(jnp.isnan(y), axis=1)))
                    rel = None
                    if ref is not None:
                        d = y.astype(jnp.float32) - ref.astype(jnp.float32)
                        rel = float(jnp.linalg.norm(d) / jnp.linalg.norm(ref.astype(jnp.float32)))
                    err64 = sampled_err(y)
                    n_bad, first_bad = bad_rows(y, ref) if ref is not None else (None, None)
                    ok = nan_rows == 0 and (rel is not None and rel < 1e-2) and err64 < 1e-2 and n_bad == 0
                    med, n = timed(cand, xs_g)
                    record(shape=shape, rows=m, kernel=label, ms=round(med * 1e3, 3),
                           tflops=round(flops / med / 1e12, 1),
                           of_anchor=round(flops / med / anchor, 3) if anchor else None, iters=n,
                           nan_rows=nan_rows, bad_rows=n_bad, first_bad=first_bad, rel_frob_vs_table=rel,
                           sampled_rel_err_f64=err64, correct=ok,
                           shared=int(kern.metadata.shared), compile_s=round(compile_s, 1))
                    del y
                except Exception as e:  # noqa: BLE001
                    record(shape=shape, rows=m, kernel=label, error=f"{type(e).__name__}: {str(e)[:600]}",
                           trace=traceback.format_exc()[-1500:])
            del xs, poison, ref
        del w

    with open(os.path.join(args.out, "gluon_probe.md"), "w") as f:
        f.write("| shape | rows | kernel | ms | TFLOP/s | of anchor | rel vs table | f64 sampled | NaN rows "
                "| bad rows | note |\n|---|---|---|---|---|---|---|---|---|---|---|\n")
        for r in rows_out:
            if r.get("kernel") == "env":
                continue
            f.write(f"| {r['shape']} | {r.get('rows', '')} | {r['kernel']} | {r.get('ms', '')} | {r.get('tflops', '')} | "
                    f"{r.get('of_anchor', '')} | {r.get('rel_frob_vs_table', '')} | {r.get('sampled_rel_err_f64', '')} | "
                    f"{r.get('nan_rows', '')} | {r.get('bad_rows', '')} {r.get('first_bad') or ''} | "
                    f"{r.get('error', '')[:120]} |\n")
    print(open(os.path.join(args.out, "gluon_probe.md")).read())


if __name__ == "__main__":
    main()
