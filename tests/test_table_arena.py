"""The table arena (packed examples' item tables of many chunks kept back to back): any sequence
of gathers, under any bound on what it holds, returns exactly the entries the tables hold, makes
a table only for a key it does not hold, keeps its memory within the bound, and stays right with threads gathering together while
it starts again."""

from __future__ import annotations

import threading

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from lakeloader.read.table_arena import Table, TableArena

ROWS = 3


def _tables(draw: st.DrawFn, keys: int) -> dict[int, Table]:
    made = {}
    for key in range(keys):
        widths = draw(st.lists(st.integers(0, 4), min_size=1, max_size=6), label=f"widths of {key}")
        bounds = np.concatenate(([0], np.cumsum(widths))).astype(np.int64)
        columns = np.arange(ROWS * int(bounds[-1]), dtype=np.int64).reshape(ROWS, -1) + 1000 * key
        made[key] = (bounds, columns)
    return made


def _expected(tables: dict[int, Table], keys: list[int], key_of: np.ndarray, entries: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray]:
    """What a gather returns, entry by entry."""
    pieces, counts = [np.zeros((ROWS, 0), np.int64)], []
    for k, e in zip(key_of.tolist(), entries.tolist()):
        bounds, columns = tables[keys[k]]
        pieces.append(columns[:, bounds[e] : bounds[e + 1]])
        counts.append(int(bounds[e + 1] - bounds[e]))
    return np.concatenate(pieces, axis=1), np.array(counts, np.int64)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_gathers_return_the_entries_of_the_tables(data: st.DataObject) -> None:
    tables = data.draw(st.integers(1, 8).flatmap(lambda n: st.composite(lambda draw: _tables(draw, n))()),
                       label="tables")
    max_columns = data.draw(st.integers(1, 40), label="max_columns")
    first_columns = data.draw(st.integers(1, 8), label="first_columns")
    arena = TableArena(ROWS, max_columns, first_columns=first_columns)
    held: set[int] = set()
    for _ in range(data.draw(st.integers(1, 12), label="gathers")):
        keys = data.draw(st.lists(st.sampled_from(sorted(tables)), min_size=1, unique=True), label="keys")
        key_of = np.array(data.draw(st.lists(st.integers(0, len(keys) - 1), max_size=10), label="key_of"), np.int64)
        entries = np.array([data.draw(st.integers(0, len(tables[keys[k]][0]) - 2)) for k in key_of.tolist()], np.int64)
        made: list[int] = []

        def make(wanted: list[object]) -> list[Table]:
            made.extend(wanted)  # type: ignore[arg-type]
            return [tables[key] for key in wanted]  # type: ignore[index]

        columns, counts = arena.gather(keys, key_of, entries, make)
        expected_columns, expected_counts = _expected(tables, keys, key_of, entries)
        assert np.array_equal(counts, expected_counts)
        assert np.array_equal(columns, expected_columns)
        assert sorted(made) == sorted(set(keys) - held), "made exactly the keys not held, once each"
        # What it holds now: the model. New keys are added while they fit; otherwise it starts
        # again with this gather's keys only.
        new = set(keys) - held
        if new:
            width = sum(tables[key][1].shape[1] for key in held | new)
            held = set(keys) if width > max_columns and held else held | new
        assert set(arena._where) == held
        # Its memory stays within the bound (or what it must hold, when that is more).
        width = sum(tables[key][1].shape[1] for key in held)
        assert arena._columns.shape[1] <= max(first_columns, max_columns, width)


def test_threads_gathering_while_the_arena_starts_again_read_the_right_entries() -> None:
    rng = np.random.default_rng(7)
    tables: dict[int, Table] = {}
    for key in range(40):
        widths = rng.integers(0, 5, size=rng.integers(1, 20))
        bounds = np.concatenate(([0], np.cumsum(widths))).astype(np.int64)
        tables[key] = (bounds, rng.integers(0, 1 << 40, size=(ROWS, int(bounds[-1]))))
    arena = TableArena(ROWS, 60, first_columns=4)   # room for a few keys: it starts again all the time
    failures: list[str] = []

    def gather_many(seed: int) -> None:
        local = np.random.default_rng(seed)
        for _ in range(300):
            keys = local.choice(40, size=local.integers(1, 6), replace=False).tolist()
            key_of = local.integers(0, len(keys), size=8)
            entries = np.array([local.integers(0, len(tables[keys[k]][0]) - 1) for k in key_of.tolist()], np.int64)
            columns, counts = arena.gather(keys, key_of, entries, lambda wanted: [tables[k] for k in wanted])
            expected_columns, expected_counts = _expected(tables, keys, key_of, entries)
            if not (np.array_equal(columns, expected_columns) and np.array_equal(counts, expected_counts)):
                failures.append(f"seed {seed}: keys {keys}")

    threads = [threading.Thread(target=gather_many, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures[:3]
