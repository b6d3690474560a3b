"""Serving load: bucketed token counts (``moe_jax.serving``) under ``nnx.jit``.

The soak calls the NNX module :data:`CALLS` times with token counts drawn from 1 to 8192 (on CPU
:data:`CPU_CALLS` times, up to :data:`CPU_MAX_TOKENS`),
bf16 and NVFP4, padded on the host to :func:`~moe_jax.serving.token_buckets` (as a server pads
what it receives; the GPU soak's buckets are :data:`GPU_BUCKETS`): the layer compiles at most
once per bucket, the live device memory does not grow after the first round of buckets, and
sampled outputs (every 97th call and the first call of each bucket) equal a float64 reference of
the same weights (statistics: those of the unpadded batch, exactly).
"""

from __future__ import annotations

import dataclasses
import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moe_jax import MoE, MoEConfig, moe_forward, reference_forward, resolve, serving

CONFIG = MoEConfig(num_experts=8, top_k=2, hidden_size=32, expert_intermediate_size=32, num_shared_experts=1,
                   scoring="sigmoid", router_bias=True, expert_gemm="xla")
CALLS, MAX_TOKENS = 1000, 8192
# On CPU the soak compiles the layer once per bucket and format (seconds each): 500 calls of up to
# 2048 tokens, 8 buckets, hold the same checks (the GPU runs the full soak).
CPU_CALLS, CPU_MAX_TOKENS = 500, 2048
# The GPU soak's buckets (tests/test_serving_gpu.py, and the native kernels' test at its shapes in
# tests/pallas_kernels/test_triton_lang_gpu.py). On the H200 the soak's time is compiling: each
# bucket compiles the layer and its Triton kernels again (their tile count is a compile-time
# constant), while its 1,000 calls take seconds. token_buckets(8192)'s ten buckets cost the GPU
# check ~270 s of test time in the two soaks and ~200 s in the kernels' test (79698bd). These six
# of them are the fewest that give every kernel of the layer every tile its ten would (decode,
# one group, between decode and prefill, prefill with extra rows, many rows, W4A16's wide down
# tile from 512 rows per expert;
# test_the_soaks_buckets_reach_every_tile_... checks that), and hold every check of the soak
# (benchmarks/NOTES.md, section 7).
GPU_BUCKETS = (16, 64, 256, 512, 2048, MAX_TOKENS)


def test_buckets_and_padding():
    assert serving.token_buckets(8192) == (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
    assert serving.token_buckets(100, smallest=10, growth=1.5) == (10, 15, 23, 35, 53, 80, 120)
    assert serving.bucket_for(0, (16, 32)) == 16 and serving.bucket_for(17, (16, 32)) == 32
    x, n = serving.pad_to_bucket(jnp.ones((20, 4)), (16, 32))
    assert x.shape == (32, 4) and n == 20 and not np.asarray(x[20:]).any()
    x_host, n_host = serving.pad_to_bucket(np.arange(80, dtype=np.float32).reshape(20, 4), (16, 32))
    assert isinstance(x_host, np.ndarray) and n_host == 20  # padded on the host: no device compilation per length
    np.testing.assert_array_equal(x_host, np.pad(np.arange(80, dtype=np.float32).reshape(20, 4), ((0, 12), (0, 0))))
    assert serving.bucket_for(np.int64(17), (16, 32)) == 32  # NumPy counts are counts
    for call, message in ((lambda: serving.token_buckets(0), r"^max_tokens: 0, expected an int >= 1$"),
                          (lambda: serving.token_buckets(8, growth=1), r"^growth: 1, expected a finite number > 1$"),
                          (lambda: serving.bucket_for(33, (16, 32)), r"^num_tokens: 33, expected at most the largest"),
                          (lambda: serving.pad_to_bucket(jnp.ones(4), (16,)), r"^x_th: shape \(4,\), expected \[T, H\]$")):
        with pytest.raises(ValueError, match=message):
            call()


def test_num_valid_tokens_gives_the_unpadded_batch(rng, cpu_devices):
    plan = resolve(CONFIG, cpu_devices[:1])
    layer = MoE(CONFIG, rngs=nnx.Rngs(0))
    x = jnp.asarray(rng.standard_normal((21, CONFIG.hidden_size)), jnp.bfloat16)
    y, stats = jax.jit(moe_forward, static_argnums=2)(layer.params(), x, plan)
    x_b, n = serving.pad_to_bucket(x.at[3].set(jnp.nan), serving.token_buckets(64))
    x_b = x_b.at[n:].set(jnp.asarray(rng.standard_normal((x_b.shape[0] - n, CONFIG.hidden_size)), jnp.bfloat16))
    y_b, stats_b = jax.jit(lambda p, x, n: moe_forward(p, x, plan, num_valid_tokens=n))(layer.params(), x_b, n)
    keep = np.arange(21) != 3
    np.testing.assert_array_equal(np.asarray(y_b)[:21][keep], np.asarray(y)[keep])
    assert not np.asarray(y_b[21:]).any()  # padding rows (here: random, not zero) get zeros
    _, stats_ref = jax.jit(moe_forward, static_argnums=2)(layer.params(), jnp.delete(x, 3, axis=0), plan)
    np.testing.assert_array_equal(stats_b["tokens_per_expert"], stats_ref["tokens_per_expert"])
    assert int(stats_b["nonfinite_tokens"]) == 1
    with pytest.raises(ValueError, match=r"^num_valid_tokens: -1, expected >= 0$"):
        moe_forward(layer.params(), x, plan, num_valid_tokens=-1)
    with pytest.raises(ValueError, match=r"^num_valid_tokens: float32\[\], expected None, an int or an integer"):
        moe_forward(layer.params(), x, plan, num_valid_tokens=jnp.float32(3))


def _live_bytes_without(*outputs) -> int:
    """Bytes of the live device arrays, less this call's own inputs and outputs (their size is
    the bucket's): what the layer keeps from call to call."""
    jax.block_until_ready(outputs)
    exclude = {id(a) for a in jax.tree.leaves(outputs)}
    gc.collect()
    return sum(a.nbytes for a in jax.live_arrays() if id(a) not in exclude)


def soak(config: MoEConfig, device, rng, *, calls: int = CALLS, max_tokens: int = MAX_TOKENS, tolerance: float = 2e-2,
         buckets: tuple[int, ...] | None = None):
    """``calls`` bucketed calls of the NNX module under ``nnx.jit`` on ``device`` (``buckets``:
    ``token_buckets(max_tokens)`` unless given); asserts the compilations, the memory and sampled
    outputs (module docstring) and returns the figures."""
    layer = MoE(config, rngs=nnx.Rngs(1), mesh=[device])
    buckets = serving.token_buckets(max_tokens) if buckets is None else buckets
    # The float64 oracle reads host copies of the (fixed) weights and routes on the CPU backend:
    # on a GPU, reading each expert from the device and routing each sample's token count there
    # compiled ~100 small XLA:GPU programs per soak, which test the oracle, not the layer.
    host_params, cpu = jax.device_get(layer.params()), jax.devices("cpu")[0]
    checked_buckets = set()
    traces = []

    @nnx.jit
    def step(layer, x, n):
        traces.append(x.shape)  # runs once per compilation
        return layer(x, num_valid_tokens=n)

    counts = np.exp(rng.uniform(0, np.log(max_tokens), calls)).astype(int).clip(1, max_tokens)
    pool = np.asarray(jnp.asarray(rng.standard_normal((max_tokens, config.hidden_size)), jnp.bfloat16))  # on the host
    # The oracle of every call at once: it routes each token alone, so a call's tokens (a prefix
    # of the pool) have the prefix's rows (on the CPU, ~20 small programs per distinct count).
    with jax.default_device(cpu):
        ref_pool = reference_forward(host_params, np.asarray(pool, np.float64), config)
    checked, warm_bytes = 0, None
    for i, t in enumerate(counts):
        x_b, n = serving.pad_to_bucket(pool[:t], buckets)
        y_b, stats = step(layer, x_b, jnp.int32(n))
        if i % 97 == 0 or x_b.shape[0] not in checked_buckets:  # sampled outputs against float64
            checked_buckets.add(x_b.shape[0])
            ref = ref_pool[:t]
            y = np.asarray(y_b[:n], np.float64)
            assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < tolerance
            assert int(np.asarray(stats["tokens_per_expert"]).sum()) == n * config.top_k
            checked += 1
        if i == calls // 2:
            warm_bytes = _live_bytes_without(y_b, stats, x_b)
    final_bytes = _live_bytes_without(y_b, stats, x_b)
    figures = {"calls": calls, "compilations": len(traces), "distinct token counts": len(set(map(int, counts))),
               "buckets": len(buckets), "buckets checked": len(checked_buckets), "outputs checked": checked,
               "live bytes at half": warm_bytes, "live bytes at the end": final_bytes}
    print(f"{config.weight_format} on {device.device_kind}: {figures}")
    assert len(traces) <= len(buckets)
    assert final_bytes <= warm_bytes
    return figures


@pytest.mark.slow
@pytest.mark.parametrize("weight_format", ["bf16", "nvfp4"])
def test_soak_of_bucketed_calls(rng, cpu_devices, weight_format, record_property):
    figures = soak(dataclasses.replace(CONFIG, weight_format=weight_format), cpu_devices[0], rng, calls=CPU_CALLS,
                   max_tokens=CPU_MAX_TOKENS)
    for name, value in figures.items():
        record_property(name, value)
