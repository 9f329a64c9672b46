"""The locate part of ``packing: pack | pad``: example ``k`` of a dataset is the ``k``-th
example of the packing plans of its chunks in order. Per-chunk example counts come from the
catalog, so a seek is a binary search over chunks; a chunk's plan is recomputed from its part
layout when read, and the items of a batch's examples are gathered from the plans' item tables
without reading a row group (then their row groups are read together)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from lakeloader.contracts.errors import LakeloaderError
from lakeloader.contracts.specs import PackingSpec
from lakeloader.feed.growing import GrowingChunks
from lakeloader.feed.packed import Item, LocatedPacked, PackedExample, PackedSet
from lakeloader.index.chunk_packing import GROUP_BITS, ITEM_FIELDS, item_table, plan_chunk
from lakeloader.index.packing import PackPlan
from lakeloader.index.ranges import cumulative, distinct, locate
from lakeloader.index.render import part_starts
from lakeloader.index.row_layout import RowLayout, row_layout
from lakeloader.read.catalog_view import CatalogView, DatasetChunks
from lakeloader.read.lru import LRU
from lakeloader.read.table_arena import TableArena
from lakeloader.read.span_set import RenderedGroup
from lakeloader.read.stream_reader import StreamReader


def require_plan(view: CatalogView, name: str, spec: PackingSpec) -> None:
    """A LakeloaderError unless the lake keeps dataset ``name``'s example counts under ``spec``."""
    if not view.plan_registered(name, spec.plan_key):
        raise LakeloaderError(
            f"dataset {name!r}: the lake keeps no example counts for this loader's packing "
            f"(packing: {spec.mode}, seq_len: {spec.seq_len}, plan {spec.plan_key}); run "
            "`lakeloader build CONFIG` with this config once: it computes them from the stored "
            "documents' lengths without tokenizing again")


_GROUP_KEY = ITEM_FIELDS.index("group_key")   # the row of LocatedItems.columns holding each item's row-group key


@dataclasses.dataclass(frozen=True)
class LocatedItems:
    """The items of examples located in their chunks' packing plans, no row group read yet:
    a row per field of ``ITEM_FIELDS``, a column per item, the items example by example as
    ``layout`` places them."""

    columns: np.ndarray     # int64 [len(ITEM_FIELDS), items]
    layout: RowLayout
    joined: np.ndarray      # bool per item but the last: the next item continues it, where it lies and where it goes
    # Items in row-group order (examples read in order): the distinct row groups and each item's.
    groups: tuple[np.ndarray, np.ndarray] | None = None

    def part(self, a: int, b: int) -> LocatedItems:
        """Examples ``a`` to ``b`` (views)."""
        lo, hi = self.layout.bounds[[a, b]].tolist()
        groups = None
        if self.groups is not None:   # (the part's row groups: a run of the distinct ones)
            used, group = self.groups
            first, last = group[[lo, hi - 1]].tolist()
            groups = used[first : last + 1], group[lo:hi] - first
        return LocatedItems(self.columns[:, lo:hi], self.layout.part(a, b), self.joined[lo : hi - 1], groups)

    def row_groups(self) -> tuple[np.ndarray, np.ndarray]:
        """The distinct row-group keys the items lie in (ascending) and each item's index into them."""
        return distinct(self.columns[_GROUP_KEY]) if self.groups is None else self.groups

    def cut(self, size: int) -> LocatedItems:
        """These items with none continuing the one before it at every ``size``-th example: the
        pieces filled at once (``joined``) end where the parts of ``size`` examples do."""
        joined = self.joined.copy()
        joined[self.layout.bounds[size:-1:size] - 1] = False
        return dataclasses.replace(self, joined=joined)


ITEM_COLUMNS = 1 << 18   # items (of all chunks) whose tables a packed dataset keeps: 14 MB (7 int64 each)
_GROUP_MASK = (1 << GROUP_BITS) - 1


def _group_pairs(keys: np.ndarray) -> list[tuple[int, int]]:
    """``(chunk, row group)`` of each row-group key (:data:`GROUP_BITS`)."""
    return list(zip((keys >> GROUP_BITS).tolist(), (keys & _GROUP_MASK).tolist()))


class PackedLocator:
    """Where each packed example of a dataset lies, over its committed prefix (the counts follow
    the prefix as it grows); the examples it returns fill their rows themselves
    (:mod:`lakeloader.feed.packed`)."""

    def __init__(self, growing: GrowingChunks, reader: StreamReader, spec: PackingSpec, *, seq2seq: bool = False,
                 pad_id: int = 0) -> None:
        """``growing`` reads the counts of ``spec``'s plan (:func:`require_plan` first)."""
        self.growing = growing
        self.reader = reader
        self.spec = spec
        self.seq2seq = seq2seq
        self.pad_id = pad_id
        self.plan_key = spec.plan_key
        # Training rows of plain packed examples are written whole, padding included (fill_packed).
        self.fills_whole_rows = not seq2seq
        self._plans: LRU[tuple[str, int], PackPlan] = LRU(64)
        self._items = TableArena(len(ITEM_FIELDS), ITEM_COLUMNS)   # chunks' item tables
        self._offsets: tuple[DatasetChunks, np.ndarray] | None = None

    def example_offsets(self) -> np.ndarray:
        """int64 [committed + 1]: the first example of each committed chunk, then the count."""
        chunks = self.growing.chunks
        if self._offsets is None or self._offsets[0] is not chunks:
            assert chunks.num_examples is not None
            self._offsets = (chunks, cumulative(chunks.num_examples))
        return self._offsets[1]

    def available(self) -> int:
        """Examples the committed prefix holds (each chunk's are whole)."""
        return int(self.example_offsets()[-1])

    def available_within(self, chunks: int) -> int:
        """Examples the first ``chunks`` committed chunks hold."""
        return int(self.example_offsets()[chunks])

    def chunk_starts(self) -> np.ndarray:
        """The first example of each chunk (an example lies in one chunk)."""
        return self.example_offsets()

    def too_small(self) -> LakeloaderError:
        """The error for a dataset with no example."""
        return LakeloaderError(f"dataset {self.growing.name!r} has no examples under packing: {self.spec.mode}")

    def eval_count(self) -> int:
        """Examples of one evaluation pass: every example once (needs the complete dataset)."""
        return self.available()

    def eval_examples(self, js: np.ndarray) -> Sequence[PackedExample]:
        """Examples ``js`` of the evaluation pass, located together."""
        js = np.asarray(js, np.int64)
        return self.located(np.zeros(len(js), np.int64), js)

    def plan(self, chunk: int) -> PackPlan:
        """The packing plan of chunk ``chunk`` (cached)."""
        chunks = self.growing.chunks
        return self._plans.get((chunks.fingerprint, chunk), lambda: plan_chunk(
            self.spec, self.reader.files.chunk_parts(chunks, chunk), chunk, f"dataset {self.growing.name!r}, chunk {chunk}"))

    def _item_tables(self, keys: list[tuple[str, int]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """The plans of chunks ``key[1]`` as tables of :attr:`_items` (their row-group tables
        fetched together: one catalog query): the first item of each example then the item count
        (``PackPlan.example_bounds``), and its items (``item_table``)."""
        chunks = [chunk for _, chunk in keys]
        tables = []
        for chunk, (_, first_docs) in zip(chunks, self.reader.groups_of(self.growing.chunks, chunks)):
            plan = self.plan(chunk)
            tables.append((plan.example_bounds, item_table(plan, first_docs, chunk)))
        return tables

    def block(self, epochs: np.ndarray, examples: np.ndarray, part_size: int
              ) -> Callable[[int, int], Sequence[PackedExample]]:
        """``part(a, b)``: :meth:`located` of examples ``a`` to ``b`` (multiples of
        ``part_size``), the items of every example located up front, at once
        (:meth:`_located_items`). Each part reads its row groups when asked, unless the cache
        holds every row group of the examples already (an epoch after the first): then they are
        read here, and the parts' fill parts are made together, once, and sliced."""
        items = self._located_items(examples)
        if len(examples) > part_size and not self._items_need_parts:
            used, group = items.row_groups()
            cached = self.reader.cached_groups(self.growing.chunks, _group_pairs(used))
            if cached is not None:
                whole = self._rendered(epochs, examples, items.cut(part_size), (used, group, cached))
                assert isinstance(whole, LocatedPacked)
                return whole.parts_of(part_size)
        return lambda a, b: self._rendered(epochs[a:b], examples[a:b], items.part(a, b))

    def located(self, epochs: np.ndarray, examples: np.ndarray) -> Sequence[PackedExample]:
        """Examples ``examples`` (of epochs ``epochs``), located together (:meth:`_located_items`,
        :meth:`_rendered`)."""
        if not len(examples):
            return []
        return self._rendered(epochs, examples, self._located_items(examples))

    def _located_items(self, examples: np.ndarray) -> LocatedItems:
        """The items of examples ``examples`` (non-empty), gathered from their chunks' item
        tables at once, without reading a row group."""
        offsets, fingerprint = self.example_offsets(), self.growing.fingerprint
        chunks = locate(offsets, examples)
        used_chunks, chunk_of = distinct(chunks)
        columns, counts = self._items.gather([(fingerprint, c) for c in used_chunks.tolist()], chunk_of,
                                             examples - offsets[chunks], self._item_tables)
        _, starts, stops, begin, _, group_keys, _ = columns
        layout = row_layout(counts, stops - starts, self.spec.seq_len)
        # Items that continue each other in a row group and in the rows (a long document's rows, in
        # order) are filled as one piece.
        joined = (group_keys[1:] == group_keys[:-1]) & (begin[1:] == begin[:-1] + layout.sizes[:-1]) & (
            layout.starts[1:] == layout.starts[:-1] + layout.sizes[:-1])
        in_order = bool((group_keys[1:] >= group_keys[:-1]).all())
        return LocatedItems(columns, layout, joined, distinct(group_keys) if in_order else None)

    @property
    def _items_need_parts(self) -> bool:
        """Whether items are made with their documents' parts (images, a seq2seq split), one by one."""
        return self.reader.template.image_kind is not None or self.seq2seq

    def _rendered(self, epochs: np.ndarray, examples: np.ndarray, items: LocatedItems,
                  groups: tuple[np.ndarray, np.ndarray, list[RenderedGroup]] | None = None) -> Sequence[PackedExample]:
        """Examples ``examples`` (of epochs ``epochs``) of located ``items``: every row group
        they lie in looked up once, up front (those not cached decode concurrently), unless
        ``groups`` gives them already (the distinct row-group keys, each item's, their renderings)."""
        docs, starts, stops, begin, end, group_keys, group_docs = items.columns
        if groups is None and self._items_need_parts:
            used, group = items.row_groups()
            rendered = self.reader.rendered_groups(self.growing.chunks, _group_pairs(used))
        elif groups is None:   # (a cold read re-points the items at renderings of what they reach)
            used, group = items.row_groups()
            group, begin, end = group.copy(), begin.copy(), end.copy()
            rendered = self.reader.ranged_groups(self.growing.chunks, _group_pairs(used), (group, begin, end))
        else:
            used, group, rendered = groups
        last = int(used[-1])
        self.reader.look_ahead_after(self.growing.chunks, last >> GROUP_BITS, last & _GROUP_MASK)
        item_chunk = group_keys >> GROUP_BITS
        located = PackedSet(rendered, items.layout, item_chunk, docs, starts, stops, group, begin, end, items.joined)
        if self._items_need_parts:
            # (made one by one: their row groups are cached now, each was looked up above)
            made = [self._item(chunk, group, doc_local, doc, start, stop) for chunk, group, doc_local, doc, start, stop
                    in zip(item_chunk.tolist(), (group_keys & _GROUP_MASK).tolist(), group_docs.tolist(), docs.tolist(),
                           starts.tolist(), stops.tolist())]
            return [PackedExample(self.growing.name, e, k, made[a : a + n], self.pad_id) for e, k, a, n in zip(
                epochs.tolist(), examples.tolist(), items.layout.bounds[:-1].tolist(), items.layout.counts.tolist())]
        return LocatedPacked(self.growing.name, epochs, examples, located, self.pad_id)

    def _item(self, chunk: int, group: int, local: int, doc: int, start: int, stop: int) -> Item:
        """Item of document ``doc`` of the chunk (``local`` within its row group ``group``)."""
        rendered = self.reader.rendered_group(self.growing.chunks, chunk, group)
        begin, end = int(rendered.doc_starts[local]), int(rendered.doc_starts[local + 1])
        tokens = rendered.tokens[begin + start : min(begin + stop + 1, end)]
        trainable = None if rendered.trainable is None else rendered.trainable[begin + start : min(begin + stop + 1, end)]
        template = self.reader.template
        images: list[tuple[int, str]] = []
        split = -1
        if template.image_kind is not None or self.seq2seq:
            parts = rendered.parts   # kept with the rendering for these templates: no second read
            assert parts is not None
            mine = np.arange(*np.searchsorted(parts.part_doc, [local, local + 1]))
            starts = part_starts(template, parts.part_lengths[mine], parts.part_kinds[mine],
                                 np.zeros(len(mine), np.int64))
            kinds = parts.part_kinds[mine]
            if template.image_kind is not None and rendered.refs is not None:
                for part, offset in zip(mine[kinds == template.image_kind], starts[kinds == template.image_kind]):
                    if start <= offset < stop:
                        images.append((int(offset) - start, str(rendered.refs[part])))
            if self.seq2seq:
                responses = starts[kinds == template.kind_names.index("response")]
                split = int(responses[0]) if len(responses) else end - begin
        return Item(chunk, doc, start, stop, tokens, trainable, images, split)
