"""MoE layers of Hugging Face-style safetensors checkpoints in NVIDIA ModelOpt's NVFP4 layout.

:func:`load_moe_layer` reads one MoE layer of a DeepSeek-V3-architecture model (DeepSeek-V3/R1,
Kimi K2) from a directory holding ``config.json`` and either ``model.safetensors`` or
``model.safetensors.index.json`` with the files its ``weight_map`` names; :func:`save_moe_layer`
writes the library's parameters back in the same format. Tensors of layer ``L``::

    model.layers.{L}.mlp.gate.weight                      router [E, H], never quantized (kept as stored)
    model.layers.{L}.mlp.gate.e_score_correction_bias     F32/BF16/F16 [E] (topk_method noaux_tc), widened to float32 exactly
    model.layers.{L}.mlp.experts.{e}.{gate,up,down}_proj.  routed expert e, NVFP4:
        weight          uint8 [N, K/2]   two E2M1 codes a byte, element 2i in the low nibble
        weight_scale    float8_e4m3fn [N, K/16]
        weight_scale_2  float32 scalar   (the matrix's global scale)
        input_scale     float32 scalar   (activation scale, for W4A4)
      or ``weight`` BF16 (or F16, see below) [N, K] where the quantization settings exclude
      the module;
    model.layers.{L}.mlp.shared_experts.{gate,up,down}_proj.*   the shared expert, either format.

Gate and up are fused into the library's ``w_gate_up_egh`` ``[E, 2F, H]`` (gate rows first;
NVFP4 codes and block scales concatenated along N, untouched), down is ``w_down_ehf``
``[E, H, F]``. ModelOpt usually gives an expert's gate and up the same ``weight_scale_2``, but
not always; the fused tensor's ``global_scale`` is ``[E]`` (that shared value) when gate and up
agree bit for bit in every expert of the layer, else ``[E, 2]`` (gate's, then up's, as stored)
for every expert of the layer, which the kernels and the references apply each to its own half:
exact either way (see :class:`moe_jax.nvfp4.NVFP4Tensor`). The shared expert likewise: ``[]``
or ``[2]``. The returned config's ``weight_format`` and ``shared_weight_format`` say what the
checkpoint stores: nothing is converted (but exact F16, below). The ``input_scale`` values are
kept as the optional group ``params["input_scales"]`` (``gate_e``/``up_e``/``down_e`` float32
``[E]``, ``shared_gate``/``shared_up``/``shared_down`` scalars): W4A4 quantizes the routed
experts' activations against them (``MoEConfig.activation_scale``).

Quantization settings come from ``config.json["quantization_config"]`` (``quant_method:
modelopt``, ``quant_algo: NVFP4``, ``group_size: 16``, ``ignore``) or the older
``hf_quant_config.json`` (``{"quantization": {quant_algo, group_size, exclude_modules}}``);
exclusion entries are ``fnmatch`` patterns over module names (``model.layers.61*``), and an
entry also excludes the modules inside the one it names. Every stored tensor is checked against
them.

Values are checked as they are read, on what is read: NVFP4 block scales must not be NaN
(E4M3 ``0x7f``/``0xff``) or negative (``-0`` is allowed, and ``0``, an all-zero block, is
kept). Unquantized projections are kept as stored when BF16 (the library's unquantized
layout); F16 ones are converted to bf16 only when bf16 holds every value exactly (F16 has 10
mantissa bits to bf16's 7, so trained F16 weights rarely do) and refused otherwise, naming the
tensor and the count of inexact values: nothing is rounded on load (and :func:`save_moe_layer`
writes the converted ones as BF16, the same values).

A sharded checkpoint's index must agree with its files: every file it names exists and holds
the tensors mapped to it, and no tensor is mapped twice or stored in two of its files. The
layer's expert ids (``experts.{e}``) must be exactly ``0..n_routed_experts - 1``.

Scope limits:

* **No re-quantization, ever.** What the checkpoint holds is loaded bit for bit (ModelOpt on a
  GPU can compute a global scale one ulp away from the host's recipe, so re-quantizing would
  change weights); :func:`save_moe_layer` writes the same bits back.
* One MoE layer at a time; the MTP layers past ``num_hidden_layers`` and
  ``moe_layer_freq != 1`` are not supported; unquantized projections must be stored as BF16,
  or as F16 that bf16 holds exactly.
* :func:`save_moe_layer` gathers the layer on the host and writes a fresh directory.

Errors are :class:`CheckpointError` (a ``ValueError``), one line naming the tensor (full name)
or file, what was found and what was expected. Nothing is skipped: a tensor of the layer's MLP
that the loader does not use is an error too.

Memory: headers are parsed up front and the files are memory-mapped, so a tensor's bytes are
read when a shard needs them. With a mesh, each addressable device's shard is read (once per
distinct shard), sent to its device and dropped before the next, so host memory peaks near one
shard; the scalars (``weight_scale_2``, ``input_scale``: 12 bytes per projection triple and
expert) of every expert are read up front to check them.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import math
import os
import re
import struct
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import assert_never

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding
from tqdm import tqdm

from moe_jax import nvfp4
from moe_jax.config import HF_KEYS, MoEConfig, WeightFormat, hf_int, read_hf_config
from moe_jax.layer import Params, check_params, param_logical_axes
from sharding.mesh import expert_parallel_rules, tree_specs

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
HF_QUANT_CONFIG = "hf_quant_config.json"

#: safetensors dtype codes the reader understands, and their numpy dtypes (float8 and bfloat16
#: through ml_dtypes: numpy has neither, which is why safetensors' numpy reader cannot return them).
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8),
    "I16": np.dtype(np.int16), "I32": np.dtype(np.int32), "I64": np.dtype(np.int64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16), "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
}
_CODES = {dtype: code for code, dtype in DTYPES.items()}

PROJECTIONS = ("gate", "up", "down")
_ROUTER_DTYPES = ("BF16", "F32", "F16")
_MAX_HEADER = 100 * 2**20  # safetensors' own limit on the JSON header


class CheckpointError(ValueError):
    """A checkpoint that does not hold what the loader expects; one line naming the tensor or file."""


# ---------------------------------------------------------------------------------------------
# Reading safetensors


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
            raise CheckpointError(f"{path}: tensor {name}: header entry {entry!r}, expected dtype, shape, data_offsets") from None
        if code not in DTYPES:
            raise CheckpointError(f"{name}: dtype {code} in {path.name}, expected one of {', '.join(DTYPES)}")
        nbytes = math.prod(shape) * DTYPES[code].itemsize
        if end - begin != nbytes or begin < 0 or data_start + end > size:
            raise CheckpointError(
                f"{name}: data_offsets [{begin}, {end}] in {path.name} ({size} bytes), expected {nbytes} bytes "
                f"for {code} {list(shape)} inside the file"
            )
        tensors[name] = TensorInfo(name=name, path=path, dtype=code, shape=shape, start=data_start + begin, nbytes=nbytes)
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


# ---------------------------------------------------------------------------------------------
# Quantization settings and layers


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantizationSettings:
    """A checkpoint's quantization: NVFP4 everywhere but the excluded modules, or nothing.

    Attributes:
      quant_algo: ``"NVFP4"``, or None for an unquantized checkpoint.
      group_size: elements per block scale (16), None when unquantized.
      exclude: ``fnmatch`` patterns of module names left unquantized.
      source: where the settings came from, for messages.
    """

    quant_algo: str | None
    group_size: int | None
    exclude: tuple[str, ...]
    source: str

    def excluded(self, module: str) -> bool:
        """Whether ``module`` (or a module containing it) matches an exclusion pattern."""
        prefixes = [".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 2)]
        return any(fnmatch.fnmatchcase(p, pattern) for pattern in self.exclude for p in prefixes)

    def format_of(self, module: str) -> WeightFormat:
        """The format a linear module's weights must be stored in."""
        return "nvfp4" if self.quant_algo is not None and not self.excluded(module) else "bf16"


def quantization_settings(directory: str | os.PathLike, hf: dict | None = None) -> QuantizationSettings:
    """The quantization settings of a checkpoint directory.

    ``config.json["quantization_config"]`` and/or ``hf_quant_config.json`` (when both are
    present they must agree), else none (every weight unquantized). ``hf``: the parsed
    ``config.json``, if already read.

    Raises:
      CheckpointError: a quantization method or algorithm other than ModelOpt NVFP4, a group
        size other than 16, malformed settings, or the two files disagreeing on the algorithm,
        the group size or the excluded modules; one line naming the key and its source(s).
    """
    directory = Path(directory)
    if hf is None:
        hf, _ = read_hf_config(directory)
    found = []
    if "quantization_config" in hf:
        source = f"{directory / 'config.json'} quantization_config"
        q = hf["quantization_config"]
        if not isinstance(q, dict):
            raise CheckpointError(f"{source}: a {type(q).__name__}, expected an object")
        if q.get("quant_method") != "modelopt":
            raise CheckpointError(f"{source}: quant_method = {q.get('quant_method')!r} is not supported, expected 'modelopt'")
        found.append(_settings(q, source, "ignore", q.get("group_size", _group_size_of_config_groups(q, source))))
    if (directory / HF_QUANT_CONFIG).is_file():
        source = str(directory / HF_QUANT_CONFIG)
        try:
            q = json.loads((directory / HF_QUANT_CONFIG).read_text())["quantization"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(f"{source}: expected JSON with a 'quantization' object ({err!r})") from None
        found.append(_settings(q, source, "exclude_modules", q.get("group_size")))
    if not found:
        return QuantizationSettings(quant_algo=None, group_size=None, exclude=(), source="no quantization settings")
    if len(found) == 2:
        # Which of two disagreeing files is right cannot be known: a layer's format would be a guess.
        new, old = found
        for field, a, b in (("quant_algo", new.quant_algo, old.quant_algo), ("group_size", new.group_size, old.group_size),
                            ("ignore / exclude_modules", sorted(new.exclude), sorted(old.exclude))):
            if a != b:
                raise CheckpointError(f"{new.source} and {old.source} disagree on {field}: {a!r} against {b!r}; "
                                      "remove or correct one")
    return found[0]


def _settings(q: dict, source: str, exclude_key: str, group_size) -> QuantizationSettings:
    if not isinstance(q, dict):
        raise CheckpointError(f"{source}: a {type(q).__name__}, expected an object")
    if q.get("quant_algo") != "NVFP4":
        raise CheckpointError(f"{source}: quant_algo = {q.get('quant_algo')!r} is not supported, expected 'NVFP4'")
    if group_size != nvfp4.BLOCK or type(group_size) is not int:
        raise CheckpointError(f"{source}: group_size = {group_size!r} is not supported, expected {nvfp4.BLOCK} (NVFP4)")
    exclude = q.get(exclude_key) or []
    if not isinstance(exclude, list) or not all(isinstance(p, str) for p in exclude):
        raise CheckpointError(f"{source}: {exclude_key} = {exclude!r}, expected a list of module name patterns")
    return QuantizationSettings(quant_algo="NVFP4", group_size=group_size, exclude=tuple(exclude), source=source)


def _group_size_of_config_groups(q: dict, source: str):
    """Newer ModelOpt exports put the group size in ``config_groups.*.weights``."""
    sizes = {
        group.get("weights", {}).get("group_size")
        for group in (q.get("config_groups") or {}).values() if isinstance(group, dict)
    }
    if len(sizes) > 1:
        raise CheckpointError(f"{source}: config_groups have group sizes {sorted(map(str, sizes))}, expected one")
    return sizes.pop() if sizes else None


def moe_layer_indices(config_json: dict | str | os.PathLike) -> range:
    """The indices of the MoE layers: ``range(first_k_dense_replace, num_hidden_layers)``.

    Layers below ``first_k_dense_replace`` are dense MLPs (Kimi K2: layer 0 of 61).

    Raises:
      ValueError: a missing or invalid key, or ``moe_layer_freq`` other than 1 (unsupported).
    """
    hf, where = read_hf_config(config_json)
    num_layers = hf_int(hf, "num_hidden_layers", where)
    first_moe = hf_int(hf, "first_k_dense_replace", where)
    if not 0 <= first_moe <= num_layers:
        raise ValueError(f"{where}: first_k_dense_replace = {first_moe}, expected 0..num_hidden_layers = {num_layers}")
    if hf.get("moe_layer_freq", 1) != 1:
        raise ValueError(f"{where}: moe_layer_freq = {hf['moe_layer_freq']!r} is not supported, expected 1")
    return range(first_moe, num_layers)


def _layer_config(directory: Path, layer: int, config: MoEConfig | None) -> tuple[MoEConfig, dict]:
    hf, where = read_hf_config(directory)
    from_hf = MoEConfig.from_hf_config(hf)
    layers = moe_layer_indices(hf)
    if type(layer) is not int or not 0 <= layer < layers.stop:
        raise CheckpointError(f"layer: {layer!r}, expected an int in 0..{layers.stop - 1} (num_hidden_layers = {layers.stop})")
    if layer not in layers:
        raise CheckpointError(
            f"layer: {layer} is a dense layer (first_k_dense_replace = {layers.start}; its MLP is "
            f"model.layers.{layer}.mlp.{{gate,up,down}}_proj), expected a MoE layer in {layers.start}..{layers.stop - 1}"
        )
    if config is None:
        return from_hf, hf
    if not isinstance(config, MoEConfig):
        raise CheckpointError(f"config: {type(config).__name__}, expected a MoEConfig or None")
    for field, key in HF_KEYS.items():
        if getattr(config, field) != getattr(from_hf, field):
            raise CheckpointError(
                f"config.{field} = {getattr(config, field)!r}, but {where} ({key}) gives {getattr(from_hf, field)!r}"
            )
    if config.shared_size != from_hf.shared_size:
        raise CheckpointError(
            f"config.shared_intermediate_size gives {config.shared_size}, but {where} gives "
            f"n_shared_experts * moe_intermediate_size = {from_hf.shared_size}"
        )
    return config, hf


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Projection:
    """One linear module of the checkpoint: ``{module}.weight`` etc., ``[N, K]`` logically."""

    module: str
    n: int
    k: int

    def tensor(self, suffix: str) -> str:
        return f"{self.module}.{suffix}"


def _expected_tensors(proj: _Projection, weight_format: WeightFormat) -> dict[str, tuple[tuple[str, ...], tuple]]:
    """suffix -> (allowed dtype codes, shape) that a projection in ``weight_format`` stores.
    Scalars may be stored as ``[]`` or ``[1]``; the shape given is ``()``."""
    match weight_format:
        case "nvfp4":
            return {
                "weight": (("U8",), (proj.n, proj.k // 2)),
                "weight_scale": (("F8_E4M3",), (proj.n, proj.k // nvfp4.BLOCK)),
                "weight_scale_2": (("F32",), ()),
            }
        case "bf16":
            return {"weight": (("BF16", "F16"), (proj.n, proj.k))}  # F16: see _read_projection
        case _ as unreachable:
            assert_never(unreachable)


def _check_tensor(ckpt: Checkpoint, name: str, dtypes: tuple[str, ...], shape: tuple, why: str) -> None:
    info = ckpt.info(name)
    scalar_ok = shape == () and info.shape in ((), (1,))
    if info.dtype not in dtypes or not (info.shape == shape or scalar_ok):
        expected = f"{'/'.join(dtypes)} {list(shape)}"
        raise CheckpointError(f"{name}: {info.describe()}, expected {expected} ({why})")


def _group_format(settings: QuantizationSettings, projections: Iterable[_Projection], what: str) -> WeightFormat:
    """The one format the settings give every projection of a group, or an error."""
    projections = list(projections)
    first = settings.format_of(projections[0].module)
    for proj in projections:
        if settings.format_of(proj.module) != first:
            raise CheckpointError(
                f"{proj.module}: {settings.format_of(proj.module)} by {settings.source}, but "
                f"{projections[0].module} is {first}; {what} must share one format"
            )
    return first


def _check_group(ckpt: Checkpoint, settings: QuantizationSettings, projections: list[_Projection],
                 weight_format: WeightFormat) -> bool:
    """Checks every tensor of a group against ``weight_format``; returns whether it has input
    scales (all of its projections or none)."""
    why = f"{weight_format} by {settings.source}"
    for proj in projections:
        for suffix, (dtypes, shape) in _expected_tensors(proj, weight_format).items():
            name = proj.tensor(suffix)
            if name not in ckpt:
                stored = ckpt.info(proj.tensor("weight")).describe() if proj.tensor("weight") in ckpt else "nothing"
                raise CheckpointError(
                    f"{name}: missing (stored {proj.tensor('weight')}: {stored}), expected {'/'.join(dtypes)} "
                    f"{list(shape)} ({why})"
                )
            _check_tensor(ckpt, name, dtypes, shape, why)
        if weight_format == "bf16" and proj.tensor("weight_scale") in ckpt:
            raise CheckpointError(
                f"{proj.tensor('weight_scale')}: {ckpt.info(proj.tensor('weight_scale')).describe()}, "
                f"expected nothing: {settings.source} excludes {proj.module} from quantization"
            )
    if weight_format == "bf16":
        return False
    present = [proj.tensor("input_scale") in ckpt for proj in projections]
    if any(present) and not all(present):
        missing = projections[present.index(False)].tensor("input_scale")
        raise CheckpointError(f"{missing}: missing, expected F32 [] (other projections of the layer have input_scale)")
    for proj in projections if all(present) else ():
        _check_tensor(ckpt, proj.tensor("input_scale"), ("F32",), (), "NVFP4 activation scale")
    return all(present)


def _scalar(ckpt: Checkpoint, name: str) -> np.float32:
    """A per-tensor scale (``weight_scale_2``, ``input_scale``): a finite float32 > 0, since every
    value of its tensor is multiplied by it (a zero, negative or non-finite one is a broken export)."""
    value = np.float32(ckpt.read(name).reshape(()))
    if not (np.isfinite(value) and value > 0):
        raise CheckpointError(f"{name}: {value}, expected a finite scale > 0")
    return value


def _gate_up_scales(ckpt: Checkpoint, pairs: list[tuple[_Projection, _Projection]]) -> np.ndarray:
    """The global scales of fused gate/up projections, one ``(gate, up)`` pair per expert.

    float32 ``[P]`` (the shared value) when every pair's gate and up ``weight_scale_2`` are equal
    bit for bit (a one-ulp difference would still change the dequantized weights), else
    ``[P, 2]`` (gate's, up's) for every pair: one array holds all experts, so one expert whose
    halves differ gives the whole layer per-half scales.
    """
    scales_p2 = np.array([[_scalar(ckpt, gate.tensor("weight_scale_2")), _scalar(ckpt, up.tensor("weight_scale_2"))]
                          for gate, up in pairs], np.float32).reshape(len(pairs), 2)
    if (scales_p2[:, 0].view(np.uint32) == scales_p2[:, 1].view(np.uint32)).all():
        return scales_p2[:, 0]
    return scales_p2


def _read_projection(ckpt: Checkpoint, name: str) -> np.ndarray:
    """One projection tensor (``weight``, ``weight_scale``) as the library holds it, its values
    checked: NVFP4 block scales neither NaN nor negative, F16 weights converted to bf16 exactly."""
    value = ckpt.read(name)
    if value.dtype == ml_dtypes.float8_e4m3fn:
        # Finite positive E4M3 is 0x00..0x7e; one max() clears a normal tensor.
        u8 = value.view(np.uint8)
        if u8.max(initial=0) >= 0x7F:
            bad = (u8 == 0x7F) | (u8 > 0x80)  # 0x7f/0xff NaN, 0x81.. negative; 0x80 is -0, harmless
            if bad.any():
                first = tuple(int(i) for i in np.argwhere(bad)[0])
                raise CheckpointError(
                    f"{name}: {np.count_nonzero(bad)} of {u8.size} block scales NaN or negative (first at {list(first)}: "
                    f"{value[first]}, byte 0x{u8[first]:02x}), expected finite E4M3 scales >= 0"
                )
    elif value.dtype == np.float16:
        # The unquantized layout is bf16, and F16 holds 3 mantissa bits more: convert where exact.
        bf16 = value.astype(ml_dtypes.bfloat16)
        wide = value.astype(np.float32)
        inexact = (bf16.astype(np.float32) != wide) & ~np.isnan(wide)  # NaN stays NaN, as in a BF16 weight
        if inexact.any():
            first = tuple(int(i) for i in np.argwhere(inexact)[0])
            raise CheckpointError(
                f"{name}: F16 {list(value.shape)}, {np.count_nonzero(inexact)} of {value.size} values not exact in bf16 "
                f"(first at {list(first)}: {value[first]}), expected BF16, or F16 that bf16 holds exactly "
                "(unquantized projections are bf16, and nothing is rounded on load)"
            )
        value = bf16
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Leaf:
    """One parameter array to be built: its global shape and dtype, and how to read a slice.

    ``read(index)`` returns ``array[index]`` (``index``: a tuple of slices as
    ``Sharding.addressable_devices_indices_map`` gives them), reading from the checkpoint
    only what that slice needs: for arrays stacked over experts (``per_expert`` set), the
    experts of ``index[0]``.
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    per_expert: Callable[[int], list[str]] | None = None  # names concatenated along N for expert e
    ckpt: Checkpoint | None = None
    value: np.ndarray | None = None  # small arrays read up front (router, scalars)

    def read(self, index: tuple) -> np.ndarray:
        if self.per_expert is None:
            return np.asarray(self.value)[index]
        experts = range(*index[0].indices(self.shape[0]))
        out = np.empty((len(experts), *self.shape[1:]), self.dtype)
        for i, e in enumerate(experts):
            out[i] = np.concatenate([_read_projection(self.ckpt, name) for name in self.per_expert(e)], axis=0)
        return out[(slice(None), *index[1:])]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _small(value: np.ndarray) -> _Leaf:
    return _Leaf(shape=value.shape, dtype=value.dtype, value=value)


def _weight_leaves(ckpt: Checkpoint, projs_of: Callable[[int], list[_Projection]], count: int | None,
                   weight_format: WeightFormat, global_scales: np.ndarray):
    """The leaves of one library weight: an NVFP4Tensor of leaves, or one bf16 leaf.

    ``projs_of(e)``: the checkpoint projections fused along N for expert ``e``; ``count``:
    experts stacked (None: the shared expert, unstacked); ``global_scales``: the NVFP4 global
    scale as the tensor holds it (``[E]`` or ``[E, 2]``; ``[]`` or ``[2]`` unstacked).
    """
    projs = projs_of(0)
    n, k = sum(p.n for p in projs), projs[0].k
    lead = () if count is None else (count,)

    def leaf(suffix, shape, dtype):
        if count is not None:
            return _Leaf(shape=(*lead, *shape), dtype=np.dtype(dtype), ckpt=ckpt,
                         per_expert=lambda e: [p.tensor(suffix) for p in projs_of(e)])
        return _small(np.concatenate([_read_projection(ckpt, p.tensor(suffix)) for p in projs], axis=0))

    match weight_format:
        case "nvfp4":
            return nvfp4.NVFP4Tensor(
                packed=leaf("weight", (n, k // 2), np.uint8),
                scales=leaf("weight_scale", (n, k // nvfp4.BLOCK), ml_dtypes.float8_e4m3fn),
                global_scale=_small(global_scales),
            )
        case "bf16":
            return leaf("weight", (n, k), ml_dtypes.bfloat16)
        case _ as unreachable:
            assert_never(unreachable)


def _check_expert_ids(ckpt: Checkpoint, mlp: str, e_count: int) -> None:
    """The routed experts stored under ``{mlp}.experts.{e}.`` must be exactly ``0..e_count - 1``:
    one line with both counts, rather than a missing or leftover tensor of one expert."""
    prefix = f"{mlp}.experts."
    ids = {int(m[1]) for name in ckpt.tensors if name.startswith(prefix)
           and (m := re.match(r"(\d+)\.", name[len(prefix):]))}
    if ids == set(range(e_count)):
        return
    stored = f"{len(ids)} expert ids"
    if ids:
        holes = sorted(set(range(max(ids))) - ids)
        stored += f" ({min(ids)}..{max(ids)}" + (f", {len(holes)} missing, the first {holes[0]})" if holes else ")")
    raise CheckpointError(f"{prefix}{{e}}: {stored} in the checkpoint, but config.json has {HF_KEYS['num_experts']} = "
                          f"{e_count}, expected experts 0..{e_count - 1}")


def _plan_layer(ckpt: Checkpoint, settings: QuantizationSettings, layer: int, config: MoEConfig):
    """Checks every tensor of the layer (headers only, plus the scalars) and returns
    ``(leaf tree in the params layout, experts' format, shared format or None)``."""
    e_count, h, f, s = config.num_experts, config.hidden_size, config.expert_intermediate_size, config.shared_size
    mlp = f"model.layers.{layer}.mlp"
    used: set[str] = set()

    def projections(prefix: str, inter: int) -> dict[str, _Projection]:
        return {
            "gate": _Projection(module=f"{prefix}.gate_proj", n=inter, k=h),
            "up": _Projection(module=f"{prefix}.up_proj", n=inter, k=h),
            "down": _Projection(module=f"{prefix}.down_proj", n=h, k=inter),
        }

    def expert(e: int) -> dict[str, _Projection]:
        return projections(f"{mlp}.experts.{e}", f)

    # The router first: its shape says how many experts the checkpoint has.
    router_name = f"{mlp}.gate.weight"
    if router_name not in ckpt and f"{mlp}.gate_proj.weight" in ckpt:
        raise CheckpointError(f"{router_name}: missing, and {mlp}.gate_proj.weight is present: layer {layer} is stored dense")
    _check_tensor(ckpt, router_name, _ROUTER_DTYPES, (e_count, h),
                  f"router [n_routed_experts, hidden_size] = [{e_count}, {h}]; never quantized")
    leaves: dict = {"router": {"w_eh": _small(ckpt.read(router_name))}}
    used.add(router_name)
    bias_name = f"{mlp}.gate.e_score_correction_bias"
    if config.router_bias:
        # Exports converted through bf16 store it as BF16; both half formats widen exactly.
        _check_tensor(ckpt, bias_name, ("F32", "BF16", "F16"), (e_count,), "topk_method noaux_tc: selection bias")
        leaves["router"]["bias_e"] = _small(ckpt.read(bias_name).astype(np.float32))
        used.add(bias_name)

    _check_expert_ids(ckpt, mlp, e_count)
    routed = [p for e in range(e_count) for p in expert(e).values()]
    experts_format = _group_format(settings, routed, f"the routed experts of layer {layer}")
    experts_inputs = _check_group(ckpt, settings, routed, experts_format)
    groups = [(routed, experts_format, experts_inputs)]  # (projections, format, has input scales)
    global_gu = global_dn = np.zeros(e_count, np.float32)
    if experts_format == "nvfp4":
        global_gu = _gate_up_scales(ckpt, [(expert(e)["gate"], expert(e)["up"]) for e in range(e_count)])
        global_dn = np.array([_scalar(ckpt, expert(e)["down"].tensor("weight_scale_2")) for e in range(e_count)],
                             np.float32)
    leaves["experts"] = {
        "w_gate_up_egh": _weight_leaves(ckpt, lambda e: [expert(e)["gate"], expert(e)["up"]], e_count,
                                        experts_format, global_gu),
        "w_down_ehf": _weight_leaves(ckpt, lambda e: [expert(e)["down"]], e_count, experts_format, global_dn),
    }
    input_scales = {}
    if experts_inputs:
        for p in PROJECTIONS:
            input_scales[f"{p}_e"] = _small(np.array([_scalar(ckpt, expert(e)[p].tensor("input_scale"))
                                                      for e in range(e_count)], np.float32))

    shared_format = None
    if config.num_shared_experts:
        shared = projections(f"{mlp}.shared_experts", s)
        shared_format = _group_format(settings, shared.values(), f"the shared expert of layer {layer}")
        shared_inputs = _check_group(ckpt, settings, list(shared.values()), shared_format)
        groups.append((list(shared.values()), shared_format, shared_inputs))
        global_gu = global_dn = np.zeros((), np.float32)
        if shared_format == "nvfp4":
            global_gu = _gate_up_scales(ckpt, [(shared["gate"], shared["up"])])[0]
            global_dn = np.asarray(_scalar(ckpt, shared["down"].tensor("weight_scale_2")))
        leaves["shared"] = {
            "w_gate_up_gh": _weight_leaves(ckpt, lambda e: [shared["gate"], shared["up"]], None, shared_format,
                                           global_gu),
            "w_down_hs": _weight_leaves(ckpt, lambda e: [shared["down"]], None, shared_format, global_dn),
        }
        if shared_inputs:
            for p in PROJECTIONS:
                input_scales[f"shared_{p}"] = _small(np.asarray(_scalar(ckpt, shared[p].tensor("input_scale"))))
    if input_scales:
        leaves["input_scales"] = input_scales

    # Nothing under the layer's MLP may go unused: an extra expert, a stray scale, a dense
    # projection all mean the checkpoint is not what the config says.
    for group, fmt, inputs in groups:
        for proj in group:
            used.update(proj.tensor(suffix) for suffix in _expected_tensors(proj, fmt))
            if inputs:
                used.add(proj.tensor("input_scale"))
    for name in sorted(n for n in ckpt.tensors if n.startswith(f"{mlp}.") and n not in used):
        raise CheckpointError(f"{name}: {ckpt.info(name).describe()}, not a tensor of a {experts_format} MoE layer "
                              f"with {'a ' + shared_format + ' shared expert' if shared_format else 'no shared expert'}")
    return leaves, experts_format, shared_format


def _is_leaf(node) -> bool:
    return isinstance(node, _Leaf)


def _materialize(leaves, mesh: Mesh | None, config: MoEConfig, progress: bool, desc: str) -> Params:
    """Reads every leaf onto the default device, or shard by shard onto ``mesh``."""
    if mesh is None:
        shardings = jax.tree.map(lambda leaf: None, leaves, is_leaf=_is_leaf)
    else:
        if not isinstance(mesh, Mesh):
            raise CheckpointError(f"mesh: {type(mesh).__name__}, expected a jax.sharding.Mesh or None")
        abstract = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype), leaves, is_leaf=_is_leaf)
        rules = expert_parallel_rules(mesh, expert_axis=config.expert_axis)
        specs = tree_specs(abstract, param_logical_axes(abstract), rules, mesh)
        shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)

    def distinct_indices(leaf: _Leaf, sharding) -> dict[tuple, tuple[tuple, list]]:
        """normalized index -> (index, devices holding that slice)."""
        if sharding is None:
            return {(): ((slice(None),) * len(leaf.shape), [None])}
        out: dict[tuple, tuple[tuple, list]] = {}
        for device, index in sharding.addressable_devices_indices_map(leaf.shape).items():
            key = tuple(s.indices(n) for s, n in zip(index, leaf.shape))
            out.setdefault(key, (index, []))[1].append(device)
        return out

    flat, treedef = jax.tree.flatten(leaves, is_leaf=_is_leaf)
    flat_shardings = treedef.flatten_up_to(shardings)
    plans = [distinct_indices(leaf, sharding) for leaf, sharding in zip(flat, flat_shardings)]
    total = sum(
        math.prod(len(range(*s.indices(n))) for s, n in zip(index, leaf.shape)) * leaf.dtype.itemsize
        for leaf, plan in zip(flat, plans) for index, _ in plan.values()
    )
    arrays = []
    with tqdm(total=total, desc=desc, unit="B", unit_scale=True, file=sys.stderr,
              disable=None if progress else True) as bar:
        for leaf, sharding, plan in zip(flat, flat_shardings, plans):
            if sharding is None:
                host = leaf.read(plan[()][0])
                arrays.append(jax.device_put(host))
                bar.update(host.nbytes)
                continue
            per_device = {}
            for index, devices in plan.values():
                host = leaf.read(index)  # one shard in host memory at a time
                for device in devices:
                    per_device[device] = jax.device_put(host, device)
                bar.update(host.nbytes)
                del host
            ordered = [per_device[d] for d in sharding.addressable_devices_indices_map(leaf.shape)]
            arrays.append(jax.make_array_from_single_device_arrays(leaf.shape, sharding, ordered))
    return jax.tree.unflatten(treedef, arrays)


def load_moe_layer(
    directory: str | os.PathLike,
    layer: int,
    *,
    config: MoEConfig | None = None,
    mesh: Mesh | None = None,
    progress: bool = True,
) -> tuple[MoEConfig, Params]:
    """One MoE layer of a checkpoint directory, as the library's config and parameters.

    Args:
      directory: holds ``config.json``, the safetensors (single or indexed) and, for older
        ModelOpt exports, ``hf_quant_config.json``.
      layer: the layer index ``L`` (a MoE layer: see :func:`moe_layer_indices`).
      config: the implementation choices (``expert_gemm``, ``exchange``, ``expert_axis``, ...);
        its shape and router fields must equal what ``config.json`` gives. None:
        :meth:`MoEConfig.from_hf_config`. The weight formats are always set from the checkpoint.
      mesh: None puts every array on the default device; a ``Mesh`` with ``config.expert_axis``
        shards the experts over that axis (as :func:`moe_jax.shard_params` does) and each
        device's experts are read for it alone.
      progress: show a progress bar (tqdm, on stderr).

    Returns:
      ``(config, params)``: ``config`` with ``weight_format`` / ``shared_weight_format`` as
      stored; ``params`` in :func:`moe_jax.init_params`' layout (router weight in its stored
      dtype), plus ``params["input_scales"]`` when the NVFP4 projections store ``input_scale``.

    Raises:
      CheckpointError: (a ValueError) one line naming the tensor or file: a missing tensor or
        file, a wrong shape or dtype, expert ids other than ``0..E-1`` of the config, a dense
        or out-of-range layer, formats that disagree with the quantization settings, a
        leftover tensor, an index that contradicts its files, a bad scale (NaN, infinite, zero
        or negative ``weight_scale_2`` / ``input_scale``, NaN or negative block scales), F16
        weights that bf16 cannot hold exactly.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"directory: {directory} is not a directory, expected a checkpoint directory")
    config, hf = _layer_config(directory, layer, config)
    settings = quantization_settings(directory, hf)
    ckpt = Checkpoint(directory)
    leaves, experts_format, shared_format = _plan_layer(ckpt, settings, layer, config)
    config = dataclasses.replace(config, weight_format=experts_format, shared_weight_format=shared_format)
    params = _materialize(leaves, mesh, config, progress, desc=f"layer {layer}")
    check_params(params, config)
    return config, params


# ---------------------------------------------------------------------------------------------
# Saving


def hf_config_dict(config: MoEConfig, *, num_hidden_layers: int, first_k_dense_replace: int) -> dict:
    """The DeepSeek-V3-style ``config.json`` keys of ``config`` (the inverse of
    :meth:`MoEConfig.from_hf_config`, for the MoE layer's keys only)."""
    if config.shared_intermediate_size not in (None, config.num_shared_experts * config.expert_intermediate_size):
        raise ValueError(
            f"config.shared_intermediate_size = {config.shared_intermediate_size}: config.json can only say "
            "n_shared_experts * moe_intermediate_size"
        )
    keys = {key: getattr(config, field) for field, key in HF_KEYS.items()}
    keys[HF_KEYS["router_bias"]] = "noaux_tc" if config.router_bias else "greedy"
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", **keys,
        "num_hidden_layers": num_hidden_layers, "first_k_dense_replace": first_k_dense_replace, "moe_layer_freq": 1,
    }


def _layer_tensors(layer: int, params: Params, config: MoEConfig) -> dict[str, np.ndarray]:
    """The checkpoint tensors of ``params`` (gathered to the host), in the module docstring's names."""
    mlp = f"model.layers.{layer}.mlp"
    out = {f"{mlp}.gate.weight": np.asarray(params["router"]["w_eh"])}
    if "bias_e" in params["router"]:
        out[f"{mlp}.gate.e_score_correction_bias"] = np.asarray(params["router"]["bias_e"], np.float32)

    def split(w, f: int):
        """[.., 2F, ..] fused gate/up -> (gate, up) along N, each with its global scale."""
        if isinstance(w, nvfp4.NVFP4Tensor):
            packed, scales, g = np.asarray(w.packed), np.asarray(w.scales), np.asarray(w.global_scale)
            # check_params allows one global scale per matrix or [..., 2]: gate's, then up's.
            g_gate, g_up = (g, g) if w.row_groups == 1 else (g[..., 0], g[..., 1])
            return (dict(weight=packed[..., :f, :], weight_scale=scales[..., :f, :], weight_scale_2=g_gate),
                    dict(weight=packed[..., f:, :], weight_scale=scales[..., f:, :], weight_scale_2=g_up))
        w = np.asarray(w)
        return dict(weight=w[..., :f, :]), dict(weight=w[..., f:, :])

    def whole(w):
        if isinstance(w, nvfp4.NVFP4Tensor):
            return dict(weight=np.asarray(w.packed), weight_scale=np.asarray(w.scales),
                        weight_scale_2=np.asarray(w.global_scale))
        return dict(weight=np.asarray(w))

    scales = {name: np.asarray(v, np.float32) for name, v in params.get("input_scales", {}).items()}
    gate, up = split(params["experts"]["w_gate_up_egh"], config.expert_intermediate_size)
    down = whole(params["experts"]["w_down_ehf"])
    for e in range(config.num_experts):
        for proj, tensors in zip(PROJECTIONS, (gate, up, down)):
            for suffix, value in tensors.items():
                out[f"{mlp}.experts.{e}.{proj}_proj.{suffix}"] = value[e]
            if f"{proj}_e" in scales:
                out[f"{mlp}.experts.{e}.{proj}_proj.input_scale"] = scales[f"{proj}_e"][e]
    if "shared" in params:
        gate, up = split(params["shared"]["w_gate_up_gh"], config.shared_size)
        down = whole(params["shared"]["w_down_hs"])
        for proj, tensors in zip(PROJECTIONS, (gate, up, down)):
            for suffix, value in tensors.items():
                out[f"{mlp}.shared_experts.{proj}_proj.{suffix}"] = value
            if f"shared_{proj}" in scales:
                out[f"{mlp}.shared_experts.{proj}_proj.input_scale"] = scales[f"shared_{proj}"]
    # Not np.ascontiguousarray: it makes 0-d arrays 1-d, and weight_scale_2 is stored as a scalar.
    return {name: np.array(value, order="C") for name, value in out.items()}


def save_moe_layer(
    directory: str | os.PathLike,
    layer: int,
    params: Params,
    config: MoEConfig,
    *,
    shard_size: int | None = None,
) -> None:
    """Writes one layer's parameters as a checkpoint that :func:`load_moe_layer` reads back bit
    for bit: gate and up split again, per-expert tensors, ``weight_scale_2`` scalars, input
    scales if present.

    Args:
      directory: created if missing; must not hold safetensors yet. A ``config.json`` already
        there is kept (the loader checks it); otherwise one is written for a model whose layer
        ``layer`` is its last MoE layer, with ModelOpt NVFP4 ``quantization_config`` whose
        ``ignore`` lists this layer's bf16 groups when the formats are mixed.
      layer: the layer index the tensor names carry.
      params, config: as :func:`moe_jax.check_params` accepts them.
      shard_size: None writes ``model.safetensors``; else files of at most this many bytes (one
        tensor larger than that gets a file of its own) named ``model-0000i-of-0000n.safetensors``
        and ``model.safetensors.index.json``.

    Raises:
      ValueError: invalid params, a bad ``layer`` or ``shard_size``, or safetensors already there.
    """
    from safetensors.numpy import save_file  # only writing needs the library

    check_params(params, config)
    if type(layer) is not int or layer < 0:
        raise ValueError(f"layer: {layer!r}, expected an int >= 0")
    if shard_size is not None and (type(shard_size) is not int or shard_size < 1):
        raise ValueError(f"shard_size: {shard_size!r}, expected None or an int >= 1 (bytes)")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    existing = sorted(p.name for p in directory.glob("*.safetensors*"))
    if existing:
        raise ValueError(f"directory: {directory} already holds {existing[0]}, expected no safetensors (a fresh directory)")
    tensors = _layer_tensors(layer, params, config)
    if not (directory / "config.json").exists():
        hf = hf_config_dict(config, num_hidden_layers=layer + 1, first_k_dense_replace=0)
        formats = {"experts": config.weight_format}
        if config.num_shared_experts:
            formats["shared_experts"] = config.shared_format
        if "nvfp4" in formats.values():
            hf["quantization_config"] = {
                "quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": nvfp4.BLOCK,
                "ignore": [f"model.layers.{layer}.mlp.{group}*" for group, fmt in formats.items() if fmt == "bf16"],
            }
        (directory / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    metadata = {"format": "pt"}  # what transformers writes, and checks for when it loads
    if shard_size is None:
        save_file(tensors, str(directory / SINGLE_FILE), metadata=metadata)
        return
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, value in tensors.items():
        if shards[-1] and size + value.nbytes > shard_size:
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += value.nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / file), metadata=metadata)
        weight_map.update(dict.fromkeys(shard, file))
    index = {"metadata": {"total_size": sum(v.nbytes for v in tensors.values())}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
