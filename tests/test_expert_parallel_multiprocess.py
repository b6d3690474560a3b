"""The multi-host path: 2 processes x 4 CPU devices joined by ``jax.distributed`` on
localhost (gloo collectives) give the same layer output as one process with 8 devices."""

import dataclasses
import os
import pickle
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from harness import exchanges_that_run, xla_flags

import sharding
from moe_jax import MoEConfig, init_params, moe_forward, quantize_params, resolve
from moe_jax.layer import shard_params

CONFIG = MoEConfig(num_experts=16, top_k=4, hidden_size=32, expert_intermediate_size=32, num_shared_experts=1,
                   weight_format="nvfp4")
# Every exchange XLA:CPU runs on this mesh (each says why not, e.g. ragged: no ragged_all_to_all).
EXCHANGES = exchanges_that_run(sharding.make_mesh(4, data_parallel=2, devices=jax.devices("cpu")), CONFIG)

# Each process loads the same host (numpy) parameters and tokens, places them on the global
# 8-device mesh, runs the layer and gathers the output for process 0 to save.
WORKER = textwrap.dedent("""
    import dataclasses, pickle, sys
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    process, port, inputs, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process)
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec as P
    import sharding
    from moe_jax import moe_forward, resolve
    from moe_jax.layer import shard_params
    assert jax.process_count() == 2 and len(jax.devices()) == 8 and len(jax.local_devices()) == 4
    with open(inputs, "rb") as f:
        config, exchanges, params, x = pickle.load(f)
    mesh = sharding.make_mesh(4, data_parallel=2)
    results = {}
    for exchange in exchanges:
        plan = resolve(dataclasses.replace(config, exchange=exchange), mesh)
        y, stats = jax.jit(moe_forward, static_argnums=2)(
            shard_params(params, plan), jax.device_put(x, NamedSharding(mesh, P())), plan)
        results[exchange] = np.asarray(multihost_utils.process_allgather(y, tiled=True), np.float32)
        results[exchange + "_tokens_per_expert"] = multihost_utils.process_allgather(stats["tokens_per_expert"], tiled=True)
    if process == 0:
        np.savez(out, **results)
""")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# 35 s in the suite (three processes compiling the layer for each exchange): collected first.
# With the exchanges' buffer buckets here too, as in the worker processes: the same programs.
@pytest.mark.slow
@pytest.mark.buffer_buckets
def test_two_processes_match_one(tmp_path: Path, rng, cpu_devices):
    params = quantize_params(init_params(dataclasses.replace(CONFIG, weight_format="bf16"),
                                         jax.random.key(int(rng.integers(1 << 30)))))
    params = jax.tree.map(np.asarray, params)
    x = np.asarray(jnp.asarray(rng.standard_normal((8 * 3 + 5, CONFIG.hidden_size)), jnp.bfloat16))
    inputs, out, port = tmp_path / "inputs.pkl", tmp_path / "result.npz", free_port()
    inputs.write_bytes(pickle.dumps((CONFIG, EXCHANGES, params, x)))
    (tmp_path / "worker.py").write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
           "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(4)}
    workers = [subprocess.Popen([sys.executable, str(tmp_path / "worker.py"), str(i), str(port), str(inputs), str(out)],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = [w.communicate(timeout=120)[0] for w in workers]
    assert [w.returncode for w in workers] == [0, 0], "\n".join(logs)[-4000:]
    result = np.load(out)

    mesh = sharding.make_mesh(4, data_parallel=2, devices=cpu_devices)
    for exchange in EXCHANGES:
        plan = resolve(dataclasses.replace(CONFIG, exchange=exchange), mesh)
        y, stats = jax.jit(moe_forward, static_argnums=2)(shard_params(params, plan), x, plan)
        # Same devices' worth of work, same programs: bit-identical, but for the sums across
        # devices: allgather's reduce-scatter adds the devices' partial outputs in gloo's order
        # in one case and XLA:CPU's in the other (seen: one element of 928 one bf16 ulp apart).
        if exchange == "allgather":
            np.testing.assert_allclose(result[exchange], np.asarray(y, np.float32), rtol=2.0**-7, atol=0,
                                       err_msg=exchange)
        else:
            np.testing.assert_array_equal(result[exchange], np.asarray(y, np.float32), err_msg=exchange)
        np.testing.assert_array_equal(result[exchange + "_tokens_per_expert"], stats["tokens_per_expert"])
