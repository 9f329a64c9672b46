"""The progress counters (dataset_progress, shard_progress) equal their count from the chunk rows
after any sequence of the writer's changes: plans, grown and replaced plans, commits in batches
or one at a time, chunks committed again (a retried task, a repair), reopening the catalog (a
resumed build); a catalog written before them reads and upgrades by that count."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import duckdb
import pandas as pd
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from lakeloader.catalog import progress
from lakeloader.catalog.lake import Lake
from lakeloader.catalog.progress import counted
from lakeloader.catalog.sql import query
from lakeloader.catalog.store import CatalogWriter, connect_reader
from lakeloader.contracts.chunk_file import ChunkResult, Reject
from lakeloader.demo.many_chunks import generated_plan
from lakeloader.plan.planner import DatasetPlan
from lakeloader.plan.sources import MissingSource
from lakeloader.report import tables

NAMES = ("a", "b")


def result(dataset: str, index: int, seed: int = 0) -> ChunkResult:
    """A chunk result: its counts vary with the chunk and ``seed``, a reject now and then."""
    docs = [2 + (index + seed) % 5, 1 + index % 3]
    tokens = [d * (7 + seed % 3) for d in docs]
    rejects = [Reject("line 2", 2, "not JSON")] * ((index + seed) % 3 == 0)
    return ChunkResult(dataset, index, sum(docs), sum(tokens), sum(docs) + len(rejects), 100 + index, "0" * 64,
                       docs, tokens, [[d] for d in docs], [[t] for t in tokens], rejects, 300 + seed, 0.1, "w")


def plan(name: str, chunks: int, shards: int, version: int) -> DatasetPlan:
    """``generated_plan`` of ``chunks`` over ``shards``, its fingerprint ``version``'s: chunk
    paths name (shard, split), so a plan over as many shards keeps the chunks both have."""
    made = generated_plan(name, chunks, shards)
    return dataclasses.replace(made, fingerprint=f"{version:064x}",
                               missing=[MissingSource("/data/gone.jsonl", "not found")] * (version % 2))


# The views datasets and shards as they were defined before the counters: aggregates of every chunk row.
AGGREGATE_DATASETS = """
SELECT d.name, CASE WHEN agg.chunks_done = agg.num_chunks THEN 'complete' WHEN agg.chunks_done > 0 THEN 'building'
                    ELSE 'planned' END AS status,
       (SELECT count(*) FROM shard_plans s WHERE s.dataset = d.name) AS num_shards, agg.num_chunks, agg.chunks_done,
       p.num_chunks AS prefix_chunks, agg.num_docs, agg.num_tokens, agg.num_bytes, agg.source_bytes,
       (SELECT count(*) FROM rejects r WHERE r.dataset = d.name) AS num_rejects
FROM dataset_plans d
JOIN (SELECT dataset, count(*) AS num_chunks, count(*) FILTER (WHERE status = 'committed') AS chunks_done,
             coalesce(sum(num_docs), 0)::BIGINT AS num_docs, coalesce(sum(num_tokens), 0)::BIGINT AS num_tokens,
             coalesce(sum(num_bytes), 0)::BIGINT AS num_bytes, coalesce(sum(source_bytes), 0)::BIGINT AS source_bytes
      FROM chunks GROUP BY dataset) agg ON agg.dataset = d.name
JOIN committed_prefix p ON p.dataset = d.name ORDER BY d.name"""
AGGREGATE_SHARDS = """
SELECT s.dataset, s.shard_index, s.num_splits, count(c.global_index) FILTER (WHERE c.status = 'committed') AS chunks_done,
       coalesce(sum(c.num_docs), 0)::BIGINT AS docs_done, coalesce(sum(c.num_tokens), 0)::BIGINT AS tokens_done,
       coalesce(sum(c.num_rejects), 0)::BIGINT AS rejects,
       CASE WHEN chunks_done = s.num_splits THEN 'complete' WHEN chunks_done > 0 THEN 'building' ELSE 'planned' END AS status
FROM shard_plans s LEFT JOIN chunks c ON c.dataset = s.dataset AND c.shard_index = s.shard_index
GROUP BY s.dataset, s.shard_index, s.num_splits ORDER BY s.dataset, s.shard_index"""


def counters_differ(con: duckdb.DuckDBPyConnection) -> bool:
    return bool(con.execute(query("progress_differs").format(**counted())).fetchone()[0])


def status_of(con: duckdb.DuckDBPyConnection) -> tuple[pd.DataFrame, pd.DataFrame]:
    return (con.execute(query("dataset_status")).df(), con.execute(query("shard_status")).df())


def shards_text(shards: pd.DataFrame) -> str:
    """The shards section of the text status (every other table empty)."""
    empty = {name: pd.DataFrame({"x": []}) for name in ("datasets", "builds", "stale_folders")}
    return tables.format_status({**empty, "shards": shards}, "table")


class Catalogs(RuleBasedStateMachine):
    """One writer's catalog, changed as builds change it; after every step its counters equal
    their count from its chunk rows, and its status equals a reader's that counts them."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        self.path = str(folder / "catalog.duckdb")
        self.writer = CatalogWriter(self.path)
        self.build_id = self.writer.start_build(workers=0, scheduler="none", dashboard="", version="test")
        self.planned: dict[str, int] = {}
        self.version = 0

    @rule(name=st.sampled_from(NAMES), chunks=st.integers(1, 40), shards=st.integers(1, 5))
    def register(self, name: str, chunks: int, shards: int) -> None:
        """A new plan: grown, shrunk or cut otherwise (chunks of the same paths stay committed)."""
        self.version += 1
        self.writer.register_plan(plan(name, chunks, shards, self.version), tokenizer_path="t.json",
                                  token_type="uint16", vocab_size=100, split_size=1, on_error="skip")
        self.planned[name] = chunks

    @precondition(lambda self: self.planned)
    @rule(data=st.data(), seed=st.integers(0, 5))
    def commit(self, data: st.DataObject, seed: int) -> None:
        """A batch of results (one, or several: some again, some committed already)."""
        name = data.draw(st.sampled_from(sorted(self.planned)))
        indexes = data.draw(st.lists(st.integers(0, self.planned[name] - 1), min_size=1, max_size=12))
        other = data.draw(st.sampled_from(sorted(self.planned)))
        batch = [result(name, i, seed) for i in indexes]
        batch += [result(other, i, seed) for i in indexes if i < self.planned[other]][:3]
        self.writer.commit(batch, self.build_id)

    @precondition(lambda self: self.planned)
    @rule(name=st.sampled_from(NAMES))
    def commit_in_order(self, name: str) -> None:
        """The next chunks of a dataset, in order: its committed prefix moves."""
        if name in self.planned:
            self.writer.commit([result(name, i) for i in range(min(6, self.planned[name]))], self.build_id)

    @rule()
    def reopen(self) -> None:
        """The build ends and another starts (a resumed build)."""
        self.writer.close()
        self.writer = CatalogWriter(self.path)
        self.build_id = self.writer.start_build(workers=0, scheduler="none", dashboard="", version="test")

    @invariant()
    def counters_equal_their_count(self) -> None:
        assert not counters_differ(self.writer.con)

    @invariant()
    def the_views_say_what_their_aggregates_say(self) -> None:
        for view, aggregate in (("datasets", AGGREGATE_DATASETS), ("shards", AGGREGATE_SHARDS)):
            expected = self.writer.con.execute(aggregate).df()
            got = self.writer.con.execute(f"SELECT {', '.join(expected.columns)} FROM {view} ORDER BY ALL").df()
            pd.testing.assert_frame_equal(got, expected, check_dtype=False)

    @invariant()
    def the_text_status_shows_what_every_shard_says(self) -> None:
        every = status_of(self.writer.con)[1]
        for datasets in (None, ["a"]):
            chosen = every if datasets is None else every[every.dataset.isin(datasets)].reset_index(drop=True)
            shown = Lake._shards(self.writer.con, datasets, 3)
            shown = shown[shown.dataset.isin(chosen.dataset.unique())].reset_index(drop=True)
            assert (shown.attrs["shards"], shown.attrs["complete"]) == (len(chosen), (chosen.status == "complete").sum())
            if len(chosen) > 3:
                unfinished = chosen[chosen.status != "complete"].head(3).reset_index(drop=True)
                pd.testing.assert_frame_equal(shown, unfinished, check_dtype=False, check_index_type=False)
                assert shards_text(shown) == shards_text(chosen)

    def teardown(self) -> None:
        self.writer.close()


def test_counters_equal_their_count_after_any_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress, "PREFIX_WINDOW", 4)   # prefixes found over several windows
    monkeypatch.setattr(tables, "SHOWN_SHARDS", 3)   # the text status of a lake of many shards
    run_state_machine_as_test(lambda: Catalogs(tmp_path / "lake"), settings=settings(
        max_examples=6, stateful_step_count=10, deadline=None, suppress_health_check=list(HealthCheck)))


def test_a_catalog_without_counters_reads_and_upgrades_by_their_count(tmp_path: Path) -> None:
    path = str(tmp_path / "catalog.duckdb")
    with CatalogWriter(path) as writer:
        build_id = writer.start_build(workers=0, scheduler="none", dashboard="", version="test")
        for name, chunks in (("a", 30), ("b", 12)):
            writer.register_plan(plan(name, chunks, 4, 1), tokenizer_path="t.json", token_type="uint16",
                                 vocab_size=100, split_size=1, on_error="skip")
        writer.commit([result("a", i) for i in (0, 1, 2, 5, 9, 17)] + [result("b", i) for i in range(12)], build_id)
    expected = status_of(connect_reader(path))
    assert list(expected[0].chunks_done) == [6, 12] and list(expected[0].prefix_chunks) == [3, 12]
    with duckdb.connect(path) as con:   # as a lakeloader before the counters wrote it
        con.execute("DROP TABLE dataset_progress; DROP TABLE shard_progress; DROP TABLE plan_folders; "
                    "UPDATE lake_meta SET value = '2' WHERE key = 'schema_version'")
    reader = connect_reader(path)
    for got, wanted in zip(status_of(reader), expected):
        pd.testing.assert_frame_equal(got, wanted)
    reader.close()
    with CatalogWriter(path) as writer:   # upgraded: counted on open
        assert writer.con.execute(query("schema_version")).fetchone()[0] == "3"
        assert not counters_differ(writer.con)
    for got, wanted in zip(status_of(connect_reader(path)), expected):
        pd.testing.assert_frame_equal(got, wanted)


def test_chunk_rows_changed_by_other_sql_are_counted_when_the_writer_opens(tmp_path: Path) -> None:
    lake = Lake(str(tmp_path))
    with CatalogWriter(lake.writer_catalog_path) as writer:
        writer.register_plan(plan("a", 20, 3, 1), tokenizer_path="t.json", token_type="uint16",
                             vocab_size=100, split_size=1, on_error="skip")
        writer.con.execute("UPDATE chunks SET status = 'committed', num_docs = 2, num_tokens = 9")
        assert counters_differ(writer.con)
    with CatalogWriter(lake.writer_catalog_path) as writer:
        assert not counters_differ(writer.con)
    datasets = lake.status(whole_lake=True)["datasets"]
    assert (datasets.chunks_done[0], datasets.prefix_chunks[0], datasets.num_docs[0], datasets.status[0]) == \
        (20, 20, 40, "complete")
