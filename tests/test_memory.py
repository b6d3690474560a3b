"""Memory per device before anything is allocated (``moe_jax.memory``, ``moe-jax explain``),
against the arrays the library actually allocates on 8 CPU devices."""

import dataclasses
import json

import jax
import pytest

import sharding
from moe_jax import MoEConfig, cli, init_params, memory, random_params, resolve
from sharding.exchange.layout import worst_case_received

SMALL = MoEConfig(num_experts=16, top_k=4, hidden_size=64, expert_intermediate_size=32, num_shared_experts=1,
                  scoring="sigmoid", router_bias=True)


@pytest.mark.parametrize("weight_format", ["bf16", "nvfp4"])
@pytest.mark.parametrize("ep", [1, 2, 8])
def test_weight_bytes_are_those_of_the_allocated_arrays(cpu_devices, weight_format, ep):
    config = dataclasses.replace(SMALL, weight_format=weight_format)
    if ep == 1:
        params = init_params(config, jax.random.key(0))
        held = {g: sum(a.nbytes for a in jax.tree.leaves(leaves)) for g, leaves in params.items()}
    else:
        plan = resolve(config, sharding.make_mesh(ep, devices=cpu_devices[:ep]))
        params = random_params(config, jax.random.key(0), plan)
        # What device 0 holds of each group.
        held = {g: sum(next(s.data.nbytes for s in a.addressable_shards if s.device == cpu_devices[0])
                       for a in jax.tree.leaves(leaves)) for g, leaves in params.items()}
    assert memory.weight_bytes(config, ep) == held


def test_exchange_buffers():
    c = MoEConfig.kimi_k2()
    h2 = c.hidden_size * 2
    assert memory.exchange_buffer_bytes(c, "ragged", 4096, 8) == 2 * worst_case_received(4096, 8, 8, 48) * h2
    # onecopy: ragged's expanded rows, plus the 8 * 4096 copies received and their float32 partial sums
    assert memory.exchange_buffer_bytes(c, "onecopy", 4096, 8) == (2 * worst_case_received(4096, 8, 8, 48) * h2
                                                                   + 8 * 4096 * (h2 + 4 * c.hidden_size))
    assert memory.exchange_buffer_bytes(c, "allgather", 64, 4) == 4 * 64 * c.hidden_size * (2 + 4)
    assert memory.exchange_buffer_bytes(c, "none", 10, 1) == 2 * 10 * 8 * h2
    with pytest.raises(ValueError, match=r"^exchange: 'x', expected one of"):
        memory.exchange_buffer_bytes(c, "x", 1, 1)


def test_kimi_k2_nvfp4_on_eight_rtx_pro_6000(capsys):
    """Kimi K2 NVFP4 (384 experts, 60 MoE layers) on 8 x 96 GB: fits, and says by how much."""
    rc = cli.main(["explain", "--preset", "kimi_k2", "--weight-format", "nvfp4", "--ep", "8", "--device-kind",
                   "NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "--tokens-per-device", "4096"])
    out = capsys.readouterr().out
    assert rc == 0
    experts = 384 // 8 * 3 * 7168 * 2048 * (1 / 2 + 1 / 16) + 384 // 8 * 3 * 4  # codes, scales, global scales
    assert f"routed experts   {experts / 1e9:.2f} GB a layer (48 of 384 experts), {60 * experts / 1e9:.2f} GB" in out
    assert "of 96.00 GB nominal:" in out and " left for attention" in out


def test_explain_takes_a_config_json_and_an_unknown_device(tmp_path, capsys):
    from synthetic_checkpoint import hf_config

    (tmp_path / "config.json").write_text(json.dumps(hf_config()))
    assert cli.main(["explain", "--hf-config", str(tmp_path), "--device-kind", "Some Future GPU"]) == 0
    out = capsys.readouterr().out
    assert "memory per device (3 MoE layers;" in out and "memory of Some Future GPU unknown" in out
    assert cli.main(["explain", "--hf-config", str(tmp_path), "--device-kind", "Some Future GPU",
                     "--device-memory-gb", "0.001"]) == 0
    assert "does NOT fit" in capsys.readouterr().out


def test_nominal_memory_by_device_kind():
    assert memory.device_memory_bytes("NVIDIA H200") == 141 * 10**9
    assert memory.device_memory_bytes("NVIDIA RTX PRO 6000 Blackwell Workstation Edition") == 96 * 10**9
    assert memory.device_memory_bytes("cpu") is None and memory.device_memory_bytes(None) is None
