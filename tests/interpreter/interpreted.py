"""Runs the native W4A4 kernels (``pallas_kernels/grouped_matmul/native.py``) in Triton's
interpreter on CPU, with NumPy buffers and every memory access bounds-checked.

Needs triton 3.9.0 and ``TRITON_INTERPRET=1`` before triton is imported (``./run test`` runs
``tests/interpreter/`` in ``.venv-interpret`` so; see ``conftest.py`` there).

Triton 3.9.0's interpreter is close to what the GPU does but for three things that matter here,
corrected in one place, :func:`install`, against its private names (it raises if they moved):

1. ``dot_scaled`` decodes every scale byte as E8M0 (``2**(byte - 127)``), also scales typed
   ``float8e4nv``: NVFP4's E4M3 block scales would come out off by up to ~1e30. They are decoded
   as E4M3 (float8_e4m3fn, exact in float32) instead.
2. ``float32 -> bfloat16`` truncates; the GPU rounds to nearest even (``cvt.rn.bf16.f32``). It
   rounds to nearest even here too.
3. Launching copies array arguments to and from torch storages. NumPy buffers live in host
   memory already: they are passed as they are, by address.

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

TRITON_VERSION = "3.9.0"

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
                "them in .venv-interpret)")
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
             np.dtype(ml_dtypes.bfloat16): "bf16"}
    start = array.ctypes.data
    _BUFFERS.append((start, start + max(array.nbytes, 1), name))
    return Buffer(array, kinds[array.dtype], name)


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
    """The three corrections above and the bounds checks; idempotent. Raises if triton moved."""
    reason = check_environment()
    if reason:
        raise RuntimeError(reason)
    from triton.runtime import interpreter as it  # noqa: PLC0415

    needed = ("_dot_scaled_scale_to_f32", "InterpreterBuilder", "GridExecutor", "TensorHandle")
    missing = [name for name in needed if not hasattr(it, name)]
    for cls, attrs in (("InterpreterBuilder", ("cast_impl", "create_masked_load", "create_masked_store")),
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

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.ascontiguousarray(src.data, np.float32).view(np.uint32).astype(np.uint64)
            rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            nan = np.isnan(src.data)
            rounded[nan] = 0x7FC0
            return it.TensorHandle(rounded.reshape(np.shape(src.data)), tl.bfloat16)
        return cast(self, src, dst_type)

    load, store = it.InterpreterBuilder.create_masked_load, it.InterpreterBuilder.create_masked_store

    def masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        itemsize = np.dtype(it._get_np_dtype(ptrs.get_element_ty())).itemsize
        mask = it.TensorHandle(_in_bounds("load", ptrs.data, mask.data, itemsize), mask.dtype)
        return load(self, ptrs, mask, other, cache_policy, is_volatile)

    def masked_store(self, ptrs, value, mask, cache_policy):
        mask = it.TensorHandle(_in_bounds("store", ptrs.data, mask.data, value.data.dtype.itemsize), mask.dtype)
        return store(self, ptrs, value, mask, cache_policy)

    it._dot_scaled_scale_to_f32 = scale_to_f32
    it.InterpreterBuilder.cast_impl = cast_impl
    it.InterpreterBuilder.create_masked_load = masked_load
    it.InterpreterBuilder.create_masked_store = masked_store
    it.GridExecutor._init_args_hst = lambda self, args, kwargs: (list(args), dict(kwargs))
    it.GridExecutor._restore_args_dev = lambda self, *args: None
    it._moe_jax_installed = True
