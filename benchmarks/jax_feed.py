"""JAX feed throughput: global device batches from the lake vs device_put of in-memory arrays.

For B=64, L=2048 on 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8 on CPU),
measures steps/s and tokens/s of `JaxFeed` with and without device prefetch, next to
`jax.device_put` of same-shaped arrays already in host memory with the same sharding (ratio).

    .venv/bin/python benchmarks/jax_feed.py     (sets that XLA_FLAGS itself unless given)
"""

from __future__ import annotations

import logging
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")   # before jax starts

import jax  # noqa: E402
import numpy as np  # noqa: E402
from _common import report  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402
from loader_throughput import BATCH, OUT, SEQ, config_for  # noqa: E402

from lakeloader.ingest.driver import build  # noqa: E402

STEPS = 100


def feed_rate(config: str, mesh: Mesh, prefetch: int) -> float:
    from lakeloader.feed.jax import JaxFeed

    with JaxFeed(config, mesh, PartitionSpec("data"), prefetch=prefetch) as feed:
        iterator = feed.iter_from(0)
        jax.block_until_ready(next(iterator))  # warm-up: compile nothing, open files
        started = time.perf_counter()
        for _, batch in zip(range(STEPS), iterator):
            jax.block_until_ready(batch)
        return STEPS / (time.perf_counter() - started)


def device_put_rate(mesh: Mesh) -> float:
    sharding = NamedSharding(mesh, PartitionSpec("data"))
    rng = np.random.default_rng(0)
    host = {name: rng.integers(0, 8000, (BATCH, SEQ)).astype(np.int32)
            for name in ("input_ids", "targets", "segment_ids", "positions")}
    host["loss_mask"] = np.ones((BATCH, SEQ), np.float32)
    jax.block_until_ready(jax.device_put(host, sharding))
    started = time.perf_counter()
    for _ in range(STEPS):
        jax.block_until_ready(jax.device_put(host, sharding))
    return STEPS / (time.perf_counter() - started)


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    config = config_for("global")
    if not (OUT / "loader-lake" / "catalog.duckdb").exists():
        build(config, workers=2, progress=False)
    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("data",))
    baseline = device_put_rate(mesh)
    figures: dict[str, object] = {
        "devices": f"{len(devices)} x {devices[0].platform} ({devices[0].device_kind})",
        "batch": f"B={BATCH}, L={SEQ}",
        "device_put_steps_per_s": round(baseline, 1),
        "device_put_tokens_per_s": round(baseline * BATCH * SEQ),
    }
    for prefetch in (0, 2):
        rate = feed_rate(config, mesh, prefetch)
        figures[f"feed_prefetch{prefetch}_steps_per_s"] = round(rate, 1)
        figures[f"feed_prefetch{prefetch}_tokens_per_s"] = round(rate * BATCH * SEQ)
        figures[f"feed_prefetch{prefetch}_ratio_to_device_put"] = round(rate / baseline, 3)
    report("jax_feed", figures)


if __name__ == "__main__":
    main()
