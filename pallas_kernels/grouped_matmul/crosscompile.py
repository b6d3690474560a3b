"""Cross-compiles every tile configuration of one capability's table row, without a GPU.

Used by CI (``tests/pallas_kernels/test_crosscompile.py``) as the proof that the SM100/SM120
rows fit those chips, and by ``benchmarks/sm_crosscompile.py`` to record registers and shared
memory. Each configuration is lowered at a Kimi K2 shape (48 experts, hidden 7168, expert
intermediate 2048) through the public entry, so the kernel compiled is the one a caller gets.
"""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp

from pallas_kernels import crosscompile
from pallas_kernels.grouped_matmul import grouped_matmul_weight_grad, run
from pallas_kernels.grouped_matmul.tuning import (
    SHARED_MEMORY_BYTES,
    TILE_TABLE,
    Key,
    Op,
    Variant,
    WeightFormat,
    choose_weight_grad_tile,
)

EXPERTS, HIDDEN, INTERMEDIATE = 48, 7168, 2048
ROWS = {Variant.DECODE: 128, Variant.PREFILL: 8192}


@dataclasses.dataclass(frozen=True)
class Record:
    capability: int
    variant: str
    weights: str
    op: str
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    target: str
    shared_bytes: int
    shared_limit: int
    registers: int
    spill_bytes: int
    mma: tuple[str, ...]


def _abstract_weights(weights: WeightFormat, n: int, k: int):
    shape = jax.ShapeDtypeStruct
    match weights:
        case WeightFormat.BF16:
            return shape((EXPERTS, n, k), jnp.bfloat16)
        case WeightFormat.NVFP4:
            return (shape((EXPERTS, n, k // 2), jnp.uint8), shape((EXPERTS, n, k // 16), jnp.float8_e4m3fn),
                    shape((EXPERTS,), jnp.float32))
    raise AssertionError(weights)


def compile_config(capability: int, key: Key) -> Record:
    """Lowers and compiles the kernel the table row of ``capability`` holds for ``key``."""
    variant, weights, op = key
    config = TILE_TABLE[capability][key]
    m, k, n = ROWS[variant], HIDDEN, 2 * INTERMEDIATE  # gate_up: N = 2F for both ops.

    def fn(x, w, group_sizes):
        if isinstance(w, tuple):
            w = types.SimpleNamespace(packed=w[0], scales=w[1], global_scale=w[2])
        return run(op, x, w, group_sizes, compute_capability=capability, config=config, variant=variant)

    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), _abstract_weights(weights, n, k),
            jax.ShapeDtypeStruct((EXPERTS,), jnp.int32))
    [module] = crosscompile.triton_modules(fn, *args, capability=capability)
    kernel = crosscompile.compile_ttir(module, capability)
    return Record(
        capability=capability, variant=variant.value, weights=weights.value, op=op.value,
        block_m=config.block_m, block_n=config.block_n, block_k=config.block_k, num_warps=config.num_warps,
        num_stages=config.num_stages, target=kernel.target, shared_bytes=kernel.shared_bytes,
        shared_limit=SHARED_MEMORY_BYTES[capability], registers=kernel.registers, spill_bytes=kernel.spill_bytes,
        mma=kernel.mma_instructions,
    )


#: The backward kernels compiled per capability: the input gradient of the down projection
#: (``dy [M, H] @ W_e [H, F]``, the matmul's tile entry, transposed) in each variant and format,
#: and the weight gradient of the gate/up projection (``[E, 2F, H]`` float32), both of its tiles.
BACKWARD_KERNELS = (
    *(("input_grad", variant, weights) for variant in Variant for weights in WeightFormat),
    ("weight_grad", Variant.DECODE, WeightFormat.BF16),
    ("weight_grad", Variant.PREFILL, WeightFormat.BF16),
)


def compile_backward(capability: int, kernel: str, variant: Variant, weights: WeightFormat) -> Record:
    """Lowers and compiles one of :data:`BACKWARD_KERNELS` at the Kimi K2 shape."""
    m = ROWS[variant]
    s = jax.ShapeDtypeStruct
    group_sizes = s((EXPERTS,), jnp.int32)
    match kernel:
        case "input_grad":
            config = TILE_TABLE[capability][(variant, weights, Op.MATMUL)]

            def fn(dy, w, group_sizes):
                if isinstance(w, tuple):
                    w = types.SimpleNamespace(packed=w[0], scales=w[1], global_scale=w[2])
                return run(Op.MATMUL, dy, w, group_sizes, compute_capability=capability, variant=variant,
                           transpose_w=True)

            args = (s((m, HIDDEN), jnp.bfloat16), _abstract_weights(weights, HIDDEN, INTERMEDIATE), group_sizes)
        case "weight_grad":
            # DECODE compiles the few-rows tile, PREFILL the many-rows one (32768 rows over 48 experts).
            m = 32768 if variant is Variant.PREFILL else m
            config = choose_weight_grad_tile(num_rows=m, num_experts=EXPERTS, compute_capability=capability)

            def fn(x, dy, group_sizes):
                return grouped_matmul_weight_grad(x, dy, group_sizes, compute_capability=capability)

            args = (s((m, HIDDEN), jnp.bfloat16), s((m, 2 * INTERMEDIATE), jnp.bfloat16), group_sizes)
        case _:
            raise ValueError(f"kernel: {kernel!r}, expected 'input_grad' or 'weight_grad'")
    [module] = crosscompile.triton_modules(fn, *args, capability=capability)
    compiled = crosscompile.compile_ttir(module, capability)
    return Record(
        capability=capability, variant=variant.value, weights=weights.value, op=kernel,
        block_m=config.block_m, block_n=config.block_n, block_k=config.block_k, num_warps=config.num_warps,
        num_stages=config.num_stages, target=compiled.target, shared_bytes=compiled.shared_bytes,
        shared_limit=SHARED_MEMORY_BYTES[capability], registers=compiled.registers,
        spill_bytes=compiled.spill_bytes, mma=compiled.mma_instructions,
    )


def native_keys(capability: int) -> list[tuple[Variant, Op]]:
    """The native kernels' tile keys of one capability (``triton_lang.NATIVE_TILES``)."""
    from pallas_kernels.grouped_matmul import triton_lang  # noqa: PLC0415 (needs triton)

    return sorted(triton_lang.NATIVE_TILES[capability], key=lambda key: tuple(part.value for part in key))


def compile_native(capability: int, key: tuple[Variant, Op], *, experts: int = EXPERTS,
                   with_sass: bool = False) -> tuple[Record, crosscompile.CompiledKernel]:
    """Compiles the Triton-language kernel (``triton_lang.py``) of one tile entry at the Kimi K2 shape:
    the mode the capability runs (W4A4 from SM100, else W4A16) and the op's projection (gate/up
    ``[E, 2F, H]`` fused with SwiGLU, or down ``[E, H, F]``). Returns the record and the kernel
    (PTX, TTGIR) for the instruction checks."""
    from pallas_kernels.grouped_matmul import triton_lang  # noqa: PLC0415 (needs triton)

    variant, op = key
    tile = triton_lang.NATIVE_TILES[capability][key]
    k, n_out = (HIDDEN, INTERMEDIATE) if op is Op.GATE_UP_SWIGLU else (INTERMEDIATE, HIDDEN)
    mode = triton_lang.mode_for(capability)
    spec = triton_lang.make_spec(op, mode, num_rows=ROWS[variant], num_experts=experts, k=k, n_out=n_out,
                            scale_groups=1, compute_capability=capability, tile=tile)
    kernel = crosscompile.compile_jit(
        triton_lang.kernel_function(), signature=triton_lang.signature(spec), constexprs=spec.constexprs(),
        capability=capability, num_warps=tile.num_warps, num_stages=tile.num_stages,
        name=f"native_{op.value}_{mode.value}_{variant.value}", with_sass=with_sass)
    record = Record(
        capability=capability, variant=variant.value, weights=f"nvfp4 ({mode.value})", op=op.value,
        block_m=tile.block_m, block_n=spec.block_n, block_k=spec.block_k, num_warps=tile.num_warps,
        num_stages=tile.num_stages, target=kernel.target, shared_bytes=kernel.shared_bytes,
        shared_limit=SHARED_MEMORY_BYTES[capability], registers=kernel.registers, spill_bytes=kernel.spill_bytes,
        mma=kernel.mma_instructions,
    )
    return record, kernel


def compile_input_grad(capability: int, *, n: int, k: int, rows: int, experts: int,
                       with_sass: bool = False) -> crosscompile.CompiledKernel:
    """Compiles the native W4A16 input-gradient kernel (``triton_lang.input_grad``) with its table's
    tile for ``rows`` rows over ``experts`` experts, weights ``[E, n, k]``."""
    from pallas_kernels.grouped_matmul import triton_lang  # noqa: PLC0415 (needs triton)

    spec = triton_lang.make_input_grad_spec(num_rows=rows, num_experts=experts, n=n, k=k, compute_capability=capability)
    return crosscompile.compile_jit(
        triton_lang.input_grad_kernel_function(), signature=triton_lang.input_grad_signature(spec),
        constexprs=spec.constexprs(),
        capability=capability, num_warps=spec.tile.num_warps, num_stages=spec.tile.num_stages,
        name="native_input_grad_w4a16", with_sass=with_sass)


def compile_launch(launch, *, with_sass: bool = False) -> crosscompile.CompiledKernel:
    """Compiles what :func:`.triton_launch.call` would launch (a ``triton_launch.Launch``: its
    kernel, pointer types, constexprs, warps, stages and capability), without a GPU."""
    constexprs = dict(launch.constexprs)
    return crosscompile.compile_jit(launch.kernel, signature={**dict(launch.signature),
                                                              **dict.fromkeys(constexprs, "constexpr")},
                                    constexprs=constexprs, capability=launch.capability, num_warps=launch.num_warps,
                                    num_stages=launch.num_stages, name=launch.name, with_sass=with_sass)


def compile_weight_grad(capability: int, *, n: int, k: int, rows: int, experts: int, out_dtype="bfloat16",
                        with_sass: bool = False) -> crosscompile.CompiledKernel:
    """Compiles the native bf16 weight-gradient kernel (``triton_weight_grad``) with the
    capability's weight-gradient tile for ``rows`` rows over ``experts`` experts, ``dW [E, n, k]``."""
    from pallas_kernels.grouped_matmul import triton_weight_grad  # noqa: PLC0415 (needs triton)

    spec = triton_weight_grad.make_spec(num_rows=rows, num_experts=experts, n=n, k=k, compute_capability=capability,
                                        out_dtype=out_dtype)
    return compile_launch(spec.launch(), with_sass=with_sass)


def table_keys(capability: int) -> list[Key]:
    return sorted(TILE_TABLE[capability], key=lambda key: tuple(part.value for part in key))


__all__ = ["BACKWARD_KERNELS", "Record", "compile_backward", "compile_config", "compile_input_grad", "compile_launch",
           "compile_native", "compile_weight_grad", "native_keys", "table_keys", "Op"]
