"""Probe: a candidate for the native weight gradient (one GPU; not a library path).

``flat``: the library kernel's tiles, order and per-expert descriptors, with
each program's tiles of an expert and their row steps as one software-pipelined loop (the tile
index and row step from the loop index, the epilogue under ``if`` on a tile's last step), so the
next tile's first rows load while a tile's result is stored: the library kernel drains and refills
its pipeline for every tile, ~11 row steps at 683 rows per expert, and Nsight Compute showed
barrier stalls on top (results/weight_grad_h100/0d0c3dd/). Triton 3.6's ``tl.range(flatten=True)``
does not fuse these loops (the inner one's bounds are the expert's rows); written out by hand, it
compiles with the epilogue inside the loop (SM90: 224 KB of shared memory). Timed beside the
library kernel, the Pallas table tile and ``torch._grouped_mm`` in the same run, 48 experts,
Kimi K2's projections, at the library's table tile and others (``CANDIDATES``: one with two
programs per SM, and flat storing through TMA); each checked against the Pallas kernel's float32 output first (relative error
< 1e-2). ``--once``: the table tile's and the TMA stores, each called twice at 32768 rows,
gate/up, for Nsight Compute.

No warp-specialized candidate: Triton 3.6's warp specialization was wrong on the library kernel
(results/weight_grad_h100/0d0c3dd_schedules/, c1ab555's probe), and on this loop it does not
specialize at all (``tl.range(warp_specialize=True)`` compiles to the same 4 warps, no
``setmaxnreg``).

    python benchmarks/weight_grad_probe.py OUT.json [--rows 32768 8192]
    ncu ... python benchmarks/weight_grad_probe.py OUT.json --once
"""
import argparse
import dataclasses
import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

sys.path.insert(0, ".")
from pallas_kernels.grouped_matmul import (  # noqa: E402
    grouped_matmul_weight_grad, pallas_triton, triton_launch, triton_weight_grad,
)
from pallas_kernels.grouped_matmul.triton_weight_grad import expert_rows  # noqa: E402
from pallas_kernels.grouped_matmul.tuning import TileConfig  # noqa: E402
from weight_grad_sweep import _median_ms  # noqa: E402 (benchmarks/, this script's directory)

E, H, F = 48, 7168, 2048
PROJECTIONS = {"gate_up": (H, 2 * F), "down": (F, H)}  # (k, n): x [M, k], dy [M, n]
#: (kernel, (block_m, block_n, block_k, num_warps, num_stages, programs per SM)): the library's SM90
#: table tile; 32-row steps with 6 stages (as fast in the library kernel,
#: results/weight_grad_h100/0d0c3dd_schedules/); 128 x 128 outputs on 4 warps in 98 KB (106 for
#: flat), two programs per SM, so one's loads and MMAs run while the other stores; and flat's TMA
#: store, whose 64 KB staging buffer leaves room for 3 stages of 64 rows (213 KB) or 5 of 32 (188).
CANDIDATES = [("library", (64, 128, 256, 8, 4, 1)), ("flat", (64, 128, 256, 8, 4, 1)),
              ("flat, TMA store", (64, 128, 256, 8, 3, 1)), ("flat, TMA store", (32, 128, 256, 8, 5, 1)),
              ("library", (32, 128, 256, 8, 6, 1)), ("flat", (32, 128, 256, 8, 6, 1)),
              ("library", (64, 128, 128, 4, 3, 2)), ("flat", (64, 128, 128, 4, 3, 2))]


@triton.jit
def _flat_kernel(starts_ptr, ends_ptr, x_ptr, dy_ptr, out_in_ptr, out_ptr, K: tl.constexpr, N: tl.constexpr,
                 NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 NUM_STAGES: tl.constexpr, TMA_STORE: tl.constexpr):
    """``triton_weight_grad._kernel``'s tiles and descriptors, a program's tiles of one expert
    and their row steps as one pipelined loop: step ``i`` is row step ``i % steps`` of the
    program's tile ``i // steps``; on a tile's last step its result is stored and the
    accumulator restarts. An expert without rows still takes one step per tile (its rows past
    the bound read as zeros; when it ends at row 0 the descriptor's one row is another expert's,
    so the stored value is selected to zero) so every tile is written. ``TMA_STORE``: the result
    leaves through a descriptor over the output as ``[E * N, K]`` (an asynchronous bulk copy from
    shared memory) instead of per-thread stores."""
    K_TILES: tl.constexpr = K // BLOCK_K
    PER_EXPERT: tl.constexpr = (N // BLOCK_N) * K_TILES
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    local_n = tl.arange(0, BLOCK_N)
    local_k = tl.arange(0, BLOCK_K)
    if TMA_STORE:
        out_desc = tl.make_tensor_descriptor(out_ptr, shape=[NUM_EXPERTS * N, K], strides=[K, 1],
                                             block_shape=[BLOCK_N, BLOCK_K])
    for expert in range(NUM_EXPERTS):
        start, end, dy_desc, x_desc, first = expert_rows(starts_ptr, ends_ptr, x_ptr, dy_ptr, expert, pid, programs,
                                                         K, N, PER_EXPERT, BLOCK_M, BLOCK_N, BLOCK_K)
        tiles = (PER_EXPERT - first + programs - 1) // programs
        steps = tl.maximum((end - start + BLOCK_M - 1) // BLOCK_M, 1)
        acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
        for i in tl.range(0, tiles * steps, num_stages=NUM_STAGES):
            tile = i // steps
            step = i - tile * steps
            local = first + tile * programs
            n_start = (local // K_TILES) * BLOCK_N
            k_start = (local % K_TILES) * BLOCK_K
            row = start + step * BLOCK_M
            acc = tl.dot(tl.trans(dy_desc.load([row, n_start])), x_desc.load([row, k_start]), acc)
            if step == steps - 1:
                value = tl.where(end > start, acc, 0.0).to(out_ptr.dtype.element_ty)
                if TMA_STORE:
                    out_desc.store([expert * N + n_start, k_start], value)
                else:
                    out_at = (out_ptr + tl.cast(expert, tl.int64) * (N * K)
                              + ((n_start + local_n)[:, None] * K + (k_start + local_k)[None, :]))
                    tl.store(out_at, value)
                acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)


def flat_launch(spec: triton_weight_grad.Spec, *, tma_store: bool = False) -> triton_launch.Launch:
    """The library launch of ``spec`` (tile, grid, constexprs) with :func:`_flat_kernel`."""
    launch = spec.launch()
    return dataclasses.replace(launch, kernel=_flat_kernel, constexprs=(*launch.constexprs, ("TMA_STORE", tma_store)),
                               name=f"flat_{spec.name}")


@functools.partial(jax.jit, static_argnums=(0, 1))
def _flat_call(spec, tma_store, x_mk, dy_mn, group_sizes_e):
    starts_e, ends_e = pallas_triton.group_bounds(group_sizes_e, num_rows=spec.num_rows)
    return triton_launch.call(flat_launch(spec, tma_store=tma_store), starts_e, ends_e, x_mk, dy_mn,
                              out_shape=jax.ShapeDtypeStruct((spec.num_experts, spec.n, spec.k), spec.out_dtype))


def flat_weight_grad(x_mk, dy_mn, group_sizes_e, *, compute_capability: int = 90, out_dtype=jnp.bfloat16,
                     tile: TileConfig | None = None, num_programs: int | None = None,
                     tma_store: bool = False) -> jax.Array:
    """:func:`.triton_weight_grad.weight_grad`'s ``[E, N, K]`` through :func:`_flat_kernel`."""
    (m, k), n, e = x_mk.shape, dy_mn.shape[1], group_sizes_e.shape[0]
    spec = triton_weight_grad.make_spec(num_rows=m, num_experts=e, n=n, k=k, compute_capability=compute_capability,
                                        out_dtype=out_dtype, tile=tile, num_programs=num_programs)
    return _flat_call(spec, tma_store, x_mk, dy_mn, group_sizes_e)


def _candidates(x, dy, gs):
    """(name, tile, f) of the Pallas table tile and :data:`CANDIDATES` (torch is timed apart)."""
    out = [("pallas table", None, lambda: grouped_matmul_weight_grad(x, dy, gs, compute_capability=90,
                                                                     out_dtype=jnp.bfloat16))]
    for name, tile in CANDIDATES:
        cfg = TileConfig(block_m=tile[0], block_n=tile[1], block_k=tile[2], num_warps=tile[3], num_stages=tile[4],
                         group_t=1)
        programs = tile[5] * triton_weight_grad.sm_count()
        if name == "library":
            f = lambda cfg=cfg, p=programs: triton_weight_grad.weight_grad(  # noqa: E731
                x, dy, gs, compute_capability=90, out_dtype=jnp.bfloat16, tile=cfg, num_programs=p)
        else:
            f = lambda cfg=cfg, p=programs, tma=name.endswith("TMA store"): flat_weight_grad(  # noqa: E731
                x, dy, gs, tile=cfg, num_programs=p, tma_store=tma)
        out.append((name, tile, f))
    return out


def probe(out: str, rows: list[int]) -> None:
    import torch  # noqa: PLC0415

    rng = np.random.default_rng(0)
    results = []
    for m in rows:
        gs = jnp.asarray(rng.multinomial(m, np.full(E, 1 / E)), jnp.int32)
        offs = torch.as_tensor(np.cumsum(np.asarray(gs)).astype(np.int32), device="cuda")
        for proj, (k, n) in PROJECTIONS.items():
            x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
            dy = jax.random.normal(jax.random.key(2), (m, n), jnp.bfloat16)
            tx, tdy = torch.from_dlpack(x), torch.from_dlpack(dy)
            ref = grouped_matmul_weight_grad(x, dy, gs, compute_capability=90, out_dtype=jnp.float32)
            torch_f = lambda: (torch._grouped_mm(tx.t(), tdy, offs=offs), torch.cuda.synchronize())  # noqa: B023, E731
            for name, tile, f in [*_candidates(x, dy, gs), ("torch", None, None)]:
                row = dict(m=m, proj=proj, kernel=name, tile=tile)
                try:
                    if name == "torch":
                        ms = _median_ms(torch_f)
                    else:
                        got = f()
                        row["err"] = float(jnp.linalg.norm(got.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
                        del got
                        if not row["err"] < 1e-2:
                            raise AssertionError(f"relative error {row['err']:.3g} against the Pallas kernel's float32")
                        ms = _median_ms(lambda: f().block_until_ready())  # noqa: B023
                    row.update(ms=ms, tflops=2 * m * n * k / ms / 1e9)
                except Exception as e:  # noqa: BLE001 -- recorded, never hidden
                    row["error"] = str(e)[:300]
                results.append(row)
                print(m, proj, name, tile or "", f"{row['ms']:.3f} ms {row['tflops']:.0f} TFLOP/s"
                      if "ms" in row else row["error"], flush=True)
                with open(out, "w") as fh:  # after every row: a cut-off run keeps what it measured
                    json.dump(results, fh, indent=1)
            del x, dy, tx, tdy, ref


def once(out: str, m: int) -> None:
    """Each candidate at the table tile, gate/up, called twice (the first compiles), then
    torch's: for Nsight Compute, whose second launch of each is the one to read."""
    import torch  # noqa: PLC0415

    k, n = PROJECTIONS["gate_up"]
    gs = jnp.asarray(np.random.default_rng(0).multinomial(m, np.full(E, 1 / E)), jnp.int32)
    x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
    dy = jax.random.normal(jax.random.key(2), (m, n), jnp.bfloat16)
    tx, tdy = torch.from_dlpack(x), torch.from_dlpack(dy)
    offs = torch.as_tensor(np.cumsum(np.asarray(gs)).astype(np.int32), device="cuda")
    calls = [(name, lambda f=f: f().block_until_ready()) for name, tile, f in _candidates(x, dy, gs)
             if tile is None or tile == (64, 128, 256, 8, 4, 1) or name.endswith("TMA store")]
    calls.append(("torch", lambda: (torch._grouped_mm(tx.t(), tdy, offs=offs), torch.cuda.synchronize())))
    launches = []
    for name, f in calls:
        for call in ("first", "measured"):
            f()
            launches.append(dict(m=m, proj="gate_up", kernel=name, call=call))
            print(name, call, flush=True)
    with open(out, "w") as fh:
        json.dump(launches, fh, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="JSON file to write (rewritten after every row)")
    parser.add_argument("--rows", type=int, nargs="+", default=[32768, 8192],
                        help="rows over 48 experts; --once takes the first")
    parser.add_argument("--once", action="store_true", help="each candidate launched twice, for Nsight Compute")
    args = parser.parse_args()
    if args.once:
        return once(args.out, args.rows[0])
    return probe(args.out, args.rows)


if __name__ == "__main__":
    main()
