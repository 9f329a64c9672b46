"""Examples of one dataset (packing: concat): index maps from example number to token windows."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from lakeloader.config import ShuffleConfig
from lakeloader.errors import LakeloaderError
from lakeloader.index.concat import cumulative, eval_examples, stream_lengths, strided_chunk, train_examples
from lakeloader.index.permutation import derive_key
from lakeloader.index.shuffle import shuffle_block, shuffle_full, shuffle_none, shuffle_window
from lakeloader.read.catalog_view import CatalogView, DatasetChunks
from lakeloader.read.windows import Piece, StreamReader


@dataclasses.dataclass
class Window:
    """One example's L+1 stream tokens (fewer at the end of an evaluation pass) and provenance."""

    dataset: str
    epoch: int
    example: int            # example number within the dataset's epoch (or ideal reader stream)
    pieces: list[Piece]

    @property
    def tokens(self) -> np.ndarray:
        return np.concatenate([p.tokens for p in self.pieces]) if self.pieces else np.zeros(0, np.int32)

    @property
    def doc_keys(self) -> np.ndarray:
        """A key per token identifying its document occurrence (equal keys = same document)."""
        if not self.pieces:
            return np.zeros(0, np.int64)
        return np.concatenate([(np.int64(p.position) << 32) + p.docs for p in self.pieces])


class DatasetExamples:
    """Example ``j`` of a dataset -> its token window, for the global or strided ordering.

    Works on the committed prefix while the dataset is being built, waiting (with a timeout)
    only when an example needs a chunk that is not committed yet.
    """

    def __init__(self, name: str, view: CatalogView, reader: StreamReader, *, seq_len: int,
                 ordering: str, ideal_readers: int, wait_timeout: float,
                 shuffle: ShuffleConfig | None = None, seed: int = 0) -> None:
        self.name = name
        self.shuffle = shuffle or ShuffleConfig()
        self.shuffle_key = derive_key(seed, "shuffle", name)
        self.view = view
        self.reader = reader
        self.seq_len = seq_len
        self.ordering = ordering
        self.ideal_readers = ideal_readers
        self.wait_timeout = wait_timeout
        self._set(view.dataset(name))

    def _set(self, chunks: DatasetChunks) -> None:
        self.chunks = chunks
        self.offsets = cumulative(stream_lengths(chunks.num_tokens, chunks.num_docs, self.reader.specials.count))
        self.sequence = np.arange(chunks.committed)  # the global order: chunk c is the c-th
        self._periods: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._epoch_window_starts: np.ndarray | None = None

    def _wait(self) -> None:
        """Wait for the next chunk of the committed prefix (or for the dataset to be complete)."""
        if self.chunks.complete:
            raise AssertionError("complete datasets never wait")
        self._set(self.view.wait_for(self.name, self.chunks.committed, self.wait_timeout))

    def _too_small(self) -> LakeloaderError:
        return LakeloaderError(
            f"dataset {self.name!r} has {int(self.offsets[-1])} stream tokens, fewer than one example "
            f"of seq_len {self.seq_len} + 1: lower loader.seq_len or add data"
        )

    @property
    def fingerprint(self) -> str:
        return self.chunks.fingerprint

    def complete_chunks(self) -> DatasetChunks:
        """The dataset once every chunk is committed (waits for the build if needed)."""
        while not self.chunks.complete:
            self._set(self.view.wait_for(self.name, self.chunks.planned - 1, self.wait_timeout))
        return self.chunks

    def eval_count(self) -> int:
        """Examples in one evaluation pass (needs the complete dataset)."""
        self.complete_chunks()
        return eval_examples(int(self.offsets[-1]), self.seq_len)

    def train_count(self) -> int:
        """Examples per epoch in training (needs the complete dataset)."""
        self.complete_chunks()
        return train_examples(int(self.offsets[-1]), self.seq_len)

    def eval_window(self, j: int) -> Window:
        """Example ``j`` of the evaluation pass: stream tokens [jL, jL+L] clipped at the end."""
        self.complete_chunks()
        total = int(self.offsets[-1])
        start = j * self.seq_len
        length = min(self.seq_len + 1, total - start)
        pieces = self.reader.window(self.chunks, self.sequence, self.offsets, start, length)
        return Window(self.name, 0, j, pieces)

    def _window_starts(self, chunk_limit: int) -> np.ndarray:
        """First example of each window of ``shuffle.window_chunks`` chunks among the first
        ``chunk_limit`` chunks (an example belongs to the window where it starts)."""
        boundaries = self.offsets[: chunk_limit + 1 : self.shuffle.window_chunks]
        return -(-boundaries // self.seq_len)

    def _shuffled(self, positions: np.ndarray, per_epoch: int, starts: np.ndarray | None = None) -> np.ndarray:
        """Example of each stream position under the configured shuffle (epoch folded in)."""
        kind, key = self.shuffle.kind, self.shuffle_key
        if kind == "none":
            return shuffle_none(positions, per_epoch)
        if kind == "full":
            return shuffle_full(positions, per_epoch, key)
        if kind == "block":
            return shuffle_block(positions, per_epoch, self.shuffle.block_size, self.shuffle.window_blocks, key)
        if starts is None:
            if self._epoch_window_starts is None:  # fixed once the dataset is complete
                self._epoch_window_starts = np.minimum(self._window_starts(self.chunks.committed), per_epoch)
            starts = self._epoch_window_starts
        return shuffle_window(positions, starts, per_epoch, key)

    def _position_while_building(self, j: int) -> int | None:
        """Example at position ``j`` of epoch 0 if the committed prefix already fixes it."""
        kind = self.shuffle.kind
        if kind == "none":
            return j
        if kind != "window":
            return None  # block and full shuffles need the whole dataset
        # Windows whose chunks and the next window's first chunk are committed are final.
        windows = (self.chunks.committed - 1) // self.shuffle.window_chunks
        if windows < 1:
            return None
        starts = self._window_starts(windows * self.shuffle.window_chunks)
        if j >= starts[-1]:
            return None
        return int(self._shuffled(np.array([j]), int(starts[-1]), starts[:-1])[0])

    def train_example(self, j: int) -> tuple[int, int]:
        """(epoch, example) at position ``j`` of the cycled, shuffled training stream (global
        ordering): index arithmetic only, waiting while building only if the prefix can't fix it."""
        length = self.seq_len + 1
        while True:
            if self.chunks.complete:
                per_epoch = train_examples(int(self.offsets[-1]), self.seq_len)
                if per_epoch == 0:
                    raise self._too_small()
                epoch, k = j // per_epoch, int(self._shuffled(np.array([j]), per_epoch)[0])
                break
            k = self._position_while_building(j)
            if k is not None and k * self.seq_len + length <= self.offsets[-1]:
                epoch = 0  # fixed by the committed prefix: necessarily epoch 0
                break
            self._wait()
        return epoch, k

    def train_window(self, j: int) -> Window:
        """Example ``j`` of the cycled training stream (shuffled per epoch if configured)."""
        if self.ordering == "strided":
            return self._strided_window(j)
        epoch, k = self.train_example(j)
        pieces = self.reader.window(self.chunks, self.sequence, self.offsets,
                                    k * self.seq_len, self.seq_len + 1)
        return Window(self.name, epoch, k, pieces)

    def _period(self, reader: int) -> tuple[np.ndarray, np.ndarray]:
        """Chunks and cumulative stream offsets of one period of ideal reader ``reader``'s
        looped chunk sequence (complete datasets only)."""
        if reader not in self._periods:
            count = self.chunks.committed
            period = count // math.gcd(count, self.ideal_readers)
            positions = strided_chunk(np.full(period, reader), np.arange(period), self.ideal_readers)
            chunks = positions % count
            lengths = np.diff(self.offsets)[chunks]
            self._periods[reader] = (chunks, cumulative(lengths))
        return self._periods[reader]

    def _strided_window(self, i: int) -> Window:
        reader, k = int(i % self.ideal_readers), int(i // self.ideal_readers)
        start, length = k * self.seq_len, self.seq_len + 1
        while not self.chunks.complete:
            positions = np.arange(reader, self.chunks.committed, self.ideal_readers)
            offsets = cumulative(np.diff(self.offsets)[positions])
            if start + length <= offsets[-1]:
                pieces = self.reader.window(self.chunks, positions, offsets, start, length)
                return Window(self.name, 0, k, pieces)
            self._wait()
        chunks, offsets = self._period(reader)
        total = int(offsets[-1])
        if total == 0:
            raise self._too_small()
        cycles, start_in_period = divmod(start, total)
        repeats = 1 + math.ceil((start_in_period + length) / total)
        sequence = np.tile(chunks, repeats)
        sequence_offsets = cumulative(np.tile(np.diff(offsets), repeats))
        pieces = self.reader.window(self.chunks, sequence, sequence_offsets, start_in_period, length)
        period = len(chunks)
        looped = [strided_chunk(reader, cycles * period + p.position, self.ideal_readers) for p in pieces]
        epoch = int(looped[0] // self.chunks.committed) if looped else 0
        return Window(self.name, epoch, k, pieces)
