"""Incremental snapshots (issue 53, item 1): a publish writes a delta of the chunks changed since
the previous one on an immutable base; every reader sees each version exactly as a full snapshot
of it, fetches only the deltas it lacks, and a damaged delta is one error naming it."""

from __future__ import annotations

import logging
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pytest

from lakeloader.catalog import snapshot
from lakeloader.catalog.lake import Lake
from lakeloader.catalog.pointer import delta_file, delta_versions, parse_pointer, seal_pointer
from lakeloader.catalog.reader_index import INDEX_FORMAT, TABLES, ReaderIndex
from lakeloader.catalog.snapshot import SNAPSHOT_DIR, materialise, open_reader_index, publish_snapshot, read_pointer
from lakeloader.catalog.store import CatalogWriter, catalog_tables, connect_reader, writer_catalog_from
from lakeloader.cli import main
from lakeloader.contracts.chunk_file import ChunkResult, PlanStats, Reject
from lakeloader.contracts.errors import CatalogError, CatalogIntegrityError
from lakeloader.demo.many_chunks import generated_plan
from lakeloader.feed.loader import Loader
from lakeloader.ingest.writer_catalog import prepare_writer_catalog
from lakeloader.read.catalog_view import CatalogView

from conftest import assert_batches_equal, reseal_snapshot, start_build_thread, stdlib_texts, write_config, write_jsonl
from test_s3 import BUCKET, s3_endpoint, storage_options  # noqa: F401  (s3_endpoint: a fixture)

DATASETS = {"a": 300, "b": 120}


@pytest.fixture(autouse=True)
def _compacted_by_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """These catalogs are small: their deltas would soon outweigh a quarter of the base."""
    monkeypatch.setattr(snapshot, "DELTA_SHARE", 10.0)


def result(dataset: str, index: int, plans: tuple[str, ...] = ("k",)) -> ChunkResult:
    """A chunk result shaped like a real one: two or three row groups, a reject now and then."""
    groups = 2 + index % 2
    docs = [3 + (index + g) % 4 for g in range(groups)]
    tokens = [d * 11 for d in docs]
    return ChunkResult(dataset, index, sum(docs), sum(tokens), sum(docs) + 1, 1000 + index, f"{index:064x}",
                       docs, tokens, [[d] for d in docs], [[t] for t in tokens],
                       [Reject("line 3", 3, "not JSON")] if index % 7 == 0 else [], 500, 0.1, "w",
                       plans=tuple(PlanStats(key, index % 5 + 1, 90, 0, 0, 0) for key in plans))


def planned_writer(lake: Lake) -> tuple[CatalogWriter, int]:
    os.makedirs(lake.root, exist_ok=True) if lake.is_local else None
    writer = CatalogWriter(lake.writer_catalog_path)
    for name, chunks in DATASETS.items():
        writer.register_plan(generated_plan(name, chunks, 7), tokenizer_path="_tokenizer/t.json",
                             token_type="uint16", vocab_size=8204, split_size=1, on_error="skip")
    return writer, writer.start_build(workers=0, scheduler="none", dashboard="", version="test")


def full_copy(lake: Lake, pointer: dict[str, Any], folder: Path) -> tuple[duckdb.DuckDBPyConnection, ReaderIndex]:
    """A full snapshot of the version ``pointer`` names, published afresh into another lake: its
    SQL connection and its reader index (what a reader of a non-incremental lake has)."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    materialise(lake, pointer, str(folder / "catalog.duckdb"))
    shutil.copyfile(folder / "catalog.duckdb", folder / "sql.duckdb")   # (publishing records its version)
    other = Lake(str(folder / "lake"))
    os.makedirs(other.root)
    with duckdb.connect(str(folder / "catalog.duckdb")) as con:
        publish_snapshot(con, other, None)
    assert not delta_versions(read_pointer(other))
    return connect_reader(str(folder / "sql.duckdb")), open_reader_index(other)[1]


def table_rows(reader: CatalogView | duckdb.DuckDBPyConnection, table: str) -> pa.Table:
    """Every row of ``table``, sorted, as ``reader`` sees it."""
    if isinstance(reader, CatalogView):
        return reader.execute(f"FROM {table} ORDER BY ALL")
    return reader.sql(f"FROM {table} ORDER BY ALL").to_arrow_table()


def assert_same_catalog(view: CatalogView, lake: Lake, folder: Path) -> None:
    """The view's SQL tables and reader index answer bitwise as a full snapshot of its version."""
    pointer = read_pointer(lake)
    full_sql, full_index = full_copy(lake, pointer, folder)
    try:
        for table in catalog_tables():
            assert table_rows(view, table).equals(table_rows(full_sql, table)), table
    finally:
        full_sql.close()
    index = view.reader_index()
    assert index is not None
    for name, planned in DATASETS.items():
        assert index.plan(name) == full_index.plan(name)
        assert index.chunks(name).equals(full_index.chunks(name)), name
        for prefix in (0, planned // 2, planned):
            got, expected = index.examples(name, "k", prefix), full_index.examples(name, "k", prefix)
            assert all(np.array_equal(got[k], expected[k]) for k in expected), (name, prefix)
        wanted = sorted(random.Random(planned).sample(range(planned), 40))
        got, expected = index.row_groups_of(name, wanted, True), full_index.row_groups_of(name, wanted, True)
        for key in expected:
            assert (got[key].equals(expected[key]) if isinstance(expected[key], pa.Array)
                    else np.array_equal(got[key], expected[key])), (name, key)
        for chunk in wanted[:10]:
            assert index.record(name, chunk) == full_index.record(name, chunk)


@pytest.mark.parametrize("copy_memory", [snapshot.COPY_MEMORY, 256 * 1024], ids=["copy-memory-default", "copy-memory-tight"])
def test_a_follower_sees_each_version_as_its_full_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture, copy_memory: int) -> None:
    """(With ``copy_memory`` 256 KiB a base's copy runs out of memory and is copied again
    without the limit.)"""
    caplog.set_level(logging.INFO, logger=snapshot.__name__)
    tight = copy_memory < snapshot.COPY_MEMORY
    monkeypatch.setattr(snapshot, "MAX_WRITER_DELTAS", 3)
    monkeypatch.setattr(snapshot, "COPY_MEMORY", copy_memory)
    lake = Lake(str(tmp_path / "lake"))
    writer, build_id = planned_writer(lake)
    order = [(name, i) for name, chunks in DATASETS.items() for i in range(chunks)]
    random.Random(0).shuffle(order)
    committed: list[tuple[str, int]] = []
    bases, deltas = set(), 0
    with writer:
        writer.commit([result(n, i) for n, i in order[:50]], build_id)
        committed += order[:50]
        publish_snapshot(writer.con, lake, build_id, writer.changes)
        view = CatalogView(lake)
        for step, start in enumerate(range(50, 290, 30)):
            batch = order[start:start + 30]
            writer.commit([result(n, i) for n, i in batch], build_id)
            committed += batch
            if step % 2:   # packing counts of another plan for chunks committed earlier, and a chunk again
                again = committed[: 5 * step]
                writer.commit_plans("a", [(i, PlanStats("k2", 1, 9, 0, 0, 0)) for n, i in again if n == "a"])
                writer.commit([result(*committed[0], plans=("k", "k3"))], build_id)
            writer.set_build_cluster(build_id, workers=step, dashboard="")   # a whole table changes too
            publish_snapshot(writer.con, lake, build_id, writer.changes)
            assert view.refresh()
            pointer = read_pointer(lake)
            bases.add(pointer.get("base", pointer["version"]))
            deltas += bool(delta_versions(pointer))
            assert_same_catalog(view, lake, tmp_path / "full")
        view.close()
    assert len(bases) >= 2 and deltas >= 4   # deltas on several bases: compacted
    assert max(len(delta_versions(read_pointer(lake))), 0) <= 3
    again = [r for r in caplog.records if "copying it again without that limit" in r.getMessage()]
    assert bool(again) == tight


def published_in_steps(folder: Path, chunks: int, step: int) -> Lake:
    """A lake at ``folder`` whose writer committed chunks ``0..chunks-1`` of dataset "a" ``step``
    at a time, publishing after each commit (a base, then deltas)."""
    lake = Lake(str(folder))
    writer, build_id = planned_writer(lake)
    with writer:
        for start in range(0, chunks, step):
            writer.commit([result("a", i) for i in range(start, start + step)], build_id)
            publish_snapshot(writer.con, lake, build_id, writer.changes)
    return lake


def test_recover_catalog_from_base_and_deltas(tmp_path: Path) -> None:
    lake = published_in_steps(tmp_path / "lake", 200, 40)
    assert len(delta_versions(read_pointer(lake))) == 4
    shutil.copyfile(lake.writer_catalog_path, tmp_path / "expected.duckdb")
    prepare_writer_catalog(lake, recover=True)
    recovered, expected = connect_reader(lake.writer_catalog_path), connect_reader(str(tmp_path / "expected.duckdb"))
    for table in catalog_tables():
        assert table_rows(recovered, table).equals(table_rows(expected, table)), table
    recovered.close()
    expected.close()
    # The published base carries rows only; the recovered catalog has the schema's keys again, and
    # its build ids go on after the lake's.
    base = snapshot.local_snapshot(lake, read_pointer(lake))
    keyed = {str(path): primary_keys(path) for path in (base, lake.writer_catalog_path, tmp_path / "expected.duckdb")}
    assert keyed[base] == set()
    assert keyed[lake.writer_catalog_path] == keyed[str(tmp_path / "expected.duckdb")] >= {"chunks", "row_groups", "builds"}
    with CatalogWriter(lake.writer_catalog_path) as writer:
        assert writer.start_build(workers=0, scheduler="none", dashboard="", version="test") == 2
        with pytest.raises(duckdb.ConstraintException):
            writer.con.execute("INSERT INTO chunks BY NAME FROM chunks LIMIT 1")
    # A snapshot of an older lakeloader kept the keys: its rows are taken alike.
    writer_catalog_from(str(tmp_path / "expected.duckdb"), str(tmp_path / "again.duckdb"))
    again, expected = connect_reader(str(tmp_path / "again.duckdb")), connect_reader(str(tmp_path / "expected.duckdb"))
    for table in catalog_tables():
        assert table_rows(again, table).equals(table_rows(expected, table)), table
    again.close()
    expected.close()
    assert primary_keys(tmp_path / "again.duckdb") == keyed[lake.writer_catalog_path]


def test_a_snapshot_of_a_newer_schema_is_refused_by_name(tmp_path: Path) -> None:
    lake = published_in_steps(tmp_path / "lake", 40, 40)
    with CatalogWriter(lake.writer_catalog_path) as writer:
        writer.con.execute("UPDATE lake_meta SET value = '99' WHERE key = 'schema_version'")
    shutil.copyfile(lake.writer_catalog_path, tmp_path / "newer.duckdb")
    with pytest.raises(CatalogError, match=r"catalog .*newer.duckdb has schema version 99, this lakeloader writes"):
        writer_catalog_from(str(tmp_path / "newer.duckdb"), str(tmp_path / "taken.duckdb"))


def primary_keys(path: str | Path) -> set[str]:
    """The tables of the catalog file at ``path`` that have a primary key."""
    with duckdb.connect(str(path), read_only=True) as con:
        return {row[0] for row in con.execute(
            "SELECT table_name FROM duckdb_constraints() WHERE constraint_type = 'PRIMARY KEY'").fetchall()}


def test_a_damaged_or_altered_delta_is_one_error_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lake = published_in_steps(tmp_path / "lake", 90, 30)
    version = read_pointer(lake)["version"]
    delta = Path(lake.path_of(f"{SNAPSHOT_DIR}/{delta_file(version)}"))
    os.remove(lake.writer_catalog_path)   # `sql LAKE` then reads the published catalog
    data = bytearray(delta.read_bytes())
    data[len(data) // 2] ^= 0xFF
    delta.write_bytes(bytes(data))
    with pytest.raises(CatalogIntegrityError, match=f"{delta_file(version)} is damaged or was altered"):
        CatalogView(lake)
    assert main(["sql", str(lake.root), "SELECT count(*) FROM chunks"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and delta_file(version) in err and "Traceback" not in err
    # Altered with a matching checksum: valid Arrow, but not a delta as lakeloader writes one.
    with pa.OSFile(str(delta), "wb") as sink, pa.ipc.new_file(sink, pa.schema([("x", pa.int64())])) as out:
        out.write_table(pa.table({"x": [1]}))
    reseal_snapshot(Path(lake.root))
    with pytest.raises(CatalogIntegrityError, match=f"{delta_file(version)} is not as lakeloader writes it"):
        CatalogView(lake)
    # Rows of another type than its base's: refused when the index or the SQL views take them.
    assert main(["sql", str(lake.root), "SELECT 1"]) == 2
    assert delta_file(version) in capsys.readouterr().err


def test_an_s3_reader_fetches_only_the_deltas_it_lacks(s3_endpoint: str, tmp_path: Path,  # noqa: F811
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    options = storage_options(s3_endpoint)
    writer_lake = Lake(f"s3://{BUCKET}/incremental", options)
    writer, build_id = planned_writer(writer_lake)
    monkeypatch.setenv("LAKELOADER_CACHE", str(tmp_path / "reader-cache"))
    reader_lake = Lake(f"s3://{BUCKET}/incremental", options)
    assert reader_lake.cache_dir != writer_lake.cache_dir

    def cached() -> dict[str, float]:
        found = {}
        for folder, _, files in os.walk(reader_lake.cache_dir):
            found |= {name: os.stat(os.path.join(folder, name)).st_mtime_ns for name in files
                      if name.startswith("catalog-")}
        return found

    with writer:
        writer.commit([result("a", i) for i in range(100)], build_id)
        publish_snapshot(writer.con, writer_lake, build_id, writer.changes)
        view = CatalogView(reader_lake)
        with view.reading():   # SQL too: the base's DuckDB file
            pass
        base = cached()
        assert sorted(base) == ["catalog-000001.chunks.arrow", "catalog-000001.duckdb",
                                "catalog-000001.examples.arrow", "catalog-000001.row_groups.arrow"]
        for version in (2, 3):
            writer.commit([result("a", i) for i in range(100 * version - 100, 100 * version)], build_id)
            publish_snapshot(writer.con, writer_lake, build_id, writer.changes)
            before = cached()
            assert view.refresh()
            with view.reading():
                pass
            now = cached()
            assert set(now) - set(before) == {delta_file(version)}
            assert all(now[name] == before[name] for name in base)   # the base is not fetched again
        assert view.dataset("a").committed == 300
        assert_same_catalog(view, reader_lake, tmp_path / "full")
        view.close()
    shutil.rmtree(reader_lake.cache_dir)
    fresh = CatalogView(reader_lake)   # a fresh reader: the base and every delta
    with fresh.reading():
        pass
    assert sorted(cached()) == sorted([*base, delta_file(2), delta_file(3)])
    assert fresh.dataset("a").committed == 300
    fresh.close()


def test_a_loader_following_a_build_reads_deltas_as_the_finished_lake(tmp_path: Path, dask_scheduler: str) -> None:
    write_jsonl(tmp_path / "data" / "d.jsonl", stdlib_texts("json") + stdlib_texts("email"))
    config = write_config(tmp_path, {"d": {"sources": [str(tmp_path / "data" / "d.jsonl")]}},
                          build={"split_size": "3KB", "publish_interval": 0.05},
                          loader={"seq_len": 32, "batch_size": 8, "shuffle": {"kind": "none"}})
    builder, _, errors = start_build_thread(config, scheduler=dask_scheduler, progress=False)
    lake = Lake(str(tmp_path / "lake"))
    seen: dict[int, int] = {}   # version read with deltas -> chunks committed in it
    during = None
    while builder.is_alive():
        pointer = read_pointer(lake)
        if pointer is not None and pointer["version"] not in seen and delta_versions(pointer):
            try:
                view = CatalogView(lake)
                seen[pointer["version"]] = view.dataset("d").committed
                view.close()
                if during is None:   # read while it builds: waits for (and refreshes to) the chunks it needs
                    with Loader(config) as loader:
                        during = [loader.batch(step) for step in range(3)]
            except CatalogError:   # that version was pruned meanwhile
                pass
        time.sleep(0.01)
    builder.join()
    assert not errors and len(seen) >= 2 and during is not None, seen
    assert not delta_versions(read_pointer(lake))   # a finished build publishes one full snapshot
    with Loader(config) as loader:
        assert_batches_equal([loader.batch(step) for step in range(3)], during)
        assert loader.view.dataset("d").committed >= max(seen.values())


@pytest.mark.parametrize("changes, why", [
    ({"base": 4}, "base"),
    ({"base": 0}, "base"),
    ({"base": "2"}, "base"),
    ({"deltas": [4, 3]}, "deltas"),
    ({"deltas": []}, "deltas"),
    ({"file": "catalog-000004.duckdb"}, "file"),
    ({"reader_index": {"prefix": "catalog-000004", "format": INDEX_FORMAT}}, "reader_index"),
    ({"sha256": {key: "a" * 64 for key in ("catalog", *TABLES, "delta-3")}}, "delta-4"),
])
def test_a_pointer_naming_other_deltas_than_its_versions_is_refused(changes: dict[str, Any], why: str) -> None:
    payload = {"version": 4, "base": 2, "deltas": [3, 4], "file": "catalog-000002.duckdb",
               "reader_index": {"prefix": "catalog-000002", "format": INDEX_FORMAT},
               "sha256": {key: "a" * 64 for key in ("catalog", *TABLES, "delta-3", "delta-4")},
               "published_at": 1.0, "build_id": 1, "lake_id": "0" * 32}
    assert delta_versions(parse_pointer(seal_pointer(payload), "CURRENT", TABLES, INDEX_FORMAT)) == [3, 4]
    with pytest.raises(CatalogIntegrityError, match=f"CURRENT is damaged or was altered.*{why}"):
        parse_pointer(seal_pointer(payload | changes), "CURRENT", TABLES, INDEX_FORMAT)
