"""Collation: a document's stored parts become its rendered tokens, with special tokens and
templates from the config (never stored, so changing them needs no rebuild). The template itself
is a plain spec (:class:`lakeloader.contracts.specs.Template`, built by :mod:`lakeloader.specs`).

A document renders as ``doc_prefix`` (BOS), then per part ``part_prefix[kind] + content +
part_suffix[kind]``, then ``doc_suffix`` (EOS). Fill-in-the-middle reorders a seeded choice of
documents' content around three sentinels; infilling masks seeded gaps of a seeded choice of
documents and puts their contents after the masked text. Everything here is a function of integer
arrays; the rendered length of a document is known from its part lengths and kinds alone (the
tokens FIM and infilling add depend on no document's length), so stream offsets and packing plans
never need the tokens.

A *choice* is what FIM or infilling drew for some documents, each array indexed by document
first (so that slicing every array slices the documents): :func:`fim_choice`'s or
:func:`infill_choice`'s, as the template has FIM or infilling.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from lakeloader.contracts.specs import Fim, Infill, Template, token_array
from lakeloader.index.permutation import mix_key, permute
from lakeloader.index.ranges import cumulative, run_indices

FIM_SENTINELS = 3
_SLOTS = 8   # output order slots per part: prefix, 6 content pieces (FIM, infilling), suffix
# render_compact copies the stored values part by part when parts are this long on average (a
# slice copy costs about as much as masking this many tokens), else in one masked copy.
TOKENS_PER_PART_COPY = 1024

Choice = tuple[np.ndarray, ...]


# -- fill-in-the-middle and infilling choices ------------------------------------------------------

def _unit(h: np.ndarray) -> np.ndarray:
    """Uniform floats in [0, 1) from uint64 hashes (53 bits)."""
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def _chosen_counts(rate: float, key: int, chunks: np.ndarray, num_docs: np.ndarray) -> np.ndarray:
    """Chosen documents of each chunk: ``floor(rate * docs + u)`` with a seeded ``u`` per chunk
    (unbiased, and closed form, so stream offsets never need the documents)."""
    num_docs = np.asarray(num_docs, np.int64)
    if rate == 0 or not len(num_docs):
        return np.zeros(len(num_docs), np.int64)
    u = _unit(mix_key(key, np.asarray(chunks, np.int64), 0))
    return np.minimum(np.floor(rate * num_docs + u).astype(np.int64), num_docs)


def fim_counts(fim: Fim | None, chunks: np.ndarray, num_docs: np.ndarray) -> np.ndarray:
    """FIM documents of each chunk: ``floor(rate * docs + u)`` with a seeded ``u`` per chunk
    (unbiased, and closed form, so stream offsets never need the documents)."""
    if fim is None:
        return np.zeros(len(num_docs), np.int64)
    return _chosen_counts(fim.rate, fim.key, chunks, num_docs)


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


def infill_gaps(infill: Infill, chunk: int, chunk_docs: int, docs: np.ndarray) -> np.ndarray:
    """Gaps of documents ``docs`` of a chunk of ``chunk_docs`` documents (0: not infilled), known
    without their lengths: the first ``floor(rate * docs + u)`` documents of a keyed permutation
    of the chunk's are infilled, their gap counts going round ``[min, max]`` in that order (each
    count as many documents, within one), so that a chunk's gaps are closed form."""
    docs = np.asarray(docs, np.int64)
    count = int(_chosen_counts(infill.rate, infill.key, np.array([chunk]), np.array([chunk_docs]))[0])
    if not len(docs) or not count:
        return np.zeros(len(docs), np.int64)
    rank = permute(docs, chunk_docs, int(mix_key(infill.key, chunk, 1)[0]))
    low, high = infill.gaps
    return np.where(rank < count, low + rank % (high - low + 1), 0)


def infill_choice(infill: Infill | None, chunk: int, chunk_docs: int, docs: np.ndarray,
                  lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For documents ``docs`` of a chunk of ``chunk_docs`` documents with content ``lengths``:
    (gaps, gap starts, gap lengths): each document's gaps (:func:`infill_gaps`), then int64
    ``[docs, max gaps]`` arrays of each gap's first token and length in the content, in order and
    never overlapping (past a document's gaps: its length, and 0).

    A gap's length is uniform in ``gap_tokens``, at most the document's length over its gaps (so
    that they always fit); the tokens left unmasked are spread before, between and after the gaps
    at seeded offsets."""
    docs, lengths = np.asarray(docs, np.int64), np.asarray(lengths, np.int64)
    width = 0 if infill is None else infill.gaps[1]
    if infill is None or not len(docs):
        empty = np.zeros((len(docs), width), np.int64)
        return np.zeros(len(docs), np.int64), empty, empty.copy()
    gaps = infill_gaps(infill, chunk, chunk_docs, docs)
    column = np.arange(width, dtype=np.int64)
    valid = column < gaps[:, None]
    low, high = infill.gap_tokens
    drawn = low + (mix_key(infill.key, chunk, docs[:, None], 2 + column) % np.uint64(high - low + 1)).astype(np.int64)
    size = np.where(valid, np.minimum(drawn, (lengths // np.maximum(gaps, 1))[:, None]), 0)
    free = lengths - size.sum(axis=1)
    # Past a document's gaps the offset sorts last (free + 1): its gaps keep their columns.
    offset = (mix_key(infill.key, chunk, docs[:, None], 2 + width + column)
              % (free + 1).astype(np.uint64)[:, None]).astype(np.int64)
    offset = np.sort(np.where(valid, offset, (free + 1)[:, None]), axis=1)
    start = np.where(valid, offset + np.cumsum(size, axis=1) - size, lengths[:, None])
    return gaps, start, size


def collation_choice(template: Template, chunk: int, chunk_docs: int, docs: np.ndarray,
                     lengths: np.ndarray) -> Choice | None:
    """The FIM or infilling choice of documents ``docs`` of a chunk of ``chunk_docs`` documents
    with content ``lengths``; None for a template with neither."""
    if template.fim is not None:
        return fim_choice(template.fim, chunk, chunk_docs, docs, lengths)
    if template.infill is not None:
        return infill_choice(template.infill, chunk, chunk_docs, docs, lengths)
    return None


def _infill_added(infill: Infill, gaps: np.ndarray) -> np.ndarray:
    """Tokens infilling adds to documents of ``gaps`` gaps each."""
    return np.where(gaps > 0, infill.fixed_tokens + infill.gap_overhead * gaps, 0)


def added_tokens(template: Template, choice: Choice | None) -> np.ndarray | None:
    """Tokens FIM or infilling adds to each document of ``choice`` (None for no choice)."""
    if choice is None:
        return None
    if template.infill is not None:
        return _infill_added(template.infill, np.asarray(choice[0], np.int64))
    return FIM_SENTINELS * np.asarray(choice[0], np.int64)


def chunk_doc_added(template: Template, chunk: int, chunk_docs: int) -> np.ndarray:
    """Tokens FIM or infilling adds to each document of chunk ``chunk`` (of ``chunk_docs``
    documents), which depend on no document's length."""
    docs = np.arange(chunk_docs, dtype=np.int64)
    if template.infill is not None:
        return _infill_added(template.infill, infill_gaps(template.infill, chunk, chunk_docs, docs))
    if template.fim is not None:
        return added_tokens(template, fim_choice(template.fim, chunk, chunk_docs, docs, np.zeros(chunk_docs, np.int64)))
    return np.zeros(chunk_docs, np.int64)


def chunk_added(template: Template, chunks: np.ndarray, num_docs: np.ndarray) -> np.ndarray:
    """Tokens FIM or infilling adds to each of ``chunks`` (of ``num_docs`` documents), closed form."""
    if template.infill is not None:
        infill = template.infill
        count = _chosen_counts(infill.rate, infill.key, chunks, num_docs)
        # The gaps go round [low, high] over the chosen documents: full rounds, then a partial one.
        low, high = infill.gaps
        m = high - low + 1
        rest = count % m
        gaps = count * low + (count // m) * (m * (m - 1) // 2) + rest * (rest - 1) // 2
        return count * infill.fixed_tokens + gaps * infill.gap_overhead
    return FIM_SENTINELS * fim_counts(template.fim, chunks, num_docs)


# -- lengths (no tokens needed) -------------------------------------------------------------------

def stream_lengths(template: Template, num_tokens: np.ndarray, num_docs: np.ndarray,
                   num_parts: np.ndarray | None, added: np.ndarray) -> np.ndarray:
    """Rendered tokens of whole chunks or row groups from their stored counts: tokens, documents,
    parts per kind (``[n, kinds]``; None will do where ``template.counts_parts`` is false) and the
    tokens FIM or infilling adds (:func:`chunk_added`). ``n`` may be 0 (a dataset with no
    committed chunk yet, or a chunk without row groups): the result is then empty."""
    lengths = (np.asarray(num_tokens, np.int64) + np.asarray(num_docs, np.int64) * template.doc_overhead
               + np.asarray(added, np.int64))
    if template.counts_parts:
        if num_parts is None:
            raise ValueError("the template adds tokens around parts: their counts per kind are needed")
        kinds = len(template.part_overhead)   # not -1: numpy cannot infer it from an empty array
        lengths += np.asarray(num_parts, np.int64).reshape(len(num_tokens), kinds) @ template.part_overhead
    return lengths


def doc_lengths(template: Template, part_lengths: np.ndarray, part_kinds: np.ndarray,
                part_doc: np.ndarray, num_docs: int, added: np.ndarray | None = None) -> np.ndarray:
    """Rendered length of each document from its parts (``part_doc``: each part's document) and
    the tokens FIM or infilling adds to it (:func:`added_tokens`)."""
    per_part = np.asarray(part_lengths, np.int64) + template.part_overhead[np.asarray(part_kinds, np.int64)]
    lengths = np.bincount(part_doc, weights=per_part, minlength=num_docs).astype(np.int64) + template.doc_overhead
    if added is not None:
        lengths += added
    return lengths


def part_starts(template: Template, part_lengths: np.ndarray, part_kinds: np.ndarray,
                part_doc: np.ndarray) -> np.ndarray:
    """Rendered offset of each part's prefix within its document (FIM and infilled documents
    excepted)."""
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
           part_doc: np.ndarray, num_docs: int, fim: Choice | None = None) -> Rendered:
    """Render documents whose parts' contents are ``values`` back to back (parts in order).

    ``fim``: the choice of these documents (:func:`collation_choice`); FIM and infilled documents
    have one part. One gather over a pool of stored values and template tokens: no per-token Python.
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
    if template.infill is not None:
        i = template.infill
        pool_pieces += [token_array([] if t is None else [t]) for t in (i.cls, i.mask, i.sep, i.start, i.end)]
    piece_at = np.cumsum([0] + [len(p) for p in pool_pieces]) + len(values)
    piece_len = [len(p) for p in pool_pieces]
    constants = np.concatenate(pool_pieces).astype(np.int32)

    segments: list[tuple[np.ndarray, ...]] = []   # (doc, slot, source start, length, trains, order in slot)

    def add(doc: np.ndarray, slot: np.ndarray | int, start: np.ndarray | int, length: np.ndarray | int,
            trains: np.ndarray | bool, sub: np.ndarray | int = 0) -> None:
        n = len(doc)
        segments.append(tuple(np.broadcast_to(np.asarray(x), (n,)).astype(t) for x, t in (
            (doc, np.int64), (slot, np.int64), (start, np.int64), (length, np.int64), (trains, bool),
            (sub, np.int64))))

    all_docs = np.arange(num_docs, dtype=np.int64)
    trains_kind, suffix_trains = _trains(template, kinds, part_doc, num_docs)
    infilled = _infilled_docs(template, fim, num_docs)
    add(all_docs, 0, piece_at[0], len(template.doc_prefix), template.train_all & ~infilled)
    add(all_docs, _SLOTS * parts + 1, piece_at[1], len(template.doc_suffix), suffix_trains)

    base_slot = 1 + _SLOTS * index_in_doc
    prefix_len = np.array([len(p) for p in template.part_prefix], np.int64)
    suffix_len = np.array([len(s) for s in template.part_suffix], np.int64)
    add(part_doc, base_slot, piece_at[2 + 2 * kinds], prefix_len[kinds], template.train_all)
    add(part_doc, base_slot + _SLOTS - 1, piece_at[3 + 2 * kinds], suffix_len[kinds], trains_kind[kinds])

    plain = np.ones(parts, bool)
    if template.fim is not None and _has_special_docs(template, fim):
        selected, spm, a, b = (np.asarray(x) for x in fim)  # type: ignore[union-attr]
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
    if template.infill is not None and _has_special_docs(template, fim):
        gaps, gap_start, gap_size = (np.asarray(x) for x in fim)  # type: ignore[union-attr]
        infill_part = np.flatnonzero(gaps[part_doc] > 0)
        plain[infill_part] = False
        d, start, length = part_doc[infill_part], content_start[infill_part], part_lengths[infill_part]
        k, first, size = gaps[d], gap_start[d], gap_size[d]
        width = first.shape[1]
        slot = base_slot[infill_part] + 1
        cls, mask, sep, begin, end = (piece_at[-6 + j] for j in range(5))
        cls_len, mask_len, sep_len, begin_len, end_len = piece_len[-5:]
        each = template.infill.cls_each
        # In one slot, in this order: [cls] text_0 MASK text_1 MASK ... text_k [sep], then per gap
        # [cls] [start] content end.
        add(d, slot, cls, 0 if each else cls_len, False)
        ends = np.concatenate([np.zeros((len(d), 1), np.int64), first + size], axis=1)   # text j starts at ends[j]
        stops = np.concatenate([first, length[:, None]], axis=1)
        for j in range(width + 1):
            add(d, slot, start + ends[:, j], stops[:, j] - ends[:, j], False, 1 + 2 * j)
            if j < width:
                add(d, slot, mask, np.where(j < k, mask_len, 0), False, 2 + 2 * j)
        add(d, slot, sep, sep_len, False, 2 * width + 2)
        for j in range(width):
            valid, at = j < k, 2 * width + 3 + 4 * j
            add(d, slot, cls, np.where(valid & each, cls_len, 0), False, at)
            add(d, slot, begin, np.where(valid, begin_len, 0), False, at + 1)
            add(d, slot, start + first[:, j], size[:, j], True, at + 2)
            add(d, slot, end, np.where(valid, end_len, 0), True, at + 3)
    add(part_doc[plain], base_slot[plain] + 1, content_start[plain], part_lengths[plain], trains_kind[kinds[plain]])

    doc, slot, start, length, trains, sub = (np.concatenate(c) for c in zip(*segments))
    order = np.lexsort((sub, slot, doc))
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


def _has_special_docs(template: Template, choice: Choice | None) -> bool:
    """Whether any document of ``choice`` is rendered as FIM or infilled."""
    return (choice is not None and (template.fim is not None or template.infill is not None)
            and bool(np.asarray(choice[0]).any()))


def _infilled_docs(template: Template, choice: Choice | None, num_docs: int) -> np.ndarray:
    """Whether each document is infilled (its prompt side then never trains)."""
    if template.infill is None or choice is None:
        return np.zeros(num_docs, bool)
    return np.asarray(choice[0]) > 0


def _special_parts(template: Template, part_doc: np.ndarray, choice: Choice | None) -> tuple[np.ndarray, np.ndarray]:
    """(the parts of FIM or infilled documents, the tokens each part's content region gains)."""
    special = np.zeros(0, np.int64)
    added = np.zeros(len(part_doc), np.int64)
    if _has_special_docs(template, choice):
        special = np.flatnonzero(np.asarray(choice[0]).astype(bool)[part_doc])  # type: ignore[index]
        added[special] = added_tokens(template, choice)[part_doc[special]]  # type: ignore[index]
    return special, added


def rendered_doc_starts(template: Template, part_lengths: np.ndarray, part_kinds: np.ndarray, part_doc: np.ndarray,
                        num_docs: int, fim: Choice | None = None) -> np.ndarray:
    """Where each document starts in :func:`render_compact`'s tokens of the same parts, then
    their end (int64 ``[num_docs + 1]``), from the part layout alone."""
    part_doc = np.asarray(part_doc, np.int64)
    if not _has_special_docs(template, fim) and _one_part_each(part_doc, num_docs):
        kinds = np.asarray(part_kinds, np.int64)
        return cumulative(np.asarray(part_lengths, np.int64) + template.part_overhead[kinds] + template.doc_overhead)
    lengths = np.asarray(part_lengths, np.int64) + _special_parts(template, part_doc, fim)[1]
    return cumulative(doc_lengths(template, lengths, np.asarray(part_kinds, np.int64), part_doc, num_docs))


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
                   part_doc: np.ndarray, num_docs: int, fim: Choice | None = None
                   ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """:func:`render`'s result compactly, bitwise as ``render`` then narrowing gives: (tokens in
    :func:`stored_token_dtype` of ``values``' dtype, target flags or None when every token is a
    target, document starts).

    The tokens are written straight in their final dtype: template tokens (and FIM sentinels,
    infilling's special tokens) placed at offsets known from the part lengths, the stored values
    copied around them in runs (one per part; three per FIM part; two per gap and one more per
    infilled part), with no int32 pass, no ordering of pieces, no index per token and no flags for
    plain text.
    """
    values = np.asarray(values)
    lengths = np.asarray(part_lengths, np.int64)
    kinds = np.asarray(part_kinds, np.int64)
    part_doc = np.asarray(part_doc, np.int64)
    if (template.train_all and not template.counts_parts and not _has_special_docs(template, fim)
            and _one_part_each(part_doc, num_docs)):
        return _render_plain(template, values, lengths, num_docs)
    special_part, sentinels = _special_parts(template, part_doc, fim)
    doc_starts = rendered_doc_starts(template, lengths, kinds, part_doc, num_docs, fim)
    prefix_len = np.array([len(p) for p in template.part_prefix], np.int64)
    content_at = doc_starts[part_doc] + part_starts(template, lengths + sentinels, kinds, part_doc) + prefix_len[kinds]
    trains_kind, suffix_trains = _trains(template, kinds, part_doc, num_docs)
    part_trains = trains_kind[kinds]
    part_trains[special_part] = trains_kind[0]   # as render: FIM content trains as kind 0
    infilled = _infilled_docs(template, fim, num_docs)
    # Runs of stored values: (source offset, output offset, length, target flag).
    source = np.cumsum(lengths) - lengths
    runs = [(source, content_at, lengths, part_trains)]
    # Template pieces, each (tokens, where each copy starts, target flag of each copy).
    pieces = [(template.doc_prefix, doc_starts[:-1], template.train_all & ~infilled),
              (template.doc_suffix, doc_starts[1:] - len(template.doc_suffix), suffix_trains)]
    for kind, (prefix, suffix) in enumerate(zip(template.part_prefix, template.part_suffix)):
        if len(prefix) or len(suffix):
            of_kind = np.flatnonzero(kinds == kind)
            end = content_at[of_kind] + lengths[of_kind] + sentinels[of_kind]
            pieces += [(prefix, content_at[of_kind] - len(prefix), np.full(len(of_kind), template.train_all)),
                       (suffix, end, np.full(len(of_kind), trains_kind[kind]))]
    if len(special_part) and template.fim is not None and fim is not None:
        d = part_doc[special_part]
        begin, start, size = content_at[special_part], source[special_part], lengths[special_part]
        spm, cut_a, cut_b = (np.asarray(x)[d] for x in fim[1:4])
        # PSM: <PRE> P <SUF> S <MID> M      SPM: <PRE> <SUF> S <MID> P M   (P [0, a), M [a, b), S [b, size))
        suffix_at = begin + np.where(spm, 1, 1 + cut_a)
        middle_at = suffix_at + 1 + size - cut_b
        p_at = np.where(spm, middle_at + 1, begin + 1)
        m_at = np.where(spm, p_at + cut_a, middle_at + 1)
        fim_trains = np.full(len(special_part), trains_kind[0])
        runs = [tuple(np.delete(x, special_part) for x in runs[0]),   # the other parts' runs first
                (start, p_at, cut_a, fim_trains), (start + cut_b, suffix_at + 1, size - cut_b, fim_trains),
                (start + cut_a, m_at, cut_b - cut_a, fim_trains)]
        f, sentinel_trains = template.fim, np.full(len(special_part), template.train_all)
        pieces += [(token_array([f.prefix]), begin, sentinel_trains),
                   (token_array([f.suffix]), suffix_at, sentinel_trains),
                   (token_array([f.middle]), middle_at, sentinel_trains)]
    if len(special_part) and template.infill is not None and fim is not None:
        d = part_doc[special_part]
        infill_runs, infill_pieces = _infill_layout(template.infill, content_at[special_part], source[special_part],
                                                    lengths[special_part], *(np.asarray(x)[d] for x in fim))
        runs = [tuple(np.delete(x, special_part) for x in runs[0]), *infill_runs]   # the other parts' runs first
        pieces += infill_pieces
    pieces = [(p, at, t) for p, at, t in pieces if len(p) and len(at)]   # the pieces rendered at all
    # The stored values fit their own dtype: only the template's ids can need int32.
    dtype = stored_token_dtype(values.dtype, max((int(p.max()) for p, _, _ in pieces), default=None))
    tokens = np.empty(int(doc_starts[-1]), dtype)
    at, ids = _template_tokens([(p, starts) for p, starts, _ in pieces])
    tokens[at] = ids
    # train_all: every piece trains (but an infilled document's prompt side)
    trainable = None if template.train_all and not infilled.any() else np.empty(len(tokens), bool)
    if trainable is not None:
        trainable[at] = np.concatenate([np.repeat(t, len(p)) for p, _, t in pieces] + [np.zeros(0, bool)])
    src, out, n, t = (np.concatenate(x) for x in zip(*runs))
    content = _place_stored(tokens, values, at, src, out, n)
    if content is None:   # copied run by run
        if trainable is not None:
            for o, k, flag in zip(out.tolist(), n.tolist(), t.tolist()):
                trainable[o : o + k] = flag
    else:   # through the content mask: a FIM or infilled part's values reordered below
        if trainable is not None:
            trainable[content] = np.repeat(part_trains, lengths)
        if len(special_part):
            moved = slice(len(kinds) - len(special_part), None)   # the FIM or infilled parts' runs
            where = run_indices(out[moved], n[moved])
            tokens[where] = values[run_indices(src[moved], n[moved])]
            if trainable is not None:
                trainable[where] = np.repeat(t[moved], n[moved])
    return tokens, None if trainable is None or trainable.all() else trainable, doc_starts


def _infill_layout(infill: Infill, begin: np.ndarray, source: np.ndarray, size: np.ndarray, gaps: np.ndarray,
                   first: np.ndarray, gap_size: np.ndarray
                   ) -> tuple[list[tuple[np.ndarray, ...]], list[tuple[np.ndarray, np.ndarray, np.ndarray]]]:
    """Where the pieces of infilled parts go in :func:`render_compact`'s tokens: their runs of stored
    values (source offset, output offset, length, target flag) and their special tokens (ids, where
    each copy starts, target flags). ``begin``: where each part's content region starts, ``source``
    where its values start, ``size`` their count; the rest is its document's choice."""
    width = first.shape[1]
    valid = np.arange(width) < gaps[:, None]
    before = np.cumsum(gap_size, axis=1) - gap_size   # gap tokens before each gap
    each, has_cls, has_start = infill.cls_each, infill.cls is not None, infill.start is not None
    text_at = begin + int(has_cls and not each)
    # [cls] text_0 MASK text_1 MASK ... text_k [sep]: text j is values [ends[j], stops[j]), after j masks.
    ends = np.concatenate([np.zeros((len(begin), 1), np.int64), first + gap_size], axis=1)
    stops = np.concatenate([first, size[:, None]], axis=1)
    masked = np.concatenate([np.zeros((len(begin), 1), np.int64), np.cumsum(gap_size, axis=1)], axis=1)
    text_out = text_at[:, None] + ends - masked + np.arange(width + 1)
    mask_at = text_at[:, None] + first - before + np.arange(width)
    text_end = text_at + size - gap_size.sum(axis=1) + gaps
    # Then per gap: [cls] [start] content end.
    block = 1 + int(has_start) + int(has_cls and each)
    block_at = (text_end + int(infill.sep is not None))[:, None] + np.arange(width) * block + before
    content_at = block_at + block - 1
    texts = stops > ends
    runs = [((source[:, None] + ends)[texts], text_out[texts], (stops - ends)[texts], np.zeros(int(texts.sum()), bool)),
            ((source[:, None] + first)[valid], content_at[valid], gap_size[valid], np.ones(int(valid.sum()), bool))]
    count = int(valid.sum())
    pieces = [(token_array([infill.mask]), mask_at[valid], np.zeros(count, bool)),
              (token_array([infill.end]), (content_at + gap_size)[valid], np.ones(count, bool))]
    if infill.sep is not None:
        pieces.append((token_array([infill.sep]), text_end, np.zeros(len(begin), bool)))
    if has_start:
        pieces.append((token_array([infill.start]), (content_at - 1)[valid], np.zeros(count, bool)))
    if has_cls:
        cls_at = block_at[valid] if each else begin
        pieces.append((token_array([infill.cls]), cls_at, np.zeros(len(cls_at), bool)))
    return runs, pieces


def _place_in_order(values: np.ndarray, constants: np.ndarray, start: np.ndarray, length: np.ndarray,
                    out_start: np.ndarray, total: int) -> np.ndarray:
    """The gather of :func:`render` when the stored values keep their order (no FIM, no infilling): template
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
