"""One least-recently-used cache for every reader cache: bounded by a count or by bytes, each
value computed once even when threads ask for it together."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class _Pending:
    """A value one thread is computing while others wait for it."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: object = None
        self.error: BaseException | None = None


class LRU(Generic[K, V]):
    """Values by key, at most ``capacity`` in total ``size`` (1 per value unless ``size`` says,
    e.g. bytes); the least recently used go first, though the newest value always stays.

    :meth:`get` computes a missing value once: threads asking for the same key meanwhile wait
    for the first instead of computing it again; an error reaches every waiter and is not kept.
    """

    def __init__(self, capacity: int, size: Callable[[V], int] | None = None) -> None:
        self.capacity = capacity
        self._size = size
        self._items: collections.OrderedDict[K, tuple[V, int]] = collections.OrderedDict()
        self._pending: dict[K, _Pending] = {}
        self._total = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._items

    def clear(self) -> None:
        """Drop every cached value (one being computed is cached when done)."""
        with self._lock:
            self._items.clear()
            self._total = 0

    def cached(self, keys: list[K]) -> list[V | None]:
        """The values cached under ``keys`` (None where missing; nothing computed), each marked
        as just used, as :meth:`get` would: many lookups under one lock."""
        found: list[V | None] = []
        with self._lock:
            for key in keys:
                item = self._items.get(key)
                if item is not None:
                    self._items.move_to_end(key)
                found.append(None if item is None else item[0])
        return found

    def get(self, key: K, compute: Callable[[], V]) -> V:
        """The value cached under ``key``, computed by ``compute()`` (once) if missing."""
        with self._lock:
            found = self._items.get(key)
            if found is not None:
                self._items.move_to_end(key)
                return found[0]
            pending = self._pending.get(key)
            owner = pending is None
            if pending is None:
                pending = self._pending[key] = _Pending()
        if not owner:
            pending.done.wait()
            if pending.error is not None:
                raise pending.error
            return pending.value  # type: ignore[return-value]
        try:
            value = compute()
            pending.value = value
            self._put(key, value)
            return value
        except BaseException as exc:
            pending.error = exc
            raise
        finally:
            with self._lock:
                del self._pending[key]
            pending.done.set()

    def _put(self, key: K, value: V) -> None:
        size = 1 if self._size is None else self._size(value)
        with self._lock:
            if key in self._items:
                return
            self._items[key] = (value, size)
            self._total += size
            while self._total > self.capacity and len(self._items) > 1:
                _, (_, evicted) = self._items.popitem(last=False)
                self._total -= evicted
