"""Does triton 3.6 feed an FP8 ``wgmma`` its A operand from registers on SM90, as the W4A16 table
kernel feeds bf16 ones? A W4A8 kernel would dequantize NVFP4 weights in registers into E4M3.

Cross-compiles (no GPU) one loop that builds its A tile in registers, ``code * scale`` in f16
converted to ``float8e4nv``, against a B tile read from memory, and the same loop in bf16; prints
each kernel's ``wgmma`` shape and A operand, registers, and conversions.

    python benchmarks/fp8_register_a_probe.py
"""

from __future__ import annotations

import collections
import re

import triton
import triton.language as tl

from pallas_kernels import crosscompile as compiler


@triton.jit
def _probe(a_ptr, b_ptr, s_ptr, o_ptr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FP8: tl.constexpr):
    rm, rn, rk = tl.arange(0, BM), tl.arange(0, BN), tl.arange(0, BK)
    acc = tl.zeros((BM, BN), tl.float32)
    dtype = tl.float16 if FP8 else tl.bfloat16
    for i in range(0, 8):
        a = tl.load(a_ptr + rm[:, None] * 1024 + i * BK + rk[None, :]).to(dtype)
        s = tl.load(s_ptr + rm[:, None] * 64 + i * (BK // 16) + (rk // 16)[None, :]).to(dtype)
        b = tl.load(b_ptr + rk[:, None] * BN + i * BK * BN + rn[None, :])
        if FP8:
            acc = tl.dot((a * s).to(tl.float8e4nv), b.to(tl.float8e4nv, bitcast=True), acc)
        else:
            acc = tl.dot(a * s, b.to(tl.bfloat16), acc)
    tl.store(o_ptr + rm[:, None] * BN + rn[None, :], acc)


def main() -> None:
    signature = {"a_ptr": "*i8", "b_ptr": "*u8", "s_ptr": "*i8", "o_ptr": "*fp32", "BM": "constexpr",
                 "BN": "constexpr", "BK": "constexpr", "FP8": "constexpr"}
    for fp8 in (True, False):
        name = "probe_fp8" if fp8 else "probe_bf16"
        kernel = compiler.compile_jit(_probe, signature=signature, constexprs=dict(BM=128, BN=128, BK=64, FP8=fp8),
                                      capability=90, num_warps=4, num_stages=2, name=name)
        mma = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\S+) \{[^}]*\}, (\{[^}]*\}|%rd\d+)", kernel.ptx)
        shape, a_operand = mma[0]
        a_from = f"registers ({a_operand.count('%r')} a thread)" if a_operand.startswith("{") else "shared memory"
        conversions = collections.Counter(re.findall(r"cvt\.[a-z0-9.]+", kernel.ptx)).most_common(4)
        print(f"{'fp8 ' if fp8 else 'bf16'}: wgmma {shape}, A from {a_from}, {len(mma)} wgmma per loop body, "
              f"{kernel.registers} registers, {kernel.spill_bytes} B spilled; conversions {conversions}")


if __name__ == "__main__":
    main()
