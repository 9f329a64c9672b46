"""Closed-form mixtures: within 2 of the target share at every batch, seekable, gap-free."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings, target
from hypothesis import strategies as st

from lakeloader.index import mixture
from lakeloader.index.mixture import (
    Stage,
    batch_assignment,
    batch_assignments,
    mixture_counts,
    stage_totals,
    staged_assignment,
    staged_assignments,
    stop_step,
)

PREFIX = 10**5
EXPONENTS = st.floats(min_value=-4.0, max_value=0.0, allow_nan=False)
WEIGHTS = st.lists(EXPONENTS, min_size=2, max_size=50).map(lambda es: [10.0**e for e in es])
BATCH_SIZES = st.sampled_from([1, 7, 64, 256])


def _shares(weights: list[float]) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    return w / w.sum()


@settings(max_examples=60, deadline=None)
@given(weights=WEIGHTS, batch_size=BATCH_SIZES)
def test_counts_stay_within_two_of_target(weights: list[float], batch_size: int) -> None:
    batches = np.arange(-(-PREFIX // batch_size))
    counts = mixture_counts(weights, batch_size, batches)
    n = (batches + 1) * batch_size
    assert np.array_equal(counts.sum(axis=1), n)
    assert (np.diff(counts, axis=0) >= 0).all() and (counts[0] >= 0).all()
    deviation = np.abs(counts - _shares(weights)[None, :] * n[:, None])
    target(float(deviation.max()))  # steer hypothesis towards the worst weights it can find
    assert deviation.max() < 2
    # A dataset of share w appears by the end of the batch holding example ceil(2/w).
    for d, w in enumerate(_shares(weights)):
        first_batch = (math.ceil(2 / w) - 1) // batch_size
        if first_batch < len(batches):
            assert counts[first_batch, d] >= 1


def test_counts_of_skewed_and_zero_weights() -> None:
    weights = [0.5, 0.0, 0.3, 1e-4, 0.2 - 1e-4, 0.0]
    counts = mixture_counts(weights, 3, np.arange(-1, 40_000))
    assert (counts[:, [1, 5]] == 0).all()
    assert (counts[0] == 0).all()  # batch -1: nothing drawn yet
    n = np.arange(0, 40_001) * 3
    assert np.abs(counts - _shares(weights) * n[:, None]).max() < 2
    assert counts[(math.ceil(2 / 1e-4) - 1) // 3, 3] >= 1


def test_seeking_matches_a_sequential_scan() -> None:
    weights = [3, 1, 1, 0.25]
    everything = mixture_counts(weights, 16, np.arange(5000))
    picks = np.array([4999, 0, 1234, 17, 17, 4000])
    assert np.array_equal(mixture_counts(weights, 16, picks), everything[picks])


def _reference_counts(weights: list[float], n: int) -> list[int]:
    """The schedule in exact Python integers: the uint64 splits must agree bit for bit."""
    tree = mixture._tree(tuple(float(w) for w in weights))
    counts = {tree.root: n}
    for split in tree.splits:
        parent = counts.pop(split.parent)
        first = (2 * split.first_weight * parent + split.parent_weight) // (2 * split.parent_weight)
        counts[split.first], counts[split.second] = first, parent - first
    out = [0] * tree.num_datasets
    for node, d in enumerate(tree.leaves):
        out[d] = counts[node]
    return out


@settings(max_examples=30, deadline=None)
@given(weights=WEIGHTS, batches=st.lists(st.integers(-1, 2**61 - 1), min_size=1, max_size=20))
def test_exact_integer_arithmetic_for_huge_prefixes(weights: list[float], batches: list[int]) -> None:
    got = mixture_counts(weights, 2, np.array(batches, np.int64))
    assert got.tolist() == [_reference_counts(weights, 2 * (k + 1)) for k in batches]
    n = 2 * (np.array(batches, dtype=object) + 1)
    # |C - w n| < 2 against the quantised weights the schedule uses (exact rationals).
    quanta = mixture.quantized_weights(weights)
    total = sum(quanta)
    for row, size in zip(got.tolist(), n):
        for c, q in zip(row, quanta):
            assert abs(c * total - q * size) < 2 * total


def test_quantised_weights_track_the_floats() -> None:
    weights = [0.7, 0.2, 0.1, 0.0, 1e-12]
    quanta = mixture.quantized_weights(weights)
    assert quanta[3] == 0 and quanta[4] == 1
    exact = [Fraction(w) / sum(map(Fraction, weights)) for w in weights]
    assert all(abs(Fraction(q, 2**40) - e) <= Fraction(1, 2**41) for q, e in zip(quanta[:4], exact))
    assert mixture_counts(weights, 1, np.array([10**12 - 1]))[0].tolist() == _reference_counts(weights, 10**12)


@settings(max_examples=30, deadline=None)
@given(weights=st.lists(EXPONENTS, min_size=2, max_size=8).map(lambda es: [10.0**e for e in es]),
       batch_size=st.sampled_from([1, 7, 64]), key=st.integers(0, 2**64 - 1))
def test_consecutive_batches_use_each_example_once(weights: list[float], batch_size: int, key: int) -> None:
    batches = np.arange(200)
    owners, indices = batch_assignments(weights, batch_size, batches, key)
    counts = mixture_counts(weights, batch_size, batches)
    for d in range(len(weights)):
        per_batch = (owners == d).sum(axis=1)
        assert np.array_equal(np.cumsum(per_batch), counts[:, d])
        # Row-major order is batch order then position order: 0, 1, 2, ... with no gap.
        assert np.array_equal(indices[owners == d], np.arange(counts[-1, d]))
    for b in (0, 1, 57, 199):
        one = batch_assignment(weights, batch_size, b, key)
        assert np.array_equal(one[0], owners[b]) and np.array_equal(one[1], indices[b])


def test_positions_are_shuffled_within_a_batch() -> None:
    sorted_batches = 0
    for seed in range(100):
        owners, _ = batch_assignment([0.5, 0.3, 0.2], 64, 10, seed)
        assert len(set(owners.tolist())) == 3
        sorted_batches += bool((np.diff(owners) >= 0).all())
    assert sorted_batches == 0
    first, _ = batch_assignment([0.5, 0.3, 0.2], 64, 10, 1)
    other, _ = batch_assignment([0.5, 0.3, 0.2], 64, 10, 2)
    assert not np.array_equal(first, other)


def test_assignment_is_frozen() -> None:
    owners, indices = batch_assignment([0.5, 0.3, 0.15, 0.05, 0.0, 1e-4], 16, 3, 42)
    assert owners.tolist() == [0, 0, 1, 0, 0, 0, 2, 2, 0, 1, 1, 0, 0, 2, 1, 1]
    assert indices.tolist() == [24, 25, 14, 26, 27, 28, 7, 8, 29, 15, 16, 30, 31, 9, 17, 18]


STAGES = [Stage(0, [1, 1, 0]), Stage(5, [0, 1, 3]), Stage(9, [2, 0, 1])]


def test_stages_restart_counts_and_continue_indices() -> None:
    batch_size = 8
    owners, indices = staged_assignments(STAGES, batch_size, np.arange(30), key=3)
    for d in range(3):
        assert np.array_equal(indices[owners == d], np.arange((owners == d).sum()))
    # Inside a stage, each batch draws what that stage's own schedule draws at its relative batch.
    for stage, stop in zip(STAGES, [5, 9, 30]):
        relative = np.arange(stop - stage.start_step)
        counts = mixture_counts(stage.weights, batch_size, relative)
        before = np.vstack([np.zeros(3, np.int64), counts[:-1]])
        drawn = np.stack([(owners[stage.start_step:stop] == d).sum(axis=1) for d in range(3)], axis=1)
        assert np.array_equal(drawn, counts - before)
    assert not (owners[:5] == 2).any() and not (owners[5:9] == 0).any() and not (owners[9:] == 1).any()
    # Dataset 1 resumes in stage 2 after its stage-1 total, and batch 9 continues dataset 0.
    totals = stage_totals(STAGES, batch_size, np.array([5, 9]))
    assert indices[9][owners[9] == 0].min() == totals[1, 0]
    one = staged_assignment(STAGES, batch_size, 12, key=3)
    assert np.array_equal(one[0], owners[12]) and np.array_equal(one[1], indices[12])


def test_a_single_stage_is_the_plain_mixture() -> None:
    for b in (0, 5, 99):
        a = batch_assignment([2, 1], 32, b, 9)
        s = staged_assignment([Stage(0, [2, 1])], 32, b, 9)
        assert np.array_equal(a[0], s[0]) and np.array_equal(a[1], s[1])


def _replay(stages: list[Stage], batch_size: int, sizes: list[int], strategy: str, limit: int = 100_000) -> int:
    """Stop step found by drawing batches one by one and watching each dataset's indices."""
    sizes_arr = np.array(sizes)
    final = np.asarray(stages[-1].weights) > 0
    drawn = np.zeros(len(sizes), np.int64)
    for m in range(limit):
        if strategy == "all_exhausted" and (drawn[final] >= sizes_arr[final]).all():
            return m
        owners, indices = staged_assignment(stages, batch_size, m, key=11)
        if strategy == "first_exhausted" and (indices >= sizes_arr[owners]).any():
            return m
        drawn += np.bincount(owners, minlength=len(sizes))
    raise AssertionError("never stopped")


@settings(max_examples=60, deadline=None)
@given(data=st.data(), datasets=st.integers(2, 4), batch_size=st.integers(1, 8))
def test_stop_step_matches_a_replay(data: st.DataObject, datasets: int, batch_size: int) -> None:
    weight = st.sampled_from([0.0, 0.1, 0.5, 1.0, 3.0])
    weights = st.lists(weight, min_size=datasets, max_size=datasets).filter(any)
    starts = sorted(set(data.draw(st.lists(st.integers(1, 30), max_size=2))))
    stages = [Stage(s, data.draw(weights)) for s in [0, *starts]]
    sizes = data.draw(st.lists(st.integers(0, 60), min_size=datasets, max_size=datasets))
    for strategy in ("first_exhausted", "all_exhausted"):
        assert stop_step(stages, batch_size, sizes, strategy) == _replay(stages, batch_size, sizes, strategy)
    assert stop_step(stages, batch_size, sizes, "restart") is None


def test_stop_step_scales_to_big_datasets() -> None:
    stages = [Stage(0, [0.9, 0.1])]
    sizes = [10**11, 10**9]
    first = stop_step(stages, 1024, sizes, "first_exhausted")
    every = stop_step(stages, 1024, sizes, "all_exhausted")
    totals = stage_totals(stages, 1024, np.array([first, first + 1, every - 1, every]))
    assert (totals[0] <= sizes).all() and (totals[1] > sizes).any()
    assert (totals[2] < sizes).any() and (totals[3] >= sizes).all()


@pytest.mark.parametrize("weights, message", [
    ([1.0, -0.5], "finite and >= 0"),
    ([1.0, float("nan")], "finite and >= 0"),
    ([1.0, float("inf")], "finite and >= 0"),
    ([0.0, 0.0], "all zero"),
    ([], "empty"),
])
def test_bad_weights_are_rejected(weights: list[float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        mixture_counts(weights, 4, np.arange(3))


def test_bad_stages_and_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="must start at step 0"):
        staged_assignment([Stage(1, [1, 1])], 4, 0, 0)
    with pytest.raises(ValueError, match="strictly increase"):
        staged_assignment([Stage(0, [1, 1]), Stage(5, [1, 2]), Stage(5, [2, 1])], 4, 0, 0)
    with pytest.raises(ValueError, match="same datasets"):
        staged_assignment([Stage(0, [1, 1]), Stage(5, [1, 2, 3])], 4, 0, 0)
    with pytest.raises(ValueError, match="at least one stage"):
        stop_step([], 4, [1], "first_exhausted")
    with pytest.raises(ValueError, match="unknown stop strategy"):
        stop_step([Stage(0, [1, 1])], 4, [1, 1], "never")
    with pytest.raises(ValueError, match="2 dataset sizes for 3"):
        stop_step([Stage(0, [1, 1, 1])], 4, [1, 1], "all_exhausted")
    with pytest.raises(ValueError, match="batch index -2"):
        mixture_counts([1, 1], 4, np.array([-2]))
    with pytest.raises(ValueError, match="batch_size"):
        mixture_counts([1, 1], 0, np.array([0]))
    with pytest.raises(ValueError, match="past the supported"):
        mixture_counts([1, 1], 2, np.array([2**61]))
