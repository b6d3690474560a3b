"""Saving one MoE layer's parameters as a checkpoint in the format :func:`load_moe_layer` reads
(:func:`save_moe_layer`), and the ``config.json`` keys of a config (:func:`hf_config_dict`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from moe_jax import nvfp4
from moe_jax.checkpoint.modelopt import PROJECTIONS
from moe_jax.checkpoint.safetensors_io import INDEX_FILE, SINGLE_FILE
from moe_jax.config import HF_KEYS, MoEConfig
from moe_jax.layer import Params, check_params


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
        raise ValueError(f"directory: {directory} already holds {existing[0]}, "
                         "expected no safetensors (a fresh directory)")
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
