"""Building a lake on a real Dask cluster: tokens equal Tokenizer.encode of every document, in order."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from lakeloader.catalog.lake import open_lake
from lakeloader.config import DatasetConfig
from lakeloader.ingest.documents import SplitSource, read_split
from lakeloader.ingest.driver import build
from lakeloader.plan.sources import expand_sources
from lakeloader.plan.splits import plan_splits
from lakeloader.tokenizer import DocumentEncoder

from conftest import DEMO_TOKENIZER, lake_documents, stdlib_texts, write_config, write_jsonl, write_parquet


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(DEMO_TOKENIZER))


def expected_documents(tokenizer: Tokenizer, config_path: Path, dataset: str) -> list[list[int]]:
    """Tokenizer.encode of each document, in the global order, read independently of the build."""
    lake = open_lake(config_path)
    chunks = lake.sql(
        "SELECT c.*, s.source, s.layout, s.compression FROM chunks c JOIN shard_plans s "
        "USING (dataset, shard_index) WHERE dataset = ? ORDER BY global_index", [dataset])
    from lakeloader.plan.splits import Split

    out = []
    for row in chunks.itertuples():
        split = Split(row.split_kind, row.split_start, row.split_stop, row.first_row)
        compression = row.compression if isinstance(row.compression, str) else None
        text_format = DatasetConfig(sources=["x"]).record_format()
        docs = read_split(SplitSource(row.source, row.layout, compression, split, text_format, "raise", {}))
        out.extend(tokenizer.encode(parts[0].text, add_special_tokens=False).ids for parts in docs.documents)
    return out


def test_lake_tokens_equal_encode_in_global_order(tmp_path: Path, dask_scheduler: str,
                                                   tokenizer: Tokenizer) -> None:
    texts = stdlib_texts("json") + stdlib_texts("email", limit=12)
    data = tmp_path / "data"
    write_jsonl(data / "a.jsonl", texts)
    write_jsonl(data / "b.jsonl.gz", texts[:5], compression="gzip")
    write_jsonl(data / "c.jsonl.zst", texts[5:9], compression="zstd")
    write_parquet(data / "d.parquet", texts[:10], row_group_size=3)
    (data / "e.txt").write_text("".join(line + "\n" for t in texts[:3] for line in t.splitlines() if line))
    config = write_config(tmp_path, {"mix": {"sources": [str(data / "*")]}}, build={"split_size": "20KB"})
    report = build(config, scheduler=dask_scheduler, progress=False)
    assert report.chunks_built == report.chunks_total > 8

    stored = lake_documents(config, "mix")
    assert stored == expected_documents(tokenizer, config, "mix")
    # Expected document multiset, independent of split logic: every source document once.
    lines = [line for t in texts[:3] for line in t.splitlines() if line]
    everything = texts + texts[:5] + texts[5:9] + texts[:10] + lines
    assert sorted(map(tuple, stored)) == sorted(
        tuple(tokenizer.encode(t, add_special_tokens=False).ids) for t in everything)

    chunks = open_lake(config).sql("SELECT * FROM chunks ORDER BY global_index")
    assert (chunks.status == "committed").all()
    for row in chunks.itertuples():
        meta = pq.read_metadata(open_lake(config).path_of(row.path))
        assert meta.num_rows == row.num_docs
        assert meta.schema.to_arrow_schema().field("tokens").type.value_type == "uint16"
    # Round-robin over the 5 shards: the first 5 chunks are split 0 of each shard.
    assert chunks.shard_index.tolist()[:5] == [0, 1, 2, 3, 4]

    again = build(config, scheduler=dask_scheduler, progress=False)
    assert again.chunks_built == 0


def test_changed_config_never_mixes_with_old_build(tmp_path: Path, dask_scheduler: str) -> None:
    data = tmp_path / "data"
    write_jsonl(data / "a.jsonl", stdlib_texts("json"))
    config = write_config(tmp_path, {"web": {"sources": [str(data / "a.jsonl")]}})
    build(config, scheduler=dask_scheduler, progress=False)
    lake = open_lake(config)
    before = lake.sql("SELECT fingerprint FROM datasets").fingerprint[0]
    paths_before = set(lake.sql("SELECT path FROM chunks").path)
    config = write_config(tmp_path, {"web": {"sources": [str(data / "a.jsonl")]}}, build={"split_size": "16KB"})
    report = build(config, scheduler=dask_scheduler, progress=False)
    after = lake.sql("SELECT fingerprint FROM datasets").fingerprint[0]
    paths_after = set(lake.sql("SELECT path FROM chunks").path)
    assert before != after and not paths_before & paths_after
    assert report.chunks_built == report.chunks_total == len(paths_after)


def test_long_document_split_for_tokenizer_equals_whole_encode(tokenizer: Tokenizer) -> None:
    text = "\n".join(stdlib_texts("json")) * 3 + " tail without newline " + "x" * 5000
    encoder = DocumentEncoder(tokenizer, max_piece_chars=2000)
    assert encoder.splits_long_documents
    assert len(encoder._cut_points(text)) > 10
    ids, lengths = encoder.encode(["short one", text, "é and more"])
    whole = [tokenizer.encode(t, add_special_tokens=False).ids for t in ["short one", text, "é and more"]]
    assert lengths.tolist() == [len(w) for w in whole]
    assert ids.tolist() == [i for w in whole for i in w]


def test_token_type_fits_vocabulary() -> None:
    from lakeloader.tokenizer import token_dtype

    assert token_dtype(65_536) == np.uint16
    assert token_dtype(65_537) == np.uint32
    assert token_dtype(200_000) == np.uint32


def test_parquet_row_groups_are_splits(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "p.parquet", [f"doc {i}" for i in range(10)], row_group_size=4)
    [shard], _ = expand_sources([str(path)], {})
    splits = plan_splits(shard, 1, {})
    assert [(s.kind, s.start, s.first_row) for s in splits] == [
        ("row_group", 0, 0), ("row_group", 1, 4), ("row_group", 2, 8)]
