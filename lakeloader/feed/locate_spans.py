"""The locate part of ``packing: concat``: example ``k`` of a dataset is the span of stream
tokens ``[kL, kL + L]`` of its rendered stream (chunks in their global order); this finds where
spans lie in the chunks' row groups, without reading a token."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from lakeloader.contracts.errors import LakeloaderError
from lakeloader.feed.growing import GrowingChunks
from lakeloader.feed.rows import Example
from lakeloader.feed.spans import LocatedSpans, Span
from lakeloader.index.ranges import cumulative, eval_examples, train_examples
from lakeloader.read.catalog_view import DatasetChunks
from lakeloader.read.stream_reader import StreamReader


class SpanLocator:
    """Where each span of a dataset lies, over its committed prefix (the counts follow the
    prefix as it grows); the spans it returns fill their rows themselves
    (:mod:`lakeloader.feed.spans`)."""

    fills_whole_rows = True   # a training span writes every position of its row (no padding)
    plan_key = None           # (spans need no packing plan)

    def __init__(self, growing: GrowingChunks, reader: StreamReader, seq_len: int) -> None:
        self.growing = growing
        self.reader = reader
        self.seq_len = seq_len
        self._counts: tuple[DatasetChunks, np.ndarray, np.ndarray, np.ndarray] | None = None

    def _counted(self) -> tuple[DatasetChunks, np.ndarray, np.ndarray, np.ndarray]:
        """The committed chunks, their order (chunk ``c`` is the ``c``-th), cumulative stream
        tokens and the first span of each chunk, recounted when the prefix grew."""
        chunks = self.growing.chunks
        if self._counts is None or self._counts[0] is not chunks:
            offsets = cumulative(self.reader.chunk_lengths(chunks))
            self._counts = (chunks, np.arange(chunks.committed), offsets, -(-offsets // self.seq_len))
        return self._counts

    def stream_offsets(self) -> np.ndarray:
        """int64 [committed + 1]: where each committed chunk starts in the dataset's stream."""
        return self._counted()[2]

    def available(self) -> int:
        """Training spans the committed prefix holds whole."""
        return train_examples(int(self.stream_offsets()[-1]), self.seq_len)

    def available_within(self, chunks: int) -> int:
        """Training spans the first ``chunks`` committed chunks hold whole."""
        return train_examples(int(self.stream_offsets()[chunks]), self.seq_len)

    def chunk_starts(self) -> np.ndarray:
        """The first span starting at or after each chunk boundary."""
        return self._counted()[3]

    def too_small(self) -> LakeloaderError:
        """The error for a dataset with fewer stream tokens than one span."""
        return LakeloaderError(
            f"dataset {self.growing.name!r} has {int(self.stream_offsets()[-1])} stream tokens, fewer than one "
            f"example of seq_len {self.seq_len} + 1: lower loader.seq_len or add data")

    def eval_count(self) -> int:
        """Spans of one evaluation pass: every target token once, the last span short (needs
        the complete dataset)."""
        return eval_examples(int(self.stream_offsets()[-1]), self.seq_len)

    def located(self, epochs: np.ndarray, examples: np.ndarray) -> LocatedSpans:
        """Spans ``examples`` (of epochs ``epochs``), located together."""
        chunks, sequence, offsets, _ = self._counted()
        found = self.reader.spans(chunks, sequence, offsets, examples * self.seq_len, self.seq_len + 1)
        return LocatedSpans(self.growing.name, epochs, examples, found)

    def block(self, epochs: np.ndarray, examples: np.ndarray, part_size: int
              ) -> Callable[[int, int], Sequence[Example]]:
        """``part(a, b)``: :meth:`located` of examples ``a`` to ``b`` (spans cost nothing to
        locate ahead: each part locates its own)."""
        return lambda a, b: self.located(epochs[a:b], examples[a:b])

    def eval_examples(self, js: np.ndarray) -> list[Span]:
        """Spans ``js`` of the evaluation pass: the whole ones located together, the short last
        one (stream tokens ``[jL, end]``) alone."""
        chunks, sequence, offsets, _ = self._counted()
        total = int(offsets[-1])
        js = np.asarray(js, np.int64)
        whole = js * self.seq_len + self.seq_len + 1 <= total
        found: list[Span | None] = [None] * len(js)
        if whole.any():
            mine = np.flatnonzero(whole)
            for n, span in zip(mine.tolist(), self.located(np.zeros(len(mine), np.int64), js[mine])):
                found[n] = span
        for n in np.flatnonzero(~whole).tolist():
            start = int(js[n]) * self.seq_len
            pieces = self.reader.span(chunks, sequence, offsets, start, min(self.seq_len + 1, total - start))
            found[n] = Span(self.growing.name, 0, int(js[n]), pieces)
        return found  # type: ignore[return-value]
