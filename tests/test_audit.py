"""Mixture audit: the catalog's SQL plan equals the closed form bit for bit, matches the loader's
batches, registers once per mixture, and `lakeloader audit` reports it as a table, JSON or plot
(the plot draws the share curves the catalog computes)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import duckdb
import numpy as np
import pandas as pd
import pytest

from lakeloader.catalog.audit import audit, closed_form_plan, closed_form_proportions, mixture_plan, share_curves
from lakeloader.catalog.lake import open_lake
from lakeloader.catalog.store import CatalogWriter
from lakeloader.cli import main
from lakeloader.config import load_config
from lakeloader.feed.loader import Loader
from lakeloader.index.mixture import Mixer, Stage, huffman_tree, mixture_counts, quantized_weights, stage_totals
from lakeloader.ingest.driver import build
from lakeloader.specs import mixture_spec

from conftest import stdlib_texts, write_config, write_jsonl

INTEGERS = ["step", "stage", "dataset_index", "examples", "before", "after", "stage_before",
            "stage_after", "stage_examples"]


def _random_mixer(rng: np.random.Generator, datasets: int, starts: list[int], batch_size: int) -> Mixer:
    """Weights spread over 8 decades (tiny ones included), some zero in each stage."""
    stages = []
    for start in starts:
        weights = 10.0 ** rng.uniform(-8, 0, datasets)
        weights[rng.random(datasets) < 0.2] = 0.0
        weights[rng.integers(datasets)] = rng.uniform(0.1, 1)
        stages.append(Stage(start, weights.tolist()))
    return Mixer(tuple(f"d{i:02d}" for i in range(datasets)), tuple(stages), batch_size, "restart", 0)


@pytest.fixture(scope="module")
def catalog(tmp_path_factory: pytest.TempPathFactory) -> CatalogWriter:
    writer = CatalogWriter(str(tmp_path_factory.mktemp("catalog") / "catalog.duckdb"))
    yield writer
    writer.close()


def _sql_plan(con: duckdb.DuckDBPyConnection, mixer: Mixer, first: int, stop: int) -> pd.DataFrame:
    return con.execute("SELECT * FROM mixture_plan(?, ?, ?)", [mixer.mixture_id, first, stop]).df()


CASES = [  # datasets, stage starts, batch size, step ranges (first, last) with both included
    (2, [0], 1, [(0, 300)]),
    (5, [0, 7, 40], 3, [(0, 60), (5, 8), (39, 41), (40, 40)]),
    (10, [0, 1000, 10**6], 256, [(0, 999), (999_990, 1_000_020), (10**6, 10**6 + 500)]),
    (33, [0, 2, 5_000_000], 64, [(0, 400), (4_999_900, 5_000_100)]),
    (40, [0], 1024, [(10**9, 10**9 + 50)]),
]


@pytest.mark.parametrize("datasets,starts,batch_size,ranges", CASES)
def test_sql_plan_equals_the_closed_form_bitwise(catalog: CatalogWriter, datasets: int, starts: list[int],
                                                 batch_size: int, ranges: list[tuple[int, int]]) -> None:
    rng = np.random.default_rng(datasets * 1000 + len(starts))
    mixer = _random_mixer(rng, datasets, starts, batch_size)
    catalog.register_mixture(mixer)
    stages = list(mixer.stages)
    for first, last in ranges:
        sql = _sql_plan(catalog.con, mixer, first, last + 1)  # half-open [first, stop)
        python = closed_form_plan(mixer, first, last + 1)
        assert len(sql) == (last - first + 1) * datasets
        for column in python.columns:  # integers and doubles alike: identical bits
            assert np.array_equal(sql[column].to_numpy(), python[column].to_numpy()), column
        # ... and the closed form of lakeloader.index.mixture itself.
        steps = np.arange(first, last + 1)
        after = sql["after"].to_numpy().reshape(len(steps), datasets)
        before = sql["before"].to_numpy().reshape(len(steps), datasets)
        assert np.array_equal(after, stage_totals(stages, batch_size, steps + 1))
        assert np.array_equal(before, stage_totals(stages, batch_size, steps))
        assert (after.sum(axis=1) == (steps + 1) * batch_size).all()
        stage_after = sql["stage_after"].to_numpy().reshape(len(steps), datasets)
        for number, stage in enumerate(stages):
            rows = sql["stage"].to_numpy()[::datasets] == number
            if rows.any():
                relative = steps[rows] - stage.start_step
                assert np.array_equal(stage_after[rows], mixture_counts(stage.weights, batch_size, relative))
        assert sql["deviation"].max() < 2
        # The proportions macro aggregates the plan: integers exact, the mean target to rounding.
        props = catalog.con.execute("SELECT * FROM mixture_proportions(?, ?, ?)",
                                    [mixer.mixture_id, first, last + 1]).df()
        expected = closed_form_proportions(mixer, first, last + 1)
        for column in ("examples", "first_index", "end_index", "share", "max_deviation"):
            assert np.array_equal(props[column].to_numpy(), expected[column].to_numpy()), column
        assert np.allclose(props["target_weight"], expected["target_weight"], rtol=1e-12, atol=0)


def test_tiny_weights_never_vanish_in_sql(catalog: CatalogWriter) -> None:
    mixer = Mixer(("big", "tiny", "zero"), (Stage(0, [1.0, 1e-9, 0.0]),), 1, "restart", 0)
    assert catalog.register_mixture(mixer) and not catalog.register_mixture(mixer)
    assert quantized_weights([1.0, 1e-9, 0.0])[1] >= 1
    # The first step that draws the tiny dataset (within 2 of its share: by step 2e9 at the latest).
    lo, hi = -1, 2 * 10**9
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if mixture_counts([1.0, 1e-9, 0.0], 1, [mid])[0, 1] else (mid, hi)
    plan = _sql_plan(catalog.con, mixer, hi - 1, hi + 1)
    tiny = plan[plan["dataset"] == "tiny"]
    assert tiny["examples"].tolist() == [0, 1] and tiny["before"].tolist() == [0, 0]
    assert (plan[plan["dataset"] == "zero"]["after"] == 0).all()
    nodes = catalog.con.execute("SELECT count(*), max(weight) FROM mixture_nodes WHERE mixture_id = ?",
                                [mixer.mixture_id]).fetchone()
    assert nodes[0] == len(huffman_tree([1.0, 1e-9, 0.0])) == 3


def test_sql_plan_is_fast(catalog: CatalogWriter) -> None:
    mixer = _random_mixer(np.random.default_rng(7), 10, [0, 5000], 256)
    catalog.register_mixture(mixer)
    _sql_plan(catalog.con, mixer, 0, 11)  # warm up
    timings = []
    for _ in range(3):  # the best of three: other tests may share the machine
        started = time.perf_counter()
        plan = _sql_plan(catalog.con, mixer, 10**6, 10**6 + 10_000)
        timings.append(time.perf_counter() - started)
    elapsed = min(timings)
    assert len(plan) == 100_000 and set(plan["stage"]) == {1}
    assert elapsed < 1.0, f"10,000 steps of a 10-dataset mixture took {elapsed:.2f}s"


# -- a real lake ------------------------------------------------------------------------------

STAGES = [{"start_step": 0, "weights": {"json": 3, "email": 1, "http": 0}},
          {"start_step": 6, "weights": {"json": 1, "email": 1, "http": 2}},
          {"start_step": 15, "weights": {"json": 0.01, "email": 0, "http": 1}}]


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory, dask_scheduler: str) -> Path:
    """A lake of three stdlib corpora with a staged mixture, built twice (the second a no-op)."""
    tmp = tmp_path_factory.mktemp("audit")
    datasets = {}
    for name in ("json", "email", "http"):
        write_jsonl(tmp / "data" / f"{name}.jsonl", stdlib_texts(name))
        datasets[name] = {"sources": [str(tmp / "data" / f"{name}.jsonl")]}
    config = write_config(tmp, datasets, loader={"seq_len": 32, "batch_size": 8, "prefetch": 0},
                          mixture={"stages": STAGES})
    build(config, scheduler=dask_scheduler, progress=False)
    build(config, scheduler=dask_scheduler, progress=False)
    return config


def test_registration_is_idempotent_across_builds(lake: Path) -> None:
    mixer = mixture_spec(load_config(lake))
    built = open_lake(lake)
    mixtures = built.sql("SELECT * FROM mixtures")
    assert mixtures["mixture_id"].tolist() == [mixer.mixture_id]
    row = mixtures.iloc[0]
    assert list(row["datasets"]) == ["json", "email", "http"] and row["batch_size"] == 8
    assert row["last_registered_at"] > row["registered_at"]  # touched by the second build
    stages = built.sql("SELECT * FROM mixture_stages ORDER BY stage")
    assert stages["start_step"].tolist() == [0, 6, 15]
    assert stages["end_step"].tolist()[:2] == [6, 15] and pd.isna(stages["end_step"].iloc[2])
    for stage, quanta in zip(mixer.stages, stages["quanta"]):
        assert list(quanta) == list(quantized_weights(stage.weights))
    nodes = built.sql("SELECT stage, count(*) AS n FROM mixture_nodes GROUP BY stage ORDER BY stage")
    assert nodes["n"].tolist() == [len(huffman_tree(s.weights)) for s in mixer.stages]
    # The id depends on the schedule only: same weights scaled, same id; other weights, new id.
    scaled = Mixer(mixer.names, tuple(Stage(s.start_step, [2 * w for w in s.weights]) for s in mixer.stages),
                   8, "restart", 5)
    assert scaled.mixture_id == mixer.mixture_id
    other = Mixer(mixer.names, mixer.stages[:2], 8, "restart", 0)
    assert other.mixture_id != mixer.mixture_id


def test_sql_proportions_match_the_loaders_batches(lake: Path) -> None:
    first, last = 3, 20  # spans all three stages
    with Loader(lake) as loader:
        windows = {step: loader.examples(step).examples for step in range(first, last + 1)}
        per_epoch = {d.name: d.train_count() for d in loader.datasets}
    plan = open_lake(lake).sql("SELECT * FROM mixture_plan(?, ?, ?)", [mixture_spec(load_config(lake)).mixture_id,
                                                                       first, last + 1])
    for step, rows in windows.items():
        here = plan[plan["step"] == step].set_index("dataset")
        for name in ("json", "email", "http"):
            mine = sorted(w.epoch * per_epoch[name] + w.example for w in rows if w.dataset == name)
            lo, hi = here.loc[name, "before"], here.loc[name, "after"]
            assert mine == list(range(lo, hi)), (step, name)  # exactly the indices [before, after)
    counted = pd.Series([w.dataset for rows in windows.values() for w in rows]).value_counts()
    report = audit(lake, first, last + 1).set_index("dataset")
    assert report.attrs["source"] == "catalog"
    for name in ("json", "email", "http"):
        assert report.loc[name, "examples"] == counted.get(name, 0)
        assert report.loc[name, "share"] == counted.get(name, 0) / ((last - first + 1) * 8)
    assert report["share"].sum() == pytest.approx(1.0)
    assert report.loc["email", "examples"] > 0 and report.loc["json", "examples"] > 0


def test_audit_agrees_with_the_closed_form(lake: Path, tmp_path: Path) -> None:
    for first, last in [(0, 0), (0, 40), (5, 16), (10**6, 10**6 + 99)]:
        from_catalog = audit(lake, first, last + 1)
        assert from_catalog.attrs["source"] == "catalog"
        # The same config pointed at a lake that does not exist: the closed form in Python.
        text = Path(lake).read_text().replace(str(Path(lake).parent / "lake"), str(tmp_path / "none"))
        (tmp_path / "elsewhere.yaml").write_text(text)
        closed = audit(tmp_path / "elsewhere.yaml", first, last + 1)
        assert closed.attrs["source"] == "closed form"
        for column in ("examples", "tokens", "first_index", "end_index", "share", "token_share", "max_deviation"):
            assert np.array_equal(from_catalog[column].to_numpy(), closed[column].to_numpy()), column
        assert np.allclose(from_catalog["target_weight"], closed["target_weight"], rtol=1e-12)
        assert (from_catalog["max_deviation"] < 2).all()
        assert (from_catalog["tokens"] == from_catalog["examples"] * 32).all()
    # One stage: its target; over stages 0 and 1 (6 + 4 steps): the example-weighted mean.
    report = audit(lake, 0, 6).set_index("dataset")["target_weight"]
    assert report.to_dict() == pytest.approx({"json": 0.75, "email": 0.25, "http": 0.0})
    report = audit(lake, 0, 10).set_index("dataset")["target_weight"]
    assert report.to_dict() == pytest.approx({"json": (6 * 0.75 + 4 * 0.25) / 10,
                                              "email": (6 * 0.25 + 4 * 0.25) / 10, "http": 4 * 0.5 / 10})
    plan = mixture_plan(lake, 14, 16)
    assert plan.attrs["source"] == "catalog" and set(plan["stage"]) == {1, 2}


def test_audit_cli_table_json_and_plot(lake: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", str(lake), "--steps", "0:30"]) == 0
    out = capsys.readouterr().out
    assert "steps [0, 30)" in out and "from the catalog" in out
    for word in ("json", "email", "http", "target_weight", "share", "token_share", "max_deviation"):
        assert word in out
    assert main(["audit", str(lake), "--steps", "2:25", "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    expected = audit(lake, 2, 25)
    assert [r["dataset"] for r in rows] == ["json", "email", "http"]
    assert [r["examples"] for r in rows] == expected["examples"].tolist()
    assert sum(r["examples"] for r in rows) == 23 * 8
    png = tmp_path / "audit.png"
    assert main(["audit", str(lake), "--steps", "0:40", "--plot", str(png)]) == 0
    capsys.readouterr()
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    with pytest.raises(SystemExit):
        main(["audit", str(lake), "--steps", "5:3"])


def test_share_curves_end_on_the_audit(lake: Path) -> None:
    """What the audit plot draws: the curves of steps [2, 25) end on the audit of that range,
    and a long range sampled at a few steps gives those steps' exact values."""
    curves = share_curves(lake, 2, 25)
    assert curves.attrs["source"] == "catalog" and curves.attrs["stage_starts"] == {1: 6, 2: 15}
    assert curves["step"].tolist() == [step for step in range(2, 25) for _ in range(3)]
    assert curves["dataset"].tolist()[:3] == ["json", "email", "http"]
    expected = audit(lake, 2, 25).set_index("dataset")
    last = curves[curves["step"] == 24].set_index("dataset")
    assert last["share"].tolist() == pytest.approx(expected["share"].tolist())
    assert last["target_share"].tolist() == pytest.approx(expected["target_weight"].tolist())
    assert curves.groupby("dataset", sort=False)["deviation"].max().tolist() == \
        pytest.approx(expected["max_deviation"].tolist())
    sampled = share_curves(lake, 2, 400, max_steps=40)
    assert sampled.attrs["source"] == "closed form at 40 evenly spaced steps"
    steps = sampled["step"].unique()
    assert len(steps) == 40 and steps[0] == 2 and steps[-1] == 399
    exact = share_curves(lake, 2, 400).set_index(["step", "dataset"])
    picked = exact.loc[sampled.set_index(["step", "dataset"]).index]
    for column in ("share", "target_share", "deviation"):
        assert sampled[column].tolist() == pytest.approx(picked[column].tolist())


def test_audit_of_a_single_dataset_without_mixture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_jsonl(tmp_path / "data" / "a.jsonl", stdlib_texts("json"))
    config = write_config(tmp_path, {"code": {"sources": [str(tmp_path / "data" / "a.jsonl")]}},
                          loader={"seq_len": 16, "batch_size": 4})
    report = audit(config, 0, 10)  # no lake built: the closed form
    assert report["dataset"].tolist() == ["code"]
    assert report.iloc[0][["target_weight", "share", "token_share"]].tolist() == [1.0, 1.0, 1.0]
    assert report.iloc[0]["examples"] == 40 and report.iloc[0]["tokens"] == 640
    assert report.iloc[0]["max_deviation"] == 0.0
    assert main(["audit", str(config), "--steps", "0:10", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["share"] == 1.0
