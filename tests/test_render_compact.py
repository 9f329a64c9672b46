"""The direct rendering of a row group (render_compact): bitwise what the general render, then
narrowing to the stored dtype, gives, for every kind of template and both ways of copying."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lakeloader.index.render as render_module
from lakeloader.contracts.specs import Fim, Template, make_template
from lakeloader.feed.loader import Loader
from lakeloader.index.render import fim_choice, render, render_compact, rendered_doc_starts

TOKEN_DTYPES = (np.uint8, np.uint16, np.uint32, np.int32, np.int64)


def narrowed(template: Template, values: np.ndarray, lengths: np.ndarray, kinds: np.ndarray, part_doc: np.ndarray,
             num_docs: int, fim: tuple[np.ndarray, ...] | None) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """The general path as the reader took it before: render (int32 tokens, a flag per token),
    then tokens in the stored dtype if unsigned, narrower and every id fits, flags None if all set."""
    rendered = render(template, values, lengths, kinds, part_doc, num_docs, fim)
    tokens, stored = rendered.tokens, values.dtype
    if stored.kind == "u" and stored.itemsize < tokens.dtype.itemsize and (
            not len(tokens) or int(tokens.max()) <= np.iinfo(stored).max):
        tokens = tokens.astype(stored)
    return tokens, None if rendered.trainable.all() else rendered.trainable, rendered.doc_starts


def assert_same(got: tuple[np.ndarray, np.ndarray | None, np.ndarray],
                want: tuple[np.ndarray, np.ndarray | None, np.ndarray]) -> None:
    (tokens, trainable, starts), (want_tokens, want_trainable, want_starts) = got, want
    assert tokens.dtype == want_tokens.dtype and tokens.shape == want_tokens.shape
    assert np.array_equal(tokens, want_tokens)
    assert (trainable is None) == (want_trainable is None)
    if trainable is not None:
        assert trainable.dtype == want_trainable.dtype and np.array_equal(trainable, want_trainable)
    assert starts.dtype == want_starts.dtype and np.array_equal(starts, want_starts)


@st.composite
def cases(draw: st.DrawFn) -> dict[str, Any]:
    """Random documents and a random template: plain text (BOS or not), chat-, instruction- and
    interleaved-like kinds with multi-token prefixes and suffixes and a training subset, or FIM;
    template ids sometimes beyond the stored dtype (then kept as int32)."""
    dtype = np.dtype(draw(st.sampled_from(TOKEN_DTYPES)))
    top = int(np.iinfo(dtype).max) if dtype.itemsize < 4 else 100_000
    special = st.integers(0, 70_000) if draw(st.booleans()) else st.integers(0, min(top, 70_000))
    bos = draw(st.none() | special)
    eos = draw(special)
    if draw(st.integers(0, 3)) == 0:   # FIM: one text part per document
        fim = Fim(rate=draw(st.sampled_from([0.0, 0.3, 1.0])), spm_rate=0.5, prefix=draw(special),
                  middle=draw(special), suffix=draw(special), key=draw(st.integers(0, 2**32)))
        # (datasets have one kind; two, and a training subset, check FIM content trains as kind 0)
        names = ("text", "other")[: draw(st.integers(1, 2))]
        trains = draw(st.none() | st.sets(st.sampled_from(names)))
        template = make_template(names, bos=bos, eos=eos, fim=fim, trains=trains)
        per_doc = draw(st.lists(st.just(1), max_size=12))
    else:
        names = ("text", "user", "image")[: draw(st.integers(1, 3))]
        pieces = st.dictionaries(st.sampled_from(names), st.lists(special, max_size=3))
        trains = draw(st.none() | st.sets(st.sampled_from(names)))
        image = "image" if "image" in names and draw(st.booleans()) else None
        template = make_template(names, bos=bos, eos=eos, part_prefix=draw(pieces), part_suffix=draw(pieces),
                                 trains=trains, image_kind=image)
        # (documents without parts, but not all of them: the general render needs some part)
        per_doc = draw(st.lists(st.integers(0, 4), max_size=12).filter(lambda d: not d or sum(d)))
    parts = sum(per_doc)
    lengths = np.array(draw(st.lists(st.integers(0, 40), min_size=parts, max_size=parts)), np.int64)
    kinds = np.array(draw(st.lists(st.integers(0, len(template.kind_names) - 1), min_size=parts, max_size=parts)),
                     np.int64)
    values = np.array(draw(st.lists(st.integers(0, min(top, 2**31 - 1)), min_size=int(lengths.sum()),
                                    max_size=int(lengths.sum()))), dtype)
    fim_choices = None
    if template.fim is not None:
        chunk = draw(st.integers(0, 1000))
        fim_choices = fim_choice(template.fim, chunk, len(per_doc), np.arange(len(per_doc)), lengths)
    return dict(template=template, values=values, lengths=lengths, kinds=kinds,
                part_doc=np.repeat(np.arange(len(per_doc)), per_doc), num_docs=len(per_doc), fim=fim_choices)


@given(cases(), st.sampled_from([0, 10**9]))
@settings(max_examples=400, deadline=None)
def test_render_compact_is_bitwise_the_general_render_narrowed(case: dict[str, Any], per_part_copy: int) -> None:
    """Both copies of the stored values (part by part: ``per_part_copy`` 0; masked: 10**9) give
    the general path's tokens (dtype and values), flags (None or the array) and document starts."""
    args = [case[k] for k in ("template", "values", "lengths", "kinds", "part_doc", "num_docs", "fim")]
    with mock.patch.object(render_module, "TOKENS_PER_PART_COPY", per_part_copy):
        got = render_compact(*args)
    assert_same(got, narrowed(*args))


@given(dtype=st.sampled_from(TOKEN_DTYPES), bos=st.none() | st.integers(0, 70_000), eos=st.integers(0, 70_000),
       lengths=st.lists(st.integers(0, 40), max_size=12), fim_rate=st.sampled_from([None, 0.0]),
       per_part_copy=st.sampled_from([0, 10**9]), data=st.data())
@settings(max_examples=300, deadline=None)
def test_plain_documents_render_bitwise_the_general_render_narrowed(
        dtype: type, bos: int | None, eos: int, lengths: list[int], fim_rate: float | None,
        per_part_copy: int, data: st.DataObject) -> None:
    """Documents of one text part each under a template adding tokens around documents only (a
    shuffled first batch's usual row group, rendered by a shorter path): the general path's
    tokens, no flags, and document starts, which ``rendered_doc_starts`` also gives from the
    layout alone."""
    top = int(np.iinfo(dtype).max) if np.dtype(dtype).itemsize < 4 else 100_000
    fim = None if fim_rate is None else Fim(rate=fim_rate, spm_rate=0.5, prefix=1, middle=2, suffix=3, key=4)
    template = make_template(("text",), bos=bos, eos=eos, fim=fim)
    n = len(lengths)
    values = np.array(data.draw(st.lists(st.integers(0, top), min_size=sum(lengths), max_size=sum(lengths))), dtype)
    args = [template, values, np.array(lengths, np.int64), np.zeros(n, np.int64), np.arange(n), n,
            None if fim is None else fim_choice(fim, 0, n, np.arange(n), np.array(lengths, np.int64))]
    with mock.patch.object(render_module, "TOKENS_PER_PART_COPY", per_part_copy):
        got = render_compact(*args)
    if n:   # (the general render needs some part)
        assert_same(got, narrowed(*args))
    assert got[1] is None and np.array_equal(rendered_doc_starts(*args[:1], *args[2:]), got[2])


@pytest.mark.parametrize("per_part_copy", [0, 10**9])
def test_fim_content_of_any_kind_trains_as_kind_0(per_part_copy: int) -> None:
    """As the general render: a FIM document's content trains as kind 0, its suffix as its kind."""
    fim = Fim(rate=1.0, spm_rate=0.5, prefix=90, middle=91, suffix=92, key=1)
    template = make_template(("text", "other"), bos=None, eos=0, fim=fim, trains={"other"})
    lengths, kinds = np.array([5, 6, 7]), np.array([1, 0, 1])
    choice = fim_choice(fim, 0, 3, np.arange(3), lengths)
    args = (template, np.arange(18, dtype=np.uint16) + 100, lengths, kinds, np.arange(3), 3, choice)
    assert choice[0].all()
    with mock.patch.object(render_module, "TOKENS_PER_PART_COPY", per_part_copy):
        got = render_compact(*args)
    assert_same(got, narrowed(*args))


def test_plain_text_renders_in_the_stored_dtype_without_flags() -> None:
    template = make_template(("text",), bos=1, eos=0)
    tokens, trainable, starts = render_compact(template, np.array([5, 6, 7], np.uint16), np.array([2, 1]),
                                               np.zeros(2, int), np.arange(2), 2)
    assert tokens.dtype == np.uint16 and tokens.tolist() == [1, 5, 6, 0, 1, 7, 0]
    assert trainable is None and starts.tolist() == [0, 4, 7]
    wide = make_template(("text",), bos=70_000, eos=0)   # an id beyond uint16: tokens stay int32
    assert render_compact(wide, np.array([5], np.uint16), np.array([1]), np.zeros(1, int), np.arange(1), 1)[0].dtype \
        == np.int32


def test_reader_row_groups_equal_the_general_render(built_lake: Path) -> None:
    """Every row group of a built lake, as the reader renders it, equals the general path's."""
    with Loader(built_lake) as loader:
        reader = loader.datasets[0].reader
        chunks = loader.view.dataset("d")
        for chunk in range(chunks.committed):
            for group in range(len(reader.tables.of(chunks, chunk)[1])):
                got = reader.renderings.render(chunks, chunk, group)
                stored = loader.files.read_row_group(chunks, chunk, group)
                parts = stored.parts
                assert_same((got.tokens, got.trainable, got.doc_starts),
                            narrowed(reader.template, stored.values, parts.part_lengths, parts.part_kinds,
                                     parts.part_doc, parts.num_docs, None))
