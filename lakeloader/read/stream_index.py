"""Where spans of a chunk sequence's stream lie: the row groups of the chunks read so far, in
stream order, so that a batch's spans are located with one search instead of a table of its
chunks' row groups rebuilt for every batch."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from lakeloader.index.ranges import run_indices

# Row groups an index holds at most (five int64 each: ~2.6 MB); past it, it starts afresh with the
# chunks of the batch at hand (a full shuffle over a lake of many chunks keeps meeting new ones).
INDEXED_GROUPS = 1 << 16


@dataclasses.dataclass(frozen=True)
class StreamIndex:
    """The row groups of some chunks of one chunk sequence, sorted by where they start in the
    sequence's stream. Immutable: adding chunks makes a new index, so threads share one without
    a lock (two adding at once only repeat work)."""

    offsets: np.ndarray      # the sequence's cumulative stream offsets (the index is for these only)
    start: np.ndarray        # int64 per row group: first stream offset in the sequence's stream
    stop: np.ndarray         # int64: one past its last
    position: np.ndarray     # int64: chunk-sequence position of its chunk
    group: np.ndarray        # int64: row group number within its chunk
    first_doc: np.ndarray    # int64: document index within its chunk of its first document
    known: frozenset[int]    # the chunk-sequence positions whose row groups are held

    @classmethod
    def empty(cls, offsets: np.ndarray) -> StreamIndex:
        """An index of no chunk of the sequence with cumulative stream offsets ``offsets``."""
        none = np.zeros(0, np.int64)
        return cls(offsets, none, none, none, none, none, frozenset())

    def with_chunks(self, positions: Sequence[int], tables: Sequence[tuple[np.ndarray, np.ndarray]]) -> StreamIndex:
        """This index and the chunks at sequence positions ``positions`` (not held yet), given each
        one's (stream offsets of its row groups within the chunk, first document of each); a new
        index without the old row groups when together they would pass :data:`INDEXED_GROUPS`."""
        counts = np.array([len(offsets) - 1 for offsets, _ in tables], np.int64)
        old = self if len(self.start) + int(counts.sum()) <= INDEXED_GROUPS else StreamIndex.empty(self.offsets)
        if not len(positions):
            return old
        owner = np.repeat(np.asarray(positions, np.int64), counts)
        start = np.concatenate([offsets[:-1] for offsets, _ in tables]) + self.offsets[owner]
        stop = np.concatenate([offsets[1:] for offsets, _ in tables]) + self.offsets[owner]
        group = np.concatenate([np.arange(n, dtype=np.int64) for n in counts.tolist()])
        first_doc = np.concatenate([first_docs for _, first_docs in tables]).astype(np.int64)
        # Sorted by start, a row group without tokens before the one starting where it does (the
        # search for a span's group takes the last group starting at or before the span).
        added = (start, stop, owner, group, first_doc)
        order = np.argsort(_order_key(start, stop))
        at = np.searchsorted(_order_key(old.start, old.stop), _order_key(start, stop)[order])
        merged = (np.insert(kept, at, new[order]) for kept, new in zip(
            (old.start, old.stop, old.position, old.group, old.first_doc), added))
        return StreamIndex(self.offsets, *merged, old.known | frozenset(int(p) for p in positions))

    def locate(self, starts: np.ndarray, length: int) -> np.ndarray:
        """For each span of ``length`` tokens starting at stream offset ``starts[i]``, the row
        group (index into this index's arrays) that holds it whole; -1 where none held here does
        (its chunk is not held, or it crosses a row group's end)."""
        found = np.searchsorted(self.start, starts, side="right") - 1
        held = found >= 0
        found[~held] = 0
        inside = held & (starts + length <= self.stop[found]) if len(self.start) else held
        found[~inside] = -1
        return found

    def reached(self, starts: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Every (span, row group) pair where a span of ``length`` tokens starting at stream
        offset ``starts[i]`` reaches tokens of a row group held here, in stream order for each
        span: (the span, the row group, the span's first token within it, one past its
        last). A span reaching a chunk not held has only the pieces held (their lengths then
        add up to less than ``length``)."""
        starts = np.asarray(starts, np.int64)
        first = np.maximum(np.searchsorted(self.start, starts, side="right") - 1, 0)
        count = np.maximum(np.searchsorted(self.start, starts + length, side="left") - first, 0)
        rows = np.repeat(np.arange(len(starts), dtype=np.int64), count)
        groups = run_indices(first, count)
        lo = np.maximum(starts[rows], self.start[groups]) - self.start[groups]
        hi = np.minimum(starts[rows] + length, self.stop[groups]) - self.start[groups]
        kept = hi > lo
        return rows[kept], groups[kept], lo[kept], hi[kept]


def _order_key(start: np.ndarray, stop: np.ndarray) -> np.ndarray:
    """Row groups' sort key: by start, those without tokens first among equal starts."""
    return start * 2 + (stop > start)
