"""SQL stored in a lake never runs in its readers, and reader SQL has limits (issue 47, items 4
and 7): a generated column planted in a catalog table is refused before anything reads it; the
predicate a filtered dataset stores is checked as strictly as the config's ``where`` before the
documents view takes it; ``lakeloader sql``/``stats`` run within ``sql.memory_limit``,
``sql.threads`` and ``sql.timeout_s``, and stop at Ctrl-C."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import duckdb
import pytest
import yaml

from lakeloader.catalog import snapshot
from lakeloader.catalog.lake import Lake, open_lake
from lakeloader.catalog.snapshot import open_snapshot, read_pointer
from lakeloader.catalog.store import connect_reader, schema_columns
from lakeloader.catalog.sql import sql_file
from lakeloader.cli import main
from lakeloader.config import load_config
from lakeloader.contracts.errors import CatalogError, QueryLimitError
from lakeloader.contracts.selection import IMPURE_FUNCTIONS, check_predicate, metadata_columns, where_problem
from lakeloader.ingest.driver import build

from conftest import reseal_snapshot, stdlib_texts, write_config

PLANTED = "planted SQL ran"
WHERE = "lang = 'en' AND num_tokens < 100000"
# Never ends unless interrupted: ~10^13 rows.
ENDLESS = "SELECT sum(hash(i)) FROM range(10000000000000) t(i)"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, dask_scheduler: str) -> Path:
    """A lake of a dataset with a metadata field and a filter of it (never changed: tests copy it)."""
    root = tmp_path_factory.mktemp("hostile_sql")
    texts = stdlib_texts("json")
    (root / "data").mkdir()
    (root / "data" / "web.jsonl").write_text("".join(
        json.dumps({"text": text, "lang": ("en", "fr")[i % 2]}) + "\n" for i, text in enumerate(texts)))
    config = write_config(root, {"web": {"sources": [str(root / "data" / "web.jsonl")], "metadata_fields": {"lang": "string"}},
                                 "web_en": {"from": "web", "where": WHERE}},
                          loader={"seq_len": 32, "batch_size": 4}, mixture={"weights": {"web": 1, "web_en": 1}})
    build(config, scheduler=dask_scheduler, progress=False)
    return config


@pytest.fixture
def own(built: Path, tmp_path: Path) -> dict[str, Path]:
    """A copy of the lake with its own config, read through its published snapshot (the local
    catalog file is gone, as on any host but the builder's)."""
    lake = tmp_path / "lake"
    shutil.copytree(built.parent / "lake", lake)
    (lake / "catalog.duckdb").unlink()
    config = tmp_path / "config.yaml"
    config.write_text(built.read_text().replace(str(built.parent / "lake"), str(lake)))
    return {"config": config, "lake": lake, "snapshot": lake / "_catalog" / read_pointer(Lake(str(lake)))["file"]}


def plant(own: dict[str, Path], *statements: str) -> None:
    """Alter the published snapshot as someone with write access to the lake could, re-sealing
    its pointer as they could too."""
    con = duckdb.connect(str(own["snapshot"]))
    try:
        for statement in statements:
            con.execute(statement)
    finally:
        con.close()
    reseal_snapshot(own["lake"])


def with_generated(table: str, column: str, expression: str) -> list[str]:
    """Statements that rebuild ``table`` with its rows and ``column`` generated from ``expression``
    (replacing the column of that name, or added)."""
    kept = [c for c in schema_columns()[table] if c != column]
    con = duckdb.connect()
    con.execute(sql_file("schema"))
    types = dict(con.execute(f"SELECT column_name, data_type FROM duckdb_columns() WHERE table_name = '{table}'").fetchall())
    con.close()
    listed = ", ".join(kept)
    return [f"CREATE TABLE planted ({', '.join(f'{c} {types[c]}' for c in kept)}, "
            f"{column} VARCHAR GENERATED ALWAYS AS ({expression}) VIRTUAL)",
            f"INSERT INTO planted ({listed}) SELECT {listed} FROM {table}",
            f"DROP TABLE {table}", f"ALTER TABLE planted RENAME TO {table}"]


# Fails only where lakeloader locks a reader's configuration: planting it (an INSERT checks it) works.
FIRES = f"CASE WHEN current_setting('lock_configuration') THEN error('{PLANTED}') END"


def test_a_generated_column_in_place_of_a_catalog_column_is_refused_by_every_reader(
        own: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    plant(own, *with_generated("builds", "error", FIRES))
    for opens in (lambda: open_snapshot(Lake(str(own["lake"])), analyst_views=False),   # a loader's
                  lambda: open_lake(own["lake"]).sql("SELECT * FROM builds")):
        with pytest.raises(CatalogError) as refused:
            opens()
        message = str(refused.value)
        assert own["snapshot"].name in message and "builds.error" in message and "generated column" in message
        assert "rebuild the catalog" in message and PLANTED not in message
    for command in (["status", str(own["config"])], ["sql", str(own["config"]), "SELECT * FROM rejects"]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert "builds.error" in err and PLANTED not in err and len(err.strip().splitlines()) == 1, err


def test_a_generated_column_added_to_a_catalog_table_is_never_read(own: dict[str, Path],
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The reader's views name schema.sql's columns, so a loader never reads one it does not know;
    `sql`, whose statements can name the file's tables (lake.rejects), refuses the file."""
    plant(own, *with_generated("rejects", "note", FIRES))
    con, _ = open_snapshot(Lake(str(own["lake"])), analyst_views=False)
    try:
        assert [d[0] for d in con.execute("SELECT * FROM rejects").description] == list(schema_columns()["rejects"])
    finally:
        con.close()
    with pytest.raises(CatalogError, match=r"rejects\.note: generated column") as refused:
        open_lake(own["lake"]).sql("SELECT * FROM lake.rejects")
    assert PLANTED not in str(refused.value)
    assert main(["sql", str(own["lake"]), "SELECT count(*) FROM datasets"]) == 2
    assert "rejects.note" in capsys.readouterr().err


def test_reader_views_are_the_schema_columns_by_name(built: Path) -> None:
    con = connect_reader(str(built.parent / "lake" / "catalog.duckdb"))
    try:
        for table, columns in schema_columns().items():
            assert [d[0] for d in con.execute(f"SELECT * FROM {table} LIMIT 0").description] == list(columns), table
    finally:
        con.close()
    schema = duckdb.connect()   # schema.sql's columns as DuckDB creates them, in its order
    schema.execute(sql_file("schema"))
    tables = [row[0] for row in schema.execute("SELECT table_name FROM duckdb_tables() ORDER BY table_name").fetchall()]
    assert sorted(schema_columns()) == tables
    for table, columns in schema_columns().items():
        assert [d[0] for d in schema.execute(f"SELECT * FROM {table} LIMIT 0").description] == list(columns), table
    schema.close()


# Each shows its text only as the message quotes it: what running it would give is not in it.
FORGED = {
    "escapes into the view": "true) UNION ALL BY NAME SELECT 'INJ' || 'ECTED' AS dataset, current_setting('threads') AS source --",
    "runs without end": "(SELECT count(*) FROM range(10000000000000) t(i) WHERE i % 2 = 7) = 0",
    "impure": "error('planted ' || 'SQL ran') IS NULL",
    "random": "random() < 2",
    "names no column of the source": "colour = 'red'",
}


@pytest.mark.parametrize("forged", list(FORGED.values()), ids=list(FORGED))
def test_a_forged_stored_predicate_is_refused(own: dict[str, Path], forged: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    config = limited(own, timeout_s=60)   # were it run, the endless one would end
    lake = open_lake(config)
    genuine = lake.sql("SELECT dataset, count(*) AS n FROM documents GROUP BY dataset ORDER BY dataset")
    english = lake.sql(f"SELECT count(*) AS n FROM documents WHERE dataset = 'web' AND {WHERE}")
    assert genuine.dataset.tolist() == ["web", "web_en"] and genuine.n[1] == english.n[0] > 0
    plant(own, f"UPDATE dataset_plans SET selection = {duckdb_literal(forged)} WHERE name = 'web_en'")
    with pytest.raises(CatalogError) as refused:
        lake.sql("SELECT dataset, source, count(*) FROM documents GROUP BY ALL")
    message = str(refused.value)
    assert "dataset 'web_en'" in message and own["snapshot"].name in message and "is refused" in message, message
    assert "INJECTED" not in message and PLANTED not in message
    assert main(["stats", str(config)]) == 2
    captured = capsys.readouterr()
    assert "dataset 'web_en'" in captured.err and "INJECTED" not in captured.out + captured.err
    assert len(captured.err.strip().splitlines()) == 1


def duckdb_literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


# -- the predicate checker (config and catalog alike) -------------------------------------------------

def test_predicates_call_no_impure_function_and_name_only_columns() -> None:
    columns = {"lang": "string"}
    for where in ("random() < 0.5", "lang = current_setting('threads')", "now() > '2020-01-01'",
                  "sleep_ms(10) IS NULL", f"error('{PLANTED}') IS NULL", "lake.main.planted(lang)"):
        assert "a filter's predicate may call only functions" in where_problem(where, columns), where
    for where in ("current_date > '2020-01-01'", "candidate.lang = 'en'"):
        assert "not found" in where_problem(where, columns), where
    assert where_problem("lang = 'en' AND num_tokens < 10", columns) is None
    assert where_problem("list_contains(['en', 'fr'], lang)", columns) is None


def test_the_checked_predicate_cannot_leave_its_parentheses() -> None:
    columns = metadata_columns({"lang": "string"})
    assert check_predicate("lang = 'en' -- c\n", columns) == "(lang = 'en')"
    assert check_predicate("true) --", columns) == "true"   # the comment ate the wrapper's ")": harmless
    for escaping in ("true) UNION ALL SELECT 1 --", "true) OR (SELECT 1) = 1 OR (true", "lang = 'x' /* "):
        assert where_problem(escaping, {"lang": "string"}) is not None, escaping
    assert "nested too deeply" in where_problem("NOT " * 995 + "true", {"lang": "string"})   # no RecursionError


def test_impure_functions_are_those_duckdb_lists() -> None:
    con = duckdb.connect()
    listed = {row[0] for row in con.execute(
        "SELECT DISTINCT lower(function_name) FROM duckdb_functions() "
        "WHERE stability IN ('VOLATILE', 'CONSISTENT_WITHIN_QUERY')").fetchall()}
    con.close()
    assert listed <= IMPURE_FUNCTIONS, f"DuckDB has impure functions the checker does not know: {listed - IMPURE_FUNCTIONS}"


# -- limits of reader SQL -------------------------------------------------------------------------------

def limited(own: dict[str, Path], **sql: Any) -> Path:
    raw = yaml.safe_load(own["config"].read_text())
    raw["sql"] = sql
    own["config"].write_text(yaml.safe_dump(raw, sort_keys=False))
    return own["config"]


def test_reader_connections_take_the_configured_limits(own: dict[str, Path]) -> None:
    config = limited(own, memory_limit="300MB", threads=1)
    assert load_config(config).sql.memory_limit == 300 * 10**6
    settings = open_lake(config).sql("SELECT current_setting('memory_limit') AS memory, current_setting('threads') AS threads")
    assert settings.memory[0] in ("286.1 MiB", "286.0 MiB") and settings.threads[0] == 1
    defaults = open_lake(own["lake"]).sql("SELECT current_setting('threads') AS threads")
    assert defaults.threads[0] == min(4, os.cpu_count() or 1)


def test_a_query_past_the_timeout_stops_with_the_key_to_raise(own: dict[str, Path],
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    config = limited(own, timeout_s=0.5)
    started = time.monotonic()
    assert main(["sql", str(config), ENDLESS]) == 2
    err = capsys.readouterr().err
    assert time.monotonic() - started < 30
    assert "sql.timeout_s" in err and str(config) in err and len(err.strip().splitlines()) == 1, err
    with pytest.raises(QueryLimitError, match="sql.timeout_s"):
        open_lake(config).sql("SELECT count(*) FROM documents a, documents b, documents c, range(10000000) t(i) "
                              "WHERE hash(a.doc, b.doc, c.doc, i) = 0")


def test_a_query_past_the_memory_limit_stops_with_the_key_to_raise(own: dict[str, Path]) -> None:
    config = limited(own, memory_limit="50MB", threads=1)
    with pytest.raises(QueryLimitError, match=r"sql\.memory_limit \(50,000,000 bytes\)") as stopped:
        open_lake(config).sql("SELECT count(*) FROM (SELECT i, repeat('x', 100) AS s FROM range(3000000) t(i) ORDER BY s, i)")
    assert str(config) in str(stopped.value) and len(str(stopped.value).splitlines()) == 1


def _query_running(pid: int) -> bool:
    """Whether a thread of process ``pid`` other than its main thread runs (its main thread waits
    while another runs the query; during imports and opening, only the main thread works)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            if task.name != str(pid) and (task / "stat").read_text().rsplit(")", 1)[1].split()[0] == "R":
                return True
        except (OSError, IndexError):
            pass
    return False


def test_ctrl_c_while_the_snapshot_opens_is_not_taken_for_a_pruned_snapshot(
        own: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """DuckDB reports a Ctrl-C that comes while it opens the snapshot as an InterruptException, a
    duckdb.Error like those of a snapshot pruned meanwhile: the reader stops at once instead of
    opening it again (which lost the Ctrl-C, and the query then ran on). Timing a real signal into
    the open is left to chance in the test below, so DuckDB's exception is raised here."""
    opened = []

    def interrupted(*args: Any, **kwargs: Any) -> None:
        opened.append(args)
        raise duckdb.InterruptException("INTERRUPT Error: Interrupted!")

    monkeypatch.setattr(snapshot, "connect_pointer", interrupted)
    with pytest.raises(duckdb.InterruptException):
        open_snapshot(Lake(str(own["lake"])))
    assert len(opened) == 1


def test_ctrl_c_stops_a_query_at_once(own: dict[str, Path]) -> None:
    config = limited(own, timeout_s=None)
    # SIGINT as a terminal leaves it, even where this test runs with it ignored (a job started with
    # & by a non-interactive shell: children inherit that, and Python then never raises Ctrl-C).
    # PYTHONFAULTHANDLER: a process still running 20 s after Ctrl-C is stopped by SIGABRT, and its
    # threads' stacks say where it stuck.
    process = subprocess.Popen([sys.executable, "-m", "lakeloader.cli", "sql", str(config), ENDLESS],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONFAULTHANDLER": "1"},
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        busy = 0
        while busy < 3 and time.monotonic() < deadline and process.poll() is None:
            busy = busy + 1 if _query_running(process.pid) else 0
            time.sleep(0.2)
        assert process.poll() is None, process.communicate()
        process.send_signal(signal.SIGINT)
        try:
            out, err = process.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGABRT)
            pytest.fail(f"still running 20 s after Ctrl-C; its threads:\n{process.communicate(timeout=20)[1]}")
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 130, err
    assert err.strip() == "lakeloader sql: interrupted" and out == ""
