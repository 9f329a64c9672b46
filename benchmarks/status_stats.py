"""`lakeloader status` and `lakeloader stats` as a lake grows: 1,000 / 10,000 / 100,000 chunks,
this code against a baseline checkout (``--baseline DIR``, e.g. a worktree of main before the
change), each measured in its own process, alternated, median of 3 per process.

- status: ``Lake.status()`` and its text tables (what the CLI prints) on a generated catalog of N
  committed chunks over N/10 shards (``lakeloader.demo.many_chunks.generated_plan``; no files).
- stats: ``Lake.stats()`` (documents, tokens and length percentiles per dataset) and its text
  table on a small real build grown to N chunks (``benchmarks/documents_index.py``: chunk i shares
  the file of chunk i % built; its documents index grown alike), which the baseline answers from
  the chunk files.

    .venv/bin/python benchmarks/status_stats.py --baseline ../main-before
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import OUT, report

SIZES = (1_000, 10_000, 100_000)


def generated_catalog(chunks: int) -> Path:
    """A lake folder whose catalog holds ``chunks`` committed chunks over chunks/10 shards."""
    from lakeloader.catalog.lake import Lake
    from lakeloader.catalog.snapshot import publish_snapshot
    from lakeloader.catalog.store import CatalogWriter
    from lakeloader.demo.many_chunks import generated_plan
    from lakeloader.storage import write_atomically

    folder = OUT / f"status-{chunks}"
    shutil.rmtree(folder, ignore_errors=True)
    lake = Lake(str(folder))
    write_atomically(lake.url_of("_tokenizer/t.json"), (Path(__file__).parents[1] / "demo" / "tokenizer.json")
                     .read_bytes(), {})
    with CatalogWriter(lake.writer_catalog_path) as writer:
        writer.register_plan(generated_plan("d", chunks, max(1, chunks // 10)), tokenizer_path="_tokenizer/t.json",
                             token_type="uint16", vocab_size=8204, split_size=1, on_error="raise")
        writer.con.execute("UPDATE chunks SET status = 'committed', num_docs = 100, num_tokens = 100000, "
                           "num_bytes = 1, checksum = '0', num_records = 100, source_bytes = 400000, num_rejects = 0")
        publish_snapshot(writer.con, lake, None)
    return folder


def measure(kind: str, folder: str, repeats: int) -> float:
    """Median milliseconds of ``kind`` (status or stats, with its text table) of the lake ``folder``."""
    from lakeloader.catalog.lake import Lake
    from lakeloader.report.tables import format_frame, format_status

    def once() -> float:
        started = time.perf_counter()
        lake = Lake(folder)
        if kind == "status":
            format_status(lake.status(), "table")
        else:
            format_frame(lake.stats(), "table")
        return (time.perf_counter() - started) * 1000

    once()   # hash records, the OS's file cache
    return statistics.median(once() for _ in range(repeats))


def run(code: str, kind: str, folder: Path, repeats: int) -> float:
    """``measure`` in a process importing lakeloader from ``code``."""
    env = {**os.environ, "PYTHONPATH": code}
    out = subprocess.run([sys.executable, __file__, "--measure", kind, str(folder), str(repeats)], env=env,
                         check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", required=False, help="a checkout of the code to compare with")
    parser.add_argument("--measure", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        kind, folder, repeats = args.measure
        print(measure(kind, folder, int(repeats)))
        return
    from documents_index import built_lake, grown_lake

    here = str(Path(__file__).resolve().parents[1])
    codes = {"after": here, **({"before": str(Path(args.baseline).resolve())} if args.baseline else {})}
    figures: dict[str, object] = {"load_average": " ".join(f"{x:.2f}" for x in os.getloadavg())}
    base = built_lake()
    for chunks in SIZES:
        status_lake = generated_catalog(chunks)
        stats_lake = Path(yaml_lake(grown_lake(base, chunks)))
        for name, code in codes.items():
            figures[f"status_{chunks}_{name}_ms"] = run(code, "status", status_lake, 3)
        for name, code in codes.items():   # the chunk files' baseline at 100,000 chunks: once
            repeats = 1 if name == "before" and chunks >= 100_000 else 3
            figures[f"stats_{chunks}_{name}_ms"] = run(code, "stats", stats_lake, repeats)
        shutil.rmtree(status_lake, ignore_errors=True)
        shutil.rmtree(stats_lake.parent, ignore_errors=True)
    figures["load_average_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    report("status_stats", figures)


def yaml_lake(config: Path) -> str:
    import yaml
    return yaml.safe_load(config.read_text())["lake"]


if __name__ == "__main__":
    main()
