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

from lakeloader.contracts.chunk_file import (
    PART_KINDS_COLUMN,
    PART_LENGTHS_COLUMN,
    PART_REFS_COLUMN,
    RECORD_COLUMN,
    TOKENS_COLUMN,
    ChunkParts,
    ChunkResult,
    PlanStats,
    document_rows,
    group_counts,
    metadata_column,
    open_chunk,
    table_parts,
    unreadable_chunk,
)
from lakeloader.contracts.formats import Document
from lakeloader.contracts.media import PART_HEIGHTS_COLUMN, PART_WIDTHS_COLUMN, media_path
from lakeloader.contracts.specs import PackingSpec
from lakeloader.index.chunk_packing import plan_stats
from lakeloader.ingest.documents import SplitSource, read_split
from lakeloader.ingest.media import StoredImages, encode_media_file, no_images
from lakeloader.storage import is_transient, with_retries, write_atomically, write_failure
from lakeloader.tokenizer import DocumentEncoder, EncoderMismatchError, backend_of

# Target size of a data page before compression (about 64K tokens): a reader starting cold (a
# shuffled first batch) decodes only the pages its windows reach, not their whole row groups.
DATA_PAGE_BYTES = 256 << 10
# The page sizes of chunk files written before, newest first (pyarrow's default, 1 MiB, until
# DATA_PAGE_BYTES): a repair rebuilds a committed chunk byte for byte as its lake's files were written.
EARLIER_DATA_PAGE_BYTES = (1 << 20,)


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
    packing: tuple[PackingSpec, ...] = ()   # plans whose per-chunk counts the catalog keeps
    encoder: str = ""       # the dataset plan's encoder with its version ("": tokenizers, any version)
    repair_checksum: str | None = None   # a committed chunk rebuilt: the sha256 its file must have


@functools.lru_cache(maxsize=4)
def _encoder(tokenizer_url: str, options: str, encoder: str) -> DocumentEncoder:
    """The encoder the dataset was planned with (``encoder``), loaded once per worker process;
    EncoderMismatchError when this worker's differs (another version installed, say)."""
    fs, path = url_to_fs(tokenizer_url, **json.loads(options))
    text = fs.cat_file(path).decode()
    tokenizer = Tokenizer.from_str(text)
    try:
        loaded = DocumentEncoder(tokenizer, backend=backend_of(encoder), text=text)
    except (ImportError, ValueError) as exc:
        raise EncoderMismatchError(
            f"worker {os.uname().nodename}:{os.getpid()} cannot load the encoder {encoder!r} the dataset "
            f"was planned with ({exc}); install it on every worker (pip install {encoder.replace(' ', '==')})"
        ) from exc
    if encoder and loaded.name != encoder:
        raise EncoderMismatchError(
            f"worker {os.uname().nodename}:{os.getpid()} has {loaded.name} but the dataset was planned with "
            f"{encoder}: ids of two encoders never mix in one dataset; install "
            f"{encoder.replace(' ', '==')} on every worker, or build again from a machine with {loaded.name} "
            "(which re-plans the dataset)"
        )
    return loaded


def row_group_bounds(lengths: np.ndarray, target_tokens: int) -> np.ndarray:
    """Document index where each row group starts (plus the end): a group holds the documents
    whose first token falls in the same ``target_tokens``-sized span of the chunk."""
    starts = np.cumsum(lengths) - lengths
    group = starts // target_tokens
    first_of_group = np.flatnonzero(np.diff(group, prepend=-1))
    return np.append(first_of_group, len(lengths)).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class EncodedParts:
    """A split's documents as token ids: every part's tokens back to back, and their layout."""

    ids: np.ndarray             # all parts' tokens
    parts: ChunkParts
    part_refs: list[str | None]


def encode_parts(encoder: DocumentEncoder, documents: list[Document]) -> EncodedParts:
    """Tokenize every part of ``documents`` in one batch (without special tokens)."""
    parts = [part for document in documents for part in document]
    ids, lengths = encoder.encode([part.text for part in parts])
    kinds = np.fromiter((part.kind for part in parts), dtype=np.int64, count=len(parts))
    per_doc = np.fromiter((len(d) for d in documents), dtype=np.int64, count=len(documents))
    part_doc = np.repeat(np.arange(len(documents), dtype=np.int64), per_doc)
    return EncodedParts(ids, ChunkParts(lengths.astype(np.int64), kinds, part_doc, len(documents)),
                        [part.ref for part in parts])


def _lists(values: pa.Array, counts: np.ndarray) -> pa.Array:
    offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return pa.LargeListArray.from_arrays(pa.array(offsets), values)


def chunk_table(records: list[int], encoded: EncodedParts, with_refs: bool,
                metadata: dict[str, pa.Array] | None = None, images: StoredImages | None = None) -> pa.Table:
    """The Parquet table of one chunk: a row per document with its tokens and part layout, its
    ``metadata`` values (a column per field, see ``metadata_column``) and, for stored ``images``,
    each part's image size."""
    parts = encoded.parts
    columns = {
        RECORD_COLUMN: pa.array(records, type=pa.int64()),
        TOKENS_COLUMN: _lists(pa.array(encoded.ids), parts.content_lengths),
        PART_LENGTHS_COLUMN: _lists(pa.array(parts.part_lengths.astype(np.int32)), parts.parts_per_doc),
        PART_KINDS_COLUMN: _lists(pa.array(parts.part_kinds.astype(np.int8)), parts.parts_per_doc),
    }
    if with_refs:
        columns[PART_REFS_COLUMN] = _lists(pa.array(encoded.part_refs, pa.string()), parts.parts_per_doc)
    if images is not None:
        columns[PART_WIDTHS_COLUMN] = _lists(pa.array(images.part_widths, pa.int32()), parts.parts_per_doc)
        columns[PART_HEIGHTS_COLUMN] = _lists(pa.array(images.part_heights, pa.int32()), parts.parts_per_doc)
    for field, values in (metadata or {}).items():
        columns[metadata_column(field)] = values
    return pa.table(columns)


def plan_committed_chunk(chunk_url: str, storage_options: dict[str, object], global_index: int,
                         specs: tuple[PackingSpec, ...]) -> tuple[int, tuple[PlanStats, ...]]:
    """Packing counts of an already built chunk (reads only its small part-layout columns, and its
    images' sizes where it stores images: a new resolution policy re-plans from these)."""
    fs, path = url_to_fs(chunk_url, **storage_options)
    where = f"chunk {global_index} ({chunk_url})"
    with fs.open(path, "rb") as handle:
        try:
            parquet = open_chunk(handle)
            table = parquet.read(columns=[c for c in (PART_LENGTHS_COLUMN, PART_KINDS_COLUMN, PART_WIDTHS_COLUMN,
                                                      PART_HEIGHTS_COLUMN) if c in parquet.schema_arrow.names])
        except (OSError, pa.ArrowException) as exc:
            raise unreadable_chunk(where, exc) from exc
    parts = table_parts(table)
    return global_index, tuple(plan_stats(spec, parts, global_index, where) for spec in specs)


def encode_chunk_file(table: pa.Table, bounds: np.ndarray, data_page_bytes: int = DATA_PAGE_BYTES) -> bytes:
    """Parquet bytes of ``table`` with one row group per ``bounds`` interval (deterministic)."""
    sink = io.BytesIO()
    with pq.ParquetWriter(
        sink, table.schema, compression="zstd", compression_level=1, use_dictionary=False,
        write_statistics=False, store_schema=True, write_page_checksum=True, data_page_size=data_page_bytes,
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
                          what=f"chunk {task.global_index} of dataset {task.dataset!r} ({task.source.name})")
    return dataclasses.replace(result, retries=retries[0])


def _build_chunk(task: ChunkTask) -> ChunkResult:
    started = time.perf_counter()
    options = task.source.storage_options
    encoder = _encoder(task.tokenizer_url, json.dumps(options, sort_keys=True), task.encoder)
    record_format = task.source.record_format
    documents = read_split(task.source)
    try:
        encoded = encode_parts(encoder, documents.documents)
    except EncoderMismatchError as exc:
        raise EncoderMismatchError(
            f"dataset {task.dataset!r}, chunk {task.global_index} (from {task.source.name}): {exc}") from exc
    lengths = encoded.parts.content_lengths
    bounds = row_group_bounds(lengths, task.row_group_tokens)
    images = (documents.images or no_images()) if record_format.stores_images else None
    table = chunk_table(documents.records, encoded, record_format.format == "interleaved", documents.metadata,
                        images)
    data = encode_chunk_file(table, bounds)
    if task.repair_checksum is not None and hashlib.sha256(data).hexdigest() != task.repair_checksum:
        # A file an earlier lakeloader wrote: rebuilt with its page size (else the driver names the mismatch).
        for page_bytes in EARLIER_DATA_PAGE_BYTES:
            earlier = encode_chunk_file(table, bounds, page_bytes)
            if hashlib.sha256(earlier).hexdigest() == task.repair_checksum:
                data = earlier
                break
    media = encode_media_file(images) if images is not None else None
    parts = encoded.parts if images is None else dataclasses.replace(   # (sizes: a patches resolution's tokens)
        encoded.parts, part_widths=np.asarray(images.part_widths, np.int64),
        part_heights=np.asarray(images.part_heights, np.int64))
    try:
        if media is not None:   # first: a committed chunk's media file is always there
            write_atomically(media_path(task.chunk_url), media, options)
        write_atomically(task.chunk_url, data, options)
    except OSError as exc:
        if is_transient(exc):
            raise  # retried by build_chunk
        raise write_failure(f"chunk {task.global_index} of dataset {task.dataset!r}", task.chunk_url, exc) from exc
    counts = group_counts(bounds, encoded.parts, len(record_format.kind_names))
    return ChunkResult(
        dataset=task.dataset,
        global_index=task.global_index,
        num_docs=len(lengths),
        num_tokens=int(lengths.sum()),
        num_records=documents.num_records,
        num_bytes=len(data),
        checksum=hashlib.sha256(data).hexdigest(),
        row_group_docs=counts.docs,
        row_group_tokens=counts.tokens,
        row_group_parts=counts.parts,
        row_group_part_tokens=counts.part_tokens,
        rejects=documents.rejects,
        source_bytes=documents.source_bytes,
        seconds=time.perf_counter() - started,
        worker=f"{os.uname().nodename}:{os.getpid()}",
        media_bytes=None if media is None else len(media),
        media_checksum=None if media is None else hashlib.sha256(media).hexdigest(),
        images=images.rows if images is not None else (),
        plans=tuple(plan_stats(spec, parts, task.global_index,
                               f"dataset {task.dataset!r}, chunk {task.global_index} (from {task.source.name})")
                    for spec in task.packing),
        documents=document_rows(task.global_index, table, encoded.parts, len(record_format.kind_names)),
    )
