"""Arbitrary infilling (``format: infill``): the seeded gaps, the rendered layout against a plain
reference renderer (general and compact renders, and the lengths known without tokens), the
config, and end to end on a small real-text lake (layout and loss of every row, any process
count, resume)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

import lakeloader.index.render as render_module
from lakeloader.catalog.lake import open_lake
from lakeloader.config import load_config
from lakeloader.contracts.errors import ConfigError
from lakeloader.contracts.specs import Infill, Template, make_template
from lakeloader.feed.loader import Loader
from lakeloader.index.ranges import cumulative
from lakeloader.index.render import (
    added_tokens, chunk_added, chunk_doc_added, doc_lengths, infill_choice, infill_gaps, render, render_compact,
    rendered_doc_starts, stream_lengths,
)
from lakeloader.ingest.driver import build
from lakeloader.specs import template_for

from conftest import DEMO_TOKENIZER, assert_batches_equal, global_batches, stdlib_texts, write_config
from test_render_compact import TOKEN_DTYPES, assert_same, narrowed

EOS, BOS, MASK, SEP, START, END, CLS = 0, 1, 90, 91, 92, 93, 94


def reference(infill: Infill, bos: int | None, eos: int, doc: list[int],
              gaps: list[tuple[int, int]]) -> tuple[list[int], list[bool]]:
    """One document rendered by hand (tokens, whether each is a target): plain text when it has
    no gaps, else ``BOS [CLS] text MASK text ... [SEP]`` then per gap ``[CLS] [START] content
    END``, then EOS; the targets are the gaps' contents, their END tokens and EOS."""
    tokens: list[int] = []
    trains: list[bool] = []

    def put(ids: list[int], flag: bool) -> None:
        tokens.extend(ids)
        trains.extend([flag] * len(ids))

    def optional(token: int | None) -> list[int]:
        return [] if token is None else [token]

    put(optional(bos), not gaps)
    if not gaps:
        put(doc, True)
    else:
        put(optional(infill.cls) if not infill.cls_each else [], False)
        at = 0
        for start, size in gaps:
            put(doc[at:start], False)
            put([infill.mask], False)
            at = start + size
        put(doc[at:], False)
        put(optional(infill.sep), False)
        for start, size in gaps:
            put(optional(infill.cls) if infill.cls_each else [], False)
            put(optional(infill.start), False)
            put(doc[start : start + size], True)
            put([infill.end], True)
    put([eos], True)
    return tokens, trains


def drawn_gaps(choice: tuple[np.ndarray, ...], d: int) -> list[tuple[int, int]]:
    """Document ``d``'s gaps of ``choice``, as (start, size) pairs."""
    gaps, start, size = choice
    return [(int(start[d, j]), int(size[d, j])) for j in range(int(gaps[d]))]


def _spans(low_max: int, high_max: int) -> st.SearchStrategy[tuple[int, int]]:
    return st.tuples(st.integers(1, low_max), st.integers(0, high_max)).map(lambda p: (p[0], p[0] + p[1]))


@st.composite
def infills(draw: st.DrawFn) -> Infill:
    """A random gap policy and special tokens (each optional one present or not)."""
    token = st.none() | st.sampled_from([SEP, START, CLS, 70_000])
    return Infill(rate=draw(st.sampled_from([0.0, 0.3, 1.0])), gaps=draw(_spans(4, 3)), gap_tokens=draw(_spans(8, 12)),
                  mask=draw(st.sampled_from([MASK, 70_001])), sep=draw(token), start=draw(token), end=END,
                  cls=draw(token), cls_each=draw(st.booleans()), key=draw(st.integers(0, 2**40)))


def _template(infill: Infill, bos: int | None) -> Template:
    return make_template(("text",), bos=bos, eos=EOS, infill=infill)


# -- the gaps ---------------------------------------------------------------------------------------

@given(infills(), st.lists(st.integers(0, 80), min_size=1, max_size=40), st.integers(0, 10_000))
@settings(max_examples=200, deadline=None)
def test_gaps_are_in_the_policy_in_order_and_never_overlap(infill: Infill, lengths: list[int], chunk: int) -> None:
    n = len(lengths)
    choice = infill_choice(infill, chunk, n, np.arange(n), np.array(lengths))
    low, high = infill.gaps
    for d, length in enumerate(lengths):
        gaps = drawn_gaps(choice, d)
        assert not gaps or low <= len(gaps) <= high
        cap = length // max(len(gaps), 1)
        at = 0
        for start, size in gaps:
            assert min(infill.gap_tokens[0], cap) <= size <= min(infill.gap_tokens[1], cap)
            assert at <= start and start + size <= length
            at = start + size
        # past the document's gaps: its length and 0
        assert (choice[1][d, len(gaps):] == length).all() and (choice[2][d, len(gaps):] == 0).all()
    # Which documents and how many gaps do not depend on the lengths, nor on the other documents asked.
    assert np.array_equal(choice[0], infill_gaps(infill, chunk, n, np.arange(n)))
    some = np.arange(n)[n // 3 : n // 3 + 5]
    again = infill_choice(infill, chunk, n, some, np.array(lengths)[some])
    for a, b in zip(again, choice):
        assert np.array_equal(a, b[some])


def test_gap_counts_go_evenly_over_the_range_and_the_rate_holds() -> None:
    infill = Infill(rate=0.4, gaps=(1, 4), gap_tokens=(2, 6), mask=MASK, sep=SEP, start=None, end=END, cls=None,
                    cls_each=False, key=11)
    template = _template(infill, None)
    for chunk, docs in enumerate([1, 7, 100, 999]):
        gaps = infill_gaps(infill, chunk, docs, np.arange(docs))
        counts = np.bincount(gaps[gaps > 0], minlength=5)[1:]
        assert counts.max() - counts.min() <= 1                   # each count as many documents, within one
        assert abs((gaps > 0).sum() - 0.4 * docs) < 1
        # The tokens it adds: per document, and per chunk in closed form.
        per_doc = chunk_doc_added(template, chunk, docs)
        assert per_doc.tolist() == [(1 + 2 * g) if g else 0 for g in gaps.tolist()]
        assert chunk_added(template, np.array([chunk]), np.array([docs])).tolist() == [per_doc.sum()]
    many = chunk_added(template, np.arange(5000), np.full(5000, 7))
    assert many.tolist() == [chunk_doc_added(template, c, 7).sum() for c in range(5000)]


# -- the layout -------------------------------------------------------------------------------------

@st.composite
def cases(draw: st.DrawFn) -> dict[str, Any]:
    """Documents of one text part, a random policy and tokens, in a random stored dtype."""
    dtype = np.dtype(draw(st.sampled_from(TOKEN_DTYPES)))
    infill = draw(infills())
    bos = draw(st.none() | st.just(BOS))
    lengths = np.array(draw(st.lists(st.integers(0, 60), max_size=12)), np.int64)
    top = int(np.iinfo(dtype).max) if dtype.itemsize < 4 else 100_000
    values = np.array(draw(st.lists(st.integers(0, min(top, 2**31 - 1)), min_size=int(lengths.sum()),
                                    max_size=int(lengths.sum()))), dtype)
    chunk, n = draw(st.integers(0, 1000)), len(lengths)
    choice = infill_choice(infill, chunk, n, np.arange(n), lengths)
    return dict(template=_template(infill, bos), values=values, lengths=lengths, kinds=np.zeros(n, np.int64),
                part_doc=np.arange(n), num_docs=n, fim=choice, chunk=chunk)


@given(cases(), st.sampled_from([0, 10**9]))
@settings(max_examples=400, deadline=None)
def test_renders_are_the_reference_and_lengths_need_no_tokens(case: dict[str, Any], per_part_copy: int) -> None:
    template, values, lengths, choice, n = (case[k] for k in ("template", "values", "lengths", "fim", "num_docs"))
    tokens: list[int] = []
    trains: list[bool] = []
    starts = [0]
    for d, at in enumerate(cumulative(lengths)[:-1].tolist()):
        doc = values[at : at + lengths[d]].tolist()
        one, flags = reference(template.infill, None if not len(template.doc_prefix) else BOS, EOS, doc,
                               drawn_gaps(choice, d))
        tokens += one
        trains += flags
        starts.append(len(tokens))
    args = [case[k] for k in ("template", "values", "lengths", "kinds", "part_doc", "num_docs", "fim")]
    if n:   # (the general render needs some part)
        rendered = render(*args)
        assert rendered.tokens.tolist() == tokens and rendered.trainable.tolist() == trains
        assert rendered.doc_starts.tolist() == starts
        with mock.patch.object(render_module, "TOKENS_PER_PART_COPY", per_part_copy):
            assert_same(render_compact(*args), narrowed(*args))
    # Lengths from the part lengths and the choice, and from chunk counts alone.
    assert rendered_doc_starts(*args[:1], *args[2:]).tolist() == starts
    added = added_tokens(template, choice)
    assert doc_lengths(template, lengths, args[3], args[4], n, added).tolist() == np.diff(starts).tolist()
    whole = chunk_added(template, np.array([case["chunk"]]), np.array([n]))
    assert stream_lengths(template, [lengths.sum()], [n], None, whole).tolist() == [len(tokens)]


def test_the_layout_by_hand() -> None:
    """Both layouts of the classification token, spelled out for one document of two gaps."""
    doc = list(range(100, 110))
    gaps = [(2, 3), (7, 2)]   # 102 103 104 and 107 108
    prefix = Infill(rate=1, gaps=(2, 2), gap_tokens=(2, 3), mask=MASK, sep=SEP, start=None, end=END, cls=CLS,
                    cls_each=False, key=0)
    tokens, trains = reference(prefix, BOS, EOS, doc, gaps)
    assert tokens == [BOS, CLS, 100, 101, MASK, 105, 106, MASK, 109, SEP, 102, 103, 104, END, 107, 108, END, EOS]
    assert [t for t, flag in zip(tokens, trains) if flag] == [102, 103, 104, END, 107, 108, END, EOS]
    each = Infill(rate=1, gaps=(2, 2), gap_tokens=(2, 3), mask=MASK, sep=None, start=START, end=END, cls=CLS,
                  cls_each=True, key=0)
    tokens, trains = reference(each, None, EOS, doc, gaps)
    assert tokens == [100, 101, MASK, 105, 106, MASK, 109, CLS, START, 102, 103, 104, END, CLS, START, 107, 108, END,
                      EOS]
    assert [t for t, flag in zip(tokens, trains) if flag] == [102, 103, 104, END, 107, 108, END, EOS]
    # The renders agree on a chunk whose documents all have two gaps.
    template = _template(prefix, BOS)
    lengths = np.full(6, 10)
    choice = infill_choice(prefix, 3, 6, np.arange(6), lengths)
    values = np.tile(np.array(doc, np.uint16), 6)
    rendered = render(template, values, lengths, np.zeros(6, int), np.arange(6), 6, choice)
    assert (choice[0] == 2).all()
    for d in range(6):
        a, b = rendered.doc_starts[d : d + 2]
        assert (rendered.tokens[a:b].tolist(), rendered.trainable[a:b].tolist()) == reference(
            prefix, BOS, EOS, doc, drawn_gaps(choice, d))


# -- the config -------------------------------------------------------------------------------------

def _tokenizer_with(tmp: Path, tokens: list[str]) -> Path:
    """The demo tokenizer with ``tokens`` added as special tokens."""
    tokenizer = Tokenizer.from_file(str(DEMO_TOKENIZER))
    tokenizer.add_special_tokens(tokens)
    path = tmp / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def test_config_defaults_keys_and_errors(tmp_path: Path) -> None:
    data = tmp_path / "t.jsonl"
    data.write_text('{"text": "x"}\n')
    config = load_config(write_config(tmp_path, {"d": {"sources": [str(data)], "format": "infill",
                                                       "infill": {"gaps": 2, "gap_tokens": [3, 9]}}}))
    section = config.datasets["d"].infill
    assert section.gaps == [2, 2] and section.gap_tokens == [3, 9] and section.rate == 1.0
    assert config.datasets["d"].build_fields == {"text_field": "text"}
    # The demo tokenizer has no <|mask|> nor <|answer|>: named with their key when a template is made.
    with pytest.raises(ConfigError, match=r"datasets\.d\.infill\.mask_token = '<\|mask\|>' is not a token"):
        template_for("d", config, Tokenizer.from_file(str(DEMO_TOKENIZER)))
    tokenizer = Tokenizer.from_file(str(_tokenizer_with(tmp_path, ["<|mask|>", "<|answer|>"])))
    infill = template_for("d", config, tokenizer).infill
    assert infill is not None and infill.sep == tokenizer.token_to_id("<|sep|>") and infill.cls is None
    for bad, message in (({"gaps": [3, 1]}, "1 <= min <= max"), ({"gap_tokens": [0, 4]}, "1 <= min <= max"),
                         ({"gaps": [1, 1000]}, "at most"), ({"cls_position": "middle"}, "prefix"),
                         ({"rate": 2}, "less than or equal")):
        path = write_config(tmp_path, {"d": {"sources": [str(data)], "format": "infill", "infill": bad}})
        with pytest.raises(ConfigError, match=message):
            load_config(path)
    path = write_config(tmp_path, {"d": {"sources": [str(data)], "infill": {"rate": 0.5}}})
    with pytest.raises(ConfigError, match="format: infill"):
        load_config(path)


# -- end to end -------------------------------------------------------------------------------------

SEQ_LEN, BATCH = 256, 8
SPECIALS = ["<|mask|>", "<|answer|>", "<|cls|>", "<|start|>"]
POLICY = {"gaps": [1, 3], "gap_tokens": [2, 12], "rate": 0.7}


def _paragraphs() -> list[str]:
    texts = stdlib_texts("json") + stdlib_texts("email", limit=10)
    return [p.strip() for t in texts for p in t.split("\n\n") if 20 < len(p.strip()) < 500]


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory, dask_scheduler: str) -> tuple[Path, dict[str, Any]]:
    """A lake of one infill dataset of real paragraphs, built under a tokenizer with the special
    tokens infilling uses; returns its folder and the extra config sections of its variants."""
    tmp = tmp_path_factory.mktemp("infill")
    data = tmp / "data" / "prose.jsonl"
    data.parent.mkdir(parents=True)
    data.write_text("".join(json.dumps({"text": p}) + "\n" for p in _paragraphs()))
    shared = {"tokenizer": str(_tokenizer_with(tmp, SPECIALS)), "build": {"split_size": "8KB"}}
    config = _variant(tmp, shared, packing="concat")
    build(config, scheduler=dask_scheduler, progress=False)
    return tmp, shared


def _variant(tmp: Path, shared: dict[str, Any], *, infill: dict[str, Any] | None = None, **loader: Any) -> Path:
    """A config of the lake with other collation or loader settings (never a rebuild)."""
    datasets = {"prose": {"sources": [str(tmp / "data" / "prose.jsonl")], "format": "infill",
                          "infill": {**POLICY, **(infill or {})}}}
    return write_config(tmp, datasets, loader={"seq_len": SEQ_LEN, "batch_size": BATCH, "seed": 5, **loader},
                        **shared)


def _built(lake: tuple[Path, dict[str, Any]], scheduler: str, **kwargs: Any) -> Path:
    config = _variant(*lake, **kwargs)
    assert build(config, scheduler=scheduler, progress=False).chunks_built == 0   # nothing tokenized again
    return config


def _expected(config: Path) -> list[tuple[list[int], list[bool]]]:
    """Every document of the lake rendered by :func:`reference`, in stream order, with the gaps
    its chunk and place in the chunk draw."""
    loaded = load_config(config)
    tokenizer = Tokenizer.from_file(loaded.tokenizer)
    template = template_for("prose", loaded, tokenizer)
    infill = template.infill
    assert infill is not None
    lake = open_lake(config)
    paths = lake.sql("SELECT path FROM chunks WHERE dataset = 'prose' AND status = 'committed' ORDER BY global_index")
    out = []
    for chunk, path in enumerate(paths["path"]):
        docs = pq.read_table(lake.path_of(path)).column("tokens").to_pylist()
        choice = infill_choice(infill, chunk, len(docs), np.arange(len(docs)), np.array([len(d) for d in docs]))
        bos = int(template.doc_prefix[0]) if len(template.doc_prefix) else None
        out += [reference(infill, bos, int(template.doc_suffix[0]), doc, drawn_gaps(choice, d))
                for d, doc in enumerate(docs)]
    return out


def _check_rows(config: Path) -> None:
    """An evaluation pass under ``pad`` or ``pack``: each document is a segment of a row as the
    reference renders it, its loss mask exactly on the reference's targets (the gaps' contents,
    their end tokens, EOS); under ``pad`` one a row, in stream order."""
    expected = [(tokens, [t for t, flag in zip(tokens[1:], trains[1:]) if flag]) for tokens, trains in _expected(config)]
    found = []
    with Loader(config, mode="eval") as loader:
        for batch in loader:
            for r in np.flatnonzero(batch["example_mask"]):
                segments = batch["segment_ids"][r]
                assert not batch["loss_mask"][r][segments == 0].any()
                for segment in np.unique(segments[segments > 0]):
                    inside = segments == segment
                    targets = batch["targets"][r][inside][batch["loss_mask"][r][inside] > 0]
                    found.append((batch["input_ids"][r][inside].tolist(), targets.tolist()))
    if load_config(config).loader.packing == "pack":
        found, expected = sorted(found), sorted(expected)
    assert found == expected
    infilled = sum(len(targets) < len(tokens) - 1 for tokens, targets in expected)
    assert abs(infilled / len(expected) - POLICY["rate"]) < 0.1


@pytest.mark.parametrize("packing", ["pad", "pack"])
def test_rows_hold_the_masked_document_then_the_gaps(lake: tuple[Path, dict[str, Any]], dask_scheduler: str,
                                                     packing: str) -> None:
    _check_rows(_built(lake, dask_scheduler, packing=packing, pack={"long_documents": "error"}))


def test_the_other_layout_and_tokens_need_no_rebuild(lake: tuple[Path, dict[str, Any]], dask_scheduler: str) -> None:
    config = _built(lake, dask_scheduler, packing="pad", pack={"long_documents": "error"}, bos_token="<|bos|>",
                    infill={"cls_token": "<|cls|>", "cls_position": "each_target", "start_token": "<|start|>",
                            "sep_token": None})
    _check_rows(config)


def test_concat_stream_is_the_reference_stream(lake: tuple[Path, dict[str, Any]], dask_scheduler: str) -> None:
    """Under concat the rows cut the stream of reference renderings: the stream offsets known from
    the catalog's counts alone are those of the rendered documents."""
    config = _built(lake, dask_scheduler, packing="concat")
    expected = _expected(config)
    tokens = [t for doc, _ in expected for t in doc]
    trains = [f for _, flags in expected for f in flags]
    with Loader(config, mode="eval") as loader:
        batches = list(loader)
    rows = [(b["targets"][r], b["loss_mask"][r]) for b in batches for r in np.flatnonzero(b["example_mask"])]
    targets = np.concatenate([t for t, _ in rows])[: len(tokens) - 1]
    loss = np.concatenate([m for _, m in rows])
    assert targets.tolist() == tokens[1:]
    assert loss[: len(tokens) - 1].astype(bool).tolist() == trains[1:] and not loss[len(tokens) - 1 :].any()


@pytest.mark.parametrize("packing", ["concat", "pack"])
def test_same_batches_for_any_process_count_and_resume(lake: tuple[Path, dict[str, Any]], dask_scheduler: str,
                                                        packing: str) -> None:
    config = _built(lake, dask_scheduler, packing=packing, shuffle={"kind": "window", "window_chunks": 2},
                    pack={"long_documents": "split"})
    steps = range(6)
    reference_batches = global_batches(config, 1, steps)
    assert_batches_equal(global_batches(config, 2, steps), reference_batches)
    with Loader(config) as loader:
        for start in (1, 4):
            resumed = [batch for _, batch in zip(range(start, 6), loader.iter_from(loader.state(start)))]
            assert_batches_equal(resumed, reference_batches[start:], steps=list(range(start, 6)))
    mask = Tokenizer.from_file(load_config(config).tokenizer).token_to_id("<|mask|>")
    batch = reference_batches[0]
    assert (batch["input_ids"] == mask).any() and 0 < batch["loss_mask"].mean() < 1
