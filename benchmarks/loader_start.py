"""Loader start-up: open + first batch at step 10 and at step 100,000, in a fresh process, for every
shuffle kind (none, window, block, full), B=64, L=2048 (target: < 150 ms together), and as the
lake grows to many chunks (target: flat).

Builds (once) a single-dataset lake of the benchmark corpus (``--size bench``: 120 MB of sources,
about 35 M tokens; ``--size demo`` for a quick, smaller one), then for each case starts a new Python
process that imports lakeloader (not timed), opens a ``Loader`` and reads one batch at the step
(timed apart), three times; prints medians and the load average of the machine. With ``--chunks
N ...`` it measures the same on copies of the lake's catalog grown to N chunks each (the built
chunks repeated: :mod:`lakeloader.demo.many_chunks`; the chunk files are shared).

With ``verify: checksum`` a process hashes each chunk file it opens unless an earlier process on
the machine recorded it unchanged since (:mod:`lakeloader.catalog.hash_records`): by default one
unmeasured run per case comes first, as a resumed run finds the machine; ``--first-on-machine``
clears the records before every run instead, so that each one hashes its files.

    .venv/bin/python benchmarks/loader_start.py [--size bench|demo] [--verify checksum|size]
                                                [--chunks 2000 20000 200000] [--first-on-machine]
                                                [--packing concat|pack|pad] [--baseline OTHER_CHECKOUT]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml
from _common import OUT, REPO, report

BATCH, SEQ = 64, 2048
CACHE = OUT / "start-cache"   # LAKELOADER_CACHE of the measured processes (their hash records)
KINDS = ("none", "window", "block", "full")
STEPS = (10, 100_000)
ROUNDS = 3


def lake_config(size: str, verify: str, kind: str, row_group_tokens: int = 1 << 20, packing: str = "concat") -> Path:
    """The config of the benchmark lake (built once) with shuffle ``kind`` and ``packing``. A built
    lake (one copied to another machine, say) is read as it is: no corpus, no build, no Dask; a
    packing other than concat is registered by a build of its config (no chunk tokenized again)."""
    from lakeloader.demo.corpus import prepare_corpus

    # (Paths of the checkout whose out folder this is: a worktree linking another's reads its lake as
    # that one's configs define it, the corpus and tokenizer paths included.)
    out = OUT.resolve()
    corpus = out / f"{size}-corpus"
    name = f"{size}" if row_group_tokens == 1 << 20 else f"{size}-rg{row_group_tokens}"
    lake = out / f"start-{name}-lake"
    built = (lake / "_catalog" / "CURRENT").exists()
    if not built:
        prepare_corpus(corpus, size=size)   # type: ignore[arg-type]
    packed = "" if packing == "concat" else f"-{packing}"
    path = out / f"start-{name}-{verify}-{kind}{packed}.yaml"
    path.write_text(yaml.safe_dump({
        "lake": str(lake), "tokenizer": str(out.parents[1] / "demo" / "tokenizer.json"),
        "datasets": {"code": {"sources": [str(corpus / "code" / "*.jsonl")]}},
        "build": {"split_size": "8MB" if size == "bench" else "1MB",   # demo: ~10 chunks, not 2
                  "row_group_tokens": row_group_tokens},
        "loader": {"seq_len": SEQ, "batch_size": BATCH, "verify": verify, "prefetch": 0, "packing": packing,
                   "shuffle": {"kind": kind, "window_chunks": 4, "block_size": 64, "window_blocks": 8}},
    }))
    plans = out / f"start-{name}{packed}.registered"
    if kind == KINDS[0] and not (built and (packing == "concat" or plans.exists())):
        from lakeloader.ingest.driver import build  # only to build: a built lake reads without Dask

        build(str(path), progress=False)
        plans.touch()
    return path


def grown_config(config: Path, kind: str, chunks: int) -> Path:
    """``config`` (shuffle ``kind``) on a copy of its lake whose catalog holds ``chunks`` chunks
    (made once per size; the copy links the lake's chunk folders instead of copying them)."""
    from lakeloader.catalog.lake import Lake
    from lakeloader.demo.many_chunks import grow

    settings = yaml.safe_load(config.read_text())
    source = Path(settings["lake"])
    lake = source.with_name(f"{source.name}-{chunks}")
    if kind == KINDS[0]:
        shutil.rmtree(lake, ignore_errors=True)
        lake.mkdir()
        for item in source.iterdir():
            if item.is_dir() and item.name not in ("_catalog", "_tokenizer"):
                os.symlink(item, lake / item.name)
            elif item.is_dir():
                shutil.copytree(item, lake / item.name)
            else:
                shutil.copy(item, lake / item.name)
        grow(Lake(str(lake)), "code", chunks)
    path = config.with_name(f"{config.stem}-{chunks}.yaml")
    path.write_text(yaml.safe_dump({**settings, "lake": str(lake)}))
    return path


def measure(config: str, step: int) -> None:
    """In a fresh process: seconds to open a Loader and to read its first batch at ``step``."""
    started = time.perf_counter()
    from lakeloader.feed.loader import Loader
    imported = time.perf_counter()
    cpu = time.process_time()
    loader = Loader(config)
    opened = time.perf_counter()
    batch = loader.batch(step)
    done = time.perf_counter()
    cpu = time.process_time() - cpu
    assert batch["input_ids"].shape == (BATCH, SEQ)
    loader.close()
    print(json.dumps({"import": imported - started, "open": opened - imported, "first": done - opened, "cpu": cpu}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=("bench", "demo"), default="bench")
    parser.add_argument("--verify", choices=("checksum", "size"), default="checksum")
    parser.add_argument("--row-group-tokens", type=int, default=1 << 20,
                        help="build.row_group_tokens of the lake (a first batch reads only the pages its "
                        "windows reach; later batches decode whole row groups)")
    parser.add_argument("--packing", choices=("concat", "pack", "pad"), default="concat",
                        help="loader.packing of the measured loaders")
    parser.add_argument("--chunks", type=int, nargs="*", default=[],
                        help="also measure on copies of the lake's catalog grown to these numbers of chunks")
    parser.add_argument("--first-on-machine", action="store_true",
                        help="clear the records of chunk files hashed before every run (each run hashes "
                        "the files it opens); by default one unmeasured run per case makes them first")
    parser.add_argument("--baseline", metavar="REPO",
                        help="also measure the lakeloader of this checkout (PYTHONPATH), alternating with this "
                        "one's run by run, and print the ratio of this one's medians to its")
    parser.add_argument("--kinds", nargs="*", choices=KINDS, default=list(KINDS), help="the shuffle kinds measured")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="measured processes per case (medians)")
    parser.add_argument("--measure", nargs=2, metavar=("CONFIG", "STEP"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        measure(args.measure[0], int(args.measure[1]))
        return
    configs = {kind: lake_config(args.size, args.verify, kind, args.row_group_tokens, args.packing) for kind in KINDS}
    figures: dict[str, object] = {"size": args.size, "verify": args.verify, "row_group_tokens": args.row_group_tokens,
                                  "packing": args.packing,
                                  "batch": BATCH, "seq_len": SEQ,
                                  "hash records": "cleared before each run" if args.first_on_machine
                                  else "made by an unmeasured run first"}
    environment = {**os.environ, "LAKELOADER_CACHE": str(CACHE)}
    shutil.rmtree(CACHE, ignore_errors=True)

    codes = {"": str(REPO)} if args.baseline is None else {"": str(REPO), "baseline ": args.baseline}
    if args.baseline is not None:
        figures["baseline"] = args.baseline

    def run(config: Path, step: int, code: str = "") -> dict[str, float]:
        if args.first_on_machine:
            shutil.rmtree(CACHE, ignore_errors=True)
        out = subprocess.run([sys.executable, __file__, "--measure", str(config), str(step)], check=True,
                             capture_output=True, text=True, env={**environment, "PYTHONPATH": codes[code]}).stdout
        return json.loads(out.strip().splitlines()[-1])

    lakes: dict[str, dict[str, Path]] = {"": configs}
    for chunks in args.chunks:
        lakes[f"{chunks:,} chunks, "] = {kind: grown_config(configs[kind], kind, chunks) for kind in KINDS}
    for label, lake in lakes.items():
        for kind in args.kinds:
            if not args.first_on_machine:
                for code in codes:
                    run(lake[kind], STEPS[0], code)
            for step in STEPS:
                runs: dict[str, list[dict[str, float]]] = {code: [] for code in codes}
                for _ in range(args.rounds):   # (the checkouts alternate run by run)
                    for code in codes:
                        runs[code].append(run(lake[kind], step, code))
                totals = {}
                for code, found in runs.items():
                    opened = statistics.median(r["open"] for r in found)
                    first = statistics.median(r["first"] for r in found)
                    totals[code] = statistics.median(r["open"] + r["first"] for r in found)
                    # (CPU seconds of all its threads: what a loaded machine moves least)
                    figures[f"{code}{label}{kind} step {step:,}: open + first batch CPU ms"] = round(
                        statistics.median(r["cpu"] for r in found) * 1000, 1)
                    figures[f"{code}{label}{kind} step {step:,}: open + first batch ms"] = round(totals[code] * 1000, 1)
                    figures[f"{code}{label}{kind} step {step:,}: open / first batch ms"] = \
                        f"{opened * 1000:.1f} / {first * 1000:.1f}"
                if args.baseline is not None:
                    figures[f"{label}{kind} step {step:,}: ratio to baseline"] = round(totals[""] / totals["baseline "], 2)
    figures["loadavg"] = Path("/proc/loadavg").read_text().strip() if Path("/proc/loadavg").exists() else "n/a"
    report("loader_start" if args.baseline is None else "loader_start_vs_baseline", figures)


if __name__ == "__main__":
    main()
