"""The Gluon W4A16 candidates (``benchmarks/gluon_probe_kernel.py``) cross-compile for SM90 (no GPU)
to what they were written to be: each K step's MMAs issued back to back and left in flight
(one ``wgmma.wait_group`` per step that keeps the step's own groups outstanding), the register
operand kept (swap-AB kernel) or both operands in shared memory (the ``ss`` kernel, m64n256),
within the SM's shared memory and without register spills; and the warp-specialized candidate
(``benchmarks/gluon_ws_kernel.py``) to partitions that synchronize through mbarriers only."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("triton")
from benchmarks import gluon_probe_kernel as gk  # noqa: E402
from pallas_kernels.crosscompile import _compiled  # noqa: E402
from pallas_kernels.grouped_matmul.tuning import SHARED_MEMORY_BYTES, Op  # noqa: E402

SHAPES = {Op.GATE_UP_SWIGLU: (7168, 2048), Op.MATMUL: (2048, 7168)}


def _facts(kernel):
    compiled = _compiled(kernel, "gluon_probe", 90, False)
    ptx = compiled.ptx
    return compiled, sorted({int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+);", ptx)}), ptx


def test_swap_ab_candidate_keeps_a_step_in_flight():
    k, n_out = SHAPES[Op.GATE_UP_SWIGLU]
    spec = gk.GluonSpec(op=Op.GATE_UP_SWIGLU, num_rows=65536, num_experts=384, k=k, n_out=n_out, block_k=128,
                        num_stages=3)
    compiled, waits, ptx = _facts(gk.compile_kernel(spec))
    # 1: the 64- or 128-row step in flight; 2: the 128 + 64-row step's two groups; 0: the last.
    assert waits == [0, 1, 2], waits
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n128k16\.f32\.bf16\.bf16 \{[^}]*\}, \{", ptx)  # A: registers
    assert compiled.spill_bytes == 0 and 0 < compiled.shared_bytes <= SHARED_MEMORY_BYTES[90]


@pytest.mark.parametrize("op", list(SHAPES), ids=lambda op: op.value)
def test_ss_candidate_multiplies_256_weight_rows_from_shared_memory(op):
    k, n_out = SHAPES[op]
    spec = gk.SsSpec(op=op, num_rows=65536, num_experts=384, k=k, n_out=n_out)
    compiled, waits, ptx = _facts(gk.compile_kernel(spec))
    assert waits == [0, 1, 2], waits
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n256k16\.f32\.bf16\.bf16 \{[^}]*\}, %rd", ptx)
    assert compiled.spill_bytes == 0 and 0 < compiled.shared_bytes <= SHARED_MEMORY_BYTES[90]


# Each op, weight format and grid once, in four compilations rather than eight.
@pytest.mark.parametrize(("op", "bf16", "persistent", "x2_in_x", "x2_as_128"),
                         [(Op.GATE_UP_SWIGLU, False, 0, False, False), (Op.MATMUL, False, 132, False, False),
                          (Op.GATE_UP_SWIGLU, True, 132, False, False), (Op.MATMUL, True, 0, False, False),
                          (Op.GATE_UP_SWIGLU, False, 0, True, False), (Op.MATMUL, False, 0, True, True)],
                         ids=["gate_up-nvfp4", "matmul-nvfp4-persistent", "gate_up-bf16-persistent", "matmul-bf16",
                              "gate_up-nvfp4-x2-in-x", "matmul-nvfp4-x2-as-128"])
def test_ws_candidate_is_warp_specialized_without_cta_barriers(op, bf16, persistent, x2_in_x, x2_as_128):
    """``gluon_ws_kernel``: 12 warps (two consumer warp groups, one producer warp padded to a
    group) whose registers are moved by ``setmaxnreg`` (224 per consumer, 56 for the producer);
    the producer loads by TMA (and for NVFP4 ``cp.async``) into mbarrier-tracked stages; every
    barrier inside a partition is a 128-thread named one (a warp group's), none spans the CTA, so
    the consumers never wait for each other."""
    from benchmarks import gluon_ws_kernel as wk  # noqa: PLC0415

    k, n_out = SHAPES[op]
    spec = wk.WsSpec(op=op, num_rows=65536, num_experts=384, k=k, n_out=n_out, bf16=bf16, persistent=persistent,
                     x2_in_x=x2_in_x, x2_as_128=x2_as_128)
    compiled, waits, ptx = _facts(gk.compile_kernel(spec))
    # The extra rows' MMA: N = 64, or 128 for the diagnostic (no m64n64 MMA of a 192-row tile left).
    n_extra = "128" if x2_as_128 else "64"
    if not bf16:
        assert re.search(rf"m64n{n_extra}k16\.f32\.bf16\.bf16 \{{[^}}]*\}}, \{{", ptx)
    assert re.search(r"\.reqntid\s+384\b", ptx)
    moved = {int(n) for n in re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)}
    assert moved >= {spec.consumer_regs, spec.producer_regs}, moved
    # 1: one step in flight (64 or 128 rows); 2: the 128 + 64-row step's two groups; 0: the last.
    assert waits == [0, 1, 2], waits
    assert "cp.async.bulk.tensor.2d" in ptx
    if bf16:  # both operands from shared memory; the fused op's weight slabs as 3D boxes
        assert "cp.async.mbarrier.arrive.noinc" not in ptx
        assert re.search(r"m64n128k16\.f32\.bf16\.bf16 \{[^}]*\}, %rd", ptx)
        assert ("cp.async.bulk.tensor.3d" in ptx) == (op is Op.GATE_UP_SWIGLU)
    else:  # the register operand dequantized; words and scales by cp.async
        assert "cp.async.mbarrier.arrive.noinc" in ptx and re.search(r"m64n128k16\.f32\.bf16\.bf16 \{[^}]*\}, \{", ptx)
    assert "mbarrier.try_wait.parity" in ptx
    named = re.findall(r"\bbar\.sync\s+(\d+)(?:,\s*(\d+))?;", ptx)
    assert named and all(count == "128" for _, count in named), sorted(set(named))
    assert compiled.spill_bytes == 0 and 0 < compiled.shared_bytes <= SHARED_MEMORY_BYTES[90]


def test_ws_diagnostic_needs_the_extra_rows_in_the_token_ring():
    from benchmarks import gluon_ws_kernel as wk  # noqa: PLC0415

    spec = wk.WsSpec(op=Op.MATMUL, num_rows=1024, num_experts=8, k=2048, n_out=7168, x2_as_128=True)
    with pytest.raises(ValueError, match=r"^x2_as_128: True, expected x2_in_x=True"):
        spec.constexprs()


def test_ws_candidate_reads_transposed_bf16_weights_as_the_transposed_mma_operand():
    """``WsSpec(bf16=True, transpose_w=True)`` (an input gradient's ``dy @ W_e``, ``W_e`` stored
    ``[K, N]``): each weight box lands ``[BLOCK_K, 64]`` and is the ``wgmma``'s A operand through
    the descriptor's transpose bit, not a copy."""
    from benchmarks import gluon_ws_kernel as wk  # noqa: PLC0415

    spec = wk.WsSpec(op=Op.MATMUL, num_rows=65536, num_experts=384, k=7168, n_out=2048, bf16=True,
                     transpose_w=True)
    compiled, waits, ptx = _facts(gk.compile_kernel(spec))
    transposes = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.bf16\.bf16 \{[^}]*\}, %rd\d+, "
                                r"%rd\d+, %p\d+, 1, 1, (\d), (\d);", ptx))
    assert transposes == {("1", "0")}, transposes  # A transposed, B (the token rows) K-major
    assert waits == [0, 1, 2] and compiled.spill_bytes == 0
    with pytest.raises(ValueError, match="transpose_w"):
        wk.WsSpec(op=Op.GATE_UP_SWIGLU, num_rows=64, num_experts=4, k=64, n_out=64, bf16=True,
                  transpose_w=True).weights


def test_ws_candidate_dequantizes_transposed_nvfp4_weights_into_shared_memory():
    """``WsSpec(transpose_w=True)`` with NVFP4 weights (the input gradient ``dy @ W_e``): each
    consumer dequantizes its ``[64 (K), 64 (N)]`` tile in natural order into one of two shared
    buffers, fences it for the async proxy, and multiplies it as the transposed A operand."""
    from benchmarks import gluon_ws_kernel as wk  # noqa: PLC0415

    spec = wk.WsSpec(op=Op.MATMUL, num_rows=65536, num_experts=384, k=7168, n_out=2048, transpose_w=True)
    compiled, waits, ptx = _facts(gk.compile_kernel(spec))
    transposes = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.bf16\.bf16 \{[^}]*\}, %rd\d+, "
                                r"%rd\d+, %p\d+, 1, 1, (\d), (\d);", ptx))
    assert transposes == {("1", "0")}, transposes
    assert "fence.proxy.async.shared::cta" in ptx and "cp.async.mbarrier.arrive.noinc" in ptx
    assert waits == [0, 1, 2] and compiled.spill_bytes == 0
    assert 0 < compiled.shared_bytes <= SHARED_MEMORY_BYTES[90]
