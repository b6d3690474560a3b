"""``moe-jax``: the demo and the resolution report.

  moe-jax demo                      reduced Kimi-shaped NVFP4 layer on whatever devices exist
  moe-jax explain --preset kimi_k2  what would run here, and why the rest would not
  moe-jax explain --preset kimi_k2 --device-kind "NVIDIA RTX PRO 6000 Blackwell Workstation Edition" --ep 4
  moe-jax selftest                  every implementation that can run here, stage and whole layer, against
                                    float64 (exit 1 on failure); --json for a bug report
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractDevice, AbstractMesh
from tqdm import tqdm

from moe_jax.config import MoEConfig
from moe_jax.layer import init_params, moe_forward, quantize_params, reference_forward
from moe_jax.resolve import resolve

DEMO_SHAPE = dict(num_experts=64, top_k=8, hidden_size=1024, expert_intermediate_size=256)


class UsageError(Exception):
    """A flag value that parsing alone cannot judge (it depends on the preset or on the
    devices here); :func:`main` reports it as argparse reports its own errors."""


class _Parser(argparse.ArgumentParser):
    """argparse, with every error on one line of stderr (exit status 2): the usage block it
    prints by default buries the one line that says what is wrong."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def positive_int(text: str) -> int:
    """argparse ``type=`` for counts: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}, expected an int >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}, expected an int >= 1")
    return value


def positive_float(text: str) -> float:
    """argparse ``type=`` for tolerances: a finite float > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}, expected a float > 0") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{value}, expected a finite float > 0")
    return value


#: MoE layers of the published models (Kimi K2 and DeepSeek-V3: 61 layers, the first 1 and 3
#: dense; Mixtral 8x7B: 32), for the memory estimate when no --hf-config is given.
PRESET_MOE_LAYERS = {"kimi_k2": 60, "deepseek_v3": 58, "mixtral_8x7b": 32}


def _config(args):
    overrides = {
        k: v for k, v in dict(
            weight_format=args.weight_format, expert_gemm=args.expert_gemm, exchange=args.exchange
        ).items() if v is not None
    }
    if getattr(args, "hf_config", None):
        return MoEConfig.from_hf_config(args.hf_config, **overrides)
    return getattr(MoEConfig, args.preset)(**overrides)


def _moe_layers(args) -> int:
    if getattr(args, "hf_config", None):
        from moe_jax.checkpoint import moe_layer_indices  # noqa: PLC0415

        return len(moe_layer_indices(args.hf_config))
    return PRESET_MOE_LAYERS[args.preset]


def _devices_or_mesh(args, config):
    """The abstract mesh of ``--device-kind``, a mesh over ``--ep`` of this machine's devices,
    or None for one device.

    Raises:
      UsageError: ``--ep`` does not divide the preset's experts, or (without
        ``--device-kind``) exceeds the devices here.
    """
    if config.num_experts % args.ep:
        divisors = [d for d in range(1, config.num_experts + 1) if config.num_experts % d == 0]
        raise UsageError(
            f"argument --ep: {args.ep} does not divide the {config.num_experts} experts of preset "
            f"{args.preset!r}; expected one of {divisors}"
        )
    if args.device_kind:
        device = AbstractDevice(device_kind=args.device_kind, num_cores=None, platform=args.platform)
        return AbstractMesh((args.ep,), (config.expert_axis,), abstract_device=device)
    if args.ep == 1:
        return None
    devices = jax.devices()
    if args.ep > len(devices):
        raise UsageError(
            f"argument --ep: {args.ep}, but this machine has {len(devices)} {devices[0].platform} device(s); "
            f"expected at most {len(devices)}, or --device-kind to plan for devices that are not here"
        )
    return jax.make_mesh((args.ep,), (config.expert_axis,), devices=devices[: args.ep])


def explain(args) -> int:
    try:
        config = _config(args)
    except ValueError as err:  # a name or value MoEConfig rejects
        print(f"cannot resolve: {err}", file=sys.stderr)
        return 1
    target = _devices_or_mesh(args, config)
    try:
        plan = resolve(config, target, training=args.training, tokens_per_device=args.tokens_per_device)
    except ValueError as err:  # nothing can run it there (ResolutionError)
        print(f"cannot resolve: {err}", file=sys.stderr)
        return 1
    print(plan.report)
    from moe_jax import memory  # noqa: PLC0415

    tokens = args.tokens_per_device or 4096
    print(memory.report(config, exchange=plan.exchange, tokens_per_device=tokens,
                        expert_parallel=plan.target.expert_parallel, moe_layers=_moe_layers(args),
                        device_kind=plan.target.device_kind,
                        device_memory=None if args.device_memory_gb is None else
                                      int(args.device_memory_gb * memory.GB)))
    print(_traffic_report(plan, tokens, args.link_gbps))
    return 0


def _traffic_report(plan, tokens_per_device: int, link_gbps: float | None) -> str:
    """:func:`moe_jax.traffic.report` for the exchanges that can run on ``plan``'s target."""
    from moe_jax import memory, traffic  # noqa: PLC0415
    from moe_jax.exchange import EXCHANGE, ragged_all_to_all_emulation  # noqa: PLC0415

    target, config = plan.target, plan.config
    runnable = tuple(i.name for i in EXCHANGE.implementations if i.cannot_run(target, config) is None)
    buffers = {n: memory.exchange_buffer_bytes(config, n, tokens_per_device, target.expert_parallel) for n in runnable}
    return traffic.report(config, exchanges=runnable, chosen=plan.exchange, expert_parallel=target.expert_parallel,
                          emulated=ragged_all_to_all_emulation(target) is not None, tokens_per_device=tokens_per_device,
                          buffers=buffers, link_gbps=link_gbps)


def _bar(label: str, total: int) -> tqdm:
    """A progress bar on stderr; none without a terminal (``disable=None``), so piped or
    logged output holds only the results printed on stdout."""
    return tqdm(total=total, desc=label, file=sys.stderr, disable=None, leave=True)


def demo(args) -> int:
    devices = jax.devices()
    print(f"moe-jax demo on {len(devices)} x {devices[0].device_kind} ({devices[0].platform})")
    config = MoEConfig.kimi_k2(**DEMO_SHAPE, weight_format="nvfp4")
    ep = max(n for n in range(1, len(devices) + 1) if config.num_experts % n == 0 and len(devices) % n == 0)
    mesh = jax.make_mesh((ep,), (config.expert_axis,), devices=devices[:ep]) if ep > 1 else None
    plan = resolve(config, mesh, tokens_per_device=-(-args.tokens // ep))
    print(plan.report)

    with _bar("initializing + quantizing", 2) as bar:
        unquantized = init_params(dataclasses.replace(config, weight_format="bf16"), jax.random.key(args.seed))
        bar.update()
        params = quantize_params(unquantized)
        jax.block_until_ready(params)
        bar.update()
    x = jax.random.normal(jax.random.key(args.seed + 1), (args.tokens, config.hidden_size), jnp.bfloat16)

    forward = jax.jit(moe_forward, static_argnums=2)
    with _bar("compiling", 1) as bar:
        y, stats = forward(params, x, plan)
        jax.block_until_ready(y)
        bar.update()

    times = []
    with _bar(f"timing {args.iters} calls", args.iters) as bar:
        for _ in range(args.iters):
            start = time.perf_counter()
            jax.block_until_ready(forward(params, x, plan))
            times.append(time.perf_counter() - start)
            bar.update()
    median = float(np.median(times))

    with _bar("float64 references", 2) as bar:
        x64 = np.asarray(x, np.float64)
        ref = reference_forward(params, x64, config)
        bar.update()
        ref_unq = reference_forward(unquantized, x64, dataclasses.replace(config, weight_format="bf16"))
        bar.update()
    y64 = np.asarray(y, np.float64)
    err = np.linalg.norm(y64 - ref) / np.linalg.norm(ref)
    err_q = np.linalg.norm(ref - ref_unq) / np.linalg.norm(ref_unq)

    load = np.asarray(stats["tokens_per_expert"])
    print(f"tokens: {args.tokens}; output {tuple(y.shape)} {y.dtype}; finite: {bool(np.isfinite(y64).all())}")
    print(f"relative error vs float64 reference of the same NVFP4 weights: {err:.2e}")
    print(f"NVFP4 quantization error (float64, vs the unquantized weights):  {err_q:.2e}")
    print(f"expert load: min {load.min()}, max {load.max()}, mean {load.mean():.1f} rows; "
          f"load-balance loss {float(stats['load_balance_loss']):.3f}; dropped {int(stats['dropped'])}")
    print(f"throughput: {args.tokens / median:,.0f} tokens/s "
          f"(median of {args.iters} calls, {median * 1e3:.2f} ms/call)")
    ok = np.isfinite(y64).all() and err < args.max_error
    if not ok:
        print(f"FAILED: error {err:.2e} above --max-error {args.max_error:.0e} or non-finite output")
    return 0 if ok else 1


def selftest(args) -> int:
    from moe_jax import selftest as checks  # noqa: PLC0415 (loads the kernels)

    with _bar("selftest", None) as bar:
        def progress(label, total):
            bar.total = total
            bar.set_postfix_str(label)
            bar.update()
        report = checks.run(full=args.full, seed=args.seed, progress=progress)
    # With --json, stdout is the one JSON document; the verdict goes to stderr.
    text = json.dumps(report.document(), indent=1) if args.json else f"{report.text()}\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(report.summary(), file=sys.stderr if args.json else sys.stdout)
    return 0 if report.passed else 1


def main(argv=None) -> int:
    parser = _Parser(prog="moe-jax", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="run a reduced Kimi-shaped NVFP4 layer and check it")
    p.add_argument("--tokens", type=positive_int, default=512, help="tokens per call, >= 1 (default 512)")
    p.add_argument("--iters", type=positive_int, default=5, help="timed calls, >= 1 (default 5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-error", type=positive_float, default=2e-2,
                   help="fail above this relative error vs the float64 reference (default 2e-2)")
    p.set_defaults(run=demo, parser=p)

    p = sub.add_parser("explain", help="print the resolution report")
    p.add_argument("--preset", choices=MoEConfig.PRESETS, default="kimi_k2")
    p.add_argument("--weight-format", choices=("bf16", "nvfp4"))
    p.add_argument("--expert-gemm")
    p.add_argument("--exchange")
    p.add_argument("--training", action="store_true")
    p.add_argument("--ep", type=positive_int, default=1,
                   help="expert-parallel degree (a mesh over that many devices), a divisor of the experts")
    p.add_argument("--tokens-per-device", type=positive_int, help="a size hint for auto, >= 1")
    p.add_argument("--device-kind", help="resolve for an abstract device of this kind (no hardware needed)")
    p.add_argument("--platform", default="cuda", help="platform of --device-kind")
    p.add_argument("--hf-config", help="a model's config.json (or its directory) instead of --preset: its MoE "
                                       "layer's shape and its number of MoE layers, for the memory estimate")
    p.add_argument("--device-memory-gb", type=positive_float, help="the target's memory, where its kind is not known")
    p.add_argument("--link-gbps", type=positive_float,
                   help="also print how long each exchange's bytes take at this many GB/s out of each device "
                        "(e.g. 55 for PCIe Gen5 peer to peer)")
    p.set_defaults(run=explain, parser=p)

    p = sub.add_parser("selftest", help="check every implementation that can run here, stage and whole layer, "
                                         "against float64")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--full", dest="full", action="store_const", const=True, default=None,
                      help="run the full Kimi K2 size (384 experts; ~10 GB of NVFP4 weights on the device) also on "
                           "a CPU (default: on accelerators only)")
    size.add_argument("--quick", "--no-full", dest="full", action="store_const", const=False,
                      help="skip the full Kimi K2 size")
    p.add_argument("--seed", type=int, help="random seed (default: fresh; printed in the header)")
    p.add_argument("--json", action="store_true", help="print one JSON document (header and results) instead")
    p.add_argument("--out", help="also write what is printed (markdown, or JSON with --json) to this file")
    p.set_defaults(run=selftest, parser=p)

    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except UsageError as err:
        args.parser.error(str(err))


if __name__ == "__main__":
    sys.exit(main())
