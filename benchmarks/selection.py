"""The cost of a dataset defined by a filter next to the build of the same lake.

Builds a lake of the demo corpus (``--size demo``, or the >= 100 MB ``bench`` corpus) with one
metadata field (each document's ``path``), then builds it again with a filtered dataset added
(``from: code, where: --where``): that second build tokenizes nothing and only evaluates the
predicate on every chunk (reading each chunk file's part layout and metadata, never its tokens).
Prints both wall times (each with planning and cluster start), their ratio, and the selection
tasks alone measured in one process (no cluster).

    .venv/bin/python benchmarks/selection.py [--size demo|bench] [--workers 2] [--where SQL]
"""

from __future__ import annotations

import argparse
import logging
import shutil
import time

import yaml
from _common import OUT, REPO, report

from lakeloader.catalog.lake import open_lake
from lakeloader.catalog.sql import query
from lakeloader.demo.corpus import prepare_corpus
from lakeloader.ingest.driver import build
from lakeloader.plan.selection import SelectionTask, evaluate_selection

TOKENIZER = REPO / "demo" / "tokenizer.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=["demo", "bench"], default="demo")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--split-size", default="1MB")
    parser.add_argument("--where", default="path LIKE 'email/%' OR num_tokens < 2048")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    files = sorted(str(p) for p in prepare_corpus(OUT / f"{args.size}-corpus", size=args.size)["code"])
    lake = OUT / "selection-lake"
    shutil.rmtree(lake, ignore_errors=True)
    datasets = {"code": {"sources": files, "metadata_fields": {"path": "string"}}}
    settings = {"lake": str(lake), "tokenizer": str(TOKENIZER),
                "build": {"split_size": args.split_size, "publish_interval": 5}}
    plain, filtered = OUT / "selection-plain.yaml", OUT / "selection-filtered.yaml"
    plain.write_text(yaml.safe_dump({**settings, "datasets": datasets}))
    filtered.write_text(yaml.safe_dump({
        **settings, "datasets": {**datasets, "selected": {"from": "code", "where": args.where}},
        "mixture": {"weights": {"code": 1, "selected": 1}}}))

    started = time.perf_counter()
    built = build(plain, workers=args.workers, progress=False)
    build_wall = time.perf_counter() - started
    started = time.perf_counter()
    selected = build(filtered, workers=args.workers, progress=False)
    select_wall = time.perf_counter() - started
    assert selected.chunks_built == 0, "selecting must tokenize nothing"

    opened = open_lake(filtered)
    rows = opened.sql(query("pending_selections"), {"datasets": ["selected"], "committed": True})
    started = time.perf_counter()
    for row in rows.itertuples(index=False):
        evaluate_selection(SelectionTask(
            dataset="selected", source="code", global_index=int(row.global_index), where=args.where,
            chunk_url=opened.url_of(row.path), num_bytes=int(row.num_bytes), checksum=row.checksum,
            num_records=int(row.num_records), kinds=1))
    tasks_seconds = time.perf_counter() - started
    counts = opened.sql("SELECT name, num_docs, num_tokens FROM datasets ORDER BY name").set_index("name")
    shutil.rmtree(lake, ignore_errors=True)
    report("selection", {
        "corpus": args.size,
        "chunks": built.chunks_built,
        "source_docs": int(counts.num_docs["code"]),
        "source_tokens": built.tokens,
        "selected_docs": int(counts.num_docs["selected"]),
        "selected_tokens": int(counts.num_tokens["selected"]),
        "where": args.where,
        "workers": args.workers,
        "build_seconds (wall, incl. planning and cluster start)": round(build_wall, 2),
        "selection_build_seconds (wall, same; tokenizes nothing)": round(select_wall, 2),
        "ratio selection/build": round(select_wall / build_wall, 3),
        "selection_tasks_seconds (one process, every chunk)": round(tasks_seconds, 3),
        "selection_tasks_ms_per_chunk": round(1000 * tasks_seconds / max(len(rows), 1), 2),
        "ratio selection_tasks/build": round(tasks_seconds / build_wall, 3),
    })


if __name__ == "__main__":
    main()
