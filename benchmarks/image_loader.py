"""Loader images/s (decode + resize into the batch) next to a plain Pillow loop on the same bytes.

A lake of the demo image corpus (``lakeloader.demo.images``: matplotlib's real photos, logos and
icons and Pillow-made images; JPEG, PNG, WEBP, GIF; ``--copies`` times over) is built once with
``interleaved.images: stored`` and a ``fixed`` 224 x 224 resolution. One loader (``workers: 0``,
``loader.prefetch: 0``, ``loader.image_cache_bytes`` of 1 byte: every image decoded again) reads
``--steps`` batches once untimed (the steady state of a long run: each media file's footer parsed),
then in each round again, and the baseline runs over the very images those batches hold, in the
same order: a plain Pillow loop making the same pixels (:func:`plain_pixels`: ``Image.open``,
``ImageOps.exif_transpose``, the documented conversion to RGB -- 16-bit to its high byte, alpha
composited onto white, ``convert`` only where the mode is not RGB -- and a bicubic resize to fit,
into a numpy array); that it makes the loader's pixels bitwise is checked on one round's images.
The loop most write, ``open().convert("RGB").resize()``, is timed too for reference: it drops
alpha instead of compositing it (and clips 16-bit), so its pixels differ for most of this corpus.
The pixel fill alone (the loader's part that reads, checks, decodes and resizes the images into
the batch) is timed too. All are timed in CPU seconds of this process (images per second of one
core: the loader's whole batch, tokens included, against the loop's decoding alone), so other load
on the machine shifts them less. Rounds alternate; medians are reported with the load average.
Then the same steps in wall-clock time with ``loader.workers`` 0, 1 and 2, alternating, in the
steady state: once the workers have started and filled their rings (their CPU time stands still;
a slot's first use faults its shared memory in, a page per 4 KiB, once), and the batches they
built ahead have been taken untimed; with the CPU time per image of this process and its workers
together (what workers add, whatever the load), and the peak RSS of this process and of its
children.

    .venv/bin/python benchmarks/image_loader.py [--copies 8] [--steps 24] [--repeat 3]
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import io
import logging
import multiprocessing
import os
import resource
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import yaml
from PIL import Image, ImageOps

from _common import REPO, report
from lakeloader import Loader
from lakeloader.demo.images import all_images, write_image_corpus
from lakeloader.feed.pixels import PixelFill
from lakeloader.feed.workers import BLOCK, LENT
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


def loader_round(loader: Loader, steps: int) -> tuple[float, float, list[str]]:
    """(CPU seconds of this process for batches 1 to ``steps`` of ``loader``, of those in the
    pixel fill, the image ids the batches hold in order)."""
    in_fill = [0.0]
    original = PixelFill.fill

    def timed(self: PixelFill, *args: object) -> None:
        started = time.process_time()
        original(self, *args)  # type: ignore[arg-type]
        in_fill[0] += time.process_time() - started

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


@functools.lru_cache(maxsize=4096)
def fit(width: int, height: int) -> tuple[int, int]:
    """The size an image of ``width`` x ``height`` is resized to (to fit :data:`SIZE`)."""
    w, h = fit_sizes(np.array([width]), np.array([height]), SIZE)
    return int(w[0]), int(h[0])


def plain_pixels(raw: bytes) -> np.ndarray:
    """The baseline: a plain Pillow loop's pixels of one image, converted to RGB as
    ``lakeloader/images.py`` documents it, resized to fit :data:`SIZE`."""
    image = Image.open(io.BytesIO(raw))
    ImageOps.exif_transpose(image, in_place=True)
    if image.mode.startswith("I;16"):
        image = Image.fromarray((np.asarray(image) >> 8).astype(np.uint8))
    if image.mode == "P" and "transparency" in image.info or image.mode in ("RGBA", "LA", "PA"):
        image = Image.alpha_composite(Image.new("RGBA", image.size, "white"), image.convert("RGBA"))
    if image.mode != "RGB":   # (``convert`` copies an RGB image: 1.1 ms of a 512 x 600 photo)
        image = image.convert("RGB")
    return np.asarray(image.resize(fit(*image.size), Image.Resampling.BICUBIC))


def convert_only_pixels(raw: bytes) -> np.ndarray:
    """The loop most write: ``convert("RGB")`` (alpha dropped, 16-bit clipped), resized to fit."""
    image = Image.open(io.BytesIO(raw)).convert("RGB")
    return np.asarray(image.resize(fit(*image.size), Image.Resampling.BICUBIC))


def pillow_round(data: list[bytes], pixels: Callable[[bytes], np.ndarray]) -> float:
    """CPU seconds of a plain loop making ``pixels`` of each image of ``data``."""
    started = time.process_time()
    for raw in data:
        pixels(raw)
    return time.process_time() - started


def check_baseline(config: Path, steps: int, by_id: dict[str, bytes]) -> tuple[int, int, int]:
    """(images of ``steps`` batches, how many of them :func:`plain_pixels` makes bitwise as the
    loader does, how many :func:`convert_only_pixels` does)."""
    images = same = same_convert = 0
    with Loader(config) as loader:
        for step in range(1, steps + 1):
            batch = loader.batch(step)
            for row, number in zip(*np.nonzero(batch["image_mask"])):
                raw = by_id[batch["image_refs"][row, number]]
                slot = batch["pixel_values"][row, number]
                for pixels, count in ((plain_pixels(raw), 0), (convert_only_pixels(raw), 1)):
                    h, w = pixels.shape[:2]
                    equal = np.array_equal(slot[:h, :w], pixels) and not slot[h:].any() and not slot[:h, w:].any()
                    same += equal and count == 0
                    same_convert += equal and count == 1
                images += 1
    return images, same, same_convert


def cpu_seconds(pids: list[int]) -> float:
    """CPU seconds (user + system) the processes ``pids`` have used so far (Linux: /proc)."""
    total = 0.0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def workers_round(config: Path, steps: int, workers: int) -> tuple[float, float]:
    """(images/s, wall, of a loader with ``workers`` workers over ``steps`` batches, CPU ms per
    image of this process and its workers together), in the steady state: after 8 steps, once
    the workers have started (their spawn and imports take seconds on a loaded machine) and filled
    their rings (their first touch of a slot's shared memory is a page fault per 4 KiB: one-off),
    and once the batches they built ahead meanwhile have been taken."""
    with Loader(config) as loader:
        iterator = loader.iter_from(0)
        for _ in range(8):
            next(iterator)
        children = [child.pid for child in multiprocessing.active_children() if child.pid]
        used, deadline = -1.0, time.monotonic() + 60
        while children and time.monotonic() < deadline:   # until the workers stand still
            time.sleep(0.5)
            used, before = cpu_seconds(children), used
            if used == before:
                break
        for _ in range(workers * (BLOCK + 1 + LENT)):   # (each worker's ring: built ahead)
            next(iterator)
        pids = [os.getpid(), *children]
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
        loader_rates, fill_rates, pillow_rates, convert_rates = [], [], [], []
        with Loader(config) as loader:
            loader_round(loader, args.steps)   # (untimed: the steady state of a long run, media footers parsed)
            for _ in range(args.repeat):
                seconds, in_fill, ids = loader_round(loader, args.steps)
                loader_rates.append(len(ids) / seconds)
                fill_rates.append(len(ids) / in_fill)
                data = [by_id[i] for i in ids]
                pillow_rates.append(len(ids) / pillow_round(data, plain_pixels))
                convert_rates.append(len(ids) / pillow_round(data, convert_only_pixels))
        images, same, same_convert = check_baseline(config, args.steps, by_id)
        if same != images:
            raise AssertionError(f"the baseline makes other pixels than the loader for {images - same} of {images} images")
        figures: dict[str, object] = {
            "images per round": len(ids),
            "pixel fill images/s (read, check, decode, resize into the batch; 1 core)": statistics.median(fill_rates),
            "whole batches, images/s (tokens too; workers 0, 1 core)": statistics.median(loader_rates),
            "Pillow loop images/s, the same pixels (1 core)": statistics.median(pillow_rates),
            "baseline pixels bitwise the loader's": f"{same} of {images}",
            "ratio pixel fill / Pillow loop": statistics.median(a / b for a, b in zip(fill_rates, pillow_rates)),
            "ratio whole batches / Pillow loop": statistics.median(a / b for a, b in zip(loader_rates, pillow_rates)),
            "convert('RGB') loop images/s (alpha dropped; 1 core)": statistics.median(convert_rates),
            "convert('RGB') loop pixels bitwise the loader's": f"{same_convert} of {images}",
            "ratio pixel fill / convert('RGB') loop": statistics.median(a / b for a, b in zip(fill_rates, convert_rates)),
        }
        rounds: dict[int, list[tuple[float, float]]] = {0: [], 1: [], 2: []}
        for _ in range(args.repeat):   # (alternating: load from other processes shifts all three alike)
            for workers in rounds:
                rounds[workers].append(workers_round(with_workers(config, workers), args.steps, workers))
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
