"""What the layer tests share: inputs, meshes, comparisons, and the parametrization over the
registries (``moe_jax.EXPERT_GEMM`` x ``moe_jax.EXCHANGE`` x ``moe_jax.WeightFormat``).

Tests import it as ``from harness import ...`` (pytest puts ``tests/`` on ``sys.path``, as for
``synthetic_checkpoint``). A test that runs "for each implementation" takes its names from here,
never from a list of its own, so that a newly registered exchange or expert GEMM is tested (or
skipped with its own reason) without editing the tests; ``tests/test_structure.py`` checks that.

A combination that cannot run on this machine skips with the implementation's own reason
(``plan_or_skip``: the ResolutionError of :func:`moe_jax.resolve`); an expert GEMM whose kernels
need a GPU runs in the Pallas interpreter (``MoEConfig.interpret=True``) where that lets it run.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_jax
import sharding
from moe_jax import MoEConfig, ResolutionError, init_params, moe_forward, nvfp4, quantize_params, resolve
from moe_jax.plan import Plan
from moe_jax.registry import Target
from moe_jax.resolve import target_for

EXPERT_GEMMS: tuple[str, ...] = moe_jax.EXPERT_GEMM.names()
EXCHANGES: tuple[str, ...] = moe_jax.EXCHANGE.names()
WEIGHT_FORMATS: tuple[str, ...] = tuple(moe_jax.WeightFormat)

#: A small config for asking implementations where they run (exchanges do not look at its shape).
PROBE_CONFIG = MoEConfig(num_experts=8, top_k=2, hidden_size=128, expert_intermediate_size=64)
# Which exchanges move tokens between devices and which keep every expert on one: asked of
# each exchange's own cannot_run, for a GPU with an expert axis of 2 and for one device.
_GPU = dict(platform="cuda", device_kind="NVIDIA H200", compute_capability=90)
#: Exchanges that run under an expert-parallel mesh (on some machine).
EP_EXCHANGES: tuple[str, ...] = tuple(
    n for n in EXCHANGES
    if moe_jax.EXCHANGE[n].cannot_run(Target(**_GPU, num_devices=2, expert_parallel=2), PROBE_CONFIG) is None)
#: Exchanges that run without a mesh (every expert on one device).
LOCAL_EXCHANGES: tuple[str, ...] = tuple(
    n for n in EXCHANGES if moe_jax.EXCHANGE[n].cannot_run(Target(**_GPU), PROBE_CONFIG) is None)

#: Every (expert_gemm, exchange, weight_format) the cross-product tests are generated for.
COMBINATIONS: tuple[tuple[str, str, str], ...] = tuple(itertools.product(EXPERT_GEMMS, EXCHANGES, WEIGHT_FORMATS))

#: The layer jitted once for every test: a plan is a static, hashable argument, so tests that
#: run the same config on the same devices share one compilation.
FORWARD = jax.jit(moe_forward, static_argnums=2)


def combinations(*, expert_gemms=EXPERT_GEMMS, exchanges=EXCHANGES, weight_formats=WEIGHT_FORMATS) -> list:
    """``pytest.param(expert_gemm, exchange, weight_format)`` for each combination, with ids
    ``gemm-exchange-format``; each argument narrows one axis (default: every registered name)."""
    return [pytest.param(g, e, f, id=f"{g}-{e}-{f}") for g, e, f in COMBINATIONS
            if g in expert_gemms and e in exchanges and f in weight_formats]


def names(registered: tuple[str, ...]) -> list:
    """``pytest.param(name, id=name)`` for each name (e.g. of :data:`EP_EXCHANGES`)."""
    return [pytest.param(n, id=n) for n in registered]


def exchanges_that_run(devices_or_mesh, config: MoEConfig) -> tuple[str, ...]:
    """The registered exchanges whose own ``cannot_run`` lets them run on ``devices_or_mesh``."""
    target = target_for(devices_or_mesh, config)
    return tuple(n for n in EXCHANGES if moe_jax.EXCHANGE[n].cannot_run(target, config) is None)


def runnable_config(config: MoEConfig, devices_or_mesh, *, training: bool = False) -> MoEConfig:
    """``config`` with ``interpret=True`` where its expert GEMM cannot run here natively but can
    in the Pallas interpreter (``pallas`` on a CPU); otherwise ``config`` itself."""
    if config.expert_gemm == "auto" or config.interpret:
        return config
    impl = moe_jax.EXPERT_GEMM[config.expert_gemm]
    target = target_for(devices_or_mesh, config, training=training)
    interpreted = dataclasses.replace(config, interpret=True)
    if impl.cannot_run(target, config) is not None and impl.cannot_run(target, interpreted) is None:
        return interpreted
    return config


def plan_or_skip(config: MoEConfig, devices_or_mesh, *, training: bool = False) -> Plan:
    """The plan for :func:`runnable_config`'s config; skips the test with the implementation's
    own reason (resolution's message) where it cannot run here."""
    config = runnable_config(config, devices_or_mesh, training=training)
    try:
        return resolve(config, devices_or_mesh, training=training)
    except ResolutionError as err:
        pytest.skip(str(err))


def xla_flags_without(*prefixes: str) -> list[str]:
    """This process's ``XLA_FLAGS`` but those starting with any of ``prefixes``."""
    return [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(prefixes)]


def xla_flags(device_count: int) -> str:
    """This process's ``XLA_FLAGS`` (``tests/conftest.py``'s code generation too) with
    ``device_count`` virtual CPU devices instead of its 8, for a subprocess's environment."""
    flags = xla_flags_without("--xla_force_host_platform_device_count")
    return " ".join([*flags, f"--xla_force_host_platform_device_count={device_count}"])


def mesh_for(expert_parallel: int, devices, data_parallel: int | None = None):
    """An (expert x data) mesh over the first ``expert_parallel * data_parallel`` devices;
    ``data_parallel`` None: all of ``devices``."""
    if data_parallel is None:
        data_parallel = len(devices) // expert_parallel
    return sharding.make_mesh(expert_parallel, data_parallel=data_parallel,
                              devices=devices[: expert_parallel * data_parallel])


def devices_for(exchange: str, devices, expert_parallel: int = 2):
    """Where ``exchange`` runs in the cross-product tests: one device for an exchange that keeps
    every expert local, else a mesh with an expert axis of ``expert_parallel`` (skips where
    ``devices`` are too few)."""
    if exchange in LOCAL_EXCHANGES:
        return devices[:1]
    if len(devices) < expert_parallel:
        pytest.skip(f"exchange {exchange!r} needs {expert_parallel} devices, found {len(devices)}")
    return mesh_for(expert_parallel, devices, 1)


def swap_exchange(plan: Plan, exchange: str) -> Plan:
    """``plan`` with its exchange decision replaced by ``exchange``, for tracing or lowering an
    exchange this machine cannot run (resolution never picks it here)."""
    decisions = tuple(dataclasses.replace(d, chosen=exchange) if d.stage == "exchange" else d for d in plan.decisions)
    return dataclasses.replace(plan, decisions=decisions)


def random_params(config: MoEConfig, rng, *, own_scales: bool = False):
    """Random parameters in ``config``'s formats, with a random correction bias where the router
    has one. ``own_scales``: NVFP4 gate and up quantized separately, up 3-10x larger, so each
    expert's fused gate/up weight keeps two global scales (``[E, 2]``), as such a checkpoint loads."""
    params = init_params(dataclasses.replace(config, weight_format="bf16", qat=False, shared_weight_format=None,
                                             reference_activations="bf16", prefill_activations="bf16"),
                         jax.random.key(int(rng.integers(1 << 30))))
    if config.router_bias:
        params["router"]["bias_e"] = jnp.asarray(rng.standard_normal(config.num_experts) * 0.3, jnp.float32)
    params = quantize_params(params, config)
    if own_scales:
        w_gate_up_egh = params["experts"]["w_gate_up_egh"]
        gate, up = jnp.split(nvfp4.dequantize(w_gate_up_egh), 2, axis=1)
        up = up * jnp.asarray(rng.uniform(3, 10, (config.num_experts, 1, 1)), jnp.float32)
        params["experts"]["w_gate_up_egh"] = nvfp4.concat_rows(nvfp4.quantize(gate), nvfp4.quantize(up))
        assert params["experts"]["w_gate_up_egh"].global_scale.shape == (config.num_experts, 2)
    return params


def random_tokens(rng, shape, dtype=jnp.bfloat16):
    """Standard normal tokens ``[..., H]``."""
    return jnp.asarray(rng.standard_normal(shape), dtype)


def make(config: MoEConfig, rng, tokens: int = 24, *, own_scales: bool = False):
    """``(params, x_th)``: :func:`random_params` and ``tokens`` random bf16 tokens ``[T, H]``."""
    return random_params(config, rng, own_scales=own_scales), random_tokens(rng, (tokens, config.hidden_size))


def float_scatters(hlo: str) -> list[tuple[int, ...]]:
    """The result shapes of the scatters of floating-point values in HLO text
    (``Lowered.as_text(dialect="hlo")``)."""
    return [tuple(int(d) for d in dims.split(",") if d)
            for dims in re.findall(r"= (?:f16|bf16|f32|f64)\[([0-9,]*)\]\S* scatter\(", hlo)]


def dot_operands(stablehlo: str) -> list[tuple[tuple[tuple[int, ...], str], ...]]:
    """Each ``dot_general``'s operands as ``((shape, dtype), (shape, dtype))`` in StableHLO text
    (``Lowered.as_text()``), e.g. ``(((8, 16), "f32"), ((16, 32), "bf16"))``."""
    def operand(t):
        *dims, dtype = t.split("x")
        return tuple(int(d) for d in dims), dtype
    return [tuple(operand(t) for t in re.findall(r"tensor<([^>]*)>", types))
            for types in re.findall(r"stablehlo\.dot_general .*: \(([^)]*)\) ->", stablehlo)]


def rel_err(y, ref, axis=None):
    """Relative (Frobenius) error of ``y`` against the float64 ``ref``, overall or along ``axis``."""
    y = np.asarray(y, np.float64)
    return np.linalg.norm(y - ref, axis=axis) / np.linalg.norm(ref, axis=axis)


def assert_same_output(y, y_ref):
    """Equal up to a couple of bf16 ulps (2^-8 relative each) of each token's largest element:
    the same rows computed with the same roundings, where only XLA's blocking of float32 sums may
    differ with the number of rows (``tests/test_expert_parallel.py`` explains)."""
    y, y_ref = np.asarray(y, np.float32), np.asarray(y_ref, np.float32)
    assert y.shape == y_ref.shape
    scale = np.abs(y_ref).max(axis=-1, keepdims=True)
    np.testing.assert_array_less(np.abs(y - y_ref), np.broadcast_to(2 * 2.0**-8 * scale, y.shape))


def assert_same_stats(stats, stats_ref):
    """Counts exactly equal, the load-balance loss to float32 rounding."""
    np.testing.assert_array_equal(stats["tokens_per_expert"], stats_ref["tokens_per_expert"])
    assert int(stats["dropped"]) == int(stats_ref["dropped"])
    assert int(stats["nonfinite_tokens"]) == int(stats_ref["nonfinite_tokens"])
    np.testing.assert_allclose(stats["load_balance_loss"], stats_ref["load_balance_loss"], rtol=1e-5)


#: The layer's tolerance against float64 where activations are quantized too (W4A4: NVFP4 rows,
#: one global scale per row), as measured for that rounding (``MoEConfig.activation_scale``).
W4A4_TOLERANCE = 0.15


def tolerance_for(plan: Plan) -> float:
    """Relative (Frobenius) error allowed against the float64 reference: bf16 rounding of the
    SwiGLU output and of y (about 2^-8 each), or W4A4's where the plan quantizes activations."""
    return W4A4_TOLERANCE if plan.activations.startswith("NVFP4") else 1e-2


def check_against_reference(config: MoEConfig, devices_or_mesh, rng, tokens: int = 40, *, own_scales: bool = False,
                            tolerance: float = 1e-2, plan: Plan | None = None) -> Plan:
    """The layer against the float64 reference (``moe_jax.reference_forward``) on fresh random
    inputs: the compiled program runs only the chosen expert GEMM, the output is finite and within
    ``tolerance`` (relative, Frobenius), and a non-finite token changes no other token.

    ``plan``: resolved already (:func:`plan_or_skip`); else ``resolve(config, devices_or_mesh)``,
    which raises where the choice cannot run. Returns the plan.
    """
    plan = plan or resolve(config, devices_or_mesh)
    config = plan.config
    params, x = make(config, rng, tokens, own_scales=own_scales)
    # The program checked is the program run (a jit call after lower() can trace it again).
    forward = FORWARD.lower(params, x, plan).compile()
    assert set(re.findall(r"moe_jax\.expert_gemm\.[a-z_]+", forward.as_text())) == {
        f"moe_jax.expert_gemm.{plan.expert_gemm}"}
    y, _ = forward(params, x)
    y_nan, _ = forward(params, x.at[5].set(jnp.nan))
    ref = moe_jax.reference_forward(jax.device_get(params), np.asarray(x, np.float64), config)
    y64 = np.asarray(y, np.float64)
    assert np.isfinite(y64).all()
    assert rel_err(y64, ref) < tolerance
    keep = np.arange(tokens) != 5
    np.testing.assert_array_equal(np.asarray(y_nan)[keep], np.asarray(y)[keep])
    return plan
