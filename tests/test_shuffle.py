"""Per-dataset example orders: every epoch a bijection, windows respected, epochs reshuffled."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lakeloader.index.shuffle import shuffle_block, shuffle_full, shuffle_none, shuffle_window, split_epoch

KEYS = st.integers(0, 2**64 - 1)
EPOCHS = 3


def _each_epoch_is_a_bijection(order: np.ndarray, n: int) -> None:
    for e in range(len(order) // n):
        assert np.array_equal(np.sort(order[e * n:(e + 1) * n]), np.arange(n)), f"epoch {e}"


def _window_starts(data: st.DataObject, n: int) -> np.ndarray:
    """Sorted window starts from 0 (maybe repeated = empty windows, maybe ending at N)."""
    cuts = data.draw(st.lists(st.integers(0, n), max_size=12))
    return np.array(sorted([0, *cuts]), np.int64)


@settings(max_examples=100, deadline=None)
@given(n=st.integers(1, 3000), key=KEYS)
def test_full_and_none_are_bijections(n: int, key: int) -> None:
    pos = np.arange(EPOCHS * n)
    _each_epoch_is_a_bijection(shuffle_full(pos, n, key), n)
    assert np.array_equal(shuffle_none(pos, n), pos % n)


@settings(max_examples=100, deadline=None)
@given(n=st.integers(1, 3000), key=KEYS, data=st.data())
def test_window_shuffle_is_a_bijection_within_windows(n: int, key: int, data: st.DataObject) -> None:
    starts = _window_starts(data, n)
    pos = np.arange(EPOCHS * n)
    order = shuffle_window(pos, starts, n, key)
    _each_epoch_is_a_bijection(order, n)
    # Every example stays in the window of its position.
    window_of = lambda j: np.searchsorted(starts, j, side="right") - 1  # noqa: E731
    assert np.array_equal(window_of(order), window_of(pos % n))


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 3000), block_size=st.integers(1, 64), window_blocks=st.integers(1, 8), key=KEYS)
def test_block_shuffle_is_a_bijection(n: int, block_size: int, window_blocks: int, key: int) -> None:
    pos = np.arange(EPOCHS * n)
    order = shuffle_block(pos, n, block_size, window_blocks, key)
    _each_epoch_is_a_bijection(order, n)
    # The examples of one block stay within one window of window_blocks blocks of positions.
    for e in range(EPOCHS):
        epoch = order[e * n:(e + 1) * n]
        where = np.empty(n, np.int64)
        where[epoch] = np.arange(n)
        block = np.arange(n) // block_size
        lo = np.full(block[-1] + 1, n)
        hi = np.zeros(block[-1] + 1, np.int64)
        np.minimum.at(lo, block, where)
        np.maximum.at(hi, block, where)
        assert (hi - lo < window_blocks * block_size).all()


def test_block_shuffle_moves_blocks_and_examples() -> None:
    n, bs = 10_000 + 37, 100
    order = shuffle_block(np.arange(n), n, bs, 4, key=5)
    assert not (order // bs == np.arange(n) // bs).all()  # blocks move
    assert not (np.diff(order) == 1).all()  # and examples within windows are mixed
    # Windows of one block: each block's examples fill consecutive positions.
    where = np.argsort(shuffle_block(np.arange(n), n, bs, 1, key=5))
    spans = [np.ptp(where[b:b + bs]) + 1 for b in range(0, n, bs)]
    assert spans == [min(bs, n - b) for b in range(0, n, bs)]


def test_window_of_one_example_and_dataset_of_one() -> None:
    assert shuffle_window(np.arange(5), np.arange(5), 5, 1).tolist() == [0, 1, 2, 3, 4]
    assert shuffle_full(np.arange(4), 1, 1).tolist() == [0, 0, 0, 0]
    assert shuffle_block(np.arange(4), 1, 8, 2, 1).tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("shuffle", [
    lambda pos, n, key: shuffle_full(pos, n, key),
    lambda pos, n, key: shuffle_window(pos, np.arange(0, n, 250), n, key),
    lambda pos, n, key: shuffle_block(pos, n, 16, 4, key),
])
def test_epochs_and_keys_differ(shuffle) -> None:
    n = 1000
    order = shuffle(np.arange(3 * n), n, 7)
    assert not np.array_equal(order[:n], order[n:2 * n])
    assert not np.array_equal(order[n:2 * n], order[2 * n:])
    assert not np.array_equal(order[:n], shuffle(np.arange(n), n, 8))
    # Pure: any slice of positions, in any shape, maps the same way.
    picks = np.array([[2999, 0], [1500, 1000]])
    assert np.array_equal(shuffle(picks, n, 7), order[picks])


def test_frozen_values() -> None:
    """Recorded outputs: a change here reorders every user's data."""
    assert shuffle_full(np.arange(10), 10, 3).tolist() == FROZEN["full"]
    assert shuffle_window(np.arange(12), np.array([0, 5, 10]), 12, 3).tolist() == FROZEN["window"]
    assert shuffle_block(np.arange(14), 14, 3, 2, 3).tolist() == FROZEN["block"]


FROZEN = {
    "full": [3, 2, 9, 5, 7, 8, 1, 6, 4, 0],
    "window": [3, 0, 2, 4, 1, 9, 8, 5, 6, 7, 11, 10],
    "block": [0, 1, 2, 13, 12, 6, 7, 11, 9, 10, 8, 5, 4, 3],
}


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="negative"):
        shuffle_full(np.array([-1]), 10, 0)
    with pytest.raises(ValueError, match="positive integer"):
        shuffle_full(np.array([0]), 0, 0)
    with pytest.raises(ValueError, match="window_starts"):
        shuffle_window(np.array([0]), np.array([1, 5]), 10, 0)
    with pytest.raises(ValueError, match="window_starts"):
        shuffle_window(np.array([0]), np.array([0, 11]), 10, 0)
    with pytest.raises(ValueError, match="block_size"):
        shuffle_block(np.array([0]), 10, 0, 1, 0)
    assert [a.tolist() for a in split_epoch(np.array([0, 9, 10, 25]), 10)] == [[0, 0, 1, 2], [0, 9, 0, 5]]
