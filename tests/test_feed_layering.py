"""The feed's layering (issue 13): every example fills its own row (one ``fill(row)`` protocol),
``explain`` works from the loader's public ``examples(step)``, every reader cache is the one LRU,
a build's live catalog reaches only the readers given its handle, and ``num_batches()`` is a call."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pytest
import yaml

import lakeloader.feed.explain
from lakeloader.catalog.lake import Lake
from lakeloader.catalog.store import CatalogWriter, LiveCatalog
from lakeloader.contracts.errors import LakeloaderError
from lakeloader.feed.spans import Span
from lakeloader.feed.explain import explain
from lakeloader.feed.loader import Loader
from lakeloader.feed.packed import PackedExample
from lakeloader.feed.rows import fill_batch, row_of
from lakeloader.read.catalog_view import CatalogView
from lakeloader.read.lru import LRU

from conftest import assert_batches_equal

SEQ_LEN = 32
BATCH = 8


@pytest.fixture(scope="module")
def lake(two_dataset_lake: dict[str, Path]) -> dict[str, Path]:
    """Two datasets in a 0.6/0.4 mixture; a config per packing (seq_len 32, batch 8)."""
    return two_dataset_lake


def empty_like(batch: dict[str, np.ndarray], pad_id: int) -> dict[str, np.ndarray]:
    """Arrays shaped as ``batch``'s before anything is written: padding tokens, zeros elsewhere."""
    return {k: np.full_like(v, pad_id) if k in ("input_ids", "targets") else np.zeros_like(v)
            for k, v in batch.items() if k not in ("example_mask", "dataset_ids")}


@pytest.mark.parametrize("packing,mode", [("concat", "train"), ("concat", "eval"), ("pack", "train"), ("pack", "eval")])
def test_every_example_fills_its_own_row_as_the_batch_does(lake: dict[str, Path], packing: str, mode: str) -> None:
    with Loader(lake[packing], mode=mode) as loader:
        kind = Span if packing == "concat" else PackedExample
        steps = [0, 1] if mode == "train" else [0, loader.num_batches() - 1]   # the last eval batch is padded
        for step in steps:
            batch = loader.batch(step)
            found = loader.examples(step)
            assert found.step == step and found.rows.tolist() == list(range(BATCH))
            assert {type(e) for e in found.examples if e is not None} == {kind}
            one_by_one = empty_like(batch, loader.pad_id)
            for number, example in enumerate(found.examples):
                if example is not None:
                    example.fill(row_of(one_by_one, number))
            together = empty_like(batch, loader.pad_id)
            fill_batch(together, found.examples)
            expected = {k: v for k, v in batch.items() if k not in ("example_mask", "dataset_ids")}
            assert_batches_equal([one_by_one, together], [expected, expected])
            if mode == "eval":
                mask = np.array([e is not None for e in found.examples], np.float32)
                assert_batches_equal([{"m": batch["example_mask"]}], [{"m": mask}])
        if mode == "eval":
            assert found.examples[-1] is None   # the pass ends inside the last batch


@pytest.mark.parametrize("packing", ["concat", "pack"])
def test_explain_reads_the_public_examples_of_a_step(lake: dict[str, Path], packing: str) -> None:
    with Loader(lake[packing]) as loader:
        found = loader.examples(3)
        frame = explain(found, loader.view)
        assert frame.equals(loader.explain(3))
        span = ["chunk_stream_start", "chunk_stream_stop"] if packing == "concat" else ["document_start", "document_stop"]
        assert frame.columns.tolist()[-2:] == span
        for row, example in enumerate(found.examples):
            assert example is not None
            mine = frame[frame.row == row]
            assert mine.segment.tolist() == sorted(mine.segment.tolist()) and mine.segment.iloc[0] == 1
            assert set(mine.dataset) == {example.dataset} and set(mine.example) == {example.example}
            assert mine.example_stop.iloc[-1] - mine.example_start.iloc[0] == sum(
                s.example_stop - s.example_start for s in example.segments())


def test_explain_does_not_import_the_loader() -> None:
    tree = ast.parse(inspect.getsource(lakeloader.feed.explain))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert "lakeloader.feed.loader" not in imported and not any("TYPE_CHECKING" in ast.dump(n) for n in tree.body)


def test_the_lru_keeps_the_recently_used_within_its_capacity() -> None:
    counted: LRU[int, str] = LRU(3)
    computed: list[int] = []

    def value(key: int) -> str:
        computed.append(key)
        return str(key)

    for key in (0, 1, 2, 0, 3):   # 0 is used again before 3 arrives: 1 is the least recent
        assert counted.get(key, lambda key=key: value(key)) == str(key)
    assert computed == [0, 1, 2, 3] and len(counted) == 3
    counted.get(0, lambda: pytest.fail("0 stays"))
    counted.get(2, lambda: pytest.fail("2 stays"))
    counted.get(1, lambda: value(1))
    assert computed == [0, 1, 2, 3, 1]
    sized: LRU[str, bytes] = LRU(10, len)
    sized.get("big", lambda: b"x" * 25)   # larger than the capacity: kept, being the newest
    assert len(sized) == 1
    sized.get("small", lambda: b"y")
    assert len(sized) == 1   # the big one went to make room
    sized.clear()   # (what a consumer decoded while its workers started)
    assert len(sized) == 0 and "small" not in sized
    for key in "abcdefghij":   # its whole capacity again: the cleared bytes no longer count
        sized.get(key, lambda: b"z")
    assert len(sized) == 10


def test_every_reader_cache_is_the_lru(lake: dict[str, Path]) -> None:
    with Loader(lake["pack"]) as loader:
        examples = loader.datasets[0]
        caches = {"plans": examples.locator._plans, "row groups": examples.reader.tables.cache,
                  "decoded": loader.files.cache}
        assert all(isinstance(cache, LRU) for cache in caches.values()), caches
        assert (caches["plans"].capacity, caches["row groups"].capacity) == (64, 4096)
        chunks = examples.chunks.committed
        plans = [examples.locator.plan(c) for c in range(chunks)]
        assert all(examples.locator.plan(c) is plans[c] for c in range(chunks))   # cached, not recomputed


def test_the_live_catalog_reaches_only_readers_given_its_handle(lake: dict[str, Path]) -> None:
    config = lake["concat"]
    expected = Loader(config).batch(2)
    location = Lake(yaml.safe_load(config.read_text())["lake"])
    live = LiveCatalog()
    assert not live.is_open and live.cursor(location.writer_catalog_path) is None
    marker = "SELECT count(*) FROM information_schema.tables WHERE table_name = 'live_marker'"
    with CatalogWriter(location.writer_catalog_path, live) as writer:   # as a build in this process
        writer.con.execute("CREATE TABLE live_marker AS SELECT 1 AS x")
        try:
            assert live.is_open
            assert location.connect(live=live).execute(marker).fetchone() == (1,)
            assert location.connect().execute(marker).fetchone() == (0,)   # no handle: the snapshot
            assert location.connect(live=live, sandboxed=True).execute(marker).fetchone() == (0,)
            view = CatalogView(location, live=live)
            assert view.execute(marker).column(0).to_pylist() == [1]
            assert CatalogView(location).execute(marker).column(0).to_pylist() == [0]
            with Loader(config, catalog=live) as reader:
                assert_batches_equal([reader.batch(2)], [expected])
            with pytest.raises(LakeloaderError, match="one handle follows one build"):
                live.attach(writer)
            with pytest.raises(LakeloaderError, match="follows the build of .*other.duckdb"):
                live.cursor(str(Path(location.writer_catalog_path).with_name("other.duckdb")))
        finally:
            writer.con.execute("DROP TABLE live_marker")
    assert not live.is_open
    assert view.execute(marker).column(0).to_pylist() == [0]   # the build ended: its published snapshot
    with pytest.raises(duckdb.Error):
        view.execute("SELECT x FROM live_marker")


def test_num_batches_is_a_call(lake: dict[str, Path]) -> None:
    with Loader(lake["pack"], mode="eval") as loader:
        count: Any = loader.num_batches
        assert callable(count) and count() == loader.num_batches() > 0
