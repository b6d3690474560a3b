"""``moe-jax``: the demo and the resolution report.

  moe-jax demo                      reduced Kimi-shaped NVFP4 layer on whatever devices exist
  moe-jax explain --preset kimi_k2  what would run here, and why the rest would not
  moe-jax explain --preset kimi_k2 --device-kind "NVIDIA RTX PRO 6000 Blackwell Workstation Edition" --ep 4
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractDevice, AbstractMesh

from moe_jax.config import MoEConfig
from moe_jax.layer import init_params, moe_forward, quantize_params, reference_forward
from moe_jax.resolve import resolve

DEMO_SHAPE = dict(num_experts=64, top_k=8, hidden_size=1024, expert_intermediate_size=256)


class Progress:
    """A one-line progress bar on stderr; without a terminal, one line when done."""

    def __init__(self, label: str, total: int):
        self.label, self.total, self.done, self.start = label, total, 0, time.perf_counter()
        self.live = sys.stderr.isatty()
        self._draw()

    def update(self, n: int = 1):
        self.done += n
        self._draw()

    def _draw(self):
        finished = self.done >= self.total
        if not (self.live or finished):
            return
        width = 30
        filled = width * self.done // max(self.total, 1)
        elapsed = time.perf_counter() - self.start
        sys.stderr.write(
            f"\r  {self.label:<28} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {elapsed:5.1f}s"
            + ("\n" if finished else "")
        )
        sys.stderr.flush()


def _config(args):
    overrides = {
        k: v for k, v in dict(
            weight_format=args.weight_format, expert_gemm=args.expert_gemm, exchange=args.exchange
        ).items() if v is not None
    }
    return getattr(MoEConfig, args.preset)(**overrides)


def _devices_or_mesh(args, config):
    if args.device_kind:
        device = AbstractDevice(device_kind=args.device_kind, num_cores=None, platform=args.platform)
        return AbstractMesh((args.ep,), (config.expert_axis,), abstract_device=device)
    if args.ep > 1:
        return jax.make_mesh((args.ep,), (config.expert_axis,), devices=jax.devices()[: args.ep])
    return None


def explain(args) -> int:
    try:
        config = _config(args)
        plan = resolve(config, _devices_or_mesh(args, config), training=args.training,
                       tokens_per_device=args.tokens_per_device)
    except ValueError as err:  # an invalid config or one that cannot resolve (ResolutionError)
        print(f"cannot resolve: {err}", file=sys.stderr)
        return 1
    print(plan.report)
    return 0


def demo(args) -> int:
    devices = jax.devices()
    print(f"moe-jax demo on {len(devices)} x {devices[0].device_kind} ({devices[0].platform})")
    config = MoEConfig.kimi_k2(**DEMO_SHAPE, weight_format="nvfp4")
    ep = max(n for n in range(1, len(devices) + 1) if config.num_experts % n == 0 and len(devices) % n == 0)
    mesh = jax.make_mesh((ep,), (config.expert_axis,), devices=devices[:ep]) if ep > 1 else None
    plan = resolve(config, mesh, tokens_per_device=args.tokens // ep)
    print(plan.report)

    bar = Progress("initializing + quantizing", 2)
    unquantized = init_params(dataclasses.replace(config, weight_format="bf16"), jax.random.key(args.seed))
    bar.update()
    params = quantize_params(unquantized)
    jax.block_until_ready(params)
    bar.update()
    x = jax.random.normal(jax.random.key(args.seed + 1), (args.tokens, config.hidden_size), jnp.bfloat16)

    forward = jax.jit(moe_forward, static_argnums=2)
    bar = Progress("compiling", 1)
    y, stats = forward(params, x, plan)
    jax.block_until_ready(y)
    bar.update()

    bar = Progress(f"timing {args.iters} calls", args.iters)
    times = []
    for _ in range(args.iters):
        start = time.perf_counter()
        jax.block_until_ready(forward(params, x, plan))
        times.append(time.perf_counter() - start)
        bar.update()
    median = float(np.median(times))

    bar = Progress("float64 reference", 1)
    x64 = np.asarray(x, np.float64)
    ref = reference_forward(params, x64, config)
    bar.update()
    y64 = np.asarray(y, np.float64)
    err = np.linalg.norm(y64 - ref) / np.linalg.norm(ref)
    ref_unq = reference_forward(unquantized, x64, dataclasses.replace(config, weight_format="bf16"))
    err_q = np.linalg.norm(ref - ref_unq) / np.linalg.norm(ref_unq)

    load = np.asarray(stats["tokens_per_expert"])
    print(f"tokens: {args.tokens}; output {tuple(y.shape)} {y.dtype}; finite: {bool(np.isfinite(y64).all())}")
    print(f"relative error vs float64 reference of the same NVFP4 weights: {err:.2e}")
    print(f"NVFP4 quantization error (float64, vs the unquantized weights):  {err_q:.2e}")
    print(f"expert load: min {load.min()}, max {load.max()}, mean {load.mean():.1f} rows; "
          f"load-balance loss {float(stats['load_balance_loss']):.3f}; dropped {int(stats['dropped'])}")
    print(f"throughput: {args.tokens / median:,.0f} tokens/s (median of {args.iters} calls, {median * 1e3:.2f} ms/call)")
    ok = np.isfinite(y64).all() and err < args.max_error
    if not ok:
        print(f"FAILED: error {err:.2e} above --max-error {args.max_error:.0e} or non-finite output")
    return 0 if ok else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="moe-jax", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="run a reduced Kimi-shaped NVFP4 layer and check it")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-error", type=float, default=2e-2,
                   help="fail above this relative error vs the float64 reference (default 2e-2)")
    p.set_defaults(run=demo)

    p = sub.add_parser("explain", help="print the resolution report")
    p.add_argument("--preset", choices=MoEConfig.PRESETS, default="kimi_k2")
    p.add_argument("--weight-format", choices=("bf16", "nvfp4"))
    p.add_argument("--expert-gemm")
    p.add_argument("--exchange")
    p.add_argument("--training", action="store_true")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree (a mesh over that many devices)")
    p.add_argument("--tokens-per-device", type=int)
    p.add_argument("--device-kind", help="resolve for an abstract device of this kind (no hardware needed)")
    p.add_argument("--platform", default="cuda", help="platform of --device-kind")
    p.set_defaults(run=explain)

    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
