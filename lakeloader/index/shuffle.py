"""Per-dataset example orders: position in the shuffled stream -> example of the dataset.

Each function maps stream positions ``pos >= 0`` of a dataset with ``N`` examples per epoch to
example indices in ``[0, N)``. Position ``pos`` belongs to epoch ``pos // N`` and is position
``pos % N`` of that epoch; the epoch is folded into every permutation key, so each epoch has its
own order and each epoch's order is a bijection of ``[0, N)``. All are pure, vectorized, and
bitwise deterministic (see :mod:`lakeloader.index.permutation`).
"""

from __future__ import annotations

import numpy as np

from lakeloader.index.permutation import derive_key, inverse_permute, mix_key, permute

__all__ = ["shuffle_block", "shuffle_full", "shuffle_none", "shuffle_window", "split_epoch"]


def _check_size(n: int, what: str = "N") -> int:
    if int(n) != n or n < 1:
        raise ValueError(f"{what} must be a positive integer, got {n!r}")
    return int(n)


def split_epoch(pos: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(epoch, position within the epoch) of stream positions ``pos`` (int64 arrays).
    Raises ValueError naming the first negative position."""
    n = _check_size(n)
    pos = np.asarray(pos)
    if pos.dtype.kind not in "iu":
        raise TypeError(f"positions must be integers, got dtype {pos.dtype}")
    pos = pos.astype(np.int64)
    if pos.size and int(pos.min()) < 0:
        raise ValueError(f"stream position {int(pos.min())} is negative")
    return pos // n, pos % n


def shuffle_none(pos: np.ndarray, n: int) -> np.ndarray:
    """Example ``pos % N``: the dataset in its stored order, every epoch alike."""
    return split_epoch(pos, n)[1]


def shuffle_full(pos: np.ndarray, n: int, key: int) -> np.ndarray:
    """Example at ``pos`` under one keyed permutation of all ``N`` examples per epoch."""
    epoch, j = split_epoch(pos, n)
    return permute(j, n, mix_key(derive_key(key, "shuffle_full"), epoch))


def shuffle_window(pos: np.ndarray, window_starts: np.ndarray, n: int, key: int) -> np.ndarray:
    """Example at ``pos`` when examples are permuted only within their window.

    ``window_starts[i]`` is the first example of window ``i`` (e.g. the example offsets of every
    ``window_chunks``-th chunk); it starts at 0, is non-decreasing and ends at most at ``N``
    (a trailing ``N``, as in a cumulative-offsets array, is an empty window and harmless). Window
    ``i`` covers ``[window_starts[i], window_starts[i+1])`` (the last one ends at ``N``, and may
    be shorter than the others). Its permutation is keyed by (key, epoch, i), so each window's
    examples stay in that window, in an order that changes every epoch.
    """
    n = _check_size(n)
    starts = np.asarray(window_starts, dtype=np.int64).reshape(-1)
    if starts.size == 0 or starts[0] != 0 or (np.diff(starts) < 0).any() or starts[-1] > n:
        raise ValueError(f"window_starts must start at 0, be non-decreasing and stay <= N={n}; "
                         f"got {starts[:8].tolist()}{' ...' if starts.size > 8 else ''}")
    epoch, j = split_epoch(pos, n)
    window = np.searchsorted(starts, j, side="right") - 1  # the last of equal starts: non-empty
    ends = np.append(starts[1:], n)
    first = starts[window]
    keys = mix_key(derive_key(key, "shuffle_window"), epoch, window)
    return first + permute(j - first, ends[window] - first, keys)


def shuffle_block(pos: np.ndarray, n: int, block_size: int, window_blocks: int, key: int) -> np.ndarray:
    """Example at ``pos`` under a two-level shuffle: blocks of ``block_size`` consecutive examples
    are permuted over the dataset, then examples are permuted within windows of
    ``window_blocks`` consecutive (already permuted) blocks.

    The last block may be partial (``N`` need not be a multiple of ``block_size``); it takes its
    place in the permuted block order at its true length, so each epoch is still a bijection of
    ``[0, N)`` and every example keeps its neighbours of the same block within one window.
    """
    n = _check_size(n)
    bs = _check_size(block_size, "block_size")
    wb = _check_size(window_blocks, "window_blocks")
    epoch, j = split_epoch(pos, n)
    blocks = -(-n // bs)
    short = blocks * bs - n  # missing examples of the last block
    block_keys = mix_key(derive_key(key, "shuffle_block", "blocks"), epoch)
    # The slot of the permuted block order that holds the (possibly partial) last block.
    partial_slot = inverse_permute(np.full(j.shape, blocks - 1, np.int64), blocks, block_keys)

    def slot_start(slot: np.ndarray) -> np.ndarray:
        return slot * bs - short * (slot > partial_slot)

    def slot_of(p: np.ndarray) -> np.ndarray:
        return np.where(p < partial_slot * bs + (bs - short), p // bs, (p + short) // bs)

    window = slot_of(j) // wb
    first = slot_start(window * wb)
    size = slot_start(np.minimum(window * wb + wb, blocks)) - first
    window_keys = mix_key(derive_key(key, "shuffle_block", "windows"), epoch, window)
    q = first + permute(j - first, size, window_keys)
    slot = slot_of(q)
    return permute(slot, blocks, block_keys) * bs + (q - slot_start(slot))
