"""Packing plans of ``packing: pack`` (whole documents several to an example) and ``packing: pad``
(one to an example): which pieces of a chunk's documents make up each example.

Pure functions of the documents' *rendered* lengths (special tokens included), so any process
computes the same plan for a chunk and the catalog need only store its example count. An *item*
is a piece ``[start, stop)`` of one document's rendered tokens. A document longer than
``seq_len``, or holding more than ``max_images`` images, is cut per ``long_documents``: greedily
into pieces as long as possible (``split``), into its first such piece (``truncate``), or refused
(``error``). Cuts never fall inside an image span.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools

import numpy as np

from lakeloader.index.ranges import cumulative, run_indices

__all__ = ["DocumentTooLong", "PackPlan", "plan_pack"]

MODES = ("pack", "pad")
ALGORITHMS = ("first_fit", "best_fit")
LONG_DOCUMENTS = ("split", "truncate", "error")


@dataclasses.dataclass(frozen=True, eq=False)
class PackPlan:
    """Where each example's tokens come from: items (pieces of documents) in example order."""

    item_doc: np.ndarray      # int64 [items]: document index within the chunk
    item_start: np.ndarray    # int64 [items]: first rendered token of the piece within its document
    item_stop: np.ndarray     # int64 [items]: end (exclusive)
    item_example: np.ndarray  # int64 [items]: example the piece is in; non-decreasing
    num_examples: int
    truncated_docs: int       # documents cut by long_documents="truncate"
    dropped_tokens: int       # rendered tokens those cuts dropped
    split_docs: int           # documents cut into several pieces by long_documents="split"
    doc_offsets: np.ndarray   # int64 [documents + 1]: where each document starts in the chunk's
                              # rendered stream (the lengths the plan was made from), then the end

    @functools.cached_property
    def example_starts(self) -> list[int]:
        """First item of each example, then the number of items."""
        return np.searchsorted(self.item_example, np.arange(self.num_examples + 1)).tolist()

    def example_items(self, example: int) -> slice:
        """The items of ``example`` (never empty) as a slice of the item arrays."""
        if not 0 <= example < self.num_examples:
            raise IndexError(f"example {example} is out of range: the plan has {self.num_examples}")
        return slice(self.example_starts[example], self.example_starts[example + 1])

    @functools.cached_property
    def example_bounds(self) -> np.ndarray:
        """int64 [num_examples + 1]: :attr:`example_starts` as an array."""
        return np.asarray(self.example_starts, np.int64)

    def items_of(self, examples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the items of every example of ``examples`` back to back, the number of each one's
        items): :meth:`example_items` of many examples in a few array operations."""
        examples = np.asarray(examples, np.int64)
        if len(examples) and not (0 <= examples.min() and examples.max() < self.num_examples):
            bad = int(examples[(examples < 0) | (examples >= self.num_examples)][0])
            raise IndexError(f"example {bad} is out of range: the plan has {self.num_examples}")
        first = self.example_bounds[examples]
        counts = self.example_bounds[examples + 1] - first
        return run_indices(first, counts), counts

    @property
    def example_tokens(self) -> np.ndarray:
        """int64 [num_examples]: non-padding tokens of each example."""
        if self.num_examples == 0:
            return np.zeros(0, np.int64)
        return np.add.reduceat(self.item_stop - self.item_start, self.example_starts[:-1]).astype(np.int64)


class DocumentTooLong(ValueError):
    """A document does not fit one example and ``long_documents`` is ``"error"``."""

    def __init__(self, doc: int, length: int, seq_len: int, images: int | None = None,
                 max_images: int | None = None) -> None:
        self.doc, self.length, self.seq_len, self.images, self.max_images = doc, length, seq_len, images, max_images
        why = (f"{length} rendered tokens, more than seq_len={seq_len}" if length > seq_len else
               f"{images} images, more than max_images={max_images} (length {length}, seq_len={seq_len})")
        super().__init__(f"document {doc} of the chunk has {why}; "
                         "set loader.pack.long_documents: split or truncate to cut such documents")

    def __reduce__(self):  # keeps the attributes across processes
        return type(self), (self.doc, self.length, self.seq_len, self.images, self.max_images)


def _int_array(values: np.ndarray, name: str) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise TypeError(f"{name} must be a 1-D integer array, got shape {array.shape} dtype {array.dtype}")
    return array.astype(np.int64)


def _check_images(lengths: np.ndarray, image_doc, image_start, image_stop) -> tuple[np.ndarray, ...]:
    """(doc, start, stop) of image spans checked to be sorted by document then start, non-empty,
    inside their document and disjoint."""
    doc, start, stop = (_int_array(a, n) for a, n in
                        ((image_doc, "image_doc"), (image_start, "image_start"), (image_stop, "image_stop")))
    if not len(doc) == len(start) == len(stop):
        raise ValueError(f"image_doc, image_start, image_stop differ in length: {len(doc)}, {len(start)}, {len(stop)}")
    if doc.size:
        if doc.min() < 0 or doc.max() >= len(lengths) or (np.diff(doc) < 0).any():
            raise ValueError(f"image_doc must be sorted document indices in [0, {len(lengths)})")
        bad = np.flatnonzero((start < 0) | (stop <= start) | (stop > lengths[doc]))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"image span {i} [{start[i]}, {stop[i]}) of document {doc[i]} is empty or "
                             f"outside the document's {lengths[doc[i]]} rendered tokens")
        at = cumulative(lengths)[doc]
        bad = np.flatnonzero(at[1:] + start[1:] < at[:-1] + stop[:-1])
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"image spans {i} and {i + 1} of document {doc[i]} overlap or are not sorted by start")
    return doc, start, stop


def _cuts(doc: int, length: int, seq_len: int, starts: list[int], stops: list[int],
          max_images: int | None, first_only: bool) -> list[int]:
    """Ends of the pieces of one document with image spans ``[starts, stops)``: each piece as
    long as possible without cutting a span or holding more than ``max_images`` images."""
    ends: list[int] = []
    begin = i = 0                                   # spans[i:] start at or after begin
    while begin < length:
        end = min(begin + seq_len, length)
        j = bisect.bisect_left(starts, end, i)      # spans[i:j] start inside [begin, end)
        if max_images is not None and j - i > max_images:
            end, j = starts[i + max_images], i + max_images
        elif j > i and stops[j - 1] > end:          # spans are disjoint: only the last can straddle
            end, j = starts[j - 1], j - 1
        if end <= begin:                            # spans[i] starts at begin and cannot be placed
            why = f"longer than seq_len={seq_len}" if stops[i] - starts[i] > seq_len else f"max_images={max_images}"
            raise ValueError(f"document {doc}: image span [{starts[i]}, {stops[i]}) fits no example ({why})")
        ends.append(end)
        if first_only:
            break
        begin, i = end, j
    return ends


def _pieces(lengths: np.ndarray, seq_len: int, policy: str, spans: tuple[np.ndarray, ...] | None,
            max_images: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """(doc, start, stop, long documents, dropped tokens) of all pieces in document order."""
    too_long = lengths > seq_len
    images = None if spans is None else np.bincount(spans[0], minlength=len(lengths))
    if images is not None and max_images is not None:
        too_long |= images > max_images
    long_docs = np.flatnonzero(too_long)
    if policy == "error" and long_docs.size:
        d = int(long_docs[0])
        raise DocumentTooLong(d, int(lengths[d]), seq_len, None if images is None else int(images[d]), max_images)
    truncate = policy == "truncate"
    counts = (lengths > 0).astype(np.int64)
    if spans is None and not truncate:
        counts[long_docs] = -(-lengths[long_docs] // seq_len)
    elif spans is not None and long_docs.size:
        # Long documents with images are cut one at a time: they are few.
        bounds = np.searchsorted(spans[0], np.stack([long_docs, long_docs + 1])).tolist()
        starts, stops = spans[1].tolist(), spans[2].tolist()
        ends = [_cuts(d, int(lengths[d]), seq_len, starts[a:b], stops[a:b], max_images, truncate)
                for d, a, b in zip(long_docs.tolist(), *bounds)]
        counts[long_docs] = [len(e) for e in ends]
    doc = np.repeat(np.arange(len(lengths)), counts)
    firsts = cumulative(counts)
    stop = np.minimum((np.arange(len(doc)) - firsts[doc] + 1) * seq_len, lengths[doc])
    if spans is not None and long_docs.size:
        stop[np.concatenate([np.arange(firsts[d], firsts[d + 1]) for d in long_docs])] = np.concatenate(ends)
    start = np.zeros_like(stop)
    start[1:] = stop[:-1]
    start[firsts[:-1][counts > 0]] = 0
    dropped = int((lengths[long_docs] - stop[firsts[long_docs]]).sum()) if truncate else 0
    return doc, start, stop, len(long_docs), dropped


def _place(sizes: list[int], images: list[int] | None, seq_len: int, max_images: int, open_examples: int,
           best: bool) -> tuple[list[int], int]:
    """(example of each piece, number of examples) of packing pieces of ``sizes`` tokens (and
    ``images`` images) in order.

    At most ``open_examples`` examples with token room left are open (``rooms``/``image_rooms``/``ids``,
    in opening order); a full example closes at once, and opening one more pushes out the
    earliest opened.
    """
    rooms: list[int] = []
    image_rooms: list[int] = []
    ids: list[int] = []
    out = [0] * len(sizes)
    opened = most = 0       # most >= every room (exact after a failed scan): larger pieces skip the scan
    for k, (size, count) in enumerate(zip(sizes, itertools.repeat(0) if images is None else images)):
        slot = -1
        if size <= most:
            tightest = seq_len
            if images is None and not best:
                for j, room in enumerate(rooms):
                    if room >= size:
                        slot = j
                        break
            elif images is None:
                for j, room in enumerate(rooms):
                    if size <= room < tightest:
                        slot, tightest = j, room
                        if room == size:
                            break
            else:
                for j, (room, image_room) in enumerate(zip(rooms, image_rooms)):
                    if size <= room < tightest and count <= image_room:
                        slot, tightest = j, room
                        if not best or room == size:
                            break
            if slot < 0:
                most = max(rooms, default=0)
        if slot >= 0:
            out[k] = ids[slot]
            image_rooms[slot] -= count
            room = rooms[slot] = rooms[slot] - size
            if not room:
                del rooms[slot], image_rooms[slot], ids[slot]
            continue
        out[k] = opened
        if size < seq_len:                        # a full piece's example is closed at once
            if len(ids) >= open_examples:                # the earliest open example closes
                del rooms[0], image_rooms[0], ids[0]
            rooms.append(seq_len - size)
            image_rooms.append(max_images - count)
            ids.append(opened)
            most = max(most, seq_len - size)
        opened += 1
    return out, opened


def plan_pack(lengths: np.ndarray, seq_len: int, *, mode: str = "pack", algorithm: str = "first_fit",
              open_examples: int = 64, long_documents: str = "split", image_doc: np.ndarray | None = None,
              image_start: np.ndarray | None = None, image_stop: np.ndarray | None = None,
              max_images: int | None = None) -> PackPlan:
    """The packing plan of one chunk whose documents have rendered ``lengths``.

    Documents become pieces per ``long_documents`` (see the module docstring; length 0: none).
    ``"pad"``: each piece is its own example, in document order. ``"pack"``: each piece in turn
    joins an open example with room for its tokens (and images): the earliest opened
    (``first_fit``) or the one left with the least room (``best_fit``, ties to the earliest);
    else it opens a new one, and when that makes more than ``open_examples`` open (full ones count) the
    earliest opened closes for good. Examples are numbered in opening order, items within an
    example are in placement order. Image spans ``[image_start, image_stop)`` of documents
    ``image_doc`` (rendered coordinates, sorted by document then start) are never cut, and no
    example holds more than ``max_images`` images (None: no limit). Deterministic; all int64.
    """
    lengths = _int_array(lengths, "lengths")
    if lengths.size and lengths.min() < 0:
        raise ValueError(f"document {int(np.argmin(lengths))} has a negative length {int(lengths.min())}")
    for name, value in (("seq_len", seq_len), ("open_examples", open_examples)):
        if int(value) != value or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if max_images is not None and (int(max_images) != max_images or max_images < 0):
        raise ValueError(f"max_images must be None or a non-negative integer, got {max_images!r}")
    for name, value, allowed in (("mode", mode, MODES), ("algorithm", algorithm, ALGORITHMS),
                                 ("long_documents", long_documents, LONG_DOCUMENTS)):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
    given = [a is not None for a in (image_doc, image_start, image_stop)]
    if any(given) and not all(given):
        raise ValueError("give all of image_doc, image_start, image_stop, or none of them")
    spans = _check_images(lengths, image_doc, image_start, image_stop) if all(given) else None
    seq_len = int(seq_len)

    doc, start, stop, long_docs, dropped = _pieces(lengths, seq_len, long_documents, spans, max_images)
    if mode == "pad":
        example, count = np.arange(len(doc), dtype=np.int64), len(doc)
    else:
        images = None
        if spans is not None and max_images is not None:
            at = cumulative(lengths)
            image_at = at[spans[0]] + spans[1]
            images = (np.searchsorted(image_at, at[doc] + stop) - np.searchsorted(image_at, at[doc] + start)).tolist()
        example, count = _place((stop - start).tolist(), images, seq_len, max_images or 0, int(open_examples),
                                algorithm == "best_fit")
    order = np.argsort(np.asarray(example, np.int64), kind="stable")
    arrays = [np.asarray(a, np.int64)[order] for a in (doc, start, stop, example)]
    for a in arrays:
        a.setflags(write=False)
    truncate = long_documents == "truncate"
    doc_offsets = cumulative(lengths)
    doc_offsets.setflags(write=False)
    return PackPlan(*arrays, num_examples=int(count), truncated_docs=long_docs if truncate else 0,
                    dropped_tokens=dropped, split_docs=0 if truncate else long_docs, doc_offsets=doc_offsets)
