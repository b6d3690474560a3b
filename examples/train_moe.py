"""Train a small Mixture-of-Experts language model, expert-parallel over every visible device.

The model: a token and a learned position embedding, ``--layers`` pre-norm blocks (causal
multi-head self-attention, then a ``moe_jax.MoE`` layer with sigmoid routing and DeepSeek-V3's
selection bias), a final RMSNorm and an unembedding. It trains with ``optax.adamw`` under
``nnx.jit`` on synthetic data made here (nothing is downloaded): a fixed random Markov chain
over ``--vocab`` tokens, each context (the ``--order`` previous tokens) followed by one of
three successors. Its entropy rate, at most log(3), is far below ``log(vocab)``, so the loss
falls clearly; ``--order 2`` and more make the attention matter (and the task slower to learn).

Load balancing is auxiliary-loss-free by default: after each step every layer's correction
bias moves by ``--bias-rate`` against its load (``MoE.update_load_balance``). ``--aux-weight``
and ``--z-weight`` add the Switch-Transformer load-balance loss and ST-MoE's router z-loss.
``--qat`` trains the experts' bf16 masters through their NVFP4 quantization, made inside ``jit``
every step (``MoEConfig(weight_format="nvfp4", qat=True)``).

Devices: a mesh ``(data, expert)`` over all visible devices of this host (``--devices N``: the
first N); the expert axis is the largest count dividing both the devices and ``--experts``, the
batch is split over every device. The layer plan (``moe-jax explain``'s report) is printed
once: on GPUs ``--expert-gemm auto`` picks the Pallas kernels where they can train. Checkpoints
(orbax) hold the model, the optimizer state and the step; the batch of step i is a pure
function of ``(--seed, i)``, so that step is the data iterator's whole state and a resumed run
repeats an uninterrupted one exactly.

    python examples/train_moe.py --steps 200 --plot loss.png                  # CPU, under a minute
    python examples/train_moe.py --checkpoint-dir ckpt --save-every 50        # then add --resume
    python examples/train_moe.py --layers 8 --hidden 1024 --heads 16 --experts 64 --top-k 8 \\
        --expert-hidden 512 --vocab 4096 --seq-len 512 --batch 64 --lr 1e-3 --steps 2000  # GPUs
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

import moe_jax
from moe_jax.cli import positive_float, positive_int

#: Successors per context of the Markov chain: its entropy rate is at most log(3) nats.
BRANCHING = 3
#: Flags that fix the model and the data; a checkpoint resumes only with the same values.
SHAPE_FLAGS = ("layers", "hidden", "heads", "experts", "top_k", "expert_hidden", "vocab", "order", "seq_len", "batch",
               "dtype", "seed", "scoring")


# --- data ---

class MarkovChain:
    """A fixed random Markov chain of order ``order`` over ``vocab`` tokens.

    Each context (the ``order`` previous tokens) has ``BRANCHING`` successors, drawn
    independently (so now and then the same twice), with Dirichlet(1) probabilities.
    ``batch(step)`` draws ``[B, L]`` int32 tokens from a generator seeded by ``(seed, step)``:
    no state to carry, so resuming at a step is exact.
    """

    def __init__(self, vocab: int, order: int, seed: int):
        rng = np.random.default_rng([seed, 0xDA7A])
        self.vocab, self.order, self.seed = vocab, order, seed
        contexts = (vocab,) * order
        self.next_cb = rng.integers(0, vocab, (*contexts, BRANCHING), dtype=np.int32)
        self.cum_cb = np.cumsum(rng.dirichlet(np.ones(BRANCHING), size=contexts), axis=-1)

    def entropy_rate(self) -> float:
        """The mean entropy of the next token given its context, in nats (contexts weighted
        uniformly; a repeated successor makes the true figure lower): about the floor of the
        loss after the first ``order`` positions."""
        p_cb = np.diff(self.cum_cb, axis=-1, prepend=0.0)
        return float(-np.mean(np.sum(p_cb * np.log(np.maximum(p_cb, 1e-30)), axis=-1)))

    def batch(self, step: int, batch: int, seq_len: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, step])
        tokens_bl = np.empty((batch, seq_len), np.int32)
        tokens_bl[:, :self.order] = rng.integers(0, self.vocab, (batch, self.order))
        for i in range(self.order, seq_len):
            context = tuple(tokens_bl[:, i - self.order:i].T)
            choice = np.sum(rng.random(batch)[:, None] > self.cum_cb[context][:, :-1], axis=-1)
            tokens_bl[:, i] = self.next_cb[context][np.arange(batch), choice]
        return tokens_bl


# --- model ---

class CausalSelfAttention(nnx.Module):
    """Multi-head causal self-attention, ``x [B, L, D] -> [B, L, D]``."""

    def __init__(self, hidden: int, heads: int, dtype, *, rngs: nnx.Rngs):
        self.heads = heads
        self.qkv = nnx.Linear(hidden, 3 * hidden, use_bias=False, dtype=dtype, rngs=rngs)
        self.out = nnx.Linear(hidden, hidden, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x_bld: jax.Array) -> jax.Array:
        b, l, d = x_bld.shape
        q_blnc, k_blnc, v_blnc = jnp.split(self.qkv(x_bld).reshape(b, l, self.heads, 3 * (d // self.heads)), 3, -1)
        a_blnc = jax.nn.dot_product_attention(q_blnc, k_blnc, v_blnc, is_causal=True)
        return self.out(a_blnc.reshape(b, l, d)).astype(x_bld.dtype)


class Block(nnx.Module):
    """Pre-norm residual block: attention, then the MoE layer. Returns ``(x, moe stats)``."""

    def __init__(self, config: moe_jax.MoEConfig, heads: int, mesh: Mesh | None, *, rngs: nnx.Rngs):
        d = config.hidden_size
        self.attention_norm = nnx.RMSNorm(d, rngs=rngs)
        self.attention = CausalSelfAttention(d, heads, jnp.dtype(config.dtype), rngs=rngs)
        self.moe_norm = nnx.RMSNorm(d, rngs=rngs)
        self.moe = moe_jax.MoE(config, rngs=rngs, mesh=mesh, training=True)

    def __call__(self, x_bld: jax.Array) -> tuple[jax.Array, dict]:
        x_bld = x_bld + self.attention(self.attention_norm(x_bld))
        y_bld, stats = self.moe(self.moe_norm(x_bld))
        return x_bld + y_bld.astype(x_bld.dtype), stats


class MoELM(nnx.Module):
    """``tokens [B, L] int32 -> (logits [B, L, V] float32, [stats of each MoE layer])``.

    The residual stream, the norms and the unembedding are float32; attention and the MoE
    layers compute in ``config.dtype``.
    """

    def __init__(self, config: moe_jax.MoEConfig, *, layers: int, heads: int, vocab: int, seq_len: int,
                 mesh: Mesh | None, rngs: nnx.Rngs):
        d = config.hidden_size
        self.token_embed = nnx.Embed(vocab, d, embedding_init=nnx.initializers.normal(1.0), rngs=rngs)
        self.position_embed = nnx.Embed(seq_len, d, embedding_init=nnx.initializers.normal(0.1), rngs=rngs)
        self.blocks = nnx.List([Block(config, heads, mesh, rngs=rngs) for _ in range(layers)])
        self.final_norm = nnx.RMSNorm(d, rngs=rngs)
        # Separate from the embedding and zero to start: the first loss is exactly log(vocab).
        # (Tied, each token's own embedding dominates its residual stream, so the first logits
        # would all favour repeating the current token, by about sqrt(D).)
        self.unembed = nnx.Linear(d, vocab, use_bias=False, kernel_init=nnx.initializers.zeros, rngs=rngs)

    def __call__(self, tokens_bl: jax.Array) -> tuple[jax.Array, list[dict]]:
        x_bld = self.token_embed(tokens_bl) + self.position_embed(jnp.arange(tokens_bl.shape[1]))[None]
        stats = []
        for block in self.blocks:
            x_bld, block_stats = block(x_bld)
            stats.append(block_stats)
        return self.unembed(self.final_norm(x_bld)).astype(jnp.float32), stats


# --- set-up ---

def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    arg = parser.add_argument
    arg("--steps", type=positive_int, default=200, help="training steps in all (a resumed run stops there too)")
    arg("--layers", type=positive_int, default=2)
    arg("--hidden", type=positive_int, default=64, help="model width D = the MoE layers' hidden size H")
    arg("--heads", type=positive_int, default=4, help="attention heads (must divide --hidden)")
    arg("--experts", type=positive_int, default=8, help="routed experts per MoE layer")
    arg("--top-k", type=positive_int, default=2, help="experts per token")
    arg("--expert-hidden", type=positive_int, default=64, help="each expert's SwiGLU width F")
    arg("--scoring", choices=("sigmoid", "softmax"), default="sigmoid", help="router scores (default: DeepSeek-V3's)")
    arg("--vocab", type=positive_int, default=32)
    arg("--order", type=positive_int, default=1, help="tokens of context of the Markov chain (2 and more need "
                                                      "the attention, and learn slower)")
    arg("--seq-len", type=positive_int, default=32)
    arg("--batch", type=positive_int, default=32, help="sequences per step over all devices (a multiple of them)")
    arg("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="attention and MoE activations")
    arg("--expert-gemm", default="auto", help="the MoE layers' expert_gemm (auto: Pallas kernels on GPUs)")
    arg("--qat", action="store_true", help="NVFP4 quantization-aware training: the routed experts' bf16 masters run "
                                           "through their NVFP4 quantization every step (MoEConfig.qat)")
    arg("--lr", type=positive_float, default=3e-3)
    arg("--bias-rate", type=positive_float, default=1e-2,
        help="correction-bias step of the auxiliary-loss-free balancing (DeepSeek-V3 used 1e-3 over a long run; "
             "short runs balance sooner with 1e-2)")
    arg("--no-bias-update", action="store_true", help="leave the correction biases at zero")
    arg("--aux-weight", type=positive_float, help="add this times the load-balance loss of each layer")
    arg("--z-weight", type=positive_float, help="add this times the router z-loss of each layer (ST-MoE: 1e-3)")
    arg("--devices", type=positive_int, help="use the first N visible devices (default: all)")
    arg("--seed", type=int, default=0, help="model initialization and data")
    arg("--log-every", type=positive_int, default=10, help="steps between progress-bar updates of the loss")
    arg("--plot", type=pathlib.Path, help="save the loss curve (and expert load) as an image here")
    arg("--checkpoint-dir", type=pathlib.Path, help="save orbax checkpoints here")
    arg("--save-every", type=positive_int, help="steps between checkpoints (with --checkpoint-dir; the last "
                                               "step is always saved)")
    arg("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir")
    args = parser.parse_args(argv)

    available = len(jax.devices())
    if args.devices is not None and args.devices > available:
        parser.error(f"--devices: {args.devices}, but only {available} devices are visible")
    devices = args.devices or available
    if args.hidden % args.heads:
        parser.error(f"--heads: {args.heads} does not divide --hidden {args.hidden}")
    if args.top_k > args.experts:
        parser.error(f"--top-k: {args.top_k}, expected at most --experts = {args.experts}")
    if args.batch % devices:
        parser.error(f"--batch: {args.batch}, expected a multiple of the {devices} devices")
    if args.seq_len <= args.order:
        parser.error(f"--seq-len: {args.seq_len}, expected more than --order = {args.order}")
    if args.vocab**args.order > 2**24:
        parser.error(f"--order: {args.order} with --vocab {args.vocab} makes {args.vocab}**{args.order} contexts; "
                     f"expected at most 2**24")
    if (args.save_every is not None or args.resume) and args.checkpoint_dir is None:
        parser.error("--save-every and --resume need --checkpoint-dir")
    if args.resume:
        if latest_step(args.checkpoint_dir) is None:
            parser.error(f"--resume: no checkpoint in {args.checkpoint_dir}")
        saved = read_meta(args.checkpoint_dir)["shape"]
        for name in SHAPE_FLAGS:
            if saved.get(name) != getattr(args, name):
                flag = "--" + name.replace("_", "-")
                parser.error(f"--resume: the checkpoint in {args.checkpoint_dir} has {flag} {saved.get(name)}, "
                             f"this run {getattr(args, name)}")
    args.device_count = devices
    return args


def expert_parallel_mesh(devices: list, num_experts: int, expert_axis: str) -> Mesh | None:
    """A ``(data, expert)`` mesh over ``devices``, or None for one device. The expert axis takes
    the largest count dividing both the devices and the experts; tokens split over both axes.

    Its axes are ``Auto``: the compiler propagates the batch split through the embedding,
    attention and norms (the MoE layers place their own tokens under ``shard_map``). Explicit
    axes, ``sharding.make_mesh``'s default, would need an output sharding on every gather.
    """
    if len(devices) == 1:
        return None
    ep = max(d for d in range(1, len(devices) + 1) if len(devices) % d == 0 and num_experts % d == 0)
    return jax.make_mesh((len(devices) // ep, ep), ("data", expert_axis), devices=devices,
                         axis_types=(AxisType.Auto, AxisType.Auto))


def place_on_mesh(node: nnx.Module | nnx.Optimizer, mesh: Mesh | None) -> None:
    """Puts every variable of ``node`` on ``mesh``, with its spec in one canonical form.

    Variables not on the mesh yet (all but the experts, which ``MoE`` places over the expert
    axis) are replicated. Specs lose trailing ``None``s, the form the step's outputs come back
    in: ``jit`` keys its cache on the spec as written, so ``P('expert', None, None)`` in and
    ``P('expert')`` out would compile the step twice, and a resumed run's first step would not
    run the executable the uninterrupted run used at that step.
    """
    if mesh is None:
        return

    def place(a):
        spec = a.sharding.spec if isinstance(a.sharding, NamedSharding) and a.sharding.mesh == mesh else P()
        entries = list(spec)
        while entries and entries[-1] is None:
            entries.pop()
        return jax.device_put(a, NamedSharding(mesh, P(*entries)))

    nnx.update(node, jax.tree.map(place, nnx.state(node)))


def moe_config(args) -> moe_jax.MoEConfig:
    return moe_jax.MoEConfig(
        num_experts=args.experts, top_k=args.top_k, hidden_size=args.hidden,
        expert_intermediate_size=args.expert_hidden, scoring=args.scoring, router_bias=True, normalize=True,
        dtype=args.dtype, expert_gemm=args.expert_gemm, weight_format="nvfp4" if args.qat else "bf16", qat=args.qat,
    )


# --- checkpoints ---

def checkpoint_manager(directory: pathlib.Path):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(directory.absolute(), options=ocp.CheckpointManagerOptions(max_to_keep=2),
                                 item_names=("model", "optimizer", "meta"))


def latest_step(directory: pathlib.Path) -> int | None:
    if not directory.is_dir():
        return None
    with checkpoint_manager(directory) as manager:
        return manager.latest_step()


def read_meta(directory: pathlib.Path) -> dict:
    """The metadata of the latest checkpoint in ``directory``: step, losses, load imbalance
    and the flags of :data:`SHAPE_FLAGS`."""
    import orbax.checkpoint as ocp

    with checkpoint_manager(directory) as manager:
        return manager.restore(manager.latest_step(), args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]


def save(manager, step: int, model, optimizer, meta: dict) -> None:
    """Saves in the background; the arrays are copied to the host before this returns (orbax's
    default), so the next step may donate their buffers."""
    import orbax.checkpoint as ocp

    manager.save(step, args=ocp.args.Composite(
        model=ocp.args.StandardSave(nnx.state(model)), optimizer=ocp.args.StandardSave(nnx.state(optimizer)),
        meta=ocp.args.JsonSave(meta)))


def restore(manager, model, optimizer) -> dict:
    """Loads the latest checkpoint into ``model`` and ``optimizer`` (each array placed as the
    fresh one's: experts over the expert axis, the rest replicated); returns its metadata."""
    import orbax.checkpoint as ocp

    def abstract(node):
        return jax.tree.map(ocp.utils.to_shape_dtype_struct, nnx.state(node))

    restored = manager.restore(manager.latest_step(), args=ocp.args.Composite(
        model=ocp.args.StandardRestore(abstract(model)), optimizer=ocp.args.StandardRestore(abstract(optimizer)),
        meta=ocp.args.JsonRestore()))
    nnx.update(model, restored["model"])
    nnx.update(optimizer, restored["optimizer"])
    return restored["meta"]


# --- training ---

def make_train_step(args):
    """The jitted step: loss, gradients, the optimizer update, then each layer's bias update.

    Returns ``(cross-entropy float32 [], tokens_per_expert int32 [layers, E])``.
    """
    # Donated: the old parameters and optimizer state are dead once the new ones exist, so at
    # full size they need not be held twice.
    @nnx.jit(donate_argnums=(0, 1))
    def train_step(model: MoELM, optimizer: nnx.Optimizer, tokens_bl: jax.Array):
        def loss_fn(model):
            logits_blv, stats = model(tokens_bl)
            # Next-token prediction. The first --order positions lack their full context and
            # stay in the mean: a constant share of the curve, not a trend.
            ce = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits_blv[:, :-1], tokens_bl[:, 1:]))
            loss = ce
            if args.aux_weight is not None:
                loss = loss + args.aux_weight * sum(s["load_balance_loss"] for s in stats)
            if args.z_weight is not None:
                loss = loss + args.z_weight * sum(s["router_z_loss"] for s in stats)
            return loss, (ce, stats)

        (_, (ce, stats)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads)
        if not args.no_bias_update:
            # The load of the step just taken, summed over the mesh: every device moves the
            # replicated bias identically.
            for block, block_stats in zip(model.blocks, stats):
                block.moe.update_load_balance(block_stats, args.bias_rate)
        return ce, jnp.stack([s["tokens_per_expert"] for s in stats])

    return train_step


def plot(path: pathlib.Path, losses: list[float], imbalance: list[float], entropy_rate: float) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_load) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    ax_loss.plot(np.arange(1, len(losses) + 1), losses, label="cross-entropy")
    ax_loss.axhline(entropy_rate, color="gray", linestyle="--", label="chain entropy rate (approx.)")
    ax_loss.set_ylabel("loss (nats/token)")
    ax_loss.legend()
    ax_load.plot(np.arange(1, len(imbalance) + 1), imbalance, color="tab:orange")
    ax_load.set_ylabel("max / mean expert load\n(worst layer)")
    ax_load.set_xlabel("step")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> list[float]:
    """Trains; returns the cross-entropy of every step, from step 1 (a resumed run included)."""
    args = parse_args(argv)
    devices = jax.devices()[: args.device_count]
    config = moe_config(args)
    mesh = expert_parallel_mesh(devices, config.num_experts, config.expert_axis)
    try:
        model = MoELM(config, layers=args.layers, heads=args.heads, vocab=args.vocab, seq_len=args.seq_len,
                      mesh=mesh, rngs=nnx.Rngs(args.seed))
    except moe_jax.ResolutionError as err:  # e.g. an --expert-gemm that cannot run here
        sys.exit(f"train_moe.py: error: --expert-gemm: {err}")
    place_on_mesh(model, mesh)
    # Clipped at global norm 1, as transformer language models usually are (a guard for large
    # runs; at the default size it changes nothing visible).
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(args.lr))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    place_on_mesh(optimizer, mesh)
    print(model.blocks[0].moe.plan.report)  # every layer has the same plan
    trainable = sum(a.size for a in jax.tree.leaves(nnx.state(model, nnx.Param)))
    print(f"model: {args.layers} layers, {trainable:,} trainable parameters; {len(devices)} x "
          f"{devices[0].device_kind}; {args.batch * args.seq_len} tokens/step")

    data = MarkovChain(args.vocab, args.order, args.seed)
    batch_sharding = NamedSharding(mesh, P(tuple(mesh.axis_names))) if mesh is not None else devices[0]
    losses, imbalance, start = [], [], 0
    manager = checkpoint_manager(args.checkpoint_dir) if args.checkpoint_dir is not None else None
    shape = {name: getattr(args, name) for name in SHAPE_FLAGS}
    if args.resume:  # parse_args checked that the checkpoint has this run's shape
        meta = restore(manager, model, optimizer)
        start, losses, imbalance = meta["step"], meta["losses"], meta["imbalance"]
        print(f"resumed at step {start} from {args.checkpoint_dir}")

    train_step = make_train_step(args)
    pending = []  # device values not yet read: reading each step would stall the device
    with tqdm(total=args.steps, initial=min(start, args.steps), desc="training", file=sys.stderr,
              disable=None) as bar:
        for step in range(start, args.steps):
            tokens_bl = jax.device_put(data.batch(step, args.batch, args.seq_len), batch_sharding)
            pending.append(train_step(model, optimizer, tokens_bl))
            bar.update()
            done = step + 1
            save_now = manager is not None and (done == args.steps or (args.save_every and done % args.save_every == 0))
            if done % args.log_every == 0 or done == args.steps or save_now:
                for ce, loads_le in pending:
                    losses.append(float(ce))
                    loads_le = np.asarray(loads_le, np.float64)
                    imbalance.append(float(np.max(loads_le.max(1) / np.maximum(loads_le.mean(1), 1e-9))))
                pending = []
                bar.set_postfix(loss=f"{losses[-1]:.3f}", load_max_over_mean=f"{imbalance[-1]:.2f}")
            if save_now:
                save(manager, done, model, optimizer,
                     {"step": done, "losses": losses, "imbalance": imbalance, "shape": shape})
    if manager is not None:
        manager.wait_until_finished()
        manager.close()

    first, last = np.mean(losses[:10]), np.mean(losses[-10:])
    print(f"loss: first 10 steps {first:.3f}, last 10 steps {last:.3f} (log vocab {math.log(args.vocab):.3f}, "
          f"chain entropy rate about {data.entropy_rate():.3f}); expert load max/mean {imbalance[-1]:.2f}")
    if args.plot is not None:
        plot(args.plot, losses, imbalance, data.entropy_rate())
        print(f"loss curve: {args.plot}")
    return losses


if __name__ == "__main__":
    main()
