"""One build task: read a split, tokenize it, write its chunk file atomically, return its stats."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
import os
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.core import url_to_fs
from tokenizers import Tokenizer

from lakeloader.build.documents import Reject, SplitSource, read_split
from lakeloader.storage import with_retries, write_atomically
from lakeloader.tokenizer import DocumentEncoder

# Column of each document's line/row index counted from its split's first record.
RECORD_COLUMN = "record"


@dataclasses.dataclass(frozen=True)
class ChunkTask:
    """Everything a worker needs to build one chunk (no catalog access)."""

    dataset: str
    global_index: int
    source: SplitSource
    chunk_url: str          # where the chunk file goes
    tokenizer_url: str      # the lake's copy of the tokenizer
    row_group_tokens: int
    io_retry_deadline: float = 0.0   # seconds of retrying transient storage errors



@dataclasses.dataclass(frozen=True)
class ChunkResult:
    """What the driver commits to the catalog for one chunk."""

    dataset: str
    global_index: int
    num_docs: int
    num_tokens: int
    num_records: int
    num_bytes: int
    checksum: str
    row_group_docs: list[int]
    row_group_tokens: list[int]
    rejects: list[Reject]
    source_bytes: int
    seconds: float
    worker: str
    retries: int = 0        # attempts repeated after transient storage errors


@functools.lru_cache(maxsize=4)
def _encoder(tokenizer_url: str, options: str) -> DocumentEncoder:
    fs, path = url_to_fs(tokenizer_url, **json.loads(options))
    return DocumentEncoder(Tokenizer.from_str(fs.cat_file(path).decode()))


def row_group_bounds(lengths: np.ndarray, target_tokens: int) -> np.ndarray:
    """Document index where each row group starts (plus the end): a group holds the documents
    whose first token falls in the same ``target_tokens``-sized span of the chunk."""
    starts = np.cumsum(lengths) - lengths
    group = starts // target_tokens
    first_of_group = np.flatnonzero(np.diff(group, prepend=-1))
    return np.append(first_of_group, len(lengths)).astype(np.int64)


def chunk_table(records: list[int], ids: np.ndarray, lengths: np.ndarray) -> pa.Table:
    """The Parquet table of one chunk: a row per document with its token list."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(ids))
    return pa.table({RECORD_COLUMN: pa.array(records, type=pa.int64()), "text": tokens})


def encode_chunk_file(table: pa.Table, bounds: np.ndarray) -> bytes:
    """Parquet bytes of ``table`` with one row group per ``bounds`` interval (deterministic)."""
    sink = io.BytesIO()
    with pq.ParquetWriter(
        sink, table.schema, compression="zstd", compression_level=1, use_dictionary=False,
        write_statistics=False, store_schema=True,
    ) as writer:
        if len(bounds) == 1:
            writer.write_table(table)
        for start, stop in zip(bounds[:-1], bounds[1:]):
            writer.write_table(table.slice(start, stop - start), row_group_size=stop - start)
    return sink.getvalue()


def build_chunk(task: ChunkTask) -> ChunkResult:
    """Read, tokenize and write one chunk; deterministic in its inputs, so a whole attempt is
    repeated while storage is unreachable (up to ``task.io_retry_deadline`` seconds)."""
    retries = [0]

    def count() -> None:
        retries[0] += 1

    result = with_retries(lambda: _build_chunk(task), on_retry=count, deadline=task.io_retry_deadline,
                          what=f"chunk {task.global_index} of dataset {task.dataset!r} ({task.source.url})")
    return dataclasses.replace(result, retries=retries[0])


def _build_chunk(task: ChunkTask) -> ChunkResult:
    started = time.perf_counter()
    options = task.source.storage_options
    encoder = _encoder(task.tokenizer_url, json.dumps(options, sort_keys=True))
    documents = read_split(task.source)
    ids, lengths = encoder.encode(documents.texts)
    bounds = row_group_bounds(lengths, task.row_group_tokens)
    data = encode_chunk_file(chunk_table(documents.records, ids, lengths), bounds)
    write_atomically(task.chunk_url, data, options)
    group_tokens = np.add.reduceat(lengths, bounds[:-1]) if len(lengths) else np.zeros(0, np.int64)
    return ChunkResult(
        dataset=task.dataset,
        global_index=task.global_index,
        num_docs=len(lengths),
        num_tokens=int(lengths.sum()),
        num_records=documents.num_records,
        num_bytes=len(data),
        checksum=hashlib.sha256(data).hexdigest(),
        row_group_docs=np.diff(bounds).tolist(),
        row_group_tokens=group_tokens.astype(np.int64).tolist(),
        rejects=documents.rejects,
        source_bytes=documents.source_bytes,
        seconds=time.perf_counter() - started,
        worker=f"{os.uname().nodename}:{os.getpid()}",
    )
