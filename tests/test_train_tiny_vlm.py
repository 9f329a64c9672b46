"""examples/train_tiny_vlm.py end to end: a tiny VLM trained on a lake of real images learns from
pixels and tokens of one loader, and a run stopped at a checkpoint and resumed sees the same
batches and losses, bitwise."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from conftest import REPO

SCRIPT = REPO / "examples" / "train_tiny_vlm.py"
STEPS, STOP = 30, 10


def train(workdir: Path, steps: int, *args: str) -> dict[str, float]:
    """Run the example's main in this process (JAX already imported: no second start-up)."""
    out = workdir / f"losses-{steps}.json"
    spec = importlib.util.spec_from_file_location("train_tiny_vlm", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", [str(SCRIPT), "--workdir", str(workdir), "--steps", str(steps),
                                    "--checkpoint-every", str(STOP), "--losses-out", str(out), *args])
        module.main()
    return json.loads(out.read_text())


def test_the_loss_falls_and_a_resumed_run_is_exact(tmp_path: Path) -> None:
    whole = train(tmp_path, STEPS)
    assert len(whole) == STEPS
    first, last = whole["0"], sum(whole[str(s)] for s in range(STEPS - 5, STEPS)) / 5
    assert last < first / 2, whole
    (tmp_path / "checkpoint.pkl").unlink()
    train(tmp_path, STOP)
    resumed = train(tmp_path, STEPS, "--resume")
    assert resumed == whole
