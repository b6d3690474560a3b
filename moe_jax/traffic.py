"""The exchanges' bytes model: what each moves across the expert axis per token and layer,
expected under uniform routing (independent random router scores), before anything runs.
``auto`` orders the exchanges by it (:mod:`moe_jax.exchange`) and ``moe-jax explain`` prints it.

Per token of a device, per layer, with ``D`` devices on the expert axis, ``k`` experts per
token, hidden ``H``, activations of ``a`` bytes (``config.dtype``):

* ``none``: nothing.
* ``ragged``: one row per (token, expert) on another device, each way:
  ``k (D - 1) / D`` rows of ``H a`` bytes out, as many back (the expert outputs, ``config.dtype``).
* ``onecopy``: one copy per other device holding one of the token's experts (``r`` of them:
  :func:`expected_devices` times ``(D - 1) / D``): ``r`` rows of ``H a`` bytes plus ``k`` int32 ids and ``k`` float32
  weights out, ``r`` float32 partial sums of ``4 H`` bytes back.
* ``padded``: dense per-peer buffers of the bucket above the load, ``1.25 k T / D`` rows
  (:data:`sharding.exchange.layout.BUCKET_FACTORS`) to each of ``D - 1`` peers, each way.
* ``allgather``: the token, its ids and weights to the ``D - 1`` others; ``D - 1`` float32
  partial sums back (reduce-scatter).
* where ``jax.lax.ragged_all_to_all`` is emulated (:mod:`sharding.exchange.emulated`), the
  twin gathers every device's whole operand: ``D - 1`` times the sender's rows.

Rows and their per-row metadata only: the all-gather of row counts (``D * E_l`` int32 per
device and call) is left out.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import jax.numpy as jnp

from moe_jax.config import MoEConfig
from sharding.exchange.layout import BUCKET_FACTORS

#: The exchanges that move rows with ``jax.lax.ragged_all_to_all`` (emulated where it is missing).
RAGGED_COLLECTIVE = ("ragged", "onecopy")


def expected_devices(num_experts: int, top_k: int, devices: int, num_groups: int = 1, topk_groups: int = 1) -> float:
    """The expected number of devices holding at least one of a token's experts, under
    independent random router scores.

    The token's ``topk_groups`` of ``num_groups`` expert groups are equally likely (no group
    limit: ``num_groups = 1``). A chosen group holds at least one of its experts (the router
    ranks groups by their best experts' scores), so a device holding a whole chosen group is
    hit; on any other device the ``top_k`` experts count as uniform among the chosen groups'
    ``n`` experts: hit with probability ``1 - C(n - m, k) / C(n, k)`` for its ``m`` of them.
    Experts are split over devices in contiguous blocks of ``E / D``, as over groups.
    (Checked against the router on random scores: ``tests/test_exchange_traffic.py``.)
    """
    e_l, per_group = num_experts // devices, num_experts // num_groups
    total, choices = 0.0, 0
    for groups in itertools.combinations(range(num_groups), topk_groups):
        n = len(groups) * per_group
        for d in range(devices):
            mine = range(d * e_l, (d + 1) * e_l)
            m = sum(1 for g in groups for e in range(g * per_group, (g + 1) * per_group) if e in mine)
            whole = any(g * per_group >= mine.start and (g + 1) * per_group <= mine.stop for g in groups)
            total += 1.0 if whole else 1 - math.comb(n - m, top_k) / math.comb(n, top_k)
        choices += 1
    return total / choices


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Bytes one exchange moves out of a device per token of that device and layer."""

    dispatch: float
    combine: float

    @property
    def total(self) -> float:
        return self.dispatch + self.combine


def exchange_traffic(config: MoEConfig, exchange: str, expert_parallel: int, *, emulated: bool = False) -> Traffic:
    """The expected bytes per token and layer of ``exchange`` (see the module docstring).

    Args:
      emulated: ``jax.lax.ragged_all_to_all`` runs as its twin (``ragged`` and ``onecopy`` only).
    """
    d, k, h = expert_parallel, config.top_k, config.hidden_size
    a = jnp.dtype(config.dtype).itemsize
    row, meta = h * a, k * (4 + 4)  # an activation row; a copy's int32 ids and float32 weights
    bucket = min(BUCKET_FACTORS)
    if d == 1:
        return Traffic(0.0, 0.0)
    remote = expected_devices(config.num_experts, k, d, config.num_groups, config.topk_groups) * (d - 1) / d
    match exchange:
        case "none":
            return Traffic(0.0, 0.0)
        case "ragged" if emulated:  # all_gather of the sorted rows, then of the receive bucket
            return Traffic((d - 1) * k * row, (d - 1) * bucket * k * row)
        case "ragged":
            return Traffic(k * (d - 1) / d * row, k * (d - 1) / d * row)
        case "onecopy" if emulated:  # all_gather of the send buffer, then of the received copies' sums
            return Traffic((d - 1) * min(k, d) * (row + meta), (d - 1) * min(d, bucket * k) * h * 4)
        case "onecopy":
            return Traffic(remote * (row + meta), remote * h * 4)
        case "padded":
            return Traffic((d - 1) * bucket * k / d * row, (d - 1) * bucket * k / d * row)
        case "allgather":
            return Traffic((d - 1) * (row + meta), (d - 1) * h * 4)
        case _:
            raise ValueError(f"exchange: {exchange!r}, expected a registered exchange (moe_jax.EXCHANGE.names())")


def kb(n: float) -> str:
    return f"{n / 1e3:.1f} KB"


def report(config: MoEConfig, *, exchanges: tuple[str, ...], chosen: str, expert_parallel: int, emulated: bool,
           tokens_per_device: int, buffers: dict[str, int], link_gbps: float | None = None) -> str:
    """The lines ``moe-jax explain`` prints: per exchange, bytes per token per layer (dispatch,
    combine), the exchange buffers, and with ``link_gbps`` the time of those bytes at that
    rate out of each device for ``tokens_per_device`` tokens."""
    d, k = expert_parallel, config.top_k
    n = expected_devices(config.num_experts, k, d, config.num_groups, config.topk_groups)
    limit = f", best {config.topk_groups} of {config.num_groups} groups" if config.num_groups > 1 else ""
    lines = [f"exchange traffic per token per layer (expected, uniform routing{limit}: a token's {k} experts on "
             f"{n:.2f} of {d} devices, {n * (d - 1) / d:.2f} of them other devices; "
             f"{'ragged_all_to_all emulated here' if emulated else 'native collectives'}):"]
    for name in exchanges:
        t = exchange_traffic(config, name, d, emulated=emulated and name in RAGGED_COLLECTIVE)
        mark = "*" if name == chosen else " "
        line = (f" {mark}{name:<10} dispatch {kb(t.dispatch):>9}  combine {kb(t.combine):>9}  "
                f"buffers {buffers[name] / 1e9:.2f} GB")
        if link_gbps is not None:
            ms = lambda b: b * tokens_per_device / (link_gbps * 1e9) * 1e3
            line += f"  at {link_gbps:g} GB/s: {ms(t.dispatch):.2f} + {ms(t.combine):.2f} ms"
        lines.append(line)
    tail = f"  (* chosen; buffers: dropless worst case at {tokens_per_device} tokens per device"
    if link_gbps is not None:
        tail += f"; times: those bytes for {tokens_per_device} tokens per device, not measured"
    lines.append(tail + ")")
    return "\n".join(lines)
