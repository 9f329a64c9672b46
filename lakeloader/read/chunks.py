"""Chunk files: verified once against the catalog, every page read checked against its CRC-32,
row groups read (the tokens' pages decoded by :mod:`lakeloader.read.pages`) and cached."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from lakeloader.catalog.hash_records import HashRecords, whole_sha256
from lakeloader.catalog.lake import Lake
from lakeloader.contracts.chunk_file import (
    PART_KINDS_COLUMN,
    PART_LENGTHS_COLUMN,
    PART_REFS_COLUMN,
    TOKENS_COLUMN,
    ChunkParts,
    altered_chunk,
    missing_chunk,
    open_chunk,
    select_parts,
    sha256_mismatch,
    size_mismatch,
    table_parts,
    unreadable_chunk,
)
from lakeloader.contracts.errors import ChunkIntegrityError, LakeloaderError
from lakeloader.contracts.media import PART_HEIGHTS_COLUMN, PART_WIDTHS_COLUMN
from lakeloader.index.ranges import cumulative
from lakeloader.read.catalog_view import CatalogView, DatasetChunks
from lakeloader.read.disk_cache import DiskCache
from lakeloader.read.lru import LRU
from lakeloader.read.pages import (
    ColumnChunk,
    DamagedBytes,
    footer_row_groups,
    layout_column_chunk,
    leaf_column,
    read_column_ranges,
)
from lakeloader.storage import with_retries

# Memory for the parsed footers of the chunk files read last (a few KB each; a row group read
# otherwise parses its file's footer again, a cost that grows with the file's row groups).
FOOTER_BYTES_KEPT = 64 << 20
_PARQUET_MAGIC = b"PAR1"


def _footer_bytes(handle: pa.NativeFile) -> bytes | None:
    """The serialized footer of the Parquet file open as ``handle`` (None if it has none, e.g.
    it is truncated: parsing it then raises as it would have)."""
    size = handle.size()
    if size < 12:
        return None
    tail = handle.read_at(8, size - 8)
    length = int.from_bytes(tail[:4], "little")
    if tail[4:] != _PARQUET_MAGIC or length + 12 > size:
        return None
    return handle.read_at(length, size - 8 - length)


_PART_COLUMNS = (PART_LENGTHS_COLUMN, PART_KINDS_COLUMN)
# An interleaved chunk's: its parts' references, and its stored images' sizes (contracts/media.py).
_IMAGE_COLUMNS = (PART_REFS_COLUMN, PART_WIDTHS_COLUMN, PART_HEIGHTS_COLUMN)


def _serialized(metadata: pq.FileMetaData) -> bytes:
    """The bytes of the footer ``metadata`` was parsed from (pyarrow writes them back unchanged)."""
    sink = pa.BufferOutputStream()
    metadata.write_metadata_file(sink)
    return sink.getvalue().to_pybytes()[4:-8]


class Footer:
    """A chunk file's parsed footer and what reading its row groups asks of it, taken out once
    per file (its Arrow schema's names and value types, each row group's documents and the
    column chunks decoded by :mod:`lakeloader.read.pages`). The row groups and column chunks are
    read from the footer's bytes (``serialized``; default: ``metadata`` written back) by
    :func:`~lakeloader.read.pages.footer_row_groups`, which raises
    :class:`~lakeloader.read.pages.DamagedBytes` for a footer that makes no sense; ``data_end``:
    where the footer starts in its file (column chunks lie before it)."""

    def __init__(self, metadata: pq.FileMetaData, serialized: bytes | None = None,
                 data_end: int | None = None) -> None:
        self.metadata = metadata
        schema = metadata.schema.to_arrow_schema()
        self.names = frozenset(schema.names)
        # The value type of each list column decoded here, and its one leaf (None: left to pyarrow).
        self.value_types = {name: schema.field(name).type.value_type for name in (TOKENS_COLUMN, *_PART_COLUMNS)
                            if name in self.names and isinstance(schema.field(name).type, (pa.ListType, pa.LargeListType))}
        self.leaves = {name: leaf_column(metadata, name) for name in self.value_types}
        self.layout = footer_row_groups(_serialized(metadata) if serialized is None else serialized, data_end)
        self.num_rows = [group.num_rows for group in self.layout]
        if (len(self.layout) != metadata.num_row_groups or sum(self.num_rows) != metadata.num_rows
                or any(len(group.columns) != metadata.num_columns for group in self.layout)):
            raise DamagedBytes(f"the footer's {len(self.layout)} row groups of {sum(self.num_rows)} rows do not add "
                               f"up to its {metadata.num_row_groups} of {metadata.num_rows} rows in "
                               f"{metadata.num_columns} columns each")
        self._chunks: dict[tuple[int, str], ColumnChunk | None] = {}

    def column(self, group: int, name: str) -> ColumnChunk | None:
        """The chunk of list column ``name`` in row group ``group`` (None: not one decoded here)."""
        key = (group, name)
        if key not in self._chunks:   # (threads may both fill it: the same value)
            leaf = self.leaves.get(name)
            self._chunks[key] = None if leaf is None else layout_column_chunk(self.layout, self.metadata, group, leaf)
        return self._chunks[key]

    def fits(self, chunks: DatasetChunks, index: int) -> bool:
        """Whether this footer agrees with the catalog's record of chunk ``index``: the tokens'
        type, and the documents of a chunk read whole (a filtered dataset's hold fewer)."""
        tokens = self.value_types.get(TOKENS_COLUMN)
        if tokens is not None and tokens != pa.from_numpy_dtype(np.dtype(chunks.token_type)):
            return False
        return chunks.filtered or sum(self.num_rows) == int(chunks.num_docs[index])

    def one_part_each(self, group: int) -> bool:
        """Whether the part columns of row group ``group`` hold one value per document, as plain
        text's do (then :meth:`single_part_layout` decodes them)."""
        docs = self.num_rows[group]
        return PART_REFS_COLUMN not in self.names and all(
            (chunk := self.column(group, name)) is not None and chunk.num_values == docs for name in _PART_COLUMNS)

    def read_values(self, handle: pa.NativeFile, group: int, name: str, count: int,
                    ranges: Sequence[tuple[int, int]]) -> list[np.ndarray] | None:
        """:func:`~lakeloader.read.pages.read_column_ranges` of list column ``name`` in row group
        ``group`` (None: read it with pyarrow)."""
        chunk = self.column(group, name)
        return None if chunk is None else read_column_ranges(handle, chunk, self.value_types[name], count, ranges)

    def single_part_layout(self, handle: pa.NativeFile, group: int) -> ChunkParts | None:
        """The part layout of row group ``group`` decoded here when each of its documents has
        exactly one part (plain text): one level entry per document in both part columns, each a
        value. None otherwise (read it with pyarrow)."""
        docs = self.num_rows[group]
        if not self.one_part_each(group):
            return None
        lengths = self.read_values(handle, group, PART_LENGTHS_COLUMN, docs, [(0, docs)])
        kinds = None if lengths is None else self.read_values(handle, group, PART_KINDS_COLUMN, docs, [(0, docs)])
        if lengths is None or kinds is None:
            return None
        return ChunkParts(lengths[0].astype(np.int64), kinds[0].astype(np.int64), np.arange(docs, dtype=np.int64), docs)


def _nbytes(item: Any) -> int:
    if item is None:   # an optional field left out costs nothing
        return 0
    if isinstance(item, np.ndarray):
        return item.nbytes
    if dataclasses.is_dataclass(item):
        return sum(_nbytes(getattr(item, f.name)) for f in dataclasses.fields(item))
    if isinstance(item, (tuple, list)):
        return sum(_nbytes(x) for x in item)
    return 64


class RowGroupCache(LRU[tuple[Any, ...], Any]):
    """Decoded row groups and what is derived from them (arrays or dataclasses of arrays),
    bounded in bytes, least recently used first (:class:`~lakeloader.read.lru.LRU`). A value is
    computed once even when read-ahead threads ask for it together."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(max_bytes, _nbytes)


@dataclasses.dataclass(frozen=True)
class RowGroup:
    """One row group of a chunk: stored tokens and each document's parts."""

    values: np.ndarray          # all parts' tokens back to back
    parts: ChunkParts           # part layout, documents numbered from 0 (from ``first_doc``)
    refs: np.ndarray | None     # interleaved: reference of each part (None for text parts)
    first_doc: int = 0          # the row group's document read first (only some were read)


def _selected(group: RowGroup, docs: np.ndarray) -> RowGroup:
    """Documents ``docs`` (ascending, within the row group) of ``group``, renumbered from 0."""
    parts, kept = select_parts(group.parts, docs)
    values = group.values[np.repeat(kept, group.parts.part_lengths)]
    return RowGroup(values, parts, None if group.refs is None else group.refs[kept])


class ChunkFiles:
    """Opens chunk files of a lake, checks each once against the catalog, reads row groups.

    The chunks of a dataset defined by a filter are its source's files: what is read of them
    here is only the documents the catalog's selection (read through ``view``) keeps, so every
    reader above sees an ordinary dataset."""

    def __init__(self, lake: Lake, verify: str, cache_bytes: int, disk_cache_bytes: int,
                 io_retry_deadline: float = 0.0, view: CatalogView | None = None) -> None:
        self.lake = lake
        self.view = view
        self.io_retry_deadline = io_retry_deadline
        self.verify = verify
        self.cache = RowGroupCache(cache_bytes)
        self.disk = None if lake.is_local else DiskCache(lake, disk_cache_bytes)
        # A local lake's files hashed by an earlier process stay vouched for while unchanged (the
        # disk cache touches its copies on every use: they are hashed once per process).
        self.hash_records = HashRecords(lake.cache_dir) if lake.is_local else None
        self._verified: LRU[str, bool] = LRU(sys.maxsize)   # paths checked against the catalog (never evicted)
        self._hashed: set[str] = set()   # paths whose sha256 this process found as the catalog says
        self._proofs: LRU[str, str] = LRU(sys.maxsize)   # path hashed by _prove -> its problem ("": none)
        self._lock = threading.Lock()
        self.files_opened: set[str] = set()   # lake-relative paths this process opened
        # Keyed by the footer's own bytes, read from the file each time: a chunk rebuilt in place
        # (other bytes, whatever the catalog says) is parsed again, never read with a stale footer.
        # Each counted as 10 times its serialized size: the key's bytes, and parsed (about 9 times, measured).
        self._footers: LRU[tuple[str, bytes], Footer] = LRU(
            FOOTER_BYTES_KEPT, lambda footer: 10 * footer.metadata.serialized_size)

    def _open(self, chunks: DatasetChunks, index: int) -> pa.NativeFile:
        """An open handle of chunk ``index``'s bytes (the lake's own file, or a cached copy)."""
        path = chunks.record(index).path
        try:
            if self.disk is None:
                return pa.OSFile(self.lake.path_of(path))
            disk = self.disk
            return with_retries(lambda: disk.open(path, chunks.record(index).num_bytes),
                                what=f"reading chunk {index} of dataset {chunks.name!r}",
                                deadline=self.io_retry_deadline)
        except FileNotFoundError:
            raise missing_chunk(self._where(chunks, index)) from None

    def _check(self, chunks: DatasetChunks, index: int, handle: pa.NativeFile) -> None:
        """Chunk ``index`` (open as ``handle``) checked against the catalog once: threads opening
        it together wait for one check (a shuffled first batch reads several row groups of a chunk
        at once) instead of each hashing the file."""
        self._verified.get(chunks.record(index).path, lambda: self._verify(chunks, index, handle))

    def _verify(self, chunks: DatasetChunks, index: int, handle: pa.NativeFile) -> bool:
        record = chunks.record(index)
        path = record.path
        size = handle.size()
        problem = None
        if size != record.num_bytes:
            problem = f"has {size_mismatch(size, record.num_bytes)}"
        elif self.verify == "checksum":
            problem = self._hash_problem(chunks, index, handle)
        if problem:
            raise altered_chunk(self._where(chunks, index), problem, self._local_copy(path))
        return True

    def _hash_problem(self, chunks: DatasetChunks, index: int, handle: pa.NativeFile) -> str | None:
        """How chunk ``index`` (open as ``handle``, left at its start) differs from its catalog
        sha256 (None: it does not; remembered)."""
        record = chunks.record(index)
        digest = self._sha256(record.path, handle, record.checksum)
        if digest != record.checksum:
            return f"has {sha256_mismatch(digest, record.checksum)}"
        with self._lock:
            self._hashed.add(record.path)
        return None

    def _prove(self, chunks: DatasetChunks, index: int, handle: pa.NativeFile) -> None:
        """Chunk ``index`` (open as ``handle``) hashed, unless this process did already, where what
        is read of it next cannot be proven by its page checksums (``verify: size`` checked only its
        size): its footer disagrees with the catalog, or its pages are left to pyarrow, whose reads
        trust the page headers and the footer. A ChunkIntegrityError if it is not as built."""
        path = chunks.record(index).path
        if path in self._hashed:
            return
        # Once per file, what it found kept (threads asking together wait for one hash).
        problem = self._proofs.get(path, lambda: self._prove_now(chunks, index, handle))
        if problem:
            raise altered_chunk(self._where(chunks, index), problem, self._local_copy(path))

    def _prove_now(self, chunks: DatasetChunks, index: int, handle: pa.NativeFile) -> str:
        position = handle.tell()
        problem = self._hash_problem(chunks, index, handle)
        handle.seek(position)
        return problem or ""

    def _failure(self, chunks: DatasetChunks, index: int, handle: pa.NativeFile,
                 exc: Exception) -> ChunkIntegrityError | None:
        """The error for ``exc``, raised reading chunk ``index`` (open as ``handle``): the file
        hashed again (the bytes may have changed since a hash) to tell damage from a file that is
        as built; None (``exc`` as it is) for a file as built that failed otherwise than a reader of
        Parquet fails."""
        path = chunks.record(index).path
        if "CRC checksum verification failed" in str(exc):   # proof of damage already
            return unreadable_chunk(self._where(chunks, index), exc, self._local_copy(path))
        try:
            problem = self._hash_problem(chunks, index, handle)
        except OSError:   # (unreadable: the error it was)
            problem = None
        if problem:
            return altered_chunk(self._where(chunks, index), problem, self._local_copy(path))
        if isinstance(exc, (OSError, pa.ArrowException)):
            return unreadable_chunk(self._where(chunks, index), exc, self._local_copy(path))
        return None

    def _local_copy(self, path: str) -> str | None:
        """The disk-cache copy read instead of remote lake file ``path`` (None: a local lake)."""
        return None if self.disk is None else self.disk.local_path(path)

    def _where(self, chunks: DatasetChunks, index: int) -> str:
        """Chunk ``index`` named for an error: its dataset, index and file."""
        return f"chunk {index} of dataset {chunks.name!r} ({self.lake.url_of(chunks.record(index).path)})"

    def _sha256(self, path: str, handle: pa.NativeFile, expected: str) -> str:
        """The sha256 of lake file ``path`` open as ``handle`` (left at its start)."""
        if self.hash_records is not None:
            return self.hash_records.sha256(self.lake.path_of(path), handle, expected)
        return whole_sha256(handle)

    @contextlib.contextmanager
    def _opened(self, chunks: DatasetChunks, index: int) -> Iterator[tuple[pa.NativeFile, Footer]]:
        """Chunk ``index`` checked (:meth:`_check`) and opened, with its footer (parsed once while
        its bytes stay the same); what fails to read in the block is an error naming the chunk."""
        path = chunks.record(index).path
        with self._open(chunks, index) as handle:
            self._check(chunks, index, handle)
            with self._lock:
                self.files_opened.add(path)
            try:
                serialized = _footer_bytes(handle)
                if serialized is None:   # (parsing raises as it would have)
                    footer = Footer(open_chunk(handle).metadata)
                else:
                    footer = self._footers.get((path, serialized), lambda: Footer(
                        open_chunk(handle).metadata, serialized, handle.size() - 8 - len(serialized)))
                if not footer.fits(chunks, index):
                    self._prove(chunks, index, handle)
                yield handle, footer
            except LakeloaderError:
                raise
            except Exception as exc:   # a damaged file fails in many ways: hashed, to say which
                failure = self._failure(chunks, index, handle, exc)
                if failure is None:
                    raise
                raise failure from exc

    def row_group(self, chunks: DatasetChunks, index: int, group: int) -> RowGroup:
        """Tokens and part layout of one row group of chunk ``index`` (tokens read-only), cached."""
        return self.cache.get((chunks.fingerprint, index, group), lambda: self.read_row_group(chunks, index, group))

    def read_row_group(self, chunks: DatasetChunks, index: int, group: int) -> RowGroup:
        """:meth:`row_group` read from the file and not cached (for what is cached derived from it)."""
        return self.read_documents(chunks, index, group)[0]

    def read_documents(self, chunks: DatasetChunks, index: int, group: int,
                       pick: Callable[[ChunkParts], Sequence[tuple[int, int]]] | None = None) -> list[RowGroup]:
        """Documents ``[first, stop)`` of row group ``group`` of chunk ``index``, for each range
        ``pick`` chooses from the row group's part layout (default: the whole row group), read
        together: where the file's layout allows, only the pages holding their tokens are decoded.
        Each a row group of those documents numbered from 0, its ``first_doc`` their first. Not
        for a dataset defined by a filter."""
        if pick is not None and chunks.filtered:
            raise ValueError(f"dataset {chunks.name!r} is defined by a filter: its row groups are read whole")
        refs = None
        with self._opened(chunks, index) as (handle, footer):
            # The part layout: the chunk's if kept (a packing plan read it), plain text's decoded
            # here, any other read by pyarrow.
            parts = self._kept_parts(chunks, index, footer, group)
            if parts is None:
                parts = footer.single_part_layout(handle, group)
            parquet = None
            if parts is None:
                if footer.one_part_each(group):   # decoded here, but the pages made no sense
                    self._prove(chunks, index, handle)
                parquet = open_chunk(handle, footer.metadata)
                # Small columns: Arrow's own threads only add their hand-offs (and contend with the decode threads).
                table = parquet.read_row_groups([group], columns=[c for c in (*_PART_COLUMNS, *_IMAGE_COLUMNS)
                                                                  if c in footer.names], use_threads=False)
                parts = table_parts(table)
                if PART_REFS_COLUMN in table.column_names:
                    refs = table.column(PART_REFS_COLUMN).combine_chunks().values.to_numpy(zero_copy_only=False)
            if parts.num_docs != footer.num_rows[group]:
                raise DamagedBytes(f"row group {group}: {parts.num_docs} documents read, its footer says "
                                   f"{footer.num_rows[group]}")
            doc_ranges = [(0, parts.num_docs)] if pick is None else list(pick(parts))
            part_ranges = np.searchsorted(parts.part_doc, np.array(doc_ranges, np.int64).reshape(-1, 2))
            part_values = cumulative(parts.part_lengths)
            value_ranges = [(int(part_values[a]), int(part_values[b])) for a, b in part_ranges.tolist()]
            # The tokens' pages decoded here (their levels skipped), or by pyarrow when stored otherwise.
            values = footer.read_values(handle, group, TOKENS_COLUMN, int(part_values[-1]), value_ranges)
            if values is None:
                self._prove(chunks, index, handle)
                parquet = parquet or open_chunk(handle, footer.metadata)
                column = parquet.read_row_groups([group], columns=[TOKENS_COLUMN]).column(TOKENS_COLUMN)
                array = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
                offsets = array.offsets.to_numpy(zero_copy_only=True)
                whole = array.values.to_numpy(zero_copy_only=True)[offsets[0] : offsets[-1]]
                if len(array) != parts.num_docs or len(whole) != part_values[-1]:
                    raise DamagedBytes(f"row group {group}: {len(whole)} tokens of {len(array)} documents read, its "
                                       f"parts say {int(part_values[-1])} of {parts.num_docs}")
                values = [whole[a:b] for a, b in value_ranges]
        if pick is None:
            stored = RowGroup(values[0], parts, refs)
            if chunks.filtered:
                return [_selected(stored, self._view(chunks).selection(chunks.name, int(index), group))]
            return [stored]
        return [RowGroup(part_tokens, parts.take(slice(a, b), parts.part_doc[a:b] - first, stop - first),
                         None if refs is None else refs[a:b], first)
                for part_tokens, (first, stop), (a, b) in zip(values, doc_ranges, part_ranges.tolist())]

    def _kept_parts(self, chunks: DatasetChunks, index: int, footer: Footer, group: int) -> ChunkParts | None:
        """Row group ``group``'s part layout cut from chunk ``index``'s whole one (:meth:`chunk_parts`)
        when the cache keeps it, else None: not for a dataset defined by a filter (its chunk's
        layout is its selection's) nor for stored images (their references are read with them)."""
        if chunks.filtered or any(name in footer.names for name in _IMAGE_COLUMNS):
            return None
        kept = self.cache.cached([("parts", chunks.fingerprint, index)])[0]
        if kept is None:
            return None
        first = int(sum(footer.num_rows[:group]))
        stop = first + int(footer.num_rows[group])
        a, b = np.searchsorted(kept.part_doc, [first, stop]).tolist()
        return kept.take(slice(a, b), kept.part_doc[a:b] - first, stop - first)

    def chunk_parts(self, chunks: DatasetChunks, index: int) -> ChunkParts:
        """The part layout of every document of chunk ``index`` (small columns only)."""
        return self.cache.get(("parts", chunks.fingerprint, index), lambda: self._chunk_parts(chunks, index))

    def _chunk_parts(self, chunks: DatasetChunks, index: int) -> ChunkParts:
        with self._opened(chunks, index) as (handle, footer):
            parts = self._single_part_layout(chunks, index, handle, footer)
            if parts is None:
                columns = [*_PART_COLUMNS, *(c for c in _IMAGE_COLUMNS[1:] if c in footer.names)]
                parts = table_parts(open_chunk(handle, footer.metadata).read(columns=columns))
            # Read by pyarrow, which trusts the page headers (or decoded here): the counts checked
            # against the footer (itself against the catalog) and the catalog.
            tokens = int(parts.part_lengths.sum())
            if parts.num_docs != sum(footer.num_rows) or not (chunks.filtered or tokens == chunks.num_tokens[index]):
                raise DamagedBytes(f"{parts.num_docs} documents of {tokens} tokens read, its footer says "
                                   f"{sum(footer.num_rows)} documents, the catalog "
                                   f"{int(chunks.num_tokens[index])} tokens")
        if chunks.filtered:
            return select_parts(parts, self._view(chunks).chunk_selection(chunks.name, int(index)))[0]
        return parts

    def _single_part_layout(self, chunks: DatasetChunks, index: int, handle: pa.NativeFile, footer: Footer
                            ) -> ChunkParts | None:
        """The part layout of the whole of chunk ``index`` (open as ``handle``) decoded here, row
        group by row group, when each document has one part (plain text: a few small pages, for far
        less than pyarrow's read of the columns costs); None otherwise."""
        groups = range(len(footer.num_rows))
        if any(name in footer.names for name in _IMAGE_COLUMNS) or not all(footer.one_part_each(g) for g in groups):
            return None
        found = [footer.single_part_layout(handle, group) for group in groups]
        if any(parts is None for parts in found):   # decodable here, but the pages made no sense
            self._prove(chunks, index, handle)
            return None
        docs = sum(parts.num_docs for parts in found)  # type: ignore[union-attr]
        return ChunkParts(np.concatenate([parts.part_lengths for parts in found]),  # type: ignore[union-attr]
                          np.concatenate([parts.part_kinds for parts in found]),  # type: ignore[union-attr]
                          np.arange(docs, dtype=np.int64), docs)

    def _view(self, chunks: DatasetChunks) -> CatalogView:
        if self.view is None:
            raise LakeloaderError(f"dataset {chunks.name!r} is defined by a filter: reading its chunks needs the "
                                  "catalog's selections (ChunkFiles(..., view=CatalogView))")
        return self.view
