"""The order part of a dataset's example stream: position ``j`` of its cycled training stream ->
(epoch, example), under the configured shuffle (none, window, block or full), over a count of
examples that may still grow while the lake builds, or over the epochs of a dataset whose plan
grew during the run (:mod:`lakeloader.index.growth`)."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from lakeloader.config import ShuffleConfig
from lakeloader.contracts.errors import LakeloaderError
from lakeloader.feed.growing import GrowingChunks
from lakeloader.index.growth import EpochSizes
from lakeloader.index.permutation import derive_key
from lakeloader.index.shuffle import shuffle_block, shuffle_full, shuffle_none, shuffle_window
from lakeloader.read.catalog_view import DatasetChunks
from lakeloader.read.lru import LRU

SHUFFLE_BLOCK = 4096   # training positions shuffled (and cached) together


class ExampleCounts(Protocol):
    """What an order needs to know of a dataset's examples (its locator knows it)."""

    def available(self) -> int:
        """Training examples the committed prefix holds whole."""

    def chunk_starts(self) -> np.ndarray:
        """int64 [committed + 1]: the first example starting at or after each chunk boundary
        of the committed prefix (an example belongs to the chunk where it starts)."""

    def available_within(self, chunks: int) -> int:
        """Training examples the first ``chunks`` chunks of the committed prefix hold whole."""

    def too_small(self) -> LakeloaderError:
        """The error for a complete dataset with no training example."""


class ExampleOrder:
    """Training positions of a dataset mapped to its examples: index arithmetic only, waiting
    while the dataset builds only when the committed prefix cannot fix a position yet. Every
    epoch has its own order (the epoch is folded into the shuffles' keys)."""

    def __init__(self, growing: GrowingChunks, counts: ExampleCounts, shuffle: ShuffleConfig, seed: int,
                 cache: LRU) -> None:
        """``cache``: where blocks of shuffled positions are kept (the reader's LRU)."""
        self.growing = growing
        self.counts = counts
        self.shuffle = shuffle
        self.key = derive_key(seed, "shuffle", growing.name)
        self.cache = cache
        self._shuffle_id = repr(shuffle)
        self._epoch_windows: tuple[DatasetChunks, np.ndarray] | None = None   # (of a complete dataset)
        self.sizes: EpochSizes | None = None   # the epochs of a dataset grown during the run

    def follow_sizes(self, sizes: EpochSizes | None) -> None:
        """Order the positions over ``sizes``, the epochs of a dataset whose plan grew during the
        run (None: every epoch has all the dataset's examples)."""
        self.sizes = sizes

    def train_count(self) -> int:
        """Examples per epoch in training (waits for the complete dataset); for a dataset grown
        during the run, of its latest epochs."""
        self.growing.complete()
        return self.counts.available()

    def available_within(self, chunks: int) -> int:
        """Training examples the dataset's first ``chunks`` chunks hold whole (waits for them)."""
        while self.growing.chunks.committed < chunks:
            self.growing.wait()
        return self.counts.available_within(chunks)

    def train_example(self, j: int) -> tuple[int, int]:
        """(epoch, example) at position ``j`` of the cycled, shuffled training stream."""
        epochs, examples = self.train_examples(np.array([j]))
        return int(epochs[0]), int(examples[0])

    def train_examples(self, js: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`train_example` of many positions: one vectorized shuffle once complete; while
        building, each position waits until the committed prefix fixes it."""
        js = np.asarray(js, np.int64)
        if self.sizes is not None:
            return self._grown_examples(js, self.sizes)
        if not self.growing.chunks.complete:
            found = [self._train_example_while_building(int(j)) for j in js]
            return np.array([e for e, _ in found], np.int64), np.array([k for _, k in found], np.int64)
        per_epoch = self.counts.available()
        if per_epoch == 0:
            raise self.counts.too_small()
        return js // per_epoch, self._shuffled_blocks(js, per_epoch)

    def _grown_examples(self, js: np.ndarray, sizes: EpochSizes) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`train_examples` over the epochs of a grown dataset (it waits for the complete
        dataset), each aligned block of ``SHUFFLE_BLOCK`` positions computed at once and cached."""
        self.growing.complete()
        if self.counts.available() != sizes.examples:
            raise LakeloaderError(
                f"dataset {self.growing.name!r} has {self.counts.available()} examples, but the run recorded "
                f"{sizes.examples} when it took its grown plan up: the lake's plan of it is not the run's; "
                "restore with the lake the state was saved with")
        blocks = js // SHUFFLE_BLOCK
        epochs, examples = np.empty(len(js), np.int64), np.empty(len(js), np.int64)
        for block in np.unique(blocks).tolist():
            mine = blocks == block
            key = ("grown", self.growing.name, self.growing.fingerprint, self._shuffle_id, self.key, sizes, block)
            found = self.cache.get(key, lambda block=block: self._grown_block(block, sizes))
            epochs[mine], examples[mine] = (a[js[mine] - block * SHUFFLE_BLOCK] for a in found)
        return epochs, examples

    def _grown_block(self, block: int, sizes: EpochSizes) -> tuple[np.ndarray, np.ndarray]:
        """(epoch, example) of positions ``[block * SHUFFLE_BLOCK, (block + 1) * SHUFFLE_BLOCK)``
        of a grown dataset: the first part of each epoch ordered as an epoch of its size, the new
        examples of a growth epoch as one of theirs, keyed by where they start."""
        parts = sizes.locate(np.arange(block * SHUFFLE_BLOCK, (block + 1) * SHUFFLE_BLOCK, dtype=np.int64))
        examples = np.empty(SHUFFLE_BLOCK, np.int64)
        chunk_starts = self.counts.chunk_starts()
        for lo, hi in np.unique(np.stack([parts.lo, parts.hi]), axis=1).T.tolist():
            mine = (parts.lo == lo) & (parts.hi == hi)
            size = hi - lo
            positions = parts.epoch[mine] * size + parts.offset[mine]
            if lo == 0:   # an epoch's examples as it had planned them
                starts = np.minimum(chunk_starts[:: self.shuffle.window_chunks], size)
                examples[mine] = self._shuffled(positions, size, starts, self.key)
                continue
            first, end = int(parts.first_chunk[mine][0]), int(parts.end_chunk[mine][0])
            starts = np.clip(chunk_starts[first : end + 1 : self.shuffle.window_chunks] - lo, 0, size)
            starts[0] = 0
            examples[mine] = lo + self._shuffled(positions, size, starts, derive_key(self.key, "growth", lo))
        return parts.epoch, examples

    def _window_starts(self, chunk_limit: int) -> np.ndarray:
        """First example of each window of ``shuffle.window_chunks`` chunks among the first
        ``chunk_limit`` chunks."""
        return self.counts.chunk_starts()[: chunk_limit + 1 : self.shuffle.window_chunks]

    def _shuffled(self, positions: np.ndarray, per_epoch: int, starts: np.ndarray | None = None,
                  key: int | None = None) -> np.ndarray:
        """Example of each stream position under the configured shuffle (epoch folded in)."""
        kind, key = self.shuffle.kind, self.key if key is None else key
        if kind == "none":
            return shuffle_none(positions, per_epoch)
        if kind == "full":
            return shuffle_full(positions, per_epoch, key)
        if kind == "block":
            return shuffle_block(positions, per_epoch, self.shuffle.block_size, self.shuffle.window_blocks, key)
        if starts is None:
            chunks = self.growing.chunks
            if self._epoch_windows is None or self._epoch_windows[0] is not chunks:
                self._epoch_windows = (chunks, np.minimum(self._window_starts(chunks.committed), per_epoch))
            starts = self._epoch_windows[1]
        return shuffle_window(positions, starts, per_epoch, key)

    def _position_while_building(self, j: int) -> int | None:
        """Example at position ``j`` of epoch 0 if the committed prefix already fixes it."""
        kind = self.shuffle.kind
        if kind == "none":
            return j
        if kind != "window":
            return None  # block and full shuffles need the whole dataset
        # Windows whose chunks and the next window's first chunk are committed are final.
        windows = (self.growing.chunks.committed - 1) // self.shuffle.window_chunks
        if windows < 1:
            return None
        starts = self._window_starts(windows * self.shuffle.window_chunks)
        # ... and only up to the examples the prefix holds whole: the epoch's size N is known to
        # be at least that many, while a window's end may lie past it (the chunks after it hold
        # less than one example: filtered datasets' last chunks, often none). Complete, that
        # window ends at N and position N is the next epoch's; taken as final now, position N
        # would be the first epoch's and the window permuted at another size.
        starts = starts[: int(np.searchsorted(starts, self.counts.available(), side="right"))]
        if len(starts) < 2 or j >= starts[-1]:
            return None
        return int(self._shuffled(np.array([j]), int(starts[-1]), starts[:-1])[0])

    def _train_example_while_building(self, j: int) -> tuple[int, int]:
        while not self.growing.chunks.complete:
            k = self._position_while_building(j)
            if k is not None and k < self.counts.available():
                return 0, k   # fixed by the committed prefix: necessarily epoch 0
            self.growing.wait()
        epochs, examples = self.train_examples(np.array([j]))
        return int(epochs[0]), int(examples[0])

    def _shuffled_blocks(self, positions: np.ndarray, per_epoch: int) -> np.ndarray:
        """:meth:`_shuffled` of a complete dataset's positions, each aligned block of
        ``SHUFFLE_BLOCK`` positions computed at once and cached: a keyed permutation costs per
        call (its cycle-walking rounds), far less per position."""
        if self.shuffle.kind == "none":
            return self._shuffled(positions, per_epoch)
        blocks = positions // SHUFFLE_BLOCK
        if len(blocks) and bool((blocks == blocks[0]).all()):   # (a batch's positions, but one in 64)
            block = int(blocks[0])
            return self._shuffled_block(block, per_epoch)[positions - block * SHUFFLE_BLOCK]
        out = np.empty(len(positions), np.int64)
        for block in np.unique(blocks).tolist():
            mine = blocks == block
            out[mine] = self._shuffled_block(block, per_epoch)[positions[mine] - block * SHUFFLE_BLOCK]
        return out

    def _shuffled_block(self, block: int, per_epoch: int) -> np.ndarray:
        """:meth:`_shuffled` of positions ``[block * SHUFFLE_BLOCK, (block + 1) * SHUFFLE_BLOCK)``
        (cached)."""
        key = ("shuffled", self.growing.name, self.growing.fingerprint, self._shuffle_id, self.key, per_epoch, block)
        return self.cache.get(key, lambda: self._shuffled(
            np.arange(block * SHUFFLE_BLOCK, (block + 1) * SHUFFLE_BLOCK, dtype=np.int64), per_epoch))
