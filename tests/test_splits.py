"""Validation splits that never leak (issue 51 item 1).

``doc_key`` is a stable per-document key (contracts/doc_keys.py): the first 8 bytes of the
sha256 of the source file's name and the document's line (or Parquet row), usable in a filter's
``where`` and shown in the ``documents`` view. ``split: {fraction, seed}`` on a dataset adds
``<name>.train`` and ``<name>.validation``, filters with complementary predicates over it. Checked
on real builds: the view's doc_key is lakeloader's function of (file, line) and the lines are the
records' own; every document of the source is in exactly one part, as the Python predicate puts
it; the loader reads exactly those documents; a rebuild from another folder with another split
size gives the same keys and parts; a predicate over metadata whose types are inferred (a JSON
float compared with a number) works end to end. A hypothesis test checks that the two predicates
partition any set of keys, evaluated by DuckDB as the build evaluates them."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from lakeloader.catalog.audit import audit
from lakeloader.catalog.lake import open_lake
from lakeloader.catalog.sql import query
from lakeloader.config import SplitConfig, load_config
from lakeloader.contracts.doc_keys import doc_key, doc_keys, held_out, key_name
from lakeloader.contracts.errors import ConfigError, SourceError
from lakeloader.contracts.selection import select_documents, where_problem
from lakeloader.feed.loader import Loader
from lakeloader.ingest.driver import build

from conftest import DEMO_TOKENIZER, stdlib_texts, write_config

TOKENIZER = Tokenizer.from_file(str(DEMO_TOKENIZER))
EOS = TOKENIZER.token_to_id("<|endoftext|>")
BATCH = 8
WEB_SPLIT = {"fraction": 0.25, "seed": 0}
HQ_WHERE = "lang = 'en' AND score >= 0.5"   # score: a JSON float, its type inferred at planning
HQ_SPLIT = {"fraction": 0.5, "seed": 7}
# Where each file lies under the data folder; the names are what doc_key hashes.
FILES = {"a/part.jsonl": "jsonl", "b/données.jsonl.gz": "gzip", "c/rows.parquet": "parquet"}


def paragraphs(package: str) -> list[str]:
    """Short documents of real text: the blank-line separated paragraphs of a stdlib package."""
    return [p for text in stdlib_texts(package) for p in text.split("\n\n") if p.strip()]


def write_corpus(data: Path) -> dict[str, list[dict[str, Any]]]:
    """The three files (JSON Lines cut into several byte splits, gzip JSON Lines, Parquet in
    several row groups) with metadata; returns each file's records by its name."""
    texts = {"a/part.jsonl": paragraphs("json"), "b/données.jsonl.gz": paragraphs("wsgiref"),
             "c/rows.parquet": paragraphs("zoneinfo")}
    out = {}
    for offset, (relative, kind) in enumerate(FILES.items()):
        rows = [{"text": t, "lang": ("en", "fr", "en")[i % 3], "score": (i * 37 % 100) / 100, "n": 1000 * offset + i}
                for i, t in enumerate(texts[relative])]
        path = data / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = "".join(json.dumps(r) + "\n" for r in rows).encode()
        if kind == "jsonl":
            path.write_bytes(lines)
        elif kind == "gzip":
            path.write_bytes(gzip.compress(lines, mtime=0))
        else:
            pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=16)
        out[path.name] = rows
    return out


def lake_config(root: Path, data: Path, weights: dict[str, float] | None = None, name: str = "main",
                split_size: str = "6KB") -> Path:
    """A config of the lake in ``root/lake``: ``web`` (untyped metadata, split), ``hq`` (a filter
    of it over inferred types, split too) and ``manual_train``/``manual_val`` (a split written by hand)."""
    datasets = {
        "web": {"sources": [str(data / relative) for relative in FILES], "metadata_fields": ["lang", "score", "n"],
                "split": WEB_SPLIT},
        "hq": {"from": "web", "where": HQ_WHERE, "split": HQ_SPLIT},
        "manual_val": {"from": "web", "where": "doc_key % 100 < 25"},
        "manual_train": {"from": "web", "where": "doc_key % 100 >= 25"},
    }
    path = write_config(root, datasets, build={"split_size": split_size, "row_group_tokens": 300},
                        loader={"seq_len": 4096, "batch_size": BATCH, "packing": "pad",
                                "pack": {"long_documents": "error"}},
                        mixture={"weights": weights or {"web.train": 1, "hq.train": 1}})
    return path.rename(root / f"{name}.yaml")


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory, dask_scheduler: str) -> tuple[Path, dict[str, list[dict[str, Any]]]]:
    """A built lake and its source records by file name."""
    root = tmp_path_factory.mktemp("splits")
    records = write_corpus(root / "data")
    build(lake_config(root, root / "data"), scheduler=dask_scheduler, progress=False)
    return root, records


def documents(config: Path) -> pd.DataFrame:
    """The documents view's rows (dataset, source, line, doc_key, n, lang, score)."""
    return open_lake(config).sql("SELECT dataset, source, line, doc_key, n, lang, score FROM documents")


def identities(frame: pd.DataFrame, dataset: str) -> set[tuple[str, int]]:
    """(file name, line) of each document of ``dataset`` in ``frame``."""
    rows = frame[frame.dataset == dataset]
    return {(key_name(s), int(line)) for s, line in zip(rows.source, rows.line)}


def record_at(records: dict[str, list[dict[str, Any]]], source: str, line: int) -> dict[str, Any]:
    """The record of the file ``source`` at ``line`` (1-based line of JSON Lines, 0-based row of Parquet)."""
    name = key_name(source)
    return records[name][line if name.endswith(".parquet") else line - 1]


def eval_texts(config: Path) -> list[str]:
    """The decoded documents of an eval pass of ``config``'s mixture (packing: pad, one each)."""
    texts = []
    with Loader(config, mode="eval") as loader:
        for batch in loader:
            for row in range(BATCH):
                if batch["example_mask"][row]:
                    ids = batch["input_ids"][row][batch["segment_ids"][row] > 0].tolist()
                    assert ids[-1] == EOS
                    texts.append(TOKENIZER.decode(ids[:-1]))
    return texts


def test_doc_key_in_the_documents_view_is_lakeloaders_function_of_file_and_line(lake) -> None:
    root, records = lake
    frame = documents(root / "main.yaml")
    web = frame[frame.dataset == "web"]
    assert len(web) == sum(map(len, records.values())) and web.doc_key.notna().all()
    assert web.doc_key.dtype == np.uint64
    assert [int(k) for k in web.doc_key] == [doc_key(s, int(line)) for s, line in zip(web.source, web.line)]
    assert web.doc_key.is_unique
    # The line is the record's own in its file (byte splits, a gzip file and Parquet row groups).
    assert all(record_at(records, s, int(line))["n"] == n for s, line, n in zip(web.source, web.line, web.n))
    # The vectorized form and the machine-independence of the name.
    assert doc_keys("/x/données.jsonl.gz", np.array([1, 2])).tolist() == \
        [doc_key("s3://bucket/y/données.jsonl.gz", 1), doc_key("données.jsonl.gz", 2)]


@pytest.mark.parametrize("train,validation,source,split", [
    ("web.train", "web.validation", "web", WEB_SPLIT),
    ("hq.train", "hq.validation", "hq", HQ_SPLIT),
    ("manual_train", "manual_val", "web", None),
])
def test_train_and_validation_are_disjoint_and_together_exactly_the_source(
        lake, train: str, validation: str, source: str, split: dict[str, Any] | None) -> None:
    root, records = lake
    config = root / "main.yaml"
    frame = documents(config)
    parts = identities(frame, train), identities(frame, validation)
    whole = identities(frame, source)
    assert not parts[0] & parts[1] and parts[0] | parts[1] == whole and all(parts)
    counts = open_lake(config).sql("SELECT name, num_docs FROM datasets").set_index("name").num_docs
    assert counts[train] + counts[validation] == counts[source] == len(whole)
    # Each document is where the predicate computed in Python puts it.
    rows = frame[frame.dataset == source]
    keys = np.array([doc_key(s, int(line)) for s, line in zip(rows.source, rows.line)], np.uint64)
    held = held_out(keys, **split) if split else keys % 100 < 25
    assert {(key_name(s), int(line)) for s, line, h in zip(rows.source, rows.line, held) if h} == parts[1]
    fraction = split["fraction"] if split else 0.25
    assert abs(len(parts[1]) / len(whole) - fraction) < 0.15
    if source == "hq":   # a split of a filter selects within the filter
        assert all(record_at(records, s, line)["lang"] == "en" and record_at(records, s, line)["score"] >= 0.5
                   for s, line in ((s, int(line)) for s, line in zip(rows.source, rows.line)))


def test_the_audit_evaluates_the_splits_again(lake) -> None:
    root, _ = lake
    frame = audit(root / "main.yaml", 0, 4)
    assert set(frame.dataset) == {"web.train", "hq.train"} and frame.attrs["selections_checked"] > 0


def test_the_loader_reads_exactly_the_selected_documents(lake, dask_scheduler: str) -> None:
    """Each part, and the filter over inferred types (a JSON float compared with 0.5), read by an
    eval pass: exactly the records the predicate, computed in Python, selects."""
    root, records = lake
    every = [(name, line, r) for name, rows in records.items()
             for line, r in enumerate(rows, 0 if name.endswith(".parquet") else 1)]
    expected = {
        "web.validation": [r["text"] for name, line, r in every if held_out(
            np.array([doc_key(name, line)], np.uint64), **WEB_SPLIT)[0]],
        "hq": [r["text"] for _, _, r in every if r["lang"] == "en" and r["score"] >= 0.5],
        "hq.train": [r["text"] for name, line, r in every if r["lang"] == "en" and r["score"] >= 0.5
                     and not held_out(np.array([doc_key(name, line)], np.uint64), **HQ_SPLIT)[0]],
    }
    for dataset, texts in expected.items():
        config = lake_config(root, root / "data", weights={dataset: 1}, name=f"read-{dataset}")
        assert build(config, scheduler=dask_scheduler, progress=False).chunks_built == 0
        assert sorted(eval_texts(config)) == sorted(texts) and texts, dataset


def test_a_rebuild_from_another_folder_with_other_splits_gives_the_same_keys_and_parts(
        lake, tmp_path: Path, dask_scheduler: str) -> None:
    root, _ = lake
    moved = tmp_path / "elsewhere" / "corpus"
    shutil.copytree(root / "data", moved)
    config = lake_config(tmp_path, moved, split_size="3KB")
    build(config, scheduler=dask_scheduler, progress=False)
    before, after = documents(root / "main.yaml"), documents(config)
    assert open_lake(config).sql("SELECT count(*) AS n FROM chunks WHERE dataset = 'web'").n[0] > \
        open_lake(root / "main.yaml").sql("SELECT count(*) AS n FROM chunks WHERE dataset = 'web'").n[0]
    for frame in (before, after):
        frame["name"] = [key_name(s) for s in frame.source]
    keyed = [dict(zip(zip(f.name[f.dataset == "web"], f.line[f.dataset == "web"]), f.doc_key[f.dataset == "web"]))
             for f in (before, after)]
    assert keyed[0] == keyed[1]
    for dataset in ("web.train", "web.validation", "hq.train", "hq.validation", "manual_val"):
        assert identities(before, dataset) == identities(after, dataset), dataset


def test_a_predicate_over_inferred_types_loads_and_a_mismatch_stops_the_build_at_planning(
        tmp_path: Path, dask_scheduler: str) -> None:
    data = tmp_path / "data"
    data.mkdir()
    rows = [{"text": t, "lang": "en", "score": 0.75} for t in paragraphs("json")[:6]]
    (data / "w.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    web = {"sources": [str(data / "w.jsonl")], "metadata_fields": ["lang", "score"]}
    readme = write_config(tmp_path, {"web": web, "hq": {
        "from": "web", "where": "lang = 'en' AND score >= 0.5 AND num_tokens < 8192"}},
        mixture={"weights": {"hq": 1}})
    assert load_config(readme).datasets["hq"].where   # bound with the types unknown: it loads
    wrong = write_config(tmp_path, {"web": web, "hq": {"from": "web", "where": "score LIKE 'h%'"}},
                         mixture={"weights": {"hq": 1}})
    with pytest.raises(ConfigError, match=r"datasets\.hq\.where: .*score.*as planned: \{'lang': 'string', "
                                          r"'score': 'float'\}"):
        build(wrong, scheduler=dask_scheduler, progress=False)


def test_a_split_with_an_empty_part_stops_the_build_naming_the_fraction(tmp_path: Path, dask_scheduler: str) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "w.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in paragraphs("json")[:3]))
    config = write_config(tmp_path, {"web": {"sources": [str(data / "w.jsonl")], "split": {"fraction": 1e-12}}},
                          mixture={"weights": {"web.train": 1}})
    with pytest.raises(SourceError, match=r"'web\.validation' has no documents: the split of dataset 'web' .*"
                                          r"change datasets\.web\.split\.fraction"):
        build(config, scheduler=dask_scheduler, progress=False)


# -- the config ---------------------------------------------------------------------------------------

def config_file(tmp_path: Path, datasets: dict[str, Any], **more: Any) -> Path:
    raw = {"lake": str(tmp_path / "lake"), "tokenizer": str(DEMO_TOKENIZER),
           "datasets": {"web": {"sources": [str(tmp_path / "web.jsonl")], "metadata_fields": ["lang"]}, **datasets},
           **more}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def test_a_split_adds_two_filters_with_complementary_predicates(tmp_path: Path) -> None:
    path = config_file(tmp_path, {"en": {"from": "web", "where": "lang = 'en' -- English\n",
                                         "split": {"fraction": 0.1, "seed": 3}}},
                       mixture={"weights": {"en.train": 1, "en.validation": 1}})
    config = load_config(path)
    train, validation = config.datasets["en.train"], config.datasets["en.validation"]
    assert train.from_ == validation.from_ == "web" and train.split is None
    predicates = SplitConfig(fraction=0.1, seed=3).predicates()
    # The filter's predicate as DuckDB prints it back (its comment gone) joined to the split's.
    assert train.where == f"((lang = 'en')) AND ({predicates['train']})"
    assert validation.where == f"((lang = 'en')) AND ({predicates['validation']})"
    assert config.split_of("en.validation") == ("en", "validation") and config.split_of("en") is None
    assert predicates != SplitConfig(fraction=0.1, seed=4).predicates()
    assert SplitConfig(fraction=0.5).predicates() == {"train": "doc_key >= 9223372036854775808",
                                                     "validation": "doc_key < 9223372036854775808"}


@pytest.mark.parametrize("split,datasets,key,says", [
    ({"fraction": 0.1}, {"web.train": {"from": "web", "where": "true"}}, "datasets.web.split",
     "adds dataset 'web.train', which this config defines already"),
    ({"fraction": 0}, {}, "datasets.web.split.fraction", "greater than 0"),
    ({"fraction": 1}, {}, "datasets.web.split.fraction", "less than 1"),
    ({"fraction": 0.1, "seed": -1}, {}, "datasets.web.split.seed", "greater than or equal to 0"),
    ({"fraction": 0.1, "part": "validation"}, {}, "datasets.web.split.part", "unknown key"),
    (None, {"hq": {"from": "web", "where": "source LIKE '%a%'"}}, "datasets.hq.where", 'column "source" not found'),
    (None, {"hq": {"from": "web", "where": "random() < 0.01"}}, "datasets.hq.where", "calls random"),
    (None, {"hq": {"from": "web", "where": "COLUMNS(*) IS NOT NULL"}}, "datasets.hq.where",
     "names columns by a pattern"),
    (None, {"hq": {"from": "web", "where": "lang = ", "split": {"fraction": 0.5}}}, "datasets.hq.where",
     "not a SQL predicate"),
])
def test_a_wrong_split_or_key_predicate_is_a_config_error_naming_file_line_and_key(
        tmp_path: Path, split: dict[str, Any] | None, datasets: dict[str, Any], key: str, says: str) -> None:
    path = config_file(tmp_path, datasets)
    if split is not None:
        raw = yaml.safe_load(path.read_text())
        raw["datasets"]["web"]["split"] = split
        path.write_text(yaml.safe_dump(raw, sort_keys=False))
    with pytest.raises(ConfigError) as error:
        load_config(path)
    message = str(error.value)
    assert key in message and says in message and str(path) in message and "line " in message, message
    assert "\n" not in message


def test_doc_key_and_untyped_fields_bind_in_a_where() -> None:
    assert where_problem("doc_key % 100 < 1", {}) is None
    assert where_problem("lang = 'en' AND score >= 0.5", {"lang": None, "score": None}) is None
    assert "does not bind" in where_problem("score >= 0.5", {"score": "string"})


# -- properties ----------------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(fraction=st.floats(0, 1, exclude_min=True, exclude_max=True), seed=st.integers(0, 2**40),
       keys=st.lists(st.integers(0, 2**64 - 1) | st.sampled_from([0, 1, 2**63, 2**64 - 1]), max_size=64))
def test_the_two_predicates_partition_any_keys(fraction: float, seed: int, keys: list[int]) -> None:
    predicates = SplitConfig(fraction=fraction, seed=seed).predicates()
    table = pa.table({"num_tokens": pa.array([1] * len(keys), pa.int64()), "doc_key": pa.array(keys, pa.uint64())})
    train, validation = (set(select_documents(predicates[part], table).tolist()) for part in ("train", "validation"))
    assert not train & validation and train | validation == set(range(len(keys)))
    assert validation == set(np.flatnonzero(held_out(np.array(keys, np.uint64), fraction, seed)).tolist())


@settings(max_examples=40, deadline=None)
@given(name=st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="/\x00"), min_size=1,
                    max_size=20),
       lines=st.lists(st.integers(0, 2**40), min_size=1, max_size=8))
def test_the_documents_views_sql_computes_doc_key_as_python_does(name: str, lines: list[int]) -> None:
    """The view's doc_key expression (catalog/queries.sql documents_of_dataset) over one file's
    rows, against :func:`doc_key` of its name and lines."""
    con = duckdb.connect()
    files = pa.table({"dataset": ["d"] * len(lines), "chunk": [0] * len(lines), "record": list(range(len(lines))),
                      "part_lengths": [[1]] * len(lines), "part_kinds": [[0]] * len(lines),
                      "source": [f"/any/folder/{name}"] * len(lines), "key_name": [name] * len(lines),
                      "line_base": [line - i for i, line in enumerate(lines)]})
    con.register("files", files)
    found = con.execute(query("documents_of_dataset").format(source="files", columns="") + " ORDER BY record").df()
    assert [int(k) for k in found.doc_key] == [doc_key(f"s3://b/{name}", line) for line in lines]
