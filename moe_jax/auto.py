"""``AUTO``: the implementation name that asks :func:`moe_jax.resolve` to choose.

A module of its own so that the config and the registries can both name it without importing
each other.
"""

AUTO = "auto"
