"""Whole files that cannot be read: with on_error: skip they become rejects and the build completes;
sources that vanish, names that are not UTF-8, datasets of empty files, and UTF-8 byte order marks."""

from __future__ import annotations

import gzip
import json
import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from tokenizers import Tokenizer

import lakeloader.ingest.driver as driver
from lakeloader.catalog.lake import open_lake
from lakeloader.contracts.errors import InputError, LakeloaderError, SourceError
from lakeloader.ingest.driver import build

from conftest import DEMO_TOKENIZER, lake_documents, stdlib_texts, write_config, write_jsonl

TEXTS = stdlib_texts("json")
ENCODER = Tokenizer.from_file(str(DEMO_TOKENIZER))


def tokens(texts: list[str]) -> list[list[int]]:
    return [ENCODER.encode(t, add_special_tokens=False).ids for t in texts]


def jsonl_bytes(texts: list[str]) -> bytes:
    return "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()


def not_gzip(folder: Path) -> tuple[Path, list[str]]:
    path = folder / "plain.jsonl.gz"
    path.write_bytes(jsonl_bytes(TEXTS))
    return path, []


def crc_error(folder: Path) -> tuple[Path, list[str]]:
    """Two gzip members; the second one's CRC is wrong: the first member's documents are exact."""
    second = bytearray(gzip.compress(jsonl_bytes(TEXTS[2:]), mtime=0))
    second[-8:-4] = struct.pack("<I", (struct.unpack("<I", second[-8:-4])[0] + 1) & 0xFFFFFFFF)
    path = folder / "crc.jsonl.gz"
    path.write_bytes(gzip.compress(jsonl_bytes(TEXTS[:2]), mtime=0) + bytes(second))
    return path, TEXTS[:2]


EMAIL = stdlib_texts("email")


def truncated_zstd(folder: Path) -> tuple[Path, list[str]]:
    data = zstandard.ZstdCompressor(level=3).compress(jsonl_bytes(EMAIL))  # blocks of 128 KiB
    path = folder / "cut.jsonl.zst"
    path.write_bytes(data[: len(data) // 2])
    return path, []  # a prefix survives; checked to be a prefix below


def int64_text_column(folder: Path) -> tuple[Path, list[str]]:
    path = folder / "ints.parquet"
    pq.write_table(pa.table({"text": pa.array(range(10), pa.int64())}), path, row_group_size=3)
    return path, []


def shard_documents(config: Path, source: str) -> list[list[int]]:
    """The stored tokens of the documents of one source file of dataset ``d``, in order."""
    lake = open_lake(config)
    paths = lake.sql("SELECT c.path FROM chunks c JOIN shard_plans s USING (dataset, shard_index) "
                     "WHERE s.source = ? AND c.status = 'committed' ORDER BY c.split_index", [source]).path
    return [doc for p in paths for doc in pq.read_table(lake.path_of(p)).column("tokens").to_pylist()]


CASES: dict[str, tuple[Callable[[Path], tuple[Path, list[str]]], str, str]] = {
    "not_gzip": (not_gzip, "after line 0", "corrupt gzip stream"),
    "crc_error": (crc_error, "after line 2", "corrupt gzip stream"),
    "truncated_zstd": (truncated_zstd, "after line", "truncated zstd stream"),
    "int64_text_column": (int64_text_column, "whole file", "has type int64, expected strings"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_skip_turns_an_unreadable_file_into_one_reject(tmp_path: Path, dask_scheduler: str, case: str) -> None:
    make, location, reason = CASES[case]
    good = write_jsonl(tmp_path / "good.jsonl", TEXTS)
    bad, kept = make(tmp_path)
    config = write_config(tmp_path, {"d": {"sources": [str(good), str(bad)], "on_error": "skip"}})
    report = build(config, scheduler=dask_scheduler, progress=False)
    lake = open_lake(config)
    rejects = lake.sql("SELECT source, location, reason FROM rejects")
    assert rejects.source.tolist() == [str(bad)] and report.rejects == (0 if location == "whole file" else 1)
    assert rejects.location[0].startswith(location) and reason in rejects.reason[0], rejects.reason[0]
    assert shard_documents(config, str(good)) == tokens(TEXTS)
    if case == "truncated_zstd":
        cut = shard_documents(config, str(bad))
        assert 0 < len(cut) < len(EMAIL) and cut == tokens(EMAIL[: len(cut)])
    else:
        assert shard_documents(config, str(bad)) == tokens(kept)
    before = lake.sql("SELECT * FROM chunks ORDER BY global_index")
    again = build(config, scheduler=dask_scheduler, progress=False)
    assert again.chunks_built == 0
    lake = open_lake(config)
    assert lake.sql("SELECT source, location, reason FROM rejects").equals(rejects)
    assert lake.sql("SELECT * FROM chunks ORDER BY global_index").equals(before)


@pytest.mark.parametrize("case", ["not_gzip", "int64_text_column"])
def test_raise_names_the_unreadable_file(tmp_path: Path, dask_scheduler: str, case: str) -> None:
    make, _, reason = CASES[case]
    bad, _ = make(tmp_path)
    config = write_config(tmp_path, {"d": {"sources": [str(bad)], "on_error": "raise"}})
    with pytest.raises((InputError, SourceError)) as info:
        build(config, scheduler=dask_scheduler, progress=False)
    message = str(info.value)
    assert str(bad) in message and reason in message and "on_error: skip" in message, message


@pytest.fixture
def delete_after_planning(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Path]]:
    """Files appended to the yielded list are deleted right after the build plans its datasets
    (the build then runs on a real cluster and finds them gone)."""
    doomed: list[Path] = []
    plan = driver.plan_dataset

    def plan_then_delete(*args: object, **kwargs: object) -> object:
        result = plan(*args, **kwargs)
        for path in doomed:
            path.unlink(missing_ok=True)
        return result

    monkeypatch.setattr(driver, "plan_dataset", plan_then_delete)
    yield doomed
    monkeypatch.setattr(driver, "plan_dataset", plan)


def test_source_deleted_after_planning_raise(tmp_path: Path, dask_scheduler: str,
                                             delete_after_planning: list[Path]) -> None:
    gone = write_jsonl(tmp_path / "data" / "b.jsonl", TEXTS)
    delete_after_planning.append(gone)
    config = write_config(tmp_path, {"d": {"sources": [str(gone)], "on_error": "raise"}})
    with pytest.raises(InputError) as info:
        build(config, scheduler=dask_scheduler, progress=False)
    message = str(info.value)
    assert str(gone) in message and "file not found" in message and "re-run the build" in message, message


def test_source_deleted_after_planning_skip_keeps_the_other_files_chunks(
        tmp_path: Path, dask_scheduler: str, delete_after_planning: list[Path]) -> None:
    kept = write_jsonl(tmp_path / "data" / "a.jsonl", TEXTS)
    gone = write_jsonl(tmp_path / "data" / "b.jsonl", TEXTS[::-1])
    delete_after_planning.append(gone)
    sources = [str(tmp_path / "data" / "*.jsonl")]
    config = write_config(tmp_path, {"d": {"sources": sources, "on_error": "skip"}}, build={"split_size": "16KB"})
    build(config, scheduler=dask_scheduler, progress=False)
    rejects = open_lake(config).sql("SELECT source, reason FROM rejects")
    assert set(rejects.source) == {str(gone)} and all("file not found" in r for r in rejects.reason)
    delete_after_planning.clear()
    # The re-run re-plans without b.jsonl and keeps every committed chunk of a.jsonl.
    report = build(config, scheduler=dask_scheduler, progress=False)
    assert report.chunks_built == 0 and report.chunks_total > 1
    replanned = open_lake(config).sql(
        "SELECT global_index, shard_index, split_index, path, num_docs, num_tokens, checksum FROM chunks "
        "ORDER BY global_index")
    groups = open_lake(config).sql("SELECT * FROM row_groups ORDER BY global_index, row_group")
    assert open_lake(config).sql("SELECT count(*) AS n FROM rejects").n[0] == 0
    # ... and ends with the lake a fresh build of the remaining file gives.
    fresh_dir = tmp_path / "fresh"
    fresh_dir.mkdir()
    fresh = write_config(fresh_dir, {"d": {"sources": sources, "on_error": "skip"}}, build={"split_size": "16KB"})
    build(fresh, scheduler=dask_scheduler, progress=False)
    assert open_lake(fresh).sql(
        "SELECT global_index, shard_index, split_index, path, num_docs, num_tokens, checksum FROM chunks "
        "ORDER BY global_index").equals(replanned)
    assert open_lake(fresh).sql("SELECT * FROM row_groups ORDER BY global_index, row_group").equals(groups)
    assert lake_documents(config, "d") == lake_documents(fresh, "d") == tokens(TEXTS)
    assert kept.exists()


def test_file_name_that_is_not_utf8(tmp_path: Path, dask_scheduler: str) -> None:
    folder = tmp_path / "data"
    folder.mkdir()
    name = os.fsdecode(b"caf\xe9.jsonl")
    (folder / name).write_bytes(jsonl_bytes(TEXTS[:3]) + b"not json\n")
    config = write_config(tmp_path, {"d": {"sources": [str(folder / "*.jsonl")], "on_error": "skip"}})
    build(config, scheduler=dask_scheduler, progress=False)
    lake = open_lake(config)
    shards = lake.sql("SELECT source, source_raw FROM shard_plans")
    assert shards.source[0] == str(folder) + "/caf\\xe9.jsonl"
    assert bytes(shards.source_raw[0]) == os.fsencode(folder / name)
    rejects = lake.sql("SELECT source, location FROM rejects")
    assert rejects.source.tolist() == [shards.source[0]] and rejects.location.tolist() == ["line 4"]
    assert lake_documents(config, "d") == tokens(TEXTS[:3])
    raising = write_config(tmp_path, {"d": {"sources": [str(folder / "*.jsonl")], "on_error": "raise"}},
                           lake=str(tmp_path / "lake2"))
    with pytest.raises(InputError) as info:
        build(raising, scheduler=dask_scheduler, progress=False)
    assert "caf\\xe9.jsonl: line 4" in str(info.value)
    str(info.value).encode("utf-8")  # printable


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_dataset_of_empty_files_has_no_documents(tmp_path: Path, on_error: str) -> None:
    (tmp_path / "a.jsonl").write_bytes(b"")
    (tmp_path / "b.txt").write_bytes(b"")
    config = write_config(tmp_path, {"empty": {"sources": [str(tmp_path / "a.jsonl"), str(tmp_path / "b.txt")],
                                               "on_error": on_error}})
    with pytest.raises(SourceError) as info:
        build(config, workers=1, progress=False)
    message = str(info.value)
    assert "'empty' has no documents" in message and "a.jsonl" in message and "b.txt" in message, message
    assert isinstance(info.value, LakeloaderError)


def test_dataset_whose_every_record_is_rejected_has_no_documents(tmp_path: Path, dask_scheduler: str) -> None:
    bad, _ = not_gzip(tmp_path)
    config = write_config(tmp_path, {"d": {"sources": [str(bad)], "on_error": "skip"}})
    with pytest.raises(SourceError) as info:
        build(config, scheduler=dask_scheduler, progress=False)
    message = str(info.value)
    assert "'d' has no documents" in message and str(bad) in message and "1 rejects" in message, message
    lake = open_lake(config)
    assert lake.sql("SELECT status FROM builds").status.tolist() == ["failed"]
    assert len(lake.sql("SELECT * FROM rejects")) == 1


def test_utf8_bom_is_stripped_at_the_start_of_a_file_only(tmp_path: Path, dask_scheduler: str) -> None:
    bom = "\ufeff".encode()
    (tmp_path / "a.jsonl").write_bytes(bom + jsonl_bytes(TEXTS[:2]))
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(bom + jsonl_bytes(TEXTS[2:4]), mtime=0))
    (tmp_path / "c.txt").write_bytes(bom + b"first line\n" + bom + b"second line keeps its mark\n")
    (tmp_path / "d.txt.zst").write_bytes(zstandard.ZstdCompressor().compress(bom + b"zstd text\n"))
    sources = [str(tmp_path / n) for n in ("a.jsonl", "b.jsonl.gz", "c.txt", "d.txt.zst")]
    config = write_config(tmp_path, {"d": {"sources": sources, "on_error": "raise"}})
    build(config, scheduler=dask_scheduler, progress=False)
    documents = lake_documents(config, "d")
    # One split per file, so the files' documents in file order; a mark inside a file is text.
    assert documents == tokens([*TEXTS[:4], "first line", "\ufeffsecond line keeps its mark", "zstd text"])
