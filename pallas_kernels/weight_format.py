"""``WeightFormat``: how expert weights are stored, the one type for it in moe-jax.

The kernels dispatch on it and :class:`moe_jax.MoEConfig` takes it (``weight_format``,
``shared_weight_format``). A ``str`` enum, so the strings users write are its values:
``WeightFormat.NVFP4 == "nvfp4"``, and its repr is the string's.
"""

from __future__ import annotations

import enum


class WeightFormat(enum.StrEnum):
    """``BF16``: bf16 (or other float) arrays. ``NVFP4``: NVIDIA ModelOpt's NVFP4 (packed E2M1
    codes, one E4M3 scale per 16 inputs, one float32 global scale)."""

    BF16 = "bf16"
    NVFP4 = "nvfp4"

    def __repr__(self) -> str:
        # Reads as the string a config was written with: MoEConfig(weight_format='nvfp4', ...).
        return repr(self.value)
