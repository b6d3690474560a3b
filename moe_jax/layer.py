"""The MoE layer as a pure function: parameters, validation and the forward pass.

Dimension letters: ``t`` tokens, ``h`` hidden, ``e`` experts, ``k`` top-k slots,
``f`` expert intermediate, ``g = 2f`` (gate and up stacked), ``s`` shared intermediate.

Parameters (a nested dict, a pytree)::

    {"router":  {"w_eh": f32 [E, H], "bias_e": f32 [E]  (only with config.router_bias)},
     "experts": {"w_gate_up_egh": [E, 2F, H], "w_down_ehf": [E, H, F]},
     "shared":  {"w_gate_up_gh": [2S, H], "w_down_hs": [H, S]}  (only with shared experts)}

Projection weights are (out, in) as checkpoints store them, gate rows before up rows, each a
bf16 array or an :class:`~moe_jax.nvfp4.NVFP4Tensor` per ``config.expert_param_format``. An NVFP4
gate/up weight has one global scale per matrix (``[E]``; ``[]`` shared) or one per half
(``[E, 2]``; ``[2]`` shared: gate's, then up's, as ModelOpt may give them); down weights have
one per matrix.
"""

from __future__ import annotations

import functools
import math
from typing import assert_never

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moe_jax import nvfp4, router
from moe_jax.config import MoEConfig
from moe_jax.exchange import EXCHANGE, run_options
from moe_jax.expert_gemm import EXPERT_GEMM, shared_expert_mlp
from moe_jax.manual_axes import varying_over
from moe_jax.plan import Plan
from moe_jax.resolve import resolve
from pallas_kernels.grouped_matmul import reference as gmm_reference
from sharding.mesh import (
    EXPERT_INTERMEDIATE, EXPERTS, HIDDEN, TOKENS, expert_parallel_rules, logical_to_spec, shard_tree, tree_specs,
)

Params = dict


def param_shapes(config: MoEConfig) -> dict:
    """The logical shape of every parameter, in the layout of :func:`init_params`.

    Shapes are those of the matrices the projections encode, whatever their format
    (``config.weight_format`` for ``"experts"``, ``config.shared_format`` for ``"shared"``).
    The optional ``"input_scales"`` group (see :func:`check_params`) is not listed.
    """
    e, h, f, s = config.num_experts, config.hidden_size, config.expert_intermediate_size, config.shared_size
    shapes = {
        "router": {"w_eh": (e, h)},
        "experts": {"w_gate_up_egh": (e, 2 * f, h), "w_down_ehf": (e, h, f)},
    }
    if config.router_bias:
        shapes["router"]["bias_e"] = (e,)
    if s:
        shapes["shared"] = {"w_gate_up_gh": (2 * s, h), "w_down_hs": (h, s)}
    return shapes


def init_params(config: MoEConfig, key: jax.Array) -> Params:
    """Random parameters (fan-in scaled normal); routed projections in ``config.expert_param_format``,
    shared ones in ``config.shared_format``."""
    shapes = param_shapes(config)
    keys = iter(jax.random.split(key, 8))

    def projection(shape, weight_format):
        w = jax.random.normal(next(keys), shape, jnp.float32) / math.sqrt(shape[-1])
        match weight_format:
            case "bf16":
                return w.astype(jnp.bfloat16)
            case "nvfp4":
                return nvfp4.quantize(w)
            case _ as unreachable:
                assert_never(unreachable)

    params = {
        "router": {"w_eh": jax.random.normal(next(keys), shapes["router"]["w_eh"]) / math.sqrt(config.hidden_size)},
        "experts": {name: projection(shape, config.expert_param_format) for name, shape in shapes["experts"].items()},
    }
    if config.router_bias:
        # Zero, as DeepSeek-V3 starts it: training moves it to balance the load.
        params["router"]["bias_e"] = jnp.zeros((config.num_experts,), jnp.float32)
    if "shared" in shapes:
        params["shared"] = {name: projection(shape, config.shared_format) for name, shape in shapes["shared"].items()}
    return params


def _group_formats(config: MoEConfig) -> dict:
    return {"router": "float32", "experts": config.expert_param_format, "shared": config.shared_format}


def param_template(config: MoEConfig) -> dict:
    """``jax.ShapeDtypeStruct`` s of the parameters :func:`random_params` and :func:`init_params`
    make (NVFP4 projections as :class:`~moe_jax.nvfp4.NVFP4Tensor` of them, one global scale per
    matrix): what the arrays weigh, before any is allocated."""

    def abstract(shape, fmt):
        match fmt:
            case "float32":
                return jax.ShapeDtypeStruct(shape, jnp.float32)
            case "bf16":
                return jax.ShapeDtypeStruct(shape, jnp.bfloat16)
            case "nvfp4":
                *lead, n, k = shape
                return nvfp4.NVFP4Tensor(packed=jax.ShapeDtypeStruct((*lead, n, k // 2), jnp.uint8),
                                         scales=jax.ShapeDtypeStruct((*lead, n, k // nvfp4.BLOCK), jnp.float8_e4m3fn),
                                         global_scale=jax.ShapeDtypeStruct(tuple(lead), jnp.float32))
            case _:
                assert_never(fmt)

    formats = _group_formats(config)
    return {group: {name: abstract(shape, formats[group]) for name, shape in leaves.items()}
            for group, leaves in param_shapes(config).items()}


def random_params(config: MoEConfig, key: jax.Array, plan: Plan | None = None) -> Params:
    """Random parameters at full size, each array made where it will live.

    Unlike :func:`init_params`, NVFP4 projections are drawn in their stored format
    (:func:`moe_jax.nvfp4.random`) rather than quantized from dense weights, which at Kimi K2's
    size would take minutes and a 45 GB float32 copy; bf16 projections are fan-in scaled
    normals. For benchmarks and examples, not for training.

    Args:
      config: the layer (formats per group as in :func:`init_params`).
      key: a JAX PRNG key.
      plan: with a ``Mesh``, arrays are placed as :func:`shard_params` would place them (each
        device makes only its own experts); else on the default device.
    """
    shapes = param_shapes(config)
    formats = _group_formats(config)
    template = param_template(config)
    if plan is not None and isinstance(plan.mesh, Mesh):
        placement = param_shardings(template, plan)
    else:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        placement = jax.tree.map(lambda _: device, template)
    params = {}
    for i, (group, name, shape) in enumerate((g, n, s) for g, leaves in shapes.items() for n, s in leaves.items()):
        where, sub = placement[group][name], jax.random.fold_in(key, i)
        if group == "router":
            scale = 0.01 if name == "bias_e" else config.hidden_size**-0.5
            value = jax.jit(lambda k, shape=shape, scale=scale: scale * jax.random.normal(k, shape),
                            out_shardings=where)(sub)
        elif formats[group] == "nvfp4":
            value = nvfp4.random(sub, shape, sharding=where)
        else:
            value = jax.jit(lambda k, shape=shape: (jax.random.normal(k, shape) / math.sqrt(shape[-1])).astype(
                jnp.bfloat16), out_shardings=where)(sub)
        params.setdefault(group, {})[name] = value
    return params


def quantize_params(params: Params, config: MoEConfig | None = None) -> Params:
    """The same parameters with routed and shared projections quantized to NVFP4.

    Without ``config``, every routed and shared projection; with it, only the groups whose
    format is ``"nvfp4"`` (``config.weight_format`` for the routed experts,
    ``config.shared_format`` for the shared expert), the others left as they are. A projection
    that is already an :class:`~moe_jax.nvfp4.NVFP4Tensor` is kept, never re-quantized.
    """
    formats = {"experts": "nvfp4", "shared": "nvfp4"}
    if config is not None:
        formats = {"experts": config.expert_param_format, "shared": config.shared_format}
    out = {group: dict(leaves) for group, leaves in params.items()}
    for group, weight_format in formats.items():
        for name, w in params.get(group, {}).items():
            match weight_format:
                case "nvfp4":
                    if not isinstance(w, nvfp4.NVFP4Tensor):
                        out[group][name] = nvfp4.quantize(w, name=f"params[{group!r}][{name!r}]")
                case "bf16":
                    pass
                case _ as unreachable:
                    assert_never(unreachable)
    return out


def check_params(params: Params, config: MoEConfig) -> None:
    """Raises ValueError naming the first parameter whose presence, shape or dtype is wrong.

    Routed projections must be in ``config.expert_param_format``, shared ones in
    ``config.shared_format``. One optional group is accepted besides :func:`param_shapes`'
    layout: ``params["input_scales"]``, the activation scales of an NVFP4 checkpoint
    (ModelOpt's ``input_scale``, one per projection): ``"gate_e"``, ``"up_e"``, ``"down_e"``
    float32 ``[E]`` (all three or none), the routed experts' static W4A4 activation scales
    (``config.activation_scale``; ``"checkpoint"`` requires them) and, with shared experts,
    ``"shared_gate"``, ``"shared_up"``, ``"shared_down"`` float32 scalars (all three or none;
    kept, unused: the shared expert's activations are not quantized).
    """
    expected = param_shapes(config)
    formats = {"router": None, "experts": config.expert_param_format, "shared": config.shared_format}
    for group, names in expected.items():
        if not isinstance(params.get(group), dict):
            raise ValueError(f"params[{group!r}]: missing, expected a dict with {sorted(names)}")
        extra = set(params[group]) - set(names)
        if extra:
            raise ValueError(f"params[{group!r}]: unexpected entries {sorted(extra)}, expected {sorted(names)}")
        for name, shape in names.items():
            where = f"params[{group!r}][{name!r}]"
            if name not in params[group]:
                raise ValueError(f"{where}: missing, expected shape {shape}")
            w = params[group][name]
            if formats[group] == "nvfp4":
                if not isinstance(w, nvfp4.NVFP4Tensor):
                    found = f"a {w.dtype} array" if hasattr(w, "dtype") else type(w).__name__
                    field = "weight_format" if group == "experts" else "shared_format"
                    raise ValueError(f"{where}: {found}, expected an NVFP4Tensor ({field}='nvfp4')")
                w.validate(where)
            elif isinstance(w, nvfp4.NVFP4Tensor) or not jnp.issubdtype(w.dtype, jnp.floating):
                raise ValueError(f"{where}: {getattr(w, 'dtype', type(w).__name__)}, expected a float array")
            if tuple(w.shape) != shape:
                raise ValueError(f"{where}: shape {tuple(w.shape)}, expected {shape}")
            if isinstance(w, nvfp4.NVFP4Tensor):
                # Gate and up may keep their own global scales (every expert path applies them
                # per half); a down projection is one matrix.
                lead = shape[:-2]
                allowed = [lead, (*lead, 2)] if name.startswith("w_gate_up") else [lead]
                if tuple(w.global_scale.shape) not in allowed:
                    raise ValueError(f"{where}.global_scale: shape {tuple(w.global_scale.shape)}, expected "
                                     f"{' or '.join(map(str, allowed))}")
    if "shared" in params and "shared" not in expected:
        raise ValueError("params['shared']: present, but config.num_shared_experts = 0")
    known = set(expected) | {"input_scales"}
    if set(params) - known:
        raise ValueError(f"params: unexpected groups {sorted(set(params) - known)}, expected {sorted(known)}")
    if "input_scales" in params:
        scales = params["input_scales"]
        triples = {"experts": ({"gate_e", "up_e", "down_e"}, (config.num_experts,))}
        if "shared" in expected:
            triples["shared"] = ({"shared_gate", "shared_up", "shared_down"}, ())
        allowed = set().union(*(names for names, _ in triples.values()))
        if not isinstance(scales, dict) or set(scales) - allowed:
            found = sorted(scales) if isinstance(scales, dict) else type(scales).__name__
            raise ValueError(f"params['input_scales']: {found}, expected a dict with entries among {sorted(allowed)}")
        for names, shape in triples.values():
            if names & set(scales) and names - set(scales):
                raise ValueError(f"params['input_scales']: {sorted(names - set(scales))} missing; "
                                 f"{sorted(names)} come together")
            for name in sorted(names & set(scales)):
                w = scales[name]
                if getattr(w, "dtype", None) != jnp.float32 or tuple(w.shape) != shape:
                    found = f"{getattr(w, 'dtype', type(w).__name__)} {tuple(getattr(w, 'shape', ()))}"
                    raise ValueError(f"params['input_scales'][{name!r}]: {found}, expected float32 {shape}")
    if config.activation_scale == "checkpoint" and "gate_e" not in params.get("input_scales", {}):
        raise ValueError("params['input_scales']: no 'gate_e', 'up_e', 'down_e' (the routed experts' input_scale), "
                         "expected with MoEConfig.activation_scale='checkpoint' ('auto' or 'dynamic' quantize per row)")


def _expert_weights(params: Params, config: MoEConfig) -> dict:
    """What the expert stage gets (:mod:`moe_jax.expert_gemm`): ``params["experts"]``, with the
    routed experts' ``"input_scales"`` where ``config.activation_scale`` takes the checkpoint's
    (``"checkpoint"``, or ``"auto"`` with the params carrying them). Inside ``shard_map`` those
    are this device's experts' (they are split along the experts as the weights are)."""
    scales = params.get("input_scales", {})
    match config.activation_scale:
        case "dynamic":
            static = False
        case "checkpoint" | "auto":
            static = "gate_e" in scales
        case _ as unreachable:
            assert_never(unreachable)
    if not static:
        return params["experts"]
    return {**params["experts"], "input_scales": {name: scales[name] for name in ("gate_e", "up_e", "down_e")}}


def _local_forward(params: Params, x_th, valid_t, plan: Plan, axis_names: tuple[str, ...]):
    """One device's share: route, exchange + experts, combine, shared expert, statistics.

    ``x_th`` ``[T, H]``; ``valid_t`` bool ``[T]`` marks real tokens: padding tokens route
    nowhere (expert id E). A token with a non-finite value in its row of ``x_th`` or in its
    router logits (finite activations can still overflow them) is counted in
    ``nonfinite_tokens``, routes nowhere, is read as zeros by every computation and gets a NaN
    output: it changes no other token's output, no statistic and no gradient (a NaN row would
    make ``x^T dy`` NaN even under a zero cotangent, so masking its output in the loss is not
    enough). The statistics cover the valid finite tokens.
    """
    config = plan.config
    dtype = jnp.dtype(config.dtype)
    finite_t = jnp.all(jnp.isfinite(x_th), axis=1)
    x_th = jnp.where(finite_t[:, None], x_th, 0)
    # With float32's accuracy, as the published models' gates run (router.logits).
    logits_te = router.logits(x_th, params["router"]["w_eh"])
    finite_t = finite_t & jnp.all(jnp.isfinite(logits_te), axis=1)
    # Zeros in place of what is left out, before any function of it: a select after the scores
    # would pass a zero cotangent through a NaN derivative, and 0 * NaN is NaN.
    x_th = jnp.where(finite_t[:, None], x_th, 0)
    logits_te = jnp.where(finite_t[:, None], logits_te, 0.0)
    counted_t = valid_t & finite_t
    ids_tk, weights_tk = router.route(logits_te, config, correction_bias_e=params["router"].get("bias_e"))
    ids_tk = jnp.where(counted_t[:, None], ids_tk, config.num_experts)

    expert_impl = EXPERT_GEMM[plan.expert_gemm]
    # Cast to varying over every mesh axis here, before the exchange: the transpose of the cast
    # (a psum of the weights' gradient over the axes they are replicated along) then runs here,
    # on every device. Left implicit, the cast happens where the weights meet the rows, inside the
    # exchange's switch over buffer sizes, whose branch is the same along the expert axis only:
    # two data-parallel groups in different branches ran different all-reduces and deadlocked
    # (benchmarks/NOTES.md, section 7).
    expert_weights = varying_over(_expert_weights(params, config), axis_names)

    def expert_fn(x_mh, group_sizes_e, row_token_m=None, token_row_tk=None):
        with jax.named_scope(plan.scope(EXPERT_GEMM.stage)):
            return expert_impl.run(x_mh, group_sizes_e, expert_weights, plan, row_token_m=row_token_m,
                                   token_row_tk=token_row_tk)

    with jax.named_scope(plan.scope(EXCHANGE.stage)):
        y_th, dropped, rows_sent = EXCHANGE[plan.exchange].run(
            x_th.astype(dtype), ids_tk, weights_tk, expert_fn,
            num_experts=config.num_experts, axis_name=config.expert_axis,
            capacity_factor=config.capacity_factor, **run_options(plan),
        )
    if "shared" in params:
        y_th = y_th + shared_expert_mlp(x_th, params["shared"]["w_gate_up_gh"], params["shared"]["w_down_hs"], plan)
    y_th = jnp.where(finite_t[:, None], y_th, jnp.nan)
    y_th = jnp.where(valid_t[:, None], y_th, 0)  # padding: routed nowhere, the shared expert's part too

    stat_logits_te = jnp.where(counted_t[:, None], logits_te, 0.0)
    sums = (router.load_statistics(router.expert_scores(stat_logits_te, config), ids_tk, counted_t,
                                   config.num_experts),
            router.z_loss_sum(stat_logits_te, counted_t))
    nonfinite = jnp.sum(valid_t & ~finite_t).astype(jnp.int32)
    if axis_names:
        # Every statistic is a sum over tokens until here, so one psum makes it the mesh's.
        sums, dropped, nonfinite, rows_sent = jax.lax.psum((sums, dropped, nonfinite, rows_sent), axis_names)
    (counts_e, prob_sum_e, num_counted), z_sum = sums
    stats = {
        "tokens_per_expert": counts_e,
        "load_balance_loss": router.load_balance_loss(counts_e, prob_sum_e, num_counted, config.top_k),
        "router_z_loss": router.router_z_loss(z_sum, num_counted),
        "dropped": dropped.astype(jnp.int32),
        "nonfinite_tokens": nonfinite,
        "rows_sent": rows_sent.astype(jnp.int32),
    }
    return y_th.astype(dtype), stats


def check_input(x, config: MoEConfig) -> None:
    """Raises ValueError unless ``x`` is a floating array ``[..., H]`` (at least one dimension)."""
    expected = f"H = config.hidden_size = {config.hidden_size}"
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"x: {type(x).__name__}, expected an array [..., H] with {expected}")
    if len(x.shape) == 0:
        raise ValueError(f"x: shape (), expected [..., H] with {expected}")
    if x.shape[-1] != config.hidden_size:
        raise ValueError(f"x: shape {tuple(x.shape)}, expected last dimension {expected}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x: dtype {x.dtype}, expected a floating dtype (bfloat16 or float32)")


def moe_forward(params: Params, x: jax.Array, plan: Plan | MoEConfig, *,
                num_valid_tokens=None) -> tuple[jax.Array, dict]:
    """The MoE layer: ``y = sum_k w_k * expert_k(x) + shared(x)``.

    Args:
      params: see the module docstring; :func:`init_params` makes them.
      x: ``[..., H]`` activations, any leading shape (flattened to tokens ``T``): ``[H]`` is
        one token, and ``T = 0`` gives an empty ``y``.
      plan: from :func:`moe_jax.resolve` (resolve once, before ``jit``; pass it as a static
        argument). A bare ``MoEConfig`` is resolved here for ``jax.devices()[0]``.
      num_valid_tokens: None (every token is real), or an int or int32 scalar (it may be
        traced): the flattened tokens at or past it are padding, as :mod:`moe_jax.serving`'s
        buckets make them. Padding routes nowhere, is left out of every statistic and gets
        zeros; the real tokens' outputs are those of the unpadded batch.

    Returns:
      ``(y, stats)``: ``y`` has ``x``'s shape in ``config.dtype``; ``stats`` holds
      ``tokens_per_expert`` int32 ``[E]`` (assignments per expert), ``load_balance_loss``
      float32 (Switch-Transformer auxiliary loss, 1.0 when balanced, 0.0 for no tokens),
      ``router_z_loss`` float32 (ST-MoE's ``mean_t logsumexp(logits_t)^2``, 0.0 for no
      tokens), ``dropped`` int32 (assignments dropped by a capacity; always 0 when dropless)
      ``rows_sent`` int32 (rows that crossed the expert axis in this call's dispatch, summed over
      the devices; what a row is depends on the exchange: :mod:`sharding.exchange`; 0 on one
      device) and ``nonfinite_tokens`` int32 (tokens with a non-finite value in ``x`` or in their
      router logits: they route nowhere and every computation reads them as zeros, so one bad
      token changes no other token's output, no statistic and no gradient; their own outputs
      are NaN). Both losses are
      differentiable with respect to the router weights (``tokens_per_expert`` is constant
      in them). On a mesh the statistics cover every device's tokens: additive sums, psum'd.

    Raises:
      ValueError: ``x`` or ``params`` of the wrong shape or dtype (naming which).
    """
    if isinstance(plan, MoEConfig):
        plan = resolve(plan)
    config = plan.config
    check_input(x, config)
    check_params(params, config)
    real = x.size // config.hidden_size if num_valid_tokens is None else _check_num_valid(num_valid_tokens)
    mesh = plan.mesh
    if isinstance(mesh, Mesh) and mesh.size > 1:
        return _sharded_forward(params, x, plan, mesh, real)
    x_th = x.reshape(-1, config.hidden_size)
    num_tokens = x_th.shape[0]
    # An empty batch runs as one padding token (routed nowhere, never counted), so that no
    # kernel is compiled for zero rows.
    padded = max(num_tokens, 1)
    x_th = jnp.pad(x_th, ((0, padded - num_tokens), (0, 0)))
    y_th, stats = _local_forward(params, x_th, jnp.arange(padded) < jnp.minimum(num_tokens, real), plan, ())
    return y_th[:num_tokens].reshape(x.shape), stats


def _check_num_valid(num_valid_tokens):
    if isinstance(num_valid_tokens, bool) or not (
            isinstance(num_valid_tokens, int) or (hasattr(num_valid_tokens, "dtype") and jnp.ndim(num_valid_tokens) == 0
                                                  and jnp.issubdtype(num_valid_tokens.dtype, jnp.integer))):
        found = (f"{num_valid_tokens.dtype}{list(jnp.shape(num_valid_tokens))}" if hasattr(num_valid_tokens, "dtype")
                 else repr(num_valid_tokens))
        raise ValueError(f"num_valid_tokens: {found}, expected None, an int or an integer scalar")
    if isinstance(num_valid_tokens, int) and num_valid_tokens < 0:
        raise ValueError(f"num_valid_tokens: {num_valid_tokens}, expected >= 0")
    return num_valid_tokens


def param_logical_axes(params: Params) -> dict:
    """The logical axes of every parameter (see :mod:`sharding.mesh`), in ``params``' layout.

    One annotation per parameter, covering every array of an NVFP4 tensor. The stacked
    gate/up rows get no logical axis: a contiguous split of ``[gate | up]`` would not be a
    tensor-parallel split of the intermediate dimension.
    """
    experts = {"w_gate_up_egh": (EXPERTS, None, HIDDEN), "w_down_ehf": (EXPERTS, HIDDEN, EXPERT_INTERMEDIATE)}
    shared = {"w_gate_up_gh": (None, HIDDEN), "w_down_hs": (HIDDEN, None)}
    # The routed experts' activation scales travel with their experts; the shared ones are scalars.
    input_scales = {"gate_e": (EXPERTS,), "up_e": (EXPERTS,), "down_e": (EXPERTS,),
                    "shared_gate": (), "shared_up": (), "shared_down": ()}
    table = {"router": {"w_eh": (None, HIDDEN), "bias_e": (None,)}, "experts": experts, "shared": shared,
             "input_scales": input_scales}
    return {group: {name: table[group][name] for name in leaves} for group, leaves in params.items()}


def _layer_rules(plan: Plan, mesh: Mesh | AbstractMesh) -> dict:
    """Experts over the expert axis; tokens over every mesh axis (the expert axis doubles as
    a data axis); no tensor parallelism (the layer does not split the intermediate)."""
    return expert_parallel_rules(mesh, expert_axis=plan.config.expert_axis)


def mesh_param_specs(params: Params, mesh: Mesh | AbstractMesh, expert_axis: str) -> dict:
    """The ``PartitionSpec`` of every array of ``params`` (arrays or ``ShapeDtypeStruct``s) on
    ``mesh``, experts split over ``expert_axis``: the one place the parameters' axes become
    specs (:func:`param_specs`, the layer's ``shard_map``, sharded checkpoint loading)."""
    return tree_specs(params, param_logical_axes(params), expert_parallel_rules(mesh, expert_axis=expert_axis), mesh)


def _plan_mesh(plan: Plan) -> Mesh:
    if not isinstance(plan, Plan) or not isinstance(plan.mesh, Mesh):
        found = type(plan).__name__ if not isinstance(plan, Plan) else f"a plan with mesh {plan.mesh!r}"
        raise ValueError(f"plan: {found}, expected a Plan resolved for a jax.sharding.Mesh "
                         "(moe_jax.resolve(config, mesh))")
    return plan.mesh


def param_specs(params: Params, plan: Plan) -> dict:
    """The ``PartitionSpec`` of every parameter array under ``plan``'s mesh (a ``Mesh`` or an
    ``AbstractMesh``), in ``params``' layout: what :func:`shard_params` places, and what
    :class:`moe_jax.MoE` records as each variable's sharding metadata.

    Raises:
      ValueError: ``plan`` has no mesh, or an expert count the expert axis does not divide.
    """
    if not isinstance(plan, Plan) or not isinstance(plan.mesh, (Mesh, AbstractMesh)):
        found = type(plan).__name__ if not isinstance(plan, Plan) else f"a plan with mesh {plan.mesh!r}"
        raise ValueError(f"plan: {found}, expected a Plan resolved for a mesh (moe_jax.resolve(config, mesh))")
    return mesh_param_specs(params, plan.mesh, plan.config.expert_axis)


def param_shardings(params: Params, plan: Plan) -> dict:
    """The ``NamedSharding`` of every parameter array under ``plan``'s mesh (for ``jax.jit``'s
    ``in_shardings``, or ``jax.device_put``)."""
    mesh = _plan_mesh(plan)
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), param_specs(params, plan))


def shard_params(params: Params, plan: Plan) -> Params:
    """Places ``params`` on ``plan``'s mesh as the layer reads them: expert weights split over
    the expert axis (each device holds ``1 / expert_parallel`` of them), the rest replicated.

    Raises:
      ValueError: ``plan`` has no ``Mesh``, an expert count the expert axis does not divide,
        or a parameter that did not land with its declared sharding.
    """
    check_params(params, plan.config)
    mesh = _plan_mesh(plan)
    return shard_tree(params, param_logical_axes(params), _layer_rules(plan, mesh), mesh)


def _explicit(mesh: Mesh) -> bool:
    """Whether ``mesh``'s shardings are part of the types (all axes Explicit) rather than left
    to the compiler (all Auto); a mix is an error."""
    types = set(mesh.axis_types)
    if types == {AxisType.Auto}:
        return False
    if types == {AxisType.Explicit}:
        return True
    raise ValueError(f"plan.mesh: axis types {mesh.axis_types}, expected all Auto or all Explicit")


def _to_specs(mesh: Mesh, tree, specs):
    """Reshards ``tree`` to ``specs`` where the mesh's sharding is explicit in types;
    ``shard_map`` reshards inputs itself over ``Auto`` axes."""
    if not _explicit(mesh):
        return tree
    return jax.tree.map(lambda leaf, spec: jax.reshard(leaf, NamedSharding(mesh, spec)), tree, specs)


def _reshape(a, shape: tuple[int, ...], mesh: Mesh, spec: P):
    """``a.reshape(shape)``, typed ``spec`` on an Explicit mesh.

    JAX infers a reshape's output sharding only when the sharded dimension stays whole or is
    the first one merged or split (and divides); anything else, such as tokens split over 8
    devices unflattened to ``(4, 16, H)``, is a ``ShardingTypeError`` unless the output
    sharding is given.
    """
    if not _explicit(mesh):
        return a.reshape(shape)
    return jax.lax.reshape(a, shape, out_sharding=NamedSharding(mesh, spec))


def _check_vma(plan: Plan) -> bool:
    """Whether the layer's ``shard_map`` types values by the mesh axes they vary over: always,
    except for the Pallas kernels run in the Pallas interpreter.

    JAX 0.11.2's interpreter evaluates a kernel body with varying operands sliced by invariant
    grid indices, which that typing rejects ("dynamic_slice requires varying manual axes to
    match"). A JAX limitation, not a bug of the layer: the interpreter is for tests. Without the
    typing, ``shard_map`` sums the cotangents of inputs along the mesh axes they do not vary over
    at its boundary, so gradients stay right (``tests/test_gradients_pallas.py`` compares them);
    with it, the kernels' VJP sums weight gradients itself
    (:func:`pallas_kernels.grouped_matmul.expert_mlp`). Never switched off for anything else.
    """
    return not (plan.expert_gemm == "pallas" and plan.config.interpret)


def _sharded_forward(params: Params, x, plan: Plan, mesh: Mesh, num_valid):
    """The layer under ``shard_map``: tokens split over every mesh axis (padded to a multiple
    of the device count, at least one per device; padding tokens route nowhere), expert
    weights over the expert axis (:func:`param_logical_axes`), everything else replicated;
    the exchange moves rows between the devices of the expert axis.

    ``x`` ``[..., H]`` may come with any sharding; ``y`` has its shape. On an Explicit mesh
    ``y`` is split along its first dimension over the token axes when the device count
    divides that dimension (tokens stay where the layer computed them), else replicated.
    """
    config = plan.config
    axes = tuple(mesh.axis_names)
    rules = _layer_rules(plan, mesh)
    h = config.hidden_size
    # Flattening keeps a split of the first dimension (and of H); a split of any later
    # leading dimension cannot survive it, so those tokens are gathered first.
    x_spec = tuple(jax.typeof(x).sharding.spec) + (None,) * x.ndim
    first = x_spec[0] if x.ndim > 1 and not any(x_spec[1:x.ndim - 1]) else None
    x_th = _reshape(x, (math.prod(x.shape[:-1]), h), mesh, P(first, x_spec[x.ndim - 1]))
    num_tokens = x_th.shape[0]
    # An empty batch runs as one padding token per device, so that no exchange buffer is empty.
    padded = max(1, -(-num_tokens // mesh.size)) * mesh.size
    valid_t = jnp.arange(padded) < jnp.minimum(num_tokens, num_valid)
    x_th = jnp.pad(x_th, ((0, padded - num_tokens), (0, 0)))
    token_spec = logical_to_spec((TOKENS,), (padded,), rules, mesh, name="x")
    specs = mesh_param_specs(params, mesh, plan.config.expert_axis)
    params, x_th, valid_t = _to_specs(mesh, (params, x_th, valid_t), (specs, token_spec, token_spec))
    body = functools.partial(_local_forward, plan=plan, axis_names=axes)
    y_th, stats = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(specs, token_spec, token_spec),
        out_specs=(token_spec, P()),
        check_vma=_check_vma(plan),
    )(params, x_th, valid_t)
    split = padded == num_tokens and x.ndim > 1 and x.shape[0] % mesh.size == 0
    if padded != num_tokens:
        # Under explicit sharding an uneven token count cannot stay split: replicate, then trim.
        y_th = _to_specs(mesh, y_th, P())[:num_tokens]
    y_spec = P(token_spec[0] if split else None, *(None,) * (x.ndim - 1))
    return _reshape(y_th, x.shape, mesh, y_spec), stats


def reference_forward(params: Params, x: np.ndarray, config: MoEConfig) -> np.ndarray:
    """The layer in float64 numpy, expert by expert: the oracle for tests, the demo and examples.

    NVFP4 weights are dequantized exactly (float64); nothing else is rounded. Only the experts
    the tokens of ``x`` route to are read, one at a time, so a sample of tokens can be checked
    against a full-size layer whose parameters live on devices (Kimi K2's experts would be
    45 GB in float64). Routing is per token, so a sample routes as it does in the whole batch.

    Args:
      params: :func:`init_params`' layout; host or device arrays.
      x: ``[..., H]`` tokens.
      config: the layer.

    Returns:
      float64 ``y`` of ``x``'s shape.
    """
    def dense(w):
        if isinstance(w, nvfp4.NVFP4Tensor):
            return gmm_reference.dequantize(w.packed[None], w.scales[None], w.global_scale[None])[0]
        return np.asarray(w).astype(np.float64)

    def entry(a, e: int) -> np.ndarray:
        """``a[e]`` on the host, copied from the device shard that holds it (only that expert)."""
        if not isinstance(a, jax.Array):
            return np.asarray(a[e])
        for shard in a.addressable_shards:
            rows = range(a.shape[0])[shard.index[0]]
            if e in rows:
                return np.asarray(shard.data[e - rows.start])
        raise ValueError(f"params: expert {e} is on no device of this process")

    def expert(w, e: int):
        if isinstance(w, nvfp4.NVFP4Tensor):
            return nvfp4.NVFP4Tensor(packed=entry(w.packed, e), scales=entry(w.scales, e),
                                     global_scale=entry(w.global_scale, e))
        return entry(w, e)

    def silu(v):
        return v / (1 + np.exp(-v))

    x_th = np.asarray(x, np.float64).reshape(-1, config.hidden_size)
    logits_te = x_th @ dense(params["router"]["w_eh"]).T
    bias = params["router"].get("bias_e")
    ids_tk, weights_tk = router.route(
        jnp.asarray(logits_te, jnp.float32), config,
        correction_bias_e=None if bias is None else jnp.asarray(bias),
    )
    ids_tk, weights_tk = np.asarray(ids_tk), np.asarray(weights_tk, np.float64)
    experts, f = params["experts"], config.expert_intermediate_size
    y_th = np.zeros_like(x_th)
    for e in np.unique(ids_tk).tolist():
        t, slot = np.nonzero(ids_tk == e)
        h = x_th[t] @ dense(expert(experts["w_gate_up_egh"], e)).T
        a = silu(h[:, :f]) * h[:, f:]
        np.add.at(y_th, t, weights_tk[t, slot, None] * (a @ dense(expert(experts["w_down_ehf"], e)).T))
    if "shared" in params:
        s = config.shared_size
        h_ts = x_th @ dense(params["shared"]["w_gate_up_gh"]).T
        y_th += (silu(h_ts[:, :s]) * h_ts[:, s:]) @ dense(params["shared"]["w_down_hs"]).T
    return y_th.reshape(np.shape(x))
