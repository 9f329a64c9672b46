"""Packing plans on real document lengths: `plan_pack` against a plain greedy first fit.

Document lengths are the bundled demo corpus (configs/demo.yaml) tokenized with the demo
tokenizer, plus 1 for the EOS added at collation, cut into chunks of 2,000 consecutive documents
per dataset. For seq_len 2048 and 8192, measures planning throughput (rendered tokens planned per
second, best of several passes over all chunks) and padding fraction (1 - non-padding tokens /
(examples * seq_len)) of `plan_pack` (pack mode, open_examples 64, first_fit and best_fit), of a plain
pure-Python greedy first fit (unbounded list of bins, the first with room, long documents split
into seq_len pieces) on the same lengths, their throughput ratio, and pad mode's padding.

    .venv/bin/python benchmarks/packing.py
"""

from __future__ import annotations

import gzip
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import orjson
import pyarrow.parquet as pq
import zstandard
from _common import REPO, report
from tokenizers import Tokenizer

from lakeloader.demo.corpus import prepare_corpus
from lakeloader.index.packing import plan_pack
from lakeloader.tokenizer import DocumentEncoder

DATA = REPO / "demo" / "data"
# The sources of each dataset of configs/demo.yaml.
DATASETS = {"code": ["code/*.jsonl", "code/*.jsonl.zst"], "docs": ["docs/*.jsonl.gz", "docs/*.parquet"],
            "notes": ["notes/*.txt"]}
CHUNK_DOCS = 2_000
SEQ_LENS = (2048, 8192)
WINDOW = 64


def read_texts(path: Path) -> list[str]:
    """The documents of one demo corpus file, as prepare_corpus wrote them."""
    if path.name.endswith(".parquet"):
        return pq.read_table(path, columns=["text"]).column(0).to_pylist()
    if path.name.endswith(".txt"):
        return path.read_text(encoding="utf-8").split("\n")[:-1]
    data = path.read_bytes()
    if path.name.endswith(".gz"):
        data = gzip.decompress(data)
    elif path.name.endswith(".zst"):
        data = zstandard.ZstdDecompressor().decompressobj().decompress(data)
    return [orjson.loads(line)["text"] for line in data.splitlines()]


def demo_chunks() -> list[np.ndarray]:
    """Rendered lengths (tokens + EOS) of the demo documents, in chunks of CHUNK_DOCS per dataset."""
    if not (DATA / "MANIFEST.json").exists():
        prepare_corpus(DATA)
    encoder = DocumentEncoder(Tokenizer.from_file(str(REPO / "demo" / "tokenizer.json")))
    chunks = []
    for patterns in DATASETS.values():
        texts = [t for pattern in patterns for path in sorted(DATA.glob(pattern)) for t in read_texts(path)]
        lengths = encoder.encode(texts)[1] + 1
        chunks += [lengths[i:i + CHUNK_DOCS] for i in range(0, len(lengths), CHUNK_DOCS)]
    return chunks


def greedy_first_fit(lengths: list[int], seq_len: int) -> int:
    """Examples of a plain first fit: every bin stays open, a piece goes to the first with room."""
    bins: list[int] = []
    for length in lengths:
        for start in range(0, length, seq_len):
            size = min(seq_len, length - start)
            for i, used in enumerate(bins):
                if used + size <= seq_len:
                    bins[i] = used + size
                    break
            else:
                bins.append(size)
    return len(bins)


def plan_all(chunks: list[np.ndarray], seq_len: int, algorithm: str) -> int:
    return sum(plan_pack(c, seq_len, algorithm=algorithm, open_examples=WINDOW).num_examples for c in chunks)


def greedy_all(chunks: list[list[int]], seq_len: int) -> int:
    return sum(greedy_first_fit(c, seq_len) for c in chunks)


def best_time(run: Callable[..., int], *args: object, budget_s: float = 3.0) -> tuple[float, int]:
    """(fastest seconds of one pass of ``run(*args)``, its examples) over passes within the budget."""
    times, examples = [], 0
    spent = time.perf_counter()
    while len(times) < 50 and (not times or time.perf_counter() - spent < budget_s):
        started = time.perf_counter()
        examples = run(*args)
        times.append(time.perf_counter() - started)
    return min(times), examples


def main() -> None:
    chunks = demo_chunks()
    tokens = int(sum(int(c.sum()) for c in chunks))
    figures: dict[str, object] = {"chunks": len(chunks), "documents": int(sum(len(c) for c in chunks)),
                                  "rendered_tokens": tokens, "chunk_docs": CHUNK_DOCS, "open_examples": WINDOW}
    as_lists = [c.tolist() for c in chunks]
    for seq_len in SEQ_LENS:
        name = f"L{seq_len}"
        rates = {}
        for algorithm in ("first_fit", "best_fit"):
            seconds, examples = best_time(plan_all, chunks, seq_len, algorithm)
            rates[algorithm] = tokens / seconds
            figures[f"{name}_{algorithm}_tokens_per_s"] = round(rates[algorithm])
            figures[f"{name}_{algorithm}_ms_per_chunk"] = round(seconds / len(chunks) * 1e3, 3)
            figures[f"{name}_{algorithm}_padding"] = round(1 - tokens / (examples * seq_len), 4)
        seconds, examples = best_time(greedy_all, as_lists, seq_len)
        figures[f"{name}_greedy_baseline_tokens_per_s"] = round(tokens / seconds)
        figures[f"{name}_greedy_baseline_padding"] = round(1 - tokens / (examples * seq_len), 4)
        figures[f"{name}_first_fit_speedup_vs_baseline"] = round(rates["first_fit"] * seconds / tokens, 2)
        examples = sum(plan_pack(c, seq_len, mode="pad").num_examples for c in chunks)
        figures[f"{name}_pad_mode_padding"] = round(1 - tokens / (examples * seq_len), 4)
    report("packing", figures)


if __name__ == "__main__":
    main()
