"""Model-based test of the promises where they meet: random walks of what users do to one lake.

Each walk drives a seeded random sequence of real actions against one lake of a two-dataset
mixture (window shuffle), on the real parts: `lakeloader build` in a subprocess on the test
session's Dask cluster, SIGKILLed at a random moment; `lakeloader batches` readers in 1, 2 or 4
processes started while a build runs, making every row field or fewer (``loader.fields``); a
committed chunk deleted, truncated or with one byte flipped; `lakeloader verify --repair`; a
build to the end. The oracle is one uninterrupted build of the same data: every batch any
reader returns equals its batches bitwise (the fields it makes), a reader that cannot return
them fails with an error naming the damaged chunk, and after the last action the lake's chunk
files are byte-identical to the oracle's and `verify` finds nothing.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from lakeloader.feed.loader import Loader
from lakeloader.feed.rows import ROW_FIELDS
from lakeloader.ingest.driver import build

from conftest import (DEMO_TOKENIZER, FIELD_CHOICES, assert_batches_equal, batch_files, stdlib_texts, with_fields,
                      write_jsonl)

CLI = [sys.executable, "-m", "lakeloader.cli"]
BATCH, SEQ_LEN, STEPS = 8, 64, 24
WALKS = int(os.environ.get("LAKELOADER_MODEL_WALKS", "2"))
ACTIONS_PER_WALK = 7
TIMEOUT = 120


def paragraphs(package: str) -> list[str]:
    return [p for text in stdlib_texts(package) for p in text.split("\n\n") if p.strip()]


def lake_config(root: Path, data: Path, name: str, fields: tuple[str, ...] = ROW_FIELDS,
                config_name: str | None = None) -> Path:
    """A mixture of a small and a larger dataset over ``data``, its lake in ``root/name``, its
    loader making the row fields ``fields``; written to ``root/<config_name or name>.yaml``."""
    config = {
        "lake": str(root / name), "tokenizer": str(DEMO_TOKENIZER),
        "datasets": {"small": {"sources": [str(data / "small" / "*.jsonl")]},
                     "large": {"sources": [str(data / "large" / "*.jsonl")]}},
        "build": {"split_size": "8KB", "row_group_tokens": 400, "publish_interval": 0.2},
        "loader": {"seq_len": SEQ_LEN, "batch_size": BATCH, "wait_timeout": 60,
                   "shuffle": {"kind": "window", "window_chunks": 3}, "fields": list(fields)},
        "mixture": {"weights": {"small": 0.3, "large": 0.7}},
    }
    path = root / f"{config_name or name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def oracle(tmp_path_factory: pytest.TempPathFactory, dask_scheduler: str) -> dict[str, Any]:
    """The data, and the chunk files and batches of one uninterrupted build of it."""
    root = tmp_path_factory.mktemp("model")
    data = root / "data"
    write_jsonl(data / "small" / "z.jsonl", paragraphs("zoneinfo"))
    write_jsonl(data / "large" / "a.jsonl", stdlib_texts("json") + paragraphs("wsgiref"))
    write_jsonl(data / "large" / "b.jsonl", stdlib_texts("tomllib") + stdlib_texts("concurrent"))
    config = lake_config(root, data, "oracle")
    build(config, scheduler=dask_scheduler, progress=False)
    loader = Loader(config)
    batches = [loader.batch(step) for step in range(STEPS)]
    loader.close()
    return {"root": root, "data": data, "files": chunk_files(root / "oracle"), "batches": batches}


def chunk_files(lake: Path) -> dict[str, bytes]:
    """Every chunk file of a lake (relative path → bytes); snapshots and the catalog excluded."""
    return {str(p.relative_to(lake)): p.read_bytes() for p in sorted(lake.rglob("*.parquet"))
            if not p.relative_to(lake).parts[0].startswith("_")}


def run(*args: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


@contextlib.contextmanager
def build_process(config: Path, scheduler: str) -> Iterator[subprocess.Popen[bytes]]:
    """`lakeloader build` on the shared cluster in its own session, killed on exit if still alive."""
    proc = subprocess.Popen([*CLI, "build", str(config), "--scheduler", scheduler, "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


class LakeWalk:
    """One lake, the actions a user takes on it, and what the model expects of each."""

    def __init__(self, root: Path, oracle: dict[str, Any], scheduler: str, seed: int) -> None:
        self.rng = random.Random(seed)
        self.oracle = oracle
        self.scheduler = scheduler
        self.lake = root / f"walk{seed}"
        self.config = lake_config(root, oracle["data"], f"walk{seed}")
        self.work = root / f"walk{seed}-out"
        self.work.mkdir()
        self.damaged: set[str] = set()   # chunk files the model knows are wrong on disk
        self.log: list[str] = []

    def committed_chunks(self) -> list[str]:
        return sorted(p for p in chunk_files(self.lake) if p in self.oracle["files"])

    # -- actions -------------------------------------------------------------------------------

    def build_killed(self) -> None:
        """Start a build and SIGKILL its process group at a random moment."""
        delay = self.rng.uniform(0.5, 4.0)
        with build_process(self.config, self.scheduler) as proc:
            time.sleep(delay)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                self.expect_build_ok(proc)
        self.log.append(f"build killed after {delay:.2f}s")

    def build_reading(self) -> None:
        """Readers in P processes making some row fields start as soon as a snapshot is
        published while a build runs."""
        processes = self.rng.choice((1, 2, 4))
        first = self.rng.randrange(STEPS - 4)
        stop = self.rng.randrange(first + 1, min(STEPS, first + 8) + 1)
        fields = self.rng.choice(FIELD_CHOICES)
        self.log.append(f"build with {processes} reader(s) of steps {first}:{stop}, fields {','.join(fields)}")
        reader_config = lake_config(self.lake.parent, self.oracle["data"], self.lake.name, fields,
                                    f"{self.lake.name}-{len(self.log)}")
        damaged_at_start = set(self.damaged)  # a reader may meet them before this build repairs them
        with build_process(self.config, self.scheduler) as proc:
            deadline = time.monotonic() + 60
            while not (self.lake / "_catalog" / "CURRENT").exists():
                assert proc.poll() is None or proc.returncode == 0, proc.stdout.read().decode()
                assert time.monotonic() < deadline, "no snapshot published within 60 s"
                time.sleep(0.05)
            outs = [self.work / f"{len(self.log)}-{p}.npz" for p in range(processes)]
            readers = [subprocess.Popen(
                [*CLI, "batches", str(reader_config), "--steps", f"{first}:{stop}", "--process-index",
                 str(p), "--process-count", str(processes), "--out", str(out)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for p, out in enumerate(outs)]
            results = [(r, *r.communicate(timeout=TIMEOUT)) for r in readers]
            self.expect_build_ok(proc, timeout=TIMEOUT)
        self.damaged = {f for f in self.damaged if self.lake_file(f).read_bytes() != self.oracle["files"][f]}
        failed = [err for r, _, err in results if r.returncode != 0]
        if failed:
            assert damaged_at_start, f"a reader failed on a lake with no damage:\n{failed[0]}"
            named = {f for f in damaged_at_start if any(Path(f).name in err for err in failed)}
            assert named and all("lakeloader verify CONFIG --repair" in err for err in failed), failed
            return
        parts = [batch_files(out) for out in outs]
        got = [{k: np.concatenate([part[k][i] for part in parts]) for k in parts[0]}
               for i in range(stop - first)]
        assert_batches_equal(got, [with_fields(batch, fields) for batch in self.oracle["batches"][first:stop]])

    def damage(self) -> None:
        """Delete, truncate or flip one byte of a random committed chunk file."""
        chunks = self.committed_chunks()
        if not chunks:
            self.log.append("damage: no chunk committed yet")
            return
        victim = self.rng.choice(chunks)
        path = self.lake_file(victim)
        how = self.rng.choice(("delete", "truncate", "flip"))
        if how == "delete":
            path.unlink()
        elif how == "truncate":
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        else:
            content = bytearray(path.read_bytes())
            content[self.rng.randrange(4, len(content) - 8)] ^= 1 << self.rng.randrange(8)
            path.write_bytes(bytes(content))
        self.damaged.add(victim)
        self.log.append(f"damage: {how} {victim}")

    def repair(self) -> None:
        """`lakeloader verify --repair` leaves every committed chunk as the oracle's."""
        self.log.append("verify --repair")
        done = run("verify", str(self.config), "--repair", "--scheduler", self.scheduler, "--no-progress")
        if not (self.lake / "_catalog" / "CURRENT").exists():  # nothing published: nothing to repair
            assert done.returncode == 2 and "start `lakeloader build`" in done.stderr, done.stderr
            return
        assert done.returncode == 0, done.stdout + done.stderr
        for name in self.committed_chunks():
            assert self.lake_file(name).read_bytes() == self.oracle["files"][name], name
        self.damaged.clear()

    def build_complete(self) -> None:
        """A build to the end: missing or wrong-size chunks are rebuilt; a same-size flip is
        only caught by the full check of `verify`."""
        self.log.append("build to the end")
        with build_process(self.config, self.scheduler) as proc:
            self.expect_build_ok(proc, timeout=TIMEOUT)
        self.damaged = {f for f in self.damaged if self.lake_file(f).read_bytes() != self.oracle["files"][f]}
        for name in set(self.oracle["files"]) - self.damaged:
            assert self.lake_file(name).read_bytes() == self.oracle["files"][name], name

    # -- checks --------------------------------------------------------------------------------

    def lake_file(self, name: str) -> Path:
        return self.lake / name

    def expect_build_ok(self, proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
        out, _ = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, out.decode()

    def finish(self) -> None:
        """Repair, build to the end: the oracle's files, a clean verify and the oracle's batches."""
        self.repair()
        self.build_complete()
        assert chunk_files(self.lake) == self.oracle["files"]
        done = run("verify", str(self.config), "--no-progress")
        assert done.returncode == 0, done.stdout + done.stderr
        loader = Loader(self.config)
        assert_batches_equal([loader.batch(s) for s in range(STEPS)], self.oracle["batches"])
        loader.close()


@pytest.mark.parametrize("seed", range(WALKS))
def test_random_walks_keep_every_promise(oracle: dict[str, Any], dask_scheduler: str, seed: int) -> None:
    walk = LakeWalk(oracle["root"], oracle, dask_scheduler, seed)
    actions = [walk.build_killed, walk.build_reading, walk.damage, walk.repair, walk.build_complete]
    weights = [3, 3, 2, 1, 1]
    try:
        for _ in range(ACTIONS_PER_WALK):
            walk.rng.choices(actions, weights)[0]()
        walk.finish()
    except BaseException:
        print(f"walk {seed}: " + " -> ".join(walk.log))
        raise
