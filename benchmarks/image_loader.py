"""Loader images/s (decode + resize into the batch) next to a plain Pillow loop on the same bytes.

A lake of the demo image corpus (``lakeloader.demo.images``: matplotlib's real photos, logos and
icons and Pillow-made images; JPEG, PNG, WEBP, GIF; ``--copies`` times over) is built once with
``interleaved.images: stored`` and a ``fixed`` 224 x 224 resolution. Each round reads ``--steps``
batches with ``loader.image_cache_bytes`` of 1 byte (every image decoded again) and
``loader.prefetch: 0`` in this process (``workers: 0``), and runs the baseline over the very images
those batches hold, in the same order: ``Image.open(...).convert("RGB").resize(fit, BICUBIC)``
into a numpy array. The pixel fill alone (the loader's part that reads, checks, decodes and
resizes the images into the batch) is timed too. All are timed in CPU seconds of this process (images per second of one
core: the loader's whole batch, tokens included, against the loop's decoding alone), so other
load on the machine shifts them less. Rounds alternate; medians are reported with the load average. Then the same
steps in wall-clock time with ``loader.workers`` 0, 1 and 2, alternating (steady state: after
each worker's first block; the figures to compare with each other), with the CPU time per image
of this process and its workers together (what workers add, whatever the load), and the peak RSS
of this process and of its children.

    .venv/bin/python benchmarks/image_loader.py [--copies 8] [--steps 24] [--repeat 3]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import logging
import multiprocessing
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml
from PIL import Image

from _common import REPO, report
from lakeloader import Loader
from lakeloader.demo.images import all_images, write_image_corpus
from lakeloader.feed.pixels import PixelFill
from lakeloader.index.image_tokens import fit_sizes
from lakeloader.ingest.driver import build

SIZE = (224, 224)


def make_lake(root: Path, copies: int) -> Path:
    files = write_image_corpus(root / "data", copies=copies)
    config = root / "images.yaml"
    config.write_text(yaml.safe_dump({
        "lake": str(root / "lake"), "tokenizer": str(REPO / "demo" / "tokenizer.json"),
        "datasets": {"images": {"sources": [str(p) for p in files["tar"] + files["parquet"]], "format": "interleaved",
                                "interleaved": {"images": "stored", "image_tokens": 16, "max_images": 4,
                                                "resolution": {"kind": "fixed", "size": list(SIZE)}}}},
        "build": {"split_size": "1MB", "workers": 2},
        "loader": {"seq_len": 512, "batch_size": 16, "packing": "pack", "shuffle": {"kind": "none"},
                   "prefetch": 0, "image_cache_bytes": 1},
    }, sort_keys=False))
    build(config, progress=False)
    return config


def with_workers(config: Path, workers: int) -> Path:
    raw = yaml.safe_load(config.read_text())
    raw["loader"]["workers"] = workers
    path = config.with_name(f"workers{workers}.yaml")
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def loader_round(config: Path, steps: int) -> tuple[float, float, list[str]]:
    """(CPU seconds of this process for ``steps`` batches, of those in the pixel fill, the image
    ids the batches hold in order)."""
    in_fill = [0.0]
    original = PixelFill.fill

    def timed(self: PixelFill, *args: object) -> None:
        started = time.process_time()
        original(self, *args)  # type: ignore[arg-type]
        in_fill[0] += time.process_time() - started

    with Loader(config) as loader:
        loader.batch(0)   # opened, the first row groups read: what follows is the steady state
        PixelFill.fill = timed  # type: ignore[method-assign]
        ids: list[str] = []
        try:
            started = time.process_time()
            for step in range(1, steps + 1):   # each batch dropped, as a training loop does: its memory recycled
                batch = loader.batch(step)
                ids += batch["image_refs"][batch["image_mask"]].tolist()
                del batch
            seconds = time.process_time() - started
        finally:
            PixelFill.fill = original  # type: ignore[method-assign]
    return seconds, in_fill[0], ids


def pillow_round(data: list[bytes]) -> float:
    """CPU seconds of the plain loop: open, convert, resize to fit, to an array."""
    started = time.process_time()
    for raw in data:
        image = Image.open(io.BytesIO(raw)).convert("RGB")
        w, h = (int(x[0]) for x in fit_sizes(np.array([image.width]), np.array([image.height]), SIZE))
        np.asarray(image.resize((w, h), Image.Resampling.BICUBIC))
    return time.process_time() - started


def cpu_seconds(pids: list[int]) -> float:
    """CPU seconds (user + system) the processes ``pids`` have used so far (Linux: /proc)."""
    total = 0.0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def workers_round(config: Path, steps: int) -> tuple[float, float]:
    """(images/s, wall, of a loader with workers over ``steps`` batches, CPU ms per image of this
    process and its workers together), once the workers have started (their spawn and imports
    take seconds on a loaded machine): after 8 steps and 3 s."""
    warm = 8
    with Loader(config) as loader:
        iterator = loader.iter_from(0)
        for _ in range(warm):
            next(iterator)
        time.sleep(3)
        pids = [os.getpid(), *(child.pid for child in multiprocessing.active_children() if child.pid)]
        started, cpu, images = time.perf_counter(), cpu_seconds(pids), 0
        for _ in range(steps):
            images += int(next(iterator)["image_mask"].sum())
        seconds, cpu = time.perf_counter() - started, cpu_seconds(pids) - cpu
        iterator.close()
    return images / seconds, 1000 * cpu / images


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=8)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        config = make_lake(Path(tmp), args.copies)
        by_id = {hashlib.sha256(d).hexdigest(): d for d in all_images().values()}
        loader_rates, fill_rates, pillow_rates = [], [], []
        for _ in range(args.repeat):
            seconds, in_fill, ids = loader_round(config, args.steps)
            loader_rates.append(len(ids) / seconds)
            fill_rates.append(len(ids) / in_fill)
            pillow_rates.append(len(ids) / pillow_round([by_id[i] for i in ids]))
        figures: dict[str, object] = {
            "images per round": len(ids),
            "pixel fill images/s (read, check, decode, resize into the batch; 1 core)": statistics.median(fill_rates),
            "whole batches, images/s (tokens too; workers 0, 1 core)": statistics.median(loader_rates),
            "Pillow loop images/s (1 core)": statistics.median(pillow_rates),
            "ratio pixel fill / Pillow": statistics.median(a / b for a, b in zip(fill_rates, pillow_rates)),
            "ratio whole batches / Pillow": statistics.median(a / b for a, b in zip(loader_rates, pillow_rates)),
        }
        rounds: dict[int, list[tuple[float, float]]] = {0: [], 1: [], 2: []}
        for _ in range(args.repeat):   # (alternating: load from other processes shifts all three alike)
            for workers in rounds:
                rounds[workers].append(workers_round(with_workers(config, workers), args.steps))
        for workers, got in rounds.items():
            figures[f"loader images/s, wall (workers {workers})"] = statistics.median(rate for rate, _ in got)
        for workers, got in rounds.items():
            figures[f"CPU ms per image, all processes (workers {workers})"] = statistics.median(ms for _, ms in got)
        figures["peak RSS MB (this process)"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        figures["peak RSS MB (largest child)"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        figures["load average"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
        report("image_loader", figures)


if __name__ == "__main__":
    main()
