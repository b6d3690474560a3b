"""The MoE layer as a pure function: parameters, validation and the forward pass.

Dimension letters: ``t`` tokens, ``h`` hidden, ``e`` experts, ``k`` top-k slots,
``f`` expert intermediate, ``g = 2f`` (gate and up stacked), ``s`` shared intermediate.

Parameters (a nested dict, a pytree)::

    {"router":  {"w_eh": f32 [E, H], "bias_e": f32 [E]  (only with config.router_bias)},
     "experts": {"w_gate_up_egh": [E, 2F, H], "w_down_ehf": [E, H, F]},
     "shared":  {"w_gate_up_gh": [2S, H], "w_down_hs": [H, S]}  (only with shared experts)}

Projection weights are (out, in) as checkpoints store them, gate rows before up rows, each a
bf16 array or an :class:`~moe_jax.nvfp4.NVFP4Tensor` per ``config.weight_format``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moe_jax import nvfp4, router
from moe_jax.config import MoEConfig
from moe_jax.exchange import EXCHANGE
from moe_jax.experts import EXPERT_GEMM, dense_weight, swiglu
from moe_jax.plan import Plan
from moe_jax.resolve import resolve
from sharding.mesh import (
    EXPERT_INTERMEDIATE, EXPERTS, HIDDEN, TOKENS, expert_parallel_rules, logical_to_spec, shard_tree, tree_specs,
)

Params = dict


def param_shapes(config: MoEConfig) -> dict:
    """The logical shape of every parameter, in the layout of :func:`init_params`."""
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
    """Random parameters (fan-in scaled normal), projections in ``config.weight_format``."""
    shapes = param_shapes(config)
    keys = iter(jax.random.split(key, 8))

    def projection(shape):
        w = jax.random.normal(next(keys), shape, jnp.float32) / math.sqrt(shape[-1])
        match config.weight_format:
            case "bf16":
                return w.astype(jnp.bfloat16)
            case "nvfp4":
                return nvfp4.quantize(w)

    params = {
        "router": {"w_eh": jax.random.normal(next(keys), shapes["router"]["w_eh"]) / math.sqrt(config.hidden_size)},
        "experts": {name: projection(shape) for name, shape in shapes["experts"].items()},
    }
    if config.router_bias:
        # Zero, as DeepSeek-V3 starts it: training moves it to balance the load.
        params["router"]["bias_e"] = jnp.zeros((config.num_experts,), jnp.float32)
    if "shared" in shapes:
        params["shared"] = {name: projection(shape) for name, shape in shapes["shared"].items()}
    return params


def quantize_params(params: Params) -> Params:
    """The same parameters with every routed and shared projection quantized to NVFP4."""
    out = {group: dict(leaves) for group, leaves in params.items()}
    for group in ("experts", "shared"):
        for name, w in params.get(group, {}).items():
            out[group][name] = nvfp4.quantize(w, name=f"params[{group!r}][{name!r}]")
    return out


def check_params(params: Params, config: MoEConfig) -> None:
    """Raises ValueError naming the first parameter whose presence, shape or dtype is wrong."""
    expected = param_shapes(config)
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
            quantized = group != "router" and config.weight_format == "nvfp4"
            if quantized:
                if not isinstance(w, nvfp4.NVFP4Tensor):
                    found = f"a {w.dtype} array" if hasattr(w, "dtype") else type(w).__name__
                    raise ValueError(f"{where}: {found}, expected an NVFP4Tensor (weight_format='nvfp4')")
                w.validate(where)
            elif isinstance(w, nvfp4.NVFP4Tensor) or not jnp.issubdtype(w.dtype, jnp.floating):
                raise ValueError(f"{where}: {getattr(w, 'dtype', type(w).__name__)}, expected a float array")
            if tuple(w.shape) != shape:
                raise ValueError(f"{where}: shape {tuple(w.shape)}, expected {shape}")
    if "shared" in params and "shared" not in expected:
        raise ValueError("params['shared']: present, but config.num_shared_experts = 0")


def _dense_mlp(x_th, w_gate_up_gh, w_down_hs, dtype):
    h_tg = jnp.einsum("th,gh->tg", x_th, dense_weight(w_gate_up_gh, dtype), preferred_element_type=jnp.float32)
    a_ts = swiglu(h_tg).astype(dtype)
    return jnp.einsum("ts,hs->th", a_ts, dense_weight(w_down_hs, dtype), preferred_element_type=jnp.float32)


def _local_forward(params: Params, x_th, valid_t, plan: Plan, axis_names: tuple[str, ...]):
    """One device's share: route, exchange + experts, combine, shared expert, statistics.

    ``valid_t`` marks real tokens; padding tokens route nowhere (expert id E) and are
    excluded from the statistics.
    """
    config = plan.config
    dtype = jnp.dtype(config.dtype)
    # Full float32, as the published models' gates run: a GPU's default TF32 would round the
    # router weights to 10 mantissa bits and flip the choice between near-tied experts.
    logits_te = jnp.matmul(x_th.astype(jnp.float32), params["router"]["w_eh"].astype(jnp.float32).T,
                           precision=jax.lax.Precision.HIGHEST)
    ids_tk, weights_tk = router.route(logits_te, config, correction_bias_e=params["router"].get("bias_e"))
    ids_tk = jnp.where(valid_t[:, None], ids_tk, config.num_experts)

    expert_impl = EXPERT_GEMM[plan.expert_gemm]

    def expert_fn(x_mh, group_sizes_e):
        with jax.named_scope(plan.scope(EXPERT_GEMM.stage)):
            return expert_impl.run(x_mh, group_sizes_e, params["experts"], plan)

    with jax.named_scope(plan.scope(EXCHANGE.stage)):
        y_th, dropped = EXCHANGE[plan.exchange].run(
            x_th.astype(dtype), ids_tk, weights_tk, expert_fn,
            num_experts=config.num_experts, axis_name=config.expert_axis,
            capacity_factor=config.capacity_factor,
        )
    if "shared" in params:
        y_th = y_th + _dense_mlp(x_th.astype(dtype), params["shared"]["w_gate_up_gh"], params["shared"]["w_down_hs"], dtype)

    sums = router.load_statistics(router.expert_scores(logits_te, config), ids_tk, valid_t, config.num_experts)
    if axis_names:
        sums, dropped = jax.lax.psum((sums, dropped), axis_names)
    counts_e, prob_sum_e, num_valid = sums
    stats = {
        "tokens_per_expert": counts_e,
        "load_balance_loss": router.load_balance_loss(counts_e, prob_sum_e, num_valid, config.top_k),
        "dropped": dropped.astype(jnp.int32),
    }
    return y_th.astype(dtype), stats


def check_input(x, config: MoEConfig) -> None:
    if not hasattr(x, "shape") or x.ndim < 2:
        raise ValueError(f"x: shape {getattr(x, 'shape', type(x).__name__)}, expected [..., T, H] with H = {config.hidden_size}")
    if x.shape[-1] != config.hidden_size:
        raise ValueError(f"x: shape {x.shape}, expected last dimension H = config.hidden_size = {config.hidden_size}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x: dtype {x.dtype}, expected a floating dtype (bfloat16 or float32)")


def moe_forward(params: Params, x: jax.Array, plan: Plan | MoEConfig) -> tuple[jax.Array, dict]:
    """The MoE layer: ``y = sum_k w_k * expert_k(x) + shared(x)``.

    Args:
      params: see the module docstring; :func:`init_params` makes them.
      x: ``[..., H]`` activations (any leading shape, flattened to tokens ``T``).
      plan: from :func:`moe_jax.resolve` (resolve once, before ``jit``; pass it as a static
        argument). A bare ``MoEConfig`` is resolved here for ``jax.devices()[0]``.

    Returns:
      ``(y, stats)``: ``y`` has ``x``'s shape in ``config.dtype``; ``stats`` holds
      ``tokens_per_expert`` int32 ``[E]`` (assignments per expert), ``load_balance_loss``
      float32 (Switch-Transformer auxiliary loss, 1.0 when balanced) and ``dropped`` int32
      (assignments dropped by a capacity; always 0 when dropless).
    """
    if isinstance(plan, MoEConfig):
        plan = resolve(plan)
    config = plan.config
    check_input(x, config)
    check_params(params, config)
    lead = x.shape[:-1]
    x_th = x.reshape(-1, config.hidden_size)
    mesh = plan.mesh
    if not isinstance(mesh, Mesh) or mesh.size == 1:
        y_th, stats = _local_forward(params, x_th, jnp.ones(x_th.shape[0], bool), plan, ())
        return y_th.reshape(*lead, config.hidden_size), stats
    y_th, stats = _sharded_forward(params, x_th, plan, mesh)
    return y_th.reshape(*lead, config.hidden_size), stats


def param_logical_axes(params: Params) -> dict:
    """The logical axes of every parameter (see :mod:`sharding.mesh`), in ``params``' layout.

    One annotation per parameter, covering every array of an NVFP4 tensor. The stacked
    gate/up rows get no logical axis: a contiguous split of ``[gate | up]`` would not be a
    tensor-parallel split of the intermediate dimension.
    """
    experts = {"w_gate_up_egh": (EXPERTS, None, HIDDEN), "w_down_ehf": (EXPERTS, HIDDEN, EXPERT_INTERMEDIATE)}
    shared = {"w_gate_up_gh": (None, HIDDEN), "w_down_hs": (HIDDEN, None)}
    table = {"router": {"w_eh": (None, HIDDEN), "bias_e": (None,)}, "experts": experts, "shared": shared}
    return {group: {name: table[group][name] for name in leaves} for group, leaves in params.items()}


def _layer_rules(plan: Plan, mesh: Mesh) -> dict:
    """Experts over the expert axis; tokens over every mesh axis (the expert axis doubles as
    a data axis); no tensor parallelism (the layer does not split the intermediate)."""
    return expert_parallel_rules(mesh, expert_axis=plan.config.expert_axis)


def _plan_mesh(plan: Plan) -> Mesh:
    if not isinstance(plan, Plan) or not isinstance(plan.mesh, Mesh):
        found = type(plan).__name__ if not isinstance(plan, Plan) else f"a plan with mesh {plan.mesh!r}"
        raise ValueError(f"plan: {found}, expected a Plan resolved for a jax.sharding.Mesh (moe_jax.resolve(config, mesh))")
    return plan.mesh


def param_shardings(params: Params, plan: Plan) -> dict:
    """The ``NamedSharding`` of every parameter array under ``plan``'s mesh (for ``jax.jit``'s
    ``in_shardings``, or ``jax.device_put``)."""
    mesh = _plan_mesh(plan)
    specs = tree_specs(params, param_logical_axes(params), _layer_rules(plan, mesh), mesh)
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)


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


def _to_specs(mesh: Mesh, tree, specs):
    """Reshards ``tree`` to ``specs`` where the mesh's sharding is explicit in types;
    ``shard_map`` reshards inputs itself over ``Auto`` axes."""
    types = set(mesh.axis_types)
    if types == {AxisType.Auto}:
        return tree
    if types == {AxisType.Explicit}:
        return jax.tree.map(lambda leaf, spec: jax.reshard(leaf, NamedSharding(mesh, spec)), tree, specs)
    raise ValueError(f"plan.mesh: axis types {mesh.axis_types}, expected all Auto or all Explicit")


def _check_vma(plan: Plan) -> bool:
    """Whether the layer's ``shard_map`` types values by the mesh axes they vary over: always,
    except for the Pallas kernels run in the Pallas interpreter.

    JAX 0.11.2's interpreter evaluates a kernel body with varying operands sliced by invariant
    grid indices, which that typing rejects ("dynamic_slice requires varying manual axes to
    match"). A JAX limitation, not a bug of the layer: the interpreter is for tests, and the
    kernels have no VJP (differentiating raises, see :func:`moe_jax.experts.pallas_expert_mlp`),
    so the typing, which is what keeps gradients through the collectives right, protects
    nothing there. Never switched off for anything else.
    """
    return not (plan.expert_gemm == "pallas" and plan.config.interpret)


def _sharded_forward(params: Params, x_th, plan: Plan, mesh: Mesh):
    """The layer under ``shard_map``: tokens split over every mesh axis (padded to a multiple
    of the device count; padding tokens route nowhere), expert weights over the expert
    axis (:func:`param_logical_axes`), everything else replicated; the exchange moves rows
    between the devices of the expert axis."""
    config = plan.config
    axes = tuple(mesh.axis_names)
    rules = _layer_rules(plan, mesh)
    num_tokens = x_th.shape[0]
    padded = -(-num_tokens // mesh.size) * mesh.size
    valid_t = jnp.arange(padded) < num_tokens
    x_th = jnp.pad(x_th, ((0, padded - num_tokens), (0, 0)))
    token_spec = logical_to_spec((TOKENS,), (padded,), rules, mesh, name="x")
    param_specs = tree_specs(params, param_logical_axes(params), rules, mesh)
    params, x_th, valid_t = _to_specs(mesh, (params, x_th, valid_t), (param_specs, token_spec, token_spec))
    body = functools.partial(_local_forward, plan=plan, axis_names=axes)
    y_th, stats = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(param_specs, token_spec, token_spec),
        out_specs=(token_spec, P()),
        check_vma=_check_vma(plan),
    )(params, x_th, valid_t)
    if padded == num_tokens:
        return y_th, stats
    # Under explicit sharding an uneven token count cannot stay split: replicate, then trim.
    return _to_specs(mesh, y_th, P())[:num_tokens], stats


def reference_forward(params: Params, x: np.ndarray, config: MoEConfig) -> np.ndarray:
    """The layer in float64 numpy, expert by expert: the oracle for tests and the demo.

    Uses the exact (float64) dequantization of NVFP4 weights and rounds nothing else.
    """
    def dense(w):
        return np.asarray(nvfp4.dequantize(w) if isinstance(w, nvfp4.NVFP4Tensor) else w, np.float64)

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
    w_gu, w_dn = dense(params["experts"]["w_gate_up_egh"]), dense(params["experts"]["w_down_ehf"])
    f = config.expert_intermediate_size
    y_th = np.zeros_like(x_th)
    for e in range(config.num_experts):
        t, slot = np.nonzero(ids_tk == e)
        h = x_th[t] @ w_gu[e].T
        np.add.at(y_th, t, weights_tk[t, slot, None] * ((silu(h[:, :f]) * h[:, f:]) @ w_dn[e].T))
    if "shared" in params:
        s = config.shared_size
        h_ts = x_th @ dense(params["shared"]["w_gate_up_gh"]).T
        y_th += (silu(h_ts[:, :s]) * h_ts[:, s:]) @ dense(params["shared"]["w_down_hs"]).T
    return y_th.reshape(np.shape(x))
