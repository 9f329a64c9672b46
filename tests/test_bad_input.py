"""Bad input: with on_error: raise the build stops naming file and line; with skip it lands in rejects."""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from lakeloader.catalog.lake import open_lake
from lakeloader.contracts.errors import InputError, SourceError
from lakeloader.ingest.driver import build

from conftest import DEMO_TOKENIZER, lake_documents, stdlib_texts, write_config, write_jsonl

GOOD = [json.dumps({"text": t}) for t in stdlib_texts("json")]


def jsonl_with(bad_line: bytes) -> Callable[[Path], tuple[Path, int]]:
    """A JSONL file whose 3rd line is ``bad_line``; the other lines are good documents."""
    def make(folder: Path) -> tuple[Path, int]:
        lines = [g.encode() for g in GOOD[:2]] + [bad_line] + [g.encode() for g in GOOD[2:]]
        path = folder / "bad.jsonl"
        path.write_bytes(b"\n".join(lines) + b"\n")
        return path, len(GOOD)
    return make


def truncated_gzip(folder: Path) -> tuple[Path, int]:
    data = gzip.compress(("\n".join(GOOD * 4) + "\n").encode(), mtime=0)
    path = folder / "cut.jsonl.gz"
    path.write_bytes(data[: len(data) * 2 // 3])
    return path, -1  # some prefix of the documents survives


CASES = {
    "malformed_json": (jsonl_with(b'{"text": "unterminated'), "line 3", "malformed JSON"),
    "missing_field": (jsonl_with(b'{"body": "no text field"}'), "line 3", "no field 'text'"),
    "not_a_string": (jsonl_with(b'{"text": 42}'), "line 3", "expected a string"),
    "invalid_utf8": (jsonl_with(b'{"text": "caf\xe9 au lait"}'), "line 3", "invalid UTF-8"),
    "empty_document": (jsonl_with(b'{"text": ""}'), "line 3", "empty document"),
    "blank_line": (jsonl_with(b""), "line 3", "empty line"),
    "truncated_gzip": (truncated_gzip, "after line", "truncated gzip"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_raise_names_file_and_line(tmp_path: Path, dask_scheduler: str, case: str) -> None:
    make, location, reason = CASES[case]
    path, _ = make(tmp_path)
    config = write_config(tmp_path, {"d": {"sources": [str(path)], "on_error": "raise"}})
    with pytest.raises(InputError) as info:
        build(config, scheduler=dask_scheduler, progress=False)
    message = str(info.value)
    assert str(path) in message and location in message and reason in message, message
    assert "on_error: skip" in message
    builds = open_lake(config).sql("SELECT status, error FROM builds")
    assert builds.status.tolist() == ["failed"] and reason in builds.error[0]


@pytest.mark.parametrize("case", sorted(CASES))
def test_skip_records_rejects(tmp_path: Path, dask_scheduler: str, case: str) -> None:
    make, location, reason = CASES[case]
    path, good_docs = make(tmp_path)
    config = write_config(tmp_path, {"d": {"sources": [str(path)], "on_error": "skip"}},
                          build={"split_size": "16KB"})
    report = build(config, scheduler=dask_scheduler, progress=False)
    lake = open_lake(config)
    rejects = lake.sql("SELECT * FROM rejects")
    assert len(rejects) == 1 and report.rejects == 1
    assert rejects.source[0] == str(path)
    assert rejects.location[0].startswith(location) and reason in rejects.reason[0]
    if location == "line 3":
        assert rejects.line[0] == 3
    documents = lake_documents(config, "d")
    if good_docs >= 0:
        assert len(documents) == good_docs
    else:
        assert 0 < len(documents) < len(GOOD) * 4
    assert lake.sql("SELECT num_rejects FROM datasets").num_rejects[0] == 1


def test_line_numbers_count_lines_of_earlier_splits(tmp_path: Path, dask_scheduler: str) -> None:
    lines = [g.encode() for g in GOOD]
    lines.insert(len(lines) - 1, b"not json")
    path = tmp_path / "late.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    config = write_config(tmp_path, {"d": {"sources": [str(path)], "on_error": "skip"}},
                          build={"split_size": "4KB"})
    build(config, scheduler=dask_scheduler, progress=False)
    rejects = open_lake(config).sql("SELECT line, location, global_index FROM rejects")
    assert rejects.line.tolist() == [len(lines) - 1]
    assert rejects.location[0] == f"line {len(lines) - 1}" and rejects.global_index[0] > 0


def test_long_single_document(tmp_path: Path, dask_scheduler: str) -> None:
    text = ("\n".join(stdlib_texts("email")) + "\n") * 8
    text = text * (20_000_000 // len(text) + 1)
    assert len(text.encode()) >= 20_000_000
    path = write_jsonl(tmp_path / "big.jsonl", [text, "small"])
    config = write_config(tmp_path, {"d": {"sources": [str(path)]}}, build={"split_size": "64MB"})
    build(config, scheduler=dask_scheduler, progress=False)
    tokenizer = Tokenizer.from_file(str(DEMO_TOKENIZER))
    stored = lake_documents(config, "d")
    assert len(stored) == 2
    assert stored[0] == tokenizer.encode(text, add_special_tokens=False).ids
    assert stored[1] == tokenizer.encode("small", add_special_tokens=False).ids


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_missing_and_unreadable_sources_before_any_work(tmp_path: Path, dask_scheduler: str,
                                                        on_error: str) -> None:
    good = write_jsonl(tmp_path / "good.jsonl", stdlib_texts("json"))
    (tmp_path / "folder.jsonl").mkdir()
    (tmp_path / "dangling.jsonl").symlink_to(tmp_path / "gone.jsonl")
    sources = [str(good), str(tmp_path / "absent.jsonl"), str(tmp_path / "folder.jsonl"),
               str(tmp_path / "dangling.jsonl")]
    config = write_config(tmp_path, {"d": {"sources": sources, "on_error": on_error}})
    if on_error == "raise":
        with pytest.raises(SourceError) as info:
            build(config, scheduler=dask_scheduler, progress=False)
        message = str(info.value)
        for name in ("absent.jsonl", "folder.jsonl", "dangling.jsonl"):
            assert name in message
        assert not list((tmp_path / "lake").rglob("*.parquet"))
        return
    build(config, scheduler=dask_scheduler, progress=False)
    rejects = open_lake(config).sql("SELECT source, reason FROM rejects ORDER BY source")
    assert [Path(s).name for s in rejects.source] == ["absent.jsonl", "dangling.jsonl", "folder.jsonl"]
    assert len(lake_documents(config, "d")) == len(stdlib_texts("json"))


def test_text_columns_of_any_string_encoding_and_a_utf16_file(tmp_path: Path, dask_scheduler: str) -> None:
    """Parquet text typed dictionary<string> or string_view reads as strings; a UTF-16 (or -32)
    JSONL file is one reject naming its encoding, its records never miscounted as lines."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = stdlib_texts("json")
    data = tmp_path / "data"
    data.mkdir()
    pq.write_table(pa.table({"text": pa.array(texts).dictionary_encode()}), data / "dict.parquet")
    pq.write_table(pa.table({"text": pa.array(texts, pa.string_view())}), data / "view.parquet")
    (data / "wide.jsonl").write_bytes("".join(json.dumps({"text": t}) + "\n" for t in texts[:3]).encode("utf-16"))
    write_jsonl(data / "narrow.jsonl", texts[:3])
    config = write_config(tmp_path, {
        "dict": {"sources": [str(data / "dict.parquet")]}, "view": {"sources": [str(data / "view.parquet")]},
        "wide": {"sources": [str(data / "narrow.jsonl"), str(data / "wide.jsonl")], "on_error": "skip"}})
    build(config, scheduler=dask_scheduler, progress=False)
    encode = Tokenizer.from_file(str(DEMO_TOKENIZER)).encode
    expected = [encode(t, add_special_tokens=False).ids for t in texts]
    assert lake_documents(config, "dict") == expected
    assert lake_documents(config, "view") == expected
    lake = open_lake(config)
    rejects = lake.sql("SELECT source, location, reason FROM rejects WHERE dataset = 'wide'")
    splits = lake.sql("SELECT count(*) AS n FROM chunks c JOIN shards s USING (dataset, shard_index) "
                      "WHERE c.dataset = 'wide' AND s.source LIKE '%wide.jsonl'").n[0]
    assert len(rejects) == splits >= 1   # one reject a split, however many lines it has
    assert all("UTF-16LE" in reason and "iconv" in reason for reason in rejects.reason)
    assert all(source.endswith("wide.jsonl") for source in rejects.source)
    assert lake_documents(config, "wide") == expected[:3]
