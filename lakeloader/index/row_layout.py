"""Where the items of packed examples go in their rows: each example fills one row of ``length``
tokens with its items back to back (each its own segment, numbered from 1), then padding.

Pure integer maps over the items' sizes, computed for many examples at once (a loader's next few
steps) and cut into the parts of single batches without recomputing (:meth:`RowLayout.part`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from lakeloader.index.ranges import cumulative


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """Example ``i`` (row ``i``) holds items ``bounds[i] : bounds[i + 1]``; item ``k`` writes
    ``sizes[k]`` tokens from flat index ``starts[k]`` of the rows taken as one array (offset
    ``starts[k] % length`` of its row). ``runs`` tile that array: item ``k``'s run is its size,
    and the last item of a row also covers the row's padding (if any), which starts at
    ``pad_start[j]`` of row ``padded[j]``."""

    length: int             # tokens per row
    counts: np.ndarray      # int64 per example: its number of items (at least one)
    bounds: np.ndarray      # cumulative(counts)
    sizes: np.ndarray       # int64 per item
    starts: np.ndarray      # int64 per item: row * length + offset in the row
    runs: np.ndarray        # int64 per item
    numbers: np.ndarray     # int64 per item: its segment number, from 1 in each row
    padded: np.ndarray      # int64: the rows with padding, ascending
    pad_start: np.ndarray   # int64 per padded row: where its padding starts

    def part(self, a: int, b: int) -> RowLayout:
        """The layout of examples ``a`` to ``b`` alone (rows from 0): slices and two subtractions."""
        lo, hi = int(self.bounds[a]), int(self.bounds[b])
        first, stop = self.padded.searchsorted((a, b)).tolist()
        return RowLayout(self.length, self.counts[a:b], self.bounds[a : b + 1] - lo, self.sizes[lo:hi],
                         self.starts[lo:hi] - a * self.length, self.runs[lo:hi], self.numbers[lo:hi],
                         self.padded[first:stop] - a, self.pad_start[first:stop])


def row_layout(counts: np.ndarray, sizes: np.ndarray, length: int) -> RowLayout:
    """The :class:`RowLayout` of examples of ``counts`` items (in order, example by example) of
    ``sizes`` tokens, in rows of ``length``. Raises ``ValueError`` for an example without items
    (its row would hold no run to cover its padding) or whose items overflow a row."""
    counts, sizes = np.asarray(counts, np.int64), np.asarray(sizes, np.int64)
    if not counts.all():
        raise ValueError(f"packed examples without items: examples {np.flatnonzero(counts == 0).tolist()}")
    n = len(counts)
    bounds = cumulative(counts)
    ends = cumulative(sizes)
    row_first = bounds[:-1].repeat(counts)
    in_row = ends[:-1] - ends[row_first]
    row_last = bounds[1:] - 1
    pads = length - (in_row[row_last] + sizes[row_last])
    if (pads < 0).any():
        raise ValueError(f"packed examples longer than a row of {length}: examples {np.flatnonzero(pads < 0).tolist()}")
    runs = sizes.copy()
    runs[row_last] += pads
    padded = np.flatnonzero(pads)
    return RowLayout(length, counts, bounds, sizes, np.arange(n, dtype=np.int64).repeat(counts) * length + in_row, runs,
                     np.arange(1, len(sizes) + 1, dtype=np.int64) - row_first, padded, length - pads[padded])
