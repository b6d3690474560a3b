"""The W4A8 probe (``benchmarks/fp8_probe_kernel.py``), executed in Triton's interpreter on CPU: its
four modes (bf16 and E4M3 weights from memory, NVFP4 weights dequantized to bf16 by the table
kernel's code or placed into E4M3 by the probe's, both inline PTX that ``ptx_emulator``
evaluates) on the real tile schedule, NaN-poisoned outputs whose padding rows must stay NaN,
every load and store bounds-checked, against float64.

The probe is not the library's kernel; this keeps what the next GPU call times honest: a wrong
permutation or a misplaced code would show here as a large error, not as a fast number.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import interpreted
from benchmarks import fp8_probe_kernel as fk
from nvfp4_float64 import compare, e2m1, e4m3, expert, random_weights
from pallas_kernels.grouped_matmul import triton_lang
from pallas_kernels.grouped_matmul.tuning import Op
from w4a8_float64 import e4m3_round


def _e4m3_round(values: np.ndarray) -> np.ndarray:
    """:func:`w4a8_float64.e4m3_round` of values within +-448 here."""
    assert np.abs(values).max() <= 448
    return e4m3_round(values)


def run_probe(mode: fk.Mode, op: Op, group_sizes, *, k: int, n_out: int, experts=None, padding: int = 3,
              seed: int = 0, block_n: int = 64) -> float:
    rng = np.random.default_rng(seed)
    group_sizes = np.asarray(group_sizes, np.int32)
    experts = experts or len(group_sizes)
    if len(group_sizes) < experts:  # the used experts are the last ones
        group_sizes = np.concatenate([np.zeros(experts - len(group_sizes), np.int32), group_sizes])
    used = [e for e in range(experts) if group_sizes[e]]
    n_w = 2 * n_out if op is Op.GATE_UP_SWIGLU else n_out
    total = int(group_sizes.sum())
    m = total + padding
    scales = np.zeros(1, np.uint8)
    if mode is fk.Mode.W4A16:  # the table kernel's dequantization: code * scale exactly, bf16 rows
        packed, scales, _ = random_weights(rng, experts, n_w, k, 1, used)
        w_stored = packed
        w_enk = np.zeros((experts, n_w, k))
        for e in used:
            w_enk[e] = e2m1(packed[e]) * np.repeat(e4m3(scales[e]), 16, axis=-1)
        x = (rng.standard_normal((m, k)) / np.sqrt(k)).astype(ml_dtypes.bfloat16)
        x_in = np.asarray(triton_lang.permute_k(x, fk.BLOCK_K.value))
    elif mode is fk.Mode.W4A8:
        packed, scales, _ = random_weights(rng, experts, n_w, k, 1, used)
        w_stored = packed
        # What the MMA multiplies: code * scale * 2**-3 rounded to E4M3, times the epilogue's 2**3.
        w_enk = np.zeros((experts, n_w, k))
        for e in used:
            w_enk[e] = _e4m3_round(e2m1(packed[e]) * np.repeat(e4m3(scales[e]), 16, axis=-1) / 8) * 8
        x = (rng.standard_normal((m, k)) / np.sqrt(k)).astype(ml_dtypes.float8_e4m3fn)
        x_in = fk.permute_k(x)
    else:
        dtype = ml_dtypes.bfloat16 if mode is fk.Mode.BF16 else ml_dtypes.float8_e4m3fn
        w_stored = (rng.standard_normal((experts, n_w, k)) / np.sqrt(k) * (1 if mode is fk.Mode.BF16 else 16)
                    ).astype(dtype)
        w_enk = w_stored.astype(np.float64)
        x = x_in = rng.standard_normal((m, k)).astype(dtype)
    spec = fk.ProbeSpec(mode=mode, op=op, num_rows=m, num_experts=experts, k=k, n_out=n_out,
                        block_n=block_n)
    interpreted.reset()
    out = np.full((m, n_out), np.nan, ml_dtypes.bfloat16)
    buffers = interpreted.schedule_buffers(group_sizes, m, fk.ROWS, spec.max_tiles)
    buffers += [interpreted.buffer(x_in, "x"), interpreted.buffer(w_stored, "w"),
                interpreted.buffer(scales, "w.scales" if scales.size > 1 else "w.scales (unread)")]
    buffers.append(interpreted.buffer(np.zeros(1, ml_dtypes.bfloat16), "out_in (unread)"))
    got = interpreted.launch(spec.kernel, spec.num_programs, buffers, out, spec.constexprs())
    starts = np.concatenate([[0], np.cumsum(group_sizes)])
    want = np.concatenate([expert(op, x[starts[e]:starts[e + 1]].astype(np.float64), w_enk[e])
                           for e in range(experts) if group_sizes[e]])
    return compare(got, want, total, spec)


@pytest.mark.parametrize("mode", list(fk.Mode), ids=lambda mode: mode.name.lower())
@pytest.mark.parametrize("op", [Op.MATMUL, Op.GATE_UP_SWIGLU], ids=lambda op: op.value)
def test_every_tile_path(mode, op):
    """Each row path (64, 128, 128 + 64 rows) and an expert of more than one tile, among empty
    experts; two K steps and two output column tiles."""
    run_probe(mode, op, [64, 0, 65, 128, 0, 192, 250, 1], k=256, n_out=128)


@pytest.mark.parametrize("op", [Op.MATMUL, Op.GATE_UP_SWIGLU], ids=lambda op: op.value)
def test_w4a8_on_tiles_of_32_output_columns(op):
    """The harness's two-programs-per-SM candidate's narrowest tile (gate/up: 32 columns of gate
    and of up a tile), four column tiles, every row path."""
    run_probe(fk.Mode.W4A8, op, [64, 0, 65, 128, 0, 192, 250, 1], k=256, n_out=128, block_n=32, seed=5)


def test_kimi_k2_s_last_experts():
    """384 experts with only the last three used: the 64-bit expert offsets of the packed codes and
    their scales reach the end of their buffers (a wrong stride lands outside, which the bounds
    checks see)."""
    run_probe(fk.Mode.W4A8, Op.MATMUL, [70, 0, 200], k=128, n_out=64, experts=384)


def test_the_dequantization_is_each_code_times_its_scale_rounded_to_e4m3():
    """The inline PTX on every code and every finite positive E4M3 scale: the E4M3 byte it returns
    is ``code * scale * 2**-3`` rounded to nearest even (the products have at most 6 significant
    bits, so the f16 step is exact)."""
    import ptx_emulator  # noqa: PLC0415

    codes = np.arange(16)
    scale_bits = np.arange(1, 0x7F, dtype=np.uint8)
    c, s = np.meshgrid(codes, scale_bits, indexing="ij")
    word = np.zeros(c.shape, np.uint64)
    for i in range(8):  # the same code in all 8 nibbles
        word |= c.astype(np.uint64) << np.uint64(4 * i)
    s16 = (e4m3(s) * 8).astype(np.float16).view(np.uint16).astype(np.uint64)
    regs = ptx_emulator.run(triton_lang._WORD_TO_E4M3_PTX.value.replace("$", "r"),
                            {"r2": word, "r6": s16 | (s16 << np.uint64(16))})
    want = _e4m3_round(np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])[c] * e4m3(s) / 8)
    for out in ("r0", "r1"):
        for byte in range(4):
            got = ((regs[out] >> np.uint64(8 * byte)) & np.uint64(0xFF)).astype(np.uint8)
            np.testing.assert_array_equal(got.view(ml_dtypes.float8_e4m3fn).astype(np.float64), want)
