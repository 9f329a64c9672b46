"""Resuming a run with a history of mixture revisions, next to resuming one without.

Builds a lake of 10 small datasets of standard-library sources, then two runs of batch 64,
seq_len 512 under a window shuffle: one never edited, over all 10 datasets, and one started on 5
whose config was revised 9 times (every 10 steps: weights redrawn, a dataset added or left out),
so that its state at step 100 holds 10 revisions over 10 datasets. A second lake takes the same
history, except that at revision 5 files are added to the dataset ``json`` (the build grows its
plan), beside a run of its final plan never edited. Measured, alternating the four, each the
median of ``--repeats`` fresh processes' worth of work in this process (a fresh Loader every
time, caches cold for the datasets' row groups only in the first round): opening the loader,
taking up the saved state (``follow``) and building batch 100. Prints the medians, the
differences to the run never edited on the same lake (target: within 10 ms) and the size of
each state as JSON.

    .venv/bin/python benchmarks/run_revisions.py [--repeats 9]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
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
GROWS = "json"   # the dataset that grows in the second lake


def _write(path: Path, files: list[Path]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for f in files:
            text = f.read_text(encoding="utf-8")
            if text.strip():   # (empty __init__.py files are not documents)
                out.write(json.dumps({"text": text}) + "\n")


def _package(name: str) -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted((stdlib / name).rglob("*.py")) if (stdlib / name).is_dir() else [stdlib / f"{name}.py"]


def _corpus(root: Path, grows: bool) -> dict[str, Any]:
    """The 10 datasets; with ``grows``, ``json`` a folder holding the first half of its files."""
    datasets = {}
    for name in PACKAGES:
        files = _package(name)
        path = root / "data" / f"{name}.jsonl"
        if grows and name == GROWS:
            path = root / "data" / name / "0.jsonl"
            files = files[: len(files) // 2]
        _write(path, files)
        datasets[name] = {"sources": [str(path.parent / "*.jsonl") if grows and name == GROWS else str(path)]}
    return datasets


def _config(root: Path, name: str, datasets: dict[str, Any], weights: dict[str, float]) -> Path:
    raw = {"lake": str(root / "lake"), "tokenizer": str(Path(__file__).resolve().parents[1] / "demo/tokenizer.json"),
           "datasets": datasets, "build": {"split_size": "64KB"},
           "loader": {"seq_len": 512, "batch_size": 64, "prefetch": 0, "shuffle": {"kind": "window"}},
           "mixture": {"weights": weights}}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _runs(root: Path, grows: bool) -> tuple[tuple[Path, dict[str, Any]], tuple[Path, dict[str, Any]]]:
    """(config, state at STEP) of the run never edited and of the run revised 9 times (with
    ``grows``, files added to dataset ``json`` at revision 5), over a lake built afresh."""
    shutil.rmtree(root, ignore_errors=True)
    datasets = _corpus(root, grows)
    plain = _config(root, "plain", datasets, {n: 1.0 for n in PACKAGES})   # the same 10 datasets to open
    build_lake(plain, workers=2, progress=False)
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
        if grows and revision == 5:
            files = _package(GROWS)
            _write(root / "data" / GROWS / "1.jsonl", files[len(files) // 2 :])
            build_lake(config, workers=2, progress=False)
        with Loader(config) as loader:
            loader.follow({**state, "step": revision * 10}, continue_changes=True)
            state = loader.state(STEP)
    with Loader(plain) as loader:   # (of the lake's final plans)
        plain_state = loader.state(STEP)
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
    (plain, plain_state), (revised, revised_state) = _runs(OUT / "run_revisions", grows=False)
    (grown_plain, grown_plain_state), (grown, grown_state) = _runs(OUT / "run_revisions_grown", grows=True)
    assert len(revised_state["run"]["revisions"]) == 10, revised_state["run"]["revisions"]
    assert len(revised_state["run"]["names"]) == 10, revised_state["run"]["names"]
    assert list(grown_state["run"]["growth"]) == [GROWS], grown_state["run"]
    runs = {"plain": (plain, plain_state), "revised": (revised, revised_state),
            "grown plain": (grown_plain, grown_plain_state), "grown": (grown, grown_state)}
    for config, state in runs.values():   # (row groups decoded once, cached on disk)
        _resume(config, state)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, (config, state) in runs.items():
            times[name].append(_resume(config, state))
    ms = {name: statistics.median(found) * 1e3 for name, found in times.items()}
    report("run_revisions", {
        "open + follow + batch 100, no edits (ms)": ms["plain"],
        "open + follow + batch 100, 10 revisions x 10 datasets (ms)": ms["revised"],
        "difference (ms, target <= 10)": ms["revised"] - ms["plain"],
        "second lake, no edits (ms)": ms["grown plain"],
        "second lake, 10 revisions, json grown at revision 5 (ms)": ms["grown"],
        "difference, grown (ms, target <= 10)": ms["grown"] - ms["grown plain"],
        "state bytes, no edits": len(json.dumps(plain_state)),
        "state bytes, 10 revisions": len(json.dumps(revised_state)),
        "state bytes, 10 revisions and a growth": len(json.dumps(grown_state)),
        "load average": os.getloadavg()[0],
    })


if __name__ == "__main__":
    main()
