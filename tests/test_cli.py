"""The command line: help, build, status and sql output formats, errors with exit status 2."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import stdlib_texts, write_config, write_jsonl

from lakeloader.cli import main


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lakeloader.cli", *args], capture_output=True, text=True,
                          timeout=300)


def test_help_explains_every_command() -> None:
    result = run("--help")
    assert result.returncode == 0
    for command in ("build", "status", "sql", "batches", "explain"):
        assert command in result.stdout
    build_help = run("build", "--help").stdout
    assert "--workers" in build_help and "--scheduler" in build_help and "resume" in build_help.lower()


def test_build_status_sql(tmp_path: Path, dask_scheduler: str, capsys: pytest.CaptureFixture[str]) -> None:
    write_jsonl(tmp_path / "data" / "a.jsonl", stdlib_texts("json"))
    config = write_config(tmp_path, {"code": {"sources": [str(tmp_path / "data" / "*.jsonl")]}})
    assert main(["build", str(config), "--scheduler", dask_scheduler, "--no-progress"]) == 0
    assert "tokens" in capsys.readouterr().out

    assert main(["status", str(config)]) == 0
    out = capsys.readouterr().out
    assert "== Datasets ==" in out and "complete" in out and "a.jsonl" in out
    # Machine-readable status: one JSON document of every table, one CSV table at a time; NULL
    # as null, empty and NULL (the first build's finished_at is set, its error is NULL).
    assert main(["status", str(config), "--format", "json"]) == 0
    tables = json.loads(capsys.readouterr().out)
    assert list(tables) == ["datasets", "shards", "builds", "stale_folders"]
    assert tables["datasets"][0]["name"] == "code" and tables["builds"][0]["error"] is None
    assert main(["status", str(config), "--format", "csv"]) == 2
    assert "--table" in capsys.readouterr().err
    assert main(["status", str(config), "--format", "csv", "--table", "builds"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert len(rows) == 1 and rows[0]["status"] == "succeeded" and rows[0]["error"] == ""
    assert main(["status", str(config), "--table", "builds"]) == 0
    out = capsys.readouterr().out
    assert "NULL" in out and "NaN" not in out and "None" not in out
    assert main(["sql", str(config), "SELECT NULL::VARCHAR AS a, NULL::DOUBLE AS b, 1 AS c"]) == 0
    assert capsys.readouterr().out.split() == ["a", "b", "c", "NULL", "NULL", "1"]

    query = "SELECT name, num_docs FROM datasets"
    assert main(["sql", str(tmp_path / "lake"), query, "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == [{"name": "code", "num_docs": len(stdlib_texts("json"))}]
    assert main(["sql", str(config), query, "--format", "csv"]) == 0
    assert capsys.readouterr().out.splitlines() == ["name,num_docs", f"code,{len(stdlib_texts('json'))}"]
    assert main(["sql", str(config), query]) == 0
    assert "code" in capsys.readouterr().out
    assert main(["sql", str(config), "SELECT * FROM no_such_table"]) == 2
    assert "no_such_table" in capsys.readouterr().err


def test_user_errors_exit_2_with_message(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("lake: x\ntokenizer: t.json\ndatasets: {}\n")
    result = run("build", str(bad))
    assert result.returncode == 2
    assert "error" in result.stderr and "datasets" in result.stderr and "Traceback" not in result.stderr
    result = run("sql", str(tmp_path / "nolake"), "SELECT 1")
    assert result.returncode == 2 and "no lake" in result.stderr
    config = write_config(tmp_path, {"d": {"sources": [str(tmp_path / "x.jsonl")]}})
    (tmp_path / "lake").mkdir()
    result = run("sql", str(config), "SELECT 1")
    assert result.returncode == 2 and "no published catalog" in result.stderr and "lakeloader build" in result.stderr


def test_status_and_stats_answer_for_the_config_given(tmp_path: Path, dask_scheduler: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Two configs sharing one lake, each with a dataset of its own: status and stats of a config
    show its datasets; --whole-lake (or the lake's path) shows every one (issue 48, item 3)."""
    write_jsonl(tmp_path / "data" / "a.jsonl", stdlib_texts("json"))
    write_jsonl(tmp_path / "data" / "b.jsonl", stdlib_texts("email", limit=5))
    second = write_config(tmp_path, {"mail": {"sources": [str(tmp_path / "data" / "b.jsonl")]}}).rename(
        tmp_path / "second.yaml")
    first = write_config(tmp_path, {"code": {"sources": [str(tmp_path / "data" / "a.jsonl")]}})
    for config in (first, second):
        assert main(["build", str(config), "--scheduler", dask_scheduler, "--no-progress"]) == 0
    capsys.readouterr()

    def shown(*args: str) -> dict[str, list[str]]:
        assert main([*args, "--format", "json"]) == 0
        document = json.loads(capsys.readouterr().out)
        if args[0] == "stats":
            return {"datasets": [row["dataset"] for row in document]}
        return {"datasets": [row["name"] for row in document["datasets"]],
                "shards": sorted({row["dataset"] for row in document["shards"]})}

    assert shown("status", str(first)) == {"datasets": ["code"], "shards": ["code"]}
    assert shown("status", str(second)) == {"datasets": ["mail"], "shards": ["mail"]}
    assert shown("status", str(first), "--whole-lake") == shown("status", str(tmp_path / "lake")) == \
        {"datasets": ["code", "mail"], "shards": ["code", "mail"]}
    assert shown("stats", str(second)) == {"datasets": ["mail"]}
    assert shown("stats", str(second), "--whole-lake") == {"datasets": ["code", "mail"]}
