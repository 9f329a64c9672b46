"""A documents aggregate (``SELECT dataset, count(*), sum(num_tokens) FROM documents GROUP BY
dataset``, through ``Lake.sql``: registering the view, checking its files, the query) from the
documents index against the chunk files (the baseline, as a lake without the index reads), in the
same run: alternated, median of 3, and at 10^8 generated documents from the index alone.

- 1,000 / 8,000 / 32,000 chunks: a small real build (demo corpus, 2 workers) whose chunks are
  repeated in its catalog (``lakeloader.demo.many_chunks.grow``: chunk i shares the file of chunk
  i % built), its index rows repeated alike into one index file. The chunk-file path checks
  every chunk (a record vouches for each file after the first hash) and opens every chunk file.
- 10^8 documents: a generated catalog of 100,000 committed chunks of 1,000 documents each and its
  index files (13 files of about 8 M documents, generated rows, written as a build writes them);
  the first query hashes the index files, later ones find them vouched for.

    .venv/bin/python benchmarks/documents_index.py [--quick]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import yaml
from _common import OUT, REPO, report
from distributed import LocalCluster

from lakeloader.catalog import documents
from lakeloader.catalog.lake import Lake, open_lake
from lakeloader.catalog.snapshot import publish_snapshot
from lakeloader.catalog.store import CatalogWriter, IndexFile
from lakeloader.demo.corpus import prepare_corpus
from lakeloader.demo.many_chunks import generated_plan, grow
from lakeloader.ingest.cluster import WORKER_ENV
from lakeloader.ingest.document_index import COMPACT_DOCS, encode_index_file
from lakeloader.ingest.driver import build
from lakeloader.storage import write_atomically

TOKENIZER = REPO / "demo" / "tokenizer.json"
AGGREGATE = "SELECT dataset, count(*) AS docs, sum(num_tokens) AS tokens FROM documents GROUP BY dataset"


def chunk_files_only() -> None:
    """The documents view as a lake without the index reads it (every chunk from its file)."""
    original = documents._document_chunks
    documents._document_chunks = lambda con: original(con).assign(index_file=None)   # type: ignore[assignment]
    documents._document_chunks.original = original   # type: ignore[attr-defined]


def restore() -> None:
    documents._document_chunks = documents._document_chunks.original   # type: ignore[attr-defined]


def built_lake() -> Path:
    """A small real lake of the demo corpus's JSON Lines files (chunks of 16 KB), built once."""
    folder = OUT / "documents-index-base"
    config = folder / "config.yaml"
    if config.exists():
        return config
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    corpus = prepare_corpus(OUT / "demo-corpus", size="demo")
    sources = sorted(str(p) for files in corpus.values() for p in files if p.suffix in (".jsonl", ".gz", ".zst", ".parquet"))
    config.write_text(yaml.safe_dump({
        "lake": str(folder / "lake"), "tokenizer": str(TOKENIZER),
        "datasets": {"d": {"sources": sources}}, "build": {"split_size": "16KB"}}))
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
                      env=WORKER_ENV) as cluster:
        build(config, scheduler=cluster.scheduler_address, progress=False)
    return config


def grown_lake(base: Path, chunks: int) -> Path:
    """A copy of the built lake grown to ``chunks`` chunks, its index grown alike (one file)."""
    folder = OUT / f"documents-index-{chunks}"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(base.parent, folder, symlinks=True)
    config = folder / "config.yaml"
    settings = yaml.safe_load(config.read_text())
    settings["lake"] = str(folder / "lake")
    config.write_text(yaml.safe_dump(settings))
    lake = open_lake(config)
    rows = lake.sql("SELECT path FROM document_index_files")
    table = pa.concat_tables([pq.read_table(lake.path_of(p)) for p in rows.path]).sort_by("chunk")
    built = int(lake.sql("SELECT count(*) AS n FROM chunks").n[0])
    per_chunk = np.bincount(table.column("chunk").to_numpy(), minlength=built)
    starts = np.concatenate([[0], np.cumsum(per_chunk)])
    order = np.concatenate([np.arange(starts[i % built], starts[i % built + 1]) for i in range(chunks)])
    grown = table.take(pa.array(order)).set_column(
        0, "chunk", pa.array(np.repeat(np.arange(chunks), per_chunk[np.arange(chunks) % built])))
    data = encode_index_file(grown)
    path = "_documents/grown/all.parquet"
    write_atomically(lake.url_of(path), data, {})
    grow(lake, "d", chunks)
    with CatalogWriter(lake.writer_catalog_path) as writer:
        writer.con.execute("DELETE FROM document_index_chunks; DELETE FROM document_index_files")
        file = IndexFile(path, "d", list(range(chunks)), len(grown), len(data), hashlib.sha256(data).hexdigest())
        with writer.transaction():
            writer.con.execute("INSERT INTO document_index_files VALUES ($path, $dataset, $first_chunk, $last_chunk, "
                               "$num_chunks, $num_docs, $num_bytes, $checksum, now()::TIMESTAMP)", file.record())
            writer.con.execute("INSERT INTO document_index_chunks SELECT dataset, global_index, path, ? FROM chunks",
                               [path])
        publish_snapshot(writer.con, lake, None)
    return config


def generated_lake(chunks: int, docs_per_chunk: int) -> Path:
    """A catalog of ``chunks`` committed chunks (no chunk files) and generated index files."""
    folder = OUT / f"documents-index-generated-{chunks}"
    config = folder / "config.yaml"
    if config.exists():
        return config
    shutil.rmtree(folder, ignore_errors=True)
    lake = Lake(str(folder))
    write_atomically(lake.url_of("_tokenizer/t.json"), TOKENIZER.read_bytes(), {})
    rng = np.random.default_rng(0)
    with CatalogWriter(lake.writer_catalog_path) as writer:
        writer.register_plan(generated_plan("d", chunks, max(1, chunks // 10)), tokenizer_path="_tokenizer/t.json",
                             token_type="uint16", vocab_size=8204, split_size=1, on_error="raise")
        writer.con.execute("UPDATE chunks SET status = 'committed', num_docs = ?, num_tokens = 0, num_bytes = 1, "
                           "checksum = '0', num_records = ?", [docs_per_chunk, docs_per_chunk])
        writer.recount_progress()
        per_file = max(1, COMPACT_DOCS // docs_per_chunk)
        for first in range(0, chunks, per_file):
            count = min(per_file, chunks - first)
            n = count * docs_per_chunk
            lengths = rng.integers(20, 4000, n)
            table = pa.table({"chunk": np.repeat(np.arange(first, first + count, dtype=np.int64), docs_per_chunk),
                              "doc": np.tile(np.arange(docs_per_chunk, dtype=np.int64), count),
                              "record": np.tile(np.arange(docs_per_chunk, dtype=np.int64), count),
                              "num_tokens": lengths, "num_parts": np.ones(n, np.int64), "kind_tokens.0": lengths})
            data = encode_index_file(table)
            path = f"_documents/generated/{first}.parquet"
            write_atomically(lake.url_of(path), data, {})
            file = IndexFile(path, "d", list(range(first, first + count)), n, len(data),
                             hashlib.sha256(data).hexdigest())
            with writer.transaction():
                writer.con.execute("INSERT INTO document_index_files VALUES ($path, $dataset, $first_chunk, "
                                   "$last_chunk, $num_chunks, $num_docs, $num_bytes, $checksum, now()::TIMESTAMP)",
                                   file.record())
                writer.con.execute("INSERT INTO document_index_chunks SELECT dataset, global_index, path, ? "
                                   "FROM chunks WHERE global_index BETWEEN ? AND ?", [path, first, first + count - 1])
        publish_snapshot(writer.con, lake, None)
    config.write_text(yaml.safe_dump({"lake": str(folder), "tokenizer": str(TOKENIZER),
                                      "datasets": {"d": {"sources": ["/data/*.jsonl"]}}}))
    return config


def timed(config: Path) -> tuple[float, pd.DataFrame]:
    started = time.perf_counter()
    result = Lake(str(Path(yaml.safe_load(config.read_text())["lake"]))).sql(AGGREGATE)
    return time.perf_counter() - started, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1,000 chunks and 10^7 documents only")
    args = parser.parse_args()
    figures: dict[str, object] = {"load_average": " ".join(f"{x:.2f}" for x in os.getloadavg())}
    base = built_lake()
    for chunks in (1_000,) if args.quick else (1_000, 8_000, 32_000):
        config = grown_lake(base, chunks)
        times: dict[str, list[float]] = {"index": [], "chunk_files": []}
        answers = {}
        timed(config)   # hash records written for both paths' files
        chunk_files_only()
        timed(config)
        restore()
        for _ in range(3):
            for way in ("chunk_files", "index"):
                if way == "chunk_files":
                    chunk_files_only()
                try:
                    seconds, answers[way] = timed(config)
                finally:
                    if way == "chunk_files":
                        restore()
                times[way].append(seconds)
        pd.testing.assert_frame_equal(answers["index"], answers["chunk_files"])
        index, files = statistics.median(times["index"]), statistics.median(times["chunk_files"])
        figures[f"{chunks}_chunks_docs"] = int(answers["index"].docs.sum())
        figures[f"{chunks}_chunks_index_s"] = index
        figures[f"{chunks}_chunks_chunk_files_s"] = files
        figures[f"{chunks}_chunks_speedup"] = files / index
        shutil.rmtree(config.parent, ignore_errors=True)
    chunks, per_chunk = (10_000, 1_000) if args.quick else (100_000, 1_000)
    config = generated_lake(chunks, per_chunk)
    cold, answer = timed(config)
    warm = statistics.median(timed(config)[0] for _ in range(3))
    figures[f"generated_{chunks * per_chunk}_docs"] = int(answer.docs.sum())
    figures["generated_first_query_s (hashes the index files)"] = cold
    figures["generated_query_s"] = warm
    figures["load_average_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    report("documents_index", figures)


if __name__ == "__main__":
    main()
