"""Memory per device, before anything is allocated: does a model fit, and with how much left.

For one MoE layer on a mesh whose expert axis has ``expert_parallel`` devices: the bytes of its
routed experts (split over that axis), shared expert and router (replicated), as the arrays
:func:`moe_jax.layer.param_template` describes; and the largest buffers the chosen exchange
allocates for a batch of ``tokens_per_device`` (dropless: the proven worst case of
:func:`sharding.exchange.layout.worst_case_received`). Times the model's MoE layers, against
the target's memory. Attention, embeddings, the KV cache and activations outside the MoE layer
are not counted.
"""

from __future__ import annotations

import dataclasses

import jax

from moe_jax.config import MoEConfig
from sharding.exchange.layout import worst_case_received, worst_case_tokens_received

GB = 10**9

#: Nominal memory of the GPUs the library is tuned for, GB as the datasheets give it (the
#: usable part is somewhat less: driver, CUDA context, the allocator's reserve).
DEVICE_MEMORY_GB = {
    "RTX PRO 6000": 96, "H200": 141, "H100": 80, "B200": 180, "GB200": 186,
}


def device_memory_bytes(device_kind: str | None) -> int | None:
    """The nominal memory of ``device_kind`` (matched by name), or None when it is not known."""
    for name, gb in DEVICE_MEMORY_GB.items():
        if device_kind and name.lower() in device_kind.lower():
            return gb * GB
    return None


@dataclasses.dataclass(frozen=True)
class LayerMemory:
    """Bytes per device of one MoE layer."""

    experts: int
    shared: int
    router: int
    exchange_buffers: int

    @property
    def weights(self) -> int:
        return self.experts + self.shared + self.router


def weight_bytes(config: MoEConfig, expert_parallel: int = 1) -> dict[str, int]:
    """Bytes per device of each parameter group (``experts`` split over the expert axis)."""
    from moe_jax.layer import param_template  # noqa: PLC0415 (the layer loads the kernels)

    if config.num_experts % expert_parallel:
        raise ValueError(f"expert_parallel: {expert_parallel} does not divide num_experts = {config.num_experts}")
    out = {}
    for group, leaves in param_template(config).items():
        total = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(leaves))
        out[group] = total // expert_parallel if group == "experts" else total
    return out


def exchange_buffer_bytes(config: MoEConfig, exchange: str, tokens_per_device: int, expert_parallel: int) -> int:
    """The largest buffers ``exchange`` holds at once for ``tokens_per_device`` tokens (bf16 rows
    of ``H``; float32 partial sums where the exchange reduces them). The senders' own sorted rows
    are not counted."""
    t, k, h, d = tokens_per_device, config.top_k, config.hidden_size, expert_parallel
    row = h * 2
    match exchange:
        case "none":  # the rows sorted by expert, and their outputs
            return 2 * t * k * row
        case "allgather":  # every device's tokens, and their float32 partial sums
            return d * t * (row + h * 4)
        case "ragged" | "padded":  # the receive buffer, both ways, at the dropless worst case
            return 2 * worst_case_received(t, k, d, config.num_experts // d) * row
        case "onecopy":  # ragged's expanded rows both ways, plus the copies received and their float32 sums
            return 2 * worst_case_received(t, k, d, config.num_experts // d) * row + \
                worst_case_tokens_received(t, d) * (row + h * 4)
        case _:
            raise ValueError(f"exchange: {exchange!r}, expected one of 'none', 'allgather', 'ragged', 'onecopy', "
                             "'padded'")


def layer_memory(config: MoEConfig, *, exchange: str, tokens_per_device: int, expert_parallel: int) -> LayerMemory:
    weights = weight_bytes(config, expert_parallel)
    return LayerMemory(experts=weights["experts"], shared=weights.get("shared", 0), router=weights["router"],
                       exchange_buffers=exchange_buffer_bytes(config, exchange, tokens_per_device, expert_parallel))


def report(config: MoEConfig, *, exchange: str, tokens_per_device: int, expert_parallel: int, moe_layers: int,
           device_kind: str | None, device_memory: int | None = None) -> str:
    """The lines ``moe-jax explain`` prints: per layer, for the model's ``moe_layers``, headroom."""
    m = layer_memory(config, exchange=exchange, tokens_per_device=tokens_per_device, expert_parallel=expert_parallel)
    capacity = device_memory if device_memory is not None else device_memory_bytes(device_kind)
    e_local = config.num_experts // expert_parallel

    def gb(n):
        return f"{n / GB:.2f} GB"

    lines = [f"memory per device ({moe_layers} MoE layer{'s' if moe_layers != 1 else ''}; weights as stored, "
             f"{config.weight_format} experts):",
             f"  routed experts   {gb(m.experts)} a layer ({e_local} of {config.num_experts} experts), "
             f"{gb(m.experts * moe_layers)} in all",
             f"  shared expert    {gb(m.shared)} a layer, {gb(m.shared * moe_layers)} in all",
             f"  router           {gb(m.router)} a layer, {gb(m.router * moe_layers)} in all",
             f"  exchange buffers {gb(m.exchange_buffers)} at most ({exchange}, {tokens_per_device} tokens per device, "
             "dropless worst case; one layer at a time)"]
    total = m.weights * moe_layers + m.exchange_buffers
    if capacity is None:
        lines.append(f"  total            {gb(total)}; memory of {device_kind or 'this device'} unknown "
                     "(pass --device-memory-gb)")
    else:
        left = capacity - total
        lines.append(f"  total            {gb(total)} of {gb(capacity)} nominal: "
                     + (f"{gb(left)} left for attention, KV cache and activations" if left >= 0
                        else f"does NOT fit: {gb(-left)} short before attention, KV cache and activations"))
    return "\n".join(lines)
