"""Loader start-up: open + first batch at step 10 and at step 100,000, in a fresh process, for every
shuffle kind (none, window, block, full), B=64, L=2048 (target: < 150 ms together).

Builds (once) a single-dataset lake of the benchmark corpus (``--size bench``: 120 MB of sources,
about 35 M tokens; ``--size demo`` for a quick, smaller one), then for each case starts a new Python
process that imports lakeloader (not timed), opens a ``Loader`` and reads one batch at the step
(timed apart), three times; prints medians and the load average of the machine.

    .venv/bin/python benchmarks/loader_start.py [--size bench|demo] [--verify checksum|size]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml
from _common import OUT, REPO, report

BATCH, SEQ = 64, 2048
KINDS = ("none", "window", "block", "full")
STEPS = (10, 100_000)
ROUNDS = 3


def lake_config(size: str, verify: str, kind: str, row_group_tokens: int = 1 << 20) -> Path:
    """The config of the benchmark lake (built once) with shuffle ``kind``."""
    from lakeloader.demo.corpus import prepare_corpus
    from lakeloader.ingest.driver import build

    corpus = prepare_corpus(OUT / f"{size}-corpus", size=size)   # type: ignore[arg-type]
    name = f"{size}" if row_group_tokens == 1 << 20 else f"{size}-rg{row_group_tokens}"
    path = OUT / f"start-{name}-{verify}-{kind}.yaml"
    path.write_text(yaml.safe_dump({
        "lake": str(OUT / f"start-{name}-lake"), "tokenizer": str(REPO / "demo" / "tokenizer.json"),
        "datasets": {"code": {"sources": [str(p) for p in corpus["code"]]}},
        "build": {"split_size": "8MB" if size == "bench" else "1MB",   # demo: ~10 chunks, not 2
                  "row_group_tokens": row_group_tokens},
        "loader": {"seq_len": SEQ, "batch_size": BATCH, "verify": verify, "prefetch": 0,
                   "shuffle": {"kind": kind, "window_chunks": 4, "block_size": 64, "window_blocks": 8}},
    }))
    if kind == KINDS[0]:
        build(str(path), progress=False)
    return path


def measure(config: str, step: int) -> None:
    """In a fresh process: seconds to open a Loader and to read its first batch at ``step``."""
    started = time.perf_counter()
    from lakeloader.feed.loader import Loader
    imported = time.perf_counter()
    loader = Loader(config)
    opened = time.perf_counter()
    batch = loader.batch(step)
    done = time.perf_counter()
    assert batch["input_ids"].shape == (BATCH, SEQ)
    loader.close()
    print(json.dumps({"import": imported - started, "open": opened - imported, "first": done - opened}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=("bench", "demo"), default="bench")
    parser.add_argument("--verify", choices=("checksum", "size"), default="checksum")
    parser.add_argument("--row-group-tokens", type=int, default=1 << 20,
                        help="build.row_group_tokens of the lake (a first batch decodes whole row groups)")
    parser.add_argument("--measure", nargs=2, metavar=("CONFIG", "STEP"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        measure(args.measure[0], int(args.measure[1]))
        return
    configs = {kind: lake_config(args.size, args.verify, kind, args.row_group_tokens) for kind in KINDS}
    figures: dict[str, object] = {"size": args.size, "verify": args.verify, "row_group_tokens": args.row_group_tokens,
                                  "batch": BATCH, "seq_len": SEQ}
    for kind in KINDS:
        for step in STEPS:
            runs = []
            for _ in range(ROUNDS):
                out = subprocess.run([sys.executable, __file__, "--measure", str(configs[kind]), str(step)],
                                     check=True, capture_output=True, text=True).stdout
                runs.append(json.loads(out.strip().splitlines()[-1]))
            opened = statistics.median(r["open"] for r in runs)
            first = statistics.median(r["first"] for r in runs)
            total = statistics.median(r["open"] + r["first"] for r in runs)
            figures[f"{kind} step {step:,}: open + first batch ms"] = round(total * 1000, 1)
            figures[f"{kind} step {step:,}: open / first batch ms"] = f"{opened * 1000:.1f} / {first * 1000:.1f}"
    figures["loadavg"] = Path("/proc/loadavg").read_text().strip() if Path("/proc/loadavg").exists() else "n/a"
    report("loader_start", figures)


if __name__ == "__main__":
    main()
