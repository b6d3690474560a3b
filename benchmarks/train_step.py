"""The MoE training step (forward + backward) on one GPU, and the layer with expert parallelism.

Times, at Kimi K2 shapes with 48 local experts (EP 8 of 384; ``--experts 384`` for all of them
on one GPU; hidden 7168, expert intermediate 2048) and M rows after routing (``--rows``, default
8192 and 32768):

* **step**: the routed experts' MLP (gate/up, SwiGLU, down) forward and backward through
  ``moe_jax.expert_gemm.EXPERT_GEMM[...].run``: ``jax.vjp`` with a fixed cotangent ``dy``, grads
  with respect to ``x`` and the bf16 weights, for ``pallas`` (the kernels' ``custom_vjp``) and
  ``xla`` (the reference path); with ``--nvfp4`` also NVFP4 frozen weights (grads w.r.t. ``x``
  only); and the torch peer: ``torch._grouped_mm`` forward and autograd backward of the same
  SwiGLU MLP on the same bf16 weights and group offsets (torch's own derivative formulas, which
  are ``_grouped_mm`` calls on transposed operands; NVFP4 configurations give torch the
  dequantized weights in bf16, dX only);
* **dense anchor** (``anchors`` in the JSON): the step's FLOPs as plain XLA matmuls (cuBLAS),
  the expert MLP for one dense expert that gets all M rows (``[M, H] x [H, 2F]``, SwiGLU,
  ``[M, F] x [F, H]``, bf16 operands, float32 accumulation) and its VJP, grads with respect to
  ``x`` and both weights (beside the bf16 rows) or ``x`` only (beside the frozen NVFP4 rows),
  once per rows and gradients, timed as the JAX rows; each step row's ``of_anchor`` is its
  TFLOP/s over its anchor's (issue 31's "dense cuBLAS on the same FLOPs, in the same run");
* **gemm**: each grouped GEMM alone, both projections (gate_up N=2F=4096 K=H=7168; down
  N=H=7168 K=F=2048): the forward ``grouped_matmul``, its ``grouped_matmul_input_grad`` (dX)
  and ``grouped_matmul_weight_grad`` (dW, bf16 out), and torch's ``_grouped_mm`` doing the same
  three products; TFLOP/s at ``2 M N K`` each and backward over forward;
* **layer** (``--layer``): ``moe_jax.moe_forward`` + its VJP under ``jax.jit`` (router,
  exchange, experts, shared expert), ``pallas``, ``triton`` (on GPUs) and ``xla``, for each
  ``--ep`` size over that many local GPUs (``M`` rows per device: ``ep * M / top_k`` tokens);
  bf16 experts trained, or with ``--layer-weights nvfp4`` frozen NVFP4 experts (routed and
  shared; gradients for ``x`` and the router).

Routing: multinomial group sizes summing to M over the local experts, uniform (and Zipf with
``--skewed``, as ``grouped_gemm.py``), fixed seed.

Correctness, once per configuration and before it is timed: every step and GEMM is compared
with an independent dense reference (each expert's rows gathered into a zero-padded
``[E, max rows, .]`` block, batched ``einsum``; fp32 accumulation; the GEMM references in fp32
with exactly dequantized NVFP4), and ``pallas`` steps also with ``xla``'s gradients where
``xla`` ran. The error is the largest relative Frobenius norm over the outputs (y, dX, each
dW). Above ``--max-err`` (or not finite) the implementation gets no time: its row records why.

Timing: JAX with ``expert_parallel.timed`` (compiled once, two warm-up calls, then the median
of ``--windows`` windows of ``--iters`` back-to-back calls, each window blocked on once; wall
time over calls); torch with ``grouped_gemm.time_torch`` (CUDA events, median of
``--torch-runs`` calls after a warm-up). CUPTI (``grouped_gemm.time_jax``) is not used: it keeps
every call's outputs alive until the end, and dW outputs are GBs.

Order: every configuration's dense anchor (where its rows and gradients have none yet), then
its ``pallas`` and torch rows (the step, then its GEMMs), first; then the ``xla`` steps (the
reference: until ``moe_jax.expert_gemm.grouped_matmul`` replaced
``ragged_dot``, which XLA expanded densely over the experts, about 0.5 s a step at 32768 rows;
``--xla-rows`` limits them), then
the layer. ``--budget-s`` starts nothing new past its time and records what it skipped.

Provenance: device, command, commit (``--commit``, else ``$GIT_COMMIT``, else ``git
rev-parse``; the GPU machine's copy has no ``.git``), versions. Writes ``train_step.json``,
``train_step.md`` (rendered from the JSON by :func:`markdown`, after every configuration, so a
run cut short keeps what it measured) and ``train_step.png`` under ``--out``.

Usage::

    python benchmarks/train_step.py --out DIR                       # 1 GPU, bf16, 8192 and 32768 rows
    python benchmarks/train_step.py --out DIR --nvfp4 --skewed       # + NVFP4 frozen weights, Zipf routing
    python benchmarks/train_step.py --out DIR --layer --ep 1 2       # + the layer step, EP over 2 GPUs
    python benchmarks/train_step.py --out DIR --layer --layer-weights bf16 nvfp4 --skip-bf16-steps  # layers only
    python benchmarks/train_step.py --smoke --out DIR                # CPU, tiny shapes, interpreted kernels
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import itertools
import json
import math
import os
import pathlib
import platform
import shlex
import subprocess
import sys
import time
import traceback

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))
# torch's rows run in this process beside JAX's: JAX's default (75% of the GPU taken at start) left
# torch 3.8 GB of an 80 GB H100, and its step ran out of memory (2f15176). Recorded in the meta's env.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import expert_parallel  # noqa: E402  (timed)
import grouped_gemm  # noqa: E402  (group_sizes, time_torch, capability, _torch_available)

KIMI = {"experts": 48, "hidden": 7168, "intermediate": 2048, "top_k": 8}
SMOKE = {"experts": 4, "hidden": 128, "intermediate": 64, "top_k": 2}
ROWS = (8192, 32768)
ROUTINGS = ("uniform", "zipf")
SMOKE_ROWS = (64,)
MAX_ERR = 2e-2
BACKWARD_GOAL = 0.9  # backward GEMM TFLOP/s over the forward kernel's
TORCH_GOAL = 1.0  # torch's step time over ours: faster than torch (issue "Prefill and training ...")
ANCHOR_GOAL = 0.75  # the full bf16 step's TFLOP/s over the dense anchor's on the same FLOPs
GEMM_OPS = ("forward", "input_grad", "weight_grad")
KERNEL_NAMES = {"forward": "grouped_matmul", "input_grad": "grouped_matmul_input_grad",
                "weight_grad": "grouped_matmul_weight_grad"}
HIGHEST = jax.lax.Precision.HIGHEST
PROFILE_TOP = 12  # kernels listed per profiled step (--profile); the rest summed


def projections(shape: dict) -> dict:
    """name -> (N, K) of the forward GEMM ``[M, K] x [E, N, K]^T``."""
    h, f = shape["hidden"], shape["intermediate"]
    return {"gate_up": (2 * f, h), "down": (h, f)}


# --- inputs -----------------------------------------------------------------------------------


def make_weights(shape: dict, fmt: str, seed: int) -> dict:
    """``{"w_gate_up_egh": [E, 2F, H], "w_down_ehf": [E, H, F]}``: fan-in scaled bf16 normals,
    or NVFP4 drawn in the stored format (:func:`moe_jax.nvfp4.random`)."""
    from moe_jax import nvfp4  # noqa: PLC0415

    e, h, f = shape["experts"], shape["hidden"], shape["intermediate"]
    out = {}
    for i, (name, dims) in enumerate((("w_gate_up_egh", (e, 2 * f, h)), ("w_down_ehf", (e, h, f)))):
        key = jax.random.key(1000 * seed + i)
        if fmt == "bf16":
            out[name] = (jax.random.normal(key, dims, jnp.float32) / math.sqrt(dims[-1])).astype(jnp.bfloat16)
        else:
            out[name] = nvfp4.random(key, dims)
    return jax.block_until_ready(out)


def dense_bf16(w):
    """A bf16 array as is; NVFP4 dequantized exactly and rounded to bf16 (what ``xla`` runs)."""
    from moe_jax.expert_gemm import dense_weight  # noqa: PLC0415

    return dense_weight(w, jnp.bfloat16)


def dense_f32(w):
    from moe_jax.expert_gemm import dense_weight  # noqa: PLC0415

    return dense_weight(w, jnp.float32)


@dataclasses.dataclass
class Case:
    rows: int
    fmt: str  # "bf16" or "nvfp4"
    routing: str
    sizes: np.ndarray
    x: jax.Array  # [M, H] bf16
    dy: jax.Array  # [M, H] bf16, the cotangent of y
    weights: dict
    layout: dict  # padded-reference gather indices (device arrays)

    @property
    def tag(self) -> str:
        return f"{self.fmt} {self.routing} M={self.rows}"

    @property
    def keys(self) -> dict:
        return {"weights": self.fmt, "routing": self.routing, "rows": self.rows,
                "active_experts": int(np.count_nonzero(self.sizes)), "max_group": int(self.sizes.max())}


def padded_layout(sizes: np.ndarray) -> dict:
    """Gather indices that put each expert's rows in a zero-padded ``[E, C]`` block
    (``C`` = the largest group) and take them back out, for the dense references."""
    e = len(sizes)
    cap = max(1, int(sizes.max()))
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    slot = np.arange(cap)
    mask = slot[None, :] < sizes[:, None]
    index = np.where(mask, starts[:, None] + slot[None, :], 0)
    expert_of_row = np.repeat(np.arange(e), sizes)
    slot_of_row = np.arange(int(sizes.sum())) - starts[expert_of_row]
    return {"index": jnp.asarray(index, jnp.int32), "mask": jnp.asarray(mask),
            "expert_of_row": jnp.asarray(expert_of_row, jnp.int32), "slot_of_row": jnp.asarray(slot_of_row, jnp.int32)}


def to_padded(a_m, layout):
    return jnp.where(layout["mask"][..., None], a_m[layout["index"]], jnp.zeros((), a_m.dtype))


def from_padded(a_ec, layout):
    return a_ec[layout["expert_of_row"], layout["slot_of_row"]]


# --- the functions timed ----------------------------------------------------------------------


def vjp_step(apply, wrt_weights: bool):
    """``step(x, weights, aux, dy)``: y and its VJP at ``dy`` (dX, and dW of both projections
    when ``wrt_weights``) of ``apply(x, weights, aux) -> y``."""
    def step(x, weights, aux, dy):
        if wrt_weights:
            y, pull = jax.vjp(lambda x, w: apply(x, w, aux), x, weights)
            dx, dw = pull(dy)
            return {"y": y, "dx": dx, "dw_gate_up": dw["w_gate_up_egh"], "dw_down": dw["w_down_ehf"]}
        y, pull = jax.vjp(lambda x: apply(x, weights, aux), x)
        (dx,) = pull(dy)
        return {"y": y, "dx": dx}
    return step


def registered_apply(impl: str, plan):
    from moe_jax.expert_gemm import EXPERT_GEMM  # noqa: PLC0415

    run = EXPERT_GEMM[impl].run
    return lambda x, weights, group_sizes_e: run(x, group_sizes_e, weights, plan)


def dense_mlp(x, weights, layout):
    """The expert MLP on zero-padded per-expert blocks: the numerics of ``xla`` (bf16 operands,
    fp32 accumulation, the SwiGLU output rounded to bf16) without ``ragged_dot``."""
    from moe_jax.expert_gemm import swiglu  # noqa: PLC0415

    x_ech = to_padded(x, layout)
    h_ecg = jnp.einsum("ech,egh->ecg", x_ech, dense_bf16(weights["w_gate_up_egh"]), preferred_element_type=jnp.float32)
    a_ecf = swiglu(h_ecg).astype(jnp.bfloat16)
    y_ech = jnp.einsum("ecf,ehf->ech", a_ecf, dense_bf16(weights["w_down_ehf"]), preferred_element_type=jnp.float32)
    return from_padded(y_ech, layout).astype(jnp.bfloat16)


def anchor_mlp(x, w_gu_hg, w_d_fh):
    """The dense anchor's MLP: the expert MLP for one dense expert that gets all M rows, as plain
    XLA matmuls (cuBLAS): ``[M, H] x [H, 2F]``, SwiGLU, ``[M, F] x [F, H]``; bf16 operands and
    outputs, float32 accumulation (XLA:GPU's bf16 GEMMs), the SwiGLU in float32 rounded to bf16."""
    from moe_jax.expert_gemm import swiglu  # noqa: PLC0415

    h_mg = jnp.dot(x, w_gu_hg)
    a_mf = swiglu(h_mg.astype(jnp.float32)).astype(jnp.bfloat16)
    return jnp.dot(a_mf, w_d_fh)


def anchor_step(wrt_weights: bool):
    """``step(x, w_gu_hg, w_d_fh, dy)``: :func:`anchor_mlp` and its VJP at ``dy`` (dX, and dW of
    both matrices when ``wrt_weights``): the step's FLOPs (:func:`step_flops`) with no experts."""
    def step(x, w_gu_hg, w_d_fh, dy):
        if wrt_weights:
            y, pull = jax.vjp(anchor_mlp, x, w_gu_hg, w_d_fh)
            dx, dw_gu, dw_d = pull(dy)
            return {"y": y, "dx": dx, "dw_gate_up": dw_gu, "dw_down": dw_d}
        y, pull = jax.vjp(lambda x: anchor_mlp(x, w_gu_hg, w_d_fh), x)
        (dx,) = pull(dy)
        return {"y": y, "dx": dx}
    return step


def reference_gemm(op: str):
    """fp32 (HIGHEST) per-expert products on padded blocks: ``(a, b, layout) -> out``."""
    def fn(a, b, layout):
        a_ec = to_padded(a, layout).astype(jnp.float32)
        match op:
            case "forward":  # a = x [M, K], b = w [E, N, K]
                return from_padded(jnp.einsum("eck,enk->ecn", a_ec, dense_f32(b), precision=HIGHEST), layout)
            case "input_grad":  # a = dy [M, N], b = w [E, N, K]
                return from_padded(jnp.einsum("ecn,enk->eck", a_ec, dense_f32(b), precision=HIGHEST), layout)
            case "weight_grad":  # a = x [M, K], b = dy [M, N]
                b_ec = to_padded(b, layout).astype(jnp.float32)
                return jnp.einsum("ecn,eck->enk", b_ec, a_ec, precision=HIGHEST)
        raise ValueError(op)
    return fn


def kernel_gemm(op: str, cc: int, interpret: bool):
    """Our kernel for ``op``: ``(a, b, group_sizes) -> out`` (operands as in :func:`reference_gemm`)."""
    import pallas_kernels.grouped_matmul as gmm  # noqa: PLC0415

    kernel = getattr(gmm, KERNEL_NAMES[op])
    # bf16 weight gradients, as the step writes them for bf16 weights and as torch writes them.
    extra = {"out_dtype": jnp.bfloat16} if op == "weight_grad" else {}
    return lambda a, b, g: kernel(a, b, g, compute_capability=cc, interpret=interpret, **extra)


def native_gemm(op: str, cc: int):
    """The native (Triton-language, W4A16) kernel for ``op`` on NVFP4 weights: the forward product
    or the input gradient (NVFP4 weights are frozen: no weight gradient)."""
    from pallas_kernels.grouped_matmul import triton_lang  # noqa: PLC0415

    match op:
        case "forward":
            return lambda a, b, g: triton_lang.run(triton_lang.Op.MATMUL, a, b, g, compute_capability=cc)
        case "input_grad":
            return lambda a, b, g: triton_lang.input_grad(a, b, g, compute_capability=cc)
    raise ValueError(op)


def native_weight_grad(cc: int):
    """The native (Triton-language, rows by TMA) bf16 weight gradient, bf16 out as the step writes it."""
    from pallas_kernels.grouped_matmul import triton_weight_grad  # noqa: PLC0415

    return lambda a, b, g: triton_weight_grad.weight_grad(a, b, g, compute_capability=cc, out_dtype=jnp.bfloat16)


#: Steps with one part other than their backend dispatches at this shape: the step's impl ->
#: (the backend whose other kernels it keeps, the part, its replacement). Weight gradients:
#: "native" is ``triton_weight_grad``'s (rows by TMA), "pallas" the Pallas kernel's
#: (``BF16_BACKEND`` runs the native one from ``tuning.NATIVE_WEIGHT_GRAD_ROWS_PER_EXPERT`` rows
#: per expert, so "triton" there is its step); the input gradient's padding rows: "select" is
#: XLA's select over every row (``BF16_BACKEND`` zeroes them with ``triton_padding_rows``; the
#: benchmark's rows have none, so the difference is the select's pass).
SWAPPED_STEPS = {"pallas, native dW": ("PALLAS", "weight_grad", "native"),
                 "triton, Pallas dW": ("BF16_BACKEND", "weight_grad", "pallas"),
                 "triton, padding select": ("BF16_BACKEND", "zero_padding_rows", "select")}


def swapped_apply(impl: str, cc: int):
    """``apply(x, weights, group_sizes)`` of the bf16 expert MLP through ``expert_mlp`` with
    :data:`SWAPPED_STEPS`' backend and part."""
    import pallas_kernels.grouped_matmul as gmm  # noqa: PLC0415
    from pallas_kernels.grouped_matmul import triton_lang, triton_weight_grad  # noqa: PLC0415

    name, part, which = SWAPPED_STEPS[impl]
    base = gmm.PALLAS if name == "PALLAS" else getattr(triton_lang, name)
    replacement = {("weight_grad", "native"): triton_weight_grad.weight_grad,
                   ("weight_grad", "pallas"): gmm.PALLAS.weight_grad,
                   ("zero_padding_rows", "select"): None}[(part, which)]
    backend = base._replace(name=f"{base.name}, {which} {part}", **{part: replacement})
    return lambda x, weights, g: gmm.expert_mlp(x, g, weights["w_gate_up_egh"], weights["w_down_ehf"],
                                                backend=backend, compute_capability=cc)


def dequantized_gemm(cc: int, interpret: bool):
    """The NVFP4 input gradient through one bf16 copy of the weights (what both backends take at
    many rows per expert, ``tuning.dequantize_for_input_grad``), whatever the rule says here."""
    from pallas_kernels.grouped_matmul import dequantized_input_grad  # noqa: PLC0415

    return lambda a, b, g: dequantized_input_grad(a, b, g, compute_capability=cc, interpret=interpret)


def torch_step(wrt_weights: bool):
    """The SwiGLU expert MLP with ``torch._grouped_mm`` (autograd: torch's own derivatives)."""
    import torch  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: N812, PLC0415

    def fn(x, w_gu, w_d, offs, dy):
        h = torch._grouped_mm(x, w_gu.transpose(1, 2), offs=offs)
        gate, up = h.chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gate) * up, w_d.transpose(1, 2), offs=offs)
        inputs = (x, w_gu, w_d) if wrt_weights else (x,)
        return y, torch.autograd.grad(y, inputs, dy)
    return fn


def torch_gemm(op: str):
    """``torch._grouped_mm`` for the same three products (the weight gradient as torch's own
    backward computes it: ``x^T dy`` per group, ``[E, K, N]``, returned as a transposed view)."""
    import torch  # noqa: PLC0415

    def fn(a, b, offs):
        match op:
            case "forward":
                return torch._grouped_mm(a, b.transpose(1, 2), offs=offs)
            case "input_grad":
                return torch._grouped_mm(a, b, offs=offs)
            case "weight_grad":
                return torch._grouped_mm(a.t(), b, offs=offs).transpose(1, 2)
        raise ValueError(op)
    return fn


# --- measuring --------------------------------------------------------------------------------


@dataclasses.dataclass
class Context:
    cc: int
    interpret: bool
    have_torch: bool
    iters: int
    windows: int
    xla_iters: int
    torch_runs: int
    max_err: float
    ref_options: dict  # compiler options for the (untimed) dense references
    xla_rows: tuple
    started: float
    budget_s: float | None
    profile_calls: int = 0  # --profile: calls of each JAX step recorded under jax.profiler (0: none)

    def over_budget(self) -> bool:
        return self.budget_s is not None and time.time() - self.started > self.budget_s


def compile_and_run(fn, args, options=None, row=None):
    """The outputs of ``jax.jit(fn)`` compiled once; ``timed`` then finds it compiled. With
    ``row``, records there ``compile_s`` and ``temp_gb``: the compiled program's
    temporary buffers by XLA's memory analysis (what a step holds beyond its arguments and
    outputs: the forward's residuals for the backward, the kernels' scratch)."""
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile(options or {})
    compile_s = time.perf_counter() - start
    if row is not None:
        row["compile_s"] = compile_s
        memory = compiled.memory_analysis()
        if memory is not None:
            row["temp_gb"] = memory.temp_size_in_bytes / 1e9
    return jax.block_until_ready(compiled(*args))


@jax.jit
def _rel_errs(out, ref):
    def rel(a, b):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        return jnp.linalg.norm((a - b).ravel()) / jnp.maximum(jnp.linalg.norm(b.ravel()), 1e-30)
    return {name: rel(out[name], ref[name]) for name in ref}


def rel_errs(out: dict, ref: dict) -> dict:
    return {name: float(v) for name, v in _rel_errs({n: out[n] for n in ref}, ref).items()}


def check(row: dict, errs: dict, max_err: float) -> bool:
    """Records the errors; False (and why, in ``row["error"]``) when any is above the bound."""
    row["errs"] = errs
    row["err"] = max(errs.values()) if errs else None
    worst = row["err"]
    if worst is None or not math.isfinite(worst) or worst > max_err:
        row["error"] = f"wrong: relative error {worst!r} > {max_err} ({errs}); not timed"
        return False
    return True


def failed(row: dict, err: BaseException) -> None:
    msg = str(err).strip().splitlines()[0][:400] if str(err).strip() else ""
    row["error"] = f"{type(err).__name__}: {msg}"
    if os.environ.get("TRAIN_STEP_TRACEBACK"):
        traceback.print_exc()


def say(row: dict, what: str) -> None:
    if "ms" in row:
        status = f"{row['ms']:10.3f} ms  err {row.get('err', float('nan')):.2e}"
        if row.get("err_vs_xla") is not None:
            status += f"  vs xla {row['err_vs_xla']:.2e}"
        status += f"  (compile {row.get('compile_s', 0):.1f}s)"
    else:
        status = "ERROR " + row.get("error", "?")
    print(f"  {what:<56} {status}", flush=True)


def step_flops(shape: dict, rows: int, wrt_weights: bool) -> float:
    """Model FLOPs: the forward's three products (6 M H F), then dX (the same again) and dW."""
    forward = 6.0 * rows * shape["hidden"] * shape["intermediate"]
    return forward * (3 if wrt_weights else 2)


_FUNCTIONS: dict = {}


def cached(key, make):
    """One function object per ``key``, so that ``jax.jit`` finds it compiled for shapes it saw."""
    if key not in _FUNCTIONS:
        _FUNCTIONS[key] = make()
    return _FUNCTIONS[key]


def step_base(case: Case, shape: dict) -> dict:
    wrt = case.fmt == "bf16"
    return {"kind": "step", **case.keys, "grads": "x, w" if wrt else "x (frozen weights)",
            "flops": step_flops(shape, case.rows, wrt)}


def step_reference(case: Case, ctx: Context) -> dict:
    wrt = case.fmt == "bf16"
    fn = cached(("dense step", wrt), lambda: vjp_step(dense_mlp, wrt))
    return compile_and_run(fn, (case.x, case.weights, case.layout, case.dy), ctx.ref_options)


def registered_step(impl: str, case: Case, plans: dict):
    plan = plans[impl]
    if isinstance(plan, Exception):
        raise plan
    wrt = case.fmt == "bf16"
    return cached(("step", impl, case.fmt), lambda: vjp_step(registered_apply(impl, plan), wrt))


def _tflops(rows: list[dict]) -> list[dict]:
    for row in rows:
        if "ms" in row:
            row["tflops"] = row["flops"] / (row["ms"] * 1e-3) / 1e12
    return rows


def step_rows(case: Case, shape: dict, ctx: Context, plans: dict) -> list[dict]:
    """The expert MLP step with ``pallas`` and torch, each checked against the dense reference
    before it is timed (``xla``, slow, comes later: :func:`xla_step_row`)."""
    base = step_base(case, shape)
    args = (case.x, case.weights, jnp.asarray(case.sizes), case.dy)
    ref = step_reference(case, ctx)
    out = []
    # ``triton``: the native kernels (NVFP4: W4A16; bf16: BF16_BACKEND's forward GEMMs at prefill sizes,
    # its input and weight gradients at many rows per expert); where they cannot run, their row says why.
    native = case.fmt == "bf16" and not ctx.interpret and not isinstance(plans.get("triton"), Exception)
    swapped = tuple(SWAPPED_STEPS) if native else ()
    for impl in ("pallas",) + (("triton",) if "triton" in plans else ()) + swapped:
        row = {**base, "impl": impl, "reference": "dense"}
        out.append(row)
        try:
            if impl in SWAPPED_STEPS:
                fn = cached(("step", impl), lambda: vjp_step(swapped_apply(impl, ctx.cc), True))  # noqa: B023
            else:
                fn = registered_step(impl, case, plans)
            result = compile_and_run(fn, args, row=row)
            ok = check(row, rel_errs(result, ref), ctx.max_err)
            del result
            if ok:
                seconds, _ = expert_parallel.timed(fn, *args, iters=ctx.iters, windows=ctx.windows)
                row["ms"] = seconds * 1e3
                if ctx.profile_calls:
                    row["profile"] = kernel_profile(fn, args, ctx.profile_calls)
        except Exception as err:  # noqa: BLE001 -- recorded in the results, never hidden
            failed(row, err)
        say(row, f"step {impl} {case.tag}")
    if ctx.have_torch:
        row = {**base, "impl": "torch", "reference": "dense"}
        out.append(row)
        try:
            row.update(torch_step_row(case, ref, case.fmt == "bf16", ctx))
        except Exception as err:  # noqa: BLE001
            failed(row, err)
        say(row, f"step torch {case.tag}")
    return _tflops(out)


def kernel_profile(fn, args, calls: int, top: int = PROFILE_TOP) -> dict:
    """Where a step's GPU time goes: ``calls`` calls under ``jax.profiler.trace`` (CUPTI: the
    kernels run as unprofiled), per call the span of its kernels, the time some kernel runs, and
    its ``top`` kernels by time (``profile_layer.summarize``; the rest summed)."""
    import profile_layer  # noqa: PLC0415

    # Jitted as the timing runs it (called as is, a step would run op by op).
    kernels, _ = profile_layer.profile(jax.jit(fn), args, calls, None)
    summary = profile_layer.summarize(kernels, calls)
    table = summary["table"]
    summary["table"] = table[:top]
    summary["rest_us"] = sum(r["us_per_call"] for r in table[top:])
    summary["rest_kernels"] = len(table[top:])
    summary["calls"] = calls
    return summary


ANCHOR_IMPL = "dense anchor (XLA)"


def anchor_grads(fmt: str) -> str:
    return "x, w" if fmt == "bf16" else "x (frozen weights)"


def anchor_row(case: Case, shape: dict, ctx: Context) -> dict:
    """The dense anchor at this configuration's rows: :func:`anchor_step` (grads with respect to
    x and the weights for bf16 configurations, x only for the frozen NVFP4 ones) on one dense
    expert's bf16 weights, timed as the JAX rows are. Not compared with anything (it is not the
    experts' computation, only their FLOPs); its outputs are checked to be finite."""
    wrt = case.fmt == "bf16"
    h, f = shape["hidden"], shape["intermediate"]
    row = {"kind": "anchor", "impl": ANCHOR_IMPL, "rows": case.rows, "grads": anchor_grads(case.fmt),
           "flops": step_flops(shape, case.rows, wrt),
           "what": f"[M, {h}] x [{h}, {2 * f}], SwiGLU, [M, {f}] x [{f}, {h}] and the VJP (grads "
                   f"{anchor_grads(case.fmt)}); bf16 operands, float32 accumulation, one dense expert"}
    try:
        key = jax.random.key(4242)
        w_gu = (jax.random.normal(key, (h, 2 * f), jnp.float32) / math.sqrt(h)).astype(jnp.bfloat16)
        w_d = (jax.random.normal(jax.random.fold_in(key, 1), (f, h), jnp.float32) / math.sqrt(f)).astype(jnp.bfloat16)
        args = (case.x, w_gu, w_d, case.dy)
        fn = cached(("anchor step", wrt), lambda: anchor_step(wrt))
        result = compile_and_run(fn, args, row=row)
        bad = [n for n, v in result.items() if not bool(jnp.isfinite(v.astype(jnp.float32)).all())]
        del result
        if bad:
            raise FloatingPointError(f"non-finite outputs: {', '.join(bad)}")
        seconds, _ = expert_parallel.timed(fn, *args, iters=ctx.iters, windows=ctx.windows)
        row["ms"] = seconds * 1e3
    except Exception as err:  # noqa: BLE001
        failed(row, err)
    say(row, f"{ANCHOR_IMPL} grads {row['grads']} M={case.rows}")
    return _tflops([row])[0]


def anchor_for(data: dict, row: dict) -> dict | None:
    """The anchor row of a step row (same rows, same gradients), or None (older results have none)."""
    return next((a for a in data.get("anchors", []) if a["rows"] == row["rows"] and a["grads"] == row["grads"]), None)


def of_anchor(data: dict) -> None:
    """Each step row's ``of_anchor``: its TFLOP/s over its anchor's (equal FLOPs: the anchor's
    time over the row's), where both were timed."""
    for row in data["steps"]:
        anchor = anchor_for(data, row)
        if anchor is not None and "ms" in anchor and "ms" in row:
            row["of_anchor"] = anchor["ms"] / row["ms"]


def xla_step_row(case: Case, shape: dict, ctx: Context, plans: dict, pallas_row: dict | None) -> dict:
    """The ``xla`` reference path's step, checked against the dense reference and timed; the
    ``pallas`` row of the same configuration gets its error against ``xla``'s outputs."""
    args = (case.x, case.weights, jnp.asarray(case.sizes), case.dy)
    row = {**step_base(case, shape), "impl": "xla", "reference": "dense"}
    try:
        ref = step_reference(case, ctx)
        fn = registered_step("xla", case, plans)
        result = compile_and_run(fn, args, row=row)
        ok = check(row, rel_errs(result, ref), ctx.max_err)
        del ref
        if ok and pallas_row is not None and "err" in pallas_row:
            # Compiled in step_rows already: the cache has it.
            pallas_out = compile_and_run(registered_step("pallas", case, plans), args)
            pallas_row["errs_vs_xla"] = rel_errs(pallas_out, result)
            pallas_row["err_vs_xla"] = max(pallas_row["errs_vs_xla"].values())
            del pallas_out
        del result
        if ok:
            seconds, _ = expert_parallel.timed(fn, *args, iters=ctx.xla_iters, windows=ctx.windows)
            row["ms"] = seconds * 1e3
    except Exception as err:  # noqa: BLE001
        failed(row, err)
    say(row, f"step xla {case.tag}")
    return _tflops([row])[0]


def _torch(a):
    import torch  # noqa: PLC0415

    return torch.from_dlpack(a)


def _torch_rel(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def torch_step_row(case: Case, ref: dict, wrt: bool, ctx: Context) -> dict:
    import torch  # noqa: PLC0415

    offs = _torch(jnp.cumsum(jnp.asarray(case.sizes)).astype(jnp.int32))
    x = _torch(case.x).requires_grad_(True)
    w_gu = _torch(dense_bf16(case.weights["w_gate_up_egh"])).requires_grad_(wrt)
    w_d = _torch(dense_bf16(case.weights["w_down_ehf"])).requires_grad_(wrt)
    dy = _torch(case.dy)
    fn = torch_step(wrt)
    y, grads = fn(x, w_gu, w_d, offs, dy)
    torch.cuda.synchronize()
    got = {"y": y, "dx": grads[0]}
    if wrt:
        got.update(dw_gate_up=grads[1], dw_down=grads[2])
    errs = {name: _torch_rel(got[name], _torch(ref[name])) for name in got}
    row: dict = {}
    del y, grads, got
    if check(row, errs, ctx.max_err):
        row["ms"] = grouped_gemm.time_torch(fn, [(x, w_gu, w_d, offs, dy)], ctx.torch_runs)
    torch.cuda.empty_cache()
    return row


def gemm_rows(case: Case, shape: dict, ctx: Context) -> list[dict]:
    """Each grouped GEMM alone: ours and torch's, checked against fp32 per-expert products."""
    out = []
    g = jnp.asarray(case.sizes)
    ops = GEMM_OPS if case.fmt == "bf16" else ("forward", "input_grad")  # NVFP4 weights are frozen
    for projection, (n, k) in projections(shape).items():
        key = jax.random.key(case.rows * 31 + n + k)
        x = case.x if k == shape["hidden"] else jax.random.normal(key, (case.rows, k), jnp.bfloat16)
        dy = jax.random.normal(jax.random.fold_in(key, 1), (case.rows, n), jnp.bfloat16)
        w = case.weights["w_gate_up_egh" if projection == "gate_up" else "w_down_ehf"]
        for op in ops:
            a, b = {"forward": (x, w), "input_grad": (dy, w), "weight_grad": (x, dy)}[op]
            base = {"kind": "gemm", **case.keys, "projection": projection, "op": op, "n": n, "k": k,
                    "flops": 2.0 * case.rows * n * k}
            ref = compile_and_run(cached(("ref gemm", op), lambda: reference_gemm(op)), (a, b, case.layout),
                                  ctx.ref_options)
            # The native kernels' rows (W4A16 on NVFP4 weights) beside the Pallas kernels'.
            impls = {"pallas": (("gemm", op), lambda: kernel_gemm(op, ctx.cc, ctx.interpret))}
            if case.fmt == "nvfp4" and not ctx.interpret:
                impls["triton"] = (("native gemm", op), lambda: native_gemm(op, ctx.cc))
            if case.fmt == "bf16" and op == "weight_grad" and not ctx.interpret:
                impls["triton"] = (("native weight grad",), lambda: native_weight_grad(ctx.cc))
            if case.fmt == "nvfp4" and op == "input_grad":
                impls["dequantized"] = (("dequantized gemm", op), lambda: dequantized_gemm(ctx.cc, ctx.interpret))
            for impl, (key, make) in impls.items():
                row = {**base, "impl": impl}
                out.append(row)
                try:
                    fn = cached(key, make)
                    result = compile_and_run(fn, (a, b, g), row=row)
                    ok = check(row, {"out": max(rel_errs({"out": result}, {"out": ref}).values())}, ctx.max_err)
                    del result
                    if ok:
                        seconds, _ = expert_parallel.timed(fn, a, b, g, iters=ctx.iters, windows=ctx.windows)
                        row["ms"] = seconds * 1e3
                except Exception as err:  # noqa: BLE001
                    failed(row, err)
                say(row, f"gemm {impl} {op} {projection} {case.tag}")
            if ctx.have_torch and case.fmt == "bf16":
                row = {**base, "impl": "torch"}
                out.append(row)
                try:
                    offs = _torch(jnp.cumsum(g).astype(jnp.int32))
                    ta, tb = _torch(a), _torch(b)
                    fn = torch_gemm(op)
                    if check(row, {"out": _torch_rel(fn(ta, tb, offs), _torch(ref))}, ctx.max_err):
                        row["ms"] = grouped_gemm.time_torch(fn, [(ta, tb, offs)], ctx.torch_runs)
                except Exception as err:  # noqa: BLE001
                    failed(row, err)
                say(row, f"gemm torch {op} {projection} {case.tag}")
            del ref
    return _tflops(out)


def layer_rows(args, shape: dict, ctx: Context, out: list, save) -> None:
    """``moe_forward`` + VJP under ``jax.jit`` for each of ``--layer-weights`` at each EP size:
    ``pallas``, ``triton`` (not interpreted), and ``xla`` (the reference their gradients are
    checked against) at the sizes in ``--xla-rows``; rows are appended to ``out`` (and saved) as
    they come."""
    from jax.sharding import NamedSharding  # noqa: PLC0415
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    import sharding  # noqa: PLC0415
    from moe_jax import MoEConfig, random_params, resolve  # noqa: PLC0415

    devices = jax.devices()
    for weights, ep, rows in itertools.product(args.layer_weights, args.ep, args.rows):
        tokens = ep * rows // shape["top_k"]
        base = {"kind": "layer", "ep": ep, "rows": rows, "tokens": tokens, "weights": weights,
                "experts_per_device": shape["experts"]}
        if ctx.over_budget():
            out.append({**base, "impl": "-", "error": "skipped: --budget-s spent"})
            continue
        if len(devices) < ep:
            out.append({**base, "impl": "-", "error": f"needs {ep} devices, found {len(devices)}"})
            say(out[-1], f"layer {weights} EP={ep} M={rows}")
            continue
        config = MoEConfig.kimi_k2(num_experts=shape["experts"] * ep, top_k=shape["top_k"],
                                   hidden_size=shape["hidden"], expert_intermediate_size=shape["intermediate"],
                                   weight_format=weights, interpret=ctx.interpret)
        mesh = sharding.make_mesh(ep, devices=devices[:ep]) if ep > 1 else None
        target = mesh if mesh is not None else devices[:1]
        key = jax.random.key(ep * 7919 + rows)
        ref = None
        try:
            params_plan = resolve(dataclasses.replace(config, expert_gemm="xla"), target, training=True)
            params = random_params(config, key, params_plan)
            x = jax.random.normal(jax.random.fold_in(key, 1), (tokens, shape["hidden"]), jnp.bfloat16)
            dy = jax.random.normal(jax.random.fold_in(key, 2), (tokens, shape["hidden"]), jnp.bfloat16)
            if mesh is not None:  # tokens over every mesh axis, as the layer splits them
                tokens_spec = P(tuple(mesh.axis_names))
                x, dy = (jax.device_put(a, NamedSharding(mesh, tokens_spec)) for a in (x, dy))
        except Exception as err:  # noqa: BLE001
            row = {**base, "impl": "-"}
            failed(row, err)
            out.append(row)
            say(row, f"layer {weights} EP={ep} M={rows}")
            continue
        gpu_impls = [] if ctx.interpret else ["triton"]
        for impl in (["xla"] if rows in ctx.xla_rows else []) + ["pallas"] + gpu_impls:
            row = {**base, "impl": impl}
            out.append(row)
            try:
                plan = resolve(dataclasses.replace(config, expert_gemm=impl), target, training=True,
                               tokens_per_device=tokens // ep)
                row["exchange"] = plan.exchange
                step = functools.partial(_layer_step, plan=plan, frozen=weights == "nvfp4")
                result = compile_and_run(step, (params, x, dy), row=row)
                bad = [n for n, v in result.items() if not bool(jnp.isfinite(v.astype(jnp.float32)).all())]
                if bad:
                    raise FloatingPointError(f"non-finite outputs: {', '.join(bad)}")
                if impl == "xla":
                    ref, row["reference"], ok = result, "is the reference", True
                elif ref is not None:
                    ok = check(row, rel_errs(result, ref), ctx.max_err)
                else:
                    ok, row["reference"] = True, "none at this size (xla not run; see the step rows)"
                del result
                if ok:
                    iters = ctx.xla_iters if impl == "xla" else ctx.iters
                    seconds, _ = expert_parallel.timed(step, params, x, dy, iters=iters, windows=ctx.windows)
                    row.update(ms=seconds * 1e3, tokens_per_s=tokens / seconds)
                    if ctx.profile_calls and impl != "xla":
                        row["profile"] = kernel_profile(step, (params, x, dy), ctx.profile_calls)
            except Exception as err:  # noqa: BLE001
                failed(row, err)
            say(row, f"layer {weights} {impl} EP={ep} M={rows}/device")
            save()
        del params, x, dy, ref


def _layer_step(params, x, dy, *, plan, frozen: bool) -> dict:
    """``moe_forward`` and its VJP: the outputs and gradients compared and timed. ``frozen``
    (NVFP4 experts): gradients for ``x`` and the router's weights only, as a fine-tune through
    frozen quantized experts takes them."""
    from moe_jax import moe_forward  # noqa: PLC0415

    if frozen:
        def forward(router, x):
            return moe_forward({**params, "router": router}, x, plan)[0]
        y, pull = jax.vjp(forward, params["router"], x)
        d_router, dx = pull(dy)
        return {"y": y, "dx": dx, "dw_router": d_router["w_eh"]}
    y, pull = jax.vjp(lambda p, x: moe_forward(p, x, plan)[0], params, x)
    dp, dx = pull(dy)
    return {"y": y, "dx": dx, "dw_gate_up": dp["experts"]["w_gate_up_egh"],
            "dw_down": dp["experts"]["w_down_ehf"], "dw_router": dp["router"]["w_eh"]}


# --- targets, report, plot --------------------------------------------------------------------


def targets(data: dict) -> list[dict]:
    """The issue's targets on every configuration measured (a pure function of the rows, after
    :func:`of_anchor`)."""
    out = []

    def add(name, value, goal, detail):
        out.append({"target": name, "value": value, "goal": goal,
                    "met": value is not None and value >= goal, "detail": detail})

    def same(a, b, fields):
        return all(a.get(f) == b.get(f) for f in fields)

    def speedup(row, candidates, is_peer, keys):
        """The peer's time over ``row``'s (a ratio of TFLOP/s at equal work), or None."""
        peer = next((p for p in candidates if is_peer(p) and same(p, row, keys)), None)
        return peer["ms"] / row["ms"] if peer and "ms" in peer and "ms" in row else None

    gemms = [r for r in data["gemms"] if r["impl"] == "pallas"]
    for row in (r for r in gemms if r["op"] != "forward"):
        value = speedup(row, gemms, lambda f: f["op"] == "forward", ("projection", "weights", "routing", "rows"))
        add(f"backward GEMM ({row['op']}) >= {BACKWARD_GOAL}x forward TFLOP/s", value, BACKWARD_GOAL,
            f"{row['projection']} {row['weights']} {row['routing']} M={row['rows']}")
    steps = data["steps"]
    for row in (r for r in steps if r["impl"] in ("pallas", "triton")):
        value = speedup(row, steps, lambda t: t["impl"] == "torch", ("weights", "grads", "routing", "rows"))
        add(f"step >= {TORCH_GOAL}x torch._grouped_mm (torch time / ours)", value, TORCH_GOAL,
            f"{row['impl']} {row['weights']} grads {row['grads']} {row['routing']} M={row['rows']}")
        if row["weights"] == "bf16" and anchor_for(data, row) is not None:
            add(f"full bf16 step >= {ANCHOR_GOAL} of the dense anchor", row.get("of_anchor"), ANCHOR_GOAL,
                f"{row['impl']} {row['routing']} M={row['rows']}")
    # Frozen NVFP4 experts move fewer bytes and skip the weight gradients: their step should take
    # no longer than the full bf16 step.
    for row in (r for r in steps if r["weights"] == "nvfp4" and r["impl"] in ("pallas", "triton")):
        value = speedup(row, steps, lambda t: t["weights"] == "bf16" and t["impl"] == "pallas", ("routing", "rows"))
        add("frozen-NVFP4 step <= 1.0x the full bf16 step (bf16 pallas time / this)", value, 1.0,
            f"{row['impl']} {row['routing']} M={row['rows']}")
    return out


def _num(value, fmt):
    return "-" if value is None else format(value, fmt)


def _note(row):
    return row.get("error", "").replace("|", "/")[:160]


PROFILE_INTRO = ("Per call, from calls recorded under `jax.profiler.trace` after timing: span = first kernel's start "
                 "to last kernel's end, busy = time some kernel runs (span - busy: gaps between kernels); the "
                 "kernels by time, the rest summed.")


def profile_lines(title: str, row: dict, heading: str = "###") -> list[str]:
    """A profiled row's section (``kernel_profile``) under a ``heading`` of that level: its span,
    busy time and kernels by time."""
    p = row["profile"]
    if not p["table"]:
        return ["", f"{heading} {title}: the trace holds no GPU kernels"]
    lines = ["", f"{heading} {title}", "",
             f"wall {row['ms'] * 1e3:.0f} us; kernels: span {p['span_us']:.0f} us, busy {p['busy_us']:.0f} us, "
             f"{p['kernels_per_call']:.0f} launches ({p['calls']} calls)", "",
             "| kernel | HLO op | launches | us per call | share of busy |", "|---|---|---:|---:|---:|"]
    for k in p["table"]:
        lines.append(f"| `{k['kernel'][:70]}` | `{k['hlo_op'][:50]}` | {k['launches_per_call']:.0f} | "
                     f"{k['us_per_call']:.1f} | {k['us_per_call'] / p['busy_us']:.1%} |")
    if p["rest_kernels"]:
        lines.append(f"| {p['rest_kernels']} more | | | {p['rest_us']:.1f} | {p['rest_us'] / p['busy_us']:.1%} |")
    return lines


def markdown(data: dict) -> str:
    meta = data["meta"]
    shape = meta["shape"]
    lines = [
        f"# MoE training step: {meta['device']}",
        "",
        f"- date: {meta['date']}; commit: {meta['commit']} (dirty: {meta['dirty']})",
        f"- command: `{meta['command']}`",
        f"- versions: {meta['versions']}",
        f"- shape: {shape['experts']} local experts, hidden {shape['hidden']}, expert intermediate "
        f"{shape['intermediate']}, top-{shape['top_k']}",
        f"- timing: {meta['timing']}",
        f"- correctness: {meta['correctness']}",
    ]
    if meta.get("smoke"):
        lines.append("- **smoke run** (CPU, interpreted kernels, tiny shapes): the times mean nothing")
    if meta.get("skipped"):
        lines.append(f"- skipped: {'; '.join(meta['skipped'])}")
    lines += [
        "",
        "## Expert MLP step (forward + backward)",
        "",
        "err: largest relative Frobenius error over y, dX and each dW against the dense reference; "
        "vs xla: the same against `xla`'s outputs. TFLOP/s counts the model's products "
        "(6 M H F forward, as much again for dX and for dW).",
        "",
    ]
    anchors = data.get("anchors", [])  # (results from before the anchor have none: the page they had)
    if anchors:
        lines[-2] += (
            f" {ANCHOR_IMPL}: the same FLOPs as plain XLA matmuls (cuBLAS) for one dense expert that gets all "
            "M rows (`[M, H] x [H, 2F]`, SwiGLU, `[M, F] x [F, H]` and the VJP: grads with respect to x and "
            "both weights beside the bf16 rows, x only beside the frozen NVFP4 rows; bf16 operands, float32 "
            "accumulation), timed as the JAX rows are; of anchor: this row's TFLOP/s over it.")
        lines += [
            "| weights | grads | routing | M | impl | time (ms) | TFLOP/s | of anchor | err | vs xla | torch / this "
            "| note |",
            "|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---|",
        ]
    else:
        lines += [
            "| weights | grads | routing | M | impl | time (ms) | TFLOP/s | err | vs xla | torch / this | note |",
            "|---|---|---|---:|---|---:|---:|---:|---:|---:|---|",
        ]
    order = {ANCHOR_IMPL: -1, "pallas": 0, "triton": 1, "dequantized": 2, "torch": 3, "xla": 4}
    # Each anchor once, first among the configurations with its rows and gradients (uniform routing).
    listed = [*data["steps"], *({**a, "weights": "bf16 (dense)", "routing": "-"} for a in anchors)]
    steps = sorted(listed, key=lambda r: (r["grads"] != "x, w", r["routing"] not in ("uniform", "-"), r["rows"],
                                          order.get(r["impl"], 4)))
    for row in steps:
        peer = next((t for t in data["steps"] if t["impl"] == "torch" and all(
            t[f] == row[f] for f in ("weights", "grads", "routing", "rows"))), None)
        ratio = peer["ms"] / row["ms"] if peer and "ms" in peer and "ms" in row and row["impl"] != "torch" else None
        cells = [row["weights"], row["grads"], row["routing"], row["rows"], row["impl"], _num(row.get("ms"), ".3f"),
                 _num(row.get("tflops"), ".0f")]
        if anchors:
            anchor = anchor_for(data, row)
            cells.append(_num(anchor["ms"] / row["ms"] if anchor and "ms" in anchor and "ms" in row else None, ".2f"))
        cells += [_num(row.get("err"), ".1e"), _num(row.get("err_vs_xla"), ".1e"), _num(ratio, ".2f"), _note(row)]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    profiled = [r for r in steps if r.get("profile")]
    if profiled:
        lines += ["", "## Where each step's GPU time goes (`--profile`)", "", PROFILE_INTRO]
        for row in profiled:
            lines += profile_lines(f"{row['impl']}, {row['weights']} {row['routing']} M={row['rows']}", row)
    lines += [
        "",
        "## Grouped GEMMs alone",
        "",
        "forward: `x W_e^T`; input_grad: `dy W_e` (dX); weight_grad: `dy_e^T x_e` (dW; ours writes bf16, "
        "torch bf16). vs forward: this op's TFLOP/s over the same implementation's forward.",
        "",
        "| projection | N | K | weights | routing | M | op | impl | time (us) | TFLOP/s | vs forward | err | note |",
        "|---|---:|---:|---|---|---:|---|---|---:|---:|---:|---:|---|",
    ]
    for row in data["gemms"]:
        fwd = next((f for f in data["gemms"] if f["op"] == "forward" and all(
            f[k] == row[k] for k in ("impl", "projection", "weights", "routing", "rows"))), None)
        ratio = fwd["ms"] / row["ms"] if fwd and "ms" in fwd and "ms" in row and row["op"] != "forward" else None
        ms = row.get("ms")
        lines.append(
            f"| {row['projection']} | {row['n']} | {row['k']} | {row['weights']} | {row['routing']} | {row['rows']} | "
            f"{row['op']} | {row['impl']} | {_num(None if ms is None else ms * 1e3, '.1f')} | "
            f"{_num(row.get('tflops'), '.0f')} | {_num(ratio, '.2f')} | {_num(row.get('err'), '.1e')} | {_note(row)} |")
    if data["layers"]:
        lines += [
            "",
            "## Whole layer step (`moe_forward` + VJP under `jax.jit`)",
            "",
            "temp GB: the compiled step's temporary buffers (XLA's memory analysis).",
            "",
            "| weights | EP | rows/device | tokens | impl | exchange | time (ms) | tokens/s | temp GB | err vs xla | note |",
            "|---|---:|---:|---:|---|---|---:|---:|---:|---:|---|",
        ]
        for row in data["layers"]:
            lines.append(
                f"| {row['weights']} | {row['ep']} | {row['rows']} | {row['tokens']} | {row['impl']} | "
                f"{row.get('exchange', '-')} | "
                f"{_num(row.get('ms'), '.3f')} | {_num(row.get('tokens_per_s'), '.0f')} | "
                f"{_num(row.get('temp_gb'), '.2f')} | {_num(row.get('err'), '.1e')} | {_note(row)} |")
        profiled = [r for r in data["layers"] if r.get("profile")]
        if profiled:
            lines += ["", "### Where each layer step's GPU time goes (`--profile`)", "", PROFILE_INTRO]
            for row in profiled:
                lines += profile_lines(f"layer {row['weights']} {row['impl']} EP={row['ep']} M={row['rows']}/device",
                                       row, heading="####")
    lines += ["", "## Targets", "", "| target | case | value | goal | met |",
              "|---|---|---:|---:|---|"]
    for goal in data["targets"]:
        lines.append(f"| {goal['target']} | {goal['detail']} | {_num(goal['value'], '.2f')} | {goal['goal']} | "
                     f"{'yes' if goal['met'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def plot(data: dict, path: pathlib.Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    series = {}
    for row in data["steps"]:
        if "tflops" in row:
            label = f"{row['impl']} {row['weights']} {row['routing']}"
            series.setdefault(label, []).append((row["rows"], row["tflops"]))
    for row in data.get("anchors", []):
        if "tflops" in row:
            series.setdefault(f"{ANCHOR_IMPL} grads {row['grads']}", []).append((row["rows"], row["tflops"]))
    for label, pts in series.items():
        ax1.plot(*zip(*sorted(pts)), marker="o", ls=":" if label.startswith(ANCHOR_IMPL) else "-", label=label)
    ax1.set_title("expert MLP step (forward + backward)")
    ax1.set_ylabel("model TFLOP/s")
    series = {}
    for row in data["gemms"]:
        if "tflops" in row and row["routing"] == "uniform":
            label = f"{row['impl']} {row['weights']} {row['projection']} {row['op']}"
            series.setdefault(label, []).append((row["rows"], row["tflops"]))
    for label, pts in series.items():
        ax2.plot(*zip(*sorted(pts)), marker="o", ls="-" if label.startswith("pallas") else "--", label=label)
    ax2.set_title("grouped GEMMs alone (uniform routing)")
    ax2.set_ylabel("TFLOP/s")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("rows M")
        ax.grid(True, which="both", alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=6)
        else:
            ax.text(0.5, 0.5, "nothing timed", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(f"{data['meta']['device']}, {data['meta']['date']}, {data['meta']['commit'][:12]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(out: pathlib.Path, data: dict, *, with_plot: bool) -> str:
    of_anchor(data)
    data["targets"] = targets(data)
    (out / "train_step.json").write_text(json.dumps(data, indent=1, default=str))
    table = markdown(data)
    (out / "train_step.md").write_text(table)
    if with_plot:
        plot(data, out / "train_step.png")
    return table


# --- provenance ---------------------------------------------------------------------------------


def _git(*argv) -> str | None:
    try:
        proc = subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def provenance(commit_arg: str | None) -> tuple[str, str]:
    """(commit, dirty): ``--commit``, else ``$GIT_COMMIT``, else git; dirty from ``$GIT_DIRTY``
    or ``git status`` (as ``tools/gpu_check.sh`` does), else unknown."""
    commit = commit_arg or os.environ.get("GIT_COMMIT") or _git("rev-parse", "HEAD") or "unknown"
    dirty = os.environ.get("GIT_DIRTY")
    if dirty is not None:
        dirty = "0" if dirty in ("0", "no", "false") else "1"
    elif not (commit_arg or os.environ.get("GIT_COMMIT")) and (status := _git("status", "--porcelain",
                                                                                "--untracked-files=no")) is not None:
        dirty = "1" if status else "0"
    else:
        dirty = "unknown"
    return commit, dirty


def versions(have_torch: bool) -> str:
    import jaxlib  # noqa: PLC0415

    parts = [f"python {platform.python_version()}", f"jax {jax.__version__}", f"jaxlib {jaxlib.__version__}"]
    try:
        import triton  # noqa: PLC0415

        parts.append(f"triton {triton.__version__}")
    except ImportError:
        parts.append("triton none")
    if have_torch:
        import torch  # noqa: PLC0415

        parts.append(f"torch {torch.__version__} (CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)})")
    else:
        parts.append("torch not run (--smoke, or not importable with CUDA)")
    return ", ".join(parts)


TIMING = ("JAX: expert_parallel.timed, compiled once, 2 warm-up calls, median of {windows} windows of {iters} "
          "back-to-back calls ({xla_iters} for xla), wall time per call; torch: grouped_gemm.time_torch, CUDA "
          "events, median of {torch_runs} calls after a warm-up; one input set per configuration")
CORRECTNESS = ("before timing, every implementation's outputs against a dense per-expert reference (zero-padded "
               "[E, max rows, .] blocks, einsum, fp32 accumulation; the GEMMs in fp32 with exact NVFP4), largest "
               "relative Frobenius error over y, dX, dW; above {max_err} a row gets no time")


# --- main ---------------------------------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=None, help="results folder (default: $OUT)")
    parser.add_argument("--rows", type=int, nargs="+",
                        help=f"rows M after routing (default {' '.join(map(str, ROWS))})")
    parser.add_argument("--nvfp4", action="store_true", help="also NVFP4 frozen weights (dX only)")
    parser.add_argument("--skewed", action="store_true", help="also Zipf-skewed routing")
    parser.add_argument("--layer", action="store_true", help="also the whole layer step (moe_forward + VJP)")
    parser.add_argument("--ep", type=int, nargs="+", default=[1], help="expert-parallel sizes of the layer rows")
    parser.add_argument("--experts", type=int, default=None,
                        help="local experts (default: 48, Kimi K2's 384 over EP 8; 384: all of them on one GPU)")
    parser.add_argument("--layer-weights", nargs="+", choices=("bf16", "nvfp4"), default=["bf16"],
                        help="the layer rows' routed and shared experts: bf16 (trained), or NVFP4 (frozen: "
                             "gradients for x and the router only)")
    parser.add_argument("--xla-rows", type=int, nargs="*", default=None,
                        help="rows at which the xla path runs (default: all of --rows; it is slow: dense expansion)")
    parser.add_argument("--skip-gemms", action="store_true", help="no GEMM-alone rows")
    parser.add_argument("--skip-bf16-steps", action="store_true",
                        help="no bf16 expert-MLP step rows (with --nvfp4 or --layer: only those)")
    parser.add_argument("--profile", type=int, default=0, metavar="CALLS",
                        help="record CALLS calls of each timed JAX step and layer step under jax.profiler: "
                             "its kernels by time")
    parser.add_argument("--iters", type=int, default=10, help="calls per timing window")
    parser.add_argument("--windows", type=int, default=5, help="timing windows (median)")
    parser.add_argument("--xla-iters", type=int, default=2, help="calls per window for the xla path")
    parser.add_argument("--torch-runs", type=int, default=20, help="timed torch calls (median)")
    parser.add_argument("--max-err", type=float, default=MAX_ERR, help="largest relative error a timed row may have")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no new configuration after this many seconds (what ran is written)")
    parser.add_argument("--commit", default=None, help="git commit measured (default: $GIT_COMMIT, else git)")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU: tiny shapes, interpreted kernels, 1 call per window, no torch")
    args = parser.parse_args(argv)
    if args.out is None:
        if not os.environ.get("OUT"):
            parser.error("--out is required (or set $OUT)")
        args.out = pathlib.Path(os.environ["OUT"])
    if args.rows is None:
        args.rows = list(SMOKE_ROWS if args.smoke else ROWS)
    if args.xla_rows is None:
        args.xla_rows = list(args.rows)
    if args.smoke:
        args.iters, args.windows, args.xla_iters, args.torch_runs = 1, 1, 1, 2
    if args.profile < 0:
        parser.error(f"--profile: {args.profile} calls, expected >= 0")
    if args.experts is not None and args.experts < 1:
        parser.error(f"--experts: {args.experts}, expected >= 1")
    for name in ("iters", "windows", "xla_iters", "torch_runs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: must be >= 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    shape = SMOKE if args.smoke else KIMI
    if args.experts is not None:
        shape = {**shape, "experts": args.experts}
    device = jax.devices()[0]
    interpret = args.smoke or device.platform != "gpu"
    from moe_jax.expert_gemm import INTERPRET_CAPABILITY  # noqa: PLC0415

    cc = INTERPRET_CAPABILITY if interpret else grouped_gemm.capability(device)
    have_torch = not args.smoke and grouped_gemm._torch_available()
    ctx = Context(cc=cc, interpret=interpret, have_torch=have_torch, iters=args.iters, windows=args.windows,
                  xla_iters=args.xla_iters, torch_runs=args.torch_runs, max_err=args.max_err,
                  # The untimed references skip XLA's GEMM autotuning (seconds per shape at these sizes).
                  ref_options={"xla_gpu_autotune_level": 0} if device.platform == "gpu" else {},
                  xla_rows=tuple(args.xla_rows), started=started, budget_s=args.budget_s,
                  profile_calls=args.profile)
    commit, dirty = provenance(args.commit)
    env = {k: v for k, v in os.environ.items() if k in ("CUDA_VISIBLE_DEVICES", "XLA_FLAGS") or
           k.startswith("XLA_PYTHON_CLIENT_")}
    data = {
        "meta": {
            "device": f"{len(jax.devices())} x {device.device_kind}", "platform": device.platform,
            "compute_capability": None if interpret else cc, "interpret": interpret, "smoke": args.smoke,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": "python " + shlex.join(sys.argv), "env": env, "commit": commit, "dirty": dirty,
            "versions": versions(have_torch), "shape": shape,
            "timing": TIMING.format(windows=args.windows, iters=args.iters, xla_iters=args.xla_iters,
                                    torch_runs=args.torch_runs),
            "correctness": CORRECTNESS.format(max_err=args.max_err),
            "max_err": args.max_err, "args": {k: str(v) if isinstance(v, pathlib.Path) else v
                                              for k, v in vars(args).items()},
            "skipped": [], "group_sizes": {},
        },
        "steps": [], "gemms": [], "layers": [], "targets": [], "anchors": [],
    }
    save = lambda: write(args.out, data, with_plot=False)  # noqa: E731
    print(f"{data['meta']['device']}, commit {commit}, {data['meta']['versions']}", flush=True)

    from moe_jax import MoEConfig, ResolutionError, resolve  # noqa: PLC0415

    config = MoEConfig.kimi_k2(num_experts=shape["experts"], top_k=shape["top_k"], hidden_size=shape["hidden"],
                               expert_intermediate_size=shape["intermediate"], interpret=interpret)
    formats = ([] if args.skip_bf16_steps else ["bf16"]) + (["nvfp4"] if args.nvfp4 else [])
    routings = ["uniform"] + (["zipf"] if args.skewed else [])
    plans = {}
    for fmt in formats:
        plans[fmt] = {}
        for impl in ("xla", "pallas") + (("triton",) if not interpret else ()):
            try:
                plans[fmt][impl] = resolve(dataclasses.replace(config, weight_format=fmt, expert_gemm=impl),
                                           [device], training=True)
            except ResolutionError as err:
                plans[fmt][impl] = err

    def make_case(fmt, weights, rows, routing):
        rng = np.random.default_rng([args.seed, rows, ROUTINGS.index(routing)])
        sizes = grouped_gemm.group_sizes(rows, routing, rng, experts=shape["experts"])
        data["meta"]["group_sizes"][f"{routing} M={rows}"] = sizes.tolist()
        key = jax.random.key(args.seed * 7919 + rows)
        x = jax.random.normal(key, (rows, shape["hidden"]), jnp.bfloat16)
        dy = jax.random.normal(jax.random.fold_in(key, 1), (rows, shape["hidden"]), jnp.bfloat16)
        return Case(rows, fmt, routing, sizes, x, dy, weights, padded_layout(sizes))

    # Pallas and torch first, xla (slow) after all of them, so that a budget cuts what matters least.
    for fmt in formats:
        weights = make_weights(shape, fmt, args.seed)
        for rows in args.rows:
            for routing in routings:
                if ctx.over_budget():
                    data["meta"]["skipped"].append(f"{fmt} {routing} M={rows} (--budget-s spent)")
                    continue
                case = make_case(fmt, weights, rows, routing)
                print(f"{case.tag} (active experts {case.keys['active_experts']}, largest group "
                      f"{case.keys['max_group']}) at {time.time() - started:.0f}s", flush=True)
                if not any(a["rows"] == rows and a["grads"] == anchor_grads(fmt) for a in data["anchors"]):
                    data["anchors"].append(anchor_row(case, shape, ctx))
                data["steps"] += step_rows(case, shape, ctx, plans[fmt])
                save()
                if not args.skip_gemms:
                    if ctx.over_budget():
                        data["meta"]["skipped"].append(f"GEMMs {case.tag} (--budget-s spent)")
                    else:
                        data["gemms"] += gemm_rows(case, shape, ctx)
                        save()
                del case
        del weights
    for fmt in formats:
        weights = make_weights(shape, fmt, args.seed)
        for rows in [r for r in args.rows if r in ctx.xla_rows]:
            for routing in routings:
                if ctx.over_budget():
                    data["meta"]["skipped"].append(f"xla step {fmt} {routing} M={rows} (--budget-s spent)")
                    continue
                case = make_case(fmt, weights, rows, routing)
                pallas_row = next((r for r in data["steps"] if r["impl"] == "pallas" and all(
                    r[k] == case.keys[k] for k in ("weights", "routing", "rows"))), None)
                data["steps"].append(xla_step_row(case, shape, ctx, plans[fmt], pallas_row))
                save()
                del case
        del weights
    if args.layer:
        layer_rows(args, shape, ctx, data["layers"], save)
    data["meta"]["wall_s"] = time.time() - started
    table = write(args.out, data, with_plot=True)
    print(table)
    print(f"done in {time.time() - started:.0f}s")


if __name__ == "__main__":
    main()
