"""The JAX feed: global arrays laid out as asked, the same for 1 process of 8 devices and
2 processes of 4 devices, checkpointable with Orbax."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from lakeloader.feed.loader import Loader

from conftest import Lakes, assert_batches_equal, batch_files, stdlib_texts

STEPS = [0, 1, 2, 5, 1000]

WORKER = textwrap.dedent("""
    import json, sys
    import jax
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec

    config, out, coordinator, process_id, processes = sys.argv[1:6]
    if int(processes) > 1:
        jax.distributed.initialize(coordinator, int(processes), int(process_id))
    from lakeloader.feed.jax import JaxFeed

    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    arrays = {}
    with JaxFeed(config, mesh, PartitionSpec("data", None)) as feed:
        steps = json.loads(sys.argv[6])
        restored = feed.restore(json.loads(json.dumps(feed.state(steps[0]))))
        for step in steps:
            for tag, batch in (("step", feed.batch(step)), ("restored", next(restored) if step == steps[0] else None)):
                if batch is None:
                    continue
                for name, array in batch.items():
                    assert array.shape[0] == 16 and array.sharding.spec[0] == "data"
                    for shard in array.addressable_shards:
                        start = shard.index[0].start or 0
                        arrays[f"{tag}{step}/{name}/{start}"] = np.asarray(shard.data)
        arrays["rows"] = feed.rows
        arrays["devices"] = np.array([len(jax.local_devices()), len(jax.devices())])
    np.savez(out, **arrays)
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lake_config(lakes: Lakes, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return lakes.copy(
        tmp_path_factory.mktemp("jaxfeed"),
        {"code.jsonl": stdlib_texts("json") + stdlib_texts("email", limit=15),
         "notes.txt": "".join(f"{line}\n" for t in stdlib_texts("json") for line in t.splitlines() if line.strip())},
        {"code": {"sources": ["code.jsonl"]}, "notes": {"sources": ["notes.txt"]}},
        build={"split_size": "16KB"},
        loader={"seq_len": 32, "batch_size": 16, "shuffle": {"kind": "full"}, "seed": 3},
        mixture={"weights": {"code": 0.7, "notes": 0.3}})


def run_workers(config: Path, tmp: Path, processes: int, devices: int) -> list[dict[str, np.ndarray]]:
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
           "JAX_PLATFORMS": "cpu"}
    coordinator = f"127.0.0.1:{free_port()}"
    outs = [tmp / f"p{processes}-{i}.npz" for i in range(processes)]
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(config), str(out), coordinator, str(i),
                               str(processes), json.dumps(STEPS)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i, out in enumerate(outs)]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
    return [batch_files(out) for out in outs]


def assemble(parts: list[dict[str, np.ndarray]], tag: str, name: str) -> np.ndarray:
    pieces = {}
    for part in parts:
        for key, value in part.items():
            prefix, field, start = (key.split("/") + ["", ""])[:3]
            if prefix == tag and field == name:
                pieces[int(start)] = value  # replicas over the model axis are identical
    return np.concatenate([pieces[s] for s in sorted(pieces)])


def test_one_process_of_8_devices_equals_two_of_4(lake_config: Path, tmp_path: Path) -> None:
    single = run_workers(lake_config, tmp_path, processes=1, devices=8)
    double = run_workers(lake_config, tmp_path, processes=2, devices=4)
    assert single[0]["devices"].tolist() == [8, 8]
    assert [d["devices"].tolist() for d in double] == [[4, 8], [4, 8]]
    # Each host read only the rows its own devices hold.
    assert double[0]["rows"].tolist() == list(range(8)) and double[1]["rows"].tolist() == list(range(8, 16))
    reference = Loader(lake_config).batch(0)
    for step in STEPS:
        expected = Loader(lake_config).batch(step)
        for name in reference:
            one = assemble(single, f"step{step}", name)
            two = assemble(double, f"step{step}", name)
            assert one.dtype == two.dtype == expected[name].dtype
            assert np.array_equal(one, expected[name]) and np.array_equal(two, expected[name]), (step, name)
    for name in reference:  # the batch after a restore equals the uninterrupted one
        assert np.array_equal(assemble(double, f"restored{STEPS[0]}", name), assemble(single, f"step{STEPS[0]}", name))


def test_orbax_checkpoint_restores_the_same_batches(lake_config: Path, tmp_path: Path) -> None:
    import jax
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, PartitionSpec

    from lakeloader.feed.jax import JaxFeed

    mesh = Mesh(np.array(jax.devices()), ("data",))
    with JaxFeed(lake_config, mesh, PartitionSpec("data")) as feed:
        uninterrupted = [jax.device_get(b) for _, b in zip(range(6), feed.iter_from(0))]
        params = {"w": np.arange(6, dtype=np.float32)}
        with ocp.CheckpointManager(tmp_path / "ckpt", item_names=("params", "loader")) as manager:
            manager.save(3, args=ocp.args.Composite(params=ocp.args.StandardSave(params),
                                                    loader=ocp.args.JsonSave(feed.state(3))))
            manager.wait_until_finished()
        with ocp.CheckpointManager(tmp_path / "ckpt", item_names=("params", "loader")) as manager:
            restored = manager.restore(3, args=ocp.args.Composite(params=ocp.args.StandardRestore(params),
                                                                  loader=ocp.args.JsonRestore()))
    assert restored.loader == feed.state(3) and restored.loader["fingerprint"] == feed.fingerprint
    with JaxFeed(lake_config, mesh, PartitionSpec("data")) as again:
        resumed = [jax.device_get(b) for _, b in zip(range(3), again.restore(restored.loader))]
    assert_batches_equal(resumed, uninterrupted[3:], "restored from the checkpoint at step 3", steps=range(3, 6))
    with pytest.raises(Exception, match="fingerprint"):
        next(JaxFeed(lake_config, mesh, PartitionSpec("data")).restore({"step": 0, "fingerprint": "0" * 32}))


def test_device_batches_kept_by_the_caller_stay_as_they_were(lake_config: Path) -> None:
    """Device batches held across many later steps equal the loader's batches: a host array
    the transfer may share with a device array (all rows in this process) is never reused."""
    import jax
    from jax.sharding import Mesh, PartitionSpec

    from lakeloader.feed.jax import JaxFeed

    mesh = Mesh(np.array(jax.devices()), ("data",))
    with JaxFeed(lake_config, mesh, PartitionSpec("data"), prefetch=2) as feed:
        held = [b for _, b in zip(range(40), feed.iter_from(0))]
        assert len(feed.rows) == 16   # one process: the whole batch in one transfer
    expected = [Loader(lake_config).batch(step) for step in range(40)]
    assert_batches_equal([jax.device_get(b) for b in held], expected, "device batches held by the caller",
                         steps=range(40))
