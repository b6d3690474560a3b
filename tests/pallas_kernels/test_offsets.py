"""CI check, no GPU needed: no kernel addresses memory through an offset that can overflow.

Each kernel is lowered without a GPU (for an abstract H200) at the largest published MoE shapes
(Kimi K2: 384 experts; DeepSeek-V3: 256; and a model with twice Kimi's experts) and the
largest row count (32768 tokens x top-8). In the Triton IR every load and store is a
``tt.addptr`` of a kernel argument and an offset tensor; an argument with 2**31 elements or
more must be addressed with 64-bit offsets, since Triton sign-extends 32-bit ones.

This is the class of bug that made the NVFP4 down projection read the wrong weights for
every Kimi K2 expert from 293 on (and fault, depending on where the buffer landed):
interpret mode clamps indices, so only the lowered IR shows it on a CPU.
"""

from __future__ import annotations

import math
import os
import pathlib
import re
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import crosscompile, pallas_offsets
from pallas_kernels.grouped_matmul import Op, grouped_matmul_weight_grad, run

SHAPES = {  # experts, hidden, expert intermediate
    "kimi_k2": (384, 7168, 2048),
    "deepseek_v3": (256, 7168, 2048),
    "twice_kimi_k2": (768, 7168, 2048),
}
ROWS = 32768 * 8


def _abstract(weight_format: str, e: int, n: int, k: int):
    s = jax.ShapeDtypeStruct
    if weight_format == "bf16":
        return s((e, n, k), jnp.bfloat16)
    return (s((e, n, k // 2), jnp.uint8), s((e, n, k // 16), jnp.float8_e4m3fn), s((e,), jnp.float32))


def _module(op: Op, weight_format: str, e: int, h: int, f: int):
    n, k = (2 * f, h) if op is Op.GATE_UP_SWIGLU else (h, f)

    def fn(x, w, group_sizes):
        if isinstance(w, tuple):
            w = types.SimpleNamespace(packed=w[0], scales=w[1], global_scale=w[2])
        return run(op, x, w, group_sizes, compute_capability=90)

    args = (jax.ShapeDtypeStruct((ROWS, k), jnp.bfloat16), _abstract(weight_format, e, n, k),
            jax.ShapeDtypeStruct((e,), jnp.int32))
    [module] = crosscompile.triton_modules(fn, *args, capability=90)
    return module


def pointer_offsets(ttir: str) -> dict[int, set[str]]:
    """Kernel argument index -> the integer types of the offsets every ``tt.addptr`` adds to it.

    Follows the pointer from the ``tt.addptr`` back through ``tt.splat``/``tt.broadcast``/
    ``tt.addptr`` to a ``%argN``.
    """
    source = {}
    for m in re.finditer(r"(%[\w#]+) = tt\.(?:splat|broadcast|expand_dims) (%[\w#]+)", ttir):
        source[m.group(1)] = m.group(2)
    adds = list(re.finditer(r"(%[\w#]+) = tt\.addptr (%[\w#]+), %[\w#]+ : [^,]+, (?:tensor<[\dx]+x)?(i\d+)", ttir))
    for m in adds:
        source[m.group(1)] = m.group(2)
    found: dict[int, set[str]] = {}
    for m in adds:
        base = m.group(2)
        while base in source:
            base = source[base]
        arg = re.fullmatch(r"%arg(\d+)", base)
        assert arg, f"addptr base {m.group(0)!r} does not lead back to a kernel argument"
        found.setdefault(int(arg.group(1)), set()).add(m.group(3))
    return found


@pytest.mark.parametrize("weight_format", ["bf16", "nvfp4"])
@pytest.mark.parametrize("op", list(Op), ids=lambda o: o.value)
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_no_32_bit_offset_can_overflow(shape, op, weight_format):
    module = _module(op, weight_format, *shape)
    num_args = len(re.search(r"tt\.func public @\w+\((.*?)\) ", module.ttir).group(1).split("%arg")) - 1
    assert len(module.arg_shapes) == num_args, (module.arg_shapes, num_args)
    offsets = pointer_offsets(module.ttir)
    assert offsets, "no tt.addptr found: the IR format changed, fix the parser"
    for arg, types_ in offsets.items():
        elements = math.prod(module.arg_shapes[arg])
        if elements > 2**31:
            assert types_ == {"i64"}, (
                f"argument {arg} {module.arg_shapes[arg]} has {elements} elements but is addressed with {types_} offsets")
        else:
            assert types_ <= {"i32", "i64"}, types_


def _backward_module(kernel: str, projection: str, weight_format: str, e: int, h: int, f: int):
    """The input gradient (``dy @ W_e``, weights as stored) or the float32 weight gradient of one
    projection's forward matmul ``[E, N, K]``."""
    n, k = (2 * f, h) if projection == "gate_up" else (h, f)
    s = jax.ShapeDtypeStruct
    group_sizes = s((e,), jnp.int32)
    match kernel:
        case "input_grad":
            def fn(dy, w, group_sizes):
                if isinstance(w, tuple):
                    w = types.SimpleNamespace(packed=w[0], scales=w[1], global_scale=w[2])
                return run(Op.MATMUL, dy, w, group_sizes, compute_capability=90, transpose_w=True)

            args = (s((ROWS, n), jnp.bfloat16), _abstract(weight_format, e, n, k), group_sizes)
        case "weight_grad":
            def fn(x, dy, group_sizes):
                return grouped_matmul_weight_grad(x, dy, group_sizes, compute_capability=90)

            args = (s((ROWS, k), jnp.bfloat16), s((ROWS, n), jnp.bfloat16), group_sizes)
        case _:
            raise AssertionError(kernel)
    [module] = crosscompile.triton_modules(fn, *args, capability=90)
    return module


@pytest.mark.parametrize("kernel, weight_format", [("input_grad", "bf16"), ("input_grad", "nvfp4"),
                                                   ("weight_grad", "bf16")])
@pytest.mark.parametrize("projection", ["gate_up", "down"])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_no_32_bit_offset_can_overflow_in_the_backward_kernels(shape, projection, kernel, weight_format):
    """The weight gradient's float32 output ``[E, N, K]`` passes 2**31 elements at every shape."""
    module = _backward_module(kernel, projection, weight_format, *shape)
    offsets = pointer_offsets(module.ttir)
    assert offsets, "no tt.addptr found: the IR format changed, fix the parser"
    big = [arg for arg in offsets if math.prod(module.arg_shapes[arg]) > 2**31]
    if kernel == "weight_grad":
        assert big, module.arg_shapes  # the output is past 2**31 elements: the check bites
    for arg in big:
        assert offsets[arg] == {"i64"}, (arg, module.arg_shapes[arg], offsets[arg])


def test_the_check_sees_32_bit_offsets(monkeypatch):
    """The check itself: a kernel the fix does not know (here: ours, unrecorded) keeps JAX's
    32-bit offsets, and Kimi K2's NVFP4 down projection is flagged."""
    monkeypatch.setattr(pallas_offsets, "prepare", lambda name, shapes: None)
    monkeypatch.setattr(pallas_offsets, "_OWN_KERNELS", set())
    jax.clear_caches()  # Lowerings are cached: neither take one from, nor leave one for, other tests.
    try:
        module = _module(Op.MATMUL, "nvfp4", *SHAPES["kimi_k2"])
    finally:
        jax.clear_caches()
    offsets = pointer_offsets(module.ttir)
    packed = next(i for i, s in enumerate(module.arg_shapes) if s == (384, 7168, 1024))
    assert offsets[packed] == {"i32"}


def _foreign_copy_kernel():
    """Another library's Pallas kernel over a one-byte operand of more than 2**31 elements."""
    from jax.experimental import pallas as pl  # noqa: PLC0415

    n, block = 2**31 + 2**20, 2**16

    def copy(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    def fn(x):
        return pl.pallas_call(copy, out_shape=jax.ShapeDtypeStruct((n,), jnp.uint8), grid=(n // block,),
                              in_specs=[pl.BlockSpec((block,), lambda i: (i,))],
                              out_specs=pl.BlockSpec((block,), lambda i: (i,)), name="someone_elses_copy")(x)

    [module] = crosscompile.triton_modules(fn, jax.ShapeDtypeStruct((n,), jnp.uint8), capability=90)
    return module.ttir


def test_another_librarys_kernel_lowers_exactly_as_jax_lowers_it(monkeypatch):
    """With the fix installed (after this library's kernels ran), a foreign kernel's Triton IR is
    the one JAX's own lowering gives, 32-bit offsets included."""
    _module(Op.MATMUL, "nvfp4", *SHAPES["kimi_k2"])  # this library's kernels: the fix is installed
    from jax._src.pallas.triton import lowering  # noqa: PLC0415

    assert hasattr(lowering._compute_offsets_from_indices, "__wrapped__")
    jax.clear_caches()
    with_fix = _foreign_copy_kernel()
    monkeypatch.setattr(lowering, "_compute_offsets_from_indices", lowering._compute_offsets_from_indices.__wrapped__)
    monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module", lowering.lower_jaxpr_to_triton_module.__wrapped__)
    jax.clear_caches()
    try:
        jax_own = _foreign_copy_kernel()
    finally:
        jax.clear_caches()
    assert with_fix == jax_own
    assert set().union(*pointer_offsets(with_fix).values()) == {"i32"}


def test_importing_the_kernels_changes_nothing_in_jax():
    code = ("from jax._src.pallas.triton import lowering as l; before = (l._compute_offsets_from_indices, "
            "l.lower_jaxpr_to_triton_module); import pallas_kernels.grouped_matmul, moe_jax; "
            "assert (l._compute_offsets_from_indices, l.lower_jaxpr_to_triton_module) == before")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=pathlib.Path(__file__).resolve().parents[2],
                   env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_an_unverified_jax_refuses_operands_that_need_the_fix(monkeypatch):
    monkeypatch.setattr(jax, "__version__", "0.11.9")
    pallas_offsets.prepare("small", [(1024, 7168), (48, 4096, 3584)])  # nothing to fix: runs
    with pytest.raises(RuntimeError, match=r"kernel 'big' has an operand of more than 2\*\*31 elements.*verified "
                                           r"for jax 0\.11\.2, found 0\.11\.9"):
        pallas_offsets.prepare("big", [(1024, 2048), (384, 7168, 1024)])
