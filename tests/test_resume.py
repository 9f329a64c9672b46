"""Promise 4: a build killed at any moment (driver or worker) resumes to the lake a clean build gives.

Real faults on real parts: the `lakeloader build` command runs as a subprocess with a LocalCluster of
2 worker processes, and the test SIGKILLs either the driver (the process holding the catalog) or one
Dask worker mid-build. The lake that results is compared with a clean reference build: same catalog
rows, same chunk file bytes. The helpers here are shared with test_catalog_concurrency.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import duckdb
import pandas as pd
import psutil
import pytest

from lakeloader.catalog.lake import open_lake
from lakeloader.ingest.driver import build

from conftest import assert_progress_counted, stdlib_texts, write_config, write_jsonl

# Standard-library packages as shards of very unequal size (about 1.4 MB down to 50 KB of text).
CORPUS_PACKAGES = ("encodings", "idlelib", "unittest", "distutils", "lib2to3", "asyncio", "email", "json")
DOC_CHARS = 2000        # documents are runs of blank-line separated blocks of about this size
SPLIT_SIZE = "20KB"     # about 6 MB of JSONL in 20 KB splits: ~300 chunks, a 2-worker build of seconds
PUBLISH_INTERVAL = 0.25
BUILD_TIMEOUT = 240

# Catalog columns that must not depend on how the build ran (worker, timing and build ids may).
CHUNK_COLUMNS = ("dataset, global_index, shard_index, split_index, path, split_kind, split_start, "
                 "split_stop, first_row, status, num_docs, num_tokens, num_records, num_bytes, checksum, "
                 "num_rejects, source_bytes")
DATASET_COLUMNS = "name, fingerprint, status, num_shards, num_chunks, chunks_done, prefix_chunks, num_docs, num_tokens"


# ----------------------------------------------------------------------------------------------
# Helpers (also used by test_catalog_concurrency.py)
# ----------------------------------------------------------------------------------------------

def write_corpus(folder: Path) -> Path:
    """Real text as JSONL shards of unequal size: each stdlib package's sources cut into documents."""
    for index, package in enumerate(CORPUS_PACKAGES):
        documents, current = [], ""
        for text in stdlib_texts(package):
            for block in text.split("\n\n"):
                current += block + "\n\n"
                if len(current) >= DOC_CHARS:
                    documents.append(current)
                    current = ""
        if current:
            documents.append(current)
        write_jsonl(folder / f"{index:02d}-{package}.jsonl", documents)
    return folder


def corpus_config(tmp: Path, data: Path) -> Path:
    """Config for a lake in ``tmp/lake`` over the corpus in ``data`` (same data, same chunk paths)."""
    return write_config(tmp, {"code": {"sources": [str(data / "*.jsonl")]}},
                        build={"split_size": SPLIT_SIZE, "publish_interval": PUBLISH_INTERVAL})


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "lakeloader.cli", *args]


def build_command(config: Path) -> list[str]:
    return cli("build", str(config), "--workers", "2", "--no-progress")


@contextlib.contextmanager
def running_build(config: Path, log: Path) -> Iterator[subprocess.Popen]:
    """`lakeloader build CONFIG --workers 2` in its own session; whatever the test did, the session's
    processes are killed on exit, so no test leaves processes behind."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(build_command(config), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:  # the driver is alive, so its process group id is still ours
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        for process in session_processes(proc.pid):
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()


def session_processes(session: int) -> list[psutil.Process]:
    """Live (non-zombie) processes of the session led by ``session``."""
    found = []
    for process in psutil.process_iter():
        try:
            if os.getsid(process.pid) == session and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except (ProcessLookupError, psutil.NoSuchProcess, PermissionError):
            continue
    return found


def describe(processes: list[psutil.Process]) -> list[str]:
    out = []
    for p in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            out.append(f"{p.pid}: {' '.join(p.cmdline())[:120]}")
    return out


def dask_workers(driver: int) -> list[psutil.Process]:
    """The Dask worker processes of a LocalCluster build: the driver's multiprocessing-spawned
    children (the nannies live in the driver; the resource tracker is not a worker)."""
    workers = []
    for child in psutil.Process(driver).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            command = " ".join(child.cmdline())
            if "spawn_main" in command and "resource_tracker" not in command:
                workers.append(child)
    return workers


def wait_until(condition: Callable[[], bool], proc: subprocess.Popen, log: Path, what: str,
               timeout: float = 120.0) -> None:
    """Poll ``condition`` until it holds; fail if ``proc`` exits first or on timeout."""
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            pytest.fail(f"the build exited ({proc.returncode}) before {what}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}:\n{log.read_text()[-3000:]}")
        time.sleep(0.01)


def chunk_files(lake_root: Path) -> list[Path]:
    """Chunk files under their final names (temporary files end in .tmp-<id>): not the catalog's
    snapshots nor the documents index."""
    return [p for p in lake_root.rglob("*.parquet") if not p.relative_to(lake_root).parts[0].startswith("_")]


def temporary_files(lake_root: Path) -> list[Path]:
    return sorted(lake_root.rglob("*.tmp-*"))


def snapshot_counts(lake_root: Path) -> tuple[int, int, int] | None:
    """(version, committed chunks, planned chunks) of the published snapshot, or None before one."""
    pointer_file = lake_root / "_catalog" / "CURRENT"
    for attempt in range(3):
        if not pointer_file.exists():
            return None
        pointer = json.loads(pointer_file.read_bytes())
        try:
            con = duckdb.connect(str(lake_root / "_catalog" / pointer["file"]), read_only=True)
        except duckdb.IOException:
            if attempt == 2:
                raise
            continue  # pruned by newer versions since CURRENT was read: read CURRENT again
        try:
            committed, planned = con.execute(
                "SELECT count(*) FILTER (WHERE status = 'committed'), count(*) FROM chunks").fetchone()
        finally:
            con.close()
        return int(pointer["version"]), int(committed), int(planned)
    raise AssertionError("unreachable")


@dataclasses.dataclass
class LakeState:
    """What must be identical between two builds of the same config."""

    chunks: pd.DataFrame
    row_groups: pd.DataFrame
    datasets: pd.DataFrame
    rejects: int
    files: dict[str, bytes]

    @property
    def total(self) -> int:
        return len(self.chunks)


def lake_state(lake_root: Path) -> LakeState:
    lake = open_lake(str(lake_root))
    chunks = lake.sql(f"SELECT {CHUNK_COLUMNS} FROM chunks ORDER BY dataset, global_index")
    return LakeState(
        chunks=chunks,
        row_groups=lake.sql("SELECT * FROM row_groups ORDER BY dataset, global_index, row_group"),
        datasets=lake.sql(f"SELECT {DATASET_COLUMNS} FROM datasets ORDER BY name"),
        rejects=int(lake.sql("SELECT count(*) AS n FROM rejects")["n"][0]),
        files={path: (lake_root / path).read_bytes() for path in chunks["path"]},
    )


def assert_same_lake(lake_root: Path, reference: LakeState) -> None:
    assert_progress_counted(lake_root)
    state = lake_state(lake_root)
    pd.testing.assert_frame_equal(state.chunks, reference.chunks)
    pd.testing.assert_frame_equal(state.row_groups, reference.row_groups)
    pd.testing.assert_frame_equal(state.datasets, reference.datasets)
    assert state.rejects == reference.rejects == 0
    assert state.files.keys() == reference.files.keys()
    different = [path for path in state.files if state.files[path] != reference.files[path]]
    assert different == [], f"{len(different)} chunk files differ from the reference, e.g. {different[:3]}"


def assert_catalog_matches_files(lake_root: Path) -> None:
    """Every committed chunk names a file that exists under its final name with the catalogued
    size and sha256; no temporary file is a chunk, and no final-named file is unaccounted for."""
    chunks = open_lake(str(lake_root)).sql(
        "SELECT path, status, num_bytes, checksum FROM chunks ORDER BY global_index")
    assert (chunks["status"] == "committed").all()
    for row in chunks.itertuples():
        assert ".tmp-" not in row.path
        data = (lake_root / row.path).read_bytes()
        assert len(data) == row.num_bytes, row.path
        assert hashlib.sha256(data).hexdigest() == row.checksum, row.path
    on_disk = {p.relative_to(lake_root).as_posix() for p in chunk_files(lake_root)}
    assert on_disk == set(chunks["path"])
    index = open_lake(str(lake_root)).sql("SELECT path, num_bytes, checksum FROM document_index_files")
    assert len(index)   # the documents index files recorded are whole (a killed build's others are unrecorded)
    for row in index.itertuples():
        data = (lake_root / row.path).read_bytes()
        assert len(data) == row.num_bytes and hashlib.sha256(data).hexdigest() == row.checksum, row.path


def read_catalog(lake_root: Path, statement: str) -> pd.DataFrame:
    """Query the writer's catalog file directly (read-only; DuckDB replays a killed writer's WAL)."""
    con = duckdb.connect(str(lake_root / "catalog.duckdb"), read_only=True)
    try:
        return con.execute(statement).df()
    finally:
        con.close()


# ----------------------------------------------------------------------------------------------
# Fixtures
# ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "data")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, corpus: Path, dask_scheduler: str) -> LakeState:
    """A clean, uninterrupted build of the corpus on the real 2-worker LocalCluster."""
    tmp = tmp_path_factory.mktemp("reference")
    report = build(corpus_config(tmp, corpus), scheduler=dask_scheduler, progress=False)
    assert report.chunks_built == report.chunks_total
    state = lake_state(tmp / "lake")
    assert 200 <= state.total <= 500, state.total
    assert (state.chunks["status"] == "committed").all()
    # Shards of unequal size: the round-robin order drops exhausted shards as it goes.
    assert state.chunks.groupby("shard_index").size().nunique() > 4
    return state


# ----------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------

def test_driver_sigkill_then_resume_gives_the_reference_lake(tmp_path: Path, corpus: Path,
                                                             reference: LakeState) -> None:
    config = corpus_config(tmp_path, corpus)
    lake_root = tmp_path / "lake"
    log = tmp_path / "killed.log"
    total = reference.total

    def some_committed() -> bool:
        counts = snapshot_counts(lake_root)
        return counts is not None and counts[1] > 0 and len(chunk_files(lake_root)) >= total // 4

    with running_build(config, log) as proc:
        wait_until(some_committed, proc, log, "some chunks were committed")
        os.kill(proc.pid, signal.SIGKILL)  # the driver only: its workers are not signalled
        assert proc.wait(timeout=30) == -signal.SIGKILL
        right_after = describe(session_processes(proc.pid))
        killed_at = time.monotonic()
        while session_processes(proc.pid) and time.monotonic() < killed_at + 10:
            time.sleep(0.05)
        orphans = describe(session_processes(proc.pid))
        grace = time.monotonic() - killed_at
    print(f"session processes right after the driver's SIGKILL: {right_after}; "
          f"after {grace:.2f}s: {orphans}")
    # Dask's worker processes watch their parent and exit when it dies: nothing is left running.
    assert orphans == []
    assert session_processes(proc.pid) == []

    # What the killed build left: a committed part, a 'running' build row, maybe temporary files.
    before = read_catalog(lake_root, "SELECT global_index, path, build_id, committed_at FROM chunks "
                                     "WHERE status = 'committed' ORDER BY global_index")
    assert 0 < len(before) < total, "the driver must be killed mid-build"
    assert read_catalog(lake_root, "SELECT build_id, status FROM builds").values.tolist() == [[1, "running"]]
    assert (before["build_id"] == 1).all()
    inodes = {path: (os.stat(lake_root / path).st_ino, os.stat(lake_root / path).st_mtime_ns)
              for path in before["path"]}
    version_at_kill = snapshot_counts(lake_root)[0]
    print(f"killed with {len(before)} of {total} chunks committed, "
          f"{len(chunk_files(lake_root))} chunk files and {len(temporary_files(lake_root))} temporary files")

    # Faults a killed writer can leave for pending chunks: a half-written temporary file, and a
    # file under the final name that was never committed (here: garbage). Neither may be trusted.
    pending = read_catalog(lake_root, "SELECT path FROM chunks WHERE status <> 'committed' "
                                      "ORDER BY global_index")["path"].tolist()
    half_written = lake_root / f"{pending[0]}.tmp-{'0' * 32}"
    half_written.parent.mkdir(parents=True, exist_ok=True)
    half_written.write_bytes(reference.files[pending[0]][:100])
    (lake_root / pending[-1]).write_bytes(b"not a parquet file")

    resumed = subprocess.run(build_command(config), capture_output=True, text=True, timeout=BUILD_TIMEOUT)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    built_again = total - len(before)
    assert f"built {built_again} chunks ({total} in the lake)" in resumed.stdout

    assert_same_lake(lake_root, reference)
    assert_catalog_matches_files(lake_root)
    assert not half_written.exists()  # the resumed build removes what a killed one left
    assert not list(lake_root.rglob("*.tmp-*"))

    builds = read_catalog(lake_root, "SELECT build_id, status, chunks_built FROM builds ORDER BY build_id")
    assert builds[["build_id", "status"]].values.tolist() == [[1, "interrupted"], [2, "succeeded"]]
    assert builds["chunks_built"][1] == built_again
    assert builds["chunks_built"][0] == len(before)  # the interrupted run is credited with its chunks
    assert 0 < built_again < total

    # Chunks committed before the kill were not rebuilt: same rows, same files (inode and mtime).
    after = read_catalog(lake_root, "SELECT global_index, path, build_id, committed_at FROM chunks "
                                    "ORDER BY global_index")
    kept = after[after["build_id"] == 1].reset_index(drop=True)
    pd.testing.assert_frame_equal(kept, before)
    assert (after[after["build_id"] != 1]["build_id"] == 2).all()
    assert {path: (os.stat(lake_root / path).st_ino, os.stat(lake_root / path).st_mtime_ns)
            for path in before["path"]} == inodes

    # The published snapshot moved on to the resumed build's final state.
    version, committed, planned = snapshot_counts(lake_root)
    assert version > version_at_kill and committed == planned == total
    assert json.loads((lake_root / "_catalog" / "CURRENT").read_bytes())["build_id"] == 2


def test_worker_sigkill_build_still_gives_the_reference_lake(tmp_path: Path, corpus: Path,
                                                             reference: LakeState) -> None:
    config = corpus_config(tmp_path, corpus)
    lake_root = tmp_path / "lake"
    log = tmp_path / "build.log"
    total = reference.total

    with running_build(config, log) as proc:
        wait_until(lambda: len(chunk_files(lake_root)) >= total // 5, proc, log, "a fifth of the chunks")
        workers = dask_workers(proc.pid)
        assert len(workers) == 2, describe(workers)
        victim = workers[0]
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=10)
        files_at_kill = len(chunk_files(lake_root))
        # The nanny (inside the driver) restarts the worker; note whether that is seen before the end.
        restarted = None
        while proc.poll() is None and restarted is None:
            fresh = [w.pid for w in dask_workers(proc.pid) if w.pid not in {p.pid for p in workers}]
            restarted = fresh[0] if fresh else None
            time.sleep(0.05)
        returncode = proc.wait(timeout=BUILD_TIMEOUT)
        output = log.read_text()
    print(f"killed worker {victim.pid} with {files_at_kill} of {total} chunk files written; "
          f"restarted worker: {restarted}; temporary files left: {len(temporary_files(lake_root))}")
    assert returncode == 0, output[-3000:]
    assert f"built {total} chunks ({total} in the lake)" in output
    assert files_at_kill < total, "the worker must be killed mid-build"

    assert_same_lake(lake_root, reference)
    assert_catalog_matches_files(lake_root)
    builds = read_catalog(lake_root, "SELECT build_id, status, chunks_built FROM builds")
    assert builds.values.tolist() == [[1, "succeeded", total]]
    # The killed worker had committed chunks (it was doing the work) and they were kept.
    workers_used = set(read_catalog(lake_root, "SELECT DISTINCT worker FROM chunks")["worker"])
    assert f"{os.uname().nodename}:{victim.pid}" in workers_used, workers_used


@contextlib.contextmanager
def external_cluster(folder: Path) -> Iterator[tuple[str, subprocess.Popen, subprocess.Popen]]:
    """A cluster as users run one: `dask scheduler` and one single-threaded `dask worker` process,
    each in its own session (killed with everything they started on exit). Yields the scheduler's
    address and the two processes once the worker has joined."""
    from distributed import Client

    from lakeloader.ingest.cluster import WORKER_ENV

    folder.mkdir(parents=True, exist_ok=True)
    scheduler_file = folder / "scheduler.json"
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "start_new_session": True}
    processes = [subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
                                   "--port", "0", "--no-dashboard", "--scheduler-file", str(scheduler_file)], **quiet)]
    try:
        deadline = time.monotonic() + 60
        while not scheduler_file.exists() or not scheduler_file.read_text().strip().endswith("}"):
            assert processes[0].poll() is None and time.monotonic() < deadline, "the scheduler did not start"
            time.sleep(0.05)
        address = json.loads(scheduler_file.read_text())["address"]
        processes.append(subprocess.Popen(
            [sys.executable, "-m", "distributed.cli.dask_worker", address, "--nthreads", "1", "--no-dashboard"],
            env={**os.environ, **WORKER_ENV}, **quiet))
        with Client(address, timeout=30) as client:
            client.wait_for_workers(1, timeout=60)
        yield address, processes[0], processes[1]
    finally:
        for process in processes:
            leftovers = session_processes(process.pid)
            if process.poll() is None:
                process.kill()
            process.wait(timeout=30)
            for child in leftovers:
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.kill()


def test_lost_scheduler_is_one_line_and_a_rerun_on_a_new_cluster_resumes(tmp_path: Path, corpus: Path,
                                                                         reference: LakeState) -> None:
    """Issue 53 item 6: the Dask scheduler of `build --scheduler` dies mid-build (SIGKILL): exit
    status 2 and one line saying what was committed and kept and that a re-run resumes, a
    `builds` row saying so, the worker gone with its scheduler; a re-run on a new scheduler and
    worker gives the reference lake, without rebuilding what was committed."""
    config = corpus_config(tmp_path, corpus)
    lake_root = tmp_path / "lake"
    log, errors = tmp_path / "build.log", tmp_path / "build.err"
    total = reference.total
    with external_cluster(tmp_path / "first") as (address, scheduler, worker):
        with open(log, "wb") as out, open(errors, "wb") as err:
            proc = subprocess.Popen(cli("build", str(config), "--scheduler", address, "--no-progress"),
                                    stdout=out, stderr=err, start_new_session=True)
        try:
            wait_until(lambda: (snapshot_counts(lake_root) or (0, 0, 0))[1] > 0
                       and len(chunk_files(lake_root)) >= total // 4, proc, errors, "some chunks were committed")
            scheduler.kill()
            returncode = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        # `dask worker` exits with its scheduler (the cluster docs say to restart both).
        worker.wait(timeout=60)
    stderr = errors.read_text()
    lines = [line for line in stderr.splitlines() if " INFO " not in line]
    assert returncode == 2, stderr[-3000:]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    message = (rf"lost the Dask scheduler at {re.escape(address)}: build 1 committed (\d+) chunks, which are "
               r"kept; restart the scheduler and its workers \(they exit with it\) and re-run "
               rf"`lakeloader build {re.escape(str(config))} --scheduler ADDRESS` to resume")
    said = re.fullmatch(rf"lakeloader build: error: {message}", lines[0])
    assert said, lines
    before = read_catalog(lake_root, "SELECT global_index, path, committed_at FROM chunks "
                                     "WHERE status = 'committed' ORDER BY global_index")
    assert 0 < len(before) == int(said.group(1)) < total
    builds = read_catalog(lake_root, "SELECT status, error, chunks_built FROM builds").to_dict(orient="records")
    assert len(builds) == 1 and builds[0]["status"] == "failed" and builds[0]["chunks_built"] == len(before)
    assert re.fullmatch(rf"SchedulerError: {message}", builds[0]["error"]), builds[0]["error"]

    with external_cluster(tmp_path / "second") as (address, _, _):
        resumed = subprocess.run(cli("build", str(config), "--scheduler", address, "--no-progress"),
                                 capture_output=True, text=True, timeout=BUILD_TIMEOUT)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"built {total - len(before)} chunks ({total} in the lake)" in resumed.stdout
    assert_same_lake(lake_root, reference)
    assert_catalog_matches_files(lake_root)
    kept = read_catalog(lake_root, "SELECT global_index, path, committed_at FROM chunks "
                                   "WHERE build_id = 1 ORDER BY global_index")
    pd.testing.assert_frame_equal(kept, before)   # committed chunks were not built again
    statuses = read_catalog(lake_root, "SELECT status FROM builds ORDER BY build_id")["status"].tolist()
    assert statuses == ["failed", "succeeded"]
