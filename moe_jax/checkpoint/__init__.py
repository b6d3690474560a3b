"""MoE layers of Hugging Face-style safetensors checkpoints in NVIDIA ModelOpt's NVFP4 layout.

:func:`load_moe_layer` reads one MoE layer of a DeepSeek-V3-architecture model (DeepSeek-V3/R1,
Kimi K2) from a directory holding ``config.json`` and either ``model.safetensors`` or
``model.safetensors.index.json`` with the files its ``weight_map`` names; :func:`save_moe_layer`
writes the library's parameters back in the same format. Tensors of layer ``L``::

    model.layers.{L}.mlp.gate.weight                      router [E, H], never quantized (kept as stored)
    model.layers.{L}.mlp.gate.e_score_correction_bias     F32/BF16/F16 [E] (topk_method noaux_tc),
                                                          widened to float32 exactly
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

The package, one module per concern: :mod:`~moe_jax.checkpoint.safetensors_io` (headers, the
index, memory-mapped reads, :class:`CheckpointError`), :mod:`~moe_jax.checkpoint.modelopt`
(the quantization settings and what each projection stores), :mod:`~moe_jax.checkpoint.load`
(:func:`load_moe_layer`, :func:`moe_layer_indices`) and :mod:`~moe_jax.checkpoint.save`
(:func:`save_moe_layer`, :func:`hf_config_dict`).
"""

from moe_jax.checkpoint.load import load_moe_layer, moe_layer_indices
from moe_jax.checkpoint.modelopt import HF_QUANT_CONFIG, PROJECTIONS, QuantizationSettings, quantization_settings
from moe_jax.checkpoint.safetensors_io import (
    DTYPES, INDEX_FILE, SINGLE_FILE, Checkpoint, CheckpointError, TensorInfo, read_header,
)
from moe_jax.checkpoint.save import hf_config_dict, save_moe_layer

__all__ = [
    "DTYPES", "HF_QUANT_CONFIG", "INDEX_FILE", "PROJECTIONS", "SINGLE_FILE", "Checkpoint", "CheckpointError",
    "QuantizationSettings", "TensorInfo", "hf_config_dict", "load_moe_layer", "moe_layer_indices",
    "quantization_settings", "read_header", "save_moe_layer",
]
