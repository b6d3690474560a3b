"""Meshes and logical-axis rules: placement is exactly what the rules declare, or an error."""

import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import moe_jax
from sharding.mesh import (
    EXPERT_INTERMEDIATE,
    EXPERTS,
    HIDDEN,
    TOKENS,
    expert_parallel_rules,
    logical_to_spec,
    make_mesh,
    shard_tree,
    tree_specs,
)


def test_make_mesh_axes(cpu_devices):
    mesh = make_mesh(4, data_parallel=2, devices=cpu_devices)
    assert dict(mesh.shape) == {"data": 2, "expert": 4}
    mesh = make_mesh(2, data_parallel=2, tensor_parallel=2, devices=cpu_devices)
    assert tuple(mesh.axis_names) == ("data", "expert", "tensor")
    with pytest.raises(ValueError, match=r"devices: 8, expected .* = 4"):
        make_mesh(4, devices=cpu_devices)
    with pytest.raises(ValueError, match="expert_parallel: 0"):
        make_mesh(0, devices=cpu_devices)


def test_rules(cpu_devices):
    mesh = make_mesh(2, data_parallel=2, tensor_parallel=2, devices=cpu_devices)
    rules = expert_parallel_rules(mesh, tensor_axis="tensor")
    assert rules == {EXPERTS: "expert", EXPERT_INTERMEDIATE: "tensor", TOKENS: ("data", "expert"), HIDDEN: None}
    assert logical_to_spec((TOKENS, HIDDEN), (8, 3), rules, mesh) == P(("data", "expert"), None)
    assert logical_to_spec((EXPERTS, HIDDEN, EXPERT_INTERMEDIATE), (4, 3, 6), rules, mesh) == P("expert", None, "tensor")
    # A lower-rank array takes the leading entries.
    assert logical_to_spec((EXPERTS, HIDDEN, EXPERT_INTERMEDIATE), (4,), rules, mesh) == P("expert")
    with pytest.raises(ValueError, match="tensor_axis: 'model' is not an axis"):
        expert_parallel_rules(mesh, tensor_axis="model")


@pytest.mark.parametrize(
    "logical,shape,rules,message",
    [
        (("vocab",), (4,), {}, "logical axis 'vocab' .* has no rule"),
        ((EXPERTS,), (4,), {EXPERTS: "model"}, "rule 'experts' -> 'model'"),
        ((EXPERTS, TOKENS), (4, 4), {EXPERTS: "expert", TOKENS: ("data", "expert")}, "mesh axis 'expert' shards dims 0 and 1"),
        ((EXPERTS,), (3,), {EXPERTS: "expert"}, "size 3, which .* does not divide"),
    ],
)
def test_invalid_annotations_raise(cpu_devices, logical, shape, rules, message):
    mesh = make_mesh(2, data_parallel=4, devices=cpu_devices)
    with pytest.raises(ValueError, match=message):
        logical_to_spec(logical, shape, rules, mesh, name="w")


def test_shard_tree_places_nvfp4_exactly(cpu_devices, rng):
    """An annotation on an NVFP4 tensor covers its codes, block scales and global scales."""
    mesh = make_mesh(2, data_parallel=2, tensor_parallel=2, devices=cpu_devices)
    rules = expert_parallel_rules(mesh, tensor_axis="tensor")
    w_ehf = rng.standard_normal((4, 32, 64)).astype(np.float32)
    tree = {
        "down": moe_jax.nvfp4.quantize(jnp.asarray(w_ehf)),
        "bias": jnp.asarray(rng.standard_normal(32), jnp.float32),
    }
    logical = {"down": (EXPERTS, HIDDEN, EXPERT_INTERMEDIATE), "bias": (HIDDEN,)}
    placed = shard_tree(tree, logical, rules, mesh)
    expected = {"packed": P("expert", None, "tensor"), "scales": P("expert", None, "tensor"), "global_scale": P("expert")}
    for field, spec in expected.items():
        leaf = getattr(placed["down"], field)
        assert leaf.sharding.spec == spec, field
        host = np.asarray(getattr(tree["down"], field))
        for shard in leaf.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), host[shard.index])
        # Each device holds 1/2 (experts) * 1/2 (intermediate) of the codes and block scales.
        if field != "global_scale":
            assert leaf.addressable_shards[0].data.size == host.size // 4
    assert placed["bias"].sharding.is_fully_replicated
    specs = tree_specs(tree, logical, rules, mesh)
    assert specs["down"].packed == P("expert", None, "tensor")


def test_shard_tree_rejects_mismatched_structure(cpu_devices):
    mesh = make_mesh(8, devices=cpu_devices)
    rules = expert_parallel_rules(mesh)
    with pytest.raises(ValueError, match="logical_tree: structure"):
        shard_tree({"a": jnp.ones(8), "b": jnp.ones(8)}, {"a": (EXPERTS,)}, rules, mesh)
    with pytest.raises(ValueError, match=r"\['a'\]: dim 0 .* size 6"):
        shard_tree({"a": jnp.ones(6)}, {"a": (EXPERTS,)}, rules, mesh)
