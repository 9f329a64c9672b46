"""Where the token spans of a dataset's stream lie (``packing: concat`` cuts examples of seq_len + 1
tokens from it) and what they hold. A batch's spans are located together in an index of the row
groups of the chunk sequence read so far (:class:`~lakeloader.read.stream_index.StreamIndex`): one
inside a row group (nearly all) stays a slice of the row group's cached rendering; one across row
groups or chunks is its pieces, one per chunk."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from lakeloader.index.ranges import distinct, locate
from lakeloader.index.ranges import run_indices
from lakeloader.read.catalog_view import DatasetChunks
from lakeloader.read.cold_pages import fill_groups
from lakeloader.read.group_tables import GroupTables
from lakeloader.read.read_ahead import ReadAhead
from lakeloader.read.renderings import Renderings
from lakeloader.read.stream_index import StreamIndex
from lakeloader.read.span_set import Piece, SpanSet, joined, piece_of

_NO_PIECES = (np.zeros(0, np.int64),) * 4


class SpanReader:
    """Spans of one dataset's chunk sequences (the chunks in some order, with the cumulative
    stream offsets of their rendered streams), from the row groups of ``tables`` rendered by
    ``renderings``; ``ahead`` decodes row groups before they are needed.

    ``scattered``: the spans asked for land anywhere in the dataset (a full shuffle). While the
    dataset's stored tokens are more than twice the cache's bytes, a row group met is rarely met
    again before it leaves the cache, so every batch reads those it finds uncached cold, as a
    first batch does (:func:`~lakeloader.read.cold_pages.fill_groups`), and none is decoded ahead.

    ``sequential``: the spans asked for move forward through the stream (no shuffle): a batch's
    spans inside one cached row group are taken from it without a search."""

    def __init__(self, tables: GroupTables, renderings: Renderings, ahead: ReadAhead, scattered: bool = False,
                 sequential: bool = False) -> None:
        self.tables = tables
        self.renderings = renderings
        self.ahead = ahead
        self.scattered = scattered
        self.sequential = sequential
        self._index: StreamIndex | None = None   # the row groups of the last sequence read, located so far
        self._started = False   # whether spans were located before (the first read cold, from pages)

    def span(self, chunks: DatasetChunks, sequence: Sequence[int], sequence_offsets: np.ndarray,
             start: int, length: int) -> list[Piece]:
        """``length`` stream tokens from offset ``start`` of the stream formed by the chunks
        ``sequence`` (global indices) whose cumulative stream offsets are ``sequence_offsets``, as
        one piece per chunk; raises ``IndexError`` past the sequence's end."""
        pieces = []
        position = int(locate(sequence_offsets, np.array([start]))[0])
        end = start + length
        while start < end:
            if position >= len(sequence):
                raise IndexError("span runs past the end of the chunk sequence")
            chunk_start = int(sequence_offsets[position])
            chunk_stop = int(sequence_offsets[position + 1])
            stop = min(end, chunk_stop)
            if stop > start:
                pieces.append(self._chunk_range(chunks, int(sequence[position]), start - chunk_start,
                                                stop - chunk_start, position))
            start = max(start, stop)
            position += 1
        return pieces

    def spans(self, chunks: DatasetChunks, sequence: Sequence[int], sequence_offsets: np.ndarray,
              starts: np.ndarray, length: int) -> SpanSet:
        """:meth:`span` of many ``starts``, located together in the index of the row groups of
        the sequence's chunks read so far (one search; the chunks met for the first time are
        added from their row-group tables, one catalog query). Spans inside one row group (nearly
        all of them) stay slices of the row groups' cached renderings. The first spans (and a
        full shuffle's beyond the cache) are read cold: then those across row groups or chunks
        are joined from slices of theirs, their row groups read with the others. Any other span
        takes the general path (:meth:`span`; past the sequence's end, it raises)."""
        starts = np.asarray(starts, np.int64)
        first, self._started = not self._started, True
        beyond = self.beyond_cache(chunks)
        self.ahead.decode_deferred()
        end = int(starts.max()) + length if len(starts) else 0   # one past the spans' last token
        if self.sequential and not first and len(starts):
            inside = self._inside_one_group(chunks, sequence, sequence_offsets, starts, length, end)
            if inside is not None:
                self.ahead.after_end(chunks, sequence, sequence_offsets, end)
                return inside
        position = locate(sequence_offsets, starts)
        self._index = index = self._indexed(chunks, sequence, sequence_offsets, starts, length, position)
        found = self._located(chunks, sequence, sequence_offsets, starts, length, position, index,
                              from_pages=first or beyond, ahead=first and not beyond)
        for row in np.flatnonzero(found.group < 0).tolist():
            if row not in found.others:
                found.others[row] = self.span(chunks, sequence, sequence_offsets, int(starts[row]), length)
        if len(starts):
            self.ahead.after_end(chunks, sequence, sequence_offsets, end)
        return found

    def beyond_cache(self, chunks: DatasetChunks) -> bool:
        """Whether every batch reads the row groups it finds uncached cold: a full shuffle over
        more than twice the cache's bytes."""
        return self.scattered and chunks.stored_bytes > 2 * self.renderings.files.cache.capacity

    def _chunk_range(self, chunks: DatasetChunks, chunk: int, start: int, stop: int, position: int) -> Piece:
        """Stream tokens ``[start, stop)`` of chunk ``chunk`` with where its documents start."""
        offsets, first_docs = self.tables.of(chunks, chunk)
        group = int(np.searchsorted(offsets, start, side="right")) - 1 if stop > start else len(first_docs)
        pieces = []
        while group < len(first_docs) and offsets[group] < stop:
            rendered = self.renderings.get(chunks, chunk, group)
            a = max(start - int(offsets[group]), 0)
            b = min(stop - int(offsets[group]), len(rendered.tokens))
            pieces.append(piece_of(position, chunk, start, rendered, int(first_docs[group]), a, b))
            group += 1
        if not pieces:
            return Piece(position, chunk, start, np.zeros(0, np.int32), None, 0, np.zeros(0, np.int64))
        return joined(pieces)

    def _indexed(self, chunks: DatasetChunks, sequence: Sequence[int], sequence_offsets: np.ndarray,
                 starts: np.ndarray, length: int, position: np.ndarray) -> StreamIndex:
        """The index of the sequence holding the chunks the spans at ``starts`` (starting in
        chunks ``position``) reach, once a catalog query is due (a chunk met for the first time):
        it fetches the chunks spans across chunks reach and those the look-ahead will need too."""
        index = self._index
        if index is None or index.offsets is not sequence_offsets:   # another sequence, or the dataset grew
            index = StreamIndex.empty(sequence_offsets)
        in_sequence = position < len(sequence)
        first_chunks = position[in_sequence]
        new = set(first_chunks.tolist()) - index.known
        if not new:   # a batch inside known chunks pays nothing more
            return index
        last = np.minimum(locate(sequence_offsets, starts + length - 1), len(sequence) - 1)[in_sequence]
        if bool((last > first_chunks).any()):
            new.update(run_indices(first_chunks, np.maximum(last - first_chunks + 1, 1)).tolist())
        new.update(self.ahead.tables_after(max(new), len(sequence)))
        wanted = sorted(new - index.known)
        return index.with_chunks(wanted, self.tables.of_chunks(chunks, np.asarray(sequence)[wanted].tolist()))

    def _inside_one_group(self, chunks: DatasetChunks, sequence: Sequence[int], sequence_offsets: np.ndarray,
                          starts: np.ndarray, length: int, end: int) -> SpanSet | None:
        """The spans as slices of one cached row group the index holds, when they all lie inside
        it (most batches without a shuffle; ``end``: one past their last token): what
        :meth:`_located` finds for them, for a few operations instead of a search per span; None
        otherwise."""
        index = self._index
        if index is None or index.offsets is not sequence_offsets or not len(index.start):
            return None
        g = int(np.searchsorted(index.start, int(starts.min()), side="right")) - 1
        if g < 0 or end > int(index.stop[g]):
            return None
        position = int(index.position[g])
        chunk = int(sequence[position])
        rendered = self.renderings.cached(chunks, [(chunk, int(index.group[g]))])[0]
        if rendered is None:
            return None
        n = len(starts)
        return SpanSet(length, [rendered], [position], [chunk], [int(index.first_doc[g])], np.zeros(n, np.int64),
                         starts - int(index.start[g]), starts - int(sequence_offsets[position]),
                         np.full(n, position, np.int64), {})

    def _located(self, chunks: DatasetChunks, sequence: Sequence[int], sequence_offsets: np.ndarray,
                 starts: np.ndarray, length: int, position: np.ndarray, index: StreamIndex, from_pages: bool,
                 ahead: bool) -> SpanSet:
        """The spans whose row groups ``index`` holds, each row group fetched once: a span inside
        one row group as a slice of its cached rendering; with ``from_pages`` (a cold read), one
        across row groups or chunks as its pieces (in ``others``, joined per chunk from slices of
        its row groups, read with the others), and with ``ahead`` the row groups read in part
        decoded whole later. Any other is left with group -1 and no pieces: across row groups in
        a warm batch (:meth:`span` finds its row groups cached, for less than locating its pieces
        costs: ~2% of the steady rate without a shuffle), or past the sequence's end."""
        n = len(starts)
        held = index.locate(starts, length)
        inside = held >= 0
        rows = None if n and bool(inside.all()) else np.flatnonzero(inside)   # None: every span
        found = SpanSet(length, [], [], [], [], *_NO_PIECES[:3], position, {})   # (group, at, start: below)
        piece_row, piece_group, piece_lo, piece_hi = _NO_PIECES
        if rows is not None:
            found.group = np.full(n, -1, np.int64)
            found.at, found.start = np.zeros(n, np.int64), np.zeros(n, np.int64)
            if from_pages:   # spans across row groups: their pieces, when every one is held
                across = np.flatnonzero(~inside)
                piece_row, piece_group, piece_lo, piece_hi = index.reached(starts[across], length)
                kept = (np.bincount(piece_row, piece_hi - piece_lo, len(across)) == length)[piece_row]
                piece_row, piece_group, piece_lo, piece_hi = (across[piece_row[kept]], piece_group[kept],
                                                              piece_lo[kept], piece_hi[kept])
        span_group = held if rows is None else held[rows]
        range_group = np.concatenate([span_group, piece_group]) if len(piece_row) else span_group
        if not len(range_group):
            return found
        used, range_group = distinct(range_group)
        span_at = starts - index.start[held] if rows is None else starts[rows] - index.start[span_group]
        range_lo = np.concatenate([span_at, piece_lo]) if len(piece_row) else span_at
        range_hi = np.concatenate([span_at + length, piece_hi]) if len(piece_row) else span_at + length
        found.group_position = index.position[used].tolist()
        found.group_chunk = np.asarray(sequence)[index.position[used]].tolist()
        found.group_first_doc = index.first_doc[used].tolist()
        wanted = list(zip(found.group_chunk, index.group[used].tolist()))
        lengths = index.stop[used] - index.start[used]
        read_in_part = fill_groups(self.renderings, chunks, found, wanted, lengths, (range_group, range_lo, range_hi),
                                   from_pages)
        if ahead:
            for j in read_in_part:
                self.ahead.decode_later(chunks, *wanted[j], int(lengths[j]))
        spans = len(span_group)
        if rows is None:
            found.group, found.at = range_group, range_lo
            found.start = starts - sequence_offsets[position]
        else:
            found.group[rows], found.at[rows] = range_group[:spans], range_lo[:spans]
            found.start[rows] = starts[rows] - sequence_offsets[position[rows]]
        if len(piece_row):
            _join_pieces(found, starts, sequence_offsets, piece_row, range_group[spans:], range_lo[spans:],
                         range_hi[spans:])
        return found


def _join_pieces(found: SpanSet, starts: np.ndarray, sequence_offsets: np.ndarray, piece_row: np.ndarray,
                 piece_group: np.ndarray, piece_lo: np.ndarray, piece_hi: np.ndarray) -> None:
    """``found.others`` of the spans across row groups or chunks: each span's pieces (``piece_row``,
    in stream order: tokens ``[piece_lo, piece_hi)`` of ``found.groups[piece_group]``) joined into
    one piece per chunk, as :meth:`SpanReader.span` makes them."""
    pieces: dict[int, list[list[Piece]]] = {}
    for row, g, lo, hi in zip(piece_row.tolist(), piece_group.tolist(), piece_lo.tolist(), piece_hi.tolist()):
        at = found.group_position[g]
        chunk_start = max(int(starts[row]) - int(sequence_offsets[at]), 0)
        piece = piece_of(at, found.group_chunk[g], chunk_start, found.groups[g], found.group_first_doc[g], lo, hi)
        per_chunk = pieces.setdefault(row, [])
        if per_chunk and per_chunk[-1][0].position == at:
            per_chunk[-1].append(piece)
        else:
            per_chunk.append([piece])
    for row, per_chunk in pieces.items():
        found.others[row] = [joined(chunk_pieces) for chunk_pieces in per_chunk]
