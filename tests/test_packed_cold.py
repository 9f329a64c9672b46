"""A packed loader's first batch (``packing: pack | pad``) reads cold as a ``concat`` one does: a
row group no cache holds whose items reach little of it is read from just the pages of the
documents they need, then decoded whole in the background; a full shuffle beyond the cache reads
every batch so. Batches are bitwise those of whole row groups, for every shuffle kind."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from lakeloader.feed.loader import Loader
from lakeloader.ingest.driver import build
from lakeloader.read import cold_pages
from lakeloader.read.chunks import ChunkFiles

from conftest import ahead_thread_caught_up, assert_batches_equal, stdlib_texts, write_config, write_jsonl

SEQ_LEN, BATCH = 48, 8
SHUFFLES = [{"kind": "none"}, {"kind": "full"}, {"kind": "block", "block_size": 7, "window_blocks": 3},
            {"kind": "window", "window_chunks": 3}]


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory, dask_scheduler: str) -> Path:
    """Text and chat conversations (targets only on assistant turns), small splits and small row
    groups, with the example counts of ``pack`` and ``pad`` registered."""
    root = tmp_path_factory.mktemp("packed-cold")
    data = root / "data"
    texts = stdlib_texts("json") + stdlib_texts("wsgiref")
    write_jsonl(data / "t" / "a.jsonl", texts[::2])   # long documents: split into many items
    write_jsonl(data / "t" / "b.jsonl", [p for t in texts[1::2] for p in t.split("\n\n") if p.strip()])
    paragraphs = [p for t in stdlib_texts("zoneinfo") for p in t.split("\n\n") if p.strip()]
    (data / "c").mkdir(parents=True)
    (data / "c" / "chat.jsonl").write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": paragraphs[i][:60]}, {"role": "assistant", "content": paragraphs[i + 1]}]}) + "\n"
        for i in range(0, len(paragraphs) - 1, 2)))
    write_config(root, {"t": {"sources": [str(data / "t" / "*.jsonl")]},
                        "c": {"sources": [str(data / "c" / "chat.jsonl")], "format": "chat"}},
                 build={"split_size": "16KB", "row_group_tokens": 600})
    for packing in ("pack", "pad"):
        build(packed_config(root, f"register-{packing}", packing, {"kind": "none"}), scheduler=dask_scheduler,
              progress=False)
    return root


def packed_config(root: Path, name: str, packing: str, shuffle: dict[str, Any], **loader: Any) -> Path:
    base = yaml.safe_load((root / "config.yaml").read_text())
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "lake": base["lake"], "tokenizer": base["tokenizer"], "build": base["build"], "datasets": base["datasets"],
        "mixture": {"weights": {"t": 0.7, "c": 0.3}},
        "loader": {"seq_len": SEQ_LEN, "batch_size": BATCH, "prefetch": 0, "packing": packing, "shuffle": shuffle,
                   **loader}}, sort_keys=False))
    return path


def tokens_read(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Patches ChunkFiles to record, for each read of only some documents of a row group, the
    stored tokens read and the row group's."""
    reads: list[tuple[int, int]] = []
    read_documents = ChunkFiles.read_documents

    def spy(self: ChunkFiles, chunks: Any, index: int, group: int, pick: Any = None) -> Any:
        found = read_documents(self, chunks, index, group, pick)
        if pick is not None:
            whole = read_documents(self, chunks, index, group)[0]
            reads.append((sum(len(stored.values) for stored in found), len(whole.values)))
        return found

    monkeypatch.setattr(ChunkFiles, "read_documents", spy)
    return reads


def whole_groups(config: Path, steps: list[int]) -> list[dict[str, np.ndarray]]:
    """The batches of ``steps`` with every row group decoded whole (none read from pages)."""
    share = cold_pages.PAGES_SHARE
    cold_pages.PAGES_SHARE = 1 << 40
    try:
        with Loader(config) as loader:
            return [loader.batch(step) for step in steps]
    finally:
        cold_pages.PAGES_SHARE = share


@pytest.mark.parametrize("packing", ["pack", "pad"])
@pytest.mark.parametrize("shuffle", SHUFFLES, ids=[s["kind"] for s in SHUFFLES])
def test_a_packed_first_batch_reads_pages_and_equals_whole_row_groups(
        packed: Path, packing: str, shuffle: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh packed loader's first batch reads some row groups in part, fewer tokens than
    those row groups hold, and its rows are bitwise those of whole row groups; once it is out the
    row groups are decoded whole in the background and the batch read warm is the same. (Without
    a shuffle a batch's few rows reach most of the one row group they lie in: it is read whole.)"""
    config = packed_config(packed, f"cold-{packing}-{shuffle['kind']}", packing, shuffle)
    with Loader(config) as one:
        steps = np.random.default_rng(5).integers(0, 3 * one.datasets[0].train_count() // BATCH, 3).tolist()
    expected = whole_groups(config, steps)
    reads = tokens_read(monkeypatch)
    for step, wanted in zip(steps, expected):
        with Loader(config) as loader:
            before = len(reads)
            assert_batches_equal(loader.batch(step), wanted, f"cold {packing} {shuffle['kind']} step {step}")
            mine = reads[before:]
            assert mine or shuffle["kind"] == "none", "no row group read in part"   # (none: 8 rows reach most of one)
            assert not mine or sum(part for part, _ in mine) < sum(whole for _, whole in mine), mine
            loader.batch(step + 1)   # hands the first batch's row groups to the background decoder
            ahead_thread_caught_up()
            before = len(reads)
            assert_batches_equal(loader.batch(step), wanted, f"warm {packing} {shuffle['kind']} step {step}")
            assert len(reads) == before, "a row group decoded whole was read in part again"


@pytest.mark.parametrize("packing", ["pack", "pad"])
def test_a_packed_full_shuffle_beyond_the_cache_reads_pages_for_every_batch(
        packed: Path, packing: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full shuffle over more than twice the cache's bytes reads the uncached row groups of
    every packed batch from the pages its items need; rows bitwise those of whole row groups."""
    config = packed_config(packed, f"beyond-{packing}", packing, {"kind": "full"}, cache_bytes="16KB")
    steps = list(range(5))
    expected = whole_groups(config, steps)
    reads = tokens_read(monkeypatch)
    read_in_part = []
    with Loader(config) as loader:
        for step, wanted in zip(steps, expected):
            before = len(reads)
            assert_batches_equal(loader.batch(step), wanted, f"{packing} step {step}")
            read_in_part.append(len(reads) - before)
    assert all(read_in_part), read_in_part
