"""JAX feed throughput: global device batches from the lake vs device_put of in-memory arrays.

For B=64, L=2048 (``packing: concat``, no shuffle) on every device JAX sees (on CPU, eight:
XLA_FLAGS=--xla_force_host_platform_device_count=8, set here unless given; on a GPU host, its
GPUs), measures steps/s and tokens/s of `JaxFeed` with and without device prefetch, and with
``loader.workers`` worker processes if asked, next to `jax.device_put` of same-shaped arrays
already in host memory with the same sharding (ratio).

    .venv/bin/python benchmarks/jax_feed.py [--size bench|demo] [--workers 0 2] [--steps 100]
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")   # before jax starts

import jax  # noqa: E402
import numpy as np  # noqa: E402
from _common import report  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402
from loader_throughput import BATCH, SEQ, build_lake, config_for, is_built  # noqa: E402

from lakeloader.feed import workers as feed_workers  # noqa: E402
from lakeloader.feed.jax import JaxFeed  # noqa: E402


def feed_rates(config: Path, mesh: Mesh, prefetch: int, steps: int) -> tuple[float, float]:
    """Steps/s of ``steps`` device batches early in the first epoch (row groups decoded as they
    are first needed, as on a lake larger than the cache; with workers, this process builds the
    first batches while they start, as users run it), and of ``steps`` in the second epoch with
    the workers building every batch from their row-group caches (without that, a short
    second epoch on a host whose workers take seconds to import JAX would time this process)."""
    rates = []
    try:
        for build_while_starting, warm in ((True, 5), (False, None)):
            feed_workers.BUILD_WHILE_STARTING = build_while_starting
            with JaxFeed(config, mesh, PartitionSpec("data"), prefetch=prefetch) as feed:
                epoch = feed.loader.datasets[0].train_count() // BATCH   # one dataset in this lake
                iterator = feed.iter_from(0)
                for _, batch in zip(range(warm or epoch + 5), iterator):   # files opened / the first epoch
                    jax.block_until_ready(batch)
                started = time.perf_counter()
                for _, batch in zip(range(steps), iterator):
                    jax.block_until_ready(batch)
                rates.append(steps / (time.perf_counter() - started))
    finally:
        feed_workers.BUILD_WHILE_STARTING = True
    return rates[0], rates[1]


def device_put_rate(mesh: Mesh, steps: int) -> float:
    sharding = NamedSharding(mesh, PartitionSpec("data"))
    rng = np.random.default_rng(0)
    host = {name: rng.integers(0, 8000, (BATCH, SEQ)).astype(np.int32)
            for name in ("input_ids", "targets", "segment_ids", "positions")}
    host["loss_mask"] = np.ones((BATCH, SEQ), np.float32)
    jax.block_until_ready(jax.device_put(host, sharding))
    started = time.perf_counter()
    for _ in range(steps):
        jax.block_until_ready(jax.device_put(host, sharding))
    return steps / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("bench", "demo"), default="bench")
    parser.add_argument("--workers", type=int, nargs="+", default=[0], help="loader.workers values to measure")
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if not is_built(args.size):
        build_lake(args.size)
    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("data",))
    baseline = device_put_rate(mesh, args.steps)
    figures: dict[str, object] = {
        "devices": f"{len(devices)} x {devices[0].platform} ({devices[0].device_kind})",
        "batch": f"B={BATCH}, L={SEQ}", "corpus": args.size,
        "loadavg_before": Path("/proc/loadavg").read_text().split()[:3],
        "device_put_steps_per_s": round(baseline, 1),
        "device_put_tokens_per_s": round(baseline * BATCH * SEQ),
    }
    for workers in args.workers:
        for prefetch in (0, 2):
            rates = feed_rates(config_for(args.size, "concat", "none", workers), mesh, prefetch, args.steps)
            for epoch, rate in zip(("first_epoch", "cached"), rates):
                name = f"feed_workers{workers}_prefetch{prefetch}_{epoch}"
                figures[f"{name}_steps_per_s"] = round(rate, 1)
                figures[f"{name}_tokens_per_s"] = round(rate * BATCH * SEQ)
                figures[f"{name}_ratio_to_device_put"] = round(rate / baseline, 3)
    figures["loadavg_after"] = Path("/proc/loadavg").read_text().split()[:3]
    report("jax_feed" if args.size == "bench" else f"jax_feed_{args.size}", figures)


if __name__ == "__main__":
    main()
