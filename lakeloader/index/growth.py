"""The epochs of a dataset that grew during a run (its plan grown append-only: ``plan/growth.py``).

A dataset's sizes are ``(epoch, chunks, examples)`` entries: the first ``(0, C0, N0)`` (the plan
the run started with), then one per growth: from ``epoch`` on the dataset has ``examples``
examples in its first ``chunks`` chunks. A growth is recorded in the epoch the run was in when it
took the grown plan up, and that epoch goes on over the examples it had planned, in their order,
then serves the new examples ``[N_old, N_new)`` (permuted among themselves by the same kind of
shuffle, keyed by the epoch and where they start); every later epoch is one order over all
examples. So within every epoch each example of the dataset comes exactly once.

Here: stream position -> (epoch, the part of the epoch holding it, the position within that part).
An epoch's parts are example ranges ``[lo, hi)`` over chunks ``[first_chunk, end_chunk)``; the
first part of every epoch starts at example 0 and is ordered as a whole epoch of ``hi`` examples.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

Size = tuple[int, int, int]   # (epoch, chunks, examples)


@dataclasses.dataclass(frozen=True)
class EpochParts:
    """Where stream positions lie (int64 arrays, one element per position): the ``epoch`` and its
    ``length`` (examples), the part's examples ``[lo, hi)`` and chunks ``[first_chunk, end_chunk)``,
    and the ``offset`` within the part (a part's positions follow the earlier parts' in its epoch)."""

    epoch: np.ndarray
    length: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    first_chunk: np.ndarray
    end_chunk: np.ndarray
    offset: np.ndarray


@dataclasses.dataclass(frozen=True)
class EpochSizes:
    """The sizes of a dataset's epochs over a run (see the module)."""

    sizes: tuple[Size, ...]

    def __post_init__(self) -> None:
        sizes = self.sizes
        if not sizes or sizes[0][0] != 0:
            raise ValueError(f"a dataset's sizes start at epoch 0, got {list(sizes)}")
        for (e0, c0, n0), (e1, c1, n1) in zip(sizes, sizes[1:]):
            if e1 < e0 or c1 < c0 or n1 < n0:
                raise ValueError(f"a dataset's sizes only grow, got {list(sizes)}")
        if sizes[0][2] < 1:
            raise ValueError(f"a dataset's first epoch needs an example, got {list(sizes)}")

    @property
    def examples(self) -> int:
        """Examples of the dataset's latest epochs."""
        return self.sizes[-1][2]

    def _runs(self) -> tuple[np.ndarray, np.ndarray, list[list[Size]]]:
        """Per epoch that has entries: that epoch, the stream position where it starts, and its
        part boundaries (the size in force before it, if any, then its own entries)."""
        epochs = sorted({e for e, _, _ in self.sizes})
        starts, bounds = [], []
        position, previous, last_epoch = 0, None, 0
        for epoch in epochs:
            if previous is not None:
                position += (epoch - last_epoch) * previous[2]
            own = [(c, n) for e, c, n in self.sizes if e == epoch]
            parts = ([(previous[1], previous[2])] if previous is not None else []) + own
            starts.append(position)
            bounds.append(parts)
            previous, last_epoch = (epoch, *own[-1]), epoch
        return np.array(epochs, np.int64), np.array(starts, np.int64), bounds

    def locate(self, positions: np.ndarray) -> EpochParts:
        """The epoch and part of each stream position (>= 0)."""
        positions = np.asarray(positions, np.int64)
        epochs, starts, bounds = self._runs()
        run = np.searchsorted(starts, positions, side="right") - 1
        out = {k: np.zeros(len(positions), np.int64) for k in ("epoch", "length", "lo", "hi", "first_chunk",
                                                                 "end_chunk", "offset")}
        for r in np.unique(run).tolist():
            mine = run == r
            parts = bounds[r]
            length = parts[-1][1]
            away = positions[mine] - starts[r]
            epoch = epochs[r] + away // length
            within = away % length
            his = np.array([n for _, n in parts], np.int64)
            ends = np.array([c for c, _ in parts], np.int64)
            los, firsts = np.concatenate([[0], his[:-1]]), np.concatenate([[0], ends[:-1]])
            # The growth epoch has every part; the epochs after it only the whole of the last.
            part = np.where(epoch == epochs[r], np.searchsorted(his, within, side="right"), len(parts) - 1)
            whole = epoch != epochs[r]
            out["epoch"][mine] = epoch
            out["length"][mine] = length
            out["lo"][mine] = np.where(whole, 0, los[part])
            out["hi"][mine] = his[part]
            out["first_chunk"][mine] = np.where(whole, 0, firsts[part])
            out["end_chunk"][mine] = ends[part]
            out["offset"][mine] = within - out["lo"][mine]
        return EpochParts(**out)

    def progress(self, positions: np.ndarray) -> np.ndarray:
        """Epochs elapsed before each stream position (float: whole epochs plus the share of the
        position's epoch before it)."""
        parts = self.locate(positions)
        return parts.epoch + (parts.lo + parts.offset) / parts.length

    def epoch_of(self, position: int) -> int:
        """The epoch of stream position ``position``."""
        return int(self.locate(np.array([position], np.int64)).epoch[0])

    def grown(self, position: int, chunks: int, examples: int) -> EpochSizes:
        """These sizes grown to ``examples`` examples in ``chunks`` chunks when the run takes the
        grown plan up at stream position ``position`` (its next example)."""
        return EpochSizes((*self.sizes, (self.epoch_of(position), chunks, examples)))


def sizes_from(found: Sequence[Sequence[int]]) -> EpochSizes:
    """:class:`EpochSizes` of a JSON list of ``[epoch, chunks, examples]``."""
    return EpochSizes(tuple((int(e), int(c), int(n)) for e, c, n in found))
