"""The W4A8 probe (``benchmarks/fp8_probe_kernel.py``) cross-compiles for SM90 (no GPU) to what it
was written to be: in every mode and both projections, ``wgmma`` with the weight tile as its A
operand (bf16 ``k16`` or E4M3 ``k32``; W4A16's and W4A8's from registers), no register spills, shared memory within the
SM's; and the W4A8 K loop dequantizes in registers, with no shared-memory round trip of the
dequantized tile (no ``STS`` in it) and fewer instructions per K step than the W4A16 table kernel's."""

from __future__ import annotations

import collections
import re

import pytest

pytest.importorskip("triton")
from benchmarks import fp8_probe_kernel as fk  # noqa: E402
from pallas_kernels import crosscompile  # noqa: E402
from pallas_kernels.grouped_matmul import crosscompile as grouped_crosscompile  # noqa: E402
from pallas_kernels.grouped_matmul.tuning import SHARED_MEMORY_BYTES, Op, Variant  # noqa: E402

SHAPES = {Op.GATE_UP_SWIGLU: (7168, 2048), Op.MATMUL: (2048, 7168)}


def _compile(mode: fk.Mode, op: Op, with_sass: bool = False, stages: int | None = None, block_n: int | None = None):
    k, n_out = SHAPES[op]
    spec = fk.ProbeSpec(mode=mode, op=op, num_rows=65536, num_experts=384, k=k, n_out=n_out, stages=stages,
                        block_n=block_n or (64 if op is Op.GATE_UP_SWIGLU else 128))
    return crosscompile.compile_jit(spec.kernel, signature=spec.signature(), constexprs=spec.constexprs(),
                                    capability=90, num_warps=spec.num_warps, num_stages=spec.num_stages,
                                    name=f"fp8_probe_{mode.name.lower()}_{op.value}", with_sass=with_sass)


def k_loops(sass: str) -> list[collections.Counter]:
    """Opcode counts of each backward-branching loop of ``sass`` that issues an MMA."""
    ins = [(int(a, 16), text) for a, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*?)\s*;", sass)]
    loops = []
    for address, text in ins:
        target = re.search(r"\bBRA(?:\.\w+)*\s+(0x[0-9a-f]+)", text)
        if target and int(target.group(1), 16) < address:
            body = [t for a, t in ins if int(target.group(1), 16) <= a <= address]
            counts = collections.Counter(re.sub(r"^@!?U?P[T\d]+\s+", "", t).split()[0].split(".")[0] for t in body)
            if counts["HGMMA"] or counts["QGMMA"]:
                counts["total"] = len(body)
                loops.append(counts)
    return loops


@pytest.mark.parametrize("mode", list(fk.Mode), ids=lambda mode: mode.name.lower())
@pytest.mark.parametrize("op", list(SHAPES), ids=lambda op: op.value)
def test_every_mode_multiplies_its_weights_where_it_should_within_the_sm(mode, op):
    """bf16 and E4M3 weights from memory reach the MMA from shared memory (a descriptor), as
    the bf16 table tile's do; dequantized weights as the register operand they were built in."""
    kernel = _compile(mode, op)
    shape = r"k16\.f32\.bf16\.bf16" if mode in (fk.Mode.BF16, fk.Mode.W4A16) else r"k32\.f32\.e4m3\.e4m3"
    a_operand = r"\{" if mode in (fk.Mode.W4A8, fk.Mode.W4A16) else r"%rd\d+"
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n\d+{shape} \{{[^}}]*\}}, {a_operand}", kernel.ptx)
    assert kernel.spill_bytes == 0 and 0 < kernel.shared_bytes <= SHARED_MEMORY_BYTES[90]


def test_the_harness_s_four_stage_w4a8_variant_fits():
    kernel = _compile(fk.Mode.W4A8, Op.GATE_UP_SWIGLU, stages=4)
    assert kernel.spill_bytes == 0 and 0 < kernel.shared_bytes <= SHARED_MEMORY_BYTES[90]


@pytest.mark.parametrize(("op", "block_n"), [(Op.MATMUL, 64), (Op.GATE_UP_SWIGLU, 32)], ids=["down", "gate_up"])
def test_w4a8_on_half_the_weight_rows_fits_two_programs_per_sm(op, block_n):
    """The harness's two-programs-per-SM candidate (``--block-n-down 64 --block-n-gate-up 32``):
    the default tiles hold one 8-warp program per SM by their registers (164 / 182 a thread); half
    the weight rows a tile must leave room for two, in registers (65536 an SM) and in shared memory,
    with no spills, or the GPU run would measure nothing new."""
    kernel = _compile(fk.Mode.W4A8, op, block_n=block_n)
    assert kernel.spill_bytes == 0, kernel.spill_bytes
    assert 2 * 8 * 32 * -(-kernel.registers // 8) * 8 <= 65536, kernel.registers  # allocated in 8s
    # An SM90 SM has 228 KB of shared memory and reserves 1 KB of it for each resident program.
    assert 2 * (kernel.shared_bytes + 1024) <= 228 * 1024, kernel.shared_bytes


@pytest.mark.parametrize("label", ["table w4a8 half", "table w4a8 half w4"])
@pytest.mark.parametrize("op", list(SHAPES), ids=lambda op: op.value)
def test_the_harness_s_table_w4a8_candidates_compile_as_measured(op, label):
    """``fp8_probe.py``'s library-kernel candidates as it runs them (the gate/up's rows read by
    index, as the layer calls it): FP8 ``wgmma``, no spills; with 4 warps two programs fit an SM in
    both projections (at 8 warps only the down projection's: 127 registers against gate/up's 164)."""
    from benchmarks import fp8_probe  # noqa: PLC0415
    from pallas_kernels.grouped_matmul import triton_lang  # noqa: PLC0415

    k, n_out = SHAPES[op]
    rows = 65536
    tile = fp8_probe.table_w4a8_tile(label, op, num_rows=rows, k=k, n_out=n_out)
    spec = triton_lang.make_spec(op, triton_lang.Mode.W4A8, num_rows=rows, num_experts=384, k=k, n_out=n_out,
                                 scale_groups=1, compute_capability=90, tile=tile,
                                 gather_rows=rows // 8 if op is Op.GATE_UP_SWIGLU else 0)
    kernel = crosscompile.compile_jit(triton_lang.kernel_function(), signature=triton_lang.signature(spec),
                                      constexprs=spec.constexprs(), capability=90, num_warps=tile.num_warps,
                                      num_stages=spec.tile.num_stages, name=f"table_w4a8_{op.value}")
    assert "e4m3.e4m3" in kernel.ptx and kernel.spill_bytes == 0, kernel.spill_bytes
    registers = -(-kernel.registers // 8) * 8  # allocated in steps of 8 a thread
    programs = min(65536 // (tile.num_warps * 32 * registers), 228 * 1024 // (kernel.shared_bytes + 1024))
    assert programs >= (2 if label.endswith(" w4") or op is Op.MATMUL else 1), (kernel.registers, kernel.shared_bytes)


def test_w4a8_dequantizes_in_registers_in_fewer_instructions_than_w4a16():
    """The 128 + 64-row path's K loop (the one with the most MMAs): E4M3 codes built in the MMA's
    register order (no STS), and fewer SASS instructions a K step than the W4A16 table tile's
    (the same 128 weight rows x 128 columns), whose MMAs are twice as many."""
    w4a8 = max(k_loops(_compile(fk.Mode.W4A8, Op.GATE_UP_SWIGLU, with_sass=True).sass), key=lambda c: c["QGMMA"])
    _, table = grouped_crosscompile.compile_native(90, (Variant.PREFILL, Op.GATE_UP_SWIGLU), experts=384,
                                                   with_sass=True)
    w4a16 = max(k_loops(table.sass), key=lambda c: c["HGMMA"])
    assert w4a8["STS"] == 0 and w4a8["QGMMA"] * 2 == w4a16["HGMMA"], (w4a8, w4a16)
    assert w4a8["total"] < w4a16["total"], (w4a8["total"], w4a16["total"])


_POINTER_TYPES = {"int32": "*i32", "bfloat16": "*bf16", "float8_e4m3fn": "*fp8e4nv", "uint8": "*u8"}


@pytest.mark.parametrize("mode", list(fk.Mode), ids=lambda mode: mode.name.lower())
def test_launch_passes_each_pointer_where_the_kernel_reads_it(monkeypatch, mode):
    """jax-triton passes the operands in order and then the output: those pointers' types are the
    kernel's own (``ProbeSpec.signature``, which the cross-compilation above uses), in its order.
    (A persistent variant once took an operand after ``out``: on the GPU it read the output
    buffer as that operand and did not compile.)"""
    import sys  # noqa: PLC0415
    import types  # noqa: PLC0415

    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    seen = {}

    def triton_call(*operands, kernel, out_shape, input_output_aliases=None, **_):
        seen.update(pointers=[_POINTER_TYPES[str(a.dtype)] for a in operands] + [_POINTER_TYPES[str(out_shape.dtype)]],
                    aliases=input_output_aliases, count=len(operands))
        return jnp.zeros(out_shape.shape, out_shape.dtype)

    monkeypatch.setitem(sys.modules, "jax_triton", types.SimpleNamespace(triton_call=triton_call))
    k, n_out, experts, m = 256, 128, 4, 256
    spec = fk.ProbeSpec(mode=mode, op=Op.MATMUL, num_rows=m, num_experts=experts, k=k, n_out=n_out)
    x_dtype = jnp.bfloat16 if mode in (fk.Mode.BF16, fk.Mode.W4A16) else jnp.float8_e4m3fn
    w = {fk.Mode.BF16: jnp.zeros((experts, n_out, k), jnp.bfloat16),
         fk.Mode.FP8: jnp.zeros((experts, n_out, k), jnp.float8_e4m3fn)}.get(
        mode, jnp.zeros((experts, n_out, k // 2), jnp.uint8))
    out = jnp.zeros((m, n_out), jnp.bfloat16)
    jax.eval_shape(lambda o: fk.launch(spec, jnp.full((experts,), m // experts, jnp.int32), jnp.zeros((m, k), x_dtype),
                                       w, jnp.zeros((experts, n_out, k // 16), jnp.uint8), o), out)
    wanted = [t for t in spec.signature().values() if t != "constexpr"]
    assert seen["pointers"] == wanted, (seen["pointers"], wanted)
    assert seen["aliases"] == {seen["count"] - 1: 0}  # the buffer written into is out's
