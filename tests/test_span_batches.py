"""Concat batches against a plain-numpy reference built from the decoded chunk files, for every
shuffle kind, both orderings and several process counts; and the compact row-group cache.

The reference renders each chunk file whole (pyarrow + the collation template), lays the
dataset's stream out as one token array with a (chunk position, document) key per token, and
cuts each row's window out of it: the five fields follow from plain slices and one comparison
of neighbouring keys. Every comparison is bitwise (values and dtypes).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from lakeloader.catalog.lake import open_lake
from lakeloader.contracts.chunk_file import table_parts
from lakeloader.feed.spans import Span
from lakeloader.feed.loader import Loader
from lakeloader.feed.rows import ArrayPool
from lakeloader.index.ranges import cut_segments
from lakeloader.index.render import render
from lakeloader.ingest.driver import build
from lakeloader.read import cold_pages
from lakeloader.read import spans as spans_module
from lakeloader.read.chunks import ChunkFiles
from lakeloader.read.renderings import Renderings

from conftest import ahead_thread_caught_up, stdlib_texts, write_config, write_jsonl
SEQ_LEN = 48
BATCH = 8
FIELDS = ("input_ids", "targets", "loss_mask", "segment_ids", "positions")


# -- the lake --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory, dask_scheduler: str) -> Path:
    """Text in two shards and chat conversations (targets only on assistant turns), small
    splits and small row groups so that windows cross row groups and chunks."""
    root = tmp_path_factory.mktemp("window-batches")
    data = root / "data"
    texts = stdlib_texts("json") + stdlib_texts("wsgiref")
    write_jsonl(data / "t" / "a.jsonl", texts[::2])
    write_jsonl(data / "t" / "b.jsonl", [p for t in texts[1::2] for p in t.split("\n\n") if p.strip()])
    paragraphs = [p for t in stdlib_texts("zoneinfo") for p in t.split("\n\n") if p.strip()]
    chats = [{"messages": [{"role": "user", "content": paragraphs[i][:60]},
                           {"role": "assistant", "content": paragraphs[i + 1]}]}
             for i in range(0, len(paragraphs) - 1, 2)]
    (data / "c").mkdir(parents=True)
    (data / "c" / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    config = write_config(root, {"t": {"sources": [str(data / "t" / "*.jsonl")]},
                                 "c": {"sources": [str(data / "c" / "chat.jsonl")], "format": "chat"}},
                          build={"split_size": "16KB", "row_group_tokens": 600})
    build(config, scheduler=dask_scheduler, progress=False)
    return root


def loader_config(root: Path, name: str, datasets: tuple[str, ...], **loader: Any) -> Path:
    base = yaml.safe_load((root / "config.yaml").read_text())
    config: dict[str, Any] = {
        "lake": base["lake"], "tokenizer": base["tokenizer"], "build": base["build"],
        "datasets": {n: base["datasets"][n] for n in datasets},
        "loader": {"seq_len": SEQ_LEN, "batch_size": BATCH, "prefetch": 0, **loader},
    }
    if len(datasets) > 1:
        config["mixture"] = {"weights": {"t": 0.7, "c": 0.3}}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


# -- the reference -----------------------------------------------------------------------------------


class Stream:
    """One dataset's rendered chunks: tokens, target flags and a document key per token."""

    def __init__(self, loader: Loader, name: str) -> None:
        lake = open_lake(loader.config)
        paths = lake.sql("SELECT path FROM chunks WHERE dataset = ? AND status = 'committed' "
                         "ORDER BY global_index", [name])["path"]
        template = loader.templates[name]
        self.chunks = []
        for path in paths:
            table = pq.read_table(lake.path_of(path))
            column = table.column("tokens").combine_chunks()
            parts = table_parts(table)
            self.chunks.append(render(template, column.values.to_numpy(), parts.part_lengths,
                                      parts.part_kinds, parts.part_doc, parts.num_docs))

    def laid_out(self, sequence: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens, trainable, key) of the chunks ``sequence`` back to back."""
        rendered = [self.chunks[c] for c in sequence]
        tokens = np.concatenate([r.tokens for r in rendered]).astype(np.int64)
        trainable = np.concatenate([r.trainable for r in rendered])
        key = np.concatenate([r.docs.astype(np.int64) + (p << 32) for p, r in enumerate(rendered)])
        return tokens, trainable, key


def reference_row(tokens: np.ndarray, trainable: np.ndarray, key: np.ndarray, start: int) -> dict[str, np.ndarray]:
    """The row of the window of stream tokens ``[start, start + L]``."""
    window = slice(start, start + SEQ_LEN + 1)
    ids, flags, keys = tokens[window], trainable[window], key[window]
    assert len(ids) == SEQ_LEN + 1
    new_doc = np.r_[True, keys[1:SEQ_LEN] != keys[: SEQ_LEN - 1]]
    segment_ids = np.cumsum(new_doc)
    first = np.flatnonzero(new_doc)
    return {"input_ids": ids[:-1].astype(np.int32), "targets": ids[1:].astype(np.int32),
            "loss_mask": flags[1:].astype(np.float32), "segment_ids": segment_ids.astype(np.int32),
            "positions": (np.arange(SEQ_LEN) - first[segment_ids - 1]).astype(np.int32)}


def global_batch(loaders: list[Loader], step: int) -> dict[str, np.ndarray]:
    parts = [loader.batch(step) for loader in loaders]
    return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}


def assert_rows_equal(actual: dict[str, np.ndarray], expected: list[dict[str, np.ndarray]], dataset_ids: list[int],
                      what: str) -> None:
    assert sorted(actual) == sorted((*FIELDS, "dataset_ids")), what
    assert actual["dataset_ids"].dtype == np.int32 and actual["dataset_ids"].tolist() == dataset_ids, what
    for name in FIELDS:
        wanted = np.stack([row[name] for row in expected])
        assert actual[name].dtype == wanted.dtype, f"{what} {name}"
        if not np.array_equal(actual[name], wanted):
            pytest.fail(f"{what} {name} differs at {np.argwhere(actual[name] != wanted)[:5].tolist()}")


# -- tests --------------------------------------------------------------------------------------------


SHUFFLES = [{"kind": "none"}, {"kind": "full"}, {"kind": "block", "block_size": 7, "window_blocks": 3},
            {"kind": "window", "window_chunks": 3}]


@pytest.mark.parametrize("shuffle", SHUFFLES, ids=[s["kind"] for s in SHUFFLES])
def test_global_ordering_batches_equal_the_numpy_reference(lake: Path, shuffle: dict[str, Any]) -> None:
    config = loader_config(lake, f"global-{shuffle['kind']}", ("t", "c"), shuffle=shuffle)
    one = Loader(config)
    streams = {name: Stream(one, name).laid_out(list(range(d.chunks.committed)))
               for name, d in zip(one.mixer.names, one.datasets)}
    per_epoch = {d.name: d.train_count() for d in one.datasets}
    steps = np.random.default_rng(7).integers(0, 3 * per_epoch["t"] // BATCH, 6).tolist() + [0]
    for count in (1, 2, 4):
        loaders = [Loader(config, process_index=p, process_count=count) for p in range(count)]
        for step in steps:
            examples = one.examples(step).examples
            assert all(isinstance(e, Span) for e in examples)
            expected = [reference_row(*streams[e.dataset], e.example * SEQ_LEN) for e in examples]
            ids = [one.mixer.names.index(e.dataset) for e in examples]
            assert_rows_equal(global_batch(loaders, step), expected, ids, f"{count} processes, step {step}")
        for loader in loaders:
            loader.close()
    one.close()


def reads_in_part(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Patches ChunkFiles to record the row group of each read of only some of its documents."""
    in_part: list[int] = []
    read_documents = ChunkFiles.read_documents

    def spy(self: ChunkFiles, chunks: Any, index: int, group: int, pick: Any = None) -> Any:
        if pick is not None:
            in_part.append(group)
        return read_documents(self, chunks, index, group, pick)

    monkeypatch.setattr(ChunkFiles, "read_documents", spy)
    return in_part


def documents_of(loader: Loader, step: int) -> list[tuple[int, int, int, int]]:
    """(chunk, document, first and last offset in its window) of every segment of the windows of ``step``."""
    return [(s.chunk, s.document, s.example_start, s.example_stop) for e in loader.examples(step).examples
                    for s in e.segments()]  # type: ignore[attr-defined]


@pytest.mark.parametrize("shuffle", SHUFFLES, ids=[s["kind"] for s in SHUFFLES])
def test_cold_batches_read_from_pages_equal_the_numpy_reference(lake: Path, shuffle: dict[str, Any],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh loader's first batch reads the row groups its windows reach little of as just the
    documents the windows need; then, once that batch is out, they are decoded whole in the
    background. Cold or warm, the rows are bitwise the reference's, and so are the documents
    they come from (explain's). Windows of a row group are read as separate ranges unless they touch."""
    monkeypatch.setattr(cold_pages, "RANGE_GAP", 0)
    config = loader_config(lake, f"cold-{shuffle['kind']}", ("t", "c"), shuffle=shuffle)
    in_part = reads_in_part(monkeypatch)
    one = Loader(config)
    streams = {name: Stream(one, name).laid_out(list(range(d.chunks.committed)))
               for name, d in zip(one.mixer.names, one.datasets)}
    steps = np.random.default_rng(11).integers(0, 3 * one.datasets[0].train_count() // BATCH, 4).tolist()
    for step in steps:
        examples = one.examples(step).examples
        expected = [reference_row(*streams[e.dataset], e.example * SEQ_LEN) for e in examples]
        ids = [one.mixer.names.index(e.dataset) for e in examples]
        with Loader(config) as loader:
            before = len(in_part)
            assert_rows_equal(loader.batch(step), expected, ids, f"cold, step {step}")
            assert len(in_part) > before or shuffle["kind"] == "none", "no row group read in part"
            with Loader(config) as fresh:
                cold = documents_of(fresh, step)
            loader.batch(step + 1)   # hands the first batches' row groups to the background decoder
            ahead_thread_caught_up()   # ... which has decoded them
            before = len(in_part)
            assert_rows_equal(loader.batch(step), expected, ids, f"warm, step {step}")
            assert documents_of(loader, step) == cold, "documents of the windows (explain) differ"
            assert len(in_part) == before, "a row group decoded whole was read in part again"
    one.close()


def test_a_first_batch_reads_windows_across_row_groups_from_pages(lake: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh loader's first batch locates its windows across row groups or chunks as pieces of
    the row groups they reach, read with the others in the batch's one catalog query: none takes
    the general path, which decoded whole row groups one after another in the asking thread.
    Rows bitwise the reference's."""
    general: list[int] = []
    joined: list[int] = []   # the chunks each window read from pieces reaches
    window, join_pieces = spans_module.SpanReader.span, spans_module._join_pieces

    def general_spy(self: Any, *args: Any) -> Any:
        general.append(args[3])
        return window(self, *args)

    def join_spy(found: Any, starts: Any, offsets: Any, rows: Any, *args: Any) -> None:
        join_pieces(found, starts, offsets, rows, *args)
        joined.extend(len(found.others[row]) for row in set(rows.tolist()))

    config = loader_config(lake, "across-cold", ("t",), shuffle={"kind": "full"})
    with Loader(config) as one:
        stream = Stream(one, "t").laid_out(list(range(one.datasets[0].chunks.committed)))
        examples = {step: one.examples(step).examples for step in range(40)}
    monkeypatch.setattr(spans_module.SpanReader, "span", general_spy)
    monkeypatch.setattr(spans_module, "_join_pieces", join_spy)
    for step, rows in examples.items():
        with Loader(config) as loader:
            lookups: list[list[int]] = []
            row_groups_of = loader.view.row_groups_of
            loader.view.row_groups_of = (  # type: ignore[method-assign]
                lambda name, chunks, *args: lookups.append(chunks) or row_groups_of(name, chunks, *args))
            expected = [reference_row(*stream, e.example * SEQ_LEN) for e in rows]
            assert_rows_equal(loader.batch(step), expected, [0] * BATCH, f"step {step}")
            assert len(lookups) == 1, lookups   # the row groups of every chunk the batch reads at once
    assert len(joined) >= 10 and max(joined) > 1 and not general, (joined, general)   # across chunks too


@pytest.mark.parametrize("shuffle", [{"kind": "full"}, {"kind": "block", "block_size": 7, "window_blocks": 3}],
                         ids=["full", "block"])
def test_a_full_shuffle_beyond_the_cache_reads_pages_for_every_batch(lake: Path, shuffle: dict[str, Any],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A full shuffle over more than twice the cache's bytes reads the uncached row groups of every
    batch from the pages its windows need, not only its first batch's; a block shuffle with the
    same cache decodes whole row groups after its first batch. Rows bitwise the reference's."""
    in_part = reads_in_part(monkeypatch)
    config = loader_config(lake, f"beyond-{shuffle['kind']}", ("t",), shuffle=shuffle, cache_bytes="16KB")
    one = Loader(config)
    dataset = one.datasets[0]
    assert int(dataset.chunks.num_tokens.sum()) * 2 > 2 * 16 * 1024   # stored tokens: more than twice the cache
    stream = Stream(one, "t").laid_out(list(range(dataset.chunks.committed)))
    read_in_part = []
    with Loader(config) as loader:
        for step in range(6):
            expected = [reference_row(*stream, e.example * SEQ_LEN) for e in one.examples(step).examples]
            before = len(in_part)
            assert_rows_equal(loader.batch(step), expected, [0] * len(expected), f"step {step}")
            read_in_part.append(len(in_part) - before)
    one.close()
    assert read_in_part[0] > 0
    if shuffle["kind"] == "full":
        assert all(read_in_part), read_in_part
    else:
        assert not any(read_in_part[1:]), read_in_part


def test_a_reader_in_stream_order_decodes_row_groups_ahead_of_its_batches(
        lake: Path, monkeypatch: pytest.MonkeyPatch, catalog_query_threads: set[str]) -> None:
    """Without a shuffle, the LOOK_AHEAD_GROUPS row groups after the one a batch's windows end in
    are decoded in the background (across chunks too), so the batches that reach them find them
    cached: after the first two batches (the first reads pages), the consuming thread decodes no
    row group. The background thread never queries the catalog (the thread building batches
    fetches what it needs, several chunks a query). Rows bitwise the reference's."""
    decoded_here: list[tuple[int, int]] = []
    decoded_ahead: list[tuple[int, int]] = []
    render_group = Renderings.render

    def spy(self: Any, chunks: Any, chunk: int, group: int) -> Any:
        on_main = threading.current_thread() is threading.main_thread()
        (decoded_here if on_main else decoded_ahead).append((chunk, group))
        return render_group(self, chunks, chunk, group)

    monkeypatch.setattr(Renderings, "render", spy)
    config = loader_config(lake, "look-ahead", ("t",), shuffle={"kind": "none"})
    with Loader(config) as loader:
        dataset = loader.datasets[0]
        stream = Stream(loader, "t").laid_out(list(range(dataset.chunks.committed)))
        steps = dataset.train_count() // BATCH
        for step in range(steps):
            expected = [reference_row(*stream, e.example * SEQ_LEN) for e in loader.examples(step).examples]
            assert_rows_equal(loader.batch(step), expected, [0] * BATCH, f"step {step}")
            ahead_thread_caught_up()   # the ahead thread has caught up
            if step == 1:
                cold = len(decoded_here)   # the first batch's row groups, read from pages, then whole
        groups = sum(len(dataset.reader.tables.of(dataset.chunks, c)[1]) for c in range(dataset.chunks.committed))
    assert groups > 20 and steps > 20, (groups, steps)
    assert not decoded_here[cold:], decoded_here
    assert len(decoded_ahead) > 20, decoded_ahead
    assert catalog_query_threads == {threading.main_thread().name}, catalog_query_threads


def test_strided_ordering_batches_equal_the_numpy_reference(lake: Path) -> None:
    readers = 3
    config = loader_config(lake, "strided", ("t",), ordering="strided", ideal_readers=readers, shuffle="none")
    one = Loader(config)
    stream = Stream(one, "t")
    committed = one.datasets[0].chunks.committed
    steps = [0, 1, *np.random.default_rng(3).integers(2, 40, 4).tolist()]
    for count in (1, 2):
        loaders = [Loader(config, process_index=p, process_count=count) for p in range(count)]
        for step in steps:
            _, indices = one.mixer.assign(step, one.row_indices)
            expected = []
            for i in indices.tolist():
                reader, k = i % readers, i // readers
                needed = (k + 1) * SEQ_LEN + 1
                sequence, laid = [], 0
                while laid < needed:   # reader r loops over chunks r, r+R, r+2R, ... of the looped lake
                    chunk = (reader + len(sequence) * readers) % committed
                    sequence.append(chunk)
                    laid += len(stream.chunks[chunk].tokens)
                expected.append(reference_row(*stream.laid_out(sequence), k * SEQ_LEN))
            assert_rows_equal(global_batch(loaders, step), expected, [0] * len(expected),
                              f"{count} processes, step {step}")
        for loader in loaders:
            loader.close()
    one.close()


def test_cached_row_groups_cost_about_two_bytes_per_token(lake: Path) -> None:
    """Decoded row groups are kept in the stored dtype (uint16 for this vocabulary) with document
    boundaries as offsets: about 2 bytes per token where it was 13 (ids, per-token document
    keys and flags) plus the stored row group."""
    loader = Loader(loader_config(lake, "memory", ("t",), cache_bytes="64MB"))
    dataset = loader.datasets[0]
    stream_tokens = int(dataset.locator.stream_offsets()[-1])
    for step in range(dataset.train_count() // BATCH + 1):   # a whole epoch: every row group once
        loader.batch(step)
    cache = loader.files.cache
    assert len(cache) > 10
    assert cache._total <= 2.2 * stream_tokens, f"{cache._total / stream_tokens:.2f} bytes per token"
    loader.close()


def test_batches_are_fresh_arrays(lake: Path) -> None:
    """The caller keeps what ``batch`` returns: a later batch never writes into it."""
    loader = Loader(loader_config(lake, "fresh", ("t",)))
    first = loader.batch(0)
    kept = {k: v.copy() for k, v in first.items()}
    loader.batch(1)
    loader.batch(0)
    for name in FIELDS:
        assert np.array_equal(first[name], kept[name])
    loader.close()


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 5), st.integers(1, 12), st.data())
def test_segments_from_document_starts_equal_segments_from_keys(rows: int, n: int, data: st.DataObject) -> None:
    cuts = [sorted(data.draw(st.lists(st.integers(-2, n + 2), max_size=6))) for _ in range(rows)]
    keys = np.array([np.searchsorted(np.array(c, np.int64), np.arange(n), side="right") for c in cuts],
                    np.int64).reshape(rows, n)
    cut_rows = np.repeat(np.arange(rows), [len(c) for c in cuts])
    cut_at = np.array([x for c in cuts for x in c], np.int64)
    order = data.draw(st.permutations(range(len(cut_at))))   # any order
    segment_ids, positions = np.full((rows, n), 7, np.int32), np.full((rows, n), 7, np.int32)
    cut_segments(cut_rows[list(order)], cut_at[list(order)], segment_ids, positions)
    # Segment ids count the documents met along a row; positions restart at each.
    expected_ids = np.array([np.cumsum(np.diff(row, prepend=row[:1] - 1) != 0) for row in keys], np.int64).reshape(rows, n)
    expected_positions = np.array([[i - int(np.flatnonzero(row == row[i])[0]) for i in range(n)] for row in keys],
                                  np.int64).reshape(rows, n)
    assert segment_ids.dtype == positions.dtype == np.int32
    assert np.array_equal(segment_ids, expected_ids) and np.array_equal(positions, expected_positions)


def test_the_array_pool_reuses_only_what_nobody_holds() -> None:
    pool = ArrayPool()
    first = pool.empty((4, 8), np.int32)
    second = pool.empty((4, 8), np.int32)
    assert not np.shares_memory(first, second)   # both held
    address = first.ctypes.data
    view = first[1:]
    del first
    assert pool.empty((4, 8), np.int32).ctypes.data != address   # a view still holds it
    del view
    batch = {"x": pool.empty((4, 8), np.int32)}   # the freed one, now held by a dict
    assert batch["x"].ctypes.data == address
    assert pool.empty((4, 8), np.int32).ctypes.data not in (address, second.ctypes.data)
    assert pool.full((2, 3), 5, np.float32).tolist() == [[5.0] * 3] * 2
