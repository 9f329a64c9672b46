"""Build scaling with 1 and 2 workers, catalog open+seek latency at 1k/10k/200k chunks, and
planning of 20,000 shards.

- Build throughput of the same corpus (the >= 110 MB bench corpus, 8 MB splits) on an already
  started LocalCluster of 1 and of 2 workers: their ratio (target >= 1.7 on 2 cores) and
  tokens/s per worker.
- Catalog open + seek: a catalog of N generated chunks over N/10 shards (generated rows, a real
  DuckDB file published as a snapshot); time to open a Loader on it (snapshot open + arrays of
  cumulative counts) and to resolve a seek to a random step (example -> chunk -> row group ->
  token range), medians of 5.
- Planning: 20,000 small local shards, time of `plan_dataset`.
- Loader throughput from a lake in a local S3 server (moto, loopback) with a cold and a warm
  local disk cache.

    .venv/bin/python benchmarks/build_scaling.py
"""

from __future__ import annotations

import logging
import shutil
import statistics
import time
from pathlib import Path

import numpy as np
import pandas as pd
import yaml
from _common import OUT, REPO, report
from distributed import LocalCluster

from lakeloader.catalog.lake import Lake
from lakeloader.catalog.snapshot import publish_snapshot
from lakeloader.catalog.store import CatalogWriter
from lakeloader.config import load_config
from lakeloader.demo.corpus import prepare_corpus
from lakeloader.demo.many_chunks import generated_plan
from lakeloader.feed.loader import Loader
from lakeloader.index.ranges import locate
from lakeloader.ingest.cluster import WORKER_ENV
from lakeloader.ingest.driver import build
from lakeloader.plan.planner import plan_dataset
from lakeloader.storage import write_atomically

TOKENIZER = REPO / "demo" / "tokenizer.json"


def build_rate(workers: int) -> float:
    """Tokens/s of building the bench corpus on an already started LocalCluster of ``workers``
    single-threaded processes (cluster start-up is not part of a build's throughput)."""
    corpus = prepare_corpus(OUT / "bench-corpus", size="bench")
    lake = OUT / f"scaling-lake-{workers}"
    shutil.rmtree(lake, ignore_errors=True)
    config = OUT / f"scaling-{workers}.yaml"
    config.write_text(yaml.safe_dump({
        "lake": str(lake), "tokenizer": str(TOKENIZER),
        "datasets": {"code": {"sources": [str(p) for p in corpus["code"]]}},
        "build": {"split_size": "8MB"}}))
    with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=":0",
                      env=WORKER_ENV) as cluster:
        started = time.perf_counter()
        result = build(config, scheduler=cluster.scheduler_address, progress=False)
        seconds = time.perf_counter() - started
    shutil.rmtree(lake, ignore_errors=True)
    return result.tokens / seconds


def generated_catalog(chunks: int) -> Path:
    """A lake whose catalog holds ``chunks`` committed chunks over chunks/10 shards (no files)."""
    folder = OUT / f"generated-{chunks}"
    shutil.rmtree(folder, ignore_errors=True)
    lake = Lake(str(folder))
    shards = max(1, chunks // 10)
    rng = np.random.default_rng(0)
    plan = generated_plan("d", chunks, shards)
    tokenizer = TOKENIZER.read_text()
    write_atomically(lake.url_of("_tokenizer/t.json"), tokenizer.encode(), {})
    with CatalogWriter(lake.writer_catalog_path) as writer:
        writer.register_plan(plan, tokenizer_path="_tokenizer/t.json", token_type="uint16",
                             vocab_size=8204, split_size=1, on_error="raise")
        docs = rng.integers(50, 200, chunks)
        tokens = rng.integers(50_000, 200_000, chunks)
        writer.con.register("stats", pd.DataFrame({"global_index": np.arange(chunks), "docs": docs, "tokens": tokens}))
        # Text documents: one part each, all of kind "text".
        writer.con.execute("UPDATE chunks SET status = 'committed', num_docs = s.docs, num_tokens = s.tokens, "
                           "num_bytes = 1, checksum = '0', num_records = s.docs, num_parts = [s.docs], "
                           "part_tokens = [s.tokens] FROM stats s WHERE chunks.global_index = s.global_index")
        writer.con.execute("INSERT INTO row_groups (dataset, global_index, row_group, first_doc, num_docs, "
                           "first_token, num_tokens, num_parts, part_tokens) "
                           "SELECT 'd', global_index, 0, 0, docs, 0, tokens, [docs], [tokens] FROM stats")
        writer.recount_progress()
        publish_snapshot(writer.con, lake, None)
    config = folder / "config.yaml"
    config.write_text(yaml.safe_dump({
        "lake": str(folder), "tokenizer": str(TOKENIZER), "datasets": {"d": {"sources": ["/data/*.jsonl"]}},
        "loader": {"seq_len": 2048, "batch_size": 64}}))
    return config


def open_and_seek(config: Path, step: int) -> tuple[float, float]:
    started = time.perf_counter()
    loader = Loader(config)
    opened = time.perf_counter()
    examples = loader.datasets[0]
    positions = step * 64 + np.arange(64)
    starts = np.array([examples.order.train_example(j)[1] * 2048 for j in positions.tolist()])
    chunks = np.unique(locate(examples.locator.stream_offsets(), starts))
    loader.view.row_groups_of("d", chunks.tolist())   # one lookup per batch, as the loader does
    resolved = time.perf_counter()
    loader.close()
    return opened - started, resolved - opened


def planning_seconds(shards: int) -> float:
    folder = OUT / "many-shards"
    if not folder.exists() or len(list(folder.iterdir())) != shards:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        for i in range(shards):
            (folder / f"{i:05d}.jsonl").write_text('{"text": "x"}\n' * 20)
    config = OUT / "many-shards.yaml"
    config.write_text(yaml.safe_dump({"lake": str(OUT / "many-lake"), "tokenizer": str(TOKENIZER),
                                      "datasets": {"d": {"sources": [str(folder / "*.jsonl")]}}}))
    started = time.perf_counter()
    plan = plan_dataset("d", load_config(config), "0")
    assert len(plan.shards) == shards
    return time.perf_counter() - started


def s3_loader_rates() -> tuple[float, float]:
    """Loader tokens/s (B=64, L=2048) from a lake in a local S3 server (moto) with a cold and a
    warm local disk cache."""
    import os
    import tempfile

    import boto3
    from moto.server import ThreadedMotoServer

    credentials = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
    os.environ.update(credentials)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        url = f"http://{host}:{port}"
        boto3.client("s3", endpoint_url=url).create_bucket(Bucket="bench")
        corpus = prepare_corpus(OUT / "demo-corpus", size="demo")
        config = OUT / "s3-loader.yaml"
        config.write_text(yaml.safe_dump({
            "lake": "s3://bench/lake", "tokenizer": str(TOKENIZER),
            "storage_options": {"endpoint_url": url, "key": "bench", "secret": "bench"},
            "datasets": {"code": {"sources": [str(p) for p in corpus["code"]]}},
            "build": {"split_size": "1MB"}, "loader": {"seq_len": 2048, "batch_size": 64}}))
        with tempfile.TemporaryDirectory() as cache:
            os.environ["LAKELOADER_CACHE"] = cache
            build(config, workers=2, progress=False)
            rates = []
            for _ in ("cold", "warm"):
                loader = Loader(config)
                steps = max(1, int(loader.datasets[0].locator.stream_offsets()[-1]) // (64 * 2048))
                started = time.perf_counter()
                for _, _batch in zip(range(steps), loader.iter_from(0)):
                    pass
                rates.append(steps * 64 * 2048 / (time.perf_counter() - started))
                loader.close()
            os.environ.pop("LAKELOADER_CACHE")
        return rates[0], rates[1]
    finally:
        server.stop()


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    figures: dict[str, object] = {}
    one, two = build_rate(1), build_rate(2)
    figures.update({"build_1_worker_tokens_per_s": round(one), "build_2_workers_tokens_per_s": round(two),
                    "per_worker_tokens_per_s (2 workers)": round(two / 2),
                    "scaling 2/1 (target >= 1.7)": round(two / one, 3)})
    rng = np.random.default_rng(1)
    for chunks in (1_000, 10_000, 200_000):
        config = generated_catalog(chunks)
        samples = [open_and_seek(config, int(rng.integers(0, 10**7))) for _ in range(5)]
        figures[f"catalog_{chunks}_open_ms"] = round(statistics.median(s[0] for s in samples) * 1e3, 1)
        figures[f"catalog_{chunks}_seek_64_rows_ms"] = round(statistics.median(s[1] for s in samples) * 1e3, 1)
    figures["plan_20000_shards_s"] = round(planning_seconds(20_000), 2)
    cold, warm = s3_loader_rates()
    figures["s3_loader_cold_cache_tokens_per_s"] = round(cold)
    figures["s3_loader_warm_cache_tokens_per_s"] = round(warm)
    figures["s3 warm/cold"] = round(warm / cold, 2)
    report("build_scaling", figures)


if __name__ == "__main__":
    main()
