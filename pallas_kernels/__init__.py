"""GPU kernels (Pallas with the Triton lowering), each op a package with its reference beside it.

Imports flow one way: ``moe_jax`` uses these packages; nothing here imports ``moe_jax``.
Importing this package makes the Pallas Triton lowering address operands of 2**31 elements
or more with 64-bit offsets (:mod:`pallas_kernels.pallas_offsets` says why).
"""

from pallas_kernels import pallas_offsets

pallas_offsets.install()
