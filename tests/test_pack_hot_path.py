"""The ``packing: pack`` batch path works on whole batches: a batch's packed examples are located
with array operations (each rendered row group looked up once per batch, not once per document),
and their rows are filled together, padding included, exactly as each example filling its own
padded row."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from lakeloader.feed.loader import LOCATE_AHEAD, Loader
from lakeloader.feed.packed import LocatedPacked, PackedExample, fill_packed
from lakeloader.feed.rows import row_of
from lakeloader.read import read_ahead

from conftest import ahead_thread_caught_up, assert_batches_equal
from test_formats import build_packed_mixture

SEQ_LEN, BATCH = 96, 16


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory, dask_scheduler: str) -> Path:
    """Plain text, chat (loss only on some tokens), FIM code and interleaved pages (images), packed."""
    return build_packed_mixture(tmp_path_factory.mktemp("pack-hot-path"), ("web", "chat", "code", "pages"),
                                split_size="16KB", seq_len=SEQ_LEN, batch_size=BATCH, scheduler=dask_scheduler)


def _padded(batch: dict[str, np.ndarray], rows: int, pad_id: int) -> dict[str, np.ndarray]:
    """Arrays shaped like ``batch``'s with ``rows`` rows of padding (as an evaluation batch starts)."""
    fill = {"input_ids": pad_id, "targets": pad_id, "image_positions": -1, "image_refs": ""}
    return {name: np.full((rows, *values.shape[1:]), fill.get(name, 0), values.dtype)
            for name, values in batch.items() if name not in ("dataset_ids", "example_mask")}


def test_packed_rows_filled_together_equal_one_at_a_time(lake: Path) -> None:
    """Training rows (written whole, padding included, into reused arrays) equal each example's
    :meth:`PackedExample.fill` into a padded row, and so do rows filled in any order."""
    with Loader(lake) as loader:
        assert loader._whole_rows, "training rows of packed examples are written once, padding included"
        trainable = images = 0
        for step in range(8):
            batch = loader.batch(step)
            examples = loader.examples(step).examples
            assert all(isinstance(e, PackedExample) for e in examples)
            alone = _padded(batch, len(examples), loader.pad_id)
            for number, example in enumerate(examples):
                example.fill(row_of(alone, number))   # type: ignore[union-attr]
            for name in alone:
                assert np.array_equal(alone[name], batch[name]), (step, name)
            # Rows scattered in another order (not a block) come out the same.
            order = list(range(len(examples)))[::-1]
            scattered = _padded(batch, len(examples), loader.pad_id)
            fill_packed(scattered, order, [examples[i] for i in order])  # type: ignore[misc]
            for name in alone:
                assert np.array_equal(scattered[name], batch[name]), (step, name, "scattered")
            trainable += int(((batch["segment_ids"] > 0) & (batch["loss_mask"] == 0)).sum())
            images += int((batch["image_positions"] >= 0).sum())
            assert (batch["input_ids"][batch["segment_ids"] == 0] == loader.pad_id).all()
        assert trainable and images, "the batches should hold untrained tokens and images"


def test_each_row_group_looked_up_once_per_batch(lake: Path) -> None:
    """Locating a batch's documents asks the reader for each rendered row group once, however
    many of the batch's documents it holds (not once per document)."""
    with Loader(lake) as loader:
        web = loader.datasets[loader.mixer.names.index("web")]
        calls: list[tuple[int, int]] = []
        rendered_group = web.reader.rendered_group

        def counted(chunks: Any, chunk: int, group: int) -> Any:
            calls.append((chunk, group))
            return rendered_group(chunks, chunk, group)

        web.reader.rendered_group = counted   # type: ignore[method-assign]
        documents = 0
        for step in range(6):
            calls.clear()
            examples = [e for e in loader.examples(step).examples if e is not None and e.dataset == "web"]
            documents += sum(len(e.items) for e in examples)   # type: ignore[attr-defined]
            assert len(calls) == len(set(calls)), (step, calls)
        assert documents > 6 * 2, "some rows should hold several documents"
        loader.batch(0)


@pytest.mark.parametrize("packing", ["pack", "concat"])
def test_a_batch_decodes_its_missing_row_groups_concurrently(lake: Path, tmp_path: Path, packing: str) -> None:
    """A shuffled first batch needs many row groups none of which is cached: they are decoded in
    the reader's decode threads, not one after another in the thread building the batch, and the
    batch is the same as one built from row groups decoded one at a time."""
    config = yaml.safe_load(lake.read_text())
    config["loader"]["packing"] = packing
    if packing == "concat":   # concat windows cannot hold images: the other datasets
        del config["datasets"]["pages"], config["mixture"]["weights"]["pages"]
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    with Loader(path) as loader:
        threads: list[str] = []
        for examples in loader.datasets:
            render = examples.reader.renderings.render

            def recorded(*args: Any, render: Any = render) -> Any:
                threads.append(threading.current_thread().name)
                return render(*args)

            examples.reader.renderings.render = recorded   # type: ignore[method-assign]
        together = loader.batch(0)
        # (a dataset missing a single row group decodes it in place)
        assert sum(name.startswith("lakeloader-decode") for name in threads) >= 2, threads
    with Loader(path) as loader:
        for examples in loader.datasets:
            examples.reader.rendered_groups = lambda chunks, wanted, reader=examples.reader: [  # type: ignore[method-assign]
                reader.rendered_group(chunks, chunk, group) for chunk, group in wanted]
        assert_batches_equal([together], [loader.batch(0)])


def test_packed_readers_in_stream_order_decode_row_groups_ahead(lake: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                catalog_query_threads: set[str]) -> None:
    """Without a shuffle, each dataset's reader has the row groups after the last one a batch
    reached decoded in the background thread, so after the batch where a dataset first appears
    and the one after it (the first reads pages; the row groups it read in part are decoded whole
    when the next batch is asked for, which may find them not yet decoded), every row group its
    batches need was decoded there (none in the thread building the batch or in the decode threads). That thread never queries the catalog. Batches bitwise those of a
    loader that decodes nothing ahead."""
    config = yaml.safe_load(lake.read_text())
    config["loader"]["shuffle"] = {"kind": "none"}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    steps = 40
    decoded: dict[str, list[tuple[int, str]]] = {}
    step = 0
    with Loader(path) as loader:
        for examples in loader.datasets:
            render = examples.reader.renderings.render

            def recorded(*args: Any, render: Any = render, name: str = examples.name) -> Any:
                decoded.setdefault(name, []).append((step, threading.current_thread().name))
                return render(*args)

            examples.reader.renderings.render = recorded   # type: ignore[method-assign]
        ahead = []
        for step in range(steps):
            ahead.append(loader.batch(step))
            ahead_thread_caught_up()   # the ahead thread has caught up
    assert set(decoded) == {"web", "chat", "code", "pages"}, decoded.keys()
    for name, found in decoded.items():
        first = min(at for at, _ in found)
        elsewhere = [(at, thread) for at, thread in found
                     if at > first + 1 and not thread.startswith("lakeloader-decode-ahead")]
        assert not elsewhere, (name, elsewhere)
        assert any(thread.startswith("lakeloader-decode-ahead") for _, thread in found), (name, found)
    later = [at for found in decoded.values() for at, _ in found if at > min(a for a, _ in found)]
    assert len(later) >= 2, decoded   # row groups reached after a dataset's first batch
    assert catalog_query_threads == {threading.main_thread().name}, catalog_query_threads
    monkeypatch.setattr(read_ahead, "LOOK_AHEAD_GROUPS", 0)
    with Loader(path) as loader:
        assert_batches_equal(ahead, [loader.batch(step) for step in range(steps)])


@pytest.mark.parametrize("shuffle", ["none", "full"])
@pytest.mark.parametrize("dataset", ["web", "chat"])
def test_steps_in_order_from_cached_row_groups_equal_each_step_alone(lake: Path, tmp_path: Path, dataset: str,
                                                                     shuffle: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the steps a loader locates together (asked in order) find every row group they need
    cached (a second epoch), their fill parts are made once for the block and sliced for each
    step. Every batch, and each row filled alone from the step's examples (provenance), is bitwise
    what a loader asked each step alone makes (seeks, in reverse order), on 1 and 2 processes;
    with one process and no shuffle, a long document's rows that continue from one step into the
    next in a block included."""
    config = yaml.safe_load(lake.read_text())
    config["loader"].update(shuffle={"kind": shuffle}, batch_size=2)   # (many steps: many boundaries between them)
    config["mixture"]["weights"] = {dataset: 1}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    blocks: list[int] = []
    parts_of = LocatedPacked.parts_of
    monkeypatch.setattr(LocatedPacked, "parts_of", lambda self, size: blocks.append(len(self)) or parts_of(self, size))
    for processes in (1, 2):
        for process in range(processes):
            with Loader(path, process_index=process, process_count=processes) as loader:
                epoch = loader.datasets[0].train_count() // 2
                steps = list(range(2 * epoch + 2 * LOCATE_AHEAD + 1))
                blocks.clear()
                in_order = [loader.batch(step) for step in steps]
                assert blocks and set(blocks) == {LOCATE_AHEAD * loader.rows}, (processes, blocks)
                examples = [loader.examples(step).examples for step in steps]
                for step in steps[epoch + LOCATE_AHEAD:]:   # (all in blocks of cached row groups)
                    alone = _padded(in_order[step], len(examples[step]), loader.pad_id)
                    for number, example in enumerate(examples[step]):
                        example.fill(row_of(alone, number))   # type: ignore[union-attr]
                    assert_batches_equal(alone, {k: v for k, v in in_order[step].items() if k in alone},
                                         "rows filled alone", [step])
                # A document's rows that continue across a boundary inside a block (1 + 8k, ...)
                ends = [(examples[s][-1].items[-1], examples[s + 1][0].items[0])   # type: ignore[union-attr]
                        for s in steps[epoch + LOCATE_AHEAD : -1] if s % LOCATE_AHEAD]
                continued = sum((a.chunk, a.doc, a.stop) == (b.chunk, b.doc, b.start) for a, b in ends)
                assert continued or processes > 1 or shuffle == "full", "no document continued into the next step"
            with Loader(path, process_index=process, process_count=processes) as loader:
                blocks.clear()
                alone_batches = {step: loader.batch(step) for step in reversed(steps)}
                assert not blocks
            assert_batches_equal(in_order, [alone_batches[step] for step in steps], f"{processes} processes", steps)
