"""Readers started before every dataset of a mixture has a committed chunk: they wait (in the build
driver's process and in others) for the chunks they need and read the same batches, bitwise, as
after the build; on a lake whose build failed before committing anything they fail with a clear
timeout naming the chunk they waited for, never a crash.

The timing is deterministic: the failed build leaves dataset ``big`` (one .jsonl.gz, so one chunk)
with nothing committed, and while the readers start, every worker of the real Dask cluster is held
busy, so the resumed build can commit nothing until the test lets it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from lakeloader.catalog.store import LiveCatalog
from lakeloader.catalog.audit import audit
from lakeloader.catalog.lake import Lake
from lakeloader.contracts.errors import InputError, LakeloaderError
from lakeloader.contracts.specs import make_template
from lakeloader.feed.loader import Loader
from lakeloader.index.render import stream_lengths
from lakeloader.ingest.driver import build
from lakeloader.read.catalog_view import CatalogView, ChunkWaitTimeout

from conftest import assert_batches_equal, batch_files, stdlib_texts, write_config

CLI = [sys.executable, "-m", "lakeloader.cli"]
STEPS = 4
READERS = [(packing, shuffle) for packing in ("concat", "pack") for shuffle in ("none", "window")]


def _jsonl(texts: list[str], bad_first_line: bool) -> bytes:
    lines = ["{not json"] if bad_first_line else []
    return "".join(f"{line}\n" for line in lines + [json.dumps({"text": t}) for t in texts]).encode()


def mixture_config(root: Path, bad: set[str]) -> Path:
    """Mixture ``{tiny: .5, big: .5}``: ``tiny`` is several small chunks, ``big`` one .jsonl.gz (one
    chunk). Datasets in ``bad`` start with a malformed line, so a build with ``on_error: raise``
    (this config) fails before committing their chunk 0. ``packing: pack``, so its build keeps
    the pack example counts every reader config below shares."""
    import gzip

    data = root / "data"
    data.mkdir(parents=True)
    (data / "tiny.jsonl").write_bytes(_jsonl(stdlib_texts("json"), "tiny" in bad))
    (data / "big.jsonl.gz").write_bytes(gzip.compress(_jsonl(stdlib_texts("asyncio", limit=12), "big" in bad), mtime=0))
    return write_config(
        root, {"tiny": {"sources": [str(data / "tiny.jsonl")]}, "big": {"sources": [str(data / "big.jsonl.gz")]}},
        build={"split_size": "8KB"},
        loader={"seq_len": 32, "batch_size": 16, "packing": "pack", "seed": 7, "wait_timeout": 120},
        mixture={"weights": {"tiny": 0.5, "big": 0.5}},
    )


def variant(config: Path, packing: str, shuffle: str, **loader: Any) -> Path:
    """The same lake and mixture read with ``packing`` and ``shuffle`` (and the inputs' bad lines
    skipped, which keeps the datasets' plans: ``on_error`` is not part of their fingerprint)."""
    raw = yaml.safe_load(config.read_text())
    raw["loader"].update(packing=packing, shuffle={"kind": shuffle, "window_chunks": 2}, **loader)
    for dataset in raw["datasets"].values():
        dataset["on_error"] = "skip"
    path = config.with_name(f"{packing}-{shuffle}.yaml")
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def fail_build(config: Path, scheduler: str) -> Lake:
    """Build ``config``, which fails on a malformed first line; the failed build publishes its
    catalog: every dataset planned, the bad ones with nothing committed."""
    with pytest.raises(InputError, match="line 1: malformed JSON"):
        build(config, scheduler=scheduler, progress=False)
    lake = Lake(yaml.safe_load(config.read_text())["lake"])
    assert (Path(lake.root) / "_catalog" / "CURRENT").exists()
    return lake


def committed(lake: Lake) -> dict[str, int]:
    """Committed prefix of each dataset in the lake's published catalog."""
    view = CatalogView(lake)
    try:
        return {name: view.dataset(name).committed for name in ("tiny", "big")}
    finally:
        view.close()


@contextlib.contextmanager
def workers_held(scheduler: str, folder: Path) -> Iterator[None]:
    """Every worker of the Dask cluster runs a task that ends only when this context exits: chunk
    tasks submitted meanwhile queue behind them (single-threaded workers)."""
    from distributed import Client

    release = folder / "release"

    def hold(started: str, release: str) -> None:
        import os
        import time

        open(started, "w").close()
        while not os.path.exists(release):
            time.sleep(0.02)

    with Client(scheduler) as client:
        workers = list(client.scheduler_info()["workers"])
        started = [folder / f"held-{n}" for n in range(len(workers))]
        futures = [client.submit(hold, str(flag), str(release), workers=[worker], allow_other_workers=False,
                                 pure=False) for flag, worker in zip(started, workers)]
        try:
            deadline = time.monotonic() + 60
            while not all(flag.exists() for flag in started):
                assert time.monotonic() < deadline, "the Dask workers did not start the holding tasks"
                time.sleep(0.02)
            yield
        finally:
            release.touch()
            client.gather(futures)


def load_steps(path: Path) -> list[dict[str, np.ndarray]]:
    """Batches of a ``lakeloader batches --out`` file, one dict per step."""
    data = batch_files(path)
    return [{name: values[step] for name, values in data.items()} for step in range(STEPS)]


@pytest.mark.parametrize("kinds", [("text",), ("system", "user", "assistant")])
def test_stream_lengths_of_no_chunks(kinds: tuple[str, ...]) -> None:
    """A dataset with no committed chunk (or a chunk without row groups) has no stream lengths."""
    template = make_template(kinds, bos=1, eos=2, part_prefix={kinds[-1]: [3, 4]})
    empty = np.zeros(0, np.int64)
    lengths = stream_lengths(template, empty, empty, np.zeros((0, len(kinds)), np.int64), empty)
    assert lengths.dtype == np.int64 and lengths.shape == (0,)
    one = stream_lengths(template, [5], [1], np.ones((1, len(kinds)), np.int64), [0])
    assert one.tolist() == [5 + 2 + 2]


def test_readers_wait_for_a_dataset_without_committed_chunks(tmp_path: Path, dask_scheduler: str) -> None:
    config = mixture_config(tmp_path, bad={"big"})
    lake = fail_build(config, dask_scheduler)
    assert committed(lake)["big"] == 0
    configs = {key: variant(config, *key) for key in READERS}
    logs = {key: tmp_path / f"{key[0]}-{key[1]}.log" for key in READERS}
    outputs = {key: tmp_path / f"{key[0]}-{key[1]}.npz" for key in READERS}
    errors: list[BaseException] = []
    readers: dict[tuple[str, str], subprocess.Popen[bytes]] = {}
    in_process: dict[tuple[str, str], concurrent.futures.Future[list[dict[str, np.ndarray]]]] = {}
    pool = concurrent.futures.ThreadPoolExecutor(len(READERS))

    def resume() -> None:
        try:   # reads with on_error: skip: the same plan, the bad line goes to rejects
            build(configs[("pack", "none")], scheduler=dask_scheduler, progress=False, live=live)
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    live = LiveCatalog()   # the build's live catalog, for the readers in this process
    builder = threading.Thread(target=resume)
    try:
        with workers_held(dask_scheduler, tmp_path):
            for key in READERS:   # other processes, on the failed build's published catalog
                with logs[key].open("wb") as log:
                    readers[key] = subprocess.Popen(
                        [*CLI, "batches", str(configs[key]), "--steps", f"0:{STEPS}", "--out", str(outputs[key])],
                        stdout=subprocess.DEVNULL, stderr=log)
            builder.start()
            deadline = time.monotonic() + 60
            while not live.is_open:
                assert builder.is_alive() and time.monotonic() < deadline, errors
                time.sleep(0.01)
            for key in READERS:   # the build driver's process: its live catalog
                loader = Loader(configs[key], catalog=live)
                assert [d.chunks.committed for d in loader.datasets][1] == 0
                in_process[key] = pool.submit(lambda loader=loader: [loader.batch(s) for s in range(STEPS)])
            deadline = time.monotonic() + 90
            while not all("waiting for chunk" in logs[key].read_text() for key in READERS):
                for key, reader in readers.items():
                    assert reader.poll() is None, f"{key} exited early:\n{logs[key].read_text()}"
                assert time.monotonic() < deadline, {key: logs[key].read_text() for key in READERS}
                time.sleep(0.05)
            for future in in_process.values():   # blocked on dataset big's chunk 0
                assert not future.done(), future.result()
        for key, reader in readers.items():
            assert reader.wait(timeout=120) == 0, f"{key}:\n{logs[key].read_text()}"
        during = {key: future.result(timeout=120) for key, future in in_process.items()}
        builder.join(timeout=120)
        assert not builder.is_alive() and not errors, errors
    finally:   # the holding tasks are released by now: nothing below waits for long
        pool.shutdown(wait=False, cancel_futures=True)
        for reader in readers.values():
            if reader.poll() is None:
                reader.kill()
        if builder.is_alive():
            builder.join(timeout=120)
    assert committed(lake)["big"] == 1
    for key in READERS:
        after = Loader(configs[key])
        assert all(d.chunks.complete for d in after.datasets)
        expected = [after.batch(step) for step in range(STEPS)]
        assert_batches_equal(load_steps(outputs[key]), expected)
        assert_batches_equal(during[key], expected)


def test_lake_whose_build_failed_before_committing_anything(tmp_path: Path, dask_scheduler: str) -> None:
    config = mixture_config(tmp_path, bad={"tiny", "big"})
    lake = fail_build(config, dask_scheduler)
    assert committed(lake) == {"tiny": 0, "big": 0}
    for key in READERS:
        loader = Loader(variant(config, *key, wait_timeout=0.5))
        started = time.monotonic()
        with pytest.raises(ChunkWaitTimeout) as error:
            loader.batch(0)
        assert time.monotonic() - started < 30
        message = str(error.value)
        assert "chunk 0 of dataset 'tiny'" in message and "none of its" in message, message
        if key == READERS[-1]:   # and provenance of the batch waits the same way
            with pytest.raises(ChunkWaitTimeout, match="chunk 0 of dataset 'tiny'"):
                loader.explain(0)
        loader.close()
    out = tmp_path / "x.npz"
    reader = subprocess.run([*CLI, "batches", str(variant(config, "pack", "window", wait_timeout=0.5)),
                             "--steps", "0:1", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert reader.returncode == 2, (reader.stdout, reader.stderr)
    assert "waiting for chunk 0 of dataset 'tiny'" in reader.stderr, reader.stderr
    assert "waited 0.5s for chunk 0 of dataset 'tiny'" in reader.stderr and "Traceback" not in reader.stderr
    assert not out.exists()
    # The audit of a pack mixture needs example counts the build has not made yet: it says so.
    with pytest.raises(LakeloaderError) as error:
        audit(variant(config, "pack", "window"), 0, 1)
    message = str(error.value)
    assert message.startswith("the audit's token shares under packing: pack needs dataset"), message
    assert "mixture.unit" not in message
