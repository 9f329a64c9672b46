"""Shuffled, mixed batches: identical for any process count, on resume, and while the lake builds."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import stdlib_texts, write_config, write_jsonl

from lakeloader.build.driver import build
from lakeloader.catalog import store
from lakeloader.feed.loader import Loader
from lakeloader.lake import Lake

STEPS = 12


def mixed_config(tmp_path: Path, shuffle: dict, **loader: object) -> Path:
    data = tmp_path / "data"
    write_jsonl(data / "code.jsonl", stdlib_texts("json") + stdlib_texts("email", limit=10))
    write_jsonl(data / "more.jsonl", stdlib_texts("email", limit=25)[10:])
    (data / "notes.txt").write_text("".join(f"{line}\n" for t in stdlib_texts("json")
                                            for line in t.splitlines() if line.strip()))
    return write_config(
        tmp_path,
        {"code": {"sources": [str(data / "*.jsonl")]}, "notes": {"sources": [str(data / "notes.txt")]}},
        build={"split_size": "8KB"},
        loader={"seq_len": 32, "batch_size": 16, "shuffle": shuffle, "seed": 7, **loader},
        mixture={"weights": {"code": 0.8, "notes": 0.2}},
    )


def global_batches(config: Path, processes: int, first: int = 0) -> list[dict[str, np.ndarray]]:
    loaders = [Loader(config, process_index=p, process_count=processes) for p in range(processes)]
    out = []
    for step in range(first, STEPS):
        parts = [loader.batch(step) for loader in loaders]
        out.append({k: np.concatenate([p[k] for p in parts]) for k in parts[0]})
    return out


def assert_equal(a: list[dict[str, np.ndarray]], b: list[dict[str, np.ndarray]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in x:
            assert x[key].dtype == y[key].dtype and np.array_equal(x[key], y[key]), key


@pytest.mark.parametrize("kind", ["none", "window", "block", "full"])
def test_same_batches_for_any_process_count_and_resume(tmp_path: Path, dask_scheduler: str, kind: str) -> None:
    config = mixed_config(tmp_path, {"kind": kind, "window_chunks": 2, "block_size": 8, "window_blocks": 3})
    build(config, scheduler=dask_scheduler, progress=False)
    reference = global_batches(config, 1)
    for processes in (2, 4, 8):
        assert_equal(global_batches(config, processes), reference)
    loader = Loader(config)
    for start in range(STEPS):
        got = [b for _, b in zip(range(STEPS - start), loader.iter_from(loader.state(start).to_dict()))]
        assert_equal(got, reference[start:])
    if kind != "none":  # shuffled: the order differs from the stored order
        plain = mixed_config(tmp_path / "plain", {"kind": "none"})
        build(plain, scheduler=dask_scheduler, progress=False)
        assert not np.array_equal(global_batches(plain, 1)[0]["input_ids"], reference[0]["input_ids"])


def test_shuffle_changes_every_epoch(tmp_path: Path, dask_scheduler: str) -> None:
    config = mixed_config(tmp_path, {"kind": "full"})
    build(config, scheduler=dask_scheduler, progress=False)
    examples = Loader(config).datasets[1]
    per_epoch = examples.train_count()
    first = [examples.train_window(j).example for j in range(per_epoch)]
    second = [examples.train_window(per_epoch + j).example for j in range(per_epoch)]
    assert sorted(first) == sorted(second) == list(range(per_epoch))
    assert first != second
    assert {examples.train_window(per_epoch + j).epoch for j in range(3)} == {1}


def test_window_shuffle_while_building_equals_after(tmp_path: Path) -> None:
    """A reader in the build driver's process reads shuffled batches from the live catalog while
    chunks are still being committed; they equal the batches read after the build."""
    config = mixed_config(tmp_path, {"kind": "window", "window_chunks": 2}, wait_timeout=120)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            build(config, workers=1, progress=False)
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    builder = threading.Thread(target=run)
    builder.start()
    lake = Lake(str(tmp_path / "lake"))
    deadline = time.monotonic() + 60
    while store.active_writer(lake.writer_catalog_path) is None and builder.is_alive():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    during_loader = None
    while during_loader is None and builder.is_alive():
        try:
            during_loader = Loader(config)
        except Exception:  # the plan is not registered yet
            time.sleep(0.01)
    assert during_loader is not None, "the build finished before a reader could start"
    committed_at_start = [d.chunks.committed for d in during_loader.datasets]
    during = [during_loader.batch(step) for step in range(STEPS)]
    builder.join()
    assert not errors, errors
    assert any(c < d.chunks.planned for c, d in zip(committed_at_start, during_loader.datasets))
    assert_equal(during, global_batches(config, 1))
