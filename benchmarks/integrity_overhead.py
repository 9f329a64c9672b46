"""What the integrity and sandbox checks cost, each next to its unchecked baseline in one run.

- Decoding every row group of the demo lake's chunk files (tokens and part layout columns, as
  the loader reads them) with Parquet page checksums verified vs without (ratio; ~1 is free).
- Opening a catalog for a reader: the sandboxed connection (an in-memory DuckDB attaching the
  file read-only, views from the wheel, external access off) plus a first query, vs a plain
  read-only ``duckdb.connect`` of the same file and the same query.

Each figure is the median of three rounds, with the load average. Builds the demo lake into
benchmarks/out/ on first use.

    .venv/bin/python benchmarks/integrity_overhead.py
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import duckdb
import pyarrow.parquet as pq
import yaml
from _common import OUT, REPO, report

from lakeloader.catalog.lake import open_lake
from lakeloader.catalog.store import connect_reader
from lakeloader.demo.corpus import prepare_corpus
from lakeloader.ingest.driver import build

COLUMNS = ["tokens", "part_lengths", "part_kinds"]
FIRST_QUERY = "SELECT dataset, count(*), sum(num_tokens) FROM chunk_offsets GROUP BY dataset"


def demo_lake() -> str:
    """Config of a lake of the demo corpus (built once)."""
    corpus = prepare_corpus(OUT / "demo-corpus", size="demo")
    path = OUT / "integrity.yaml"
    path.write_text(yaml.safe_dump({
        "lake": str(OUT / "integrity-lake"), "tokenizer": str(REPO / "demo" / "tokenizer.json"),
        "datasets": {name: {"sources": [str(p) for p in files]} for name, files in corpus.items()},
        "build": {"split_size": "4MB"},
    }))
    build(str(path), workers=2, progress=False)
    return str(path)


def median_seconds(run: Callable[[], object], rounds: int = 3) -> float:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def decode_all(paths: list[str], verify: bool) -> int:
    tokens = 0
    for path in paths:
        parquet = pq.ParquetFile(path, page_checksum_verification=verify)
        for group in range(parquet.num_row_groups):
            tokens += parquet.read_row_group(group, columns=COLUMNS).num_rows
    return tokens


def main() -> None:
    config = demo_lake()
    lake = open_lake(config)
    paths = [lake.path_of(p) for p in lake.sql("SELECT path FROM chunks ORDER BY global_index").path]
    decode_all(paths, True)  # warm the page cache
    checked = median_seconds(lambda: [decode_all(paths, True) for _ in range(5)])
    unchecked = median_seconds(lambda: [decode_all(paths, False) for _ in range(5)])
    catalog = lake.writer_catalog_path

    def sandboxed() -> None:
        con = connect_reader(catalog)
        con.execute(FIRST_QUERY).fetchall()
        con.close()

    def plain() -> None:
        con = duckdb.connect(catalog, read_only=True)
        con.execute(FIRST_QUERY).fetchall()
        con.close()

    sandboxed_s = median_seconds(lambda: [sandboxed() for _ in range(10)]) / 10
    plain_s = median_seconds(lambda: [plain() for _ in range(10)]) / 10
    report("integrity_overhead", {
        "chunk_files": len(paths),
        "decode_with_page_checksums_s": checked,
        "decode_without_s": unchecked,
        "page_checksum_cost_ratio": checked / unchecked,
        "reader_catalog_open_sandboxed_ms": sandboxed_s * 1e3,
        "reader_catalog_open_plain_ms": plain_s * 1e3,
        "sandbox_open_ratio": sandboxed_s / plain_s,
        "load_average": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    })


if __name__ == "__main__":
    main()
