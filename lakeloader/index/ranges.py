"""Integer maps over ranges of a stream of pieces: the offsets of consecutive pieces and the piece
holding a position (``cumulative``, ``locate``), the examples of one stream under ``packing:
concat``, the strided readers' order, and the segments of documents within spans.

Pure functions over integer arrays. A dataset's *stream* is its documents in chunk order, each
rendered by its collation template (:mod:`lakeloader.index.render`: BOS/EOS, chat templates, FIM
sentinels); chunk ``c`` contributes ``render.stream_lengths`` tokens. Under ``concat``, example
``k`` of a stream covers stream tokens ``[k*L, k*L + L]`` (L+1 tokens: inputs are the first L,
targets the last L).
"""

from __future__ import annotations

import functools
import math

import numpy as np


def cumulative(lengths: np.ndarray) -> np.ndarray:
    """Offsets ``[0, l0, l0+l1, ...]`` of consecutive pieces (length n+1)."""
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    # (np.cumsum's wrapper costs more than the sum of a few elements; this runs often)
    np.add.accumulate(lengths, dtype=np.int64, out=out[1:])
    return out


def run_indices(first: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``concatenate([arange(f, f + c) for f, c in zip(first, counts)])`` (int64), in a few array
    operations."""
    first, counts = np.asarray(first, np.int64), np.asarray(counts, np.int64)
    ends = np.add.accumulate(counts)
    return np.arange(int(ends[-1]) if len(ends) else 0, dtype=np.int64) + (first - (ends - counts)).repeat(counts)


def distinct(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(values, return_inverse=True)`` of a non-empty int64 array (the inverse
    int64): a single value without sorting, a few (a batch's row groups or chunks) sorted as
    Python integers, values already in order (examples read in order) by where they change
    (np.unique's sorts cost more for either)."""
    if bool((values == values[0]).all()):
        return values[:1], np.zeros(len(values), np.int64)
    if len(values) <= _FEW:
        used = np.array(sorted(set(values.tolist())), np.int64)
        return used, used.searchsorted(values)
    if bool((values[1:] >= values[:-1]).all()):
        changes = values[1:] != values[:-1]
        inverse = np.zeros(len(values), np.int64)
        np.add.accumulate(changes, dtype=np.int64, out=inverse[1:])
        return values[np.concatenate((_ONE_TRUE, changes))], inverse
    used, inverse = np.unique(values, return_inverse=True)
    return used, inverse.astype(np.int64, copy=False)


_ONE_TRUE = np.ones(1, bool)


_FEW = 256


def merged_runs(item: np.ndarray, first: np.ndarray, stop: np.ndarray, gap: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Ranges ``[first[i], stop[i])`` (non-negative) of items ``item[i]`` (non-negative), merged
    per item into runs: sorted by start, a range joins the run before it when it starts at most
    ``gap`` past the furthest end in that run. (each run's item, start and end, runs sorted by item
    then start; the run of each range), in a fixed number of array operations."""
    item, first, stop = (np.asarray(a, np.int64) for a in (item, first, stop))
    if not len(item):
        none = np.zeros(0, np.int64)
        return none, none, none, none
    order = np.lexsort((first, item))
    owner, lo, hi = item[order], first[order], stop[order]
    # Each item's ends shifted past every earlier item's: one running maximum restarts per item.
    shift = owner * (int(hi.max()) + 1)
    furthest = np.maximum.accumulate(hi + shift) - shift
    opens = np.ones(len(owner), bool)
    opens[1:] = (owner[1:] != owner[:-1]) | (lo[1:] > furthest[:-1] + gap)
    begins = np.flatnonzero(opens)
    run_of = np.empty(len(owner), np.int64)
    run_of[order] = np.cumsum(opens) - 1
    return owner[begins], lo[begins], np.maximum.reduceat(hi, begins), run_of


def train_examples(stream_total: int, seq_len: int) -> int:
    """Whole examples in one epoch of a stream of ``stream_total`` tokens (the tail is dropped)."""
    return max(0, (stream_total - 1) // seq_len)


def eval_examples(stream_total: int, seq_len: int) -> int:
    """Examples of one evaluation pass: every target token once, the last example padded."""
    return max(0, math.ceil((stream_total - 1) / seq_len))


def locate(offsets: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Index of the piece holding each stream position, given cumulative ``offsets``.

    Empty pieces are skipped: the result is the last piece starting at or before the position.
    """
    # (the array's method: np.searchsorted's wrapper costs more than a small search)
    return np.asarray(offsets).searchsorted(positions, side="right") - 1


def strided_chunk(iterator: np.ndarray, step: np.ndarray, ideal_readers: int) -> np.ndarray:
    """Position in the looped chunk list of the ``step``-th chunk of ideal reader ``iterator``,
    ``loop(chunks)[iterator::R*][step]`` (epoch = position // chunks, chunk = position % chunks)."""
    return np.asarray(iterator, np.int64) + np.asarray(step, np.int64) * ideal_readers


def strided_example(example: np.ndarray, ideal_readers: int) -> tuple[np.ndarray, np.ndarray]:
    """(ideal reader, example within that reader's stream) of global example ``example``:
    ``example[i] = chunk_examples[i % R*][i // R*]``."""
    example = np.asarray(example, np.int64)
    return example % ideal_readers, example // ideal_readers


def cut_segments(cut_rows: np.ndarray, cut_at: np.ndarray, segment_ids: np.ndarray | None,
                 positions: np.ndarray | None) -> None:
    """Segment ids (from 1) and positions (restarting at 0 with each document) of a ``[rows, n]``
    batch of spans, written into ``segment_ids`` and ``positions`` (int32, any views; None:
    not wanted, at least one is), given where documents start: a document starts at offset
    ``cut_at[i]`` of row ``cut_rows[i]`` (any order; repeats, offsets 0 and offsets past the row
    change nothing) and every row starts one. A few whole-batch passes and a fixed number of
    small ones, whatever the number of documents (this runs for every batch: each numpy call
    counts)."""
    rows, n = (positions if segment_ids is None else segment_ids).shape
    if not rows or not n:
        return
    cut_at = np.asarray(cut_at, np.int64)
    within = (cut_at > 0) & (cut_at < n)
    inside = np.asarray(cut_rows, np.int64)[within] * n + cut_at[within]
    row_bounds = _row_bounds(rows, n)
    # Every segment's flat start (the rows' own starts among them), then the batch's end.
    bounds = np.concatenate((row_bounds, inside))
    bounds.sort()   # the end stays last: every start is below it
    lengths = bounds[1:] - bounds[:-1]
    if len(inside):   # a repeated start (or a row's own) makes an empty segment: dropped
        kept = lengths > 0
        starts, lengths = bounds[:-1][kept], lengths[kept]
    else:
        starts = bounds[:-1]
    if segment_ids is not None:
        # Each start's segment number: its rank among its row's starts, from 1.
        number = _iota(len(starts) + 1, np.int64)[1:] - np.searchsorted(starts, row_bounds[:-1])[starts // n]
        fill_runs(number, lengths, segment_ids)
    if positions is not None:
        run_positions(starts, lengths, positions)


def fill_runs(values: np.ndarray, lengths: np.ndarray, out: np.ndarray) -> None:
    """Write ``values[i]`` ``lengths[i]`` times, run after run, into ``out`` (``[rows, n]``,
    int32, any view; the lengths add up to its size; every value in ``0..n``)."""
    rows, n = out.shape
    np.copyto(out, values.astype(_narrow(n)).repeat(lengths).reshape(rows, n))


def run_positions(starts: np.ndarray, lengths: np.ndarray, positions: np.ndarray) -> None:
    """Write into ``positions`` (``[rows, n]``, int32, any view) each element's offset within its
    run, for runs that tile the flattened array and none across a row's end: run ``i`` starts at
    flat index ``starts[i]`` and holds ``lengths[i]`` elements (runs of length 0 allowed). Two
    whole-array passes."""
    rows, n = positions.shape
    small = _narrow(n)
    # Each element's offset within its row minus its run's (no broadcast: numpy's broadcasting
    # loops are several times slower than same-shape ones).
    run_offsets = (starts % n).astype(small).repeat(lengths).reshape(rows, n)
    np.copyto(positions, np.subtract(_row_offsets(rows, n, small), run_offsets, out=run_offsets))


def _narrow(n: int) -> type:
    """The type runs of values in ``0..n`` (offsets within rows of ``n``, numbers of runs in one)
    are repeated in: 16 bits where they fit (numpy repeats and subtracts half the bytes; the
    copies into int32 arrays widen them)."""
    return np.int16 if n <= _INT16_MAX else np.int32


@functools.lru_cache(maxsize=8)
def _row_bounds(rows: int, n: int) -> np.ndarray:
    """The flat starts of ``rows`` rows of ``n``, then their end, made once per shape and read-only."""
    found = np.arange(rows + 1, dtype=np.int64) * n
    found.flags.writeable = False
    return found


_INT16_MAX = int(np.iinfo(np.int16).max)


@functools.lru_cache(maxsize=8)
def _row_offsets(rows: int, n: int, dtype: type) -> np.ndarray:
    """Each element's offset within its row of a ``[rows, n]`` array, made once per shape and read-only."""
    found = np.tile(np.arange(n, dtype=dtype), rows).reshape(rows, n)
    found.flags.writeable = False
    return found


@functools.lru_cache(maxsize=8)
def _iota(size: int, dtype: type) -> np.ndarray:
    """``arange(size)``, made once per size and read-only."""
    found = np.arange(size, dtype=dtype)
    found.flags.writeable = False
    return found
