"""Building a lake of stored images (``interleaved.images: stored``) next to a plain Pillow loop.

The corpus is lakeloader/demo/images.py's (real images from matplotlib's sample data and icons,
Pillow-made ones of every kind the decoder converts) in ``COPIES`` distinct copies (each copy
flipped or rotated, re-encoded in its format), as WebDataset tars, Parquet (256 documents a row
group, so a chunk) and JSON Lines.
Alternating, ``REPEATS`` times each, median:

- build: a fresh lake of the corpus on an already started LocalCluster of one single-threaded
  worker (read, check each image once, tokenize the text, write chunk and media files, commit);
  images/s counts every image occurrence of the sources;
- baseline: in this process, for each of the same occurrences' bytes, ``Image.open(...).verify()``
  then ``Image.open(...).load()`` (verify cannot load, so a checker that also measures the decoded
  size does both), the least a build that checks every image must do.

Each repeat also builds the corpus with the build's end's rewrite of the media files left out (each
image stored once per chunk, not once per dataset: ``ingest/media_dedup.py``), alternating which
goes first: the build time with the rewrite over without it, and the bytes of the lake's current
media files of each. Also the stored bytes (media files) next to the images' bytes in the sources,
and the load average.

    .venv/bin/python benchmarks/image_build.py
"""

from __future__ import annotations

import io
import os
import shutil
import statistics
import time
from pathlib import Path
from unittest import mock

import pyarrow.parquet as pq
import yaml
from _common import OUT, REPO, report
from distributed import LocalCluster
from PIL import Image

from lakeloader.catalog.lake import open_lake
from lakeloader.contracts.media import media_path
from lakeloader.demo.images import write_image_corpus
from lakeloader.ingest.cluster import WORKER_ENV
from lakeloader.ingest.driver import build

COPIES, REPEATS = 8, 3
TOKENIZER = REPO / "demo" / "tokenizer.json"


def pillow_loop(images: list[bytes]) -> float:
    """Seconds of opening, verifying and loading each image."""
    started = time.perf_counter()
    for data in images:
        Image.open(io.BytesIO(data)).verify()
        Image.open(io.BytesIO(data)).load()
    return time.perf_counter() - started


def current_media(config: Path) -> list[Path]:
    """The media files the lake's catalog reads (each chunk's, or the one its build's end rewrote)."""
    lake = Path(yaml.safe_load(config.read_text())["lake"])
    rows = open_lake(config).sql("SELECT c.path, m.path AS deduped FROM chunks c LEFT JOIN media_files m "
                                 "ON m.dataset = c.dataset AND m.global_index = c.global_index "
                                 "WHERE c.media_checksum IS NOT NULL")
    return [lake / (deduped if isinstance(deduped, str) else media_path(chunk))
            for chunk, deduped in zip(rows.path, rows.deduped)]


def timed_build(config: Path, scheduler: str, rewrite: bool) -> float:
    """Seconds of a build of ``config`` (``rewrite``: with the rewrite of the media files at its end)."""
    started = time.perf_counter()
    if rewrite:
        build(config, scheduler=scheduler, progress=False)
    else:
        with mock.patch("lakeloader.ingest.driver.dedup_media"):
            build(config, scheduler=scheduler, progress=False)
    return time.perf_counter() - started


def main() -> None:
    root = OUT / "image-bench"
    shutil.rmtree(root, ignore_errors=True)
    sources = write_image_corpus(root / "data", copies=COPIES, distinct=True, row_group_size=256)
    stored = {"images": "stored", "image_tokens": 16, "max_images": 8}
    datasets = {form: {"sources": [str(p) for p in paths], "format": "interleaved", "interleaved": stored}
                for form, paths in sources.items()}
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=":0",
                      env=WORKER_ENV) as cluster:
        builds, unrewritten, loops, occurrences, task_seconds = [], [], [], [], []
        for repeat in range(REPEATS):
            for rewrite in ((True, False) if repeat % 2 == 0 else (False, True)):
                config = root / ("images.yaml" if rewrite else "unrewritten.yaml")
                lake = root / ("lake" if rewrite else "lake-unrewritten")
                shutil.rmtree(lake, ignore_errors=True)
                config.write_text(yaml.safe_dump({"lake": str(lake), "tokenizer": str(TOKENIZER), "datasets": datasets,
                                                  "build": {"split_size": "1MB"}}))
                (builds if rewrite else unrewritten).append(timed_build(config, cluster.scheduler_address, rewrite))
            config = root / "images.yaml"
            task_seconds.append(float(open_lake(config).sql("SELECT sum(seconds) AS s FROM chunks").s[0]))
            if not occurrences:   # the bytes of every image occurrence, as the sources hold them
                ids = open_lake(config).sql("SELECT image_id FROM images ORDER BY ALL").image_id.tolist()
                by_id = {}
                for path in lake.rglob("*.media.parquet"):
                    table = pq.read_table(path)
                    by_id.update(zip(table.column("image_id").to_pylist(), table.column("bytes").to_pylist()))
                occurrences = [by_id[key] for key in ids]
            loops.append(pillow_loop(occurrences))
    media_files = current_media(root / "images.yaml")
    media = sum(p.stat().st_size for p in media_files)
    media_unrewritten = sum(p.stat().st_size for p in current_media(root / "unrewritten.yaml"))
    stored_rows = sum(pq.ParquetFile(p).metadata.num_rows for p in media_files)
    stored_images = sum(sum(map(len, pq.read_table(p, columns=["bytes"]).column("bytes").to_pylist()))
                        for p in media_files)
    source_bytes = sum(len(data) for data in occurrences)
    source_files = sum(p.stat().st_size for paths in sources.values() for p in paths)
    build_rate, loop_rate = len(occurrences) / statistics.median(builds), len(occurrences) / statistics.median(loops)
    task_rate = len(occurrences) / statistics.median(task_seconds)
    report("image_build", {
        "image occurrences": len(occurrences), "distinct images": len(set(map(bytes, occurrences))),
        "build images/s (1 worker)": build_rate, "Pillow open+verify+load images/s (1 core)": loop_rate,
        "build / Pillow loop": build_rate / loop_rate,
        "build tasks' images/s (their seconds summed)": task_rate, "build tasks / Pillow loop": task_rate / loop_rate,
        "build seconds (median)": statistics.median(builds), "Pillow loop seconds (median)": statistics.median(loops),
        "source files' bytes (tars, Parquet, JSONL)": source_files,
        "image bytes of the sources' occurrences": source_bytes,
        "build seconds without the media rewrite (median)": statistics.median(unrewritten),
        "build with / without the media rewrite": statistics.median(builds) / statistics.median(unrewritten),
        "media files' bytes without the rewrite (each image once per chunk)": media_unrewritten,
        "media files' bytes (each image once per dataset)": media, "with / without the rewrite": media / media_unrewritten,
        "media files / image occurrences' bytes": media / source_bytes,
        "images stored (media rows)": stored_rows,
        "media overhead per stored image (bytes)": (media - stored_images) / max(stored_rows, 1),
        "load average (1 min)": os.getloadavg()[0],
    })


if __name__ == "__main__":
    main()
