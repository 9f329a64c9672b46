"""How a chunk's documents become examples under ``packing: pack | pad``: the packing plan of one
chunk from its documents' stored part lengths and the collation template (no tokens needed).

The build computes each chunk's plan for the config's loader and stores the counts in the catalog
(``chunk_examples``); the loader recomputes the same plan for a chunk it reads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np

from lakeloader.contracts.chunk_file import ChunkParts, PlanStats
from lakeloader.contracts.errors import InputError
from lakeloader.index.packing import DocumentTooLong, PackPlan, plan_pack
from lakeloader.index.render import Template, doc_lengths, fim_choice, part_starts


@dataclasses.dataclass(frozen=True, eq=False)
class PackingSpec:
    """Everything that decides a chunk's packing plan (hashable into ``plan_key``)."""

    seq_len: int
    mode: str                   # pack | pad
    algorithm: str              # first_fit | best_fit
    window: int
    long_documents: str         # truncate | split | error
    template: Template
    max_images: int | None = None

    @property
    def plan_key(self) -> str:
        """Id of this plan in the catalog."""
        payload = {
            "seq_len": self.seq_len, "mode": self.mode, "algorithm": self.algorithm,
            "window": self.window if self.mode == "pack" else None, "long_documents": self.long_documents,
            "template": self.template.fingerprint, "max_images": self.max_images,
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]

    def to_json(self) -> str:
        """The spec's settings for the catalog's ``packing_plans`` table (readable, not parsed)."""
        return json.dumps({
            "seq_len": self.seq_len, "mode": self.mode, "algorithm": self.algorithm, "window": self.window,
            "long_documents": self.long_documents, "template": self.template.fingerprint,
            "max_images": self.max_images,
        }, sort_keys=True)


def rendered_doc_lengths(template: Template, parts: ChunkParts, chunk: int) -> tuple[np.ndarray, np.ndarray | None]:
    """(rendered length of each document of a whole chunk, FIM choice or None)."""
    fim = None
    if template.fim is not None:
        fim = fim_choice(template.fim, chunk, parts.num_docs, np.arange(parts.num_docs), parts.content_lengths)
    lengths = doc_lengths(template, parts.part_lengths, parts.part_kinds, parts.part_doc, parts.num_docs,
                          None if fim is None else fim[0])
    return lengths, fim


def image_spans(template: Template, parts: ChunkParts) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(document, start, stop) of every image's rendered run, sorted by document and start."""
    starts = part_starts(template, parts.part_lengths, parts.part_kinds, parts.part_doc)
    images = np.flatnonzero(parts.part_kinds == template.image_kind)
    overhead = template.part_overhead[parts.part_kinds[images]] + parts.part_lengths[images]
    return parts.part_doc[images], starts[images], starts[images] + overhead


def plan_chunk(spec: PackingSpec, parts: ChunkParts, chunk: int, where: str = "") -> PackPlan:
    """The packing plan of chunk ``chunk`` (global index) whose documents have ``parts``;
    ``where`` names the chunk in errors."""
    lengths, _ = rendered_doc_lengths(spec.template, parts, chunk)
    images: dict[str, np.ndarray | int | None] = {}
    if spec.template.image_kind is not None:
        doc, start, stop = image_spans(spec.template, parts)
        images = {"image_doc": doc, "image_start": start, "image_stop": stop, "max_images": spec.max_images}
    try:
        return plan_pack(lengths, spec.seq_len, mode=spec.mode, algorithm=spec.algorithm, window=spec.window,
                         long_documents=spec.long_documents, **images)
    except DocumentTooLong as exc:
        raise InputError(f"{where or f'chunk {chunk}'}: {exc}") from None


def plan_stats(spec: PackingSpec, parts: ChunkParts, chunk: int, where: str = "") -> PlanStats:
    """The catalog row of chunk ``chunk``'s plan under ``spec``."""
    plan = plan_chunk(spec, parts, chunk, where)
    return PlanStats(spec.plan_key, plan.num_examples, int(plan.example_tokens.sum()),
                     plan.truncated_docs, plan.dropped_tokens, plan.split_docs)
