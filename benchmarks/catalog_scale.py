"""Catalog publishes and reads as the lake grows: incremental snapshots (a base plus deltas)
against full snapshots, in the same run.

For each size, a copy of the demo lake's catalog grown to that many chunks and some more
(:mod:`lakeloader.demo.many_chunks`; the chunk files are shared, so loaders read real tokens) is
opened by a writer, which sets the chunks after the first ``size`` back to planned, then commits
``--new`` of them (their chunk, row-group and packing rows, as a build's commits write them) before
each publish, ``--rounds`` times alternating the order:

- old: a full snapshot (``publish_snapshot(..., whole=True)``: the DuckDB copy and its reader
  index, as every publish did before deltas);
- new: a delta (the rows of the chunks committed since the previous publish).

Printed per size (medians), old / new and their ratio: seconds and bytes of each publish (the
bytes a remote reader then downloads), seconds of a following reader's refresh
(``CatalogView.refresh`` and its dataset's counts), and, on a full snapshot (old) and on a base
with four deltas of ``--new`` chunks each (new, as a build leaves the lake between publishes;
every chunk committed, so these deltas carry chunks whose rows are as the base has them): a fresh
reader's first open,
a ``Loader``'s open + first batch at step 0 (shuffle none and full; in this process, hash records
made), and ``lakeloader status LAKE`` (which reads the published catalog while the writer holds
it).
Targets: publish and refresh flat across sizes for a fixed number of new chunks; first open at
10^6 chunks under 1 s.

Real builds (``--real 1000,8000,32000``, any sizes, so they can run in parts): the bench corpus cut
into splits of (corpus bytes / size) bytes, built on a LocalCluster of 2 workers into a local lake,
the build in a child process of its own (its peak RSS is the driver's: the LocalCluster's scheduler
runs in it, the workers do not). Printed per size: build wall time and ms per chunk, the driver's
peak RSS, commit throughput (chunks per second of the commit transactions, index files included,
and chunks per commit), the publishes (count, median seconds and bytes of those during the build,
and the final full one), a reader in this process refreshing every 0.5 s while the build runs
(median seconds of a refresh that found a new version, with its dataset's counts), and after the
build: open + first batch (shuffle none and full; a fresh ``Loader`` each, median of 3), a
``documents`` aggregate (``GROUP BY dataset``) and ``lakeloader status``. ``--baseline CHECKOUT``
builds each size with that checkout's lakeloader too (``PYTHONPATH``), alternating, and prints the
wall time and peak RSS ratios.

    .venv/bin/python benchmarks/catalog_scale.py [--chunks 1000 8000 32000 100000 [1000000]] [--new 100] [--rounds 3]
    .venv/bin/python benchmarks/catalog_scale.py --chunks --real 1000,8000,32000 [--baseline /path/to/old/checkout]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from _common import OUT, REPO, report
from loader_start import BATCH, SEQ, grown_config, lake_config

from lakeloader.catalog.lake import Lake, open_lake
from lakeloader.catalog.pointer import delta_versions
from lakeloader.catalog.snapshot import SNAPSHOT_DIR, publish_snapshot, read_pointer
from lakeloader.catalog.store import CatalogWriter
from lakeloader.cli import main as cli
from lakeloader.demo.corpus import prepare_corpus
from lakeloader.feed.loader import Loader
from lakeloader.ingest import execute
from lakeloader.ingest.driver import build
from lakeloader.read.catalog_view import CatalogView


DELTAS_READ = 4   # deltas on the base when the reads are measured
REAL_WORKERS = 2
AGGREGATE = "SELECT dataset, count(*) AS docs, sum(num_tokens) AS tokens FROM documents GROUP BY dataset"


def timed(call: Callable[[], Any]) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def version_bytes(lake: Lake, before: set[str]) -> int:
    """Bytes of the files in ``_catalog/`` that were not there before (what a reader fetches)."""
    folder = lake.path_of(SNAPSHOT_DIR)
    return sum(os.path.getsize(os.path.join(folder, name)) for name in os.listdir(folder)
               if name not in before and name != "CURRENT")


# The chunks after the first ``chunks`` of the grown catalog are set back to planned (their rows
# kept aside), then committed ``new`` at a time as a build commits them.
_SET_ASIDE = [
    "CREATE TEMP TABLE later_row_groups AS FROM row_groups WHERE dataset = 'code' AND global_index >= $chunks",
    "CREATE TEMP TABLE later_examples AS FROM chunk_examples WHERE dataset = 'code' AND global_index >= $chunks",
    "DELETE FROM row_groups WHERE dataset = 'code' AND global_index >= $chunks",
    "DELETE FROM chunk_examples WHERE dataset = 'code' AND global_index >= $chunks",
    "UPDATE chunks SET status = 'planned' WHERE dataset = 'code' AND global_index >= $chunks",
]
_COMMIT = [
    "UPDATE chunks SET status = 'committed' WHERE dataset = 'code' AND global_index >= $a AND global_index < $b",
    "INSERT INTO row_groups FROM later_row_groups WHERE global_index >= $a AND global_index < $b",
    "INSERT INTO chunk_examples FROM later_examples WHERE global_index >= $a AND global_index < $b",
]


def measure(config_none: Path, config_full: Path, chunks: int, new: int, rounds: int) -> dict[str, Any]:
    lake = Lake(yaml.safe_load(config_none.read_text())["lake"])
    samples: dict[str, list[float]] = {}

    def sample(key: str, value: float) -> None:
        samples.setdefault(key, []).append(value)

    with CatalogWriter(lake.writer_catalog_path) as writer:
        for statement in _SET_ASIDE:
            writer.con.execute(statement, {"chunks": chunks})
        writer.recount_progress(["code"])
        committed = chunks

        def commit_next() -> None:
            nonlocal committed
            with writer.transaction():
                for statement in _COMMIT:
                    writer.con.execute(statement, {"a": committed, "b": committed + new})
            writer.changes.chunks(("code", i) for i in range(committed, committed + new))
            committed += new

        publish_snapshot(writer.con, lake, None, writer.changes, whole=True)
        view = CatalogView(lake)
        view.dataset("code")
        for round_ in range(rounds):
            for code in (("old", "new") if round_ % 2 == 0 else ("new", "old")):
                commit_next()
                before = set(os.listdir(lake.path_of(SNAPSHOT_DIR)))
                sample(f"{code} publish s", timed(lambda: publish_snapshot(
                    writer.con, lake, None, writer.changes, whole=code == "old")))
                sample(f"{code} publish bytes", version_bytes(lake, before))
                sample(f"{code} refresh s", timed(lambda: (view.refresh(), view.dataset("code"))))
        view.close()
        writer.recount_progress(["code"])   # the commits above set chunk rows by SQL of their own
        deltas = 0
        for _ in range(rounds):
            # Read a full snapshot (old), then the lake as a build leaves it between publishes (new):
            # a base and DELTAS_READ deltas.
            for code in ("old", "new"):
                if code == "old":
                    publish_snapshot(writer.con, lake, None, writer.changes, whole=True)
                for k in range(DELTAS_READ if code == "new" else 0):
                    # Every chunk is committed by now (a loader's full shuffle waits for the whole
                    # dataset): deltas of as many chunks recorded as changed, their rows as they are.
                    writer.changes.chunks(("code", i) for i in range(k * new, (k + 1) * new))
                    publish_snapshot(writer.con, lake, None, writer.changes)
                deltas = max(deltas, len(delta_versions(read_pointer(lake))))
                sample(f"{code} first open s", timed(lambda: CatalogView(lake).dataset("code")))
                for kind, config in (("none", config_none), ("full", config_full)):
                    def open_and_batch() -> None:
                        with Loader(config) as loader:
                            loader.batch(0)
                    sample(f"{code} loader open + batch 0 ({kind}) s", timed(open_and_batch))
                with contextlib.redirect_stdout(io.StringIO()):
                    sample(f"{code} status s", timed(lambda: cli(["status", lake.root])))
    medians = {key: statistics.median(values) for key, values in samples.items()}
    figures: dict[str, Any] = {"deltas read": deltas, "chunks committed at the end": committed}
    for what in ("publish s", "publish bytes", "refresh s", "first open s", "loader open + batch 0 (none) s",
                 "loader open + batch 0 (full) s", "status s"):
        old, new_ = medians[f"old {what}"], medians[f"new {what}"]
        shown = (lambda v: f"{int(v):,}") if "bytes" in what else (lambda v: f"{v * 1e3:.1f} ms")
        figures[f"{what.removesuffix(' s')}: full / incremental"] = (
            f"{shown(old)} / {shown(new_)} (x{old / max(new_, 1e-9):.2f})")
    return figures


def real_configs(chunks: int, code: str = "new") -> tuple[Path, Path]:
    """Configs (shuffle none, full) of a lake of the bench corpus cut into about ``chunks`` splits
    (one lake per ``code``: old, new)."""
    corpus = prepare_corpus(OUT / "bench-corpus", size="bench")["code"]
    split = max(1, sum(path.stat().st_size for path in corpus) // chunks)
    lake = OUT / f"scale-real-{chunks}-{code}"
    paths = []
    for kind in ("none", "full"):
        path = OUT / f"scale-real-{chunks}-{code}-{kind}.yaml"
        path.write_text(yaml.safe_dump({
            "lake": str(lake), "tokenizer": str(REPO / "demo" / "tokenizer.json"),
            "datasets": {"code": {"sources": [str(p) for p in corpus]}},
            "build": {"split_size": split, "workers": REAL_WORKERS},
            "loader": {"seq_len": SEQ, "batch_size": BATCH, "prefetch": 0, "shuffle": {"kind": kind}}}))
        paths.append(path)
    return paths[0], paths[1]


def build_child(config: str) -> None:
    """(In the child process) build ``config``, timing its commits and publishes; prints them as JSON."""
    lake = Lake(yaml.safe_load(Path(config).read_text())["lake"])
    commits: list[tuple[int, float]] = []
    publishes: list[tuple[bool, float, int]] = []
    write, publish = execute.ResultCommitter.write, execute.publish

    def timed_write(self: execute.ResultCommitter, results: list[Any]) -> None:
        started = time.perf_counter()
        write(self, results)
        commits.append((len(results), time.perf_counter() - started))

    def timed_publish(*args: Any, **kwargs: Any) -> None:
        folder = lake.path_of(SNAPSHOT_DIR)
        before = set(os.listdir(folder)) if os.path.isdir(folder) else set()
        started = time.perf_counter()
        publish(*args, **kwargs)
        seconds = time.perf_counter() - started
        whole = bool(kwargs.get("whole", args[4] if len(args) > 4 else False))
        publishes.append((whole, seconds, version_bytes(lake, before)))

    execute.ResultCommitter.write = timed_write   # type: ignore[method-assign]
    execute.publish = timed_publish   # type: ignore[assignment]
    started = time.perf_counter()
    result = build(config, progress=False)
    print(json.dumps({"wall s": time.perf_counter() - started, "chunks": result.chunks_built,
                      "peak rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      "commits": commits, "publishes": publishes}))


def follow(lake: Lake, stop: threading.Event, seconds: list[float]) -> None:
    """A reader refreshing every 0.5 s until ``stop``: the seconds of each refresh that found a new
    version (and its dataset's counts)."""
    view = None
    while not stop.wait(0.5):
        if view is None:
            if read_pointer(lake) is not None:
                view = CatalogView(lake)
            continue
        started = time.perf_counter()
        if view.refresh():
            view.dataset("code")
            seconds.append(time.perf_counter() - started)
    if view is not None:
        view.close()


def real_build(chunks: int, code: str, checkout: Path) -> dict[str, Any]:
    """Build about ``chunks`` chunks with ``checkout``'s lakeloader (``code``: old, new) in a child
    process, a reader following it; returns what the child measured plus the reader's refreshes."""
    config, _ = real_configs(chunks, code)
    lake = Lake(yaml.safe_load(config.read_text())["lake"])
    shutil.rmtree(lake.root, ignore_errors=True)
    stop, refreshes = threading.Event(), []
    reader = threading.Thread(target=follow, args=(lake, stop, refreshes), daemon=True)
    reader.start()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(checkout), os.environ.get("PYTHONPATH", "")])}
    try:
        done = subprocess.run([sys.executable, __file__, "--build-child", str(config)], env=env,
                              capture_output=True, text=True, check=True)
    finally:
        stop.set()
        reader.join()
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    measured["refreshes"] = refreshes
    return measured


def real_figures(chunks: int, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The figures of the real builds ``runs`` (by code: new, and old with a baseline) of ``chunks``
    chunks, and the reads of the lake the new code built."""
    figures: dict[str, Any] = {}
    for code, run in runs.items():
        built = run["chunks"]
        committed = sum(n for n, _ in run["commits"])
        during = [(s, b) for whole, s, b in run["publishes"] if not whole]
        final = [(s, b) for whole, s, b in run["publishes"] if whole]
        figures.update({
            f"{code}: chunks built, build wall": f"{built:,}, {run['wall s']:.1f} s ({run['wall s'] / built * 1e3:.1f} ms per chunk)",
            f"{code}: driver peak RSS": f"{run['peak rss'] / 2**20:.0f} MB",
            f"{code}: commits": (f"{committed / max(sum(s for _, s in run['commits']), 1e-9):,.0f} chunks/s "
                                 f"in {len(run['commits'])} commits ({committed / max(len(run['commits']), 1):.1f} chunks each)"),
            f"{code}: publishes during the build": (
                f"{len(during)}, median {statistics.median(s for s, _ in during) * 1e3:.0f} ms, "
                f"{statistics.median(b for _, b in during):,.0f} bytes" if during else "none"),
            f"{code}: final publish": "; ".join(f"{s * 1e3:.0f} ms, {b:,} bytes" for s, b in final),
            f"{code}: reader refreshes": (
                f"{len(run['refreshes'])}, median {statistics.median(run['refreshes']) * 1e3:.1f} ms, "
                f"max {max(run['refreshes']) * 1e3:.1f} ms" if run["refreshes"] else "none"),
        })
    if "old" in runs:
        old, new = runs["old"], runs["new"]
        figures["new/old: build wall, driver peak RSS"] = (
            f"x{new['wall s'] / old['wall s']:.2f}, x{new['peak rss'] / old['peak rss']:.2f}")
    config_none, config_full = real_configs(chunks)
    for kind, config in (("none", config_none), ("full", config_full)):
        def open_and_batch() -> None:
            with Loader(config) as loader:
                loader.batch(0)
        open_and_batch()   # imports and the hash records made once
        figures[f"open + batch 0 ({kind})"] = f"{statistics.median(timed(open_and_batch) for _ in range(3)) * 1e3:.1f} ms"
    lake = open_lake(config_none)
    figures["documents aggregate"] = f"{statistics.median(timed(lambda: lake.sql(AGGREGATE)) for _ in range(3)) * 1e3:.0f} ms"
    with contextlib.redirect_stdout(io.StringIO()):
        status = statistics.median(timed(lambda: cli(["status", lake.root])) for _ in range(3))
    figures["status"] = f"{status * 1e3:.0f} ms"
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunks", type=int, nargs="*", default=[1000, 8000, 32000, 100000])
    parser.add_argument("--new", type=int, default=100, help="chunks each incremental publish carries")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--real", default="", help="sizes of real builds, e.g. 1000,8000,32000")
    parser.add_argument("--baseline", type=Path, help="a checkout whose lakeloader builds each size too")
    parser.add_argument("--build-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.build_child:
        build_child(args.build_child)
        return
    figures: dict[str, Any] = {"new chunks per publish": args.new, "rounds": args.rounds,
                               "load average before": " ".join(f"{x:.2f}" for x in os.getloadavg())}
    for i, chunks in enumerate(int(size) for size in args.real.split(",") if size):
        runs: dict[str, dict[str, Any]] = {}
        codes = ("old", "new") if i % 2 == 0 else ("new", "old")   # alternating which goes first
        for code in codes if args.baseline else ("new",):
            runs[code] = real_build(chunks, code, args.baseline if code == "old" else REPO)
        if args.baseline:   # as computed above, in the order shown
            runs = {"old": runs["old"], "new": runs["new"]}
        for key, value in real_figures(chunks, runs).items():
            figures[f"real {chunks:>6,}: {key}"] = value
        figures[f"real {chunks:>6,}: load average after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
        print(f"real build of {chunks} chunks measured", flush=True)
    if args.chunks:
        base_none, base_full = lake_config("demo", "checksum", "none"), lake_config("demo", "checksum", "full")
    for chunks in args.chunks:
        grown = chunks + args.new * args.rounds * 2   # the chunks committed as publishes are measured
        config_none = grown_config(base_none, "none", grown)
        config_full = grown_config(base_full, "full", grown)
        for key, value in measure(config_none, config_full, chunks, args.new, args.rounds).items():
            figures[f"{chunks:>9,} chunks: {key}"] = value
        print(f"{chunks} chunks measured", flush=True)
    figures["load average after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    report("catalog_scale", figures)


if __name__ == "__main__":
    main()
