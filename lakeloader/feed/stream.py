"""A dataset's example stream, assembled from three parts: its *order* (position -> epoch and
example, :mod:`lakeloader.feed.order`), a *locator* per packing (example -> where its pieces
lie: :mod:`lakeloader.feed.locate_spans`, :mod:`lakeloader.feed.locate_packed`) and the
examples' own *fill* (:meth:`~lakeloader.feed.rows.Example.fill`, ``fill_rows``), all over the
dataset's committed chunks, which may grow while the lake builds
(:mod:`lakeloader.feed.growing`). The strided ordering of concat spans orders and locates in
one step (:mod:`lakeloader.feed.strided_spans`) behind the same protocol."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from lakeloader.config import ShuffleConfig
from lakeloader.contracts.errors import LakeloaderError
from lakeloader.contracts.specs import PackingSpec, Template
from lakeloader.feed.growing import GrowingChunks
from lakeloader.feed.locate_packed import PackedLocator, require_plan
from lakeloader.feed.locate_spans import SpanLocator
from lakeloader.feed.order import ExampleOrder
from lakeloader.feed.rows import Example
from lakeloader.feed.strided_spans import StridedSpans
from lakeloader.index.growth import EpochSizes
from lakeloader.read.catalog_view import CatalogView, DatasetChunks
from lakeloader.read.chunks import ChunkFiles
from lakeloader.read.stream_reader import StreamReader


class Locator(Protocol):
    """The locate part: example -> where its pieces lie, over the committed prefix."""

    fills_whole_rows: bool          # a training example writes every position of its row
    plan_key: str | None            # the packing plan whose per-chunk counts it reads

    def available(self) -> int: ...
    def available_within(self, chunks: int) -> int: ...
    def chunk_starts(self) -> np.ndarray: ...
    def too_small(self) -> LakeloaderError: ...
    def eval_count(self) -> int: ...
    def eval_examples(self, js: np.ndarray) -> Sequence[Example]: ...
    def located(self, epochs: np.ndarray, examples: np.ndarray) -> Sequence[Example]: ...
    def block(self, epochs: np.ndarray, examples: np.ndarray, part_size: int
              ) -> Callable[[int, int], Sequence[Example]]: ...


class ExampleStream(Protocol):
    """What the loader asks of one dataset: its training examples at stream positions, its
    evaluation pass, and their counts."""

    name: str
    fills_whole_rows: bool
    plan_key: str | None

    @property
    def chunks(self) -> DatasetChunks: ...
    @property
    def fingerprint(self) -> str: ...
    def train_count(self) -> int: ...
    def eval_count(self) -> int: ...
    def follow_sizes(self, sizes: EpochSizes | None) -> None: ...
    def available_within(self, chunks: int) -> int: ...
    def train(self, positions: np.ndarray) -> Sequence[Example]: ...
    def train_block(self, positions: np.ndarray, part_size: int) -> Callable[[int, int], Sequence[Example]]: ...
    def eval(self, js: np.ndarray) -> Sequence[Example]: ...
    def close(self) -> None: ...


class DatasetStream:
    """A dataset's examples as its order and its locator give them."""

    def __init__(self, growing: GrowingChunks, order: ExampleOrder, locator: Locator, reader: StreamReader) -> None:
        self.name = growing.name
        self.growing = growing
        self.order = order
        self.locator = locator
        self.reader = reader
        self.fills_whole_rows = locator.fills_whole_rows
        self.plan_key = locator.plan_key

    @property
    def chunks(self) -> DatasetChunks:
        """The dataset's committed prefix."""
        return self.growing.chunks

    @property
    def fingerprint(self) -> str:
        """Fingerprint of the dataset's plan."""
        return self.growing.fingerprint

    def train_count(self) -> int:
        """Examples per training epoch (waits for the complete dataset)."""
        return self.order.train_count()

    def eval_count(self) -> int:
        """Examples of one evaluation pass (waits for the complete dataset)."""
        self.growing.complete()
        return self.locator.eval_count()

    def follow_sizes(self, sizes: EpochSizes | None) -> None:
        """Order the training stream over ``sizes``, the epochs of a dataset grown during the run
        (:meth:`~lakeloader.feed.order.ExampleOrder.follow_sizes`)."""
        self.order.follow_sizes(sizes)

    def available_within(self, chunks: int) -> int:
        """Training examples the first ``chunks`` chunks hold whole (waits for them)."""
        return self.order.available_within(chunks)

    def train(self, positions: np.ndarray) -> Sequence[Example]:
        """The examples at training stream positions ``positions``, located together."""
        return self.locator.located(*self.order.train_examples(positions))

    def train_block(self, positions: np.ndarray, part_size: int) -> Callable[[int, int], Sequence[Example]]:
        """``part(a, b)``: :meth:`train` of ``positions[a:b]``, for parts asked one by one (a
        loader's next steps: ``a`` and ``b`` multiples of ``part_size``); what can be located for
        all positions at once is located here, up front."""
        return self.locator.block(*self.order.train_examples(positions), part_size)

    def eval(self, js: np.ndarray) -> Sequence[Example]:
        """Examples ``js`` of the evaluation pass, in order (waits for the complete dataset)."""
        self.growing.complete()
        return self.locator.eval_examples(js)

    def close(self) -> None:
        """Stop the reader's decoding ahead."""
        self.reader.close()


def dataset_stream(name: str, view: CatalogView, files: ChunkFiles, template: Template, spec: PackingSpec | None, *,
                   seq_len: int, ordering: str, ideal_readers: int, shuffle: ShuffleConfig, seed: int,
                   wait_timeout: float, seq2seq: bool, pad_id: int) -> ExampleStream:
    """The example stream of dataset ``name``: spans (``spec`` None: concat) in the global or
    strided ``ordering``, or packed examples under ``spec``; ``shuffle`` applies to the global
    ordering (the loader's settings checked the combination)."""
    reader = StreamReader(view, files, template, scattered=shuffle.kind == "full",
                          sequential=shuffle.kind == "none" and ordering == "global")
    if spec is not None:
        require_plan(view, name, spec)
    growing = GrowingChunks(name, view, wait_timeout, None if spec is None else spec.plan_key, template.counts_parts)
    locator: Locator
    if spec is None:
        spans = SpanLocator(growing, reader, seq_len)
        if ordering == "strided":
            return StridedSpans(growing, spans, ideal_readers)
        locator = spans
    else:
        locator = PackedLocator(growing, reader, spec, seq2seq=seq2seq, pad_id=pad_id)
    return DatasetStream(growing, ExampleOrder(growing, locator, shuffle, seed, files.cache), locator, reader)
