"""Loader throughput with ``loader.workers`` = 0, 1, 2, ... worker processes.

For B=64, L=2048, ``packing: concat``, each shuffle asked for, each worker count in a fresh
subprocess (``loader_throughput.py --measure``): steady-state tokens/s (the median of the epochs
after the first) with the workers building every batch (row groups cached in every worker: their
steady state) and the CPU time a batch costs there, in this process (receiving it) and in the
workers (building it: their sum); and, as users run it (this process building the first batches
while the workers start), tokens/s over the first epoch and the seconds from opening the loader to
its first batch; rounds interleaved, medians reported with the load average, and the ratio of 2
workers to 1 (target: >= 1.7; it needs spare cores: run it where the workers do not share cores
with each other or with other work).

    .venv/bin/python benchmarks/loader_workers.py [--size bench|demo] [--workers 0 1 2 4]
        [--shuffle none full] [--repeat 3]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
from pathlib import Path

from _common import report
from loader_throughput import BATCH, SEQ, build_lake, config_for, in_subprocess, is_built


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("bench", "demo"), default="bench")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--shuffle", nargs="+", default=["none", "full"])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if not is_built(args.size):
        build_lake(args.size)
    rates: dict[tuple[str, int], list[float]] = {}        # steady state, the workers building every batch
    firsts: dict[tuple[str, int], list[float]] = {}       # first epoch, as users run it (start included)
    starts: dict[tuple[str, int], list[float]] = {}       # seconds from opening the loader to its first batch
    cpu: dict[tuple[str, int], list[tuple[float, float]]] = {}   # steady state: CPU µs a batch, here and in workers
    loads = [Path("/proc/loadavg").read_text().split()[0]]
    for _ in range(args.repeat):   # rounds interleaved: a change of load hits every count alike
        for shuffle in args.shuffle:
            for workers in args.workers:
                config = str(config_for(args.size, "concat", shuffle, workers))
                # Steady state: the workers build every batch (the epochs after the first, from their caches).
                steady = in_subprocess("--measure", config, "--workers-build-all")
                rates.setdefault((shuffle, workers), []).append(steady["tokens_per_s"])
                cpu.setdefault((shuffle, workers), []).append(
                    (steady["cpu_us_per_batch_here"], steady["cpu_us_per_batch_workers"]))
                # As users run it: this process builds the first batches while the workers start.
                measured = in_subprocess("--measure", config) if workers else steady
                firsts.setdefault((shuffle, workers), []).append(measured["first_epoch_tokens_per_s"])
                starts.setdefault((shuffle, workers), []).append(measured["first_batch_s"])
        loads.append(Path("/proc/loadavg").read_text().split()[0])
    figures: dict[str, object] = {"batch": f"B={BATCH}, L={SEQ}", "corpus": args.size, "cores": os.cpu_count(),
                                  "repeat": args.repeat, "loadavg_1min_per_round": " ".join(loads)}
    for (shuffle, workers), found in rates.items():
        figures[f"concat_{shuffle}_workers{workers}_tokens_per_s (median)"] = round(statistics.median(found))
        figures[f"concat_{shuffle}_workers{workers}_tokens_per_s (all)"] = " ".join(f"{r / 1e6:.1f}M" for r in found)
        figures[f"concat_{shuffle}_workers{workers}_first_epoch_tokens_per_s (median)"] = round(
            statistics.median(firsts[shuffle, workers]))
        figures[f"concat_{shuffle}_workers{workers}_first_batch_s (median)"] = round(
            statistics.median(starts[shuffle, workers]), 3)
        here, built = (statistics.median(values) for values in zip(*cpu[shuffle, workers]))
        figures[f"concat_{shuffle}_workers{workers}_cpu_us_per_batch_this_process (median)"] = round(here)
        if workers:
            figures[f"concat_{shuffle}_workers{workers}_cpu_us_per_batch_in_workers (median)"] = round(built)
    for shuffle in args.shuffle:
        if {(shuffle, 1), (shuffle, 2)} <= rates.keys():
            figures[f"concat_{shuffle}_2_vs_1_workers (target >= 1.7)"] = round(
                statistics.median(rates[shuffle, 2]) / statistics.median(rates[shuffle, 1]), 2)
    report("loader_workers" if args.size == "bench" else f"loader_workers_{args.size}", figures)


if __name__ == "__main__":
    main()
