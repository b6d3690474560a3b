"""Compiles Pallas-Triton kernels for a GPU this machine does not have (CPU is enough).

Deviceless lowering: under an ``AbstractMesh`` whose ``AbstractDevice`` names the target GPU,
``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`` runs the Pallas Triton lowering
for that GPU's compute capability. Each kernel becomes a ``__gpu$xla.gpu.triton`` custom call
whose ``mhlo.backend_config`` carries the Triton module (MLIR bytecode, key ``ir``) and its
``num_warps``/``num_stages``; :func:`triton_modules` reads them back as TTIR text, and
:func:`compile_ttir` compiles that text with the ``triton`` package (3.6) and reads the
resource usage out of the cubin with the ``cuobjdump`` that package ships.

Triton-language kernels (``@triton.jit``, called through ``jax_triton`` on a GPU) need no
lowering: :func:`compile_jit` compiles them directly.

Needs the optional ``triton`` dependency (imported lazily).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import re
import subprocess
import tempfile

import jax
from jax._src.interpreters import mlir as jax_mlir
from jax._src.lib import triton as jax_triton_lib
from jax._src.lib.mlir import ir

#: A device kind the Pallas Triton lowering maps to each compute capability.
DEVICE_KIND = {
    80: "NVIDIA A100-SXM4-80GB",
    89: "NVIDIA L40S",
    90: "NVIDIA H200",
    100: "NVIDIA B200",
    120: "NVIDIA RTX PRO 6000 Blackwell Workstation Edition",
}


@dataclasses.dataclass(frozen=True)
class TritonModule:
    """One Pallas kernel as lowered: TTIR text and its launch parameters."""

    name: str
    ttir: str
    num_warps: int
    num_stages: int
    #: Shapes of the kernel's pointer arguments, in order: the custom call's operands, then its results.
    arg_shapes: tuple[tuple[int, ...], ...] = ()


@dataclasses.dataclass(frozen=True)
class CompiledKernel:
    """What ptxas made of one kernel for one capability."""

    name: str
    capability: int
    target: str  # e.g. "sm_120a", from the PTX's .target line.
    shared_bytes: int
    registers: int
    spill_bytes: int  # Local memory (stack frame) per thread.
    mma_instructions: tuple[str, ...]  # Distinct MMA opcodes in the PTX.
    ptx: str
    sass: str
    ttgir: str


def _custom_calls(op, found):
    for region in op.regions:
        for block in region.blocks:
            for child in block.operations:
                if child.operation.name == "stablehlo.custom_call":
                    found.append(child)
                _custom_calls(child.operation, found)
    return found


def triton_modules(fn, *args, capability: int) -> list[TritonModule]:
    """Lowers ``jax.jit(fn)(*args)`` for ``capability`` without a GPU; returns its Triton kernels.

    ``args`` may be ``jax.ShapeDtypeStruct`` trees.
    """
    device = jax.sharding.AbstractDevice(device_kind=DEVICE_KIND[capability], num_cores=None, platform="cuda")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    modules = []
    for call in _custom_calls(lowered.compiler_ir("stablehlo").operation, []):
        if ir.StringAttr(call.attributes["call_target_name"]).value != "__gpu$xla.gpu.triton":
            continue
        config = call.attributes["mhlo.backend_config"]
        context = jax_mlir.make_ir_context()
        jax_triton_lib.dialect.register_dialect(context)
        with context:
            module = ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes)
            modules.append(TritonModule(
                name=ir.StringAttr(config["name"]).value,
                ttir=str(module),
                num_warps=ir.IntegerAttr(config["num_warps"]).value,
                num_stages=ir.IntegerAttr(config["num_stages"]).value,
                arg_shapes=tuple(tuple(ir.RankedTensorType(v.type).shape)
                                 for v in (*call.operands, *call.results)),
            ))
    return modules


def _cuda_tool(name: str) -> str:
    import triton  # noqa: PLC0415 (optional dependency)

    return str(pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def _run_ttir_passes(ttir: str, capability: int, tmp: str) -> str:
    """Applies Triton's TTIR passes (combine, canonicalize, ...), as XLA's Triton pipeline does.

    ``triton.compile`` skips the passes of the stage an IR file is given in, but they matter:
    among them is the fold of ``acc + dot(a, b, 0)`` into ``dot(a, b, acc)``.
    """
    from triton._C.libtriton import ir as triton_ir  # noqa: PLC0415 (optional dependency)
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.compiler.compiler import make_backend  # noqa: PLC0415

    backend = make_backend(GPUTarget("cuda", capability, 32))
    context = triton_ir.context()
    triton_ir.load_dialects(context)
    backend.load_dialects(context)
    raw = os.path.join(tmp, "raw.ttir")
    pathlib.Path(raw).write_text(ttir)
    module = triton_ir.parse_mlir_module(raw, context)
    module.context = context
    options = backend.parse_options({})
    return str(backend.make_ttir(module, {}, options, capability))


def compile_ttir(module: TritonModule, capability: int, *, with_sass: bool = False) -> CompiledKernel:
    """Compiles TTIR for ``capability`` with triton (3.6) and reads back resource usage."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{module.name}.ttir")
        pathlib.Path(path).write_text(_run_ttir_passes(module.ttir, capability, tmp))
        kernel = triton_compile(path, capability, {"num_warps": module.num_warps, "num_stages": module.num_stages})
    return _compiled(kernel, module.name, capability, with_sass)


def compile_jit(fn, *, signature: dict[str, str], constexprs: dict, capability: int, num_warps: int,
                num_stages: int, name: str, with_sass: bool = False) -> CompiledKernel:
    """Compiles a ``@triton.jit`` function for ``capability`` (Triton-language kernels, the way
    ``jax_triton`` compiles them, minus the launch): ``signature`` maps each argument to its
    Triton type (``"*u8"``, ``"constexpr"``), ``constexprs`` the constexpr arguments to values."""
    kernel = triton_compile(jit_source(fn, signature=signature, constexprs=constexprs), capability,
                            {"num_warps": num_warps, "num_stages": num_stages})
    return _compiled(kernel, name, capability, with_sass)


def jit_source(fn, *, signature: dict[str, str], constexprs: dict):
    """The ``triton.compile`` source of a ``@triton.jit`` function: ``signature`` maps each
    argument to its Triton type (``"*u8"``, ``"constexpr"``), ``constexprs`` the constexpr
    arguments to values; every pointer declared 16-byte aligned."""
    from triton.compiler import ASTSource  # noqa: PLC0415 (optional dependency)

    # jax_triton declares every array argument 16-byte aligned (XLA's buffers are), which decides
    # the loads' vector widths: without it the kernel compiled here is not the one that runs.
    aligned = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(fn.arg_names)
               if signature.get(arg, "").startswith("*")}
    return ASTSource(fn=fn, signature=signature, attrs=aligned,
                     constexprs={(fn.arg_names.index(arg),): value for arg, value in constexprs.items()})


@functools.cache
def _process_cache() -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix="moe-jax-triton-cache-")


def triton_compile(source, capability: int, options: dict):
    """``triton.compile(source)`` for ``capability``. Importing jax_triton sets
    ``TRITON_CACHE_DIR`` to "" in the process (it keeps its compiled kernels itself), after which
    ``triton.compile`` finds no cache directory and raises: then the kernel is compiled into a
    cache directory of this process's own, removed at exit."""
    import triton  # noqa: PLC0415 (optional dependency)
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415

    with triton.knobs.cache.scope():
        if not triton.knobs.cache.dir:
            triton.knobs.cache.dir = _process_cache().name
        return triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)


def _compiled(kernel, name: str, capability: int, with_sass: bool) -> CompiledKernel:
    """Resource usage and instructions of a compiled triton kernel, read from its cubin and PTX."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        pathlib.Path(cubin).write_bytes(kernel.asm["cubin"])
        usage = subprocess.run([_cuda_tool("cuobjdump"), "--dump-resource-usage", cubin],
                               check=True, capture_output=True, text=True).stdout
        sass = ""
        if with_sass:
            sass = subprocess.run([_cuda_tool("cuobjdump"), "--dump-sass", cubin],
                                  check=True, capture_output=True, text=True).stdout
    registers = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    ptx = kernel.asm["ptx"]
    target = re.search(r"^\.target\s+(\S+)", ptx, re.MULTILINE)
    mma = sorted({m.group(0) for m in re.finditer(r"\b(?:wgmma\.mma_async|mma\.sync|tcgen05\.mma)[\w.:]*", ptx)})
    return CompiledKernel(
        name=name,
        capability=capability,
        target=target.group(1) if target else "",
        shared_bytes=int(kernel.metadata.shared),
        registers=int(registers.group(1)) if registers else -1,
        spill_bytes=int(stack.group(1)) if stack else -1,
        mma_instructions=tuple(mma),
        ptx=ptx,
        sass=sass,
        ttgir=kernel.asm["ttgir"],
    )
