"""What W4A8 (FP8 activations, NVFP4 weights on Hopper's FP8 tensor cores) would cost in accuracy,
measured on the CPU against float64, beside the W4A16 path SM90 runs today and the W4A4 path of
SM100/SM120.

The expert MLP ``down(silu(x W_gate^T) * (x W_up^T))`` of a few experts at Kimi K2's projections
(hidden 7168, intermediate 2048), its NVFP4 weights from ``moe_jax.nvfp4.quantize``. Every variant
is computed in float64 from the values its kernel would multiply, so the errors are those of the
operands' rounding alone (accumulation in float32 adds ~1e-6):

* ``w4a16``: bf16 activations (the SwiGLU output rounded to bf16), weights exact (``code * scale``
  is exact in bf16, the global scale applied to the accumulator): what the W4A16 kernels compute.
* ``w4a8 (weights exact)``: activations E4M3 with one float32 scale per row (``amax / 448``), the
  weights exact. A kernel cannot reach this one on FP8 tensor cores: an ``m64nNk32`` FP8 MMA sums
  over two 16-element blocks whose scales differ, so the block scale cannot be applied after it
  without halving the MMA's useful work. It bounds what FP8 activations cost.
* ``w4a8 (scales folded)``: the same activations, each weight ``code * scale`` rounded to E4M3
  (an E2M1 code has 2 significant bits, an E4M3 scale 4, their product up to 5: one bit rounded),
  a power of two per expert taken out so the largest fits, the rest on the accumulator: what an
  FP8 kernel that dequantizes into FP8 registers would multiply.
* ``w4a4``: activations NVFP4 per row (``nvfp4.quantize_rows``, each row's own amax), weights
  exact: what the SM100/SM120 kernels compute.

For scale, the last column is the error every variant starts from: the float64 MLP on the NVFP4
weights against the same MLP on the float32 masters they were quantized from.

Activations: Gaussian, and Gaussian with 1% of the channels 30x larger (the outlier channels of
LLM activations, which per-row scales serve worst).

    python benchmarks/w4a8_numerics.py --out benchmarks/results/w4a8_numerics_cpu
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from moe_jax import nvfp4

HIDDEN, INTERMEDIATE = 7168, 2048
E4M3_MAX = 448.0
VARIANTS = ("w4a16", "w4a8 (weights exact)", "w4a8 (scales folded)", "w4a4")
MASTERS = "NVFP4 weights against their masters"


def round_bf16(a: np.ndarray) -> np.ndarray:
    return a.astype(ml_dtypes.bfloat16).astype(np.float64)


def round_e4m3(a: np.ndarray) -> np.ndarray:
    """Round to nearest even in float8_e4m3fn; ``a`` must lie within +-448."""
    assert np.abs(a).max() <= E4M3_MAX, np.abs(a).max()
    return a.astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def fp8_rows(a_mk: np.ndarray) -> np.ndarray:
    """``a_mk`` as E4M3 with one float32 scale per row (``amax / 448``), dequantized."""
    scale_m = (np.abs(a_mk).max(axis=1, keepdims=True) / E4M3_MAX).astype(np.float32).astype(np.float64)
    scale_m = np.where(scale_m > 0, scale_m, 1.0)
    return round_e4m3(np.clip(a_mk / scale_m, -E4M3_MAX, E4M3_MAX)) * scale_m


def nvfp4_rows(a_mk: np.ndarray) -> np.ndarray:
    """``a_mk`` as NVFP4 per row (the W4A4 kernels' activations), dequantized."""
    packed, scales, global_m = nvfp4.quantize_rows(jnp.asarray(a_mk, jnp.float32))
    t = nvfp4.NVFP4Tensor(packed=packed, scales=scales, global_scale=global_m)
    return np.asarray(nvfp4.dequantize(t), np.float64)


def weights(t: nvfp4.NVFP4Tensor) -> tuple[np.ndarray, np.ndarray]:
    """``(exact, folded)`` float64 ``[N, K]`` of one expert's NVFP4 weight: ``code * scale *
    global`` exactly, and with ``code * scale`` rounded to E4M3 after a power of two per expert
    moves its largest value within range."""
    exact = np.asarray(nvfp4.dequantize(t), np.float64)
    global_scale = float(np.asarray(t.global_scale).reshape(-1)[0])
    code_scale = exact / global_scale  # code * block scale, exact in float64
    shift = 2.0 ** max(0, int(np.ceil(np.log2(np.abs(code_scale).max() / E4M3_MAX))))
    return exact, round_e4m3(code_scale / shift) * shift * global_scale


def swiglu(h: np.ndarray) -> np.ndarray:
    gate, up = np.split(h, 2, axis=-1)
    return gate / (1.0 + np.exp(-gate)) * up


def expert_outputs(x_mk, w_gate_up, w_down) -> dict[str, np.ndarray]:
    """Each variant's output of one expert for bf16 rows ``x_mk`` (float64 values)."""
    gate_up_exact, gate_up_folded = weights(w_gate_up)
    down_exact, down_folded = weights(w_down)
    out = {"float64": swiglu(x_mk @ gate_up_exact.T) @ down_exact.T}
    out["w4a16"] = round_bf16(swiglu(x_mk @ gate_up_exact.T)) @ down_exact.T
    a = swiglu(fp8_rows(x_mk) @ gate_up_exact.T)
    out["w4a8 (weights exact)"] = fp8_rows(round_bf16(a)) @ down_exact.T
    a = swiglu(fp8_rows(x_mk) @ gate_up_folded.T)
    out["w4a8 (scales folded)"] = fp8_rows(round_bf16(a)) @ down_folded.T
    a = swiglu(nvfp4_rows(x_mk) @ gate_up_exact.T)
    out["w4a4"] = nvfp4_rows(round_bf16(a)) @ down_exact.T
    return out


def activations(rng, rows: int, hidden: int, outliers: bool) -> np.ndarray:
    x = rng.standard_normal((rows, hidden))
    if outliers:
        x[:, rng.choice(hidden, hidden // 100, replace=False)] *= 30.0
    return round_bf16(x)


def measure(*, experts: int, rows: int, seed: int, hidden: int = HIDDEN,
            intermediate: int = INTERMEDIATE) -> list[dict]:
    """Relative Frobenius error against float64 per variant and activation kind, over ``experts``
    experts of ``rows`` rows each."""
    rng = np.random.default_rng(seed)
    results = []
    for outliers in (False, True):
        sq_err = dict.fromkeys((*VARIANTS, MASTERS), 0.0)
        sq_ref = sq_master = 0.0
        for e in range(experts):
            key = jax.random.key(seed * 1000 + e)
            k1, k2 = jax.random.split(key)
            master_gate_up = jax.random.normal(k1, (2 * intermediate, hidden)) / np.sqrt(hidden)
            master_down = jax.random.normal(k2, (hidden, intermediate)) / np.sqrt(intermediate)
            x_mk = activations(rng, rows, hidden, outliers)
            out = expert_outputs(x_mk, nvfp4.quantize(master_gate_up), nvfp4.quantize(master_down))
            masters = (swiglu(x_mk @ np.asarray(master_gate_up, np.float64).T)
                       @ np.asarray(master_down, np.float64).T)
            sq_ref += float(np.sum(out["float64"] ** 2))
            sq_master += float(np.sum(masters ** 2))
            for name in VARIANTS:
                sq_err[name] += float(np.sum((out[name] - out["float64"]) ** 2))
            sq_err[MASTERS] += float(np.sum((out["float64"] - masters) ** 2))
        sq_err[MASTERS] *= sq_ref / sq_master  # relative to the masters' output, not the NVFP4 one
        for name in (*VARIANTS, MASTERS):
            results.append({"activations": "outlier channels" if outliers else "gaussian", "variant": name,
                            "relative_error": (sq_err[name] / sq_ref) ** 0.5})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--rows", type=int, default=128, help="rows per expert")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    results = measure(experts=args.experts, rows=args.rows, seed=args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "w4a8_numerics.json").write_text(json.dumps(results, indent=1))
    columns = (*VARIANTS, MASTERS)
    lines = ["| activations | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    for kind in ("gaussian", "outlier channels"):
        errors = {r["variant"]: r["relative_error"] for r in results if r["activations"] == kind}
        lines.append(f"| {kind} | " + " | ".join(f"{errors[v]:.2e}" for v in columns) + " |")
    (args.out / "w4a8_numerics.md").write_text(
        f"# W4A8 numerics against float64 (CPU)\n\n`python benchmarks/w4a8_numerics.py --out OUT --experts "
        f"{args.experts} --rows {args.rows} --seed {args.seed}`: the expert MLP of {args.experts} experts x "
        f"{args.rows} rows at Kimi K2's projections, relative Frobenius error of each variant's output against "
        "float64 on the same NVFP4 weights (the module docstring defines the variants).\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
