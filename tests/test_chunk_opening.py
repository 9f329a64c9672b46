"""Opening chunk files: each is checked against the catalog once, even by threads opening it
together, and hashed again by a later process only once it has changed; footers are parsed once
per file, not once per row group read, and a chunk file rebuilt in place (same path, other bytes)
is never read with the footer of its former bytes."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

import lakeloader.read.chunks as chunks_module
import lakeloader.catalog.hash_records as hashed_module
from lakeloader.catalog.lake import Lake, open_lake
from lakeloader.contracts.errors import ChunkIntegrityError
from lakeloader.read.catalog_view import CatalogView, DatasetChunks
from lakeloader.read.chunks import ChunkFiles


def test_each_footer_is_parsed_once(built_lake: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parsed: list[bool] = []
    real = chunks_module.open_chunk

    def spy(source: object, metadata: object = None) -> pq.ParquetFile:
        parsed.append(metadata is None)
        return real(source, metadata) if metadata is not None else real(source)  # type: ignore[arg-type]

    monkeypatch.setattr(chunks_module, "open_chunk", spy)
    lake = open_lake(built_lake)
    view = CatalogView(lake)
    chunks = view.dataset("d")
    files = ChunkFiles(lake, "checksum", 0, 0)
    reads = 0
    for _ in range(3):
        for chunk in range(chunks.committed):
            groups = pq.ParquetFile(lake.path_of(chunks.record(chunk).path)).metadata.num_row_groups
            for group in range(groups):
                files.read_row_group(chunks, chunk, group)
                reads += 1
    view.close()
    assert reads >= 3 * 2 and sum(parsed) == chunks.committed, (reads, parsed)


def test_a_chunk_rebuilt_in_place_is_read_with_its_new_footer(built_lake: Path) -> None:
    """The same ChunkFiles reads a chunk, then the file is written again in place with other bytes
    (uncompressed: every page at another offset): the next read decodes the new bytes, same tokens."""
    lake = open_lake(built_lake)
    view = CatalogView(lake)
    chunks = view.dataset("d")
    # Checked once against the catalog (hashed: with verify size, pages left to pyarrow, as these
    # become, are hashed first), not again after the rewrite.
    files = ChunkFiles(lake, "checksum", 0, 0)
    path = Path(lake.path_of(chunks.record(0).path))
    before = pq.ParquetFile(path).metadata
    expected = [files.read_row_group(chunks, 0, g) for g in range(before.num_row_groups)]
    table = pq.read_table(path)
    with pq.ParquetWriter(path, table.schema, compression="none", write_page_checksum=True) as writer:
        for g in range(before.num_row_groups):   # the same row groups, stored otherwise
            writer.write_table(table.slice(sum(before.row_group(i).num_rows for i in range(g)),
                                           before.row_group(g).num_rows))
    after = pq.ParquetFile(path).metadata
    assert after.num_row_groups == before.num_row_groups
    assert after.row_group(0).column(1).data_page_offset != before.row_group(0).column(1).data_page_offset
    for g, want in enumerate(expected):
        got = files.read_row_group(chunks, 0, g)
        assert got.values.dtype == want.values.dtype and np.array_equal(got.values, want.values)
        assert np.array_equal(got.parts.part_lengths, want.parts.part_lengths)
    view.close()


def test_threads_opening_a_chunk_together_hash_it_once(built_lake: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four threads read row groups of one chunk at once (as a shuffled first batch's decode threads
    do): the file is hashed once. A chunk failing its check fails every thread, and is checked
    again on the next read (the failure is not remembered: a repaired file then reads)."""
    hashed: list[str] = []
    real = hashed_module.sha256_of

    def slow(handle: object) -> str:
        if os.readlink(f"/proc/self/fd/{handle.fileno()}").endswith(".parquet"):   # type: ignore[attr-defined]
            hashed.append(threading.current_thread().name)
            time.sleep(0.2)   # every other thread opens the chunk meanwhile
        return real(handle)

    monkeypatch.setattr(hashed_module, "sha256_of", slow)
    lake = open_lake(built_lake)
    view = CatalogView(lake)
    chunks = view.dataset("d")
    files = ChunkFiles(lake, "checksum", 0, 0)

    def together(chunk: int) -> list[object]:
        start = threading.Barrier(4)

        def read(_: int) -> object:
            start.wait()
            try:
                return files.read_row_group(chunks, chunk, 0).values
            except ChunkIntegrityError as exc:
                return exc

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            return list(pool.map(read, range(4)))

    values = together(0)
    assert len(hashed) == 1, hashed
    assert all(np.array_equal(v, values[0]) for v in values)   # type: ignore[arg-type]
    path = Path(lake.path_of(chunks.record(1).path))
    intact = path.read_bytes()
    path.write_bytes(intact[:100] + bytes([intact[100] ^ 1]) + intact[101:])   # same size, other bytes
    errors = together(1)
    assert all(isinstance(e, ChunkIntegrityError) and "sha256" in str(e) for e in errors), errors
    path.write_bytes(intact)
    assert len(files.read_row_group(chunks, 1, 0).values) > 0
    view.close()


def _hash_spy(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the chunk files hashed from now on (each time one is)."""
    hashed: list[str] = []
    real = hashed_module.sha256_of

    def spy(handle: object) -> str:
        name = os.readlink(f"/proc/self/fd/{handle.fileno()}")   # type: ignore[attr-defined]
        if name.endswith(".parquet"):   # chunk files, not the published catalog's
            hashed.append(name)
        return real(handle)

    monkeypatch.setattr(hashed_module, "sha256_of", spy)
    return hashed


_OTHER_PROCESS = """
import json, sys
import lakeloader.catalog.hash_records as records
from lakeloader.catalog.lake import Lake, open_lake
from lakeloader.read.catalog_view import CatalogView, DatasetChunks
from lakeloader.read.chunks import ChunkFiles
hashed, real = [], records.sha256_of
records.sha256_of = lambda handle: hashed.append(handle.fileno()) or real(handle)
lake = open_lake(sys.argv[1])
chunks = CatalogView(lake).dataset("d")
files = ChunkFiles(lake, "checksum", 0, 0)
for chunk in range(chunks.committed):
    files.read_row_group(chunks, chunk, 0)
print(json.dumps(hashed))
"""


def _hashed_by_another_process(config: Path) -> list[int]:
    """What a fresh Python process reading row group 0 of every chunk hashes (from another folder)."""
    done = subprocess.run([sys.executable, "-c", _OTHER_PROCESS, str(config)], capture_output=True, text=True,
                          check=True, cwd="/", env=os.environ)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _read_every_chunk(lake: Lake, chunks: DatasetChunks) -> list[np.ndarray]:
    """Row group 0 of every chunk, read by a new ChunkFiles (as a new process would)."""
    files = ChunkFiles(lake, "checksum", 0, 0)
    return [files.read_row_group(chunks, c, 0).values for c in range(chunks.committed)]


def test_a_later_process_hashes_a_chunk_file_again_only_once_it_changed(
        built_lake: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Files hashed and found as the catalog says are recorded on the machine: a later reader
    (a new ChunkFiles, as in a new process) reads them without hashing. A byte changed in place,
    even with the file's modification time set back, is hashed again and refused; so is a file
    whose record names another checksum or is damaged; the intact file reads again."""
    monkeypatch.setattr(hashed_module, "RACY_SECONDS", 0.0)   # the copy was just written
    hashed = _hash_spy(monkeypatch)
    lake = open_lake(built_lake)
    view = CatalogView(lake)
    chunks = view.dataset("d")
    paths = [os.path.realpath(lake.path_of(chunks.record(c).path)) for c in range(chunks.committed)]
    first = _read_every_chunk(lake, chunks)
    assert sorted(hashed) == sorted(paths) and len(paths) >= 3
    records = [r for r in Path(lake.cache_dir, "hashed").glob("*.json") if json.loads(r.read_text())["path"] in paths]
    assert len(records) == len(paths)   # beside the records of the published catalog's files

    hashed.clear()
    again = _read_every_chunk(lake, chunks)
    assert hashed == []
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert _hashed_by_another_process(built_lake) == []

    victim = Path(paths[1])
    intact, times = victim.read_bytes(), victim.stat()
    victim.write_bytes(intact[:100] + bytes([intact[100] ^ 1]) + intact[101:])   # same size, other bytes
    os.utime(victim, ns=(times.st_atime_ns, times.st_mtime_ns))                  # and the same mtime
    with pytest.raises(ChunkIntegrityError, match="sha256"):
        ChunkFiles(lake, "checksum", 0, 0).read_row_group(chunks, 1, 0)
    assert hashed == [str(victim)]
    victim.write_bytes(intact)
    hashed.clear()
    assert all(np.array_equal(a, b) for a, b in zip(first, _read_every_chunk(lake, chunks)))
    assert hashed == [str(victim)]   # recorded again: the next reader hashes nothing
    hashed.clear()
    _read_every_chunk(lake, chunks)
    assert hashed == []

    record = records[0]
    kept = json.loads(record.read_text())
    record.write_text(json.dumps({**kept, "sha256": "0" * 64}))
    _read_every_chunk(lake, chunks)
    record.write_text("{not json")
    _read_every_chunk(lake, chunks)
    assert hashed == [kept["path"], kept["path"]]
    assert json.loads(record.read_text()) == kept
    view.close()


def test_a_file_changed_just_before_it_is_hashed_is_not_recorded(
        built_lake: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A file whose times are within RACY_SECONDS of its hash (a write then could keep them on a
    file system with coarse times) is hashed by every reader. A cache folder that cannot be
    written is a warning naming it, once, and reading goes on."""
    hashed = _hash_spy(monkeypatch)
    lake = open_lake(built_lake)
    view = CatalogView(lake)
    chunks = view.dataset("d")
    path = os.path.realpath(lake.path_of(chunks.record(0).path))
    os.utime(path)   # changed now
    for _ in range(2):
        _read_every_chunk(lake, chunks)
    assert hashed.count(path) == 2

    monkeypatch.setattr(hashed_module, "RACY_SECONDS", 0.0)
    Path(lake.cache_dir).mkdir(parents=True, exist_ok=True)
    Path(lake.cache_dir, "hashed").write_text("a file where the records' folder should be")
    hashed.clear()
    with caplog.at_level(logging.WARNING, logger=hashed_module.__name__):
        values = _read_every_chunk(lake, chunks)
    assert len(values) == chunks.committed and len(hashed) == chunks.committed
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(Path(lake.cache_dir, "hashed")) in warnings[0], warnings
    view.close()
