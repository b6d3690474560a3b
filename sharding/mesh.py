"""Expert-parallel meshes and logical-axis rules.

Arrays are annotated with *logical* axis names (one per leading dimension); *rules* map
each logical name to mesh axes. Applying the rules to a pytree places every leaf exactly as
declared, or raises: a name without a rule, a mesh axis the mesh lacks, a mesh axis used
twice in one array, or a dimension that does not divide over its mesh axes are errors, never
a quiet fallback to replication.

An annotation is a tuple of logical names (``None`` for an unsharded dimension) and may sit
at any node of the annotation tree, where it applies to every array below that node: an
array takes the annotation's first ``ndim`` entries and leaves dimensions past the
annotation unsharded. A quantized weight stored as several arrays (e.g. an NVFP4 tensor:
codes ``[E, N, K/2]``, block scales ``[E, N, K/16]``, one global scale per matrix ``[E]``)
is therefore annotated once, with the logical dimensions of the matrix it encodes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

#: Logical axis names of the MoE layer.
EXPERTS = "experts"
EXPERT_INTERMEDIATE = "expert_intermediate"
TOKENS = "tokens"
HIDDEN = "hidden"

LogicalAxes = tuple[str | None, ...]
MeshAxes = str | tuple[str, ...] | None
Rules = Mapping[str, MeshAxes]


def make_mesh(
    expert_parallel: int,
    *,
    data_parallel: int = 1,
    tensor_parallel: int = 1,
    devices: Sequence[jax.Device] | None = None,
    expert_axis: str = "expert",
    data_axis: str = "data",
    tensor_axis: str = "tensor",
) -> Mesh:
    """A mesh ``(data, expert[, tensor])`` over ``data * expert * tensor`` devices.

    The tensor axis exists only when ``tensor_parallel > 1``. Its devices are neighbours in
    ``jax.make_mesh``'s order, then the expert axis's, since the exchange over the expert
    axis moves the most bytes after tensor-parallel reductions.

    Raises:
      ValueError: a size below 1, or a device count that is not the product of the sizes.
    """
    sizes = {"expert_parallel": expert_parallel, "data_parallel": data_parallel, "tensor_parallel": tensor_parallel}
    for name, size in sizes.items():
        if type(size) is not int or size < 1:
            raise ValueError(f"{name}: {size!r}, expected an int >= 1")
    devices = list(jax.devices() if devices is None else devices)
    needed = expert_parallel * data_parallel * tensor_parallel
    if len(devices) != needed:
        raise ValueError(
            f"devices: {len(devices)}, expected data_parallel * expert_parallel * tensor_parallel = "
            f"{data_parallel} * {expert_parallel} * {tensor_parallel} = {needed}"
        )
    shape, names = [data_parallel, expert_parallel], [data_axis, expert_axis]
    if tensor_parallel > 1:
        shape.append(tensor_parallel)
        names.append(tensor_axis)
    return jax.make_mesh(tuple(shape), tuple(names), devices=devices)


def expert_parallel_rules(
    mesh: Mesh | AbstractMesh, *, expert_axis: str = "expert", tensor_axis: str | None = None
) -> dict[str, MeshAxes]:
    """The usual EP rules for ``mesh``.

    Experts over ``expert_axis``; the expert intermediate dimension over ``tensor_axis``
    (None: unsharded); tokens over every other mesh axis, the expert axis included (it
    doubles as a data axis); hidden unsharded.

    Raises:
      ValueError: ``expert_axis`` or ``tensor_axis`` is not a mesh axis, or they are equal.
    """
    names = tuple(mesh.axis_names)
    for arg, axis in (("expert_axis", expert_axis), ("tensor_axis", tensor_axis)):
        if axis is not None and axis not in names:
            raise ValueError(f"{arg}: {axis!r} is not an axis of the mesh {names}")
    if tensor_axis == expert_axis:
        raise ValueError(f"tensor_axis: {tensor_axis!r}, expected an axis other than expert_axis")
    return {
        EXPERTS: expert_axis,
        EXPERT_INTERMEDIATE: tensor_axis,
        TOKENS: tuple(a for a in names if a != tensor_axis),
        HIDDEN: None,
    }


def _as_tuple(mesh_axes: MeshAxes) -> tuple[str, ...]:
    if mesh_axes is None:
        return ()
    return (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)


def logical_to_spec(
    logical: LogicalAxes, shape: Sequence[int], rules: Rules, mesh: Mesh | AbstractMesh, *, name: str = "array"
) -> P:
    """The ``PartitionSpec`` of an array of ``shape`` annotated ``logical``.

    Only the first ``len(shape)`` entries of ``logical`` apply; dimensions past the
    annotation are unsharded.

    Raises:
      ValueError: naming ``name``, for a logical name without a rule, a mesh axis not in
        ``mesh``, a mesh axis used by two dimensions, or a dimension that its mesh axes'
        total size does not divide.
    """
    used: dict[str, int] = {}
    entries = []
    for dim, (size, logical_name) in enumerate(zip(shape, logical)):
        if logical_name is None:
            entries.append(None)
            continue
        if logical_name not in rules:
            raise ValueError(f"{name}: logical axis {logical_name!r} (dim {dim}) has no rule; "
                             f"rules cover {sorted(rules)}")
        mesh_axes = _as_tuple(rules[logical_name])
        for axis in mesh_axes:
            if axis not in mesh.shape:
                raise ValueError(f"{name}: rule {logical_name!r} -> {axis!r}, "
                                 f"but the mesh has axes {tuple(mesh.axis_names)}")
            if axis in used:
                raise ValueError(f"{name}: mesh axis {axis!r} shards dims {used[axis]} and {dim}; "
                                 "an axis may shard one dim")
            used[axis] = dim
        ways = int(np.prod([mesh.shape[a] for a in mesh_axes], dtype=np.int64))
        if size % ways:
            raise ValueError(
                f"{name}: dim {dim} ({logical_name!r}) has size {size}, "
                f"which {mesh_axes} ({ways} devices) does not divide"
            )
        entries.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return P(*entries)


def _is_annotation(node) -> bool:
    return isinstance(node, tuple) and all(a is None or isinstance(a, str) for a in node)


def tree_specs(tree, logical_tree, rules: Rules, mesh: Mesh | AbstractMesh):
    """The ``PartitionSpec`` of every array leaf of ``tree`` (same structure as ``tree``).

    ``logical_tree`` has ``tree``'s structure down to the annotations (tuples), each of
    which covers the subtree of ``tree`` at its position (see the module docstring).

    Raises:
      ValueError: the trees' structures disagree, or any leaf's annotation is invalid.
    """
    structure = jax.tree_util.tree_structure(logical_tree, is_leaf=_is_annotation)
    try:
        structure.flatten_up_to(tree)
    except (TypeError, ValueError) as err:
        raise ValueError(f"logical_tree: structure {structure} is not a prefix of the tree's: {err}") from err

    def per_subtree(path, logical, subtree):
        def per_leaf(leaf_path, leaf):
            where = jax.tree_util.keystr((*path, *leaf_path))
            return logical_to_spec(logical, tuple(leaf.shape), rules, mesh, name=where)
        return jax.tree_util.tree_map_with_path(per_leaf, subtree)

    return jax.tree_util.tree_map_with_path(per_subtree, logical_tree, tree, is_leaf=_is_annotation)


def shard_tree(tree, logical_tree, rules: Rules, mesh: Mesh | AbstractMesh):
    """Places every leaf of ``tree`` with the ``NamedSharding`` its annotation declares.

    Works on any pytree (dicts, registered dataclasses such as quantized weights) whose
    leaves are arrays; host arrays are copied to the mesh, device arrays resharded. Every
    returned array is checked to carry exactly the declared sharding. Traced leaves (under
    ``jax.jit`` or ``jax.eval_shape``, e.g. building an abstract model) are not placed yet:
    the traced program carries the sharding, and there is nothing to check.

    Raises:
      ValueError: an invalid annotation (see :func:`logical_to_spec`), or a leaf that did
        not end up with its declared sharding.
    """
    specs = tree_specs(tree, logical_tree, rules, mesh)
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)
    placed = jax.device_put(tree, shardings)

    def check(path, leaf, sharding):
        if isinstance(leaf, jax.core.Tracer):
            return leaf
        if not (isinstance(leaf, jax.Array) and leaf.sharding.is_equivalent_to(sharding, leaf.ndim)):
            found = getattr(leaf, "sharding", type(leaf).__name__)
            raise ValueError(f"{jax.tree_util.keystr(path)}: placed as {found}, declared {sharding}")
        return leaf

    return jax.tree_util.tree_map_with_path(check, placed, shardings)
