"""Digests of the batches every loader combination makes on the bundled demo corpora: a guard
for refactors that must keep batches bitwise identical.

    python scripts/batch_digests.py --write digests.json      # record
    python scripts/batch_digests.py --check digests.json      # compare (exit 1 on a difference)

One lake of every task format and one of plain text (small splits, so that shuffles cross many
chunks) are built under ``--work``; each combination of packing, shuffle kind, ordering, mode,
process count and worker count reads 6 steps, and its digest is the sha256 of every field of
every batch (name, dtype, shape, bytes) in order. A combination the loader refuses records its
error instead.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from lakeloader import Loader, LakeloaderError, build_lake

ROOT = Path(__file__).resolve().parents[1]
STEPS = 6

FORMATS = {
    "code": {"sources": [str(ROOT / "demo/data/code/*.jsonl")], "format": "fim", "fim": {"rate": 0.5, "spm_rate": 0.5}},
    "chat": {"sources": [str(ROOT / "demo/data/formats/chat/*.jsonl")], "format": "chat",
             "chat": {"roles": ["system", "user", "assistant"], "loss_roles": ["assistant"]}},
    "sft": {"sources": [str(ROOT / "demo/data/formats/sft/*.jsonl")], "format": "supervised",
            "supervised": {"separator": "<|sep|>"}},
    "pages": {"sources": [str(ROOT / "demo/data/formats/pages/*.jsonl")], "format": "interleaved",
              "interleaved": {"image_tokens": 16, "max_images": 4}},
    "web": {"sources": [str(ROOT / "demo/data/docs/*.parquet")]},
}
TEXT = {
    "web": {"sources": [str(ROOT / "demo/data/docs/*.parquet")]},
    "code": {"sources": [str(ROOT / "demo/data/code/*.jsonl")]},
}


def _config(work: Path, lake: str, datasets: dict[str, Any], loader: dict[str, Any], unit: str) -> Path:
    weights = {name: round(1 / len(datasets), 6) for name in datasets}
    raw = {"lake": str(work / lake), "tokenizer": str(ROOT / "demo/tokenizer.json"), "datasets": datasets,
           "build": {"split_size": "64KB"},
           "loader": {"seq_len": 128, "batch_size": 8, "prefetch": 0, **loader},
           "mixture": {"unit": unit, "weights": weights}}
    name = lake + "-" + "-".join(f"{k}={v}" for k, v in sorted(_flat(loader).items())) + ".yaml"
    path = work / name
    path.write_text(yaml.safe_dump(raw))
    return path


def _flat(loader: dict[str, Any]) -> dict[str, Any]:
    return {k: (v["kind"] if isinstance(v, dict) else v) for k, v in loader.items()}


def _digest(batches: list[dict[str, Any]]) -> str:
    h = hashlib.sha256()
    for batch in batches:
        for key in sorted(batch):
            value = np.ascontiguousarray(np.asarray(batch[key]))
            if value.dtype == object:
                h.update(f"{key}:{value.tolist()!r}".encode())
                continue
            h.update(f"{key}:{value.dtype}:{value.shape}".encode())
            h.update(value.tobytes())
    return h.hexdigest()


def _read(config: Path, mode: str, processes: int) -> str:
    try:
        loaders = [Loader(config, process_index=p, process_count=processes, mode=mode) for p in range(processes)]
    except LakeloaderError as error:
        return f"refused: {error}"
    try:
        steps = range(STEPS) if mode == "train" else range(min(STEPS, loaders[0].num_batches() or STEPS))
        batches = []
        for step in steps:
            parts = [loader.batch(step) for loader in loaders]
            batches.append({k: (np.concatenate([p[k] for p in parts]) if np.asarray(parts[0][k]).ndim
                                else parts[0][k]) for k in parts[0]})
        return _digest(batches)
    except LakeloaderError as error:
        return f"refused: {error}"
    finally:
        for loader in loaders:
            loader.close()


def _combinations(work: Path) -> dict[str, tuple[Path, str, int]]:
    out: dict[str, tuple[Path, str, int]] = {}
    shuffles = [{"kind": "none"}, {"kind": "window", "window_chunks": 3}, {"kind": "block", "block_size": 16,
                "window_blocks": 4}, {"kind": "full"}]
    for packing, shuffle in itertools.product(["pack", "pad"], shuffles):
        config = _config(work, "formats", FORMATS, {"packing": packing, "shuffle": shuffle}, "tokens")
        out[f"formats {packing} {shuffle['kind']} train P1"] = (config, "train", 1)
        out[f"formats {packing} {shuffle['kind']} train P2"] = (config, "train", 2)
    for packing in ["pack", "pad"]:
        config = _config(work, "formats", FORMATS, {"packing": packing}, "tokens")
        out[f"formats {packing} eval P1"] = (config, "eval", 1)
        out[f"formats {packing} eval P2"] = (config, "eval", 2)
        workers = _config(work, "formats", FORMATS, {"packing": packing, "shuffle": {"kind": "full"},
                                                     "workers": 2}, "tokens")
        out[f"formats {packing} full train P1 workers2"] = (workers, "train", 1)
    for shuffle, ordering in [*itertools.product(shuffles, ["global"]), (shuffles[0], "strided")]:
        config = _config(work, "text", TEXT, {"packing": "concat", "shuffle": shuffle, "ordering": ordering},
                         "examples")
        out[f"text concat {shuffle['kind']} {ordering} train P1"] = (config, "train", 1)
        out[f"text concat {shuffle['kind']} {ordering} train P2"] = (config, "train", 2)
    for packing in ["concat", "pack", "pad"]:
        config = _config(work, "text", TEXT, {"packing": packing}, "examples")
        out[f"text {packing} eval P1"] = (config, "eval", 1)
        workers = _config(work, "text", TEXT, {"packing": packing, "shuffle": {"kind": "window"}, "workers": 2},
                          "examples")
        out[f"text {packing} window train P2 workers2"] = (workers, "train", 2)
    return out


def digests(work: Path) -> dict[str, str]:
    """The digest of every combination (building the two lakes under ``work`` first if needed)."""
    work.mkdir(parents=True, exist_ok=True)
    if not (ROOT / "demo/data/formats").exists():
        subprocess.run([sys.executable, "-m", "lakeloader.demo.formats", "prepare", str(ROOT / "demo/data")], check=True)
    combinations = _combinations(work)
    built: set[tuple[str, str]] = set()
    for config, _, _ in combinations.values():   # once per packing: the build keeps each packing's counts
        lake, packing = config.name.split("-")[0], yaml.safe_load(config.read_text())["loader"]["packing"]
        if (lake, packing) not in built:
            build_lake(config, workers=2, progress=False)
            built.add((lake, packing))
    return {name: _read(config, mode, processes) for name, (config, mode, processes) in combinations.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/lakeloader-digests"))
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", type=Path)
    group.add_argument("--check", type=Path)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    found = digests(args.work)
    if args.write:
        args.write.write_text(json.dumps(found, indent=1) + "\n")
        print(f"{len(found)} digests written to {args.write}")
        return 0
    expected = json.loads(args.check.read_text())
    differ = sorted(k for k in expected.keys() | found.keys() if expected.get(k) != found.get(k))
    for name in differ:
        print(f"DIFFERS {name}: {expected.get(name)} -> {found.get(name)}")
    print(f"{len(found) - len(differ)} of {len(found)} combinations identical")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
