"""Token windows of a dataset's stream: chunk row groups rendered (special tokens, templates)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

import numpy as np

from lakeloader.index.concat import cumulative, locate
from lakeloader.index.render import Rendered, Template, fim_choice, fim_counts, render, stream_lengths
from lakeloader.read.catalog_view import CatalogView, DatasetChunks, part_matrix
from lakeloader.read.chunks import ChunkFiles


@dataclasses.dataclass
class Piece:
    """Part of a window taken from one chunk."""

    position: int       # index into the chunk sequence the window was read from
    chunk: int          # global index of the chunk
    start: int          # first stream offset within the chunk
    tokens: np.ndarray
    docs: np.ndarray    # document index within the chunk of every token
    trainable: np.ndarray   # bool: whether each token is a training target


class StreamReader:
    """Reads ranges of one dataset's chunk streams (documents rendered by its collation
    template), one row group at a time."""

    def __init__(self, view: CatalogView, files: ChunkFiles, template: Template) -> None:
        self.view = view
        self.files = files
        self.template = template
        self._row_groups: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]] = {}
        self._lock = threading.Lock()

    def chunk_lengths(self, chunks: DatasetChunks) -> np.ndarray:
        """Rendered stream tokens of each committed chunk (from catalog counts only)."""
        fim = fim_counts(self.template.fim, np.arange(chunks.committed), chunks.num_docs)
        return stream_lengths(self.template, chunks.num_tokens, chunks.num_docs, chunks.num_parts, fim)

    def _fim(self, chunks: DatasetChunks, chunk: int, docs: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, ...] | None:
        if self.template.fim is None:
            return None
        return fim_choice(self.template.fim, chunk, int(chunks.num_docs[chunk]), docs, lengths)

    def groups(self, chunks: DatasetChunks, chunk: int) -> tuple[np.ndarray, np.ndarray]:
        """(stream offsets of the row groups within the chunk, first document of each)."""
        key = (chunks.fingerprint, chunk)
        with self._lock:
            found = self._row_groups.get(key)
        if found is None:
            groups = self.view.row_groups(chunks.name, chunk)
            first_doc = groups["first_doc"].astype(np.int64)
            num_docs = groups["num_docs"].astype(np.int64)
            fim_docs = np.zeros(len(first_doc), np.int64)
            if self.template.fim is not None:
                # Which documents are FIM does not depend on their lengths: count them per group.
                docs = np.arange(int(chunks.num_docs[chunk]), dtype=np.int64)
                selected = self._fim(chunks, chunk, docs, np.zeros(len(docs), np.int64))[0]
                fim_docs = np.add.reduceat(selected.astype(np.int64), first_doc) if len(docs) else fim_docs
            lengths = stream_lengths(self.template, groups["num_tokens"], num_docs,
                                     part_matrix(groups["num_parts"], len(self.template.kind_names)), fim_docs)
            found = (cumulative(lengths), first_doc)
            with self._lock:
                if len(self._row_groups) > 4096:
                    self._row_groups.clear()
                self._row_groups[key] = found
        return found

    def rendered_group(self, chunks: DatasetChunks, chunk: int, group: int) -> Rendered:
        """One row group's documents rendered (cached apart from the stored row group, which is
        read only when the rendering is not cached)."""
        key = ("rendered", chunks.fingerprint, chunk, group, self.template.fingerprint)
        cached = self.files.cache.get(key)
        if cached is None:
            stored = self.files.row_group(chunks, chunk, group)
            parts = stored.parts
            first_doc = int(self.groups(chunks, chunk)[1][group])
            fim = self._fim(chunks, chunk, first_doc + np.arange(parts.num_docs), parts.content_lengths)
            cached = render(self.template, stored.values, parts.part_lengths, parts.part_kinds, parts.part_doc,
                            parts.num_docs, fim)
            self.files.cache.put(key, cached)
        return cached

    def chunk_range(self, chunks: DatasetChunks, chunk: int, start: int, stop: int,
                    position: int = 0) -> Piece:
        """Stream tokens ``[start, stop)`` of chunk ``chunk`` with each token's document."""
        offsets, first_docs = self.groups(chunks, chunk)
        tokens, docs = [], []
        group = int(locate(offsets, np.array([start]))[0]) if stop > start else len(first_docs)
        trainable = []
        while group < len(first_docs) and offsets[group] < stop:
            rendered = self.rendered_group(chunks, chunk, group)
            a = max(start - offsets[group], 0)
            b = min(stop - offsets[group], len(rendered.tokens))
            tokens.append(rendered.tokens[a:b])
            trainable.append(rendered.trainable[a:b])
            first, last = np.searchsorted(rendered.doc_starts, [a, b - 1], side="right") - 1
            bounds = np.clip(rendered.doc_starts[first : last + 2], a, b)
            docs.append(np.repeat(np.arange(first, last + 1) + first_docs[group], np.diff(bounds)))
            group += 1
        return Piece(
            position=position, chunk=chunk, start=start,
            tokens=np.concatenate(tokens) if tokens else np.zeros(0, np.int32),
            docs=np.concatenate(docs) if docs else np.zeros(0, np.int64),
            trainable=np.concatenate(trainable) if trainable else np.zeros(0, bool),
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
