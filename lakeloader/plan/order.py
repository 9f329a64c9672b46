"""The global order of chunks: round-robin over shards by split index."""

from __future__ import annotations

import numpy as np


def round_robin_order(splits_per_shard: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(shard_index, split_index) of every chunk in global order.

    The c-th chunk is split ``c // K`` of shard ``c % K`` while all K shards have splits left;
    exhausted shards drop out and the round-robin continues over the rest.
    """
    counts = np.asarray(splits_per_shard, dtype=np.int64)
    if counts.ndim != 1 or (counts < 0).any():
        raise ValueError(f"splits_per_shard must be a 1-d array of counts >= 0, got {counts!r}")
    shard = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    starts = np.cumsum(counts) - counts
    split = np.arange(len(shard), dtype=np.int64) - np.repeat(starts, counts)
    order = np.lexsort((shard, split))
    return shard[order], split[order]
