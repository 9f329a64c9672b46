"""Token windows of a dataset's stream: chunk row groups rendered (special tokens, templates).

Each row group is rendered once into a compact form kept in the reader's byte-bounded cache
(``loader.cache_bytes``): its tokens in the stored dtype (uint16 when the vocabulary fits), a
target flag per token only when some token is not a target, and its documents' boundaries as
offsets (no per-token document key). Windows are slices of it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa

from lakeloader.contracts.chunk_file import ChunkParts
from lakeloader.contracts.specs import Template
from lakeloader.index.ranges import cumulative, distinct, locate, merged_runs, spans
from lakeloader.index.render import fim_choice, fim_counts, render_compact, rendered_doc_starts, stream_lengths
from lakeloader.read.catalog_view import CatalogView, DatasetChunks
from lakeloader.read.chunks import ChunkFiles
from lakeloader.read.lru import LRU
from lakeloader.read.stream_index import StreamIndex
from lakeloader.read.window_set import Piece, RenderedGroup, WindowSet, joined, piece_of

log = logging.getLogger(__name__)
T = TypeVar("T")

# Row groups a batch needs that no cache holds are decoded and rendered this many at a time
# (Parquet decoding and most numpy work run without the GIL): a shuffled first batch can need as
# many row groups as it has rows. One pool for every reader of the process; idle threads cost nothing.
_DECODE_POOL = concurrent.futures.ThreadPoolExecutor(min(4, os.cpu_count() or 1),
                                                     thread_name_prefix="lakeloader-decode")
# Row groups a cold start read from a few pages are decoded whole here, one at a time, so that the
# batches that follow find them cached; only when the cache holds AHEAD_CACHE_SHARE row groups like
# them (else they would not stay).
_AHEAD_POOL = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lakeloader-decode-ahead")
AHEAD_CACHE_SHARE = 8
# A reader that reads its stream in order has this many row groups past the one its last window
# ends in decoded in the ahead thread: with 1 M-token row groups, 8 to 16 batches of 64 x 2048 before
# a batch needs them (counted in row groups, not tokens: a lake of small chunks is not read far ahead).
LOOK_AHEAD_GROUPS = 2
# Such a reader fetches the row-group tables of this many chunks per catalog query (a query costs
# ~3-4 ms whatever its chunks: one per chunk was ~10% of a first epoch here).
TABLES_AHEAD = 8
# A row group not cached is read from the pages its windows need when they reach at most 1 / PAGES_SHARE
# of its tokens, as ranges of windows less than RANGE_GAP tokens apart.
PAGES_SHARE = 4
RANGE_GAP = 1 << 14


def _concurrently(calls: Sequence[Callable[[], T]]) -> list[T]:
    """Each call's result, the calls run in the decode threads when there are several; the first
    error is raised here, as making that call in this thread would raise it."""
    if len(calls) < 2:
        return [call() for call in calls]
    running = [_DECODE_POOL.submit(call) for call in calls]
    return [future.result() for future in running]


def _log_failure(future: concurrent.futures.Future[Any]) -> None:
    """A row group decoded ahead that failed is read again when asked for, and raises then."""
    if future.exception() is not None:
        log.debug("a row group decoded ahead failed (read again when asked for): %s", future.exception())


def _page_runs(missing: list[int], ranges: tuple[np.ndarray, np.ndarray, np.ndarray], lengths: np.ndarray
               ) -> tuple[dict[int, tuple[int, int]], np.ndarray, np.ndarray, np.ndarray]:
    """Which row groups of ``missing`` to read from pages: those whose ``ranges`` (row group,
    first token, one past the last, per window or piece) reach at most 1 / :data:`PAGES_SHARE` of
    their ``lengths`` rendered tokens, as runs of ranges less than :data:`RANGE_GAP` apart. (For
    each of them its runs ``[a, b)``; the runs' starts and ends; the run of each range, -1 where
    its row group is read otherwise.)"""
    group, lo, hi = ranges
    candidate = np.zeros(len(lengths), bool)
    candidate[missing] = True
    mine = np.flatnonzero(candidate[group])
    run_group, run_lo, run_hi, run_of = merged_runs(group[mine], lo[mine], hi[mine], RANGE_GAP)
    kept = ~(np.bincount(run_group, run_hi - run_lo, len(lengths)) * PAGES_SHARE > lengths)[run_group]
    run_of_range = np.full(len(group), -1, np.int64)
    run_of_range[mine] = np.where(kept[run_of], (np.cumsum(kept) - 1)[run_of], -1)
    run_group, run_lo, run_hi = run_group[kept], run_lo[kept], run_hi[kept]
    used, firsts = np.unique(run_group, return_index=True)
    bounds = np.append(firsts, len(run_group)).tolist()
    return ({j: (a, b) for j, a, b in zip(used.tolist(), bounds[:-1], bounds[1:])}, run_lo, run_hi, run_of_range)


_NO_PIECES = (np.zeros(0, np.int64),) * 4


class StreamReader:
    """Reads ranges of one dataset's chunk streams (documents rendered by its collation
    template), one row group at a time.

    ``scattered``: the windows asked for land anywhere in the dataset (a full shuffle). While the
    dataset's stored tokens are more than twice the cache's bytes, a row group met is rarely met
    again before it leaves the cache, so every batch reads those it finds uncached from the pages
    its windows need, as a first batch does (:meth:`_add_groups`), and none is decoded ahead.

    ``sequential``: the windows asked for move forward through the stream (no shuffle). The
    :data:`LOOK_AHEAD_GROUPS` row groups after the one the last window ends in (or, for packed
    examples, :meth:`look_ahead_after` the last row group a batch reached) are decoded in the
    ahead thread, so that decoding them overlaps building the batches before them. Which row
    groups those are is worked out in the thread asking for windows (their chunks' row-group
    tables and records fetched there, :data:`TABLES_AHEAD` chunks a query): the ahead thread only
    reads files, and the catalog queries stay few and in the thread that asks."""

    def __init__(self, view: CatalogView, files: ChunkFiles, template: Template, scattered: bool = False,
                 sequential: bool = False) -> None:
        self.view = view
        self.files = files
        self.template = template
        self.scattered = scattered
        self.sequential = sequential
        # Part kinds whose counts the template needs of each row group (None: it needs none).
        self._part_kinds = len(template.kind_names) if template.counts_parts else None
        # The stream range [lo, hi) of the row group the last window ended in when the reader last
        # looked ahead (no new look-ahead while windows end in it), or the (chunk, row group) a
        # packed batch last reached; the newest row groups to decode ahead, and whether the ahead
        # thread is on them.
        self._ahead_range = (0, 0)
        self._ahead_origin = (-1, -1)
        self._ahead_wanted: tuple[DatasetChunks, list[tuple[int, int]]] | None = None
        self._ahead_task: concurrent.futures.Future[None] | None = None
        self._ahead_running = False
        self._ahead_closed = False
        self._ahead_lock = threading.Lock()
        # Row-group offsets per chunk: a few numbers each, kept by count.
        self._row_groups: LRU[tuple[str, int], tuple[np.ndarray, np.ndarray]] = LRU(4096)
        self._index: StreamIndex | None = None   # the row groups of the last sequence read, located so far
        self._started = False   # whether windows were located before (the first read cold, from pages)
        # Row groups the first windows were read from in part: decoded whole in the background once
        # those windows are out (while the consumer uses them), not while they are read.
        self._decode_later: list[tuple[DatasetChunks, int, int]] = []

    def chunk_lengths(self, chunks: DatasetChunks) -> np.ndarray:
        """Rendered stream tokens of each committed chunk (from catalog counts only)."""
        fim = fim_counts(self.template.fim, np.arange(chunks.committed), chunks.num_docs)
        return stream_lengths(self.template, chunks.num_tokens, chunks.num_docs, chunks.num_parts, fim)

    def _fim(self, chunks: DatasetChunks, chunk: int, docs: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, ...] | None:
        if self.template.fim is None:
            return None
        return fim_choice(self.template.fim, chunk, int(chunks.num_docs[chunk]), docs, lengths)

    def groups(self, chunks: DatasetChunks, chunk: int) -> tuple[np.ndarray, np.ndarray]:
        """(stream offsets of the row groups within the chunk, first document of each)."""
        return self._row_groups.get((chunks.fingerprint, chunk), lambda: self._groups(chunks, chunk))

    def groups_of(self, chunks: DatasetChunks, wanted: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
        """:meth:`groups` of each chunk of ``wanted``: the cached ones in one lookup, the others
        from one catalog query."""
        keys = [(chunks.fingerprint, chunk) for chunk in wanted]
        found = self._row_groups.cached(keys)
        missing = sorted({chunk for chunk, value in zip(wanted, found) if value is None})
        if missing:
            rows = self.view.row_groups_of(chunks.name, missing, self._part_kinds)
            for i, chunk in enumerate(wanted):
                if found[i] is None:
                    found[i] = self._row_groups.get(keys[i], lambda c=chunk: self._groups(chunks, c, rows[c]))
        return found  # type: ignore[return-value]

    def _groups(self, chunks: DatasetChunks, chunk: int,
                groups: dict[str, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
        if groups is None:
            groups = self.view.row_groups_of(chunks.name, [chunk], self._part_kinds)[chunk]
        first_doc = groups["first_doc"].astype(np.int32)   # per-token document keys stay int32
        num_docs = groups["num_docs"].astype(np.int64)
        fim_docs = np.zeros(len(first_doc), np.int64)
        if self.template.fim is not None:
            # Which documents are FIM does not depend on their lengths: count them per group.
            docs = np.arange(int(chunks.num_docs[chunk]), dtype=np.int64)
            selected = self._fim(chunks, chunk, docs, np.zeros(len(docs), np.int64))[0]
            fim_docs = np.add.reduceat(selected.astype(np.int64), first_doc) if len(docs) else fim_docs
        num_parts = groups.get("num_parts")
        lengths = stream_lengths(self.template, groups["num_tokens"], num_docs, num_parts, fim_docs)
        return cumulative(lengths), first_doc

    def rendered_group(self, chunks: DatasetChunks, chunk: int, group: int) -> RenderedGroup:
        """One row group's documents rendered, compactly (cached; the stored row group is read
        for it and not kept)."""
        return self.files.cache.get(self._rendered_key(chunks, chunk, group),
                                    lambda: self._render_group(chunks, chunk, group))

    def _rendered_key(self, chunks: DatasetChunks, chunk: int, group: int) -> tuple[object, ...]:
        return self._rendered_keys(chunks, [(chunk, group)])[0]

    def _rendered_keys(self, chunks: DatasetChunks, wanted: Sequence[tuple[int, int]]) -> list[tuple[object, ...]]:
        """The cache key of each ``(chunk, group)`` rendering of ``wanted`` (in one pass: a batch can want 64)."""
        dataset, template = chunks.fingerprint, self.template.fingerprint
        return [("rendered", dataset, chunk, group, template) for chunk, group in wanted]

    def rendered_groups(self, chunks: DatasetChunks, wanted: Sequence[tuple[int, int]]) -> list[RenderedGroup]:
        """:meth:`rendered_group` of each ``(chunk, group)`` of ``wanted``; those not cached yet
        are decoded concurrently (in the process's decode threads)."""
        found = self.files.cache.cached(self._rendered_keys(chunks, wanted))
        missing = [i for i, value in enumerate(found) if value is None]
        for i, rendered in zip(missing, _concurrently([functools.partial(self.rendered_group, chunks, *wanted[i])
                                                        for i in missing])):
            found[i] = rendered
        return found  # type: ignore[return-value]

    def cached_groups(self, chunks: DatasetChunks, wanted: Sequence[tuple[int, int]]) -> list[RenderedGroup] | None:
        """:meth:`rendered_groups` of ``wanted`` if the cache holds every one (each marked as
        just used), else None (nothing decoded)."""
        found = self.files.cache.cached(self._rendered_keys(chunks, wanted))
        return None if any(value is None for value in found) else found  # type: ignore[return-value]

    def _render_group(self, chunks: DatasetChunks, chunk: int, group: int) -> RenderedGroup:
        stored = self.files.read_row_group(chunks, chunk, group)
        parts = stored.parts
        first_doc = int(self.groups(chunks, chunk)[1][group])
        fim = self._fim(chunks, chunk, first_doc + np.arange(parts.num_docs), parts.content_lengths)
        rendered = RenderedGroup(*render_compact(self.template, stored.values, parts.part_lengths, parts.part_kinds,
                                                 parts.part_doc, parts.num_docs, fim))
        if self._keeps_parts:
            rendered = dataclasses.replace(rendered, parts=parts, refs=stored.refs)
        del stored, parts
        # The decoded row group is gone: hand the allocator's freed pages back (Arrow's pool
        # otherwise keeps them, ~100 MB over a lake's first epoch).
        pa.default_memory_pool().release_unused()
        return rendered

    def chunk_range(self, chunks: DatasetChunks, chunk: int, start: int, stop: int,
                    position: int = 0) -> Piece:
        """Stream tokens ``[start, stop)`` of chunk ``chunk`` with where its documents start."""
        offsets, first_docs = self.groups(chunks, chunk)
        group = int(np.searchsorted(offsets, start, side="right")) - 1 if stop > start else len(first_docs)
        pieces = []
        while group < len(first_docs) and offsets[group] < stop:
            rendered = self.rendered_group(chunks, chunk, group)
            a = max(start - int(offsets[group]), 0)
            b = min(stop - int(offsets[group]), len(rendered.tokens))
            pieces.append(piece_of(position, chunk, start, rendered, int(first_docs[group]), a, b))
            group += 1
        if not pieces:
            return Piece(position, chunk, start, np.zeros(0, np.int32), None, 0, np.zeros(0, np.int64))
        return joined(pieces)

    def window(self, chunks: DatasetChunks, sequence: Sequence[int], sequence_offsets: np.ndarray,
               start: int, length: int) -> list[Piece]:
        """``length`` stream tokens from offset ``start`` of the stream formed by the chunks
        ``sequence`` (global indices) whose cumulative stream offsets are ``sequence_offsets``."""
        pieces = []
        position = int(locate(sequence_offsets, np.array([start]))[0])
        end = start + length
        while start < end:
            if position >= len(sequence):
                raise IndexError("window runs past the end of the chunk sequence")
            chunk_start = int(sequence_offsets[position])
            chunk_stop = int(sequence_offsets[position + 1])
            stop = min(end, chunk_stop)
            if stop > start:
                pieces.append(self.chunk_range(chunks, int(sequence[position]), start - chunk_start,
                                               stop - chunk_start, position))
            start = max(start, stop)
            position += 1
        return pieces

    def windows(self, chunks: DatasetChunks, sequence: Sequence[int], sequence_offsets: np.ndarray,
                starts: np.ndarray, length: int) -> WindowSet:
        """:meth:`window` of many starts, located together in the reader's index of the row groups
        of the sequence's chunks read so far (one search; the chunks met for the first time are
        added from their row-group tables, one catalog query). Windows inside one row group (nearly
        all of them) stay slices of the row groups' cached renderings. The reader's first windows (and
        a full shuffle's beyond the cache) are read cold, see :meth:`_add_groups`: then those across
        row groups or chunks are joined from slices of theirs, their row groups read with the
        others. Any other window takes the general path (:meth:`window`; past the sequence's end,
        it raises)."""
        starts = np.asarray(starts, np.int64)
        first, self._started = not self._started, True
        beyond = self.scattered and chunks.stored_bytes > 2 * self.files.cache.capacity
        later, self._decode_later = self._decode_later, []
        for chunks_later, chunk, group in later:
            _AHEAD_POOL.submit(self.rendered_group, chunks_later, chunk, group).add_done_callback(_log_failure)
        end = int(starts.max()) + length if len(starts) else 0   # one past the windows' last token
        if self.sequential and not first and len(starts):
            inside = self._inside_one_group(chunks, sequence, sequence_offsets, starts, length, end)
            if inside is not None:
                self._look_ahead(chunks, sequence, sequence_offsets, end)
                return inside
        position = locate(sequence_offsets, starts)
        index = self._index
        if index is None or index.offsets is not sequence_offsets:   # another sequence, or the dataset grew
            index = StreamIndex.empty(sequence_offsets)
        in_sequence = position < len(sequence)
        first_chunks = position[in_sequence]
        new = set(first_chunks.tolist()) - index.known
        if new:   # a catalog query is due: it also fetches the chunks windows across chunks reach, and
            # (reading in order) those the look-ahead will need; a batch inside known chunks pays nothing more
            last = np.minimum(locate(sequence_offsets, starts + length - 1), len(sequence) - 1)[in_sequence]
            if bool((last > first_chunks).any()):
                new.update(spans(first_chunks, np.maximum(last - first_chunks + 1, 1)).tolist())
            if self.sequential:   # (:meth:`_fetch_tables_ahead` finds them)
                new.update(range(max(new) + 1, min(max(new) + TABLES_AHEAD, len(sequence))))
            wanted = sorted(new - index.known)
            index = index.with_chunks(wanted, self.groups_of(chunks, np.asarray(sequence)[wanted].tolist()))
        self._index = index
        found = self._views(chunks, sequence, sequence_offsets, starts, length, position, index,
                            from_pages=first or beyond, ahead=first and not beyond)
        for row in np.flatnonzero(found.group < 0).tolist():
            if row not in found.others:
                found.others[row] = self.window(chunks, sequence, sequence_offsets, int(starts[row]), length)
        if self.sequential and len(starts):
            self._look_ahead(chunks, sequence, sequence_offsets, end)
        return found

    def _inside_one_group(self, chunks: DatasetChunks, sequence: Sequence[int], sequence_offsets: np.ndarray,
                          starts: np.ndarray, length: int, end: int) -> WindowSet | None:
        """The windows as slices of one cached row group the reader's index holds, when they all
        lie inside it (most batches without a shuffle; ``end``: one past their last token): what
        :meth:`_views` finds for them, for a few operations instead of a search per window; None
        otherwise."""
        index = self._index
        if index is None or index.offsets is not sequence_offsets or not len(index.start):
            return None
        g = int(np.searchsorted(index.start, int(starts.min()), side="right")) - 1
        if g < 0 or end > int(index.stop[g]):
            return None
        position = int(index.position[g])
        chunk = int(sequence[position])
        rendered = self.files.cache.cached([self._rendered_key(chunks, chunk, int(index.group[g]))])[0]
        if rendered is None:
            return None
        n = len(starts)
        return WindowSet(length, [rendered], [position], [chunk], [int(index.first_doc[g])], np.zeros(n, np.int64),
                         starts - int(index.start[g]), starts - int(sequence_offsets[position]),
                         np.full(n, position, np.int64), {})

    def _look_ahead(self, chunks: DatasetChunks, sequence: Sequence[int], sequence_offsets: np.ndarray,
                    end: int) -> None:
        """:meth:`_decode_after` the row group holding stream position ``end``, unless the windows
        ended in that row group last time too (nothing for a dataset defined by a filter: reading
        one queries its selection)."""
        lo, hi = self._ahead_range
        if lo <= end < hi or chunks.filtered:
            return
        self._ahead_range = (end, end + 1)   # until its row group is known (none past the stream)
        if end >= int(sequence_offsets[-1]):
            return
        position = int(np.searchsorted(sequence_offsets, end, side="right")) - 1
        self._fetch_tables_ahead(chunks, sequence, position)
        offsets, _ = self.groups(chunks, int(sequence[position]))
        group = int(np.searchsorted(offsets, end - sequence_offsets[position], side="right")) - 1
        self._ahead_range = (int(sequence_offsets[position] + offsets[group]),
                             int(sequence_offsets[position] + offsets[group + 1]))
        self._decode_after(chunks, sequence, position, group)

    def look_ahead_after(self, chunks: DatasetChunks, chunk: int, group: int) -> None:
        """For a reader whose batches move forward through the chunks in global order (packed
        examples without a shuffle): :meth:`_decode_after` row group ``group`` of chunk ``chunk``,
        the last a batch reached, unless the last batch reached that one too. Nothing for a
        reader that is not ``sequential``, nor for a dataset defined by a filter (reading one
        queries its selection)."""
        if not self.sequential or chunks.filtered or (chunk, group) == self._ahead_origin:
            return
        self._ahead_origin = (chunk, group)
        sequence = range(chunks.committed)
        self._fetch_tables_ahead(chunks, sequence, chunk)
        self._decode_after(chunks, sequence, chunk, group)

    def _fetch_tables_ahead(self, chunks: DatasetChunks, sequence: Sequence[int], position: int) -> None:
        """The row-group tables (and records) of the chunks a look-ahead from chunk
        ``sequence[position]`` can reach, fetched here when one is missing, together with those of
        the chunks up to :data:`TABLES_AHEAD` on, in one query."""
        near = [(chunks.fingerprint, int(c)) for c in sequence[position : position + LOOK_AHEAD_GROUPS + 1]]
        if any(table is None for table in self._row_groups.cached(near)):
            self.groups_of(chunks, [int(c) for c in sequence[position : position + TABLES_AHEAD]])

    def _decode_after(self, chunks: DatasetChunks, sequence: Sequence[int], position: int, group: int) -> None:
        """Have the :data:`LOOK_AHEAD_GROUPS` row groups after row group ``group`` of chunk
        ``sequence[position]``, in stream order, decoded in the ahead thread (those the cache
        would keep and does not hold yet). Their chunks' row-group tables and records are learnt
        here (:meth:`_fetch_tables_ahead`), so the ahead thread needs nothing from the catalog."""
        wanted: list[tuple[int, int]] = []
        offsets, _ = self.groups(chunks, int(sequence[position]))
        for _ in range(LOOK_AHEAD_GROUPS):
            group += 1
            while group >= len(offsets) - 1 and position + 1 < len(sequence):   # (a chunk may hold no row group)
                position, group = position + 1, 0
                offsets, _ = self.groups(chunks, int(sequence[position]))
            if group >= len(offsets) - 1:   # past the committed chunks
                break
            if int(offsets[group + 1] - offsets[group]) * AHEAD_CACHE_SHARE <= self.files.cache.capacity // 4:
                chunk = int(sequence[position])   # (4 bytes a token at most)
                chunks.record(chunk)   # (kept by the view: fetched with the row-group table)
                wanted.append((chunk, group))
        cached = self.files.cache.cached(self._rendered_keys(chunks, wanted))
        wanted = [key for key, rendered in zip(wanted, cached) if rendered is None]
        if not wanted:
            return
        with self._ahead_lock:
            self._ahead_wanted = (chunks, wanted)
            if self._ahead_closed or self._ahead_running:
                return   # (the running task takes the newest row groups once done with its own)
            self._ahead_running = True
            self._ahead_task = task = _AHEAD_POOL.submit(self._decode_ahead)
        task.add_done_callback(_log_failure)

    def _decode_ahead(self) -> None:
        """In the ahead thread: decode the newest row groups :meth:`_decode_after` asked for, until
        it asks for none new. Files only (a row group whose chunk's table left the reader's cache
        meanwhile is skipped: finding it again would query the catalog; the chunks' records stay
        in the view's far larger cache). A failure is logged, and the row group is read again when
        a batch needs it (raising then)."""
        try:
            while True:
                with self._ahead_lock:
                    if self._ahead_wanted is None or self._ahead_closed:
                        self._ahead_running = False
                        return
                    chunks, wanted = self._ahead_wanted
                    self._ahead_wanted = None
                tables = self._row_groups.cached([(chunks.fingerprint, chunk) for chunk, _ in wanted])
                for (chunk, group), table in zip(wanted, tables):
                    if self._ahead_closed:
                        break
                    if table is not None:
                        self.rendered_group(chunks, chunk, group)
        except BaseException:
            with self._ahead_lock:
                self._ahead_running = False
            raise

    def close(self) -> None:
        """Stop decoding ahead, once the row group at hand is decoded."""
        with self._ahead_lock:
            self._ahead_closed = True
            task = self._ahead_task
        if task is not None:
            concurrent.futures.wait([task])   # (a failure is logged by the task's callback)

    def _views(self, chunks: DatasetChunks, sequence: Sequence[int], sequence_offsets: np.ndarray,
               starts: np.ndarray, length: int, position: np.ndarray, index: StreamIndex, from_pages: bool,
               ahead: bool) -> WindowSet:
        """The windows whose row groups ``index`` holds, each row group fetched once: a window
        inside one row group as a slice of its cached rendering; with ``from_pages`` (a batch read
        cold), one across row groups or chunks as its pieces (in ``others``, joined per chunk from
        slices of its row groups, read with the others). Any other is left with group -1 and no
        pieces: across row groups in a warm batch (:meth:`window` finds its row groups cached, for
        less than locating its pieces costs: ~2% of the steady rate without a shuffle), or past
        the sequence's end."""
        n = len(starts)
        held = index.locate(starts, length)
        inside = held >= 0
        rows = None if n and bool(inside.all()) else np.flatnonzero(inside)   # None: every window
        found = WindowSet(length, [], [], [], [], *_NO_PIECES[:3], position, {})   # (group, at, start: below)
        piece_row, piece_group, piece_lo, piece_hi = _NO_PIECES
        if rows is not None:
            found.group = np.full(n, -1, np.int64)
            found.at, found.start = np.zeros(n, np.int64), np.zeros(n, np.int64)
            if from_pages:   # windows across row groups: their pieces, when every one is held
                across = np.flatnonzero(~inside)
                piece_row, piece_group, piece_lo, piece_hi = index.reached(starts[across], length)
                kept = (np.bincount(piece_row, piece_hi - piece_lo, len(across)) == length)[piece_row]
                piece_row, piece_group, piece_lo, piece_hi = (across[piece_row[kept]], piece_group[kept],
                                                              piece_lo[kept], piece_hi[kept])
        window_group = held if rows is None else held[rows]
        span_group = np.concatenate([window_group, piece_group]) if len(piece_row) else window_group
        if not len(span_group):
            return found
        used, span_group = distinct(span_group)
        window_at = starts - index.start[held] if rows is None else starts[rows] - index.start[window_group]
        span_lo = np.concatenate([window_at, piece_lo]) if len(piece_row) else window_at
        span_hi = np.concatenate([window_at + length, piece_hi]) if len(piece_row) else window_at + length
        found.group_position = index.position[used].tolist()
        found.group_chunk = np.asarray(sequence)[index.position[used]].tolist()
        found.group_first_doc = index.first_doc[used].tolist()
        self._add_groups(chunks, found, list(zip(found.group_chunk, index.group[used].tolist())),
                         index.stop[used] - index.start[used], (span_group, span_lo, span_hi), from_pages, ahead)
        windows = len(window_group)
        if rows is None:
            found.group, found.at = span_group, span_lo
            found.start = starts - sequence_offsets[position]
        else:
            found.group[rows], found.at[rows] = span_group[:windows], span_lo[:windows]
            found.start[rows] = starts[rows] - sequence_offsets[position[rows]]
        if len(piece_row):
            self._join_pieces(found, starts, sequence_offsets, piece_row, span_group[windows:], span_lo[windows:],
                              span_hi[windows:])
        return found

    @staticmethod
    def _join_pieces(found: WindowSet, starts: np.ndarray, sequence_offsets: np.ndarray, piece_row: np.ndarray,
                     piece_group: np.ndarray, piece_lo: np.ndarray, piece_hi: np.ndarray) -> None:
        """``found.others`` of the windows across row groups or chunks: each window's pieces
        (``piece_row``, in stream order: tokens ``[piece_lo, piece_hi)`` of ``found.groups[piece_group]``)
        joined into one piece per chunk, as :meth:`window` makes them."""
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

    def _add_groups(self, chunks: DatasetChunks, found: WindowSet, wanted: list[tuple[int, int]],
                    lengths: np.ndarray, ranges: tuple[np.ndarray, np.ndarray, np.ndarray], from_pages: bool,
                    ahead: bool) -> None:
        """Fills ``found.groups`` with the renderings of the row groups ``wanted`` (``(chunk,
        group)`` of each group of ``found``, ``lengths`` their rendered tokens): the cached ones,
        and those not cached decoded whole, concurrently. ``ranges`` are the tokens the windows
        need (index into ``wanted``, first token, one past the last; a window inside a row group,
        or a piece of one across row groups).

        ``from_pages`` (a reader's first windows: a start, or a resume; and scattered windows beyond
        the cache): a row group not cached whose ranges reach little of it is read from the pages
        they need instead. Its ranges are re-pointed (in place) at renderings of just the documents
        they reach (one per run of nearby ranges), and with ``ahead`` it is decoded whole in the
        background once these windows are out (when the cache can keep it). Otherwise windows
        decode whole row groups: the windows of the batches that follow reach the rest of them
        (every shuffle's do, within an epoch, while the cache keeps them)."""
        groups = self.files.cache.cached(self._rendered_keys(chunks, wanted))
        missing = [j for j, rendered in enumerate(groups) if rendered is None]
        runs: dict[int, tuple[int, int]] = {}
        # (per run: where its rendering went, an index into groups, and where it starts in its row group)
        run_lo = run_hi = run_of_range = run_target = run_base = _NO_PIECES[0]
        if from_pages and missing and not self._keeps_parts and not chunks.filtered:
            runs, run_lo, run_hi, run_of_range = _page_runs(missing, ranges, lengths)
            run_target, run_base = np.zeros(len(run_lo), np.int64), np.zeros(len(run_lo), np.int64)
        reads: list[Callable[[], RenderedGroup | list[tuple[RenderedGroup, int, int]]]] = [
            functools.partial(self._render_ranges, chunks, *wanted[j], run_lo[runs[j][0]:runs[j][1]],
                              run_hi[runs[j][0]:runs[j][1]]) if j in runs
            else functools.partial(self.rendered_group, chunks, *wanted[j]) for j in missing]
        for j, result in zip(missing, _concurrently(reads)):
            if isinstance(result, RenderedGroup):
                groups[j] = result
                continue
            first_doc = found.group_first_doc[j]
            for k, (rendered, base, first) in enumerate(result):
                g = j if k == 0 else len(groups)
                if k:
                    groups.append(rendered)
                    found.group_position.append(found.group_position[j])
                    found.group_chunk.append(found.group_chunk[j])
                    found.group_first_doc.append(first_doc + first)
                else:
                    groups[j] = rendered
                    found.group_first_doc[j] = first_doc + first
                run_target[runs[j][0] + k], run_base[runs[j][0] + k] = g, base
            # (4 bytes a token at most)
            if ahead and int(lengths[j]) * AHEAD_CACHE_SHARE <= self.files.cache.capacity // 4:
                self._decode_later.append((chunks, *wanted[j]))
        if runs:   # the ranges re-pointed at their runs' renderings
            moved = np.flatnonzero(run_of_range >= 0)
            run = run_of_range[moved]
            range_group, range_lo, range_hi = ranges
            range_group[moved] = run_target[run]
            range_lo[moved] -= run_base[run]
            range_hi[moved] -= run_base[run]
        found.groups.extend(groups)  # type: ignore[arg-type]

    @property
    def _keeps_parts(self) -> bool:
        """Whether renderings keep their stored parts (templates that need them after rendering)."""
        return self.template.image_kind is not None or "response" in self.template.kind_names

    def _render_ranges(self, chunks: DatasetChunks, chunk: int, group: int, lo: np.ndarray,
                       hi: np.ndarray) -> list[tuple[RenderedGroup, int, int]]:
        """For each rendered range ``[lo[k], hi[k])`` of a row group, the documents reaching it
        rendered: (rendering, where it starts in the row group's rendering, its first document
        within the row group). Only their tokens' pages are decoded (as the file allows)."""
        first_doc = int(self.groups(chunks, chunk)[1][group])
        fim: tuple[np.ndarray, ...] | None = None
        starts = np.zeros(1, np.int64)   # the rendered documents' starts, from the row group's part layout

        def pick(parts: ChunkParts) -> list[tuple[int, int]]:
            nonlocal fim, starts
            fim = self._fim(chunks, chunk, first_doc + np.arange(parts.num_docs), parts.content_lengths)
            starts = rendered_doc_starts(self.template, parts.part_lengths, parts.part_kinds, parts.part_doc,
                                         parts.num_docs, fim)
            return list(zip((np.searchsorted(starts, lo, "right") - 1).tolist(),
                            np.searchsorted(starts, hi, "left").tolist()))

        found = []
        for stored in self.files.read_documents(chunks, chunk, group, pick):
            first, parts = stored.first_doc, stored.parts
            their_fim = None if fim is None else tuple(x[first:first + parts.num_docs] for x in fim)
            rendered = RenderedGroup(*render_compact(self.template, stored.values, parts.part_lengths, parts.part_kinds,
                                                     parts.part_doc, parts.num_docs, their_fim))
            found.append((rendered, int(starts[first]), first))
        return found
