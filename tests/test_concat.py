"""Index maps of concat spans: segments and positions of batches of spans."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from lakeloader.index.ranges import cut_segments


def _plain_segments(keys: list[int]) -> tuple[list[int], list[int]]:
    segment_ids, positions = [], []
    for i, key in enumerate(keys):
        if i == 0 or key != keys[i - 1]:
            segment_ids.append(segment_ids[-1] + 1 if segment_ids else 1)
            positions.append(0)
        else:
            segment_ids.append(segment_ids[-1])
            positions.append(positions[-1] + 1)
    return segment_ids, positions


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 6), st.integers(0, 12), st.data())
def test_segments_of_a_batch_equal_a_plain_loop_per_row(rows: int, n: int, data: st.DataObject) -> None:
    runs = [data.draw(st.lists(st.integers(1, 5), min_size=n, max_size=n)) for _ in range(rows)]
    # Keys of contiguous documents: a run of equal keys per document, keys growing along a row.
    keys = np.array([np.repeat(np.arange(n), r)[:n] if n else [] for r in runs], np.int64).reshape(rows, n)
    # Where each document starts: every change of key along a row.
    cut_rows, cut_at = np.nonzero(np.diff(keys, axis=1)) if n else (np.zeros(0, np.int64), np.zeros(0, np.int64))
    segment_ids, positions = np.full((rows, n), -1, np.int32), np.full((rows, n), -1, np.int32)
    cut_segments(cut_rows, cut_at + 1, segment_ids, positions)
    for row in range(rows):
        expected_ids, expected_positions = _plain_segments(keys[row].tolist())
        assert segment_ids[row].tolist() == expected_ids
        assert positions[row].tolist() == expected_positions
    if rows:   # one span alone gives what it gives inside a batch
        mine = cut_rows == 0
        one_ids, one_positions = np.zeros((1, n), np.int32), np.zeros((1, n), np.int32)
        cut_segments(cut_rows[mine], cut_at[mine] + 1, one_ids, one_positions)
        assert np.array_equal(one_ids[0], segment_ids[0]) and np.array_equal(one_positions[0], positions[0])


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 3), st.sampled_from([32767, 32768, 40000, 70000]), st.data())
def test_segments_of_rows_past_16_bits_equal_runs_between_the_starts(rows: int, n: int, data: st.DataObject) -> None:
    """Rows longer than 16-bit offsets reach (segments are worked out in 16 bits where they fit)."""
    cuts = [sorted(set(data.draw(st.lists(st.integers(1, n - 1), max_size=5)))) for _ in range(rows)]
    cut_rows = np.repeat(np.arange(rows), [len(c) for c in cuts])
    cut_at = np.array([x for c in cuts for x in c], np.int64)
    segment_ids, positions = np.full((rows, n), -1, np.int32), np.full((rows, n), -1, np.int32)
    cut_segments(cut_rows, cut_at, segment_ids, positions)
    for row, row_cuts in enumerate(cuts):
        bounds = [0, *row_cuts, n]
        assert np.array_equal(segment_ids[row], np.repeat(np.arange(1, len(bounds)), np.diff(bounds)))
        assert np.array_equal(positions[row], np.concatenate([np.arange(b - a) for a, b in zip(bounds[:-1], bounds[1:])]))
