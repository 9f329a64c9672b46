"""Cutting one shard into splits; every split becomes exactly one chunk."""

from __future__ import annotations

import dataclasses
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.core import url_to_fs

from lakeloader.contracts.errors import SourceError
from lakeloader.contracts.formats import RecordFormat
from lakeloader.plan.sources import Shard, readable_url


@dataclasses.dataclass(frozen=True)
class Split:
    """A part of a shard read by one build task.

    ``kind`` is ``bytes`` (documents are the lines, or a tar's samples, *starting* in ``[start, stop)``), ``row_group``
    (Parquet row group ``start``; its first row is ``first_row`` of the file) or ``file``
    (the whole compressed stream).
    """

    kind: str
    start: int
    stop: int
    first_row: int = 0


def holds_text(kind: pa.DataType) -> bool:
    """Whether a Parquet column of Arrow type ``kind`` holds text: strings, large strings, string
    views, or a dictionary of one of those."""
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)


def plan_splits(shard: Shard, split_size: int, storage_options: dict[str, Any],
                record_format: RecordFormat | None = None) -> list[Split]:
    """The splits of ``shard`` in order; empty files have none.

    A Parquet file whose text column (of a text-only ``record_format``) does not hold strings
    raises :class:`SourceError`: none of its rows could be read.
    """
    if shard.layout == "parquet":
        fs, path = url_to_fs(shard.url, **storage_options)
        with fs.open(path, "rb") as handle:
            parquet = pq.ParquetFile(handle)
            metadata, schema = parquet.metadata, parquet.schema_arrow
        if record_format is not None and record_format.text_only:
            field = record_format.columns[0]
            if field in schema.names:
                kind = schema.field(field).type
                if not holds_text(kind):
                    raise SourceError(f"{readable_url(shard.url)}: column {field!r} has type {kind}, "
                                      "expected strings; point text_field at a string column")
        splits, first_row = [], 0
        for group in range(metadata.num_row_groups):
            rows = metadata.row_group(group).num_rows
            splits.append(Split("row_group", group, group + 1, first_row))
            first_row += rows
        return splits
    if shard.compression is not None:
        return [Split("file", 0, shard.size)]
    # Text, JSON Lines and uncompressed tars (a split holds the samples whose first header starts in it).
    return [
        Split("bytes", start, min(start + split_size, shard.size))
        for start in range(0, shard.size, split_size)
    ]
