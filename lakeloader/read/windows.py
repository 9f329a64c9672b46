"""Token windows of a dataset's stream: chunk row groups rendered (special tokens, templates)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from lakeloader.contracts.specs import Template
from lakeloader.index.ranges import cumulative, locate
from lakeloader.index.render import Rendered, fim_choice, fim_counts, render, stream_lengths
from lakeloader.read.catalog_view import CatalogView, DatasetChunks, part_matrix
from lakeloader.read.chunks import ChunkFiles
from lakeloader.read.lru import LRU


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
        self._row_groups: LRU[tuple[str, int], tuple[np.ndarray, np.ndarray]] = LRU(4096)

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
        return self._row_groups.get((chunks.fingerprint, chunk), lambda: self._groups(chunks, chunk))

    def prefetch_groups(self, chunks: DatasetChunks, wanted: Sequence[int] | np.ndarray) -> None:
        """:meth:`groups` of the chunks ``wanted`` that are not cached yet, from one catalog
        query (a shuffled batch's rows can lie in as many chunks as it has rows)."""
        missing = sorted(c for c in {int(c) for c in wanted} if (chunks.fingerprint, c) not in self._row_groups)
        if len(missing) < 2:
            return
        found = self.view.row_groups_of(chunks.name, missing)
        for chunk in missing:
            self._row_groups.get((chunks.fingerprint, chunk), lambda c=chunk: self._groups(chunks, c, found[c]))

    def _groups(self, chunks: DatasetChunks, chunk: int,
                groups: dict[str, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
        if groups is None:
            groups = self.view.row_groups(chunks.name, chunk)
        first_doc = groups["first_doc"].astype(np.int32)   # per-token document keys stay int32
        num_docs = groups["num_docs"].astype(np.int64)
        fim_docs = np.zeros(len(first_doc), np.int64)
        if self.template.fim is not None:
            # Which documents are FIM does not depend on their lengths: count them per group.
            docs = np.arange(int(chunks.num_docs[chunk]), dtype=np.int64)
            selected = self._fim(chunks, chunk, docs, np.zeros(len(docs), np.int64))[0]
            fim_docs = np.add.reduceat(selected.astype(np.int64), first_doc) if len(docs) else fim_docs
        lengths = stream_lengths(self.template, groups["num_tokens"], num_docs,
                                 part_matrix(groups["num_parts"], len(self.template.kind_names)), fim_docs)
        return cumulative(lengths), first_doc

    def rendered_group(self, chunks: DatasetChunks, chunk: int, group: int) -> Rendered:
        """One row group's documents rendered (cached apart from the stored row group, which is
        read only when the rendering is not cached)."""
        key = ("rendered", chunks.fingerprint, chunk, group, self.template.fingerprint)
        return self.files.cache.get(key, lambda: self._render_group(chunks, chunk, group))

    def _render_group(self, chunks: DatasetChunks, chunk: int, group: int) -> Rendered:
        stored = self.files.row_group(chunks, chunk, group)
        parts = stored.parts
        first_doc = int(self.groups(chunks, chunk)[1][group])
        fim = self._fim(chunks, chunk, first_doc + np.arange(parts.num_docs), parts.content_lengths)
        return render(self.template, stored.values, parts.part_lengths, parts.part_kinds, parts.part_doc,
                      parts.num_docs, fim)

    def chunk_range(self, chunks: DatasetChunks, chunk: int, start: int, stop: int,
                    position: int = 0) -> Piece:
        """Stream tokens ``[start, stop)`` of chunk ``chunk`` with each token's document."""
        offsets, first_docs = self.groups(chunks, chunk)
        group = int(np.searchsorted(offsets, start, side="right")) - 1 if stop > start else len(first_docs)
        tokens, docs, trainable = [], [], []
        while group < len(first_docs) and offsets[group] < stop:
            rendered = self.rendered_group(chunks, chunk, group)
            a = max(start - int(offsets[group]), 0)
            b = min(stop - int(offsets[group]), len(rendered.tokens))
            tokens.append(rendered.tokens[a:b])
            trainable.append(rendered.trainable[a:b])
            docs.append(rendered.docs[a:b] + first_docs[group])
            group += 1
        if len(tokens) == 1:   # the common case: views of one cached row group
            return Piece(position, chunk, start, tokens[0], docs[0], trainable[0])
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

    def windows(self, chunks: DatasetChunks, sequence: Sequence[int], sequence_offsets: np.ndarray,
                starts: np.ndarray, length: int) -> list[list[Piece]]:
        """:meth:`window` of many starts. Windows inside one row group (nearly all of them) are
        located together and become views of its cached rendering; the rest take the general path."""
        starts = np.asarray(starts, np.int64)
        found: list[list[Piece] | None] = [None] * len(starts)
        position = locate(sequence_offsets, starts)
        inside = (position == locate(sequence_offsets, starts + length - 1)) & (position < len(sequence))
        self.prefetch_groups(chunks, np.asarray(sequence)[np.unique(position[position < len(sequence)])])
        for p in np.unique(position[inside]).tolist():
            rows = np.flatnonzero(inside & (position == p))
            chunk = int(sequence[p])
            local = starts[rows] - sequence_offsets[p]
            offsets, first_docs = self.groups(chunks, chunk)
            group = locate(offsets, local)
            whole = group == locate(offsets, local + length - 1)
            for row, start, g in zip(rows[whole].tolist(), local[whole].tolist(), group[whole].tolist()):
                rendered = self.rendered_group(chunks, chunk, g)
                a = start - int(offsets[g])
                found[row] = [Piece(p, chunk, start, rendered.tokens[a : a + length],
                                    rendered.docs[a : a + length] + first_docs[g], rendered.trainable[a : a + length])]
        for row in range(len(starts)):
            if found[row] is None:
                found[row] = self.window(chunks, sequence, sequence_offsets, int(starts[row]), length)
        return found  # type: ignore[return-value]
