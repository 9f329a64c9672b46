"""``loader.workers: N``: batches built by worker processes into shared memory are bitwise the
batches of one process (concat and pack, shuffled or not, from any resume step), errors reach the
consumer, and no worker or shared-memory segment outlives the loader, even a SIGKILLed one."""

from __future__ import annotations

import functools
import itertools
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from lakeloader.contracts.errors import ChunkIntegrityError
from lakeloader.feed.loader import Loader
from lakeloader.feed.packed import LocatedPacked
from lakeloader.feed.rows import ROW_FIELDS
from lakeloader.feed import workers as workers_module
from lakeloader.feed.slots import Layout, Slots, field_of
from lakeloader.ingest.driver import build

from conftest import (alive, assert_batches_equal, children, shm_segments, spawned_workers, stdlib_texts,
                      write_config, write_jsonl)

STEPS = 10


@pytest.fixture(autouse=True)
def workers_build_from_the_first_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The consumer building the first batches while its workers start would leave these short
    tests' batches to it: here the workers build every batch (one test turns it back on)."""
    monkeypatch.setattr(workers_module, "BUILD_WHILE_STARTING", False)


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory, dask_scheduler: str) -> Path:
    """A small lake of several chunks, built with the pack plan registered."""
    root = tmp_path_factory.mktemp("workers")
    write_jsonl(root / "data" / "a.jsonl", stdlib_texts("json") + stdlib_texts("email", limit=12))
    config = write_config(root, {"d": {"sources": [str(root / "data" / "*.jsonl")]}},
                          build={"split_size": "8KB", "row_group_tokens": 500},
                          loader={"seq_len": 32, "batch_size": 8, "packing": "pack"})
    build(config, scheduler=dask_scheduler, progress=False)
    return root


def config_of(lake: Path, name: str, **loader: Any) -> Path:
    base = yaml.safe_load((lake / "config.yaml").read_text())
    base["loader"] = {"seq_len": 32, "batch_size": 8, "seed": 3, **loader}
    path = lake / f"{name}.yaml"
    path.write_text(yaml.safe_dump(base, sort_keys=False))
    return path


def one_process(config: Path, steps: range) -> list[dict[str, np.ndarray]]:
    with Loader(config) as loader:
        return [loader.batch(step) for step in steps]


def from_workers(config: Path, start: int, count: int) -> list[dict[str, np.ndarray]]:
    with Loader(config) as loader:
        iterator = loader.iter_from(loader.state(start))
        batches = list(itertools.islice(iterator, count))
        iterator.close()
    return batches


@pytest.mark.parametrize(("packing", "shuffle"), [("concat", "none"), ("concat", "full"), ("pack", "none"),
                                                  ("pack", "full")])
def test_workers_give_the_batches_of_one_process(lake: Path, packing: str, shuffle: str) -> None:
    reference = one_process(config_of(lake, f"{packing}-{shuffle}-0", packing=packing, shuffle=shuffle),
                            range(STEPS))
    for workers in (1, 2) if (packing, shuffle) == ("pack", "full") else (2,):
        config = config_of(lake, f"{packing}-{shuffle}-{workers}", packing=packing, shuffle=shuffle,
                           workers=workers, prefetch=3)
        got = from_workers(config, 0, STEPS)
        assert_batches_equal(got, reference)
        got[0]["input_ids"][:] = -1   # batches are the caller's own arrays: later ones unaffected
        assert not (got[1]["input_ids"] == -1).all()
    assert not shm_segments(os.getpid())


def test_batches_lent_from_shared_memory_stay_intact_while_referenced(lake: Path) -> None:
    """Batches are handed out over the workers' shared memory where it can be lent: a slot goes
    back to its worker only once nothing refers to its arrays, so whole batches kept, slices
    kept after the batch was dropped, and batches dropped at once all read as one process's."""
    steps = 40
    reference = one_process(config_of(lake, "lend-0", shuffle="full"), range(steps))
    config = config_of(lake, "lend-2", shuffle="full", workers=2, prefetch=2)
    kept, slices = {}, {}
    with Loader(config) as loader:
        iterator = loader.iter_from(0)
        for step, batch in zip(range(steps), iterator):
            if step % 3 == 0:
                kept[step] = batch
            elif step % 3 == 1:
                slices[step] = batch["input_ids"][:, 3:9]   # the batch itself is dropped
            del batch
        # A copy's base is pool memory it owns; a lent batch's is an array over the mapped slot.
        lent = sum(not b["input_ids"].base.flags.owndata for b in kept.values())
        iterator.close()
    assert lent > 0   # some batches were memory of the workers' slots, not copies
    assert_batches_equal([kept[s] for s in sorted(kept)], [reference[s] for s in sorted(kept)], steps=sorted(kept))
    for step, values in slices.items():
        assert np.array_equal(values, reference[step]["input_ids"][:, 3:9]), step
    assert not shm_segments(os.getpid())


def read_slot(slots: Slots, slot: int, layout: Layout) -> dict[str, np.ndarray]:
    """Copies of the fields ``layout`` says are in ``slot``, as the consumer maps them."""
    memory = slots.memory[slot]
    assert memory is not None
    return {field: field_of(memory, offset, np.dtype(dtype), shape).copy() for field, dtype, shape, offset in layout}


@pytest.mark.parametrize("packing", ["concat", "pack"])
def test_a_batch_built_in_its_slot_is_put_there_without_a_copy(lake: Path, packing: str) -> None:
    """A worker builds each batch in its shared-memory slot, where the slot's previous batch had
    its fields: putting it there copies none of them, the slot holds the batch bitwise (padding
    too, over the previous batch's values), and a slot that has to grow keeps the fields built in
    its old memory."""
    config = config_of(lake, f"slot-{packing}", packing=packing, shuffle="full")
    reference = one_process(config, range(6))
    slots = Slots(f"lakeloader_{os.getpid()}_slottest", 0, 2)
    try:
        with Loader(config) as loader:
            for step in range(6):
                slot = step % 2
                built = slots.pool(slot)
                batch = loader.batch(step, built)
                in_place = {f for f, v in batch.items() if built.memory is not None and np.shares_memory(v, built.memory)}
                _, layout, _ = slots.write(slot, batch, built)
                assert in_place == (set() if step < 2 else {*ROW_FIELDS, "dataset_ids"}), step   # a slot's first batch is copied
                assert_batches_equal([read_slot(slots, slot, layout)], [reference[step]], steps=[step])
            # A batch that no longer fits: its fields built in the slot are copied out before the
            # slot's memory is replaced by a larger one.
            built = slots.pool(0)
            batch = loader.batch(4, built)
            assert np.shares_memory(batch["input_ids"], slots.memory[0])
            batch["extra"] = np.arange(100_000, dtype=np.int64)
            before = slots.segments[0].name
            name, layout, _ = slots.write(0, batch, built)
            assert name != before and not np.shares_memory(batch["input_ids"], slots.memory[0])
            got = read_slot(slots, 0, layout)
            assert np.array_equal(got.pop("extra"), np.arange(100_000))
            assert_batches_equal([got], [reference[4]], steps=[4])
            del batch, built
    finally:
        slots.unlink_all()
    assert not shm_segments(os.getpid())


def test_the_consumer_builds_while_its_workers_start_then_hands_over(lake: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While its workers start, the consumer builds the batches itself (its first batch does not
    wait a worker's start); once they are ready they build from the first step it has not built.
    Bitwise the batches of one process across the hand-over, from a resume step."""
    monkeypatch.setattr(workers_module, "BUILD_WHILE_STARTING", True)
    start, after = 5, 3 * workers_module.BLOCK * 2
    config = config_of(lake, "handover-2", shuffle="full", workers=2, prefetch=2)
    got, built_here = [], []
    with Loader(config) as loader:
        iterator = loader.iter_from(start)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and built_here.count(False) < after:
            batch = next(iterator)
            # Dropped at once: a worker's batch is then always lent (an array over its slot), one
            # built here is pool memory of its own.
            built_here.append(bool(batch["input_ids"].base.flags.owndata))
            got.append({name: values.copy() for name, values in batch.items()})
            del batch
            time.sleep(0.001)   # a trainer's step: fewer batches for the reference below
        iterator.close()
    assert built_here[0] and not built_here[-1], built_here[:3]
    handover = built_here.index(False)
    assert built_here == [True] * handover + [False] * (len(built_here) - handover)   # never back
    assert_batches_equal(got, one_process(config_of(lake, "handover-0", shuffle="full"),
                                          range(start, start + len(got))))
    assert not shm_segments(os.getpid())


def test_resume_with_workers_equals_the_tail(lake: Path) -> None:
    reference = one_process(config_of(lake, "resume-0", shuffle="full"), range(STEPS))
    config = config_of(lake, "resume-2", shuffle="full", workers=2, prefetch=1)
    for start in (3, 7):
        assert_batches_equal(from_workers(config, start, STEPS - start), reference[start:])
    assert not shm_segments(os.getpid())


@pytest.mark.parametrize("shuffle", ["none", "full"])
def test_packed_workers_past_the_first_epoch_give_the_batches_of_steps_asked_alone(
        lake: Path, shuffle: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the first epoch a worker's loader finds its blocks' row groups cached and makes each
    block's fill parts once (asked in a worker's runs of :data:`BLOCK` steps, it uses half of each
    block): two workers' batches over an epoch and a half are bitwise those of one loader asked
    every step alone (seeks, in reverse order)."""
    config = config_of(lake, f"epochs-{shuffle}-0", packing="pack", shuffle=shuffle)
    with Loader(config) as loader:
        steps = range(loader.datasets[0].train_count() // 8 * 3 // 2)
        alone = {step: loader.batch(step) for step in reversed(steps)}
    reference = [alone[step] for step in steps]
    # In this process, the steps a worker of two builds take the cached blocks' path here too.
    blocks: list[int] = []
    parts_of = LocatedPacked.parts_of
    monkeypatch.setattr(LocatedPacked, "parts_of", lambda self, size: blocks.append(len(self)) or parts_of(self, size))
    mine = [step for step in steps if step // workers_module.BLOCK % 2 == 0]
    with Loader(config) as loader:
        assert_batches_equal([loader.batch(step) for step in mine], [reference[step] for step in mine],
                             "a worker's steps", mine)
    assert blocks, "no block of cached row groups"
    workers = config_of(lake, f"epochs-{shuffle}-2", packing="pack", shuffle=shuffle, workers=2, prefetch=3)
    assert_batches_equal(from_workers(workers, 0, len(steps)), reference, "two workers", steps)
    assert not shm_segments(os.getpid())


def test_a_workers_error_is_raised_by_the_consumer(lake: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    config = config_of(lake, "error", shuffle="none", workers=2)
    loader = Loader(config)
    chunks = loader.datasets[0].chunks
    step = next(s for s in range(2, 40) if {p.chunk for e in loader.examples(s).examples for p in e.pieces} -
                {p.chunk for s0 in range(2) for e in loader.examples(s0).examples for p in e.pieces})
    needed = {p.chunk for e in loader.examples(step).examples for p in e.pieces}
    early = {p.chunk for s0 in range(step) for e in loader.examples(s0).examples for p in e.pieces}
    victim = sorted(needed - early)[0]
    path = lake / "lake" / chunks.record(victim).path
    original = path.read_bytes()
    try:
        path.write_bytes(original[:-10])    # cut short: a ChunkIntegrityError naming the chunk
        with pytest.raises(ChunkIntegrityError, match=chunks.record(victim).path):
            batches = []
            for batch in loader.iter_from(0):
                batches.append(batch)
        assert len(batches) == step   # every earlier batch came first, in order
    finally:
        path.write_bytes(original)
        loader.close()
    assert not shm_segments(os.getpid())
    # The failed worker kept nothing over its slots (the error's frames held arrays over one): its
    # segments closed when it stopped, without complaints at its exit.
    assert "Exception ignored" not in capfd.readouterr().err


def a_loader_that_cannot_open() -> Loader:
    """A worker's ``make_loader`` failing as a config the worker cannot read would."""
    raise ChunkIntegrityError("chunk 3 of dataset 'd' is missing: opened by a worker")


def test_a_worker_that_cannot_open_its_loader_is_an_error_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's error opening its loader reaches the consumer, same type and message, whether the
    consumer is still building the first batches itself or already waits for the workers'."""
    for while_starting in (True, False):
        monkeypatch.setattr(workers_module, "BUILD_WHILE_STARTING", while_starting)
        built_here = []
        batches = workers_module.worker_batches(a_loader_that_cannot_open, 2, 0, None, 2,
                                                lambda step: built_here.append(step) or {})
        with pytest.raises(ChunkIntegrityError, match="opened by a worker") as raised:
            for _ in itertools.islice(batches, 100_000):
                time.sleep(0.001)
        assert "raised in loader worker" in "".join(raised.value.__notes__)
        assert bool(built_here) == while_starting
        batches.close()
    assert not shm_segments(os.getpid())


class GatedLoader:
    """A real loader whose batches after the first wait for file ``gate``, as batches waiting for
    a chunk of a build in progress do, and that says the lake is built (``complete``) or not."""

    def __init__(self, config: Path, gate: str, complete: bool) -> None:
        self.loader, self.gate, self.complete = Loader(config), gate, complete

    def batch(self, step: int, pool: Any = None) -> dict[str, np.ndarray]:
        while step and not os.path.exists(self.gate):
            time.sleep(0.01)
        return self.loader.batch(step, pool)

    def close(self) -> None:
        self.loader.close()


@pytest.mark.parametrize("complete", [False, True])
def test_a_batch_built_while_the_lake_is_built_is_announced_at_once(lake: Path, tmp_path: Path,
                                                                     complete: bool) -> None:
    """While the lake is being built a worker announces each batch once it is built: the next one
    may wait long for a chunk. Once the lake is built it announces them two at a time (one
    wake-up of a waiting consumer for two), the first when the second is built too, and the last
    one alone before it waits (odd total); the batches are the same either way."""
    gate = tmp_path / "gate"
    config = config_of(lake, "gated", shuffle="none")
    batches = workers_module.worker_batches(functools.partial(GatedLoader, config, str(gate), complete),
                                            1, 0, 5, 2)
    got: list[dict[str, np.ndarray]] = []
    consumer = threading.Thread(target=lambda: got.extend(batches), daemon=True)
    consumer.start()
    deadline = time.monotonic() + (5 if complete else 60)   # (a spawned worker starts in about a second)
    while not got and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(got) == (0 if complete else 1)
    gate.touch()
    consumer.join(60)
    assert not consumer.is_alive(), "the worker's last batches never came"
    assert_batches_equal(got, [Loader(config).batch(step) for step in range(5)])
    got.clear()
    assert not shm_segments(os.getpid())


def test_closing_removes_a_segment_a_killed_worker_never_announced(lake: Path) -> None:
    """A worker killed between creating a slot's segment and announcing it leaves one the
    consumer never heard of: closing the pool finds it by the pool's name prefix and removes it."""
    pool = workers_module.WorkerPool(functools.partial(Loader, config_of(lake, "stray", shuffle="none")), 1, None, 4)
    stray = shared_memory.SharedMemory(f"{pool.prefix}_0_3_9", create=True, size=4096)
    stray.close()
    assert shm_segments(os.getpid())
    pool.close()
    assert not shm_segments(os.getpid())


UNGUARDED = textwrap.dedent("""
    import sys
    from lakeloader.feed import workers
    from lakeloader.feed.loader import Loader
    workers.BUILD_WHILE_STARTING = sys.argv[2] == "starting"
    for step, batch in zip(range(100_000), Loader(sys.argv[1]).iter_from(0)):
        pass
""")


@pytest.mark.parametrize("phase", ["starting", "building"])
def test_a_script_without_a_main_guard_is_told_to_add_one(lake: Path, tmp_path: Path, phase: str) -> None:
    """A script that iterates a loader with workers at its top level (no ``if __name__ ==
    "__main__":``) has spawned workers that run it again and die starting their own: the script
    ends with a WorkerError that says to add the guard, whatever the consumer was doing then."""
    config = config_of(lake, "unguarded", shuffle="none", workers=2)
    script = tmp_path / "train.py"
    script.write_text(UNGUARDED)
    done = subprocess.run([sys.executable, str(script), str(config), phase], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("lakeloader.feed.workers.WorkerError: ") and 'if __name__ == "__main__":' in last, \
        done.stderr[-3000:]


PARENT = textwrap.dedent("""
    import signal, sys, time
    from lakeloader.feed import workers
    from lakeloader.feed.loader import Loader
    if __name__ == "__main__":
        workers.BUILD_WHILE_STARTING = sys.argv[2] == "starting"
        # Ctrl-C raises KeyboardInterrupt, as in a terminal, even when this test runs where SIGINT
        # is ignored (a job started with & by a non-interactive shell: children inherit that).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        loader = Loader(sys.argv[1])
        iterator = iter(loader)
        next(iterator)
        print("ready", flush=True)
        for batch in iterator:
            time.sleep(0.05)
""")


def test_a_worker_killed_while_building_is_an_error_here(lake: Path) -> None:
    """A worker killed while it builds batches (the kernel's out-of-memory killer, say) ends the
    consumer's iteration with a WorkerError naming the signal, not an error of the pipe beneath
    (the consumer's messages left unread make the pipe reset), and leaves no segment."""
    config = config_of(lake, "killed-worker", shuffle="full", workers=2, prefetch=2)
    before = children(os.getpid())
    with Loader(config) as loader:
        iterator = loader.iter_from(0)
        kept = list(itertools.islice(iterator, 6))   # kept: some of their slots stay lent
        started = spawned_workers(before)
        assert len(started) == 2
        os.kill(min(started), signal.SIGKILL)
        with pytest.raises(workers_module.WorkerError, match="was killed by SIGKILL"):
            for _ in itertools.islice(iterator, 1000):
                pass
        iterator.close()
        del kept
    assert not shm_segments(os.getpid())


def test_a_segment_a_killed_worker_left_empty_is_removed() -> None:
    """A worker killed between creating a segment and giving it its size leaves it empty (what
    ``shm_open`` makes before ``ftruncate``), which ``SharedMemory`` cannot map: the consumer's
    clean-up removes it all the same, and the sized segments it removes after it."""
    names = [f"lakeloader_{os.getpid()}_empty_test_{n}" for n in range(2)]
    os.close(os.open(os.path.join("/dev/shm", names[0]), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
    shared_memory.SharedMemory(names[1], create=True, size=64).close()
    for name in names:
        workers_module._unlink(name)
    assert not shm_segments(os.getpid())


@pytest.mark.parametrize(("how", "phase"), [("SIGKILL", "building"), ("SIGINT", "building"), ("SIGKILL", "starting")])
def test_no_worker_or_segment_outlives_the_parent(lake: Path, tmp_path: Path, how: str, phase: str) -> None:
    """Killed or interrupted while its workers build batches, or while they are still starting
    (the parent building the first batches itself), the parent leaves no worker and no segment."""
    config = config_of(lake, f"kill-{how}", shuffle="full", workers=2)
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    parent = subprocess.Popen([sys.executable, str(script), str(config), phase], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None and parent.stdout.readline().strip() == "ready", parent.stderr.read()
        workers = children(parent.pid)
        assert len(workers) >= 2 and (phase == "starting" or shm_segments(parent.pid))
        parent.send_signal(getattr(signal, how))
        try:   # communicate, not wait: a parent blocked writing to a full pipe never exits
            parent.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            parent.kill()
            raise AssertionError(f"the parent did not exit 30 s after {how}; its stderr:\n{parent.communicate()[1]}")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (shm_segments(parent.pid) or any(alive(p) for p in workers)):
            time.sleep(0.1)
        assert not shm_segments(parent.pid)
        assert not [p for p in workers if alive(p)]
    finally:
        if parent.poll() is None:
            parent.kill()


def test_jax_feed_with_workers_gives_the_same_arrays(lake: Path) -> None:
    import jax
    from jax.sharding import Mesh, PartitionSpec

    from lakeloader.feed.jax import JaxFeed

    mesh = Mesh(np.array(jax.devices()), ("data",))
    reference = one_process(config_of(lake, "jax-0", shuffle="full"), range(4))
    with JaxFeed(config_of(lake, "jax-2", shuffle="full", workers=2), mesh, PartitionSpec("data")) as feed:
        got = [{k: np.asarray(v) for k, v in b.items()} for b in itertools.islice(feed.restore(feed.state(0)), 4)]
    assert_batches_equal(got, reference)
    assert not shm_segments(os.getpid())
