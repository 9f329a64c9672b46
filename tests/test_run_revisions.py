"""A run continued under an edited config (issue 50): its mixture reweighted, restaged, datasets
added or left out mid-run.

The index part alone (``index/revisions.py``) against the staged mixture it extends, then a
model-based test on a real lake: random sequences of reading steps, saving the state, editing
the config and resuming in fresh loaders (one or two processes), against an oracle that keeps
every batch served and every (dataset, epoch, example) consumed: earlier steps keep their
batches, no example repeats within its dataset's epoch and none is skipped, each revision's
weights hold within 2 examples over its whole-batch prefixes, and the batches equal those of one
loader that took the same edits at the same steps without restarting.
"""

from __future__ import annotations

import copy
import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from lakeloader.contracts.errors import ConfigError
from lakeloader.contracts.specs import MixtureSpec, Stage
from lakeloader.feed.loader import Loader
from lakeloader.index.mixture import staged_assignments
from lakeloader.index.revisions import RunMixture, continued
from lakeloader.ingest.driver import build

from conftest import RunLoaders as Loaders
from conftest import (assert_batches_equal, assert_epochs_whole, read_run, resume_run, stdlib_texts, write_config,
                      write_jsonl)

SEQ_LEN = 32
BATCH = 8
KEY = 11

# -- the index part ----------------------------------------------------------------------------------


def _spec(names: list[str], stages: list[tuple[int, list[float]]]) -> MixtureSpec:
    return MixtureSpec(tuple(names), tuple(Stage(s, w) for s, w in stages), BATCH, "restart", 0)


WEIGHTS = st.lists(st.integers(0, 5), min_size=3, max_size=3).filter(any).map(lambda w: [float(x) for x in w])


@settings(max_examples=80, deadline=None)
@given(old=WEIGHTS, new=WEIGHTS, later=WEIGHTS, at=st.integers(1, 40), stage_after=st.integers(1, 20),
       drop=st.booleans())
def test_a_continued_mixture_keeps_the_past_and_continues_each_dataset(old: list[float], new: list[float],
                                                                       later: list[float], at: int,
                                                                       stage_after: int, drop: bool) -> None:
    before = RunMixture(_spec(["a", "b", "c"], [(0, old)]))
    names = ["c", "b", "d"] if drop else ["c", "b", "a"]   # another order; "a" left out and "d" added
    after = continued(before, at, _spec(names, [(0, new), (at + stage_after, later)]))
    assert after.spec.names[:3] == ("a", "b", "c") and after.revisions == (0, at)
    past = np.arange(at)
    old_owners, old_indices = staged_assignments(before.spec.stages, BATCH, past, KEY)
    new_owners, new_indices = staged_assignments(after.spec.stages, BATCH, past, KEY)
    np.testing.assert_array_equal(new_owners, old_owners)
    np.testing.assert_array_equal(new_indices, old_indices)
    steps = np.arange(at + stage_after + 15)
    owners, indices = staged_assignments(after.spec.stages, BATCH, steps, KEY)
    for d, name in enumerate(after.spec.names):   # each dataset's indices run 0, 1, 2, ... over the steps
        mine = indices[owners == d]
        np.testing.assert_array_equal(mine, np.arange(len(mine)))
        if name not in names:
            assert not (owners[at:] == d).any()   # left out: drawn no more
    weights = dict(zip(names, new))
    total = sum(new)
    for k in range(1, stage_after + 1):   # the new weights hold from the revision on
        counts = np.array([(owners[at : at + k] == d).sum() for d in range(len(after.spec.names))])
        target = np.array([weights.get(n, 0.0) / total * BATCH * k for n in after.spec.names])
        assert np.abs(counts - target).max() < 2


def test_a_state_round_trips_and_a_bad_one_is_named() -> None:
    run = continued(RunMixture(_spec(["a", "b"], [(0, [0.1, 0.9])])), 7, _spec(["b"], [(0, [1.0])]))
    assert RunMixture.from_dict(json.loads(json.dumps(run.to_dict()))) == run
    with pytest.raises(ValueError, match="batch size"):
        continued(run, 9, MixtureSpec(("b",), (Stage(0, [1.0]),), BATCH * 2, "restart", 0))
    with pytest.raises(ValueError, match="cannot be continued at step 3"):
        continued(run, 3, _spec(["b"], [(0, [1.0])]))


# -- on a lake ---------------------------------------------------------------------------------------

DATASETS = {"a": "json", "b": "zoneinfo", "c": "tomllib"}


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory, dask_scheduler: str) -> Path:
    """Three small datasets (b and c hold a few dozen examples: their epochs end within a test)."""
    root = tmp_path_factory.mktemp("revisions")
    for name, package in DATASETS.items():
        texts = stdlib_texts(package)
        write_jsonl(root / "data" / f"{name}.jsonl", texts if name == "a" else [t[:1500] for t in texts[:2]])
    config = write_config(root, {n: {"sources": [str(root / "data" / f"{n}.jsonl")]} for n in DATASETS},
                          build={"split_size": "16KB"}, mixture={"weights": {n: 1.0 for n in DATASETS}},
                          loader={"seq_len": SEQ_LEN, "batch_size": BATCH, "prefetch": 0,
                                  "shuffle": {"kind": "window", "window_chunks": 2}})
    build(config, scheduler=dask_scheduler, progress=False)
    return config


def edited(base: Path, folder: Path, name: str, mixture: dict[str, Any]) -> Path:
    """``base`` with ``mixture`` instead of its own, written to ``folder/name.yaml``."""
    raw = yaml.safe_load(base.read_text())
    raw["mixture"] = mixture
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


class ContinuedRuns(RuleBasedStateMachine):
    """Read, save, edit, resume against the oracle (see the module)."""

    config: Path
    folder: Path
    epochs_crossed = False

    @initialize(weights=st.sampled_from([{"a": 1.0, "b": 1.0}, {"a": 3.0, "b": 1.0}]))
    def start(self, weights: dict[str, float]) -> None:
        self.mixture: dict[str, Any] = {"weights": weights}
        self.edits = 0
        path = edited(self.config, self.folder, "run0", self.mixture)
        self.current = Loaders(path, 1)
        self.straight = Loader(path)   # the same edits at the same steps, in this process, one process
        self.step = 0
        self.served: list[dict[str, np.ndarray]] = []
        self.rows: list[list[tuple[str, int, int]]] = []
        self.revisions: list[tuple[int, dict[str, Any]]] = [(0, copy.deepcopy(self.mixture))]

    @rule(k=st.integers(1, 8))
    def read(self, k: int) -> None:
        self.step = read_run(self.current, self.straight, self.step, k, self.served, self.rows)

    @rule(kind=st.sampled_from(["reweight", "add", "leave out", "stage"]), data=st.data())
    def edit(self, kind: str, data: st.DataObject) -> None:
        current = self.mixture.get("weights") or self.mixture["stages"][-1]["weights"]
        weights = {n: w for n, w in current.items() if w > 0}
        if kind == "reweight":
            weights = {n: float(data.draw(st.integers(1, 4))) for n in weights}
        elif kind == "add":
            absent = sorted(set(DATASETS) - set(weights))
            if not absent:
                return
            weights[absent[0]] = float(data.draw(st.integers(1, 3)))
        elif kind == "leave out":
            if len(weights) < 2:
                return
            del weights[sorted(weights)[data.draw(st.integers(0, len(weights) - 1))]]
        mixture: dict[str, Any] = {"weights": weights}
        if kind == "stage":
            later = {n: float(data.draw(st.integers(0, 3))) for n in weights}
            later[sorted(later)[0]] = 1.0   # (never all zero)
            mixture = {"stages": [{"start_step": 0, "weights": weights},
                                  {"start_step": self.step + data.draw(st.integers(1, 6)), "weights": later}]}
        if mixture == self.mixture:
            return
        self.edits += 1
        path = edited(self.config, self.folder, f"run{self.edits}", mixture)
        self.current, self.straight = resume_run(self.current, self.straight, path, self.step,
                                                 data.draw(st.sampled_from([1, 2])), self.served, "continue_changes=True")
        self.mixture = mixture
        self.revisions.append((self.step, copy.deepcopy(mixture)))

    @invariant()
    def no_repeat_within_an_epoch_and_no_skip(self) -> None:
        straight = self.straight
        if assert_epochs_whole(self.rows, lambda name, _: straight.datasets[straight.dataset_names.index(name)].train_count()):
            ContinuedRuns.epochs_crossed = True

    @invariant()
    def each_revision_holds_its_weights(self) -> None:
        ends = [start for start, _ in self.revisions[1:]] + [self.step]
        for (start, mixture), end in zip(self.revisions, ends):
            stop = end
            weights = mixture.get("weights")
            if weights is None:   # staged: its first stage runs from the revision to the next stage
                weights = mixture["stages"][0]["weights"]
                stop = min(end, mixture["stages"][1]["start_step"])
            total = sum(weights.values())
            names = self.straight.dataset_names
            for k in range(1, stop - start + 1):
                ids = np.concatenate([self.served[s]["dataset_ids"] for s in range(start, start + k)])
                for d, name in enumerate(names):
                    assert abs(int((ids == d).sum()) - weights.get(name, 0.0) / total * BATCH * k) < 2, (name, start, k)

    def teardown(self) -> None:
        if hasattr(self, "current"):
            self.current.close()
            self.straight.close()


def test_runs_continued_under_edited_configs(lake: Path, tmp_path: Path) -> None:
    ContinuedRuns.config = lake
    ContinuedRuns.folder = tmp_path
    machine = ContinuedRuns.TestCase
    machine.settings = settings(max_examples=15, stateful_step_count=8, deadline=None,
                                suppress_health_check=list(HealthCheck))
    machine().runTest()
    assert ContinuedRuns.epochs_crossed, "no dataset's epoch ended: the no-skip check never ran"


def test_a_dataset_the_run_drew_from_must_stay_defined(lake: Path, tmp_path: Path) -> None:
    first = edited(lake, tmp_path, "first", {"weights": {"a": 1.0, "c": 1.0}})
    with Loader(first) as loader:
        state = loader.state(4)
    raw = yaml.safe_load(first.read_text())
    del raw["datasets"]["c"]
    raw["mixture"] = {"weights": {"a": 1.0}}
    second = tmp_path / "second.yaml"
    second.write_text(yaml.safe_dump(raw))
    with Loader(second) as loader, pytest.raises(ConfigError, match=r"\['c'\].*keep their sections under datasets"):
        loader.follow(state, continue_changes=True)


def test_the_command_line_continues_a_run_and_audits_it(lake: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from lakeloader.cli import main

    first = edited(lake, tmp_path, "first", {"weights": {"a": 1.0, "b": 1.0}})
    second = edited(lake, tmp_path, "second", {"weights": {"a": 1.0, "b": 2.0, "c": 1.0}})
    saved, later = tmp_path / "at6.json", tmp_path / "at10.json"
    assert main(["batches", str(first), "--steps", "0:6", "--out", str(tmp_path / "a.npz"), "--no-progress",
                 "--save-state", str(saved)]) == 0
    capsys.readouterr()
    out = str(tmp_path / "b.npz")
    assert main(["batches", str(second), "--resume", str(saved), "--steps", "6:10", "--out", out, "--no-progress"]) == 2
    error = capsys.readouterr().err
    assert "--continue-changes" in error and "datasets added: c" in error and len(error.strip().splitlines()) == 1
    assert main(["batches", str(second), "--resume", str(saved), "--continue-changes", "--steps", "0:10", "--out", out,
                 "--no-progress", "--save-state", str(later)]) == 0
    with Loader(second) as loader:
        loader.follow(json.loads(saved.read_text()), continue_changes=True)
        files = np.load(out)
        for step in range(10):
            np.testing.assert_array_equal(files["input_ids"][step], loader.batch(step)["input_ids"])
    with np.load(tmp_path / "a.npz") as before:   # the steps before the revision kept their batches
        np.testing.assert_array_equal(before["input_ids"], files["input_ids"][:6])
    capsys.readouterr()
    assert main(["audit", str(second), "--state", str(later), "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    revisions = {(r["segment"], r["first_step"], r["stop_step"]) for r in rows}
    assert revisions == {("0", 0, 6), ("1", 6, 10), ("all", 0, 10)}
    by = {(r["segment"], r["dataset"]): r for r in rows}
    assert by["0", "c"]["examples"] == 0 and by["1", "c"]["examples"] > 0
    for name in ("a", "b", "c"):
        assert by["all", name]["examples"] == by["0", name]["examples"] + by["1", name]["examples"]
        assert by["all", name]["epochs"] > 0 or name == "c" and by["all", name]["examples"] == 0
    assert sum(by["1", n]["examples"] for n in "abc") == 4 * BATCH
    capsys.readouterr()   # the same table in SQL, beside the catalog
    assert main(["sql", str(second), "--state", str(later), "--format", "json",
                 "SELECT s.segment, s.dataset, s.examples, d.num_chunks FROM run_segments s "
                 "JOIN datasets d ON d.name = s.dataset WHERE s.segment = 'all' ORDER BY s.dataset"]) == 0
    joined = json.loads(capsys.readouterr().out)
    assert [(r["dataset"], r["examples"]) for r in joined] == [(n, by["all", n]["examples"]) for n in "abc"]
    assert all(r["num_chunks"] > 0 for r in joined)


def test_worker_processes_follow_the_revised_run(lake: Path, tmp_path: Path) -> None:
    first = edited(lake, tmp_path, "first", {"weights": {"a": 1.0, "b": 1.0}})
    second = edited(lake, tmp_path, "second", {"weights": {"a": 1.0, "c": 3.0}})
    with Loader(first) as loader:
        state = loader.state(5)
    raw = yaml.safe_load(second.read_text())
    raw["loader"]["workers"] = 2
    with_workers = tmp_path / "workers.yaml"
    with_workers.write_text(yaml.safe_dump(raw, sort_keys=False))
    with Loader(second) as alone, Loader(with_workers) as pooled:
        alone.follow(state, continue_changes=True)
        expected = [alone.batch(step) for step in range(12)]
        found = list(itertools.islice(pooled.iter_from(state, continue_changes=True), 7))
        assert_batches_equal(found, expected[5:], "workers of a revised run", steps=range(5, 12))
        assert pooled.dataset_names == ("a", "b", "c")


def test_run_segments_count_what_the_batches_served(lake: Path, tmp_path: Path) -> None:
    from lakeloader.feed.run_audit import run_segments

    mixtures = [{"a": 1.0, "b": 1.0}, {"a": 1.0, "b": 2.0, "c": 1.0}, {"b": 1.0, "c": 3.0}, {"a": 2.0, "c": 1.0}]
    starts, stop = [0, 7, 15, 22], 30
    served: list[list[tuple[str, int]]] = []
    state = None
    for number, (weights, start, end) in enumerate(zip(mixtures, starts, [*starts[1:], stop])):
        with Loader(edited(lake, tmp_path, f"segment{number}", {"weights": weights})) as loader:
            if state is not None:
                loader.follow(state, continue_changes=True)
            served += [[(e.dataset, e.epoch) for e in loader.examples(step).examples] for step in range(start, end)]
            state = loader.state(end)
    with Loader(tmp_path / "segment3.yaml") as loader:
        loader.follow(state)
        table = run_segments(loader, stop)
        batches = [loader.batch(step)["dataset_ids"] for step in range(stop)]
    segments = [*zip(map(str, range(4)), starts, [*starts[1:], stop]), ("all", 0, stop)]
    assert sorted(set(table["segment"])) == sorted(s for s, _, _ in segments)
    for segment, first, end in segments:
        rows = table[table["segment"] == segment].set_index("dataset")
        assert (rows["first_step"] == first).all() and (rows["stop_step"] == end).all()
        ids = np.concatenate(batches[first:end])
        for d, name in enumerate(loader.dataset_names):   # what the batches' dataset_ids and examples say
            epochs = [epoch for step in served[first:end] for dataset, epoch in step if dataset == name]
            assert rows.loc[name, "examples"] == len(epochs) == int((ids == d).sum())
            assert (rows.loc[name, "first_epoch"], rows.loc[name, "last_epoch"]) == (
                (min(epochs), max(epochs)) if epochs else (-1, -1))
            size = loader.datasets[d].train_count()
            assert rows.loc[name, "epochs"] == pytest.approx(len(epochs) / size)
            assert rows.loc[name, "tokens"] == len(epochs) * SEQ_LEN   # (concat: every example is seq_len tokens)
    assert table[table["segment"] == "all"]["epochs"].max() > 1   # a dataset went round more than once
