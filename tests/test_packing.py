"""Packing plans: every token once, capacities respected, images whole, and the same plans as a
plain reference implementation of the rules."""

from __future__ import annotations

import itertools
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lakeloader.index.packing import DocumentTooLong, PackPlan, plan_pack

ALGORITHMS = ("first_fit", "best_fit")
POLICIES = ("split", "truncate", "error")


# ---------------------------------------------------------------------------- reference


def reference_pieces(lengths, seq_len, policy, spans, max_images):
    """(doc, start, stop, images) of every piece: each cut moved back one rule at a time until none applies."""
    pieces = []
    for d, length in enumerate(lengths):
        mine = spans.get(d, [])
        if length == 0:
            continue
        if length <= seq_len and (max_images is None or len(mine) <= max_images):
            pieces.append((d, 0, length, len(mine)))
            continue
        if policy == "error":
            raise DocumentTooLong(d, length, seq_len)
        start = 0
        while start < length:
            end = min(start + seq_len, length)
            while True:
                straddling = [a for a, b in mine if a < end < b]
                held = sorted(a for a, b in mine if start <= a < end)
                if straddling:
                    end = min(straddling)
                elif max_images is not None and len(held) > max_images:
                    end = held[max_images]
                else:
                    break
            if end <= start:
                raise ValueError("cannot cut")
            pieces.append((d, start, end, len(held)))
            if policy == "truncate":
                break
            start = end
    return pieces


def reference_plan(lengths, seq_len, *, mode="pack", algorithm="first_fit", open_examples=64, long_documents="split",
                   spans=None, max_images=None):
    """Items as (doc, start, stop, example) in example then placement order, and the example count."""
    pieces = reference_pieces(lengths, seq_len, long_documents, spans or {}, max_images)
    if mode == "pad":
        return [(d, a, b, e) for e, (d, a, b, _) in enumerate(pieces)], len(pieces)
    limit = max_images if max_images is not None else 10**9
    tokens, images, members = [], [], []     # per example
    still_open = []                          # in opening order
    for d, a, b, n in pieces:
        fits = [e for e in still_open if tokens[e] + b - a <= seq_len and images[e] + n <= limit]
        if fits:
            e = min(fits) if algorithm == "first_fit" else min(fits, key=lambda e: (seq_len - tokens[e], e))
        else:
            e = len(tokens)
            tokens.append(0)
            images.append(0)
            members.append([])
        tokens[e] += b - a
        images[e] += n
        members[e].append((d, a, b, e))
        if tokens[e] == seq_len:
            if e in still_open:
                still_open.remove(e)          # full: closed at once
        elif e not in still_open:
            still_open.append(e)
            if len(still_open) > open_examples:
                still_open.pop(0)
    return [item for m in members for item in m], len(tokens)


def as_items(plan: PackPlan):
    return list(zip(plan.item_doc.tolist(), plan.item_start.tolist(), plan.item_stop.tolist(),
                    plan.item_example.tolist()))


# ---------------------------------------------------------------------------- strategies


@st.composite
def chunks(draw, images: bool):
    """(lengths, seq_len, spans by document) with lengths around seq_len and image spans that
    never overlap and are at most seq_len long."""
    seq_len = draw(st.integers(1, 24))
    longest = draw(st.sampled_from([seq_len // 4 + 1, seq_len // 2 + 1, seq_len, 3 * seq_len]))
    lengths = draw(st.lists(st.one_of(st.integers(0, longest), st.sampled_from([0, seq_len, seq_len + 1])),
                            max_size=40))
    spans: dict[int, list[tuple[int, int]]] = {}
    if images:
        most = draw(st.sampled_from([1, 2, 8]))     # cut points a document: few images, or many
        for d, length in enumerate(lengths):
            cuts = sorted(set(draw(st.lists(st.integers(0, length), max_size=most))) | {0, length})
            chosen = [(a, b) for a, b in itertools.pairwise(cuts) if b - a <= seq_len and draw(st.booleans())]
            if chosen:
                spans[d] = chosen
    return lengths, seq_len, spans


def image_arrays(spans):
    flat = [(d, a, b) for d in sorted(spans) for a, b in spans[d]]
    doc, start, stop = (np.array(c, np.int64) for c in zip(*flat)) if flat else (np.zeros(0, np.int64),) * 3
    return {"image_doc": doc, "image_start": start, "image_stop": stop}


def outcome(fn):
    try:
        return fn()
    except DocumentTooLong as exc:
        return ("DocumentTooLong", exc.doc)
    except ValueError:
        return ("ValueError",)


# ---------------------------------------------------------------------------- properties


def check_plan(plan: PackPlan, lengths, seq_len, mode, policy, spans, max_images) -> None:
    lengths = np.asarray(lengths, np.int64)
    for a in (plan.item_doc, plan.item_start, plan.item_stop, plan.item_example):
        assert a.dtype == np.int64
    assert (plan.item_start < plan.item_stop).all()
    assert (plan.item_stop <= lengths[plan.item_doc]).all() and (plan.item_start >= 0).all()
    ex = plan.item_example
    assert (np.diff(ex) >= 0).all()
    assert np.array_equal(np.unique(ex), np.arange(plan.num_examples))
    assert (plan.example_tokens <= seq_len).all()
    assert plan.example_tokens.sum() == (plan.item_stop - plan.item_start).sum()
    for e in range(plan.num_examples):
        s = plan.example_items(e)
        assert (ex[s] == e).all() and s.stop > s.start
    if mode == "pad":
        assert np.array_equal(ex, np.arange(len(ex)))
    # Placement order is document order, within each example too.
    order = np.lexsort((plan.item_start, plan.item_doc, ex))
    assert np.array_equal(order, np.arange(len(ex)))

    kept = dropped = truncated = split = 0
    for d, length in enumerate(lengths.tolist()):
        mine = np.flatnonzero(plan.item_doc == d)
        mine = mine[np.argsort(plan.item_start[mine])]
        starts, stops = plan.item_start[mine], plan.item_stop[mine]
        if length == 0:
            assert mine.size == 0
            continue
        # Pieces tile [0, end) of their document: the whole of it unless truncated.
        assert starts[0] == 0 and np.array_equal(starts[1:], stops[:-1])
        end = int(stops[-1])
        kept += end
        if policy == "truncate":
            assert mine.size == 1
            truncated += end < length
            dropped += length - end
        else:
            assert end == length
            split += mine.size > 1
        for a, b in spans.get(d, []):   # each image whole in one piece, or dropped with the tail
            inside = (starts <= a) & (b <= stops)
            assert inside.sum() == 1 or (policy == "truncate" and a >= end)
    assert (plan.truncated_docs, plan.dropped_tokens, plan.split_docs) == (truncated, dropped, split)
    assert (plan.item_stop - plan.item_start).sum() == kept
    if max_images is not None:
        per_example = np.zeros(plan.num_examples, np.int64)
        for d, pieces in spans.items():
            for a, _ in pieces:
                hit = np.flatnonzero((plan.item_doc == d) & (plan.item_start <= a) & (a < plan.item_stop))
                per_example[ex[hit]] += 1
        assert (per_example <= max_images).all()


@settings(max_examples=300, deadline=None)
@given(data=st.data(), images=st.booleans(), mode=st.sampled_from(["pack", "pad"]),
       algorithm=st.sampled_from(ALGORITHMS), policy=st.sampled_from(POLICIES), open_examples=st.integers(1, 6),
       max_images=st.one_of(st.none(), st.integers(0, 3)))
def test_plans_match_the_reference_and_keep_every_token_once(data, images, mode, algorithm, policy, open_examples,
                                                             max_images) -> None:
    lengths, seq_len, spans = data.draw(chunks(images))
    kwargs = {"mode": mode, "algorithm": algorithm, "open_examples": open_examples, "long_documents": policy}
    arrays = image_arrays(spans) if images else {}

    def fast():
        plan = plan_pack(np.array(lengths, np.int64), seq_len, **kwargs, **arrays,
                         max_images=max_images if images else None)
        return as_items(plan), plan.num_examples, plan

    def slow():
        return reference_plan(lengths, seq_len, **kwargs, spans=spans, max_images=max_images if images else None)

    got, want = outcome(fast), outcome(slow)
    if isinstance(want, tuple) and isinstance(want[0], str):
        assert got == want
        return
    items, count, plan = got
    assert (items, count) == want
    check_plan(plan, lengths, seq_len, mode, policy, spans, max_images if images else None)
    again = fast()[2]
    for name in ("item_doc", "item_start", "item_stop", "item_example"):
        assert np.array_equal(getattr(plan, name), getattr(again, name))


def test_matches_the_reference_on_many_random_chunks() -> None:
    """Many small seeded chunks: cheaper than shrinking examples, finds rare placement slips."""
    rng = np.random.default_rng(0)
    for _ in range(3000):
        seq_len = int(rng.integers(1, 16))
        lengths = rng.integers(0, int(rng.choice([seq_len // 3 + 2, seq_len + 1, 3 * seq_len])), rng.integers(0, 30))
        spans = {}
        for d, length in enumerate(lengths.tolist()):
            a = int(rng.integers(0, length + 1))
            b = min(length, a + int(rng.integers(1, seq_len + 1)))
            if b > a and rng.random() < 0.4:
                spans[d] = [(a, b)]
        max_images = None if rng.random() < 0.2 else int(rng.integers(1, 4))
        kwargs = {"algorithm": str(rng.choice(ALGORITHMS)), "open_examples": int(rng.integers(1, 6)),
                  "long_documents": str(rng.choice(["split", "truncate"]))}
        plan = plan_pack(lengths, seq_len, **kwargs, **image_arrays(spans), max_images=max_images)
        want = reference_plan(lengths.tolist(), seq_len, **kwargs, spans=spans, max_images=max_images)
        assert (as_items(plan), plan.num_examples) == want, (lengths.tolist(), seq_len, spans, max_images, kwargs)


@settings(max_examples=100, deadline=None)
@given(lengths=st.lists(st.integers(0, 80), max_size=60), seq_len=st.integers(1, 40))
def test_first_fit_with_one_open_example_is_next_fit(lengths, seq_len) -> None:
    plan = plan_pack(np.array(lengths, np.int64), seq_len, algorithm="first_fit", open_examples=1)
    # Next fit: one open example, a new one when a piece misses; a full example closes at once
    # (so a piece of exactly seq_len does not close the partly filled one).
    want, current, filled, opened = [], None, 0, 0
    for d, length in enumerate(lengths):
        for start in range(0, length, seq_len):
            size = min(seq_len, length - start)
            if size == seq_len:
                want.append((d, start, start + size, opened))
                opened += 1
                continue
            if current is None or filled + size > seq_len:
                current, filled, opened = opened, 0, opened + 1
            filled += size
            want.append((d, start, start + size, current))
            if filled == seq_len:
                current = None
    want.sort(key=lambda item: item[3])   # stable: placement order within an example
    assert as_items(plan) == want and plan.num_examples == opened


def test_best_fit_picks_the_tightest_example() -> None:
    lengths = np.array([5, 7, 3])      # rooms left 5 and 3; the 3 fills the second one exactly
    first = plan_pack(lengths, 10, algorithm="first_fit")
    best = plan_pack(lengths, 10, algorithm="best_fit")
    assert as_items(first) == [(0, 0, 5, 0), (2, 0, 3, 0), (1, 0, 7, 1)]
    assert as_items(best) == [(0, 0, 5, 0), (1, 0, 7, 1), (2, 0, 3, 1)]
    assert best.example_tokens.tolist() == [5, 10]
    tie = plan_pack(np.array([6, 6, 2]), 10, algorithm="best_fit")   # equal rooms: the earliest opened
    assert tie.item_example.tolist() == [0, 0, 1] and tie.item_doc.tolist() == [0, 2, 1]


def test_a_piece_too_large_for_every_example_does_not_hide_the_room_of_older_ones() -> None:
    plan = plan_pack(np.array([6, 7, 4]), 10)
    assert plan.item_doc.tolist() == [0, 2, 1] and plan.item_example.tolist() == [0, 0, 1]


def test_one_more_open_example_closes_the_earliest_and_full_ones_take_no_place() -> None:
    plan = plan_pack(np.array([9, 9, 9, 1]), 10, open_examples=2)       # example 0 closed when example 2 opens
    assert plan.item_example.tolist() == [0, 1, 1, 2] and plan.item_doc.tolist() == [0, 1, 3, 2]
    plan = plan_pack(np.array([9, 10, 1]), 10, open_examples=1)         # the full example 1 never opens
    assert plan.item_doc.tolist() == [0, 2, 1]
    plan = plan_pack(np.array([9, 10, 20, 1]), 10, open_examples=1)     # nor do full pieces of a split document
    assert plan.item_doc.tolist() == [0, 3, 1, 2, 2] and plan.num_examples == 4 and plan.split_docs == 1


def test_pad_and_truncate() -> None:
    plan = plan_pack(np.array([4, 0, 25, 10]), 10, mode="pad", long_documents="truncate")
    assert as_items(plan) == [(0, 0, 4, 0), (2, 0, 10, 1), (3, 0, 10, 2)]
    assert (plan.truncated_docs, plan.dropped_tokens, plan.split_docs) == (1, 15, 0)
    assert plan.example_items(1) == slice(1, 2)
    with pytest.raises(IndexError):
        plan.example_items(3)
    empty = plan_pack(np.zeros(0, np.int64), 8)
    assert empty.num_examples == 0 and empty.example_tokens.shape == (0,)


def test_images_move_cuts_to_span_starts_and_cap_images() -> None:
    spans = {"image_doc": np.array([0, 0, 0]), "image_start": np.array([2, 5, 10]),
             "image_stop": np.array([4, 9, 11])}
    plan = plan_pack(np.array([12]), 6, **spans)                 # the cut at 6 is inside [5, 9): moves to 5
    assert as_items(plan) == [(0, 0, 5, 0), (0, 11, 12, 0), (0, 5, 11, 1)]
    capped = plan_pack(np.array([6, 3]), 8, image_doc=np.array([0, 0, 1]), image_start=np.array([0, 3, 0]),
                       image_stop=np.array([1, 4, 1]), max_images=1)
    assert [(d, a, b) for d, a, b, _ in as_items(capped)] == [(0, 0, 3), (0, 3, 6), (1, 0, 3)]
    assert capped.num_examples == 3 and capped.split_docs == 1   # each example holds one image
    with pytest.raises(ValueError, match="image span"):
        plan_pack(np.array([12]), 4, image_doc=np.array([0]), image_start=np.array([1]), image_stop=np.array([7]))
    with pytest.raises(ValueError, match="overlap"):
        plan_pack(np.array([12]), 8, image_doc=np.array([0, 0]), image_start=np.array([1, 2]),
                  image_stop=np.array([3, 4]))


def test_error_names_the_document() -> None:
    with pytest.raises(DocumentTooLong, match="document 2 .* 11 rendered tokens, more than seq_len=10") as info:
        plan_pack(np.array([3, 10, 11, 12]), 10, long_documents="error")
    assert (info.value.doc, info.value.length, info.value.seq_len) == (2, 11, 10)
    assert "long_documents: split or truncate" in str(info.value)
    assert pickle.loads(pickle.dumps(info.value)).doc == 2
    with pytest.raises(DocumentTooLong, match="document 0 .* 2 images, more than max_images=1"):
        plan_pack(np.array([5]), 10, long_documents="error", image_doc=np.array([0, 0]),
                  image_start=np.array([0, 2]), image_stop=np.array([1, 3]), max_images=1)


@pytest.mark.parametrize("bad", [{"mode": "fill"}, {"algorithm": "worst_fit"}, {"long_documents": "drop"},
                                 {"open_examples": 0}, {"max_images": -1}, {"image_doc": np.array([0])}])
def test_bad_arguments(bad) -> None:
    with pytest.raises(ValueError):
        plan_pack(np.array([1, 2]), 4, **bad)
