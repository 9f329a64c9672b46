"""Batches built ahead by background threads (feed/read_ahead.py): in order, never further ahead
than allowed, a failed step raised when reached, threads gone after close; a consumer that asks
again at once builds the batches itself, a slower one has them built ahead."""

from __future__ import annotations

import random
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lakeloader.feed.read_ahead import ReadAhead


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 5), st.integers(1, 4), st.integers(0, 30), st.integers(0, 40), st.integers(0, 2**32),
       st.lists(st.sampled_from([0.0, 0.0, 0.003]), min_size=1, max_size=8))
def test_steps_come_in_order_never_too_far_ahead(start: int, threads: int, ahead: int, taken: int,
                                                 seed: int, pauses: list[float]) -> None:
    """Whatever the consumer's pace (``pauses`` between asks, cycled: it builds some batches
    itself and has others built ahead, switching between the two). Build times come from a
    seeded generator of the test's own (how many steps get built depends on timing, so they
    are drawn from no generator of hypothesis's)."""
    rng = random.Random(seed)
    lock = threading.Lock()
    asked = [start]           # the step the consumer asked for last
    overreach: list[tuple[int, int]] = []

    def make(step: int) -> int:
        with lock:
            if step > asked[0] + ahead:
                overreach.append((step, asked[0]))
            delay = rng.random() * 0.002
        time.sleep(delay)
        return step * step

    stop = start + 25
    with ReadAhead(make, start, stop, ahead, threads, "test-read-ahead") as batches:
        got = []
        for _ in range(taken):
            with lock:
                asked[0] = start + len(got)
            try:
                got.append(next(batches))
            except StopIteration:
                break
            time.sleep(pauses[len(got) % len(pauses)])
    assert got == [step * step for step in range(start, min(stop, start + taken))]
    assert not overreach
    assert not [t for t in threading.enumerate() if t.name.startswith("test-read-ahead")]


def test_a_failed_step_raises_when_reached_after_the_steps_before_it() -> None:
    def make(step: int) -> int:
        if step == 3:
            raise ValueError("step 3 is broken")
        return step

    with ReadAhead(make, 0, None, 4, 2, "test-read-ahead-error") as batches:
        assert [next(batches) for _ in range(3)] == [0, 1, 2]
        with pytest.raises(ValueError, match="step 3 is broken"):
            next(batches)
        assert next(batches) == 4   # later steps still come (the loader stops at the error)


def test_close_ends_the_threads_and_the_iteration() -> None:
    started = threading.Event()

    def make(step: int) -> int:
        started.set()
        time.sleep(0.01)
        return step

    batches = ReadAhead(make, 0, None, 3, 3, "test-read-ahead-close")
    assert next(batches) == 0 and started.is_set()
    batches.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("test-read-ahead-close")]
    with pytest.raises(StopIteration):
        next(batches)


def _builders(pause: float, threads: int, steps: int = 30) -> list[str]:
    """The thread that built each of ``steps`` batches (each taking 10 ms) for a consumer that
    waits ``pause`` seconds between asks (GIL released, as a JAX step on an accelerator)."""
    built_by: dict[int, str] = {}

    def make(step: int) -> int:
        built_by[step] = threading.current_thread().name
        time.sleep(0.01)
        return step

    with ReadAhead(make, 0, steps, 2, threads, "test-read-ahead-pace") as batches:
        for step in range(steps):
            assert next(batches) == step
            if pause:
                time.sleep(pause)
    return [built_by[step] for step in range(steps)]


def test_a_consumer_that_asks_again_at_once_builds_its_batches_itself() -> None:
    """One builder thread only pays a handoff per batch to a consumer that does nothing between
    asks: after the first few steps (its pace unknown) the consumer's thread builds them (nearly
    all: a consumer descheduled on a loaded machine may look slow for a step or two)."""
    later = _builders(0.0, threads=1)[5:]
    assert later.count(threading.current_thread().name) >= 0.8 * len(later), later


def test_a_slower_consumer_has_its_batches_built_ahead() -> None:
    assert set(_builders(0.05, threads=1, steps=15)[5:]) == {"test-read-ahead-pace-0"}


def test_several_threads_always_build_ahead() -> None:
    """Several threads overlap each other (an object store's downloads), whatever the consumer's pace."""
    assert threading.current_thread().name not in _builders(0.0, threads=2, steps=15)
