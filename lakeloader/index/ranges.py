"""Integer maps over ranges of a stream of pieces: the offsets of consecutive pieces and the piece
holding a position (``cumulative``, ``locate``), the examples of one stream under ``packing:
concat``, the strided readers' order, and the segments of documents within windows.

Pure functions over integer arrays. A dataset's *stream* is its documents in chunk order, each
rendered by its collation template (:mod:`lakeloader.index.render`: BOS/EOS, chat templates, FIM
sentinels); chunk ``c`` contributes ``render.stream_lengths`` tokens. Under ``concat``, example
``k`` of a stream covers stream tokens ``[k*L, k*L + L]`` (L+1 tokens: inputs are the first L,
targets the last L).
"""

from __future__ import annotations

import math

import numpy as np


def cumulative(lengths: np.ndarray) -> np.ndarray:
    """Offsets ``[0, l0, l0+l1, ...]`` of consecutive pieces (length n+1)."""
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


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
    return np.searchsorted(offsets, positions, side="right") - 1


def strided_chunk(iterator: np.ndarray, step: np.ndarray, ideal_readers: int) -> np.ndarray:
    """Position in the looped chunk list of the ``step``-th chunk of ideal reader ``iterator``,
    ``loop(chunks)[iterator::R*][step]`` (epoch = position // chunks, chunk = position % chunks)."""
    return np.asarray(iterator, np.int64) + np.asarray(step, np.int64) * ideal_readers


def strided_example(example: np.ndarray, ideal_readers: int) -> tuple[np.ndarray, np.ndarray]:
    """(ideal reader, example within that reader's stream) of global example ``example``:
    ``example[i] = chunk_examples[i % R*][i // R*]``."""
    example = np.asarray(example, np.int64)
    return example % ideal_readers, example // ideal_readers


def segments(doc_keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(segment_ids from 1, positions restarting at 0) along the last axis of windows whose
    tokens belong to documents ``doc_keys`` (equal keys = same document; documents are
    contiguous). Works on one window or a ``[rows, n]`` batch of them."""
    shape = doc_keys.shape
    keys = doc_keys.reshape(math.prod(shape[:-1]), shape[-1])
    starts = np.empty(keys.shape, dtype=bool)
    starts[:, :1] = True
    np.not_equal(keys[:, 1:], keys[:, :-1], out=starts[:, 1:])
    # Number segments across all rows at once, then rebase each row's numbers to start at 1.
    flat = starts.ravel()
    number = np.cumsum(flat, dtype=np.int32)
    first_token = np.flatnonzero(flat).astype(np.int32)
    positions = np.arange(flat.size, dtype=np.int32) - first_token[number - 1]
    number = number.reshape(keys.shape)
    segment_ids = number - number[:, :1] + 1
    return segment_ids.reshape(shape), positions.reshape(shape)



def cut_segments(cut_rows: np.ndarray, cut_at: np.ndarray, segment_ids: np.ndarray, positions: np.ndarray,
                 scratch: np.ndarray) -> None:
    """:func:`segments` of a ``[rows, n]`` batch of windows written into ``segment_ids`` and
    ``positions``, given where documents start instead of a key per token: a document starts at
    offset ``cut_at[i]`` of row ``cut_rows[i]`` (any order; repeats, offsets 0 and offsets past
    the row change nothing) and every row starts one. ``scratch``: an int32 array of the same
    shape to work in. A few passes over the batch, whatever the number of documents, and no
    allocation of the batch's size."""
    rows, n = segment_ids.shape
    cut_rows, cut_at = np.asarray(cut_rows, np.int64), np.asarray(cut_at, np.int64)
    inside = (cut_at > 0) & (cut_at < n)
    starts = np.unique(np.concatenate([np.arange(rows, dtype=np.int64) * n, cut_rows[inside] * n + cut_at[inside]]))
    first = starts % n == 0
    later = starts[~first]
    previous = starts[np.flatnonzero(~first) - 1]   # the start before each later one, in its row
    flat = scratch.reshape(-1)
    # Segment numbers: a running count of starts along each row.
    scratch.fill(0)
    scratch[:, 0] = 1
    flat[later] = 1
    np.cumsum(scratch, axis=1, out=segment_ids)
    # Positions: a running count of ones that each start resets to 0 (it adds minus the length
    # of the document before it, less one).
    scratch.fill(1)
    scratch[:, 0] = 0
    flat[later] = (previous - later + 1).astype(scratch.dtype)
    np.cumsum(scratch, axis=1, out=positions)
