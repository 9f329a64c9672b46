"""Model-based: random sessions of what a trainer does with loaders over one lake (open one with
any ``loader.workers``, ``prefetch`` and ``fields``, as any of two processes, from a step or a
saved state; take batches, keep some and write into them, save states, ask for steps directly,
close or abandon iterators) checked against an oracle: the batches of one process building each
step alone, every field. Every batch is bitwise the oracle's rows (its fields the loader makes),
kept batches stay as their owner left them, and no worker process or shared-memory segment
outlives the session."""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from lakeloader.feed import workers as workers_module
from lakeloader.feed.loader import Loader
from lakeloader.feed.rows import ROW_FIELDS, Batch
from lakeloader.ingest.driver import build

from conftest import (FIELD_CHOICES, assert_batches_equal, children, shm_segments, spawned_workers, stdlib_texts,
                      with_fields, write_config, write_jsonl)

BATCH = 8
SCRIBBLE = -7   # what a user writes into a batch it keeps


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory, dask_scheduler: str) -> Path:
    """Two datasets mixed 3:2, both packings registered, small row groups (many per batch)."""
    root = tmp_path_factory.mktemp("model")
    write_jsonl(root / "data" / "a.jsonl", stdlib_texts("json"))
    write_jsonl(root / "data" / "b.jsonl", stdlib_texts("email", limit=12))
    config = write_config(root, {"a": {"sources": [str(root / "data" / "a.jsonl")]},
                                 "b": {"sources": [str(root / "data" / "b.jsonl")]}},
                          build={"split_size": "8KB", "row_group_tokens": 500},
                          mixture={"weights": {"a": 0.6, "b": 0.4}},
                          loader={"seq_len": 32, "batch_size": BATCH, "packing": "pack"})
    build(config, scheduler=dask_scheduler, progress=False)
    return root


def config_of(lake: Path, packing: str, shuffle: str, workers: int = 0, prefetch: int = 0,
              fields: tuple[str, ...] = ROW_FIELDS) -> Path:
    base = yaml.safe_load((lake / "config.yaml").read_text())
    base["loader"] = {"seq_len": 32, "batch_size": BATCH, "seed": 5, "packing": packing, "shuffle": shuffle,
                      "workers": workers, "prefetch": prefetch, "fields": list(fields)}
    path = lake / f"model-{packing}-{shuffle}-{workers}-{prefetch}-{'-'.join(fields)}.yaml"
    path.write_text(yaml.safe_dump(base, sort_keys=False))
    return path


class Oracle:
    """Batch ``step`` of one process with no workers and no read-ahead, built alone (copies)."""

    def __init__(self, config: Path) -> None:
        self.loader = Loader(config)
        self.batches: dict[int, Batch] = {}

    def rows(self, step: int, rows: np.ndarray, fields: tuple[str, ...] = ROW_FIELDS) -> Batch:
        """Rows ``rows`` of batch ``step``: the row fields ``fields`` and the others (dataset ids)."""
        if step not in self.batches:
            self.batches[step] = {k: v.copy() for k, v in self.loader.batch(step).items()}
        return {k: v[rows] for k, v in with_fields(self.batches[step], fields).items()}


def sessions(lake: Path, oracles: dict[tuple[str, str], Oracle]) -> type[RuleBasedStateMachine]:
    """The state machine of one trainer's session over ``lake`` (oracles shared across runs)."""

    class TrainingSession(RuleBasedStateMachine):
        @initialize(packing=st.sampled_from(["concat", "pack"]), shuffle=st.sampled_from(["none", "block", "full"]))
        def choose_data(self, packing: str, shuffle: str) -> None:
            key = (packing, shuffle)
            if key not in oracles:
                oracles[key] = Oracle(config_of(lake, packing, shuffle))
            self.packing, self.shuffle, self.oracle = packing, shuffle, oracles[key]
            self.children_before = children(os.getpid())
            self.loader: Loader | None = None
            self.iterator: Any = None
            self.next_step = 0
            self.saved: list[tuple[dict[str, Any], int]] = []
            self.kept: list[tuple[Batch, Batch]] = []   # (batch as the user holds it, what it must read)

        def _expected(self, step: int) -> Batch:
            assert self.loader is not None
            return self.oracle.rows(step, self.loader.row_indices, tuple(self.loader.config.loader.fields))

        @rule(workers=st.sampled_from([0, 1, 2]), prefetch=st.sampled_from([0, 2]),
              process=st.sampled_from([(0, 1), (0, 2), (1, 2)]), while_starting=st.booleans(),
              start=st.integers(0, 30), from_saved=st.booleans(), close_before=st.booleans(),
              first=st.integers(1, 12), fields=st.sampled_from(FIELD_CHOICES))
        def open_loader(self, workers: int, prefetch: int, process: tuple[int, int], while_starting: bool,
                        start: int, from_saved: bool, close_before: bool, first: int, fields: tuple[str, ...]) -> None:
            """A (new) loader making the row fields ``fields`` and an iterator from a step or a
            saved state (saved by a loader of any fields), and its ``first`` batches; the previous
            loader closed or its iterator abandoned (collected)."""
            if self.loader is not None and close_before:
                self.loader.close()
            self.iterator = self.loader = None
            gc.collect()
            workers_module.BUILD_WHILE_STARTING = while_starting
            self.loader = Loader(config_of(lake, self.packing, self.shuffle, workers, prefetch, fields),
                                 process_index=process[0], process_count=process[1])
            if from_saved and self.saved:
                state, self.next_step = self.saved[start % len(self.saved)]
                self.iterator = self.loader.restore(state)
            else:
                self.next_step = start
                self.iterator = self.loader.iter_from(start)
            self.take(first, "none")

        @precondition(lambda self: self.iterator is not None)
        @rule(count=st.integers(1, 12), keep=st.sampled_from(["none", "batch", "slice"]))
        def take(self, count: int, keep: str) -> None:
            """The next ``count`` batches, each checked; ``keep``: each kept whole or as a slice."""
            for _ in range(count):
                batch = next(self.iterator)
                expected = self._expected(self.next_step)
                assert_batches_equal([batch], [expected], steps=[self.next_step])
                if keep == "batch":
                    self.kept.append((batch, expected))
                elif keep == "slice":   # a view kept after the batch is dropped
                    self.kept.append(({"input_ids": batch["input_ids"][:, 2:9]}, {"input_ids": expected["input_ids"][:, 2:9]}))
                del batch
                self.next_step += 1

        @precondition(lambda self: self.iterator is not None)
        @rule()
        def save_state(self) -> None:
            assert self.loader is not None
            self.saved.append((self.loader.state(self.next_step), self.next_step))

        @precondition(lambda self: self.loader is not None)
        @rule(step=st.integers(0, 40))
        def batch_directly(self, step: int) -> None:
            """``Loader.batch`` beside a running iterator (its caches and array pool shared)."""
            assert self.loader is not None
            assert_batches_equal([self.loader.batch(step)], [self._expected(step)], steps=[step])

        @precondition(lambda self: bool(self.kept))
        @rule(which=st.integers(0, 100))
        def scribble_on_a_kept_batch(self, which: int) -> None:
            """The user writes into a batch it keeps: its own memory, no later batch sees it."""
            batch, expected = self.kept[which % len(self.kept)]
            for name, values in batch.items():
                values[...] = SCRIBBLE
                expected[name] = np.full_like(expected[name], SCRIBBLE)

        @precondition(lambda self: bool(self.kept))
        @rule(keep=st.integers(0, 3))
        def drop_kept(self, keep: int) -> None:
            del self.kept[keep:]

        @precondition(lambda self: self.iterator is not None)
        @rule()
        def close_iterator(self) -> None:
            self.iterator.close()
            self.iterator = None

        @invariant()
        def kept_batches_read_as_left(self) -> None:
            for batch, expected in getattr(self, "kept", []):
                assert_batches_equal([batch], [expected], "kept")

        def teardown(self) -> None:
            self.iterator = None
            if getattr(self, "loader", None) is not None:
                self.loader.close()   # type: ignore[union-attr]
            self.loader = None
            self.kept = []
            gc.collect()
            workers_module.BUILD_WHILE_STARTING = True
            deadline = time.monotonic() + 30
            while (spawned_workers(self.children_before) or shm_segments(os.getpid())) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not spawned_workers(self.children_before), "worker processes outlived the session"
            assert not shm_segments(os.getpid()), "shared-memory segments outlived the session"

    return TrainingSession


def test_random_training_sessions_match_one_process(lake: Path) -> None:
    oracles: dict[tuple[str, str], Oracle] = {}
    try:
        run_state_machine_as_test(sessions(lake, oracles), settings=settings(
            max_examples=10, stateful_step_count=10, deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]))
    finally:
        workers_module.BUILD_WHILE_STARTING = True
        for oracle in oracles.values():
            oracle.loader.close()


@pytest.mark.parametrize("packing", ["concat", "pack"])
def test_fewer_fields_resume_any_state_with_the_same_rows(lake: Path, packing: str) -> None:
    """A loader making only input ids and targets resumes a state saved by one making every field
    (the fields are not part of what a state names), and its rows are the full loader's."""
    full = Loader(config_of(lake, packing, "full"))
    fewer = Loader(config_of(lake, packing, "full", fields=("input_ids", "targets")))
    try:
        assert fewer.fingerprint == full.fingerprint
        expected = [{k: v.copy() for k, v in with_fields(full.batch(step), ("input_ids", "targets")).items()}
                    for step in range(5, 9)]
        iterator = fewer.restore(full.state(5))
        assert_batches_equal([next(iterator) for _ in range(4)], expected, steps=list(range(5, 9)))
        iterator.close()
    finally:
        full.close()
        fewer.close()
