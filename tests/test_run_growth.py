"""A run continued over a dataset whose files grew (issue 50): the build grows the dataset's plan
append-only (``plan/growth.py``) and a run resumed with ``continue_changes`` goes on over it
(``index/growth.py``): the epoch the dataset is in serves the examples it had planned, in their
order, then the new ones; later epochs are over all of them.

The index part alone, the build's grown plan against a fresh plan of the same files, and a
model-based test on real lakes: random sequences of reading steps, editing the mixture, adding
files to a dataset (a real build) and resuming in fresh loaders (one or two processes), against
an oracle that keeps every batch served and every (dataset, epoch, example) consumed: earlier
steps keep their batches, within every epoch no example repeats and none is skipped (an epoch's
examples are those the dataset had when it started, and every new one when it grew in it), and
the batches equal those of one loader that took the same changes at the same steps.
"""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from lakeloader.catalog.lake import open_lake
from lakeloader.config import load_config
from lakeloader.contracts.errors import LakeloaderError
from lakeloader.feed.loader import Loader
from lakeloader.index.growth import EpochSizes
from lakeloader.ingest.driver import build
from lakeloader.plan.planner import plan_dataset

from conftest import RunLoaders as Loaders
from conftest import (assert_batches_equal, assert_epochs_whole, assert_progress_counted, read_run, resume_run,
                      stdlib_texts, write_config, write_jsonl)

SEQ_LEN = 32
BATCH = 8

# -- the index part ----------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(first=st.integers(1, 30), growths=st.lists(st.tuples(st.integers(0, 90), st.integers(0, 25)), max_size=4))
def test_every_epoch_of_a_grown_dataset_holds_each_of_its_examples_once(first: int,
                                                                         growths: list[tuple[int, int]]) -> None:
    sizes = EpochSizes(((0, 1, first),))
    taken = 0
    for advance, more in growths:   # the run reads on, then the dataset grows by ``more``
        taken += advance
        before = sizes
        sizes = sizes.grown(taken, sizes.sizes[-1][1] + 1, sizes.examples + more)
        past = np.arange(taken)
        was, now = before.locate(past), sizes.locate(past)   # the positions read keep their examples
        np.testing.assert_array_equal(was.epoch, now.epoch)
        np.testing.assert_array_equal(was.lo + was.offset, now.lo + now.offset)
    parts = sizes.locate(np.arange(taken + 4 * sizes.examples))
    example = parts.lo + parts.offset
    assert (np.diff(parts.epoch) >= 0).all()
    assert ((parts.offset >= 0) & (example < parts.hi)).all()
    for epoch in np.unique(parts.epoch)[:-1].tolist():   # whole epochs: every example once
        mine = np.sort(example[parts.epoch == epoch])
        np.testing.assert_array_equal(mine, np.arange(len(mine)))
        assert len(mine) in {n for _, _, n in sizes.sizes}


# -- on real lakes -----------------------------------------------------------------------------------

TEXTS = [t[:700] for t in stdlib_texts("json") + stdlib_texts("zoneinfo") + stdlib_texts("email")[:12]]


def _lake(root: Path, shuffle: str, packing: str) -> Path:
    """A lake whose dataset ``g`` (a folder of files) grows, beside ``a``, which does not."""
    for k in range(2):
        write_jsonl(root / "data" / "g" / f"{k:02d}.jsonl", TEXTS[2 * k : 2 * k + 2])
    write_jsonl(root / "data" / "a.jsonl", TEXTS[20:30])
    return write_config(root, {"g": {"sources": [str(root / "data" / "g" / "*.jsonl")]},
                               "a": {"sources": [str(root / "data" / "a.jsonl")]}},
                        build={"split_size": "1KB"}, mixture={"weights": {"g": 1.0, "a": 1.0}},
                        loader={"seq_len": SEQ_LEN, "batch_size": BATCH, "prefetch": 0, "packing": packing,
                                "shuffle": {"kind": shuffle, "window_chunks": 2, "block_size": 4}})


def _edited(base: Path, name: str, mixture: dict[str, Any]) -> Path:
    raw = yaml.safe_load(base.read_text())
    raw["mixture"] = mixture
    path = base.parent / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


class GrowingRuns(RuleBasedStateMachine):
    """Read, reweight, add files, resume against the oracle (see the module)."""

    scheduler: str
    folder: Path
    lakes = itertools.count()
    grown_in_an_epoch = False
    epochs_crossed_after_growth = False

    @initialize(shuffle=st.sampled_from(["window", "full", "none", "block"]), packing=st.sampled_from(["concat", "pack"]))
    def start(self, shuffle: str, packing: str) -> None:
        self.root = self.folder / f"lake{next(self.lakes)}"
        self.config = _lake(self.root, shuffle, packing)
        build(self.config, scheduler=self.scheduler, progress=False)
        self.files, self.edits = 2, 0
        self.path = self.config
        self.current = Loaders(self.path, 1)
        self.straight = Loader(self.path)   # the same changes at the same steps, one process, never restarted
        self.step = 0
        self.served: list[dict[str, np.ndarray]] = []
        self.rows: list[list[tuple[str, int, int]]] = []
        # Per dataset, the oracle's sizes: (first epoch, examples per epoch from then on).
        self.sizes = {name: [(0, self.straight.datasets[d].train_count())]
                      for d, name in enumerate(self.straight.dataset_names)}

    @rule(k=st.integers(1, 16))
    def read(self, k: int) -> None:
        self.step = read_run(self.current, self.straight, self.step, k, self.served, self.rows)

    @rule(weights=st.tuples(st.integers(0, 3), st.integers(1, 3)))
    def reweight(self, weights: tuple[int, int]) -> None:
        self.edits += 1
        self.path = _edited(self.config, f"run{self.edits}", {"weights": dict(zip("ga", map(float, weights)))})
        self._resume(self.path)

    @rule(files=st.integers(1, 2))
    def add_files(self, files: int) -> None:
        if self.files >= 8:
            return
        for _ in range(files):
            write_jsonl(self.root / "data" / "g" / f"{self.files:02d}.jsonl",
                        TEXTS[2 * self.files : 2 * self.files + 2])
            self.files += 1
        build(self.config, scheduler=self.scheduler, progress=False)
        with Loader(self.config) as fresh:   # a run of the grown config from step 0 reads the grown plan
            stream = fresh.datasets[fresh.dataset_names.index("g")]
            total = stream.train_count()
            epochs, examples = stream.order.train_examples(np.arange(total))
            assert (epochs == 0).all() and sorted(examples.tolist()) == list(range(total))
        taken = [(e, k) for rows in self.rows for d, e, k in rows if d == "g"]
        sizes = self.sizes["g"]
        if not taken:
            sizes[:] = [(0, total)]
        else:
            last = taken[-1][0]
            whole = sum(1 for e, _ in taken if e == last) == [n for e, n in sizes if e <= last][-1]
            sizes.append((last + 1 if whole else last, total))
            GrowingRuns.grown_in_an_epoch |= not whole
        self._resume(self.path, grew=True)

    def _resume(self, path: Path, grew: bool = False) -> None:
        drawn = grew and "g" in self.straight.dataset_names   # (else the run just reads its new plan)
        self.current, self.straight = resume_run(self.current, self.straight, path, self.step, 2 if self.step % 2 else 1,
                                                 self.served, "dataset 'g' grew.*continue_changes=True" if drawn else None)

    @invariant()
    def every_epoch_holds_each_example_once(self) -> None:
        whole = assert_epochs_whole(self.rows, lambda name, epoch: [n for e, n in self.sizes[name] if e <= epoch][-1])
        if any(len(self.sizes[name]) > 1 and epoch >= self.sizes[name][1][0] for name, epoch in whole):
            GrowingRuns.epochs_crossed_after_growth = True

    def teardown(self) -> None:
        if hasattr(self, "current"):
            self.current.close()
            self.straight.close()
            shutil.rmtree(self.root, ignore_errors=True)


def test_runs_continued_over_grown_datasets(dask_scheduler: str, tmp_path: Path) -> None:
    GrowingRuns.scheduler = dask_scheduler
    GrowingRuns.folder = tmp_path
    run = GrowingRuns()   # first one sequence known to grow within an epoch and read epochs past it
    run.start(shuffle="window", packing="concat")
    for action in (lambda: run.read(7), lambda: run.add_files(1), lambda: run.read(16), lambda: run.add_files(2),
                   lambda: run.reweight((3, 1)), lambda: run.read(16)):
        action()
        run.every_epoch_holds_each_example_once()
    run.teardown()
    assert GrowingRuns.grown_in_an_epoch and GrowingRuns.epochs_crossed_after_growth
    machine = GrowingRuns.TestCase
    machine.settings = settings(max_examples=10, stateful_step_count=10, deadline=None,
                                suppress_health_check=list(HealthCheck), phases=[Phase.generate])
    machine().runTest()


# -- the build's grown plan --------------------------------------------------------------------------


def test_a_grown_plan_keeps_its_chunks_and_a_fresh_build_orders_all_files(dask_scheduler: str, tmp_path: Path) -> None:
    config = _lake(tmp_path, "window", "concat")
    raw = yaml.safe_load(config.read_text())
    raw["datasets"]["short"] = {"from": "g", "where": "doc_key % 2 = 0"}
    raw["mixture"]["weights"]["short"] = 1.0
    config.write_text(yaml.safe_dump(raw, sort_keys=False))
    build(config, scheduler=dask_scheduler, progress=False)
    columns = "global_index, shard_index, split_index, path, num_docs, num_tokens, checksum"
    lake = open_lake(config)
    before = lake.sql(f"SELECT {columns} FROM chunks WHERE dataset = 'g' ORDER BY global_index")
    old = lake.sql("SELECT name, fingerprint FROM dataset_plans ORDER BY name").set_index("name")["fingerprint"]
    with Loader(config) as loader:
        state = loader.state(9)
        served = [loader.batch(step) for step in range(9)]
    for k in (2, 3):
        write_jsonl(tmp_path / "data" / "g" / f"{k:02d}.jsonl", TEXTS[2 * k : 2 * k + 2])
    build(config, scheduler=dask_scheduler, progress=False)
    lake = open_lake(config)
    after = lake.sql(f"SELECT {columns} FROM chunks WHERE dataset = 'g' ORDER BY global_index")
    assert after.iloc[: len(before)].equals(before) and len(after) > len(before)
    assert set(after["shard_index"][len(before):]) == {2, 3}   # the new files' chunks after the old ones
    growth = lake.sql("SELECT dataset, extends, chunks_before FROM plan_growth ORDER BY dataset")
    assert growth.values.tolist() == [["g", old["g"], len(before)], ["short", old["short"], len(before)]]
    assert_progress_counted(config)
    build(config, scheduler=dask_scheduler, progress=False)   # again, nothing added: the grown plan stays
    assert open_lake(config).sql(f"SELECT {columns} FROM chunks WHERE dataset = 'g' ORDER BY global_index").equals(after)
    fresh = plan_dataset("g", load_config(config), "x")
    assert fresh.chunks["shard_index"].tolist() != after["shard_index"].tolist()   # round-robin over all four
    with Loader(config) as loader:   # the filter of the grown source goes on with it
        loader.follow(state, continue_changes=True)
        assert_batches_equal([loader.batch(step) for step in range(9)], served, "after the growth", range(9))
        assert {n for n, _ in loader.run.growth} <= {"g", "short"} and loader.run.growth
        loader.batch(40)


def test_a_dataset_whose_files_changed_is_refused_in_one_line(dask_scheduler: str, tmp_path: Path) -> None:
    config = _lake(tmp_path, "window", "concat")
    build(config, scheduler=dask_scheduler, progress=False)
    with Loader(config) as loader:
        state = loader.state(5)
    write_jsonl(tmp_path / "data" / "g" / "00.jsonl", TEXTS[9:11])   # an old file changed: no growth
    build(config, scheduler=dask_scheduler, progress=False)
    with Loader(config) as loader, pytest.raises(LakeloaderError, match="changed other than by files added") as error:
        loader.follow(state, continue_changes=True)
    assert "\n" not in str(error.value)


def test_growth_under_a_stop_strategy_or_the_strided_ordering_is_refused(dask_scheduler: str, tmp_path: Path) -> None:
    config = _lake(tmp_path, "none", "concat")
    raw = yaml.safe_load(config.read_text())
    strided = tmp_path / "strided.yaml"
    strided.write_text(yaml.safe_dump({**raw, "loader": {**raw["loader"], "ordering": "strided"}}))
    stopping = _edited(config, "stopping", {"weights": raw["mixture"]["weights"], "stop": "first_exhausted"})
    build(config, scheduler=dask_scheduler, progress=False)
    with Loader(config) as loader, Loader(strided) as along:
        state, strided_state = loader.state(5), along.state(5)
    write_jsonl(tmp_path / "data" / "g" / "02.jsonl", TEXTS[4:6])
    build(config, scheduler=dask_scheduler, progress=False)
    for path, saved, reason in [(stopping, state, "needs mixture.stop: restart"),
                                (strided, strided_state, "under loader.ordering: strided")]:
        with Loader(path) as loader, pytest.raises(LakeloaderError, match=f"dataset.s. g grew, and.*{reason}") as error:
            loader.follow(saved, continue_changes=True)
        assert "\n" not in str(error.value)
