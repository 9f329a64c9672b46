"""The row groups a batch's spans need that no cache holds, read for them concurrently. Read cold
(a reader's first batch: a start or a resume; a full shuffle over more than the cache keeps), a
row group whose spans reach little of it is read from just the pages they need, as runs of
nearby spans; any other is decoded whole (the batches that follow reach the rest of it)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import numpy as np

from lakeloader.contracts.chunk_file import ChunkParts
from lakeloader.index.ranges import merged_runs
from lakeloader.index.render import render_compact, rendered_doc_starts
from lakeloader.read.catalog_view import DatasetChunks
from lakeloader.read.renderings import Renderings, concurrently, doc_choice
from lakeloader.read.span_set import RenderedGroup, SpanSet

# A row group not cached is read from the pages its spans need when they reach at most 1 / PAGES_SHARE
# of its tokens, as ranges of spans less than RANGE_GAP tokens apart.
PAGES_SHARE = 4
RANGE_GAP = 1 << 14

_NONE = np.zeros(0, np.int64)


def page_runs(missing: list[int], ranges: tuple[np.ndarray, np.ndarray, np.ndarray], lengths: np.ndarray
              ) -> tuple[dict[int, tuple[int, int]], np.ndarray, np.ndarray, np.ndarray]:
    """Which row groups of ``missing`` to read from pages: those whose ``ranges`` (row group,
    first token, one past the last, per span or piece) reach at most 1 / :data:`PAGES_SHARE` of
    their ``lengths`` rendered tokens, as runs of ranges less than :data:`RANGE_GAP` apart. (For
    each of them its runs ``[a, b)``; the runs' starts and ends; the run of each range, -1 where
    its row group is read otherwise.)"""
    group, lo, hi = ranges
    candidate = np.zeros(len(lengths), bool)
    candidate[missing] = True
    mine = np.flatnonzero(candidate[group])
    run_group, run_lo, run_hi, run_of = merged_runs(group[mine], lo[mine], hi[mine], RANGE_GAP)
    kept = ~(np.bincount(run_group, run_hi - run_lo, len(lengths)) * PAGES_SHARE > lengths)[run_group]
    run_of_range = np.full(len(group), -1, np.int64)
    run_of_range[mine] = np.where(kept[run_of], (np.cumsum(kept) - 1)[run_of], -1)
    run_group, run_lo, run_hi = run_group[kept], run_lo[kept], run_hi[kept]
    used, firsts = np.unique(run_group, return_index=True)
    bounds = np.append(firsts, len(run_group)).tolist()
    return ({j: (a, b) for j, a, b in zip(used.tolist(), bounds[:-1], bounds[1:])}, run_lo, run_hi, run_of_range)


def render_ranges(renderings: Renderings, chunks: DatasetChunks, chunk: int, group: int, first_doc: int,
                  lo: np.ndarray, hi: np.ndarray) -> list[tuple[RenderedGroup, int, int]]:
    """For each rendered range ``[lo[k], hi[k])`` of row group ``group`` of chunk ``chunk`` (whose
    first document is ``first_doc``), the documents reaching it rendered: (rendering, where it
    starts in the row group's rendering, its first document within the row group). Only their
    tokens' pages are decoded (as the file allows)."""
    template = renderings.template
    fim: tuple[np.ndarray, ...] | None = None
    starts = np.zeros(1, np.int64)   # the rendered documents' starts, from the row group's part layout

    def pick(parts: ChunkParts) -> list[tuple[int, int]]:
        nonlocal fim, starts
        fim = doc_choice(template, chunks, chunk, first_doc + np.arange(parts.num_docs), parts.content_lengths)
        starts = rendered_doc_starts(template, parts.part_lengths, parts.part_kinds, parts.part_doc, parts.num_docs,
                                     fim)
        return list(zip((np.searchsorted(starts, lo, "right") - 1).tolist(),
                        np.searchsorted(starts, hi, "left").tolist()))

    found = []
    for stored in renderings.files.read_documents(chunks, chunk, group, pick):
        first, parts = stored.first_doc, stored.parts
        their_fim = None if fim is None else tuple(x[first:first + parts.num_docs] for x in fim)
        rendered = RenderedGroup(*render_compact(template, stored.values, parts.part_lengths, parts.part_kinds,
                                                 parts.part_doc, parts.num_docs, their_fim))
        found.append((rendered, int(starts[first]), first))
    return found


@dataclasses.dataclass
class ReadGroups:
    """Row groups read for ranges of their tokens (:func:`read_groups`): the renderings, those of
    the row groups asked for then those of further runs read from pages; for every rendering, the
    index of its row group among those asked for and the first document it holds (within the chunk)."""

    groups: list[RenderedGroup]
    origin: list[int]
    first_doc: list[int]
    from_pages: list[int]   # the row groups read from pages (indexes among those asked for)


def read_groups(renderings: Renderings, chunks: DatasetChunks, wanted: list[tuple[int, int]], first_docs: list[int],
                lengths: np.ndarray, ranges: tuple[np.ndarray, np.ndarray, np.ndarray], from_pages: bool) -> ReadGroups:
    """The renderings of the row groups ``wanted`` (``(chunk, group)``, ``first_docs`` the first
    document of each, ``lengths`` their rendered tokens): the cached ones, and those not cached
    read concurrently. ``ranges`` are the tokens asked for (index into ``wanted``, first token, one
    past the last; a span inside a row group, a piece of one across row groups, a packed item).

    ``from_pages`` (a cold read): a row group not cached whose ranges reach little of it is read
    from the pages they need, and its ranges are re-pointed (in place) at renderings of just the
    documents they reach (one per run of nearby ranges: the row group's own place, then appended).
    Any other is decoded whole and cached."""
    groups = renderings.cached(chunks, wanted)
    missing = [j for j, rendered in enumerate(groups) if rendered is None]
    found = ReadGroups(groups, list(range(len(wanted))), list(first_docs), [])  # type: ignore[arg-type]
    runs: dict[int, tuple[int, int]] = {}
    # (per run: where its rendering went, an index into groups, and where it starts in its row group)
    run_lo = run_hi = run_of_range = run_target = run_base = _NONE
    if from_pages and missing and not renderings.keeps_parts and not chunks.filtered:
        runs, run_lo, run_hi, run_of_range = page_runs(missing, ranges, lengths)
        run_target, run_base = np.zeros(len(run_lo), np.int64), np.zeros(len(run_lo), np.int64)
    reads: list[Callable[[], RenderedGroup | list[tuple[RenderedGroup, int, int]]]] = [
        functools.partial(render_ranges, renderings, chunks, *wanted[j], first_docs[j],
                          run_lo[runs[j][0]:runs[j][1]], run_hi[runs[j][0]:runs[j][1]]) if j in runs
        else functools.partial(renderings.get, chunks, *wanted[j]) for j in missing]
    for j, result in zip(missing, concurrently(reads)):
        if isinstance(result, RenderedGroup):
            groups[j] = result
            continue
        for k, (rendered, base, first) in enumerate(result):
            g = j if k == 0 else len(groups)
            if k:
                groups.append(rendered)
                found.origin.append(j)
                found.first_doc.append(first_docs[j] + first)
            else:
                groups[j] = rendered
                found.first_doc[j] = first_docs[j] + first
            run_target[runs[j][0] + k], run_base[runs[j][0] + k] = g, base
    if runs:   # the ranges re-pointed at their runs' renderings
        moved = np.flatnonzero(run_of_range >= 0)
        run = run_of_range[moved]
        range_group, range_lo, range_hi = ranges
        range_group[moved] = run_target[run]
        range_lo[moved] -= run_base[run]
        range_hi[moved] -= run_base[run]
    found.from_pages = list(runs)
    return found


def fill_groups(renderings: Renderings, chunks: DatasetChunks, found: SpanSet, wanted: list[tuple[int, int]],
                lengths: np.ndarray, ranges: tuple[np.ndarray, np.ndarray, np.ndarray], from_pages: bool) -> list[int]:
    """Fills ``found.groups`` with the renderings of the row groups ``wanted`` (``(chunk, group)``
    of each group of ``found``): :func:`read_groups`, a run read from pages added to ``found`` as
    a row group of its own. Returns the row groups read from pages (indexes into ``wanted``)."""
    read = read_groups(renderings, chunks, wanted, found.group_first_doc, lengths, ranges, from_pages)
    found.groups.extend(read.groups)
    found.group_position = [found.group_position[j] for j in read.origin]
    found.group_chunk = [found.group_chunk[j] for j in read.origin]
    found.group_first_doc = read.first_doc
    return read.from_pages
