"""Task-format corpora derived from the demo corpus, and a look at the lake they build.

:func:`prepare_formats` turns the demo corpus (``python -m lakeloader.demo.corpus prepare``) into
``<data_dir>/formats/{chat,sft,pages}``: conversations about help topics and modules, docstring
prompts, and help-text pages with image ids between paragraphs (ids only: the demo has no
images). FIM reads the demo's code files as they are. :func:`summarize` is what ``show`` prints.

    python -m lakeloader.demo.formats prepare demo/data
    python -m lakeloader.demo.formats show configs/formats.yaml
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import orjson
import pandas as pd
import pyarrow.parquet as pq

from lakeloader.catalog.audit import audit
from lakeloader.catalog.lake import open_lake
from lakeloader.config import load_config
from lakeloader.contracts.errors import LakeloaderError
from lakeloader.feed.loader import Loader

log = logging.getLogger("lakeloader.demo.formats")

Record = dict[str, Any]
SYSTEM = "You are a concise assistant for the Python standard library. Quote its documentation."
ANSWER_CHARS = 1200      # an answer, a response or a page holds at most this much real text
SFT_RECORDS = 300        # supervised records, spread evenly over the short member docstrings
CHAT_MODULES = 220       # module conversations (after one per help topic)


def _bounded(text: str, limit: int = ANSWER_CHARS) -> str:
    """``text`` cut to at most ``limit`` characters at its last paragraph, line or word break."""
    text = text.strip()
    for sep in (("\n\n", "\n", " ") if len(text) > limit else ()):
        cut = text.rfind(sep, 0, limit)
        if cut > limit // 3:
            return text[:cut].rstrip()
    return text[:limit]


def _name(source: str) -> str:
    """``json/decoder.py:JSONDecoder.decode`` -> ``json.decoder.JSONDecoder.decode``
    (``pkg/__init__.py`` -> ``pkg``)."""
    path, _, qualname = source.partition(":")
    module = path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    return f"{module}.{qualname}" if qualname else module


def chats(topics: list[Record], docs: list[Record]) -> list[Record]:
    """One conversation per help topic, then some about modules; every third has a system
    message, every third module one a follow-up turn about one of the module's members."""
    members: dict[str, list[Record]] = {}
    for row in docs:
        if ":" in row["source"]:
            members.setdefault(_name(row["source"].partition(":")[0]), []).append(row)
    modules = [r for r in docs if ":" not in r["source"] and len(r["text"]) >= 80]
    turns = [[("user", f"What does the Python help topic `{t['topic']}` explain?"), ("assistant", _bounded(t["text"]))]
             for t in topics]
    for i, row in enumerate(modules[::max(1, len(modules) // CHAT_MODULES)][:CHAT_MODULES]):
        name = _name(row["source"])
        turns.append([("user", f"What is the `{name}` module for?"), ("assistant", _bounded(row["text"]))])
        if i % 3 == 1 and members.get(name):
            member = members[name][i % len(members[name])]
            turns[-1] += [("user", "Name one thing it defines."),
                          ("assistant", f"`{_name(member['source'])}`: {_bounded(member['text'], 400)}")]
    return [{"messages": [{"role": role, "content": content}
                          for role, content in ([("system", SYSTEM)] if i % 3 == 0 else []) + turn]}
            for i, turn in enumerate(turns)]


def supervised(docs: list[Record]) -> list[Record]:
    """Prompt ``Write the docstring of `module.qualname`.``, response the real docstring."""
    rows = [r for r in docs if ":" in r["source"] and 40 <= len(r["text"]) <= ANSWER_CHARS]
    return [{"prompt": f"Write the docstring of `{_name(r['source'])}`.", "response": r["text"]}
            for r in rows[::max(1, len(rows) // SFT_RECORDS)][:SFT_RECORDS]]


def pages(topics: list[Record]) -> list[Record]:
    """Help topics cut into pages of whole paragraphs (at most ``ANSWER_CHARS``), with 1-4
    image references ``demo-image://<topic>/<n>`` spread after paragraphs."""
    out: list[Record] = []
    for topic in topics:
        groups: list[list[str]] = [[]]
        for paragraph in [p.strip("\n").rstrip() for p in topic["text"].split("\n\n") if p.strip()][:60]:
            if groups[-1] and sum(map(len, groups[-1])) + len(paragraph) > ANSWER_CHARS:
                groups.append([])
            groups[-1].append(_bounded(paragraph))
        image = 0
        for group in groups:
            count = 1 + len(out) % 4
            after = [k * len(group) // count for k in range(count)]   # paragraph an image follows
            items: list[Record] = []
            for position, paragraph in enumerate(group):
                if items and "text" in items[-1]:
                    items[-1]["text"] += "\n\n" + paragraph           # no image between: one text item
                else:
                    items.append({"text": paragraph})
                for _ in range(after.count(position)):
                    items.append({"image": f"demo-image://{topic['topic']}/{image}"})
                    image += 1
            out.append({"items": items})
    return out


def prepare_formats(data_dir: str | Path) -> dict[str, list[Path]]:
    """Write ``formats/{chat,sft,pages}/*.jsonl`` from the demo corpus in ``data_dir`` (files
    already identical are left alone); return each format dataset's files, ``code`` (FIM)
    being the demo's own code files."""
    data_dir = Path(data_dir)
    topics_path, docs = data_dir / "docs" / "topics.jsonl.gz", sorted((data_dir / "docs").glob("docstrings-*.parquet"))
    if not topics_path.is_file() or not docs:
        raise FileNotFoundError(f"{data_dir}: no demo corpus; run python -m lakeloader.demo.corpus prepare {data_dir}")
    topics = [orjson.loads(line) for line in gzip.decompress(topics_path.read_bytes()).splitlines()]
    rows = [row for path in docs for row in pq.read_table(path, columns=["text", "source"]).to_pylist()]
    files = {"code": sorted((data_dir / "code").glob("*.jsonl*"))}
    for name, records in (("chat", chats(topics, rows)), ("sft", supervised(rows)), ("pages", pages(topics))):
        path = files.setdefault(name, [data_dir / "formats" / name / f"{name}.jsonl"])[0]
        data = b"".join(orjson.dumps(r) + b"\n" for r in records)
        if path.is_file() and path.read_bytes() == data:
            log.info("%s is up to date (%d records)", path, len(records))
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_name(path.name + ".tmp").write_bytes(data)
        os.replace(path.with_name(path.name + ".tmp"), path)
        log.info("wrote %s: %d records, %d bytes", path, len(records), len(data))
    return dict(sorted(files.items()))


# ---------------------------------------------------------------------------- show


class Summary(NamedTuple):
    """What ``show`` prints: catalog datasets, mixture audit, padding, speed, decoded examples."""

    datasets: pd.DataFrame
    audit: pd.DataFrame
    padding_fraction: float
    tokens_per_s: float
    examples: dict[str, str]


def marked(tokenizer: Any, ids: np.ndarray, trained: np.ndarray, max_chars: int = 160) -> str:
    """Decode ``ids`` with the spans of ``trained`` tokens in ``[[...]]``; text between special
    tokens longer than ``max_chars`` keeps its head and tail around `` … ``."""
    special, out = set(tokenizer.get_added_tokens_decoder()), []
    for flag, run in itertools.groupby(zip(ids.tolist(), trained.tolist()), key=lambda pair: bool(pair[1])):
        pieces = []
        for is_special, tokens in itertools.groupby((t for t, _ in run), key=special.__contains__):
            text = tokenizer.decode(list(tokens), skip_special_tokens=False)
            if not is_special and len(text) > max_chars:
                text = f"{text[:max_chars * 2 // 3]} … {text[-(max_chars // 3):]}"
            pieces.append(text.replace("\n", "⏎"))
        out.append(f"[[{''.join(pieces)}]]" if flag else "".join(pieces))
    return "".join(out)


def summarize(config: Any, *, batches: int = 20, audit_steps: int = 100) -> Summary:
    """Open a loader on the config's lake: its datasets, the audit of steps ``0..audit_steps-1``
    (plus ``weight``: the configured weight, normalized), the padding fraction and non-padding
    tokens/s of ``batches`` batches, and the most complete chat and FIM example among them
    (by dataset, found with ``Loader.explain``) decoded by :func:`marked`."""
    config = load_config(config)
    datasets = open_lake(config).sql("SELECT name, format, num_docs, num_tokens FROM datasets ORDER BY name")
    frame = audit(config, 0, audit_steps)[["dataset", "target_weight", "share", "token_share", "tokens"]]
    weights = config.mixture.all_weights()[0] if config.mixture else {name: 1.0 for name in frame["dataset"]}
    frame.insert(1, "weight", frame["dataset"].map(weights) / sum(weights.values()))
    with Loader(config) as loader:
        started = time.perf_counter()
        seen = list(itertools.islice(loader.iter_from(0), batches))
        seconds = time.perf_counter() - started
        real = sum(int((b["segment_ids"] > 0).sum()) for b in seen)
        slots = sum(b["segment_ids"].size for b in seen)
        tok = loader.tokenizer
        prefix, middle, turn = (tok.token_to_id(t) for t in ("<|fim_prefix|>", "<|fim_middle|>", "<|im_start|>"))
        eos = tok.token_to_id(config.loader.eos_token)
        shown = [n for n in loader.mixer.names if config.datasets[n].format in ("chat", "fim")]
        best: dict[str, tuple[int, str]] = {}
        for step, batch in enumerate(seen):
            where = loader.explain(step)
            for row in where[where["dataset"].isin(shown) & (where["document_start"] == 0)].itertuples():
                a, b, r = int(row.example_start), int(row.example_stop), int(row.row)
                ids, fim = batch["input_ids"][r][a:b], config.datasets[row.dataset].format == "fim"
                if fim and not (ids[0] == prefix and middle in ids):
                    continue                                   # a document not cut for FIM
                score = 10 * int(ids[-1] == eos) + (0 if fim else int((ids == turn).sum()))
                if score > best.get(row.dataset, (-1, ""))[0]:    # whole, then most turns
                    trained = np.concatenate([[False], batch["loss_mask"][r][a:b - 1] > 0])  # input t+1 = target t
                    best[row.dataset] = (score, marked(tok, ids, trained))
    return Summary(datasets, frame, 1 - real / slots, real / seconds, {n: t for n, (_, t) in sorted(best.items())})


def main(argv: Sequence[str] | None = None) -> int:
    """``prepare DATA_DIR`` or ``show CONFIG``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m lakeloader.demo.formats", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser("prepare", help="derive the format corpora").add_argument("data_dir", metavar="DATA_DIR")
    commands.add_parser("show", help="summarize the built formats lake").add_argument("config", metavar="CONFIG")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "prepare":
            files = prepare_formats(args.data_dir)
            counts = ", ".join(f"{name} {len(paths[0].read_bytes().splitlines()):,} records"
                               for name, paths in files.items() if name != "code")
            print(f"format corpora in {args.data_dir}/formats: {counts}; "
                  f"code (FIM): the demo's {len(files['code'])} files")
            return 0
        s = summarize(args.config)
    except (OSError, LakeloaderError) as exc:
        print(f"{args.command}: error: {exc}", file=sys.stderr)
        return 2
    with pd.option_context("display.width", 200, "display.float_format", "{:.3f}".format):
        print("== datasets ==", s.datasets.to_string(index=False), "",
              "== mixture audit, steps 0..99 (weight: configured, in tokens; target_weight: in examples) ==",
              s.audit.to_string(index=False), sep="\n")
    print(f"\n20 batches: padding fraction {s.padding_fraction:.3f}, {s.tokens_per_s:,.0f} non-padding tokens/s")
    formats = dict(zip(s.datasets["name"], s.datasets["format"]))
    for name, text in s.examples.items():
        print(f"\n== a {name} example ({formats.get(name)}; [[...]]: trained targets, ⏎: newline) ==\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
