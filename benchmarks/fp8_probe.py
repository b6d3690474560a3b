"""One-GPU-call probe: what Hopper's FP8 tensor cores would give the routed grouped GEMMs (W4A8),
against the W4A16 table kernel and the dense cuBLAS anchor, at Kimi K2's prefill sizes.

Per shape (rows over 384 experts, uniform routing or ``--routing irregular``; gate/up K 7168 N
2x2048 with SwiGLU, down K 2048 N 7168), from one set of random NVFP4 weights
(:func:`nvfp4_weights`, global scales 1) and one set of bf16 rows:

* ``dense anchor``: ``[M, K] x [K, N]`` bf16 through XLA (cuBLAS), the FLOPs of the grouped GEMM;
* ``table w4a16``: ``triton_lang.run`` (rows already in its ``permute_k`` order);
* ``table w4a8``: ``triton_lang.run(mode=W4A8)`` from bf16 rows (its per-row E4M3 quantization pass
  included, and for gate/up its rows read by index in a random order: as the layer runs it);
  ``table w4a8 half`` on W4A16's tile with half the output columns (``tile=``,
  :func:`table_w4a8_tile`): fewer registers, two programs per SM for the down projection;
  ``table w4a8 half w4`` with 4 warps too: two programs per SM for both;
* ``bf16 table``: ``triton_lang.bf16_matmul`` on the weights dequantized to bf16 (exact);
* ``probe bf16`` / ``probe fp8``: ``fp8_probe_kernel`` with bf16, or E4M3, weights and rows from
  memory (E4M3 weights: ``code * scale / 8`` rounded, as W4A8 places them): the schedule's rate
  with nothing dequantized, the second the ceiling of a W4A8 kernel on it;
* ``probe w4a16``: the NVFP4 weights dequantized to bf16 in registers by ``triton_lang``'s own code: the
  table kernel's inner loop in the probe's skeleton, the baseline ``probe w4a8`` differs from only
  in its dequantization and MMA;
* ``probe w4a8``: the NVFP4 weights placed into E4M3 in registers, E4M3 rows (in the probe's
  column order); ``probe w4a8 s4`` with 4 pipeline stages instead of 3 (126 KB of shared memory);

Each kernel writes into a NaN-poisoned buffer; recorded: NaN rows among the defined ones, the
relative error of sampled rows (experts 0, 1, 191, 383) against float64 of the values that kernel
multiplies (bf16 rows and exact weights; E4M3 rows and E4M3 weights), the relative difference of
``probe w4a8`` from 8 x ``probe fp8`` (the same products), and the median of timed calls (rows
rotated over 3 copies) after a warm-up. ``--budget-s`` bounds the run.

    PYTHONPATH=$PWD python benchmarks/fp8_probe.py --out DIR [--rows 65536 8192] [--budget-s 240]
    ncu ... python benchmarks/fp8_probe.py --out DIR --rows 65536 --shapes down --once --kernels ...
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
import traceback

import numpy as np

T0 = time.monotonic()
E, H, F = 384, 7168, 2048
SHAPES = {"gate_up": (H, F), "down": (F, H)}  # (K, n_out)
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)
KERNELS = ("table w4a16", "table w4a8", "table w4a8 half", "table w4a8 half w4", "bf16 table", "probe bf16", "probe fp8", "probe w4a16", "probe w4a8", "probe w4a8 s4")


def left(budget: float) -> float:
    return budget - (time.monotonic() - T0)


def table_w4a8_tile(label: str, op, *, num_rows: int, k: int, n_out: int):
    """The tile a ``table w4a8 ...`` label runs: None (the library's W4A8 tile) for ``table w4a8``;
    W4A16's tile with half its output columns for ``... half``, and 4 warps for ``... half w4``
    (the down projection's is the library's W4A8 tile at many rows per expert since 8ee55c6's run)."""
    from pallas_kernels.grouped_matmul import triton_lang  # noqa: PLC0415 (needs triton)

    if label == "table w4a8":
        return None
    tile = triton_lang.make_spec(op, triton_lang.Mode.W4A16, num_rows=num_rows, num_experts=E, k=k, n_out=n_out,
                                 scale_groups=1, compute_capability=90).tile
    return dataclasses.replace(tile, block_n=tile.block_n // 2, num_warps=4 if label.endswith(" w4") else tile.num_warps)


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
    code), not uniform bits: uniform codes toggle more bits, and on an H200's power cap that
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rows", type=int, nargs="*", default=[65536, 8192])
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--kernels", nargs="*", default=list(KERNELS), choices=KERNELS)
    ap.add_argument("--block-n-down", type=int, default=128, help="the probe's output columns per tile for down")
    ap.add_argument("--block-n-gate-up", type=int, default=64,
                    help="the probe's output columns per tile for gate/up (each of gate and up: 2x as many weight rows)")
    ap.add_argument("--once", action="store_true",
                    help="run each kernel once (its correctness row) and time nothing, no dense anchor: for ncu")
    ap.add_argument("--routing", choices=("uniform", "irregular"), default="uniform",
                    help="irregular: experts of 0, 1, 63-65, 127-129, 191-193, 384 ... rows (every tile "
                         "path and its edges), the remainder on the last expert")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows_out: list[dict] = []

    def record(**row):
        row["t_s"] = round(time.monotonic() - T0, 1)
        rows_out.append(row)
        print(json.dumps(row), flush=True)
        with open(os.path.join(args.out, "fp8_probe.json"), "w") as f:
            json.dump(rows_out, f, indent=1)

    import jax
    import jax.numpy as jnp

    from benchmarks import fp8_probe_kernel as fk
    from pallas_kernels.grouped_matmul import triton_lang
    from pallas_kernels.grouped_matmul.tuning import Op

    record(shape="-", kernel="env", device=str(jax.devices()[0].device_kind), jax=jax.__version__)
    lut = jnp.asarray(E2M1, jnp.float32)

    for shape in args.shapes:
        k, n_out = SHAPES[shape]
        op = Op.GATE_UP_SWIGLU if shape == "gate_up" else Op.MATMUL
        n_w = 2 * n_out if op is Op.GATE_UP_SWIGLU else n_out
        kw, ks, kg, kx = jax.random.split(jax.random.key(0 if shape == "gate_up" else 1), 4)
        w = nvfp4_weights(jax, jnp, kw, ks, kg, n_w, k)
        w.global_scale = jnp.ones((E,), jnp.float32)
        scales_u8 = jax.lax.bitcast_convert_type(w.scales, jnp.uint8)

        @jax.jit
        def values(packed, scales):  # code * scale, float32 [e, n_w, k] (exact in bf16)
            codes = jnp.stack([packed & 15, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
            return lut[codes] * jnp.repeat(scales.astype(jnp.float32), 16, axis=-1)

        chunks = [slice(c, c + 24) for c in range(0, E, 24)]
        w_bf16 = jnp.concatenate([values(w.packed[c], w.scales[c]).astype(jnp.bfloat16) for c in chunks])
        w_fp8 = jnp.concatenate([(values(w.packed[c], w.scales[c]) / 8).astype(jnp.float8_e4m3fn) for c in chunks])
        jax.block_until_ready((w_bf16, w_fp8))

        for m in args.rows:
            if left(args.budget_s) < 30:
                record(shape=shape, rows=m, kernel="-", error="skipped: budget")
                continue
            flops = 2.0 * m * k * n_w
            if args.routing == "uniform":
                sizes = np.full(E, m // E, np.int32)
                sizes[: m - sizes.sum()] += 1
                picks = ((0, 0), (1, 5), (E // 2 - 1, 3), (E - 1, sizes[-1] - 1))
            else:  # the last row of each kind of tile and of the largest expert (the highest id)
                sizes = irregular_sizes(m)
                picks = [(e, int(sizes[e]) - 1) for e in (1, 3, 4, 6, 7, 10, 11, E - 1) if sizes[e]]
            group_sizes = jnp.asarray(sizes)
            starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
            samples = [(e, int(starts[e] + o)) for e, o in picks]
            xs = [jax.random.normal(jax.random.fold_in(kx, i), (m, k), jnp.bfloat16) for i in range(3)]
            xs_fp8 = [x.astype(jnp.float8_e4m3fn) for x in xs]
            poison = jnp.full((m, n_out), jnp.nan, jnp.bfloat16)

            def exact(x, w_values, scale=1.0, quantize_rows=False):
                """float64 ``[samples, n_out]``: the sampled rows through their experts
                (``quantize_rows``: each row first to E4M3 against its amax, as W4A8 takes it)."""
                import ml_dtypes  # noqa: PLC0415

                out = []
                for e, row in samples:
                    x_k = np.asarray(x[row].astype(jnp.float32), np.float64)
                    if quantize_rows:
                        amax = np.abs(x_k).max()
                        x_k = (x_k * (448 / amax)).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * (amax / 448)
                    y = np.asarray(w_values[e].astype(jnp.float32), np.float64) @ x_k * scale
                    if op is Op.GATE_UP_SWIGLU:
                        g, u = y[:n_out], y[n_out:]
                        y = g / (1.0 + np.exp(-g)) * u
                    out.append(y)
                return np.stack(out)

            def sampled_err(y, want):
                got = np.asarray(y[np.array([r for _, r in samples])].astype(jnp.float32), np.float64)
                return float(np.linalg.norm(got - want) / np.linalg.norm(want))

            def timed(fn, inputs):
                for i in range(2):
                    jax.block_until_ready(fn(inputs[i % 3]))
                times = []
                while len(times) < max(5, args.iters) and (len(times) < 3 or left(args.budget_s) > 20):
                    t = time.perf_counter()
                    jax.block_until_ready(fn(inputs[len(times) % 3]))
                    times.append(time.perf_counter() - t)
                return float(np.median(times)), len(times)

            anchor = None
            try:
                if not args.once:  # ncu profiles the kernels alone
                    wd = jax.random.normal(kw, (k, n_w), jnp.bfloat16)
                    dense = jax.jit(lambda x: jnp.dot(x, wd, preferred_element_type=jnp.bfloat16))
                    med, n = timed(dense, xs)
                    anchor = flops / med
                    record(shape=shape, rows=m, kernel="dense anchor (XLA bf16)", ms=round(med * 1e3, 3),
                           tflops=round(flops / med / 1e12, 1), iters=n)
                    del wd
            except Exception as err:  # noqa: BLE001 (recorded, never hidden)
                record(shape=shape, rows=m, kernel="dense anchor", error=f"{type(err).__name__}: {str(err)[:300]}")

            want_bf16 = exact(xs[0], w_bf16)
            want_fp8 = exact(xs_fp8[0], w_fp8)
            block_n = args.block_n_gate_up if op is Op.GATE_UP_SWIGLU else args.block_n_down
            probe_fp8_out = None
            for label in args.kernels:
                if left(args.budget_s) < 20:
                    record(shape=shape, rows=m, kernel=label, error="skipped: budget")
                    continue
                try:
                    if label == "table w4a16":
                        bk = triton_lang.k_order(op, num_rows=m, num_experts=E, k=k, n_out=n_out, compute_capability=90)
                        inputs = [jax.jit(triton_lang.permute_k, static_argnums=1)(x, bk) for x in xs]

                        def fn(x, out=None, bk=bk):
                            return triton_lang.run(op, x, w, group_sizes, compute_capability=90, out=out, x_k_order=bk)
                        want = want_bf16
                    elif label.startswith("table w4a8"):
                        inputs, tile = xs, table_w4a8_tile(label, op, num_rows=m, k=k, n_out=n_out)

                        # One jitted program (the tile schedule and the rows' quantization in it, as
                        # in the layer), where `table w4a16` is timed eagerly. The gate/up reads row m
                        # from row_token[m] of its input, so each input holds x's row m there.
                        # (The weights go in as arrays: their namespace is no pytree.)
                        row_token = (jnp.asarray(np.random.default_rng(m).permutation(m), jnp.int32)
                                     if op is Op.GATE_UP_SWIGLU else None)
                        if row_token is not None:
                            inputs = [jnp.zeros_like(x).at[row_token].set(x) for x in xs]
                        run_w4a8 = jax.jit(lambda x, packed, scales, global_scale, sizes, row_token, out, op=op,
                                           tile=tile: triton_lang.run(
                                               op, x, type(w)(packed=packed, scales=scales, global_scale=global_scale),
                                               sizes, compute_capability=90, mode=triton_lang.Mode.W4A8, tile=tile,
                                               out=out, row_token_m=row_token))

                        def fn(x, out=None, run_w4a8=run_w4a8, row_token=row_token):
                            return run_w4a8(x, w.packed, w.scales, w.global_scale, group_sizes, row_token, out)
                        want = exact(xs[0], w_fp8, scale=8.0, quantize_rows=True)
                    elif label == "bf16 table":
                        inputs = xs

                        def fn(x, out=None):
                            return triton_lang.bf16_matmul(op, x, w_bf16, group_sizes, compute_capability=90, out=out)
                        want = want_bf16
                    else:
                        mode = fk.Mode[label.split()[1].upper()]
                        spec = fk.ProbeSpec(mode=mode, op=op, num_rows=m, num_experts=E, k=k, n_out=n_out,
                                            block_n=block_n, stages=4 if label.endswith(" s4") else None)
                        unread = scales_u8[:1, :1, :1]
                        weights = {fk.Mode.BF16: (w_bf16, unread), fk.Mode.FP8: (w_fp8, unread),
                                   fk.Mode.W4A8: (w.packed, scales_u8), fk.Mode.W4A16: (w.packed, scales_u8)}[mode]
                        # Only this mode's rows are built (each permuted set is 3 copies of [M, K]).
                        match mode:
                            case fk.Mode.BF16:
                                inputs, want = xs, want_bf16
                            case fk.Mode.FP8:
                                inputs, want = xs_fp8, want_fp8
                            case fk.Mode.W4A16:
                                inputs = [jax.jit(triton_lang.permute_k, static_argnums=1)(x, fk.BLOCK_K.value)
                                          for x in xs]
                                want = want_bf16
                            case fk.Mode.W4A8:  # the E4M3 weights times the epilogue's 2**3
                                inputs = [jax.jit(fk.permute_k)(x) for x in xs_fp8]
                                want = exact(xs_fp8[0], w_fp8, scale=8.0)

                        def fn(x, out=None, spec=spec, weights=weights):
                            return fk.launch(spec, group_sizes, x, *weights, out)
                    y = jax.block_until_ready(fn(inputs[0], out=poison.copy()))
                    nan_rows = int(jnp.sum(jnp.any(jnp.isnan(y[: int(sizes.sum())]), axis=1)))
                    row = dict(nan_rows=nan_rows, sampled_rel_err_f64=sampled_err(y, want))
                    if label == "probe fp8":
                        probe_fp8_out = y
                    if label.startswith("probe w4a8") and probe_fp8_out is not None and op is Op.MATMUL:
                        d = y.astype(jnp.float32) - 8 * probe_fp8_out.astype(jnp.float32)
                        row["rel_vs_8x_probe_fp8"] = float(jnp.linalg.norm(d) / jnp.linalg.norm(y.astype(jnp.float32)))
                    del y
                    if args.once:
                        record(shape=shape, rows=m, kernel=label, correct=nan_rows == 0
                               and row["sampled_rel_err_f64"] < 1e-2, **row)
                        continue
                    med, n = timed(fn, inputs)
                    record(shape=shape, rows=m, kernel=label, ms=round(med * 1e3, 3),
                           tflops=round(flops / med / 1e12, 1),
                           of_anchor=round(flops / med / anchor, 3) if anchor else None, iters=n,
                           correct=nan_rows == 0 and row["sampled_rel_err_f64"] < 1e-2, **row)
                    del inputs
                except Exception as err:  # noqa: BLE001 (recorded, never hidden)
                    record(shape=shape, rows=m, kernel=label, error=f"{type(err).__name__}: {str(err)[:600]}",
                           trace=traceback.format_exc()[-1500:])
            del xs, xs_fp8, poison
        del w, w_bf16, w_fp8

    with open(os.path.join(args.out, "fp8_probe.md"), "w") as f:
        f.write("| shape | rows | kernel | ms | TFLOP/s | of anchor | f64 sampled | NaN rows | correct | note |\n"
                "|---|---:|---|---:|---:|---:|---:|---:|---|---|\n")
        for r in rows_out:
            if r.get("kernel") == "env":
                continue
            f.write(f"| {r['shape']} | {r.get('rows', '')} | {r['kernel']} | {r.get('ms', '')} | {r.get('tflops', '')} "
                    f"| {r.get('of_anchor', '')} | {r.get('sampled_rel_err_f64', '')} | {r.get('nan_rows', '')} "
                    f"| {r.get('correct', '')} | {r.get('error', '')[:120]} |\n")
    print(open(os.path.join(args.out, "fp8_probe.md")).read())


if __name__ == "__main__":
    main()
