"""Build throughput vs raw ``Tokenizer.encode_batch`` on the same documents and cores.

Builds a lake from >= 100 MB of real text (the Python standard library and installed packages'
sources, see lakeloader/demo/corpus.py size="bench") on 2 local Dask workers, then tokenizes the same
documents with ``Tokenizer.encode_batch`` in one process using the same 2 cores, and prints
both throughputs and their ratio (target: build >= 0.85 x raw).

    .venv/bin/python benchmarks/build_throughput.py [--workers 2] [--keep]
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import time

import orjson
import yaml
from _common import OUT, REPO, report

from lakeloader.catalog.lake import open_lake
from lakeloader.demo.corpus import prepare_corpus
from lakeloader.ingest.driver import build

TOKENIZER = REPO / "demo" / "tokenizer.json"


def raw_encode(files: list[str], threads: int, method: str) -> tuple[int, float]:
    """Tokens and seconds of ``Tokenizer.<method>`` (encode_batch or encode_batch_fast) over every
    document of ``files``, in one process with ``threads`` tokenizer threads."""
    os.environ["RAYON_NUM_THREADS"] = str(threads)  # read when the tokenizer's pool first starts
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(TOKENIZER))
    encode = getattr(tokenizer, method)
    documents = [orjson.loads(line)["text"] for name in files for line in open(name, "rb")]
    tokens, started = 0, time.perf_counter()
    for first in range(0, len(documents), 512):
        encodings = encode(documents[first:first + 512], add_special_tokens=False)
        tokens += sum(len(e) for e in encodings)
    return tokens, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--split-size", default="8MB")
    parser.add_argument("--keep", action="store_true", help="keep the lake in benchmarks/out")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    corpus = OUT / "bench-corpus"
    files = sorted(str(p) for p in prepare_corpus(corpus, size="bench")["code"])
    source_bytes = sum(os.path.getsize(f) for f in files)
    lake = OUT / "bench-lake"
    shutil.rmtree(lake, ignore_errors=True)
    config = OUT / "bench.yaml"
    config.write_text(yaml.safe_dump({
        "lake": str(lake), "tokenizer": str(TOKENIZER),
        "datasets": {"code": {"sources": files}},
        "build": {"split_size": args.split_size, "publish_interval": 5},
    }))
    started = time.perf_counter()
    result = build(config, workers=args.workers, progress=False)
    build_wall = time.perf_counter() - started
    raw_tokens, raw_seconds = raw_encode(files, args.workers, "encode_batch")
    fast_tokens, fast_seconds = raw_encode(files, args.workers, "encode_batch_fast")
    assert raw_tokens == fast_tokens == result.tokens, (raw_tokens, fast_tokens, result.tokens)
    build_rate = result.tokens / build_wall
    raw_rate = raw_tokens / raw_seconds
    encoders = open_lake(config).sql("SELECT DISTINCT encoder FROM builds ORDER BY encoder").encoder.tolist()
    if not args.keep:
        shutil.rmtree(lake, ignore_errors=True)
    report("build_throughput", {
        "source_MB": round(source_bytes / 1e6, 1),
        "chunks": result.chunks_built,
        "tokens": result.tokens,
        "workers": args.workers,
        "build_encoder (tokenizer_backend: auto)": " ".join(encoders),
        "build_seconds (wall, incl. planning and cluster start)": round(build_wall, 2),
        "build_tokens_per_s": round(build_rate),
        "raw_encode_batch_seconds": round(raw_seconds, 2),
        "raw_encode_batch_tokens_per_s": round(raw_rate),
        "ratio build/raw (target >= 0.85)": round(build_rate / raw_rate, 3),
        "raw_encode_batch_fast_tokens_per_s (what tokenizer_backend: hf calls)": round(fast_tokens / fast_seconds),
        "ratio build/raw_fast": round(build_rate / (fast_tokens / fast_seconds), 3),
    })


if __name__ == "__main__":
    main()
