"""Probe: the native weight gradient with Triton's warp-specialized row loop (one GPU; not a library path).

``triton_weight_grad`` has no warp-specialized row loop: with Triton 3.6 on an H100 it failed
with an illegal instruction through ``triton_launch.call`` (results/weight_grad_h100/0d0c3dd/),
and through Triton's own launcher with wrong output (the kernel's per-tile schedule, 3.15 ms
against 3.75 unspecialized) or an illegal memory access (the per-expert schedule the library
has now; results/weight_grad_h100/0d0c3dd_schedules/, from c1ab555's schedule probe). This
probe keeps that test for a later Triton: the library kernel's source with
``tl.range(warp_specialize=WARP_SPECIALIZE)``, launched by Triton's own launcher on torch
tensors beside the library kernel (the control), gate/up at Kimi K2's shape, 48 experts; error
against float32 for three experts, then the median of 10 timed launches (CUDA events).

    python benchmarks/weight_grad_ws_probe.py OUT.json [--rows 32768]

Run it in its own process: a failed launch loses the CUDA context.
"""
import argparse
import json
import sys

import numpy as np
import triton
import triton.language as tl

sys.path.insert(0, ".")
from pallas_kernels.grouped_matmul import triton_weight_grad  # noqa: E402

E, H, F = 48, 7168, 2048


@triton.jit
def _warp_specialized_kernel(starts_ptr, ends_ptr, x_ptr, dy_ptr, out_in_ptr, out_ptr, K: tl.constexpr,
                             N: tl.constexpr, NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                             WARP_SPECIALIZE: tl.constexpr):
    """``triton_weight_grad._kernel`` with the row loop's ``warp_specialize`` as a constexpr."""
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="JSON file to write (rewritten after every launch)")
    parser.add_argument("--rows", type=int, default=32768)
    args = parser.parse_args()
    import torch  # noqa: PLC0415

    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    m, k, n = args.rows, H, 2 * F
    gen = torch.Generator(device="cuda").manual_seed(0)
    sizes = np.random.default_rng(0).multinomial(m, np.full(E, 1 / E))
    ends = torch.as_tensor(np.cumsum(sizes), dtype=torch.int32, device="cuda")
    starts = torch.cat([torch.zeros(1, dtype=torch.int32, device="cuda"), ends[:-1]])
    x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
    dy = torch.randn(m, n, generator=gen, device="cuda").to(torch.bfloat16)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    results = []
    for name, kernel, extra, warps in (("library", triton_weight_grad.kernel_function(), {}, 8),
                                       ("warp-specialized", _warp_specialized_kernel, {"WARP_SPECIALIZE": True}, 4)):
        out_enk = torch.full((E, n, k), float("nan"), dtype=torch.bfloat16, device="cuda")
        consts = dict(K=k, N=n, NUM_EXPERTS=E, BLOCK_M=64, BLOCK_N=128, BLOCK_K=256, NUM_STAGES=4, **extra)

        def launch():
            kernel[(programs,)](starts, ends, x, dy, out_enk, out_enk, **consts,  # noqa: B023
                                num_warps=warps, num_stages=4)  # noqa: B023
        row = dict(kernel=name, tile=(64, 128, 256, warps, 4), m=m, proj="gate_up")
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
        except Exception as e:  # noqa: BLE001 -- recorded, never hidden
            row["error"] = str(e)[:300]
        results.append(row)
        print(row, flush=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
        if "error" in row:
            break  # the CUDA context is gone


if __name__ == "__main__":
    main()
