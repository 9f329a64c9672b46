"""A lake with many chunks without building them: a built dataset's committed chunks repeated in
its catalog (chunk ``i`` is a copy of chunk ``i % committed`` and shares its file), published as a
new snapshot; or a generated plan of many chunks, none built. For measuring what grows with the
number of chunks (opening a loader, seeking, the driver's commits).

    python -m lakeloader.demo.many_chunks CONFIG DATASET CHUNKS
"""

from __future__ import annotations

import argparse

import numpy as np
import pandas as pd

from lakeloader.catalog.lake import Lake
from lakeloader.catalog.snapshot import publish_snapshot
from lakeloader.catalog.sql import query
from lakeloader.catalog.store import CatalogWriter
from lakeloader.config import load_config
from lakeloader.contracts.errors import LakeloaderError
from lakeloader.plan.planner import DatasetPlan
from lakeloader.plan.sources import Shard

TABLES = ("chunks", "row_groups", "chunk_examples")


def grow(lake: Lake, dataset: str, chunks: int) -> int:
    """Make dataset ``dataset`` of the built, complete ``lake`` ``chunks`` chunks long by repeating
    its chunks in the writer's catalog, then publish the snapshot readers open; returns its version.
    Growing it again starts from the chunks it has, so grow a fresh copy of a lake to shrink it."""
    with CatalogWriter(lake.writer_catalog_path) as writer:
        con = writer.con
        planned, committed = con.execute(query("demo_committed_chunks"), {"name": dataset}).fetchone()
        if not committed or committed != planned:
            raise LakeloaderError(f"dataset {dataset!r} of {lake.url} is not complete ({committed} of "
                                  f"{planned} chunks committed): build it first (lakeloader build CONFIG)")
        with writer.transaction():
            for table in TABLES:
                con.execute(query("demo_copy_rows").format(table=table), {"name": dataset})
                con.execute(query("demo_delete_rows").format(table=table), {"name": dataset})
                con.execute(query("demo_repeat_rows").format(table=table), {"chunks": chunks, "base": committed})
        writer.recount_progress([dataset])
        return publish_snapshot(con, lake, None)


def generated_plan(name: str, chunks: int, shards: int) -> DatasetPlan:
    """A plan of dataset ``name`` (format text) of ``chunks`` byte-split chunks over ``shards``
    JSON Lines files that do not exist, chunk ``i`` split ``i // shards`` of shard ``i % shards``:
    a catalog's rows for chunks never tokenized."""
    table = pd.DataFrame({
        "global_index": np.arange(chunks), "shard_index": np.arange(chunks) % shards,
        "split_index": np.arange(chunks) // shards,
        "path": [f"{name}/{'f' * 16}/{i % shards:05d}-{i // shards:06d}.parquet" for i in range(chunks)],
        "split_kind": "bytes", "split_start": 0, "split_stop": 1, "first_row": 0})
    return DatasetPlan(name, "f" * 64, "text", ("text",),
                       [Shard(f"/data/{i}.jsonl", 1, "0", "jsonl", None) for i in range(shards)], table, [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config")
    parser.add_argument("dataset")
    parser.add_argument("chunks", type=int)
    args = parser.parse_args()
    config = load_config(args.config)
    print(grow(Lake(config.lake, config.storage_options), args.dataset, args.chunks))


if __name__ == "__main__":
    main()
