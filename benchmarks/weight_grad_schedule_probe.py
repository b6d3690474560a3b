"""Probe: where the native weight gradient's time goes, by schedule (one GPU; not a library path).

At 0d0c3dd on an H100 the native weight gradient (``triton_weight_grad``, rows by TMA) was no
faster than the Pallas kernel (gate/up 4.29-4.46 against 4.23 ms at 48 experts x 32768 rows,
``benchmarks/results/weight_grad_h100/0d0c3dd/``). Nsight Compute showed two things the Pallas
kernel does not have: 2.7 GB read from DRAM where the Pallas kernel reads 0.79 (the inputs once:
0.74), and ``barrier`` as the top stall (two device-side descriptors made per output tile, each
with CTA barriers and a fence through global memory). Two hypotheses, one kernel each:

* ``hoisted``: the library's schedule (one program per SM, tiles ``p, p + P, ...``) with the
  descriptors made once per expert a program visits, not once per tile: the descriptors' cost.
* ``chunked``: no persistent loop; one program per ``CHUNK`` consecutive output tiles of one
  expert, the hardware handing out programs in order as SMs free up (as the Pallas kernel's
  grid): whether persistent programs drifting apart lose the L2 reuse of an expert's rows.

Beside them in the same run: the library kernel (``strided``), the Pallas table tile and
``torch._grouped_mm``. Each candidate's output is checked against the Pallas kernel's float32
one (relative Frobenius error < 1e-2) before it is timed.

``--triton-launcher``: the warp-specialized row loop, which failed with an illegal instruction
through ``triton_launch.call``, launched by Triton's own launcher on torch tensors (its non-
specialized twin first, as the control), to tell the kernel from our launch path. Run it in its
own process: a failed launch loses the CUDA context.

    python benchmarks/weight_grad_schedule_probe.py OUT.json [--rows 32768 8192]
    python benchmarks/weight_grad_schedule_probe.py OUT.json --triton-launcher [--rows 32768]
    ncu --metrics dram__bytes_read.sum,gpu__time_duration.sum ... python benchmarks/weight_grad_schedule_probe.py OUT.json --once
"""
import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

sys.path.insert(0, ".")
from pallas_kernels.grouped_matmul import grouped_matmul_weight_grad, pallas_triton, triton_launch, triton_weight_grad  # noqa: E402
from pallas_kernels.grouped_matmul.tuning import TileConfig  # noqa: E402

E, H, F = 48, 7168, 2048
PROJECTIONS = {"gate_up": (H, 2 * F), "down": (F, H)}  # (k, n): x [M, k], dy [M, n]
#: (block_m, block_n, block_k, num_warps, num_stages): the library's table tile, and the one that
#: led the 0d0c3dd sweep on the down projection.
TILES = [(64, 128, 256, 8, 4), (32, 128, 256, 8, 6)]
POINTERS = (("starts_ptr", "*i32"), ("ends_ptr", "*i32"), ("x_ptr", "*bf16"), ("dy_ptr", "*bf16"),
            ("out_in_ptr", "*bf16"), ("out_ptr", "*bf16"))


@triton.jit
def _hoisted_kernel(starts_ptr, ends_ptr, x_ptr, dy_ptr, out_in_ptr, out_ptr, K: tl.constexpr, N: tl.constexpr,
                    NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    NUM_STAGES: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """The library kernel's tiles and order (tile ``t`` of program ``p`` when ``t = p mod P``),
    walked expert by expert so each program makes its two descriptors once per expert."""
    K_TILES: tl.constexpr = K // BLOCK_K
    PER_EXPERT: tl.constexpr = (N // BLOCK_N) * K_TILES
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    local_n = tl.arange(0, BLOCK_N)
    local_k = tl.arange(0, BLOCK_K)
    for expert in range(NUM_EXPERTS):
        start = tl.load(starts_ptr + expert)
        end = tl.load(ends_ptr + expert)
        rows = tl.maximum(end, 1)
        dy_desc = tl.make_tensor_descriptor(dy_ptr, shape=[rows, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N])
        x_desc = tl.make_tensor_descriptor(x_ptr, shape=[rows, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
        base = expert * PER_EXPERT
        first = (pid + programs - base % programs) % programs
        for local in range(first, PER_EXPERT, programs):
            n_start = (local // K_TILES) * BLOCK_N
            k_start = (local % K_TILES) * BLOCK_K
            acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
            for row in tl.range(start, end, BLOCK_M, num_stages=NUM_STAGES, warp_specialize=WARP_SPECIALIZE):
                acc = tl.dot(tl.trans(dy_desc.load([row, n_start])), x_desc.load([row, k_start]), acc)
            out_at = (out_ptr + tl.cast(expert, tl.int64) * (N * K)
                      + ((n_start + local_n)[:, None] * K + (k_start + local_k)[None, :]))
            tl.store(out_at, acc.to(out_ptr.dtype.element_ty))


@triton.jit
def _chunked_kernel(starts_ptr, ends_ptr, x_ptr, dy_ptr, out_in_ptr, out_ptr, K: tl.constexpr, N: tl.constexpr,
                    CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    NUM_STAGES: tl.constexpr):
    """Program ``p``: ``CHUNK`` consecutive output tiles (column tiles innermost) of expert
    ``p // ceil(PER_EXPERT / CHUNK)``, its descriptors made once."""
    K_TILES: tl.constexpr = K // BLOCK_K
    PER_EXPERT: tl.constexpr = (N // BLOCK_N) * K_TILES
    CHUNKS: tl.constexpr = (PER_EXPERT + CHUNK - 1) // CHUNK
    pid = tl.program_id(0)
    expert = pid // CHUNKS
    first = (pid % CHUNKS) * CHUNK
    start = tl.load(starts_ptr + expert)
    end = tl.load(ends_ptr + expert)
    rows = tl.maximum(end, 1)
    dy_desc = tl.make_tensor_descriptor(dy_ptr, shape=[rows, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N])
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[rows, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    local_n = tl.arange(0, BLOCK_N)
    local_k = tl.arange(0, BLOCK_K)
    for local in range(first, tl.minimum(first + CHUNK, PER_EXPERT)):
        n_start = (local // K_TILES) * BLOCK_N
        k_start = (local % K_TILES) * BLOCK_K
        acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
        for row in tl.range(start, end, BLOCK_M, num_stages=NUM_STAGES):
            acc = tl.dot(tl.trans(dy_desc.load([row, n_start])), x_desc.load([row, k_start]), acc)
        out_at = (out_ptr + expert.to(tl.int64) * (N * K)
                  + ((n_start + local_n)[:, None] * K + (k_start + local_k)[None, :]))
        tl.store(out_at, acc.to(out_ptr.dtype.element_ty))


def make_launch(schedule: str, tile, *, n: int, k: int, experts: int, programs: int, capability: int = 90):
    """The :class:`.triton_launch.Launch` of one candidate: ``hoisted``, ``chunkC`` (``C`` tiles
    per program) at ``tile`` = (block_m, block_n, block_k, num_warps, num_stages)."""
    bm, bn, bk, warps, stages = tile
    per_expert = (n // bn) * (k // bk)
    blocks = dict(K=k, N=n, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=stages)
    if schedule == "hoisted":
        kernel, constexprs = _hoisted_kernel, dict(blocks, NUM_EXPERTS=experts, WARP_SPECIALIZE=False)
        grid = min(programs, experts * per_expert)
    else:
        chunk = int(schedule.removeprefix("chunk"))
        kernel, constexprs = _chunked_kernel, dict(blocks, CHUNK=chunk)
        grid = experts * -(-per_expert // chunk)
    return triton_launch.Launch(kernel=kernel, signature=POINTERS, constexprs=tuple(constexprs.items()),
                                num_warps=warps, num_stages=stages, grid=grid, capability=capability,
                                name=f"wgrad_probe_{schedule}")


def runner(launch, *, experts: int, n: int, k: int):
    """``f(x_mk, dy_mn, group_sizes_e) -> [E, N, K]`` bf16 through :func:`.triton_launch.call`, jitted."""
    @jax.jit
    def f(x_mk, dy_mn, group_sizes_e):
        starts_e, ends_e = pallas_triton.group_bounds(group_sizes_e, num_rows=x_mk.shape[0])
        return triton_launch.call(launch, starts_e, ends_e, x_mk, dy_mn,
                                  out_shape=jax.ShapeDtypeStruct((experts, n, k), jnp.bfloat16))
    return f


def _median_ms(f) -> float:
    """Median wall time of 10 synchronized calls after two more."""
    f()
    f()
    ts = []
    for _ in range(10):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) * 1e3


def probe(out: str, rows: list[int]) -> None:
    import torch  # noqa: PLC0415

    rng = np.random.default_rng(0)
    programs = triton_weight_grad.sm_count()
    results = []

    def record(row):
        results.append(row)
        print(row["m"], row["proj"], row["kernel"], row.get("tile", ""),
              f"{row['ms']:.3f} ms {row['tflops']:.0f} TFLOP/s" if "ms" in row else row.get("error"), flush=True)
        with open(out, "w") as f:  # after every row: a cut-off run keeps what it measured
            json.dump(results, f, indent=1)

    for m in rows:
        gs = jnp.asarray(rng.multinomial(m, np.full(E, 1 / E)), jnp.int32)
        offs = torch.as_tensor(np.cumsum(np.asarray(gs)).astype(np.int32), device="cuda")
        for proj, (k, n) in PROJECTIONS.items():
            x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
            dy = jax.random.normal(jax.random.key(2), (m, n), jnp.bfloat16)
            tx, tdy = torch.from_dlpack(x), torch.from_dlpack(dy)
            flops = 2 * m * n * k
            ref = grouped_matmul_weight_grad(x, dy, gs, compute_capability=90, out_dtype=jnp.float32)
            candidates = [("pallas table", None, lambda: grouped_matmul_weight_grad(  # noqa: E731
                               x, dy, gs, compute_capability=90, out_dtype=jnp.bfloat16)),  # noqa: B023
                          ("torch", None, None)]
            for tile in TILES:
                cfg = TileConfig(block_m=tile[0], block_n=tile[1], block_k=tile[2], num_warps=tile[3],
                                 num_stages=tile[4], group_t=1)
                candidates.append(("strided", tile, lambda cfg=cfg: triton_weight_grad.weight_grad(  # noqa: E731
                    x, dy, gs, compute_capability=90, out_dtype=jnp.bfloat16, tile=cfg)))  # noqa: B023
                for schedule in ("hoisted", "chunk1", "chunk4"):
                    run = runner(make_launch(schedule, tile, n=n, k=k, experts=E, programs=programs),
                                 experts=E, n=n, k=k)
                    candidates.append((schedule, tile, lambda run=run: run(x, dy, gs)))  # noqa: B023
            for name, tile, f in candidates:
                row = dict(m=m, proj=proj, kernel=name, tile=tile)
                try:
                    if name == "torch":
                        ms = _median_ms(lambda: (torch._grouped_mm(tx.t(), tdy, offs=offs),  # noqa: B023
                                                 torch.cuda.synchronize()))
                    else:
                        got = f()
                        err = float(jnp.linalg.norm(got.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
                        del got
                        row["err"] = err
                        if not err < 1e-2:
                            raise AssertionError(f"relative error {err:.3g} against the Pallas kernel's float32")
                        ms = _median_ms(lambda: f().block_until_ready())  # noqa: B023
                    record(dict(row, ms=ms, tflops=flops / ms / 1e9))
                except Exception as e:  # noqa: BLE001 -- recorded, never hidden
                    record(dict(row, error=str(e)[:300]))
            del x, dy, tx, tdy, ref


def once(out: str, m: int) -> None:
    """Each schedule at the table tile, gate/up, called twice (the first compiles), for Nsight
    Compute (``--kernel-name regex:"^_kernel|wgrad_probe"``): the second launch of each is the one to read."""
    k, n = PROJECTIONS["gate_up"]
    gs = jnp.asarray(np.random.default_rng(0).multinomial(m, np.full(E, 1 / E)), jnp.int32)
    x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
    dy = jax.random.normal(jax.random.key(2), (m, n), jnp.bfloat16)
    cfg = TileConfig(block_m=TILES[0][0], block_n=TILES[0][1], block_k=TILES[0][2], num_warps=TILES[0][3],
                     num_stages=TILES[0][4], group_t=1)
    launches = []
    calls = [("strided", lambda: triton_weight_grad.weight_grad(x, dy, gs, compute_capability=90,
                                                                out_dtype=jnp.bfloat16, tile=cfg))]
    for schedule in ("hoisted", "chunk1", "chunk4"):
        run = runner(make_launch(schedule, TILES[0], n=n, k=k, experts=E, programs=triton_weight_grad.sm_count()),
                     experts=E, n=n, k=k)
        calls.append((schedule, lambda run=run: run(x, dy, gs)))
    for name, f in calls:
        for call in ("first", "measured"):
            f().block_until_ready()
            launches.append(dict(m=m, proj="gate_up", kernel=name, call=call))
            print(name, call, flush=True)
    with open(out, "w") as f:
        json.dump(launches, f, indent=1)


def triton_launcher(out: str, m: int = 32768) -> None:
    """The library kernel and the hoisted one, each plain and warp-specialized, through Triton's
    own launcher on torch tensors at the gate/up projection: error against float32 per expert,
    then the median of 10 timed launches (CUDA events)."""
    import torch  # noqa: PLC0415

    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    k, n = PROJECTIONS["gate_up"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    sizes = np.random.default_rng(0).multinomial(m, np.full(E, 1 / E))
    ends = torch.as_tensor(np.cumsum(sizes), dtype=torch.int32, device="cuda")
    starts = torch.cat([torch.zeros(1, dtype=torch.int32, device="cuda"), ends[:-1]])
    x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
    dy = torch.randn(m, n, generator=gen, device="cuda").to(torch.bfloat16)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    results = []
    for name, kernel, ws, tile in (("strided", triton_weight_grad.kernel_function(), False, (64, 128, 256, 8, 4)),
                                   ("hoisted", _hoisted_kernel, False, (64, 128, 256, 8, 4)),
                                   ("strided", triton_weight_grad.kernel_function(), True, (64, 128, 256, 4, 4)),
                                   ("hoisted", _hoisted_kernel, True, (64, 128, 256, 4, 4))):
        bm, bn, bk, warps, stages = tile
        programs = torch.cuda.get_device_properties(0).multi_processor_count
        out_enk = torch.full((E, n, k), float("nan"), dtype=torch.bfloat16, device="cuda")
        consts = dict(K=k, N=n, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=stages, WARP_SPECIALIZE=ws)
        if name == "strided":
            consts["NUM_TILES"] = E * (n // bn) * (k // bk)
        else:
            consts["NUM_EXPERTS"] = E

        def launch():
            kernel[(programs,)](starts, ends, x, dy, out_enk, out_enk, **consts,  # noqa: B023
                                num_warps=warps, num_stages=stages)  # noqa: B023
        row = dict(kernel=name, warp_specialize=ws, tile=tile, m=m, proj="gate_up")
        print("launching", row, flush=True)
        try:
            launch()
            torch.cuda.synchronize()
            errs = []
            for e in (0, E // 2, E - 1):
                want = dy[bounds[e]:bounds[e + 1]].float().T @ x[bounds[e]:bounds[e + 1]].float()
                errs.append(float((out_enk[e].float() - want).norm() / want.norm()))
            row["err"] = max(errs)
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(12)]
            for a, b in events:
                a.record()
                launch()
                b.record()
            torch.cuda.synchronize()
            row["ms"] = float(np.median([a.elapsed_time(b) for a, b in events[2:]]))
            row["tflops"] = 2 * m * n * k / row["ms"] / 1e9
        except Exception as e:  # noqa: BLE001 -- recorded, never hidden
            row["error"] = str(e)[:300]
        results.append(row)
        print(row, flush=True)
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
        if "error" in row:
            break  # the CUDA context is gone


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="JSON file to write (rewritten after every row)")
    parser.add_argument("--rows", type=int, nargs="+", default=[32768, 8192],
                        help="rows (48 experts); --triton-launcher takes the first")
    parser.add_argument("--triton-launcher", action="store_true",
                        help="the warp-specialized row loop through Triton's own launcher (torch tensors)")
    parser.add_argument("--once", action="store_true", help="each schedule launched twice, for Nsight Compute")
    args = parser.parse_args()
    if args.triton_launcher:
        return triton_launcher(args.out, args.rows[0])
    if args.once:
        return once(args.out, args.rows[0])
    return probe(args.out, args.rows)


if __name__ == "__main__":
    main()
