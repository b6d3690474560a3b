"""NVFP4 in float64, written from the format's definition (E2M1 codes x E4M3 block scales x
global scales), and random weights in ModelOpt's layout: the reference side of the interpreted
kernel tests, independent of the code under test."""

from __future__ import annotations

import ml_dtypes
import numpy as np
from pallas_kernels.grouped_matmul.tuning import Op

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
TOLERANCE = 1e-2  # relative (Frobenius); bf16 output rounding alone is ~1.5e-3
#: Group sizes with empty experts (first, middle), one hot expert, odd totals.
PATTERNS = {
    "empty experts": [5, 0, 17, 0, 3, 9],
    "one hot expert": [0, 0, 40, 0, 0, 1],
    "first expert empty, odd totals": [0, 33, 15, 1, 1, 19],
}


def e2m1(packed_u8: np.ndarray) -> np.ndarray:
    """uint8 ``[..., K/2]`` -> float64 ``[..., K]`` (element 2i in the low nibble of byte i)."""
    codes = np.stack([packed_u8 & 0xF, packed_u8 >> 4], axis=-1)
    return E2M1[codes].reshape(*packed_u8.shape[:-1], -1)


def e4m3(bits_u8: np.ndarray) -> np.ndarray:
    return bits_u8.view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def dequantized(packed, scales_u8, global_scale) -> np.ndarray:
    """NVFP4 -> float64 ``[..., N, K]``; ``global_scale`` broadcasts over rows ``[..., N, 1]``."""
    return e2m1(packed) * np.repeat(e4m3(scales_u8), 16, axis=-1) * global_scale


def random_weights(rng, experts: int, n_w: int, k: int, scale_groups: int, used=None):
    """Random NVFP4 weights ``[E, N_W, K]`` (all 16 codes, scales in [2**-9, 448] incl. subnormal
    E4M3, global scales per expert or per gate/up half); only the experts in ``used`` are filled
    (the rest stay zero pages: a 384-expert buffer costs what its used experts cost)."""
    packed = np.zeros((experts, n_w, k // 2), np.uint8)
    scales = np.zeros((experts, n_w, k // 16), np.uint8)
    for e in range(experts) if used is None else used:
        packed[e] = rng.integers(0, 256, (n_w, k // 2), dtype=np.uint8)
        bits = rng.integers(0x01, 0x7F, (n_w, k // 16)).astype(np.uint8)  # every finite positive E4M3
        scales[e] = np.where(rng.random((n_w, k // 16)) < 0.8, 0x30 + bits % 0x20, bits)  # mostly near 1
    shape = (experts,) if scale_groups == 1 else (experts, 2)
    global_scale = (rng.uniform(0.5, 2.0, shape) / (6 * 448 * np.sqrt(k))).astype(np.float32)
    return packed, scales, global_scale


def random_problem(rng, op: Op, group_sizes, *, k: int, n_out: int, scale_groups: int = 1, experts=None,
                   used=None):
    """``(group_sizes, packed, scales, global_scale)``: ``op``'s random weights over
    ``experts`` (default: one per group size), ``[E, 2 n_out, k]`` for the fused gate/up."""
    group_sizes = np.asarray(group_sizes)
    n_w = 2 * n_out if op is Op.GATE_UP_SWIGLU else n_out
    return group_sizes, *random_weights(rng, experts or len(group_sizes), n_w, k, scale_groups, used)


def expert(op: Op, x_mk: np.ndarray, w_nk: np.ndarray) -> np.ndarray:
    """float64 ``[M, n_out]``: one expert's rows times its dense weights ``[N_W, K]``, with SwiGLU
    for the fused gate/up op (gate rows, then up rows)."""
    h = x_mk @ w_nk.T
    if op is Op.MATMUL:
        return h
    gate, up = np.split(h, 2, axis=-1)
    return gate / (1.0 + np.exp(-gate)) * up


def reference(op: Op, a_mk, packed, scales, global_scale, group_sizes) -> np.ndarray:
    """float64 ``[sum(group_sizes), n_out]``."""
    rows = []
    start = 0
    for e, size in enumerate(group_sizes):
        if not size:
            continue  # (at 384 experts, dequantizing the unused ones would take most of a test's time)
        g = global_scale[e]
        n_w = packed.shape[1]
        row_scale = np.repeat(np.atleast_1d(g), n_w // np.atleast_1d(g).size)[:, None]
        y = a_mk[start:start + size] @ dequantized(packed[e], scales[e], row_scale).T
        if op is Op.GATE_UP_SWIGLU:
            gate, up = np.split(y, 2, axis=-1)
            y = gate / (1 + np.exp(-gate)) * up
        rows.append(y)
        start += size
    return np.concatenate(rows)


def compare(got, want, total: int, tile) -> float:
    """Asserts that a kernel's NaN-poisoned output ``got`` wrote its ``total`` defined rows, kept
    the padding rows' poison, and is within :data:`TOLERANCE` of ``want``; returns the error."""
    assert np.isnan(got[total:]).all(), "padding rows were written"
    assert np.isfinite(got[:total]).all(), f"{np.count_nonzero(~np.isfinite(got[:total]))} outputs not written"
    err = np.linalg.norm(got[:total] - want) / np.linalg.norm(want)
    assert err < TOLERANCE, f"relative error {err:.3g} (tile {tile})"
    return err
