"""Cross-compiles every grouped-matmul tile configuration for SM120 and SM100, on a CPU.

For each entry of those rows of ``pallas_kernels.grouped_matmul.tuning.TILE_TABLE``: deviceless
lowering for an RTX PRO 6000 (SM120) or a B200 (SM100), then ``triton.compile`` (triton 3.6)
for that target; records the target, the MMA instruction, shared memory against the chip's
per-block limit, registers and spill bytes. Nothing here ran on SM100/SM120 hardware.

Usage::

    python benchmarks/sm_crosscompile.py [--out benchmarks/results]

writes ``crosscompile.json`` and ``crosscompile.md``. CI asserts the same properties in
``tests/pallas_kernels/test_crosscompile.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import pathlib
import platform
import shlex
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax  # noqa: E402

from pallas_kernels.grouped_matmul import crosscompile  # noqa: E402

CAPABILITIES = (120, 100)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    import triton  # noqa: PLC0415 (optional dependency)

    records = [crosscompile.compile_config(cc, key) for cc in CAPABILITIES for key in crosscompile.table_keys(cc)]
    meta = {
        "date": datetime.date.today().isoformat(),
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "host": f"{platform.machine()} CPU, no GPU",
        "versions": f"jax {jax.__version__}, triton {triton.__version__}",
        "shape": f"{crosscompile.EXPERTS} experts, K={crosscompile.HIDDEN}, N=2x{crosscompile.INTERMEDIATE}, "
                 + ", ".join(f"M={rows} ({variant.value})" for variant, rows in crosscompile.ROWS.items()),
    }
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "crosscompile.json").write_text(json.dumps(
        {**meta, "kernels": [dataclasses.asdict(r) for r in records]}, indent=1, default=str))
    lines = [
        "# Grouped matmul kernels cross-compiled for SM120 and SM100 (no GPU)",
        "",
        f"- date: {meta['date']}; host: {meta['host']}; {meta['versions']}",
        f"- command: `{meta['command']}`",
        f"- lowered at {meta['shape']}; compiled with triton.compile(target=GPUTarget('cuda', cc, 32))",
        "",
        "| cc | variant | weights | op | block m/n/k | warps | stages | target | MMA | shared (bytes) | limit "
        "| fits | registers | spill (bytes) |",
        "|---|---|---|---|---|---:|---:|---|---|---:|---:|---|---:|---:|",
    ]
    for r in records:
        lines.append(
            f"| {r.capability} | {r.variant} | {r.weights} | {r.op} | {r.block_m}/{r.block_n}/{r.block_k} | "
            f"{r.num_warps} | {r.num_stages} | {r.target} | {', '.join(r.mma)} | {r.shared_bytes} | "
            f"{r.shared_limit} | {'yes' if r.shared_bytes <= r.shared_limit else 'NO'} | {r.registers} | "
            f"{r.spill_bytes} |")
    (out / "crosscompile.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
