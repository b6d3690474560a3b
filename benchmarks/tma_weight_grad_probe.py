"""Probe: the bf16 weight gradient ``dW_e = dy_e^T x_e`` with its rows loaded by TMA, timed against
our two kernels and ``torch._grouped_mm`` in the same run (nothing dispatches to it).

Why. At the training shape (48 experts x 32768 rows) torch's weight gradients reach 570-594
TFLOP/s and ours 495-512 (``results/train_step_h100/``), and the persistent native kernel showed
that fixed per-tile costs are not the gap: the steady-state loop is. Ours loads rows with
``cp.async`` (per-thread addresses, a CTA barrier every row step); CUTLASS's, torch's, with TMA.
Here each output tile makes two device-side tensor descriptors bounded at its expert's last row,
so TMA fills the rows past it with zeros: no masks, and no row of another expert is ever read
(a non-finite token cannot reach another expert's gradient). The descriptors cannot be made
inside a pipelined loop (Triton 3.6: "pipeliner doesn't know how to predicate"), so the tiles
are an outer loop of a persistent program and the row steps its inner, pipelined loop.
Optionally the inner loop is warp-specialized (``tl.range(warp_specialize=True)``: a producer
warp group issuing the TMA copies, two consumer warp groups; needs ``num_warps=4``, launched as
12).

jax-triton 0.3.1 can launch neither (it passes no global scratch, where device-side descriptors
live, and launches with the call's warps, not the specialized 12), so the probe has its own
primitive around jaxlib's ``triton_kernel_call`` (as the removed Gluon probes had, b4fa5fd).

    python benchmarks/tma_weight_grad_probe.py --out OUT                # check, then time
    python benchmarks/tma_weight_grad_probe.py --out OUT --once         # one launch each, for ncu

Each candidate is checked first: against the Pallas kernel's float32 output on the timed shapes
(relative Frobenius error), and against float64 on the host for irregular routing at 384 experts
(experts of 0, 1, 63-65, 127-129 rows and the highest ids), NaN-poisoned rows outside every
expert's, and non-finite rows in one expert that must not reach any other. One that fails is
not timed.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl
from jax.extend.core import Primitive
from jax.interpreters import mlir

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pallas_kernels.grouped_matmul import grouped_matmul_weight_grad, pallas_triton, triton_weight_grad  # noqa: E402

E, H, F = 48, 7168, 2048


@triton.jit
def _kernel(starts_ptr, ends_ptr, x_ptr, dy_ptr, out_ptr, K: tl.constexpr, N: tl.constexpr, NUM_TILES: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
            WS: tl.constexpr):
    """Program ``p`` takes output tiles ``p, p + P, ...`` (expert-major, column tiles innermost),
    each over its expert's rows ``[starts[e], ends[e])`` in steps of ``BLOCK_M``; ``out_ptr`` bf16
    ``[E, N, K]``, every element written (an expert without rows gets zeros)."""
    K_TILES: tl.constexpr = K // BLOCK_K
    PER_EXPERT: tl.constexpr = (N // BLOCK_N) * K_TILES
    local_n = tl.arange(0, BLOCK_N)
    local_k = tl.arange(0, BLOCK_K)
    for tile in range(tl.program_id(0), NUM_TILES, tl.num_programs(0)):
        expert = tile // PER_EXPERT
        n_start = ((tile % PER_EXPERT) // K_TILES) * BLOCK_N
        k_start = (tile % K_TILES) * BLOCK_K
        start = tl.load(starts_ptr + expert)
        end = tl.load(ends_ptr + expert)
        # Bounded at the expert's last row: TMA reads zeros past it. At least one row, as a
        # descriptor needs (an expert without rows runs no step).
        rows = tl.maximum(end, 1)
        dy_desc = tl.make_tensor_descriptor(dy_ptr, shape=[rows, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N])
        x_desc = tl.make_tensor_descriptor(x_ptr, shape=[rows, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
        acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
        for row in tl.range(start, end, BLOCK_M, num_stages=NUM_STAGES, warp_specialize=WS):
            dy_mn = dy_desc.load([row, n_start])
            x_mk = x_desc.load([row, k_start])
            acc = tl.dot(tl.trans(dy_mn), x_mk, acc)
        out_at = (out_ptr + expert.to(tl.int64) * (N * K)
                  + ((n_start + local_n)[:, None] * K + (k_start + local_k)[None, :]))
        tl.store(out_at, acc.to(out_ptr.dtype.element_ty))


@dataclasses.dataclass(frozen=True)
class Spec:
    num_experts: int
    n: int
    k: int
    block_m: int = 64
    block_n: int = 128
    block_k: int = 256
    num_warps: int = 8
    num_stages: int = 4
    ws: bool = False
    num_programs: int = 132

    @property
    def num_tiles(self) -> int:
        return self.num_experts * (self.n // self.block_n) * (self.k // self.block_k)

    def constexprs(self) -> dict:
        return dict(K=self.k, N=self.n, NUM_TILES=self.num_tiles, BLOCK_M=self.block_m, BLOCK_N=self.block_n,
                    BLOCK_K=self.block_k, NUM_STAGES=self.num_stages, WS=self.ws)

    @property
    def label(self) -> str:
        return (f"tma {self.block_m}x{self.block_n}x{self.block_k} w{self.num_warps} s{self.num_stages}"
                + (" ws" if self.ws else ""))


_POINTERS = {"starts_ptr": "*i32", "ends_ptr": "*i32", "x_ptr": "*bf16", "dy_ptr": "*bf16", "out_ptr": "*bf16"}


@functools.cache
def compile_kernel(spec: Spec, capability: int = 90):
    """``triton.compile`` of the kernel for ``capability`` (no GPU needed)."""
    from triton.compiler import ASTSource  # noqa: PLC0415

    from pallas_kernels.crosscompile import triton_compile  # noqa: PLC0415

    constexprs = spec.constexprs()
    signature = {**_POINTERS, **{name: "constexpr" for name in constexprs}}
    aligned = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(_kernel.arg_names) if arg in _POINTERS}
    source = ASTSource(fn=_kernel, signature=signature, attrs=aligned,
                       constexprs={(_kernel.arg_names.index(a),): v for a, v in constexprs.items()})
    return triton_compile(source, capability, {"num_warps": spec.num_warps, "num_stages": spec.num_stages})


_call_p = Primitive("moe_jax_tma_weight_grad_probe")
_call_p.multiple_results = True


def _scratch_bytes(spec: Spec) -> int:
    """Triton's global scratch (the device-side descriptors): its size per program, for all of them."""
    meta = compile_kernel(spec).metadata
    return max(1, int(meta.global_scratch_size) * spec.num_programs)


@_call_p.def_abstract_eval
def _abstract(*avals, spec: Spec):
    del avals
    return (jax.core.ShapedArray((spec.num_experts, spec.n, spec.k), jnp.bfloat16),
            jax.core.ShapedArray((_scratch_bytes(spec),), jnp.uint8))


def _lowering(ctx, *args, spec: Spec):
    from jax._src.lib import gpu_triton  # noqa: PLC0415 (CUDA plugin only)

    kernel = compile_kernel(spec)
    meta = kernel.metadata
    # The block is the kernel's warps after warp specialization, not the warps it was written for.
    tk = gpu_triton.TritonKernel(meta.name, int(meta.num_warps), 1, int(meta.shared), kernel.asm["ptx"], "", 90)
    # Operands, the output, then the scratch output in the kernel's global-scratch slot (jaxlib
    # appends null pointers for the slots after it).
    params = [gpu_triton.create_array_parameter(0, 16) for _ in range(len(_POINTERS))]
    params.append(gpu_triton.create_array_parameter(0, int(meta.global_scratch_align) if meta.global_scratch_size
                                                    else 0))
    call = gpu_triton.TritonKernelCall(tk, spec.num_programs, 1, 1, params)
    proto = call.to_proto(f"tma_weight_grad_{spec.label}", b"")
    rule = jax.ffi.ffi_lowering("triton_kernel_call", api_version=2, backend_config=zlib.compress(proto))
    return rule(ctx, *args)


mlir.register_lowering(_call_p, _lowering, platform="cuda")


@functools.partial(jax.jit, static_argnums=(0,))
def launch(spec: Spec, x_mk, dy_mn, group_sizes_e):
    """bf16 ``[E, N, K]``: per expert ``dy_e^T x_e`` over its rows."""
    starts_e, ends_e = pallas_triton.group_bounds(group_sizes_e, num_rows=x_mk.shape[0])
    dw, _ = _call_p.bind(starts_e, ends_e, x_mk, dy_mn, spec=spec)
    return dw


CANDIDATES = [Spec(0, 0, 0), Spec(0, 0, 0, num_stages=3), Spec(0, 0, 0, block_m=32, num_stages=6),
              Spec(0, 0, 0, num_warps=4, num_stages=4, ws=True), Spec(0, 0, 0, num_warps=4, num_stages=3, ws=True),
              Spec(0, 0, 0, block_n=128, block_k=128, num_stages=5),
              Spec(0, 0, 0, block_n=256, block_k=128, num_stages=4)]


def for_shape(c: Spec, e: int, n: int, k: int, programs: int) -> Spec:
    return dataclasses.replace(c, num_experts=e, n=n, k=k, num_programs=programs)


def sm_count() -> int:
    return triton_weight_grad.sm_count()


def check_edges(c: Spec, out: list) -> bool:
    """Irregular routing at 384 experts against float64 on the host, with non-finite rows."""
    e, m, n, k = 384, 4096, 256, 512
    rng = np.random.default_rng(3)
    sizes = np.zeros(e, np.int64)
    special = {0: 0, 1: 1, 2: 63, 3: 64, 4: 65, 5: 127, 6: 128, 7: 129, 381: 0, 382: 65, 383: 200}
    for i, s in special.items():
        sizes[i] = s
    rest = m - 300 - sizes.sum()  # 300 padding rows past the last expert
    free = [i for i in range(e) if i not in special]
    sizes[free] = rng.multinomial(rest, np.full(len(free), 1 / len(free)))
    x = rng.standard_normal((m, k)).astype(np.float32)
    dy = rng.standard_normal((m, n)).astype(np.float32)
    ends = np.cumsum(sizes)
    x[ends[-1]:] = np.nan  # padding rows: never read
    dy[ends[-1]:] = np.nan
    bad = int(ends[9] - 3)  # a non-finite value in one of expert 9's last rows: no other expert sees it
    x[bad, 5] = np.inf
    spec = for_shape(c, e, n, k, sm_count())
    spec = dataclasses.replace(spec, block_n=min(spec.block_n, n), block_k=min(spec.block_k, k))
    xb, dyb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(dy, jnp.bfloat16)
    got = np.asarray(launch(spec, xb, dyb, jnp.asarray(sizes, jnp.int32)).astype(jnp.float32))
    x64, dy64 = np.asarray(xb.astype(jnp.float32), np.float64), np.asarray(dyb.astype(jnp.float32), np.float64)
    worst, wrong = 0.0, []
    starts = ends - sizes
    for i in range(e):
        ref = dy64[starts[i]:ends[i]].T @ x64[starts[i]:ends[i]]
        if i == 9:
            finite = np.isfinite(ref)
            ok = np.array_equal(np.isfinite(got[i]), finite)
            if not ok:
                wrong.append(i)
            continue
        if not np.all(np.isfinite(got[i])):
            wrong.append(i)
            continue
        err = np.max(np.abs(got[i] - ref)) / max(np.max(np.abs(ref)), 1.0)
        worst = max(worst, err)
        if err > 1e-2:
            wrong.append(i)
    out.append(dict(check="edges_384", spec=spec.label, worst_rel=worst, wrong_experts=wrong[:20]))
    print("edges", spec.label, f"worst {worst:.2e}", "wrong", wrong[:20], flush=True)
    return not wrong


def timed(f, iters: int = 10) -> float:
    f()
    f()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--once", action="store_true")
    parser.add_argument("--rows", type=int, nargs="+", default=[32768, 8192])
    parser.add_argument("--budget-s", type=float, default=200)
    args = parser.parse_args()
    import torch  # noqa: PLC0415

    os.makedirs(args.out, exist_ok=True)
    t_start = time.time()
    rows_out: list = []
    programs = sm_count()
    good = []
    for c in CANDIDATES:
        try:
            ok = check_edges(c, rows_out)
        except Exception as exc:  # noqa: BLE001 -- recorded, never hidden
            rows_out.append(dict(check="edges_384", spec=c.label, error=str(exc)[:400]))
            print("edges", c.label, "EXC", str(exc)[:300], flush=True)
            ok = False
        if ok:
            good.append(c)
    for m in ([32768] if args.once else args.rows):
        gs = jnp.asarray(np.random.default_rng(0).multinomial(m, np.full(E, 1 / E)), jnp.int32)
        offs = torch.as_tensor(np.cumsum(np.asarray(gs)).astype(np.int32), device="cuda")
        for proj, (k, n) in {"gate_up": (H, 2 * F), "down": (F, H)}.items():
            x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
            dy = jax.random.normal(jax.random.key(2), (m, n), jnp.bfloat16)
            tx, tdy = (torch.from_dlpack(a) for a in (x, dy))
            ref = grouped_matmul_weight_grad(x, dy, gs, compute_capability=90, out_dtype=jnp.float32)
            impls = {
                "pallas": lambda: grouped_matmul_weight_grad(x, dy, gs, compute_capability=90,  # noqa: B023
                                                             out_dtype=jnp.bfloat16).block_until_ready(),
                "native": lambda: triton_weight_grad.weight_grad(x, dy, gs, compute_capability=90,  # noqa: B023
                                                                 out_dtype=jnp.bfloat16).block_until_ready(),
                "torch": lambda: (torch._grouped_mm(tx.t(), tdy, offs=offs), torch.cuda.synchronize()),  # noqa: B023
            }
            specs = {c.label: for_shape(c, E, n, k, programs) for c in good}
            for label, spec in specs.items():
                impls[label] = functools.partial(lambda s: launch(s, x, dy, gs).block_until_ready(), spec)  # noqa: B023
            for name, f in impls.items():
                if not args.once and time.time() - t_start > args.budget_s:
                    print("budget spent: stop", flush=True)
                    break
                try:
                    if name in specs:
                        got = launch(specs[name], x, dy, gs)
                        err = float(jnp.linalg.norm(got.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
                        del got
                        if not err < 1e-2:
                            raise AssertionError(f"relative error {err:.3g} against the Pallas kernel's float32")
                    if args.once:
                        f()
                        f()
                        rows_out.append(dict(m=m, proj=proj, kernel=name, launches=2))
                        print(proj, name, "launched twice", flush=True)
                        continue
                    ms = timed(f)
                    tf = 2 * m * n * k / ms / 1e9
                    rows_out.append(dict(m=m, proj=proj, kernel=name, ms=ms, tflops=tf))
                    print(m, proj, f"{name:34s} {ms:8.3f} ms {tf:6.0f} TFLOP/s", flush=True)
                except Exception as exc:  # noqa: BLE001 -- recorded, never hidden
                    rows_out.append(dict(m=m, proj=proj, kernel=name, error=str(exc)[:400]))
                    print(m, proj, name, "EXC", str(exc)[:300], flush=True)
            del x, dy, tx, tdy, ref
    with open(os.path.join(args.out, "tma_weight_grad_probe.json"), "w") as fh:
        json.dump(dict(device=jax.devices()[0].device_kind, commit=os.environ.get("GIT_COMMIT", "unknown"),
                       command=" ".join(sys.argv), rows=rows_out), fh, indent=1)


if __name__ == "__main__":
    main()
