"""Batches built ahead of the consumer by background threads, handed out in order.

Each thread loops: claim the next step (at most ``ahead`` past the one the consumer waits for),
build it, leave it for the consumer. No task is queued per batch: a thread goes on to the next
step as soon as it may, and the consumer is woken only when the batch it waits for is there
(measured against a thread pool given one task per batch: docs/performance-history.md).

One builder thread only overlaps batches with the consumer's own time between asks. A consumer
that asks again at once (it only takes batches) gains nothing from it and pays the handoff (it
waits, is woken and takes the GIL back for every batch), so while its time between asks stays
under :data:`INLINE_SHARE` of a batch's build time it builds the steps nobody has claimed
itself; the thread takes over again as soon as the consumer takes longer. Several threads (an
object store's downloads) always build ahead: they overlap each other."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")

INLINE_SHARE = 0.25   # a single builder's consumer builds inline below this gap / build time
_SMOOTHING = 0.25     # weight of the newest measurement in the running means


class ReadAhead(Generic[T]):
    """``make(step)`` for ``step = start, start + 1, ...`` (up to ``stop``, None: no end), built
    by ``threads`` threads named ``name-N`` no more than ``ahead`` steps past the one the consumer
    last asked for (the batch in its hands), handed out in step order; a step whose ``make`` raised
    raises when reached. With one thread, a consumer that asks again at once builds unclaimed
    steps itself (module docstring). :meth:`close` (or leaving a ``with`` block) stops the
    threads once their batch at hand is built."""

    def __init__(self, make: Callable[[int], T], start: int, stop: int | None, ahead: int, threads: int,
                 name: str) -> None:
        self._make = make
        self._stop = stop
        self._ahead = ahead
        self._next_wanted = start      # the step the consumer takes next
        self._asked = start            # the step the consumer asked for last
        self._next_claimed = start     # the step the next builder (a thread or the consumer) builds
        self._done: dict[int, tuple[T | None, BaseException | None]] = {}
        self._closed = False
        self._inline = False           # the consumer builds the unclaimed steps; threads wait
        self._build_seconds: float | None = None   # running mean of one batch's build
        self._gap_seconds: float | None = None     # running mean of the consumer's time between asks
        self._returned_at: float | None = None
        self._changed = threading.Condition()
        self._threads = [threading.Thread(target=self._build, name=f"{name}-{i}", daemon=True)
                         for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def _claim(self) -> int | None:
        """The next step for a thread to build, once it may; None once closed or past the end."""
        with self._changed:
            while True:
                if self._closed or (self._stop is not None and self._next_claimed >= self._stop):
                    return None
                if not self._inline and self._next_claimed <= self._asked + self._ahead:
                    self._next_claimed += 1
                    return self._next_claimed - 1
                self._changed.wait()

    def _timed_make(self, step: int) -> tuple[T | None, BaseException | None]:
        started = time.perf_counter()
        try:
            done: tuple[T | None, BaseException | None] = (self._make(step), None)
        except BaseException as exc:   # raised to the consumer when it reaches this step
            done = (None, exc)
        self._build_seconds = _running_mean(self._build_seconds, time.perf_counter() - started)
        return done

    def _build(self) -> None:
        while (step := self._claim()) is not None:
            done = self._timed_make(step)
            with self._changed:
                self._done[step] = done
                self._changed.notify_all()

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        if self._returned_at is not None:
            self._gap_seconds = _running_mean(self._gap_seconds, time.perf_counter() - self._returned_at)
        with self._changed:
            step = self._next_wanted
            if self._closed or (self._stop is not None and step >= self._stop):
                raise StopIteration
            self._asked = step
            self._next_wanted += 1
            inline = len(self._threads) == 1 and self._build_seconds is not None and self._gap_seconds is not None and (
                self._gap_seconds < INLINE_SHARE * self._build_seconds)
            self._inline = inline
            here = inline and step not in self._done and self._next_claimed == step
            if here:
                self._next_claimed += 1
            else:
                self._changed.notify_all()
                while step not in self._done:
                    self._changed.wait()
                value, error = self._done.pop(step)
        if here:
            value, error = self._timed_make(step)
        self._returned_at = time.perf_counter()
        if error is not None:
            raise error
        return value  # type: ignore[return-value]

    def close(self) -> None:
        """Stop building: each thread finishes the batch at hand and ends; waits for them."""
        with self._changed:
            self._closed = True
            self._done.clear()
            self._changed.notify_all()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join()
        self._done.clear()   # a batch a thread finished after the first clear

    def __enter__(self) -> ReadAhead[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _running_mean(mean: float | None, value: float) -> float:
    return value if mean is None else mean + _SMOOTHING * (value - mean)
