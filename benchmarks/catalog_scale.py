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

    .venv/bin/python benchmarks/catalog_scale.py [--chunks 1000 8000 32000 100000 [1000000]] [--new 100] [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from _common import report
from loader_start import grown_config, lake_config

from lakeloader.catalog.lake import Lake
from lakeloader.catalog.pointer import delta_versions
from lakeloader.catalog.snapshot import SNAPSHOT_DIR, publish_snapshot, read_pointer
from lakeloader.catalog.store import CatalogWriter
from lakeloader.cli import main as cli
from lakeloader.feed.loader import Loader
from lakeloader.read.catalog_view import CatalogView


DELTAS_READ = 4   # deltas on the base when the reads are measured


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunks", type=int, nargs="*", default=[1000, 8000, 32000, 100000])
    parser.add_argument("--new", type=int, default=100, help="chunks each incremental publish carries")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    base_none, base_full = lake_config("demo", "checksum", "none"), lake_config("demo", "checksum", "full")
    figures: dict[str, Any] = {"new chunks per publish": args.new, "rounds": args.rounds,
                               "load average before": " ".join(f"{x:.2f}" for x in os.getloadavg())}
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
