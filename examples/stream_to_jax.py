"""Stream a few batches of a lake into JAX devices and print throughput.

    .venv/bin/python examples/stream_to_jax.py configs/demo.yaml [--steps 20] [--start 0]

Batches are global ``jax.Array``s sharded along the batch axis over a ``data`` mesh axis of all
devices (run with XLA_FLAGS=--xla_force_host_platform_device_count=8 for eight CPU devices).
"""

from __future__ import annotations

import argparse
import logging
import time

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from lakeloader import JaxFeed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--start", type=int, default=0, help="first step (a seek)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    mesh = Mesh(np.array(jax.devices()), ("data",))
    with JaxFeed(args.config, mesh, PartitionSpec("data")) as feed:
        loader = feed.loader.config.loader
        print(f"devices: {mesh.size} x {jax.devices()[0].platform}; batch {loader.batch_size} x "
              f"{loader.seq_len}; fingerprint {feed.fingerprint}")
        tokens = 0
        started = time.perf_counter()
        for step, batch in enumerate(feed.iter_from(feed.state(args.start))):
            jax.block_until_ready(batch)
            tokens += int(np.asarray(batch["loss_mask"]).sum())
            if step == 0:
                shapes = {name: tuple(a.shape) for name, a in batch.items()}
                print(f"first batch after {(time.perf_counter() - started) * 1e3:.0f} ms: {shapes}, "
                      f"sharding {batch['input_ids'].sharding.spec}")
            if step + 1 == args.steps:
                break
        seconds = time.perf_counter() - started
        print(f"streamed {args.steps} batches ({tokens:,} target tokens) in {seconds:.2f}s: "
              f"{args.steps / seconds:.1f} steps/s, {tokens / seconds:,.0f} tokens/s")
        print(feed.loader.explain(args.start + args.steps - 1).head(6)[
            ["row", "dataset", "epoch", "chunk", "source", "location"]].to_string(index=False))


if __name__ == "__main__":
    main()
