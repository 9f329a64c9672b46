"""The driver reads a build's pending chunks from the catalog a page at a time (ingest/tasks.py
``PendingChunks``): it holds no row per chunk of the lake, whatever the lake's size, and builds the
same lake as when every chunk fits one page."""

from __future__ import annotations

import itertools
import shutil

import pandas as pd
import yaml

from lakeloader.catalog.lake import open_lake
from lakeloader.catalog.store import CatalogWriter
from lakeloader.ingest import tasks
from lakeloader.ingest.driver import build
from lakeloader.ingest.tasks import PendingChunks


def _recording_pages(monkeypatch, pages: list[int]) -> None:   # type: ignore[no-untyped-def]
    """Record the number of rows of each page of pending chunks the catalog returns."""
    original = CatalogWriter.pending_chunks

    def recorded(self: CatalogWriter, *args, **kwargs) -> pd.DataFrame:   # type: ignore[no-untyped-def]
        frame = original(self, *args, **kwargs)
        pages.append(len(frame))
        return frame

    monkeypatch.setattr(CatalogWriter, "pending_chunks", recorded)


def test_pages_hold_every_pending_chunk_and_repair_once_by_global_index(two_dataset_lake, tmp_path, monkeypatch):
    lake = open_lake(two_dataset_lake["pack"])
    catalog = tmp_path / "catalog.duckdb"
    shutil.copy(lake.writer_catalog_path, catalog)
    with CatalogWriter(str(catalog)) as writer:
        names = ["a", "b"]
        writer.con.execute("UPDATE chunks SET status = 'planned' WHERE global_index % 3 <> 0")
        committed = writer.committed_chunks(names)
        repairs = committed[committed.global_index % 2 == 0]
        everything = pd.concat([writer.pending_chunks(names), repairs]).sort_values("global_index", kind="stable")
        assert len(everything) >= 8 and len(repairs) >= 2 and set(everything.dataset) == set(names)
        pages: list[int] = []
        _recording_pages(monkeypatch, pages)
        pending = PendingChunks(writer, names, writer.pending_chunk_count(names) + len(repairs), repairs, page_rows=2)
        assert len(pending) == len(everything)
        rows = pending.rows()
        first = list(itertools.islice(rows, 2))
        taken = len(pages)   # pages are read as the rows are taken
        keys = [(row.dataset, int(row.global_index)) for row in [*first, *rows]]
        assert taken < len(pages) and max(pages) <= 2
        assert sorted(keys) == sorted(zip(everything.dataset, everything.global_index.astype(int)))
        assert len(set(keys)) == len(keys)
        assert [index for _, index in keys] == sorted(index for _, index in keys)
        limited = PendingChunks(writer, names, 5, repairs, page_rows=2)
        assert len(list(limited.rows())) == 5


def test_a_build_reading_its_chunks_in_pages_builds_the_same_lake(built_lake, tmp_path, dask_scheduler, monkeypatch):
    monkeypatch.setattr(tasks, "PAGE_ROWS", 2)
    settings = yaml.safe_load(built_lake.read_text())
    settings["lake"] = str(tmp_path / "paged")
    config = tmp_path / "paged.yaml"
    config.write_text(yaml.safe_dump(settings))
    pages: list[int] = []
    _recording_pages(monkeypatch, pages)
    build(config, scheduler=dask_scheduler, progress=False)
    query = "SELECT dataset, global_index, path, checksum FROM chunks WHERE status = 'committed' ORDER BY ALL"
    paged, whole = open_lake(config).sql(query), open_lake(built_lake).sql(query)
    assert len(pages) >= 3 and max(pages) <= 2
    assert paged.equals(whole)


def test_pages_after_a_chunk_committed_mid_build_skip_nothing(built_lake, monkeypatch):
    """Chunks committed while the pages are read (those of earlier pages) leave no later one out."""
    with CatalogWriter(open_lake(built_lake).writer_catalog_path) as writer:
        writer.con.execute("UPDATE chunks SET status = 'planned'")
        count = writer.pending_chunk_count(["d"])
        pending = PendingChunks(writer, ["d"], count, writer.committed_chunks(["d"]), page_rows=2)
        seen = []
        for row in pending.rows():
            seen.append(int(row.global_index))
            writer.con.execute("UPDATE chunks SET status = 'committed' WHERE global_index = ?", [int(row.global_index)])
        assert seen == list(range(count))
