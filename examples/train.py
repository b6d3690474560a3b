"""Fine-tune a small Kimi-shaped MoE layer with Flax NNX and optax on synthetic data.

The layer learns to imitate a "teacher": the same layer with its expert weights perturbed
by 50% noise, so the relative error starts near 0.4 and falls steadily. The
auxiliary load-balance loss keeps the experts evenly used. Runs on CPU in about a minute:

    python examples/train.py --steps 100
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import moe_jax


def main(argv=None) -> tuple[float, float]:
    """Returns the relative mse of the first and the last step."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--aux-weight", type=float, default=1e-2)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)

    config = moe_jax.MoEConfig.kimi_k2(num_experts=16, top_k=4, hidden_size=128, expert_intermediate_size=64,
                                       dtype="float32")
    student = moe_jax.MoE(config, rngs=nnx.Rngs(2), training=True)
    params = student.params()
    noise = jax.random.split(jax.random.key(1), 2)
    for key, name in zip(noise, ("w_gate_up_egh", "w_down_ehf")):
        w = params["experts"][name]
        params["experts"][name] = w + 0.5 * jnp.std(w) * jax.random.normal(key, w.shape)
    teacher = moe_jax.MoE(config, rngs=nnx.Rngs(0), params=params)
    print(student.plan.report)
    optimizer = nnx.Optimizer(student, optax.adamw(args.lr), wrt=nnx.Param)

    @nnx.jit
    def step(student, optimizer, x):
        target, _ = teacher(x)

        def loss_fn(model):
            y, stats = model(x)
            mse = jnp.mean((y - target) ** 2) / jnp.mean(target**2)
            return mse + args.aux_weight * stats["load_balance_loss"], (mse, stats)

        (_, (mse, stats)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(student)
        optimizer.update(student, grads)
        return mse, stats

    key = jax.random.key(0)
    history = []
    for i in range(args.steps):
        key, sub = jax.random.split(key)
        mse, stats = step(student, optimizer, jax.random.normal(sub, (args.tokens, config.hidden_size)))
        history.append(float(mse))
        if i % max(args.steps // 10, 1) == 0 or i == args.steps - 1:
            load = stats["tokens_per_expert"]
            print(f"step {i:4d}  relative mse {float(mse):.4f}  balance loss {float(stats['load_balance_loss']):.3f}"
                  f"  expert load {int(load.min())}..{int(load.max())}")
    return history[0], history[-1]


if __name__ == "__main__":
    main()
