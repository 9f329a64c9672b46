"""Build throughput with each tokenizer backend next to the encoders alone, on the same documents
and cores, in one run.

For the demo BPE (8,192 ids) and a BPE of more than 65,536 ids trained here on the first two
shards (32 MB) of the corpus with ``tokenizers`` (``BpeTrainer(vocab_size=100_000)`` behind the
demo's ByteLevel pre-tokenizer; cached in benchmarks/out), it prints tokens/s of:

- the build (``tokenizer_backend: fastokens``; and ``hf`` with ``--hf``), with 1 and with 2 local
  workers (wall clock, planning and cluster start included; and the driver's tokens/s of its task
  phase);
- (a) ``tokenizers`` ``encode_batch_fast`` and (b) fastokens ``encode_batch_flat`` over the same
  documents already in memory, in one process with as many threads as workers;
- (c) the rest of a chunk task alone: reading, JSON parsing, building the Arrow table, Parquet
  encoding and writing each split, with its tokens computed beforehand (untimed), in as many
  processes as workers;

and the ratios build/(b), build/(a) and 2 workers / 1 worker. The corpus is the first
``--megabytes`` of the bench corpus (lakeloader/demo/corpus.py size="bench": Python sources of the
standard library and site-packages). With ``--repeat N`` every figure but (a) (minutes on this
corpus) is the median of N runs. The load average of the machine is printed with the figures.

    .venv/bin/python benchmarks/tokenizer_backends.py [--megabytes 100] [--workers 2] [--repeat 3] [--hf]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import logging
import multiprocessing
import os
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import orjson
import yaml
from _common import OUT, REPO, report

from lakeloader.catalog.lake import open_lake
from lakeloader.config import load_config
from lakeloader.demo.corpus import prepare_corpus
from lakeloader.ingest.chunk import ChunkTask, chunk_table, encode_chunk_file, encode_parts, row_group_bounds
from lakeloader.ingest.documents import SplitSource, read_split
from lakeloader.ingest.driver import build
from lakeloader.plan.planner import plan_dataset
from lakeloader.plan.splits import Split
from lakeloader.storage import write_atomically
from lakeloader.tokenizer import DocumentEncoder, encoder_name

DEMO_TOKENIZER = REPO / "demo" / "tokenizer.json"
LARGE_VOCAB = 100_000


def load_average() -> str:
    """The 1, 5 and 15 minute load averages of the machine."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def large_tokenizer(files: list[str], path: Path) -> Path:
    """A byte-level BPE of up to ``LARGE_VOCAB`` ids trained on ``files`` (cached at ``path``); it
    reaches more than 65,536 ids on 32 MB of the bench corpus."""
    if path.exists():
        return path
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    demo = Tokenizer.from_file(str(DEMO_TOKENIZER))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = demo.pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    specials = [t.content for t in demo.get_added_tokens_decoder().values()]
    trainer = trainers.BpeTrainer(vocab_size=LARGE_VOCAB, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator((orjson.loads(line)["text"] for name in files for line in open(name, "rb")),
                                  trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return path


def corpus_files(megabytes: float) -> list[str]:
    """The first ``megabytes`` of the bench corpus's shards."""
    files = sorted(str(p) for p in prepare_corpus(OUT / "bench-corpus", size="bench")["code"])
    chosen, total = [], 0
    for name in files:
        if total >= megabytes * 1e6:
            break
        chosen.append(name)
        total += os.path.getsize(name)
    return chosen


def _encode_alone(tokenizer: str, files: list[str], threads: int, backend: str) -> tuple[int, float]:
    """Tokens and seconds of encoding every document of ``files`` in memory with ``backend`` (``a``:
    tokenizers encode_batch_fast, ``b``: fastokens encode_batch_flat), ``threads`` threads, batches
    of 512 documents. Runs in a fresh process: the thread pools read RAYON_NUM_THREADS once."""
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    from tokenizers import Tokenizer

    documents = [orjson.loads(line)["text"] for name in files for line in open(name, "rb")]
    if backend == "a":
        hf = Tokenizer.from_file(tokenizer)

        def encode(batch: list[str]) -> int:
            return sum(len(e) for e in hf.encode_batch_fast(batch, add_special_tokens=False))
    else:
        import fastokens

        fast = fastokens.Tokenizer.from_file(tokenizer)

        def encode(batch: list[str]) -> int:
            return len(fast.encode_batch_flat(batch, add_special_tokens=False)[0]) // 4
    tokens, started = 0, time.perf_counter()
    for first in range(0, len(documents), 512):
        tokens += encode(documents[first:first + 512])
    return tokens, time.perf_counter() - started


def _rest_of_task(task: ChunkTask) -> tuple[int, float]:
    """Tokens of one chunk task and the seconds of its path without tokenizing: read and parse
    the split, build the table, encode the Parquet file and write it (ids computed beforehand)."""
    os.environ["RAYON_NUM_THREADS"] = "1"
    from tokenizers import Tokenizer

    encoder = DocumentEncoder(Tokenizer.from_file(task.tokenizer_url), backend="fastokens")
    encoded = encode_parts(encoder, read_split(task.source).documents)
    started = time.perf_counter()
    documents = read_split(task.source)
    lengths = encoded.parts.content_lengths
    table = chunk_table(documents.records, encoded, False)
    write_atomically(task.chunk_url, encode_chunk_file(table, row_group_bounds(lengths, task.row_group_tokens)), {})
    return int(lengths.sum()), time.perf_counter() - started


def _spawned(workers: int) -> concurrent.futures.ProcessPoolExecutor:
    return concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))


def encode_alone(tokenizer: Path, files: list[str], threads: int, backend: str) -> float:
    """Tokens/s of :func:`_encode_alone` in a fresh process."""
    with _spawned(1) as pool:
        tokens, seconds = pool.submit(_encode_alone, str(tokenizer), files, threads, backend).result()
    return tokens / seconds


def rest_alone(config_path: Path, workers: int, folder: Path) -> float:
    """Tokens/s of the chunk tasks of ``config_path`` without tokenizing, in ``workers`` processes
    (tokens over the summed timed seconds divided by ``workers``)."""
    config = load_config(config_path)
    plan = plan_dataset("code", config, "bench", encoder=encoder_name("fastokens"))
    folder.mkdir(parents=True, exist_ok=True)
    tasks = []
    for row in plan.chunks.itertuples(index=False):
        shard = plan.shards[row.shard_index]
        source = SplitSource(shard.url, shard.layout, shard.compression,
                             Split(row.split_kind, int(row.split_start), int(row.split_stop), int(row.first_row)),
                             config.datasets["code"].record_format(), "raise", {})
        tasks.append(ChunkTask("code", int(row.global_index), source, str(folder / f"{row.global_index}.parquet"),
                               config.tokenizer, config.build.row_group_tokens))
    with _spawned(workers) as pool:
        results = list(pool.map(_rest_of_task, tasks))
    shutil.rmtree(folder, ignore_errors=True)
    return sum(t for t, _ in results) / (sum(s for _, s in results) / workers)


def build_rate(tokenizer: Path, files: list[str], backend: str, workers: int,
               split_size: str) -> tuple[float, float, float, int]:
    """Wall-clock tokens/s of a fresh build, the driver's tokens/s of its task phase (cluster start
    included), tokens/s of the chunk tasks alone (tokens over their summed seconds divided by
    ``workers``: what the build approaches on a corpus large enough to hide the fixed costs), and
    tokens."""
    OUT.mkdir(parents=True, exist_ok=True)
    lake = OUT / "backends-lake"
    shutil.rmtree(lake, ignore_errors=True)
    config = OUT / "backends.yaml"
    config.write_text(yaml.safe_dump({
        "lake": str(lake), "tokenizer": str(tokenizer), "tokenizer_backend": backend,
        "datasets": {"code": {"sources": files}},
        "build": {"split_size": split_size, "publish_interval": 5},
    }))
    started = time.perf_counter()
    result = build(config, workers=workers, progress=False)
    wall = time.perf_counter() - started
    opened = open_lake(config)
    recorded = opened.sql("SELECT tokens_per_s, encoder FROM builds ORDER BY build_id DESC LIMIT 1").iloc[0]
    assert recorded.encoder == encoder_name(backend), recorded.encoder
    task_seconds = float(opened.sql("SELECT sum(seconds) AS s FROM chunks")["s"].iloc[0])
    shutil.rmtree(lake, ignore_errors=True)
    return result.tokens / wall, float(recorded.tokens_per_s), result.tokens / (task_seconds / workers), result.tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megabytes", type=float, default=100.0, help="corpus size (whole 16 MB shards)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--split-size", default="8MB")
    parser.add_argument("--repeat", type=int, default=1, help="median of this many runs (all but (a))")
    parser.add_argument("--hf", action="store_true", help="also build with tokenizer_backend: hf (slow)")
    args = parser.parse_args()

    def median(measure: Callable[[], tuple[float, ...]]) -> tuple[float, ...]:
        runs = [measure() for _ in range(args.repeat)]
        return tuple(statistics.median(column) for column in zip(*runs))

    logging.basicConfig(level=logging.WARNING)
    files = corpus_files(args.megabytes)
    figures: dict[str, object] = {
        "source_MB": round(sum(os.path.getsize(f) for f in files) / 1e6, 1),
        "runs per figure (median; (a): 1)": args.repeat,
        "load average before": load_average(),
    }
    trained = time.perf_counter()
    large = large_tokenizer(files[:2], OUT / f"bpe-{LARGE_VOCAB}-2shards.json")
    figures["seconds to train (or load) the large BPE"] = round(time.perf_counter() - trained, 1)
    from tokenizers import Tokenizer

    large_ids = Tokenizer.from_file(str(large)).get_vocab_size(with_added_tokens=True)
    tokenizers = {"demo BPE (8,192 ids)": DEMO_TOKENIZER, f"trained BPE ({large_ids:,} ids)": large}
    counts = sorted({1, args.workers})
    for label, tokenizer in tokenizers.items():
        for workers in counts:
            key = f"{label}, {workers} worker(s)"
            a = encode_alone(tokenizer, files, workers, "a")
            (b,) = median(lambda: (encode_alone(tokenizer, files, workers, "b"),))
            fast_wall, fast_task, fast_chunks, tokens = median(
                lambda: build_rate(tokenizer, files, "fastokens", workers, args.split_size))
            config = OUT / "backends.yaml"
            (c,) = median(lambda: (rest_alone(config, workers, OUT / "backends-rest"),))
            figures.update({
                f"{key}: tokens": int(tokens),
                f"{key}: build fastokens tok/s (wall)": round(fast_wall),
                f"{key}: build fastokens tok/s (task phase)": round(fast_task),
                f"{key}: build fastokens tok/s (chunk tasks alone)": round(fast_chunks),
                f"{key}: (a) tokenizers encode_batch_fast tok/s": round(a),
                f"{key}: (b) fastokens encode_batch_flat tok/s": round(b),
                f"{key}: (c) read+parse+write alone tok/s": round(c),
                f"{key}: build/(b) (wall; task phase; chunk tasks)":
                    f"{fast_wall / b:.2f}; {fast_task / b:.2f}; {fast_chunks / b:.2f}",
                f"{key}: build/(a) (wall; task phase; chunk tasks)":
                    f"{fast_wall / a:.2f}; {fast_task / a:.2f}; {fast_chunks / a:.2f}",
            })
        if args.hf:
            figures[f"{label}, {args.workers} worker(s): build hf tok/s (wall)"] = round(
                build_rate(tokenizer, files, "hf", args.workers, args.split_size)[0])
        if len(counts) == 2:
            for phase in ("wall", "chunk tasks alone"):
                one, two = (figures[f"{label}, {w} worker(s): build fastokens tok/s ({phase})"] for w in counts)
                figures[f"{label}: {counts[0]} -> {counts[1]} workers ({phase})"] = round(two / one, 2)  # type: ignore[operator]
    figures["load average after"] = load_average()
    report("tokenizer_backends", figures)


if __name__ == "__main__":
    main()
