"""The formats demo (lakeloader.demo.formats, configs/formats.yaml) on a fresh demo corpus."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
import yaml

from lakeloader.catalog.lake import open_lake
from lakeloader.config import load_config
from lakeloader.demo.corpus import corpus_stats, prepare_corpus
from lakeloader.demo.formats import main, prepare_formats, summarize
from lakeloader.ingest.driver import build

from conftest import DEMO_TOKENIZER, REPO

FORMATS_CONFIG = REPO / "configs" / "formats.yaml"


def _records(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


@pytest.fixture(scope="module")
def formats_lake(tmp_path_factory: pytest.TempPathFactory,
                 dask_scheduler: str) -> tuple[Path, Path, dict[str, list[Path]]]:
    """configs/formats.yaml pointed at a demo corpus and a lake in a tmp folder, built."""
    tmp = tmp_path_factory.mktemp("demo_formats")
    data = tmp / "data"
    prepare_corpus(data, "demo")
    files = prepare_formats(data)
    raw = yaml.safe_load(FORMATS_CONFIG.read_text(encoding="utf-8"))
    raw.update(lake=str(tmp / "lake"), tokenizer=str(DEMO_TOKENIZER))
    for spec in raw["datasets"].values():
        spec["sources"] = [source.replace("../demo/data", str(data)) for source in spec["sources"]]
    config = tmp / "formats.yaml"
    config.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    build(config, scheduler=dask_scheduler, progress=False)
    return config, data, files


def test_corpora_shapes_and_idempotent_prepare(formats_lake: tuple[Path, Path, dict[str, list[Path]]]) -> None:
    _, data, files = formats_lake
    assert sorted(files) == ["chat", "code", "pages", "sft"]
    assert files["code"] == sorted((data / "code").glob("*.jsonl*"))   # FIM reuses the demo's files
    chats, sft, pages = (_records(files[name][0]) for name in ("chat", "sft", "pages"))
    assert all(200 <= len(records) <= 500 for records in (chats, sft, pages))
    roles = [[m["role"] for m in c["messages"]] for c in chats]
    assert all(r[-2:] == ["user", "assistant"] and set(r) <= {"system", "user", "assistant"} for r in roles)
    assert any(r[0] == "system" for r in roles) and any(r.count("assistant") > 1 for r in roles)
    assert all(m["content"].strip() for c in chats for m in c["messages"])
    assert all(s["prompt"].startswith("Write the docstring of `") and s["response"].strip() for s in sft)
    refs = [item["image"] for page in pages for item in page["items"] if "image" in item]
    assert len(refs) == len(set(refs)) and all(ref.startswith("demo-image://") for ref in refs)
    counts = [sum("image" in item for item in page["items"]) for page in pages]
    assert set(counts) == {1, 2, 3, 4}
    assert all(any(item.get("text", "").strip() for item in page["items"]) for page in pages)
    # Deterministic and idempotent: the same bytes again, so nothing is rewritten.
    stamps = {p: (p.stat().st_mtime_ns, p.read_bytes()) for name in ("chat", "sft", "pages") for p in files[name]}
    assert prepare_formats(data) == files
    assert all((p.stat().st_mtime_ns, p.read_bytes()) == stamp for p, stamp in stamps.items())


def test_every_record_became_a_document(formats_lake: tuple[Path, Path, dict[str, list[Path]]]) -> None:
    config, data, files = formats_lake
    frame = open_lake(config).sql(
        "SELECT name, format, status, num_docs, num_rejects FROM datasets ORDER BY name").set_index("name")
    stats = corpus_stats(data)
    expected = {name: len(_records(files[name][0])) for name in ("chat", "sft", "pages")}
    expected.update(code=stats["code"]["docs"], web=stats["docs"]["docs"])
    assert frame["num_docs"].to_dict() == expected
    assert frame["format"].to_dict() == {"chat": "chat", "code": "fim", "pages": "interleaved",
                                         "sft": "supervised", "web": "text"}
    assert (frame["status"] == "complete").all() and (frame["num_rejects"] == 0).all()


def test_show_figures_and_output(formats_lake: tuple[Path, Path, dict[str, list[Path]]],
                                 capsys: pytest.CaptureFixture[str]) -> None:
    config = formats_lake[0]
    summary = summarize(config)
    assert 0 <= summary.padding_fraction < 0.5 and summary.tokens_per_s > 0
    audit = summary.audit.set_index("dataset")
    weights = load_config(config).mixture.weights
    assert sorted(audit.index) == sorted(weights) and audit["weight"].sum() == pytest.approx(1.0)
    assert (audit["token_share"] - audit["weight"]).abs().max() < 0.02       # unit: tokens
    assert (audit["share"] - audit["weight"]).abs().max() > 0.005            # examples differ in size
    chat, code = summary.examples["chat"], summary.examples["code"]
    assert chat.startswith("<|im_start|>") and "<|im_start|>assistant⏎[[" in chat and "<|im_end|>⏎]]" in chat
    assert "[[<|im_start|>" not in chat                                      # prompts are not trained
    assert code.startswith("<|fim_prefix|>[[") and "<|fim_middle|>" in code and "<|fim_suffix|>" in code

    assert main(["show", str(config)]) == 0
    out = capsys.readouterr().out
    for heading in ("== datasets ==", "== mixture audit", "padding fraction", "== a chat example", "== a code example"):
        assert heading in out
