"""Cutting one shard into splits; every split becomes exactly one chunk."""

from __future__ import annotations

import dataclasses
from typing import Any

import pyarrow.parquet as pq
from fsspec.core import url_to_fs

from lakeloader.plan.sources import Shard


@dataclasses.dataclass(frozen=True)
class Split:
    """A part of a shard read by one build task.

    ``kind`` is ``bytes`` (documents are the lines *starting* in ``[start, stop)``), ``row_group``
    (Parquet row group ``start``; its first row is ``first_row`` of the file) or ``file``
    (the whole compressed stream).
    """

    kind: str
    start: int
    stop: int
    first_row: int = 0


def plan_splits(shard: Shard, split_size: int, storage_options: dict[str, Any]) -> list[Split]:
    """The splits of ``shard`` in order; empty files have none."""
    if shard.layout == "parquet":
        fs, path = url_to_fs(shard.url, **storage_options)
        with fs.open(path, "rb") as handle:
            metadata = pq.ParquetFile(handle).metadata
        splits, first_row = [], 0
        for group in range(metadata.num_row_groups):
            rows = metadata.row_group(group).num_rows
            splits.append(Split("row_group", group, group + 1, first_row))
            first_row += rows
        return splits
    if shard.compression is not None:
        return [Split("file", 0, shard.size)]
    return [
        Split("bytes", start, min(start + split_size, shard.size))
        for start in range(0, shard.size, split_size)
    ]
