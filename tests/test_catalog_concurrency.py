"""The catalog under concurrency: one writer per lake, readers of the published snapshot meanwhile.

Each test runs `lakeloader build CONFIG --workers 2` as a real subprocess (LocalCluster of 2 worker
processes, real DuckDB, real Parquet) and acts on the lake from other processes while it runs.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import duckdb
import pytest
from test_resume import (
    BUILD_TIMEOUT,
    assert_catalog_matches_files,
    build_command,
    cli,
    corpus_config,
    read_catalog,
    running_build,
    wait_until,
    write_corpus,
)

from lakeloader.catalog.lake import Lake
from lakeloader.catalog.reader_index import INDEX_FORMAT, TABLES, ReaderIndex, index_file
from lakeloader.catalog.pointer import delta_file, delta_versions
from lakeloader.catalog.snapshot import KEEP_SNAPSHOTS, connect_pointer, open_snapshot, published_deltas, read_pointer
from lakeloader.catalog.store import SCHEMA_VERSION, connect_reader
from lakeloader.contracts.errors import CatalogError, CatalogLockedError
from lakeloader.ingest.driver import build

COMMITTED = "SELECT count(*) FROM chunks WHERE status='committed'"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "data")


def planned_chunks(lake_root: Path) -> int:
    return int(read_catalog(lake_root, "SELECT count(*) AS n FROM chunks")["n"][0])


def test_second_build_fails_at_once_and_the_first_completes(tmp_path: Path, corpus: Path) -> None:
    config = corpus_config(tmp_path, corpus)
    lake_root = tmp_path / "lake"
    log = tmp_path / "first.log"
    with running_build(config, log) as first:
        # Once a snapshot is published mid-build, the first build holds the catalog, its workers
        # tokenize, and it has copied its catalog file at least once (which must keep it locked).
        wait_until(lambda: (lake_root / "_catalog" / "CURRENT").exists(), first, log, "the first snapshot")
        started = time.monotonic()
        second = subprocess.run(build_command(config), capture_output=True, text=True, timeout=60)
        seconds = time.monotonic() - started
        first_was_running = first.poll() is None
        # The Python API refuses the same way, before starting any Dask cluster.
        started_api = time.monotonic()
        with pytest.raises(CatalogLockedError, match="Only one build may write a lake at a time"):
            build(config, workers=2, progress=False)
        api_seconds = time.monotonic() - started_api
        first_returncode = first.wait(timeout=BUILD_TIMEOUT)
        first_output = log.read_text()

    assert second.returncode == 2, (second.stdout, second.stderr)
    assert first_was_running, "the second build must fail at once, not after the first one ends"
    assert seconds < 20 and api_seconds < 5, (seconds, api_seconds)
    message = second.stderr
    assert message.startswith("lakeloader build: error: catalog "), message
    assert str(lake_root / "catalog.duckdb") in message
    assert f"is in use by process {first.pid}" in message
    assert "another `lakeloader build` of this lake" in message
    assert "Only one build may write a lake at a time: wait for it to finish or stop it" in message
    assert "Traceback" not in message and second.stdout == ""

    assert first_returncode == 0, first_output[-3000:]
    total = planned_chunks(lake_root)
    assert f"built {total} chunks ({total} in the lake)" in first_output
    assert_catalog_matches_files(lake_root)
    # The refused builds left no trace in the catalog.
    builds = read_catalog(lake_root, "SELECT build_id, status, chunks_built FROM builds")
    assert builds.values.tolist() == [[1, "succeeded", total]]


POLLER = textwrap.dedent("""
    import os, sys, time
    from lakeloader.catalog.lake import open_lake
    lake, out, stop = sys.argv[1:4]
    with open(out, "w") as log:
        while True:
            last = os.path.exists(stop)
            try:
                n = int(open_lake(lake).sql(sys.argv[4]).iloc[0, 0])
                log.write(f"{n}\\n")
            except Exception as exc:
                log.write(f"ERROR {type(exc).__name__}: {exc}\\n".replace("\\n", " ") + "\\n")
            log.flush()
            if last:
                break
            time.sleep(0.02)
""")


def test_published_snapshot_is_readable_from_other_processes_during_the_build(tmp_path: Path,
                                                                                corpus: Path) -> None:
    config = corpus_config(tmp_path, corpus)
    lake_root = tmp_path / "lake"
    log = tmp_path / "build.log"
    samples, stop = tmp_path / "poller.txt", tmp_path / "stop"
    cli_counts: list[tuple[int, bool]] = []  # (count, build still running when the query returned)
    with running_build(config, log) as proc:
        wait_until(lambda: (lake_root / "_catalog" / "CURRENT").exists(), proc, log, "the first snapshot")
        poller = subprocess.Popen([sys.executable, "-c", POLLER, str(lake_root), str(samples), str(stop),
                                   COMMITTED])
        try:
            while proc.poll() is None:
                result = subprocess.run(cli("sql", str(lake_root), COMMITTED, "--format", "csv"),
                                        capture_output=True, text=True, timeout=60)
                assert result.returncode == 0, result.stderr
                header, value = result.stdout.splitlines()
                assert header == "count_star()"
                cli_counts.append((int(value), proc.poll() is None))
            returncode = proc.wait(timeout=BUILD_TIMEOUT)
            stop.touch()
            assert poller.wait(timeout=60) == 0
        finally:
            poller.kill()
            poller.wait()
    assert returncode == 0, log.read_text()[-3000:]
    total = planned_chunks(lake_root)

    after = subprocess.run(cli("sql", str(lake_root), COMMITTED, "--format", "csv"),
                           capture_output=True, text=True, timeout=60)
    assert after.returncode == 0 and after.stdout == f"count_star()\n{total}\n", (after.stdout, after.stderr)

    lines = samples.read_text().splitlines()
    errors = [line for line in lines if line.startswith("ERROR")]
    assert errors == []
    counts = [int(line) for line in lines]
    print(f"poller saw {len(counts)} samples, {len(set(counts))} distinct; CLI saw {cli_counts}")
    assert len(counts) >= 10
    assert counts == sorted(counts), "committed counts seen by a reader must never decrease"
    assert any(0 < n < total for n in counts), "a reader must see the build's progress, not only its end"
    assert counts[-1] == total
    seen = [n for n, _ in cli_counts] + [total]
    assert seen == sorted(seen)
    assert any(running for _, running in cli_counts), "a CLI query must answer during the build"


def test_snapshot_versions_increase_and_current_is_always_complete(tmp_path: Path, corpus: Path) -> None:
    config = corpus_config(tmp_path, corpus)
    lake_root = tmp_path / "lake"
    lake = Lake(str(lake_root))
    log = tmp_path / "build.log"
    seen: list[tuple[int, int, int]] = []  # (version, committed, planned) per check
    with running_build(config, log) as proc:
        wait_until(lambda: read_pointer(lake) is not None, proc, log, "the first snapshot")
        while proc.poll() is None:
            pointer = read_pointer(lake)
            deltas = delta_versions(pointer)   # a version is its base plus the deltas after it
            base = pointer.get("base", pointer["version"])
            assert set(pointer) == {"version", "file", "reader_index", "sha256", "published_at", "build_id",
                                    "lake_id", "checksum", *(("base", "deltas") if deltas else ())}
            assert pointer["file"] == f"catalog-{base:06d}.duckdb"
            assert pointer["reader_index"] == {"prefix": f"catalog-{base:06d}", "format": INDEX_FORMAT}
            # The reader index CURRENT names is whole, and says what its version says.
            index_files = {table: index_file(pointer["reader_index"]["prefix"], table) for table in TABLES}
            delta_files = {f"delta-{v}": delta_file(v) for v in deltas}
            try:
                published = {key: (lake_root / "_catalog" / name).read_bytes()
                             for key, name in {"catalog": pointer["file"], **index_files, **delta_files}.items()}
                merged = published_deltas(lake, pointer)
                paths = {table: str(lake_root / "_catalog" / name) for table, name in index_files.items()}
                index = ReaderIndex(paths) if merged is None else ReaderIndex(paths, merged.index, merged.changed())
                con = connect_pointer(lake, pointer)   # the files CURRENT names, as readers see them
            except (FileNotFoundError, CatalogError, duckdb.Error):
                # Pruned meanwhile (DuckDB's error when between its check and the ATTACH): then a
                # newer version is current; otherwise the failure is a real one.
                if read_pointer(lake)["version"] == pointer["version"]:
                    raise
                continue
            assert pointer["build_id"] == 1
            # CURRENT gives each file's sha256 as published (none is written after the pointer).
            for key, data in published.items():
                assert hashlib.sha256(data).hexdigest() == pointer["sha256"][key], key
            try:
                committed, planned = con.execute(
                    "SELECT count(*) FILTER (WHERE status = 'committed'), count(*) FROM chunks").fetchone()
                assert con.execute("SELECT value FROM lake_meta WHERE key = 'schema_version'").fetchone() \
                    == (SCHEMA_VERSION,)
                assert con.execute("SELECT value FROM lake_meta WHERE key = 'published_version'").fetchone() \
                    == (str(pointer["version"]),)
                status, = con.execute("SELECT status FROM builds WHERE build_id = 1").fetchone()
                prefix, = con.execute("SELECT num_chunks FROM committed_prefix").fetchone()
                assert index.chunks("code").num_rows == planned
                assert int(index.chunks("code").column("committed").to_numpy(zero_copy_only=False).sum()) == committed
                groups = index.row_groups_of("code", list(range(planned)), False)["global_index"]
                assert len(groups) == con.execute("SELECT count(*) FROM row_groups").fetchone()[0]
                assert con.execute("SELECT count(*) FROM chunk_offsets").fetchone() == (prefix,)
                assert con.execute("SELECT count(*) FROM row_groups r JOIN chunks c USING (dataset, "
                                   "global_index) WHERE c.status <> 'committed'").fetchone() == (0,)
            finally:
                con.close()
            # 'succeeded' only in the final snapshot, published as the build process ends.
            assert status == "running" or (status == "succeeded" and committed == planned), status
            seen.append((pointer["version"], committed, planned))
            # Publishing copies the writer's catalog: it must stay locked to every other process
            # until the build closes it at its very end.
            try:
                con = connect_reader(str(lake_root / "catalog.duckdb"))
            except CatalogLockedError as exc:
                assert f"in use by process {proc.pid}" in str(exc)
            else:
                try:
                    assert con.execute("SELECT status FROM builds").fetchall() == [("succeeded",)]
                finally:
                    con.close()
            # The library's reader opens the same or a newer version.
            con, version = open_snapshot(lake)
            con.close()
            assert version >= pointer["version"]
            time.sleep(0.05)
        returncode = proc.wait(timeout=BUILD_TIMEOUT)
    assert returncode == 0, log.read_text()[-3000:]

    versions = [v for v, _, _ in seen]
    print(f"{len(seen)} checks of {len(set(versions))} snapshot versions during the build")
    assert len(set(versions)) >= 3
    assert versions == sorted(versions), "snapshot versions never go backwards"
    committed_seen = [committed for _, committed, _ in seen]
    assert committed_seen == sorted(committed_seen), "committed counts never go backwards"
    total = planned_chunks(lake_root)
    assert {planned for _, _, planned in seen} == {total}  # the whole plan is in every snapshot
    assert any(0 < committed < total for _, committed, _ in seen)

    # After the build: the newest version (maybe seen as the process ended) holds the finished
    # build, and only the newest few versions are kept.
    final = read_pointer(lake)
    assert final["version"] >= max(versions) and final["build_id"] == 1
    con, version = open_snapshot(lake)
    try:
        assert version == final["version"]
        assert con.execute(COMMITTED).fetchone() == (total,)
        assert con.execute("SELECT status, chunks_built FROM builds").fetchall() == [("succeeded", total)]
    finally:
        con.close()
    kept = range(final["version"] - KEEP_SNAPSHOTS + 1, final["version"] + 1)
    assert not delta_versions(final)   # the build's last publish is a full snapshot
    names = sorted(p.name for p in (lake_root / "_catalog").iterdir())
    whole = {f"catalog-{final['version']:06d}.{kind}" for kind in ("duckdb", *(f"{table}.arrow" for table in TABLES))}
    assert whole <= set(names) and names[0] == "CURRENT"
    for name in names[1:]:   # each a file of a kept version: a full snapshot's or a delta
        assert int(name.split(".")[0].removeprefix("catalog-")) in kept, name
        assert name.split(".", 1)[1] in ("duckdb", "delta.arrow", *(f"{table}.arrow" for table in TABLES)), name
    assert json.loads((lake_root / "_catalog" / "CURRENT").read_bytes()) == final
