"""Resuming a run with a history of mixture revisions, next to resuming one without.

Builds (once) a lake of 10 small datasets of standard-library sources, then two runs of batch 64,
seq_len 512 under a window shuffle: one never edited, over all 10 datasets, and one started on 5
whose config was revised 9 times (every 10 steps: weights redrawn, a dataset added or left out),
so that its state at step 100 holds 10 revisions over 10 datasets. Measured, alternating the two, each the median of ``--repeats`` fresh
processes' worth of work in this process (a fresh Loader every time, caches cold for the
datasets' row groups only in the first round): opening the loader, taking up the saved state
(``follow``) and building batch 100. Prints both medians, their difference (target: within
10 ms) and the size of each state as JSON.

    .venv/bin/python benchmarks/run_revisions.py [--repeats 9]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sysconfig
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from _common import OUT, report
from lakeloader import Loader, build_lake

PACKAGES = ["json", "email", "zoneinfo", "tomllib", "wsgiref", "html", "http", "urllib", "logging", "xml"]
STEP = 100


def _corpus(root: Path) -> dict[str, Any]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    datasets = {}
    for name in PACKAGES:
        files = sorted((stdlib / name).rglob("*.py")) if (stdlib / name).is_dir() else [stdlib / f"{name}.py"]
        path = root / "data" / f"{name}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as out:
            for f in files:
                text = f.read_text(encoding="utf-8")
                if text.strip():   # (empty __init__.py files are not documents)
                    out.write(json.dumps({"text": text}) + "\n")
        datasets[name] = {"sources": [str(path)]}
    return datasets


def _config(root: Path, name: str, datasets: dict[str, Any], weights: dict[str, float]) -> Path:
    raw = {"lake": str(root / "lake"), "tokenizer": str(Path(__file__).resolve().parents[1] / "demo/tokenizer.json"),
           "datasets": datasets, "build": {"split_size": "64KB"},
           "loader": {"seq_len": 512, "batch_size": 64, "prefetch": 0, "shuffle": {"kind": "window"}},
           "mixture": {"weights": weights}}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _runs(root: Path) -> tuple[tuple[Path, dict[str, Any]], tuple[Path, dict[str, Any]]]:
    """(config, state at STEP) of the run never edited and of the run revised 9 times."""
    datasets = _corpus(root)
    plain = _config(root, "plain", datasets, {n: 1.0 for n in PACKAGES})   # the same 10 datasets to open
    build_lake(plain, workers=2, progress=False)
    with Loader(plain) as loader:
        plain_state = loader.state(STEP)
    rng = np.random.default_rng(0)
    weights = {n: 1.0 for n in PACKAGES[:5]}
    config = _config(root, "revision0", datasets, weights)
    with Loader(config) as loader:
        state = loader.state(0)
    for revision in range(1, 10):
        names = list(weights)
        unused = [n for n in PACKAGES if n not in weights]
        if revision % 3 == 0 or not unused:
            del weights[names[int(rng.integers(len(names)))]]
        else:
            weights[unused[-1]] = 1.0
        weights = {n: float(rng.integers(1, 5)) for n in weights}
        config = _config(root, f"revision{revision}", datasets, weights)
        with Loader(config) as loader:
            loader.follow({**state, "step": revision * 10}, continue_changes=True)
            state = loader.state(STEP)
    return (plain, plain_state), (config, state)


def _resume(config: Path, state: dict[str, Any]) -> float:
    start = time.perf_counter()
    with Loader(config) as loader:
        loader.batch(loader.follow(state))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    root = OUT / "run_revisions"
    (plain, plain_state), (revised, revised_state) = _runs(root)
    assert len(revised_state["run"]["revisions"]) == 10, revised_state["run"]["revisions"]
    assert len(revised_state["run"]["names"]) == 10, revised_state["run"]["names"]
    _resume(plain, plain_state), _resume(revised, revised_state)   # (row groups decoded once, cached on disk)
    plain_times, revised_times = [], []
    for _ in range(args.repeats):
        plain_times.append(_resume(plain, plain_state))
        revised_times.append(_resume(revised, revised_state))
    a, b = statistics.median(plain_times), statistics.median(revised_times)
    report("run_revisions", {
        "open + follow + batch 100, no edits (ms)": a * 1e3,
        "open + follow + batch 100, 10 revisions x 10 datasets (ms)": b * 1e3,
        "difference (ms, target <= 10)": (b - a) * 1e3,
        "state bytes, no edits": len(json.dumps(plain_state)),
        "state bytes, 10 revisions": len(json.dumps(revised_state)),
        "load average": os.getloadavg()[0],
    })


if __name__ == "__main__":
    main()
