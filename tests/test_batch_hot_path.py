"""The per-batch hot path: each row group is decoded once, even for packed examples that need
their documents' parts after rendering (image positions, seq2seq response splits); windows
located together fill a batch exactly as one at a time; the two offset tables of concat and
packed examples keep their own names."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lakeloader.feed.locate_spans import SpanLocator
from lakeloader.feed.spans import Span
from lakeloader.feed.loader import Loader
from lakeloader.feed.locate_packed import PackedLocator
from lakeloader.feed.rows import ROW_FIELDS
from lakeloader.ingest.driver import build
from lakeloader.read.chunks import RowGroup

from conftest import write_config
from test_formats import write_corpora

SEQ_LEN, BATCH = 128, 8


@pytest.fixture(scope="module")
def formats(tmp_path_factory: pytest.TempPathFactory, dask_scheduler: str) -> tuple[Path, dict[str, Any]]:
    """A lake of interleaved pages and supervised records (the task formats that read parts)."""
    tmp = tmp_path_factory.mktemp("hot-path")
    datasets = write_corpora(tmp / "data")
    datasets = {"pages": datasets["pages"], "sft": {**datasets["sft"], "supervised": {"output": "seq2seq"}}}
    return tmp, datasets


def _folder(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _config(formats: tuple[Path, dict[str, Any]], name: str, dask_scheduler: str, **loader: Any) -> Path:
    tmp, datasets = formats
    config = write_config(_folder(tmp / name), {name: datasets[name]}, build={"split_size": "16KB"},
                          loader={"seq_len": SEQ_LEN, "batch_size": BATCH, "packing": "pack",
                                  "pack": {"long_documents": "truncate"}, **loader})
    build(config, scheduler=dask_scheduler, progress=False)
    return config


@pytest.mark.parametrize("name", ["pages", "sft"])
def test_packed_examples_with_parts_decode_each_row_group_once(formats: tuple[Path, dict[str, Any]],
                                                                dask_scheduler: str, name: str) -> None:
    config = _config(formats, name, dask_scheduler)
    with Loader(config, mode="eval") as loader:
        files = loader.files
        reads: Counter[tuple[int, int]] = Counter()
        read_row_group = files.read_row_group

        def counted(chunks: Any, index: int, group: int) -> RowGroup:
            reads[index, group] += 1
            return read_row_group(chunks, index, group)

        files.read_row_group = counted  # type: ignore[method-assign]
        batches = [loader.batch(step) for step in range(loader.num_batches() or 0)]
        assert reads and max(reads.values()) == 1, "a row group was decoded more than once"
        assert not any(isinstance(value, RowGroup) for value, _ in files.cache._items.values())
    assert isinstance(loader.datasets[0].locator, PackedLocator)
    if name == "pages":   # the image references travel with the batches
        assert any(ref for batch in batches for ref in batch["image_refs"].ravel())
    else:                 # the prompt side is filled
        assert all((batch["inputs_segment_ids"] > 0).any() for batch in batches)


def test_offset_tables_are_named_for_what_they_count(formats: tuple[Path, dict[str, Any]], dask_scheduler: str) -> None:
    tmp, datasets = formats
    packed = _config(formats, "pages", dask_scheduler)
    concat = write_config(_folder(tmp / "concat"), {"sft": {**datasets["sft"], "supervised": {}}}, build={"split_size": "16KB"},
                          loader={"seq_len": SEQ_LEN, "batch_size": BATCH, "packing": "concat"})
    build(concat, scheduler=dask_scheduler, progress=False)
    with Loader(packed) as loader:
        examples = loader.datasets[0]
        assert isinstance(examples.locator, PackedLocator)
        assert not hasattr(examples.locator, "stream_offsets") and not hasattr(examples.locator, "offsets")
        assert int(examples.locator.example_offsets()[-1]) == examples.train_count()
    with Loader(concat) as loader:
        spans = loader.datasets[0]
        assert type(spans.locator) is SpanLocator
        assert not hasattr(spans.locator, "example_offsets") and not hasattr(spans.locator, "offsets")
        assert (int(spans.locator.stream_offsets()[-1]) - 1) // SEQ_LEN == spans.train_count()


def test_windows_located_together_fill_rows_as_one_at_a_time(formats: tuple[Path, dict[str, Any]],
                                                             dask_scheduler: str) -> None:
    """Some windows of a batch lie inside one row group, some across row groups or chunks: the
    batch equals the rows each filled alone from the window's pieces (the general path)."""
    tmp, datasets = formats
    config = write_config(_folder(tmp / "mixed"), {"sft": {**datasets["sft"], "supervised": {}}}, build={"split_size": "4KB"},
                          loader={"seq_len": SEQ_LEN, "batch_size": 32, "packing": "concat",
                                  "shuffle": {"kind": "full"}})
    build(config, scheduler=dask_scheduler, progress=False)
    with Loader(config) as loader:
        kinds = set()
        for step in range(6):
            batch = loader.batch(step)
            windows = loader.examples(step).examples
            kinds |= {w.located is not None and int(w.located.group[w.index]) >= 0 for w in windows}  # type: ignore[union-attr]
            for row, window in enumerate(windows):
                assert isinstance(window, Span)
                alone = Span(window.dataset, window.epoch, window.example, list(window.pieces))
                arrays = {name: np.full((1, SEQ_LEN), -7, batch[name].dtype) for name in ROW_FIELDS}
                Span.fill_rows(arrays, [0], [alone])
                for name in ROW_FIELDS:
                    assert np.array_equal(arrays[name][0], batch[name][row]), (step, row, name)
        assert kinds == {True, False}, "the lake should give windows of both kinds"
