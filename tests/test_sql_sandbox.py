"""A lake safe to share: `lakeloader sql` reads only the catalog and writes nothing, and readers
never run SQL left in a catalog file (issue 12, items 1 and 2)."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pytest

from lakeloader.catalog.lake import Lake, open_lake
from lakeloader.catalog.snapshot import open_snapshot, read_pointer
from lakeloader.catalog.store import CatalogWriter
from lakeloader.cli import main
from lakeloader.contracts.errors import CatalogError
from lakeloader.read.catalog_view import CatalogView

from conftest import Lakes, batch_files, global_batches, reseal_snapshot, stdlib_texts

SECRET = "a colleague's private note 0451"


@pytest.fixture(scope="module")
def built(lakes: Lakes) -> Path:
    """A small built lake (two datasets, a mixture), never changed by the tests: they copy it."""
    names = ("json", "email")
    config = lakes.shared({f"{name}.jsonl": stdlib_texts(name) for name in names},
                          {name: {"sources": [f"{name}.jsonl"]} for name in names},
                          loader={"seq_len": 32, "batch_size": 4, "prefetch": 0},
                          mixture={"weights": {"json": 0.5, "email": 0.5}})
    return config


def tree_state(root: Path) -> dict[str, str]:
    """Every file and folder under ``root`` with the sha256 of each file."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


def lake_copy(built: Path, tmp_path: Path) -> dict[str, Path]:
    """A copy of the built lake with its own config (same datasets) in ``tmp_path``, a colleague's
    file outside it, and the paths the attacks aim at."""
    lake = tmp_path / "lake"
    shutil.copytree(built.parent / "lake", lake)
    config = tmp_path / "config.yaml"
    config.write_text(built.read_text().replace(str(built.parent / "lake"), str(lake)))
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "secret.txt").write_text(SECRET)
    return {
        "config": config, "lake": lake, "secret": tmp_path / "home" / "secret.txt",
        "chunk": sorted(lake.glob("json/*/*.parquet"))[0],
        "snapshot": lake / "_catalog" / read_pointer(Lake(str(lake)))["file"],
        "catalog": lake / "catalog.duckdb", "out": tmp_path / "out",
    }


@pytest.fixture(scope="module")
def shared(built: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One copy of the lake for the tests that must leave it as it is (each checks that they do)."""
    return lake_copy(built, tmp_path_factory.mktemp("shared"))


@pytest.fixture
def own(built: Path, tmp_path: Path) -> dict[str, Path]:
    """A copy of the lake for a test that alters it."""
    return lake_copy(built, tmp_path)


ATTACKS = [
    "COPY (SELECT 1 AS x) TO '{chunk}' (FORMAT parquet)",
    "COPY chunks TO '{out}.csv'",
    "EXPORT DATABASE '{out}'",
    "ATTACH '{snapshot}' AS s (READ_WRITE)",
    "ATTACH '{snapshot}' AS s (READ_WRITE); DELETE FROM s.chunks WHERE global_index > 0",
    "ATTACH '{out}.duckdb' AS fresh",
    "SELECT * FROM read_text('{secret}')",
    "SELECT * FROM read_text('/etc/passwd')",
    "SELECT * FROM read_parquet('{chunk}')",
    "SELECT * FROM glob('{lake}/*')",
    "SELECT count(*) FROM chunks, read_blob('{secret}')",
    "INSTALL httpfs",
    "LOAD httpfs",
    "SELECT * FROM read_parquet('https://example.com/data.parquet')",
    "SET enable_external_access = true",
    "RESET enable_external_access",
    "SET lock_configuration = false",
    "PRAGMA enable_profiling",
    "CREATE TABLE t AS SELECT 1 AS x",
    "CREATE OR REPLACE VIEW committed_prefix AS SELECT 'x' AS dataset, 0 AS num_chunks",
    "INSERT INTO lake.lake_meta VALUES ('k', 'v')",
    "UPDATE lake.chunks SET status = 'planned'",
    "DELETE FROM lake.chunks",
    "DROP TABLE lake.chunks",
    "DETACH lake",
    "CHECKPOINT",
    "SELECT 1; DROP VIEW datasets",
    "EXPLAIN ANALYZE COPY (SELECT 1) TO '{chunk}'",
]


@pytest.mark.parametrize("attack", ATTACKS)
def test_sql_refuses_writes_files_network_and_settings(shared: dict[str, Path], attack: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    statement = attack.format(**shared)
    before = tree_state(shared["lake"].parent)
    with pytest.raises(CatalogError) as refused:
        open_lake(shared["lake"]).sql(statement)
    message = str(refused.value)
    assert "lakeloader sql runs one read-only query" in message, message  # says what is allowed
    assert SECRET not in message and "root:" not in message
    assert main(["sql", str(shared["config"]), statement]) == 2
    captured = capsys.readouterr()
    assert "lakeloader sql: error:" in captured.err and "read-only query" in captured.err
    assert SECRET not in captured.out + captured.err
    assert tree_state(shared["lake"].parent) == before  # nothing on disk changed, in or out of the lake


def test_sql_help_says_what_is_allowed(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["sql", "--help"])
    assert exited.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for words in ("one read-only query", "SELECT", "Nothing can be written", "no other file",
                  "no network", "no extension", "mixture_plan"):
        assert words in text, words


@pytest.mark.parametrize("opener", ["catalog file", "snapshot", "snapshot cursor", "loader view"])
def test_reader_connections_reach_nothing_but_the_catalog(shared: dict[str, Path], opener: str) -> None:
    """Below `sql`'s statement check, the connection itself refuses (the loader's, `status`'s,
    `audit`'s); the loader's view, whose analyst views are defined after the lock, included."""
    lake = Lake(str(shared["lake"]))
    if opener == "catalog file":
        con = lake.connect()
    elif opener == "loader view":
        con = CatalogView(lake)
    else:
        con, _ = open_snapshot(lake)
        con = con.cursor() if opener == "snapshot cursor" else con

    def rows(statement: str) -> list[tuple[Any, ...]]:
        result = con.execute(statement)
        return result.fetchall() if opener != "loader view" else [tuple(r.values()) for r in result.to_pylist()]
    before = tree_state(shared["lake"].parent)
    refused = {
        f"COPY (SELECT 1 AS x) TO '{shared['chunk']}' (FORMAT parquet)": duckdb.PermissionException,
        f"ATTACH '{shared['snapshot']}' AS s (READ_WRITE)": duckdb.Error,
        f"ATTACH '{shared['out']}.duckdb' AS fresh": duckdb.PermissionException,
        f"SELECT * FROM read_text('{shared['secret']}')": duckdb.PermissionException,
        f"SELECT * FROM read_parquet('{shared['chunk']}')": duckdb.PermissionException,
        "INSTALL httpfs": duckdb.PermissionException,
        "LOAD httpfs": duckdb.PermissionException,
        "SET enable_external_access = true": duckdb.InvalidInputException,
        "SET lock_configuration = false": duckdb.InvalidInputException,
        "DELETE FROM lake.chunks": duckdb.Error,
        "CREATE TABLE lake.t AS SELECT 1": duckdb.Error,
    }
    try:
        for statement, error in refused.items():
            with pytest.raises(error):
                rows(statement)
        assert rows("SELECT count(*) FROM committed_prefix") == [(2,)]
        assert rows("SELECT count(*) FROM datasets") == [(2,)]   # an analyst view
        # The catalog file is attached as `lake`; its tables are also reachable under that name.
        assert rows("SELECT count(*) FROM lake.chunks") == rows("SELECT count(*) FROM chunks")
    finally:
        con.close()
    assert tree_state(shared["lake"].parent) == before


def test_analyst_queries_still_work(shared: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    lake = open_lake(shared["config"])
    datasets = lake.sql("SELECT name, num_chunks, prefix_chunks FROM datasets ORDER BY name")
    assert datasets.name.tolist() == ["email", "json"]
    assert (datasets.num_chunks == datasets.prefix_chunks).all()
    grouped = lake.sql("WITH c AS (SELECT dataset, num_tokens FROM chunk_offsets) "
                       "SELECT dataset, count(*) AS n, sum(num_tokens) AS tokens FROM c GROUP BY dataset ORDER BY dataset")
    assert grouped.n.tolist() == datasets.num_chunks.tolist()
    mixture = lake.sql("SELECT mixture_id FROM mixtures").mixture_id[0]
    plan = lake.sql("SELECT dataset, sum(examples) AS n FROM mixture_plan(?, 0, 10) GROUP BY dataset ORDER BY dataset",
                    [mixture])
    assert plan.n.sum() == 10 * 4
    shares = lake.sql("SELECT * FROM mixture_proportions($id, 0, 99)", {"id": mixture})
    assert shares.share.sum() == pytest.approx(1.0)
    assert "num_tokens" in lake.sql("DESCRIBE chunks").column_name.tolist()
    assert len(lake.sql("EXPLAIN SELECT * FROM committed_prefix")) == 1
    assert main(["sql", str(shared["config"]), "SELECT dataset, count(*) AS n FROM chunks GROUP BY ALL "
                 "ORDER BY dataset", "--format", "csv"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "dataset,n"


def test_sql_during_a_build_in_this_process_reads_the_snapshot_not_the_writer(own: dict[str, Path]) -> None:
    """The build's own connection may write and reach files: Lake.sql never uses it."""
    lake = open_lake(own["lake"])
    writer = CatalogWriter(lake.writer_catalog_path)
    try:
        assert lake.sql("SELECT count(*) AS n FROM committed_prefix").n[0] == 2
        with pytest.raises(CatalogError, match="Permission"):
            lake.sql(f"SELECT * FROM read_text('{own['secret']}')")
    finally:
        writer.close()


def plant(path: Path, statement: str) -> None:
    """Alter a published catalog file as a colleague with write access to the lake could (a
    snapshot's checksum in CURRENT sealed again: they guard against damage, not a lake's writer)."""
    con = duckdb.connect(str(path))
    try:
        con.execute(statement)
    finally:
        con.close()
    if path.parent.name == "_catalog":
        reseal_snapshot(path.parent.parent)


def test_batches_never_run_a_view_planted_in_the_snapshot(built: Path, own: dict[str, Path],
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    expected = global_batches(built, 1, range(3))
    # If run, the planted view reads the reader's file and fails with its contents.
    plant(own["snapshot"], f"""
        CREATE OR REPLACE VIEW committed_prefix AS
        SELECT dataset,
               error('planted view ran and read: ' || (SELECT content FROM read_text('{own['secret']}')))::BIGINT
                   AS num_chunks,
               count(*)::BIGINT AS planned_chunks
        FROM chunks GROUP BY dataset""")
    out = own["out"].with_suffix(".npz")
    result = subprocess.run([sys.executable, "-m", "lakeloader.cli", "batches", str(own["config"]),
                             "--steps", "0:3", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert SECRET not in result.stdout + result.stderr and "planted" not in result.stderr
    assert result.returncode == 0, result.stderr[-3000:]
    arrays = batch_files(out)
    assert sorted(arrays) == sorted(expected[0])
    for name in arrays:
        stacked = np.stack([batch[name] for batch in expected])
        assert arrays[name].dtype == stacked.dtype and np.array_equal(arrays[name], stacked), name
    assert main(["status", str(own["config"])]) == 0  # status reads the same views
    assert "planted" not in capsys.readouterr().out
    for macro in ("mixture_plan", "mixture_proportions"):  # planted macros are not used either
        plant(own["snapshot"], f"CREATE OR REPLACE MACRO {macro}(m, a, b) AS TABLE "
                                  f"SELECT * FROM read_text('{own['secret']}')")
    mixture = open_lake(own["lake"]).sql("SELECT mixture_id FROM mixtures").mixture_id[0]
    assert "planted" not in str(open_lake(own["lake"]).sql(f"SELECT * FROM mixture_proportions('{mixture}', 0, 9)"))


def test_a_table_replaced_by_a_view_is_refused(own: dict[str, Path]) -> None:
    plant(own["snapshot"], "DROP TABLE row_groups; CREATE VIEW row_groups AS "
                              f"SELECT * FROM read_text('{own['secret']}')")
    own["catalog"].unlink()  # readers of the lake now open the snapshot
    with pytest.raises(CatalogError, match=r"row_groups should be tables but are views"):
        open_snapshot(Lake(str(own["lake"])))
    with pytest.raises(CatalogError, match=r"row_groups should be tables but are views"):
        open_lake(own["lake"]).sql("SELECT 1")
