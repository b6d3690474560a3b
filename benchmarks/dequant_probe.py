"""How fast XLA turns NVFP4 weights into a bf16 copy, by formulation (a probe: nothing in the
library calls these).

The bf16-copy input gradient (benchmarks/NOTES.md, "Training") lost because XLA's pass over
``pallas_triton.dequantize_tile`` (``EXACT``: float32 values, then a stack of the two nibbles)
wrote its bf16 output at ~0.6 TB/s. This times, at 48 experts of Kimi K2's gate/up (``[48 * 4096,
7168]``, 2.8 GB of bf16), against a plain copy of the same bytes in the same run:

* ``exact``: that formulation (``dequantize_tile(..., Dequant.EXACT, Order.MODELOPT)``);
* ``bits``: each nibble's bf16 bits built with integer operations, times its E4M3 block scale in
  bf16 (exact: at most 6 significant bits), the two nibbles of a byte packed into one uint32 and
  bitcast to two bf16 (the interleave without a stack);
* ``lut``: the same with each byte's two values gathered from 256-entry tables.

Each formulation's bits are compared with ``exact``'s (times 2**7, its operand deficit) first.

Usage::

    python benchmarks/dequant_probe.py [--experts 48] [--iters 20]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.grouped_matmul import pallas_triton  # noqa: E402
from pallas_kernels.grouped_matmul.pallas_triton import Dequant, Order  # noqa: E402

N, K = 4096, 7168


def exact(packed_rj, scales_rb):
    return pallas_triton.dequantize_tile(packed_rj, scales_rb, Dequant.EXACT, Order.MODELOPT)


def _nibble_bits(code):
    """uint32 E2M1 codes 0..15 -> the bf16 bits of their values (sign, exponent, mantissa)."""
    exponent, mantissa = (code >> 1) & 3, code & 1
    normal = ((exponent + 126) << 7) | (mantissa << 6)
    magnitude = jnp.where(exponent == 0, mantissa * (126 << 7), normal)  # 0 or 0.5 below 1
    return magnitude | ((code & 8) << 12)


def bits(packed_rj, scales_rb):
    rows, half = packed_rj.shape
    byte = packed_rj.astype(jnp.uint32)
    scale = jax.lax.bitcast_convert_type(scales_rb, jnp.float8_e4m3fn).astype(jnp.bfloat16)
    scale_rj = jnp.repeat(scale, 8, axis=1)  # 8 bytes (16 codes) a block
    lo, hi = (jax.lax.bitcast_convert_type(_nibble_bits(v).astype(jnp.uint16), jnp.bfloat16) * scale_rj
              for v in (byte & 15, byte >> 4))
    word = (jax.lax.bitcast_convert_type(lo, jnp.uint16).astype(jnp.uint32)
            | (jax.lax.bitcast_convert_type(hi, jnp.uint16).astype(jnp.uint32) << 16))
    return jax.lax.bitcast_convert_type(word, jnp.bfloat16).reshape(rows, 2 * half)


_BYTE_VALUES = np.arange(256, dtype=np.uint32)


def lut(packed_rj, scales_rb):
    """As ``bits``, with each byte's two nibble values gathered from 256-entry bf16 tables."""
    rows, half = packed_rj.shape
    scale = jax.lax.bitcast_convert_type(scales_rb, jnp.float8_e4m3fn).astype(jnp.bfloat16)
    scale_rj = jnp.repeat(scale, 8, axis=1)
    index = packed_rj.astype(jnp.int32)
    lo, hi = (jnp.asarray(jax.lax.bitcast_convert_type(_nibble_bits(jnp.asarray(v)).astype(jnp.uint16), jnp.bfloat16))
              [index] * scale_rj for v in (_BYTE_VALUES & 15, _BYTE_VALUES >> 4))
    word = (jax.lax.bitcast_convert_type(lo, jnp.uint16).astype(jnp.uint32)
            | (jax.lax.bitcast_convert_type(hi, jnp.uint16).astype(jnp.uint32) << 16))
    return jax.lax.bitcast_convert_type(word, jnp.bfloat16).reshape(rows, 2 * half)


def timed(fn, *args, iters: int) -> float:
    out = fn(*args)
    out.block_until_ready()
    del out
    start = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    out.block_until_ready()
    return (time.perf_counter() - start) / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=48)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    rows = args.experts * N
    key = jax.random.key(0)
    packed = jax.random.bits(key, (rows, K // 2), jnp.uint8)
    scales = jax.lax.bitcast_convert_type(jax.random.uniform(jax.random.fold_in(key, 1), (rows, K // 16), jnp.float32,
                                                             0.5, 1.5).astype(jnp.float8_e4m3fn), jnp.uint8)
    out_bytes = rows * K * 2
    print(f"{jax.devices()[0].device_kind}: [{rows}, {K}] bf16 = {out_bytes / 1e9:.2f} GB out, "
          f"{(packed.size + scales.size) / 1e9:.2f} GB in", flush=True)
    copy_in = jnp.zeros((rows, K), jnp.bfloat16)
    copy_s = timed(jax.jit(lambda a: a + 1), copy_in, iters=args.iters)
    print(f"  copy (read + write {2 * out_bytes / 1e9:.2f} GB): {copy_s * 1e3:.3f} ms, "
          f"{2 * out_bytes / copy_s / 1e12:.2f} TB/s", flush=True)
    del copy_in
    # The floor: the bytes read and written at the copy's rate.
    floor_s = (out_bytes + packed.size + scales.size) / (2 * out_bytes / copy_s)
    print(f"  floor: {floor_s * 1e3:.3f} ms", flush=True)
    want = None
    for name, fn in (("exact", exact), ("bits", bits), ("lut", lut)):
        call = jax.jit(fn)
        got = call(packed[:4096], scales[:4096])
        if want is None:
            want = np.asarray(got.astype(jnp.float32)) * 2.0**7  # exact's operand deficit
        else:
            same = np.array_equal(np.asarray(got.astype(jnp.float32)), want)
            print(f"  {name}: bits {'equal' if same else 'DIFFER'} to exact's on 4096 rows", flush=True)
        seconds = timed(call, packed, scales, iters=args.iters)
        print(f"  {name}: {seconds * 1e3:.3f} ms, {out_bytes / seconds / 1e12:.2f} TB/s written, "
              f"{seconds / floor_s:.2f}x its floor", flush=True)


if __name__ == "__main__":
    main()
