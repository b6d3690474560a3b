"""Probe: a warp-specialized Pallas Mosaic GPU grouped weight gradient on Hopper, beside ours.

``out[e] = a_e^T @ b_e`` over the rows of expert e (rows sorted by
expert, ``group_sizes_e`` of them each): the expert MLP's weight gradient, ``[E, N, K] = dy_e^T
x_e`` with ``a = dy`` and ``b = x``. Triton 3.6 gives our native kernel (``triton_weight_grad``) no
working warp specialization on SM90; this kernel has it: one memory warpgroup issues the TMA loads
of a pipeline over an expert's 64-row blocks, two compute warpgroups each own half of a
``[tile_a, 2 * tile_b]`` output tile (``wgmma``, a's block read transposed from shared memory),
and one tile's epilogue overlaps the next tile's loads. Persistent: one program (or cluster of two)
per SM walks (expert, a-tile, b-tile), experts outermost so that an expert's rows stay in L2 while
every SM works on them. Option: ``cluster=2`` (b's blocks multicast to two CTAs). One ``wgmma``
in flight across steps (``delay_release=1``) was an option here; with a pipeline per tile it is
unsafe (a pipeline's last slot is left unreleased, and the next tile's may load into it while
that ``wgmma`` still reads it; ``benchmarks/NOTES.md``, "Training") and is gone.

A 64-row block that straddles an expert's first or last row has the other experts' rows selected
to zero in shared memory before its MMA: each compute warpgroup its half of a's columns and its
own b columns, then both meet at a barrier. A selection, not a product, so a non-finite row of one
expert never reaches another's gradient. In the Mosaic GPU interpreter on CPU
(``plgpu.InterpretGPUParams(detect_races=True)``, one block) it matches float64 with no race
reported; every option lowers for SM90 on CPU (``jax.export`` with ``platforms=["cuda"]``).

    python3 benchmarks/wgrad_mgpu_probe.py OUT.json [--rows 32768 8192]

Times (median of 10 synchronized calls after 2 more, ms) at 48 experts, both projections: this
kernel at each of ``CONFIGS``, our native and Pallas weight gradients, JAX's (not
warp-specialized) ``transposed_ragged_dot_mgpu``, ``torch._grouped_mm`` and the dense anchor (one
XLA matmul of the same FLOPs), every output checked against the Pallas kernel's (relative
Frobenius error < 1e-2) and the first and last experts' against float64; first, for every config,
a NaN and an inf next to an expert boundary reach only their own experts.
"""
import argparse
import functools
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


def weight_grad_ws(a_ma, b_mb, group_sizes_e, *, tile_a: int = 128, tile_b: int = 128, block_m: int = 64,
                   steps: int = 4, cluster: int = 1, epi: int = 64,
                   num_sms: int | None = None, interpret=False):
    """``[M, A] x [M, B] -> [E, A, B]``, per expert ``a_e^T @ b_e`` over its rows, in a's dtype.

    ``M`` a multiple of ``block_m`` (the rows of one pipeline step). A CTA's output tile is
    ``[tile_a, 2 * tile_b]``: compute warpgroup w owns columns ``w * tile_b`` on. With ``cluster=2``
    two CTAs take neighbouring ``tile_a`` tiles of the same columns, and b's blocks reach both by
    one multicast TMA load (a third less L2 traffic per step at the default tile).
    """
    m, na = a_ma.shape
    m2, nb = b_mb.shape
    (e,) = group_sizes_e.shape
    if m != m2 or m % block_m or na % (cluster * tile_a) or nb % (2 * tile_b):
        raise ValueError(f"shapes a {a_ma.shape}, b {b_mb.shape} do not fit the tile")
    dtype = a_ma.dtype
    cta_b = 2 * tile_b
    a_tiles, b_tiles = na // (cluster * tile_a), nb // cta_b
    ends_e = jnp.cumsum(group_sizes_e.astype(jnp.int32))
    starts_e = ends_e - group_sizes_e.astype(jnp.int32)
    block_starts_e = starts_e // block_m * block_m
    blocks_e = jnp.where(group_sizes_e > 0, (ends_e + block_m - 1) // block_m - starts_e // block_m, 0)
    swizzle = plgpu.find_swizzle(64 * jnp.dtype(dtype).itemsize * 8)
    transforms = (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
                  plgpu.SwizzleTransform(swizzle))
    out_swizzle = plgpu.find_swizzle(epi * jnp.dtype(dtype).itemsize * 8)
    out_transforms = (plgpu.TilingTransform((8, out_swizzle // jnp.dtype(dtype).itemsize)),
                      plgpu.SwizzleTransform(out_swizzle))
    grid_axis = "cluster_grid" if cluster > 1 else "sm"

    def body(starts_ref, ends_ref, block_starts_ref, blocks_ref, a_gmem, b_gmem, out_gmem):
        def get_pipeline(pipeline_body, compute_context, blocks):
            return plgpu.emit_pipeline_warp_specialized(
                pipeline_body,
                grid=(blocks,),
                memory_registers=40,
                in_specs=[plgpu.BlockSpec((block_m, tile_a), lambda i: (i, 0), transforms=transforms),
                          plgpu.BlockSpec((block_m, cta_b), lambda i: (i, 0), transforms=transforms,
                                          collective_axes=("cluster",) if cluster > 1 else ())],
                wg_axis="wg",
                num_compute_wgs=2,
                max_concurrent_steps=steps,
                compute_context=compute_context,
            )

        ignore = lambda *_, **__: None  # noqa: E731

        @functools.partial(
            pl.run_scoped,
            allocs=get_pipeline(ignore, ignore, steps).get_allocations(a_gmem.at[:, pl.ds(0, tile_a)],
                                                                      b_gmem.at[:, pl.ds(0, cta_b)]),
            out_smem=plgpu.SMEM((2, 2, epi, epi), dtype, transforms=out_transforms),
            selected=plgpu.Barrier(num_arrivals=2),
            collective_axes="wg",
        )
        def scope(allocs, out_smem, selected):
            wg = lax.axis_index("wg")
            cta = lax.axis_index("cluster") if cluster > 1 else 0

            @plgpu.nd_loop((e, a_tiles * b_tiles), collective_axes=grid_axis)
            def tile_loop(info):
                g, lin = info.index
                a_pair, b_i = plgpu.planar_snake(lin, (a_tiles, b_tiles), 1, 8)
                a_i = a_pair * cluster + cta
                blocks = blocks_ref[g]
                start, end = starts_ref[g], ends_ref[g]
                row0 = pl.multiple_of(block_starts_ref[g], block_m)
                wg_b = pl.ds(wg * tile_b, tile_b)

                def select_rows(ref, i):
                    """Zero the rows of block i outside [start, end) (a select: NaN * 0 stays NaN)."""
                    row = row0 + i * block_m + plgpu.layout_cast(
                        lax.broadcasted_iota(jnp.int32, ref.shape, 0), plgpu.Layout.WGMMA)
                    ref[...] = jnp.where((row >= start) & (row < end), ref[...], jnp.zeros((), dtype))

                def mma(idx, a_smem, b_smem, acc_ref):
                    (i,) = idx

                    # A block that straddles the expert's first or last row: each warpgroup selects
                    # its half of a's columns and its own b columns, then waits for the other, so
                    # that neither multiplies a half the other is still writing.
                    @pl.when((i == 0) | (i == blocks - 1))
                    def _():
                        select_rows(a_smem.at[:, pl.ds(wg * (tile_a // 2), tile_a // 2)], i)
                        select_rows(b_smem.at[:, wg_b], i)
                        plgpu.commit_smem()
                        plgpu.barrier_arrive(selected)
                        plgpu.barrier_wait(selected)

                    plgpu.wgmma(acc_ref, a_smem.transpose((1, 0)), b_smem.at[:, wg_b])
                    plgpu.wgmma_wait(0)
                    return acc_ref

                def compute_context(run):
                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_a, tile_b), jnp.float32))
                    def _(acc_ref):
                        run(acc_ref)
                        acc = acc_ref[...].astype(dtype)  # waits for the last wgmma
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        for r in range(tile_a // epi):
                            for c in range(tile_b // epi):
                                slot = (r * (tile_b // epi) + c) % 2
                                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                                out_smem[wg, slot] = acc[r * epi:(r + 1) * epi, c * epi:(c + 1) * epi]
                                plgpu.commit_smem()
                                plgpu.copy_smem_to_gmem(
                                    out_smem.at[wg, slot],
                                    out_gmem.at[g, pl.ds(a_i * tile_a + r * epi, epi),
                                                pl.ds(b_i * cta_b + wg * tile_b + c * epi, epi)])

                get_pipeline(mma, compute_context, blocks)(
                    a_gmem.at[pl.ds(row0, m), pl.ds(a_i * tile_a, tile_a)],
                    b_gmem.at[pl.ds(row0, m), pl.ds(b_i * cta_b, cta_b)],
                    allocations=allocs)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    if num_sms is None:
        num_sms = jax.devices()[0].core_count
    mesh = dict(grid=(num_sms // cluster,), grid_names=(grid_axis,))
    if cluster > 1:
        mesh.update(cluster=(cluster,), cluster_names=("cluster",))
    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((e, na, nb), dtype),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret,
        **mesh,
    )
    return kernel(starts_e, ends_e, block_starts_e, blocks_e, a_ma, b_mb)


E, H, F = 48, 7168, 2048
# weight_grad_ws's tile options. The CTA's output tile is [tile_a, 2 * tile_b]; shared memory is
# steps x block_m x (tile_a + 2 tile_b) x 2 B plus 32 KB of epilogue slots (227 KB at most): at
# 128 / 128 / 64 rows, 4 steps are the most that fit. The first is the probe's first build (3.60 ms
# for the gate/up weight gradient at 32768 rows on an H100, 856d486); the cluster one last (not
# run in the interpreter, which takes one block).
CONFIGS = [dict(tile_a=128, tile_b=128, block_m=64, steps=4, cluster=1),
           dict(tile_a=128, tile_b=128, block_m=64, steps=4, cluster=2)]


def _float64_check(got_ekn, x_mk, dy_mn, sizes, experts) -> float:
    """Largest error of the given experts against float64, relative to each one's largest entry."""
    ends = np.cumsum(sizes)
    worst = 0.0
    for e in experts:
        lo, hi = ends[e] - sizes[e], ends[e]
        ref = np.asarray(x_mk[lo:hi], np.float64).T @ np.asarray(dy_mn[lo:hi], np.float64)
        got = np.asarray(got_ekn[e].astype(jnp.float32), np.float64)
        worst = max(worst, float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30)))
    return worst


def _nonfinite_isolation(sizes, config) -> bool:
    """A NaN in expert 1's first row of x and an inf in expert 0's last row of dy reach no other expert."""
    m, k, n = int(np.sum(sizes)), 256, 512
    ends = np.cumsum(sizes)
    x = np.random.default_rng(3).standard_normal((m, k)).astype(np.float32)
    dy = np.random.default_rng(4).standard_normal((m, n)).astype(np.float32)
    x[ends[0]] = np.nan
    dy[ends[0] - 1] = np.inf
    got = np.asarray(weight_grad_ws(jnp.asarray(x, jnp.bfloat16), jnp.asarray(dy, jnp.bfloat16),
                                    jnp.asarray(sizes, jnp.int32), **config).astype(jnp.float32))
    bad = [e for e in range(len(sizes)) if not np.isfinite(got[e]).all()]
    print("  non-finite experts:", bad, config, flush=True)
    return bad == [0, 1] if sizes[0] and sizes[1] else False


def main() -> None:
    import torch  # noqa: PLC0415

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu  # noqa: PLC0415

    from pallas_kernels.grouped_matmul import grouped_matmul_weight_grad, triton_weight_grad  # noqa: PLC0415
    from weight_grad_sweep import median_ms  # noqa: PLC0415 (beside this script)

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="JSON file to write")
    parser.add_argument("--rows", type=int, nargs="+", default=[32768, 8192])
    args = parser.parse_args()
    print(jax.devices()[0].device_kind, flush=True)
    rng = np.random.default_rng(0)
    results = dict(device=jax.devices()[0].device_kind, rows=[])
    isolation_sizes = rng.multinomial(4096, np.full(E, 1 / E))
    results["nonfinite_isolated"] = []
    for c in CONFIGS:
        try:
            results["nonfinite_isolated"].append(dict(config=c, isolated=_nonfinite_isolation(isolation_sizes, c)))
        except Exception as ex:  # noqa: BLE001 -- recorded, never hidden
            results["nonfinite_isolated"].append(dict(config=c, error=str(ex)[:300]))
            print("  isolation", c, "EXC", str(ex)[:300], flush=True)
    for m in args.rows:
        sizes = rng.multinomial(m, np.full(E, 1 / E))
        gs = jnp.asarray(sizes, jnp.int32)
        offs = torch.as_tensor(np.cumsum(sizes).astype(np.int32), device="cuda")
        for proj, (k, n) in {"gate_up": (H, 2 * F), "down": (F, H)}.items():
            x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
            dy = jax.random.normal(jax.random.key(2), (m, n), jnp.bfloat16)
            tx, tdy = torch.from_dlpack(x), torch.from_dlpack(dy)
            ref = grouped_matmul_weight_grad(x, dy, gs, compute_capability=90, out_dtype=jnp.float32)
            xh, dyh = np.asarray(x), np.asarray(dy)
            flops = 2 * m * n * k
            # Functions of (x, dy, group sizes), each jitted with them as arguments: called eagerly, a
            # Mosaic GPU kernel built inside a function is traced and compiled at every call (~1 s),
            # and arrays closed over would be baked into the program as constants.
            cands = {
                "dense cuBLAS (dy^T x, same FLOPs)": lambda x, dy, gs: jnp.dot(
                    dy.T, x, preferred_element_type=jnp.float32).astype(jnp.bfloat16),
                "ours native (triton_weight_grad)": lambda x, dy, gs: triton_weight_grad.weight_grad(
                    x, dy, gs, compute_capability=90, out_dtype=jnp.bfloat16),
                "ours pallas": lambda x, dy, gs: grouped_matmul_weight_grad(
                    x, dy, gs, compute_capability=90, out_dtype=jnp.bfloat16),
                "jax transposed_ragged_dot_mgpu": lambda x, dy, gs: transposed_ragged_dot_mgpu.transposed_ragged_dot(
                    dy, x, group_sizes=gs, block_m=128, block_n=128, block_k=64,
                    max_concurrent_steps=4, grid_block_n=8),
            }
            for c in CONFIGS:
                cands["ws mosaic " + " ".join(f"{k}={v}" for k, v in c.items())] = (
                    lambda x, dy, gs, c=c: weight_grad_ws(dy, x, gs, **c))
            row = dict(m=m, proj=proj, k=k, n=n)
            try:
                row["torch._grouped_mm"] = median_ms(
                    lambda: (torch._grouped_mm(tdy.t(), tx, offs=offs), torch.cuda.synchronize()),  # noqa: B023
                    warmups=2)
                print(m, proj, "torch._grouped_mm", f"{row['torch._grouped_mm']:.3f} ms "
                      f"{flops / row['torch._grouped_mm'] / 1e9:.0f} TFLOP/s", flush=True)
            except Exception as ex:  # noqa: BLE001 -- recorded, never hidden
                row["torch._grouped_mm"] = f"error: {str(ex)[:200]}"
            for name, f in cands.items():
                try:
                    jf = jax.jit(f)
                    got = jf(x, dy, gs)
                    if not name.startswith("dense"):
                        err = float(jnp.linalg.norm(got.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
                        f64 = _float64_check(got, dyh, xh, sizes, [0, E - 1])
                        if not (err < 1e-2 and f64 < 1e-2):
                            raise AssertionError(f"relative error {err:.3g} (Pallas), {f64:.3g} (float64)")
                    del got
                    ms = median_ms(lambda: jf(x, dy, gs).block_until_ready(), warmups=2)  # noqa: B023
                    row[name] = ms
                    print(m, proj, name, f"{ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
                except Exception as ex:  # noqa: BLE001 -- recorded, never hidden
                    row[name] = f"error: {str(ex)[:300]}"
                    print(m, proj, name, "EXC", str(ex)[:300], flush=True)
            results["rows"].append(row)
            del x, dy, tx, tdy, ref
            with open(args.out, "w") as fh:
                json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
