"""Opening chunk files: each is checked against the catalog once, even by threads opening it
together; footers are parsed once per file, not once per row group read, and a chunk file rebuilt
in place (same path, other bytes) is never read with the footer of its former bytes."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

import lakeloader.read.chunks as chunks_module
from lakeloader.catalog.lake import open_lake
from lakeloader.contracts.errors import ChunkIntegrityError
from lakeloader.read.catalog_view import CatalogView
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
    files = ChunkFiles(lake, "size", 0, 0)   # checked once against the catalog: not again after the rewrite
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
    real = chunks_module.sha256_of

    def slow(handle: object) -> str:
        hashed.append(threading.current_thread().name)
        time.sleep(0.2)   # every other thread opens the chunk meanwhile
        return real(handle)

    monkeypatch.setattr(chunks_module, "sha256_of", slow)
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
