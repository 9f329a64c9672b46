"""The demo corpus (lakeloader.demo.corpus) and the committed demo tokenizer (demo/tokenizer.json)."""

from __future__ import annotations

import gzip
import json
import sysconfig
from pathlib import Path

import orjson
import pyarrow.parquet as pq
import pytest
import zstandard
from tokenizers import Tokenizer

from lakeloader.demo.corpus import MANIFEST, iter_texts, main, prepare_corpus

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "demo" / "tokenizer.json"
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|bos|>", "<|pad|>", "<|sep|>", "<|im_start|>", "<|im_end|>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|image|>", "<|image_start|>", "<|image_end|>",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[Path]]]:
    out = tmp_path_factory.mktemp("demo") / "data"
    return out, prepare_corpus(out, "demo")


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _jsonl_lines(path: Path) -> list[bytes]:
    data = path.read_bytes()
    if path.name.endswith(".gz"):
        data = gzip.decompress(data)
    elif path.name.endswith(".zst"):
        data = zstandard.ZstdDecompressor().decompressobj().decompress(data)
    assert data.endswith(b"\n")
    return data.split(b"\n")[:-1]


def test_three_datasets_with_expected_layouts(corpus: tuple[Path, dict[str, list[Path]]]) -> None:
    out, files = corpus
    assert sorted(files) == ["code", "docs", "notes"]
    names = {dataset: sorted(p.name for p in paths) for dataset, paths in files.items()}
    code = names["code"]
    assert sum(n.endswith(".jsonl") for n in code) >= 3 and sum(n.endswith(".jsonl.zst") for n in code) == 1
    assert names["docs"] == ["docstrings-000.parquet", "docstrings-001.parquet", "topics.jsonl.gz"]
    assert names["notes"] == ["lines.txt"]
    sizes = [p.stat().st_size for p in files["code"] if p.name.endswith(".jsonl")]
    assert len(set(sizes)) == len(sizes)  # unequal shards
    assert all(p.is_file() and p.parent.parent == out for paths in files.values() for p in paths)
    total = sum(len(t.encode()) for paths in files.values() for t in iter_texts(paths))
    assert 5_000_000 < total < 13_000_000


def test_byte_identical_on_rerun_and_cheap_skip(corpus: tuple[Path, dict[str, list[Path]]], tmp_path: Path) -> None:
    out, files = corpus
    again = prepare_corpus(tmp_path / "other", "demo")
    assert _files(out) == _files(tmp_path / "other")
    assert {k: [p.name for p in v] for k, v in again.items()} == {k: [p.name for p in v] for k, v in files.items()}
    # Up to date: nothing is rewritten.
    stamps = {p: p.stat().st_mtime_ns for paths in again.values() for p in paths}
    assert prepare_corpus(tmp_path / "other", "demo") == again
    assert all(p.stat().st_mtime_ns == stamp for p, stamp in stamps.items())


def test_damaged_corpus_is_rewritten(tmp_path: Path) -> None:
    files = prepare_corpus(tmp_path, "demo")
    expected = _files(tmp_path)
    victim = files["notes"][0]
    victim.write_text("truncated\n")
    prepare_corpus(tmp_path, "demo")
    assert _files(tmp_path) == expected


def test_jsonl_lines_parse_with_nonempty_text(corpus: tuple[Path, dict[str, list[Path]]]) -> None:
    _, files = corpus
    jsonl = [p for paths in files.values() for p in paths if ".jsonl" in p.name]
    assert len(jsonl) >= 5
    for path in jsonl:
        lines = _jsonl_lines(path)
        assert lines
        for line in lines:
            record = orjson.loads(line)
            assert isinstance(record["text"], str) and record["text"].strip()
            assert set(record) == ({"text", "path"} if path.parent.name == "code" else {"text", "topic"})
    code_paths = [orjson.loads(line)["path"] for p in sorted(files["code"]) for line in _jsonl_lines(p)]
    assert not any(part in {"test", "tests", "idlelib", "lib2to3", "site-packages", "__pycache__"}
                   for path in code_paths for part in path.split("/")[:-1])
    assert "json/decoder.py" in code_paths
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    record = next(orjson.loads(line) for p in files["code"] for line in _jsonl_lines(p)
                  if orjson.loads(line)["path"] == "json/decoder.py")
    assert record["text"] == (stdlib / "json" / "decoder.py").read_text(encoding="utf-8")


def test_parquet_docstrings_have_several_row_groups(corpus: tuple[Path, dict[str, list[Path]]]) -> None:
    _, files = corpus
    parquets = [p for p in files["docs"] if p.suffix == ".parquet"]
    assert len(parquets) == 2
    for path in parquets:
        parquet = pq.ParquetFile(path)
        assert parquet.num_row_groups >= 2
        assert parquet.schema_arrow.names == ["text", "source"]
        assert all(str(t) == "string" for t in parquet.schema_arrow.types)
        table = parquet.read()
        assert table.column("text").null_count == 0
        assert all(t.strip() for t in table.column("text").to_pylist())
    sources = pq.read_table(parquets[0]).column("source").to_pylist()
    assert any(":" in s for s in sources) and any(":" not in s for s in sources)


def test_notes_have_no_empty_lines(corpus: tuple[Path, dict[str, list[Path]]]) -> None:
    _, files = corpus
    data = files["notes"][0].read_bytes()
    assert data.endswith(b"\n") and b"\r" not in data
    lines = data.decode("utf-8").split("\n")[:-1]
    assert lines and all(line.strip() for line in lines)
    assert "Beautiful is better than ugly." in lines  # the Zen, decoded from this.py


def test_manifest_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["prepare", str(tmp_path), "-q"]) == 0
    summary = capsys.readouterr().out.strip().splitlines()
    assert len(summary) == 1 and "code" in summary[0] and "notes" in summary[0]
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert manifest["size"] == "demo"
    assert set(manifest["datasets"]) == {"code", "docs", "notes"}
    assert all((tmp_path / rel).stat().st_size == info["bytes"] for rel, info in manifest["files"].items())


# ------------------------------------------------------------------------ the demo tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(TOKENIZER))


def test_tokenizer_special_tokens(tokenizer: Tokenizer) -> None:
    assert tokenizer.get_vocab_size() == 8192
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert [tokenizer.id_to_token(i) for i in range(len(SPECIAL_TOKENS))] == SPECIAL_TOKENS
    assert tokenizer.normalizer is None and tokenizer.post_processor is None
    assert tokenizer.encode("<|endoftext|>").ids == [0]


def _snippets() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [
        (stdlib / "json" / "decoder.py").read_text(encoding="utf-8")[:3000],
        (stdlib / "textwrap.py").read_text(encoding="utf-8")[:2000],
        "def f(x):\n    return x  # naïve café\n\n\n\tclass Ünïcödé:\n        pass\r\n",
        "日本語のテキスト, Ελληνικά, русский текст, emoji 🐍🎉 and a zero-width\u200bjoiner",
        "  leading spaces and trailing   \n\n",
        "\x00\x01 control characters \x7f",
    ]


@pytest.mark.parametrize("index", range(6))
def test_tokenizer_round_trips(tokenizer: Tokenizer, index: int) -> None:
    text = _snippets()[index]
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert tokenizer.decode(ids) == text


def test_tokenizer_concatenation_at_line_starts(tokenizer: Tokenizer) -> None:
    def ids(s: str) -> list[int]:
        return tokenizer.encode(s, add_special_tokens=False).ids

    pairs = [("def f(x):\n", "return x\n"), ("Hello world\n", "foo bar"), ("x = 1\n", "#comment"),
             ("café\n", "日本")]
    source = _snippets()[0]
    lines = source.splitlines(keepends=True)
    for cut in range(1, len(lines)):
        a, b = "".join(lines[:cut]), "".join(lines[cut:])
        # a ends with a single "\n" after text (a blank line before the cut merges "\n\n").
        if a.endswith("\n") and not a.endswith("\n\n") and b[:1] and not b[:1].isspace():
            pairs.append((a, b))
    assert len(pairs) > 10
    for a, b in pairs:
        assert ids(a + b) == ids(a) + ids(b), (a[-20:], b[:20])
