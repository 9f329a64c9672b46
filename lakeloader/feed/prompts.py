"""The prompt side of an evaluation pass (``evaluation.prompts``): each row's document cut where
generation starts, for a generation eval off the same lake. Under ``packing: pad`` a row holds
one document from position 0; its first training target marks the cut (a supervised document's
response, an infilled document's first gap), so the prompt is every token before it and the
reference the rest of the rendered document. A row's images stay as the row places them."""

from __future__ import annotations

import numpy as np

from lakeloader.feed.pixels import PIXEL_FIELDS
from lakeloader.feed.rows import Batch

PROMPT_FIELDS = ("input_ids", "prompt_lengths", "references", "reference_lengths")


def prompt_batch(batch: Batch, pad_id: int) -> Batch:
    """``batch`` (rows of ``packing: pad``, with ``targets``, ``loss_mask`` and ``segment_ids``)
    as prompts: ``input_ids`` each row's prompt, left-aligned and padded with ``pad_id``;
    ``prompt_lengths`` its length; ``references`` the tokens after it, left-aligned and padded;
    ``reference_lengths`` theirs. A row without a training target is all prompt (an empty
    reference); a padding row of the pass is empty on both sides. ``dataset_ids``,
    ``example_mask`` and an interleaved row's images (``image_refs``, ``image_positions``, the
    pixel fields) are kept as they are: the prompt keeps the row's positions, so an image at a
    position before ``prompt_lengths`` is in the prompt, one at or after it in the reference."""
    inputs, targets = batch["input_ids"], batch["targets"]
    rows, length = inputs.shape
    valid = batch["segment_ids"] > 0                    # the row's document, from position 0
    lengths = valid.sum(axis=1)                          # input tokens of each row
    trains = (batch["loss_mask"] > 0) & valid
    first = np.where(trains.any(axis=1), trains.argmax(axis=1), lengths)
    # Input i predicts target i (token i + 1): the prompt ends with the input token before the
    # first trained target; the reference is that target and every later one.
    prompt_lengths = np.where(lengths > 0, np.minimum(first + 1, lengths), 0)
    reference_lengths = np.maximum(lengths - first, 0) * (lengths > 0)
    positions = np.arange(length)
    prompts = np.where(positions < prompt_lengths[:, None], inputs, pad_id).astype(np.int32)
    shift = np.minimum(first, length - 1)[:, None]
    taken = np.take_along_axis(targets, np.minimum(positions + shift, length - 1), axis=1)
    references = np.where(positions < reference_lengths[:, None], taken, pad_id).astype(np.int32)
    found: Batch = {"input_ids": prompts, "prompt_lengths": prompt_lengths.astype(np.int32),
                    "references": references, "reference_lengths": reference_lengths.astype(np.int32)}
    for name in ("dataset_ids", "example_mask", "image_refs", "image_positions", *PIXEL_FIELDS):
        if name in batch:
            found[name] = batch[name]
    return found
