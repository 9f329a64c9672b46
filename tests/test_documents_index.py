"""The documents index (issue 53 item 3): the documents view answers from per-document index files
written as chunks commit, bitwise the rows it reads from the chunk files (metadata fields, part
kinds, Parquet sources, filtered datasets, a build read while it runs, a build that failed and
resumed); a damaged or missing index file is one error naming it; a lake without the index reads
as before; the selections of a filtered build do not change."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lakeloader.catalog import documents, snapshot
from lakeloader.catalog.gc import remove_stale
from lakeloader.catalog.lake import open_lake
from lakeloader.catalog.pointer import delta_versions
from lakeloader.catalog.snapshot import read_pointer
from lakeloader.catalog.store import CatalogWriter
from lakeloader.contracts.errors import CatalogIntegrityError
from lakeloader.ingest import document_index
from lakeloader.ingest.driver import build
from lakeloader.ingest.repair import repair_lake
from lakeloader.ingest.execute import ResultCommitter
from lakeloader.read.verify import verify_lake

from conftest import write_config
from test_documents import METADATA, Corpus
from test_page_checksums import copy_lake

EVERYTHING = "SELECT * FROM documents ORDER BY dataset, chunk, doc"


def filtered_config(corpus: Corpus, tmp: Path, **build_settings: Any) -> Path:
    """The corpus's datasets and three filters of ``meta`` (metadata, num_tokens and doc_key),
    into a lake in ``tmp``."""
    data = corpus.root / "data"
    return write_config(tmp, {
        "meta": {"sources": [str(data / n) for n in ("good.jsonl", "bad.jsonl", "p1.parquet", "p2.parquet",
                                                      "p3.parquet")],
                 "metadata_fields": METADATA, "on_error": "skip"},
        "sft": {"sources": [str(data / "sft.jsonl")], "format": "supervised", "metadata_fields": {"lang": "string"}},
        "english": {"from": "meta", "where": "lang = 'en' AND num_tokens > 20"},
        "keyed": {"from": "meta", "where": "doc_key % 3 = 1"},
        "scored": {"from": "meta", "where": "score > 4 OR ok"},
    }, build={"split_size": "6KB", "row_group_tokens": 300, **build_settings},
        loader={"seq_len": 64, "batch_size": 4})


def without_index(monkeypatch: pytest.MonkeyPatch) -> None:
    """The documents view reads every chunk file, as on a lake built before the index."""
    original = documents._document_chunks
    monkeypatch.setattr(documents, "_document_chunks", lambda con: original(con).assign(index_file=None))


def both_ways(config: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Every row of the documents view from the index, and from the chunk files only."""
    lake = open_lake(config)
    indexed = lake.sql(EVERYTHING)
    with pytest.MonkeyPatch.context() as patch:
        without_index(patch)
        direct = lake.sql(EVERYTHING)
    return indexed, direct


def index_state(config: Path) -> tuple[int, int, int]:
    """Indexed chunks, committed chunks of the datasets built from sources, index files."""
    lake = open_lake(config)
    row = lake.sql("SELECT (SELECT count(*) FROM document_index_chunks) AS indexed, "
                   "(SELECT count(*) FROM chunks c JOIN dataset_plans d ON d.name = c.dataset "
                   " WHERE c.status = 'committed' AND d.source_dataset IS NULL) AS built, "
                   "(SELECT count(*) FROM document_index_files) AS files")
    return int(row.indexed[0]), int(row.built[0]), int(row.files[0])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Corpus:
    return Corpus(tmp_path_factory.mktemp("documents_index"))


@pytest.fixture(scope="module")
def built(corpus: Corpus, tmp_path_factory: pytest.TempPathFactory, dask_scheduler: str) -> Path:
    config = filtered_config(corpus, tmp_path_factory.mktemp("built"))
    build(config, scheduler=dask_scheduler, progress=False)
    return config


def test_the_index_answers_bitwise_as_the_chunk_files(built: Path) -> None:
    indexed, direct = both_ways(built)
    assert set(indexed.dataset) == {"meta", "sft", "english", "keyed", "scored"}
    assert {"id", "lang", "score", "ok", "tokens_prompt", "tokens_response"} <= set(indexed.columns)
    pd.testing.assert_frame_equal(indexed, direct)
    covered, committed, files = index_state(built)
    assert covered == committed > 10 and files == 2   # every chunk indexed; compacted: a file per dataset
    stats = open_lake(built).stats(by="lang")
    with pytest.MonkeyPatch.context() as patch:
        without_index(patch)
        pd.testing.assert_frame_equal(stats, open_lake(built).stats(by="lang"))


def test_a_build_read_while_it_runs_and_after_a_failure_and_resume(
        corpus: Corpus, built: Path, tmp_path: Path, dask_scheduler: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """At every publish of a build (each commit group), the view answers as the chunk files do;
    a build that fails mid-way keeps an index of what it committed, and its resumed build ends
    with the rows of an uninterrupted one."""
    config = filtered_config(corpus, tmp_path, publish_interval=0.001)
    monkeypatch.setattr(document_index, "COMPACT_FILES", 3)   # compacted while it builds too
    monkeypatch.setattr(snapshot, "DELTA_SHARE", 10.0)        # small catalogs: deltas, not bases
    seen: list[tuple[int, int]] = []
    deltas: list[int] = []
    publish = ResultCommitter.publish_if_due

    def checked(self: ResultCommitter) -> None:
        publish(self)
        indexed, direct = both_ways(config)   # the index's rows as a reader merges them from the deltas
        pd.testing.assert_frame_equal(indexed, direct)
        seen.append(index_state(config)[:2])
        deltas.append(len(delta_versions(read_pointer(open_lake(config)))))

    monkeypatch.setattr(ResultCommitter, "publish_if_due", checked)
    original = CatalogWriter._run
    commits: list[str] = []

    def failing(self: CatalogWriter, name: str, params: dict[str, Any] | None = None) -> Any:
        if name in ("commit_chunk", "commit_batch_chunks"):
            commits.append(name)
            if len(commits) == 6:
                raise RuntimeError("the driver crashed mid-build")
        return original(self, name, params)

    monkeypatch.setattr(CatalogWriter, "_run", failing)
    with pytest.raises(RuntimeError, match="mid-build"):
        build(config, scheduler=dask_scheduler, progress=False)
    monkeypatch.setattr(CatalogWriter, "_run", original)
    assert len(seen) == 5 and all(covered == committed for covered, committed in seen)
    assert max(deltas) >= 3   # the index's commits and compactions published as deltas
    indexed, direct = both_ways(config)
    pd.testing.assert_frame_equal(indexed, direct)
    build(config, scheduler=dask_scheduler, progress=False)
    indexed, direct = both_ways(config)
    pd.testing.assert_frame_equal(indexed, direct)
    pd.testing.assert_frame_equal(indexed, both_ways(built)[0])   # as the uninterrupted build's


def index_file_of(config: Path) -> Path:
    lake = open_lake(config)
    path = lake.sql("SELECT path FROM document_index_files ORDER BY dataset LIMIT 1").path[0]
    return Path(lake.path_of(path))


@pytest.mark.parametrize("damage", ["missing", "flipped", "cut"])
def test_a_damaged_index_file_is_an_error_naming_it(built: Path, tmp_path: Path, dask_scheduler: str,
                                                    damage: str) -> None:
    config = copy_lake(built.parent, tmp_path)
    before = open_lake(config).sql(EVERYTHING)
    path = index_file_of(config)
    data = path.read_bytes()
    if damage == "missing":
        path.unlink()
    elif damage == "flipped":
        path.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    else:
        path.write_bytes(data[:-10])
    with pytest.raises(CatalogIntegrityError) as caught:
        open_lake(config).sql("SELECT dataset, count(*) FROM documents GROUP BY dataset")
    message = str(caught.value)
    assert "\n" not in message and str(path) in message and "lakeloader build" in message
    assert {"missing": "is missing", "flipped": "sha256", "cut": "bytes, the catalog says"}[damage] in message
    report = verify_lake(config, progress=False)
    found = report[report.status != "ok"]
    assert len(found) == 1 and found.global_index.iloc[0] == -1 and str(path).endswith(found.path.iloc[0])
    assert found.status.iloc[0] == {"missing": "missing", "flipped": "checksum", "cut": "size"}[damage]
    if damage == "flipped":   # the right size: found only by its checksum, so removed by verify --repair
        report = repair_lake(config, report, scheduler=dask_scheduler, progress=False)
        assert (report.status == "ok").all() and not path.exists()
    else:
        build(config, scheduler=dask_scheduler, progress=False)   # forgets it: those chunks read from their files
    pd.testing.assert_frame_equal(open_lake(config).sql(EVERYTHING), before)
    assert (verify_lake(config, progress=False).status == "ok").all()


def test_a_lake_without_the_index_reads_as_before(corpus: Corpus, built: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch, dask_scheduler: str) -> None:
    """Chunks a build did not index (the first commit groups here) are read from their files
    beside the indexed ones; a lake whose catalog has no index tables (built before the index)
    answers from its chunk files: the rows of a lake indexed throughout, either way."""
    write = document_index.DocumentIndexWriter.write
    calls: list[int] = []

    def late(self: document_index.DocumentIndexWriter, results: Any) -> Any:
        calls.append(1)
        return write(self, results) if len(calls) > 3 else []

    monkeypatch.setattr(document_index.DocumentIndexWriter, "write", late)
    config = filtered_config(corpus, tmp_path)
    build(config, scheduler=dask_scheduler, progress=False)
    covered, committed, _ = index_state(config)
    assert 0 < covered < committed == index_state(built)[1]
    expected = open_lake(built).sql(EVERYTHING)
    indexed, direct = both_ways(config)
    pd.testing.assert_frame_equal(indexed, expected)
    pd.testing.assert_frame_equal(direct, expected)
    con = duckdb.connect(open_lake(config).writer_catalog_path)
    con.execute("DROP TABLE document_index_chunks; DROP TABLE document_index_files")
    con.close()
    pd.testing.assert_frame_equal(open_lake(config).sql(EVERYTHING), expected)


def test_selections_follow_only_the_shards_just_committed(
        corpus: Corpus, built: Path, tmp_path: Path, dask_scheduler: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """After each commit group the build looks for ready selections in the shards it committed
    only: every selection the whole lake's query finds then is among them or found before (so
    the same tasks run), and the lake's selections and chunks are the module's build's."""
    pending = CatalogWriter.pending_selections
    found: set[tuple[str, int]] = set()
    restricted = []

    def compared(self: CatalogWriter, datasets: Any, committed: bool = False, built: Any = None) -> pd.DataFrame:
        rows = pending(self, datasets, committed, built)
        keys = set(zip(rows.dataset, rows.global_index))
        if built is not None:
            restricted.append(len(rows))
            every = pending(self, datasets, committed)
            assert keys <= set(zip(every.dataset, every.global_index)) <= keys | found
        found.update(keys)
        return rows

    monkeypatch.setattr(CatalogWriter, "pending_selections", compared)
    config = filtered_config(corpus, tmp_path)
    build(config, scheduler=dask_scheduler, progress=False)
    assert len(restricted) >= 2   # (fewer, larger commit groups under load)
    tables = ("SELECT * FROM selections ORDER BY ALL",
              "SELECT dataset, global_index, status, num_docs, num_tokens, path FROM chunks ORDER BY ALL")
    for query in tables:
        pd.testing.assert_frame_equal(open_lake(config).sql(query), open_lake(built).sql(query))


def test_gc_removes_the_index_files_a_compaction_replaced(
        corpus: Corpus, tmp_path: Path, dask_scheduler: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compaction keeps the files it replaced (readers of earlier snapshots may read them);
    `lakeloader gc` lists and removes exactly those, and the view answers as before."""
    monkeypatch.setattr(document_index, "COMPACT_FILES", 3)
    config = filtered_config(corpus, tmp_path, publish_interval=0.001)   # every commit group published
    build(config, scheduler=dask_scheduler, progress=False)
    lake = open_lake(config)
    expected = lake.sql(EVERYTHING)
    recorded = set(lake.sql("SELECT path FROM document_index_files").path)
    on_disk = {str(p.relative_to(Path(lake.path_of("_documents")).parent)) for p in Path(lake.path_of("_documents")).rglob("*") if p.is_file()}
    assert recorded < on_disk   # compactions left files behind
    listed = remove_stale(lake, dry_run=True)
    assert set(listed.folder) == on_disk - recorded and set(listed.dataset) <= {"meta", "sft"}
    assert (listed.files == 1).all() and listed.bytes.sum() > 0
    removed = remove_stale(lake)
    assert set(removed.folder) == on_disk - recorded
    assert {str(p.relative_to(Path(lake.path_of("_documents")).parent)) for p in Path(lake.path_of("_documents")).rglob("*") if p.is_file()} == recorded
    assert remove_stale(lake, dry_run=True).empty
    pd.testing.assert_frame_equal(open_lake(config).sql(EVERYTHING), expected)


def test_index_files_no_snapshot_listed_are_deleted_when_replaced(
        corpus: Corpus, built: Path, tmp_path: Path, dask_scheduler: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A build that publishes only at its end leaves no replaced index file behind: each was
    written and merged before any snapshot could list it. The view answers as before."""
    monkeypatch.setattr(document_index, "COMPACT_FILES", 3)
    removed: list[str] = []
    original = document_index.DocumentIndexWriter._remove_unpublished
    monkeypatch.setattr(document_index.DocumentIndexWriter, "_remove_unpublished",
                        lambda self, paths: (removed.extend(paths), original(self, paths))[1])
    config = filtered_config(corpus, tmp_path, publish_interval=3600)
    build(config, scheduler=dask_scheduler, progress=False)
    lake = open_lake(config)
    folder = Path(lake.path_of("_documents"))
    on_disk = {str(p.relative_to(folder.parent)) for p in folder.rglob("*") if p.is_file()}
    assert removed and not on_disk & set(removed)   # compactions ran, and what they replaced is gone
    assert on_disk == set(lake.sql("SELECT path FROM document_index_files").path)
    assert remove_stale(lake, dry_run=True).empty
    pd.testing.assert_frame_equal(lake.sql(EVERYTHING), open_lake(built).sql(EVERYTHING))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1_000, 50_000), min_size=1, max_size=3_000))
def test_compactions_during_a_build_rewrite_each_row_a_few_times(sizes: list[int]) -> None:
    """Files of ``sizes`` bytes, one per commit group, compacted as a build does: the dataset keeps
    at most COMPACT_FILES + 1 files, and each byte is rewritten at most log1.5(all / smallest) + 1
    times (a file merges only with as much as half its bytes newer than it), not at every compaction."""
    files: list[int] = []
    rewritten = 0
    for size in sizes:
        files.append(size)
        if len(files) > document_index.COMPACT_FILES:
            worth = document_index._worth_merging(np.array(files))
            assert worth.sum() >= 2
            merged = sum(np.array(files)[worth])
            rewritten += merged
            first = int(np.argmax(worth))
            files = files[:first] + [merged] + [
                size for size, chosen in zip(files[first:], worth[first:]) if not chosen]
        assert len(files) <= document_index.COMPACT_FILES
    assert sum(files) == sum(sizes)
    assert rewritten <= sum(sizes) * (math.log(sum(sizes) / min(sizes), 1.5) + 1)
