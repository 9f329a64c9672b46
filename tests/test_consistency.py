"""What a user expects to be consistent: JSON loader states, half-open step ranges, integer sums,
``-v``/``--version``, ``py.typed``, ``batches`` in bounded memory, small snapshots, stale folders."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
import tracemalloc
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

import lakeloader
from lakeloader.catalog.audit import audit, mixture_plan
from lakeloader.catalog.lake import open_lake
from lakeloader.catalog.snapshot import SNAPSHOT_DIR, open_snapshot
from lakeloader.cli import main
from lakeloader.contracts.errors import LakeloaderError
from lakeloader.feed.loader import Loader
from lakeloader.ingest.driver import build
from lakeloader.specs import mixture_spec

from conftest import REPO, Lakes, assert_batches_equal, stdlib_texts

BATCH = 8


def _make_lake(lakes: Lakes, tmp: Path) -> Path:
    """Config in ``tmp`` of a private copy of the built two-dataset lake (``tmp/lake``)."""
    return lakes.copy(tmp, {"code.jsonl": stdlib_texts("json"), "mail.jsonl": stdlib_texts("email", limit=12)},
                      {"code": {"sources": ["code.jsonl"]}, "mail": {"sources": ["mail.jsonl"]}},
                      loader={"seq_len": 64, "batch_size": BATCH}, mixture={"weights": {"code": 0.3, "mail": 0.7}})


@pytest.fixture(scope="module")
def lake(lakes: Lakes, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _make_lake(lakes, tmp_path_factory.mktemp("consistency"))


def _variant(config: Path, name: str, **loader: Any) -> Path:
    """The same lake read with other loader settings."""
    raw = yaml.safe_load(config.read_text())
    raw["loader"].update(loader)
    path = config.with_name(f"{name}.yaml")
    path.write_text(yaml.safe_dump(raw))
    return path


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lakeloader.cli", *args], capture_output=True, text=True,
                          timeout=300)


# -- Loader.state -------------------------------------------------------------------------------

def test_loader_state_is_a_json_dict_that_resumes(lake: Path) -> None:
    with Loader(lake) as loader:
        state = loader.state(5)
        assert (state["step"], state["fingerprint"]) == (5, loader.fingerprint)
        saved = json.loads(json.dumps(state))  # what a checkpoint stores
        assert saved == state and len(json.dumps(state)) < 4096   # small, whatever the step
        resumed = next(loader.restore(saved))
        expected = loader.batch(5)
        assert_batches_equal(resumed, expected, "restored at step 5")
        with pytest.raises(LakeloaderError, match="fingerprint"):
            next(loader.restore({"step": 0, "fingerprint": "0" * 32}))


# -- step ranges ---------------------------------------------------------------------------------

def test_step_ranges_are_half_open_everywhere(lake: Path, capsys: pytest.CaptureFixture[str]) -> None:
    one = audit(lake, 3, 4)  # step 3 only
    assert one.attrs["source"] == "catalog" and one["examples"].sum() == BATCH
    assert (one.attrs["first_step"], one.attrs["stop_step"]) == (3, 4)
    assert audit(lake, 0, 10)["examples"].sum() == 10 * BATCH
    plan = mixture_plan(lake, 3, 6)
    assert sorted(set(plan["step"])) == [3, 4, 5]
    mixture_id = mixture_spec(lakeloader.load_config(lake)).mixture_id
    sql = open_lake(lake).sql("SELECT DISTINCT step FROM mixture_plan(?, 3, 6) ORDER BY step", [mixture_id])
    assert sql["step"].tolist() == [3, 4, 5]
    props = open_lake(lake).sql("SELECT sum(examples) AS n FROM mixture_proportions(?, 0, 10)", [mixture_id])
    assert props["n"].tolist() == [10 * BATCH]
    assert main(["audit", str(lake), "--steps", "0:10", "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["examples"] for r in rows] == audit(lake, 0, 10)["examples"].tolist()
    with pytest.raises(LakeloaderError, match=r"first < stop"):
        audit(lake, 4, 4)


# -- integer sums --------------------------------------------------------------------------------

def test_integer_sums_stay_integers(lake: Path, capsys: pytest.CaptureFixture[str]) -> None:
    total = int(open_lake(lake).sql("SELECT num_tokens FROM datasets")["num_tokens"].sum())
    query = ("SELECT sum(num_tokens) AS tokens, sum(num_docs)::HUGEINT AS docs, "
             "sum(num_tokens) FILTER (WHERE false) AS nothing, avg(num_tokens) AS mean FROM chunks")
    frame = open_lake(lake).sql(query)
    assert str(frame["tokens"].dtype) == "int64" and frame["tokens"].iloc[0] == total
    assert str(frame["docs"].dtype) == "int64"
    assert str(frame["nothing"].dtype) == "Int64" and frame["nothing"].isna().all()
    assert frame["mean"].dtype.kind == "f"
    assert main(["sql", str(lake), query, "--format", "json"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    assert type(row["tokens"]) is int and row["tokens"] == total and row["nothing"] is None
    assert main(["sql", str(lake), "SELECT sum(num_tokens) AS tokens FROM chunks", "--format", "csv"]) == 0
    assert capsys.readouterr().out.splitlines() == ["tokens", str(total)]


# -- command line and packaging ------------------------------------------------------------------

def test_verbose_after_the_command_and_version(lake: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["status", str(lake), "-v"], ["-v", "status", str(lake)], ["status", str(lake), "--verbose"]):
        assert main(argv) == 0, argv
        assert "== Datasets ==" in capsys.readouterr().out
    result = _run("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"lakeloader {lakeloader.__version__}"


def test_py_typed_marker_ships_in_the_wheel() -> None:
    assert resources.files("lakeloader").joinpath("py.typed").is_file()
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "py.typed" in data["lakeloader"]


# -- batches -------------------------------------------------------------------------------------

def test_batches_streams_with_bounded_memory(lake: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    wide = _variant(lake, "wide", seq_len=2048, batch_size=32)
    steps, per_batch = 60, 32 * 2048 * 4 * 5  # five int32/float32 fields: 1.3 MB a batch
    Loader(wide).close()  # imports and first-use caches outside the measurement
    tracemalloc.start()  # numpy's arrays are traced: what the batches held in memory would show
    try:
        assert main(["batches", str(wide), "--steps", f"0:{steps}", "--out", str(tmp_path / "many.npz")]) == 0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # 79 MB of batches (twice that when stacked in memory); streamed, the peak stays near a few
    # batches and the loader's own state.
    assert peak < steps * per_batch / 3, f"peak {peak / 1e6:.0f} MB for {steps * per_batch / 1e6:.0f} MB of batches"
    assert "batches: 100%" in capsys.readouterr().err  # the progress bar, on stderr
    with np.load(tmp_path / "many.npz") as data, Loader(wide) as loader:
        assert list(data.keys()) == ["input_ids", "targets", "loss_mask", "segment_ids", "positions", "dataset_ids",
                                     "dataset_names"]
        for step in (0, 17, steps - 1):
            for key, values in loader.batch(step).items():
                assert data[key].shape == (steps, *values.shape) and data[key].dtype == values.dtype
                assert np.array_equal(data[key][step], values), (step, key)
    assert [p.name for p in tmp_path.iterdir()] == ["many.npz"]  # no temporaries left


def test_batches_file_is_the_np_savez_file_and_atomic(lake: Path, tmp_path: Path) -> None:
    from lakeloader.feed.npz import write_batches

    with Loader(lake) as loader:
        out, shapes = write_batches(loader, 2, 7, tmp_path / "new", progress=False)
        stacked = [loader.batch(step) for step in range(2, 7)]
        names = np.array(loader.dataset_names, dtype=str)
    np.savez(tmp_path / "old.npz", **{k: np.stack([b[k] for b in stacked]) for k in stacked[0]}, dataset_names=names)
    assert out == str(tmp_path / "new.npz") and shapes["input_ids"] == (5, BATCH, 64)
    assert (tmp_path / "new.npz").read_bytes() == (tmp_path / "old.npz").read_bytes()
    with Loader(lake, mode="eval") as loader:  # an eval pass ends: a range past it fails midway
        stop = loader.num_batches() + 2
        with pytest.raises(IndexError):
            write_batches(loader, 0, stop, tmp_path / "partial.npz", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.npz", "old.npz"]  # nothing half-written


# -- snapshots -----------------------------------------------------------------------------------

def test_snapshots_are_no_larger_than_their_content(lake: Path) -> None:
    folder = lake.parent / "lake" / SNAPSHOT_DIR
    snapshots = sorted(folder.glob("catalog-*.duckdb"))
    assert snapshots
    for path in snapshots:
        assert path.stat().st_size < 1_000_000, f"{path.name} is {path.stat().st_size:,} bytes"
    con, _ = open_snapshot(open_lake(lake))  # and readers open it as before
    try:
        assert con.execute("SELECT count(*) FROM chunks WHERE status = 'committed'").fetchone()[0] > 0
    finally:
        con.close()


# -- stale chunk folders -------------------------------------------------------------------------

def test_status_lists_and_gc_removes_stale_chunk_folders(lakes: Lakes, tmp_path: Path, dask_scheduler: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    config = _make_lake(lakes, tmp_path)
    root = tmp_path / "lake"
    old = {p.relative_to(root).as_posix() for p in root.glob("*/*") if p.parent.name in ("code", "mail")}
    assert main(["status", str(config)]) == 0
    assert "Stale chunk folders" not in capsys.readouterr().out
    raw = yaml.safe_load(config.read_text())
    raw["build"]["split_size"] = "32KB"  # a new fingerprint: every dataset rebuilt into a new folder
    config.write_text(yaml.safe_dump(raw))
    build(config, scheduler=dask_scheduler, progress=False)
    with Loader(config) as loader:
        before = [loader.batch(step) for step in range(6)]
    stale = open_lake(config).status()["stale_folders"]
    assert set(stale["folder"]) == old and (stale["files"] > 0).all() and (stale["bytes"] > 0).all()
    assert main(["status", str(config)]) == 0
    out = capsys.readouterr().out
    assert "Stale chunk folders" in out and "lakeloader gc" in out and all(f in out for f in old)

    holder = subprocess.Popen(  # a build holding the catalog: gc refuses and removes nothing
        [sys.executable, "-c", "import sys, time\nfrom lakeloader.catalog.store import CatalogWriter\n"
         f"w = CatalogWriter({str(root / 'catalog.duckdb')!r})\nprint('held', flush=True)\ntime.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        assert main(["gc", str(config)]) == 2
        assert "in use" in capsys.readouterr().err
    finally:
        holder.kill()
        holder.wait()
    assert all((root / folder).is_dir() for folder in old)

    assert main(["gc", str(config), "--dry-run", "--format", "json"]) == 0
    listed = {r["folder"] for r in json.loads(capsys.readouterr().out)}   # and replaced documents index files
    assert {f for f in listed if not f.startswith("_documents/")} == old
    assert all((root / folder).is_dir() for folder in old)
    assert main(["gc", str(config)]) == 0
    assert f"removed {len(listed)} stale chunk folders and documents index files" in capsys.readouterr().err
    assert not any((root / folder).exists() for folder in old)
    assert open_lake(config).status()["stale_folders"].empty
    live = open_lake(config).sql("SELECT chunk_dir FROM dataset_plans")["chunk_dir"]
    assert all(os.listdir(root / folder) for folder in live)
    with Loader(config) as loader:  # the lake reads bitwise the same
        assert_batches_equal([loader.batch(step) for step in range(len(before))], before, "after gc")
