"""The warp-specialized Mosaic GPU weight-gradient probe (benchmarks/wgrad_mgpu_probe.py) on CPU:
executed in Pallas' Mosaic GPU interpreter (one block, every warpgroup, the TMA pipeline and its
barriers simulated, races detected) against float64, and lowered for SM90 at the training shapes
with every option, cluster multicast included (the interpreter takes no clusters)."""
import sys

import jax
import jax.export
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.grouped_matmul import reference

sys.path.insert(0, "benchmarks")
import wgrad_mgpu_probe as probe  # noqa: E402

# Experts of 70, 60, 0, 130, 124 and 128 rows: 64-row blocks straddle most boundaries, one expert
# has no rows (its gradient is zeros), the last ends on a block's end.
SIZES = np.array([70, 60, 0, 130, 124, 128], np.int32)
UNCLUSTERED = [c for c in probe.CONFIGS if c["cluster"] == 1]


def _interpreted(a_ma, b_mb, sizes, config):
    interpret_pallas_call.reset_gpu_interpret_mode_state()
    out = probe.weight_grad_ws(a_ma, b_mb, jnp.asarray(sizes), num_sms=1,
                               interpret=plgpu.InterpretGPUParams(detect_races=True), **config)
    out = np.asarray(out.astype(jnp.float32))
    assert not interpret_pallas_call.get_races().races_found, "the interpreter reported a data race"
    return out


@pytest.mark.parametrize("config", UNCLUSTERED, ids=lambda c: f"steps{c['steps']}")
def test_matches_float64_with_no_race(config):
    rng = np.random.default_rng(7)
    m = int(SIZES.sum())
    a = jnp.asarray(rng.standard_normal((m, 256)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((m, 512)), jnp.bfloat16)
    got = _interpreted(a, b, SIZES, config)
    # The library's float64 weight gradient is dy_e^T x_e: a here plays dy, b plays x.
    want_e = reference.grouped_matmul_weight_grad(np.asarray(b), np.asarray(a), SIZES)
    for e, want in enumerate(want_e):
        # bf16 output: half an ulp of the largest entry, with room for float32 accumulation
        np.testing.assert_allclose(got[e], want, rtol=0, atol=2 ** -8 * max(np.abs(want).max(), 1.0),
                                   err_msg=f"expert {e}")
    assert not got[2].any()


@pytest.mark.parametrize("config", UNCLUSTERED, ids=lambda c: f"steps{c['steps']}")
def test_a_non_finite_row_reaches_only_its_expert(config):
    rng = np.random.default_rng(8)
    m = int(SIZES.sum())
    ends = np.cumsum(SIZES)
    a = rng.standard_normal((m, 256)).astype(np.float32)
    b = rng.standard_normal((m, 512)).astype(np.float32)
    a[ends[0]] = np.nan  # expert 1's first row, in the block expert 0 ends in
    b[ends[3] - 1] = np.inf  # expert 3's last row, in the block expert 4 starts in
    got = _interpreted(jnp.asarray(a, jnp.bfloat16), jnp.asarray(b, jnp.bfloat16), SIZES, config)
    assert [e for e in range(len(SIZES)) if not np.isfinite(got[e]).all()] == [1, 3]


@pytest.mark.parametrize("config", probe.CONFIGS, ids=lambda c: f"cluster{c['cluster']}")
def test_every_option_lowers_for_sm90_at_the_training_shape(config):
    # The gate/up projection's weight gradient at 48 experts x 32768 rows: a = dy [M, 2F], b = x [M, H].
    fn = jax.jit(lambda a, b, gs: probe.weight_grad_ws(a, b, gs, num_sms=132, **config))
    exported = jax.export.export(fn, platforms=["cuda"])(
        jax.ShapeDtypeStruct((32768, 4096), jnp.bfloat16), jax.ShapeDtypeStruct((32768, 7168), jnp.bfloat16),
        jax.ShapeDtypeStruct((48,), jnp.int32))
    assert exported.out_avals[0].shape == (48, 4096, 7168)
    assert "mosaic_gpu" in exported.mlir_module()
