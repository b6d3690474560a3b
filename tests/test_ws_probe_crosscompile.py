"""The warp-specialized bf16 candidate (``benchmarks/ws_probe_kernel.py``) cross-compiles for SM90 to a
producer/consumer kernel (no GPU): 12 warps, ``setmaxnreg``, TMA, wgmma, within shared memory."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")
from benchmarks import ws_probe_kernel as triton_ws  # noqa: E402
from pallas_kernels.grouped_matmul.tuning import SHARED_MEMORY_BYTES, Op  # noqa: E402


CASES = [(Op.GATE_UP_SWIGLU, 7168, 2048, dict(block_n=128, extra_m=64, num_stages=3)),
         (Op.GATE_UP_SWIGLU, 7168, 2048, dict(block_n=128, num_stages=4)),
         (Op.MATMUL, 2048, 7168, dict(block_n=128, extra_m=64, num_stages=4)),
         (Op.MATMUL, 2048, 7168, dict(block_n=256, extra_m=64, num_stages=3))]


@pytest.mark.parametrize("op,k,n_out,tile", CASES, ids=["gate_up-192", "gate_up-128", "down-192", "down-bn256-192"])
def test_ws_candidate_is_warp_specialized(op, k, n_out, tile):
    spec = triton_ws.make_spec(op, num_rows=65536, num_experts=384, k=k, n_out=n_out, **tile)
    facts = triton_ws.kernel_facts(triton_ws.compile_kernel(spec, 90))
    assert facts["warp_specialized"] and facts["num_warps"] == 12 and facts["threads"] == 384
    assert ("inc", "232") in facts["setmaxnreg"] and ("dec", "40") in facts["setmaxnreg"]
    assert facts["tma"] and facts["wgmma"]
    assert 0 < facts["shared_bytes"] <= SHARED_MEMORY_BYTES[90]
