"""Documents in SQL (issue 14, items 1-3): metadata kept with each document, the `documents` view
equal to counting the source files directly (local lake, S3 lake, during a build), `lakeloader
stats` and its plot, and the SQL sandbox with the view registered."""

from __future__ import annotations

import collections
import json
import math
import threading
import time
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from tokenizers import Tokenizer

from lakeloader.catalog.store import LiveCatalog
from lakeloader.catalog.documents import register_documents
from lakeloader.catalog.lake import Lake, open_lake
from lakeloader.cli import main
from lakeloader.config import parse_config
from lakeloader.contracts.errors import CatalogError, ConfigError, InputError
from lakeloader.ingest.documents import SplitSource, read_split
from lakeloader.ingest.driver import build
from lakeloader.plan.planner import plan_dataset, settings_fingerprint
from lakeloader.plan.splits import Split
from lakeloader.report.lengths_plot import plot_lengths

from conftest import DEMO_TOKENIZER, stdlib_texts, write_config
from test_read_while_mixture_builds import workers_held
from test_s3 import BUCKET, s3_endpoint, storage_options, upload  # noqa: F401  (s3_endpoint: a fixture)

METADATA = {"id": "int", "lang": "string", "score": "float", "ok": "bool"}
LANGS = ["en", "de", "fr", None]
TOKENIZER = Tokenizer.from_file(str(DEMO_TOKENIZER))


def paragraphs(package: str, count: int) -> list[str]:
    """The first ``count`` paragraphs of a standard-library package's sources: many small documents."""
    found = [p for text in stdlib_texts(package) for p in text.split("\n\n") if p.strip()]
    return found[:count]


def good_records(texts: list[str]) -> list[dict[str, Any]]:
    """Records with metadata of every type: nulls, missing fields and ints in the float field."""
    records = []
    for i, text in enumerate(texts):
        record: dict[str, Any] = {"text": text, "id": i * 7, "lang": LANGS[i % 4], "score": i / 8, "ok": i % 3 == 0}
        if i % 5 == 1:
            del record["lang"]          # missing: NULL
        if i % 6 == 2:
            record["score"] = i         # an int in a float field
        if i % 7 == 3:
            record["ok"] = None
        records.append(record)
    return records


# Each record breaks one field's type: a reject under on_error: skip, an error under raise.
BAD = [
    ({"id": "seven"}, "metadata field 'id' is string ('seven'), expected int"),
    ({"lang": 5}, "metadata field 'lang' is int (5), expected string"),
    ({"score": "high"}, "metadata field 'score' is string ('high'), expected float"),
    ({"ok": 1}, "metadata field 'ok' is int (1), expected bool"),
    ({"id": True}, "metadata field 'id' is bool (True), expected int"),
    ({"id": 1.5}, "metadata field 'id' is float (1.5), expected int"),
    ({"lang": {"code": "en"}}, "metadata field 'lang' is dict (an object)"),
    ({"id": 2**63 + 5}, "beyond the 64-bit integers"),
]


def write_lines(path: Path, records: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def tokens(text: str) -> int:
    return len(TOKENIZER.encode(text, add_special_tokens=False).ids)


def expected_rows(records: list[dict[str, Any]], source: str, first_line: int) -> list[tuple[Any, ...]]:
    """(source, line, id, lang, score, ok, num_tokens) of each record, counted directly."""
    return [(source, first_line + i, r.get("id"), r.get("lang"), None if r.get("score") is None else float(r["score"]),
             r.get("ok"), tokens(r["text"])) for i, r in enumerate(records)]


ROW_COLUMNS = "source, line, id, lang, score, ok, num_tokens"


def view_rows(lake: Lake, dataset: str) -> list[tuple[Any, ...]]:
    frame = lake.sql(f"SELECT {ROW_COLUMNS} FROM documents WHERE dataset = ? ORDER BY source, line", [dataset])
    frame = frame.astype(object).where(frame.notna(), None)
    return [tuple(row) for row in frame.itertuples(index=False)]


def per_lang(rows: list[tuple[Any, ...]]) -> dict[Any, tuple[int, int]]:
    counts: dict[Any, list[int]] = collections.defaultdict(lambda: [0, 0])
    for row in rows:
        counts[row[3]][0] += 1
        counts[row[3]][1] += row[6]
    return {lang: (docs, total) for lang, (docs, total) in counts.items()}


class Corpus:
    """The local lake: ``plain`` (no metadata), ``meta`` (the same file with metadata, bad
    records, and Parquet files: one without a metadata column, one with a column of the wrong
    type) under on_error: skip, and ``sft`` (supervised: two part kinds)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        texts = paragraphs("json", 150)
        self.good = good_records(texts)
        bad = [{"text": f"bad record {i}", **fields} for i, (fields, _) in enumerate(BAD)]
        self.bad_lines = [{"text": "a fine record", "id": 1, "lang": "en"}] + bad
        write_lines(root / "data" / "good.jsonl", self.good)
        write_lines(root / "data" / "bad.jsonl", self.bad_lines)
        self.p1 = [{"text": t, "id": n, "lang": "en" if n % 2 else None, "score": n, "ok": True}
                   for n, t in enumerate(texts[:9])]
        pq.write_table(pa.table({"text": [r["text"] for r in self.p1], "id": pa.array([r["id"] for r in self.p1], pa.int32()),
                                 "lang": [r["lang"] for r in self.p1], "score": pa.array([r["score"] for r in self.p1], pa.int64()),
                                 "ok": [r["ok"] for r in self.p1]}), root / "data" / "p1.parquet", row_group_size=4)
        self.p2 = [{"text": t, "id": None, "lang": "fr"} for t in texts[9:14]]   # no id, score or ok columns
        pq.write_table(pa.table({"text": [r["text"] for r in self.p2], "lang": [r["lang"] for r in self.p2]}),
                       root / "data" / "p2.parquet")
        pq.write_table(pa.table({"text": texts[:3], "lang": [1, 2, 3]}), root / "data" / "p3.parquet")
        self.sft = [{"prompt": f"Question {i}: what is {t[:40]}?", "response": t[:300], "lang": LANGS[i % 3]}
                    for i, t in enumerate(texts[:12])]
        write_lines(root / "data" / "sft.jsonl", self.sft)
        # listed without types: score's first value is an int (its later floats are rejects), tag's
        # first non-null value a string
        self.first = [{"text": "one", "score": 1}, {"text": "two", "score": None, "tag": None},
                      {"text": "three", "score": 0.5, "tag": "x"}, {"text": "four", "score": 7, "tag": "y"},
                      {"text": "five", "tag": 3}]
        write_lines(root / "data" / "first.jsonl", self.first)
        data = root / "data"
        self.config = write_config(root, {
            "plain": {"sources": [str(data / "good.jsonl")]},
            "meta": {"sources": [str(data / n) for n in ("good.jsonl", "bad.jsonl", "p1.parquet", "p2.parquet",
                                                          "p3.parquet")],
                     "metadata_fields": METADATA, "on_error": "skip"},
            "sft": {"sources": [str(data / "sft.jsonl")], "format": "supervised", "metadata_fields": {"lang": "string"}},
            "listed": {"sources": [str(data / "good.jsonl")], "metadata_fields": list(METADATA)},
            "first": {"sources": [str(data / "first.jsonl")], "on_error": "skip", "metadata_fields": ["score", "tag"]},
        }, build={"split_size": "12KB"}, loader={"seq_len": 64, "batch_size": 4})

    def expected_meta(self) -> list[tuple[Any, ...]]:
        data = self.root / "data"
        rows = expected_rows(self.good, str(data / "good.jsonl"), 1)
        rows += expected_rows(self.bad_lines[:1], str(data / "bad.jsonl"), 1)
        rows += expected_rows(self.p1, str(data / "p1.parquet"), 0)
        rows += expected_rows(self.p2, str(data / "p2.parquet"), 0)
        return sorted(rows, key=lambda row: (row[0], row[1]))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory, dask_scheduler: str) -> Corpus:
    corpus = Corpus(tmp_path_factory.mktemp("documents"))
    build(corpus.config, scheduler=dask_scheduler, progress=False)
    return corpus


def test_documents_view_equals_counting_the_source_files(corpus: Corpus) -> None:
    lake = open_lake(corpus.config)
    rows = view_rows(lake, "meta")
    assert rows == corpus.expected_meta()   # every document: its file, line/row, metadata and tokens
    by_lang = lake.sql("SELECT lang, count(*) AS docs, sum(num_tokens) AS tokens FROM documents "
                       "WHERE dataset = 'meta' GROUP BY lang")
    assert {(None if pd_na(r.lang) else r.lang): (r.docs, r.tokens) for r in by_lang.itertuples()} == \
        per_lang(corpus.expected_meta())
    types = dict(lake.sql("SELECT column_name, column_type FROM (DESCRIBE documents)").values.tolist())
    assert {name: types[name] for name in METADATA} == {"id": "BIGINT", "lang": "VARCHAR", "score": "DOUBLE",
                                                         "ok": "BOOLEAN"}
    # chunk and doc locate each document in its chunk file; counts match the catalog's
    per_chunk = lake.sql("SELECT d.dataset, d.chunk, count(*) AS n, max(d.doc) + 1 AS top, sum(d.num_tokens) AS t, "
                         "any_value(c.num_docs) AS num_docs, any_value(c.num_tokens) AS num_tokens FROM documents d "
                         "JOIN chunks c ON c.dataset = d.dataset AND c.global_index = d.chunk GROUP BY ALL")
    assert (per_chunk.n == per_chunk.num_docs).all() and (per_chunk.top == per_chunk.n).all()
    assert (per_chunk.t == per_chunk.num_tokens).all()
    located = lake.sql("SELECT chunk, doc, num_tokens FROM documents WHERE dataset = 'meta' ORDER BY chunk, doc")
    paths = lake.sql("SELECT path FROM chunks WHERE dataset = 'meta' ORDER BY global_index").path
    in_files = [len(doc) for path in paths for doc in pq.read_table(lake.path_of(path)).column("tokens").to_pylist()]
    assert located.num_tokens.tolist() == in_files
    assert set(per_chunk.dataset) == {"plain", "meta", "sft", "listed", "first"}


def pd_na(value: Any) -> bool:
    return value is None or value != value


def test_metadata_is_not_in_the_token_stream(corpus: Corpus) -> None:
    """The chunks of good.jsonl hold the same tokens with and without metadata fields; bad
    records are rejects naming the field; a Parquet column of the wrong type rejects its row group."""
    lake = open_lake(corpus.config)

    def good_tokens(dataset: str) -> list[list[int]]:
        paths = lake.sql("SELECT c.path FROM chunks c JOIN shard_plans s ON s.dataset = c.dataset AND "
                         "s.shard_index = c.shard_index WHERE c.dataset = ? AND s.source LIKE '%good.jsonl' "
                         "ORDER BY c.split_index", [dataset]).path
        return [doc for path in paths for doc in pq.read_table(lake.path_of(path)).column("tokens").to_pylist()]

    assert good_tokens("meta") == good_tokens("plain") and len(good_tokens("plain")) == len(corpus.good)
    rejects = lake.sql("SELECT source, location, reason FROM rejects WHERE dataset = 'meta' ORDER BY source, line")
    bad = rejects[rejects.source.str.endswith("bad.jsonl")]
    assert bad.location.tolist() == [f"line {n}" for n in range(2, 2 + len(BAD))]
    for reason, (_, expected) in zip(bad.reason, BAD):
        assert expected in reason
    p3 = rejects[rejects.source.str.endswith("p3.parquet")]
    assert p3.reason.tolist() == ["column 'lang' has type int64, but metadata field 'lang' is declared string; "
                                  "fix the file or the type in metadata_fields"]
    assert len(rejects) == len(BAD) + 1


def test_metadata_listed_without_types_takes_the_first_seen_type(corpus: Corpus) -> None:
    lake = open_lake(corpus.config)
    data = corpus.root / "data"
    # the first record's types are those of METADATA (ints in the float field are accepted)
    assert view_rows(lake, "listed") == expected_rows(corpus.good, str(data / "good.jsonl"), 1)
    first = lake.sql("SELECT line, score, tag FROM documents WHERE dataset = 'first' ORDER BY line")
    assert first.line.tolist() == [1, 2, 4] and first.score.tolist()[::2] == [1, 7] \
        and [None if pd_na(tag) else tag for tag in first.tag][1:] == [None, "y"]
    chunk = lake.path_of(lake.sql("SELECT path FROM chunks WHERE dataset = 'first'").path[0])
    schema = pq.read_schema(chunk)
    assert (schema.field("meta.score").type, schema.field("meta.tag").type) == (pa.int64(), pa.string())
    rejects = lake.sql("SELECT location, reason FROM rejects WHERE dataset = 'first' ORDER BY line")
    assert rejects.location.tolist() == ["line 3", "line 5"]
    assert rejects.reason.str.startswith("metadata field 'score' is float (0.5), expected int (the field's type").tolist()[0]
    assert rejects.reason[1].startswith("metadata field 'tag' is int (3), expected string (the field's type")


def test_part_kinds_have_token_columns(corpus: Corpus) -> None:
    lake = open_lake(corpus.config)
    frame = lake.sql("SELECT line, lang, tokens_prompt, tokens_response, num_tokens, num_parts FROM documents "
                     "WHERE dataset = 'sft' ORDER BY line")
    assert frame.line.tolist() == list(range(1, len(corpus.sft) + 1))
    assert frame.tokens_prompt.tolist() == [tokens(r["prompt"]) for r in corpus.sft]
    assert frame.tokens_response.tolist() == [tokens(r["response"]) for r in corpus.sft]
    assert (frame.tokens_prompt + frame.tokens_response == frame.num_tokens).all() and (frame.num_parts == 2).all()
    # other datasets have no such kinds, and no metadata where they declare none
    other = lake.sql("SELECT count(tokens_prompt) AS kinds, count(id) AS ids, sum(tokens_text) = sum(num_tokens) "
                     "AS same FROM documents WHERE dataset = 'plain'")
    assert other.values.tolist() == [[0, 0, True]]


def test_stats_cli_and_plot(corpus: Corpus, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stats", str(corpus.config), "--by", "lang", "--format", "json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    meta = {row["lang"]: (row["documents"], row["tokens"]) for row in stats if row["dataset"] == "meta"}
    assert meta == per_lang(corpus.expected_meta())
    plot = tmp_path / "lengths.png"
    assert main(["stats", str(corpus.config), "--plot", str(plot)]) == 0
    printed = capsys.readouterr().out.split()
    assert printed[:7] == ["dataset", "documents", "tokens", "p50", "p90", "p99", "max"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000
    by_plot = tmp_path / "by-lang.png"   # the Python API: a curve per value, returns stats(by)
    assert plot_lengths(open_lake(corpus.config), by_plot, by="lang").documents.sum() == \
        len(corpus.expected_meta()) + 2 * len(corpus.good) + len(corpus.sft) + 3
    assert by_plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # percentiles are those of the documents' token counts
    lengths = sorted(row[6] for row in corpus.expected_meta())
    frame = open_lake(corpus.config).stats()
    meta_row = frame[frame.dataset == "meta"].iloc[0]
    assert meta_row.documents == len(lengths) and meta_row.tokens == sum(lengths) and meta_row["max"] == lengths[-1]
    for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):   # the shortest with a share q at or below it
        assert meta_row[name] == lengths[math.ceil(q * len(lengths)) - 1], name
    assert main(["stats", str(corpus.config), "--by", "nope"]) == 2
    error = capsys.readouterr().err
    assert "no column 'nope'" in error and "lang" in error
    with pytest.raises(SystemExit):
        main(["stats", "--help"])
    assert "p50" in capsys.readouterr().out


SECRET = "not for the documents view"


def test_sandbox_holds_with_documents_registered(corpus: Corpus, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text(SECRET)
    lake = open_lake(corpus.config)
    chunk = lake.path_of(lake.sql("SELECT path FROM chunks LIMIT 1").path[0])
    for statement in (f"SELECT * FROM documents, read_text('{secret}')",
                      f"SELECT count(*) FROM documents UNION ALL SELECT count(*) FROM read_parquet('{chunk}')",
                      f"COPY (SELECT * FROM documents) TO '{tmp_path / 'out.csv'}'",
                      "SET enable_external_access = true; SELECT * FROM documents"):
        with pytest.raises(CatalogError) as refused:
            lake.sql(statement)
        assert SECRET not in str(refused.value)
    assert not (tmp_path / "out.csv").exists()
    con = lake.connect(sandboxed=True)
    try:
        register_documents(con, lake)
        assert con.execute("SELECT count(*) FROM documents").fetchone()[0] > 0
        for statement, error in ((f"SELECT * FROM read_text('{secret}')", duckdb.PermissionException),
                                 (f"SELECT * FROM read_parquet('{chunk}')", duckdb.PermissionException),
                                 (f"COPY (SELECT * FROM documents) TO '{tmp_path / 'x.csv'}'", duckdb.PermissionException),
                                 ("SET enable_external_access = true", duckdb.InvalidInputException)):
            with pytest.raises(error):
                con.execute(statement).fetchall()
    finally:
        con.close()


def test_documents_on_an_s3_lake(s3_endpoint: str, tmp_path: Path, dask_scheduler: str) -> None:  # noqa: F811
    records = good_records(paragraphs("json", 120))
    write_lines(tmp_path / "src" / "a.jsonl", records)
    upload(s3_endpoint, tmp_path / "src", "docs-src")
    config = tmp_path / "s3.yaml"
    config.write_text(yaml.safe_dump({
        "lake": f"s3://{BUCKET}/docs-lake", "tokenizer": str(DEMO_TOKENIZER), "storage_options": storage_options(s3_endpoint),
        "datasets": {"web": {"sources": [f"s3://{BUCKET}/docs-src/a.jsonl"], "metadata_fields": METADATA}},
        "build": {"split_size": "10KB", "publish_interval": 0.5}, "loader": {"seq_len": 64, "batch_size": 4},
    }))
    build(config, scheduler=dask_scheduler, progress=False)
    lake = open_lake(config)
    assert lake.sql("SELECT count(DISTINCT chunk) FROM documents").iloc[0, 0] > 1
    rows = view_rows(lake, "web")
    assert rows == expected_rows(records, f"s3://{BUCKET}/docs-src/a.jsonl", 1)
    stats = lake.stats(by="lang")
    assert {(None if pd_na(r.lang) else r.lang): (r.documents, r.tokens) for r in stats.itertuples()} == per_lang(rows)


def test_documents_during_a_build_are_the_committed_chunks(tmp_path: Path, dask_scheduler: str) -> None:
    """A second file joins a built dataset and fails (a malformed first line): its chunk stays
    planned. While the next build runs with every worker held (nothing can commit), and after it
    stopped, the view holds exactly the first file's documents; once it finishes, both files'."""
    first, second = good_records(paragraphs("json", 120)), good_records(paragraphs("email", 30))
    data = tmp_path / "data"
    write_lines(data / "a.jsonl", first)
    dataset = {"sources": [str(data / "a.jsonl")], "metadata_fields": METADATA}
    settings: dict[str, Any] = {"build": {"split_size": "10KB"}, "loader": {"seq_len": 64, "batch_size": 4}}
    config = write_config(tmp_path, {"web": dataset}, **settings)
    build(config, scheduler=dask_scheduler, progress=False)
    (data / "b.jsonl").write_text("{not json\n" + "".join(json.dumps(r) + "\n" for r in second))
    dataset["sources"].append(str(data / "b.jsonl"))
    config = write_config(tmp_path, {"web": dataset}, **settings)
    with pytest.raises(InputError, match="b.jsonl: line 1: malformed JSON"):
        build(config, scheduler=dask_scheduler, progress=False)
    lake = open_lake(config)
    expected_first = expected_rows(first, str(data / "a.jsonl"), 1)
    state = lake.sql("SELECT count(*) FILTER (WHERE status = 'committed') AS done, count(*) AS planned FROM chunks")
    assert 0 < state.done[0] < state.planned[0]
    assert view_rows(lake, "web") == expected_first
    write_lines(data / "b.jsonl", second)
    failure: list[BaseException] = []
    live = LiveCatalog()

    def run() -> None:
        try:
            build(config, scheduler=dask_scheduler, progress=False, live=live)
        except BaseException as exc:  # reported by the test thread
            failure.append(exc)

    with workers_held(dask_scheduler, tmp_path):
        builder = threading.Thread(target=run)
        builder.start()
        deadline = time.monotonic() + 60
        while not live.is_open:   # the build holds its catalog: readers here use its snapshot
            assert time.monotonic() < deadline and builder.is_alive(), failure
            time.sleep(0.02)
        assert view_rows(lake, "web") == expected_first
        assert builder.is_alive()
    builder.join(120)
    assert not failure and not builder.is_alive()
    assert view_rows(lake, "web") == sorted(expected_first + expected_rows(second, str(data / "b.jsonl"), 1),
                                            key=lambda row: (row[0], row[1]))


def test_type_conflicts_raise_under_on_error_raise(tmp_path: Path) -> None:
    config = parse_config({"lake": str(tmp_path / "lake"), "tokenizer": str(DEMO_TOKENIZER),
                           "datasets": {"web": {"sources": ["x.jsonl"], "metadata_fields": METADATA}}})
    record_format = config.datasets["web"].record_format()
    for number, (fields, expected) in enumerate(BAD):
        path = write_lines(tmp_path / f"bad{number}.jsonl", [{"text": "fine", "id": 3}, {"text": "bad", **fields}])
        source = SplitSource(str(path), "jsonl", None, Split("bytes", 0, path.stat().st_size, 0), record_format,
                             "raise", {})
        with pytest.raises(InputError) as raised:
            read_split(source)
        assert f"bad{number}.jsonl: line 2: " in str(raised.value) and expected in str(raised.value)
    table = tmp_path / "wrong.parquet"
    pq.write_table(pa.table({"text": ["a", "b"], "ok": ["yes", "no"]}), table)
    source = SplitSource(str(table), "parquet", None, Split("row_group", 0, 1, 0), record_format, "raise", {})
    with pytest.raises(InputError, match=r"wrong.parquet: rows 0-1 \(row group 0\): column 'ok' has type string"):
        read_split(source)


def test_metadata_fields_config_errors_name_the_key(tmp_path: Path) -> None:
    def parse(fields: Any) -> Any:
        return parse_config({"lake": str(tmp_path / "lake"), "tokenizer": str(DEMO_TOKENIZER),
                             "datasets": {"web": {"sources": ["x.jsonl"], "metadata_fields": fields}}})

    for fields, message in (
        ([1, 2], "list the metadata fields by name"),
        ({"lang": "text"}, "datasets.web.metadata_fields.lang"),
        ({"num_tokens": "int"}, "would hide the documents view's column"),
        ({"tokens_text": "int"}, "would hide the documents view's column"),
        ({"my-field": "string"}, "must be letters, digits and _"),
    ):
        with pytest.raises(ConfigError) as raised:
            parse(fields)
        assert "datasets.web.metadata_fields" in str(raised.value) and message in str(raised.value), raised.value
    dataset = parse({"lang": "string"}).datasets["web"]
    fingerprints = {settings_fingerprint(parse(fields).datasets["web"], "tok", 1000)
                    for fields in ({}, {"lang": "string"}, {"lang": "int"}, {"lang": "string", "id": "int"})}
    assert len(fingerprints) == 4   # metadata is part of the fingerprint (and names the chunk folder)
    assert dataset.record_format().metadata == (("lang", "string"),)


def test_untyped_fields_are_typed_at_planning(tmp_path: Path) -> None:
    write_lines(tmp_path / "a.jsonl", [{"text": "a", "n": None}, {"text": "b", "n": 2.5}])
    pq.write_table(pa.table({"text": ["a"], "lang": ["en"], "n": pa.array([1], pa.int16())}), tmp_path / "b.parquet")

    def plan(source: str, fields: Any) -> Any:
        config = parse_config({"lake": str(tmp_path / "lake"), "tokenizer": str(DEMO_TOKENIZER),
                               "datasets": {"web": {"sources": [str(tmp_path / source)], "metadata_fields": fields}}})
        return plan_dataset("web", config, "tok")

    assert plan("a.jsonl", ["n"]).metadata == (("n", "float"),)
    assert plan("b.parquet", ["n", "lang"]).metadata == (("n", "int"), ("lang", "string"))
    assert plan("a.jsonl", {"n": "int"}).metadata == (("n", "int"),)   # a declared type wins
    assert plan("a.jsonl", ["n"]).chunk_dir != plan("a.jsonl", {"n": "int"}).chunk_dir
    with pytest.raises(ConfigError, match=r"datasets.web.metadata_fields: cannot tell the type of 'lang', 'x' "
                       r"\(no string, number or boolean value in the first 10,000 records of .*a.jsonl\)"):
        plan("a.jsonl", ["lang", "x", "n"])
    with pytest.raises(ConfigError, match=r"cannot tell the type of 'x' \(its column in .*b.parquet is missing"):
        plan("b.parquet", ["x"])


def test_metadata_needs_fields_in_the_sources(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("one line\n")
    config = write_config(tmp_path, {"web": {"sources": [str(tmp_path / "a.txt")], "metadata_fields": {"x": "int"}}})
    with pytest.raises(ConfigError, match="metadata_fields needs JSON Lines or Parquet sources"):
        build(config, workers=1, progress=False)
