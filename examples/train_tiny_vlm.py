"""Train a tiny vision-language model on an image-text lake: pixels and tokens from one loader.

    .venv/bin/python examples/train_tiny_vlm.py --workdir /tmp/tiny-vlm --steps 120
    .venv/bin/python examples/train_tiny_vlm.py --workdir /tmp/tiny-vlm --steps 200 --resume

The lake is built (once, in ``--workdir``) from the demo image corpus (``lakeloader.demo.images``:
real photos, logos and icons shipped with matplotlib and Pillow-made images, as WebDataset tars of
captioned images), with ``interleaved.images: stored`` and a ``patches`` resolution: every image
is resized to a grid of 8 x 8 patches keeping its aspect (at most 32 patches) and takes one
placeholder token per patch, counted from its stored size when the lake is planned.

Each batch holds ``pixel_patches`` [rows, max_patches, 8*8*3] (uint8: the feed moves bytes, the
model normalises on the device), ``patch_image`` and ``patch_grid``; the row's image placeholder
tokens are its patches in order, so the model puts the patch embedding of patch ``j`` of a row
(a linear map of its pixels plus an embedding of its grid position) in place of the row's
``j``-th placeholder token. A two-layer causal transformer (the layers of
``examples/train_tiny_lm.py``) then predicts the caption; the loss (cross entropy on the text,
``loss_mask``) falls as it learns which caption goes with which picture.

Every ``--checkpoint-every`` steps the parameters, optimizer state and the loader's state are
saved in ``--workdir``; ``--resume`` continues from the latest, and an interrupted run sees the
same batches and losses as an uninterrupted one, bitwise.
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import yaml
from jax.sharding import Mesh, PartitionSpec

sys.path.insert(0, str(Path(__file__).parent))
from train_tiny_lm import D_MODEL, NUM_HEADS, attention, init_params, make_optimizer, rms_norm, rope  # noqa: E402

from lakeloader import JaxFeed  # noqa: E402

PATCH = 8
RESOLUTION = {"kind": "patches", "patch_size": PATCH, "min_pixels": 16 * PATCH * PATCH,
              "max_pixels": 32 * PATCH * PATCH, "max_patches": 32}
MAX_GRID = 32   # grid positions embedded per axis
# Pixel normalisation, on the device: uint8 in the batch.
PIXEL_MEAN, PIXEL_STD = 127.5, 64.0


def make_lake(workdir: Path, copies: int = 4) -> Path:
    """The config of the example's lake in ``workdir``, the corpus written and the lake built if
    not there yet."""
    from lakeloader.demo.images import write_image_corpus
    from lakeloader.ingest.driver import build

    config = workdir / "vlm.yaml"
    if not config.exists():
        files = write_image_corpus(workdir / "data", copies=copies)
        config.write_text(yaml.safe_dump({
            "lake": str(workdir / "lake"), "tokenizer": str(Path(__file__).parents[1] / "demo" / "tokenizer.json"),
            "datasets": {"captions": {"sources": [str(p) for p in files["tar"]], "format": "interleaved",
                                      "interleaved": {"images": "stored", "max_images": 2, "resolution": RESOLUTION}}},
            "build": {"split_size": "256KB", "workers": 1},
            "loader": {"seq_len": 96, "batch_size": 8, "packing": "pack", "shuffle": {"kind": "full"}, "seed": 0},
        }, sort_keys=False))
        build(config, progress=False)
    return config


def init_vlm(key: jax.Array, vocab_size: int) -> dict[str, Any]:
    """The tiny LM's parameters plus a patch embedding (pixels and grid position)."""
    k_lm, k_patch, k_grid = jax.random.split(key, 3)
    params = init_params(k_lm, vocab_size)
    normal = jax.nn.initializers.normal(0.02)
    params["patch"] = normal(k_patch, (PATCH * PATCH * 3, D_MODEL), jnp.float32)
    params["grid"] = normal(k_grid, (2, MAX_GRID, D_MODEL), jnp.float32)
    return params


def embed(params: dict[str, Any], batch: dict[str, jax.Array], image_token: int) -> jax.Array:
    """Token embeddings [B, L, D] with each image placeholder replaced by its patch's embedding."""
    x = params["embed"][batch["input_ids"]]
    pixels = (batch["pixel_patches"].astype(jnp.float32) - PIXEL_MEAN) / PIXEL_STD   # normalised on the device
    grid = jnp.clip(batch["patch_grid"], 0, MAX_GRID - 1)
    patches = pixels @ params["patch"] + params["grid"][0][grid[..., 0]] + params["grid"][1][grid[..., 1]]
    is_image = batch["input_ids"] == image_token
    which = jnp.clip(jnp.cumsum(is_image, axis=1) - 1, 0, patches.shape[1] - 1)   # j-th placeholder: patch j
    placed = jnp.take_along_axis(patches, which[..., None], axis=1)
    return jnp.where(is_image[..., None], placed, x)


def loss_fn(params: dict[str, Any], batch: dict[str, jax.Array], image_token: int) -> jax.Array:
    """Mean cross entropy over the tokens with ``loss_mask`` set."""
    x = embed(params, batch, image_token)
    b, length, _ = x.shape
    head = D_MODEL // NUM_HEADS
    for layer in params["layers"]:
        h = rms_norm(x, layer["attn_norm"])
        q, k, v = (t.reshape(b, length, NUM_HEADS, head) for t in jnp.split(h @ layer["wqkv"], 3, axis=-1))
        q, k = rope(q, batch["positions"]), rope(k, batch["positions"])
        x = x + attention(q, k, v, batch["segment_ids"]).reshape(b, length, D_MODEL) @ layer["wo"]
        x = x + jax.nn.gelu(rms_norm(x, layer["mlp_norm"]) @ layer["w_up"]) @ layer["w_down"]
    logits = rms_norm(x, params["final_norm"]) @ params["embed"].T
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    mask = batch["loss_mask"]
    return jnp.sum(losses * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=120, help="total steps of the run")
    parser.add_argument("--checkpoint-every", type=int, default=40)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--losses-out", type=Path, help="write {step: loss} as JSON")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    config = make_lake(args.workdir)

    mesh = Mesh(np.array(jax.devices()), ("data",))
    with JaxFeed(config, mesh, PartitionSpec("data", None)) as feed:
        image_token = int(feed.loader.tokenizer.token_to_id("<|image|>"))
        optimizer = make_optimizer(args.learning_rate, warmup_steps=10)
        params = init_vlm(jax.random.PRNGKey(0), feed.vocab_size)
        opt_state = optimizer.init(params)
        start, losses = 0, {}
        checkpoint = args.workdir / "checkpoint.pkl"
        if args.resume and checkpoint.exists():
            saved = pickle.loads(checkpoint.read_bytes())
            params, opt_state, losses = saved["params"], saved["opt_state"], saved["losses"]
            start = saved["loader"]["step"]
            batches = feed.restore(saved["loader"])
        else:
            batches = feed.iter_from(0)

        @jax.jit
        def train_step(params: Any, opt_state: Any, batch: dict[str, jax.Array]) -> tuple[Any, Any, jax.Array]:
            loss, grads = jax.value_and_grad(loss_fn)(params, batch, image_token)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        for step in range(start, args.steps):
            batch = {k: v for k, v in next(batches).items() if not isinstance(v, np.ndarray)}   # (image_refs stay home)
            params, opt_state, loss = train_step(params, opt_state, batch)
            losses[step] = float(loss)
            if step % 20 == 0 or step == args.steps - 1:
                print(f"step {step}: loss {losses[step]:.4f}", flush=True)
            if (step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps:
                checkpoint.write_bytes(pickle.dumps({
                    "params": jax.device_get(params), "opt_state": jax.device_get(opt_state), "losses": losses,
                    "loader": feed.state(step + 1)}))
        batches.close()
    print(f"trained steps {start}..{args.steps - 1}")
    if args.losses_out:
        args.losses_out.write_text(json.dumps({str(k): v for k, v in sorted(losses.items())}))


if __name__ == "__main__":
    main()
