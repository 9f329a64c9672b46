"""Row groups rendered by a dataset's collation template (special tokens, chat templates, FIM,
infilling), each once, into the compact form the reader's byte-bounded cache keeps
(``loader.cache_bytes``): its tokens in the stored dtype (uint16 when the vocabulary fits), a
target flag per token only when some token is not a target, and its documents' boundaries as
offsets (no per-token document key)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np
import pyarrow as pa

from lakeloader.contracts.errors import InputError
from lakeloader.contracts.specs import Template
from lakeloader.index.image_tokens import with_image_values
from lakeloader.index.render import Choice, collation_choice, render_compact
from lakeloader.read.catalog_view import DatasetChunks
from lakeloader.read.chunks import ChunkFiles
from lakeloader.read.group_tables import GroupTables
from lakeloader.read.span_set import RenderedGroup

T = TypeVar("T")

# Row groups a batch needs that no cache holds are decoded and rendered this many at a time
# (Parquet decoding and most numpy work run without the GIL): a shuffled first batch can need as
# many row groups as it has rows. One pool for every reader of the process; idle threads cost nothing.
_DECODE_POOL = concurrent.futures.ThreadPoolExecutor(min(4, os.cpu_count() or 1),
                                                     thread_name_prefix="lakeloader-decode")


def concurrently(calls: Sequence[Callable[[], T]]) -> list[T]:
    """Each call's result, the calls run in the decode threads when there are several; the first
    error is raised here, as making that call in this thread would raise it."""
    if len(calls) < 2:
        return [call() for call in calls]
    running = [_DECODE_POOL.submit(call) for call in calls]
    return [future.result() for future in running]


def doc_choice(template: Template, chunks: DatasetChunks, chunk: int, docs: np.ndarray,
               lengths: np.ndarray) -> Choice | None:
    """The FIM or infilling choice (:func:`~lakeloader.index.render.collation_choice`) of
    documents ``docs`` of chunk ``chunk``, of content ``lengths``; None for a template with neither."""
    if template.fim is None and template.infill is None:
        return None
    return collation_choice(template, chunk, int(chunks.num_docs[chunk]), docs, lengths)


class Renderings:
    """The row groups of a dataset rendered by ``template``, kept in ``files``' cache (under the
    dataset, the row group and the template); ``tables`` give each row group's first document."""

    def __init__(self, files: ChunkFiles, template: Template, tables: GroupTables) -> None:
        self.files = files
        self.template = template
        self.tables = tables
        # Whether renderings keep their stored parts (templates that need them after rendering).
        self.keeps_parts = template.image_kind is not None or "response" in template.kind_names

    def cached(self, chunks: DatasetChunks, wanted: Sequence[tuple[int, int]]) -> list[RenderedGroup | None]:
        """The cached rendering of each ``(chunk, group)`` of ``wanted`` (None where not cached;
        each marked as just used; nothing rendered)."""
        return self.files.cache.cached(self._keys(chunks, wanted))

    def all_cached(self, chunks: DatasetChunks, wanted: Sequence[tuple[int, int]]) -> list[RenderedGroup] | None:
        """:meth:`cached` of ``wanted`` if the cache holds every one, else None."""
        found = self.cached(chunks, wanted)
        return None if any(value is None for value in found) else found  # type: ignore[return-value]

    def get(self, chunks: DatasetChunks, chunk: int, group: int) -> RenderedGroup:
        """Row group ``group`` of chunk ``chunk`` rendered (cached; :meth:`render` once if not)."""
        return self.files.cache.get(self._keys(chunks, ((chunk, group),))[0],
                                    lambda: self.render(chunks, chunk, group))

    def get_all(self, chunks: DatasetChunks, wanted: Sequence[tuple[int, int]]) -> list[RenderedGroup]:
        """:meth:`get` of each ``(chunk, group)`` of ``wanted``; those not cached yet are rendered
        concurrently (in the process's decode threads)."""
        found = self.cached(chunks, wanted)
        missing = [i for i, value in enumerate(found) if value is None]
        for i, rendered in zip(missing, concurrently([functools.partial(self.get, chunks, *wanted[i])
                                                      for i in missing])):
            found[i] = rendered
        return found  # type: ignore[return-value]

    def render(self, chunks: DatasetChunks, chunk: int, group: int) -> RenderedGroup:
        """Row group ``group`` of chunk ``chunk`` read from its file and rendered, not cached (nor
        is the stored row group kept)."""
        stored = self.files.read_row_group(chunks, chunk, group)
        try:   # (images' placeholder runs of their sizes, under a patches resolution)
            values, parts = with_image_values(self.template, stored.values, stored.parts)
        except InputError as exc:
            raise InputError(f"chunk {chunk} of dataset {chunks.name!r}: {exc}") from None
        first_doc = int(self.tables.of(chunks, chunk)[1][group])
        fim = doc_choice(self.template, chunks, chunk, first_doc + np.arange(parts.num_docs), parts.content_lengths)
        rendered = RenderedGroup(*render_compact(self.template, values, parts.part_lengths, parts.part_kinds,
                                                 parts.part_doc, parts.num_docs, fim))
        if self.keeps_parts:
            rendered = dataclasses.replace(rendered, parts=parts, refs=stored.refs)
        del stored, parts, values
        # The decoded row group is gone: hand the allocator's freed pages back (Arrow's pool
        # otherwise keeps them, ~100 MB over a lake's first epoch).
        pa.default_memory_pool().release_unused()
        return rendered

    def _keys(self, chunks: DatasetChunks, wanted: Sequence[tuple[int, int]]) -> list[tuple[object, ...]]:
        dataset, template = chunks.fingerprint, self.template.fingerprint
        return [("rendered", dataset, chunk, group, template) for chunk, group in wanted]
