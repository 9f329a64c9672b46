"""The fill part of ``packing: concat``: a span is an example of L+1 tokens cut from a
dataset's rendered stream (located by :mod:`lakeloader.feed.locate_spans` or
:mod:`lakeloader.feed.strided_spans`); spans write their batch rows here, one by one or all
rows of a batch at once."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

import numpy as np

from lakeloader.feed.rows import ROW_FIELDS, Batch, Example, ExampleRun, Row, Segment, segment_fields
from lakeloader.index.ranges import cut_segments
from lakeloader.read.span_set import Piece, SpanSet


@dataclasses.dataclass
class Span(Example):
    """One example's L+1 stream tokens (fewer at the end of an evaluation pass) and provenance:
    its pieces, or where it lies in the spans it was located with (``located[index]``)."""

    found: list[Piece] | None = None
    located: SpanSet | None = None
    index: int = -1

    @property
    def pieces(self) -> list[Piece]:
        """The span's pieces, each from one chunk position."""
        if self.found is None:
            assert self.located is not None
            self.found = self.located.pieces(self.index)
        return self.found

    def write(self, tokens: np.ndarray, trainable: np.ndarray) -> tuple[int, np.ndarray]:
        """Copy the span's stream tokens and target flags into row buffers; returns how many
        (L+1, fewer at the end of an evaluation pass) and the offsets where documents start
        (each piece starts one: pieces come from different chunk positions)."""
        at, cuts = 0, []
        for piece in self.pieces:
            n = len(piece.tokens)
            tokens[at : at + n] = piece.tokens
            trainable[at : at + n] = piece.flags()
            cuts += [np.array([at]), piece.doc_offsets + at]
            at += n
        return at, np.concatenate(cuts) if cuts else np.zeros(0, np.int64)

    def fill(self, row: Row) -> None:
        """Write the span into a batch row: inputs its first L tokens, targets its last L."""
        fill_spans({name: getattr(row, name)[None] for name in ROW_FIELDS}, [0], [self])

    @classmethod
    def fill_rows(cls, batch: Batch, rows: list[int], examples: Sequence[Example]) -> None:
        """All spans' rows at once (:func:`fill_spans`)."""
        fill_spans(batch, rows, examples)  # type: ignore[arg-type]

    def segments(self) -> list[Segment]:
        """A segment per document run; a document continued from the previous piece's chunk
        position keeps its segment."""
        found: list[Segment] = []
        offset, number, previous = 0, 0, None
        for piece in self.pieces:
            bounds = np.concatenate([[0], piece.doc_offsets, [len(piece.tokens)]]).tolist()
            for doc, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]), start=piece.first_doc):
                if a == b:   # a document without tokens here (only its start lies in the piece)
                    continue
                if (piece.position, doc) != previous:
                    number += 1
                    previous = (piece.position, doc)
                found.append(Segment(number, piece.chunk, doc, offset + a, offset + b,
                                     {"chunk_stream_start": piece.start + a, "chunk_stream_stop": piece.start + b}))
            offset += len(piece.tokens)
        return found


_scratch = threading.local()


def _buffer(name: str, shape: tuple[int, ...], dtype: type | np.dtype) -> np.ndarray:
    """A work array of this thread, reused from batch to batch (never handed out, so nobody can
    see it reused; fresh arrays of a batch's size cost page faults on every batch)."""
    found = getattr(_scratch, name, None)
    if found is None or found.shape != shape or found.dtype != dtype:
        found = np.empty(shape, dtype)
        setattr(_scratch, name, found)
    return found


def _gather(spans: list[Span], length: int, counts: np.ndarray) -> tuple[
        list[np.ndarray], list[np.ndarray | None], np.ndarray, np.ndarray]:
    """Each span's tokens and target flags (None: all targets) and where documents start in
    it (row, offset), for spans of any kind: slices of row groups of located sets, or written
    from their pieces (across row groups or chunks, or short at the end of an evaluation pass;
    their lengths go into ``counts``)."""
    n = len(spans)
    tokens: list[np.ndarray | None] = [None] * n
    flags: list[np.ndarray | None] = [None] * n
    cut_rows, cut_at = [], []
    located: dict[int, tuple[SpanSet, list[int], list[int]]] = {}
    rest = []
    for i, span in enumerate(spans):
        where = span.located
        if span.found is None and where is not None and where.group[span.index] >= 0:
            _, mine, at = located.setdefault(id(where), (where, [], []))
            mine.append(span.index)
            at.append(i)
        else:
            rest.append(i)
    for where, mine, at in located.values():   # spans inside a row group: slices of it
        which = np.asarray(mine, np.int64)
        views, trainable = where.tokens(which)
        for i, view, flag in zip(at, views, trainable or [None] * len(views)):
            tokens[i], flags[i] = view, flag
        k, offsets = where.cuts(which)
        cut_rows.append(np.asarray(at, np.int64)[k])
        cut_at.append(offsets)
    for i in rest:   # spans across row groups or chunks, or short (the end of an evaluation pass)
        row_tokens, row_flags = np.zeros(length + 1, np.int32), np.zeros(length + 1, bool)
        counts[i], cuts = spans[i].write(row_tokens, row_flags)
        tokens[i], flags[i] = row_tokens, row_flags
        cut_rows.append(np.full(len(cuts), i, np.int64))
        cut_at.append(cuts)
    return tokens, flags, np.concatenate(cut_rows), np.concatenate(cut_at)  # type: ignore[return-value]


def fill_spans(batch: dict[str, np.ndarray], rows: list[int], spans: Sequence[Span]) -> None:
    """Write concat spans into rows ``rows`` of ``batch`` at once: inputs are each span's
    first L tokens, targets the last L; tokens are gathered once into one array, and segments
    and masks computed for all rows together from where documents start
    (:func:`~lakeloader.index.ranges.cut_segments`). Each output field is written once."""
    if not spans:
        return
    index: slice | np.ndarray = np.asarray(rows)
    if rows == list(range(rows[0], rows[0] + len(rows))):
        index = slice(rows[0], rows[0] + len(rows))   # a block of rows: views, plain copies
    one = spans[0].located
    if one is not None and all(w.located is one and w.found is None for w in spans):
        which = np.array([w.index for w in spans], np.int64)
        if bool((one.group[which] >= 0).all()):
            fill_located(batch, index, one, which)
            return
    length = batch["input_ids"].shape[1]
    n = len(spans)
    counts = np.full(n, length + 1, np.int64)
    tokens, flags, cut_rows, cut_at = _gather(list(spans), length, counts)
    stacked, trainable = _stacked(tokens, flags, length)
    if counts.min() == length + 1:   # every span whole (training)
        _write_tokens(batch, index, stacked[:, :-1], stacked[:, 1:], None if trainable is None else trainable[:, 1:])
        _write_segments(batch, index, cut_rows, cut_at)
        return
    segment_ids, positions = np.empty((n, length), np.int32), np.empty((n, length), np.int32)
    cut_segments(cut_rows, cut_at, segment_ids, positions)
    valid = np.arange(length) < (counts - 1)[:, None]   # the short end of an evaluation pass
    fields = {"input_ids": np.where(valid, stacked[:, :-1], batch["input_ids"][index]),
              "targets": np.where(valid, stacked[:, 1:], batch["targets"][index]),
              "loss_mask": valid if trainable is None else valid & trainable[:, 1:],
              "segment_ids": np.where(valid, segment_ids, 0), "positions": np.where(valid, positions, 0)}
    for name, values in fields.items():
        if name in batch:   # (loader.fields)
            batch[name][index] = values


def _stacked(tokens: list[np.ndarray], flags: list[np.ndarray | None] | None, length: int) -> tuple[
        np.ndarray, np.ndarray | None]:
    """Spans of ``length + 1`` tokens as one [n, length + 1] array (this thread's work array)
    and their target flags (None for a span, or instead of the list: all targets) likewise:
    rows of equal length back to back, one concatenation each (np.stack costs more per row)."""
    dtype = np.result_type(*{t.dtype for t in tokens})
    stacked = _buffer(f"tokens_{dtype.str}", (len(tokens), length + 1), dtype)
    np.concatenate(tokens, out=stacked.reshape(-1))
    if flags is None or all(f is None for f in flags):
        return stacked, None
    return stacked, _stacked_flags(flags, len(tokens), length)


def fill_located(batch: dict[str, np.ndarray], index: slice | np.ndarray, located: SpanSet,
                 which: np.ndarray) -> None:
    """Write spans ``which`` of ``located``, each inside a row group (training spans, the
    common case), into rows ``index`` of ``batch``: slices of the row groups' renderings, with
    segments from their document starts."""
    _write_segments(batch, index, *_located_tokens(batch, index, located, which))


def _located_tokens(batch: dict[str, np.ndarray], index: slice | np.ndarray, located: SpanSet,
                    which: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`fill_located` but the segments: the tokens, targets and loss mask written, where
    documents start returned (row among ``index``, offset); consecutive spans of one row group
    (no shuffle) as one run of its tokens."""
    length = batch["input_ids"].shape[1]
    n = len(which)
    groups, at = located.group[which], located.at[which]
    if bool((groups == groups[0]).all()) and bool((at[1:] - at[:-1] == length).all()):
        # Consecutive spans: row i is the run's tokens [i*L, i*L + L] (rows overlap by a token),
        # so the inputs and the targets are each one slice of it.
        group, begin = located.groups[int(groups[0])], int(at[0])
        stop = begin + n * length + 1
        target_flags = None if group.trainable is None else group.trainable[begin + 1 : stop].reshape(n, length)
        _write_tokens(batch, index, group.tokens[begin : stop - 1].reshape(n, length),
                      group.tokens[begin + 1 : stop].reshape(n, length), target_flags)
        if not segment_fields(batch):
            return _NO_CUTS
        starts = group.doc_starts
        inside = starts[starts.searchsorted(begin, side="right") : starts.searchsorted(stop - 1, side="left")]
        return np.divmod(inside - begin, length)   # (offset 0: a row's own start)
    stacked, trainable = _stacked(*located.tokens(which), length)
    _write_tokens(batch, index, stacked[:, :-1], stacked[:, 1:], None if trainable is None else trainable[:, 1:])
    return located.cuts(which) if segment_fields(batch) else _NO_CUTS


_NO_CUTS = (np.zeros(0, np.int64), np.zeros(0, np.int64))   # (no segment fields: where documents start unasked)


def _stacked_flags(flags: list[np.ndarray | None], n: int, length: int) -> np.ndarray:
    """The spans' target flags (None: all targets) as one [n, length + 1] array."""
    ones = np.ones(length + 1, bool)
    trainable = _buffer("trainable", (n, length + 1), bool)
    np.concatenate([ones if f is None else f for f in flags], out=trainable.reshape(-1))
    return trainable


def _write_tokens(batch: dict[str, np.ndarray], index: slice | np.ndarray, inputs: np.ndarray, targets: np.ndarray,
                  target_flags: np.ndarray | None) -> None:
    """Rows ``index`` of ``batch`` from whole spans: their first L tokens (``inputs``), their
    last L (``targets``) and the targets' flags (None: all train)."""
    batch["input_ids"][index] = inputs
    batch["targets"][index] = targets
    if "loss_mask" in batch:
        batch["loss_mask"][index] = 1 if target_flags is None else target_flags


def _write_segments(batch: dict[str, np.ndarray], index: slice | np.ndarray, cut_rows: np.ndarray,
                    cut_at: np.ndarray) -> None:
    """Segment ids and positions of rows ``index`` of ``batch`` from where documents start (row
    ``cut_rows[i]`` among ``index``, offset ``cut_at[i]``); those of the two the batch has
    (``loader.fields``)."""
    wanted = segment_fields(batch)
    if not wanted:
        return
    if isinstance(index, slice):   # a block of rows: written straight into the batch
        out = {name: batch[name][index] for name in wanted}
    else:
        out = {name: np.empty((len(index), batch[name].shape[1]), np.int32) for name in wanted}
    cut_segments(cut_rows, cut_at, out.get("segment_ids"), out.get("positions"))
    if not isinstance(index, slice):
        for name in wanted:
            batch[name][index] = out[name]


class LocatedSpans(ExampleRun):
    """Training spans of one dataset located together in ``located`` (span ``k`` is
    ``located``'s ``k``): rows 0, 1, ... of a batch, filled at once."""

    def __init__(self, dataset: str, epochs: np.ndarray, examples: np.ndarray, located: SpanSet) -> None:
        super().__init__(dataset, epochs, examples)
        self.located = located

    def example(self, k: int, epoch: int, example: int) -> Span:
        """Span ``k`` as a :class:`Span`."""
        return Span(self.dataset, epoch, example, None, self.located, k)

    def fill_all(self, batch: Batch) -> None:
        """Every span into its row, the segments of all rows at once: the rows between two
        spans that do not lie inside a row group as runs (:func:`fill_located`), those (across
        row groups or chunks) from their pieces."""
        n = len(self)
        rows = slice(0, n)
        across = np.flatnonzero(self.located.group < 0)
        if not len(across):
            fill_located(batch, rows, self.located, np.arange(n))
            return
        # Without a shuffle about one batch in eight reaches the next row group: its other rows
        # are still two runs of consecutive spans, each written as one.
        cut_rows, cut_at = [], []
        bounds = [-1, *across.tolist(), n]
        for before, after in zip(bounds[:-1], bounds[1:]):
            if after - before > 1:
                run_rows, run_at = _located_tokens(batch, slice(before + 1, after), self.located,
                                                   np.arange(before + 1, after))
                cut_rows.append(run_rows + (before + 1))
                cut_at.append(run_at)
        length = batch["input_ids"].shape[1]
        tokens, flags, across_rows, across_at = _gather([self[k] for k in across.tolist()], length,
                                                        np.full(len(across), length + 1, np.int64))
        stacked, trainable = _stacked(tokens, flags, length)
        _write_tokens(batch, across, stacked[:, :-1], stacked[:, 1:], None if trainable is None else trainable[:, 1:])
        cut_rows.append(across[across_rows])
        cut_at.append(across_at)
        _write_segments(batch, rows, np.concatenate(cut_rows), np.concatenate(cut_at))
