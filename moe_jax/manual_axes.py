"""Casts between invariant and varying values over ``shard_map``'s manual mesh axes.

Inside ``shard_map(check_vma=True)`` each value's type says which mesh axes it varies over.
Where a value that is the same on every device (a weight) meets one that varies (the tokens),
the cast to varying is implicit, and its transpose, a ``psum`` of the weight's gradient over
those axes, is where JAX puts it. These make the cast explicit where its place matters: before
a branch that devices may take differently, and before a custom VJP, whose gradients must have
their primals' types.
"""

from __future__ import annotations

import jax


def varying_over(tree, axis_names: tuple[str, ...]):
    """``tree`` with every leaf cast to varying over ``axis_names`` (inside ``shard_map``; the
    axes a leaf already varies over are left as they are)."""
    def cast(leaf):
        missing = tuple(a for a in axis_names if a not in jax.typeof(leaf).manual_axis_type.varying)
        return jax.lax.pcast(leaf, missing, to="varying")

    return jax.tree.map(cast, tree) if axis_names else tree


def varying_alike(*arrays: jax.Array) -> tuple[jax.Array, ...]:
    """``arrays``, each cast to vary over every mesh axis that any of them varies over (outside
    ``shard_map``: as they are). A custom VJP taking them then returns gradients of its primals'
    types, and the casts' transposes sum an invariant operand's gradient over the axes."""
    axes = frozenset().union(*(jax.typeof(a).manual_axis_type.varying for a in arrays))
    return tuple(varying_over(a, tuple(sorted(axes))) for a in arrays)
