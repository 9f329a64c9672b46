"""Task formats end to end: one lake with a dataset of every format, mixed, under every packing
mode; loss masks checked by decoding; templates changed without re-tokenizing."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from tokenizers import Tokenizer

from lakeloader.catalog.lake import open_lake
from lakeloader.contracts.errors import ConfigError
from lakeloader.feed.loader import Loader
from lakeloader.ingest.driver import build

from conftest import DEMO_TOKENIZER, assert_batches_equal, global_batches, lake_documents, stdlib_texts, write_config

SEQ_LEN, BATCH = 128, 8
TOKENIZER = Tokenizer.from_file(str(DEMO_TOKENIZER))


def _paragraphs() -> list[str]:
    texts = stdlib_texts("json") + stdlib_texts("email", limit=12)
    return [p.strip() for t in texts for p in t.split("\n\n") if 20 < len(p.strip()) < 600]


def _write(path: Path, records: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def write_corpora(data: Path) -> dict[str, dict[str, Any]]:
    """Real text shaped into each format; returns the datasets section of a config."""
    paragraphs = _paragraphs()
    chats = []
    for i in range(0, 240, 3):
        messages = [{"role": "user", "content": paragraphs[i][:80]},
                    {"role": "assistant", "content": paragraphs[i + 1]}]
        if i % 2:
            messages = [{"role": "system", "content": "Answer briefly."}, *messages,
                        {"role": "user", "content": paragraphs[i + 2][:60]}]
        chats.append({"messages": messages})
    _write(data / "chat.jsonl", chats)
    _write(data / "sft.jsonl", [{"prompt": paragraphs[i][:100], "response": paragraphs[i + 1]}
                                for i in range(0, 200, 2)])
    _write(data / "code.jsonl", [{"text": t} for t in stdlib_texts("json")] +
           [{"text": p} for p in paragraphs[:120]])
    _write(data / "web.jsonl", [{"text": p} for p in paragraphs[120:300]])
    items = []
    for i in range(0, 160, 4):
        items.append({"items": [{"text": paragraphs[i][:200]}, {"image": f"img://{i}/a"},
                                {"text": paragraphs[i + 1][:150]}, {"image": f"img://{i}/b"},
                                {"image": f"img://{i}/c"}, {"text": paragraphs[i + 2][:100]}]})
    _write(data / "pages.jsonl", items)
    return {
        "web": {"sources": [str(data / "web.jsonl")]},
        "chat": {"sources": [str(data / "chat.jsonl")], "format": "chat"},
        "sft": {"sources": [str(data / "sft.jsonl")], "format": "supervised"},
        "code": {"sources": [str(data / "code.jsonl")], "format": "fim", "fim": {"rate": 0.5, "spm_rate": 0.5}},
        "pages": {"sources": [str(data / "pages.jsonl")], "format": "interleaved",
                  "interleaved": {"image_tokens": 4, "max_images": 2}},
    }


def build_packed_mixture(tmp: Path, names: tuple[str, ...], *, split_size: str, seq_len: int, batch_size: int,
                         scheduler: str) -> Path:
    """Build a lake of the ``names`` corpora of :func:`write_corpora`, read packed (long documents
    split) under a full shuffle in an equal mixture; returns its config."""
    corpora = write_corpora(tmp / "data")
    datasets = {name: corpora[name] for name in names}
    config = write_config(tmp, datasets, build={"split_size": split_size},
                          loader={"seq_len": seq_len, "batch_size": batch_size, "packing": "pack",
                                  "pack": {"long_documents": "split"}, "shuffle": {"kind": "full"}},
                          mixture={"weights": {name: 1 for name in datasets}})
    build(config, scheduler=scheduler, progress=False)
    return config


def write_variant(tmp: Path, datasets: dict[str, Any], *, packing: str, weights: dict[str, float] | None = None,
                  **loader: Any) -> Path:
    """A config for the shared lake (same datasets: never rebuilt) with other loader settings."""
    names = weights or {n: 1.0 for n in datasets if packing != "concat" or n != "pages"}
    path = write_config(tmp, datasets, build={"split_size": "16KB"},
                        loader={"seq_len": SEQ_LEN, "batch_size": BATCH, "packing": packing, "seed": 3, **loader},
                        mixture={"weights": names})
    return path


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory, dask_scheduler: str) -> tuple[Path, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("formats")
    datasets = write_corpora(tmp / "data")
    config = write_variant(tmp, datasets, packing="concat")
    build(config, scheduler=dask_scheduler, progress=False)
    return tmp, datasets


def variant(lake: tuple[Path, dict[str, Any]], scheduler: str, **kwargs: Any) -> Path:
    tmp, datasets = lake
    config = write_variant(tmp, datasets, **kwargs)
    report = build(config, scheduler=scheduler, progress=False)
    assert report.chunks_built == 0   # nothing is tokenized again
    return config


@pytest.mark.parametrize("packing", ["concat", "pack", "pad"])
def test_mixed_formats_same_for_any_process_count_and_every_resume(lake, dask_scheduler: str, packing: str) -> None:
    config = variant(lake, dask_scheduler, packing=packing, shuffle={"kind": "window", "window_chunks": 2})
    steps = range(0, 8)
    reference = global_batches(config, 1, steps)
    for processes in (2, 4):
        assert_batches_equal(global_batches(config, processes, steps), reference)
    with Loader(config) as loader:
        for start in steps:
            resumed = [batch for _, batch in zip(range(start, 8), loader.iter_from(loader.state(start)))]
            assert_batches_equal(resumed, reference[start:])
    batch = reference[0]
    assert batch["input_ids"].shape == (BATCH, SEQ_LEN)
    if packing != "concat":
        assert {"image_refs", "image_positions"} <= batch.keys()
        assert (batch["segment_ids"] == 0).any() or packing == "pack"
        padding = batch["segment_ids"] == 0
        assert (batch["loss_mask"][padding] == 0).all()


def _decode(ids: np.ndarray) -> str:
    return TOKENIZER.decode([int(i) for i in ids], skip_special_tokens=False)


def test_chat_loss_covers_exactly_the_assistant_turns(lake, dask_scheduler: str) -> None:
    config = variant(lake, dask_scheduler, packing="pad", weights={"chat": 1.0}, seq_len=512,
                     pack={"long_documents": "error"})
    chats = [json.loads(line)["messages"] for line in (lake[0] / "data" / "chat.jsonl").read_text().splitlines()]
    with Loader(config, mode="eval") as loader:
        rows = [(b, r) for b in loader for r in range(BATCH) if b["example_mask"][r]]
    assert len(rows) == len(chats)  # one conversation per example, each once
    seen = 0
    for batch, r in rows:
        text = _decode(batch["input_ids"][r][batch["segment_ids"][r] > 0])
        rendered = {"".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in c) + "<|endoftext|>": c
                    for c in chats}
        chat = rendered[text]
        trained = _decode(batch["targets"][r][batch["loss_mask"][r] > 0])
        expected = "".join(m["content"] + "<|im_end|>\n" for m in chat if m["role"] == "assistant")
        if chat[-1]["role"] == "assistant":
            expected += "<|endoftext|>"
        assert trained == expected
        seen += 1
    assert seen == len(chats)


def test_chat_template_and_special_tokens_change_without_rebuild(lake, dask_scheduler: str) -> None:
    template = {"user": {"prefix": "User: ", "suffix": "\n"}, "assistant": {"prefix": "<|bos|>Bot: ", "suffix": "<|sep|>"},
                "system": {"prefix": "", "suffix": "\n"}}
    tmp, datasets = lake
    datasets = {**datasets, "chat": {**datasets["chat"], "chat": {"template": template, "loss_roles": ["user"]}}}
    config = write_config(tmp, datasets, build={"split_size": "16KB"},
                          loader={"seq_len": 512, "batch_size": BATCH, "packing": "pad",
                                  "eos_token": "<|pad|>"},
                          mixture={"weights": {"chat": 1.0}})
    report = build(config, scheduler=dask_scheduler, progress=False)
    assert report.chunks_built == 0
    with Loader(config) as loader:
        batch = loader.batch(0)
    for r in range(BATCH):
        text = _decode(batch["input_ids"][r][batch["segment_ids"][r] > 0])
        assert "<|bos|>Bot: " in text and "<|im_start|>" not in text
        trained = _decode(batch["targets"][r][batch["loss_mask"][r] > 0])
        assert "Bot:" not in trained and trained.endswith("\n") or trained.endswith("<|pad|>")


def test_supervised_causal_and_seq2seq(lake, dask_scheduler: str) -> None:
    records = [json.loads(line) for line in (lake[0] / "data" / "sft.jsonl").read_text().splitlines()]
    config = variant(lake, dask_scheduler, packing="pack", weights={"sft": 1.0}, pack={"long_documents": "truncate"})
    with Loader(config, mode="eval") as loader:
        batch = next(iter(loader))
        for r in range(BATCH):
            for segment in np.unique(batch["segment_ids"][r][batch["segment_ids"][r] > 0]):
                inside = batch["segment_ids"][r] == segment
                text = _decode(batch["input_ids"][r][inside])
                record = next(x for x in records if text.startswith(x["prompt"] + "<|sep|>"))
                trained = _decode(batch["targets"][r][inside & (batch["loss_mask"][r] > 0)])
                assert (record["response"] + "<|endoftext|>").startswith(trained) and trained
    tmp, datasets = lake
    seq2seq = {"sft": {**datasets["sft"], "supervised": {"output": "seq2seq", "separator": ""}}}
    config = write_config(tmp, seq2seq, build={"split_size": "16KB"},
                          loader={"seq_len": SEQ_LEN, "batch_size": BATCH, "packing": "pad",
                                  "pack": {"long_documents": "truncate"}})
    assert build(config, scheduler=dask_scheduler, progress=False).chunks_built == 0
    with Loader(config, mode="eval") as loader:
        batch = next(iter(loader))
    for r in range(BATCH):
        prompt = _decode(batch["inputs"][r][batch["inputs_segment_ids"][r] > 0])
        record = next(x for x in records if x["prompt"] == prompt)
        response = _decode(batch["targets"][r][batch["loss_mask"][r] > 0])
        assert (record["response"] + "<|endoftext|>").startswith(response) and response
        decoder_inputs = batch["input_ids"][r][batch["segment_ids"][r] > 0]
        assert np.array_equal(decoder_inputs[1:], batch["targets"][r][batch["segment_ids"][r] > 0][:-1])


def _unfim(doc: list[int], suf: int, mid: int) -> list[int]:
    """Remove the sentinels of <PRE> P <SUF> S <MID> M (PSM) or <PRE> <SUF> S <MID> P M (SPM)."""
    s, m = doc.index(suf), doc.index(mid)
    if s == 1:   # SPM (or PSM with an empty prefix: the same reading)
        return doc[m + 1 :] + doc[s + 1 : m]
    return doc[1:s] + doc[m + 1 :] + doc[s + 1 : m]


def test_fim_reconstructs_documents_at_the_configured_rate(lake, dask_scheduler: str) -> None:
    config = variant(lake, dask_scheduler, packing="pad", weights={"code": 1.0}, pack={"long_documents": "split"})
    ids = {t: TOKENIZER.token_to_id(t) for t in ("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|endoftext|>")}
    pre, mid, suf, eos = ids.values()
    documents = lake_documents(config, "code")
    rebuilt, fim_docs = [], 0
    with Loader(config, mode="eval") as loader:
        pieces: list[int] = []
        for batch in loader:
            for r in range(BATCH):
                if not batch["example_mask"][r]:
                    continue
                pieces += batch["input_ids"][r][batch["segment_ids"][r] > 0].tolist()
                if pieces[-1] == eos:   # a document ends (long ones arrive in pieces)
                    doc = pieces[:-1]
                    if doc and doc[0] == pre:
                        fim_docs += 1
                        doc = _unfim(doc, suf, mid)
                    rebuilt.append(doc)
                    pieces = []
    assert rebuilt == documents
    rate = fim_docs / len(documents)
    assert abs(rate - 0.5) < 3 * np.sqrt(0.25 / len(documents))


def test_interleaved_images_whole_refs_aligned_and_limited(lake, dask_scheduler: str) -> None:
    config = variant(lake, dask_scheduler, packing="pack", weights={"pages": 1.0}, pack={"long_documents": "split"})
    start, image, end = (TOKENIZER.token_to_id(t) for t in ("<|image_start|>", "<|image|>", "<|image_end|>"))
    refs: list[str] = []
    with Loader(config, mode="eval") as loader:
        for batch in loader:
            for r in range(BATCH):
                ids = batch["input_ids"][r]
                starts = np.flatnonzero(ids == start)
                assert len(starts) <= 2                                    # max_images per example
                assert (batch["image_positions"][r][: len(starts)] == starts).all()
                assert (batch["image_positions"][r][len(starts):] == -1).all()
                for s in starts:                                           # never split
                    assert ids[s + 1 : s + 5].tolist() == [image] * 4 and ids[s + 5] == end
                    assert batch["loss_mask"][r][s] == 0                  # image tokens are not targets
                assert (ids == image).sum() == 4 * len(starts)
                refs += [x for x in batch["image_refs"][r] if x]
    expected = sorted(f"img://{i}/{x}" for i in range(0, 160, 4) for x in "abc")
    assert sorted(refs) == expected


def test_pack_places_every_document_once_and_reports_padding(lake, dask_scheduler: str) -> None:
    config = variant(lake, dask_scheduler, packing="pack", weights={"web": 1.0})
    documents = lake_documents(config, "web")
    eos = TOKENIZER.token_to_id("<|endoftext|>")
    placed: dict[tuple[int, int], list[tuple[int, int, list[int]]]] = {}
    tokens = slots = 0
    with Loader(config, mode="eval") as loader:
        for step in range(loader.num_batches()):
            batch = loader.batch(step)
            for row in loader.explain(step).dropna(subset=["dataset"]).itertuples():
                r, a, b = int(row.row), int(row.example_start), int(row.example_stop)
                placed.setdefault((int(row.chunk), int(row.document)), []).append(
                    (int(row.document_start), int(row.document_stop), batch["input_ids"][r][a:b].tolist()))
            tokens += int((batch["segment_ids"] > 0).sum())
            slots += int(batch["example_mask"].sum()) * SEQ_LEN
    # Every document once: its pieces tile it exactly, and carry its tokens.
    rendered = [d + [eos] for d in documents]
    found = []
    for key in sorted(placed):
        pieces = sorted(placed[key])
        assert [a for a, _, _ in pieces] == [0] + [b for _, b, _ in pieces[:-1]]
        found.append([t for _, _, piece in pieces for t in piece])
    assert found == rendered
    assert any(len(p) > 1 for p in placed.values())    # some documents are longer than seq_len
    with Loader(config) as loader:
        plan_key = loader.datasets[0].plan_key
    stats = open_lake(config).sql("SELECT * FROM packing WHERE dataset = 'web' AND plan_key = ?", [plan_key])
    assert int(stats["tokens"][0]) == tokens and int(stats["examples"][0]) * SEQ_LEN == slots
    assert int(stats["split_docs"][0]) == sum(len(p) > 1 for p in placed.values())
    assert stats["padding_fraction"][0] == pytest.approx(1 - tokens / slots)
    assert 0 <= 1 - tokens / slots < 0.2


def test_token_weighted_mixture_and_audit(lake, dask_scheduler: str) -> None:
    from lakeloader.catalog.audit import audit

    config = variant(lake, dask_scheduler, packing="pad", weights={"web": 1.0, "chat": 1.0})
    raw = yaml.safe_load(config.read_text())
    raw["mixture"]["unit"] = "tokens"
    config.write_text(yaml.safe_dump(raw))
    build(config, scheduler=dask_scheduler, progress=False)
    frame = audit(config, 0, 200).set_index("dataset")
    assert frame["token_share"].between(0.45, 0.55).all()
    assert abs(frame.loc["web", "share"] - frame.loc["chat", "share"]) > 0.05  # example shares differ


def test_bad_combinations_are_config_errors(lake, dask_scheduler: str) -> None:
    tmp, datasets = lake
    config = write_variant(tmp, datasets, packing="concat", weights={"pages": 1.0})
    with pytest.raises(ConfigError, match="interleaved.*pack or pad"):
        Loader(config)
    config = write_variant(tmp, datasets, packing="pack", weights={"web": 1.0}, ordering="strided")
    with pytest.raises(ConfigError, match="strided"):
        Loader(config)
    config = write_variant(tmp, datasets, packing="pack", weights={"web": 1.0}, seq_len=64)
    with pytest.raises(Exception, match=re.escape("lakeloader build CONFIG")):
        Loader(config)   # a packing plan no build has counted yet


def test_jax_feed_carries_task_fields(lake, dask_scheduler: str) -> None:
    import jax
    from jax.sharding import Mesh, PartitionSpec

    from lakeloader.feed.jax import JaxFeed

    config = variant(lake, dask_scheduler, packing="pack", weights={"pages": 1.0, "chat": 1.0})
    devices = np.array(jax.devices())
    mesh = Mesh(devices.reshape(-1, 2) if len(devices) % 2 == 0 else devices.reshape(-1, 1), ("data", "model"))
    with JaxFeed(config, mesh, PartitionSpec("data", "model")) as feed, Loader(config) as loader:
        device_batch, host_batch = feed.batch(3), loader.batch(3)
    assert isinstance(device_batch["image_refs"], np.ndarray)            # strings stay on the host
    assert np.array_equal(device_batch["image_refs"], host_batch["image_refs"])
    for key in ("input_ids", "loss_mask", "segment_ids", "image_positions"):
        assert isinstance(device_batch[key], jax.Array)
        assert np.array_equal(np.asarray(device_batch[key]), host_batch[key]), key
