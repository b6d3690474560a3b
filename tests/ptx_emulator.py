"""A small evaluator of the native kernels' inline PTX (the W4A16 dequantization, and the W4A8
probe's E4M3 placement in ``benchmarks/fp8_probe_kernel.py``) on NumPy registers.

The native W4A16 kernels (``pallas_kernels/grouped_matmul/triton_lang.py``) place E2M1 codes into
bf16 with a block of inline PTX that no CPU executes. This evaluates it instruction by
instruction, so that a test can check its bits (``tests/pallas_kernels/test_triton_lang_crosscompile.py``)
and so that Triton's interpreter can run whole W4A16 kernels (``tests/interpreter/interpreted.py``).
Only the instructions that block uses are known; any other raises.
"""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np


def _f16(bits):
    return np.asarray(bits).astype(np.uint16).view(np.float16)


def _e4m3_to_f16_bits(bits):
    e4m3 = np.asarray(bits).astype(np.uint8).view(ml_dtypes.float8_e4m3fn)
    return e4m3.astype(np.float16).view(np.uint16).astype(np.uint64)


def run(ptx: str, operands: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Evaluates the W4A16 asm block on uint32 registers (numpy arrays): the instructions it uses,
    ``mov`` with ``{lo, hi}`` packing and unpacking included; ``fma.rn.bf16x2`` is checked to be
    exact (no rounding), so the bits it returns are the product's."""
    regs = dict(operands)
    mask = np.uint64(0xFFFFFFFF)

    def val(token):
        token = token.strip()
        return np.uint64(int(token, 16) if token.startswith("0x") else int(token)) if token[0].isdigit() else regs[token]

    def bf16(bits16):
        return (bits16.astype(np.uint32) << 16).view(np.float32).astype(np.float64)

    for line in ptx.strip().strip("{}").split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        if op == "mov.b32" and args.startswith("{"):  # unpack: {lo, hi}, src
            lo, hi, src = re.match(r"\{\s*(\S+),\s*(\S+)\s*\},\s*(\S+)", args).groups()
            regs[lo], regs[hi] = val(src) & np.uint64(0xFFFF), val(src) >> np.uint64(16)
            continue
        dst, *src = [a.strip() for a in re.split(r",(?![^{]*\})", args)]
        if op == "mov.b32" and src[0].startswith("{"):  # pack: dst, {lo, hi}
            lo, hi = re.match(r"\{\s*(\S+),\s*(\S+)\s*\}", src[0]).groups()
            regs[dst] = (val(lo) & np.uint64(0xFFFF)) | ((val(hi) & np.uint64(0xFFFF)) << np.uint64(16))
        elif op == "mov.b32":
            regs[dst] = val(src[0])
        elif op == "shl.b32":
            regs[dst] = (val(src[0]) << val(src[1])) & mask
        elif op == "shr.b32":
            regs[dst] = val(src[0]) >> val(src[1])
        elif op == "and.b32":
            regs[dst] = val(src[0]) & val(src[1])
        elif op == "or.b32":
            regs[dst] = val(src[0]) | val(src[1])
        elif op == "lop3.b32":
            a, b, c, lut = (val(x) for x in src)
            out = np.zeros_like(a)
            for bit in range(8):  # the LUT's bit (a << 2 | b << 1 | c) per input combination
                if int(lut) >> bit & 1:
                    ta, tb, tc = (a if bit & 4 else ~a & mask), (b if bit & 2 else ~b & mask), (c if bit & 1 else ~c & mask)
                    out |= ta & tb & tc
            regs[dst] = out
        elif op == "fma.rn.bf16x2":
            halves = []
            for shift in (np.uint64(0), np.uint64(16)):
                a, b, c = ((val(x) >> shift) & np.uint64(0xFFFF) for x in src)
                exact = bf16(a) * bf16(b) + bf16(c)
                as32 = exact.astype(np.float32)
                assert (as32.astype(np.float64) == exact).all()
                bits = as32.view(np.uint32)
                assert not (bits & 0xFFFF).any(), "fma.rn.bf16x2 would round"
                halves.append((bits >> 16).astype(np.uint64))
            regs[dst] = halves[0] | (halves[1] << np.uint64(16))
        elif op == "cvt.rn.f16x2.e4m3x2":  # two E4M3 bytes -> two f16 (exact), low byte to the low half
            bits = val(src[0])
            halves = [_e4m3_to_f16_bits((bits >> np.uint64(8 * i)) & np.uint64(0xFF)) for i in (0, 1)]
            regs[dst] = halves[0] | (halves[1] << np.uint64(16))
        elif op == "mul.rn.f16x2":
            halves = []
            for shift in (np.uint64(0), np.uint64(16)):
                a, b = ((val(x) >> shift) & np.uint64(0xFFFF) for x in src)
                product = _f16(a).astype(np.float64) * _f16(b).astype(np.float64)
                halves.append(product.astype(np.float16).view(np.uint16).astype(np.uint64))  # nearest even
            regs[dst] = halves[0] | (halves[1] << np.uint64(16))
        elif op == "cvt.rn.satfinite.e4m3x2.f16x2":  # two f16 -> two E4M3 bytes, nearest even, clamped to +-448
            bits = val(src[0])
            out = np.zeros_like(bits)
            for i in (0, 1):
                value = _f16((bits >> np.uint64(16 * i)) & np.uint64(0xFFFF)).astype(np.float32)
                value = np.where(np.isnan(value), value, np.clip(value, -448.0, 448.0))
                e4m3 = value.astype(ml_dtypes.float8_e4m3fn).view(np.uint8).astype(np.uint64)
                out |= e4m3 << np.uint64(8 * i)
            regs[dst] = out
        else:
            raise AssertionError(f"instruction not emulated: {op}")
    return regs
