"""Shuffled, mixed batches: identical for any process count, on resume, and while the lake builds."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lakeloader.feed import order as order_module
from lakeloader.feed import workers as workers_module
from lakeloader.feed.loader import Loader

from conftest import (
    Lakes,
    assert_batches_equal,
    global_batches,
    loader_during_build,
    start_build_thread,
    stdlib_texts,
    write_config,
    write_corpus,
)

STEPS = 12


def mixed_request(shuffle: dict, **loader: object) -> dict[str, Any]:
    """Corpus, datasets and config sections of the two-dataset mixed lake."""
    return {
        "corpus": {"code.jsonl": stdlib_texts("json") + stdlib_texts("email", limit=10),
                   "more.jsonl": stdlib_texts("email", limit=25)[10:],
                   "notes.txt": "".join(f"{line}\n" for t in stdlib_texts("json")
                                        for line in t.splitlines() if line.strip())},
        "datasets": {"code": {"sources": ["*.jsonl"]}, "notes": {"sources": ["notes.txt"]}},
        "build": {"split_size": "8KB"},
        "loader": {"seq_len": 32, "batch_size": 16, "shuffle": shuffle, "seed": 7, **loader},
        "mixture": {"weights": {"code": 0.8, "notes": 0.2}},
    }


def mixed_config(tmp_path: Path, shuffle: dict, **loader: object) -> Path:
    """The mixed lake's data and config in ``tmp_path``, not built."""
    request = mixed_request(shuffle, **loader)
    write_corpus(tmp_path / "data", request.pop("corpus"))
    datasets = {name: {"sources": [str(tmp_path / "data" / s) for s in spec["sources"]]}
                for name, spec in request.pop("datasets").items()}
    return write_config(tmp_path, datasets, **request)


def mixed_lake(lakes: Lakes, shuffle: dict, **sections: Any) -> Path:
    """Config of the shared built mixed lake (``sections`` replace config sections; read only)."""
    request = {**mixed_request(shuffle), **sections}
    return lakes.shared(request.pop("corpus"), request.pop("datasets"), **request)


@pytest.mark.parametrize("kind", ["none", "window", "block", "full"])
def test_same_batches_for_any_process_count_and_resume(lakes: Lakes, kind: str) -> None:
    config = mixed_lake(lakes, {"kind": kind, "window_chunks": 2, "block_size": 8, "window_blocks": 3})
    reference = global_batches(config, 1, range(STEPS))
    for processes in (2, 4, 8):
        assert_batches_equal(global_batches(config, processes, range(STEPS)), reference)
    loader = Loader(config)
    for start in range(STEPS):
        got = [b for _, b in zip(range(STEPS - start), loader.iter_from(loader.state(start)))]
        assert_batches_equal(got, reference[start:])
    if kind != "none":  # shuffled: the order differs from the stored order
        plain = mixed_lake(lakes, {"kind": "none"})
        assert not np.array_equal(global_batches(plain, 1, range(STEPS))[0]["input_ids"], reference[0]["input_ids"])


def test_shuffle_changes_every_epoch(lakes: Lakes) -> None:
    config = mixed_lake(lakes, {"kind": "full"})
    examples = Loader(config).datasets[1]
    per_epoch = examples.train_count()
    first = [examples.train(np.array([j]))[0].example for j in range(per_epoch)]
    second = [examples.train(np.array([per_epoch + j]))[0].example for j in range(per_epoch)]
    assert sorted(first) == sorted(second) == list(range(per_epoch))
    assert first != second
    assert {examples.train(np.array([per_epoch + j]))[0].epoch for j in range(3)} == {1}


@pytest.mark.parametrize("packing", ["concat", "pack"])
def test_window_shuffle_while_building_equals_after(tmp_path: Path, packing: str) -> None:
    """A reader in the build driver's process reads shuffled batches from the live catalog while
    chunks (and, for pack, their example counts) are still being committed; they equal the
    batches read after the build."""
    config = mixed_config(tmp_path, {"kind": "window", "window_chunks": 2}, wait_timeout=120, packing=packing)
    builder, live, errors = start_build_thread(config, workers=1, progress=False)
    during_loader = loader_during_build(config, builder, live)
    committed_at_start = [d.chunks.committed for d in during_loader.datasets]
    during = [during_loader.batch(step) for step in range(STEPS)]
    builder.join()
    assert not errors, errors
    assert any(c < d.chunks.planned for c, d in zip(committed_at_start, during_loader.datasets))
    assert_batches_equal(during, global_batches(config, 1, range(STEPS)))


@pytest.mark.parametrize("packing", ["concat", "pack"])
@pytest.mark.parametrize("while_starting", [True, False])
def test_workers_read_while_building_equals_after(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   while_starting: bool, packing: str) -> None:
    """``loader.workers: 2`` in the build driver's process while chunks are still being committed:
    the consumer reads the live catalog (building the first batches itself while its workers
    start, or leaving every batch to them), the workers read the published snapshots and wait for
    chunks (and, for pack, their plans, kept in each process's item-table arena) as one process
    does; the batches equal those read after the build."""
    monkeypatch.setattr(workers_module, "BUILD_WHILE_STARTING", while_starting)
    config = mixed_config(tmp_path, {"kind": "window", "window_chunks": 2}, wait_timeout=120, workers=2,
                          packing=packing)
    builder, live, errors = start_build_thread(config, workers=1, progress=False)
    during_loader = loader_during_build(config, builder, live)
    committed_at_start = [d.chunks.committed for d in during_loader.datasets]
    iterator = during_loader.iter_from(0)
    during = [{name: values.copy() for name, values in batch.items()} for batch in itertools.islice(iterator, STEPS)]
    iterator.close()
    builder.join()
    assert not errors, errors
    assert any(c < d.chunks.planned for c, d in zip(committed_at_start, during_loader.datasets))
    assert_batches_equal(during, global_batches(config, 1, range(STEPS)))


def test_resume_across_a_stage_boundary(lakes: Lakes) -> None:
    staged = mixed_lake(
        lakes, {"kind": "window", "window_chunks": 2},
        mixture={"stages": [{"start_step": 0, "weights": {"code": 0.9, "notes": 0.1}},
                            {"start_step": 5, "weights": {"code": 0.2, "notes": 0.8}}]})
    reference = global_batches(staged, 1, range(STEPS))
    assert_batches_equal(global_batches(staged, 4, range(STEPS)), reference)
    loader = Loader(staged)
    for start in (3, 4, 5, 6):
        got = [b for _, b in zip(range(STEPS - start), loader.iter_from(loader.state(start)))]
        assert_batches_equal(got, reference[start:])
    owners = [{w.dataset for w in loader.examples(step).examples} for step in (4, 5)]
    shares = [sum(w.dataset == "notes" for w in loader.examples(step).examples) for step in (4, 5)]
    assert owners[0] and shares[0] < shares[1]  # the second stage favours notes


@pytest.mark.parametrize("stop", ["first_exhausted", "all_exhausted"])
def test_stop_strategies_end_the_stream_exactly(lakes: Lakes, stop: str) -> None:
    from lakeloader.index.mixture import stop_step

    config = mixed_lake(lakes, {"kind": "none"}, mixture={**mixed_request({})["mixture"], "stop": stop})
    loader = Loader(config)
    sizes = [d.train_count() for d in loader.datasets]
    expected = stop_step(list(loader.mixer.stages), 16, sizes, stop)
    assert loader.num_batches() == expected > 0
    batches = list(loader.iter_from(max(0, expected - 2)))
    assert len(batches) == min(2, expected)
    used = {name: 0 for name in loader.mixer.names}
    for step in range(expected):
        for window in loader.examples(step).examples:
            used[window.dataset] = max(used[window.dataset], window.epoch * 10**9 + window.example + 1)
    if stop == "first_exhausted":  # nothing is read twice, and some dataset is (nearly) used up
        assert all(v <= size for v, size in zip(used.values(), sizes))
    else:  # every dataset was read completely at least once
        assert all(v >= size for v, size in zip(used.values(), sizes))
    with pytest.raises(IndexError):
        loader.batch(expected)


@pytest.mark.parametrize("kind", ["window", "block", "full"])
def test_positions_shuffled_in_cached_blocks_equal_the_plain_shuffle(lakes: Lakes, kind: str) -> None:
    # A batch's positions inside one block (the common case), across a block's end, and scattered
    # over several blocks in any order with repeats: each as the shuffle maps it without blocks.
    loader = Loader(mixed_lake(lakes, {"kind": kind, "window_chunks": 2, "block_size": 8, "window_blocks": 3}))
    dataset = loader.datasets[0]
    per_epoch = dataset.train_count()
    block = order_module.SHUFFLE_BLOCK
    rng = np.random.default_rng(3)
    for positions in (np.arange(5 * block + 17, 5 * block + 81), np.arange(2 * block - 30, 2 * block + 34),
                      rng.integers(0, 7 * block, 300), np.array([block - 1])):
        epochs, examples = dataset.order.train_examples(positions)
        np.testing.assert_array_equal(epochs, positions // per_epoch)
        np.testing.assert_array_equal(examples, dataset.order._shuffled(positions, per_epoch))
    loader.close()
