"""Datasets defined by a filter (issue 14 item 4): ``{from: web, where: "<SQL predicate>"}``.

The predicate is checked before any work: parsed and bound by DuckDB against an empty relation of
the source dataset's metadata fields and ``num_tokens``, refused unless it is one pure expression.
The build evaluates it per chunk of the source on the Dask workers without tokenizing anything,
and the loader reads exactly the selected documents: checked against the source records
(decoded), for any process count, from every resume step, while the lake builds, in a mixture
with the source, in explain, the documents view and the audit; a changed predicate is a new
selection."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

import dataclasses
import json
import shutil

import duckdb
import pyarrow.parquet as pq
from tokenizers import Tokenizer

from lakeloader.catalog.audit import audit
from lakeloader.catalog.gc import remove_stale
from lakeloader.catalog.lake import open_lake
from lakeloader.catalog.snapshot import open_reader_index
from lakeloader.cli import main
from lakeloader.config import load_config
from lakeloader.contracts.errors import CatalogError, ConfigError, LakeloaderError, SourceError
from lakeloader.contracts.selection import where_problem
from lakeloader.feed.loader import Loader
from lakeloader.ingest.driver import build
from lakeloader.read import catalog_view as catalog_view_module
from lakeloader.read.catalog_view import CatalogView
from lakeloader.read.verify import verify_lake

from conftest import (
    DEMO_TOKENIZER,
    assert_batches_equal,
    global_batches,
    loader_during_build,
    start_build_thread,
    stdlib_texts,
    write_config,
    write_jsonl,
)

WEB = {"metadata_fields": {"lang": "string", "score": "float"}}


def config_file(tmp_path: Path, filtered: dict[str, Any], **more: Any) -> Path:
    write_jsonl(tmp_path / "web.jsonl", ["a text", "another text"])
    raw = {"lake": str(tmp_path / "lake"), "tokenizer": str(Path(__file__).parents[1] / "demo" / "tokenizer.json"),
           "datasets": {"web": {"sources": [str(tmp_path / "web.jsonl")], **WEB}, "web_en": filtered, **more},
           "mixture": {"weights": {"web": 1, "web_en": 1}}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@pytest.mark.parametrize("filtered,key,says", [
    ({"from": "web", "where": "lang = 'en' AND colour = 'red'"}, "datasets.web_en.where", 'column "colour" not found'),
    ({"from": "web", "where": "lang = 'en' AND"}, "datasets.web_en.where", "not a SQL predicate"),
    ({"from": "web", "where": "lang IN (SELECT 'en')"}, "datasets.web_en.where", "not one pure expression"),
    ({"from": "web", "where": "1) UNION SELECT (1"}, "datasets.web_en.where", "not one pure expression"),
    ({"from": "web", "where": "true; DROP TABLE chunks"}, "datasets.web_en.where", "not a SQL predicate"),
    ({"from": "web", "where": "length(read_text('/etc/passwd')) > 0"}, "datasets.web_en.where", "table function"),
    ({"from": "web", "where": "count(*) > 1"}, "datasets.web_en.where", "aggregates"),
    ({"from": "web", "where": "random() < 0.1"}, "datasets.web_en.where", "calls random"),   # not the same twice
    ({"from": "web", "where": "lang = 'en' AND now() > DATE '2026-01-01'"}, "datasets.web_en.where", "calls now"),
    ({"from": "web", "where": "  "}, "datasets.web_en.where", "empty"),
    ({"from": "news", "where": "true"}, "datasets.web_en.from", "no dataset 'news'"),
    ({"from": "web", "where": "true", "sources": ["x.jsonl"]}, "datasets.web_en.sources", "remove this key"),
    ({"from": "web", "where": "true", "format": "chat"}, "datasets.web_en.format", "remove this key"),
    ({"from": "web"}, "datasets.web_en.where", "needs where"),
    ({"where": "true"}, "datasets.web_en.where", "add from"),
])
def test_a_wrong_filter_is_a_config_error_naming_its_key_before_any_work(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], filtered: dict[str, Any], key: str, says: str) -> None:
    path = config_file(tmp_path, filtered)
    with pytest.raises(ConfigError) as error:
        load_config(path)
    message = str(error.value)
    assert key in message and says in message and str(path) in message and "line " in message, message
    assert main(["build", str(path)]) == 2
    assert key in capsys.readouterr().err
    assert not (tmp_path / "lake").exists()   # nothing planned, nothing written


def test_a_filter_of_a_filtered_dataset_is_refused(tmp_path: Path) -> None:
    path = config_file(tmp_path, {"from": "web", "where": "true"}, web_hq={"from": "web_en", "where": "score > 0.5"})
    with pytest.raises(ConfigError, match=r"datasets\.web_hq\.from.*'web_en' is itself defined by a filter"):
        load_config(path)


def test_predicates_bind_against_the_planned_types() -> None:
    assert where_problem("lang = 'en' AND score >= 0.5 AND num_tokens < 8192", WEB["metadata_fields"]) is None
    assert where_problem("flag AND num_tokens BETWEEN 1 AND 10", {"flag": "bool"}) is None
    assert where_problem("lang LIKE 'e%' OR lang IS NULL", {"lang": None}) is None   # untyped: NULL-typed until planned
    assert "not found" in where_problem("tokens > 3", {})
    assert "does not bind" in where_problem("flag + 1 > 1", {"flag": "bool"})   # no bool + int


# -- a lake with a filtered dataset -----------------------------------------------------------------

SEQ_LEN = 48
BATCH = 8
WHERE = "(lang = 'en' AND score >= 0.3 AND num_tokens < 150) OR (flag AND n % 7 = 0)"
METADATA = {"lang": "string", "score": "float", "flag": "bool", "n": "int"}
TOKENIZER = Tokenizer.from_file(str(DEMO_TOKENIZER))


def paragraphs(package: str) -> list[str]:
    """Short documents of real text: the blank-line separated paragraphs of a stdlib package."""
    return [p for text in stdlib_texts(package) for p in text.split("\n\n") if p.strip()]


def records(texts: list[str], offset: int, langs: tuple[str | None, ...]) -> list[dict[str, Any]]:
    """Records with metadata of every type; ``lang`` missing where its value is None."""
    out = []
    for i, text in enumerate(texts):
        n = offset + i
        record: dict[str, Any] = {"text": text, "score": (n * 37 % 100) / 100, "flag": n % 4 == 0, "n": n}
        if langs[n % len(langs)] is not None:
            record["lang"] = langs[n % len(langs)]
        out.append(record)
    return out


def corpus(data: Path) -> list[dict[str, Any]]:
    """Three files; the third's records never pass WHERE (its chunks select nothing)."""
    files = {"a.jsonl": records(paragraphs("json"), 0, ("en", "fr", None)),
             "b.jsonl": records(paragraphs("wsgiref"), 1000, ("en", "en", "de")),
             "c.jsonl": [dict(r, lang="de", flag=False) for r in records(paragraphs("zoneinfo"), 2000, ("de",))]}
    data.mkdir(parents=True, exist_ok=True)
    for name, rows in files.items():
        (data / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [r for rows in files.values() for r in rows]


def passes(record: dict[str, Any], tokens: int, where: str) -> bool:
    """``where`` (WHERE, or CHANGED) in Python, over a record whose text has ``tokens`` tokens."""
    if where == WHERE:
        return bool((record.get("lang") == "en" and record["score"] >= 0.3 and tokens < 150)
                    or (record["flag"] and record["n"] % 7 == 0))
    assert where == CHANGED
    return record.get("lang") == "fr" and tokens >= 20


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False).ids


CHANGED = "lang = 'fr' AND num_tokens >= 20"


def lake_config(root: Path, where: str = WHERE, weights: dict[str, float] | None = None, data: Path | None = None,
                metadata: Any = None, **loader: Any) -> Path:
    """The config of a lake in ``root`` (sources in ``data``, default ``root/data``): ``web`` and
    ``web_sel``, a filter of it."""
    data = data or root / "data"
    datasets = {"web": {"sources": [str(data / "*.jsonl")], "metadata_fields": metadata or METADATA},
                "web_sel": {"from": "web", "where": where}}
    return write_config(root, datasets, build={"split_size": "6KB", "row_group_tokens": 300},
                        loader={"seq_len": SEQ_LEN, "batch_size": BATCH, **loader},
                        mixture={"weights": weights or {"web": 1, "web_sel": 1}})


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory, dask_scheduler: str) -> tuple[Path, list[dict[str, Any]]]:
    """A built lake (packing: pack, window shuffle) and the source records."""
    root = tmp_path_factory.mktemp("filtered")
    rows = corpus(root / "data")
    config = lake_config(root, packing="pack", shuffle={"kind": "window", "window_chunks": 2})
    build(config.rename(root / "main.yaml"), scheduler=dask_scheduler, progress=False)
    return root, rows


def variant(lake: tuple[Path, list[dict[str, Any]]], scheduler: str, name: str, **kwargs: Any) -> Path:
    """Another config of the same lake, built (nothing tokenized again)."""
    root, _ = lake
    config = lake_config(root, **kwargs).rename(root / f"{name}.yaml")
    report = build(config, scheduler=scheduler, progress=False)
    assert report.chunks_built == 0
    return config


def eval_documents(config: Path) -> list[list[int]]:
    """Each example's tokens (EOS removed) of an eval pass under packing: pad (a document each)."""
    docs = []
    with Loader(config, mode="eval") as loader:
        for batch in loader:
            for row in range(BATCH):
                if batch["example_mask"][row]:
                    ids = batch["input_ids"][row][batch["segment_ids"][row] > 0].tolist()
                    assert ids[-1] == TOKENIZER.token_to_id("<|endoftext|>")
                    docs.append(ids[:-1])
    return docs


def source_documents(config: Path, where: str = WHERE) -> tuple[list[list[int]], int]:
    """The source dataset's documents in lake order that pass ``where`` (read from its chunk files
    with pyarrow and selected in Python), and how many source chunks with documents select none."""
    lake = open_lake(config)
    paths = lake.sql("SELECT path FROM chunks WHERE dataset = 'web' ORDER BY global_index")["path"]
    selected, empty = [], 0
    for path in paths:
        table = pq.read_table(lake.path_of(path)).to_pylist()
        mine = [row["tokens"] for row in table if passes(
            {"lang": row["meta.lang"], "score": row["meta.score"], "flag": row["meta.flag"], "n": row["meta.n"]},
            len(row["tokens"]), where)]
        selected += mine
        empty += bool(table) and not mine
    return selected, empty


def test_batches_hold_exactly_the_selected_documents(lake, dask_scheduler: str) -> None:
    root, rows = lake
    config = variant(lake, dask_scheduler, "pad", weights={"web_sel": 1}, packing="pad", seq_len=4096,
                     pack={"long_documents": "error"})
    expected, empty = source_documents(config)
    assert empty > 0, "some source chunks should select no document"
    docs = eval_documents(config)
    assert docs == expected   # in lake order, each once
    # Decoded, they are exactly the source records that pass the predicate.
    texts = sorted(r["text"] for r in rows if passes(r, len(ids(r["text"])), WHERE))
    assert sorted(TOKENIZER.decode(d) for d in docs) == texts
    assert sorted(map(tuple, docs)) == sorted(tuple(ids(t)) for t in texts)
    # Under concat, the stream is those documents each followed by EOS.
    concat = variant(lake, dask_scheduler, "concat", weights={"web_sel": 1}, packing="concat")
    stream = [t for d in expected for t in [*d, TOKENIZER.token_to_id("<|endoftext|>")]]
    with Loader(concat, mode="eval") as loader:
        got = [t for b in loader for r in range(BATCH) if b["example_mask"][r]
               for t in b["input_ids"][r][b["segment_ids"][r] > 0].tolist()]
    assert got == stream[: len(got)] and len(got) >= len(stream) - 1
    counts = open_lake(config).sql("SELECT name, num_docs, num_tokens FROM datasets WHERE name = 'web_sel'")
    assert counts.num_docs[0] == len(expected) and counts.num_tokens[0] == sum(map(len, expected))


def test_same_batches_for_any_process_count_every_resume_and_the_mixture(lake) -> None:
    root, _ = lake
    config = root / "main.yaml"
    steps = range(0, 10)
    reference = global_batches(config, 1, steps)
    for processes in (2, 4):
        assert_batches_equal(global_batches(config, processes, steps), reference, f"P={processes}")
    with Loader(config) as loader:
        for start in steps:
            resumed = [batch for _, batch in zip(range(start, 10), loader.iter_from(loader.state(start)))]
            assert_batches_equal(resumed, reference[start:], f"resumed at {start}", steps[start:])
        rows = loader.explain(3)
    both = {int(d) for b in reference for d in b["dataset_ids"]}
    assert both == {0, 1}   # the mixture draws from the source and its filter
    selected = rows[rows.dataset == "web_sel"]
    assert len(selected) and set(selected.columns) >= {"chunk", "document", "source_document", "location"}
    # explain names the source file's line of each document of the filter: that record passes.
    lines = {}
    for row in selected.itertuples():
        record = json.loads(Path(row.source).read_text().splitlines()[int(row.location.split()[1]) - 1])
        lines[(row.chunk, row.document)] = record
        assert passes(record, len(ids(record["text"])), WHERE)
    assert len(lines) > 1


def test_documents_view_and_audit_of_a_filtered_dataset(lake) -> None:
    root, _ = lake
    config = root / "main.yaml"
    expected, _ = source_documents(config)
    lake_ = open_lake(config)
    found = lake_.sql("SELECT count(*) AS docs, sum(num_tokens) AS tokens, max(doc) AS last FROM documents "
                      "WHERE dataset = 'web_sel'")
    assert found.docs[0] == len(expected) and found.tokens[0] == sum(map(len, expected))
    stats = lake_.stats().set_index("dataset")
    assert stats.loc["web_sel", "documents"] == len(expected)
    status = lake_.status()["datasets"].set_index("name")
    assert status.loc["web_sel", "status"] == "complete" and status.loc["web_sel", "num_docs"] == len(expected)
    frame = audit(config, 0, 10)
    assert set(frame.dataset) == {"web", "web_sel"} and frame.attrs["selections_checked"] == 33


def test_audit_finds_a_tampered_selection(lake, tmp_path: Path) -> None:
    root, _ = lake
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    config = lake_config(copy, packing="pack", shuffle={"kind": "window", "window_chunks": 2})
    con = duckdb.connect(str(copy / "lake" / "catalog.duckdb"))
    con.execute("UPDATE chunks SET num_docs = num_docs + 1 WHERE dataset = 'web_sel' AND global_index = 3")
    con.close()
    with pytest.raises(LakeloaderError, match=r"dataset 'web_sel', chunk 3: .*num_docs"):
        audit(config, 0, 10)


def test_read_while_building_equals_after(tmp_path: Path, dask_scheduler: str) -> None:
    """A reader follows the build's live catalog while source chunks and their selections are
    still being committed; its batches equal those read after the build."""
    corpus(tmp_path / "data")
    config = lake_config(tmp_path, packing="pack", shuffle={"kind": "window", "window_chunks": 2}, wait_timeout=120)
    builder, live, errors = start_build_thread(config, scheduler=dask_scheduler, progress=False)
    during_loader = loader_during_build(config, builder, live)
    committed_at_start = {d.name: d.chunks.committed for d in during_loader.datasets}
    during = [during_loader.batch(step) for step in range(8)]
    builder.join()
    assert not errors, errors
    assert committed_at_start["web_sel"] < 33, committed_at_start
    assert_batches_equal(during, global_batches(config, 1, range(8)), "read while building")


def test_a_seek_while_the_last_chunks_of_a_selection_are_building_equals_after(
        tmp_path: Path, dask_scheduler: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 48 item 8: the last chunks of a selection hold less than one example (here none), so
    a window's end computed from the committed prefix lies past the epoch's size N. A reader that
    resumes (or runs ahead) to the step holding position N (the second epoch's first) while the
    last chunk is not committed got the first epoch's order for it: another example than after
    the build."""
    texts = [t[:1500] for t in stdlib_texts("email")]
    data = tmp_path / "data"
    data.mkdir()
    for f in range(4):   # one chunk per file, in file order; files 2 and 3 select nothing
        rows = [{"text": texts[(10 * f + i) % len(texts)], "score": 0.9 if f < 2 else 0.1, "flag": True}
                for i in range(10)]
        (data / f"p{f}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = write_config(tmp_path, {
        "web": {"sources": [str(data / "*.jsonl")], "metadata_fields": {"score": "float", "flag": "bool"}},
        "hq": {"from": "web", "where": "score >= 0.5 AND flag"}},
        build={"split_size": "1MB"}, mixture={"weights": {"web": 0.6, "hq": 0.4}},
        loader={"seq_len": 64, "batch_size": 8, "shuffle": {"kind": "window", "window_chunks": 2}})
    build(config, scheduler=dask_scheduler, progress=False)
    after = Loader(config)
    hq = after.datasets[after.dataset_names.index("hq")]
    assert hq.chunks.committed == 4 and hq.chunks.num_tokens[2:].tolist() == [0, 0]
    epoch = hq.train_count()
    step = next(s for s in range(1000) if any(
        owner == 1 and index == epoch for owner, index in zip(*after.mixer.assign(s, after.row_indices))))
    expected = after.batch(step)
    after.close()

    # The reader sees hq's first three chunks committed, the last when it first waits.
    dataset = CatalogView.dataset
    served = []

    def building(self: CatalogView, name: str, *args: Any, **options: Any) -> Any:
        chunks = dataset(self, name, *args, **options)
        if name == "hq" and not served:
            served.append(name)
            n = chunks.committed - 1
            return dataclasses.replace(chunks, complete=False, num_docs=chunks.num_docs[:n],
                                       num_tokens=chunks.num_tokens[:n],
                                       num_parts=None if chunks.num_parts is None else chunks.num_parts[:n])
        return chunks

    monkeypatch.setattr(CatalogView, "dataset", building)
    with Loader(config) as during:
        assert not during.complete
        assert_batches_equal(during.batch(step), expected, f"step {step} sought while building")


def test_a_changed_predicate_is_a_new_selection_and_tokenizes_nothing(lake, tmp_path: Path,
                                                                      dask_scheduler: str) -> None:
    original, rows = lake
    shutil.copytree(original / "lake", tmp_path / "copy" / "lake")
    root = tmp_path / "copy"
    pad = dict(weights={"web_sel": 1}, data=original / "data", packing="pad", seq_len=4096,
               pack={"long_documents": "error"})
    before = lake_config(root, **pad)
    report = build(before, scheduler=dask_scheduler, progress=False)
    assert report.chunks_built == 0
    fingerprint = open_lake(before).sql("SELECT fingerprint FROM datasets WHERE name = 'web_sel'").fingerprint[0]
    changed = lake_config(root, where=CHANGED, **pad)
    report = build(changed, scheduler=dask_scheduler, progress=False)
    assert report.chunks_built == 0 and report.tokens == 0   # nothing tokenized: selections only
    lake_ = open_lake(changed)
    after = lake_.sql("SELECT fingerprint, num_docs FROM datasets WHERE name = 'web_sel'")
    assert after.fingerprint[0] != fingerprint
    expected, _ = source_documents(changed, CHANGED)
    assert after.num_docs[0] == len(expected) > 0
    assert eval_documents(changed) == expected
    assert sorted(TOKENIZER.decode(d) for d in expected) == sorted(
        r["text"] for r in rows if passes(r, len(ids(r["text"])), CHANGED))
    # No row of the old selection is left; the chunk files stay (gc removes nothing) and verify
    # checks them once, as the source's.
    stored = lake_.sql("SELECT sum(len(docs)) AS docs FROM selections WHERE dataset = 'web_sel'")
    assert stored.docs[0] == len(expected)
    assert remove_stale(lake_).empty
    assert eval_documents(changed) == expected
    report = verify_lake(changed, progress=False)
    assert set(report.status) == {"ok"} and set(report.dataset) == {"web"}
    # Spacing, keyword case and parentheses do not change the selection: the plan is kept.
    respaced = lake_config(root, where="(lang='fr')   and num_tokens>=20", **pad)
    build(respaced, scheduler=dask_scheduler, progress=False)
    assert open_lake(respaced).sql("SELECT fingerprint FROM datasets WHERE name = 'web_sel'").fingerprint[0] == \
        after.fingerprint[0]


def test_two_configs_giving_one_name_other_predicates_never_read_each_others_selection(
        lake, tmp_path: Path, dask_scheduler: str) -> None:
    """One dataset name, two predicates in two configs of one lake: a loader reads its own
    predicate's selection or says to build it, never the other config's (issue 48, item 1)."""
    original, _ = lake
    shutil.copytree(original / "lake", tmp_path / "lake")
    pad = dict(weights={"web_sel": 1}, data=original / "data", packing="pad", seq_len=4096,
               pack={"long_documents": "error"})
    first = lake_config(tmp_path, **pad).rename(tmp_path / "first.yaml")
    second = lake_config(tmp_path, where=CHANGED, **pad).rename(tmp_path / "second.yaml")
    build(first, scheduler=dask_scheduler, progress=False)
    expected = eval_documents(first)
    with pytest.raises(CatalogError, match=r"'web_sel' .* not the selection .*second\.yaml defines.*"
                                           r"lakeloader build .*second\.yaml"):
        Loader(second, mode="eval")
    assert main(["batches", str(second), "--steps", "0:1", "--out", str(tmp_path / "b.npz")]) == 2
    build(second, scheduler=dask_scheduler, progress=False)
    assert eval_documents(second) == source_documents(second, CHANGED)[0] != expected
    with pytest.raises(CatalogError, match=r"first\.yaml defines"):
        Loader(first, mode="eval")
    build(first, scheduler=dask_scheduler, progress=False)
    assert eval_documents(first) == expected


def test_gc_keeps_the_source_files_a_filtered_dataset_reads_after_its_source_is_replanned(
        lake, tmp_path: Path, dask_scheduler: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Another config rebuilds the source dataset with another split size (a new chunk folder):
    the filtered dataset still reads the old folder's files, so status never lists it as stale
    and gc keeps it; once the filter is re-selected from the new plan, the old folder is stale
    (issue 48, item 2)."""
    original, _ = lake
    shutil.copytree(original / "lake", tmp_path / "lake")
    both = lake_config(tmp_path, data=original / "data").rename(tmp_path / "both.yaml")
    build(both, scheduler=dask_scheduler, progress=False)
    old = {folder.parent.relative_to(tmp_path / "lake").as_posix() for folder in (tmp_path / "lake").glob("web/*/*")}
    raw = yaml.safe_load(both.read_text())
    raw["datasets"] = {"web": raw["datasets"]["web"]}
    raw["build"]["split_size"] = "9KB"
    raw["mixture"] = {"weights": {"web": 1}}
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump(raw))
    build(other, scheduler=dask_scheduler, progress=False)
    assert open_lake(other).status()["stale_folders"].empty
    assert main(["gc", str(both)]) == 0
    capsys.readouterr()
    assert all((tmp_path / "lake" / folder).is_dir() for folder in old)
    files = open_lake(both).sql("SELECT path FROM chunks WHERE dataset = 'web_sel'").path
    assert all((tmp_path / "lake" / path).is_file() for path in files)
    build(both, scheduler=dask_scheduler, progress=False)   # both plans back: the 9KB folder is stale now
    stale = open_lake(both).status()["stale_folders"]
    assert len(stale) == 1 and stale.folder[0] not in old


def test_a_filter_needs_the_planned_types_and_selects_something(tmp_path: Path, dask_scheduler: str) -> None:
    corpus(tmp_path / "data")
    # Untyped fields bind as strings when the config is read; the plan infers score: float.
    config = lake_config(tmp_path, where="score LIKE '0.%'", weights={"web_sel": 1}, metadata=list(METADATA))
    with pytest.raises(ConfigError, match=r"datasets\.web_sel\.where: does not bind.*'score': 'float'"):
        build(config, scheduler=dask_scheduler, progress=False)
    assert not (tmp_path / "lake").exists()   # a build that could not start leaves no new lake
    config = lake_config(tmp_path, where="lang = 'xx'", weights={"web_sel": 1})
    with pytest.raises(SourceError, match=r"dataset 'web_sel' has no documents: its filter where: \"lang = 'xx'\""):
        build(config, scheduler=dask_scheduler, progress=False)


def test_a_catalog_from_before_filters_still_reads(lake, tmp_path: Path) -> None:
    """Readers (loader, verify) of a lake whose catalog predates the columns of filters read it."""
    root, _ = lake
    shutil.copytree(root / "lake", tmp_path / "lake")
    config = write_config(tmp_path, {"web": {"sources": [str(root / "data" / "*.jsonl")], "metadata_fields": METADATA}},
                          build={"split_size": "6KB", "row_group_tokens": 300},
                          loader={"seq_len": SEQ_LEN, "batch_size": BATCH})
    reference = global_batches(config, 1, range(3))
    con = duckdb.connect(str(tmp_path / "lake" / "catalog.duckdb"))
    for table in ("selections", "row_groups", "chunk_examples", "packing_plans", "chunks", "shard_plans"):
        con.execute(f"DELETE FROM {table} WHERE dataset = 'web_sel'")
    con.execute("DELETE FROM dataset_plans WHERE name = 'web_sel'")
    con.execute("DROP TABLE selections")
    con.execute("ALTER TABLE dataset_plans DROP COLUMN source_dataset")
    con.execute("ALTER TABLE dataset_plans DROP COLUMN selection")
    con.close()
    assert_batches_equal(global_batches(config, 1, range(3)), reference, "old catalog")
    assert set(verify_lake(config, progress=False).status) == {"ok"}


def test_a_predicate_failing_on_a_value_names_the_key_and_chunk(tmp_path: Path, dask_scheduler: str) -> None:
    corpus(tmp_path / "data")
    config = lake_config(tmp_path, where="CAST(lang AS INTEGER) > 3", weights={"web_sel": 1})
    with pytest.raises(ConfigError, match=r"datasets\.web_sel\.where = .* fails on the documents of chunk \d+ of "
                                          r"dataset 'web' .*Could not convert"):
        build(config, scheduler=dask_scheduler, progress=False)


def test_a_chunks_selections_are_fetched_once_for_all_its_row_groups(lake, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading a filter's chunk file row group by row group asks the catalog for the chunk's
    selections once (one query per chunk, not per row group)."""
    root, _ = lake
    asked: list[tuple[str, int]] = []
    real = CatalogView.named

    def counting(self: CatalogView, name: str, params: Any = None, *fetch: Any) -> Any:
        if "selection" in name:   # any query of the selections table
            asked.append((params["name"], params["global_index"]))
        return real(self, name, params, *fetch)

    monkeypatch.setattr(CatalogView, "named", counting)
    with Loader(root / "main.yaml") as loader:
        examples = next(d for d in loader.datasets if d.name == "web_sel")
        chunks, files = examples.chunks, examples.reader.files
        groups = {c: len(examples.reader.tables.of(chunks, c)[1]) for c in range(chunks.committed)}
        assert max(groups.values()) > 1   # chunks of several row groups
        for chunk, count in groups.items():
            for group in range(count):
                files.read_row_group(chunks, chunk, group)
            files.chunk_parts(chunks, chunk)
    assert sorted(asked) == sorted(set(asked)) and len(asked) == chunks.committed


# -- the reader index answers as the snapshot does --------------------------------------------------

def _answers(view: CatalogView, name: str, plan_key: str | None, chunks: list[int]) -> dict[str, Any]:
    """Everything a loader asks the catalog of dataset ``name``, as plain values."""
    found = view.dataset(name, plan_key, part_counts=True)
    rows = view.row_groups_of(name, chunks, kinds=2)   # (one kind stored, two asked: the second counts 0)
    return {
        "dataset": (found.fingerprint, found.complete, found.planned, found.token_type, found.filtered,
                    found.num_docs.tolist(), found.num_tokens.tolist(), found.num_parts.tolist(),
                    None if found.num_examples is None else found.num_examples.tolist()),
        "row_groups": {chunk: {k: v.tolist() for k, v in groups.items()} for chunk, groups in rows.items()},
        "records": [view.chunk_record(name, chunk) for chunk in chunks if 0 <= chunk < found.committed],
        "filtered": view.is_filtered(name),
        "plans": (view.plan_registered(name, plan_key or ""), view.plan_registered(name, "no such plan")),
        "tokenizer": view.tokenizer_path([name]),
    }


@pytest.fixture(scope="module")
def two_views(lake: tuple[Path, list[dict[str, Any]]]) -> Iterator[tuple[CatalogView, CatalogView, dict[str, str]]]:
    """Views of the lake answering from its reader index and by SQL (as for a snapshot published
    without an index), and the packing plan of each dataset."""
    root, _ = lake
    with Loader(root / "main.yaml") as loader:
        plan_keys = {d.name: d.plan_key for d in loader.datasets}
    at = open_lake(load_config(root / "main.yaml"))
    indexed = CatalogView(at)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(catalog_view_module, "open_reader_index", lambda where: (open_reader_index(where)[0], None))
        queried = CatalogView(at)
    assert indexed.reader_index() is not None and queried.reader_index() is None
    yield indexed, queried, plan_keys
    indexed.close()
    queried.close()


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_the_reader_index_answers_every_question_as_the_snapshot_does(
        two_views: tuple[CatalogView, CatalogView, dict[str, str]], data: st.DataObject) -> None:
    """A loader's questions (a dataset's counts and committed prefix, packing counts, the row
    groups and records of any chunks, filters, packing plans, the tokenizer) answered from the
    snapshot's reader index equal the answers of SQL on the snapshot itself, for a dataset built
    from sources and one defined by a filter, with and without a packing plan, for any chunks
    asked (repeated, unordered, beyond the prefix)."""
    indexed, queried, plan_keys = two_views
    name = data.draw(st.sampled_from(sorted(plan_keys)))
    plan_key = data.draw(st.sampled_from([plan_keys[name], None]))
    planned = indexed.dataset(name).planned
    chunks = data.draw(st.lists(st.integers(-2, planned + 2), max_size=12))
    assert _answers(indexed, name, plan_key, chunks) == _answers(queried, name, plan_key, chunks)
    for view in (indexed, queried):
        with pytest.raises(CatalogError, match="dataset 'nowhere' is not in the lake .*: build it first"):
            view.dataset("nowhere")
