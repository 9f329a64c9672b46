"""Instant start as the lake grows: opening a loader fetches per-chunk counts only, and a batch
fetches the paths and checksums of the chunks it reads only (with their row groups, in one
query; without a shuffle, also those of the few chunks after them, whose row groups are decoded
ahead), whatever the number of chunks; batches are bitwise those the loader gave when it fetched
every chunk's row on open (digests recorded from that code)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from lakeloader.catalog.lake import Lake
from lakeloader.catalog.snapshot import publish_snapshot, read_pointer
from lakeloader.catalog.sql import query
from lakeloader.catalog.store import CatalogWriter
from lakeloader.contracts.errors import CatalogError
from lakeloader.demo.many_chunks import grow
from lakeloader.feed.loader import Loader
from lakeloader.catalog.reader_index import ReaderIndex
from lakeloader.read import catalog_view as catalog_view_module
from lakeloader.read import read_ahead
from lakeloader.read.catalog_view import CatalogView

from conftest import Lakes, ahead_thread_caught_up

KINDS = ("none", "window", "block", "full")
STEPS = (0, 7, 1234, 100_000)
GROWN = 3000
WORDS = ("lake loader chunk token window shuffle block seed step batch catalog row group epoch "
         "permutation offset stream document parquet duckdb resume process worker build").split()


def texts(count: int = 120, seed: int = 5) -> list[str]:
    """Documents of seeded pseudo-random words (the same on every platform)."""
    rng = np.random.default_rng(seed)
    return [" ".join(WORDS[i] for i in rng.integers(0, len(WORDS), int(n))) + "."
            for n in rng.integers(20, 400, count)]


def shuffle(kind: str) -> dict[str, Any]:
    return {"kind": kind, "window_chunks": 3, "block_size": 8, "window_blocks": 3}


@pytest.fixture(scope="module")
def configs(lakes: Lakes, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Path]]:
    """Per lake (``small``: as built; ``grown``: its catalog grown to GROWN chunks) the config of
    each shuffle kind."""
    corpus, datasets = {"d.jsonl": texts()}, {"d": {"sources": ["d.jsonl"]}}
    sections = {"build": {"split_size": "8KB", "row_group_tokens": 512},
                "loader": {"seq_len": 32, "batch_size": 16, "seed": 3}}
    small = lakes.shared(corpus, datasets, **sections)
    grown = lakes.copy(tmp_path_factory.mktemp("grown"), corpus, datasets, **sections)
    grow(Lake(yaml.safe_load(grown.read_text())["lake"]), "d", GROWN)
    # The same grown lake with its chunk rows stored in reverse global order (a reader must not
    # rely on the order rows are stored in).
    reversed_ = lakes.copy(tmp_path_factory.mktemp("reversed"), corpus, datasets, **sections)
    lake = Lake(yaml.safe_load(reversed_.read_text())["lake"])
    grow(lake, "d", GROWN)
    with CatalogWriter(lake.writer_catalog_path) as writer:
        with writer.transaction():
            writer.con.execute("CREATE TEMP TABLE backwards AS FROM chunks ORDER BY global_index DESC")
            writer.con.execute("DELETE FROM chunks")
            writer.con.execute("INSERT INTO chunks FROM backwards")
        publish_snapshot(writer.con, lake, None)
    found: dict[str, dict[str, Path]] = {}
    for name, config in (("small", small), ("grown", grown), ("reversed", reversed_)):
        settings = yaml.safe_load(config.read_text())
        found[name] = {}
        for kind in KINDS:
            settings["loader"]["shuffle"] = shuffle(kind)
            path = config.parent / f"{name}-{kind}.yaml"
            path.write_text(yaml.safe_dump(settings))
            found[name][kind] = path
    return found


class Recorder:
    """Every catalog question a CatalogView asks: each named query it runs (name and parameters)
    and each lookup in its reader index (method and chunks asked for)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        for method in ("named", "named_table"):
            monkeypatch.setattr(CatalogView, method, self._wrap(getattr(CatalogView, method)))
        for method in ("plan", "chunks", "examples", "row_groups_of", "record"):
            monkeypatch.setattr(ReaderIndex, method, self._wrap_index(method, getattr(ReaderIndex, method)))

    def _wrap(self, original: Any) -> Any:
        def run(view: CatalogView, name: str, params: Any = None, *fetch: Any) -> Any:
            self.calls.append((name, dict(params or {})))
            return original(view, name, params, *fetch)
        return run

    def _wrap_index(self, method: str, original: Any) -> Any:
        def run(index: ReaderIndex, name: str, *args: Any) -> Any:
            chunks = args[0] if method == "row_groups_of" else [args[0]] if method == "record" else None
            self.calls.append((f"index.{method}", {"global_indexes": chunks}))
            return original(index, name, *args)
        return run

    def take(self) -> list[tuple[str, dict[str, Any]]]:
        calls, self.calls = self.calls, []
        return calls


def record_rows(view: CatalogView, calls: list[tuple[str, dict[str, Any]]]) -> Iterator[tuple[str, set[int] | None]]:
    """For each question whose answer names chunk files (a ``path`` or ``checksum`` column, or a
    reader-index lookup of records): its name and the chunks (global indexes) it names, None when
    it does not say which."""
    for name, params in calls:
        if name.startswith("index."):
            if params["global_indexes"] is not None:
                yield name, {int(i) for i in params["global_indexes"]}
            continue
        table = view.execute(query(name), params)
        if {"path", "checksum"} & set(table.column_names):
            at = "global_index" in table.column_names
            yield name, {int(i) for i in table.column("global_index").to_pylist()} if at else None


@pytest.fixture(params=["reader index", "sql"])
def answered_by(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which way the loader's catalog questions are answered: from the snapshot's reader index,
    or (as for a snapshot published without one) by queries of the snapshot."""
    if request.param == "sql":
        opened = catalog_view_module.open_reader_index
        monkeypatch.setattr(catalog_view_module, "open_reader_index", lambda lake, *rest: (opened(lake, *rest)[0], None))
    return str(request.param)


@pytest.mark.parametrize("kind", KINDS)
def test_chunk_records_are_fetched_only_for_the_chunks_a_batch_reads(
        configs: dict[str, dict[str, Path]], monkeypatch: pytest.MonkeyPatch, kind: str, answered_by: str) -> None:
    recorder = Recorder(monkeypatch)
    with Loader(configs["grown"][kind]) as loader:
        assert loader.datasets[0].chunks.committed == GROWN
        assert (loader.view.reader_index() is not None) == (answered_by == "reader index")
        opened = recorder.take()
        assert opened and not list(record_rows(loader.view, opened)), "opening fetched chunk files' records"
        for step in STEPS:
            loader.batch(step)
            ahead_thread_caught_up()   # (what the ahead thread did counts here)
            calls = recorder.take()
            read = {p.chunk for e in loader.examples(step).examples for p in e.pieces}
            if kind == "none":   # the row groups after the spans' last one are decoded ahead: the
                # row-group tables of TABLES_AHEAD chunks from the one the spans end in (the last
                # read, or the next) come in one query
                sequence = list(range(loader.datasets[0].chunks.committed))   # (the global order)
                last = max(sequence.index(c) for c in read)
                read |= set(sequence[last + 1 : last + 1 + read_ahead.TABLES_AHEAD])
            fetched = list(record_rows(loader.view, calls))
            assert fetched or step != STEPS[0], calls   # the first batch learns its chunks' records
            for name, chunks in fetched:
                assert chunks is not None and chunks <= read, (step, name, sorted(chunks or [])[:10], sorted(read))
            recorder.take()


def digest(batches: list[dict[str, np.ndarray]]) -> str:
    h = hashlib.sha256()
    for batch in batches:
        for name in sorted(batch):
            h.update(name.encode() + np.ascontiguousarray(batch[name]).tobytes())
    return h.hexdigest()[:16]


# Recorded from the loader before this change (every chunk's row fetched on open).
EXPECTED = {
    ("small", "none"): "c5cb27c015af6912", ("grown", "none"): "ee40949dc24db7be",
    ("small", "window"): "7fcd6d5a28349681", ("grown", "window"): "e1634f069385cfab",
    ("small", "block"): "395d032b5d8047bc", ("grown", "block"): "f8681cb2bba14953",
    ("small", "full"): "c9c32bc82799a7f4", ("grown", "full"): "d428f7f7d3fa6b16",
}


@pytest.mark.parametrize("lake", ["small", "grown", "reversed"])
@pytest.mark.parametrize("kind", KINDS)
def test_batches_are_those_of_the_loader_before(configs: dict[str, dict[str, Path]], lake: str, kind: str,
                                                answered_by: str) -> None:
    with Loader(configs[lake][kind]) as loader:
        found = digest([loader.batch(step) for step in STEPS])
    assert found == EXPECTED["small" if lake == "small" else "grown", kind]


@pytest.fixture(scope="module")
def statuses_lake(lakes: Lakes, tmp_path_factory: pytest.TempPathFactory) -> Lake:
    """A private copy of the small lake, its chunks' statuses free to change."""
    corpus, datasets = {"d.jsonl": texts()}, {"d": {"sources": ["d.jsonl"]}}
    config = lakes.copy(tmp_path_factory.mktemp("statuses"), corpus, datasets,
                        build={"split_size": "8KB", "row_group_tokens": 512})
    return Lake(yaml.safe_load(config.read_text())["lake"])


@settings(max_examples=12, deadline=None)
@given(uncommitted=st.sets(st.integers(0, 40), max_size=4))
def test_the_committed_prefix_a_loader_opens_is_the_catalogs(statuses_lake: Lake, uncommitted: set[int]) -> None:
    """A reader takes the committed prefix from the one scan of the chunks it opens with: the
    chunks before the first one not committed, as the catalog's committed_prefix view says, with
    their counts in global order, whichever chunks are not committed (a build in progress commits
    chunks in any order)."""
    with CatalogWriter(statuses_lake.writer_catalog_path) as writer:
        with writer.transaction():
            writer.con.execute("UPDATE chunks SET status = 'committed'")
            writer.con.execute("UPDATE chunks SET status = 'planned' WHERE list_contains($1, global_index)",
                               [sorted(uncommitted)])
        publish_snapshot(writer.con, statuses_lake, None)
    view = CatalogView(statuses_lake)
    try:
        chunks = view.dataset("d", part_counts=False)
        counts = view.execute("SELECT num_chunks, planned_chunks FROM committed_prefix WHERE dataset = 'd'").to_pylist()
        prefix, planned = counts[0]["num_chunks"], counts[0]["planned_chunks"]
        expected = view.execute("SELECT num_tokens, num_docs FROM chunks WHERE dataset = 'd' AND global_index < $1 "
                                "ORDER BY global_index", [prefix])
        # Row groups (and records) come for committed chunks only, past the prefix too.
        with_groups = {chunk for chunk, groups in view.row_groups_of("d", list(range(planned))).items()
                       if len(groups["num_tokens"])}
        committed = view.execute("SELECT DISTINCT global_index FROM row_groups JOIN chunks "
                                 "USING (dataset, global_index) WHERE dataset = 'd' AND status = 'committed'")
        assert view.reader_index() is not None
    finally:
        view.close()
    assert planned > 20 and (chunks.committed, chunks.planned, chunks.complete) == (prefix, planned, prefix == planned)
    assert chunks.num_tokens.tolist() == expected.column("num_tokens").to_pylist()
    assert chunks.num_docs.tolist() == expected.column("num_docs").to_pylist()
    assert with_groups == set(committed.column("global_index").to_pylist()) and not with_groups & uncommitted


def test_a_catalog_missing_a_chunk_row_is_an_error_naming_the_dataset(statuses_lake: Lake) -> None:
    """Chunk rows whose global indexes are not 0 to one less than their number (a row lost or
    renumbered by hand) are refused on open, with what to do, never read as another prefix."""
    def renumber(sql: str) -> None:
        with CatalogWriter(statuses_lake.writer_catalog_path) as writer:
            with writer.transaction():
                writer.con.execute("UPDATE chunks SET status = 'committed'")
                writer.con.execute(sql)
            publish_snapshot(writer.con, statuses_lake, None)

    renumber("UPDATE chunks SET global_index = global_index + 1000 WHERE global_index = 3")
    try:
        view = CatalogView(statuses_lake)
        with pytest.raises(CatalogError, match=r"dataset 'd' .* damaged; restore it with `lakeloader build CONFIG "
                                               r"--recover-catalog`"):
            view.dataset("d", part_counts=False)
        view.close()
    finally:
        renumber("UPDATE chunks SET global_index = global_index - 1000 WHERE global_index >= 1000")


def test_sql_after_the_opened_snapshot_was_pruned_reads_the_newest(statuses_lake: Lake) -> None:
    """A view answers from the reader index of the snapshot it opened, and connects to a snapshot
    only for a question the index does not answer (its user's SQL). If the catalog file of the
    snapshot it opened was pruned meanwhile (a build keeps the newest few), it reads the newest
    one instead of failing."""
    def publish(sql: str) -> None:
        with CatalogWriter(statuses_lake.writer_catalog_path) as writer:
            with writer.transaction():
                writer.con.execute(sql)
            publish_snapshot(writer.con, statuses_lake, None)

    publish("UPDATE chunks SET status = CASE WHEN global_index = 3 THEN 'planned' ELSE 'committed' END")
    opened = read_pointer(statuses_lake)
    view = CatalogView(statuses_lake)
    try:
        assert view.dataset("d", part_counts=False).committed == 3
        publish("UPDATE chunks SET status = 'committed'")
        os.remove(statuses_lake.path_of(f"_catalog/{opened['file']}"))
        rows = view.execute("SELECT count(*) AS n FROM chunks WHERE dataset = 'd' AND status <> 'committed'")
        assert rows.to_pylist() == [{"n": 0}]
        assert view.dataset("d", part_counts=False).complete   # (and the newest snapshot answers from now on)
    finally:
        view.close()
