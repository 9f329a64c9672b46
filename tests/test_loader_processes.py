"""The loader across OS processes: `lakeloader batches` from 1, 2, 4 and 8 processes gives the same
global batches, and readers running while the lake is still being built get the same batches as
after the build (or a clear error when a chunk never comes)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from test_loader import BATCH, SEQ_LEN, assert_batches_equal, build_small_lake, loader_config, paragraphs
from tokenizers import Tokenizer

from lakeloader.catalog.lake import Lake
from lakeloader.feed.loader import Loader
from lakeloader.read.catalog_view import CatalogView, ChunkWaitTimeout

from conftest import DEMO_TOKENIZER, batch_files, write_config, write_jsonl

CLI = [sys.executable, "-m", "lakeloader.cli"]


def start(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(process: subprocess.Popen[str], timeout: float = 180) -> str:
    """Wait for a CLI process; fail with its output unless it succeeded. Returns its stderr."""
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == 0, f"{process.args} exited {process.returncode}:\n{out}\n{err}"
    return err


def load(path: Path) -> dict[str, np.ndarray]:
    return batch_files(path)


def assembled(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Global batches [steps, B, ...] from each process's [steps, rows, ...] blocks, in process order."""
    return {name: np.concatenate([p[name] for p in parts], axis=1) for name in parts[0]}


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory, dask_scheduler: str) -> Path:
    return build_small_lake(tmp_path_factory.mktemp("processes"), dask_scheduler)


@pytest.mark.parametrize("ordering", ["global", "strided"])
def test_cli_batches_identical_for_1_2_4_8_processes(lake: Path, tmp_path: Path, ordering: str) -> None:
    config = loader_config(lake, f"cli_{ordering}", ("d", "e"), ordering=ordering, ideal_readers=4)
    steps = 160   # past the first epoch of the small dataset e
    runs = {}
    for count in (1, 2, 4, 8):
        runs[count] = [
            (tmp_path / f"{count}-{p}.npz",
             start("batches", str(config), "--steps", f"0:{steps}", "--process-index", str(p),
                   "--process-count", str(count), "--out", str(tmp_path / f"{count}-{p}.npz")))
            for p in range(count)
        ]
    results = {}
    for count, procs in runs.items():
        for _, process in procs:
            finish(process)
        parts = [load(path) for path, _ in procs]
        assert {tuple(a.shape for name, a in part.items() if name != "dataset_ids") for part in parts} == {
            tuple((steps, BATCH // count, SEQ_LEN) for name in parts[0] if name != "dataset_ids")}
        assert {part["dataset_ids"].shape for part in parts} == {(steps, BATCH // count)}   # one id per row
        results[count] = assembled(parts)
    for count in (2, 4, 8):
        assert_batches_equal(results[count], results[1], f"{ordering}: {count} processes vs 1")
    loader = Loader(config)  # and the CLI writes exactly what the Python API gives
    for step in (0, 1, steps // 2, steps - 1):
        assert_batches_equal({k: v[step] for k, v in results[1].items()}, loader.batch(step), f"step {step}")


# -- reading while the lake is being built ---------------------------------------------------------


def slow_lake(root: Path, **loader: object) -> tuple[Path, int]:
    """A config whose build is slow by volume (hundreds of small splits of real text), and the
    number of training examples in one epoch of its stream (computed with the tokenizer)."""
    first, second = paragraphs("unittest"), paragraphs("asyncio")
    write_jsonl(root / "data" / "a.jsonl", first)
    write_jsonl(root / "data" / "b.jsonl", second)
    config = write_config(root, {"slow": {"sources": [str(root / "data" / "*.jsonl")]}},
                          build={"split_size": "3KB"},
                          loader={"seq_len": SEQ_LEN, "batch_size": BATCH, "shuffle": "none", **loader})
    tokenizer = Tokenizer.from_file(str(DEMO_TOKENIZER))
    encoded = tokenizer.encode_batch(first + second, add_special_tokens=False)
    stream = sum(len(e.ids) + 1 for e in encoded)
    return config, (stream - 1) // SEQ_LEN


def committed(lake: Lake) -> tuple[int, int]:
    """(committed prefix, planned chunks) of dataset 'slow' in the published snapshot; (0, 0)
    before anything is published."""
    try:
        view = CatalogView(lake)
    except Exception:  # noqa: BLE001 - nothing published yet
        return 0, 0
    try:
        chunks = view.dataset("slow")
        return chunks.committed, chunks.planned
    except Exception:  # noqa: BLE001 - the dataset is not planned yet
        return 0, 0
    finally:
        view.close()


def wait_until_committed(lake: Lake, builder: subprocess.Popen[str], at_least: int) -> tuple[int, int]:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        done, planned = committed(lake)
        if done >= at_least:
            return done, planned
        assert builder.poll() is None, f"the build ended early: {builder.communicate()}"
        time.sleep(0.05)
    pytest.fail("the build committed nothing in 120s")


def test_read_during_build_equals_batches_after_build(tmp_path: Path, dask_scheduler: str) -> None:
    config, per_epoch = slow_lake(tmp_path)
    strided = tmp_path / "strided.yaml"
    raw = yaml.safe_load(config.read_text())
    raw["loader"].update(ordering="strided", ideal_readers=4)
    strided.write_text(yaml.safe_dump(raw))
    lake = Lake(str(tmp_path / "lake"))
    builder = start("build", str(config), "--scheduler", dask_scheduler, "--no-progress")
    try:
        done, planned = wait_until_committed(lake, builder, 1)
        # All of epoch 0 and the start of epoch 1: needs every chunk, most of them not committed yet.
        steps = per_epoch // BATCH + 2
        readers = [
            start("batches", str(config), "--steps", f"0:{steps}", "--out", str(tmp_path / "global.npz")),
            start("batches", str(strided), "--steps", f"0:{steps}", "--process-index", "1",
                  "--process-count", "2", "--out", str(tmp_path / "strided.npz")),
        ]
        assert builder.poll() is None and done < planned // 2, (done, planned)
        logs = [finish(reader) for reader in readers]
        finish(builder)
    finally:
        if builder.poll() is None:
            builder.kill()
    assert planned > 300
    assert any("waiting for chunk" in log for log in logs), logs  # the readers did wait for the build

    after = Loader(config)
    assert after.datasets[0].train_count() == per_epoch and after.datasets[0].chunks.complete
    during = load(tmp_path / "global.npz")
    for step in range(steps):
        assert_batches_equal({k: v[step] for k, v in during.items()}, after.batch(step), f"global step {step}")
    after = Loader(strided, process_index=1, process_count=2)
    assert after.config.loader.ordering == "strided"
    during = load(tmp_path / "strided.npz")
    for step in range(steps):
        assert_batches_equal({k: v[step] for k, v in during.items()}, after.batch(step), f"strided step {step}")


def test_chunk_that_never_comes_is_a_clear_error(tmp_path: Path, dask_scheduler: str) -> None:
    config, _ = slow_lake(tmp_path, wait_timeout=1)
    lake = Lake(str(tmp_path / "lake"))
    builder = start("build", str(config), "--scheduler", dask_scheduler, "--no-progress")
    try:
        wait_until_committed(lake, builder, 3)
    finally:
        builder.kill()   # a crashed build: nothing more will be committed
        builder.communicate()
    loader = Loader(config)
    chunks = loader.datasets[0].chunks
    assert 3 <= chunks.committed < chunks.planned and not chunks.complete
    loader.batch(0)  # what is committed can be read
    beyond = int(loader.datasets[0].locator.stream_offsets()[-1]) // SEQ_LEN // BATCH + 1
    started = time.monotonic()
    with pytest.raises(ChunkWaitTimeout) as error:
        loader.batch(beyond)
    assert time.monotonic() - started < 30
    message = str(error.value)
    assert f"chunk {chunks.committed} " in message and "'slow'" in message, message

    reader = start("batches", str(config), "--steps", f"{beyond}:{beyond + 1}", "--out", str(tmp_path / "x.npz"))
    out, err = reader.communicate(timeout=120)
    assert reader.returncode == 2, (out, err)
    assert f"chunk {chunks.committed} " in err and "'slow'" in err and "Traceback" not in err
    assert not (tmp_path / "x.npz").exists()
