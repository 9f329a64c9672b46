"""Loader throughput and peak memory next to a plain numpy copy of the same windows.

Builds (once) a single-dataset lake of the benchmark corpus (standard-library and site-packages
sources; ``--size bench``: ~120 MB, ``--size demo``: a few MB for a quick look), then, for B=64,
L=2048, ``packing: concat`` and ``pack``, ``shuffle: none`` and ``full``, each in a fresh
subprocess (so that peak RSS is that configuration's alone):

- tokens/s (B*L per batch) over the first epoch from a fresh Loader (row groups decoded as they
  are first needed) and, served from the row-group cache, the median of the next ``PASSES``
  epochs, timed inside the loader's ``next()`` (the script's own count of padding tokens
  between batches is left out, as a trainer's step would be; the baselines do nothing between
  batches either);
- peak RSS of the process (``VmHWM``);
- the ratio to the baseline: a plain numpy copy of the same number of L+1-token windows from one
  in-memory token array of the whole lake (consecutive windows for ``none``, random ones for
  ``full``), measured in this run, also in a fresh subprocess, the median of ``PASSES`` passes
  (a median beside a median: one pass takes a fraction of a second, and a shared machine's
  speed drifts within seconds);
- the ratio to a second baseline: input ids and targets copied as two [B, L] arrays from the
  same tokens memory-mapped from a .npy file (two copies where the first makes one; the least a
  trainer needs as separate arrays).

The loader makes all five row fields unless ``--fields`` says which (``loader.fields``);
``--fields input_ids,targets`` makes what the baselines make.

Targets (README, performance): ratio >= 0.10 of the first baseline in one process, peak RSS <= 450 MB.

    .venv/bin/python benchmarks/loader_throughput.py [--size bench|demo] [--built] [--prefetch N]
        [--fields input_ids,targets]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import psutil   # of the dev extras every `make` target installs (the package itself does not need it)
import pyarrow.parquet as pq
import yaml
from _common import OUT, REPO, report

from lakeloader.demo.corpus import prepare_corpus

BATCH, SEQ = 64, 2048
PASSES = 5   # steady-state passes timed per configuration (and per baseline); their median is reported
CONFIGS = [(packing, shuffle) for packing in ("concat", "pack") for shuffle in ("none", "full")]


def lake_dir(size: str) -> Path:
    return OUT / f"loader-lake-{size}"


def is_built(size: str) -> bool:
    """Whether the ``size`` lake has a published catalog."""
    return (lake_dir(size) / "_catalog" / "CURRENT").exists()


def build_lake(size: str, packings: tuple[str, ...] = ("concat",)) -> None:
    """Build (or bring up to date) the ``size`` lake with the counts of ``packings``."""
    from lakeloader.ingest.driver import build  # only here: a built lake reads without Dask

    for packing in packings:   # a second packing only adds its plan's counts
        build(config_for(size, packing, "none"), workers=2, progress=False)


def config_for(size: str, packing: str, shuffle: str, workers: int = 0, prefetch: int | None = None,
               fields: list[str] | None = None) -> Path:
    """A config reading the ``size`` lake with the given packing, shuffle, ``loader.workers``,
    ``loader.prefetch`` (None: the default, 2) and ``loader.fields`` (None: the default, all five;
    defaults otherwise: verify checksum, cache_bytes as documented). The corpus is
    written only while the lake is not built: a built lake copied to another machine (a GPU
    host, say) reads without it."""
    corpus = OUT / f"{size}-corpus"
    if not is_built(size):
        prepare_corpus(corpus, size=size)  # type: ignore[arg-type]
    path = OUT / (f"loader-{size}-{packing}-{shuffle}{f'-workers{workers}' if workers else ''}"
                  f"{'' if prefetch is None else f'-prefetch{prefetch}'}"
                  f"{'' if fields is None else '-' + '-'.join(fields)}.yaml")
    read_ahead = {} if prefetch is None else {"prefetch": prefetch}
    if fields is not None:
        read_ahead["fields"] = fields
    path.write_text(yaml.safe_dump({
        "lake": str(lake_dir(size)), "tokenizer": str(REPO / "demo" / "tokenizer.json"),
        "datasets": {"code": {"sources": [str(corpus / "code" / "*.jsonl")]}},
        "build": {"split_size": "8MB"},
        "loader": {"seq_len": SEQ, "batch_size": BATCH, "packing": packing, "shuffle": shuffle, "workers": workers,
                   **read_ahead},
    }))
    return path


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, in MB: ``VmHWM`` (``ru_maxrss`` would carry
    the parent's peak over ``exec``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def measure_loader(config: Path) -> dict[str, float]:
    """One fresh Loader: its first epoch, then ``PASSES`` more (tokens/s of the first and the
    median of the others, steps per epoch, padding share of the last, peak RSS)."""
    from lakeloader.feed.loader import Loader

    started = time.perf_counter()
    loader = Loader(config)
    opened = time.perf_counter() - started
    dataset = loader.datasets[0]
    steps = max(1, dataset.train_count() // BATCH)
    rates, real = [], 0
    iterator = loader.iter_from(0)
    first_batch = 0.0
    cpu_here = cpu_workers = 0.0
    for epoch in range(1 + PASSES):
        if epoch == 1:   # the steady state's CPU: this process's (read-ahead included) and its workers'
            cpu_here, cpu_workers = time.process_time(), _children_cpu()
        waited = 0.0   # in next() only: the count of padding below is this script's, not the loader's
        real = 0
        for _ in range(steps):
            asked = time.perf_counter()
            batch = next(iterator)
            waited += time.perf_counter() - asked
            first_batch = first_batch or waited + opened
            if epoch == PASSES and "segment_ids" in batch:   # (else loader.fields left them out: not known)
                real += int(np.count_nonzero(batch["segment_ids"]))
        rates.append(steps * BATCH * SEQ / waited)
    batches = steps * PASSES
    cpu_here, cpu_workers = time.process_time() - cpu_here, _children_cpu() - cpu_workers
    loader.close()
    return {"open_s": opened, "first_batch_s": first_batch, "steps": steps, "first_epoch_tokens_per_s": rates[0],
            "tokens_per_s": float(np.median(rates[1:])), "non_padding": real / (steps * BATCH * SEQ),
            "peak_rss_mb": peak_rss_mb(), "cpu_us_per_batch_here": cpu_here / batches * 1e6,
            "cpu_us_per_batch_workers": cpu_workers / batches * 1e6}


def _children_cpu() -> float:
    """CPU seconds (user + system) the running child processes (``loader.workers``) have used."""
    found = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            times = child.cpu_times()
        except psutil.NoSuchProcess:
            continue   # ended meanwhile
        found += times.user + times.system
    return found


def lake_tokens(config: Path) -> np.ndarray:
    """Every stored token of the lake, in chunk order, as one int32 array."""
    from lakeloader.catalog.lake import open_lake

    lake = open_lake(config)
    paths = lake.sql("SELECT path FROM chunks ORDER BY global_index").path
    return np.concatenate([pq.read_table(lake.path_of(p), columns=["tokens"]).column(0).combine_chunks()
                           .values.to_numpy() for p in paths]).astype(np.int32)


def measure_baseline(config: Path, shuffle: str, steps: int) -> dict[str, float]:
    """Tokens/s of ``steps`` batches of B windows (the median of ``PASSES`` passes), two ways, and the peak RSS:

    - ``tokens_per_s``: one copy of B windows of L+1 tokens out of one in-memory array of the
      lake's tokens (targets would be a view of it shifted by one);
    - ``ids_targets_tokens_per_s``: input ids and targets as two [B, L] arrays copied out of the
      same tokens memory-mapped from a .npy file (page cache warm).
    """
    tokens = lake_tokens(config)
    mapped_path = OUT / f"baseline-tokens-{os.getpid()}.npy"
    np.save(mapped_path, tokens)
    try:
        mapped = np.load(mapped_path, mmap_mode="r")
        figures = {"tokens_per_s": _median_rate(tokens, shuffle, steps, lambda windows, rows: windows[rows]),
                   "ids_targets_tokens_per_s": _median_rate(
                       mapped, shuffle, steps, lambda windows, rows: (windows[rows, :-1], windows[rows, 1:]))}
    finally:
        mapped_path.unlink()
    return {**figures, "peak_rss_mb": peak_rss_mb()}


def _median_rate(tokens: np.ndarray, shuffle: str, steps: int, make: Callable[[np.ndarray, np.ndarray], Any]) -> float:
    """Median of ``PASSES`` passes of ``steps`` batches, each ``make(windows, rows)`` of the B
    rows of the step (consecutive windows for ``none``, random ones for ``full``) of the
    L+1-token windows of ``tokens``."""
    windows = np.lib.stride_tricks.sliding_window_view(tokens, SEQ + 1)[::SEQ]
    rng = np.random.default_rng(0)
    rates = []
    for _ in range(PASSES):
        order = rng.permutation(len(windows)) if shuffle == "full" else np.arange(len(windows))
        started = time.perf_counter()
        for step in range(steps):
            made = make(windows, order[np.arange(step * BATCH, (step + 1) * BATCH) % len(windows)])
        rates.append(steps * BATCH * SEQ / (time.perf_counter() - started))
    assert made is not None
    return float(np.median(rates))


def in_subprocess(*args: str) -> dict[str, float]:
    """Run this script with ``args`` in a fresh interpreter; its JSON answer."""
    done = subprocess.run([sys.executable, __file__, *args], check=True, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])})
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("bench", "demo"), default="bench")
    parser.add_argument("--built", action="store_true",
                        help="the lake is built already (copied to this machine, say): no build check, no Dask")
    parser.add_argument("--prefetch", type=int, help="loader.prefetch (default: the config default, 2); 0 measures "
                        "how fast one thread builds batches, without read-ahead threads")
    parser.add_argument("--fields", type=lambda text: text.split(","),
                        help="loader.fields, comma-separated (default: all five); input_ids,targets makes what "
                        "the numpy copy makes")
    parser.add_argument("--measure", help=argparse.SUPPRESS)   # internal: one configuration
    parser.add_argument("--baseline", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--workers-build-all", action="store_true", help=argparse.SUPPRESS)   # see loader_workers.py
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.measure:
        if args.workers_build_all:
            from lakeloader.feed import workers
            workers.BUILD_WHILE_STARTING = False
        print(json.dumps(measure_loader(Path(args.measure))))
        return
    if args.baseline:
        print(json.dumps(measure_baseline(Path(args.measure or config_for(args.size, "concat", "none")),
                                          args.baseline, args.steps)))
        return

    started = time.perf_counter()
    if not args.built:
        build_lake(args.size, ("concat", "pack"))
    figures: dict[str, object] = {"batch": f"B={BATCH}, L={SEQ}", "corpus": args.size,
                                  "prefetch": "default (2)" if args.prefetch is None else args.prefetch,
                                  "fields": "all five" if args.fields is None else ", ".join(args.fields),
                                  "build_or_check_s": round(time.perf_counter() - started, 1),
                                  "loadavg_before": Path("/proc/loadavg").read_text().split()[:3]}
    for packing, shuffle in CONFIGS:
        measured = in_subprocess("--measure", str(config_for(args.size, packing, shuffle, prefetch=args.prefetch,
                                                             fields=args.fields)))
        baseline = in_subprocess("--size", args.size, "--baseline", shuffle, "--steps", str(int(measured["steps"])))
        name = f"{packing}_{shuffle}"
        figures[f"{name}_tokens_per_s"] = round(measured["tokens_per_s"])
        figures[f"{name}_first_epoch_tokens_per_s"] = round(measured["first_epoch_tokens_per_s"])
        figures[f"{name}_numpy_copy_tokens_per_s"] = round(baseline["tokens_per_s"])
        figures[f"{name}_ratio_to_numpy_copy (target >= 0.10)"] = round(
            measured["tokens_per_s"] / baseline["tokens_per_s"], 3)
        figures[f"{name}_numpy_ids_targets_tokens_per_s"] = round(baseline["ids_targets_tokens_per_s"])
        figures[f"{name}_ratio_to_numpy_ids_targets"] = round(
            measured["tokens_per_s"] / baseline["ids_targets_tokens_per_s"], 3)
        figures[f"{name}_peak_rss_mb (target <= 450)"] = round(measured["peak_rss_mb"])
        figures[f"{name}_numpy_copy_peak_rss_mb"] = round(baseline["peak_rss_mb"])
        if packing == "pack" and measured["non_padding"]:
            figures[f"{name}_non_padding_fraction"] = round(measured["non_padding"], 4)
        figures[f"{name}_steps_per_epoch"] = int(measured["steps"])
    figures["loadavg_after"] = Path("/proc/loadavg").read_text().split()[:3]
    name = "loader_throughput" + ("" if args.size == "bench" else f"_{args.size}") + (
        "" if args.prefetch is None else f"_prefetch{args.prefetch}") + (
        "" if args.fields is None else "_" + "_".join(args.fields))
    report(name, figures)


if __name__ == "__main__":
    main()
