"""Row groups decoded in a background thread before a batch needs them, so that decoding them
overlaps building the batches before them: those after the last row group a reader in stream
order reached, and those a cold start read only in part."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from lakeloader.read.catalog_view import DatasetChunks
from lakeloader.read.group_tables import GroupTables
from lakeloader.read.renderings import Renderings

log = logging.getLogger(__name__)

# Row groups are decoded ahead here, one at a time; only when the cache holds AHEAD_CACHE_SHARE row
# groups like them (else they would not stay).
_AHEAD_POOL = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lakeloader-decode-ahead")
AHEAD_CACHE_SHARE = 8
# A reader that reads its stream in order has this many row groups past the one its last span ends
# in decoded ahead: with 1 M-token row groups, 8 to 16 batches of 64 x 2048 before a batch needs
# them (counted in row groups, not tokens: a lake of small chunks is not read far ahead).
LOOK_AHEAD_GROUPS = 2
# Such a reader fetches the row-group tables of this many chunks per catalog query (a query costs
# ~3-4 ms whatever its chunks: one per chunk was ~10% of a first epoch here).
TABLES_AHEAD = 8


def _log_failure(future: concurrent.futures.Future[Any]) -> None:
    """A row group decoded ahead that failed is read again when asked for, and raises then."""
    if future.exception() is not None:
        log.debug("a row group decoded ahead failed (read again when asked for): %s", future.exception())


class ReadAhead:
    """Row groups of one dataset decoded ahead into ``renderings``' cache.

    ``in_order``: the reader reads its stream in order (no shuffle). The :data:`LOOK_AHEAD_GROUPS`
    row groups after the one its last spans end in (:meth:`after_end`), or after the last row
    group a batch of packed examples reached (:meth:`after_group`), are decoded ahead. Which row
    groups those are is worked out in the thread that asks (their chunks' row-group tables and
    records fetched there, :data:`TABLES_AHEAD` chunks a query): the ahead thread only reads
    files, and the catalog queries stay few and in the thread that asks.

    In any order, row groups a cold start read in part are decoded whole after the spans read
    from them are out (:meth:`decode_later`)."""

    def __init__(self, tables: GroupTables, renderings: Renderings, in_order: bool = False) -> None:
        self.tables = tables
        self.renderings = renderings
        self.in_order = in_order
        # The stream range [lo, hi) of the row group the last spans ended in when the reader last
        # looked ahead (no new look-ahead while spans end in it), or the (chunk, row group) a
        # packed batch last reached; the newest row groups to decode ahead, and whether the ahead
        # thread is on them.
        self._end_range = (0, 0)
        self._origin = (-1, -1)
        self._wanted: tuple[DatasetChunks, list[tuple[int, int]]] | None = None
        self._task: concurrent.futures.Future[None] | None = None
        self._running = False
        self._closed = False
        self._lock = threading.Lock()
        # Row groups read in part, decoded whole once the spans read from them are out (while the
        # consumer uses them), not while those are read.
        self._later: list[tuple[DatasetChunks, int, int]] = []

    def fits(self, tokens: int) -> bool:
        """Whether the cache keeps :data:`AHEAD_CACHE_SHARE` row groups of ``tokens`` rendered tokens."""
        return tokens * AHEAD_CACHE_SHARE <= self.renderings.files.cache.capacity // 4   # (4 bytes a token at most)

    def tables_after(self, position: int, count: int) -> range:
        """The chunk-sequence positions after ``position`` (of ``count``) whose row-group tables a
        catalog query due for chunk ``position`` fetches too, for the look-ahead to find: up to
        :data:`TABLES_AHEAD` chunks in all when reading in order, else none."""
        return range(position + 1, min(position + TABLES_AHEAD, count)) if self.in_order else range(0)

    def decode_later(self, chunks: DatasetChunks, chunk: int, group: int, tokens: int) -> None:
        """Have row group ``group`` of chunk ``chunk`` (``tokens`` rendered tokens, read in part)
        decoded whole at the next :meth:`decode_deferred`, if the cache can keep it (:meth:`fits`)."""
        if self.fits(tokens):
            self._later.append((chunks, chunk, group))

    def decode_deferred(self) -> None:
        """Start decoding the row groups :meth:`decode_later` was given, in the ahead thread."""
        later, self._later = self._later, []
        for chunks, chunk, group in later:
            _AHEAD_POOL.submit(self.renderings.get, chunks, chunk, group).add_done_callback(_log_failure)

    def after_end(self, chunks: DatasetChunks, sequence: Sequence[int], sequence_offsets: np.ndarray,
                  end: int) -> None:
        """Reading in order: decode ahead the row groups after the one holding stream position
        ``end`` of the chunks ``sequence`` (cumulative stream offsets ``sequence_offsets``),
        unless spans ended in that row group last time too (nothing for a dataset defined by a
        filter: reading one queries its selection)."""
        lo, hi = self._end_range
        if not self.in_order or lo <= end < hi or chunks.filtered:
            return
        self._end_range = (end, end + 1)   # until its row group is known (none past the stream)
        if end >= int(sequence_offsets[-1]):
            return
        position = int(np.searchsorted(sequence_offsets, end, side="right")) - 1
        self._fetch_tables(chunks, sequence, position)
        offsets, _ = self.tables.of(chunks, int(sequence[position]))
        group = int(np.searchsorted(offsets, end - sequence_offsets[position], side="right")) - 1
        self._end_range = (int(sequence_offsets[position] + offsets[group]),
                           int(sequence_offsets[position] + offsets[group + 1]))
        self._decode_after(chunks, sequence, position, group)

    def after_group(self, chunks: DatasetChunks, chunk: int, group: int) -> None:
        """Reading the chunks in global order (packed examples without a shuffle): decode ahead
        the row groups after row group ``group`` of chunk ``chunk``, the last a batch reached,
        unless the last batch reached that one too (nothing for a dataset defined by a filter)."""
        if not self.in_order or chunks.filtered or (chunk, group) == self._origin:
            return
        self._origin = (chunk, group)
        sequence = range(chunks.committed)
        self._fetch_tables(chunks, sequence, chunk)
        self._decode_after(chunks, sequence, chunk, group)

    def close(self) -> None:
        """Stop decoding ahead, once the row group at hand is decoded."""
        with self._lock:
            self._closed = True
            task = self._task
        if task is not None:
            concurrent.futures.wait([task])   # (a failure is logged by the task's callback)

    def _fetch_tables(self, chunks: DatasetChunks, sequence: Sequence[int], position: int) -> None:
        """The row-group tables (and records) of the chunks a look-ahead from chunk
        ``sequence[position]`` can reach, fetched here when one is missing, together with those of
        the chunks up to :data:`TABLES_AHEAD` on, in one query."""
        near = [int(c) for c in sequence[position : position + LOOK_AHEAD_GROUPS + 1]]
        if any(table is None for table in self.tables.kept(chunks, near)):
            self.tables.of_chunks(chunks, [int(c) for c in sequence[position : position + TABLES_AHEAD]])

    def _decode_after(self, chunks: DatasetChunks, sequence: Sequence[int], position: int, group: int) -> None:
        """Have the :data:`LOOK_AHEAD_GROUPS` row groups after row group ``group`` of chunk
        ``sequence[position]``, in stream order, decoded in the ahead thread (those the cache
        would keep and does not hold yet). Their chunks' row-group tables and records are learnt
        here (:meth:`_fetch_tables`), so the ahead thread needs nothing from the catalog."""
        wanted: list[tuple[int, int]] = []
        offsets, _ = self.tables.of(chunks, int(sequence[position]))
        for _ in range(LOOK_AHEAD_GROUPS):
            group += 1
            while group >= len(offsets) - 1 and position + 1 < len(sequence):   # (a chunk may hold no row group)
                position, group = position + 1, 0
                offsets, _ = self.tables.of(chunks, int(sequence[position]))
            if group >= len(offsets) - 1:   # past the committed chunks
                break
            if self.fits(int(offsets[group + 1] - offsets[group])):
                chunk = int(sequence[position])
                chunks.record(chunk)   # (kept by the view: fetched with the row-group table)
                wanted.append((chunk, group))
        cached = self.renderings.cached(chunks, wanted)
        wanted = [key for key, rendered in zip(wanted, cached) if rendered is None]
        if not wanted:
            return
        with self._lock:
            self._wanted = (chunks, wanted)
            if self._closed or self._running:
                return   # (the running task takes the newest row groups once done with its own)
            self._running = True
            self._task = task = _AHEAD_POOL.submit(self._decode_ahead)
        task.add_done_callback(_log_failure)

    def _decode_ahead(self) -> None:
        """In the ahead thread: decode the newest row groups :meth:`_decode_after` asked for, until
        it asks for none new. Files only (a row group whose chunk's table left the reader's cache
        meanwhile is skipped: finding it again would query the catalog; the chunks' records stay
        in the view's far larger cache). A failure is logged, and the row group is read again when
        a batch needs it (raising then)."""
        try:
            while True:
                with self._lock:
                    if self._wanted is None or self._closed:
                        self._running = False
                        return
                    chunks, wanted = self._wanted
                    self._wanted = None
                tables = self.tables.kept(chunks, [chunk for chunk, _ in wanted])
                for (chunk, group), table in zip(wanted, tables):
                    if self._closed:
                        break
                    if table is not None:
                        self.renderings.get(chunks, chunk, group)
        except BaseException:
            with self._lock:
                self._running = False
            raise
