"""``MoE``'s variables carry their ``PartitionSpec`` s as NNX metadata: exactly the specs
:func:`moe_jax.shard_params` places, and enough for orbax to restore a checkpoint onto another mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import sharding
from moe_jax import MoE, MoEConfig, resolve, shard_params
from moe_jax.layer import param_specs, param_template

E, H, F, S = 8, 64, 32, 32


def tiny(weight_format: str, shared: bool) -> MoEConfig:
    return MoEConfig(num_experts=E, top_k=2, hidden_size=H, expert_intermediate_size=F, weight_format=weight_format,
                     num_shared_experts=int(shared), shared_intermediate_size=S if shared else None,
                     router_bias=shared)


def random_params(config: MoEConfig, rng) -> dict:
    """Random parameters drawn on the host: random E2M1 codes, block scales in [0.5, 2], fan-in
    scaled normal weights. No quantizer or initializer runs on the devices (they would compile
    for seconds)."""

    def draw(s):
        if s.dtype == np.uint8:  # two E2M1 codes a byte: every byte is valid
            return rng.integers(0, 256, s.shape)
        if s.dtype == jnp.float8_e4m3fn:  # block scales
            return rng.uniform(0.5, 2.0, s.shape)
        if s.ndim < 2:  # global scales, the selection bias
            return rng.uniform(0.05, 0.2, s.shape)
        return rng.standard_normal(s.shape) / np.sqrt(s.shape[-1])

    return jax.tree.map(lambda s: jnp.asarray(draw(s).astype(s.dtype)), param_template(config))


def with_input_scales(params: dict, config: MoEConfig, rng) -> dict:
    """``params`` with an NVFP4 checkpoint's activation scales (the module's InputScale variables)."""
    routed, shared = ("gate_e", "up_e", "down_e"), ("shared_gate", "shared_up", "shared_down")
    scales = {name: jnp.asarray(rng.uniform(0.5, 2.0, E), jnp.float32) for name in routed}
    if config.num_shared_experts:
        scales |= {name: jnp.asarray(rng.uniform(0.5, 2.0), jnp.float32) for name in shared}
    return {**params, "input_scales": scales}


def metadata_specs(layer: MoE) -> dict:
    """``nnx.get_partition_spec`` of the layer's state, in :func:`moe_jax.init_params`' layout."""
    specs = nnx.get_partition_spec(nnx.state(layer))
    return nnx.merge(nnx.graphdef(layer), specs).params()


def assert_same_specs(found, expected):
    assert jax.tree.structure(found) == jax.tree.structure(expected)
    for (path, f), e in zip(jax.tree_util.tree_leaves_with_path(found), jax.tree.leaves(expected), strict=True):
        assert isinstance(f, P) and f == e, f"{jax.tree_util.keystr(path)}: {f}, expected {e}"


@pytest.mark.parametrize("shared", [False, True], ids=["routed", "shared_and_bias"])
@pytest.mark.parametrize("weight_format", ["bf16", "nvfp4"])
def test_the_metadata_specs_are_those_shard_params_places(weight_format, shared, rng, cpu_devices):
    config = tiny(weight_format, shared)
    mesh = sharding.make_mesh(4, data_parallel=2, devices=cpu_devices)  # expert axis of size 4
    params = random_params(config, rng)
    if weight_format == "nvfp4":
        params = with_input_scales(params, config, rng)
    placed = shard_params(params, resolve(config, mesh))
    layer = MoE(config, rngs=nnx.Rngs(0), mesh=mesh, params=params)

    specs = metadata_specs(layer)
    assert_same_specs(specs, jax.tree.map(lambda a: a.sharding.spec, placed))
    assert_same_specs(jax.tree.map(lambda a: a.sharding.spec, layer.params()), specs)  # and the arrays lie so
    assert all(spec[0] == "expert" for spec in jax.tree.leaves(specs["experts"]))  # not all replicated
    # An abstract mesh of the same shape (deviceless compilation) records the same specs.
    abstract = MoE(config, rngs=nnx.Rngs(0), mesh=mesh.abstract_mesh, params=params)
    assert_same_specs(metadata_specs(abstract), specs)
    # Without a mesh the layer is on one device: no metadata, every array replicated.
    single = MoE(config, rngs=nnx.Rngs(0), params=params)
    assert all(s == P() for s in jax.tree.leaves(metadata_specs(single)))
    with pytest.raises(ValueError, match=r"^plan: a plan with mesh None, expected a Plan resolved for a mesh"):
        param_specs(params, single.plan)


def restore(path, config, mesh) -> MoE:
    """The layer saved at ``path``, restored onto ``mesh``: the README's recipe. The abstract
    layer's variables carry their specs for ``mesh``, and orbax places each array by them."""
    graphdef, abstract = nnx.get_abstract_model(lambda: MoE(config, rngs=nnx.Rngs(0), mesh=mesh), mesh)
    with ocp.StandardCheckpointer() as checkpointer:
        return nnx.merge(graphdef, checkpointer.restore(path, abstract))


def test_an_orbax_checkpoint_restores_onto_another_mesh(rng, cpu_devices, tmp_path):
    configs = {fmt: tiny(fmt, shared=True) for fmt in ("bf16", "nvfp4")}
    saved_mesh = sharding.make_mesh(8, devices=cpu_devices)
    new_mesh = sharding.make_mesh(4, data_parallel=2, devices=cpu_devices)
    layers, restored = {}, {}
    for fmt, config in configs.items():
        layers[fmt] = MoE(config, rngs=nnx.Rngs(0), mesh=saved_mesh, params=random_params(config, rng))
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(tmp_path / fmt, nnx.state(layers[fmt]))
        restored[fmt] = restore(tmp_path / fmt, config, new_mesh)
        assert restored[fmt].plan.target.expert_parallel == 4

        # Every array bit for bit, each placed as shard_params places it on the new mesh.
        saved, found = layers[fmt].params(), restored[fmt].params()
        expected = jax.tree.map(lambda a: a.sharding, shard_params(saved, resolve(config, new_mesh)))
        assert jax.tree.structure(found) == jax.tree.structure(saved)
        for (path, a), b, sharding_ in zip(jax.tree_util.tree_leaves_with_path(found), jax.tree.leaves(saved),
                                           jax.tree.leaves(expected), strict=True):
            where = f"{fmt}{jax.tree_util.keystr(path)}"
            assert a.dtype == b.dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes(), where
            assert a.sharding == sharding_ and a.sharding.mesh == new_mesh, f"{where}: {a.sharding}"
        assert_same_specs(metadata_specs(restored[fmt]), jax.tree.map(lambda s: s.spec, expected))

    # The restored layer computes what the saved one did (NVFP4, the layout with the most arrays;
    # each format's forward costs two compilations). Routing is identical. The outputs agree to
    # within one bf16 ulp at their largest magnitude, not bit for bit: the expert stage's GEMMs
    # have other shapes on the new mesh (two experts a device, not one), XLA:CPU's dot may then
    # sum a float32 product in another order, and a last-bit change can flip the bf16 rounding of
    # the activation between the two projections (seen: a few elements in a thousand, <= 2**-9 of
    # the largest output).
    x = jnp.asarray(rng.standard_normal((16, H)), jnp.bfloat16)
    forward = nnx.jit(lambda m, x: m(x))
    (y, stats), (y_restored, stats_restored) = forward(layers["nvfp4"], x), forward(restored["nvfp4"], x)
    np.testing.assert_array_equal(stats_restored["tokens_per_expert"], stats["tokens_per_expert"])
    y, y_restored = np.asarray(y, np.float32), np.asarray(y_restored, np.float32)
    assert np.abs(y_restored - y).max() <= 2**-7 * np.abs(y).max()
