"""The build's side of the documents index: the per-document rows its chunk tasks return written
into the lake as one Parquet file per dataset and commit group, and a dataset's small files merged
into larger ones now and then and at the build's end.

The files hold what the ``documents`` view shows of a document but its tokens (the columns of
``contracts.chunk_file.document_rows``), sorted by chunk and document, with row-group statistics
and page checksums; the catalog records each with its size and sha256 (``document_index_files``)
and which file holds each chunk's rows (``document_index_chunks``), committed with the chunks.
Replaced files stay in the lake for readers of older snapshots (``gc`` removes them later), but
for those no snapshot ever listed: written and replaced between two publishes, they are deleted
at once.
"""

from __future__ import annotations

import hashlib
import io
import logging
import uuid
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from lakeloader.catalog.lake import Lake
from lakeloader.catalog.stale import index_folder
from lakeloader.catalog.store import CatalogWriter, IndexFile
from lakeloader.contracts.chunk_file import ChunkResult, open_chunk
from lakeloader.contracts.errors import CatalogIntegrityError
from lakeloader.storage import with_retries, write_atomically, write_failure

log = logging.getLogger(__name__)

# Rows per row group of an index file: a query on a few chunks reads a few groups.
ROW_GROUP_ROWS = 128 * 1024
# A dataset's files holding fewer than half this many documents are merged once it has more than
# COMPACT_FILES of them (and at the build's end), into files of at most this many documents. During
# a build a file is merged only once newer ones hold at least half its chunks (_worth_merging), so
# that each chunk's rows are rewritten a few times, not at every compaction.
COMPACT_DOCS = 8_000_000
COMPACT_FILES = 32


def encode_index_file(table: pa.Table) -> bytes:
    """Parquet bytes of index rows ``table`` (sorted by chunk and doc)."""
    sink = io.BytesIO()
    pq.write_table(table, sink, row_group_size=ROW_GROUP_ROWS, compression="zstd", compression_level=1,
                   write_statistics=True, write_page_checksum=True, store_schema=True)
    return sink.getvalue()


class DocumentIndexWriter:
    """Writes a build's documents index files and compacts them (the driver's, beside its catalog
    writer)."""

    def __init__(self, lake: Lake, writer: CatalogWriter) -> None:
        self.lake = lake
        self.writer = writer
        # The files this writer wrote, each with the count of publishes begun before it was written:
        # one replaced before another publish began was never published, so no reader can need it.
        self._written: dict[str, int] = {}

    def _write(self, dataset: str, tables: Sequence[pa.Table], chunks: list[int], ordered: bool = False) -> IndexFile:
        """An index file of ``dataset`` holding the rows ``tables`` of ``chunks`` (some may have
        none); ``ordered``: ``tables`` are sorted by chunk and doc already, one after the other."""
        table = pa.concat_tables(tables)
        if not ordered:
            table = table.sort_by([("chunk", "ascending"), ("doc", "ascending")])
        data = encode_index_file(table)
        path = f"{index_folder(dataset)}/{min(chunks, default=0)}-{max(chunks, default=0)}-{uuid.uuid4().hex[:12]}.parquet"
        url = self.lake.url_of(path)
        try:
            with_retries(lambda: write_atomically(url, data, self.lake.storage_options),
                         what=f"writing a documents index file of dataset {dataset!r} ({url})",
                         deadline=self.lake.io_retry_deadline)
        except OSError as exc:
            raise write_failure(f"a documents index file of dataset {dataset!r}", url, exc) from exc
        self._written[path] = self.writer.changes.publishes
        return IndexFile(path, dataset, chunks, len(table), len(data), hashlib.sha256(data).hexdigest())

    def write(self, results: Sequence[ChunkResult]) -> list[IndexFile]:
        """One index file per dataset of the rows of ``results`` whose chunks are not committed yet
        (what the commit of ``results`` commits for the first time): to commit with them."""
        rows: dict[str, dict[int, pa.Table]] = {}
        for result in results:
            if result.documents is not None:
                rows.setdefault(result.dataset, {}).setdefault(result.global_index, result.documents)
        files = []
        for dataset, tables in rows.items():
            committed = self.writer.committed_among(dataset, list(tables))
            fresh = sorted(index for index in tables if index not in committed)
            if fresh:
                files.append(self._write(dataset, [tables[index] for index in fresh], fresh, ordered=True))
        return files

    def drop_missing(self, datasets: Sequence[str]) -> None:
        """Forget the index files of ``datasets`` that are missing or not the size the catalog
        records (found by listing their folders): their chunks are read from the chunk files."""
        for dataset in datasets:
            files = self.writer.index_files(dataset)
            if files.empty:
                continue
            sizes: dict[str, int] = {}
            for folder in sorted({path.rsplit("/", 1)[0] for path in files.path}):
                sizes.update(self.lake.file_sizes(folder, "the documents index folder"))
            lost = [row.path for row in files.itertuples(index=False) if sizes.get(row.path) != row.num_bytes]
            if lost:
                log.warning("dataset %r: %d documents index file(s) missing or damaged (%s); the documents view "
                            "reads their chunks' files", dataset, len(lost), self.lake.url_of(lost[0]))
                self.writer.forget_index_files(lost)

    def compact(self, dataset: str, final: bool = False) -> int:
        """Merge ``dataset``'s small index files (under half ``COMPACT_DOCS`` documents), in
        chunk order, into files of at most ``COMPACT_DOCS`` documents, if it has more than
        ``COMPACT_FILES`` of them or, with ``final``, two or more; returns how many files were
        merged (their rows are checked against their sha256 first)."""
        files = self.writer.index_files(dataset)
        small = files[files.num_docs < COMPACT_DOCS // 2]
        if len(small) < 2 or (not final and len(small) <= COMPACT_FILES):
            return 0
        if not final:
            small = small[_worth_merging(small.num_chunks.to_numpy())]
        groups: list[list[tuple[str, str]]] = [[]]
        docs = 0
        for row in small.itertuples(index=False):
            if groups[-1] and docs + row.num_docs > COMPACT_DOCS:
                groups.append([])
                docs = 0
            groups[-1].append((row.path, row.checksum))
            docs += int(row.num_docs)
        merged = 0
        for group in groups:
            if len(group) < 2:
                continue
            paths = [path for path, _ in group]
            new = self._write(dataset, [self._read(dataset, path, checksum) for path, checksum in group],
                              self.writer.index_file_chunks(paths))
            self.writer.replace_index_files(paths, new)
            self._remove_unpublished(paths)
            merged += len(group)
        log.info("documents index of dataset %r: %d files merged", dataset, merged)
        return merged

    def _remove_unpublished(self, paths: Sequence[str]) -> None:
        """Delete the replaced index files ``paths`` that no snapshot listed (written by this writer
        after the last publish began); the others wait for ``gc``."""
        publishes = self.writer.changes.publishes
        for path in paths:
            if self._written.pop(path, None) == publishes:
                with_retries(lambda: self.lake.fs.rm_file(self.lake.path_of(path)), deadline=self.lake.io_retry_deadline,
                             what=f"removing the unpublished documents index file {self.lake.url_of(path)}")

    def _read(self, dataset: str, path: str, checksum: str) -> pa.Table:
        """The rows of index file ``path``, checked against its sha256 ``checksum`` (a damaged
        file is never merged into a new one)."""
        data = with_retries(lambda: self.lake.fs.cat_file(self.lake.path_of(path)), deadline=self.lake.io_retry_deadline,
                            what=f"reading the documents index file {self.lake.url_of(path)}")
        if hashlib.sha256(data).hexdigest() != checksum:
            raise CatalogIntegrityError(
                f"documents index file {self.lake.url_of(path)} of dataset {dataset!r} is not as the catalog "
                "records it (sha256): it was altered or damaged; delete it and build again")
        return open_chunk(pa.BufferReader(data)).read()


def _worth_merging(sizes: np.ndarray) -> np.ndarray:
    """Which files of ``sizes`` (chunks, in chunk order) a compaction during a build merges: the
    newest, and each one of at most twice the chunks of all those after it. A file is rewritten only
    once as much again was added after it, so each chunk's rows are rewritten about
    log2(dataset / file) times in a build, and the files left out (each over twice all those after
    it) are a few of geometric sizes."""
    after = np.cumsum(sizes[::-1])[::-1] - sizes
    worth = sizes <= 2 * after
    worth[-1:] = True
    return worth
