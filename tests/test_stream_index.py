"""The stream index of row groups a reader has met: windows located in it are the row groups a
plain scan over the held chunks finds (the one holding a window whole, or the pieces of each row
group a window reaches), whatever the order chunks were added in, with row groups and chunks
without tokens, and across the index starting afresh at its size bound."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lakeloader.index.ranges import cumulative, distinct, merged_runs
from lakeloader.read import stream_index
from lakeloader.read.stream_index import StreamIndex

chunk_groups = st.lists(st.integers(0, 9), min_size=0, max_size=4)   # row-group lengths of one chunk


def _tables(chunks: list[list[int]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each chunk's (row-group stream offsets within it, first document of each)."""
    return [(cumulative(np.array(lengths, np.int64)), np.arange(len(lengths), dtype=np.int32) * 3) for lengths in chunks]


def _scan(chunks: list[list[int]], held: set[int], start: int, length: int) -> tuple[int, int, int] | None:
    """(chunk position, row group, offset within it) of the held row group holding the window whole."""
    at = 0
    for position, lengths in enumerate(chunks):
        for group, size in enumerate(lengths):
            if position in held and at <= start and start + length <= at + size:
                return position, group, start - at
            at += size
    return None


@settings(max_examples=300, deadline=None)
@given(chunks=st.lists(chunk_groups, min_size=1, max_size=8), data=st.data(),
       bound=st.sampled_from([3, 8, 1 << 16]))
def test_windows_are_located_as_a_scan_finds_them(chunks: list[list[int]], data: st.DataObject, bound: int) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stream_index, "INDEXED_GROUPS", bound)
        _check_located(chunks, data, bound)


def _check_located(chunks: list[list[int]], data: st.DataObject, bound: int) -> None:
    tables = _tables(chunks)
    offsets = cumulative(np.array([sum(lengths) for lengths in chunks], np.int64))
    index = StreamIndex.empty(offsets)
    total = int(offsets[-1])
    for _ in range(data.draw(st.integers(1, 4))):
        adding = data.draw(st.lists(st.sampled_from(range(len(chunks))), unique=True, max_size=len(chunks)))
        adding = [p for p in adding if p not in index.known]
        grown = index.with_chunks(adding, [tables[p] for p in adding])
        held = set(grown.known)
        if len(index.start) + sum(len(chunks[p]) for p in adding) > bound:   # started afresh
            assert held == set(adding)
        else:
            assert held == set(index.known) | set(adding)
        assert len(grown.start) == sum(len(chunks[p]) for p in held)
        index = grown
        length = data.draw(st.integers(1, 6))
        starts = np.array(data.draw(st.lists(st.integers(0, total + 2), max_size=12)), np.int64)
        found = index.locate(starts, length)
        for start, row in zip(starts.tolist(), found.tolist()):
            expected = _scan(chunks, held, start, length)
            if expected is None:
                assert row == -1
            else:
                position, group, offset = expected
                assert (int(index.position[row]), int(index.group[row])) == (position, group)
                assert start - int(index.start[row]) == offset
                assert int(index.first_doc[row]) == group * 3
        rows, groups, lo, hi = index.reached(starts, length)
        pieces = [(int(index.position[g]), int(index.group[g]), a, b)
                  for g, a, b in zip(groups.tolist(), lo.tolist(), hi.tolist())]
        for k, start in enumerate(starts.tolist()):
            mine = [piece for row, piece in zip(rows.tolist(), pieces) if row == k]
            assert mine == _scan_pieces(chunks, held, start, length)


def _scan_pieces(chunks: list[list[int]], held: set[int], start: int, length: int) -> list[tuple[int, int, int, int]]:
    """(chunk position, row group, first and one past the last offset within it) of each held row
    group the window reaches a token of, in stream order."""
    found, at = [], 0
    for position, lengths in enumerate(chunks):
        for group, size in enumerate(lengths):
            lo, hi = max(start, at), min(start + length, at + size)
            if position in held and hi > lo:
                found.append((position, group, lo - at, hi - at))
            at += size
    return found


def test_an_empty_index_locates_nothing() -> None:
    index = StreamIndex.empty(np.array([0, 10], np.int64))
    assert index.locate(np.array([0, 5], np.int64), 2).tolist() == [-1, -1]
    assert index.with_chunks([], []).known == frozenset()


@settings(max_examples=300, deadline=None)
@given(ranges=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 60), st.integers(0, 30)), max_size=25),
       gap=st.integers(0, 10))
def test_ranges_merge_into_runs_as_a_scan_merges_them(ranges: list[tuple[int, int, int]], gap: int) -> None:
    """The runs a cold batch reads a row group's pages by (index.ranges.merged_runs): per row
    group, ranges sorted by start join the run before them when they start at most ``gap`` past
    its furthest end; as a plain scan finds them, every range in its run."""
    item = np.array([r[0] for r in ranges], np.int64)
    first = np.array([r[1] for r in ranges], np.int64)
    stop = first + np.array([r[2] for r in ranges], np.int64)
    run_item, run_lo, run_hi, run_of = merged_runs(item, first, stop, gap)
    expected: list[tuple[int, int, int]] = []
    expected_of = [0] * len(ranges)
    for i in sorted(range(len(ranges)), key=lambda i: (item[i], first[i], i)):
        if expected and expected[-1][0] == item[i] and first[i] <= expected[-1][2] + gap:
            expected[-1] = (expected[-1][0], expected[-1][1], max(expected[-1][2], int(stop[i])))
        else:
            expected.append((int(item[i]), int(first[i]), int(stop[i])))
        expected_of[i] = len(expected) - 1
    assert list(zip(run_item.tolist(), run_lo.tolist(), run_hi.tolist())) == expected
    assert run_of.tolist() == expected_of


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.integers(0, 2**40), min_size=1, max_size=600), few=st.booleans(), many=st.booleans(),
       in_order=st.booleans())
def test_the_row_groups_a_batch_reaches_are_those_np_unique_finds(values: list[int], few: bool, many: bool,
                                                                  in_order: bool) -> None:
    # (a batch's windows reach a handful of distinct row groups, or hundreds; several batches'
    # items, located together, are many; in order when read in order)
    array = np.array([v % 7 for v in values] if few else values, np.int64)
    if many:
        array = np.resize(array, 300 + len(array))
    if in_order:
        array.sort()
    used, inverse = distinct(array)
    expected_used, expected_inverse = np.unique(array, return_inverse=True)
    np.testing.assert_array_equal(used, expected_used)
    np.testing.assert_array_equal(inverse, expected_inverse)
    assert used.dtype == inverse.dtype == np.int64
