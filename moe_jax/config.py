"""``MoEConfig``: what a layer is, and which implementations it asks for.

A frozen, keyword-only, hashable dataclass (usable as a static ``jit`` argument), validated
in ``__post_init__``; ``dataclasses.replace`` re-validates. ``expert_gemm`` and ``exchange``
are only checked to be names here: :func:`moe_jax.resolve` checks them against the
registries that dispatch reads (``moe_jax.EXPERT_GEMM``, ``moe_jax.EXCHANGE``), so this module
loads no kernels and no collectives.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Literal, get_args

from moe_jax.auto import AUTO
from pallas_kernels.weight_format import WeightFormat

Scoring = Literal["softmax", "sigmoid"]
ActivationDtype = Literal["bfloat16", "float32"]
ActivationScale = Literal["auto", "checkpoint", "dynamic"]
ReferenceActivations = Literal["bf16", "nvfp4"]
PrefillActivations = Literal["bf16", "fp8"]


def _fail(field: str, value, rule: str):
    raise ValueError(f"MoEConfig.{field} = {value!r}: {rule}")


#: The MoEConfig fields a DeepSeek-V3 / Kimi K2 ``config.json`` determines, and the key each comes
#: from (``router_bias`` from ``topk_method``: ``noaux_tc`` or ``greedy``). The one table that
#: :meth:`MoEConfig.from_hf_config`, the checkpoint loader's consistency check and
#: :func:`moe_jax.checkpoint.hf_config_dict` read.
HF_KEYS = {
    "hidden_size": "hidden_size", "expert_intermediate_size": "moe_intermediate_size",
    "num_experts": "n_routed_experts", "top_k": "num_experts_per_tok", "num_shared_experts": "n_shared_experts",
    "num_groups": "n_group", "topk_groups": "topk_group", "routed_scaling_factor": "routed_scaling_factor",
    "scoring": "scoring_func", "router_bias": "topk_method", "normalize": "norm_topk_prob",
}
_HF_INT_FIELDS = ("hidden_size", "expert_intermediate_size", "num_experts", "top_k", "num_shared_experts",
                  "num_groups", "topk_groups")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """A Mixture-of-Experts layer: shape, router, weight format and implementation choices.

    Shape:
      num_experts: routed experts E.
      top_k: experts per token k (1 <= k <= E).
      hidden_size: model width H.
      expert_intermediate_size: each routed expert's SwiGLU width F.
      num_shared_experts: always-on experts added to every token (DeepSeek-V3, Kimi K2: 1).
      shared_intermediate_size: their combined SwiGLU width; None means
        ``num_shared_experts * expert_intermediate_size`` (DeepSeek-V3's convention).

    Router (see :func:`moe_jax.router.route`):
      scoring: ``"softmax"`` (Mixtral, Qwen) or ``"sigmoid"`` (DeepSeek-V3, Kimi K2).
      num_groups, topk_groups: group-limited selection; E must divide into num_groups.
      normalize: divide the chosen weights by their sum.
      routed_scaling_factor: multiplies the routed weights.
      router_bias: the router has a per-expert correction bias used for selection only.

    Weights and activations:
      weight_format: routed expert weights in ``"bf16"`` or ``"nvfp4"`` (ModelOpt layout).
      shared_weight_format: the shared expert's weights, ``"bf16"`` or ``"nvfp4"``; None means
        the same as ``weight_format``. NVIDIA's NVFP4 exports of Kimi K2 keep the shared expert
        in bf16 while the routed experts are NVFP4. :attr:`shared_format` is the effective one.
      dtype: activation dtype.
      qat: quantization-aware training of NVFP4 experts (needs ``weight_format="nvfp4"``). The
        routed experts' parameters are then float master weights (bf16 or float32, see
        :attr:`expert_param_format`), quantized to NVFP4 in every forward pass; the expert GEMMs
        run on that quantization, and gradients reach the masters through a straight-through
        estimator (``moe_jax.expert_gemm``).
      activation_scale: the global scale W4A4 quantizes the routed experts' activations against
        (one per row; E4M3 block scales are always computed on the fly). ``"checkpoint"``: the
        checkpoint's calibrated static ``input_scale`` of each expert (``params["input_scales"]``,
        required), as TensorRT-LLM and vLLM quantize; the fused gate/up takes the larger of gate's
        and up's. A row past the calibrated range (``6 * 448 * input_scale``) saturates.
        ``"dynamic"``: ``amax(|row|) / (6 * 448)`` of each row, computed on the fly (never
        saturates). ``"auto"``: the checkpoint's where the params carry them, else dynamic.
        Only where activations are quantized (``triton`` on SM100/SM120,
        ``reference_activations="nvfp4"``); ignored everywhere else. The shared expert's
        activations are never quantized. What it costs, measured
        (``benchmarks/activation_scale_error.py`` on CPU, seeds 0 and 1): Kimi K2's routed experts
        at 16 experts, 64 tokens with log-normal channel sizes, static scales max-calibrated on
        256 other tokens; relative (Frobenius) error of their output against float64 with the
        same NVFP4 weights and unquantized activations: W4A16 (bf16 activations) 4.2e-3, W4A4
        ``"dynamic"`` 0.160, ``"checkpoint"`` 0.160, ``"checkpoint"`` with every input_scale 4x
        too small 0.33; against W4A16 the same figures (0.160, 0.160, 0.33): W4A4's error is the
        activations' rounding.
      reference_activations: what the ``xla`` reference multiplies the routed experts' weights
        with: ``"bf16"``, the activations in ``dtype`` (W4A16, as the ``pallas`` kernels and
        ``triton`` below SM100 do), or ``"nvfp4"``, the activations quantized exactly as the W4A4
        kernels' inputs are (per ``activation_scale``) and dequantized, so that the W4A4 layer's
        numerics can be checked on any machine (needs ``weight_format="nvfp4"``).
      prefill_activations: what the NVFP4 expert GEMMs on SM90 multiply the weights with at prefill
        sizes (more than two 16-row tiles per expert on average). ``"bf16"`` (the default): W4A16,
        the activations as they are. ``"fp8"`` (opt-in, W4A8; ``expert_gemm="triton"``, inference):
        each row quantized to E4M3 against its own amax, each weight's code times its block scale
        placed into E4M3, Hopper's FP8 tensor cores; decode sizes stay W4A16. On one H100 at Kimi
        K2's size (384 experts x 65536 rows, ``benchmarks/results/fp8_probe_h100/``) its GEMMs ran
        at 0.90 (gate/up) and 0.82 (down) of dense bf16 cuBLAS on the same FLOPs, against 0.63 and
        0.61 for W4A16 in the same harness. What it costs: the expert MLP's output moves ~4-6%
        (relative Frobenius) from W4A16's on Gaussian rows (``benchmarks/results/w4a8_numerics_cpu/``;
        the activations' rounding, a third of what quantizing the weights to NVFP4 moved them),
        against W4A16's 0.2% from float64. Applies to the routed experts and, where it runs through
        the same kernels, the NVFP4 shared expert.

    Implementations (each ``"auto"`` or a registered name, checked by ``resolve``; see
    ``moe-jax explain``):
      expert_gemm: the grouped expert MLP, one of ``moe_jax.EXPERT_GEMM.names()``.
      exchange: the expert-parallel token exchange, one of ``moe_jax.EXCHANGE.names()``.
      interpret: run Pallas kernels in the Pallas interpreter, which lets them run on CPU;
        slow, for tests and debugging, never chosen on its own.

    Parallelism:
      expert_axis: the mesh axis over which experts are sharded.
      capacity_factor: None for dropless (the default); else each device receives at most
        ``ceil(capacity_factor * tokens * top_k / expert_parallel)`` rows and the rest are
        dropped and counted in the layer's statistics.
    """

    num_experts: int
    top_k: int
    hidden_size: int
    expert_intermediate_size: int
    num_shared_experts: int = 0
    shared_intermediate_size: int | None = None

    scoring: Scoring = "softmax"
    num_groups: int = 1
    topk_groups: int = 1
    normalize: bool = True
    routed_scaling_factor: float = 1.0
    router_bias: bool = False

    weight_format: WeightFormat = "bf16"
    shared_weight_format: WeightFormat | None = None
    dtype: ActivationDtype = "bfloat16"
    qat: bool = False
    activation_scale: ActivationScale = "auto"
    reference_activations: ReferenceActivations = "bf16"
    prefill_activations: PrefillActivations = "bf16"

    expert_gemm: str = AUTO
    exchange: str = AUTO
    interpret: bool = False

    expert_axis: str = "expert"
    capacity_factor: float | None = None

    def __post_init__(self):
        for field, least in (("num_experts", 1), ("top_k", 1), ("hidden_size", 1),
                             ("expert_intermediate_size", 1), ("num_shared_experts", 0),
                             ("num_groups", 1), ("topk_groups", 1)):
            value = getattr(self, field)
            if type(value) is not int or value < least:
                _fail(field, value, f"must be an int >= {least}")
        if self.top_k > self.num_experts:
            _fail("top_k", self.top_k, f"must be <= num_experts = {self.num_experts}")
        if self.shared_intermediate_size is not None:
            if type(self.shared_intermediate_size) is not int or self.shared_intermediate_size < 1:
                _fail("shared_intermediate_size", self.shared_intermediate_size, "must be a positive int or None")
            if self.num_shared_experts == 0:
                _fail("shared_intermediate_size", self.shared_intermediate_size, "needs num_shared_experts >= 1")
        self._check_groups()
        for field, allowed in (
            ("scoring", get_args(Scoring)),
            ("weight_format", tuple(WeightFormat)),
            ("dtype", get_args(ActivationDtype)),
            ("activation_scale", get_args(ActivationScale)),
            ("reference_activations", get_args(ReferenceActivations)),
            ("prefill_activations", get_args(PrefillActivations)),
        ):
            if getattr(self, field) not in allowed:
                _fail(field, getattr(self, field), f"must be one of {', '.join(map(repr, allowed))}")
        # Stored as the enum (equal to its string), so that kernels and configs share one type.
        object.__setattr__(self, "weight_format", WeightFormat(self.weight_format))
        for field in ("expert_gemm", "exchange"):
            if not isinstance(getattr(self, field), str) or not getattr(self, field):
                _fail(field, getattr(self, field), f"must be a non-empty string: {AUTO!r} or a registered name")
        for field in ("normalize", "router_bias", "interpret", "qat"):
            if type(getattr(self, field)) is not bool:
                _fail(field, getattr(self, field), "must be a bool")
        if not (isinstance(self.routed_scaling_factor, (int, float)) and math.isfinite(self.routed_scaling_factor)
                and self.routed_scaling_factor > 0):
            _fail("routed_scaling_factor", self.routed_scaling_factor, "must be a finite number > 0")
        if self.shared_weight_format is not None:
            if self.shared_weight_format not in tuple(WeightFormat):
                allowed = ", ".join(map(repr, (None, *WeightFormat)))
                _fail("shared_weight_format", self.shared_weight_format, f"must be one of {allowed}")
            object.__setattr__(self, "shared_weight_format", WeightFormat(self.shared_weight_format))
            if self.num_shared_experts == 0:
                _fail("shared_weight_format", self.shared_weight_format, "needs num_shared_experts >= 1")
        if self.qat and self.weight_format != "nvfp4":
            _fail("qat", self.qat, f"needs weight_format='nvfp4' (found {self.weight_format!r}): it trains "
                  "float masters through their NVFP4 quantization")
        if self.reference_activations == "nvfp4" and self.weight_format != "nvfp4":
            _fail("reference_activations", self.reference_activations, f"needs weight_format='nvfp4' (found "
                  f"{self.weight_format!r}): it reproduces the W4A4 kernels, which take NVFP4 weights")
        if self.prefill_activations == "fp8" and (self.weight_format != "nvfp4" or self.qat):
            _fail("prefill_activations", self.prefill_activations, f"needs weight_format='nvfp4' without qat (found "
                  f"{self.weight_format!r}, qat={self.qat}): W4A8 multiplies NVFP4 weights as stored")
        if self.weight_format == "nvfp4":
            for field in ("hidden_size", "expert_intermediate_size"):
                if getattr(self, field) % 16:
                    _fail(field, getattr(self, field), "must be a multiple of 16 for NVFP4 weights (one scale per 16)")
        if self.num_shared_experts and self.shared_format == "nvfp4":
            # The shared down projection is [H, S]: its input dimension S needs whole blocks too.
            for field, value in (("hidden_size", self.hidden_size), ("shared_intermediate_size", self.shared_size)):
                if value % 16:
                    _fail(field, value, "must be a multiple of 16 for NVFP4 shared-expert weights (one scale per 16)")
        if not isinstance(self.expert_axis, str) or not self.expert_axis:
            _fail("expert_axis", self.expert_axis, "must be a non-empty mesh axis name")
        if self.capacity_factor is not None and not (
            isinstance(self.capacity_factor, (int, float)) and math.isfinite(self.capacity_factor)
            and self.capacity_factor > 0
        ):
            _fail("capacity_factor", self.capacity_factor, "must be None (dropless) or a finite number > 0")

    def _check_groups(self):
        if self.num_experts % self.num_groups:
            _fail("num_groups", self.num_groups, f"must divide num_experts = {self.num_experts}")
        if self.topk_groups > self.num_groups:
            _fail("topk_groups", self.topk_groups, f"must be <= num_groups = {self.num_groups}")
        if self.num_groups > 1:
            per_group = self.num_experts // self.num_groups
            if per_group < 2:
                _fail("num_groups", self.num_groups, "needs >= 2 experts per group (a group scores by its top 2)")
            if self.top_k > self.topk_groups * per_group:
                _fail("top_k", self.top_k,
                      f"must be <= topk_groups * experts per group = {self.topk_groups * per_group}")

    @property
    def shared_format(self) -> WeightFormat:
        """The shared expert's effective weight format: ``shared_weight_format`` or, when that
        is None, ``weight_format``."""
        return self.weight_format if self.shared_weight_format is None else self.shared_weight_format

    @property
    def expert_param_format(self) -> WeightFormat:
        """The format the routed experts' parameters are stored in: ``weight_format``, except
        under ``qat``, where they are float masters (``"bf16"`` here means "a float array")."""
        return WeightFormat.BF16 if self.qat else self.weight_format

    @property
    def shared_size(self) -> int:
        """The shared experts' combined SwiGLU width (0 without shared experts)."""
        if self.shared_intermediate_size is not None:
            return self.shared_intermediate_size
        return self.num_shared_experts * self.expert_intermediate_size

    # Presets carry the published numbers of each model's config.json.

    @classmethod
    def kimi_k2(cls, **overrides) -> MoEConfig:
        """Kimi K2 (moonshotai/Kimi-K2-Instruct): 384 experts, top-8, sigmoid, scaling 2.827."""
        return cls(**{
            **dict(num_experts=384, top_k=8, hidden_size=7168, expert_intermediate_size=2048,
                   num_shared_experts=1, scoring="sigmoid", num_groups=1, topk_groups=1,
                   normalize=True, routed_scaling_factor=2.827, router_bias=True),
            **overrides,
        })

    @classmethod
    def deepseek_v3(cls, **overrides) -> MoEConfig:
        """DeepSeek-V3: 256 experts, top-8 within the best 4 of 8 groups, sigmoid, scaling 2.5."""
        return cls(**{
            **dict(num_experts=256, top_k=8, hidden_size=7168, expert_intermediate_size=2048,
                   num_shared_experts=1, scoring="sigmoid", num_groups=8, topk_groups=4,
                   normalize=True, routed_scaling_factor=2.5, router_bias=True),
            **overrides,
        })

    @classmethod
    def mixtral_8x7b(cls, **overrides) -> MoEConfig:
        """Mixtral 8x7B: 8 experts, top-2, softmax renormalized over the chosen two."""
        return cls(**{
            **dict(num_experts=8, top_k=2, hidden_size=4096, expert_intermediate_size=14336,
                   scoring="softmax", normalize=True),
            **overrides,
        })

    PRESETS = ("kimi_k2", "deepseek_v3", "mixtral_8x7b")

    @classmethod
    def from_hf_config(cls, config_json: dict | str | os.PathLike, **overrides) -> MoEConfig:
        """The MoE layer of a DeepSeek-V3-architecture model (DeepSeek-V3/R1, Kimi K2) from
        its Hugging Face ``config.json``.

        Args:
          config_json: the parsed ``config.json``, or the path of that file or of the
            directory holding it.
          overrides: fields to set on top (``weight_format``, ``expert_gemm``, ...).

        Maps ``hidden_size``, ``moe_intermediate_size``, ``n_routed_experts``,
        ``num_experts_per_tok``, ``n_shared_experts``, ``n_group``, ``topk_group``,
        ``routed_scaling_factor``, ``scoring_func`` (``sigmoid``/``softmax``), ``topk_method``
        (``noaux_tc``: selection with the ``e_score_correction_bias``, group-limited as
        DeepSeek-V3 does it; ``greedy``: plain top-k, groups unused) and ``norm_topk_prob``.
        Kimi K2's values are 7168 / 2048 / 384 / 8 / 1 / 1 / 1 / 2.827 / sigmoid / noaux_tc /
        true. Weight formats are not read here: they are per layer and per group, and
        :func:`moe_jax.checkpoint.load_moe_layer` sets them from what the checkpoint stores.
        Which layers are MoE layers: :func:`moe_jax.checkpoint.moe_layer_indices`.

        Raises:
          ValueError: one line naming the key that is missing, of the wrong type or unsupported
            (e.g. ``topk_method = 'group_limited_greedy'``), or the field a value breaks.
        """
        hf, where = read_hf_config(config_json)
        fields = {field: hf_int(hf, HF_KEYS[field], where) for field in _HF_INT_FIELDS}
        fields["routed_scaling_factor"] = float(_hf_value(hf, HF_KEYS["routed_scaling_factor"], (int, float), where))
        fields["normalize"] = _hf_value(hf, HF_KEYS["normalize"], bool, where)
        scoring = _hf_value(hf, HF_KEYS["scoring"], str, where)
        if scoring not in get_args(Scoring):
            raise ValueError(f"{where}: scoring_func = {scoring!r} is not supported, expected one of "
                             f"{', '.join(map(repr, get_args(Scoring)))}")
        fields["scoring"] = scoring
        method = _hf_value(hf, HF_KEYS["router_bias"], str, where)
        match method:
            case "noaux_tc":
                fields["router_bias"] = True
            case "greedy":
                # Plain top-k over all experts: DeepSeek's greedy ignores n_group/topk_group.
                fields.update(router_bias=False, num_groups=1, topk_groups=1)
            case _:
                # Not assert_never: this is input, and the other methods (DeepSeek-V2's
                # group_limited_greedy scores a group by its best expert) are not implemented.
                raise ValueError(f"{where}: topk_method = {method!r} is not supported, expected 'noaux_tc' or 'greedy'")
        try:
            return cls(**{**fields, **overrides})
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None


def read_hf_config(config_json: dict | str | os.PathLike) -> tuple[dict, str]:
    """``(config dict, where)`` from a parsed ``config.json`` or the path of the file or of its
    directory; ``where`` names the source in error messages."""
    if isinstance(config_json, dict):
        return config_json, "config.json"
    if not isinstance(config_json, (str, os.PathLike)):
        raise ValueError(f"config_json: {type(config_json).__name__}, expected a dict or the path of config.json")
    path = Path(config_json)
    if path.is_dir():
        path = path / "config.json"
    try:
        hf = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"config_json: {path} does not exist, expected a Hugging Face config.json") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{path}: a JSON {type(hf).__name__}, expected an object")
    return hf, str(path)


def _hf_value(hf: dict, key: str, types, where: str):
    if key not in hf:
        raise ValueError(f"{where}: key {key!r} is missing")
    value = hf[key]
    # bool is an int subclass: a true/false where a number belongs is a mistake, and vice versa.
    if not isinstance(value, types) or (isinstance(value, bool) and types is not bool):
        names = " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
        raise ValueError(f"{where}: {key} = {value!r}, expected {names}")
    return value


def hf_int(hf: dict, key: str, where: str = "config.json") -> int:
    """``hf[key]`` as an int, or a one-line ValueError naming the key."""
    return _hf_value(hf, key, int, where)
