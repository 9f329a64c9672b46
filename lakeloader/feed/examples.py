"""Examples of one dataset: index maps from example number to its tokens.

``packing: concat`` cuts the dataset's rendered stream into windows (:class:`DatasetExamples`);
``pack`` and ``pad`` take whole documents per each chunk's packing plan (:class:`PackedExamples`).
Each example assembles its own batch row.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import Any

import numpy as np

from lakeloader.config import ShuffleConfig
from lakeloader.contracts.errors import LakeloaderError
from lakeloader.contracts.specs import PackingSpec
from lakeloader.index.chunk_packing import plan_chunk
from lakeloader.index.packing import PackPlan
from lakeloader.index.permutation import derive_key
from lakeloader.index.ranges import cumulative, eval_examples, locate, segments, strided_chunk, train_examples
from lakeloader.index.render import part_starts
from lakeloader.index.shuffle import shuffle_block, shuffle_full, shuffle_none, shuffle_window
from lakeloader.read.catalog_view import CatalogView, DatasetChunks
from lakeloader.read.windows import Piece, StreamReader


@dataclasses.dataclass
class Window:
    """One example's L+1 stream tokens (fewer at the end of an evaluation pass) and provenance."""

    dataset: str
    epoch: int
    example: int            # example number within the dataset's epoch (or ideal reader stream)
    pieces: list[Piece]

    def write(self, tokens: np.ndarray, keys: np.ndarray, trainable: np.ndarray) -> int:
        """Copy the window's stream tokens, document keys and target flags into row buffers;
        returns how many (L+1, fewer at the end of an evaluation pass)."""
        at = 0
        for piece in self.pieces:
            n = len(piece.tokens)
            tokens[at : at + n] = piece.tokens
            keys[at : at + n] = piece.docs + (np.int64(piece.position) << 32)
            trainable[at : at + n] = piece.trainable
            at += n
        return at


def fill_windows(batch: dict[str, np.ndarray], rows: list[int], windows: list[Window]) -> None:
    """Write concat windows into rows ``rows`` of ``batch`` at once: inputs are each window's
    first L tokens, targets the last L; segments and masks are computed for all rows together."""
    if not windows:
        return
    length = batch["input_ids"].shape[1]
    if all(len(w.pieces) == 1 and len(w.pieces[0].tokens) == length + 1 for w in windows):
        # The common case, each window one piece: stack the views (document keys need no chunk
        # position when a window never leaves its chunk).
        tokens = np.stack([w.pieces[0].tokens for w in windows])
        keys = np.stack([w.pieces[0].docs for w in windows])
        trainable = np.stack([w.pieces[0].trainable for w in windows])
        counts = np.full(len(windows), length + 1)
    else:
        tokens = np.zeros((len(rows), length + 1), np.int32)
        keys = np.full((len(rows), length + 1), -1, np.int64)
        trainable = np.zeros((len(rows), length + 1), bool)
        counts = np.array([w.write(tokens[i], keys[i], trainable[i]) for i, w in enumerate(windows)])
    segment_ids, positions = segments(keys[:, :-1])
    fields = {"input_ids": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": trainable[:, 1:],
              "segment_ids": segment_ids, "positions": positions}
    index: slice | np.ndarray = np.asarray(rows)
    if rows == list(range(rows[0], rows[0] + len(rows))):
        index = slice(rows[0], rows[0] + len(rows))   # a block of rows: plain copies, no gathers
    if counts.min() == length + 1:   # every window whole (training)
        for name, values in fields.items():
            batch[name][index] = values
        return
    valid = np.arange(length) < (counts - 1)[:, None]   # the short end of an evaluation pass
    fields["loss_mask"] = valid & fields["loss_mask"]
    for name in ("segment_ids", "positions"):
        fields[name] = np.where(valid, fields[name], 0)
    for name in ("input_ids", "targets"):
        fields[name] = np.where(valid, fields[name], batch[name][index])
    for name, values in fields.items():
        batch[name][index] = values


@dataclasses.dataclass
class Row:
    """Views of one row of each batch array (filled in place)."""

    input_ids: np.ndarray
    targets: np.ndarray
    loss_mask: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray
    extra: dict[str, np.ndarray]     # task fields: image_refs, image_positions, inputs_*, ...


class DatasetExamples:
    """Example ``j`` of a dataset -> its token window, for the global or strided ordering.

    Works on the committed prefix while the dataset is being built, waiting (with a timeout)
    only when an example needs a chunk that is not committed yet.
    """

    def __init__(self, name: str, view: CatalogView, reader: StreamReader, *, seq_len: int,
                 ordering: str, ideal_readers: int, wait_timeout: float,
                 shuffle: ShuffleConfig | None = None, seed: int = 0) -> None:
        self.name = name
        self.shuffle = shuffle or ShuffleConfig()
        self.shuffle_key = derive_key(seed, "shuffle", name)
        self.view = view
        self.reader = reader
        self.seq_len = seq_len
        self.ordering = ordering
        self.ideal_readers = ideal_readers
        self.wait_timeout = wait_timeout
        self._set(view.dataset(name, self.plan_key))

    plan_key: str | None = None   # packing plan whose per-chunk counts this reads (pack | pad)

    def _set(self, chunks: DatasetChunks) -> None:
        self.chunks = chunks
        self.offsets = cumulative(self.reader.chunk_lengths(chunks))
        self.sequence = np.arange(chunks.committed)  # the global order: chunk c is the c-th
        self._periods: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._epoch_window_starts: np.ndarray | None = None

    def _wait(self) -> None:
        """Wait for the next chunk of the committed prefix (or for the dataset to be complete)."""
        if self.chunks.complete:
            raise AssertionError("complete datasets never wait")
        self._set(self.view.wait_for(self.name, self.chunks.committed, self.wait_timeout, self.plan_key))

    def _too_small(self) -> LakeloaderError:
        return LakeloaderError(
            f"dataset {self.name!r} has {int(self.offsets[-1])} stream tokens, fewer than one example "
            f"of seq_len {self.seq_len} + 1: lower loader.seq_len or add data"
        )

    @property
    def fingerprint(self) -> str:
        return self.chunks.fingerprint

    def complete_chunks(self) -> DatasetChunks:
        """The dataset once every chunk is committed (waits for the build if needed)."""
        while not self.chunks.complete:
            self._set(self.view.wait_for(self.name, self.chunks.planned - 1, self.wait_timeout, self.plan_key))
        return self.chunks

    def eval_count(self) -> int:
        """Examples in one evaluation pass (needs the complete dataset)."""
        self.complete_chunks()
        return eval_examples(int(self.offsets[-1]), self.seq_len)

    def train_count(self) -> int:
        """Examples per epoch in training (needs the complete dataset)."""
        self.complete_chunks()
        return self._available()

    def _available(self) -> int:
        """Training examples the committed prefix holds whole."""
        return train_examples(int(self.offsets[-1]), self.seq_len)

    def eval_window(self, j: int) -> Window:
        """Example ``j`` of the evaluation pass: stream tokens [jL, jL+L] clipped at the end."""
        self.complete_chunks()
        total = int(self.offsets[-1])
        start = j * self.seq_len
        length = min(self.seq_len + 1, total - start)
        pieces = self.reader.window(self.chunks, self.sequence, self.offsets, start, length)
        return Window(self.name, 0, j, pieces)

    def _window_starts(self, chunk_limit: int) -> np.ndarray:
        """First example of each window of ``shuffle.window_chunks`` chunks among the first
        ``chunk_limit`` chunks (an example belongs to the window where it starts)."""
        boundaries = self.offsets[: chunk_limit + 1 : self.shuffle.window_chunks]
        return -(-boundaries // self.seq_len)

    def _shuffled(self, positions: np.ndarray, per_epoch: int, starts: np.ndarray | None = None) -> np.ndarray:
        """Example of each stream position under the configured shuffle (epoch folded in)."""
        kind, key = self.shuffle.kind, self.shuffle_key
        if kind == "none":
            return shuffle_none(positions, per_epoch)
        if kind == "full":
            return shuffle_full(positions, per_epoch, key)
        if kind == "block":
            return shuffle_block(positions, per_epoch, self.shuffle.block_size, self.shuffle.window_blocks, key)
        if starts is None:
            if self._epoch_window_starts is None:  # fixed once the dataset is complete
                self._epoch_window_starts = np.minimum(self._window_starts(self.chunks.committed), per_epoch)
            starts = self._epoch_window_starts
        return shuffle_window(positions, starts, per_epoch, key)

    def _position_while_building(self, j: int) -> int | None:
        """Example at position ``j`` of epoch 0 if the committed prefix already fixes it."""
        kind = self.shuffle.kind
        if kind == "none":
            return j
        if kind != "window":
            return None  # block and full shuffles need the whole dataset
        # Windows whose chunks and the next window's first chunk are committed are final.
        windows = (self.chunks.committed - 1) // self.shuffle.window_chunks
        if windows < 1:
            return None
        starts = self._window_starts(windows * self.shuffle.window_chunks)
        if j >= starts[-1]:
            return None
        return int(self._shuffled(np.array([j]), int(starts[-1]), starts[:-1])[0])

    def train_example(self, j: int) -> tuple[int, int]:
        """(epoch, example) at position ``j`` of the cycled, shuffled training stream (global
        ordering): index arithmetic only, waiting while building only if the prefix can't fix it."""
        epochs, examples = self.train_examples(np.array([j]))
        return int(epochs[0]), int(examples[0])

    def train_examples(self, js: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`train_example` of many positions (one vectorized shuffle once complete)."""
        js = np.asarray(js, np.int64)
        if not self.chunks.complete:
            found = [self._train_example_while_building(int(j)) for j in js]
            return np.array([e for e, _ in found], np.int64), np.array([k for _, k in found], np.int64)
        per_epoch = self._available()
        if per_epoch == 0:
            raise self._too_small()
        return js // per_epoch, self._shuffled(js, per_epoch)

    def _train_example_while_building(self, j: int) -> tuple[int, int]:
        while not self.chunks.complete:
            k = self._position_while_building(j)
            if k is not None and k < self._available():
                return 0, k   # fixed by the committed prefix: necessarily epoch 0
            self._wait()
        epochs, examples = self.train_examples(np.array([j]))
        return int(epochs[0]), int(examples[0])

    def train_window(self, j: int) -> Window:
        """Example ``j`` of the cycled training stream (shuffled per epoch if configured)."""
        return self.train_windows(np.array([j]))[0]

    def train_windows(self, js: np.ndarray) -> list[Window]:
        """:meth:`train_window` of many positions."""
        if self.ordering == "strided":
            return self._strided_windows(js)
        return self._examples(*self.train_examples(js))

    def _examples(self, epochs: np.ndarray, examples: np.ndarray) -> list[Window]:
        """Windows of examples ``examples`` (of epochs ``epochs``), looked up together."""
        pieces = self.reader.windows(self.chunks, self.sequence, self.offsets, examples * self.seq_len,
                                     self.seq_len + 1)
        return [Window(self.name, e, k, p) for e, k, p in zip(epochs.tolist(), examples.tolist(), pieces)]

    def _period(self, reader: int) -> tuple[np.ndarray, np.ndarray]:
        """Chunks and cumulative stream offsets of one period of ideal reader ``reader``'s
        looped chunk sequence (complete datasets only)."""
        if reader not in self._periods:
            count = self.chunks.committed
            period = count // math.gcd(count, self.ideal_readers)
            positions = strided_chunk(np.full(period, reader), np.arange(period), self.ideal_readers)
            chunks = positions % count
            lengths = np.diff(self.offsets)[chunks]
            self._periods[reader] = (chunks, cumulative(lengths))
        return self._periods[reader]

    def _strided_while_building(self, i: int) -> Window | None:
        """Window of global example ``i`` of the strided ordering from the committed prefix
        (waiting for chunks as needed); None once the dataset is complete."""
        reader, k = int(i % self.ideal_readers), int(i // self.ideal_readers)
        start, length = k * self.seq_len, self.seq_len + 1
        while not self.chunks.complete:
            positions = np.arange(reader, self.chunks.committed, self.ideal_readers)
            offsets = cumulative(np.diff(self.offsets)[positions])
            if start + length <= offsets[-1]:
                return Window(self.name, 0, k, self.reader.window(self.chunks, positions, offsets, start, length))
            self._wait()
        return None

    def _strided_windows(self, ids: np.ndarray) -> list[Window]:
        """Windows of global examples ``ids`` of the strided ordering: each ideal reader's
        looped chunk sequence, read in one batch per reader once the dataset is complete."""
        found = [self._strided_while_building(int(i)) for i in ids] if not self.chunks.complete else [None] * len(ids)
        rest = np.array([n for n, window in enumerate(found) if window is None], np.int64)
        ids = np.asarray(ids, np.int64)[rest]
        readers, ks = ids % self.ideal_readers, ids // self.ideal_readers
        length = self.seq_len + 1
        for reader in np.unique(readers).tolist():
            mine = np.flatnonzero(readers == reader)
            chunks, offsets = self._period(reader)
            total = int(offsets[-1])
            if total == 0:
                raise self._too_small()
            cycles, starts = np.divmod(ks[mine] * self.seq_len, total)
            repeats = 1 + math.ceil((int(starts.max()) + length) / total)
            sequence = np.tile(chunks, repeats)
            sequence_offsets = cumulative(np.tile(np.diff(offsets), repeats))
            pieces = self.reader.windows(self.chunks, sequence, sequence_offsets, starts, length)
            first = np.array([window_pieces[0].position for window_pieces in pieces], np.int64)
            epochs = strided_chunk(reader, cycles * len(chunks) + first, self.ideal_readers) // self.chunks.committed
            for n, k, epoch, window_pieces in zip(rest[mine].tolist(), ks[mine].tolist(), epochs.tolist(), pieces):
                found[n] = Window(self.name, epoch, k, window_pieces)
        return found  # type: ignore[return-value]


@dataclasses.dataclass
class Item:
    """One document (or a piece of one) inside a packed example."""

    chunk: int
    doc: int                    # document index within the chunk
    start: int                  # rendered token range of the document
    stop: int
    tokens: np.ndarray          # rendered tokens [start, stop] (one more for the last target, if any)
    trainable: np.ndarray
    images: list[tuple[int, str]]   # (offset of the image run within the item, reference)
    split: int                  # rendered offset where the response starts (seq2seq), else -1


@dataclasses.dataclass
class PackedExample:
    """An example of whole documents (``packing: pack | pad``) with provenance."""

    dataset: str
    epoch: int
    example: int
    items: list[Item]

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
            row.loss_mask[at : at + len(targets)] = item.trainable[1 : n + 1]  # all True for plain text
            row.segment_ids[at : at + n] = number
            row.positions[at : at + n] = np.arange(n, dtype=np.int32)
            if "image_refs" in row.extra:
                filled = int((row.extra["image_positions"] >= 0).sum())
                for offset, ref in item.images:
                    row.extra["image_positions"][filled] = at + offset
                    row.extra["image_refs"][filled] = ref
                    filled += 1
            at += n

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


class PackedExamples(DatasetExamples):
    """Example ``j`` of a dataset under ``packing: pack | pad``: whole documents per the packing
    plan of the chunk holding it. Per-chunk example counts come from the catalog, so a seek is a
    binary search over chunks; the chunk's plan is recomputed from its part layout when read."""

    def __init__(self, name: str, view: CatalogView, reader: StreamReader, spec: PackingSpec, *,
                 seq2seq: bool = False, **kwargs: Any) -> None:
        self.spec = spec
        self.seq2seq = seq2seq
        self.plan_key = spec.plan_key
        if not view.plan_registered(name, spec.plan_key):
            raise LakeloaderError(
                f"dataset {name!r}: the lake keeps no example counts for this loader's packing "
                f"(packing: {spec.mode}, seq_len: {spec.seq_len}, plan {spec.plan_key}); run "
                "`lakeloader build CONFIG` with this config once: it computes them from the stored "
                "documents' lengths without tokenizing again")
        self._plans: dict[tuple[str, int], PackPlan] = {}
        self._lock = threading.Lock()
        super().__init__(name, view, reader, **kwargs)

    def _set(self, chunks: DatasetChunks) -> None:
        super()._set(chunks)
        assert chunks.num_examples is not None
        self.offsets = cumulative(chunks.num_examples)   # example offsets, not stream tokens

    def _available(self) -> int:
        return int(self.offsets[-1])

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
        return self.offsets[: chunk_limit + 1 : self.shuffle.window_chunks]

    def plan(self, chunk: int) -> PackPlan:
        """The packing plan of chunk ``chunk`` (cached)."""
        key = (self.chunks.fingerprint, chunk)
        with self._lock:
            found = self._plans.get(key)
        if found is None:
            found = plan_chunk(self.spec, self.reader.files.chunk_parts(self.chunks, chunk), chunk,
                               f"dataset {self.name!r}, chunk {chunk}")
            with self._lock:
                if len(self._plans) > 64:
                    self._plans.clear()
                self._plans[key] = found
        return found

    def _examples(self, epochs: np.ndarray, examples: np.ndarray) -> list[PackedExample]:  # type: ignore[override]
        chunks = locate(self.offsets, examples).tolist()
        return [self._example(e, k, c) for e, k, c in zip(epochs.tolist(), examples.tolist(), chunks)]

    def _example(self, epoch: int, k: int, chunk: int | None = None) -> PackedExample:
        if chunk is None:
            chunk = int(locate(self.offsets, np.array([k]))[0])
        plan = self.plan(chunk)
        items = plan.example_items(k - int(self.offsets[chunk]))
        docs = plan.item_doc[items]
        _, first_docs = self.reader.groups(self.chunks, chunk)
        groups = np.searchsorted(first_docs, docs, side="right") - 1
        return PackedExample(self.name, epoch, k, [
            self._item(chunk, group, doc - int(first_docs[group]), doc, start, stop)
            for group, doc, start, stop in zip(groups.tolist(), docs.tolist(), plan.item_start[items].tolist(),
                                               plan.item_stop[items].tolist())])

    def _item(self, chunk: int, group: int, local: int, doc: int, start: int, stop: int) -> Item:
        """Item of document ``doc`` of the chunk (``local`` within its row group ``group``)."""
        rendered = self.reader.rendered_group(self.chunks, chunk, group)
        begin, end = int(rendered.doc_starts[local]), int(rendered.doc_starts[local + 1])
        tokens = rendered.tokens[begin + start : min(begin + stop + 1, end)]
        trainable = rendered.trainable[begin + start : min(begin + stop + 1, end)]
        template = self.reader.template
        images: list[tuple[int, str]] = []
        split = -1
        if template.image_kind is not None or self.seq2seq:
            stored = self.reader.files.row_group(self.chunks, chunk, group)
            parts = stored.parts
            mine = np.arange(*np.searchsorted(parts.part_doc, [local, local + 1]))
            starts = part_starts(template, parts.part_lengths[mine], parts.part_kinds[mine],
                                 np.zeros(len(mine), np.int64))
            kinds = parts.part_kinds[mine]
            if template.image_kind is not None and stored.refs is not None:
                for part, offset in zip(mine[kinds == template.image_kind], starts[kinds == template.image_kind]):
                    if start <= offset < stop:
                        images.append((int(offset) - start, str(stored.refs[part])))
            if self.seq2seq:
                responses = starts[kinds == template.kind_names.index("response")]
                split = int(responses[0]) if len(responses) else end - begin
        return Item(chunk, doc, start, stop, tokens, trainable, images, split)
