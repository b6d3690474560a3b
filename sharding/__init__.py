"""Meshes, logical-axis rules and expert-parallel token exchange.

Knows nothing about kernels or routers: callers pass routing results and the local expert
function. Imports flow one way: ``moe_jax`` imports ``sharding``, never the reverse.
"""

from sharding.local import clip_group_sizes, combine, dispatch, sort_by_expert

__all__ = ["clip_group_sizes", "combine", "dispatch", "sort_by_expert"]
