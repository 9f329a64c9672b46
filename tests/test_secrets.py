"""No credential leaves the config: a secret planted in ``storage_options`` appears in no output,
log line, error message, catalog table, snapshot, chunk or cache file.

Two lakes: one in S3 (moto's server on loopback) whose access key and secret are the planted
strings, and one local lake whose ``storage_options`` carry a planted token (fsspec's local
filesystem accepts and ignores it). Every command of the CLI runs on them, successful and
failing ones (model-level and field-level config errors, a YAML syntax error on the secret's
line, a build that fails on bad input); then every output and every file under the lakes and
the local cache (DuckDB catalogs and Parquet chunks decoded too, as they compress strings) is
searched for the secrets.
"""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import boto3
import duckdb
import pyarrow.parquet as pq
import pytest
import yaml
from conftest import DEMO_TOKENIZER, stdlib_texts, write_jsonl
from test_s3 import BUCKET, s3_endpoint, upload  # noqa: F401  (s3_endpoint: the moto fixture)

from lakeloader.cli import main

SECRET = f"planted-secret-{uuid.uuid4().hex}"
KEY_ID = f"AKIAPLANTED{uuid.uuid4().hex[:12].upper()}"
PLANTED = (SECRET, KEY_ID)


def leaks(text: str | bytes) -> list[str]:
    """The planted strings found in ``text``."""
    data = text.encode() if isinstance(text, str) else text
    return [p for p in PLANTED if p.encode() in data]


def decoded(name: str, data: bytes) -> str:
    """Text of a DuckDB or Parquet file's every value (their string columns are compressed)."""
    if data[8:12] == b"DUCK":
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "probe.duckdb"
            path.write_bytes(data)
            with duckdb.connect(str(path), read_only=True) as con:
                tables = [row[0] for row in con.execute("SELECT table_name FROM information_schema.tables").fetchall()]
                return "\n".join(str(con.execute(f'SELECT * FROM "{t}"').fetchall()) for t in tables)
    if data[:4] == b"PAR1":
        table = pq.read_table(io.BytesIO(data))
        return f"{table.schema.metadata}\n{table.to_pylist()}"
    return ""


def assert_no_secret_in_files(files: dict[str, bytes]) -> None:
    assert files, "nothing to search"
    for name, data in files.items():
        assert not leaks(data), f"secret in {name}"
        assert not leaks(decoded(name, data)), f"secret in the values of {name}"


def local_files(*roots: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for root in roots for p in sorted(root.rglob("*")) if p.is_file()}


def s3_files(endpoint: str, prefix: str) -> dict[str, bytes]:
    client = boto3.client("s3", endpoint_url=endpoint)
    keys = [item["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
            for item in page.get("Contents", [])]
    return {f"s3://{BUCKET}/{k}": client.get_object(Bucket=BUCKET, Key=k)["Body"].read() for k in keys}


def config_dict(lake: str, sources: list[str], options: dict[str, Any]) -> dict[str, Any]:
    return {
        "lake": lake, "tokenizer": str(DEMO_TOKENIZER),
        "storage_options": options,
        "datasets": {"code": {"sources": sources}},
        "build": {"split_size": "16KB", "publish_interval": 0.2},
        "loader": {"seq_len": 64, "batch_size": 4},
    }


def write_yaml(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


class Outputs:
    """Runs CLI commands in this process; their stdout, stderr and log records must not show a
    planted string."""

    def __init__(self, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
        self.capsys, self.caplog = capsys, caplog

    def cli(self, *args: str, status: int = 0) -> str:
        self.caplog.clear()
        code = main(list(args))
        out, err = self.capsys.readouterr()
        text = f"$ lakeloader {' '.join(args)}\n{out}\n{err}\n{self.caplog.text}"
        assert not leaks(text), text
        assert code == status, text
        return text

    def add(self, result: subprocess.CompletedProcess[str]) -> None:
        text = f"{result.args}\n{result.stdout}\n{result.stderr}"
        assert not leaks(text), text


def run_every_command(config: Path, out: Outputs, tmp: Path) -> None:
    """The reading commands of the CLI on a built lake."""
    out.cli("status", str(config))
    out.cli("status", str(config), "--format", "json")
    out.cli("sql", str(config), "SELECT * FROM builds", "--format", "csv")
    out.cli("sql", str(config), "SELECT * FROM shards")
    out.cli("batches", str(config), "--steps", "0:2", "--out", str(tmp / "b.npz"))
    out.cli("explain", str(config), "--step", "1")
    out.cli("audit", str(config), "--steps", "0:3")
    out.cli("verify", str(config), "--no-progress")


def run_config_errors(raw: dict[str, Any], tmp: Path, out: Outputs) -> None:
    """Model-level and field-level config errors, and a YAML syntax error, on a config holding
    the planted secrets: each names its key (and line), none shows a secret (every command
    loads its config the same way)."""
    cases = {
        "unknown-dataset": ({**raw, "mixture": {"weights": {"code": 1.0, "nope": 1.0}}},
                            ["mixture.weights.nope", "line ", "unknown dataset"]),
        "negative-weight": ({**raw, "mixture": {"weights": {"code": -1.0}}},
                            ["mixture.weights.code", "line ", ">= 0"]),
        "staged-weight": ({**raw, "mixture": {"stages": [{"start_step": 0, "weights": {"code": 1}},
                                                         {"start_step": 3, "weights": {"code": -2}}]}},
                          ["mixture.stages.1.weights.code", "line "]),
        "field-level": ({**raw, "loader": {"packing": "zip"}}, ["loader.packing", "'zip'"]),
        "options-not-a-mapping": ({**raw, "storage_options": SECRET}, ["storage_options", "line "]),
        "bad-dataset-name": ({**raw, "datasets": {"co de": raw["datasets"]["code"]}}, ["datasets.co de", "line "]),
    }
    for name, (config, expected) in cases.items():
        path = write_yaml(tmp / f"{name}.yaml", config)
        err = out.cli("build", str(path), "--no-progress", status=2)
        assert str(path) in err and all(word in err for word in expected), (name, err)
    broken = write_yaml(tmp / "broken.yaml", raw).read_text().replace(f"secret: {SECRET}", f'secret: "{SECRET}')
    (tmp / "broken.yaml").write_text(broken)
    err = out.cli("status", str(tmp / "broken.yaml"), status=2)
    assert f"{tmp / 'broken.yaml'}: not valid YAML: line " in err and "<unicode string>" not in err, err


def test_no_secret_anywhere_s3_lake(s3_endpoint: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],  # noqa: F811
                                    caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    data = tmp_path / "data"
    write_jsonl(data / "a.jsonl", stdlib_texts("json"))
    upload(s3_endpoint, data, "secret-src")
    options = {"endpoint_url": s3_endpoint, "key": KEY_ID, "secret": SECRET}
    raw = config_dict(f"s3://{BUCKET}/secret-lake", [f"s3://{BUCKET}/secret-src/*"], options)
    config = write_yaml(tmp_path / "s3.yaml", raw)
    out = Outputs(capsys, caplog)

    # The build in a subprocess with its own local cluster: the workers' logs are captured too.
    result = subprocess.run([sys.executable, "-m", "lakeloader.cli", "build", str(config), "--workers", "1"],
                            capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert result.returncode == 0, result.stderr
    out.add(result)
    run_every_command(config, out, tmp_path)
    verbose = subprocess.run([sys.executable, "-m", "lakeloader.cli", "-v", "batches", str(config), "--steps", "0:1",
                              "--out", str(tmp_path / "v.npz")], capture_output=True, text=True, timeout=300)
    assert verbose.returncode == 0 and "DEBUG" in verbose.stderr, verbose.stderr
    out.add(verbose)
    assert_no_secret_in_files({**s3_files(s3_endpoint, "secret-lake/"),
                               **local_files(Path(os.environ["LAKELOADER_CACHE"]))})


def test_no_secret_anywhere_local_lake(tmp_path: Path, dask_scheduler: str, capsys: pytest.CaptureFixture[str],
                                       caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    write_jsonl(tmp_path / "data" / "a.jsonl", stdlib_texts("json"))
    raw = config_dict(str(tmp_path / "lake"), [str(tmp_path / "data" / "*.jsonl")], {"secret": SECRET, "key": KEY_ID})
    config = write_yaml(tmp_path / "local.yaml", raw)
    out = Outputs(capsys, caplog)
    out.cli("build", str(config), "--scheduler", dask_scheduler, "--no-progress")
    out.cli("status", str(config))
    out.cli("batches", str(config), "--steps", "0:2", "--out", str(tmp_path / "b.npz"))

    # A failing build of the same lake: its error is kept in the builds table.
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "b.jsonl").write_text('{"text": "fine"}\n{"text": "broken\n')
    failing = {**raw, "datasets": {**raw["datasets"], "bad": {"sources": [str(tmp_path / "bad" / "b.jsonl")]}}}
    err = out.cli("build", str(write_yaml(tmp_path / "failing.yaml", failing)), "--scheduler", dask_scheduler,
                  "--no-progress", status=2)
    assert "b.jsonl: line 2" in err
    assert "failed" in out.cli("sql", str(config), "SELECT status, error FROM builds")
    run_config_errors(raw, tmp_path, out)
    assert_no_secret_in_files(local_files(tmp_path / "lake", Path(os.environ["LAKELOADER_CACHE"])))


def test_the_file_search_sees_through_duckdb_and_parquet_compression(tmp_path: Path) -> None:
    """The search would catch a secret stored in a catalog table or a chunk column."""
    import pyarrow as pa

    catalog = tmp_path / "c.duckdb"
    with duckdb.connect(str(catalog)) as con:
        con.execute("CREATE TABLE builds (error VARCHAR)")
        con.execute("INSERT INTO builds SELECT ? || i::VARCHAR FROM range(5000) t(i)", [SECRET])
    pq.write_table(pa.table({"s": [f"{SECRET}{i}" for i in range(5000)]}), tmp_path / "c.parquet",
                   compression="zstd")
    for path in (catalog, tmp_path / "c.parquet"):
        with pytest.raises(AssertionError, match="secret in"):
            assert_no_secret_in_files({str(path): path.read_bytes()})
