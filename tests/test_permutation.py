"""Keyed Feistel permutations: bijective for every size, invertible, keyed and frozen."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lakeloader.index import permutation
from lakeloader.index.permutation import derive_key, inverse_permute, mix_key, permute

KEYS = st.integers(min_value=0, max_value=2**64 - 1)


def test_bijective_for_every_size_up_to_2000() -> None:
    for size in range(1, 2001):
        image = permute(np.arange(size), size, size * 7919)
        assert np.array_equal(np.sort(image), np.arange(size)), size


@pytest.mark.parametrize("size", [65_537, 262_145, 1_048_577])
def test_bijective_just_past_a_power_of_two(size: int) -> None:
    x = np.arange(size)
    image = permute(x, size, derive_key("big", size))
    assert np.array_equal(np.sort(image), x)
    assert np.array_equal(inverse_permute(image, size, derive_key("big", size)), x)


@settings(max_examples=200, deadline=None)
@given(size=st.integers(1, 5000), key=KEYS)
def test_inverse_undoes_permute(size: int, key: int) -> None:
    x = np.arange(size)
    assert np.array_equal(inverse_permute(permute(x, size, key), size, key), x)
    assert np.array_equal(permute(inverse_permute(x, size, key), size, key), x)


@settings(max_examples=50, deadline=None)
@given(size=st.integers(2**40, 2**62), key=KEYS, data=st.data())
def test_huge_sizes_round_trip(size: int, key: int, data: st.DataObject) -> None:
    x = np.array(data.draw(st.lists(st.integers(0, size - 1), min_size=1, max_size=50)), np.int64)
    image = permute(x, size, key)
    assert ((image >= 0) & (image < size)).all()
    assert np.array_equal(inverse_permute(image, size, key), x)


def test_keys_give_different_permutations() -> None:
    for size in (10, 100, 1000, 65_537):
        images = {permute(np.arange(size), size, key).tobytes() for key in range(50)}
        assert len(images) == 50, size


def test_frozen_values() -> None:
    """Recorded outputs: a change here changes every shuffle and mixture of every user."""
    assert permute(np.arange(10), 10, 1).tolist() == [5, 6, 0, 3, 7, 2, 8, 9, 1, 4]
    assert permute(np.arange(4), 4, 0).tolist() == [1, 3, 2, 0]
    assert permute(np.arange(12), 1000, derive_key(0, "test")).tolist() == [
        961, 245, 600, 383, 527, 12, 230, 263, 46, 201, 949, 898]
    assert inverse_permute(np.arange(6), 3**13, 2**64 - 1).tolist() == [
        837839, 1239612, 1508055, 1232785, 124149, 17422]
    assert derive_key(0) == 11666789087612926428
    assert derive_key(1, "mixture") == 2393299746914579254
    assert mix_key(5, np.array([0, 1, 2])).tolist() == [
        6393685979062615639, 14121261644836312801, 12294176196992727080]


def test_deterministic_across_calls_and_shapes() -> None:
    x = np.arange(1000)
    first = permute(x, 1000, 42)
    assert np.array_equal(permute(x, 1000, 42), first)
    assert np.array_equal(permute(x.reshape(10, 100), 1000, 42), first.reshape(10, 100))
    assert np.array_equal(permute(x.astype(np.uint32), 1000, 42), first)
    assert permute(np.int64(7), 1000, 42).shape == ()
    assert int(permute(np.int64(7), 1000, 42)) == first[7]


def test_size_one_and_two() -> None:
    assert permute(np.zeros(3, np.int64), 1, 99).tolist() == [0, 0, 0]
    assert sorted(permute(np.arange(2), 2, 5).tolist()) == [0, 1]


def test_per_element_sizes_and_keys_match_scalar_calls() -> None:
    sizes = [1, 2, 3, 17, 1000, 65_537]
    keys = [3, 4, 5, 6, 2**64 - 1, 2**63]
    x = np.concatenate([np.arange(n) for n in sizes])
    size_of = np.repeat(sizes, sizes)
    key_of = np.repeat(np.array(keys, np.uint64), sizes)
    together = permute(x, size_of, key_of)
    apart = np.concatenate([permute(np.arange(n), n, k) for n, k in zip(sizes, keys)])
    assert np.array_equal(together, apart)
    assert np.array_equal(inverse_permute(together, size_of, key_of), x)
    # One key, many sizes, and one size, many keys.
    assert np.array_equal(permute(x, size_of, 7),
                          np.concatenate([permute(np.arange(n), n, 7) for n in sizes]))
    rows = permute(np.broadcast_to(np.arange(8), (3, 8)), 8, np.array([[1], [2], [3]], np.uint64))
    assert np.array_equal(rows, np.stack([permute(np.arange(8), 8, k) for k in (1, 2, 3)]))


def test_negative_keys_wrap() -> None:
    assert np.array_equal(permute(np.arange(50), 50, -1), permute(np.arange(50), 50, 2**64 - 1))


def test_bad_inputs_are_named() -> None:
    with pytest.raises(ValueError, match="index 10 is outside"):
        permute(np.array([0, 10]), 10, 1)
    with pytest.raises(ValueError, match="index -1 is outside"):
        inverse_permute(np.array([-1]), 10, 1)
    with pytest.raises(ValueError, match="size must be >= 1"):
        permute(np.array([], np.int64), 0, 1)
    with pytest.raises(TypeError):
        permute(np.array([0.5]), 10, 1)
    with pytest.raises(TypeError):
        derive_key(1.5)  # type: ignore[arg-type]


def test_derive_key_separates_parts() -> None:
    assert derive_key("ab", 1) != derive_key("a", "b1")
    assert derive_key(1) != derive_key("1")
    assert derive_key(1, 2) != derive_key(2, 1)
    assert derive_key(np.int64(5), "x") == derive_key(5, "x")
    assert 0 <= derive_key(-3) < 2**64
    assert len({derive_key(0, "epoch", e) for e in range(1000)}) == 1000


@settings(max_examples=100, deadline=None)
@given(data=st.data(), per_element=st.booleans(), inverse=st.booleans())
def test_the_walks_last_steps_in_python_integers_equal_the_array_walk(data: st.DataObject, per_element: bool,
                                                                      inverse: bool) -> None:
    """A walk's last elements step on as Python integers: every element walked that way (or
    none) gives the same permutation."""
    n = data.draw(st.integers(1, 40))
    if per_element:
        sizes = np.array(data.draw(st.lists(st.integers(1, 2**40), min_size=n, max_size=n)), np.int64)
        size: int | np.ndarray = sizes
        key: int | np.ndarray = np.array(data.draw(st.lists(st.integers(0, 2**63 - 1), min_size=n, max_size=n)),
                                         np.int64)
    else:
        size = data.draw(st.integers(1, 2**40))
        sizes = np.full(n, size, np.int64)
        key = data.draw(KEYS)
    x = np.array([data.draw(st.integers(0, int(s) - 1)) for s in sizes], np.int64)
    walk = inverse_permute if inverse else permute
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(permutation, "SCALAR_WALK", 0)
        in_arrays = walk(x, size, key)
        patch.setattr(permutation, "SCALAR_WALK", n)
        in_integers = walk(x, size, key)
    assert np.array_equal(in_arrays, in_integers)
