"""Train a tiny decoder-only transformer LM on a lake, data parallel, with resumable checkpoints.

    .venv/bin/python examples/train_tiny_lm.py --config configs/demo.yaml --steps 200 \\
        --seq-len 128 --checkpoint-dir /tmp/tiny-lm --checkpoint-every 50
    .venv/bin/python examples/train_tiny_lm.py --config configs/demo.yaml --steps 300 \\
        --seq-len 128 --checkpoint-dir /tmp/tiny-lm --checkpoint-every 50 --resume

On CPU the cost of a step is set by the tokens per batch, not by the (tiny) model: the softmax
over the 8192-token vocabulary and the [L, L] attention scores dominate. With the demo's
16 x 512 batches two CPU cores manage about 2 steps/s (200 steps: ~1.5-2 minutes);
``--seq-len 128`` (a derived config, with its own fingerprint) runs 200 steps in ~20 s.

Plain JAX + optax, no model library. Batches come from ``JaxFeed`` as global ``jax.Array``s
sharded along the batch axis over a ``data`` mesh axis of all devices (run with
XLA_FLAGS=--xla_force_host_platform_device_count=8 for eight CPU devices); parameters and
optimizer state are replicated and the gradient all-reduce is inserted by XLA.

Packed rows hold several documents: attention is causal *within* a document (``segment_ids``)
and rotary position embeddings use the per-document ``positions``; the loss is cross entropy
weighted by ``loss_mask``. The loss is also logged per dataset of the mixture, from the batch's
``dataset_ids`` (each row's dataset position in the mixture) and the per-row sums the loss is
made of: no extra pass.

Every ``--checkpoint-every`` steps (and at the last step) an Orbax ``CheckpointManager`` saves
the train state (parameters + optimizer state) and the loader state (a small JSON dict).
``--resume`` restores the latest checkpoint and continues the batch stream from the saved loader
state, so an interrupted run and an uninterrupted one see the same batches and losses.
``--steps`` is the total number of steps of the run (a resumed run stops at the same step).

``--eval-every N`` runs the config's evaluation pass every N steps and at the end (its
``evaluation`` section, or a pass over the mixture's datasets; ``--eval-batches K``: its first K
batches only) and logs the validation loss per dataset: the pass's ``dataset_ids`` label its
rows, and its padding rows (``example_mask`` 0) carry no loss tokens.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from lakeloader import JaxFeed, LakeloaderError, dataset_names, load_config

log = logging.getLogger("train_tiny_lm")

# The model: 0.62M parameters with the demo's 8192-token vocabulary (0.52M of them the tied
# embedding).
D_MODEL = 64
NUM_HEADS = 4
NUM_LAYERS = 2
D_FF = 4 * D_MODEL
ROPE_BASE = 10_000.0

FIELDS = ("input_ids", "targets", "loss_mask", "segment_ids", "positions", "dataset_ids")

# -- model ---------------------------------------------------------------------------------------


def init_params(key: jax.Array, vocab_size: int) -> dict[str, Any]:
    """Parameters of a pre-norm transformer with tied input/output embeddings."""
    keys = jax.random.split(key, 1 + 4 * NUM_LAYERS)
    normal = jax.nn.initializers.normal(0.02)
    out_std = 0.02 / math.sqrt(2 * NUM_LAYERS)  # GPT-2 style scaling of residual projections
    layers = []
    for i in range(NUM_LAYERS):
        k_qkv, k_o, k_up, k_down = keys[1 + 4 * i:5 + 4 * i]
        layers.append({
            "attn_norm": jnp.ones((D_MODEL,), jnp.float32),
            "wqkv": normal(k_qkv, (D_MODEL, 3 * D_MODEL), jnp.float32),
            "wo": jax.random.normal(k_o, (D_MODEL, D_MODEL), jnp.float32) * out_std,
            "mlp_norm": jnp.ones((D_MODEL,), jnp.float32),
            "w_up": normal(k_up, (D_MODEL, D_FF), jnp.float32),
            "w_down": jax.random.normal(k_down, (D_FF, D_MODEL), jnp.float32) * out_std,
        })
    return {"embed": normal(keys[0], (vocab_size, D_MODEL), jnp.float32), "layers": layers,
            "final_norm": jnp.ones((D_MODEL,), jnp.float32)}


def rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def rope(x: jax.Array, positions: jax.Array) -> jax.Array:
    """Rotary embedding of ``x`` [B, L, H, Dh] at per-token ``positions`` [B, L]."""
    half = x.shape[-1] // 2
    freqs = ROPE_BASE ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions[..., None].astype(jnp.float32) * freqs  # [B, L, half]
    sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """Causal attention within documents: query i sees key j iff j <= i and both have the same
    segment id. q, k, v: [B, L, H, Dh]."""
    length, head_dim = q.shape[1], q.shape[-1]
    causal = jnp.tril(jnp.ones((length, length), bool))
    mask = (causal[None] & (segment_ids[:, :, None] == segment_ids[:, None, :]))[:, None]
    q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))  # [B, H, L, Dh]
    scores = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(head_dim))
    scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    return (jax.nn.softmax(scores, axis=-1) @ v).transpose(0, 2, 1, 3)


def hidden_states(params: dict[str, Any], input_ids: jax.Array, segment_ids: jax.Array,
                  positions: jax.Array) -> jax.Array:
    """Final normalized hidden states [B, L, D] (logits are ``h @ embed.T``)."""
    batch, length = input_ids.shape
    head_dim = D_MODEL // NUM_HEADS
    x = params["embed"][input_ids]
    for layer in params["layers"]:
        h = rms_norm(x, layer["attn_norm"])
        q, k, v = jnp.split(h @ layer["wqkv"], 3, axis=-1)
        q, k, v = (t.reshape(batch, length, NUM_HEADS, head_dim) for t in (q, k, v))
        q, k = rope(q, positions), rope(k, positions)
        x = x + attention(q, k, v, segment_ids).reshape(batch, length, D_MODEL) @ layer["wo"]
        h = rms_norm(x, layer["mlp_norm"])
        x = x + jax.nn.gelu(h @ layer["w_up"]) @ layer["w_down"]
    return rms_norm(x, params["final_norm"])


def forward(params: dict[str, Any], input_ids: jax.Array, segment_ids: jax.Array,
            positions: jax.Array) -> jax.Array:
    """Logits [B, L, V] (for inspection; training never materializes them all at once)."""
    return hidden_states(params, input_ids, segment_ids, positions) @ params["embed"].T


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def row_cross_entropy(h: jax.Array, embed: jax.Array, targets: jax.Array, weights: jax.Array,
                      chunk: int) -> jax.Array:
    """Per row, ``sum(weights * cross_entropy(h @ embed.T, targets))`` [B], computed ``chunk``
    positions of every row at a time, never holding the whole [B, L, V] logits (on CPU,
    streaming those through memory costs more than the matmuls); the backward pass recomputes
    each chunk's logits. h: [B, L, D], embed: [V, D], targets/weights: [B, L]."""
    return _ce_forward(h, embed, targets, weights, chunk)[0]


def chunked_cross_entropy(h: jax.Array, embed: jax.Array, targets: jax.Array, weights: jax.Array,
                          chunk: int) -> jax.Array:
    """``sum(weights * cross_entropy(h @ embed.T, targets))``: the sum of :func:`row_cross_entropy`."""
    return jnp.sum(row_cross_entropy(h, embed, targets, weights, chunk))


def _chunks(x: jax.Array, chunk: int) -> jax.Array:
    """[B, L, ...] -> [L // chunk, B, chunk, ...] (the batch axis stays where its sharding is)."""
    b, length = x.shape[:2]
    return jnp.moveaxis(x.reshape(b, length // chunk, chunk, *x.shape[2:]), 1, 0)


def _ce_forward(h, embed, targets, weights, chunk):
    def body(total, xs):
        hb, tb, wb = xs
        logits = hb @ embed.T
        top = jax.lax.stop_gradient(logits.max(-1, keepdims=True))
        lse = jnp.log(jnp.exp(logits - top).sum(-1)) + top[..., 0]
        target = jnp.take_along_axis(logits, tb[..., None], -1)[..., 0]
        return total + jnp.sum(wb * (lse - target), axis=-1), lse

    total, lse = jax.lax.scan(body, jnp.zeros(h.shape[:1], h.dtype),
                              (_chunks(h, chunk), _chunks(targets, chunk), _chunks(weights, chunk)))
    return total, (h, embed, targets, weights, lse)


def _ce_backward(chunk, residuals, grad):
    h, embed, targets, weights, lse = residuals

    def body(d_embed_t, xs):
        hb, tb, wb, lb = xs
        probs = jnp.exp(hb @ embed.T - lb[..., None])
        d_logits = (probs - jax.nn.one_hot(tb, embed.shape[0], dtype=probs.dtype)) * (grad[:, None] * wb)[..., None]
        # d_embed^T = h^T @ d_logits keeps both products in plain (untransposed) layouts.
        flat_h, flat_d = hb.reshape(-1, hb.shape[-1]), d_logits.reshape(-1, embed.shape[0])
        return d_embed_t + flat_h.T @ flat_d, d_logits @ embed

    d_embed_t, d_h = jax.lax.scan(body, jnp.zeros((h.shape[-1], embed.shape[0]), h.dtype),
                                  (_chunks(h, chunk), _chunks(targets, chunk), _chunks(weights, chunk), lse))
    d_h = jnp.moveaxis(d_h, 0, 1).reshape(h.shape)
    return d_h, d_embed_t.T, None, None


row_cross_entropy.defvjp(_ce_forward, _ce_backward)


def loss_fn(params: dict[str, Any], batch: dict[str, jax.Array], chunk: int,
            num_datasets: int) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """Mean cross entropy over the tokens with ``loss_mask`` set, and per dataset of the mixture
    (by the batch's ``dataset_ids``) the summed cross entropy and the number of loss tokens: the
    per-row sums the loss is made of, grouped, so logging loss per dataset costs nothing more."""
    h = hidden_states(params, batch["input_ids"], batch["segment_ids"], batch["positions"])
    mask = batch["loss_mask"]
    total = jnp.maximum(jnp.sum(mask), 1.0)
    rows = row_cross_entropy(h, params["embed"], batch["targets"], mask / total, chunk)
    ids = batch["dataset_ids"]   # -1 (eval padding) falls outside the segments and is dropped
    sums = jax.ops.segment_sum(jax.lax.stop_gradient(rows) * total, ids, num_datasets)
    tokens = jax.ops.segment_sum(jnp.sum(mask, axis=1), ids, num_datasets)
    return jnp.sum(rows), (sums, tokens)


def evaluate(eval_step: Any, params: dict[str, Any], feed: JaxFeed, names: tuple[str, ...],
             batches: int | None) -> dict[str, float]:
    """Validation loss per dataset of the evaluation pass (its first ``batches`` batches when
    given): summed cross entropy over loss tokens, dataset by dataset."""
    total = feed.loader.num_batches() or 0
    count = total if batches is None else min(batches, total)
    sums, tokens = np.zeros(len(names)), np.zeros(len(names))
    for _, batch in zip(range(count), feed.iter_from(0)):
        found = jax.device_get(eval_step(params, {name: batch[name] for name in FIELDS}))
        sums += np.asarray(found[0], np.float64)
        tokens += np.asarray(found[1], np.float64)
    return {name: sums[i] / tokens[i] for i, name in enumerate(names) if tokens[i]}


def loss_chunk(seq_len: int, rows_per_device: int, tokens: int = 256) -> int:
    """Largest divisor of ``seq_len`` giving each device at most ``tokens`` positions per chunk."""
    return max(c for c in range(1, seq_len + 1) if seq_len % c == 0 and (c * rows_per_device <= tokens or c == 1))


# -- training ------------------------------------------------------------------------------------


def make_optimizer(learning_rate: float, warmup_steps: int) -> optax.GradientTransformation:
    """AdamW with linear warmup to a constant rate: the schedule does not depend on ``--steps``,
    so a run stopped early and resumed follows the same schedule as an uninterrupted one."""
    schedule = optax.linear_schedule(0.0, learning_rate, max(1, warmup_steps))
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.98, weight_decay=0.01))


def batch_digest(array: jax.Array) -> str:
    """SHA-256 of this process's rows of a batch array (all of it on one process)."""
    if array.is_fully_addressable:
        data = np.asarray(array)
    else:
        shards = sorted(array.addressable_shards, key=lambda s: s.index[0].start or 0)
        data = np.concatenate([np.asarray(s.data) for s in shards if s.replica_id == 0])
    return hashlib.sha256(np.ascontiguousarray(data).tobytes()).hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/demo.yaml",
                        help="lakeloader config (its loader section sets the batch)")
    parser.add_argument("--steps", type=int, default=200,
                        help="total steps of the run (a resumed run stops here too)")
    parser.add_argument("--checkpoint-dir", type=Path, default=None,
                        help="Orbax checkpoint folder (none: no checkpoints)")
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest checkpoint in --checkpoint-dir")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0, help="parameter initialization seed")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="override loader.seq_len of the config (another fingerprint: resume with the same)")
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--eval-every", type=int, default=0,
                        help="run the evaluation pass every N steps and at the end (0: never)")
    parser.add_argument("--eval-batches", type=int, default=None,
                        help="evaluate on the first K batches of the pass only (default: all of it)")
    parser.add_argument("--losses-out", type=Path, default=None,
                        help='write {"loss": {step: loss}, "input_ids_sha256": {step: digest}, '
                             '"dataset_loss": {step: {dataset: [summed cross entropy, loss tokens]}}, '
                             '"eval_loss": {step: {dataset: loss}}} of the steps run')
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)
    if args.resume and args.checkpoint_dir is None:
        parser.error("--resume needs --checkpoint-dir")

    import orbax.checkpoint as ocp

    mesh = Mesh(np.array(jax.devices()), ("data",))
    replicated = NamedSharding(mesh, PartitionSpec())
    config = load_config(args.config)
    if args.seq_len is not None:
        config = config.model_copy(update={"loader": config.loader.model_copy(update={"seq_len": args.seq_len})})
    with JaxFeed(config, mesh, PartitionSpec("data")) as feed:
        loader = feed.config.loader
        if loader.batch_size % mesh.size:
            raise SystemExit(f"loader.batch_size {loader.batch_size} must be a multiple of the {mesh.size} devices")
        vocab_size = feed.vocab_size   # the lake's tokenizer's, special tokens included
        optimizer = make_optimizer(args.learning_rate, args.warmup_steps)
        chunk = loss_chunk(loader.seq_len, loader.batch_size // mesh.size)
        names = dataset_names(feed.config)   # batch["dataset_ids"] are positions in this list

        def init(key: jax.Array) -> dict[str, Any]:
            params = init_params(key, vocab_size)
            return {"params": params, "opt_state": optimizer.init(params)}

        def train_step(state: dict[str, Any], batch: dict[str, jax.Array]) -> tuple[dict[str, Any], jax.Array, Any]:
            (loss, per_dataset), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                state["params"], batch, chunk, len(names))
            updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
            return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, loss, per_dataset

        evaluation = JaxFeed(config, mesh, PartitionSpec("data"), mode="eval") if args.eval_every else None
        eval_names = evaluation.loader.dataset_names if evaluation is not None else ()
        eval_losses: dict[int, dict[str, float]] = {}

        def eval_step(params: dict[str, Any], batch: dict[str, jax.Array]) -> Any:
            assert evaluation is not None
            size = evaluation.config.loader
            return loss_fn(params, batch, loss_chunk(size.seq_len, size.batch_size // mesh.size), len(eval_names))[1]

        eval_fn = jax.jit(eval_step)

        def run_evaluation(step: int) -> None:
            assert evaluation is not None
            eval_losses[step] = evaluate(eval_fn, state["params"], evaluation, eval_names, args.eval_batches)
            log.info("step %d: validation loss per dataset: %s", step,
                     ", ".join(f"{name} {loss:.4f}" for name, loss in eval_losses[step].items()))

        # Fixed shardings in and out: a fresh and a restored state run the very same program.
        state = jax.jit(init, out_shardings=replicated)(jax.random.key(args.seed))
        step_fn = jax.jit(train_step, in_shardings=(replicated, feed.sharding),
                          out_shardings=(replicated, replicated, replicated))
        num_params = sum(x.size for x in jax.tree.leaves(state["params"]))
        log.info("model: %d layers, d_model %d, %d heads, vocab %d: %.2fM parameters; %d x %s devices; "
                 "batch %d x %d; fingerprint %s", NUM_LAYERS, D_MODEL, NUM_HEADS, vocab_size, num_params / 1e6,
                 mesh.size, jax.devices()[0].platform, loader.batch_size, loader.seq_len, feed.fingerprint)

        manager = None
        start = 0
        loader_state = feed.state(0)
        if args.checkpoint_dir is not None:
            options = ocp.CheckpointManagerOptions(max_to_keep=3, create=True)
            manager = ocp.CheckpointManager(args.checkpoint_dir.resolve(), options=options,
                                            item_names=("state", "loader"))
            latest = manager.latest_step()
            if not args.resume and latest is not None:
                raise SystemExit(f"{args.checkpoint_dir} already holds checkpoints (latest: step {latest}); pass "
                                 "--resume to continue from it, or choose an empty --checkpoint-dir")
            if args.resume:
                if latest is None:
                    log.warning("--resume: no checkpoint in %s; starting from step 0", args.checkpoint_dir)
                else:
                    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
                    restored = manager.restore(latest, args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(target), loader=ocp.args.JsonRestore()))
                    state, loader_state = restored.state, restored.loader
                    start = int(loader_state["step"])
                    if start != latest:
                        raise SystemExit(f"checkpoint {latest} holds loader state for step {start}")
                    log.info("resumed from checkpoint %d in %s (loader state %s)", latest, args.checkpoint_dir,
                             loader_state)

        def save(step: int) -> None:
            manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                       loader=ocp.args.JsonSave(feed.state(step))), force=True)
            log.info("checkpoint %d saved", step)

        losses: dict[int, jax.Array] = {}
        per_dataset: dict[int, Any] = {}   # step -> (summed cross entropy, loss tokens) per dataset
        digests: dict[int, str] = {}
        pending: list[int] = []
        compiled_at = None
        started = time.perf_counter()
        batches = feed.restore(loader_state)
        try:
            for step, batch in zip(range(start, args.steps), batches):
                if args.losses_out is not None:
                    digests[step] = batch_digest(batch["input_ids"])
                state, loss, per_dataset[step] = step_fn(state, {name: batch[name] for name in FIELDS})
                losses[step] = loss
                pending.append(step)
                if compiled_at is None:
                    jax.block_until_ready(loss)
                    compiled_at = time.perf_counter()
                done = step + 1
                if done % args.log_every == 0 or done == args.steps:
                    values = jax.device_get([(losses[s], per_dataset[s]) for s in pending])
                    for s, (value, (sums, tokens)) in zip(pending, values):
                        losses[s] = float(value)
                        per_dataset[s] = (np.asarray(sums, np.float64), np.asarray(tokens, np.float64))
                    pending = []
                    steps_logged = range(max(start, done - args.log_every), done)
                    window = [losses[s] for s in steps_logged]
                    sums = np.sum([per_dataset[s][0] for s in steps_logged], axis=0)
                    tokens = np.sum([per_dataset[s][1] for s in steps_logged], axis=0)
                    by_dataset = ", ".join(f"{name} {sums[i] / tokens[i]:.4f}" if tokens[i] else f"{name} -"
                                           for i, name in enumerate(names))
                    log.info("step %d/%d: loss %.4f (mean of the last %d steps: %.4f; per dataset: %s)", done,
                             args.steps, losses[step], len(window), float(np.mean(window)), by_dataset)
                if manager is not None and (done % args.checkpoint_every == 0 or done == args.steps):
                    save(done)
                if evaluation is not None and (done % args.eval_every == 0 or done == args.steps):
                    run_evaluation(done)
        finally:
            batches.close()
            if evaluation is not None:
                evaluation.close()
            if manager is not None:
                manager.wait_until_finished()
                manager.close()
        finished = time.perf_counter()

    ran = sorted(losses)
    for s in pending:
        losses[s] = float(losses[s])
        per_dataset[s] = tuple(np.asarray(x, np.float64) for x in jax.device_get(per_dataset[s]))
    if args.losses_out is not None and jax.process_index() == 0:
        dataset_loss = {str(s): {name: [float(per_dataset[s][0][i]), float(per_dataset[s][1][i])]
                                 for i, name in enumerate(names)} for s in ran}
        args.losses_out.write_text(json.dumps({"loss": {str(s): losses[s] for s in ran},
                                               "input_ids_sha256": {str(s): digests[s] for s in ran},
                                               "dataset_loss": dataset_loss,
                                               "eval_loss": {str(s): v for s, v in eval_losses.items()}}, indent=1))
    if ran:
        first_loss = float(np.mean([losses[s] for s in ran[:10]]))
        last_loss = float(np.mean([losses[s] for s in ran[-10:]]))
        timed = len(ran) - 1
        rate = timed / (finished - compiled_at) if timed and compiled_at else float("nan")
        tokens = loader.batch_size * loader.seq_len
        print(f"trained steps {ran[0]}..{ran[-1]} ({len(ran)} steps, {num_params / 1e6:.2f}M params, "
              f"{mesh.size} devices): loss {first_loss:.3f} (mean of first 10) -> {last_loss:.3f} "
              f"(mean of last 10); {rate:.2f} steps/s, {rate * tokens:,.0f} tokens/s after compilation "
              f"({compiled_at - started:.1f}s to the first step); total {finished - started:.1f}s")
    else:
        print(f"nothing to train: already at step {start} of {args.steps}")


if __name__ == "__main__":
    try:
        main()
    except LakeloaderError as exc:  # e.g. resuming with another config: say why, without a traceback
        raise SystemExit(f"error: {exc}") from None
