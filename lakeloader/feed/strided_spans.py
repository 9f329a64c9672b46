"""The strided ordering of ``packing: concat`` (``loader.ordering: strided``): global example
``i`` is example ``i // R`` of ideal reader ``i % R`` (``R = loader.ideal_readers``), each
ideal reader looping over every ``R``-th chunk of the dataset. Its order is a chunk sequence per
reader, so ordering and locating are one step here; the spans are those of
:class:`~lakeloader.feed.locate_spans.SpanLocator`, which also counts them."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from lakeloader.feed.growing import GrowingChunks
from lakeloader.feed.locate_spans import SpanLocator
from lakeloader.feed.rows import Example
from lakeloader.feed.spans import Span
from lakeloader.index.growth import EpochSizes
from lakeloader.index.ranges import cumulative, strided_chunk
from lakeloader.read.catalog_view import DatasetChunks


class StridedSpans:
    """Training spans of one dataset in the strided ordering: an example stream
    (:class:`~lakeloader.feed.stream.ExampleStream`) of its own, working on the committed prefix
    while the dataset builds and waiting only for a chunk an example needs."""

    fills_whole_rows = True

    def __init__(self, growing: GrowingChunks, locator: SpanLocator, ideal_readers: int) -> None:
        self.growing = growing
        self.locator = locator
        self.reader = locator.reader
        self.ideal_readers = ideal_readers
        self.name = growing.name
        self.plan_key = None
        self._periods: tuple[DatasetChunks, dict[int, tuple[np.ndarray, np.ndarray]]] | None = None

    @property
    def chunks(self) -> DatasetChunks:
        """The dataset's committed prefix."""
        return self.growing.chunks

    @property
    def fingerprint(self) -> str:
        """Fingerprint of the dataset's plan."""
        return self.growing.fingerprint

    def train_count(self) -> int:
        """Spans per epoch (waits for the complete dataset)."""
        self.growing.complete()
        return self.locator.available()

    def eval_count(self) -> int:
        """Spans of an evaluation pass (evaluation reads in the global order)."""
        self.growing.complete()
        return self.locator.eval_count()

    def follow_sizes(self, sizes: EpochSizes | None) -> None:
        """Only None: a run over a dataset grown during it is refused under this ordering (each
        ideal reader loops over its own chunks; ``Loader.follow`` says so)."""
        if sizes is not None:
            raise AssertionError(f"dataset {self.name!r}: the strided ordering cannot follow a grown dataset")

    def available_within(self, chunks: int) -> int:
        """Training spans the first ``chunks`` chunks hold whole (waits for them)."""
        while self.growing.chunks.committed < chunks:
            self.growing.wait()
        return self.locator.available_within(chunks)

    def eval(self, js: np.ndarray) -> Sequence[Example]:
        """Spans ``js`` of the evaluation pass (in the global order, as every evaluation)."""
        self.growing.complete()
        return self.locator.eval_examples(js)

    def train_block(self, ids: np.ndarray, part_size: int) -> Callable[[int, int], Sequence[Example]]:
        """``part(a, b)``: :meth:`train` of ``ids[a:b]``."""
        return lambda a, b: self.train(ids[a:b])

    def close(self) -> None:
        """Stop the reader's decoding ahead."""
        self.reader.close()

    def _period(self, reader: int) -> tuple[np.ndarray, np.ndarray]:
        """Chunks and cumulative stream offsets of one period of ideal reader ``reader``'s
        looped chunk sequence (complete datasets only)."""
        chunks = self.growing.chunks
        if self._periods is None or self._periods[0] is not chunks:
            self._periods = (chunks, {})
        periods = self._periods[1]
        if reader not in periods:
            count = chunks.committed
            period = count // math.gcd(count, self.ideal_readers)
            positions = strided_chunk(np.full(period, reader), np.arange(period), self.ideal_readers)
            looped = positions % count
            lengths = np.diff(self.locator.stream_offsets())[looped]
            periods[reader] = (looped, cumulative(lengths))
        return periods[reader]

    def _span_while_building(self, i: int) -> Span | None:
        """Span of global example ``i`` from the committed prefix (waiting for chunks as
        needed); None once the dataset is complete."""
        reader, k = int(i % self.ideal_readers), int(i // self.ideal_readers)
        seq_len = self.locator.seq_len
        start, length = k * seq_len, seq_len + 1
        while not self.growing.chunks.complete:
            chunks = self.growing.chunks
            positions = np.arange(reader, chunks.committed, self.ideal_readers)
            offsets = cumulative(np.diff(self.locator.stream_offsets())[positions])
            if start + length <= offsets[-1]:
                return Span(self.name, 0, k, self.reader.span(chunks, positions, offsets, start, length))
            self.growing.wait()
        return None

    def train(self, ids: np.ndarray) -> list[Span]:
        """Spans of global examples ``ids``: each ideal reader's looped chunk sequence, read in
        one batch per reader once the dataset is complete."""
        building = not self.growing.chunks.complete
        found = [self._span_while_building(int(i)) for i in ids] if building else [None] * len(ids)
        rest = np.array([n for n, span in enumerate(found) if span is None], np.int64)
        ids = np.asarray(ids, np.int64)[rest]
        readers, ks = ids % self.ideal_readers, ids // self.ideal_readers
        seq_len = self.locator.seq_len
        length = seq_len + 1
        chunks = self.growing.chunks
        for reader in np.unique(readers).tolist():
            mine = np.flatnonzero(readers == reader)
            looped, offsets = self._period(reader)
            total = int(offsets[-1])
            if total == 0:
                raise self.locator.too_small()
            cycles, starts = np.divmod(ks[mine] * seq_len, total)
            repeats = 1 + math.ceil((int(starts.max()) + length) / total)
            sequence = np.tile(looped, repeats)
            sequence_offsets = cumulative(np.tile(np.diff(offsets), repeats))
            located = self.reader.spans(chunks, sequence, sequence_offsets, starts, length)
            epochs = strided_chunk(reader, cycles * len(looped) + located.position, self.ideal_readers) // chunks.committed
            for i, (n, k, epoch) in enumerate(zip(rest[mine].tolist(), ks[mine].tolist(), epochs.tolist())):
                found[n] = Span(self.name, epoch, k, None, located, i)
        return found  # type: ignore[return-value]
