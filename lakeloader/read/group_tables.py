"""Where each chunk's row groups lie in the stream its collation template renders: a row-group
table per chunk (the stream offsets of its row groups within the chunk, and the first document
of each), from the catalog's counts alone, kept by each reader."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from lakeloader.contracts.specs import Template
from lakeloader.index.ranges import cumulative
from lakeloader.index.render import chunk_added, chunk_doc_added, stream_lengths
from lakeloader.read.catalog_view import CatalogView, DatasetChunks
from lakeloader.read.lru import LRU

# Row-group tables a reader keeps: a few numbers a row group each.
TABLES_KEPT = 4096

# (stream offsets of a chunk's row groups within it, one more than its row groups; first document of each)
GroupTable = tuple[np.ndarray, np.ndarray]


def group_table(template: Template, chunk: int, chunk_docs: int, counts: dict[str, np.ndarray]) -> GroupTable:
    """The :data:`GroupTable` of chunk ``chunk`` (of ``chunk_docs`` documents) rendered by
    ``template``, from its row groups' catalog ``counts`` (``first_doc``, ``num_docs``,
    ``num_tokens``; ``num_parts`` where the template counts parts). First documents are int32."""
    first_doc = counts["first_doc"].astype(np.int32)   # per-token document keys stay int32
    added = np.zeros(len(first_doc), np.int64)
    if (template.fim is not None or template.infill is not None) and chunk_docs:
        # The tokens FIM or infilling adds to a document do not depend on its length: sum them per group.
        added = np.add.reduceat(chunk_doc_added(template, chunk, chunk_docs), first_doc)
    lengths = stream_lengths(template, counts["num_tokens"], counts["num_docs"].astype(np.int64),
                             counts.get("num_parts"), added)
    return cumulative(lengths), first_doc


class GroupTables:
    """The row-group tables of a dataset's chunks rendered by ``template``, fetched from ``view``
    (many chunks a query) and kept by count."""

    def __init__(self, view: CatalogView, template: Template) -> None:
        self.view = view
        self.template = template
        self.cache: LRU[tuple[str, int], GroupTable] = LRU(TABLES_KEPT)
        # Part kinds whose counts the template needs of each row group (None: it needs none).
        self._part_kinds = len(template.kind_names) if template.counts_parts else None

    def chunk_lengths(self, chunks: DatasetChunks) -> np.ndarray:
        """Rendered stream tokens of each committed chunk (from catalog counts only)."""
        added = chunk_added(self.template, np.arange(chunks.committed), chunks.num_docs)
        return stream_lengths(self.template, chunks.num_tokens, chunks.num_docs, chunks.num_parts, added)

    def of(self, chunks: DatasetChunks, chunk: int) -> GroupTable:
        """Chunk ``chunk``'s table (fetched alone when not kept)."""
        return self.cache.get((chunks.fingerprint, chunk), lambda: self._table(chunks, chunk))

    def of_chunks(self, chunks: DatasetChunks, wanted: list[int]) -> list[GroupTable]:
        """:meth:`of` each chunk of ``wanted``: the kept ones in one lookup, the others from one
        catalog query."""
        keys = [(chunks.fingerprint, chunk) for chunk in wanted]
        found = self.cache.cached(keys)
        missing = sorted({chunk for chunk, value in zip(wanted, found) if value is None})
        if missing:
            rows = self.view.row_groups_of(chunks.name, missing, self._part_kinds)
            for i, chunk in enumerate(wanted):
                if found[i] is None:
                    found[i] = self.cache.get(keys[i], lambda c=chunk: self._table(chunks, c, rows[c]))
        return found  # type: ignore[return-value]

    def kept(self, chunks: DatasetChunks, wanted: Sequence[int]) -> list[GroupTable | None]:
        """The kept table of each chunk of ``wanted`` (None where not kept; nothing fetched)."""
        return self.cache.cached([(chunks.fingerprint, chunk) for chunk in wanted])

    def _table(self, chunks: DatasetChunks, chunk: int, counts: dict[str, np.ndarray] | None = None) -> GroupTable:
        if counts is None:
            counts = self.view.row_groups_of(chunks.name, [chunk], self._part_kinds)[chunk]
        return group_table(self.template, chunk, int(chunks.num_docs[chunk]), counts)
