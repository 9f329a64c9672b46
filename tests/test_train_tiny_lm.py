"""examples/train_tiny_lm.py end to end: a tiny LM trained on a real lake learns, and a run
stopped at a checkpoint and resumed sees the same batches and the same losses, bitwise."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lakeloader.feed.loader import Loader

from conftest import REPO, Lakes, stdlib_texts

SCRIPT = REPO / "examples" / "train_tiny_lm.py"
STEPS, STOP, EVERY = 60, 40, 20


@pytest.fixture(scope="module")
def lake_config(lakes: Lakes, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return lakes.copy(
        tmp_path_factory.mktemp("tinylm"),
        {"code.jsonl": stdlib_texts("json") + stdlib_texts("email", limit=20),
         "notes.txt": "".join(f"{line}\n" for t in stdlib_texts("email", limit=20)
                              for line in t.splitlines() if line.strip())},
        {"code": {"sources": ["code.jsonl"]}, "notes": {"sources": ["notes.txt"]}},
        build={"split_size": "32KB"},
        loader={"seq_len": 64, "batch_size": 8, "shuffle": {"kind": "full"}, "seed": 1},
        mixture={"weights": {"code": 0.8, "notes": 0.2}})


def train(config: Path, out: Path, *args: str) -> tuple[dict[str, Any], str]:
    """Run the example; returns its --losses-out JSON and its output."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--config", str(config), "--checkpoint-every", str(EVERY),
         "--log-every", "10", "--seed", "0", "--losses-out", str(out), *args],
        check=False, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text()), proc.stdout + proc.stderr


def checkpoints(folder: Path) -> list[int]:
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit())


@pytest.fixture(scope="module")
def uninterrupted(lake_config: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("uninterrupted")
    result, output = train(lake_config, tmp / "losses.json", "--steps", str(STEPS),
                           "--checkpoint-dir", str(tmp / "ckpt"))
    assert checkpoints(tmp / "ckpt") == [20, 40, 60], output
    assert "trained steps 0..59" in output and "loss" in output
    return result


def test_the_loss_falls(uninterrupted: dict[str, Any]) -> None:
    losses = [uninterrupted["loss"][str(s)] for s in range(STEPS)]
    assert all(np.isfinite(losses))
    first, last = np.mean(losses[:10]), np.mean(losses[-10:])
    assert first > 8.0  # ~log(8192) at initialization
    assert last < first - 1.5, (first, last, losses)


def test_the_loss_is_logged_per_dataset_from_dataset_ids(uninterrupted: dict[str, Any], lake_config: Path) -> None:
    with Loader(lake_config) as loader:
        for step in (0, 1, 37, STEPS - 1):
            batch = loader.batch(step)
            per_dataset = uninterrupted["dataset_loss"][str(step)]
            assert list(per_dataset) == ["code", "notes"]
            tokens = [batch["loss_mask"][batch["dataset_ids"] == i].sum() for i in range(2)]
            assert [t for _, t in per_dataset.values()] == tokens, step
            # The per-dataset sums make up the step's loss (the mean over all loss tokens).
            summed = sum(s for s, _ in per_dataset.values()) / sum(tokens)
            np.testing.assert_allclose(summed, uninterrupted["loss"][str(step)], rtol=1e-5)
    seen = {name for step in uninterrupted["dataset_loss"].values() for name, (_, t) in step.items() if t}
    assert seen == {"code", "notes"}


def test_the_example_trains_on_the_loaders_batches(uninterrupted: dict[str, Any], lake_config: Path) -> None:
    with Loader(lake_config) as loader:
        for step in (0, 1, 37, STEPS - 1):
            digest = hashlib.sha256(np.ascontiguousarray(loader.batch(step)["input_ids"]).tobytes()).hexdigest()[:16]
            assert uninterrupted["input_ids_sha256"][str(step)] == digest, step


def test_stop_and_resume_gives_the_same_batches_and_losses(
        uninterrupted: dict[str, Any], lake_config: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    first, _ = train(lake_config, tmp_path / "first.json", "--steps", str(STOP), "--checkpoint-dir", str(ckpt))
    assert sorted(map(int, first["loss"])) == list(range(STOP))
    assert checkpoints(ckpt) == [20, 40]
    resumed, output = train(lake_config, tmp_path / "resumed.json", "--steps", str(STEPS),
                            "--checkpoint-dir", str(ckpt), "--resume")
    assert "resumed from checkpoint 40" in output, output[-3000:]
    assert sorted(map(int, resumed["loss"])) == list(range(STOP, STEPS))  # no step repeated or skipped
    assert checkpoints(ckpt) == [20, 40, 60]
    for step in range(STEPS):
        run = first if step < STOP else resumed
        # Same batches, and (CPU XLA being deterministic) bitwise the same losses.
        assert run["input_ids_sha256"][str(step)] == uninterrupted["input_ids_sha256"][str(step)], step
        assert run["loss"][str(step)] == uninterrupted["loss"][str(step)], step
    # Nothing left to do: a resume at the end trains no step.
    again, output = train(lake_config, tmp_path / "again.json", "--steps", str(STEPS),
                          "--checkpoint-dir", str(ckpt), "--resume")
    assert again["loss"] == {} and "nothing to train" in output


def test_a_fresh_run_refuses_a_folder_with_checkpoints(lake_config: Path, tmp_path: Path) -> None:
    (tmp_path / "ckpt" / "20").mkdir(parents=True)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--config", str(lake_config), "--steps", "1",
                           "--checkpoint-dir", str(tmp_path / "ckpt")], env=env, capture_output=True, text=True,
                          check=False, timeout=300)
    assert proc.returncode != 0 and "--resume" in proc.stderr


def example_module() -> Any:
    spec = importlib.util.spec_from_file_location("train_tiny_lm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_attention_stays_within_documents() -> None:
    import jax
    import jax.numpy as jnp

    module = example_module()
    forward = jax.jit(module.forward)
    params = module.init_params(jax.random.key(0), 50)
    tokens = jax.random.randint(jax.random.key(1), (1, 12), 0, 50)
    segment_ids = jnp.array([[1] * 5 + [2] * 7])
    positions = jnp.array([list(range(5)) + list(range(7))])
    logits = forward(params, tokens, segment_ids, positions)
    # The second document packed after the first = the second document alone at the row start.
    alone = forward(params, tokens[:, 5:], segment_ids[:, 5:] - 1, positions[:, 5:])
    np.testing.assert_allclose(logits[:, 5:], alone, atol=1e-5)
    # Changing a token of the first document changes nothing in the second; a later token of the
    # second document changes nothing before it.
    changed = forward(params, tokens.at[0, 2].add(1), segment_ids, positions)
    np.testing.assert_array_equal(changed[:, 5:], logits[:, 5:])
    assert not np.allclose(changed[:, 2:5], logits[:, 2:5])
    later = forward(params, tokens.at[0, 9].add(1), segment_ids, positions)
    np.testing.assert_array_equal(later[:, :9], logits[:, :9])
    assert not np.allclose(later[:, 9:], logits[:, 9:])


def test_chunked_cross_entropy_matches_optax() -> None:
    import jax
    import jax.numpy as jnp
    import optax

    module = example_module()
    keys = jax.random.split(jax.random.key(0), 4)
    h = jax.random.normal(keys[0], (2, 12, 8))
    embed = jax.random.normal(keys[1], (50, 8))
    targets = jax.random.randint(keys[2], (2, 12), 0, 50)
    weights = jax.random.uniform(keys[3], (2, 12)) * (jnp.arange(12) < 9)

    def reference(h: jax.Array, embed: jax.Array) -> jax.Array:
        return jnp.sum(weights * optax.softmax_cross_entropy_with_integer_labels(h @ embed.T, targets))

    want, want_grads = jax.jit(jax.value_and_grad(reference, argnums=(0, 1)))(h, embed)
    for chunk in (1, 4, 12):
        loss = functools.partial(module.chunked_cross_entropy, targets=targets, weights=weights, chunk=chunk)
        got, got_grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(h, embed)
        np.testing.assert_allclose(got, want, rtol=1e-5)
        for a, b in zip(got_grads, want_grads):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_the_example_reports_validation_loss_per_dataset(lake_config: Path, tmp_path: Path) -> None:
    import yaml

    raw = yaml.safe_load(lake_config.read_text())
    raw["evaluation"] = {"datasets": ["notes", "code"], "batch_size": 64}
    config = lake_config.parent / "with_evaluation.yaml"
    config.write_text(yaml.safe_dump(raw, sort_keys=False))
    result, output = train(config, tmp_path / "losses.json", "--steps", "10", "--eval-every", "5")
    assert set(result["eval_loss"]) == {"5", "10"}, output
    for losses in result["eval_loss"].values():
        assert set(losses) == {"notes", "code"} and all(0 < v < 20 for v in losses.values())
    assert "validation loss per dataset: notes" in output
