"""tokenizer_backend: fastokens gives exactly the ids of Hugging Face tokenizers (differential
tests on generated and real text), builds with either backend hold the same tokens and give the
same batches, and every way the fast backend can be unusable or wrong is a fallback or an error."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import duckdb
import fastokens
import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

from lakeloader import tokenizer as tokenizer_module
from lakeloader.catalog.lake import open_lake
from lakeloader.config import load_config
from lakeloader.contracts.errors import ConfigError
from lakeloader.demo.corpus import demo_code_files, help_topics
from lakeloader.ingest.chunk import _encoder
from lakeloader.ingest.driver import build
from lakeloader.plan.planner import plan_dataset
from lakeloader.tokenizer import (
    MAX_PIECE_CHARS,
    DocumentEncoder,
    EncoderMismatchError,
    encoder_name,
    resolve_backend,
)

from conftest import (
    DEMO_TOKENIZER,
    REPO,
    assert_batches_equal,
    global_batches,
    lake_documents,
    stdlib_texts,
    write_config,
    write_jsonl,
)


def _demo() -> Tokenizer:
    return Tokenizer.from_file(str(DEMO_TOKENIZER))


def _demo_nfc() -> Tokenizer:
    tokenizer = _demo()
    tokenizer.normalizer = normalizers.NFC()
    return tokenizer


def _config_tokenizers() -> list[str]:
    """Every tokenizer file the shipped configs name, besides the demo one."""
    found = set()
    for path in sorted((REPO / "configs").glob("*.yaml")):
        spec = yaml.safe_load(path.read_text()).get("tokenizer", "")
        if spec.endswith(".json"):
            found.add(str((path.parent / spec).resolve()))
    return sorted(found - {str(DEMO_TOKENIZER.resolve())})


# Every tokenizer the tests and configs use, plus the demo BPE behind an NFC normalizer (fastokens
# implements NFC itself: the hardest case it accepts).
TOKENIZERS = {"demo": _demo, "demo+NFC": _demo_nfc,
              **{Path(p).name + "@configs": (lambda p=p: Tokenizer.from_file(p)) for p in _config_tokenizers()}}


def _wordpiece(tmp_path: Path) -> Path:
    """A tiny WordPiece tokenizer (Whitespace pre-tokenizer), trained here: fastokens refuses it."""
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]", "<|endoftext|>"])
    tokenizer.train_from_iterator(stdlib_texts("json"), trainer)
    path = tmp_path / "wordpiece.json"
    tokenizer.save(str(path))
    return path


def _reference(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]


def _split(ids: np.ndarray, lengths: np.ndarray) -> list[list[int]]:
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    return [ids[a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:])]


def _fast(tokenizer: Tokenizer) -> DocumentEncoder:
    return DocumentEncoder(tokenizer, backend="fastokens")


@pytest.fixture(scope="module")
def encoders() -> dict[str, tuple[Tokenizer, DocumentEncoder]]:
    out = {}
    for name, make in TOKENIZERS.items():
        tokenizer = make()
        out[name] = (tokenizer, _fast(tokenizer))
    return out


def _added(tokenizer: Tokenizer) -> list[str]:
    return [t.content for t in tokenizer.get_added_tokens_decoder().values()]


_ADDED = _added(_demo())
# Text made of pieces that stress tokenizers: any code point, whitespace runs, combining marks,
# emoji sequences and the added tokens.
_PIECES = st.one_of(
    st.text(st.characters(codec="utf-8"), max_size=40),
    st.text(" \t\n\r\u00a0\u3000", min_size=1, max_size=300),
    st.text(st.characters(categories=["Mn", "Mc", "Me"]), max_size=6),
    st.sampled_from(["👍🏽", "👨\u200d👩\u200d👧", "🇫🇷", "e\u0301", "A\u030a", "\u212b", "ﬁ", "한", "\u1100\u1161",
                     "漢字", "مرحبا", "\ufeff", "\x00"]),
    st.sampled_from(_ADDED),
)
TEXTS = st.lists(st.lists(_PIECES, max_size=30).map("".join), min_size=1, max_size=6)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(texts=TEXTS)
def test_fastokens_equals_tokenizers_on_generated_text(encoders: dict[str, tuple[Tokenizer, DocumentEncoder]],
                                                        texts: list[str]) -> None:
    for name, (tokenizer, fast) in encoders.items():
        assert _split(*fast.encode(texts)) == _reference(tokenizer, texts), name


def test_fastokens_equals_tokenizers_on_real_files(encoders: dict[str, tuple[Tokenizer, DocumentEncoder]]) -> None:
    texts = [f.text for f in demo_code_files()[::25]] + [text for _, text in help_topics()[::4]]
    texts.append("\n\n".join(texts[:12]))   # one document far over the long-document cut
    assert len(texts[-1]) > 2 * MAX_PIECE_CHARS
    for name, (tokenizer, fast) in encoders.items():
        ids, lengths = fast.encode(texts)
        hf_ids, hf_lengths = DocumentEncoder(tokenizer).encode(texts)
        assert np.array_equal(lengths, hf_lengths) and np.array_equal(ids, hf_ids), name
        assert ids.dtype == hf_ids.dtype
        assert _split(ids, lengths)[-1] == tokenizer.encode(texts[-1], add_special_tokens=False).ids


def _corpus(folder: Path) -> Path:
    texts = stdlib_texts("json") + stdlib_texts("email", limit=4)
    texts += ["   \n\n\t  ", "Ünïcödé e\u0301 👍🏽 漢字 שלום <|endoftext|> in text <|im_start|>",
              "\n\n".join(stdlib_texts("email", limit=10))]   # over the long-document cut
    assert len(texts[-1]) > MAX_PIECE_CHARS
    return write_jsonl(folder / "a.jsonl", texts)


def _lake_config(tmp_path: Path, source: Path, backend: str, tokenizer: Path = DEMO_TOKENIZER) -> Path:
    folder = tmp_path / backend
    folder.mkdir()
    return write_config(folder, {"d": {"sources": [str(source)]}}, tokenizer=str(tokenizer),
                        tokenizer_backend=backend, build={"split_size": "32KB"},
                        loader={"seq_len": 64, "batch_size": 4})


def _recorded(config: Path) -> tuple[str, str, list[str]]:
    lake = open_lake(config)
    plan = lake.sql("SELECT fingerprint, encoder, chunk_dir FROM dataset_plans WHERE name = 'd'").iloc[0]
    builds = lake.sql("SELECT coalesce(encoder, '') AS e FROM builds ORDER BY build_id")["e"].tolist()
    return plan.fingerprint, plan.encoder, builds


def test_builds_with_either_backend_hold_the_same_tokens(tmp_path: Path, dask_scheduler: str) -> None:
    source = _corpus(tmp_path / "data")
    lakes = {backend: _lake_config(tmp_path, source, backend) for backend in ("hf", "fastokens")}
    for config in lakes.values():
        report = build(config, scheduler=dask_scheduler, progress=False)
        assert report.chunks_built > 3
    assert lake_documents(lakes["fastokens"], "d") == lake_documents(lakes["hf"], "d")
    assert_batches_equal(global_batches(lakes["fastokens"], 2, range(4)), global_batches(lakes["hf"], 2, range(4)))
    fast_fp, fast_encoder, fast_builds = _recorded(lakes["fastokens"])
    hf_fp, hf_encoder, hf_builds = _recorded(lakes["hf"])
    assert (fast_encoder, fast_builds) == (f"fastokens {fastokens_version()}", [fast_encoder])
    assert (hf_encoder, hf_builds) == (encoder_name("hf"), [hf_encoder])
    assert fast_fp != hf_fp   # two encoders' ids never share a dataset plan


def fastokens_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("fastokens")


def test_changed_backend_is_a_new_plan_and_old_catalogs_gain_the_columns(tmp_path: Path, dask_scheduler: str) -> None:
    source = _corpus(tmp_path / "data")
    config = _lake_config(tmp_path, source, "auto")
    build(config, scheduler=dask_scheduler, progress=False)
    first_fp, first_encoder, _ = _recorded(config)
    assert first_encoder == encoder_name("fastokens")
    with duckdb.connect(str(open_lake(config).writer_catalog_path)) as con:   # a catalog from before the encoder
        con.execute("ALTER TABLE dataset_plans DROP COLUMN encoder")
        con.execute("ALTER TABLE builds DROP COLUMN encoder")
    raw = yaml.safe_load(config.read_text())
    config.write_text(yaml.safe_dump({**raw, "tokenizer_backend": "hf"}))
    report = build(config, scheduler=dask_scheduler, progress=False)
    assert report.chunks_built == report.chunks_total   # re-tokenized, not mixed with the fastokens chunks
    fp, encoder, builds = _recorded(config)
    assert fp != first_fp and encoder == encoder_name("hf")
    assert builds == ["", encoder]


def test_plan_fingerprint_and_chunk_folder_name_the_encoder(tmp_path: Path) -> None:
    source = _corpus(tmp_path / "data")
    config = load_config(_lake_config(tmp_path, source, "auto"))
    plans = [plan_dataset("d", config, "tok", encoder=name) for name in ("fastokens 0.3.5", "tokenizers 0.23.3")]
    assert plans[0].fingerprint != plans[1].fingerprint and plans[0].chunk_dir != plans[1].chunk_dir
    assert [p.encoder for p in plans] == ["fastokens 0.3.5", "tokenizers 0.23.3"]


def test_auto_falls_back_to_hf_with_one_log_line(tmp_path: Path, dask_scheduler: str,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    wordpiece = _wordpiece(tmp_path)
    config = _lake_config(tmp_path, _corpus(tmp_path / "data"), "auto", tokenizer=wordpiece)
    with caplog.at_level(logging.INFO, logger="lakeloader"):
        build(config, scheduler=dask_scheduler, progress=False)
    lines = [r.getMessage() for r in caplog.records if "tokenizer_backend" in r.getMessage()]
    assert len(lines) == 1 and "not fastokens" in lines[0] and "cannot load this tokenizer" in lines[0], lines
    assert _recorded(config)[1] == encoder_name("hf")
    tokenizer = Tokenizer.from_file(str(wordpiece))
    assert lake_documents(config, "d")[:20] == _reference(tokenizer, [
        json.loads(line)["text"] for line in (tmp_path / "data" / "a.jsonl").read_text().splitlines()[:20]])


def test_explicit_fastokens_that_cannot_load_is_a_config_error(tmp_path: Path) -> None:
    config = _lake_config(tmp_path, _corpus(tmp_path / "data"), "fastokens", tokenizer=_wordpiece(tmp_path))
    with pytest.raises(ConfigError, match=r"tokenizer_backend: fastokens cannot be used .*wordpiece\.json.*"
                                          r"unsupported .*set tokenizer_backend: auto"):
        build(config, workers=1, progress=False)


def test_unknown_backend_names_the_key(tmp_path: Path) -> None:
    config = _lake_config(tmp_path, _corpus(tmp_path / "data"), "gigatoken")
    with pytest.raises(ConfigError, match="tokenizer_backend"):
        load_config(config)


def _off_by_one_merge(tokenizer: Tokenizer, text: str | None = None) -> object:
    """fastokens loaded from ``tokenizer`` without its first merge: a fast encoder that is wrong."""
    data = json.loads(tokenizer.to_str())
    data["model"]["merges"] = data["model"]["merges"][1:]
    return fastokens.Tokenizer.from_json_str(json.dumps(data))


def test_a_fast_encoder_that_disagrees_fails_the_self_check(monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    tokenizer = _demo()
    tokenizer.add_tokens(["<|self-check|>"])   # a tokenizer not checked yet in this process
    monkeypatch.setattr(tokenizer_module, "_fast_tokenizer", _off_by_one_merge)
    with pytest.raises(ConfigError, match=r"tokenizer_backend: fastokens .* disagrees with tokenizers .* "
                                          r"self-check sample ."):
        resolve_backend(tokenizer, "fastokens", "demo+1")
    with caplog.at_level(logging.INFO, logger="lakeloader"):
        assert resolve_backend(tokenizer, "auto", "demo+1") == "hf"
    assert sum("disagrees" in r.getMessage() for r in caplog.records) == 1


def test_workers_check_a_document_of_every_chunk(tmp_path: Path) -> None:
    tokenizer = _demo()
    fast = _fast(tokenizer)
    fast._fast = _off_by_one_merge(tokenizer)   # the one attribute patched: a wrong fast encoder
    with pytest.raises(EncoderMismatchError, match=r"gave other ids than tokenizers .* text 1 of the batch "
                                                   r".*tokenizer_backend: hf"):
        fast.encode(["x", "     spaces     and more spaces " * 20, "y" * (tokenizer_module.VERIFY_SAMPLE_CHARS + 1)])


def test_a_worker_with_another_encoder_version_refuses(tmp_path: Path) -> None:
    with pytest.raises(EncoderMismatchError, match=r"has fastokens .* planned with fastokens 0\.0\.1.*"
                                                   r"fastokens==0\.0\.1"):
        _encoder(str(DEMO_TOKENIZER), "{}", "fastokens 0.0.1")
    assert _encoder(str(DEMO_TOKENIZER), "{}", encoder_name("fastokens")).backend == "fastokens"
    assert _encoder(str(DEMO_TOKENIZER), "{}", "").backend == "hf"
