"""What NVIDIA ModelOpt's NVFP4 export holds: the quantization settings
(``config.json["quantization_config"]`` or ``hf_quant_config.json``, their ``ignore`` /
``exclude_modules`` wildcards), the tensors each projection stores in each format, and the
checks on their headers and values."""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import assert_never

import ml_dtypes
import numpy as np

from moe_jax import nvfp4
from moe_jax.checkpoint.safetensors_io import Checkpoint, CheckpointError
from moe_jax.config import HF_KEYS, WeightFormat, read_hf_config

HF_QUANT_CONFIG = "hf_quant_config.json"

PROJECTIONS = ("gate", "up", "down")
ROUTER_DTYPES = ("BF16", "F32", "F16")


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
            raise CheckpointError(f"{source}: quant_method = {q.get('quant_method')!r} is not supported, "
                                  "expected 'modelopt'")
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
        for field, a, b in (("quant_algo", new.quant_algo, old.quant_algo),
                            ("group_size", new.group_size, old.group_size),
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class Projection:
    """One linear module of the checkpoint: ``{module}.weight`` etc., ``[N, K]`` logically."""

    module: str
    n: int
    k: int

    def tensor(self, suffix: str) -> str:
        return f"{self.module}.{suffix}"


def expected_tensors(proj: Projection, weight_format: WeightFormat) -> dict[str, tuple[tuple[str, ...], tuple]]:
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
            return {"weight": (("BF16", "F16"), (proj.n, proj.k))}  # F16: see read_projection
        case _ as unreachable:
            assert_never(unreachable)


def check_tensor(ckpt: Checkpoint, name: str, dtypes: tuple[str, ...], shape: tuple, why: str) -> None:
    info = ckpt.info(name)
    scalar_ok = shape == () and info.shape in ((), (1,))
    if info.dtype not in dtypes or not (info.shape == shape or scalar_ok):
        expected = f"{'/'.join(dtypes)} {list(shape)}"
        raise CheckpointError(f"{name}: {info.describe()}, expected {expected} ({why})")


def group_format(settings: QuantizationSettings, projections: Iterable[Projection], what: str) -> WeightFormat:
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


def check_group(ckpt: Checkpoint, settings: QuantizationSettings, projections: list[Projection],
                weight_format: WeightFormat) -> bool:
    """Checks every tensor of a group against ``weight_format``; returns whether it has input
    scales (all of its projections or none)."""
    why = f"{weight_format} by {settings.source}"
    for proj in projections:
        for suffix, (dtypes, shape) in expected_tensors(proj, weight_format).items():
            name = proj.tensor(suffix)
            if name not in ckpt:
                stored = ckpt.info(proj.tensor("weight")).describe() if proj.tensor("weight") in ckpt else "nothing"
                raise CheckpointError(
                    f"{name}: missing (stored {proj.tensor('weight')}: {stored}), expected {'/'.join(dtypes)} "
                    f"{list(shape)} ({why})"
                )
            check_tensor(ckpt, name, dtypes, shape, why)
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
        check_tensor(ckpt, proj.tensor("input_scale"), ("F32",), (), "NVFP4 activation scale")
    return all(present)


def read_scale(ckpt: Checkpoint, name: str) -> np.float32:
    """A per-tensor scale (``weight_scale_2``, ``input_scale``): a finite float32 > 0, since every
    value of its tensor is multiplied by it (a zero, negative or non-finite one is a broken export)."""
    value = np.float32(ckpt.read(name).reshape(()))
    if not (np.isfinite(value) and value > 0):
        raise CheckpointError(f"{name}: {value}, expected a finite scale > 0")
    return value


def read_projection(ckpt: Checkpoint, name: str) -> np.ndarray:
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
                    f"{name}: {np.count_nonzero(bad)} of {u8.size} block scales NaN or negative "
                    f"(first at {list(first)}: "
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
                f"{name}: F16 {list(value.shape)}, {np.count_nonzero(inexact)} of {value.size} "
                "values not exact in bf16 "
                f"(first at {list(first)}: {value[first]}), expected BF16, or F16 that bf16 holds exactly "
                "(unquantized projections are bf16, and nothing is rounded on load)"
            )
        value = bf16
    return value


def check_expert_ids(ckpt: Checkpoint, mlp: str, e_count: int) -> None:
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
