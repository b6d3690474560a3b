"""GPU kernels (Pallas with the Triton lowering), each op a package with its reference beside it.

Imports flow one way: ``moe_jax`` uses these packages; nothing here imports ``moe_jax``.
Importing this package changes nothing outside it; the kernels' 64-bit-offset fix to JAX's
Pallas Triton lowering applies to this library's kernels only, from their first use
(:mod:`pallas_kernels.pallas_offsets` says why and how).
"""
