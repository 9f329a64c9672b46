"""Object-store faults: the S3 endpoint stops during a build and during reading. Transient
failures are retried with backoff; the build then completes with the same lake, or fails with a
clear error after ``io_retry_deadline``; a partial chunk is never registered."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
import types
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import boto3
import botocore.exceptions
import numpy as np
import pyarrow as pa
import pytest
import yaml
from moto.server import ThreadedMotoServer

from lakeloader.catalog.changes import ChangeLog
from lakeloader.catalog.lake import open_lake
from lakeloader.contracts.errors import StorageUnavailableError
from lakeloader.feed.loader import Loader
from lakeloader.ingest.document_index import DocumentIndexWriter
from lakeloader.ingest.driver import build
from lakeloader.storage import is_transient

from conftest import stdlib_texts, write_jsonl
from test_s3 import CREDENTIALS, config_dict, write_yaml
BUCKET = "lakeloader-faults"


class Endpoint:
    """A moto S3 server on a fixed loopback port that can be stopped and started again (moto
    keeps its buckets per process, so they survive a restart)."""

    def __init__(self) -> None:
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        self.host, self.port = self.server.get_host_and_port()
        self.url = f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self.server.stop()

    def start(self) -> None:
        self.server = ThreadedMotoServer(ip_address=self.host, port=self.port, verbose=False)
        self.server.start()


@pytest.fixture
def endpoint(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Endpoint]:
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    server = Endpoint()
    urllib.request.urlopen(urllib.request.Request(f"{server.url}/moto-api/reset", method="POST"), timeout=10)
    boto3.client("s3", endpoint_url=server.url).create_bucket(Bucket=BUCKET)
    yield server
    server.stop()


def options(url: str) -> dict[str, Any]:
    # One botocore attempt per call and short timeouts: lakeloader's own retries are under test.
    return {"endpoint_url": url, "key": CREDENTIALS["AWS_ACCESS_KEY_ID"],
            "secret": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1, "read_timeout": 5}}


def s3_config(tmp: Path, endpoint: Endpoint, name: str, deadline: float) -> Path:
    data = tmp / "data"
    write_jsonl(data / "a.jsonl", stdlib_texts("json") + stdlib_texts("email", limit=20))
    client = boto3.client("s3", endpoint_url=endpoint.url)
    client.upload_file(str(data / "a.jsonl"), BUCKET, "src/a.jsonl")
    raw = config_dict(f"s3://{BUCKET}/{name}", [f"s3://{BUCKET}/src/a.jsonl"], options(endpoint.url))
    raw["build"]["split_size"] = "8KB"
    raw["io_retry_deadline"] = deadline
    return write_yaml(tmp / f"{name}.yaml", raw)


def committed(config: Path) -> int:
    try:
        return int(open_lake(config).sql("SELECT count(*) AS n FROM chunks WHERE status = 'committed'").n[0])
    except Exception:  # no snapshot yet, or the endpoint is down
        return 0


def test_build_survives_an_outage_and_equals_a_clean_build(tmp_path: Path, endpoint: Endpoint, dask_scheduler: str,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="lakeloader.storage")
    config = s3_config(tmp_path, endpoint, "outage", deadline=60)
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(report=build(config, scheduler=dask_scheduler,
                                                                        progress=False)))
    thread.start()
    deadline = time.monotonic() + 60
    while committed(config) < 3:
        assert thread.is_alive() and time.monotonic() < deadline, "build ended before the outage"
        time.sleep(0.05)
    endpoint.stop()
    time.sleep(4)
    endpoint.start()
    thread.join(timeout=120)
    report = result["report"]
    assert report.chunks_built == report.chunks_total
    lake = open_lake(config)
    builds = lake.sql("SELECT status, retries FROM builds")
    assert builds.status.tolist() == ["succeeded"]
    # The build met the outage: in its chunk tasks, or (on a loaded machine the snapshot showing 3
    # chunks may be the build's last) in the driver's publishing of the snapshot.
    driver_retries = [r for r in caplog.records if r.name == "lakeloader.storage" and "retrying" in r.getMessage()]
    assert builds.retries[0] > 0 or driver_retries
    clean = s3_config(tmp_path / "clean", endpoint, "clean", deadline=60)
    build(clean, scheduler=dask_scheduler, progress=False)
    query = "SELECT global_index, num_docs, num_tokens, checksum FROM chunks ORDER BY global_index"
    assert lake.sql(query).equals(open_lake(clean).sql(query))
    for step in range(4):
        a, b = Loader(config).batch(step), Loader(clean).batch(step)
        assert all(np.array_equal(a[k], b[k]) for k in a)


def test_build_fails_clearly_after_the_deadline_and_resumes(tmp_path: Path, endpoint: Endpoint,
                                                           dask_scheduler: str) -> None:
    config = s3_config(tmp_path, endpoint, "down", deadline=2)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            build(config, scheduler=dask_scheduler, progress=False)
        except BaseException as exc:  # inspected below
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    while committed(config) < 2 and thread.is_alive():
        time.sleep(0.05)
    endpoint.stop()
    thread.join(timeout=120)
    assert errors and isinstance(errors[0], StorageUnavailableError), errors
    assert "unreachable" in str(errors[0]) and "io_retry_deadline" in str(errors[0])
    endpoint.start()
    report = build(config, scheduler=dask_scheduler, progress=False)
    assert 0 < report.chunks_built < report.chunks_total  # resumed, committed chunks kept
    assert open_lake(config).sql("SELECT count(*) AS n FROM chunks WHERE status <> 'committed'").n[0] == 0


def test_the_drivers_documents_index_files_survive_an_outage(tmp_path: Path, endpoint: Endpoint,
                                                            dask_scheduler: str) -> None:
    """The driver writes, lists and (to merge them) reads documents index files itself, beside its
    chunk tasks: an outage then is retried like a chunk's, not raised into the build."""
    config = s3_config(tmp_path, endpoint, "index", deadline=30)
    build(config, scheduler=dask_scheduler, progress=False)
    lake = open_lake(config)
    rows = lake.sql("SELECT chunk, doc, num_tokens FROM documents ORDER BY chunk, doc LIMIT 50")
    dataset = lake.sql("SELECT name FROM datasets").name[0]
    # The catalog is not touched here: a writer stand-in with nothing published.
    index = DocumentIndexWriter(lake, writer=types.SimpleNamespace(changes=ChangeLog()))  # type: ignore[arg-type]
    table = pa.Table.from_pandas(rows, preserve_index=False)
    endpoint.stop()
    threading.Timer(2.0, endpoint.start).start()
    written = index._write(dataset, [table], sorted(set(rows.chunk.tolist())), ordered=True)
    endpoint.stop()
    threading.Timer(2.0, endpoint.start).start()
    assert index._read(dataset, written.path, written.checksum).equals(table)
    assert written.path in lake.file_sizes(written.path.rsplit("/", 1)[0], "the documents index folder")


def test_reader_retries_then_fails_clearly(tmp_path: Path, endpoint: Endpoint, dask_scheduler: str) -> None:
    config = s3_config(tmp_path, endpoint, "read", deadline=20)
    build(config, scheduler=dask_scheduler, progress=False)
    expected = Loader(config).batch(0)
    endpoint.stop()
    threading.Timer(2.0, endpoint.start).start()
    fresh = Loader(config)  # opens the snapshot while the endpoint is still down: retried
    assert all(np.array_equal(fresh.batch(0)[k], expected[k]) for k in expected)

    short = write_yaml(tmp_path / "short.yaml", {**yaml.safe_load(config.read_text()),
                                                 "io_retry_deadline": 1})
    endpoint.stop()
    started = time.monotonic()
    with pytest.raises(StorageUnavailableError, match="reading the published catalog"):
        Loader(short)
    assert time.monotonic() - started < 30
    endpoint.start()


def test_connection_errors_of_the_object_store_clients_are_transient() -> None:
    """aiohttp's and botocore's connection errors are retried, raised alone or under another
    error; a missing file never is, whatever it was raised from. Importing lakeloader imports
    neither client (aiohttp's import alone costs every process's start ~130 ms): their errors are
    known once a client is imported, which raising them needs."""
    for error in (aiohttp.ClientConnectionError("refused"), botocore.exceptions.EndpointConnectionError(
            endpoint_url="http://127.0.0.1:1"), TimeoutError()):
        assert is_transient(error)
        wrapped = OSError("read failed")
        wrapped.__cause__ = error
        assert is_transient(wrapped)
        missing = FileNotFoundError("gone")
        missing.__cause__ = error
        assert not is_transient(missing)
    assert not is_transient(ValueError("bad data"))
    imported = subprocess.run([sys.executable, "-c", "import sys, lakeloader.feed.loader, lakeloader.cli; "
                               "print(sorted({'aiohttp', 'botocore'} & set(sys.modules)))"],
                              capture_output=True, text=True, timeout=120)
    assert imported.returncode == 0 and imported.stdout.strip() == "[]", imported.stderr[-2000:]
