"""Runs the native kernels (``pallas_kernels/grouped_matmul/triton_lang.py``), W4A4 and W4A16, in
Triton's interpreter on CPU, with NumPy buffers and every memory access bounds-checked.

Needs triton 3.9.0 and ``TRITON_INTERPRET=1`` before triton is imported (``./run test`` runs
``tests/interpreter/`` so, with ``.triton-interpret``'s triton; see ``conftest.py`` there).

Triton 3.9.0's interpreter is close to what the GPU does but for four things that matter here,
corrected in one place, :func:`install`, against its private names (it raises if they moved):

1. ``dot_scaled`` decodes every scale byte as E8M0 (``2**(byte - 127)``), also scales typed
   ``float8e4nv``: NVFP4's E4M3 block scales would come out off by up to ~1e30. They are decoded
   as E4M3 (float8_e4m3fn, exact in float32) instead.
2. ``float32 -> bfloat16`` truncates; the GPU rounds to nearest even (``cvt.rn.bf16.f32``). It
   rounds to nearest even here too.
3. Launching copies array arguments to and from torch storages. NumPy buffers live in host
   memory already: they are passed as they are, by address.

4. bfloat16 values are stored as their uint16 bits, and arithmetic (``*``, ``+``, ...) and
   ``tl.dot`` on them operate on those bits as integers. They are decoded to float32 first here
   (products of two bf16 are exact there), and arithmetic results rounded to nearest even.

It also runs what it has no support for at all: inline PTX (``tl.inline_asm_elementwise``, the
W4A16 kernels' E2M1 placement) is evaluated instruction by instruction by ``ptx_emulator``,
which knows exactly the instructions that block uses and raises on any other.

What the interpreter cannot see, this module adds: a load or store lane whose address falls
outside the buffer its other lanes address (each tile derives from one argument) is counted
(:data:`VIOLATIONS`) and left out of the access, and the tests require none; the interpreter
itself would read or write whatever lies there, or crash. Races stay invisible (programs run one at a time).
"""

from __future__ import annotations

import dataclasses
import os

import ml_dtypes
import numpy as np
import ptx_emulator

TRITON_VERSION = "3.9.0"

#: The interpreter's float arithmetic that correction 4 routes through float32 for bf16 operands.
_BF16_ARITHMETIC = ("create_fadd", "create_fsub", "create_fmul", "create_fdiv", "create_fneg", "create_minimumf",
                    "create_maximumf", "create_minnumf", "create_maxnumf")

#: Out-of-buffer load/store lanes seen since the last :func:`reset` (op, lanes, detail).
VIOLATIONS: list[tuple[str, int, str]] = []
_BUFFERS: list[tuple[int, int, str]] = []  # (start, end, name) of every registered buffer


def check_environment() -> str | None:
    """Why this cannot run here, or None."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return "TRITON_INTERPRET=1 must be set before triton is imported"
    try:
        import triton  # noqa: PLC0415
    except ImportError:
        return "triton is not installed"
    if triton.__version__ != TRITON_VERSION:
        return (f"triton {triton.__version__}; the W4A4 interpreter tests need {TRITON_VERSION} (./run test runs "
                "them with triton 3.9.0 from .triton-interpret)")
    return None


@dataclasses.dataclass
class Buffer:
    """A NumPy array the interpreter addresses by pointer (what ``triton`` reads off a tensor)."""

    array: np.ndarray
    dtype: str  # triton's name of the element type: "u8", "i32", "fp32", "bf16"
    name: str

    def data_ptr(self) -> int:
        return self.array.ctypes.data


def buffer(array: np.ndarray, name: str) -> Buffer:
    """Registers ``array`` (C-contiguous) for the bounds checks and wraps it for a launch."""
    array = np.ascontiguousarray(array)
    kinds = {np.dtype(np.uint8): "u8", np.dtype(np.int32): "i32", np.dtype(np.float32): "fp32",
             np.dtype(ml_dtypes.bfloat16): "bf16", np.dtype(ml_dtypes.float8_e4m3fn): "fp8e4nv"}
    start = array.ctypes.data
    _BUFFERS.append((start, start + max(array.nbytes, 1), name))
    return Buffer(array, kinds[array.dtype], name)


def schedule_buffers(group_sizes, num_rows: int, block_m: int, num_tiles: int) -> list[Buffer]:
    """The kernels' first three arguments: the real tile schedule (``tile_schedule``) as buffers."""
    import jax.numpy as jnp  # noqa: PLC0415
    from pallas_kernels.grouped_matmul import pallas_triton  # noqa: PLC0415

    schedule = pallas_triton.tile_schedule(jnp.asarray(group_sizes, jnp.int32), num_rows=num_rows, block_m=block_m,
                                            num_tiles=num_tiles)
    return [buffer(np.asarray(a, np.int32), name)
            for a, name in zip(schedule, ("tile_expert", "tile_start", "tile_end"), strict=True)]


def launch(kernel, num_programs: int, buffers: list[Buffer], out: np.ndarray, constexprs: dict) -> np.ndarray:
    """Runs ``kernel`` over ``num_programs`` programs on ``buffers`` and ``out`` (its last
    argument, registered here); asserts that no access left its buffer; ``out`` as float64."""
    out_buffer = buffer(out, "out")
    kernel[(num_programs,)](*buffers, out_buffer, **constexprs)
    assert not VIOLATIONS, VIOLATIONS[:5]
    return out_buffer.array.astype(np.float64)


def reset() -> None:
    VIOLATIONS.clear()
    _BUFFERS.clear()


def _in_bounds(op: str, ptrs: np.ndarray, mask: np.ndarray, itemsize: int) -> np.ndarray:
    """The lanes of ``mask`` whose addresses lie inside the buffer the tile addresses (the one
    holding its lowest active address); the others are counted in :data:`VIOLATIONS` and
    dropped from the access, so a broken kernel fails with that count instead of crashing."""
    mask = np.broadcast_to(mask, ptrs.shape)
    addresses = ptrs.astype(np.uint64)
    if not mask.any():
        return mask
    first = int(addresses[mask].min())
    for start, end, name in _BUFFERS:
        if start <= first < end:
            inside = (addresses >= start) & (addresses + itemsize <= end)
            outside = int(np.count_nonzero(mask & ~inside))
            if outside:
                VIOLATIONS.append((op, outside, f"{outside} lanes outside {name}"))
            return mask & inside
    VIOLATIONS.append((op, int(np.count_nonzero(mask)), "no registered buffer holds the lowest address"))
    return np.zeros_like(mask)


def install() -> None:
    """The corrections above, the inline PTX and the bounds checks; idempotent. Raises if triton moved."""
    reason = check_environment()
    if reason:
        raise RuntimeError(reason)
    from triton.runtime import interpreter as it  # noqa: PLC0415

    needed = ("_dot_scaled_scale_to_f32", "InterpreterBuilder", "GridExecutor", "TensorHandle")
    missing = [name for name in needed if not hasattr(it, name)]
    for cls, attrs in (("InterpreterBuilder", ("cast_impl", "create_masked_load", "create_masked_store",
                                               "create_inline_asm", "create_dot", *_BF16_ARITHMETIC)),
                       ("GridExecutor", ("_init_args_hst", "_restore_args_dev"))):
        missing += [f"{cls}.{a}" for a in attrs if not hasattr(getattr(it, cls, None), a)]
    if missing:
        raise RuntimeError(f"triton {TRITON_VERSION}'s interpreter has no {', '.join(missing)}: the corrections in "
                           f"{__file__} need updating")
    if getattr(it, "_moe_jax_installed", False):
        return
    import triton.language as tl  # noqa: PLC0415

    e8m0 = it._dot_scaled_scale_to_f32

    def scale_to_f32(scale_handle, compute_type):
        if scale_handle.dtype == tl.float8e4nv:
            return scale_handle.data.view(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
        return e8m0(scale_handle, compute_type)

    cast = it.InterpreterBuilder.cast_impl

    def to_bf16(values_f32):
        bits = np.ascontiguousarray(values_f32, np.float32).view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        rounded[np.isnan(values_f32)] = 0x7FC0
        return rounded.reshape(np.shape(values_f32))

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return it.TensorHandle(to_bf16(src.data), tl.bfloat16)
        return cast(self, src, dst_type)

    def from_bf16(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle.data
        return (np.asarray(handle.data, np.uint16).astype(np.uint32) << 16).view(np.float32)

    def bf16_arithmetic(name):
        original = getattr(it.InterpreterBuilder, name)

        def op(self, *operands):
            if all(h.dtype.scalar != tl.bfloat16 for h in operands):
                return original(self, *operands)
            as_f32 = [it.TensorHandle(from_bf16(h), tl.float32) for h in operands]
            return it.TensorHandle(to_bf16(original(self, *as_f32).data), tl.bfloat16)
        return op

    dot = it.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if tl.bfloat16 in (a.dtype.scalar, b.dtype.scalar):
            a, b = (it.TensorHandle(from_bf16(h), tl.float32) for h in (a, b))
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    load, store = it.InterpreterBuilder.create_masked_load, it.InterpreterBuilder.create_masked_store

    def masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        itemsize = np.dtype(it._get_np_dtype(ptrs.get_element_ty())).itemsize
        mask = it.TensorHandle(_in_bounds("load", ptrs.data, mask.data, itemsize), mask.dtype)
        return load(self, ptrs, mask, other, cache_policy, is_volatile)

    def masked_store(self, ptrs, value, mask, cache_policy):
        mask = it.TensorHandle(_in_bounds("store", ptrs.data, mask.data, value.data.dtype.itemsize), mask.dtype)
        return store(self, ptrs, value, mask, cache_policy)

    def inline_asm(self, asm, constraints, values, types, is_pure, pack):
        return _InlineAsm(it, asm, constraints, values, types, pack)

    it._dot_scaled_scale_to_f32 = scale_to_f32
    it.InterpreterBuilder.create_inline_asm = inline_asm
    it.InterpreterBuilder.create_dot = create_dot
    for name in _BF16_ARITHMETIC:
        setattr(it.InterpreterBuilder, name, bf16_arithmetic(name))
    it.InterpreterBuilder.cast_impl = cast_impl
    it.InterpreterBuilder.create_masked_load = masked_load
    it.InterpreterBuilder.create_masked_store = masked_store
    it.GridExecutor._init_args_hst = lambda self, args, kwargs: (list(args), dict(kwargs))
    it.GridExecutor._restore_args_dev = lambda self, *args: None
    it._moe_jax_installed = True


class _InlineAsm:
    """The results of one ``tl.inline_asm_elementwise``, evaluated by :mod:`ptx_emulator` on every
    element at once; ``get_result(i)`` as the builder's op has it. With ``pack > 1`` an instance
    takes ``pack`` consecutive elements (row-major, the last axis fastest) of each input, one
    register each, and an output narrower than 32 bits holds its ``pack`` elements in one
    register, element ``q`` in the ``q``-th lowest bits (the W4A8 probe's pack of 4 bytes)."""

    _BITS = {"h": (np.uint16, 0xFFFF), "r": (np.uint32, 0xFFFFFFFF)}

    def __init__(self, it, asm: str, constraints: str, values, types, pack: int):
        kinds = [c.strip() for c in constraints.split(",")]
        outputs = [k.lstrip("=") for k in kinds if k.startswith("=")]
        inputs = kinds[len(outputs):]
        if len(inputs) != pack * len(values):
            raise NotImplementedError(f"inline asm: {len(inputs)} input registers for {len(values)} inputs at "
                                      f"pack={pack}")
        shape = np.broadcast_shapes(*(np.shape(v.data) for v in values))
        operands = {}
        for i, value in enumerate(values):
            flat = np.broadcast_to(value.data, shape).reshape(-1)
            for q in range(pack):
                dtype, _ = self._BITS[inputs[i * pack + q]]
                part = np.ascontiguousarray(flat[q::pack])
                bits = part.view(dtype) if part.dtype.itemsize == np.dtype(dtype).itemsize else part.astype(dtype)
                operands[f"r{len(outputs) + i * pack + q}"] = bits.astype(np.uint64)
        regs = ptx_emulator.run(asm.replace("$", "r"), operands)
        self._results = []
        for j, (kind, ty) in enumerate(zip(outputs, types, strict=True)):
            dtype, mask = self._BITS[kind]
            scalar = getattr(ty, "scalar", ty)
            np_dtype = np.dtype(it._get_np_dtype(scalar))
            if pack == 1:
                bits = (regs[f"r{j}"] & np.uint64(mask)).astype(dtype)
                self._results.append(it.TensorHandle(bits.view(np_dtype).reshape(shape), scalar))
                continue
            width = 8 * np_dtype.itemsize
            if kind != "r" or width * pack != 32:
                raise NotImplementedError(f"inline asm output {kind} of {np_dtype} at pack={pack}")
            element_bits = np.uint64((1 << width) - 1)
            parts = [(regs[f"r{j}"] >> np.uint64(width * q)) & element_bits for q in range(pack)]
            flat = np.stack(parts, axis=-1).reshape(-1).astype(np.dtype(f"uint{width}"))
            self._results.append(it.TensorHandle(flat.view(np_dtype).reshape(shape), scalar))

    def get_result(self, i: int):
        return self._results[i]
