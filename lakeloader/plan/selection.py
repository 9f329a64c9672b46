"""Evaluating a filtered dataset's predicate on one chunk file (``from: web, where: ...``).

Chunk i of a dataset defined by a filter is chunk i of its source dataset (the same file) with
the documents its predicate selects: this reads only the file's part layout and the metadata
columns (and the documents' record indices when the predicate names ``doc_key``, computed from
the source file's name and each document's line: ``contracts/doc_keys.py``), selects with DuckDB
(:func:`lakeloader.contracts.selection.select_documents`) and counts what the catalog keeps of the
selected documents (row groups, parts, packing plans) exactly as a built chunk's are counted. A
build runs it as a Dask task per chunk; the audit runs it again to check the catalog.
"""

from __future__ import annotations

import dataclasses
import os
import time

import duckdb
import numpy as np
import pyarrow as pa
from fsspec.core import url_to_fs

from lakeloader.contracts.chunk_file import (
    META_PREFIX,
    PART_KINDS_COLUMN,
    PART_LENGTHS_COLUMN,
    RECORD_COLUMN,
    ChunkResult,
    group_counts,
    open_chunk,
    select_parts,
    table_parts,
    unreadable_chunk,
)
from lakeloader.contracts.doc_keys import DOC_KEY_COLUMN, doc_keys, mentions_doc_key
from lakeloader.contracts.errors import ConfigError, LakeloaderError
from lakeloader.contracts.selection import select_documents
from lakeloader.contracts.specs import PackingSpec
from lakeloader.index.chunk_packing import plan_stats


@dataclasses.dataclass(frozen=True)
class SelectionTask:
    """Everything a worker needs to evaluate one chunk of a filtered dataset (no catalog access):
    the source chunk's file and the catalog record the derived chunk takes over."""

    dataset: str            # the filtered dataset
    source: str             # its source dataset
    global_index: int
    where: str              # the predicate
    chunk_url: str          # the source chunk's file
    num_bytes: int          # the source chunk's size, checksum and records (from the catalog)
    checksum: str
    num_records: int
    kinds: int              # part kinds of the format
    storage_options: dict[str, object] = dataclasses.field(default_factory=dict)
    packing: tuple[PackingSpec, ...] = ()
    source_file: str = ""   # the source chunk's input file, as the catalog names it
    line_base: int | None = None   # the line (or Parquet row) of its record 0; None: not known yet


def evaluate_selection(task: SelectionTask) -> ChunkResult:
    """The catalog record of chunk ``task.global_index`` of filtered dataset ``task.dataset``: its
    selected documents' counts per row group of the source file, their packing counts and the
    selection itself (per row group, the selected documents within it). Reads no tokens."""
    started = time.perf_counter()
    where = f"chunk {task.global_index} of dataset {task.source!r} ({task.chunk_url})"
    fs, path = url_to_fs(task.chunk_url, **task.storage_options)
    with fs.open(path, "rb") as handle:
        try:
            parquet = open_chunk(handle)
            meta = [name for name in parquet.schema_arrow.names if name.startswith(META_PREFIX)]
            keyed = mentions_doc_key(task.where)
            table = parquet.read(columns=[PART_LENGTHS_COLUMN, PART_KINDS_COLUMN, *meta,
                                          *([RECORD_COLUMN] if keyed else [])])
            rows = [parquet.metadata.row_group(g).num_rows for g in range(parquet.metadata.num_row_groups)]
        except (OSError, pa.ArrowException) as exc:
            raise unreadable_chunk(where, exc) from exc
    parts = table_parts(table)
    candidate = pa.table({**{name.removeprefix(META_PREFIX): table.column(name) for name in meta},
                          "num_tokens": pa.array(parts.content_lengths)})
    if keyed:
        candidate = candidate.append_column(DOC_KEY_COLUMN, pa.array(_doc_keys(task, table, where), pa.uint64()))
    try:
        selected = select_documents(task.where, candidate)
    except duckdb.Error as exc:   # bound at planning, failed on a value (a cast, say)
        raise ConfigError(f"datasets.{task.dataset}.where = {task.where!r} fails on the documents of {where}: "
                          f"{str(exc).splitlines()[0]}; fix the predicate (e.g. TRY_CAST instead of CAST)") from exc
    chosen, _ = select_parts(parts, selected)
    file_bounds = np.concatenate([[0], np.cumsum(rows, dtype=np.int64)]) if parts.num_docs else np.zeros(1, np.int64)
    bounds = np.searchsorted(selected, file_bounds).astype(np.int64)   # row groups in selected numbering
    counts = group_counts(bounds, chosen, task.kinds)
    label = f"dataset {task.dataset!r}, chunk {task.global_index} (of {where})"
    return ChunkResult(
        dataset=task.dataset, global_index=task.global_index, num_docs=len(selected),
        num_tokens=int(chosen.part_lengths.sum()), num_records=task.num_records, num_bytes=task.num_bytes,
        checksum=task.checksum, row_group_docs=counts.docs, row_group_tokens=counts.tokens,
        row_group_parts=counts.parts, row_group_part_tokens=counts.part_tokens, rejects=[], source_bytes=0,
        seconds=time.perf_counter() - started, worker=f"{os.uname().nodename}:{os.getpid()}",
        plans=tuple(plan_stats(spec, chosen, task.global_index, label) for spec in task.packing),
        selection=tuple((int(first), selected[bounds[g]:bounds[g + 1]] - np.int32(first))
                        for g, first in enumerate(file_bounds[:-1].tolist())),
    )


def _doc_keys(task: SelectionTask, table: pa.Table, where: str) -> np.ndarray:
    """The doc_key of each document of the chunk (``table`` holds its record column): of its
    source file's name and its line, the line of record 0 plus its record index."""
    if task.line_base is None:   # the build waits for it (pending_selections); never a user's mistake
        raise LakeloaderError(f"dataset {task.dataset!r}: the doc_key of the documents of {where} is not known before "
                              "the earlier splits of its file are committed; build again")
    records = table.column(RECORD_COLUMN).to_numpy().astype(np.int64)
    return doc_keys(task.source_file, task.line_base + records)
