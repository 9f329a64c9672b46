"""Batch rows and the examples that fill them: one ``fill(row)`` protocol for every kind of
example (concat spans, packed documents), and where each row's segments came from."""

from __future__ import annotations

import abc
import dataclasses
import math
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any, overload

import numpy as np

from lakeloader.contracts.specs import ROW_FIELDS

Batch = dict[str, np.ndarray]


@dataclasses.dataclass
class Row:
    """Views of one row of each batch array (filled in place)."""

    input_ids: np.ndarray
    targets: np.ndarray
    loss_mask: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray
    extra: dict[str, np.ndarray]     # task fields: image_refs, image_positions, inputs_*, ...


def row_of(batch: Batch, number: int) -> Row:
    """Views of row ``number`` of every array of ``batch``; a row field the batch does not have
    (``loader.fields``) is a throwaway row, written and dropped."""
    length = batch["input_ids"].shape[1]
    return Row(*(batch[k][number] if k in batch else np.empty(length, field_dtype(k)) for k in ROW_FIELDS),
               {k: batch[k][number] for k in batch if k not in ROW_FIELDS})


def field_dtype(name: str) -> type:
    """The dtype of row field ``name``: float32 for the loss mask, int32 for the others."""
    return np.float32 if name == "loss_mask" else np.int32


def segment_fields(batch: Batch) -> list[str]:
    """Which of the fields made from where documents start (segment ids, positions) ``batch``
    has (``loader.fields``): none, and those starts need not be found."""
    return [name for name in ("segment_ids", "positions") if name in batch]


@dataclasses.dataclass(frozen=True)
class Segment:
    """One segment of an example's row: tokens of one document from one chunk."""

    number: int             # the row's segment id (1, 2, ...)
    chunk: int              # global index of the chunk
    document: int           # document index within the chunk
    example_start: int      # token range within the example
    example_stop: int
    span: dict[str, int]    # where the tokens lie in their chunk or document, by column name


@dataclasses.dataclass
class Example(abc.ABC):
    """One example of a dataset with its provenance; it writes its own batch row."""

    dataset: str
    epoch: int
    example: int            # example number within the dataset's epoch (or ideal reader stream)

    @abc.abstractmethod
    def fill(self, row: Row) -> None:
        """Write the example into the views of one batch row."""

    @classmethod
    def fill_rows(cls, batch: Batch, rows: list[int], examples: Sequence[Example]) -> None:
        """Write ``examples`` (all of this kind) into rows ``rows`` of ``batch``; the same as
        each one's :meth:`fill` of its row (a kind may do it for all rows at once)."""
        for number, example in zip(rows, examples):
            example.fill(row_of(batch, number))

    @abc.abstractmethod
    def segments(self) -> list[Segment]:
        """The example's segments in row order."""


class ExampleRun(Sequence[Example]):
    """Examples ``examples`` (of epochs ``epochs``) of one dataset, located together for rows 0,
    1, ... of a batch (a dataset's share of a training batch when it has every row): the batch
    fills their rows at once (:meth:`fill_all`), and an object per example is made only when one
    is asked for (provenance)."""

    def __init__(self, dataset: str, epochs: np.ndarray, examples: np.ndarray) -> None:
        self.dataset = dataset
        self.epochs = epochs
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    @overload
    def __getitem__(self, k: int) -> Example: ...

    @overload
    def __getitem__(self, k: slice) -> list[Example]: ...

    def __getitem__(self, k: int | slice) -> Example | list[Example]:
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        if not -len(self) <= k < len(self):
            raise IndexError(f"example {k} of {len(self)}")
        k %= len(self)
        return self.example(k, int(self.epochs[k]), int(self.examples[k]))

    @abc.abstractmethod
    def example(self, k: int, epoch: int, example: int) -> Example:
        """The object of example ``k`` of the run (``example`` of epoch ``epoch``)."""

    @abc.abstractmethod
    def fill_all(self, batch: Batch) -> None:
        """Write example ``k`` into row ``k`` of ``batch`` for every ``k``: what each one's
        :meth:`Example.fill` of its row writes."""


def fill_batch(batch: Batch, examples: Sequence[Example | None]) -> None:
    """Write example ``i`` into row ``i`` of ``batch`` (None leaves the row as it is), each kind
    of example filling its rows together (:meth:`Example.fill_rows`; an :class:`ExampleRun`
    fills them all at once)."""
    if isinstance(examples, ExampleRun):
        examples.fill_all(batch)
        return
    one = type(examples[0]) if examples else type(None)
    if one is not type(None) and all(type(example) is one for example in examples):   # one kind, no gaps
        one.fill_rows(batch, list(range(len(examples))), examples)  # type: ignore[arg-type]
        return
    kinds: dict[type[Example], tuple[list[int], list[Example]]] = {}
    for number, example in enumerate(examples):
        if example is not None:
            rows, found = kinds.setdefault(type(example), ([], []))
            rows.append(number)
            found.append(example)
    for kind, (rows, found) in kinds.items():
        kind.fill_rows(batch, rows, found)


@dataclasses.dataclass(frozen=True)
class StepExamples:
    """The examples of one batch step on one process (``Loader.examples``), with what is needed
    to say where they came from."""

    step: int
    rows: np.ndarray                    # global row number (within the batch) of each local row
    examples: list[Example | None]      # each local row's example; None: past an evaluation pass
    shards: dict[str, Mapping[int, int]]  # per dataset: shard index of each committed chunk
    dataset_ids: np.ndarray             # each local row's dataset position (-1: padding), as in batches


PAGE = 4096
STAGGER = 9 * 64   # bytes between the page offsets of successively made arrays (whole cache lines)


class ArraySource(abc.ABC):
    """Where a batch's arrays come from (:meth:`~lakeloader.feed.loader.Loader.batch`): memory
    nobody else holds, with unspecified contents."""

    @abc.abstractmethod
    def empty(self, shape: tuple[int, ...], dtype: type | np.dtype) -> np.ndarray:
        """An array of ``shape`` and ``dtype`` with unspecified contents that nobody else holds."""

    def empty_fields(self, shape: tuple[int, ...], dtypes: Sequence[type | np.dtype]) -> list[np.ndarray]:
        """An array of ``shape`` for each of ``dtypes`` (a batch's fields), as :meth:`empty` makes them."""
        return [self.empty(shape, dtype) for dtype in dtypes]

    def full(self, shape: tuple[int, ...], value: Any, dtype: type | np.dtype) -> np.ndarray:
        """:meth:`empty` filled with ``value``."""
        found = self.empty(shape, dtype)
        found.fill(value)
        return found


class ArrayPool(ArraySource):
    """Arrays for batches, each handed out again only once nothing outside the pool refers to it
    (no array, view, buffer or dict of the caller's): a caller never sees memory it holds reused,
    yet batches after the first cost no fresh memory (whose page faults cost more than filling
    it). The arrays of one :meth:`empty_fields` call share one allocation, reused once none of
    them is referred to (one look-up a batch, not one a field). Successive arrays start at
    different offsets within a page: arrays of a batch's size all start at the same page offset
    otherwise, and copying between two of them with a shift of a few bytes (targets from inputs)
    stalls on 4K aliasing, several times slower. Thread-safe."""

    def __init__(self, keep: int = 64) -> None:
        self.keep = keep    # allocations kept per shape and dtypes
        # Per shape and dtypes (as asked): each allocation (owned by the pool) and where its arrays start in it.
        self._kept: dict[tuple[tuple[int, ...], tuple[type | np.dtype, ...]], list[tuple[np.ndarray, list[int]]]] = {}
        self._made = 0
        self._lock = threading.Lock()

    def empty(self, shape: tuple[int, ...], dtype: type | np.dtype) -> np.ndarray:
        """An array of ``shape`` and ``dtype`` with unspecified contents that nobody else holds."""
        return self.empty_fields(shape, (dtype,))[0]

    def empty_fields(self, shape: tuple[int, ...], dtypes: Sequence[type | np.dtype]) -> list[np.ndarray]:
        """An array of ``shape`` for each of ``dtypes``, with unspecified contents, that nobody
        else holds: one allocation, handed out again once none of them is held."""
        key = (shape, tuple(dtypes))
        with self._lock:
            kept = self._kept.setdefault(key, [])
            for i in range(len(kept)):
                # Free when only the pool's tuple and this call's argument refer to the memory
                # (every view of a handed-out array refers to it as its base).
                if sys.getrefcount(kept[i][0]) == 2:
                    owner, starts = kept[i]
                    return [np.ndarray(shape, dtype, owner, start) for dtype, start in zip(dtypes, starts)]
            extents = [-(-math.prod(shape) * np.dtype(dtype).itemsize // PAGE) * PAGE + PAGE for dtype in dtypes]
            owner = np.empty(sum(extents) + PAGE, np.uint8)
            starts, at = [], -owner.ctypes.data % PAGE
            for extent in extents:
                starts.append(at + self._made * STAGGER % PAGE)
                self._made += 1
                at += extent
            if len(kept) < self.keep:
                kept.append((owner, starts))
            return [np.ndarray(shape, dtype, owner, start) for dtype, start in zip(dtypes, starts)]
