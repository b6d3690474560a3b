"""Safetensors checkpoint directories: the header reader, the index and the memory-mapped
tensor data, and :class:`CheckpointError`, the error of the whole package."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

#: safetensors dtype codes the reader understands, and their numpy dtypes (float8 and bfloat16
#: through ml_dtypes: numpy has neither, which is why safetensors' numpy reader cannot return them).
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8),
    "I16": np.dtype(np.int16), "I32": np.dtype(np.int32), "I64": np.dtype(np.int64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16), "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
}

_MAX_HEADER = 100 * 2**20  # safetensors' own limit on the JSON header


class CheckpointError(ValueError):
    """A checkpoint that does not hold what the loader expects; one line naming the tensor or file."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TensorInfo:
    """Where one tensor lies: ``path``, bytes ``[start, start + nbytes)`` of the file."""

    name: str
    path: Path
    dtype: str  # the safetensors code, e.g. "F8_E4M3"
    shape: tuple[int, ...]
    start: int
    nbytes: int

    def describe(self) -> str:
        return f"{self.dtype} {list(self.shape)}"


def read_header(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """The tensors of one ``.safetensors`` file, from its header alone (no tensor data is read).

    The format: 8 bytes little-endian header length ``n``, ``n`` bytes of JSON mapping each name
    to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (relative to the end of the header;
    ``"__metadata__"`` is skipped), then the data.

    Raises:
      CheckpointError: an unreadable or inconsistent header, naming the file (and tensor).
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: {size} bytes, expected a safetensors file (8-byte header length first)")
        (n,) = struct.unpack("<Q", raw)
        if n > min(_MAX_HEADER, size - 8):
            raise CheckpointError(f"{path}: header length {n} for a file of {size} bytes, expected a safetensors file")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise CheckpointError(f"{path}: header is not JSON ({err})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is a JSON {type(header).__name__}, expected an object")
    data_start = 8 + n
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            code, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name}: header entry {entry!r}, "
                                  "expected dtype, shape, data_offsets") from None
        if code not in DTYPES:
            raise CheckpointError(f"{name}: dtype {code} in {path.name}, expected one of {', '.join(DTYPES)}")
        nbytes = math.prod(shape) * DTYPES[code].itemsize
        if end - begin != nbytes or begin < 0 or data_start + end > size:
            raise CheckpointError(
                f"{name}: data_offsets [{begin}, {end}] in {path.name} ({size} bytes), expected {nbytes} bytes "
                f"for {code} {list(shape)} inside the file"
            )
        tensors[name] = TensorInfo(name=name, path=path, dtype=code, shape=shape, start=data_start + begin,
                                   nbytes=nbytes)
    return tensors


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object, refusing a key given two different values (``json.loads`` would keep the
    last silently: an index mapping a tensor to two files)."""
    out: dict = {}
    for key, value in pairs:
        if out.setdefault(key, value) != value:
            raise CheckpointError(f"{key}: given twice in {INDEX_FILE}, as {out[key]!r} and {value!r}, expected once")
    return out


class Checkpoint:
    """A Hugging Face-style directory of safetensors: tensor names to :class:`TensorInfo`, and
    their data through memory maps (nothing is read before :meth:`read` asks for it).

    ``model.safetensors.index.json`` (its ``weight_map``) if present, else ``model.safetensors``.

    Raises:
      CheckpointError: an index that contradicts its files: a key given two values, a file
        missing, a tensor missing from the file it is mapped to, or one tensor in two files.
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self._maps: dict[Path, np.memmap] = {}
        index = self.directory / INDEX_FILE
        single = self.directory / SINGLE_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(), object_pairs_hook=_unique_keys)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise CheckpointError(f"{index}: expected JSON with a 'weight_map' object ({err!r})") from None
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: weight_map is a {type(weight_map).__name__}, expected an object")
            files = sorted(set(weight_map.values()))
            headers: dict[str, dict[str, TensorInfo]] = {}
            seen: set[str] = set()  # the tensors of the headers read so far
            for file in files:
                if not (self.directory / file).is_file():
                    names = [name for name, f in weight_map.items() if f == file]
                    more = f" and {len(names) - 1} more" if len(names) > 1 else ""
                    raise CheckpointError(
                        f"{self.directory / file}: missing, but {INDEX_FILE} lists it (for {names[0]}{more})"
                    )
                header = read_header(self.directory / file)
                if not seen.isdisjoint(header):
                    # Which copy is meant cannot be known, even where the index names one.
                    name = next(n for n in header if n in seen)
                    before = next(f for f, h in headers.items() if name in h)
                    mapped = f"maps it to {weight_map[name]}" if name in weight_map else "does not list it"
                    raise CheckpointError(
                        f"{name}: stored in both {before} and {file}, expected one file ({INDEX_FILE} {mapped})"
                    )
                headers[file] = header
                seen.update(header)
            self.tensors: dict[str, TensorInfo] = {}
            for name, file in weight_map.items():
                if name not in headers[file]:
                    raise CheckpointError(f"{name}: missing from {file}, where {INDEX_FILE} says it is")
                self.tensors[name] = headers[file][name]
        elif single.is_file():
            self.tensors = read_header(single)
        else:
            raise CheckpointError(f"{self.directory}: neither {INDEX_FILE} nor {SINGLE_FILE}, expected one of them")

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise CheckpointError(f"{name}: missing from the checkpoint in {self.directory}")
        return self.tensors[name]

    def read(self, name: str) -> np.ndarray:
        """A copy of one tensor's data, in its numpy dtype (float8/bfloat16 from ml_dtypes).

        The one place tensor data is read (tests instrument it).
        """
        info = self.info(name)
        if info.path not in self._maps:
            self._maps[info.path] = np.memmap(info.path, dtype=np.uint8, mode="r")
        raw = self._maps[info.path][info.start:info.start + info.nbytes]
        return np.array(raw.view(DTYPES[info.dtype]).reshape(info.shape))
