"""Where packed examples' items go in their rows (:mod:`lakeloader.index.row_layout`): the
layout of random examples equals a loop placing each item after the previous one, and any part of
it equals the layout of those examples alone."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lakeloader.index.row_layout import RowLayout, row_layout

LENGTH = 80
examples = st.lists(st.lists(st.integers(1, 20), min_size=1, max_size=4), min_size=1, max_size=12)


def _looped(items: list[list[int]]) -> dict[str, list[int]]:
    """Each field of the layout, item by item and row by row."""
    found: dict[str, list[int]] = {name: [] for name in ("starts", "runs", "numbers", "padded", "pad_start")}
    for row, sizes in enumerate(items):
        offset = 0
        for number, size in enumerate(sizes, start=1):
            found["starts"].append(row * LENGTH + offset)
            found["runs"].append(size)
            found["numbers"].append(number)
            offset += size
        found["runs"][-1] += LENGTH - offset
        if offset < LENGTH:
            found["padded"].append(row)
            found["pad_start"].append(offset)
    return found


def _layout(items: list[list[int]]) -> RowLayout:
    counts = np.array([len(sizes) for sizes in items])
    return row_layout(counts, np.array([size for sizes in items for size in sizes]), LENGTH)


def _assert_same(found: RowLayout, expected: RowLayout) -> None:
    for field in dataclasses.fields(RowLayout):
        a, b = getattr(found, field.name), getattr(expected, field.name)
        assert np.array_equal(a, b), (field.name, a, b)


@settings(max_examples=200, deadline=None)
@given(items=examples, data=st.data())
def test_a_layout_places_each_item_after_the_last_and_its_parts_are_their_examples_alone(
        items: list[list[int]], data: st.DataObject) -> None:
    layout = _layout(items)
    for name, values in _looped(items).items():
        assert getattr(layout, name).tolist() == values, name
    assert layout.counts.tolist() == [len(sizes) for sizes in items]
    assert layout.sizes.tolist() == [s for sizes in items for s in sizes]
    assert int(layout.runs.sum()) == len(items) * LENGTH, "the runs tile the rows"
    a = data.draw(st.integers(0, len(items) - 1), label="a")
    b = data.draw(st.integers(a + 1, len(items)), label="b")
    _assert_same(layout.part(a, b), _layout(items[a:b]))


@pytest.mark.parametrize(("counts", "sizes", "named"), [
    ([2, 0, 1], [5, 5, 5], "without items: examples [1]"),
    ([1, 2], [LENGTH, LENGTH - 3, 4], f"longer than a row of {LENGTH}: examples [1]"),
])
def test_an_example_without_items_or_too_long_is_named(counts: list[int], sizes: list[int], named: str) -> None:
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
        row_layout(np.array(counts), np.array(sizes), LENGTH)
