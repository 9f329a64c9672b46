"""Instant start: a loader learns its special tokens' ids from the tokenizer JSON's
``added_tokens`` without building the tokenizer (the same ids as the tokenizer gives), and builds
it only when text must be encoded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from lakeloader.feed.loader import Loader
from lakeloader.ingest.driver import build
from lakeloader.tokenizer import LazyTokenizer, added_tokens

from conftest import DEMO_TOKENIZER, stdlib_texts, write_config, write_jsonl


def test_added_tokens_match_the_tokenizer() -> None:
    text = Path(DEMO_TOKENIZER).read_text()
    found = added_tokens(text)
    full = Tokenizer.from_file(str(DEMO_TOKENIZER))
    assert found and len(found) == len(json.loads(text)["added_tokens"])
    assert all(full.token_to_id(token) == number for token, number in found.items())
    lazy = LazyTokenizer(found, lambda: full)
    assert lazy.token_to_id("<|endoftext|>") == full.token_to_id("<|endoftext|>")
    assert "full" not in lazy.__dict__          # answered without the full tokenizer
    assert lazy.token_to_id("the") == full.token_to_id("the")   # a vocabulary token: the full one
    assert lazy.get_vocab_size(with_added_tokens=True) == full.get_vocab_size(with_added_tokens=True)


@pytest.mark.parametrize("head", [
    '{"model": {"added_tokens": [{"id": 1, "content": "x"}]}}',                # not a top-level key
    '{"version": "1.0", "added_tokens": [{"id": 0, "content": "<a>"',          # cut short
    '{"version": "1.0"}',                                                      # none
])
def test_added_tokens_none_unless_certain(head: str) -> None:
    assert added_tokens(head) is None


def test_loader_opens_without_building_the_tokenizer(tmp_path: Path, dask_scheduler: str) -> None:
    write_jsonl(tmp_path / "data" / "a.jsonl", stdlib_texts("json"))
    config = write_config(tmp_path, {"d": {"sources": [str(tmp_path / "data" / "a.jsonl")]}},
                          build={"split_size": "8KB"}, loader={"seq_len": 32, "batch_size": 16, "shuffle": "full"})
    build(config, scheduler=dask_scheduler, progress=False)
    with Loader(config) as loader:
        lookups: list[list[int]] = []
        row_groups_of = loader.view.row_groups_of
        loader.view.row_groups_of = (  # type: ignore[method-assign]
            lambda name, wanted, *args: lookups.append(wanted) or row_groups_of(name, wanted, *args))
        batch = loader.batch(5)
        chunks = {p.chunk for e in loader.examples(5).examples for p in e.pieces}
        assert len(chunks) > 2 and batch["input_ids"].shape == (16, 32)
        # the row groups of every chunk the batch needs come from one catalog lookup
        assert len(lookups) == 1 and chunks <= set(lookups[0]), lookups
        assert "full" not in loader.tokenizer.__dict__
        eos = Tokenizer.from_file(str(DEMO_TOKENIZER)).token_to_id("<|endoftext|>")
        assert loader.pad_id == eos and loader.templates["d"].doc_suffix.tolist() == [eos]
        assert loader.vocab_size == Tokenizer.from_file(str(DEMO_TOKENIZER)).get_vocab_size(with_added_tokens=True)
