"""A worker's ring of shared-memory slots (``loader.workers``, :mod:`lakeloader.feed.workers`):
each batch is built in its slot's memory where the slot's previous batch had its fields, and put
there copying only what is not in place yet."""

from __future__ import annotations

import threading
from multiprocessing import shared_memory

import numpy as np

from lakeloader.feed.rows import PAGE, STAGGER, ArrayPool, ArraySource, Batch

ALIGN = 64
Layout = list[tuple[str, str, tuple[int, ...], int]]   # (field, dtype, shape, offset in the slot)


def field_of(memory: np.ndarray, offset: int, dtype: np.dtype | str, shape: tuple[int, ...]) -> np.ndarray:
    """The array of ``dtype`` and ``shape`` at byte ``offset`` of ``memory`` (a view: its base is
    ``memory``; one constructor call, a third of a slice's, view's and reshape's cost)."""
    return np.ndarray(shape, dtype, memory, offset)


class SlotArrays(ArraySource):
    """Arrays of a batch placed in a slot's memory where its previous batch had a field of the
    same shape and dtype (the write that follows then copies nothing); others from ``fallback``."""

    def __init__(self, memory: np.ndarray | None, layout: Layout, fallback: ArrayPool) -> None:
        self.memory = memory   # the slot's segment as bytes (None: it has none yet)
        self.places = [] if memory is None else [(np.dtype(dtype), tuple(shape), offset)
                                                  for _, dtype, shape, offset in layout]
        self.fallback = fallback
        self.placed: dict[int, tuple[np.ndarray, int]] = {}   # by id: each array placed, its offset

    def empty(self, shape: tuple[int, ...], dtype: type | np.dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        for number, (kind, dims, offset) in enumerate(self.places):
            if kind == dtype and dims == tuple(shape):
                del self.places[number]
                assert self.memory is not None
                found = field_of(self.memory, offset, dtype, shape)
                self.placed[id(found)] = (found, offset)   # (the array kept: its id stays its own)
                return found
        return self.fallback.empty(shape, dtype)

    def forget(self) -> None:
        """Drop every reference to the slot's memory (it is about to be replaced)."""
        self.memory, self.places, self.placed = None, [], {}

    def offset_of(self, values: np.ndarray) -> int | None:
        """Where in the slot ``values`` was placed (None: not one of this pool's arrays)."""
        found = self.placed.get(id(values))
        return None if found is None or found[0] is not values else found[1]


class Slots:
    """A worker's ring of shared-memory slots (grown when a batch does not fit). A batch is built
    in its slot (:meth:`pool`) and then written there (:meth:`write`: only what is not in place
    yet is copied)."""

    def __init__(self, prefix: str, worker: int, ring: int) -> None:
        self.prefix, self.worker = prefix, worker
        self.segments: list[shared_memory.SharedMemory | None] = [None] * ring
        self.memory: list[np.ndarray | None] = [None] * ring      # each segment as bytes
        self.layouts: list[Layout] = [[] for _ in range(ring)]    # each slot's last batch
        self.generation = 0
        self.lock = threading.Lock()
        self.fallback = ArrayPool()

    def pool(self, slot: int) -> SlotArrays:
        """Where the next batch for ``slot`` is built: its previous batch's places in the slot."""
        return SlotArrays(self.memory[slot], self.layouts[slot], self.fallback)

    def write(self, slot: int, batch: Batch, built: SlotArrays | None = None) -> tuple[str, Layout, dict[str, np.ndarray]]:
        """Put ``batch``'s numeric fields in ``slot``, copying those not ``built`` there (by
        :meth:`pool`): (segment name, layout, object fields). Fields built in the slot are
        replaced in ``batch`` by copies when the slot has to grow (its segment is then removed)."""
        memory = self.memory[slot]
        placed = {} if built is None or memory is None or built.memory is not memory else {
            name: offset for name, values in batch.items() if (offset := built.offset_of(values)) is not None}
        layout, objects, size = _layout(batch, placed)
        with self.lock:
            segment = self.segments[slot]
            if segment is None or segment.size < max(size, 1):
                # Out of the segment about to be removed: nothing may refer to it when it is closed.
                for name in placed:
                    batch[name] = batch[name].copy()
                if built is not None:
                    built.forget()
                placed = {}
                layout, objects, size = _layout(batch, placed)
                self.memory[slot] = memory = None
                if segment is not None:
                    segment.close()
                    segment.unlink()
                self.generation += 1
                name = f"{self.prefix}_{self.worker}_{slot}_{self.generation}"
                segment = self.segments[slot] = shared_memory.SharedMemory(name, create=True, size=max(size, 1))
                # (frombuffer holds the segment's buffer: closing it while arrays over it live
                # raises instead of unmapping memory they point to)
                self.memory[slot] = memory = np.frombuffer(segment.buf, np.uint8)
        assert memory is not None
        for field, dtype, shape, offset in layout:
            if field not in placed:
                values = batch[field]
                field_of(memory, offset, values.dtype, shape)[...] = values
        self.layouts[slot] = layout
        return segment.name, layout, objects

    def unlink_all(self) -> None:
        """Remove every segment of the ring (idempotent; called by the worker and its watchdog)."""
        with self.lock:
            for number, segment in enumerate(self.segments):
                if segment is None:
                    continue
                self.segments[number] = None
                self.memory[number] = None
                try:
                    segment.unlink()
                except FileNotFoundError:
                    pass  # the consumer's cleanup removed it first
                try:
                    segment.close()
                except BufferError:
                    pass  # a batch being built or written still maps it; the mapping ends with the process


def _layout(batch: Batch, placed: dict[str, int]) -> tuple[Layout, dict[str, np.ndarray], int]:
    """(layout of ``batch``'s numeric fields, its object fields, bytes needed): fields ``placed``
    where they are, the others after them, :data:`ALIGN`-aligned and staggered (see
    :class:`~lakeloader.feed.rows.ArrayPool`: fields at one page offset copy slowly between each other)."""
    layout: Layout = []
    objects: dict[str, np.ndarray] = {}
    size = max((offset + batch[name].nbytes for name, offset in placed.items()), default=0)
    for name, values in batch.items():
        if values.dtype == object:
            objects[name] = values
        elif name in placed:
            layout.append((name, values.dtype.str, values.shape, placed[name]))
        else:
            offset = -(-size // ALIGN) * ALIGN + len(layout) * STAGGER % PAGE
            layout.append((name, values.dtype.str, values.shape, offset))
            size = offset + values.nbytes
    return layout, objects, size
