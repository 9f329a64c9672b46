"""The reader's row-group cache: bounded, and each value computed once across threads."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from lakeloader.read.chunks import RowGroupCache


def test_threads_asking_together_compute_a_value_once() -> None:
    cache = RowGroupCache(1 << 20)
    calls = []
    start = threading.Barrier(8)

    def compute() -> np.ndarray:
        calls.append(threading.get_ident())
        time.sleep(0.05)   # long enough for every other thread to ask meanwhile
        return np.arange(10)

    results: list[np.ndarray] = []

    def ask() -> None:
        start.wait()
        results.append(cache.get(("group", 1), compute))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1
    assert len(results) == 8 and all(r is results[0] for r in results)
    assert cache.get(("group", 1), lambda: pytest.fail("cached values are not computed again")) is results[0]


def test_an_error_reaches_every_waiter_and_is_not_cached() -> None:
    cache = RowGroupCache(1 << 20)
    start = threading.Barrier(4)
    errors: list[BaseException] = []

    def failing() -> np.ndarray:
        time.sleep(0.05)
        raise OSError("chunk unreadable")

    def ask() -> None:
        start.wait()
        try:
            cache.get(("group", 2), failing)
        except OSError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(errors) == 4 and all("chunk unreadable" in str(e) for e in errors)
    assert cache.get(("group", 2), lambda: np.ones(3)).tolist() == [1, 1, 1]   # retried, not remembered


def test_the_cache_keeps_within_its_bytes_least_recently_used_first() -> None:
    cache = RowGroupCache(3 * 800)
    for key in range(3):
        cache.get((key,), lambda: np.zeros(100))   # 800 bytes each
    cache.get((0,), lambda: pytest.fail("0 is cached"))   # 0 is now the most recent
    cache.get((3,), lambda: np.zeros(100))             # evicts 1, the least recently used
    recomputed = []
    cache.get((1,), lambda: recomputed.append(1) or np.zeros(100))
    assert recomputed == [1]
    cache.get((0,), lambda: pytest.fail("0 stays: it was used after 1 and 2"))
