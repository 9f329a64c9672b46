"""Catalog publishes and reads as the lake grows: incremental snapshots (a base plus deltas)
against full snapshots, in the same run.

For each size, a copy of the demo lake's catalog grown to that many chunks
(:mod:`lakeloader.demo.many_chunks`; the chunk files are shared, so loaders read real tokens) is
opened by a writer, which then publishes, ``--rounds`` times alternating the order:

- old: a full snapshot (``publish_snapshot(..., whole=True)``: the DuckDB copy and its reader
  index, as every publish did before deltas);
- new: a delta of ``--new`` chunks recorded as changed (the rows of that many chunks, as a
  publish after committing them carries).

Printed per size (medians): seconds and bytes of each publish (the bytes a remote reader then
downloads), seconds of a following reader's refresh (``CatalogView.refresh`` and its dataset's
counts), and on the lake left as a base plus deltas: a fresh reader's first open, a ``Loader``'s
open + first batch at step 0 (shuffle none and full; in this process, hash records made), and
``lakeloader status LAKE`` (which reads the published catalog while the writer holds it).
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


def timed(call: Callable[[], Any]) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def version_bytes(lake: Lake, before: set[str]) -> int:
    """Bytes of the files in ``_catalog/`` that were not there before (what a reader fetches)."""
    folder = lake.path_of(SNAPSHOT_DIR)
    return sum(os.path.getsize(os.path.join(folder, name)) for name in os.listdir(folder)
               if name not in before and name != "CURRENT")


def measure(config_none: Path, config_full: Path, chunks: int, new: int, rounds: int) -> dict[str, Any]:
    lake = Lake(yaml.safe_load(config_none.read_text())["lake"])
    samples: dict[str, list[float]] = {}

    def sample(key: str, value: float) -> None:
        samples.setdefault(key, []).append(value)

    with CatalogWriter(lake.writer_catalog_path) as writer:
        publish_snapshot(writer.con, lake, None, writer.changes, whole=True)
        view = CatalogView(lake)
        view.dataset("code")
        for round_ in range(rounds):
            for code in (("old", "new") if round_ % 2 == 0 else ("new", "old")):
                first = (round_ * 2 * new + (code == "new") * new) % max(1, chunks - new)
                writer.changes.chunks(("code", i) for i in range(first, first + new))
                before = set(os.listdir(lake.path_of(SNAPSHOT_DIR)))
                sample(f"{code} publish s", timed(lambda: publish_snapshot(
                    writer.con, lake, None, writer.changes, whole=code == "old")))
                sample(f"{code} publish bytes", version_bytes(lake, before))
                sample(f"{code} refresh s", timed(lambda: (view.refresh(), view.dataset("code"))))
        for _ in range(3):   # the lake as a build leaves it between publishes: a base and deltas
            writer.changes.chunks(("code", i) for i in range(new))
            publish_snapshot(writer.con, lake, None, writer.changes)
        view.close()
        deltas = len(delta_versions(read_pointer(lake)))
        for _ in range(rounds):
            sample("first open s", timed(lambda: CatalogView(lake).dataset("code")))
            for kind, config in (("none", config_none), ("full", config_full)):
                def open_and_batch() -> None:
                    with Loader(config) as loader:
                        loader.batch(0)
                sample(f"loader open + batch 0 ({kind}) s", timed(open_and_batch))
            with contextlib.redirect_stdout(io.StringIO()):
                sample("status s", timed(lambda: cli(["status", lake.root])))
    medians = {key: statistics.median(values) for key, values in samples.items()}
    figures: dict[str, Any] = {"chunks": chunks, "deltas at the reads": deltas}
    for what in ("publish s", "publish bytes", "refresh s"):
        old, new_ = medians[f"old {what}"], medians[f"new {what}"]
        shown = (lambda v: f"{int(v):,}") if "bytes" in what else (lambda v: f"{v * 1e3:.1f} ms")
        figures[f"{what.split()[0]} {what.split()[1]}: full / incremental"] = (
            f"{shown(old)} / {shown(new_)} (x{old / max(new_, 1e-9):.1f})")
    for key in ("first open s", "loader open + batch 0 (none) s", "loader open + batch 0 (full) s", "status s"):
        figures[key.removesuffix(" s")] = f"{medians[key] * 1e3:.1f} ms"
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
        config_none = grown_config(base_none, "none", chunks)
        config_full = grown_config(base_full, "full", chunks)
        for key, value in measure(config_none, config_full, chunks, args.new, args.rounds).items():
            figures[f"{chunks:>9,} chunks: {key}"] = value
        print(f"{chunks} chunks measured", flush=True)
    figures["load average after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    report("catalog_scale", figures)


if __name__ == "__main__":
    main()
