"""The build's path after tokenization: the tokenizer's JSON is produced once per build (driver)
and never on workers, and a chunk's row groups reach the catalog as they did one row at a time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import duckdb
import pytest
from tokenizers import Tokenizer

from lakeloader.catalog.lake import open_lake
from lakeloader.ingest import chunk as chunk_module
from lakeloader.ingest import driver as driver_module
from lakeloader.ingest.driver import build
from lakeloader.tokenizer import encoder_name

from conftest import DEMO_TOKENIZER, stdlib_texts, write_config, write_jsonl


class _CountingTokenizer:
    """A real tokenizer that counts how often its JSON is produced."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.to_str_calls = 0

    def to_str(self, *args: Any, **kwargs: Any) -> str:
        self.to_str_calls += 1
        return self._tokenizer.to_str(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


def _config(tmp_path: Path, backend: str = "fastokens", **build_options: Any) -> Path:
    source = write_jsonl(tmp_path / "data" / "a.jsonl", stdlib_texts("json"))
    return write_config(tmp_path, {"d": {"sources": [str(source)]}}, tokenizer=str(DEMO_TOKENIZER),
                        tokenizer_backend=backend, build={"split_size": "16KB", **build_options},
                        loader={"seq_len": 64, "batch_size": 4})


def test_a_build_produces_the_tokenizer_json_once(tmp_path: Path, dask_scheduler: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    counted: list[_CountingTokenizer] = []

    def load(spec: str) -> _CountingTokenizer:
        counted.append(_CountingTokenizer(Tokenizer.from_file(spec)))
        return counted[-1]

    monkeypatch.setattr(driver_module, "load_tokenizer", load)
    config = _config(tmp_path)
    report = build(config, scheduler=dask_scheduler, progress=False)
    assert report.chunks_built > 1
    assert [t.to_str_calls for t in counted] == [1]
    published = open_lake(config).sql("SELECT tokenizer_path FROM dataset_plans")["tokenizer_path"].iloc[0]
    assert (tmp_path / "lake" / published).read_text() == Tokenizer.from_file(str(DEMO_TOKENIZER)).to_str()


def test_a_worker_loads_fastokens_from_the_file_it_read(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[_CountingTokenizer] = []

    class Counting:
        @staticmethod
        def from_str(text: str) -> _CountingTokenizer:
            made.append(_CountingTokenizer(Tokenizer.from_str(text)))
            return made[-1]

    monkeypatch.setattr(chunk_module, "Tokenizer", Counting)
    encoder = chunk_module._encoder.__wrapped__(str(DEMO_TOKENIZER), "{}", encoder_name("fastokens"))
    assert encoder.backend == "fastokens" and [t.to_str_calls for t in made] == [0]
    ids, lengths = encoder.encode(["def f(x):\n    return x\n"])
    assert ids.tolist() == Tokenizer.from_file(str(DEMO_TOKENIZER)).encode(
        "def f(x):\n    return x\n", add_special_tokens=False).ids


def test_row_groups_of_every_chunk_are_committed_in_order(tmp_path: Path, dask_scheduler: str) -> None:
    config = _config(tmp_path, split_size="64KB", row_group_tokens=128)
    build(config, scheduler=dask_scheduler, progress=False)
    with duckdb.connect(str(open_lake(config).writer_catalog_path), read_only=True) as con:
        groups = con.execute("SELECT global_index, row_group, first_doc, num_docs, first_token, num_tokens, "
                             "num_parts, part_tokens FROM row_groups ORDER BY global_index, row_group").fetchall()
        chunks = dict(con.execute("SELECT global_index, num_tokens FROM chunks").fetchall())
    by_chunk: dict[int, list[tuple[Any, ...]]] = {}
    for row in groups:
        by_chunk.setdefault(row[0], []).append(row)
    assert max(len(rows) for rows in by_chunk.values()) > 2   # several row groups per chunk
    assert set(by_chunk) == set(chunks)
    for index, rows in by_chunk.items():
        assert [r[1] for r in rows] == list(range(len(rows)))
        docs = tokens = 0
        for _, _, first_doc, num_docs, first_token, num_tokens, num_parts, part_tokens in rows:
            assert (first_doc, first_token) == (docs, tokens)
            assert num_parts == [num_docs] and part_tokens == [num_tokens]   # format text: one part per document
            docs, tokens = docs + num_docs, tokens + num_tokens
        assert tokens == chunks[index]
