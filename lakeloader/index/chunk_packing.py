"""How a chunk's documents become examples under ``packing: pack | pad``: the packing plan of one
chunk from its documents' stored part lengths and the collation template (no tokens needed),
under a :class:`lakeloader.contracts.specs.PackingSpec`.

The build computes each chunk's plan for the config's loader and stores the counts in the catalog
(``chunk_examples``); the loader recomputes the same plan for a chunk it reads.
"""

from __future__ import annotations

import numpy as np

from lakeloader.contracts.chunk_file import ChunkParts, PlanStats
from lakeloader.contracts.errors import InputError
from lakeloader.contracts.specs import PackingSpec, Template
from lakeloader.index.image_tokens import with_image_tokens
from lakeloader.index.packing import DocumentTooLong, PackPlan, plan_pack
from lakeloader.index.render import Choice, added_tokens, collation_choice, doc_lengths, part_starts


def rendered_doc_lengths(template: Template, parts: ChunkParts, chunk: int) -> tuple[np.ndarray, Choice | None]:
    """(rendered length of each document of a whole chunk, FIM or infilling choice or None)."""
    choice = collation_choice(template, chunk, parts.num_docs, np.arange(parts.num_docs), parts.content_lengths)
    lengths = doc_lengths(template, parts.part_lengths, parts.part_kinds, parts.part_doc, parts.num_docs,
                          added_tokens(template, choice))
    return lengths, choice


def image_spans(template: Template, parts: ChunkParts) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(document, start, stop) of every image's rendered run, sorted by document and start."""
    starts = part_starts(template, parts.part_lengths, parts.part_kinds, parts.part_doc)
    images = np.flatnonzero(parts.part_kinds == template.image_kind)
    overhead = template.part_overhead[parts.part_kinds[images]] + parts.part_lengths[images]
    return parts.part_doc[images], starts[images], starts[images] + overhead


def plan_chunk(spec: PackingSpec, parts: ChunkParts, chunk: int, where: str = "") -> PackPlan:
    """The packing plan of chunk ``chunk`` (global index) whose documents have ``parts``;
    ``where`` names the chunk in errors. Images take their placeholder counts from their stored
    sizes under the template's resolution (:func:`~lakeloader.index.image_tokens.with_image_tokens`)."""
    try:
        parts = with_image_tokens(spec.template, parts)
    except InputError as exc:
        raise InputError(f"{where or f'chunk {chunk}'}: {exc}") from None
    lengths, _ = rendered_doc_lengths(spec.template, parts, chunk)
    images: dict[str, np.ndarray | int | None] = {}
    if spec.template.image_kind is not None:
        doc, start, stop = image_spans(spec.template, parts)
        images = {"image_doc": doc, "image_start": start, "image_stop": stop, "max_images": spec.max_images}
    try:
        return plan_pack(lengths, spec.seq_len, mode=spec.mode, algorithm=spec.algorithm, open_examples=spec.open_examples,
                         long_documents=spec.long_documents, **images)
    except DocumentTooLong as exc:
        raise InputError(f"{where or f'chunk {chunk}'}: {exc}") from None


ITEM_FIELDS = ("doc", "start", "stop", "begin", "end", "group_key", "group_doc")
GROUP_BITS = 32   # a group key is chunk << GROUP_BITS | row group


def item_table(plan: PackPlan, group_first_docs: np.ndarray, chunk: int) -> np.ndarray:
    """Where each item of chunk ``chunk``'s ``plan`` lies in the chunk's rendered row groups
    (``group_first_docs``: the first document of each), as int64 [len(ITEM_FIELDS), items], read-only:
    the item's document, its rendered range ``[start, stop)`` in the document, the tokens
    ``[begin, end)`` of its row group's rendering it reads (one past ``stop`` while the document
    goes on: the last target), the row group as a key unique in the lake (``chunk <<
    GROUP_BITS | group``) and the document's index within the row group."""
    doc = plan.item_doc
    group = np.searchsorted(group_first_docs, doc, side="right") - 1
    group_doc = doc - group_first_docs[group]
    group_at = plan.doc_offsets[group_first_docs[group]]
    doc_begin = plan.doc_offsets[doc] - group_at
    begin = doc_begin + plan.item_start
    end = np.minimum(doc_begin + plan.item_stop + 1, plan.doc_offsets[doc + 1] - group_at)
    table = np.stack([doc, plan.item_start, plan.item_stop, begin, end, (chunk << GROUP_BITS) | group, group_doc])
    table.setflags(write=False)
    return table


def plan_stats(spec: PackingSpec, parts: ChunkParts, chunk: int, where: str = "") -> PlanStats:
    """The catalog row of chunk ``chunk``'s plan under ``spec``."""
    plan = plan_chunk(spec, parts, chunk, where)
    return PlanStats(spec.plan_key, plan.num_examples, int(plan.example_tokens.sum()),
                     plan.truncated_docs, plan.dropped_tokens, plan.split_docs)
