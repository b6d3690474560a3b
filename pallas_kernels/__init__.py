"""GPU kernels (Pallas with the Triton lowering), each op a package with its reference beside it.

Imports flow one way: ``moe_jax`` uses these packages; nothing here imports ``moe_jax``.
"""
