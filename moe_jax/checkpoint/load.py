"""Loading one MoE layer: the layer's config from ``config.json``, the plan of every parameter
array checked against the checkpoint's headers, and the reads onto a device or, shard by shard,
onto a mesh (:func:`load_moe_layer`)."""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import assert_never

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding
from tqdm import tqdm

from moe_jax import nvfp4
from moe_jax.checkpoint.modelopt import (
    PROJECTIONS, ROUTER_DTYPES, Projection, QuantizationSettings, check_expert_ids, check_group, check_tensor,
    expected_tensors, group_format, quantization_settings, read_projection, read_scale,
)
from moe_jax.checkpoint.safetensors_io import Checkpoint, CheckpointError
from moe_jax.config import HF_KEYS, MoEConfig, WeightFormat, hf_int, read_hf_config
from moe_jax.layer import Params, check_params, mesh_param_specs


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
        raise CheckpointError(f"layer: {layer!r}, expected an int in 0..{layers.stop - 1} "
                              f"(num_hidden_layers = {layers.stop})")
    if layer not in layers:
        raise CheckpointError(
            f"layer: {layer} is a dense layer (first_k_dense_replace = {layers.start}; its MLP is "
            f"model.layers.{layer}.mlp.{{gate,up,down}}_proj), expected a MoE layer in "
            f"{layers.start}..{layers.stop - 1}"
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


def _gate_up_scales(ckpt: Checkpoint, pairs: list[tuple[Projection, Projection]]) -> np.ndarray:
    """The global scales of fused gate/up projections, one ``(gate, up)`` pair per expert.

    float32 ``[P]`` (the shared value) when every pair's gate and up ``weight_scale_2`` are equal
    bit for bit (a one-ulp difference would still change the dequantized weights), else
    ``[P, 2]`` (gate's, up's) for every pair: one array holds all experts, so one expert whose
    halves differ gives the whole layer per-half scales.
    """
    scales_p2 = np.array([[read_scale(ckpt, gate.tensor("weight_scale_2")),
                           read_scale(ckpt, up.tensor("weight_scale_2"))] for gate, up in pairs],
                         np.float32).reshape(len(pairs), 2)
    if (scales_p2[:, 0].view(np.uint32) == scales_p2[:, 1].view(np.uint32)).all():
        return scales_p2[:, 0]
    return scales_p2


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
            out[i] = np.concatenate([read_projection(self.ckpt, name) for name in self.per_expert(e)], axis=0)
        return out[(slice(None), *index[1:])]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _small(value: np.ndarray) -> _Leaf:
    return _Leaf(shape=value.shape, dtype=value.dtype, value=value)


def _weight_leaves(ckpt: Checkpoint, projs_of: Callable[[int], list[Projection]], count: int | None,
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
        return _small(np.concatenate([read_projection(ckpt, p.tensor(suffix)) for p in projs], axis=0))

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


def _plan_layer(ckpt: Checkpoint, settings: QuantizationSettings, layer: int, config: MoEConfig):
    """Checks every tensor of the layer (headers only, plus the scalars) and returns
    ``(leaf tree in the params layout, experts' format, shared format or None)``."""
    e_count, h, f, s = config.num_experts, config.hidden_size, config.expert_intermediate_size, config.shared_size
    mlp = f"model.layers.{layer}.mlp"
    used: set[str] = set()

    def projections(prefix: str, inter: int) -> dict[str, Projection]:
        return {
            "gate": Projection(module=f"{prefix}.gate_proj", n=inter, k=h),
            "up": Projection(module=f"{prefix}.up_proj", n=inter, k=h),
            "down": Projection(module=f"{prefix}.down_proj", n=h, k=inter),
        }

    def expert(e: int) -> dict[str, Projection]:
        return projections(f"{mlp}.experts.{e}", f)

    # The router first: its shape says how many experts the checkpoint has.
    router_name = f"{mlp}.gate.weight"
    if router_name not in ckpt and f"{mlp}.gate_proj.weight" in ckpt:
        raise CheckpointError(f"{router_name}: missing, and {mlp}.gate_proj.weight is present: "
                              f"layer {layer} is stored dense")
    check_tensor(ckpt, router_name, ROUTER_DTYPES, (e_count, h),
                 f"router [n_routed_experts, hidden_size] = [{e_count}, {h}]; never quantized")
    leaves: dict = {"router": {"w_eh": _small(ckpt.read(router_name))}}
    used.add(router_name)
    bias_name = f"{mlp}.gate.e_score_correction_bias"
    if config.router_bias:
        # Exports converted through bf16 store it as BF16; both half formats widen exactly.
        check_tensor(ckpt, bias_name, ("F32", "BF16", "F16"), (e_count,), "topk_method noaux_tc: selection bias")
        leaves["router"]["bias_e"] = _small(ckpt.read(bias_name).astype(np.float32))
        used.add(bias_name)

    check_expert_ids(ckpt, mlp, e_count)
    routed = [p for e in range(e_count) for p in expert(e).values()]
    experts_format = group_format(settings, routed, f"the routed experts of layer {layer}")
    experts_inputs = check_group(ckpt, settings, routed, experts_format)
    groups = [(routed, experts_format, experts_inputs)]  # (projections, format, has input scales)
    global_gu = global_dn = np.zeros(e_count, np.float32)
    if experts_format == "nvfp4":
        global_gu = _gate_up_scales(ckpt, [(expert(e)["gate"], expert(e)["up"]) for e in range(e_count)])
        global_dn = np.array([read_scale(ckpt, expert(e)["down"].tensor("weight_scale_2")) for e in range(e_count)],
                             np.float32)
    leaves["experts"] = {
        "w_gate_up_egh": _weight_leaves(ckpt, lambda e: [expert(e)["gate"], expert(e)["up"]], e_count,
                                        experts_format, global_gu),
        "w_down_ehf": _weight_leaves(ckpt, lambda e: [expert(e)["down"]], e_count, experts_format, global_dn),
    }
    input_scales = {}
    if experts_inputs:
        for p in PROJECTIONS:
            input_scales[f"{p}_e"] = _small(np.array([read_scale(ckpt, expert(e)[p].tensor("input_scale"))
                                                      for e in range(e_count)], np.float32))

    shared_format = None
    if config.num_shared_experts:
        shared = projections(f"{mlp}.shared_experts", s)
        shared_format = group_format(settings, shared.values(), f"the shared expert of layer {layer}")
        shared_inputs = check_group(ckpt, settings, list(shared.values()), shared_format)
        groups.append((list(shared.values()), shared_format, shared_inputs))
        global_gu = global_dn = np.zeros((), np.float32)
        if shared_format == "nvfp4":
            global_gu = _gate_up_scales(ckpt, [(shared["gate"], shared["up"])])[0]
            global_dn = np.asarray(read_scale(ckpt, shared["down"].tensor("weight_scale_2")))
        leaves["shared"] = {
            "w_gate_up_gh": _weight_leaves(ckpt, lambda e: [shared["gate"], shared["up"]], None, shared_format,
                                           global_gu),
            "w_down_hs": _weight_leaves(ckpt, lambda e: [shared["down"]], None, shared_format, global_dn),
        }
        if shared_inputs:
            for p in PROJECTIONS:
                input_scales[f"shared_{p}"] = _small(np.asarray(read_scale(ckpt, shared[p].tensor("input_scale"))))
    if input_scales:
        leaves["input_scales"] = input_scales

    # Nothing under the layer's MLP may go unused: an extra expert, a stray scale, a dense
    # projection all mean the checkpoint is not what the config says.
    for group, fmt, inputs in groups:
        for proj in group:
            used.update(proj.tensor(suffix) for suffix in expected_tensors(proj, fmt))
            if inputs:
                used.add(proj.tensor("input_scale"))
    for name in sorted(n for n in ckpt.tensors if n.startswith(f"{mlp}.") and n not in used):
        raise CheckpointError(f"{name}: {ckpt.info(name).describe()}, not a tensor of a {experts_format} MoE layer "
                              "with "
                              f"{'a ' + shared_format + ' shared expert' if shared_format else 'no shared expert'}")
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
        specs = mesh_param_specs(abstract, mesh, config.expert_axis)
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
