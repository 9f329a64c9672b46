"""A batch's spans located together: each row group's compact rendering (what the reader's
cache keeps), the pieces of a span taken from one chunk, and the set of a batch's spans as
slices of the renderings (filled into batches without a Python object per span)."""

from __future__ import annotations

import dataclasses

import numpy as np

from lakeloader.contracts.chunk_file import ChunkParts
from lakeloader.index.ranges import run_indices


@dataclasses.dataclass(frozen=True)
class RenderedGroup:
    """One row group's documents rendered, compactly (what the cache keeps)."""

    tokens: np.ndarray              # the stored dtype when every rendered id fits it, else int32
    trainable: np.ndarray | None    # bool per token; None: every token is a training target
    doc_starts: np.ndarray          # int64 [docs + 1]: offset of each document, then the end
    # Kept only for templates that need the stored parts after rendering (image positions of
    # interleaved documents, the response split of supervised ones): a few numbers per part.
    parts: ChunkParts | None = None
    refs: np.ndarray | None = None  # interleaved: each part's reference (None for text parts)


@dataclasses.dataclass
class Piece:
    """Part of a span taken from one chunk."""

    position: int       # index into the chunk sequence the span was read from
    chunk: int          # global index of the chunk
    start: int          # first stream offset within the chunk
    tokens: np.ndarray
    trainable: np.ndarray | None    # bool: whether each token is a training target (None: all)
    first_doc: int      # document index within the chunk of the piece's first token
    doc_offsets: np.ndarray  # int64: offsets within the piece where documents first_doc+1, ... start

    @property
    def docs(self) -> np.ndarray:
        """Document index within the chunk of every token (computed; not kept)."""
        return self.first_doc + np.searchsorted(self.doc_offsets, np.arange(len(self.tokens)), side="right")

    def flags(self) -> np.ndarray:
        """Target flag of every token."""
        return np.ones(len(self.tokens), bool) if self.trainable is None else self.trainable


def piece_of(position: int, chunk: int, start: int, rendered: RenderedGroup, first_doc: int, a: int, b: int) -> Piece:
    """Piece of tokens ``[a, b)`` of a rendered row group whose first document is ``first_doc``."""
    starts = rendered.doc_starts
    lo = int(np.searchsorted(starts, a, side="right"))
    hi = int(np.searchsorted(starts, b, side="left"))
    trainable = None if rendered.trainable is None else rendered.trainable[a:b]
    return Piece(position, chunk, start, rendered.tokens[a:b], trainable, first_doc + lo - 1,
                 starts[lo:max(lo, hi)] - a)


def joined(pieces: list[Piece]) -> Piece:
    """One piece of consecutive pieces of a chunk's stream, from its row groups in order."""
    if len(pieces) == 1:   # the common case: views of one row group
        return pieces[0]
    at, last_doc, doc_offsets = 0, pieces[0].first_doc, []
    for piece in pieces:
        # Row groups hold whole documents: a later group's first document starts where the
        # group does (as do any documents without rendered tokens before it).
        doc_offsets += [np.full(piece.first_doc - last_doc, at, np.int64), piece.doc_offsets + at]
        last_doc = piece.first_doc + len(piece.doc_offsets)
        at += len(piece.tokens)
    trainable = None if all(p.trainable is None for p in pieces) else np.concatenate([p.flags() for p in pieces])
    first = pieces[0]
    return Piece(first.position, first.chunk, first.start, np.concatenate([p.tokens for p in pieces]), trainable,
                 first.first_doc, np.concatenate(doc_offsets))


_MANY_DOCS = 4096   # a row group with more documents is searched only where spans lie
_GROUP_SHIFT = 32   # (a row group renders to fewer than 2**32 tokens)


@dataclasses.dataclass
class SpanSet:
    """Spans of one length located together (:meth:`SpanReader.spans`). Nearly every span
    lies inside one cached row group and stays a slice of it: span ``i`` is tokens
    ``[at[i], at[i] + length)`` of ``groups[group[i]]``; the others (``group[i] == -1``: across
    row groups or chunks) keep their pieces in ``others``. Batches are filled from these arrays
    without a Python object per span (:meth:`tokens`, :meth:`cuts`)."""

    length: int
    groups: list[RenderedGroup]     # the row groups the spans lie in, each once
    group_position: list[int]       # chunk-sequence position of each of those row groups
    group_chunk: list[int]          # its chunk (global index)
    group_first_doc: list[int]      # document index within the chunk of its first document
    group: np.ndarray               # int64 per span: index into ``groups``; -1: see ``others``
    at: np.ndarray                  # int64 per span: first token within its row group
    start: np.ndarray               # int64 per span: first stream offset within its chunk
    position: np.ndarray            # int64 per span: chunk-sequence position of its first token
    others: dict[int, list[Piece]]  # pieces of the spans not inside one row group

    def pieces(self, i: int) -> list[Piece]:
        """Span ``i``'s pieces (one view of its row group's rendering unless in ``others``)."""
        g = int(self.group[i])
        if g < 0:
            return self.others[i]
        a = int(self.at[i])
        return [piece_of(self.group_position[g], self.group_chunk[g], int(self.start[i]), self.groups[g],
                       self.group_first_doc[g], a, a + self.length)]

    def tokens(self, which: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray | None] | None]:
        """Token views of spans ``which`` (each inside a row group) and their target flags
        (None for a span whose tokens all train; None instead of the list when every one does)."""
        groups = [self.groups[g] for g in self.group[which].tolist()]
        ats = self.at[which].tolist()
        n = self.length
        views = [r.tokens[a : a + n] for r, a in zip(groups, ats)]
        if all(g.trainable is None for g in self.groups):
            return views, None
        return views, [None if r.trainable is None else r.trainable[a : a + n] for r, a in zip(groups, ats)]

    def cuts(self, which: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(k, offset) of every document start strictly inside span ``which[k]`` (each inside
        a row group): one search for all spans over their row groups' document starts."""
        k, at = self.group[which], self.at[which]   # every row group of the set holds some span
        doc_starts = [g.doc_starts for g in self.groups]
        counts = [len(d) for d in doc_starts]
        if max(counts) > _MANY_DOCS:   # short documents: only those the spans reach
            reach = np.full((2, len(doc_starts)), [[np.iinfo(np.int64).max], [0]], np.int64)
            np.minimum.at(reach[0], k, at)
            np.maximum.at(reach[1], k, at + self.length)
            for j, (d, a, b) in enumerate(zip(doc_starts, *reach.tolist())):
                if len(d) > _MANY_DOCS:
                    doc_starts[j] = d[d.searchsorted(a, side="right") : d.searchsorted(b, side="left")]
            counts = [len(d) for d in doc_starts]
        # Row group j's starts shifted by j * 2**32 (past any row group's tokens): one sorted array.
        shifted = np.concatenate(doc_starts)
        shifted += (np.arange(len(doc_starts), dtype=np.int64) << _GROUP_SHIFT).repeat(counts)
        begin = (k << _GROUP_SHIFT) + at
        # (the arrays' methods: numpy's function wrappers cost more than these small calls)
        lo = shifted.searchsorted(begin, side="right")
        count = np.maximum(shifted.searchsorted(begin + self.length, side="left") - lo, 0)
        found = shifted[run_indices(lo, count)] - begin.repeat(count)
        return np.arange(len(which)).repeat(count), found
