"""``moe-jax selftest``: every expert-GEMM implementation that can run here, against float64.

For users on hardware this project cannot run (an RTX PRO 6000, a B200): one command checks the
native path and every other one resolution would consider, and prints a table to paste into a
bug report. For each weight format and each registered implementation whose capability check
passes on the local device (inference), it runs the expert MLP stage (gate/up, SwiGLU, down) at
a small shape and, for NVFP4, at Kimi K2's full size (384 experts, hidden 7168, intermediate
2048; rows routed to the lowest and highest expert ids, expert 383 included), and compares the
defined rows with a float64 reference computed on the host from the same stored weights.

The reference follows each path's declared numerics: bf16 activations, the SwiGLU output rounded
to bf16 between the projections, and for W4A4 (the native kernels on SM100/SM120) both
projections' activations quantized to NVFP4 per row by :func:`moe_jax.nvfp4.quantize_rows`, as
the kernels' inputs are. Weights and activations are random (never zeros), fresh per run.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax import nvfp4
from moe_jax.config import MoEConfig
from moe_jax.experts import EXPERT_GEMM
from moe_jax.layer import random_params
from moe_jax.resolve import ResolutionError, resolve
from pallas_kernels.grouped_matmul import reference

#: Relative Frobenius error allowed against the float64 reference. bf16 output rounding alone is
#: ~3e-3; W4A4 adds the rounding of the SwiGLU output, which the reference quantizes from its own
#: float64 values (a code can differ where the kernel's bf16 value sits on a rounding boundary).
TOLERANCE = {"w4a4": 5e-2, "other": 2e-2}


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    experts: int
    hidden: int
    intermediate: int
    checked_experts: tuple[int, ...]  # the experts that get rows (and are checked)
    rows_per_expert: int


SMALL = Shape("small", 16, 512, 256, tuple(range(16)), 24)
KIMI = Shape("kimi_k2", 384, 7168, 2048, (*range(0, 8), 191, 292, 293, *range(376, 384)), 16)


@dataclasses.dataclass
class Result:
    implementation: str
    mode: str
    capability: str
    shape: str
    weights: str
    error: float
    tolerance: float
    ms: float
    failure: str = ""

    @property
    def passed(self) -> bool:
        return not self.failure and self.error < self.tolerance


def _expert(w, e: int) -> np.ndarray:
    """Expert ``e`` of a bf16 or NVFP4 weight as float64 ``[N, K]`` (only that expert leaves the device)."""
    if isinstance(w, nvfp4.NVFP4Tensor):
        return reference.dequantize(*jax.device_get((w.packed[e:e + 1], w.scales[e:e + 1], w.global_scale[e:e + 1])))[0]
    return np.asarray(jax.device_get(w[e])).astype(np.float64)


def _as_nvfp4_rows(a_mk: np.ndarray) -> np.ndarray:
    """float64 rows quantized to NVFP4 per row (on the host CPU, the kernels' quantizer's bits)."""
    cpu = jax.devices("cpu")[0]
    packed, scales, g = jax.device_get(nvfp4.quantize_rows(jax.device_put(jnp.asarray(a_mk, jnp.float32), cpu)))
    return reference.dequantize(packed[:, None], scales[:, None], g)[:, 0]


def _bf16(a: np.ndarray) -> np.ndarray:
    return np.asarray(jnp.asarray(a, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)


def reference_rows(x_mh: np.ndarray, w_gate_up_gh: np.ndarray, w_down_hf: np.ndarray, w4a4: bool) -> np.ndarray:
    """One expert's rows in float64, with the path's quantization points (module docstring)."""
    x = _as_nvfp4_rows(x_mh) if w4a4 else x_mh
    gate, up = np.split(x @ w_gate_up_gh.T, 2, axis=-1)
    a = _bf16(gate / (1.0 + np.exp(-gate)) * up)
    if w4a4:
        a = _as_nvfp4_rows(a)
    return a @ w_down_hf.T


def _mode(name: str, capability: int | None) -> str:
    if name == "triton" and capability is not None:
        return "w4a4" if capability >= 100 else "w4a16"
    return {"pallas": "w4a16" if capability else "-", "xla": "dequantize + ragged_dot"}.get(name, "-")


def check(name: str, shape: Shape, fmt: str, device, rng: np.random.Generator, *, iters: int = 3) -> Result | None:
    """Runs implementation ``name`` at ``shape`` in ``fmt`` on ``device``; None if it cannot run there."""
    config = MoEConfig.kimi_k2(num_experts=shape.experts, top_k=min(8, shape.experts), hidden_size=shape.hidden,
                               expert_intermediate_size=shape.intermediate, weight_format=fmt, expert_gemm=name)
    try:
        plan = resolve(config, [device])
    except ResolutionError:
        return None
    cc = plan.target.compute_capability
    mode = _mode(name, cc) if fmt == "nvfp4" else ("bf16" if name != "xla" else "ragged_dot")
    sizes = np.zeros(shape.experts, np.int32)
    sizes[list(shape.checked_experts)] = rng.integers(1, 2 * shape.rows_per_expert, len(shape.checked_experts))
    padding = 7
    rows = int(sizes.sum()) + padding
    result = Result(name, mode, f"SM{cc}" if cc else plan.target.platform, shape.name, fmt, math.inf,
                    TOLERANCE["w4a4" if mode == "w4a4" else "other"], math.nan)
    with jax.default_device(device):
        # Drawn in the stored format where they will live (no float32 copy at Kimi K2 size).
        weights = random_params(config, jax.random.key(int(rng.integers(1 << 31))))["experts"]
        x = jnp.asarray(rng.standard_normal((rows, shape.hidden)), jnp.bfloat16)
        stage = jax.jit(lambda x, g, w: EXPERT_GEMM[name].run(x, g, w, plan))
        try:
            y = stage(x, jnp.asarray(sizes), weights)
            y.block_until_ready()
            times = []
            for _ in range(iters):
                start = time.perf_counter()
                stage(x, jnp.asarray(sizes), weights).block_until_ready()
                times.append(time.perf_counter() - start)
            result.ms = float(np.median(times)) * 1e3
        except Exception as err:  # noqa: BLE001 -- a failing implementation is the result to report.
            result.failure = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
            return result
    y64 = np.asarray(jax.device_get(y.astype(jnp.float32)), np.float64)
    x64 = np.asarray(jax.device_get(x.astype(jnp.float32)), np.float64)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    sq_err = sq_ref = 0.0
    for e in shape.checked_experts:
        ref = reference_rows(x64[starts[e]:starts[e + 1]], _expert(weights["w_gate_up_egh"], e),
                             _expert(weights["w_down_ehf"], e), mode == "w4a4")
        got = np.nan_to_num(y64[starts[e]:starts[e + 1]], nan=1e30, posinf=1e30, neginf=-1e30)
        sq_err += float(np.sum((got - ref) ** 2))
        sq_ref += float(np.sum(ref**2))
    result.error = math.sqrt(sq_err / sq_ref)
    return result


def table(results: list[Result]) -> str:
    header = "| implementation | mode | capability | shape | weights | rel. error | tolerance | result | time (ms) |"
    lines = [header, "|" + " --- |" * 9]
    for r in results:
        verdict = "PASS" if r.passed else f"FAIL{': ' + r.failure if r.failure else ''}"
        lines.append(f"| {r.implementation} | {r.mode} | {r.capability} | {r.shape} | {r.weights} | {r.error:.2e} | "
                     f"{r.tolerance:.0e} | {verdict} | {r.ms:.2f} |")
    return "\n".join(lines)


def run(*, full: bool = True, seed: int | None = None, progress=None) -> tuple[list[Result], str]:
    """Every (implementation, format, shape) that can run on ``jax.devices()[0]``; returns the
    results and a header line naming the device, versions and seed."""
    device = jax.devices()[0]
    seed = int(np.random.SeedSequence().entropy % (2**31)) if seed is None else seed
    rng = np.random.default_rng(seed)
    cases = [(name, fmt, shape) for fmt in ("nvfp4", "bf16") for shape in ((SMALL, KIMI) if full and fmt == "nvfp4"
             else (SMALL,)) for name in EXPERT_GEMM.names()]
    results = []
    for name, fmt, shape in cases:
        if progress is not None:
            progress(f"{name} {fmt} {shape.name}")
        result = check(name, shape, fmt, device, rng)
        if result is not None:
            results.append(result)
    header = (f"moe-jax selftest on {device.device_kind} ({device.platform}), jax {jax.__version__}, "
              f"python {sys.version.split()[0]}, seed {seed}")
    return results, header
