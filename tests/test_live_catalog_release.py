"""A build in this process releases its live catalog, and a reader moves to a newer snapshot,
while readers of other threads are in the middle of their queries: DuckDB refuses to close a
connection while a cursor of it runs a call, and a cursor of a closed connection loses its result.
Neither may reach the user: the build's close waits for the readers' queries, and no reader
fails, whichever connection it was reading when the other one went."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import duckdb
import pytest
import yaml

from lakeloader.catalog.lake import Lake
from lakeloader.catalog.snapshot import publish_snapshot
from lakeloader.catalog import store
from lakeloader.catalog.store import CatalogWriter, LiveCatalog
from lakeloader.contracts.errors import CatalogError
from lakeloader.read.catalog_view import CatalogView

BUILDS = 30
READERS = 3
ROWS = 400_000_000   # a query of ~1 s on one DuckDB thread


@pytest.fixture
def own_lake(two_dataset_lake: dict[str, Path], tmp_path: Path) -> Lake:
    """A copy of the shared two-dataset lake this test may publish snapshots into."""
    source = Path(yaml.safe_load(two_dataset_lake["pack"].read_text())["lake"])
    shutil.copytree(source, tmp_path / "lake")
    return Lake(str(tmp_path / "lake"))


def test_builds_release_their_catalog_while_readers_of_this_process_query_it(own_lake: Lake) -> None:
    live = LiveCatalog()
    view = CatalogView(own_lake, live=live)
    expected = {name: view.dataset(name) for name in ("a", "b")}
    stop = threading.Event()
    failures: list[BaseException] = []
    read_live = [0, 0]   # queries made while no build / a build held the catalog
    read_with = [threading.Event(), threading.Event()]   # set once read_live[0] / [1] counts one

    def read() -> None:
        try:
            while not stop.is_set():
                fresh = CatalogView(own_lake, live=live)   # opened while a build holds the catalog, or not
                for _ in range(4):
                    holding = live.is_open
                    for reader in (view, fresh):
                        reader.refresh()   # moves to a newly published snapshot, retiring the last
                        for name, chunks in expected.items():
                            found = reader.dataset(name)
                            assert (found.committed, found.num_tokens.tolist()) == (
                                chunks.committed, chunks.num_tokens.tolist())
                            assert reader.row_groups_of(name, [0])[0]["num_tokens"].sum() == chunks.num_tokens[0]
                    with fresh.reading() as cursor:   # open until the block ends, however long it takes
                        time.sleep(0.02)
                        prefix = cursor.execute("SELECT sum(num_chunks) FROM committed_prefix").fetchone()[0]
                        assert prefix == sum(chunks.committed for chunks in expected.values())
                    kind = int(holding and live.is_open)
                    read_live[kind] += 1
                    read_with[kind].set()
                fresh.close()
        except BaseException as exc:  # surfaced by the assertion below
            failures.append(exc)

    readers = [threading.Thread(target=read) for _ in range(READERS)]
    for reader in readers:
        reader.start()
    try:
        for build in range(BUILDS):   # as builds in this process: open, publish, close
            with CatalogWriter(own_lake.writer_catalog_path, live) as writer:
                time.sleep(0.01)
                publish_snapshot(writer.con, own_lake, build)
                if build == BUILDS // 2:   # however loaded the machine, some reader reads through a build
                    read_with[1].wait(timeout=120)
            time.sleep(0.01)
            assert not failures, failures
        read_with[0].wait(timeout=120)   # and some reader without one
    finally:
        stop.set()
        for reader in readers:
            reader.join(timeout=60)
    assert not failures, failures
    assert min(read_live) > 0, read_live   # both kinds of reading happened
    assert not live.is_open
    view.close()


def long_query(cursor: duckdb.DuckDBPyConnection) -> tuple[threading.Thread, list[int]]:
    """Start, on one DuckDB thread, a query of about a second on ``cursor`` (of the live catalog)
    in a thread of its own; return that thread once the query is running, and its result list."""
    cursor.execute("SET threads = 1")   # the test database's own setting: as long on any machine
    results: list[int] = []
    started = threading.Event()

    def run() -> None:
        started.set()
        results.append(cursor.execute(f"SELECT sum(i) FROM range({ROWS}) t(i)").fetchone()[0])

    analyst = threading.Thread(target=run)
    analyst.start()
    started.wait()
    time.sleep(0.05)
    assert analyst.is_alive()   # still in its query
    return analyst, results


def test_a_build_waits_for_a_query_on_a_cursor_taken_from_its_live_catalog(own_lake: Lake) -> None:
    """A cursor of ``LiveCatalog.cursor`` (``Lake.connect(live=...)``) in the middle of a query when
    the build ends: the build's close waits for it, and the cursor is closed with the build."""
    live = LiveCatalog()
    with CatalogWriter(own_lake.writer_catalog_path, live):
        cursor = own_lake.connect(live=live)
        analyst, results = long_query(cursor)
    assert results == [ROWS * (ROWS - 1) // 2]   # finished before the close
    analyst.join()
    with pytest.raises(duckdb.ConnectionException, match="closed"):
        cursor.execute("SELECT 1")


def test_a_query_outlasting_the_wait_is_an_error_that_says_what_to_do(
        own_lake: Lake, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store, "CLOSE_WAIT_SECONDS", 0.2)
    live = LiveCatalog()
    writer = CatalogWriter(own_lake.writer_catalog_path, live)
    analyst, results = long_query(own_lake.connect(live=live))
    with pytest.raises(CatalogError, match=r"still running after 0.2s\. Everything built is committed, "
                                           r"but the file stays locked until that query ends"):
        writer.close()
    analyst.join()
    assert results == [ROWS * (ROWS - 1) // 2]   # the user's query was not cut short
    writer.con.close()   # it ended: the catalog closes
