"""``moe-jax selftest``: every implementation that can run here, stage and whole layer, against float64.

For users on hardware this project cannot run (an RTX PRO 6000, a B200): one command checks the
native path and every other one resolution would consider, and prints a report to paste into a
bug report (``--json``: the same as one JSON document). It starts with a header: the device,
the versions, the seed, and what ``auto`` resolves Kimi K2 with NVFP4 experts to here. Then,
for each weight format and each registered expert GEMM whose capability check passes here
(inference), at a small shape and, for NVFP4, at Kimi K2's full size (384 experts, hidden 7168,
intermediate 2048):

* ``experts``: the expert MLP stage alone (gate/up, SwiGLU, down) on rows sorted by expert, the
  rows on chosen experts (at full size 0..7, 191, 292, 293 and 376..383: the lowest and highest
  ids, expert 293 being the first whose packed down weights start past 2**31 bytes);
* ``layer``: the whole :func:`moe_jax.moe_forward` (router, dispatch, experts, combine, one
  shared expert) of a Kimi-K2-style config (sigmoid scores, a correction bias, the routed
  scaling factor, a shared expert; at the small shape group-limited, 3 of 4 groups) on one
  device and, where several devices are visible and divide the experts, on a mesh of all of
  them with every exchange that can run there. At full size the correction bias sends every
  token to the experts listed above (it is 1 larger there than elsewhere, and scores are below
  1), which keeps the float64 reference to those experts' weights.

Each is compared with a float64 reference computed on the host from the same stored weights
(:mod:`moe_jax.float64_reference`, written from the model definitions), with the path's declared
numerics: bf16 activations, the SwiGLU output rounded to bf16 between the projections, and for
W4A4 (the native kernels on SM100/SM120) both routed projections' activations quantized to NVFP4
per row. Tokens within :data:`TIE` of a routing tie in float64 may legitimately route
differently and are left out of the layer comparison, counted in the report; a case with more
than half of its tokens left out fails. Weights, router, bias and activations are random (never
zeros), fresh per run unless a seed is given. Full-size cases run by default on accelerators
only: on a CPU they need tens of GB and minutes (the ``xla`` path dequantizes every expert).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import math
import platform
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_jax import float64_reference
from moe_jax.config import MoEConfig
from moe_jax.exchange import EXCHANGE
from moe_jax.expert_gemm import EXPERT_GEMM
from moe_jax.layer import moe_forward, random_params, shard_params
from moe_jax.resolve import ResolutionError, resolve, target_for
from pallas_kernels.grouped_matmul import reference

#: Relative Frobenius error allowed against the float64 reference. bf16 output rounding alone is
#: ~3e-3; W4A4 adds the rounding of the SwiGLU output, which the reference quantizes from its own
#: float64 values (a code can differ where the kernel's bf16 value sits on a rounding boundary).
TOLERANCE = {"w4a4": 5e-2, "other": 2e-2}

#: Tokens whose float64 selection margin (:class:`moe_jax.float64_reference.Routing`) is below
#: this are left out of the layer comparison. The layer's router logits are float32 (IEEE, precision
#: "highest"): summing 7168 products of unit scale in float32 errs by about 1e-6, so a margin of
#: 1e-4 chooses the same experts in both.
TIE = 1e-4

#: The routed experts' weight formats checked, in order (the shared expert's follows).
FORMATS = ("nvfp4", "bf16")

#: The distributions whose versions the header reports (None where not installed).
VERSIONED = ("jax", "jaxlib", "flax", "triton", "jax-triton", "moe-jax")


@dataclasses.dataclass(frozen=True)
class Shape:
    """A size to check at (see :func:`config` for the layer it makes)."""

    name: str
    experts: int
    hidden: int
    intermediate: int
    checked_experts: tuple[int, ...]  # the experts that get rows (stage) or tokens (layer)
    rows_per_expert: int  # stage: rows per checked expert, on average
    tokens: int  # layer: tokens per call
    groups: tuple[int, int] = (1, 1)  # layer: (num_groups, topk_groups)


SMALL = Shape("small", 16, 512, 256, tuple(range(16)), 24, 64, groups=(4, 3))
KIMI = Shape("kimi_k2", 384, 7168, 2048, (*range(0, 8), 191, 292, 293, *range(376, 384)), 16, 128)


@dataclasses.dataclass
class Result:
    """One checked case. ``compared`` counts the rows (``experts``) or tokens (``layer``) compared;
    ``excluded`` the layer's tokens left out near a routing tie."""

    check: str  # "experts" (the expert MLP stage) or "layer" (moe_forward)
    implementation: str
    mode: str
    exchange: str  # the layer's; "-" for the stage
    devices: int
    capability: str
    shape: str
    weights: str
    error: float
    tolerance: float
    ms: float
    compared: int = 0
    excluded: int = 0
    failure: str = ""

    @property
    def passed(self) -> bool:
        return not self.failure and self.error < self.tolerance


def config(shape: Shape, fmt: str, **fields) -> MoEConfig:
    """The Kimi-K2-style layer of ``shape`` with ``fmt`` experts (and shared expert)."""
    return MoEConfig.kimi_k2(num_experts=shape.experts, top_k=min(8, shape.experts), hidden_size=shape.hidden,
                             expert_intermediate_size=shape.intermediate, num_groups=shape.groups[0],
                             topk_groups=shape.groups[1], weight_format=fmt, **fields)


def _mode(name: str, fmt: str, capability: int | None) -> str:
    if fmt == "bf16":
        return "tiled einsum" if name == "xla" else "bf16"
    if name == "triton" and capability is not None:
        return "w4a4" if capability >= 100 else "w4a16"
    return {"pallas": "w4a16" if capability else "-", "xla": "dequantize + tiled einsum"}.get(name, "-")


def _failure(err: Exception) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"


def _timed(fn, iters: int):
    """``(first output, median ms of iters more calls)``."""
    out = jax.block_until_ready(fn())
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return out, float(np.median(times)) * 1e3


def _relative_error(y: np.ndarray, ref: np.ndarray) -> float:
    got = np.nan_to_num(y, nan=1e30, posinf=1e30, neginf=-1e30)
    return math.sqrt(float(np.sum((got - ref) ** 2)) / float(np.sum(ref**2)))


def check(name: str, shape: Shape, fmt: str, weights: dict, device, rng: np.random.Generator, *,
          iters: int = 3) -> Result:
    """The expert MLP stage of implementation ``name`` at ``shape`` in ``fmt`` on ``device``, with
    ``weights`` (``params["experts"]`` of :func:`config`'s layer, on ``device``).

    Raises:
      ResolutionError: ``name`` cannot run there (with the implementation's reason).
    """
    plan = resolve(config(shape, fmt, expert_gemm=name), [device])
    cc = plan.target.compute_capability
    mode = _mode(name, fmt, cc)
    sizes = np.zeros(shape.experts, np.int32)
    sizes[list(shape.checked_experts)] = rng.integers(1, 2 * shape.rows_per_expert, len(shape.checked_experts))
    padding = 7
    rows = int(sizes.sum()) + padding
    result = Result(check="experts", implementation=name, mode=mode, exchange="-", devices=1,
                    capability=f"SM{cc}" if cc else plan.target.platform, shape=shape.name, weights=fmt,
                    error=math.inf, tolerance=TOLERANCE["w4a4" if mode == "w4a4" else "other"], ms=math.nan,
                    compared=int(sizes.sum()))
    with jax.default_device(device):
        x = jnp.asarray(rng.standard_normal((rows, shape.hidden)), jnp.bfloat16)
        stage = jax.jit(lambda x, g, w: EXPERT_GEMM[name].run(x, g, w, plan))
        try:
            y, result.ms = _timed(lambda: stage(x, jnp.asarray(sizes), weights), iters)
        except Exception as err:  # noqa: BLE001 -- a failing implementation is the result to report.
            result.failure = _failure(err)
            return result
    y64 = np.asarray(jax.device_get(y.astype(jnp.float32)), np.float64)
    x64 = np.asarray(jax.device_get(x.astype(jnp.float32)), np.float64)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    ref = np.concatenate([
        float64_reference.expert_mlp(x64[starts[e]:starts[e + 1]], reference.expert_weight(weights["w_gate_up_egh"], e),
                                     reference.expert_weight(weights["w_down_ehf"], e), w4a4=mode == "w4a4")
        for e in shape.checked_experts])
    result.error = _relative_error(np.concatenate([y64[starts[e]:starts[e + 1]] for e in shape.checked_experts]), ref)
    return result


@dataclasses.dataclass(frozen=True)
class LayerCase:
    """One ``layer`` case: an expert GEMM and an exchange, on one device or on ``mesh``."""

    implementation: str
    exchange: str
    mesh: jax.sharding.Mesh | None = None

    def label(self, shape: Shape, fmt: str) -> str:
        where = f", {self.mesh.size} devices" if self.mesh is not None else ""
        return f"layer {self.implementation} {fmt} {shape.name}{where}, exchange {self.exchange}"


def random_layer_params(shape: Shape, fmt: str, device, rng: np.random.Generator) -> dict:
    """Random parameters of :func:`config`'s layer on ``device``, drawn in the stored format (no
    float32 copy at Kimi K2 size), with a correction bias large enough to change the choice
    (scores are spread over ~0.2), and 1 larger on ``shape.checked_experts`` when those are not
    all experts (sigmoid scores lie in (0, 1): every token then chooses among them)."""
    with jax.default_device(device):
        params = random_params(config(shape, fmt), jax.random.key(int(rng.integers(1 << 31))))
    bias_e = rng.normal(0.0, 0.1, shape.experts)
    if len(shape.checked_experts) < shape.experts:
        bias_e[list(shape.checked_experts)] += 1.0
    params["router"]["bias_e"] = jax.device_put(jnp.asarray(bias_e, jnp.float32), device)
    return params


def check_layer(shape: Shape, fmt: str, params: dict, cases: list[LayerCase], device, rng: np.random.Generator, *,
                step: Callable[[str], None] = lambda label: None, iters: int = 3,
                ) -> tuple[list[Result], list[tuple[str, str]]]:
    """Runs :func:`moe_jax.moe_forward` for each of ``cases`` on ``params`` and one batch of random
    tokens, and compares every output with the one float64 reference of those weights.

    Args:
      shape, fmt: the layer (:func:`config`) and its weight format.
      params: its parameters on ``device`` (:func:`random_layer_params`).
      cases: the expert GEMM and exchange of each run; those without a mesh run on ``device``.
      device: where the tokens are made (a mesh case gets them and ``params`` resharded).
      rng: the source of every random number.
      step: called with each case's label before it resolves.

    Returns:
      ``(results, not_run)``: a :class:`Result` per case that resolution accepts, and
      ``(label, resolution's reason)`` for the others.
    """
    base = config(shape, fmt)
    plans, not_run = [], []
    for case in cases:
        label = case.label(shape, fmt)
        step(label)
        try:
            plans.append((case, resolve(dataclasses.replace(base, expert_gemm=case.implementation,
                                                            exchange=case.exchange),
                                        case.mesh if case.mesh is not None else [device])))
        except ResolutionError as err:
            not_run.append((label, str(err)))
    if not plans:
        return [], not_run
    with jax.default_device(device):
        x_th = jnp.asarray(rng.standard_normal((shape.tokens, shape.hidden)), jnp.bfloat16)
    forward = jax.jit(moe_forward, static_argnums=2)
    on_mesh = {}  # mesh -> (params, x_th) placed on it, made once for all its cases
    runs = []
    for case, plan in plans:
        cc = plan.target.compute_capability
        mode = _mode(case.implementation, fmt, cc)
        result = Result(check="layer", implementation=case.implementation, mode=mode, exchange=plan.exchange,
                        devices=plan.target.num_devices, capability=f"SM{cc}" if cc else plan.target.platform,
                        shape=shape.name, weights=fmt, error=math.inf,
                        tolerance=TOLERANCE["w4a4" if mode == "w4a4" else "other"], ms=math.nan)
        y = None
        try:
            args = (params, x_th)
            if case.mesh is not None:
                if case.mesh not in on_mesh:
                    on_mesh[case.mesh] = (shard_params(params, plan),
                                          jax.device_put(x_th, NamedSharding(case.mesh, P())))
                args = on_mesh[case.mesh]
            (y, _), result.ms = _timed(lambda args=args, plan=plan: forward(*args, plan), iters)
            y = np.asarray(jax.device_get(y.astype(jnp.float32)), np.float64)
        except Exception as err:  # noqa: BLE001 -- a failing implementation is the result to report.
            result.failure = _failure(err)
        runs.append((result, y))
    del on_mesh
    modes = tuple({result.mode == "w4a4" for result, y in runs if y is not None})
    if not modes:  # nothing ran: no reference to compute (at full size, seconds of dequantization)
        return [result for result, _ in runs], not_run
    x64_th = np.asarray(jax.device_get(x_th.astype(jnp.float32)), np.float64)
    refs, routing = float64_reference.layer(params, x64_th, base, w4a4=modes)
    clear_t = routing.margin_t >= TIE
    for result, y in runs:
        if y is None:
            continue
        result.compared, result.excluded = int(clear_t.sum()), int((~clear_t).sum())
        if result.excluded > shape.tokens // 2:
            result.failure = (f"{result.excluded} of {shape.tokens} tokens within {TIE:g} of a routing tie; "
                              "expected at most half")
            continue
        result.error = _relative_error(y[clear_t], refs[result.mode == "w4a4"][clear_t])
    return [result for result, _ in runs], not_run


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


#: The config whose resolution the header reports: Kimi K2 with NVFP4 experts, every choice ``auto``.
REPORTED_CONFIG = MoEConfig.kimi_k2(weight_format="nvfp4")


def header(seed: int, full_size: bool) -> dict:
    """The device, the versions, the seed and what ``auto`` resolves :data:`REPORTED_CONFIG` to
    on this machine's devices (a mesh of all of them where they divide its experts)."""
    devices = jax.devices()
    device = devices[0]
    target = ([device] if len(devices) == 1 or REPORTED_CONFIG.num_experts % len(devices)
              else jax.make_mesh((len(devices),), (REPORTED_CONFIG.expert_axis,), devices=devices))
    try:
        report = resolve(REPORTED_CONFIG, target).report
    except ResolutionError as err:
        report = f"cannot resolve: {err}"
    return {
        "device_kind": device.device_kind,
        "platform": device.platform,
        "compute_capability": target_for([device], REPORTED_CONFIG).compute_capability,
        "num_devices": len(devices),
        "platform_version": " ".join(device.client.platform_version.split()),
        "versions": {"python": platform.python_version(), **{name: _version(name) for name in VERSIONED}},
        "seed": seed,
        "full_size": full_size,
        "resolution_report": report,
    }


@dataclasses.dataclass
class Report:
    """What :func:`run` found: :func:`header`'s fields, the results, notes on the cases left out
    as a whole (full size, expert parallelism), and each case resolution refused, with its reason."""

    header: dict
    results: list[Result]
    notes: list[str]
    not_run: list[tuple[str, str]]  # (case, resolution's reason)

    @property
    def passed(self) -> bool:
        return bool(self.results) and all(r.passed for r in self.results)

    def summary(self) -> str:
        failed = [r for r in self.results if not r.passed]
        if not self.results:
            return "FAILED: no implementation could run here"
        if failed:
            return f"FAILED: {len(failed)} of {len(self.results)} checks"
        return f"all {len(self.results)} checks passed"

    def text(self) -> str:
        """The report in markdown: header lines, the table, then what did not run, grouped by reason."""
        h = self.header
        cc = f", SM{h['compute_capability']}" if h["compute_capability"] is not None else ""
        versions = ", ".join(f"{name} {v or 'not installed'}" for name, v in h["versions"].items())
        lines = [
            f"moe-jax selftest on {h['num_devices']} x {h['device_kind']} ({h['platform']}{cc}), seed {h['seed']}",
            f"versions: {versions}; backend {h['platform_version']}",
            "auto resolves Kimi K2 with NVFP4 experts (MoEConfig.kimi_k2(weight_format='nvfp4')) here to:",
            h["resolution_report"], "", table(self.results),
        ]
        if self.notes or self.not_run:
            by_reason: dict[str, int] = {}
            for _, why in self.not_run:
                by_reason[why] = by_reason.get(why, 0) + 1
            lines += ["", "Not run here:", *(f"- {note}" for note in self.notes)]
            lines += [f"- {why} ({n} case{'s' * (n > 1)})" for why, n in by_reason.items()]
        return "\n".join(lines)

    def document(self) -> dict:
        """The report as one JSON-serializable dict (non-finite numbers as null)."""
        def finite(v):
            return None if isinstance(v, float) and not math.isfinite(v) else v

        results = [{**{k: finite(v) for k, v in dataclasses.asdict(r).items()}, "passed": r.passed}
                   for r in self.results]
        return {**self.header, "results": results,
                "notes": self.notes, "not_run": [{"case": case, "why": why} for case, why in self.not_run],
                "passed": self.passed, "summary": self.summary()}


def table(results: list[Result]) -> str:
    header_row = ("| check | implementation | mode | exchange | devices | capability | shape | weights | compared | "
                  "rel. error | tolerance | result | time (ms) |")
    lines = [header_row, "|" + " --- |" * 13]
    for r in results:
        verdict = "PASS" if r.passed else f"FAIL{': ' + r.failure if r.failure else ''}"
        compared = (f"{r.compared} rows" if r.check == "experts"
                    else f"{r.compared} tokens ({r.excluded} near a tie left out)")
        lines.append(f"| {r.check} | {r.implementation} | {r.mode} | {r.exchange} | {r.devices} | {r.capability} | "
                     f"{r.shape} | {r.weights} | {compared} | {r.error:.2e} | {r.tolerance:.0e} | {verdict} | "
                     f"{r.ms:.2f} |")
    return "\n".join(lines)


def expert_parallel_meshes(devices: list, shapes: list[Shape]) -> tuple[dict[Shape, jax.sharding.Mesh], list[str]]:
    """``(meshes, notes)``: an expert-parallel mesh of all ``devices`` for each shape whose experts
    they divide, and a line for each shape (or, with one device, for all) that gets none."""
    if len(devices) == 1:
        return {}, [f"expert-parallel layer cases: one {devices[0].platform} device here; they run on a mesh of "
                    "all devices where there are several"]
    meshes, notes = {}, []
    for shape in shapes:
        if shape.experts % len(devices):
            notes.append(f"expert-parallel {shape.name} layer cases: the {len(devices)} devices here do not divide "
                         f"its {shape.experts} experts")
        else:
            meshes[shape] = jax.make_mesh((len(devices),), (config(shape, "bf16").expert_axis,), devices=devices)
    return meshes, notes


def run(*, full: bool | None = None, seed: int | None = None,
        progress: Callable[[str, int], None] | None = None) -> Report:
    """Every check that can run here (module docstring).

    Args:
      full: run the full-size cases (True), skip them (False), or run them on accelerators only (None).
      seed: of every random number; None draws one (the header reports it).
      progress: called with each case's label and the number of cases, before the case.
    """
    devices = jax.devices()
    device = devices[0]
    seed = int(np.random.SeedSequence().entropy % (2**31)) if seed is None else seed
    rng = np.random.default_rng(seed)
    full_size = device.platform != "cpu" if full is None else full
    notes = []
    if not full_size:
        notes.append(f"full-size ({KIMI.name}) cases: " + (
            "skipped (--quick)" if full is False else
            "off by default on CPU (tens of GB and minutes: the xla path dequantizes all 384 experts); "
            "--full runs them"))
    groups = [(fmt, shape) for fmt in FORMATS
              for shape in ((SMALL, KIMI) if full_size and fmt == "nvfp4" else (SMALL,))]
    meshes, ep_notes = expert_parallel_meshes(devices, list(dict.fromkeys(shape for _, shape in groups)))
    notes += ep_notes
    names = EXPERT_GEMM.names()
    layer_cases = {shape: [LayerCase(name, "none") for name in names]
                   + [LayerCase(name, exchange, meshes[shape]) for name in names for exchange in EXCHANGE.names()
                      if shape in meshes] for _, shape in groups}
    total = sum(len(names) + len(layer_cases[shape]) for _, shape in groups)

    def step(label):
        if progress is not None:
            progress(label, total)

    results, not_run = [], []
    for fmt, shape in groups:
        # One draw for every case of the group: at Kimi K2 size the weights take 10 GB.
        params = random_layer_params(shape, fmt, device, rng)
        for name in names:
            label = f"experts {name} {fmt} {shape.name}"
            step(label)
            try:
                results.append(check(name, shape, fmt, params["experts"], device, rng))
            except ResolutionError as err:
                not_run.append((label, str(err)))
        layer_results, layer_not_run = check_layer(shape, fmt, params, layer_cases[shape], device, rng, step=step)
        results += layer_results
        not_run += layer_not_run
        del params
    return Report(header(seed, full_size), results, notes, not_run)
