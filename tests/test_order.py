"""The order part alone (``feed/order.py``), without a lake: a growing dataset is a list of
per-chunk example counts that gains a chunk each time the order waits.

Against plain references: once complete, every position maps to the epoch ``j // N`` and the
example the index-level shuffle gives (``index/shuffle.py``), cached blocks or not; and while the
dataset grows, every answer the order gives early (the committed prefix fixed it) is the answer
it gives once complete: a reader started during the build reads what a reader after it reads.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from lakeloader.config import ShuffleConfig
from lakeloader.contracts.errors import LakeloaderError
from lakeloader.feed.order import SHUFFLE_BLOCK, ExampleOrder
from lakeloader.index.permutation import derive_key
from lakeloader.index.shuffle import shuffle_block, shuffle_full, shuffle_none, shuffle_window
from lakeloader.read.lru import LRU

SEED = 5


@dataclasses.dataclass(frozen=True)
class Prefix:
    """What an order reads of a dataset's committed prefix."""

    committed: int
    complete: bool
    fingerprint: str = "f"


class GrowingCounts:
    """A dataset of ``counts[c]`` examples in chunk ``c``, committed ``start`` chunks at first and
    one more each time a reader waits: both the growing chunks and the example counts an order
    reads (the two protocols of ``ExampleOrder``)."""

    name = "d"
    fingerprint = "f"

    def __init__(self, counts: list[int], start: int) -> None:
        self.all = counts
        self.chunks = Prefix(start, start == len(counts))
        self.waits = 0

    def wait(self) -> None:
        assert not self.chunks.complete
        self.waits += 1
        committed = self.chunks.committed + 1
        self.chunks = Prefix(committed, committed == len(self.all))

    def complete(self) -> Prefix:
        while not self.chunks.complete:
            self.wait()
        return self.chunks

    def chunk_starts(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.all[: self.chunks.committed])]).astype(np.int64)

    def available(self) -> int:
        return int(self.chunk_starts()[-1])

    def too_small(self) -> LakeloaderError:
        return LakeloaderError("no examples")


def order_of(counts: list[int], start: int, shuffle: ShuffleConfig) -> tuple[ExampleOrder, GrowingCounts]:
    growing = GrowingCounts(counts, start)
    return ExampleOrder(growing, growing, shuffle, SEED, LRU(16)), growing  # type: ignore[arg-type]


def plain(positions: np.ndarray, counts: list[int], shuffle: ShuffleConfig) -> tuple[np.ndarray, np.ndarray]:
    """The reference: (epoch, example) of each position of the complete dataset, straight from
    the index-level shuffles (windows: every ``window_chunks``-th chunk boundary)."""
    n = int(sum(counts))
    key = derive_key(SEED, "shuffle", "d")
    if shuffle.kind == "none":
        examples = shuffle_none(positions, n)
    elif shuffle.kind == "full":
        examples = shuffle_full(positions, n, key)
    elif shuffle.kind == "block":
        examples = shuffle_block(positions, n, shuffle.block_size, shuffle.window_blocks, key)
    else:
        starts = np.concatenate([[0], np.cumsum(counts)])[:: shuffle.window_chunks]
        examples = shuffle_window(positions, np.minimum(starts, n), n, key)
    return positions // n, examples


SHUFFLES = st.sampled_from([
    ShuffleConfig(kind="none"), ShuffleConfig(kind="full"), ShuffleConfig(kind="window", window_chunks=1),
    ShuffleConfig(kind="window", window_chunks=3), ShuffleConfig(kind="block", block_size=4, window_blocks=3)])
COUNTS = st.lists(st.integers(0, 40), min_size=1, max_size=12).filter(lambda c: sum(c) > 0)


@settings(max_examples=60, deadline=None)
@given(counts=COUNTS, shuffle=SHUFFLES, data=st.data())
def test_a_complete_dataset_is_ordered_as_the_plain_shuffle(counts: list[int], shuffle: ShuffleConfig,
                                                             data: st.DataObject) -> None:
    order, _ = order_of(counts, len(counts), shuffle)
    n = sum(counts)
    positions = np.array(data.draw(st.lists(st.integers(0, 4 * SHUFFLE_BLOCK), min_size=1, max_size=40)), np.int64)
    epochs, examples = order.train_examples(positions)
    want_epochs, want_examples = plain(positions, counts, shuffle)
    np.testing.assert_array_equal(epochs, want_epochs)
    np.testing.assert_array_equal(examples, want_examples)
    assert order.train_count() == n
    assert order.train_example(int(positions[0])) == (int(want_epochs[0]), int(want_examples[0]))
    every = order.train_examples(np.arange(2 * n))[1]
    assert sorted(every[:n].tolist()) == sorted(every[n:].tolist()) == list(range(n))   # each epoch a permutation


@settings(max_examples=80, deadline=None)
@given(counts=COUNTS, shuffle=SHUFFLES, start=st.integers(1, 12), data=st.data())
def test_what_a_growing_dataset_answers_is_what_it_answers_complete(counts: list[int], shuffle: ShuffleConfig,
                                                                     start: int, data: st.DataObject) -> None:
    order, growing = order_of(counts, min(start, len(counts)), shuffle)
    n = sum(counts)
    asked: list[tuple[int, tuple[int, int]]] = []
    for _ in range(data.draw(st.integers(1, 6))):
        j = data.draw(st.integers(0, 2 * n))
        asked.append((j, order.train_example(j)))
    assert growing.chunks.complete or all(e == 0 for _, (e, _) in asked)
    for j, found in asked:
        epoch, example = plain(np.array([j]), counts, shuffle)
        assert found == (int(epoch[0]), int(example[0])), (j, growing.waits)


def test_an_unshuffled_position_waits_only_for_its_chunk() -> None:
    order, growing = order_of([5, 5, 5, 5], 1, ShuffleConfig(kind="none"))
    assert order.train_example(3) == (0, 3) and growing.waits == 0
    assert order.train_example(12) == (0, 12) and growing.waits == 2
    assert order.train_example(20) == (1, 0) and growing.chunks.complete


def test_a_full_shuffle_waits_for_the_whole_dataset() -> None:
    order, growing = order_of([5, 5, 5, 5], 1, ShuffleConfig(kind="full"))
    order.train_example(0)
    assert growing.chunks.complete


def test_a_dataset_without_examples_says_so() -> None:
    order, _ = order_of([0, 0], 2, ShuffleConfig(kind="none"))
    try:
        order.train_examples(np.array([0]))
    except LakeloaderError as error:
        assert "no examples" in str(error)
    else:
        raise AssertionError("an order over no examples answered")
