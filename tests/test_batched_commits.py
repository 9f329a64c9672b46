"""The driver commits every chunk result at hand in one transaction (issue 53 item 2): a few
statements per batch whatever its size, the same rows as committing the chunks one by one, all or
nothing for a batch, and a build that fails mid-batch resumes to the lake a clean build gives."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from lakeloader.catalog.store import CatalogWriter
from lakeloader.contracts.chunk_file import ChunkResult, PlanStats, Reject
from lakeloader.demo.many_chunks import generated_plan
from lakeloader.ingest.driver import build

from conftest import stdlib_texts, write_config, write_jsonl

CHUNKS = 12
SHARDS = 3
# Every table a commit writes, with the columns that do not depend on when it ran.
TABLES = {
    "chunks": "dataset, global_index, status, num_docs, num_tokens, num_records, num_bytes, checksum, num_rejects, "
              "source_bytes, build_id, worker, seconds, num_parts, part_tokens",
    "row_groups": "*",
    "chunk_examples": "*",
    "selections": "*",
    "rejects": "dataset, source, location, line, reason, shard_index, split_index, global_index, build_id",
}


def planned_writer(path: Path) -> CatalogWriter:
    """A catalog planning CHUNKS chunks of dataset "d" over SHARDS shards, none committed."""
    writer = CatalogWriter(str(path))
    writer.register_plan(generated_plan("d", CHUNKS, SHARDS), tokenizer_path="t.json", token_type="uint16", vocab_size=100, split_size=1,
                         on_error="skip")
    return writer


def result(index: int, rejects: int = 0, plans: tuple[str, ...] = ("a",), checksum: str | None = None) -> ChunkResult:
    """A chunk result of two row groups with ``rejects`` rejects and counts under ``plans``."""
    return ChunkResult(
        dataset="d", global_index=index, num_docs=3 + index, num_tokens=30 + index, num_records=4 + index,
        num_bytes=1000 + index, checksum=checksum or f"{index:064x}", row_group_docs=[2, 1 + index],
        row_group_tokens=[20, 10 + index], row_group_parts=[[2], [1 + index]],
        row_group_part_tokens=[[20], [10 + index]],
        rejects=[Reject(f"line {k + 1}", k + 1, f"reject {k} of {index}") for k in range(rejects)],
        source_bytes=500 + index, seconds=0.25, worker="host:1",
        plans=tuple(PlanStats(key, index, 10 * index, 0, 0, 0) for key in plans))


def rows(writer: CatalogWriter) -> dict[str, list[tuple[Any, ...]]]:
    """What the commits wrote, table by table, in a fixed order (rejects in their insertion order)."""
    found = {}
    for table, columns in TABLES.items():
        order = "" if table == "rejects" else " ORDER BY ALL"
        found[table] = writer.con.execute(f"SELECT {columns} FROM {table}{order}").fetchall()
    return found


@pytest.fixture
def transactions(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The named statements CatalogWriter runs, in order (begin_transaction starts each transaction)."""
    names: list[str] = []
    original = CatalogWriter._run

    def spy(self: CatalogWriter, name: str, params: dict[str, Any] | None = None) -> Any:
        names.append(name)
        return original(self, name, params)

    monkeypatch.setattr(CatalogWriter, "_run", spy)
    yield names


def test_results_at_hand_are_one_transaction_with_the_rows_of_one_by_one_commits(
        tmp_path: Path, transactions: list[str]) -> None:
    batch = [result(i, rejects=i % 3) for i in (4, 0, 5, 1, 2, 3)]
    with planned_writer(tmp_path / "batch.duckdb") as writer:
        build_id = writer.start_build(workers=1, scheduler="local", dashboard="", version="test")
        transactions.clear()
        assert writer.commit(batch, build_id) == len(batch)
        assert transactions.count("begin_transaction") == 1 and transactions.count("commit_transaction") == 1
        assert len(transactions) <= 8, transactions   # a few statements, not a few per chunk
        together = rows(writer)
    with planned_writer(tmp_path / "single.duckdb") as writer:
        build_id = writer.start_build(workers=1, scheduler="local", dashboard="", version="test")
        for one in batch:
            assert writer.commit([one], build_id) == 1
        assert rows(writer) == together
    assert len(together["row_groups"]) == 2 * len(batch) and len(together["chunk_examples"]) == len(batch)
    # Rejects in the batch's order, each with its chunk's source file, shard and split.
    assert [(r[0], r[1], r[2], r[5], r[6], r[7]) for r in together["rejects"]] == [
        ("d", f"/data/{i % SHARDS}.jsonl", f"line {k + 1}", i % SHARDS, i // SHARDS, i)
        for i in (4, 0, 5, 1, 2, 3) for k in range(i % 3)]


def test_a_chunk_committed_already_or_twice_in_a_batch_only_gets_the_counts_it_lacks(tmp_path: Path) -> None:
    with planned_writer(tmp_path / "catalog.duckdb") as writer:
        build_id = writer.start_build(workers=1, scheduler="local", dashboard="", version="test")
        assert writer.commit([result(0, rejects=1)], build_id) == 1
        first = rows(writer)
        again = [result(0, rejects=2, plans=("a", "b"), checksum="e" * 64),   # committed: only counts "b" added
                 result(1), result(1, plans=("a", "c"), checksum="f" * 64)]   # twice: the first one committed
        assert writer.commit(again, build_id) == 1
        after = rows(writer)
    assert [row for row in after["chunks"] if row[1] == 0] == [row for row in first["chunks"] if row[1] == 0]
    assert [row[1] for row in after["chunks"] if row[2] == "committed"] == [0, 1]
    assert [row for row in after["chunks"] if row[1] == 1][0][7] == f"{1:064x}"
    assert len(after["row_groups"]) == 4 and len(after["rejects"]) == 1
    assert sorted((row[1], row[2]) for row in after["chunk_examples"]) == [(0, "a"), (0, "b"), (1, "a"), (1, "c")]


def test_a_failure_mid_batch_commits_nothing_of_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with planned_writer(tmp_path / "catalog.duckdb") as writer:
        build_id = writer.start_build(workers=1, scheduler="local", dashboard="", version="test")
        writer.commit([result(0, rejects=1)], build_id)
        before = rows(writer)
        original = CatalogWriter._run

        def failing(self: CatalogWriter, name: str, params: dict[str, Any] | None = None) -> Any:
            if name == "commit_batch_examples":   # after the chunks and their row groups were written
                raise RuntimeError("the driver crashed mid-batch")
            return original(self, name, params)

        monkeypatch.setattr(CatalogWriter, "_run", failing)
        batch = [result(i, rejects=1) for i in (1, 2, 3)]
        with pytest.raises(RuntimeError, match="mid-batch"):
            writer.commit(batch, build_id)
        assert rows(writer) == before
        monkeypatch.setattr(CatalogWriter, "_run", original)
        assert writer.commit(batch, build_id) == 3   # the connection takes the batch again
        assert [row[1] for row in rows(writer)["chunks"] if row[2] == "committed"] == [0, 1, 2, 3]


# ------------------------------------------------------------------------------------------------
# Through a build on the real cluster
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Real text as JSONL shards, shared by the module's builds (same files, same chunk paths)."""
    data = tmp_path_factory.mktemp("corpus")
    texts = stdlib_texts("email") + stdlib_texts("json")
    for index in range(4):
        write_jsonl(data / f"p{index}.jsonl", texts)
    return data


def corpus_config(tmp: Path, data: Path) -> Path:
    """A config of about 56 chunks of ``data`` with packing counts (a `pack` loader), its lake in ``tmp/lake``."""
    return write_config(tmp, {"d": {"sources": [str(data / "*.jsonl")]}},
                        build={"split_size": "32KB", "publish_interval": 0.2},
                        loader={"seq_len": 256, "batch_size": 4, "packing": "pack"})


def lake_rows(config: Path) -> dict[str, pd.DataFrame]:
    """The tables a build commits, without the columns that depend on when and where it ran."""
    from lakeloader.catalog.lake import open_lake

    lake = open_lake(config)
    return {
        "chunks": lake.sql("SELECT global_index, status, path, num_docs, num_tokens, num_bytes, checksum, num_parts, "
                           "part_tokens FROM chunks ORDER BY global_index"),
        "row_groups": lake.sql("SELECT * FROM row_groups ORDER BY global_index, row_group"),
        "chunk_examples": lake.sql("SELECT * FROM chunk_examples ORDER BY global_index, plan_key"),
    }


def consistent(config: Path) -> int:
    """Committed chunks in the writer catalog, after checking that exactly those have packing
    counts, and row groups if they hold documents."""
    import duckdb

    con = duckdb.connect(str(config.parent / "lake" / "catalog.duckdb"), read_only=True)
    try:
        committed = {row[0] for row in con.execute(
            "SELECT global_index FROM chunks WHERE status = 'committed'").fetchall()}
        documents = {row[0] for row in con.execute("SELECT global_index FROM chunks WHERE status = 'committed' "
                                                   "AND num_docs > 0").fetchall()}
        grouped = {row[0] for row in con.execute("SELECT DISTINCT global_index FROM row_groups").fetchall()}
        counted = {row[0] for row in con.execute("SELECT DISTINCT global_index FROM chunk_examples").fetchall()}
    finally:
        con.close()
    assert grouped == documents and counted == committed
    return len(committed)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, corpus: Path, dask_scheduler: str) -> dict[str, pd.DataFrame]:
    config = corpus_config(tmp_path_factory.mktemp("reference"), corpus)
    report = build(config, scheduler=dask_scheduler, progress=False)
    assert report.chunks_total >= 50
    return lake_rows(config)


def slow_first_commit(monkeypatch: pytest.MonkeyPatch, sizes: list[int]) -> None:
    """Record the size of every batch the build commits; the first one takes a second, so that
    results pile up behind it as behind a busy driver."""
    original = CatalogWriter.commit

    def commit(self: CatalogWriter, results: list[ChunkResult], build_id: int, index_files: Any = ()) -> int:
        if not sizes:
            time.sleep(1.0)
        sizes.append(len(results))
        return original(self, results, build_id, index_files)

    monkeypatch.setattr(CatalogWriter, "commit", commit)


def test_a_build_commits_the_results_at_hand_together(tmp_path: Path, corpus: Path, dask_scheduler: str,
                                                      monkeypatch: pytest.MonkeyPatch, transactions: list[str],
                                                      reference: dict[str, pd.DataFrame]) -> None:
    config = corpus_config(tmp_path, corpus)
    sizes: list[int] = []
    slow_first_commit(monkeypatch, sizes)
    build(config, scheduler=dask_scheduler, progress=False)
    assert sum(sizes) == len(reference["chunks"]) and max(sizes) > 1, sizes
    commits = [name for name in transactions if name in ("commit_chunk", "commit_batch_chunks")]
    assert len(commits) == len([size for size in sizes if size])   # one transaction per batch
    for name, table in lake_rows(config).items():
        pd.testing.assert_frame_equal(table, reference[name], obj=name)


def test_a_build_that_fails_mid_batch_keeps_a_consistent_catalog_and_resumes(
        tmp_path: Path, corpus: Path, dask_scheduler: str, monkeypatch: pytest.MonkeyPatch,
        reference: dict[str, pd.DataFrame]) -> None:
    config = corpus_config(tmp_path, corpus)
    sizes: list[int] = []
    slow_first_commit(monkeypatch, sizes)
    original = CatalogWriter._run
    calls = []

    def failing(self: CatalogWriter, name: str, params: dict[str, Any] | None = None) -> Any:
        if name == "commit_batch_examples":
            calls.append(name)
            if len(calls) == 2:   # the second batch (results piled up behind the slow first one)
                raise RuntimeError("the driver crashed mid-batch")
        return original(self, name, params)

    monkeypatch.setattr(CatalogWriter, "_run", failing)
    with pytest.raises(RuntimeError, match="mid-batch"):
        build(config, scheduler=dask_scheduler, progress=False)
    assert len(sizes) == 2 and sizes[1] > 1, sizes
    assert consistent(config) == sizes[0]   # the first batch, nothing of the second
    monkeypatch.undo()
    report = build(config, scheduler=dask_scheduler, progress=False)
    assert report.chunks_built == len(reference["chunks"]) - sizes[0]
    assert consistent(config) == len(reference["chunks"])
    for name, table in lake_rows(config).items():
        pd.testing.assert_frame_equal(table, reference[name], obj=name)
