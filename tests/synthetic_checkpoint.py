"""Synthetic Kimi K2-style ModelOpt NVFP4 checkpoints at a reduced size, written with the
``safetensors`` library (an independent writer for the loader's own reader).

Layout (Kimi naming, DeepSeek-V3 architecture): ``num_hidden_layers = 4``,
``first_k_dense_replace = 1`` (layer 0 is a dense bf16 MLP), layers 1..3 MoE with 16 experts,
hidden 256, expert intermediate 128, top-4, one shared expert. Routed experts are NVFP4 except
in layer 2, which an ``ignore`` wildcard excludes; shared experts are bf16 everywhere (as
NVIDIA's exports of Kimi K2 keep them); a few attention/embedding tensors sit beside them.

:func:`build` returns the tensors and, per MoE layer, the parameters in the library's layout
built straight from the arrays that were quantized (before they were split into gate and up),
so a test can compare the loader's output with data the loader never touched. With
``separate_gate_up=True`` each expert's gate and up are quantized on their own, up scaled 3x to
10x (by expert) first, so every expert's two ``weight_scale_2`` differ; the expected fused weight
is then :func:`moe_jax.nvfp4.concat_rows` of the two (global scale ``[E, 2]``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from moe_jax import MoEConfig, nvfp4

NUM_LAYERS, FIRST_MOE, EXCLUDED_LAYER = 4, 1, 2
E, H, F, K, DENSE_F, VOCAB = 16, 256, 128, 4, 512, 64


def hf_config() -> dict:
    """config.json with Kimi K2's keys (reduced sizes) and ModelOpt's quantization_config."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "torch_dtype": "bfloat16",
        "hidden_size": H, "intermediate_size": DENSE_F, "moe_intermediate_size": F, "n_routed_experts": E,
        "num_experts_per_tok": K, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 2.827, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "norm_topk_prob": True, "first_k_dense_replace": FIRST_MOE, "num_hidden_layers": NUM_LAYERS,
        "moe_layer_freq": 1, "vocab_size": VOCAB,
        "quantization_config": {
            "quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None,
            "ignore": ["lm_head", "model.layers.0.mlp*", "model.layers.*.self_attn*", "model.layers.*.mlp.gate",
                       "model.layers.*.mlp.shared_experts*", f"model.layers.{EXCLUDED_LAYER}*"],
        },
    }


def layer_config(**overrides) -> MoEConfig:
    return MoEConfig.kimi_k2(**{**dict(num_experts=E, top_k=K, hidden_size=H, expert_intermediate_size=F), **overrides})


def _bf16(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale / np.sqrt(shape[-1])).astype(ml_dtypes.bfloat16)


@dataclasses.dataclass
class Synthetic:
    tensors: dict[str, np.ndarray]   # name -> array, as written
    expected: dict[int, dict]        # MoE layer -> params in the library's layout (numpy)
    config: dict                     # config.json


def build(seed: int = 0, *, separate_gate_up: bool = False) -> Synthetic:
    rng = np.random.default_rng(seed)
    t: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": _bf16(rng, (VOCAB, H)),
        "model.norm.weight": np.ones(H, ml_dtypes.bfloat16),
        "lm_head.weight": _bf16(rng, (VOCAB, H)),
    }
    expected = {}
    for layer in range(NUM_LAYERS):
        pre = f"model.layers.{layer}"
        t[f"{pre}.self_attn.o_proj.weight"] = _bf16(rng, (H, H))
        t[f"{pre}.input_layernorm.weight"] = np.ones(H, ml_dtypes.bfloat16)
        if layer < FIRST_MOE:
            for proj, shape in (("gate", (DENSE_F, H)), ("up", (DENSE_F, H)), ("down", (H, DENSE_F))):
                t[f"{pre}.mlp.{proj}_proj.weight"] = _bf16(rng, shape)
            continue
        mlp = f"{pre}.mlp"
        p: dict = {"router": {"w_eh": _bf16(rng, (E, H), 4.0),
                              "bias_e": (rng.standard_normal(E) * 0.1).astype(np.float32)}}
        t[f"{mlp}.gate.weight"] = p["router"]["w_eh"]
        t[f"{mlp}.gate.e_score_correction_bias"] = p["router"]["bias_e"]
        w_gu = rng.standard_normal((E, 2 * F, H)).astype(np.float32) / np.sqrt(H)
        w_dn = rng.standard_normal((E, H, F)).astype(np.float32) / np.sqrt(F)
        if layer == EXCLUDED_LAYER:
            w_gu, w_dn = w_gu.astype(ml_dtypes.bfloat16), w_dn.astype(ml_dtypes.bfloat16)
            p["experts"] = {"w_gate_up_egh": w_gu, "w_down_ehf": w_dn}
            for e in range(E):
                t[f"{mlp}.experts.{e}.gate_proj.weight"] = w_gu[e, :F]
                t[f"{mlp}.experts.{e}.up_proj.weight"] = w_gu[e, F:]
                t[f"{mlp}.experts.{e}.down_proj.weight"] = w_dn[e]
        else:
            if separate_gate_up:
                # Each projection quantized on its own, as ModelOpt does when it does not sync
                # gate's and up's amax: two weight_scale_2 per expert, here 3x to 10x apart.
                w_gu[:, F:] *= np.linspace(3.0, 10.0, E, dtype=np.float32)[:, None, None]
                q_gu = jax.tree.map(np.asarray, nvfp4.concat_rows(
                    nvfp4.quantize(jnp.asarray(w_gu[:, :F])), nvfp4.quantize(jnp.asarray(w_gu[:, F:]))))
            else:
                # Gate and up quantized as one matrix per expert: one amax, so one weight_scale_2,
                # as ModelOpt's export gives fused gate/up when it syncs their amax.
                q_gu = jax.tree.map(np.asarray, nvfp4.quantize(jnp.asarray(w_gu)))
            q_dn = jax.tree.map(np.asarray, nvfp4.quantize(jnp.asarray(w_dn)))
            p["experts"] = {"w_gate_up_egh": q_gu, "w_down_ehf": q_dn}
            inputs = {proj: (rng.uniform(0.5, 2.0, E) / (6 * 448)).astype(np.float32) for proj in ("gate", "up", "down")}
            p["input_scales"] = {f"{proj}_e": v for proj, v in inputs.items()}
            global_gu = q_gu.global_scale.reshape(E, -1)  # [E, 1] or [E, 2]: gate's in column 0, up's in the last
            for e in range(E):
                for proj, rows, q, g in (("gate", slice(0, F), q_gu, global_gu[e, 0]),
                                         ("up", slice(F, 2 * F), q_gu, global_gu[e, -1]),
                                         ("down", slice(None), q_dn, q_dn.global_scale[e])):
                    name = f"{mlp}.experts.{e}.{proj}_proj"
                    t[f"{name}.weight"] = q.packed[e, rows]
                    t[f"{name}.weight_scale"] = q.scales[e, rows]
                    t[f"{name}.weight_scale_2"] = np.asarray(g)
                    t[f"{name}.input_scale"] = np.asarray(inputs[proj][e])
        s_gu, s_dn = _bf16(rng, (2 * F, H)), _bf16(rng, (H, F))
        p["shared"] = {"w_gate_up_gh": s_gu, "w_down_hs": s_dn}
        t[f"{mlp}.shared_experts.gate_proj.weight"] = s_gu[:F]
        t[f"{mlp}.shared_experts.up_proj.weight"] = s_gu[F:]
        t[f"{mlp}.shared_experts.down_proj.weight"] = s_dn
        expected[layer] = p
    return Synthetic(tensors=t, expected=expected, config=hf_config())


def write(directory: Path, tensors: dict[str, np.ndarray], config: dict | None, *, files: int = 3) -> Path:
    """Writes ``tensors`` with safetensors, as one ``model.safetensors`` (``files=1``) or
    ``files`` shards with ``model.safetensors.index.json``; ``config`` as config.json."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (directory / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {name: np.array(v, order="C") for name, v in tensors.items()}  # 0-d stays 0-d
    if files == 1:
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        return directory
    names = list(tensors)
    weight_map = {}
    for i in range(files):
        chunk = names[i * len(names) // files:(i + 1) * len(names) // files]
        file = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        save_file({n: tensors[n] for n in chunk}, str(directory / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chunk, file))
    total = sum(v.nbytes for v in tensors.values())
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    return directory
