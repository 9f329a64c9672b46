"""Token windows of a dataset's stream: chunk row groups turned into stream tokens with specials."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

import numpy as np

from lakeloader.index.concat import cumulative, locate
from lakeloader.read.catalog_view import CatalogView, DatasetChunks
from lakeloader.read.chunks import ChunkFiles


@dataclasses.dataclass(frozen=True)
class Specials:
    """Token ids added at collation."""

    eos: int
    bos: int | None
    pad: int

    @property
    def count(self) -> int:
        """Special tokens added per document."""
        return 1 + (self.bos is not None)


@dataclasses.dataclass
class Piece:
    """Part of a window taken from one chunk."""

    position: int       # index into the chunk sequence the window was read from
    chunk: int          # global index of the chunk
    start: int          # first stream offset within the chunk
    tokens: np.ndarray
    docs: np.ndarray    # document index within the chunk of every token


class StreamReader:
    """Reads ranges of chunk streams (documents with their specials), one row group at a time."""

    def __init__(self, view: CatalogView, files: ChunkFiles, specials: Specials) -> None:
        self.view = view
        self.files = files
        self.specials = specials
        self._row_groups: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]] = {}
        self._lock = threading.Lock()

    def _groups(self, chunks: DatasetChunks, chunk: int) -> tuple[np.ndarray, np.ndarray]:
        """(stream offsets of the row groups within the chunk, first document of each)."""
        key = (chunks.fingerprint, chunk)
        with self._lock:
            found = self._row_groups.get(key)
        if found is None:
            groups = self.view.row_groups(chunks.name, chunk)
            lengths = groups["num_tokens"] + groups["num_docs"] * self.specials.count
            found = (cumulative(lengths.astype(np.int64)), groups["first_doc"].astype(np.int64))
            with self._lock:
                if len(self._row_groups) > 4096:
                    self._row_groups.clear()
                self._row_groups[key] = found
        return found

    def _group_stream(self, chunks: DatasetChunks, chunk: int, group: int) -> tuple[np.ndarray, np.ndarray]:
        """(stream tokens, document start offsets + end) of one row group, specials inserted."""
        key = ("stream", chunks.fingerprint, chunk, group, self.specials)
        cached = self.files.cache.get(key)
        if cached is not None:
            return cached
        values, offsets = self.files.row_group(chunks, chunk, group)
        specials = self.specials
        lengths = np.diff(offsets)
        docs = len(lengths)
        starts = offsets[:-1] + np.arange(docs, dtype=np.int64) * specials.count
        stream = np.empty(len(values) + docs * specials.count, dtype=np.int32)
        lead = int(specials.bos is not None)
        owner = np.repeat(np.arange(docs, dtype=np.int64), lengths)
        stream[np.arange(len(values), dtype=np.int64) + owner * specials.count + lead] = values
        if specials.bos is not None:
            stream[starts] = specials.bos
        stream[starts + lead + lengths] = specials.eos
        item = (stream, np.append(starts, len(stream)))
        self.files.cache.put(key, item)
        return item

    def chunk_range(self, chunks: DatasetChunks, chunk: int, start: int, stop: int,
                    position: int = 0) -> Piece:
        """Stream tokens ``[start, stop)`` of chunk ``chunk`` with each token's document."""
        offsets, first_docs = self._groups(chunks, chunk)
        tokens, docs = [], []
        group = int(locate(offsets, np.array([start]))[0]) if stop > start else len(first_docs)
        while group < len(first_docs) and offsets[group] < stop:
            stream, doc_starts = self._group_stream(chunks, chunk, group)
            a = max(start - offsets[group], 0)
            b = min(stop - offsets[group], len(stream))
            tokens.append(stream[a:b])
            local = np.searchsorted(doc_starts, np.arange(a, b), side="right") - 1
            docs.append(local + first_docs[group])
            group += 1
        return Piece(
            position=position, chunk=chunk, start=start,
            tokens=np.concatenate(tokens) if tokens else np.zeros(0, np.int32),
            docs=np.concatenate(docs) if docs else np.zeros(0, np.int64),
        )

    def window(self, chunks: DatasetChunks, sequence: Sequence[int], sequence_offsets: np.ndarray,
               start: int, length: int) -> list[Piece]:
        """``length`` stream tokens from offset ``start`` of the stream formed by the chunks
        ``sequence`` (global indices) whose cumulative stream offsets are ``sequence_offsets``."""
        pieces = []
        position = int(locate(sequence_offsets, np.array([start]))[0])
        end = start + length
        while start < end:
            if position >= len(sequence):
                raise IndexError("window runs past the end of the chunk sequence")
            chunk_start = int(sequence_offsets[position])
            chunk_stop = int(sequence_offsets[position + 1])
            stop = min(end, chunk_stop)
            if stop > start:
                pieces.append(self.chunk_range(chunks, int(sequence[position]), start - chunk_start,
                                               stop - chunk_start, position))
            start = max(start, stop)
            position += 1
        return pieces
