"""Faults of the machine, not of the input: each gives one clear error (what failed, where, what to
do) and no traceback, and a failed build leaves its `builds` row and no half-made lake behind.

Full and read-only disks are real: small tmpfs mounts (the tests need root to mount them and are
skipped without). The object store that is down is a loopback port with nothing listening.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from lakeloader.catalog.lake import open_lake
from lakeloader.catalog.snapshot import read_pointer
from lakeloader.config import load_config
from lakeloader.contracts.errors import ConfigError
from lakeloader.ingest.driver import build

from conftest import stdlib_texts, write_config, write_jsonl

CLI = [sys.executable, "-m", "lakeloader.cli"]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300)


def assert_clean_error(result: subprocess.CompletedProcess[str], *expected: str) -> str:
    """Exit status 2, one error message (from `error:` on) naming all of ``expected``, no traceback."""
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stderr.count(": error: ") == 1, result.stderr
    message = result.stderr[result.stderr.index(": error: "):]
    for text in expected:
        assert text in message, (text, message)
    return message


@contextmanager
def tmpfs(folder: Path, size: str) -> Iterator[Path]:
    """A real tmpfs of ``size`` mounted at ``folder`` (unmounted at the end)."""
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


def remount(folder: Path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(folder)], check=True)


def random_words(count: int, words: int, seed: int = 0) -> list[str]:
    """Documents of random words: they do not compress, so their chunks really take space."""
    vocabulary = sorted(set(" ".join(stdlib_texts("json")).split()))
    rng = random.Random(seed)
    return [" ".join(rng.choice(vocabulary) for _ in range(words)) for _ in range(count)]


def builds(config: Path) -> list[dict[str, object]]:
    frame = open_lake(config).sql("SELECT build_id, status, error FROM builds ORDER BY build_id")
    return frame.to_dict(orient="records")


def leftovers(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if ".tmp-" in p.name]


def test_chunk_write_on_a_full_disk_names_the_chunk_and_resumes(tmp_path: Path, dask_scheduler: str) -> None:
    write_jsonl(tmp_path / "data" / "a.jsonl", random_words(12, 1500))
    config = write_config(tmp_path, {"web": {"sources": [str(tmp_path / "data" / "a.jsonl")]}})
    # The catalog has room; the dataset's chunk folder is a tmpfs too small for its chunks.
    with tmpfs(tmp_path / "lake" / "web", "64k") as chunks:
        result = cli("build", str(config), "--scheduler", dask_scheduler, "--no-progress")
        line = assert_clean_error(result, "chunk ", "of dataset 'web'", str(chunks), "No space left on device",
                                  "Free space", "re-run `lakeloader build CONFIG`")
        assert leftovers(tmp_path / "lake") == []
        [row] = builds(config)
        assert row["status"] == "failed" and "No space left on device" in str(row["error"])
        assert line.split(": error: ")[1].strip() in str(row["error"])

        remount(chunks, "size=8m")  # space freed: the same command resumes and completes
        assert build(config, scheduler=dask_scheduler, progress=False).chunks_total > 0
        assert [r["status"] for r in builds(config)] == ["failed", "succeeded"]


def test_disk_full_even_for_the_catalog_gives_one_clean_error(tmp_path: Path, dask_scheduler: str) -> None:
    write_jsonl(tmp_path / "data" / "a.jsonl", stdlib_texts("json"))
    config = write_config(tmp_path, {"code": {"sources": [str(tmp_path / "data" / "a.jsonl")]}})
    with tmpfs(tmp_path / "lake", "1m") as lake:
        result = cli("build", str(config), "--scheduler", dask_scheduler, "--no-progress")
        if result.returncode == 0:
            # The disk filled only after the catalog was saved and the final snapshot published:
            # the build stands, its last records kept by the write-ahead log.
            assert "build 1 succeeded and is published, but its last catalog records stay" in result.stderr
        else:
            assert_clean_error(result, str(lake), "No space left on device", "Free space", "lakeloader build CONFIG")
        assert "Failed to create checkpoint" not in result.stderr
        assert leftovers(lake) == []
        remount(lake, "size=64m")
        [row] = builds(config)  # read from the catalog file: it kept what happened, as the exit says
        if result.returncode == 0:
            assert row["status"] == "succeeded" and row["error"] is None
        else:   # the disk filled at a write that names the error, or at the final save of the catalog
            assert row["status"] == "failed", row
            assert ("No space left on device" in str(row["error"])
                    or f"the build ended before its catalog {lake / 'catalog.duckdb'} was saved" in str(row["error"])), row
        build(config, scheduler=dask_scheduler, progress=False)
        assert [r["status"] for r in builds(config)] == [row["status"], "succeeded"]


def test_build_on_a_read_only_lake_leaves_nothing(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "data" / "a.jsonl", stdlib_texts("json", limit=2))
    config = write_config(tmp_path, {"code": {"sources": [str(tmp_path / "data" / "a.jsonl")]}})
    with tmpfs(tmp_path / "lake", "4m") as lake:
        remount(lake, "ro")
        result = cli("build", str(config), "--no-progress")
        assert_clean_error(result, str(lake / "catalog.duckdb"), "read-only", "remount it read-write")
        assert list(lake.iterdir()) == []


@pytest.mark.parametrize("where", ["proc", "deep_under_a_file"])
def test_lake_folder_that_cannot_be_created(tmp_path: Path, where: str) -> None:
    (tmp_path / "plain").write_text("not a folder")
    lake = {"proc": "/proc/lake", "deep_under_a_file": str(tmp_path / "plain" / "a" / "lake")}[where]
    write_jsonl(tmp_path / "data" / "a.jsonl", stdlib_texts("json", limit=2))
    config = write_config(tmp_path, {"code": {"sources": [str(tmp_path / "data" / "a.jsonl")]}}, lake=lake)
    result = cli("build", str(config), "--no-progress")
    line = assert_clean_error(result, "lake folder (config key `lake`)", lake, "point `lake:` at")
    if where != "proc":
        assert f"{tmp_path / 'plain'} is a file, not a folder" in line
    assert not os.path.exists("/proc/lake") and (tmp_path / "plain").is_file()
    assert {p.name for p in tmp_path.iterdir()} <= {"cache", "config.yaml", "data", "plain"}


def test_a_lake_folder_made_by_a_build_that_cannot_start_is_removed(tmp_path: Path) -> None:
    # The folders can be made, but the disk has no room for the catalog: they go again.
    write_jsonl(tmp_path / "data" / "a.jsonl", stdlib_texts("json", limit=2))
    with tmpfs(tmp_path / "tiny", "16k") as tiny:
        lake = tiny / "new" / "lake"
        config = write_config(tmp_path, {"code": {"sources": [str(tmp_path / "data" / "a.jsonl")]}}, lake=str(lake))
        assert_clean_error(cli("build", str(config), "--no-progress"), str(lake / "catalog.duckdb"),
                           "No space left on device", "Free space")
        assert list(tiny.iterdir()) == []


def test_dataset_named_like_the_catalog_is_a_config_error(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "data" / "a.jsonl", stdlib_texts("json", limit=2))
    config = write_config(tmp_path, {"catalog.duckdb": {"sources": [str(tmp_path / "data" / "a.jsonl")]}})
    assert_clean_error(cli("build", str(config), "--no-progress"), str(config), "line ", "datasets",
                       "'catalog.duckdb' collides with the lake's catalog file", "rename the dataset")
    assert not (tmp_path / "lake").exists()
    for name in ("Catalog.duckdb.wal", "_catalog", "_tokenizer", "../up", "..", "a/b"):
        config = write_config(tmp_path, {name: {"sources": [str(tmp_path / "data" / "a.jsonl")]}})
        with pytest.raises(ConfigError, match=re.escape(repr(name))):
            load_config(config)


def corrupt(path: Path, offset: int = 20_000) -> None:
    """Overwrite bytes of a catalog block (the first data block starts at 12288)."""
    with open(path, "r+b") as handle:
        handle.seek(offset)
        handle.write(b"\xde\xad\xbe\xef" * 1024)


def test_unwritable_output_file_and_corrupt_catalog(tmp_path: Path, dask_scheduler: str) -> None:
    write_jsonl(tmp_path / "data" / "a.jsonl", stdlib_texts("json"))
    config = write_config(tmp_path, {"code": {"sources": [str(tmp_path / "data" / "a.jsonl")]}},
                          loader={"seq_len": 32, "batch_size": 4})
    build(config, scheduler=dask_scheduler, progress=False)
    with tmpfs(tmp_path / "ro", "1m") as ro:  # an output file the command cannot write
        remount(ro, "ro")
        out = ro / "batches.npz"
        assert_clean_error(cli("batches", str(config), "--steps", "0:1", "--out", str(out)),
                           f"cannot write {out}", "Read-only file system", "writable location")
    catalog = tmp_path / "lake" / "catalog.duckdb"
    corrupt(catalog)
    for args in (("status", str(config)), ("sql", str(config), "SELECT count(*) FROM chunks"),
                 ("build", str(config), "--scheduler", dask_scheduler, "--no-progress")):
        assert_clean_error(cli(*args), f"catalog {catalog} is corrupt",
                           "recover it from the lake's newest published snapshot with `lakeloader build CONFIG --recover-catalog`")
    assert leftovers(tmp_path / "lake") == []


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("command", ["build", "sql"])
def test_object_store_down_at_start(tmp_path: Path, command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    write_jsonl(tmp_path / "data" / "a.jsonl", stdlib_texts("json", limit=2))
    options = {"endpoint_url": endpoint, "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1}}
    config = write_config(tmp_path, {"code": {"sources": [str(tmp_path / "data" / "a.jsonl")]}},
                          lake="s3://bucket/lake", storage_options=options, io_retry_deadline=2)
    started = time.monotonic()
    args = ("build", str(config), "--no-progress") if command == "build" else ("sql", str(config), "SELECT 1")
    result = cli(*args)
    elapsed = time.monotonic() - started
    assert_clean_error(result, "s3://bucket/lake", f"endpoint {endpoint}", "_catalog/CURRENT",
                       "storage unreachable for", "Check the endpoint", "io_retry_deadline")  # retried until the deadline
    assert elapsed < 60
    assert not any(Path(os.environ["LAKELOADER_CACHE"]).rglob("catalog.duckdb"))


@pytest.mark.parametrize("after_publishes", [1, 3])
def test_ctrl_c_during_a_build_is_one_line_an_interrupted_run_and_a_resumable_lake(
        tmp_path: Path, dask_scheduler: str, after_publishes: int) -> None:
    """SIGINT to the whole process group of `lakeloader build` (a terminal's Ctrl-C reaches its Dask
    workers too) while it commits: exit 130, one line saying what was kept, the run recorded
    interrupted, the published snapshot whole; a re-run resumes and completes (issue 48 item 5)."""
    texts = stdlib_texts("email") + stdlib_texts("json") + stdlib_texts("asyncio")
    for index in range(4):
        write_jsonl(tmp_path / "data" / f"p{index}.jsonl", texts)
    config = write_config(tmp_path, {"d": {"sources": [str(tmp_path / "data" / "*.jsonl")]}},
                          build={"split_size": "32KB", "workers": 2, "publish_interval": 0.2})
    command = [sys.executable, "-m", "lakeloader.cli", "build", str(config), "--no-progress"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    pointer = tmp_path / "lake" / "_catalog" / "CURRENT"
    deadline = time.monotonic() + 120
    while not pointer.exists() or json.loads(pointer.read_bytes())["version"] < after_publishes:
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.02)
    os.killpg(process.pid, signal.SIGINT)
    out, err = process.communicate(timeout=120)
    lines = [line for line in err.splitlines() if " INFO " not in line]
    if process.returncode == 0:   # the build finished first: nothing to check on this machine
        pytest.skip("the build ended before the interrupt reached it")
    assert process.returncode == 130, err
    assert len(lines) == 1 and "Traceback" not in err, err
    assert re.fullmatch(r"lakeloader build: interrupted: build 1 committed \d+ chunks before it stopped; "
                        rf"re-run `lakeloader build {re.escape(str(config))}` to resume \(committed chunks are kept\)",
                        lines[0]), lines
    lake = open_lake(config)
    assert lake.sql("SELECT status FROM builds").status.tolist() == ["interrupted"]
    read_pointer(lake)   # whole, and its snapshot reads
    assert build(config, scheduler=dask_scheduler, progress=False).chunks_total > 0
    statuses = lake.sql("SELECT status FROM builds ORDER BY build_id").status.tolist()
    assert statuses == ["interrupted", "succeeded"]
    assert lake.sql("SELECT status FROM datasets").status.tolist() == ["complete"]


def test_unreachable_scheduler_is_one_line_and_a_failed_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`build --scheduler` with nothing listening there: one line naming the address and what to do."""
    monkeypatch.setenv("DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT", "2s")
    write_jsonl(tmp_path / "data" / "a.jsonl", stdlib_texts("json", limit=2))
    config = write_config(tmp_path, {"code": {"sources": [str(tmp_path / "data" / "a.jsonl")]}})
    address = f"tcp://127.0.0.1:{free_port()}"
    assert_clean_error(cli("build", str(config), "--scheduler", address, "--no-progress"),
                       f"cannot reach the Dask scheduler {address}", "start it and its workers")
    [run] = builds(config)
    assert run["status"] == "failed" and str(run["error"]).startswith("SchedulerError: cannot reach"), run


def test_a_local_clusters_workers_keep_quiet_when_their_scheduler_closes() -> None:
    """A build's own LocalCluster closes its scheduler while workers may still beat: their
    heartbeat error would print a traceback after the build's one line (seen under load in the
    Ctrl-C test above); a cluster of the user's keeps its workers' logs."""
    import logging

    from lakeloader.ingest.cluster import _hide_lost_heartbeats, dask_client

    lost = logging.LogRecord("distributed.worker", logging.ERROR, __file__, 1,
                             "Failed to communicate with scheduler during heartbeat.", (), None)
    other = logging.LogRecord("distributed.worker", logging.ERROR, __file__, 1, "Compute Failed", (), None)
    assert not _hide_lost_heartbeats(lost) and _hide_lost_heartbeats(other)

    def installed() -> bool:
        return _hide_lost_heartbeats in logging.getLogger("distributed.worker").filters

    with dask_client(workers=1, dashboard=None) as client:
        assert list(client.run(installed).values()) == [True]


def test_a_local_clusters_scheduler_keeps_quiet_about_gathers_the_build_cancelled() -> None:
    """Ctrl-C while the driver gathers results: the build cancels those tasks, and the scheduler
    (in the build's process) logged an error for the gather of their forgotten keys after the
    build's one line (seen under load in the Ctrl-C test above). Other gather errors still show,
    and the filter lives only as long as the build's own cluster."""
    import logging

    from lakeloader.ingest.cluster import _hide_forgotten_gathers, dask_client

    def record(states: dict[str, str]) -> logging.LogRecord:
        return logging.LogRecord("distributed.scheduler", logging.ERROR, __file__, 1,
                                 "Couldn't gather keys: %s", (states,), None)

    assert not _hide_forgotten_gathers(record({"chunk-d-6": "forgotten", "chunk-d-4": "forgotten"}))
    assert _hide_forgotten_gathers(record({"chunk-d-6": "forgotten", "chunk-d-4": "memory"}))
    assert _hide_forgotten_gathers(logging.LogRecord("distributed.scheduler", logging.ERROR, __file__, 1,
                                                     "Unexpected worker completed task", (), None))
    scheduler_log = logging.getLogger("distributed.scheduler")
    with dask_client(workers=1, dashboard=None):
        assert _hide_forgotten_gathers in scheduler_log.filters
    assert _hide_forgotten_gathers not in scheduler_log.filters
