"""Run one Kimi K2 MoE layer for inference: from a ModelOpt NVFP4 checkpoint, or random NVFP4
weights at the published shape, with expert parallelism over the visible devices.

Prints the resolution report, the error against a float64 reference of the same stored
weights (for a sample of tokens: the reference dequantizes only the experts they use), and
tokens/s at decode and prefill sizes (median of timed windows after warm-up).

    python examples/infer_kimi_layer.py                               # random weights, every device
    python examples/infer_kimi_layer.py --checkpoint DIR --layer 3    # a layer of a checkpoint
    python examples/infer_kimi_layer.py --devices 1 --tokens 32 8192  # one device, two sizes
    python examples/infer_kimi_layer.py --preset deepseek_v3
    python examples/infer_kimi_layer.py --reduced                     # a small layer (CPU, tests)

A checkpoint directory is Hugging Face style: config.json (with ``quantization_config``, or
an ``hf_quant_config.json`` beside it) and ``model.safetensors`` or sharded safetensors with
``model.safetensors.index.json``. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import moe_jax
import sharding
from moe_jax.cli import positive_int

#: A layer small enough for a CPU: the Kimi K2 router rule at 1/12 of its width.
REDUCED = dict(num_experts=64, top_k=8, hidden_size=512, expert_intermediate_size=256)
REFERENCE_TOKENS = 8


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--checkpoint", type=pathlib.Path, help="a Hugging Face-style checkpoint directory")
    parser.add_argument("--layer", type=int, help="the MoE layer to load (with --checkpoint)")
    parser.add_argument("--preset", choices=moe_jax.MoEConfig.PRESETS, default="kimi_k2",
                        help="the layer's shape without --checkpoint")
    parser.add_argument("--reduced", action="store_true", help=f"a reduced layer ({REDUCED}) for CPUs")
    parser.add_argument("--tokens", type=positive_int, nargs="+", default=[32, 8192], help="token counts to time")
    parser.add_argument("--devices", type=positive_int, help="devices for expert parallelism (default: all)")
    parser.add_argument("--iters", type=positive_int, default=10, help="calls per timed window (5 windows)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--expert-gemm", default="auto",
                        help="expert GEMM implementation ('auto' or one of moe_jax.EXPERT_GEMM.names())")
    args = parser.parse_args(argv)
    if (args.checkpoint is None) != (args.layer is None):
        parser.error("--checkpoint and --layer go together")
    if args.checkpoint is not None and args.reduced:
        parser.error("--reduced is for random weights; a checkpoint has its own shape")
    if args.checkpoint is not None and not args.checkpoint.is_dir():
        parser.error(f"--checkpoint: {args.checkpoint} is not a directory")
    available = len(jax.devices())
    if args.devices is not None and args.devices > available:
        parser.error(f"--devices: {args.devices}, but only {available} devices are visible")
    return args


def expert_parallel_mesh(config: moe_jax.MoEConfig, devices: int) -> jax.sharding.Mesh | None:
    """A mesh over ``devices`` devices (data x expert), or None for one device.

    The expert axis takes the largest count that divides both the devices and the experts.
    """
    if devices == 1:
        return None
    ep = max(d for d in range(1, devices + 1) if devices % d == 0 and config.num_experts % d == 0)
    return sharding.make_mesh(ep, data_parallel=devices // ep, devices=jax.devices()[:devices])


def timed(forward, params, x, iters: int, windows: int = 5) -> float:
    """Median seconds per call over ``windows`` windows of ``iters`` back-to-back calls."""
    jax.block_until_ready(forward(params, x))
    per_call = []
    for _ in range(windows):
        start = time.perf_counter()
        for _ in range(iters):
            out = forward(params, x)
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - start) / iters)
    return statistics.median(per_call)


def main(argv=None) -> dict:
    """Returns ``{"error": relative error, "tokens_per_s": {tokens: rate}}``."""
    args = parse_args(argv)
    devices = args.devices or len(jax.devices())
    key = jax.random.key(args.seed)
    if args.checkpoint is not None:
        mesh = expert_parallel_mesh(moe_jax.MoEConfig.from_hf_config(args.checkpoint), devices)
        config, params = moe_jax.load_moe_layer(args.checkpoint, args.layer, mesh=mesh)
        config = dataclasses.replace(config, expert_gemm=args.expert_gemm)
        plan = moe_jax.resolve(config, mesh, tokens_per_device=max(args.tokens) // devices)
    else:
        config = getattr(moe_jax.MoEConfig, args.preset)(weight_format="nvfp4", expert_gemm=args.expert_gemm,
                                                         **(REDUCED if args.reduced else {}))
        plan = moe_jax.resolve(config, expert_parallel_mesh(config, devices), tokens_per_device=max(args.tokens) // devices)
        params = moe_jax.random_params(config, key, plan)
    print(plan.report)
    forward = jax.jit(lambda p, x: moe_jax.moe_forward(p, x, plan)[0])

    rates, error = {}, None
    for tokens in args.tokens:
        x = jax.random.normal(jax.random.fold_in(key, tokens), (tokens, config.hidden_size), jnp.bfloat16)
        seconds = timed(forward, params, x, args.iters)
        rates[tokens] = tokens / seconds
        print(f"{tokens:>6} tokens: {seconds * 1e3:8.2f} ms  {rates[tokens]:>12,.0f} tokens/s")
        if error is None:
            sample = np.random.default_rng(args.seed).choice(tokens, min(REFERENCE_TOKENS, tokens), replace=False)
            y = np.asarray(forward(params, x), np.float64)[sample]
            ref = moe_jax.reference_forward(params, np.asarray(x, np.float64)[sample], config)
            error = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
            print(f"relative error vs float64 reference of the stored weights ({len(sample)} tokens): {error:.2e}")
    return {"error": error, "tokens_per_s": rates}


if __name__ == "__main__":
    result = main()
    sys.exit(0 if result["error"] is not None and result["error"] < 2e-2 else 1)
