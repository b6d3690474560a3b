"""How much W4A4's activation quantization costs at Kimi K2's width, per ``MoEConfig.activation_scale``.

The ``xla`` reference's W4A4 mode (``reference_activations="nvfp4"``) quantizes the routed
experts' activations exactly as the SM100/SM120 kernels do; this script compares it, with
dynamic per-row scales and with static per-expert ``input_scale`` s, against the layer in
float64 (``moe_jax.layer.reference_forward``: the same NVFP4 weights, activations unquantized)
and against the W4A16 reference (bf16 activations). The weights are the same everywhere, so
every figure is the activations' part alone.

Kimi K2's routed experts (hidden 7168, expert intermediate 2048, top-8, sigmoid router with
correction bias, scaling 2.827) with 16 experts instead of 384 and no shared expert (its
activations are never quantized: it would only dilute the figures), NVFP4 weights quantized from
fan-in scaled normal ones, and tokens whose channels have log-normally distributed sizes
(sigma 0.7), as hidden states with outlier channels do. The static scales are calibrated as
ModelOpt's max calibration does, on other tokens of the same distribution: ``input_scale =
amax / (6 * 448)`` of each expert's inputs (gate/up: its tokens; down: their SwiGLU outputs), so
evaluation tokens beyond the calibrated range saturate.

Usage (CPU: about 90 s and 4 GB on two cores)::

    python3 benchmarks/activation_scale_error.py [--experts 16] [--tokens 64] [--calibration-tokens 256]
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from moe_jax import MoEConfig, moe_forward, nvfp4, resolve, router  # noqa: E402
from moe_jax.layer import reference_forward  # noqa: E402


def quantized_normal(rng, shape) -> nvfp4.NVFP4Tensor:
    """Fan-in scaled normal weights ``[E, N, K]`` quantized to NVFP4, one expert at a time (all at
    once would hold several float32 copies of every expert)."""
    parts = [jax.tree.map(np.asarray, nvfp4.quantize(jnp.asarray(rng.standard_normal(shape[1:], np.float32)
                                                                  / np.sqrt(shape[-1]))))
             for _ in range(shape[0])]
    return jax.tree.map(lambda *a: jnp.asarray(np.stack(a)), *parts)


def tokens(rng, n: int, channel_scale_h) -> jax.Array:
    return jnp.asarray(rng.standard_normal((n, channel_scale_h.size)) * channel_scale_h, jnp.bfloat16)


def calibrate(params, x, config) -> dict:
    """ModelOpt-style max calibration of the routed experts' ``input_scale`` on tokens ``x``."""
    x_th = np.asarray(x, np.float64)
    logits = x_th @ np.asarray(params["router"]["w_eh"], np.float64).T
    ids, _ = router.route(jnp.asarray(logits, jnp.float32), config, correction_bias_e=params["router"]["bias_e"])
    ids = np.asarray(ids)
    f = config.expert_intermediate_size
    amax_e2 = np.ones((config.num_experts, 2))  # an expert without tokens: any positive scale
    for e in np.unique(ids).tolist():
        rows = x_th[np.nonzero(ids == e)[0]]
        w = params["experts"]["w_gate_up_egh"]
        w_e = nvfp4.NVFP4Tensor(packed=w.packed[e], scales=w.scales[e], global_scale=w.global_scale[e])
        h = rows @ np.asarray(nvfp4.dequantize(w_e), np.float64).T
        a = h[:, :f] / (1 + np.exp(-h[:, :f])) * h[:, f:]
        amax_e2[e] = np.abs(rows).max(), np.abs(a).max()
    scale_e2 = (amax_e2 / (6 * 448)).astype(np.float32)
    return {"gate_e": jnp.asarray(scale_e2[:, 0]), "up_e": jnp.asarray(scale_e2[:, 0]),
            "down_e": jnp.asarray(scale_e2[:, 1])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--calibration-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    config = MoEConfig.kimi_k2(num_experts=args.experts, num_shared_experts=0, weight_format="nvfp4",
                               reference_activations="nvfp4")
    e, h, f = config.num_experts, config.hidden_size, config.expert_intermediate_size
    params = {
        "router": {"w_eh": jnp.asarray(rng.standard_normal((e, h), np.float32) / np.sqrt(h)),
                   "bias_e": jnp.asarray(rng.standard_normal(e) * 0.01, jnp.float32)},
        "experts": {"w_gate_up_egh": quantized_normal(rng, (e, 2 * f, h)), "w_down_ehf": quantized_normal(rng, (e, h, f))},
    }
    channel_scale_h = rng.lognormal(0, 0.7, config.hidden_size)
    params["input_scales"] = calibrate(params, tokens(rng, args.calibration_tokens, channel_scale_h), config)
    x = tokens(rng, args.tokens, channel_scale_h)
    exact = reference_forward(params, np.asarray(x, np.float64), config)

    def run(**overrides):
        c = dataclasses.replace(config, **overrides)
        return np.asarray(jax.jit(moe_forward, static_argnums=2)(params, x, resolve(c))[0], np.float64)

    def relative(a, b):
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))

    w4a16 = run(reference_activations="bf16")
    rows = {"W4A16 (bf16 activations)": w4a16, "W4A4 dynamic": run(activation_scale="dynamic"),
            "W4A4 checkpoint (calibrated)": run(activation_scale="checkpoint")}
    off = {name: v / 4 for name, v in params["input_scales"].items()}
    params = {**params, "input_scales": off}
    rows["W4A4 checkpoint (input_scale 4x too small)"] = run(activation_scale="checkpoint")
    print(f"Kimi K2's routed experts, {config.num_experts} of them, {args.tokens} tokens (calibrated on "
          f"{args.calibration_tokens}), seed {args.seed}: relative error (Frobenius)")
    print(f"{'':44s} {'vs float64':>11s} {'vs W4A16':>9s}")
    for name, y in rows.items():
        print(f"{name:44s} {relative(y, exact):11.3e} {relative(y, w4a16):9.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
