"""Collation templates: rendered tokens, lengths known without tokens, loss flags, FIM."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lakeloader.contracts.specs import Fim, make_template
from lakeloader.index.render import (
    FIM_SENTINELS, added_tokens, doc_lengths, fim_choice, fim_counts, part_starts, render, stream_lengths,
)

PRE, MID, SUF, EOS, BOS = 90, 91, 92, 0, 1


def _documents(draw: st.DrawFn, kinds: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    per_doc = draw(st.lists(st.integers(1, 4), min_size=1, max_size=12))
    lengths = draw(st.lists(st.integers(0, 9), min_size=sum(per_doc), max_size=sum(per_doc)))
    part_kinds = draw(st.lists(st.integers(0, kinds - 1), min_size=sum(per_doc), max_size=sum(per_doc)))
    part_doc = np.repeat(np.arange(len(per_doc)), per_doc)
    return np.array(lengths, np.int64), np.array(part_kinds, np.int64), part_doc, len(per_doc)


def _chat_template(bos: int | None = None):
    return make_template(("system", "user", "assistant"), bos=bos, eos=EOS,
                         part_prefix={"system": [50], "user": [51, 52], "assistant": [53]},
                         part_suffix={"user": [54], "assistant": [55, 56]}, trains={"assistant"})


def _reference(template, values, lengths, kinds, part_doc, docs):
    """Straightforward per-document rendering (lists), for comparison."""
    tokens, trains, starts = [], [], []
    at = 0
    for doc in range(docs):
        starts.append(len(tokens))
        tokens += template.doc_prefix.tolist()
        trains += [template.train_all] * len(template.doc_prefix)
        last_trains = False
        for part in np.flatnonzero(part_doc == doc):
            k, n = kinds[part], lengths[part]
            t = template.train_all or template.part_trains[k]
            tokens += template.part_prefix[k].tolist() + values[at : at + n].tolist() + template.part_suffix[k].tolist()
            trains += ([template.train_all] * len(template.part_prefix[k]) + [t] * n
                       + [t] * len(template.part_suffix[k]))
            at += n
            last_trains = t
        tokens += template.doc_suffix.tolist()
        trains += [template.train_all or last_trains] * len(template.doc_suffix)
    return tokens, trains, starts + [len(tokens)]


@st.composite
def chat_documents(draw: st.DrawFn):
    return _documents(draw, 3)


@given(chat_documents(), st.booleans())
@settings(max_examples=150, deadline=None)
def test_render_equals_reference_and_lengths_need_no_tokens(docs, with_bos):
    lengths, kinds, part_doc, n = docs
    template = _chat_template(BOS if with_bos else None)
    values = np.arange(1000, 1000 + lengths.sum())
    rendered = render(template, values, lengths, kinds, part_doc, n)
    tokens, trains, starts = _reference(template, values, lengths, kinds, part_doc, n)
    assert rendered.tokens.tolist() == tokens
    assert rendered.trainable.tolist() == trains
    assert rendered.doc_starts.tolist() == starts
    assert rendered.docs.tolist() == [d for d in range(n) for _ in range(starts[d], starts[d + 1])]
    per_doc = doc_lengths(template, lengths, kinds, part_doc, n)
    assert per_doc.tolist() == np.diff(starts).tolist()
    counts = np.bincount(kinds, minlength=3)[None, :]
    assert stream_lengths(template, [lengths.sum()], [n], counts, [0]).tolist() == [len(tokens)]
    # Each part's rendered start, from lengths alone, points at its prefix.
    for part, start in enumerate(part_starts(template, lengths, kinds, part_doc)):
        prefix = template.part_prefix[kinds[part]]
        at = starts[part_doc[part]] + start
        assert tokens[at : at + len(prefix)] == prefix.tolist()


def test_plain_text_is_documents_with_bos_and_eos_all_trained():
    template = make_template(("text",), bos=BOS, eos=EOS)
    rendered = render(template, np.array([5, 6, 7]), np.array([2, 1]), np.zeros(2, int), np.arange(2), 2)
    assert rendered.tokens.tolist() == [BOS, 5, 6, EOS, BOS, 7, EOS]
    assert rendered.trainable.all()
    # Its lengths need no part counts (readers do not fetch them); a chat template's do.
    assert not template.counts_parts and _chat_template().counts_parts
    assert stream_lengths(template, [3], [2], None, [0]).tolist() == [len(rendered.tokens)]
    with pytest.raises(ValueError, match="counts per kind"):
        stream_lengths(_chat_template(), [3], [2], None, [0])


FIM = Fim(rate=0.5, spm_rate=0.5, prefix=PRE, middle=MID, suffix=SUF, key=12345)


def _unfim(tokens: list[int]) -> list[int]:
    """Undo PSM (<PRE> P <SUF> S <MID> M) or SPM (<PRE> <SUF> S <MID> P M)."""
    assert tokens[0] == PRE
    if tokens[1] == SUF:                       # SPM
        mid = tokens.index(MID)
        suffix, rest = tokens[2:mid], tokens[mid + 1 :]
        return rest + suffix                   # P M then S: rest is P+M
    suf, mid = tokens.index(SUF), tokens.index(MID)
    return tokens[1:suf] + tokens[mid + 1 :] + tokens[suf + 1 : mid]


@given(st.lists(st.integers(0, 40), min_size=1, max_size=60), st.integers(0, 1000))
@settings(max_examples=100, deadline=None)
def test_fim_reorders_and_removing_sentinels_reconstructs(lengths, chunk):
    lengths = np.array(lengths, np.int64)
    n = len(lengths)
    template = make_template(("text",), bos=None, eos=EOS, fim=FIM)
    values = np.arange(1000, 1000 + lengths.sum())
    choice = fim_choice(FIM, chunk, n, np.arange(n), lengths)
    rendered = render(template, values, lengths, np.zeros(n, int), np.arange(n), n, choice)
    per_doc = doc_lengths(template, lengths, np.zeros(n, int), np.arange(n), n, added_tokens(template, choice))
    assert np.diff(rendered.doc_starts).tolist() == per_doc.tolist()
    assert int(choice[0].sum()) == int(fim_counts(FIM, np.array([chunk]), np.array([n]))[0])
    starts = np.concatenate([[0], np.cumsum(lengths)])
    for d in range(n):
        doc = rendered.tokens[rendered.doc_starts[d] : rendered.doc_starts[d + 1]].tolist()
        assert doc[-1] == EOS
        original = values[starts[d] : starts[d + 1]].tolist()
        if choice[0][d]:
            assert len(doc) == len(original) + FIM_SENTINELS + 1
            if choice[2][d] > 0:   # with an empty prefix PSM and SPM read alike
                assert (doc[1] == SUF) == bool(choice[1][d])
            assert _unfim(doc[:-1]) == original
        else:
            assert doc[:-1] == original


def test_fim_rate_and_choice_are_stable():
    docs = np.full(20_000, 10, np.int64)
    selected = np.concatenate([fim_choice(FIM, c, 2_000, np.arange(2_000), docs[:2_000])[0] for c in range(10)])
    assert abs(selected.mean() - FIM.rate) < 0.001   # stratified per chunk: within a document per chunk
    again = fim_choice(FIM, 3, 2_000, np.arange(500, 700), docs[:200])
    full = fim_choice(FIM, 3, 2_000, np.arange(2_000), docs[:2_000])
    for a, b in zip(again, full):
        assert np.array_equal(a, b[500:700])  # a document's choice does not depend on what else is asked
    counts = fim_counts(FIM, np.arange(10_000), np.full(10_000, 7))
    assert abs(counts.mean() / 7 - FIM.rate) < 0.01
