"""Meshes, logical-axis rules and expert-parallel token exchange.

Knows nothing about kernels or routers: callers pass routing results and the local expert
function. Imports flow one way: ``moe_jax`` imports ``sharding``, never the reverse.
"""

from sharding.exchange import (
    ExchangeLayout, allgather_exchange, exchange_layout, local_exchange, onecopy_exchange, padded_exchange,
    ragged_exchange,
)
from sharding.local import clip_group_sizes, combine, dispatch, sort_by_expert
from sharding.mesh import expert_parallel_rules, logical_to_spec, make_mesh, shard_tree, tree_specs

__all__ = [
    "ExchangeLayout", "allgather_exchange", "clip_group_sizes", "combine", "dispatch", "exchange_layout",
    "expert_parallel_rules", "local_exchange", "logical_to_spec", "make_mesh", "onecopy_exchange", "padded_exchange",
    "ragged_exchange",
    "shard_tree", "sort_by_expert", "tree_specs",
]
