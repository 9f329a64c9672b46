"""Stream a few batches of a lake into JAX devices and print throughput.

    .venv/bin/python examples/stream_to_jax.py configs/demo.yaml [--steps 20]

Each batch's rows are read by the lakeloader Loader (one process here) and placed on the local
devices sharded along the batch axis. Run with
XLA_FLAGS=--xla_force_host_platform_device_count=8 to see eight CPU devices.
"""

from __future__ import annotations

import argparse
import logging
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from lakeloader.feed.loader import Loader


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--start", type=int, default=0, help="first step (seek)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    loader = Loader(args.config)
    devices = np.array(jax.devices())
    mesh = Mesh(devices, ("data",))
    rows = loader.config.loader.batch_size
    if rows % len(devices):
        raise SystemExit(f"batch_size {rows} is not divisible by the {len(devices)} devices")
    sharding = NamedSharding(mesh, PartitionSpec("data"))
    print(f"devices: {len(devices)} x {devices[0].platform}; batch {rows} x {loader.config.loader.seq_len}; "
          f"loader fingerprint {loader.fingerprint}")

    tokens = 0
    started = time.perf_counter()
    for step, batch in enumerate(loader.iter_from(args.start)):
        arrays = {name: jax.device_put(value, sharding) for name, value in batch.items()}
        jax.block_until_ready(arrays)
        tokens += int(batch["loss_mask"].sum())
        if step == 0:
            first = time.perf_counter() - started
            shapes = {name: (a.shape, str(a.dtype)) for name, a in arrays.items()}
            print(f"first batch after {first * 1e3:.0f} ms: {shapes}")
        if step + 1 == args.steps:
            break
    seconds = time.perf_counter() - started
    print(f"streamed {args.steps} batches ({tokens:,} target tokens) in {seconds:.2f}s: "
          f"{args.steps / seconds:.1f} steps/s, {tokens / seconds:,.0f} tokens/s into {len(devices)} devices")
    print(loader.explain(args.start + args.steps - 1).head(8)[
        ["row", "dataset", "epoch", "chunk", "source", "location"]].to_string(index=False))


if __name__ == "__main__":
    main()
