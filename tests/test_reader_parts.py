"""The reader's parts, each alone against a plain reference: a small lake held in memory (chunks
of row groups of documents, some chunks without any), whose stream is every chunk's documents
rendered whole by the general render and put end to end.

- row-group tables: offsets and first documents are those of the row groups' renderings, from
  one catalog query for the chunks not kept;
- renderings: each row group's is its slice of the stream, rendered once;
- cold page ranges: runs are a plain merge of the ranges; a range's rendering from pages is a
  slice of the row group's;
- spans: every span (cold or warm, inside a row group or across row groups and chunks, found
  together or alone) is its slice of the stream, with its documents' boundaries;
- read-ahead: the row groups after the last one reached, in stream order, decoded in the ahead
  thread only;
- the facade keeps every call lakeloader/feed makes of it."""

from __future__ import annotations

import dataclasses
import re
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lakeloader
from lakeloader.contracts.chunk_file import ChunkParts
from lakeloader.contracts.specs import Fim, Infill, Template, make_template
from lakeloader.index.ranges import cumulative
from lakeloader.index.render import collation_choice, render
from lakeloader.read import cold_pages, read_ahead
from lakeloader.read.catalog_view import DatasetChunks
from lakeloader.read.chunks import RowGroup, RowGroupCache
from lakeloader.read.group_tables import GroupTables
from lakeloader.read.read_ahead import ReadAhead
from lakeloader.read.renderings import Renderings
from lakeloader.read.spans import SpanReader
from lakeloader.read.span_set import Piece
from lakeloader.read.stream_reader import StreamReader

TEMPLATES = {
    "text": make_template(("text",), bos=1, eos=2),
    "chat": make_template(("user", "assistant"), bos=None, eos=2, part_prefix={"user": [10], "assistant": [11, 12]},
                          part_suffix={"assistant": [13]}, trains={"assistant"}),
    "fim": make_template(("text",), bos=None, eos=2, fim=Fim(rate=0.5, spm_rate=0.5, prefix=3, middle=4, suffix=5,
                                                            key=7)),
    "infill": make_template(("text",), bos=1, eos=2, infill=Infill(
        rate=0.5, gaps=(1, 3), gap_tokens=(1, 6), mask=3, sep=4, start=None, end=5, cls=6, cls_each=True, key=7)),
}


@dataclasses.dataclass
class Lake:
    """A dataset's chunks in memory as its catalog view and chunk files show them (with a cache
    of ``cache_bytes``), and the catalog queries and file reads made of it."""

    template: Template
    groups: list[list[RowGroup]]   # per chunk, its row groups (documents numbered from 0 in each)
    cache_bytes: int = 1 << 24
    queries: list[list[int]] = dataclasses.field(default_factory=list)   # chunks of each catalog query
    reads: list[tuple[int, int, bool]] = dataclasses.field(default_factory=list)   # (chunk, group, in part)

    def __post_init__(self) -> None:
        self.cache = RowGroupCache(self.cache_bytes)
        docs = [sum(g.parts.num_docs for g in groups) for groups in self.groups]
        tokens = [sum(len(g.values) for g in groups) for groups in self.groups]
        parts = np.array([self._part_counts(groups).sum(axis=0) for groups in self.groups], np.int64)
        self.chunks = DatasetChunks("d", "d-fingerprint", True, len(docs), np.array(docs, np.int64),
                                    np.array(tokens, np.int64), "uint16", parts, records=lambda chunk: None)  # type: ignore

    def _part_counts(self, groups: list[RowGroup]) -> np.ndarray:
        kinds = len(self.template.kind_names)
        return np.array([np.bincount(g.parts.part_kinds, minlength=kinds) for g in groups], np.int64).reshape(-1, kinds)

    # -- what the catalog view and the chunk files answer -----------------------------------------

    def row_groups_of(self, name: str, chunks: list[int], kinds: int | None = None) -> dict[int, dict[str, np.ndarray]]:
        self.queries.append(list(chunks))
        found = {}
        for chunk in chunks:
            docs = np.array([g.parts.num_docs for g in self.groups[chunk]], np.int64)
            counts = {"first_doc": np.cumsum(docs) - docs, "num_docs": docs,
                      "num_tokens": np.array([len(g.values) for g in self.groups[chunk]], np.int64)}
            if kinds is not None:
                counts["num_parts"] = self._part_counts(self.groups[chunk])
            found[chunk] = counts
        return found

    def read_row_group(self, chunks: DatasetChunks, chunk: int, group: int) -> RowGroup:
        return self.read_documents(chunks, chunk, group)[0]

    def read_documents(self, chunks: DatasetChunks, chunk: int, group: int,
                       pick: Callable[[ChunkParts], Sequence[tuple[int, int]]] | None = None) -> list[RowGroup]:
        stored = self.groups[chunk][group]
        self.reads.append((chunk, group, pick is not None))
        if pick is None:
            return [stored]
        parts, values = stored.parts, cumulative(stored.parts.part_lengths)
        found = []
        for first, stop in pick(parts):
            a, b = np.searchsorted(parts.part_doc, [first, stop]).tolist()
            found.append(RowGroup(stored.values[values[a]:values[b]], ChunkParts(
                parts.part_lengths[a:b], parts.part_kinds[a:b], parts.part_doc[a:b] - first, stop - first), None, first))
        return found

    # -- the reference ----------------------------------------------------------------------------

    def rendered_chunk(self, chunk: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Chunk ``chunk``'s documents rendered together by the general render: (tokens, target
        flags, where each document starts, then the end)."""
        groups = self.groups[chunk]
        docs_before = cumulative(np.array([g.parts.num_docs for g in groups], np.int64))
        num_docs = int(docs_before[-1])
        if not num_docs:
            return np.zeros(0, np.int32), np.zeros(0, bool), np.zeros(1, np.int64)
        values = np.concatenate([g.values for g in groups])
        lengths = np.concatenate([g.parts.part_lengths for g in groups])
        kinds = np.concatenate([g.parts.part_kinds for g in groups])
        part_doc = np.concatenate([g.parts.part_doc + before for g, before in zip(groups, docs_before.tolist())])
        content = np.bincount(part_doc, weights=lengths, minlength=num_docs).astype(np.int64)
        fim = collation_choice(self.template, chunk, num_docs, np.arange(num_docs, dtype=np.int64), content)
        rendered = render(self.template, values, lengths, kinds, part_doc, num_docs, fim)
        return rendered.tokens, rendered.trainable, rendered.doc_starts

    def stream(self, sequence: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[np.ndarray]]:
        """The chunks ``sequence`` rendered whole, end to end: (tokens, target flags, cumulative
        offsets of the chunks, where each one's documents start within it)."""
        rendered = [self.rendered_chunk(chunk) for chunk in sequence]
        offsets = cumulative(np.array([len(tokens) for tokens, _, _ in rendered], np.int64))
        return (np.concatenate([tokens for tokens, _, _ in rendered]), np.concatenate([flags for _, flags, _ in rendered]),
                offsets, [starts for _, _, starts in rendered])


def make_lake(seed: int, template: str, docs: tuple[int, int] = (1, 6), chunks: int = 6,
              cache_bytes: int = 1 << 24) -> Lake:
    """A lake of ``chunks`` chunks of 0 to 3 row groups of ``docs`` documents (1 to 3 parts each;
    one for FIM), random token ids below 1000."""
    rng = np.random.default_rng(seed)
    kinds = len(TEMPLATES[template].kind_names)
    lake = []
    for _ in range(chunks):
        groups = []
        for _ in range(int(rng.integers(0, 4))):
            n = int(rng.integers(*docs))
            per_doc = np.ones(n, np.int64) if template in ("fim", "infill") else rng.integers(1, 4, n)
            lengths = rng.integers(1, 30, int(per_doc.sum()))
            parts = ChunkParts(lengths, rng.integers(0, kinds, len(lengths)), np.repeat(np.arange(n), per_doc), n)
            groups.append(RowGroup(rng.integers(0, 1000, int(lengths.sum())).astype(np.uint16), parts, None))
        lake.append(groups)
    return Lake(TEMPLATES[template], lake, cache_bytes)


def parts_of(lake: Lake) -> tuple[GroupTables, Renderings]:
    """The row-group tables and the renderings of ``lake``."""
    tables = GroupTables(lake, lake.template)  # type: ignore[arg-type]
    return tables, Renderings(lake, lake.template, tables)  # type: ignore[arg-type]


def group_order(lake: Lake) -> list[tuple[int, int]]:
    """Every (chunk, group) in stream order."""
    return [(c, g) for c, groups in enumerate(lake.groups) for g in range(len(groups))]


def caught_up() -> None:
    """Return once the ahead thread has done all it was asked so far."""
    read_ahead._AHEAD_POOL.submit(lambda: None).result()


# -- row-group tables ----------------------------------------------------------------------------------

@pytest.mark.parametrize("template", list(TEMPLATES))
@pytest.mark.parametrize("seed", range(4))
def test_row_group_tables_are_where_the_row_groups_renderings_lie(template: str, seed: int) -> None:
    lake = make_lake(seed, template)
    tables, _ = parts_of(lake)
    chunks = lake.chunks
    every = list(range(chunks.committed))
    found = tables.of_chunks(chunks, every[::-1] + [0])
    assert lake.queries == [every]   # the missing ones in one query
    assert tables.of_chunks(chunks, every) == found[-2::-1] and lake.queries == [every]
    for chunk, (offsets, first_docs) in zip(every, found[-2::-1]):
        docs_before = cumulative(np.array([g.parts.num_docs for g in lake.groups[chunk]], np.int64))
        _, _, doc_starts = lake.rendered_chunk(chunk)
        assert first_docs.dtype == np.int32 and first_docs.tolist() == docs_before[:-1].tolist()
        assert offsets.tolist() == doc_starts[docs_before].tolist()
        assert tables.chunk_lengths(chunks)[chunk] == offsets[-1]


def test_a_table_not_kept_is_fetched_alone() -> None:
    lake = make_lake(0, "text")
    tables, _ = parts_of(lake)
    assert tables.kept(lake.chunks, [1]) == [None]
    table = tables.of(lake.chunks, 1)
    assert lake.queries == [[1]] and tables.kept(lake.chunks, [1]) == [table]


# -- renderings ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("template", list(TEMPLATES))
def test_each_row_groups_rendering_is_its_slice_of_the_stream_rendered_once(template: str) -> None:
    lake = make_lake(1, template)
    tables, renderings = parts_of(lake)
    chunks = lake.chunks
    wanted = group_order(lake)
    assert renderings.all_cached(chunks, wanted) is None and renderings.cached(chunks, wanted[:1]) == [None]
    together = renderings.get_all(chunks, wanted)   # (in the decode threads)
    assert sorted(lake.reads) == sorted((c, g, False) for c, g in wanted)   # each read once, whole
    for (chunk, group), rendered in zip(wanted, together):
        tokens, flags, doc_starts = lake.rendered_chunk(chunk)
        offsets, first_docs = tables.of(chunks, chunk)
        a, b = int(offsets[group]), int(offsets[group + 1])
        first, docs = int(first_docs[group]), lake.groups[chunk][group].parts.num_docs
        assert rendered.tokens.dtype == np.uint16 and np.array_equal(rendered.tokens, tokens[a:b])
        assert np.array_equal(np.ones(b - a, bool) if rendered.trainable is None else rendered.trainable, flags[a:b])
        assert rendered.doc_starts.tolist() == (doc_starts[first:first + docs + 1] - a).tolist()
        assert renderings.get(chunks, chunk, group) is rendered
    assert len(lake.reads) == len(wanted)
    assert renderings.all_cached(chunks, wanted) == together


# -- cold page ranges ----------------------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(lengths=st.lists(st.integers(1, 400), min_size=1, max_size=5), gap=st.sampled_from([0, 5, 50]),
       drawn=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 10**6), st.integers(0, 10**6)), max_size=20),
       missing=st.sets(st.integers(0, 4)))
def test_page_runs_are_a_plain_merge_of_the_ranges(lengths: list[int], gap: int, drawn: list[tuple[int, int, int]],
                                                   missing: set[int]) -> None:
    ranges = []   # (row group, first token, one past the last), inside the row group
    for g, a, size in drawn:
        g %= len(lengths)
        a %= lengths[g]
        ranges.append((g, a, a + 1 + size % (lengths[g] - a)))
    wanted = sorted(j for j in missing if j < len(lengths))
    group, lo, hi = (np.array([r[k] for r in ranges], np.int64) for k in range(3))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cold_pages, "RANGE_GAP", gap)
        runs, run_lo, run_hi, run_of = cold_pages.page_runs(wanted, (group, lo, hi), np.array(lengths, np.int64))
    # The plain way: a missing row group's ranges by start, each joining the run before it when it
    # starts at most gap past the run's end; its runs kept when they cover at most a PAGES_SHARE-th of it.
    expected: list[tuple[int, int, int]] = []   # (row group, start, end) of each run kept
    expected_of = [-1] * len(ranges)
    for j in wanted:
        merged: list[tuple[int, int, list[int]]] = []
        for a, b, i in sorted((r[1], r[2], i) for i, r in enumerate(ranges) if r[0] == j):
            if merged and a <= merged[-1][1] + gap:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b), merged[-1][2] + [i])
            else:
                merged.append((a, b, [i]))
        if merged and sum(b - a for a, b, _ in merged) * cold_pages.PAGES_SHARE <= lengths[j]:
            for a, b, members in merged:
                for i in members:
                    expected_of[i] = len(expected)
                expected.append((j, a, b))
    run_group = [j for j, (a, b) in sorted(runs.items()) for _ in range(a, b)]
    assert list(zip(run_group, run_lo.tolist(), run_hi.tolist())) == expected
    assert run_of.tolist() == expected_of


@pytest.mark.parametrize("template", list(TEMPLATES))
def test_ranges_read_from_pages_are_slices_of_the_whole_rendering(template: str) -> None:
    lake = make_lake(2, template, docs=(8, 12))
    tables, renderings = parts_of(lake)
    chunks = lake.chunks
    rng = np.random.default_rng(3)
    for chunk, group in group_order(lake):
        whole = renderings.render(chunks, chunk, group)
        n = len(whole.tokens)
        lo = np.sort(rng.integers(0, n, 3))
        hi = np.minimum(lo + rng.integers(1, 20, 3), n)
        found = cold_pages.render_ranges(renderings, chunks, chunk, group, int(tables.of(chunks, chunk)[1][group]),
                                         lo, hi)
        assert lake.reads[-1] == (chunk, group, True) and len(found) == 3
        for (rendered, base, first), a, b in zip(found, lo.tolist(), hi.tolist()):
            assert base == whole.doc_starts[first] and base <= a and b <= base + len(rendered.tokens)
            assert np.array_equal(rendered.tokens, whole.tokens[base:base + len(rendered.tokens)])
            assert rendered.doc_starts.tolist() == (whole.doc_starts[first:first + len(rendered.doc_starts)]
                                                    - base).tolist()


# -- spans ---------------------------------------------------------------------------------------------

def expected_pieces(lake: Lake, sequence: list[int], start: int, length: int) -> list[tuple[Any, ...]]:
    """Span ``[start, start + length)`` of the stream of ``sequence``, cut at chunk ends: per chunk
    (position, chunk, start within it, tokens, flags, first document, later documents' starts)."""
    tokens, flags, offsets, doc_starts = lake.stream(sequence)
    found = []
    for position, chunk in enumerate(sequence):
        a, b = max(start, int(offsets[position])), min(start + length, int(offsets[position + 1]))
        if a < b:
            starts = doc_starts[position] + offsets[position]
            later = starts[(starts > a) & (starts < b)]
            found.append((position, chunk, a - int(offsets[position]), tokens[a:b].tolist(), flags[a:b].tolist(),
                          int(np.searchsorted(starts, a, side="right")) - 1, (later - a).tolist()))
    return found


def described(pieces: list[Piece]) -> list[tuple[Any, ...]]:
    return [(p.position, p.chunk, p.start, p.tokens.tolist(), p.flags().tolist(), p.first_doc, p.doc_offsets.tolist())
            for p in pieces]


@pytest.mark.parametrize("template", list(TEMPLATES))
@pytest.mark.parametrize(("scattered", "sequential", "cache_bytes"),
                         [(False, False, 1 << 24), (True, False, 1 << 24), (True, False, 256), (False, True, 1 << 24)])
def test_spans_are_their_slices_of_the_stream(template: str, scattered: bool, sequential: bool,
                                              cache_bytes: int) -> None:
    """Batches of spans of every kind (inside a row group, across row groups and chunks; the
    first batch cold, and every batch of a full shuffle over more than the cache keeps), each
    span equal to its slice of the stream, as found together and alone."""
    lake = make_lake(5, template, docs=(6, 14), chunks=8, cache_bytes=cache_bytes)
    tables, renderings = parts_of(lake)
    ahead = ReadAhead(tables, renderings, in_order=sequential)
    locator = SpanReader(tables, renderings, ahead, scattered=scattered, sequential=sequential)
    chunks = lake.chunks
    sequence = [3, 0, 7, 1, 2, 5, 4, 6]
    offsets = cumulative(tables.chunk_lengths(chunks)[sequence])
    total = int(offsets[-1])
    rng = np.random.default_rng(9)
    for length in (61, 1, 7, 60):
        for batch in range(3):
            starts = (np.arange(batch * 4, batch * 4 + 4) * length if sequential
                      else rng.integers(0, total - length + 1, 12))
            starts = starts[starts + length <= total]
            found = locator.spans(chunks, sequence, offsets, starts, length)
            for i, start in enumerate(starts.tolist()):
                expected = expected_pieces(lake, sequence, start, length)
                assert described(found.pieces(i)) == expected, (length, batch, i)
                assert described(locator.span(chunks, sequence, offsets, start, length)) == expected
    ahead.close()
    assert any(in_part for _, _, in_part in lake.reads) or sequential   # (in order, the first spans are dense)
    with pytest.raises(IndexError):
        locator.span(chunks, sequence, offsets, total - 1, 2)


def test_a_first_batch_reads_little_of_its_row_groups_from_pages_then_has_them_decoded_whole() -> None:
    lake = make_lake(6, "text", docs=(30, 40))
    tables, renderings = parts_of(lake)
    ahead = ReadAhead(tables, renderings)
    locator = SpanReader(tables, renderings, ahead)
    chunks = lake.chunks
    sequence = list(range(chunks.committed))
    offsets = cumulative(tables.chunk_lengths(chunks))
    first = group_order(lake)[:3]
    starts = np.array([int(offsets[c] + tables.of(chunks, c)[0][g]) + 1 for c, g in first], np.int64)
    found = locator.spans(chunks, sequence, offsets, starts, 5)
    for i, start in enumerate(starts.tolist()):
        assert described(found.pieces(i)) == expected_pieces(lake, sequence, start, 5)
    assert lake.reads == [(c, g, True) for c, g in first] and renderings.all_cached(chunks, first) is None
    ahead.decode_deferred()   # (what the next batch starts with)
    caught_up()
    assert lake.reads[3:] == [(c, g, False) for c, g in first] and renderings.all_cached(chunks, first) is not None


# -- read-ahead ----------------------------------------------------------------------------------------

def test_the_row_groups_after_the_last_one_reached_are_decoded_ahead_in_stream_order(
        monkeypatch: pytest.MonkeyPatch) -> None:
    lake = make_lake(7, "text", chunks=10)
    order = group_order(lake)
    assert any(not groups for groups in lake.groups[:-1]), "some chunk between others should hold no row group"
    tables, renderings = parts_of(lake)
    threads: list[str] = []
    render = renderings.render
    monkeypatch.setattr(renderings, "render", lambda *args: threads.append(threading.current_thread().name)
                        or render(*args))
    ReadAhead(tables, renderings).after_group(lake.chunks, *order[0])   # (not reading in order: nothing)
    caught_up()
    assert not lake.reads
    ahead = ReadAhead(tables, renderings, in_order=True)
    for at in range(len(order)):
        ahead.after_group(lake.chunks, *order[at])
        caught_up()
        assert [(c, g) for c, g, _ in lake.reads] == order[1 : at + 1 + read_ahead.LOOK_AHEAD_GROUPS], at
    assert threads and all(name.startswith("lakeloader-decode-ahead") for name in threads), threads
    ahead.close()


def test_spans_read_in_order_have_the_row_groups_after_their_end_decoded_ahead() -> None:
    lake = make_lake(8, "text", chunks=10)
    order = group_order(lake)
    tables, renderings = parts_of(lake)
    ahead = ReadAhead(tables, renderings, in_order=True)
    chunks = lake.chunks
    sequence = list(range(chunks.committed))
    offsets = cumulative(tables.chunk_lengths(chunks))
    for at, (chunk, group) in enumerate(order):   # spans ending at the start of each row group in turn
        ahead.after_end(chunks, sequence, offsets, int(offsets[chunk] + tables.of(chunks, chunk)[0][group]))
        caught_up()
        assert [(c, g) for c, g, _ in lake.reads] == order[1 : at + 1 + read_ahead.LOOK_AHEAD_GROUPS], at
    assert ahead.tables_after(2, 20) == range(3, 2 + read_ahead.TABLES_AHEAD)
    assert ReadAhead(tables, renderings).tables_after(2, 20) == range(0)
    ahead.close()


def test_a_closed_read_ahead_decodes_nothing_nor_one_whose_cache_would_not_keep_its_row_groups() -> None:
    lake = make_lake(9, "text")
    tables, renderings = parts_of(lake)
    closed = ReadAhead(tables, renderings, in_order=True)
    closed.close()
    closed.after_group(lake.chunks, *group_order(lake)[0])
    small = make_lake(9, "text", cache_bytes=16)
    tables, renderings = parts_of(small)
    ahead = ReadAhead(tables, renderings, in_order=True)
    assert not ahead.fits(1)
    ahead.after_group(small.chunks, *group_order(small)[0])
    ahead.decode_later(small.chunks, *group_order(small)[1], 1)
    ahead.decode_deferred()
    caught_up()
    assert not lake.reads and not small.reads


# -- the facade ----------------------------------------------------------------------------------------

def test_the_reader_keeps_every_call_feed_makes_of_it() -> None:
    lake = make_lake(0, "text")
    reader = StreamReader(lake, lake, lake.template)  # type: ignore[arg-type]
    feed = Path(lakeloader.__file__).parent / "feed"
    called = {name for path in feed.glob("*.py") for name in re.findall(r"\breader\.(\w+)", path.read_text())}
    assert {"span", "spans", "rendered_groups", "look_ahead_after"} <= called
    assert [name for name in sorted(called) if not hasattr(reader, name)] == []
