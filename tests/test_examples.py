"""Unit tests of one dataset's example stream on a real lake (its order and its locators).

The order's vectorized ``train_examples(js)`` equals ``train_example(j)`` one position at a time
under every shuffle kind (and the stream's examples located together equal those located one
at a time, under both orderings), on a complete lake and on a catalog that grows while a build
runs; an evaluation pass covers every example (concat: every stream target; pack: every stored
document token) exactly once.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from lakeloader.feed.loader import Loader
from lakeloader.feed.locate_packed import PackedLocator
from lakeloader.feed.stream import DatasetStream, ExampleStream

from conftest import Lakes, small_lake_request, start_build_thread, stdlib_texts, write_config, write_jsonl

SEQ_LEN = 32
SHUFFLES = {
    "none": {"kind": "none"},
    "window": {"kind": "window", "window_chunks": 2},
    "block": {"kind": "block", "block_size": 8, "window_blocks": 3},
    "full": {"kind": "full"},
}


@pytest.fixture(scope="module")
def lake_config(lakes: Lakes) -> Path:
    """A shared lake of one dataset ``d`` whose build also registered the ``pack`` plan
    (never changed: tests read it through their own configs)."""
    spec = small_lake_request(loader={"seq_len": SEQ_LEN, "packing": "pack"})
    return lakes.shared(spec.pop("corpus"), spec.pop("datasets"), **spec)


def reader_config(lake_config: Path, tmp_path: Path, **loader: Any) -> Path:
    """A config reading the shared lake with these loader settings."""
    config = yaml.safe_load(lake_config.read_text())
    config["loader"] = {"seq_len": SEQ_LEN, "batch_size": 8, "prefetch": 0, "seed": 3, **loader}
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "reader.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def examples_of(config: Path, mode: str = "train") -> ExampleStream:
    loader = Loader(config, mode=mode)
    (examples,) = loader.datasets
    return examples


def stream_of(config: Path, mode: str = "train") -> DatasetStream:
    """The example stream of the config's one dataset, in the global ordering."""
    examples = examples_of(config, mode)
    assert isinstance(examples, DatasetStream)
    return examples


def random_positions(per_epoch: int, seed: int) -> np.ndarray:
    """Positions over a few epochs, far ones and repeats, in no order."""
    rng = np.random.default_rng(seed)
    return np.concatenate([rng.integers(0, 3 * per_epoch, 150), rng.integers(0, 10**9, 20), [0, 0, per_epoch - 1]])


def example_content(span: Any) -> tuple[Any, ...]:
    """What a span or packed example holds: provenance and every token."""
    if hasattr(span, "pieces"):
        parts = [(p.chunk, p.start, p.tokens.tolist(), p.docs.tolist()) for p in span.pieces]
    else:
        parts = [(i.chunk, i.doc, i.start, i.stop, i.tokens.tolist()) for i in span.items]
    return span.dataset, span.epoch, span.example, parts


@pytest.mark.parametrize("packing", ["concat", "pack"])
@pytest.mark.parametrize("shuffle", list(SHUFFLES))
def test_train_examples_equal_one_at_a_time(lake_config: Path, tmp_path: Path, packing: str, shuffle: str) -> None:
    examples = stream_of(reader_config(lake_config, tmp_path, packing=packing, shuffle=SHUFFLES[shuffle]))
    assert isinstance(examples.locator, PackedLocator) == (packing == "pack")
    per_epoch = examples.train_count()
    assert per_epoch > 20
    js = random_positions(per_epoch, seed=len(shuffle))
    epochs, ks = examples.order.train_examples(js)
    assert epochs.dtype == ks.dtype == np.int64
    assert list(zip(epochs.tolist(), ks.tolist())) == [examples.order.train_example(int(j)) for j in js]
    assert np.array_equal(epochs, js // per_epoch)
    # Each epoch is a permutation of the dataset's examples.
    whole = np.arange(2 * per_epoch)
    epochs, ks = examples.order.train_examples(whole)
    for epoch in (0, 1):
        assert sorted(ks[epochs == epoch].tolist()) == list(range(per_epoch))
    if shuffle == "none":
        assert np.array_equal(ks, whole % per_epoch)
    some = js[:12]
    assert [example_content(w) for w in examples.train(some)] == \
        [example_content(examples.train(np.array([int(j)]))[0]) for j in some]


def test_strided_spans_equal_one_at_a_time(lake_config: Path, tmp_path: Path) -> None:
    examples = examples_of(reader_config(lake_config, tmp_path, ordering="strided", ideal_readers=3))
    js = random_positions(examples.train_count(), seed=1)[:60]
    assert [example_content(w) for w in examples.train(js)] == \
        [example_content(examples.train(np.array([int(j)]))[0]) for j in js]


def test_concat_eval_pass_covers_every_target_once(lake_config: Path, tmp_path: Path) -> None:
    examples = stream_of(reader_config(lake_config, tmp_path, shuffle=SHUFFLES["full"]), mode="eval")
    count = examples.eval_count()
    total = int(examples.locator.stream_offsets()[-1])
    stream = np.concatenate([p.tokens for p in examples.reader.span(examples.chunks, np.arange(examples.chunks.committed),
                                                                      examples.locator.stream_offsets(), 0, total)])
    assert len(stream) == total
    spans = [examples.eval(np.array([j]))[0] for j in range(count)]
    # Span j holds stream tokens [jL, jL+L] (clipped): every target 1..total-1 exactly once.
    targets = np.concatenate([np.concatenate([p.tokens for p in w.pieces])[1:] for w in spans])
    assert np.array_equal(targets, stream[1:])
    for j, span in enumerate(spans):
        assert (span.epoch, span.example) == (0, j)
        assert np.array_equal(np.concatenate([p.tokens for p in span.pieces]), stream[j * SEQ_LEN : (j + 1) * SEQ_LEN + 1])
    assert count == -(-(total - 1) // SEQ_LEN)


def test_packed_eval_pass_covers_every_document_once(lake_config: Path, tmp_path: Path) -> None:
    examples = stream_of(reader_config(lake_config, tmp_path, packing="pack"), mode="eval")
    assert isinstance(examples.locator, PackedLocator)
    count = examples.eval_count()
    assert count == examples.train_count()
    pieces: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for j in range(count):
        example = examples.eval(np.array([j]))[0]
        assert (example.epoch, example.example) == (0, j) and example.items
        for item in example.items:
            pieces.setdefault((item.chunk, item.doc), []).append((item.start, item.stop))
    lengths = examples.reader.chunk_lengths(examples.chunks)
    for chunk in range(examples.chunks.committed):
        docs = sorted(doc for c, doc in pieces if c == chunk)
        assert docs == list(range(len(docs))), f"chunk {chunk}: documents missing"
        covered = 0
        for doc in docs:
            spans = sorted(pieces[chunk, doc])
            assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:])), (chunk, doc, spans)
            covered += spans[-1][1]
        assert covered == lengths[chunk], f"chunk {chunk}: {covered} of {lengths[chunk]} tokens"


def test_train_examples_while_the_catalog_grows(tmp_path: Path) -> None:
    """Positions asked while chunks are still being committed get the examples they get once
    the dataset is complete, one at a time or vectorized (unshuffled and window-shuffled)."""
    write_jsonl(tmp_path / "d.jsonl", stdlib_texts("json") + stdlib_texts("email", limit=4))
    config = write_config(tmp_path, {"d": {"sources": [str(tmp_path / "d.jsonl")]}}, build={"split_size": "8KB"},
                          loader={"seq_len": SEQ_LEN, "batch_size": 8, "prefetch": 0, "wait_timeout": 120})
    configs = {kind: reader_config(config, tmp_path / kind, shuffle=SHUFFLES[kind], wait_timeout=120)
               for kind in ("none", "window")}
    builder, _, errors = start_build_thread(config, workers=1, progress=False)
    during: dict[str, DatasetStream] = {}
    while len(during) < len(configs) and builder.is_alive():
        try:
            during = {kind: stream_of(path) for kind, path in configs.items()}
        except Exception:  # nothing committed yet
            time.sleep(0.01)
    assert during, "the build finished before a reader could start"
    asked: list[tuple[str, np.ndarray, tuple[np.ndarray, np.ndarray], bool]] = []
    rng = np.random.default_rng(0)
    for round_ in range(4):
        for kind, examples in during.items():
            js = rng.integers(0, 30 * (round_ + 1), 10)
            growing = not examples.chunks.complete
            asked.append((kind, js, examples.order.train_examples(js), growing))
            assert [examples.order.train_example(int(j)) for j in js] == list(zip(*(a.tolist() for a in asked[-1][2])))
    builder.join()
    assert not errors, errors
    assert all(growing for _, _, _, growing in asked[:2]), "no position was asked while the catalog was growing"
    after = {kind: stream_of(path) for kind, path in configs.items()}
    for kind, js, (epochs, ks), _ in asked:
        want_epochs, want_ks = after[kind].order.train_examples(js)
        assert np.array_equal(epochs, want_epochs) and np.array_equal(ks, want_ks), (kind, js)
