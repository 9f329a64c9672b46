"""Examples of one dataset under ``packing: pack | pad``: whole documents per each chunk's
packing plan, with the images of interleaved documents and the prompt/response split of
seq2seq ones."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from lakeloader.contracts.errors import LakeloaderError
from lakeloader.contracts.specs import PackingSpec
from lakeloader.feed.concat_examples import DatasetExamples
from lakeloader.feed.rows import Batch, Example, Row, Segment
from lakeloader.index.chunk_packing import plan_chunk
from lakeloader.index.packing import PackPlan
from lakeloader.index.ranges import _iota, cumulative, locate
from lakeloader.index.render import part_starts
from lakeloader.read.catalog_view import CatalogView, DatasetChunks
from lakeloader.read.lru import LRU
from lakeloader.read.windows import RenderedGroup, StreamReader


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
class PackedExample(Example):
    """An example of whole documents (``packing: pack | pad``) with provenance."""

    items: list[Item]
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
            found.append(Segment(number, item.chunk, item.doc, offset, offset + length,
                                 {"document_start": item.start, "document_stop": item.stop}))
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


def fill_packed(batch: Batch, rows: list[int], examples: Sequence[PackedExample]) -> None:
    """Write packed examples into rows ``rows`` of ``batch`` at once, padding included, as each
    one's :meth:`PackedExample.fill` into a padded row. Each field is written once for all rows:
    inputs and positions by one concatenation of views (the items' tokens where they lie in their
    rendered row groups, constant runs for padding), segment ids from where the items start, and
    targets and loss masks as the inputs shifted by one, corrected at each item's last token (the
    document's next token, or padding at its end)."""
    if not examples:
        return
    length = batch["input_ids"].shape[1]
    n = len(examples)
    items = [item for example in examples for item in example.items]
    counts = np.array([len(example.items) for example in examples], np.int64)
    first = cumulative(counts)[:-1]                   # first item of each row
    sizes = np.array([item.stop - item.start for item in items], np.int64)   # tokens written per item
    item_at = cumulative(sizes)[:-1]
    in_row = item_at - np.repeat(item_at[first], counts)        # where each item starts in its row
    used = np.add.reduceat(sizes, first)
    pads = (length - used).tolist()
    starts, ends = first.tolist(), cumulative(counts)[1:].tolist()
    pad_id = examples[0].pad_id
    index: slice | np.ndarray = np.asarray(rows)
    if rows == list(range(rows[0], rows[0] + n)):
        index = slice(rows[0], rows[0] + n)   # a block of rows: write into views of the batch

    def pieces(per_item: list[np.ndarray], tail: np.ndarray) -> list[np.ndarray]:
        out: list[np.ndarray] = []
        for a, b, rest in zip(starts, ends, pads):
            out += per_item[a:b]
            out.append(tail[:rest])
        return out

    def rows_of(name: str, dtype: type) -> np.ndarray:
        """Where the rows of field ``name`` are built: the batch's own rows, or a work array."""
        return batch[name][index] if isinstance(index, slice) else np.empty((n, length), dtype)

    built: dict[str, np.ndarray] = {}
    lengths = sizes.tolist()
    inputs = built["input_ids"] = rows_of("input_ids", np.int32)
    np.concatenate(pieces([item.tokens[:size] for item, size in zip(items, lengths)], _run(pad_id, length, np.int32)),
                   out=inputs.reshape(-1), casting="unsafe")
    positions = built["positions"] = rows_of("positions", np.int32)
    iota = _iota(length, np.int32)
    np.concatenate(pieces([iota[:size] for size in lengths], _run(0, length, np.int32)), out=positions.reshape(-1))
    runs = np.zeros(len(items) + n, np.int64)          # each row: its items, then its padding
    values = np.zeros(len(items) + n, np.int32)
    slots = np.arange(len(items), dtype=np.int64) + np.repeat(np.arange(n, dtype=np.int64), counts)
    runs[slots], values[slots] = sizes, np.arange(len(items), dtype=np.int64) - np.repeat(first, counts) + 1
    runs[cumulative(counts)[1:] + np.arange(n)] = pads
    segment_ids = built["segment_ids"] = rows_of("segment_ids", np.int32)
    np.copyto(segment_ids.reshape(-1), np.repeat(values, runs))
    # Each item's last token: its target is the document's next token if the item holds one.
    last = np.repeat(np.arange(n, dtype=np.int64), counts) * length + in_row + sizes - 1
    has_next = [len(item.tokens) > size for item, size in zip(items, lengths)]
    targets = built["targets"] = rows_of("targets", np.int32)
    np.copyto(targets[:, :-1], inputs[:, 1:])
    targets[:, -1] = pad_id
    targets.reshape(-1)[last] = [int(item.tokens[size]) if more else pad_id
                                 for item, size, more in zip(items, lengths, has_next)]
    loss_mask = built["loss_mask"] = rows_of("loss_mask", np.float32)
    if all(item.trainable is None for item in items):
        np.not_equal(segment_ids, 0, out=loss_mask, casting="unsafe")
        loss_mask.reshape(-1)[last] = has_next
    else:
        trainable = np.empty((n, length), bool)
        everything = np.ones(length, bool)
        np.concatenate(pieces([everything[:size] if item.trainable is None else item.trainable[:size]
                               for item, size in zip(items, lengths)], np.zeros(length, bool)),
                       out=trainable.reshape(-1))
        np.copyto(loss_mask[:, :-1], trainable[:, 1:], casting="unsafe")
        loss_mask[:, -1] = 0
        loss_mask.reshape(-1)[last] = [more and (item.trainable is None or bool(item.trainable[size]))
                                       for item, size, more in zip(items, lengths, has_next)]
    if not isinstance(index, slice):
        for name, values in built.items():
            batch[name][index] = values
    if "image_refs" in batch:   # few: only the items of interleaved documents carry images
        item_row = np.repeat(np.asarray(rows, np.int64), counts)
        for k in [k for k, item in enumerate(items) if item.images]:
            row = int(item_row[k])
            filled = int((batch["image_positions"][row] >= 0).sum())
            for offset, ref in items[k].images:
                batch["image_positions"][row, filled] = int(in_row[k]) + offset
                batch["image_refs"][row, filled] = ref
                filled += 1


@functools.lru_cache(maxsize=16)
def _run(value: int, length: int, dtype: type) -> np.ndarray:
    """``length`` copies of ``value``, made once and read-only (runs of padding and masks)."""
    found = np.full(length, value, dtype)
    found.flags.writeable = False
    return found


class LocatedItems(NamedTuple):
    """The items (placed documents) of some examples of one chunk."""

    items: np.ndarray       # indices into the chunk's packing plan, example by example
    counts: np.ndarray      # items of each example
    docs: np.ndarray        # document of each item within the chunk
    groups: np.ndarray      # row group holding each item's document


class PackedExamples(DatasetExamples):
    """Example ``j`` of a dataset under ``packing: pack | pad``: whole documents per the packing
    plan of the chunk holding it. Per-chunk example counts come from the catalog, so a seek is a
    binary search over chunks; the chunk's plan is recomputed from its part layout when read."""


    def __init__(self, name: str, view: CatalogView, reader: StreamReader, spec: PackingSpec, *,
                 seq2seq: bool = False, pad_id: int = 0, **kwargs: Any) -> None:
        self.spec = spec
        self.seq2seq = seq2seq
        self.pad_id = pad_id
        # Training rows of plain packed examples are written whole, padding included (fill_packed).
        self.fills_whole_rows = not seq2seq
        self.plan_key = spec.plan_key
        if not view.plan_registered(name, spec.plan_key):
            raise LakeloaderError(
                f"dataset {name!r}: the lake keeps no example counts for this loader's packing "
                f"(packing: {spec.mode}, seq_len: {spec.seq_len}, plan {spec.plan_key}); run "
                "`lakeloader build CONFIG` with this config once: it computes them from the stored "
                "documents' lengths without tokenizing again")
        self._plans: LRU[tuple[str, int], PackPlan] = LRU(64)
        super().__init__(name, view, reader, **kwargs)

    def _set_offsets(self, chunks: DatasetChunks) -> None:
        """The cumulative per-chunk counts examples are located by: here packed examples."""
        assert chunks.num_examples is not None
        self.example_offsets = cumulative(chunks.num_examples)

    def _available(self) -> int:
        return int(self.example_offsets[-1])

    def _too_small(self) -> LakeloaderError:
        return LakeloaderError(f"dataset {self.name!r} has no examples under packing: {self.spec.mode}")

    def eval_count(self) -> int:
        """Examples in one evaluation pass (needs the complete dataset)."""
        self.complete_chunks()
        return self._available()

    def eval_window(self, j: int) -> PackedExample:
        """Example ``j`` of the evaluation pass."""
        self.complete_chunks()
        return self._example(0, j)

    def _window_starts(self, chunk_limit: int) -> np.ndarray:
        return self.example_offsets[: chunk_limit + 1 : self.shuffle.window_chunks]

    def plan(self, chunk: int) -> PackPlan:
        """The packing plan of chunk ``chunk`` (cached)."""
        return self._plans.get((self.chunks.fingerprint, chunk), lambda: plan_chunk(
            self.spec, self.reader.files.chunk_parts(self.chunks, chunk), chunk, f"dataset {self.name!r}, chunk {chunk}"))

    def _examples(self, epochs: np.ndarray, examples: np.ndarray) -> list[PackedExample]:  # type: ignore[override]
        chunks = locate(self.example_offsets, examples)
        self.reader.prefetch_groups(self.chunks, chunks)
        located = {chunk: self._locate(chunk, examples[chunks == chunk]) for chunk in np.unique(chunks).tolist()}
        # Every row group of the batch looked up once, up front: those not cached decode concurrently.
        wanted = [(chunk, group) for chunk, where in located.items() for group in np.unique(where.groups).tolist()]
        rendered: dict[int, dict[int, RenderedGroup]] = {chunk: {} for chunk in located}
        for (chunk, group), value in zip(wanted, self.reader.rendered_groups(self.chunks, wanted)):
            rendered[chunk][group] = value
        found: list[PackedExample] = [None] * len(examples)  # type: ignore[list-item]
        for chunk, where in located.items():
            which = np.flatnonzero(chunks == chunk)
            made = self._chunk_examples(chunk, epochs[which], examples[which], where, rendered[chunk])
            for i, example in zip(which.tolist(), made):
                found[i] = example
        return found

    def _locate(self, chunk: int, examples: np.ndarray) -> LocatedItems:
        """The items of examples ``examples`` (all in chunk ``chunk``), with array operations."""
        plan = self.plan(chunk)
        items, counts = plan.items_of(examples - int(self.example_offsets[chunk]))
        docs = plan.item_doc[items]
        _, first_docs = self.reader.groups(self.chunks, chunk)
        return LocatedItems(items, counts, docs, np.searchsorted(first_docs, docs, side="right") - 1)

    def _chunk_examples(self, chunk: int, epochs: np.ndarray, examples: np.ndarray,
                        located: LocatedItems, rendered: dict[int, RenderedGroup]) -> list[PackedExample]:
        """Examples ``examples`` (all in chunk ``chunk``, located by :meth:`_locate`) from the
        chunk's row groups ``rendered`` (by row group)."""
        plan = self.plan(chunk)
        items, counts, docs, groups = located
        starts, stops = plan.item_start[items], plan.item_stop[items]
        _, first_docs = self.reader.groups(self.chunks, chunk)
        local = docs - first_docs[groups]
        if self.reader.template.image_kind is not None or self.seq2seq:   # items that need their parts
            made = [self._item(chunk, group, doc_local, doc, start, stop) for group, doc_local, doc, start, stop
                    in zip(groups.tolist(), local.tolist(), docs.tolist(), starts.tolist(), stops.tolist())]
        else:
            begin, end = np.empty_like(docs), np.empty_like(docs)
            single = bool((groups == groups[0]).all())
            for group in ([int(groups[0])] if single else np.unique(groups).tolist()):
                mine = slice(None) if single else groups == group   # one row group: no mask
                doc_starts = rendered[group].doc_starts
                begin[mine], end[mine] = doc_starts[local[mine]], doc_starts[local[mine] + 1]
            cut_start, cut_stop = begin + starts, np.minimum(begin + stops + 1, end)
            made = []
            for group, doc, start, stop, a, b in zip(groups.tolist(), docs.tolist(), starts.tolist(), stops.tolist(),
                                                     cut_start.tolist(), cut_stop.tolist()):
                group_tokens = rendered[group]
                made.append(Item(chunk, doc, start, stop, group_tokens.tokens[a:b],
                                 None if group_tokens.trainable is None else group_tokens.trainable[a:b], [], -1))
        ends = np.cumsum(counts).tolist()
        return [PackedExample(self.name, e, k, made[stop - n : stop], self.pad_id)
                for e, k, stop, n in zip(epochs.tolist(), examples.tolist(), ends, counts.tolist())]

    def _example(self, epoch: int, k: int, chunk: int | None = None) -> PackedExample:
        if chunk is None:
            chunk = int(locate(self.example_offsets, np.array([k]))[0])
        plan = self.plan(chunk)
        items, _, docs, groups = self._locate(chunk, np.array([k]))
        _, first_docs = self.reader.groups(self.chunks, chunk)
        return PackedExample(self.name, epoch, k, [
            self._item(chunk, group, doc - int(first_docs[group]), doc, start, stop)
            for group, doc, start, stop in zip(groups.tolist(), docs.tolist(), plan.item_start[items].tolist(),
                                               plan.item_stop[items].tolist())], self.pad_id)

    def _item(self, chunk: int, group: int, local: int, doc: int, start: int, stop: int) -> Item:
        """Item of document ``doc`` of the chunk (``local`` within its row group ``group``)."""
        rendered = self.reader.rendered_group(self.chunks, chunk, group)
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
