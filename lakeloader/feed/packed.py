"""The fill part of ``packing: pack | pad``: examples of whole documents (located by
:mod:`lakeloader.feed.locate_packed`), with the images of interleaved documents and the
prompt/response split of seq2seq ones, writing their batch rows one by one or all rows of a
batch at once."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from lakeloader.feed.rows import Batch, Example, ExampleRun, Row, Segment, field_dtype
from lakeloader.index.ranges import cumulative, fill_runs, run_positions, run_indices
from lakeloader.index.row_layout import RowLayout, row_layout
from lakeloader.read.span_set import RenderedGroup


@dataclasses.dataclass
class Item:
    """One document (or a piece of one) inside a packed example."""

    chunk: int
    doc: int                    # document index within the chunk
    start: int                  # rendered token range of the document
    stop: int
    tokens: np.ndarray          # rendered tokens [start, stop] (one more for the last target, if any)
    trainable: np.ndarray | None    # None: every token is a target (plain text)
    images: list[tuple[int, str]]   # (offset of the image run within the item, reference)
    split: int                  # rendered offset where the response starts (seq2seq), else -1


@dataclasses.dataclass
class PackedSet:
    """The items of packed examples located together (:meth:`~lakeloader.feed.locate_packed.PackedLocator.located`), as
    arrays: example ``i``'s items are ``layout.bounds[i] : layout.bounds[i + 1]``; item ``k`` is
    tokens ``[begin[k], end[k])`` of ``groups[group[k]]`` (one more than it writes when the
    document goes on). A batch is filled from these without an :class:`Item` per document."""

    groups: list[RenderedGroup]     # the rendered row groups the items lie in, each once
    layout: RowLayout               # where the items go in the examples' rows
    chunk: np.ndarray               # int64 per item: global chunk index
    doc: np.ndarray                 # int64 per item: document within the chunk
    start: np.ndarray               # int64 per item: rendered token range within the document
    stop: np.ndarray
    group: np.ndarray               # int64 per item: index into ``groups``
    begin: np.ndarray               # int64 per item: token range within its row group
    end: np.ndarray
    joined: np.ndarray              # bool per item but the last: the next item continues it (LocatedItems)

    def items(self, i: int) -> list[Item]:
        """Example ``i``'s items."""
        a, b = self.layout.bounds[i : i + 2].tolist()
        made = []
        for chunk, doc, start, stop, group, lo, hi in zip(*(field[a:b].tolist() for field in (
                self.chunk, self.doc, self.start, self.stop, self.group, self.begin, self.end))):
            rendered = self.groups[group]
            made.append(Item(chunk, doc, start, stop, rendered.tokens[lo:hi],
                             None if rendered.trainable is None else rendered.trainable[lo:hi], [], -1))
        return made

    def fill_parts(self, which: list[int] | None, pad_id: int) -> FillParts:
        """:class:`FillParts` of examples ``which`` (None: every example, in order), the items
        :meth:`items` would make; with every example, items that continue each other (``joined``)
        are one piece."""
        layout, joined = self.layout, self.joined
        if which is None:   # every item, in order
            begin, group, end = self.begin, self.group, self.end
        else:
            which_ = np.asarray(which, np.int64)
            counts = layout.counts[which_]
            items = run_indices(layout.bounds[which_], counts)
            layout = row_layout(counts, layout.sizes[items], layout.length)
            begin, group, end, joined = self.begin[items], self.group[items], self.end[items], None
        sizes = layout.sizes
        after = begin + sizes   # where each item's next token lies in its row group, if it holds one
        has_next = end > after   # (only the items of a document cut at a row's end do)
        ahead = has_next.nonzero()[0]   # (the methods: numpy's wrappers cost more than these small arrays' work)
        every_token = [rendered.tokens for rendered in self.groups]
        next_token = np.empty(len(sizes), np.int32)
        next_token.fill(pad_id)
        next_token[ahead] = _picked(every_token, group[ahead], after[ahead], pad_id)
        first = None   # each item a piece
        if joined is not None and joined.any():   # (a long document's rows, read in order)
            # The pieces' first items, then the end.
            bounds = np.concatenate((_ONE_TRUE, ~joined, _ONE_TRUE)).nonzero()[0]
            first = bounds[:-1]
            ends = cumulative(sizes)[bounds]
            where, at, lengths = group[first].tolist(), begin[first].tolist(), (ends[1:] - ends[:-1]).tolist()
        else:
            where, at, lengths = group.tolist(), begin.tolist(), sizes.tolist()
        tokens = [every_token[g][a : a + size] for g, a, size in zip(where, at, lengths)]
        if all(r.trainable is None for r in self.groups):
            return FillParts(layout, tokens, None, next_token, has_next, first)
        everything = np.ones(max(lengths, default=0), bool)
        every_flag = [r.trainable for r in self.groups]
        flags = [every_flag[g] for g in where]
        trainable = [everything[:size] if f is None else f[a : a + size] for f, a, size in zip(flags, at, lengths)]
        last_mask = has_next.copy()
        last_mask[ahead] = _picked(every_flag, group[ahead], after[ahead], True)
        return FillParts(layout, tokens, trainable, next_token, last_mask, first)


_ONE_TRUE = np.ones(1, bool)
FEW_GATHERS = 4   # row groups up to which _picked gathers from each (a few calls each) rather than item by item


def _picked(arrays: list[np.ndarray | None], which: np.ndarray, at: np.ndarray, missing: Any) -> Any:
    """``arrays[which[k]][at[k]]`` for each ``k`` (``missing`` where that array is None): a
    gather per array when there are few (a batch read in order lies in one or two row groups),
    else item by item (a shuffled batch's items lie in up to one row group each)."""
    if len(arrays) == 1:
        return missing if arrays[0] is None else arrays[0][at]
    if len(arrays) <= FEW_GATHERS:
        present = [(g, values) for g, values in enumerate(arrays) if values is not None]
        if not present:
            return missing
        found = np.full(len(at), missing, present[0][1].dtype)
        for g, values in present:
            mine = which == g
            found[mine] = values[at[mine]]
        return found
    return [missing if arrays[g] is None else arrays[g][a] for g, a in zip(which.tolist(), at.tolist())]


class LazyItems(Sequence[Item]):
    """The items of example ``index`` of a :class:`PackedSet`, made on first use (filling a
    batch reads the set's arrays instead)."""

    def __init__(self, located: PackedSet, index: int) -> None:
        self.located = located
        self.index = index
        self._made: list[Item] | None = None

    def _items(self) -> list[Item]:
        if self._made is None:
            self._made = self.located.items(self.index)
        return self._made

    def __len__(self) -> int:
        return int(self.located.layout.counts[self.index])

    def __getitem__(self, i):  # type: ignore[no-untyped-def, override]
        return self._items()[i]

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._items())

    def __repr__(self) -> str:
        return repr(self._items())


@dataclasses.dataclass
class PackedExample(Example):
    """An example of whole documents (``packing: pack | pad``) with provenance."""

    items: Sequence[Item]       # a list, or :class:`LazyItems` of a batch located together
    pad_id: int = 0             # the loader's padding token (written by :func:`fill_packed`)

    def fill(self, row: Row) -> None:
        """Write the example into a batch row: items back to back, each its own segment with
        positions from 0; a target is the next token of the same document."""
        if "inputs" in row.extra:
            return self._fill_seq2seq(row)
        at = 0
        for number, item in enumerate(self.items, start=1):
            n = item.stop - item.start
            row.input_ids[at : at + n] = item.tokens[:n]
            targets = item.tokens[1 : n + 1]
            row.targets[at : at + len(targets)] = targets
            row.loss_mask[at : at + len(targets)] = 1 if item.trainable is None else item.trainable[1 : n + 1]
            row.segment_ids[at : at + n] = number
            row.positions[at : at + n] = np.arange(n, dtype=np.int32)
            if "image_refs" in row.extra:
                filled = int((row.extra["image_positions"] >= 0).sum())
                for offset, ref in item.images:
                    row.extra["image_positions"][filled] = at + offset
                    row.extra["image_refs"][filled] = ref
                    filled += 1
            at += n

    @classmethod
    def fill_rows(cls, batch: Batch, rows: list[int], examples: Sequence[Example]) -> None:
        """All packed examples' rows at once (:func:`fill_packed`); seq2seq rows one by one."""
        if "inputs" in batch:
            return super().fill_rows(batch, rows, examples)
        fill_packed(batch, rows, examples)  # type: ignore[arg-type]

    def segments(self) -> list[Segment]:
        """A segment per item, in row order."""
        found: list[Segment] = []
        offset = 0
        for number, item in enumerate(self.items, start=1):
            length = item.stop - item.start
            span = {"document_start": item.start, "document_stop": item.stop}
            if item.images:   # (interleaved: the images the segment places)
                span["images"] = len(item.images)
            found.append(Segment(number, item.chunk, item.doc, offset, offset + length, span))
            offset += length
        return found

    def _fill_seq2seq(self, row: Row) -> None:
        extra, at_in, at_out = row.extra, 0, 0
        for number, item in enumerate(self.items, start=1):
            cut = min(max(item.split - item.start, 0), item.stop - item.start)
            prompt, response = item.tokens[:cut], item.tokens[cut : item.stop - item.start]
            extra["inputs"][at_in : at_in + len(prompt)] = prompt
            extra["inputs_segment_ids"][at_in : at_in + len(prompt)] = number
            extra["inputs_positions"][at_in : at_in + len(prompt)] = np.arange(len(prompt))
            row.targets[at_out : at_out + len(response)] = response
            row.input_ids[at_out + 1 : at_out + len(response)] = response[:-1]  # decoder inputs
            row.loss_mask[at_out : at_out + len(response)] = 1.0
            row.segment_ids[at_out : at_out + len(response)] = number
            row.positions[at_out : at_out + len(response)] = np.arange(len(response))
            at_in, at_out = at_in + len(prompt), at_out + len(response)


class FillParts(NamedTuple):
    """What :func:`fill_packed` writes, per example, per item and per piece (consecutive items
    copied as one view), without an object per item."""

    layout: RowLayout               # where the items go (their sizes: stop - start)
    tokens: list[np.ndarray]        # each piece's input tokens (views): items first[p] to first[p + 1] - 1
    trainable: list[np.ndarray] | None  # each piece's target flags; None: all targets
    next_token: np.ndarray          # int32: target of each item's last token (pad_id past the document)
    last_mask: np.ndarray           # bool: loss mask of each item's last token
    first: np.ndarray | None = None     # int64: each piece's first item (None: a piece per item)

    def part(self, a: int, b: int) -> FillParts:
        """The parts of examples ``a`` to ``b`` alone (slices), whose first item begins a piece
        and whose last ends one (pieces cut there: :meth:`~lakeloader.feed.locate_packed.LocatedItems.cut`)."""
        lo, hi = self.layout.bounds[[a, b]].tolist()
        p, q, first = lo, hi, self.first
        if first is not None:
            p, q = first.searchsorted((lo, hi)).tolist()
            first = first[p:q] - lo
        trainable = None if self.trainable is None else self.trainable[p:q]
        return FillParts(self.layout.part(a, b), self.tokens[p:q], trainable, self.next_token[lo:hi],
                         self.last_mask[lo:hi], first)


def _parts_of_items(examples: Sequence[PackedExample], pad_id: int, length: int) -> FillParts:
    """:class:`FillParts` of examples given by their :class:`Item` lists, in rows of ``length``."""
    items = [item for example in examples for item in example.items]
    counts = np.array([len(example.items) for example in examples], np.int64)
    sizes = np.array([item.stop - item.start for item in items], np.int64)
    lengths = sizes.tolist()
    has_next = [len(item.tokens) > size for item, size in zip(items, lengths)]
    trainable = None
    last_mask = has_next
    if any(item.trainable is not None for item in items):
        everything = np.ones(max(lengths, default=0), bool)
        trainable = [everything[:size] if item.trainable is None else item.trainable[:size]
                     for item, size in zip(items, lengths)]
        last_mask = [more and (item.trainable is None or bool(item.trainable[size]))
                     for item, size, more in zip(items, lengths, has_next)]
    next_token = [int(item.tokens[size]) if more else pad_id for item, size, more in zip(items, lengths, has_next)]
    return FillParts(row_layout(counts, sizes, length), [item.tokens[:size] for item, size in zip(items, lengths)],
                     trainable,
                     np.array(next_token, np.int32), np.array(last_mask, bool))


def fill_packed(batch: Batch, rows: list[int], examples: Sequence[PackedExample]) -> None:
    """Write packed examples into rows ``rows`` of ``batch`` at once, padding included, as each
    one's :meth:`PackedExample.fill` into a padded row. Each field is written once for all rows,
    from one layout of runs tiling them (each row's items, its last item's run reaching over the
    row's padding, if any: :class:`~lakeloader.index.row_layout.RowLayout`): inputs by one
    concatenation of views (the items' tokens where they lie in their rendered row groups, items
    that continue each other there and in the rows as one view; a constant run for each padded
    row's padding), segment ids and positions run by run, then zero over the few padded rows'
    tails, and targets and loss masks as the inputs shifted by one, corrected at each item's last
    token (the document's next token, or padding at its end). Examples located together
    (:class:`PackedSet`) are read from its arrays, without an :class:`Item` per document."""
    if not examples:
        return
    pad_id = examples[0].pad_id
    length = batch["input_ids"].shape[1]
    sources: dict[int, tuple[PackedSet | None, list[int]]] = {}   # by located set (None: Item lists)
    for i, example in enumerate(examples):
        located = example.items.located if isinstance(example.items, LazyItems) else None
        sources.setdefault(id(located), (located, []))[1].append(i)
    found = [_parts_of_items([examples[i] for i in mine], pad_id, length) if located is None else
             located.fill_parts([examples[i].items.index for i in mine], pad_id)  # type: ignore[attr-defined]
             for located, mine in sources.values()]
    parts = found[0] if len(found) == 1 else _merged(found, [mine for _, mine in sources.values()], len(examples),
                                                     length)
    _write_packed(batch, rows, parts, pad_id)
    if "image_refs" in batch:   # few: only the items of interleaved documents carry images
        firsts, in_row = parts.layout.bounds[:-1].tolist(), parts.layout.starts % length
        for row, first, example in zip(rows, firsts, examples):
            if isinstance(example.items, LazyItems):
                continue   # located together: no images (documents with parts are made item by item)
            filled = int((batch["image_positions"][row] >= 0).sum())
            for k, item in enumerate(example.items):
                for offset, ref in item.images:
                    batch["image_positions"][row, filled] = int(in_row[first + k]) + offset
                    batch["image_refs"][row, filled] = ref
                    filled += 1


class LocatedPacked(ExampleRun):
    """Packed examples of one dataset located together in ``located`` (example ``k`` is
    ``located``'s ``k``): rows 0, 1, ... of a batch, filled at once from its arrays."""

    def __init__(self, dataset: str, epochs: np.ndarray, examples: np.ndarray, located: PackedSet,
                 pad_id: int, offset: int = 0, parts: FillParts | None = None) -> None:
        super().__init__(dataset, epochs, examples)
        self.located = located
        self.pad_id = pad_id
        self.offset = offset    # example k is ``located``'s example offset + k
        self.parts = parts      # what fill_all writes, if made already (a part of a block's)

    def example(self, k: int, epoch: int, example: int) -> PackedExample:
        """Example ``k`` as a :class:`PackedExample` (its items made on first use)."""
        return PackedExample(self.dataset, epoch, example, LazyItems(self.located, self.offset + k), self.pad_id)

    def fill_all(self, batch: Batch) -> None:
        """Every example into its row, as :func:`fill_packed` writes them."""
        if "inputs" in batch:   # another dataset of the mixture is seq2seq: rows one by one
            PackedExample.fill_rows(batch, list(range(len(self))), list(self))  # type: ignore[arg-type]
            return
        parts = self.located.fill_parts(None, self.pad_id) if self.parts is None else self.parts
        _write_packed(batch, range(len(self)), parts, self.pad_id)

    def parts_of(self, size: int) -> Callable[[int, int], LocatedPacked]:
        """``part(a, b)``: examples ``a`` to ``b`` alone, ``a`` and ``b`` multiples of ``size``
        (where the located items' pieces are cut: :meth:`~lakeloader.feed.locate_packed.LocatedItems.cut`), with their
        :class:`FillParts` sliced from those of every example, made here once."""
        assert self.offset == 0 and self.parts is None, "parts of a whole located set"
        parts = self.located.fill_parts(None, self.pad_id)
        return lambda a, b: LocatedPacked(self.dataset, self.epochs[a:b], self.examples[a:b], self.located,
                                          self.pad_id, a, parts.part(a, b))


def _merged(found: list[FillParts], positions: list[list[int]], n: int, length: int) -> FillParts:
    """One :class:`FillParts` of ``n`` examples from parts ``found[g]`` of the examples at
    ``positions[g]``, in rows of ``length``."""
    counts, first = np.empty(n, np.int64), np.empty(n, np.int64)
    base = 0
    for parts, mine in zip(found, positions):
        assert parts.first is None, "merged parts hold a piece per item"
        counts[mine] = parts.layout.counts
        first[mine] = base + parts.layout.bounds[:-1]
        base += len(parts.layout.sizes)
    order = run_indices(first, counts).tolist()   # every item, example by example

    def pick(lists: list[list[Any]]) -> list[Any]:
        every = [value for values in lists for value in values]
        return [every[k] for k in order]

    sizes = np.concatenate([parts.layout.sizes for parts in found])
    trainable = None
    if any(parts.trainable is not None for parts in found):
        everything = np.ones(int(sizes.max()), bool)
        trainable = pick([[everything[:size] for size in parts.layout.sizes.tolist()] if parts.trainable is None
                          else parts.trainable for parts in found])
    return FillParts(row_layout(counts, sizes[order], length), pick([parts.tokens for parts in found]), trainable,
                     np.concatenate([parts.next_token for parts in found])[order],
                     np.concatenate([parts.last_mask for parts in found])[order])


def _write_packed(batch: Batch, rows: Sequence[int], parts: FillParts, pad_id: int) -> None:
    """The row fields of :func:`fill_packed` from ``parts`` into rows ``rows`` of ``batch``."""
    layout = parts.layout
    length, n, bounds = layout.length, len(layout.counts), layout.bounds
    # The items' runs tile the rows, each row's last one reaching over the row's padding (few
    # rows have any: their tails are written apart). Each padded row: (row, where its padding
    # starts, the piece its padding goes before: the one of the item after the row's last).
    before = bounds[layout.padded + 1]
    if parts.first is not None:
        before = parts.first.searchsorted(before)
    tails = list(zip(layout.padded.tolist(), layout.pad_start.tolist(), before.tolist()))
    index: slice | np.ndarray
    if isinstance(rows, range) and rows.step == 1 or list(rows) == list(range(rows[0], rows[0] + n)):
        index = slice(rows[0], rows[0] + n)   # a block of rows: write into views of the batch
    else:
        index = np.asarray(rows)

    def with_padding(pieces: list[np.ndarray], tail: np.ndarray) -> list[np.ndarray]:
        """The pieces with each padded row's padding (a prefix of ``tail``) after its items."""
        pieces = list(pieces)
        for _, start, at in reversed(tails):
            pieces.insert(at, tail[: length - start])
        return pieces

    def rows_of(name: str) -> np.ndarray:
        """Where the rows of field ``name`` are built: the batch's own rows, or a work array."""
        return batch[name][index] if isinstance(index, slice) else np.empty((n, length), field_dtype(name))

    def clear_tails(values: np.ndarray) -> None:
        """Zero the padded rows' padding in ``values`` (rows built by ``rows_of``)."""
        for row, start, _ in tails:
            values[row, start:] = 0

    built: dict[str, np.ndarray] = {}
    inputs = built["input_ids"] = rows_of("input_ids")
    np.concatenate(with_padding(parts.tokens, _run(pad_id, length, np.int32)), out=inputs.reshape(-1),
                   casting="unsafe")
    if "segment_ids" in batch:   # (loader.fields)
        segment_ids = built["segment_ids"] = rows_of("segment_ids")
        fill_runs(layout.numbers, layout.runs, segment_ids)
        clear_tails(segment_ids)
    if "positions" in batch:
        positions = built["positions"] = rows_of("positions")
        run_positions(layout.starts, layout.runs, positions)   # from 0 in each item
        clear_tails(positions)
    # Each item's last token: its target is the document's next token if the item holds one.
    last = layout.starts + layout.sizes - 1
    targets = built["targets"] = rows_of("targets")
    np.copyto(targets.reshape(-1)[:-1], inputs.reshape(-1)[1:])   # (one flat copy: each row's last is set below)
    targets[:, -1] = pad_id
    targets.reshape(-1)[last] = parts.next_token
    if "loss_mask" in batch:
        loss_mask = built["loss_mask"] = rows_of("loss_mask")
        if parts.trainable is None:
            loss_mask.fill(1)
            clear_tails(loss_mask)
        else:
            trainable = np.empty((n, length), bool)
            np.concatenate(with_padding(parts.trainable, _run(False, length, np.bool_)), out=trainable.reshape(-1))
            np.copyto(loss_mask[:, :-1], trainable[:, 1:], casting="unsafe")
            loss_mask[:, -1] = 0
        loss_mask.reshape(-1)[last] = parts.last_mask
    if not isinstance(index, slice):
        for name, values in built.items():
            batch[name][index] = values


@functools.lru_cache(maxsize=16)
def _run(value: int, length: int, dtype: type) -> np.ndarray:
    """``length`` copies of ``value``, made once and read-only (runs of padding and masks)."""
    found = np.full(length, value, dtype)
    found.flags.writeable = False
    return found
