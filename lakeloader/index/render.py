"""Collation: a document's stored parts become its rendered tokens, with special tokens and
templates from the config (never stored, so changing them needs no rebuild). The template itself
is a plain spec (:class:`lakeloader.contracts.specs.Template`, built by :mod:`lakeloader.specs`).

A document renders as ``doc_prefix`` (BOS), then per part ``part_prefix[kind] + content +
part_suffix[kind]``, then ``doc_suffix`` (EOS). Fill-in-the-middle reorders a seeded choice of
documents' content around three sentinels. Everything here is a function of integer arrays; the
rendered length of a document is known from its part lengths and kinds alone, so stream offsets
and packing plans never need the tokens.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from lakeloader.contracts.specs import Fim, Template, token_array
from lakeloader.index.permutation import mix_key, permute
from lakeloader.index.ranges import cumulative, run_indices

FIM_SENTINELS = 3
_SLOTS = 8   # output order slots per part: prefix, 6 content pieces (FIM), suffix
# render_compact copies the stored values part by part when parts are this long on average (a
# slice copy costs about as much as masking this many tokens), else in one masked copy.
TOKENS_PER_PART_COPY = 1024


# -- fill-in-the-middle choices --------------------------------------------------------------------

def _unit(h: np.ndarray) -> np.ndarray:
    """Uniform floats in [0, 1) from uint64 hashes (53 bits)."""
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def fim_counts(fim: Fim | None, chunks: np.ndarray, num_docs: np.ndarray) -> np.ndarray:
    """FIM documents of each chunk: ``floor(rate * docs + u)`` with a seeded ``u`` per chunk
    (unbiased, and closed form, so stream offsets never need the documents)."""
    num_docs = np.asarray(num_docs, np.int64)
    if fim is None or fim.rate == 0 or not len(num_docs):
        return np.zeros(len(num_docs), np.int64)
    u = _unit(mix_key(fim.key, np.asarray(chunks, np.int64), 0))
    return np.minimum(np.floor(fim.rate * num_docs + u).astype(np.int64), num_docs)


def fim_choice(fim: Fim | None, chunk: int, chunk_docs: int, docs: np.ndarray,
               lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For documents ``docs`` of a chunk of ``chunk_docs`` documents with content ``lengths``:
    (selected, spm, cut a, cut b): the document is cut into ``[0, a) [a, b) [b, len)``."""
    docs = np.asarray(docs, np.int64)
    n = len(docs)
    if fim is None or not n:
        z = np.zeros(n, np.int64)
        return z.astype(bool), z.astype(bool), z, z
    count = int(fim_counts(fim, np.array([chunk]), np.array([chunk_docs]))[0])
    selected = permute(docs, chunk_docs, int(mix_key(fim.key, chunk, 1)[0])) < count
    hashes = [mix_key(fim.key, chunk, docs, salt) for salt in (2, 3, 4)]
    spm = _unit(hashes[0]) < fim.spm_rate
    span = np.asarray(lengths, np.int64) + 1
    cuts = np.sort(np.stack([(h % span.astype(np.uint64)).astype(np.int64) for h in hashes[1:]]), axis=0)
    return selected, spm, cuts[0], cuts[1]


# -- lengths (no tokens needed) -------------------------------------------------------------------

def stream_lengths(template: Template, num_tokens: np.ndarray, num_docs: np.ndarray,
                   num_parts: np.ndarray | None, fim_docs: np.ndarray) -> np.ndarray:
    """Rendered tokens of whole chunks or row groups from their stored counts: tokens, documents,
    parts per kind (``[n, kinds]``; None will do where ``template.counts_parts`` is false) and FIM
    documents. ``n`` may be 0 (a dataset with no committed chunk yet, or a chunk without row
    groups): the result is then empty."""
    lengths = (np.asarray(num_tokens, np.int64) + np.asarray(num_docs, np.int64) * template.doc_overhead
               + FIM_SENTINELS * np.asarray(fim_docs, np.int64))
    if template.counts_parts:
        if num_parts is None:
            raise ValueError("the template adds tokens around parts: their counts per kind are needed")
        kinds = len(template.part_overhead)   # not -1: numpy cannot infer it from an empty array
        lengths += np.asarray(num_parts, np.int64).reshape(len(num_tokens), kinds) @ template.part_overhead
    return lengths


def doc_lengths(template: Template, part_lengths: np.ndarray, part_kinds: np.ndarray,
                part_doc: np.ndarray, num_docs: int, fim_selected: np.ndarray | None = None) -> np.ndarray:
    """Rendered length of each document from its parts (``part_doc``: each part's document)."""
    per_part = np.asarray(part_lengths, np.int64) + template.part_overhead[np.asarray(part_kinds, np.int64)]
    lengths = np.bincount(part_doc, weights=per_part, minlength=num_docs).astype(np.int64) + template.doc_overhead
    if fim_selected is not None:
        lengths += FIM_SENTINELS * fim_selected.astype(np.int64)
    return lengths


def part_starts(template: Template, part_lengths: np.ndarray, part_kinds: np.ndarray,
                part_doc: np.ndarray) -> np.ndarray:
    """Rendered offset of each part's prefix within its document (FIM documents excepted)."""
    per_part = np.asarray(part_lengths, np.int64) + template.part_overhead[np.asarray(part_kinds, np.int64)]
    ends = np.cumsum(per_part)
    first_of_doc = np.searchsorted(part_doc, part_doc, side="left")
    before_doc = np.where(first_of_doc > 0, ends[first_of_doc - 1], 0)
    return ends - per_part - before_doc + len(template.doc_prefix)


# -- tokens ------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Rendered:
    """Rendered tokens of consecutive documents."""

    tokens: np.ndarray        # int32
    trainable: np.ndarray     # bool: token is a training target
    doc_starts: np.ndarray    # int64 [docs + 1]: offsets of each document, then the end

    @functools.cached_property
    def docs(self) -> np.ndarray:
        """Document of each token (int32), derived from ``doc_starts`` when first asked."""
        return np.repeat(np.arange(len(self.doc_starts) - 1, dtype=np.int32), np.diff(self.doc_starts))


def render(template: Template, values: np.ndarray, part_lengths: np.ndarray, part_kinds: np.ndarray,
           part_doc: np.ndarray, num_docs: int, fim: tuple[np.ndarray, ...] | None = None) -> Rendered:
    """Render documents whose parts' contents are ``values`` back to back (parts in order).

    ``fim``: :func:`fim_choice` of these documents (selected, spm, a, b); FIM documents have one
    part. One gather over a pool of stored values and template tokens: no per-token Python.
    """
    part_lengths = np.asarray(part_lengths, np.int64)
    kinds = np.asarray(part_kinds, np.int64)
    part_doc = np.asarray(part_doc, np.int64)
    parts = len(kinds)
    content_start = np.cumsum(part_lengths) - part_lengths
    index_in_doc = np.arange(parts) - np.searchsorted(part_doc, part_doc, side="left")

    # The constant pool after the values: doc prefix, doc suffix, then each kind's prefix and suffix.
    pool_pieces = [template.doc_prefix, template.doc_suffix, *[x for pair in zip(
        template.part_prefix, template.part_suffix) for x in pair]]
    if template.fim is not None:
        f = template.fim
        pool_pieces += [token_array([f.prefix]), token_array([f.suffix]), token_array([f.middle])]
    piece_at = np.cumsum([0] + [len(p) for p in pool_pieces]) + len(values)
    constants = np.concatenate(pool_pieces).astype(np.int32)

    segments: list[tuple[np.ndarray, ...]] = []   # (doc, slot, source start, length, trains)

    def add(doc: np.ndarray, slot: np.ndarray | int, start: np.ndarray | int, length: np.ndarray | int,
            trains: np.ndarray | bool) -> None:
        n = len(doc)
        segments.append(tuple(np.broadcast_to(np.asarray(x), (n,)).astype(t) for x, t in (
            (doc, np.int64), (slot, np.int64), (start, np.int64), (length, np.int64), (trains, bool))))

    all_docs = np.arange(num_docs, dtype=np.int64)
    trains_kind, suffix_trains = _trains(template, kinds, part_doc, num_docs)
    add(all_docs, 0, piece_at[0], len(template.doc_prefix), template.train_all)
    add(all_docs, _SLOTS * parts + 1, piece_at[1], len(template.doc_suffix), suffix_trains)

    base_slot = 1 + _SLOTS * index_in_doc
    prefix_len = np.array([len(p) for p in template.part_prefix], np.int64)
    suffix_len = np.array([len(s) for s in template.part_suffix], np.int64)
    add(part_doc, base_slot, piece_at[2 + 2 * kinds], prefix_len[kinds], template.train_all)
    add(part_doc, base_slot + _SLOTS - 1, piece_at[3 + 2 * kinds], suffix_len[kinds], trains_kind[kinds])

    plain = np.ones(parts, bool)
    if fim is not None and template.fim is not None and np.asarray(fim[0]).any():
        selected, spm, a, b = (np.asarray(x) for x in fim)
        fim_part = np.flatnonzero(selected[part_doc])
        plain[fim_part] = False
        d, start, length = part_doc[fim_part], content_start[fim_part], part_lengths[fim_part]
        a, b, is_spm = a[d], b[d], spm[d]
        slot = base_slot[fim_part]
        sentinel = piece_at[-4:-1]   # prefix, suffix, middle sentinels
        # PSM: <PRE> P <SUF> S <MID> M      SPM: <PRE> <SUF> S <MID> P M
        order = [
            (sentinel[0], 1, False), (start, a, True), (sentinel[1], 1, False),
            (start + b, length - b, True), (sentinel[2], 1, False), (start + a, b - a, True),
        ]
        spm_slots = [0, 4, 1, 2, 3, 5]   # where each PSM piece goes in SPM order
        for i, (src, n, content) in enumerate(order):
            piece_slot = slot + 1 + np.where(is_spm, spm_slots[i], i)
            add(d, piece_slot, src, n, trains_kind[0] if content else template.train_all)
    add(part_doc[plain], base_slot[plain] + 1, content_start[plain], part_lengths[plain], trains_kind[kinds[plain]])

    doc, slot, start, length, trains = (np.concatenate(c) for c in zip(*segments))
    order = np.lexsort((slot, doc))
    doc, start, length, trains = doc[order], start[order], length[order], trains[order]
    out_start = np.cumsum(length) - length
    total = int(length.sum())
    if plain.all():
        tokens = _place_in_order(values, constants, start, length, out_start, total)
    else:
        pool = np.concatenate([np.asarray(values, np.int32), constants])
        tokens = pool[np.repeat(start - out_start, length) + np.arange(total, dtype=np.int64)]
    doc_lengths = np.bincount(doc, weights=length, minlength=num_docs).astype(np.int64)
    return Rendered(tokens=tokens, trainable=np.repeat(trains, length),
                    doc_starts=np.concatenate([[0], np.cumsum(doc_lengths)]).astype(np.int64))


def _trains(template: Template, kinds: np.ndarray, part_doc: np.ndarray,
            num_docs: int) -> tuple[np.ndarray, np.ndarray]:
    """(whether the content and suffix of each part kind train, whether each document's suffix
    trains: when its last part's content does)."""
    trains_kind = np.array(template.part_trains, bool) | template.train_all
    last_part = np.full(num_docs, -1, np.int64)
    last_part[part_doc] = np.arange(len(kinds))
    return trains_kind, template.train_all | np.where(last_part >= 0, trains_kind[kinds[last_part]], False)


def stored_token_dtype(stored: np.dtype, largest: int | None) -> np.dtype:
    """The dtype rendered tokens are kept in: the stored one (``stored``, unsigned and narrower
    than int32) when the largest rendered id ``largest`` fits it (None: no token), else int32."""
    if stored.kind == "u" and stored.itemsize < 4 and (largest is None or largest <= np.iinfo(stored).max):
        return stored
    return np.dtype(np.int32)


def _fim_parts(template: Template, part_doc: np.ndarray, fim: tuple[np.ndarray, ...] | None
               ) -> tuple[np.ndarray, np.ndarray]:
    """(the parts of FIM documents, the FIM sentinels among each part's content)."""
    fim_part = np.zeros(0, np.int64)
    if fim is not None and template.fim is not None and np.asarray(fim[0]).any():
        fim_part = np.flatnonzero(np.asarray(fim[0], bool)[part_doc])
    sentinels = np.zeros(len(part_doc), np.int64)
    sentinels[fim_part] = FIM_SENTINELS
    return fim_part, sentinels


def rendered_doc_starts(template: Template, part_lengths: np.ndarray, part_kinds: np.ndarray, part_doc: np.ndarray,
                        num_docs: int, fim: tuple[np.ndarray, ...] | None = None) -> np.ndarray:
    """Where each document starts in :func:`render_compact`'s tokens of the same parts, then
    their end (int64 ``[num_docs + 1]``), from the part layout alone."""
    part_doc = np.asarray(part_doc, np.int64)
    if not _has_fim_parts(template, fim) and _one_part_each(part_doc, num_docs):
        kinds = np.asarray(part_kinds, np.int64)
        return cumulative(np.asarray(part_lengths, np.int64) + template.part_overhead[kinds] + template.doc_overhead)
    lengths = np.asarray(part_lengths, np.int64) + _fim_parts(template, part_doc, fim)[1]
    return cumulative(doc_lengths(template, lengths, np.asarray(part_kinds, np.int64), part_doc, num_docs))


def _has_fim_parts(template: Template, fim: tuple[np.ndarray, ...] | None) -> bool:
    """Whether any of the documents ``fim`` chose for is rendered as FIM."""
    return fim is not None and template.fim is not None and bool(np.asarray(fim[0]).any())


def _one_part_each(part_doc: np.ndarray, num_docs: int) -> bool:
    """Whether documents 0 to ``num_docs - 1`` have one part each (``part_doc``: each part's)."""
    return len(part_doc) == num_docs and bool((part_doc == np.arange(num_docs)).all())


def _template_tokens(pieces: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Where template pieces go in rendered tokens, and their ids (int32): each piece's tokens
    (``pieces``: ids, the offsets of its copies) at each of its offsets."""
    at = np.concatenate([np.add.outer(starts, np.arange(len(p))).ravel() for p, starts in pieces]
                        + [np.zeros(0, np.int64)])
    return at, np.concatenate([np.tile(p, len(starts)) for p, starts in pieces] + [np.zeros(0, np.int32)])


def _place_stored(tokens: np.ndarray, values: np.ndarray, template_at: np.ndarray, source: np.ndarray,
                  out: np.ndarray, lengths: np.ndarray) -> np.ndarray | None:
    """The stored ``values`` written into ``tokens`` around the template's (at ``template_at``):
    run ``k`` is values ``[source[k], source[k] + lengths[k])`` at ``out[k]``. Long runs are
    copied one by one (a memcpy each is cheaper than a mask over every token: then None); else
    every position no template token takes gets the values in order, and that mask of content
    positions is returned (runs placed out of the values' order are the caller's to rewrite)."""
    if len(lengths) * TOKENS_PER_PART_COPY <= len(values):
        for a, o, k in zip(source.tolist(), out.tolist(), lengths.tolist()):
            tokens[o : o + k] = values[a : a + k]
        return None
    content = np.ones(len(tokens), bool)
    content[template_at] = False
    tokens[content] = values
    return content


def _render_plain(template: Template, values: np.ndarray, lengths: np.ndarray, num_docs: int
                  ) -> tuple[np.ndarray, None, np.ndarray]:
    """:func:`render_compact` of documents of one part each (``lengths``: theirs) under a template
    that adds tokens around documents only and trains on every token (plain text): a few
    operations per row group instead of the general case's few dozen (a shuffled first batch
    renders a window's documents in each of many row groups)."""
    prefix, suffix = template.doc_prefix, template.doc_suffix
    doc_starts = cumulative(lengths + template.doc_overhead)
    dtype = stored_token_dtype(values.dtype, max((int(p.max()) for p in (prefix, suffix) if len(p) and num_docs),
                                                 default=None))
    tokens = np.empty(int(doc_starts[-1]), dtype)
    at, ids = _template_tokens([(prefix, doc_starts[:-1]), (suffix, doc_starts[1:] - len(suffix))])
    tokens[at] = ids
    _place_stored(tokens, values, at, np.cumsum(lengths) - lengths, doc_starts[:-1] + len(prefix), lengths)
    return tokens, None, doc_starts


def render_compact(template: Template, values: np.ndarray, part_lengths: np.ndarray, part_kinds: np.ndarray,
                   part_doc: np.ndarray, num_docs: int, fim: tuple[np.ndarray, ...] | None = None
                   ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """:func:`render`'s result compactly, bitwise as ``render`` then narrowing gives: (tokens in
    :func:`stored_token_dtype` of ``values``' dtype, target flags or None when every token is a
    target, document starts).

    The tokens are written straight in their final dtype: template tokens (and FIM sentinels)
    placed at offsets known from the part lengths, the stored values copied around them in runs
    (one per part; three per FIM part), with no int32 pass, no ordering of pieces, no index per
    token and no flags for plain text.
    """
    values = np.asarray(values)
    lengths = np.asarray(part_lengths, np.int64)
    kinds = np.asarray(part_kinds, np.int64)
    part_doc = np.asarray(part_doc, np.int64)
    if (template.train_all and not template.counts_parts and not _has_fim_parts(template, fim)
            and _one_part_each(part_doc, num_docs)):
        return _render_plain(template, values, lengths, num_docs)
    fim_part, sentinels = _fim_parts(template, part_doc, fim)
    doc_starts = rendered_doc_starts(template, lengths, kinds, part_doc, num_docs, fim)
    prefix_len = np.array([len(p) for p in template.part_prefix], np.int64)
    content_at = doc_starts[part_doc] + part_starts(template, lengths + sentinels, kinds, part_doc) + prefix_len[kinds]
    trains_kind, suffix_trains = _trains(template, kinds, part_doc, num_docs)
    part_trains = trains_kind[kinds]
    part_trains[fim_part] = trains_kind[0]   # as render: FIM content trains as kind 0
    # Runs of stored values: (source offset, output offset, length, target flag).
    source = np.cumsum(lengths) - lengths
    runs = [(source, content_at, lengths, part_trains)]
    # Template pieces, each (tokens, where each copy starts, target flag of each copy).
    pieces = [(template.doc_prefix, doc_starts[:-1], np.full(num_docs, template.train_all)),
              (template.doc_suffix, doc_starts[1:] - len(template.doc_suffix), suffix_trains)]
    for kind, (prefix, suffix) in enumerate(zip(template.part_prefix, template.part_suffix)):
        if len(prefix) or len(suffix):
            of_kind = np.flatnonzero(kinds == kind)
            end = content_at[of_kind] + lengths[of_kind] + sentinels[of_kind]
            pieces += [(prefix, content_at[of_kind] - len(prefix), np.full(len(of_kind), template.train_all)),
                       (suffix, end, np.full(len(of_kind), trains_kind[kind]))]
    if len(fim_part) and template.fim is not None and fim is not None:
        d = part_doc[fim_part]
        begin, start, size = content_at[fim_part], source[fim_part], lengths[fim_part]
        spm, cut_a, cut_b = (np.asarray(x)[d] for x in fim[1:4])
        # PSM: <PRE> P <SUF> S <MID> M      SPM: <PRE> <SUF> S <MID> P M   (P [0, a), M [a, b), S [b, size))
        suffix_at = begin + np.where(spm, 1, 1 + cut_a)
        middle_at = suffix_at + 1 + size - cut_b
        p_at = np.where(spm, middle_at + 1, begin + 1)
        m_at = np.where(spm, p_at + cut_a, middle_at + 1)
        fim_trains = np.full(len(fim_part), trains_kind[0])
        runs = [tuple(np.delete(x, fim_part) for x in runs[0]),   # the other parts' runs first
                (start, p_at, cut_a, fim_trains), (start + cut_b, suffix_at + 1, size - cut_b, fim_trains),
                (start + cut_a, m_at, cut_b - cut_a, fim_trains)]
        f, sentinel_trains = template.fim, np.full(len(fim_part), template.train_all)
        pieces += [(token_array([f.prefix]), begin, sentinel_trains),
                   (token_array([f.suffix]), suffix_at, sentinel_trains),
                   (token_array([f.middle]), middle_at, sentinel_trains)]
    pieces = [(p, at, t) for p, at, t in pieces if len(p) and len(at)]   # the pieces rendered at all
    # The stored values fit their own dtype: only the template's ids can need int32.
    dtype = stored_token_dtype(values.dtype, max((int(p.max()) for p, _, _ in pieces), default=None))
    tokens = np.empty(int(doc_starts[-1]), dtype)
    at, ids = _template_tokens([(p, starts) for p, starts, _ in pieces])
    tokens[at] = ids
    trainable = None if template.train_all else np.empty(len(tokens), bool)   # train_all: every piece trains
    if trainable is not None:
        trainable[at] = np.concatenate([np.repeat(t, len(p)) for p, _, t in pieces] + [np.zeros(0, bool)])
    src, out, n, t = (np.concatenate(x) for x in zip(*runs))
    content = _place_stored(tokens, values, at, src, out, n)
    if content is None:   # copied run by run
        if trainable is not None:
            for o, k, flag in zip(out.tolist(), n.tolist(), t.tolist()):
                trainable[o : o + k] = flag
    else:   # through the content mask: a FIM part's values reordered below
        if trainable is not None:
            trainable[content] = np.repeat(part_trains, lengths)
        if len(fim_part):
            moved = slice(len(kinds) - len(fim_part), None)   # the FIM parts' runs
            tokens[run_indices(out[moved], n[moved])] = values[run_indices(src[moved], n[moved])]
    return tokens, None if trainable is None or trainable.all() else trainable, doc_starts


def _place_in_order(values: np.ndarray, constants: np.ndarray, start: np.ndarray, length: np.ndarray,
                    out_start: np.ndarray, total: int) -> np.ndarray:
    """The gather of :func:`render` when the stored values keep their order (no FIM): template
    tokens (``start`` past the values: the constant pool) are scattered to their places and the
    values fill the rest in one masked copy, several times cheaper than an index per token."""
    constant = start >= len(values)
    count = length[constant]
    at = run_indices(out_start[constant], count)
    tokens = np.empty(total, np.int32)
    tokens[at] = constants[run_indices(start[constant] - len(values), count)]
    from_values = np.ones(total, bool)
    from_values[at] = False
    tokens[from_values] = values
    return tokens
