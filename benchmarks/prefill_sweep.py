"""Prefill grouped GEMMs at Kimi K2's real size against dense cuBLAS on the same FLOPs.

384 experts on one GPU, 65536 rows (8192 tokens x 8) routed uniformly, the fused gate/up +
SwiGLU (``[E, 4096, 7168]``) and the down projection (``[E, 7168, 2048]``), bf16 and NVFP4 weights:
every candidate tile of the Triton-language kernels (``triton_lang``: ``Mode.BF16`` and
``Mode.W4A16``) beside the Pallas kernels, ``torch._grouped_mm`` and the dense anchor (one
``[65536, K] x [K, N]`` matmul through XLA and through torch, the same FLOPs with no experts); the
NVFP4 weights also through their exact bf16 copy made in the same program and the bf16 kernel
with the global scales on its accumulators (``bf16 copy + native bf16``: the products of
``triton_lang.dequantized_forward``), which pays at many rows per expert (``--experts 24``).
Then the input gradients at the training shape (48 experts, 32768 rows); ``--rows 32768 --experts 48``
sweeps the forward there too (256-row tiles beside the table's). ``--only mlp``: the NVFP4 expert
MLP through the W4A16 kernels and through bf16 copies of its weights, as the library runs either.
Each candidate's output is first compared with the Pallas kernel's (or the table tile's) on the same
inputs; a tile that computes something else is recorded as wrong and never timed as a winner. Times
are the median CUPTI kernel time over ``--runs`` calls.

Besides ``prefill_sweep.json``, the run writes ``prefill_sweep.md``: each projection's rows with
their fraction of XLA's dense anchor and of the byte floor (every expert's weights in the row's
format, x read, y written, at the copy bandwidth of the same run), and what the weights' bytes
alone allow of the anchor.

Usage::

    python benchmarks/prefill_sweep.py --out DIR [--runs 20] [--only bf16 nvfp4 dx anchor router mlp]
    python benchmarks/prefill_sweep.py --render DIR/prefill_sweep.json   # the page again, from the JSON
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.grouped_gemm import (  # noqa: E402
    copy_bandwidth, group_sizes, nvfp4_bytes_per_expert, time_jax, time_torch)
from moe_jax import nvfp4  # noqa: E402
from pallas_kernels.grouped_matmul import dequantized_copy  # noqa: E402
from pallas_kernels.grouped_matmul import run as pallas_run  # noqa: E402
from pallas_kernels.grouped_matmul import triton_lang  # noqa: E402
from pallas_kernels.grouped_matmul import tuning  # noqa: E402
from pallas_kernels.grouped_matmul.tuning import Op, prefill_tile as _p  # noqa: E402

HIDDEN, INTERMEDIATE = 7168, 2048
G, M = Op.GATE_UP_SWIGLU, Op.MATMUL
# (projection, op, K, weight rows N_W, output columns)
PROJECTIONS = {"gate_up": (G, HIDDEN, 2 * INTERMEDIATE, INTERMEDIATE), "down": (M, INTERMEDIATE, HIDDEN, HIDDEN)}

BF16_CANDIDATES = {
    "gate_up": [_p(128, 64, 64, 8, 4, extra_m=64, tail_m=64), _p(128, 64, 64, 8, 3, extra_m=64, tail_m=64),
                _p(128, 64, 128, 8, 2, extra_m=64, tail_m=64), _p(128, 128, 64, 8, 3, extra_m=64, tail_m=64),
                _p(128, 64, 64, 8, 4)],
    "down": [_p(128, 128, 64, 8, 4, extra_m=64, tail_m=64), _p(128, 128, 64, 8, 3, extra_m=64, tail_m=64),
             _p(128, 256, 64, 8, 3), _p(128, 64, 64, 4, 4, extra_m=64, tail_m=64),
             _p(128, 128, 64, 8, 4)],
}
NVFP4_CANDIDATES = {
    "gate_up": [None, _p(128, 64, 64, 8, 4, extra_m=64, tail_m=64), _p(128, 64, 128, 8, 3, extra_m=64, tail_m=64),
                _p(128, 128, 64, 8, 3, extra_m=64, tail_m=64), _p(128, 64, 256, 8, 2, extra_m=64, tail_m=64),
                _p(256, 64, 64, 8, 4), _p(256, 64, 64, 8, 3)],
    "down": [None, _p(128, 128, 64, 8, 4, extra_m=64, tail_m=64), _p(128, 64, 128, 8, 4, extra_m=64, tail_m=64),
             _p(128, 128, 128, 8, 4, extra_m=64, tail_m=64), _p(128, 256, 64, 8, 3), _p(256, 128, 64, 8, 4),
             _p(256, 128, 64, 8, 3)],
}
# The 256-row tiles are BF16_MANY_ROWS_TILES' shapes with W4A16's dequantization: at many rows per
# expert each weight tile is dequantized once per 256 rows instead of 192 (cross-compiled for SM90:
# 205-212 registers, no spills, 106-143 KB of shared memory, m64n256k16). The down projection's
# 3-stage one is the library's tile from 512 rows per expert since 90cff0c (triton_lang.WIDE_TILES).
# The training shape (48 experts, 32768 rows: ~680 rows per expert, from the library's
# BF16_MANY_ROWS_PER_EXPERT on average): the library's tile there (None: since bdd1fac its 256-row
# tile, 256x64x64 / 256x128x64 w8 s4) and BF16_TILES' 128 + 64-row tile against other 256-row
# tiles, which read each weight tile once per 256 rows instead of 192 (cross-compiled for SM90
# without spills within the shared memory: gate/up 256x64x64 w8 s4 207 registers, down
# 256x128x64 198 and 256x64x64 120, 128x256x64 183).
TRAINING_BF16_CANDIDATES = {
    "gate_up": [None, triton_lang.BF16_TILES[90][G], _p(256, 64, 64, 8, 3)],
    "down": [None, triton_lang.BF16_TILES[90][M], _p(256, 128, 64, 8, 3), _p(256, 64, 64, 8, 4),
             _p(128, 256, 64, 8, 3)],
}
DX_CANDIDATES = [_p(128, 128, 64, 8, 4, extra_m=64, tail_m=64), _p(128, 128, 64, 8, 3), _p(128, 256, 64, 8, 3),
                 _p(256, 128, 64, 8, 3), _p(256, 64, 64, 8, 4)]


def tile_name(tile) -> str:
    if tile is None:
        return "table"
    extra = f"+{tile.extra_m}" if tile.extra_m else ""
    tail = f"/t{tile.tail_m}" if tile.tail_m else ""
    return f"{tile.block_m}{extra}{tail}x{tile.block_n}x{tile.block_k} w{tile.num_warps} s{tile.num_stages} g{tile.group_t}"


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if not np.all(np.isfinite(a)):
        return float("inf")
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def bf16_weights(e, n, k, seed):
    key = jax.random.key(seed)
    draw = jax.jit(lambda key: (jax.random.normal(key, (16, n, k), jnp.float32) * 0.02).astype(jnp.bfloat16))
    parts = [draw(jax.random.fold_in(key, i)) for i in range(0, e, 16)]
    return jax.block_until_ready(jnp.concatenate(parts)[:e])


def quantized(w_enk):
    quantize = jax.jit(lambda v: nvfp4.quantize(v.astype(jnp.float32)))
    parts = [quantize(w_enk[i:i + 16]) for i in range(0, w_enk.shape[0], 16)]
    return jax.block_until_ready(jax.tree.map(lambda *p: jnp.concatenate(p), *parts))


def flops(rows, n_w, k) -> float:
    return 2.0 * rows * n_w * k


@dataclasses.dataclass
class Row:
    group: str
    projection: str
    impl: str
    tile: str
    ms: float | None
    tflops: float | None
    rel_err: float | None
    note: str = ""


class Rows(list):
    """The result rows, written to ``path`` after each one (a run cut off by its limit keeps them)."""

    def __init__(self, path: pathlib.Path, meta: dict):
        super().__init__()
        self.path, self.meta = path, meta

    def append(self, row: Row) -> None:
        super().append(row)
        self.path.write_text(json.dumps({"meta": self.meta, "rows": [dataclasses.asdict(r) for r in self]}, indent=1))


def measure(rows_out, group, projection, impl, tile, fn, args, work, ref, runs, reference_impl):
    t0 = time.time()
    try:
        y = jax.block_until_ready(fn(*args))
        err = None if ref is None else rel_err(y, ref)
        if err is not None and not err < 2e-2:
            rows_out.append(Row(group, projection, impl, tile, None, None, err, f"wrong against {reference_impl}"))
            print(f"  {group:8s} {projection:8s} {impl:14s} {tile:34s} WRONG rel {err:.2e}", flush=True)
            return None
        ms = time_jax(fn, [args], runs)
    except Exception as exc:  # a candidate that does not compile or run is recorded, not fatal
        msg = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        rows_out.append(Row(group, projection, impl, tile, None, None, None, msg))
        print(f"  {group:8s} {projection:8s} {impl:14s} {tile:34s} FAILED {msg}", flush=True)
        return None
    rows_out.append(Row(group, projection, impl, tile, ms, work / ms / 1e9, err))
    print(f"  {group:8s} {projection:8s} {impl:14s} {tile:34s} {ms:8.3f} ms {work / ms / 1e9:6.0f} TFLOP/s"
          f"{'' if err is None else f'  rel {err:.1e}'}  ({time.time() - t0:.0f} s)", flush=True)
    return y


def anchor(rows_out, runs, rows):
    import torch  # noqa: PLC0415

    for projection, (_, k, n_w, _) in PROJECTIONS.items():
        a = jax.random.normal(jax.random.key(1), (rows, k), jnp.bfloat16)
        b = jax.random.normal(jax.random.key(2), (k, n_w), jnp.bfloat16)
        measure(rows_out, "anchor", projection, "xla dense", f"{rows}x{k}x{n_w}", jax.jit(jnp.dot), (a, b),
                flops(rows, n_w, k), None, runs, "")
        ta = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        tb = torch.randn(k, n_w, device="cuda", dtype=torch.bfloat16)
        ms = time_torch(torch.matmul, [(ta, tb)], runs)
        rows_out.append(Row("anchor", projection, "torch dense", f"{rows}x{k}x{n_w}", ms, flops(rows, n_w, k) / ms / 1e9,
                            None))
        print(f"  anchor   {projection:8s} torch dense    {ms:8.3f} ms {flops(rows, n_w, k) / ms / 1e9:6.0f} TFLOP/s")
        del ta, tb


def torch_grouped(rows_out, projection, x, w_enk, g, runs, work):
    import torch  # noqa: PLC0415

    tx = torch.from_dlpack(x)
    tw = torch.from_dlpack(w_enk)
    offs = torch.from_dlpack(jnp.cumsum(g).astype(jnp.int32))
    fn = lambda x, w, o: torch._grouped_mm(x, w.transpose(1, 2), offs=o)  # noqa: E731
    ms = time_torch(fn, [(tx, tw, offs)], runs)
    rows_out.append(Row("bf16", projection, "torch grouped", "", ms, work / ms / 1e9, None, "plain matmul (no SwiGLU)"))
    print(f"  bf16     {projection:8s} torch grouped  {'':34s} {ms:8.3f} ms {work / ms / 1e9:6.0f} TFLOP/s")


def grouped(rows_out, args, cc, experts, rows):
    rng = np.random.default_rng(0)
    g = jnp.asarray(group_sizes(rows, "uniform", rng, experts=experts))
    print(f"rows {rows}, experts {experts}: rows per expert min {int(g.min())} max {int(g.max())}", flush=True)
    for projection, (op, k, n_w, n_out) in PROJECTIONS.items():
        work = flops(rows, n_w, k)
        x = jax.random.normal(jax.random.key(7), (rows, k), jnp.bfloat16)
        w = bf16_weights(experts, n_w, k, seed=11 if projection == "gate_up" else 12)
        if "bf16" in args.only:
            ref = measure(rows_out, "bf16", projection, "pallas", "table", jax.jit(
                lambda x, w, g: pallas_run(op, x, w, g, compute_capability=cc)), (x, w, g), work, None, args.runs, "")
            training = rows >= triton_lang.BF16_MANY_ROWS_PER_EXPERT * experts
            for tile in (TRAINING_BF16_CANDIDATES if training else BF16_CANDIDATES)[projection]:
                measure(rows_out, "bf16", projection, "native bf16", tile_name(tile), jax.jit(
                    lambda x, w, g, tile=tile: triton_lang.bf16_matmul(op, x, w, g, compute_capability=cc, tile=tile)),
                    (x, w, g), work, ref, args.runs, "pallas")
            try:
                torch_grouped(rows_out, projection, x, w, g, args.runs, work)
            except Exception as exc:  # torch is a peer; its absence is recorded
                rows_out.append(Row("bf16", projection, "torch grouped", "", None, None, None, repr(exc)[:200]))
            del ref
        if "nvfp4" in args.only:
            q = quantized(w)
            del w
            ref = None
            for tile in NVFP4_CANDIDATES[projection]:
                y = measure(rows_out, "nvfp4", projection, "native w4a16", tile_name(tile), jax.jit(
                    lambda x, q, g, tile=tile: triton_lang.run(op, x, q, g, compute_capability=cc, tile=tile)),
                    (x, q, g), work, ref, args.runs, "the table's tile")
                if tile is None:
                    ref = y
            measure(rows_out, "nvfp4", projection, "pallas", "table", jax.jit(
                lambda x, q, g: pallas_run(op, x, q, g, compute_capability=cc)), (x, q, g), work, ref, args.runs,
                "the native table tile")
            # The copy and the bf16 kernel as one program, as dequantized_forward runs them: at many
            # rows per expert the copy's ~2.5 bytes a weight cost less than W4A16's main loop.
            measure(rows_out, "nvfp4", projection, "bf16 copy + native bf16", "table", jax.jit(
                lambda x, q, g: triton_lang.bf16_matmul(op, x, dequantized_copy(q), g, compute_capability=cc,
                                                        global_scale=q.global_scale)), (x, q, g),
                work, ref, args.runs, "the native table tile")
            del q, ref
        del x


def mlp(rows_out, args, cc):
    """The NVFP4 expert MLP (fused gate/up + SwiGLU, then down) as the library runs it, over
    ``--experts`` at ``--rows``: through the W4A16 kernels (``triton_lang.w4a16_forward``) and
    through bf16 copies of both weights (``triton_lang.dequantized_forward``), each output against
    the W4A16 kernels'; prints which one ``tuning.dequantize_for_forward`` takes there."""
    experts, rows = args.experts, args.rows
    g = jnp.asarray(group_sizes(rows, "uniform", np.random.default_rng(0), experts=experts))
    x = jax.random.normal(jax.random.key(7), (rows, HIDDEN), jnp.bfloat16)
    w_gate_up = quantized(bf16_weights(experts, 2 * INTERMEDIATE, HIDDEN, seed=11))
    w_down = quantized(bf16_weights(experts, HIDDEN, INTERMEDIATE, seed=12))
    work = flops(rows, 2 * INTERMEDIATE, HIDDEN) + flops(rows, HIDDEN, INTERMEDIATE)
    taken = tuning.dequantize_for_forward(num_rows=rows, num_experts=experts, hidden=HIDDEN,
                                          intermediate=INTERMEDIATE, compute_capability=cc)
    print(f"mlp: {rows // experts} rows per expert; the library takes "
          f"{'the bf16 copies' if taken else 'the W4A16 kernels'}", flush=True)
    operands = (x, g, w_gate_up, w_down)
    ref = measure(rows_out, "mlp", "gate_up+down", "w4a16 kernels", "library", jax.jit(
        lambda x, g, a, b: triton_lang.w4a16_forward(x, g, a, b, compute_capability=cc)), operands, work, None,
        args.runs, "")
    measure(rows_out, "mlp", "gate_up+down", "bf16 copies + bf16 kernels", "library", jax.jit(
        lambda x, g, a, b: triton_lang.dequantized_forward(x, g, a, b, compute_capability=cc)), operands, work, ref,
        args.runs, "the w4a16 kernels")


def input_grads(rows_out, args, cc):
    experts, rows = 48, 32768
    rng = np.random.default_rng(1)
    g = jnp.asarray(group_sizes(rows, "uniform", rng, experts=experts))
    for projection, (_, k, n_w, _) in PROJECTIONS.items():
        # dx = dy @ W_e: dy [M, N_W], W_e [N_W, K] as stored, out [M, K].
        work = flops(rows, n_w, k)
        dy = jax.random.normal(jax.random.key(3), (rows, n_w), jnp.bfloat16)
        w = bf16_weights(experts, n_w, k, seed=21)
        ref = measure(rows_out, "dx", projection, "pallas", "table", jax.jit(
            lambda d, w, g: pallas_run(M, d, w, g, compute_capability=cc, transpose_w=True)), (dy, w, g), work, None,
            args.runs, "")
        for tile in DX_CANDIDATES:
            measure(rows_out, "dx", projection, "native bf16", tile_name(tile), jax.jit(
                lambda d, w, g, tile=tile: triton_lang.bf16_matmul(M, d, w, g, compute_capability=cc, tile=tile,
                                                                   transpose_w=True)),
                (dy, w, g), work, ref, args.runs, "pallas")
        del dy, w, ref


def router(rows_out, args):
    """The router's logits at 8192 tokens, 384 experts: float32 HIGHEST against bf16 splits."""
    t, h, e = 8192, HIDDEN, 384
    x = jax.random.normal(jax.random.key(5), (t, h), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(6), (e, h), jnp.float32) / np.sqrt(h)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    bound = np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64)).T
    work = 2.0 * t * h * e

    def highest(x, w):
        return jnp.matmul(x.astype(jnp.float32), w.T, precision=jax.lax.Precision.HIGHEST)

    def split3(x, w):
        hi = w.astype(jnp.bfloat16)
        r1 = w - hi.astype(jnp.float32)
        mid = r1.astype(jnp.bfloat16)
        lo = (r1 - mid.astype(jnp.float32)).astype(jnp.bfloat16)
        parts = jnp.concatenate([hi, mid, lo])
        y = jnp.dot(x, parts.T, preferred_element_type=jnp.float32).reshape(x.shape[0], 3, -1)
        return (y[:, 2] + y[:, 1]) + y[:, 0]

    def algorithm(preset):
        return lambda x, w: jax.lax.dot(x.astype(jnp.float32), w.T, precision=preset,
                                        preferred_element_type=jnp.float32)

    fns = {"f32 highest": highest, "bf16 x3 split of w": split3,
           "BF16_BF16_F32_X6": algorithm(jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X6),
           "BF16_BF16_F32_X9": algorithm(jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X9)}
    for name, fn in fns.items():
        try:
            fn = jax.jit(fn)
            y = np.asarray(fn(x, w), np.float64)
            err = float(np.max(np.abs(y - exact) / bound))
            ms = time_jax(fn, [(x, w)], args.runs)
            rows_out.append(Row("router", "logits", name, f"{t}x{h}x{e}", ms, work / ms / 1e9, err,
                                "rel_err: max |y - exact| / (|x| |w|) per logit"))
            print(f"  router   logits   {name:22s} {ms:8.3f} ms  max err / (|x||w|) {err:.2e}", flush=True)
        except Exception as exc:
            rows_out.append(Row("router", "logits", name, "", None, None, None, repr(exc)[:200]))
            print(f"  router   {name} FAILED {exc!r}"[:300], flush=True)


def weight_bytes(fmt: str, experts: int, n_w: int, k: int) -> int:
    """The bytes of ``experts`` weights ``[N_W, K]``: bf16, or NVFP4 codes and E4M3 block scales."""
    return experts * (n_w * k * 2 if fmt == "bf16" else nvfp4_bytes_per_expert(n_w, k))


def floor_ms(meta: dict, fmt: str, projection: str) -> float:
    """The projection's byte floor at the run's copy bandwidth: the weights of every expert that
    gets rows (uniform routing: all, up to one per row), x read and the output written, bf16."""
    _, k, n_w, n_out = PROJECTIONS[projection]
    rows, experts = meta["rows"], min(meta["experts"], meta["rows"])
    moved = weight_bytes(fmt, experts, n_w, k) + rows * (k + n_out) * 2
    return moved / (meta["copy_bandwidth_tbs"] * 1e12) * 1e3


def _number(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def markdown(data: dict) -> str:
    """The page of one run: per projection, the anchor, our kernels and torch's with their
    fraction of XLA's dense anchor and of the byte floor; then the other groups as measured."""
    meta, rows = data["meta"], data["rows"]
    out = [f"# Prefill grouped GEMMs against dense cuBLAS ({meta['device']})", "",
           f"- {meta['rows']} rows over {meta['experts']} experts, uniform routing; median CUPTI time of "
           f"{meta['runs']} calls; copy bandwidth {meta['copy_bandwidth_tbs']:.2f} TB/s.",
           "- of anchor: XLA's dense `[rows, K] x [K, N]` matmul of the same FLOPs (no experts) over this row's time.",
           "- floor: every expert's weights in the row's format, x read and the output written, at the copy "
           "bandwidth; of floor: the floor over this row's time (1.00: the bytes' speed).",
           "- wrong or failed rows (against the reference named in their note) have no time."]
    for projection, (_, k, n_w, n_out) in PROJECTIONS.items():
        here = [r for r in rows if r["projection"] == projection and r["group"] in ("anchor", "bf16", "nvfp4")]
        if not here:
            continue
        anchor_ms = next((r["ms"] for r in here if r["impl"] == "xla dense" and r["ms"]), None)
        out += ["", f"## {projection} (K {k}, weight rows {n_w}, output columns {n_out})", ""]
        if anchor_ms:
            bounds = [f"{fmt} {anchor_ms / floor_ms(meta, fmt, projection):.2f}" for fmt in ("bf16", "nvfp4")]
            out += ["What the weights' bytes allow at the copy bandwidth, as a fraction of the anchor: "
                    + ", ".join(bounds) + " (a kernel streaming every byte at the copy bandwidth, its MMAs hidden).", ""]
        out += ["| group | impl | tile | ms | TFLOP/s | of anchor | floor (ms) | of floor | note |",
                "|---|---|---|---:|---:|---:|---:|---:|---|"]
        for r in here:
            floor = None if r["group"] == "anchor" else floor_ms(meta, r["group"], projection)
            of_anchor = anchor_ms / r["ms"] if anchor_ms and r["ms"] else None
            of_floor = floor / r["ms"] if floor and r["ms"] else None
            out.append(f"| {r['group']} | {r['impl']} | {r['tile']} | {_number(r['ms'], '.3f')} | "
                       f"{_number(r['tflops'], '.0f')} | {_number(of_anchor, '.2f')} | {_number(floor, '.3f')} | "
                       f"{_number(of_floor, '.2f')} | {r['note']} |")
    others = [r for r in rows if r["group"] not in ("anchor", "bf16", "nvfp4")]
    if others:
        out += ["", "## Other measurements", "", "| group | projection | impl | tile | ms | TFLOP/s | rel err | note |",
                "|---|---|---|---|---:|---:|---:|---|"]
        out += [f"| {r['group']} | {r['projection']} | {r['impl']} | {r['tile']} | {_number(r['ms'], '.3f')} | "
                f"{_number(r['tflops'], '.0f')} | {_number(r['rel_err'], '.1e')} | {r['note']} |" for r in others]
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path)
    parser.add_argument("--render", type=pathlib.Path, metavar="JSON",
                        help="write the page of an earlier run's prefill_sweep.json beside it, and measure nothing")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--rows", type=int, default=65536)
    parser.add_argument("--experts", type=int, default=384)
    parser.add_argument("--only", nargs="+", default=["anchor", "bf16", "nvfp4", "dx", "router"])
    parser.add_argument("--tables-only", action="store_true",
                        help="only the tile tables' entries (beside the peers and the anchor), no candidates")
    parser.add_argument("--ncu", action="store_true",
                        help="run each kernel of interest once (96 experts, 16384 rows: ~170 per expert), for ncu")
    args = parser.parse_args()
    if args.render:
        args.render.with_suffix(".md").write_text(markdown(json.loads(args.render.read_text())))
        return None
    if args.out is None:
        parser.error("--out is required unless --render is given")
    cc = 90
    if args.ncu:
        return ncu_targets(cc)
    if args.tables_only:
        for table in (BF16_CANDIDATES, TRAINING_BF16_CANDIDATES, NVFP4_CANDIDATES):
            for projection in table:
                table[projection] = [None]
        DX_CANDIDATES[:] = []
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"device": jax.devices()[0].device_kind, "rows": args.rows, "experts": args.experts, "runs": args.runs,
            "copy_bandwidth_tbs": copy_bandwidth(args.runs) / 1e12}
    rows_out = Rows(args.out / "prefill_sweep.json", meta)
    print(f"copy bandwidth {meta['copy_bandwidth_tbs']:.2f} TB/s", flush=True)
    if "anchor" in args.only:
        anchor(rows_out, args.runs, args.rows)
    if "router" in args.only:
        router(rows_out, args)
    if {"bf16", "nvfp4"} & set(args.only):
        grouped(rows_out, args, cc, args.experts, args.rows)
    if "mlp" in args.only:
        mlp(rows_out, args, cc)
    if "dx" in args.only:
        input_grads(rows_out, args, cc)
    (args.out / "prefill_sweep.md").write_text(markdown({"meta": meta, "rows": [dataclasses.asdict(r) for r in rows_out]}))


def ncu_targets(cc: int) -> None:
    """One call of each kernel Nsight Compute should look at, ~170 rows per expert as at 384."""
    experts, rows = 96, 16384
    g = jnp.asarray(group_sizes(rows, "uniform", np.random.default_rng(0), experts=experts))
    for projection, (op, k, n_w, _) in PROJECTIONS.items():
        x = jax.random.normal(jax.random.key(7), (rows, k), jnp.bfloat16)
        w = bf16_weights(experts, n_w, k, seed=3)
        q = quantized(w)
        calls = {"nvfp4 table": lambda: triton_lang.run(op, x, q, g, compute_capability=cc),
                 "bf16 native": lambda: triton_lang.bf16_matmul(op, x, w, g, compute_capability=cc,
                                                                tile=None)}
        for name, call in calls.items():
            jax.block_until_ready(call())
            print(f"ran {projection} {name}", flush=True)


if __name__ == "__main__":
    main()
