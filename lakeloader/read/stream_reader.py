"""One dataset's chunk streams as feed/ reads them (:class:`StreamReader`): a thin front over the
reader's parts, composed: the row-group tables (:mod:`~lakeloader.read.group_tables`), the render
cache (:mod:`~lakeloader.read.renderings`), the token spans located in them
(:mod:`~lakeloader.read.spans`; cold ones read from pages, :mod:`~lakeloader.read.cold_pages`) and
the row groups decoded ahead (:mod:`~lakeloader.read.read_ahead`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from lakeloader.contracts.specs import Template
from lakeloader.read.catalog_view import CatalogView, DatasetChunks
from lakeloader.read.chunks import ChunkFiles
from lakeloader.read.cold_pages import read_groups
from lakeloader.read.group_tables import GroupTable, GroupTables
from lakeloader.read.read_ahead import ReadAhead
from lakeloader.read.renderings import Renderings
from lakeloader.read.spans import SpanReader
from lakeloader.read.span_set import Piece, RenderedGroup, SpanSet


class StreamReader:
    """Reads ranges of one dataset's chunk streams (documents rendered by its collation
    ``template``), one row group at a time, from ``files`` and the row-group tables ``view``
    gives. ``scattered`` and ``sequential``: how the spans asked for move (:class:`SpanReader`);
    a ``sequential`` reader also decodes row groups ahead (:class:`ReadAhead`)."""

    def __init__(self, view: CatalogView, files: ChunkFiles, template: Template, scattered: bool = False,
                 sequential: bool = False) -> None:
        self.files = files
        self.template = template
        self.tables = GroupTables(view, template)
        self.renderings = Renderings(files, template, self.tables)
        self.ahead = ReadAhead(self.tables, self.renderings, in_order=sequential)
        self.span_reader = SpanReader(self.tables, self.renderings, self.ahead, scattered=scattered, sequential=sequential)
        self._started = False   # whether ranged_groups read before (the first read cold, from pages)

    def chunk_lengths(self, chunks: DatasetChunks) -> np.ndarray:
        """Rendered stream tokens of each committed chunk (:meth:`GroupTables.chunk_lengths`)."""
        return self.tables.chunk_lengths(chunks)

    def groups_of(self, chunks: DatasetChunks, wanted: list[int]) -> list[GroupTable]:
        """The row-group table of each chunk of ``wanted`` (:meth:`GroupTables.of_chunks`)."""
        return self.tables.of_chunks(chunks, wanted)

    def rendered_group(self, chunks: DatasetChunks, chunk: int, group: int) -> RenderedGroup:
        """One row group rendered, cached (:meth:`Renderings.get`)."""
        return self.renderings.get(chunks, chunk, group)

    def rendered_groups(self, chunks: DatasetChunks, wanted: Sequence[tuple[int, int]]) -> list[RenderedGroup]:
        """Each ``(chunk, group)`` of ``wanted`` rendered, the missing concurrently (:meth:`Renderings.get_all`)."""
        return self.renderings.get_all(chunks, wanted)

    def ranged_groups(self, chunks: DatasetChunks, wanted: Sequence[tuple[int, int]],
                      ranges: tuple[np.ndarray, np.ndarray, np.ndarray]) -> list[RenderedGroup]:
        """Each ``(chunk, group)`` of ``wanted`` rendered for ``ranges`` of its tokens (index into
        ``wanted``, first token, one past the last: packed items). The first read, and every read of
        a full shuffle beyond the cache (:meth:`SpanReader.beyond_cache`), is cold: a row group no
        cache holds whose ranges reach little of it is read from just their pages, the ranges
        re-pointed (in place) at renderings of the documents they reach, appended to those returned
        (:func:`~lakeloader.read.cold_pages.read_groups`); on a first read such row groups are
        decoded whole later (:meth:`ReadAhead.decode_later`). Otherwise :meth:`rendered_groups`."""
        first, self._started = not self._started, True
        beyond = self.span_reader.beyond_cache(chunks)
        self.ahead.decode_deferred()
        if not (first or beyond):
            return self.renderings.get_all(chunks, wanted)
        wanted = list(wanted)
        used = sorted({chunk for chunk, _ in wanted})
        tables = dict(zip(used, self.tables.of_chunks(chunks, used)))
        first_docs = [int(tables[chunk][1][group]) for chunk, group in wanted]
        lengths = np.array([tables[chunk][0][group + 1] - tables[chunk][0][group] for chunk, group in wanted], np.int64)
        read = read_groups(self.renderings, chunks, wanted, first_docs, lengths, ranges, from_pages=True)
        if first and not beyond:
            for j in read.from_pages:
                self.ahead.decode_later(chunks, *wanted[j], int(lengths[j]))
        return read.groups

    def cached_groups(self, chunks: DatasetChunks, wanted: Sequence[tuple[int, int]]) -> list[RenderedGroup] | None:
        """Each ``(chunk, group)`` of ``wanted`` rendered if all are cached, else None
        (:meth:`Renderings.all_cached`)."""
        return self.renderings.all_cached(chunks, wanted)

    def span(self, chunks: DatasetChunks, sequence: Sequence[int], sequence_offsets: np.ndarray,
               start: int, length: int) -> list[Piece]:
        """One span's pieces (:meth:`SpanReader.span`)."""
        return self.span_reader.span(chunks, sequence, sequence_offsets, start, length)

    def spans(self, chunks: DatasetChunks, sequence: Sequence[int], sequence_offsets: np.ndarray,
                starts: np.ndarray, length: int) -> SpanSet:
        """Many spans located together (:meth:`SpanReader.spans`)."""
        return self.span_reader.spans(chunks, sequence, sequence_offsets, starts, length)

    def look_ahead_after(self, chunks: DatasetChunks, chunk: int, group: int) -> None:
        """Decode ahead the row groups after the last one a batch of packed examples reached
        (:meth:`ReadAhead.after_group`)."""
        self.ahead.after_group(chunks, chunk, group)

    def close(self) -> None:
        """Stop decoding ahead, once the row group at hand is decoded."""
        self.ahead.close()
