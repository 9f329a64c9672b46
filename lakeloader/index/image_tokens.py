"""Image tokens from image metadata: how many placeholder tokens an image takes, and the size its
pixels are resized to, as pure functions of its stored width and height (after EXIF orientation)
and the dataset's :class:`~lakeloader.contracts.specs.ImageResolution`. Packing, example counts
and seeks use them without decoding an image; the loader resizes to the same sizes.

- ``fixed``: the image is resized to fit ``size`` keeping its aspect (:func:`fit_sizes`, then
  padded); its placeholders are the template's fixed count.
- ``patches``: the image is resized to ``rows x cols`` patches of ``patch_size`` pixels
  (:func:`patch_grids`): each side rounded to a multiple of the patch size, then scaled as a whole
  (keeping the aspect) into ``[min_pixels, max_pixels]`` and at most ``max_patches`` patches; one
  placeholder per patch. The upper bounds always hold (they bound a batch's memory); the lower
  one holds unless the upper ones forbid it or the image's aspect is beyond the patch grid.
"""

from __future__ import annotations

import numpy as np

from lakeloader.contracts.chunk_file import ChunkParts
from lakeloader.contracts.errors import InputError
from lakeloader.contracts.specs import ImageResolution, Template


def patch_grids(widths: np.ndarray, heights: np.ndarray, resolution: ImageResolution) -> tuple[np.ndarray, np.ndarray]:
    """(rows, cols) of patches each image (``widths``, ``heights``: positive ints) is resized to
    under a ``patches`` resolution: int64 arrays, ``1 <= rows * cols <= resolution.patch_cap``."""
    p = resolution.patch_size
    w = np.asarray(widths, np.float64)
    h = np.asarray(heights, np.float64)
    if len(w) and (w.min() < 1 or h.min() < 1):
        raise ValueError("image widths and heights must be positive")
    cap = resolution.patch_cap
    floor = min(cap, -(-resolution.min_pixels // (p * p)))
    rows = np.maximum(1, np.rint(h / p)).astype(np.int64)
    cols = np.maximum(1, np.rint(w / p)).astype(np.int64)
    # Too many patches: both sides scaled down by one factor (the aspect kept), rounded down.
    big = rows * cols > cap
    shrink = np.sqrt(h * w / (cap * p * p))
    rows = np.where(big, np.maximum(1, np.floor(h / shrink / p)), rows).astype(np.int64)
    cols = np.where(big, np.maximum(1, np.floor(w / shrink / p)), cols).astype(np.int64)
    # Too few: scaled up by one factor, rounded up, where that stays within the cap; then a grid
    # still over it (an extreme aspect, pinned at one patch a side) cut along its long side.
    grow = np.sqrt(floor * p * p / (h * w))
    grown_rows, grown_cols = np.ceil(h * grow / p).astype(np.int64), np.ceil(w * grow / p).astype(np.int64)
    small = (rows * cols < floor) & (grown_rows * grown_cols <= cap)
    rows, cols = np.where(small, grown_rows, rows), np.where(small, grown_cols, cols)
    wide = cols >= rows
    cols = np.where((rows * cols > cap) & wide, np.maximum(1, cap // rows), cols)
    rows = np.where(rows * cols > cap, np.maximum(1, cap // cols), rows)
    return rows, cols


def fit_sizes(widths: np.ndarray, heights: np.ndarray, size: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(width, height) of each image resized to fit ``size`` (height, width) keeping its aspect:
    the larger of the two scales that fit, rounded, at least 1 pixel a side (int64)."""
    box_h, box_w = size
    w = np.asarray(widths, np.float64)
    h = np.asarray(heights, np.float64)
    scale = np.minimum(box_w / w, box_h / h)
    fit_w = np.clip(np.rint(w * scale), 1, box_w).astype(np.int64)
    fit_h = np.clip(np.rint(h * scale), 1, box_h).astype(np.int64)
    return fit_w, fit_h


def image_token_counts(widths: np.ndarray, heights: np.ndarray, resolution: ImageResolution,
                       fixed_tokens: int) -> np.ndarray:
    """Placeholder tokens of each image (int64): ``fixed_tokens`` each under a ``fixed``
    resolution, its patch count under ``patches``."""
    if resolution.kind == "fixed":
        return np.full(len(np.asarray(widths)), fixed_tokens, np.int64)
    rows, cols = patch_grids(widths, heights, resolution)
    return rows * cols


def _image_parts(template: Template, parts: ChunkParts) -> np.ndarray:
    """Indices of the image parts of ``parts``, checked to have their sizes and no stored tokens."""
    images = np.flatnonzero(parts.part_kinds == template.image_kind)
    if parts.part_widths is None or parts.part_heights is None:
        raise InputError("the chunk has no part_widths/part_heights columns: its images are not stored in the lake, "
                         "so interleaved.resolution kind 'patches' cannot size them; set interleaved.images: stored "
                         "and build, or use resolution kind 'fixed'")
    if len(images) and (parts.part_lengths[images].any() or parts.part_widths[images].min() < 1
                        or parts.part_heights[images].min() < 1):
        raise InputError("an image part holds tokens or has no size: the chunk file is not as the media contract says")
    return images


def with_image_tokens(template: Template, parts: ChunkParts) -> ChunkParts:
    """``parts`` with each image part's length its placeholder count under the template's
    :class:`~lakeloader.contracts.specs.ImageRun` (unchanged without one): the layout the
    rendering of :func:`with_image_values` has, from which lengths, image spans and packing plans
    follow as for any part."""
    if template.image_run is None:
        return parts
    images = _image_parts(template, parts)
    assert parts.part_widths is not None and parts.part_heights is not None
    lengths = parts.part_lengths.copy()
    lengths[images] = image_token_counts(parts.part_widths[images], parts.part_heights[images],
                                         template.image_run.resolution, 0)
    return ChunkParts(lengths, parts.part_kinds, parts.part_doc, parts.num_docs, parts.part_widths, parts.part_heights)


def with_image_values(template: Template, values: np.ndarray, parts: ChunkParts) -> tuple[np.ndarray, ChunkParts]:
    """Stored ``values`` of ``parts`` with each image part's placeholder run put in as its content
    (:func:`with_image_tokens`' layout), so that rendering places runs of any length as it places
    stored tokens; unchanged without an :class:`~lakeloader.contracts.specs.ImageRun`."""
    if template.image_run is None:
        return values, parts
    expanded = with_image_tokens(template, parts)
    token = template.image_run.token
    dtype = values.dtype if values.dtype.kind in "ui" and token <= np.iinfo(values.dtype).max else np.dtype(np.int32)
    is_image = np.repeat(expanded.part_kinds == template.image_kind, expanded.part_lengths)
    out = np.empty(len(is_image), dtype)
    out[is_image] = token
    out[~is_image] = values
    out.setflags(write=False)
    return out, expanded
