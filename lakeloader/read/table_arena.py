"""Ragged integer tables of many keys kept back to back, so that entries of many keys are
gathered in a few array operations instead of a lookup and a gather per key (a batch of packed
examples reads the item tables of up to one chunk per row)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterable, Sequence

import numpy as np

from lakeloader.index.ranges import run_indices

Table = tuple[np.ndarray, np.ndarray]   # (bounds: int64 [entries + 1] from 0, columns: int64 [rows, bounds[-1]])


class TableArena:
    """The tables of keys as they are asked for, at most ``max_columns`` columns of ``rows`` rows
    in all: beyond that the arena starts again with the keys of the request at hand only (all of
    them, however many columns they take). Key ``k``'s table is ``(bounds, columns)``: its entry
    ``e`` is ``columns[:, bounds[e] : bounds[e + 1]]``. Thread-safe: a gather reads arrays whose
    part it reads is never written again (the arena appends, or starts new arrays)."""

    def __init__(self, rows: int, max_columns: int, first_columns: int = 1 << 12) -> None:
        self.rows = rows
        self.max_columns = max_columns
        self._first_columns = first_columns
        self._lock = threading.Lock()
        self._start_empty(0, 0)

    def _start_empty(self, columns: int, entries: int) -> None:
        self._where: dict[Hashable, tuple[int, int]] = {}   # key -> (where its bounds start, how many)
        self._columns = np.empty((self.rows, max(self._first_columns, columns)), np.int64)
        self._bounds = np.empty(max(self._first_columns, entries), np.int64)
        self._used_columns = self._used_bounds = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._where)

    def gather(self, keys: Sequence[Hashable], key_of: np.ndarray, entries: np.ndarray,
               make: Callable[[list[Hashable]], list[Table]]) -> tuple[np.ndarray, np.ndarray]:
        """(the columns of entry ``entries[i]`` of key ``keys[key_of[i]]`` (``keys`` distinct) for
        every ``i``, back to back: int64 [rows, n]; how many columns each ``i`` has). The keys not
        held are made together, ``make(those keys)`` giving their tables in order, outside the lock
        (threads asking for a key together may each make it)."""
        made: dict[int, Table] = {}
        while True:
            with self._lock:
                found = self._place(keys, made)
                if None not in found:
                    bounds, columns = self._bounds, self._columns
                    break
            # (a key held a moment ago may have gone with another thread's fresh start: made too)
            missing = [i for i, at in enumerate(found) if at is None]
            made.update(zip(missing, make([keys[i] for i in missing])))
        rows = np.asarray(found, np.int64)[key_of] + entries
        first = bounds[rows]
        counts = bounds[rows + 1] - first
        return columns[:, run_indices(first, counts)], counts

    def _place(self, keys: Sequence[Hashable], made: dict[int, Table]) -> list[int | None]:
        """Hold the tables ``made`` (by position in ``keys``) that are not held; where the bounds
        of each key start (None: neither held nor made)."""
        new = {i: made[i] for i in made if keys[i] not in self._where}
        if new and self._used_columns + _columns(new.values()) > self.max_columns and self._where:
            held = {i: self._held(key) for i, key in enumerate(keys) if i not in new and key in self._where}
            new.update(held)
            self._start_empty(_columns(new.values()), sum(len(bounds) for bounds, _ in new.values()))
        self._reserve(self._used_columns + _columns(new.values()),
                      self._used_bounds + sum(len(bounds) for bounds, _ in new.values()))
        for i, (bounds, columns) in new.items():
            at, width = self._used_bounds, columns.shape[1]
            self._bounds[at : at + len(bounds)] = bounds + self._used_columns
            self._columns[:, self._used_columns : self._used_columns + width] = columns
            self._where[keys[i]] = (at, len(bounds))
            self._used_bounds += len(bounds)
            self._used_columns += width
        return [None if key not in self._where else self._where[key][0] for key in keys]

    def _held(self, key: Hashable) -> Table:
        """The table held for ``key``, as it was given."""
        at, size = self._where[key]
        bounds = self._bounds[at : at + size]
        return bounds - bounds[0], self._columns[:, int(bounds[0]) : int(bounds[-1])]

    def _reserve(self, columns: int, entries: int) -> None:
        """Room for ``columns`` columns and ``entries`` bounds: larger arrays (the used part copied)
        where needed, doubling up to ``max_columns``; the old ones stay as they are for gathers
        reading them."""
        if columns > self._columns.shape[1]:
            grown = np.empty((self.rows, max(columns, min(2 * self._columns.shape[1], self.max_columns))), np.int64)
            grown[:, : self._used_columns] = self._columns[:, : self._used_columns]
            self._columns = grown
        if entries > len(self._bounds):
            grown_bounds = np.empty(max(entries, min(2 * len(self._bounds), self.max_columns)), np.int64)
            grown_bounds[: self._used_bounds] = self._bounds[: self._used_bounds]
            self._bounds = grown_bounds


def _columns(tables: Iterable[Table]) -> int:
    return sum(columns.shape[1] for _, columns in tables)
