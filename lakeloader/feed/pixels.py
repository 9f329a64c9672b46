"""The pixel fill of interleaved datasets whose images are stored in the lake: after a batch's rows
are written, the images they place (``image_positions``) are read from their chunks' media files
(:mod:`lakeloader.read.media`), decoded by the one conversion to RGB (:func:`lakeloader.images.decode_rgb`),
resized by the dataset's resolution (:mod:`lakeloader.index.image_tokens`) and written into
fixed-shape uint8 arrays, so a jitted step never recompiles:

- ``fixed``: ``pixel_values [rows, max_images, H, W, 3]``, each image resized (bicubic) to fit
  ``H x W`` keeping its aspect, at the top left, zeros around it;
- ``patches``: ``pixel_patches [rows, max_patches, patch*patch*3]``, each image resized (bicubic)
  to its grid of patches and cut into them row by row (each patch ``[patch, patch, 3]`` flattened),
  the row's images one after another; ``patch_image [rows, max_patches]`` (which image of the row,
  -1: none) and ``patch_grid [rows, max_patches, 2]`` (the patch's row and column in its image's
  grid, -1: none). A row's ``max_patches`` is ``min(seq_len, max_images * resolution.patch_cap)``:
  every patch is a token of the row, so a row never has more;
- ``image_mask [rows, max_images]`` (bool): the image has pixels here.

Only the images of the rows built are read and decoded; resized images are kept in a byte-bounded
LRU (``loader.image_cache_bytes``). Pixels are a function of the image's bytes, the resolution and
:data:`lakeloader.images.DECODER` alone, so they are bitwise the same in any process.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Sequence

import numpy as np
from PIL import Image

from lakeloader.contracts.errors import ChunkIntegrityError
from lakeloader.contracts.specs import ImageResolution
from lakeloader.feed.rows import ArraySource, Batch
from lakeloader.images import BadImage, decode_rgb
from lakeloader.index.image_tokens import fit_sizes, patch_grids
from lakeloader.read.lru import LRU
from lakeloader.read.media import MediaFiles

PIXEL_FIELDS = ("pixel_values", "pixel_patches", "patch_image", "patch_grid", "image_mask")
RESAMPLE = Image.Resampling.BICUBIC
READ_AHEAD_BYTES = 8 << 20   # an image batch's stored bytes read before they are decoded, at most (about)


@dataclasses.dataclass(frozen=True)
class PlacedImage:
    """An image a batch row places: its row, its number in the row, the chunk file it is stored
    beside (a lake path) and its id."""

    row: int
    number: int
    chunk_path: str
    image: str


class PixelFill:
    """Writes the pixels of a batch's stored images under one resolution."""

    def __init__(self, media: MediaFiles, resolution: ImageResolution, max_images: int, seq_len: int,
                 cache_bytes: int, max_pixels: int) -> None:
        self.media = media
        self.resolution = resolution
        self.max_images = max_images
        self.max_pixels = max_pixels
        self.row_patches = min(seq_len, max_images * resolution.patch_cap)
        self._images: LRU[str, np.ndarray] = LRU(cache_bytes, lambda pixels: pixels.nbytes)

    def empty(self, pool: ArraySource, rows: int) -> Batch:
        """The pixel fields of a batch of ``rows`` rows from ``pool`` (the pixels' memory left as
        it is: :meth:`fill` writes every byte of it)."""
        fields: Batch = {}
        if self.resolution.kind == "fixed":
            height, width = self.resolution.size
            fields["pixel_values"] = pool.empty((rows, self.max_images, height, width, 3), np.uint8)
        else:
            p = self.resolution.patch_size
            fields["pixel_patches"] = pool.empty((rows, self.row_patches, p * p * 3), np.uint8)
            fields["patch_image"] = pool.full((rows, self.row_patches), -1, np.int32)
            fields["patch_grid"] = pool.full((rows, self.row_patches, 2), -1, np.int32)
        fields["image_mask"] = pool.full((rows, self.max_images), False, np.bool_)
        return fields

    def fill(self, batch: Batch, placed: Sequence[PlacedImage]) -> None:
        """Write the pixels of ``placed`` (in each row, in the order of its ``image_positions``),
        and zeros everywhere else (each byte written once: no zeroing pass before)."""
        patches_at = np.zeros(len(batch["image_mask"]), np.int64)
        for image, pixels in zip(placed, self._all_pixels(placed)):
            if self.resolution.kind == "fixed":
                height, width = pixels.shape[:2]
                slot = batch["pixel_values"][image.row, image.number]
                slot[:height, :width] = pixels
                if width < slot.shape[1]:   # (an empty slice's assignment costs a microsecond too)
                    slot[:height, width:] = 0
                if height < slot.shape[0]:
                    slot[height:] = 0
            else:
                rows, cols = pixels.shape[0], pixels.shape[1]
                at = int(patches_at[image.row])
                n = rows * cols
                if at + n > self.row_patches:   # (packing keeps a row's patches within its tokens)
                    raise AssertionError(f"row {image.row}: {at + n} patches, more than {self.row_patches}")
                batch["pixel_patches"][image.row, at : at + n] = pixels.reshape(n, -1)
                batch["patch_image"][image.row, at : at + n] = image.number
                grid = batch["patch_grid"][image.row, at : at + n]
                grid[:, 0] = np.repeat(np.arange(rows, dtype=np.int32), cols)
                grid[:, 1] = np.tile(np.arange(cols, dtype=np.int32), rows)
                patches_at[image.row] += n
            batch["image_mask"][image.row, image.number] = True
        if self.resolution.kind == "fixed":
            batch["pixel_values"][~batch["image_mask"]] = 0
        else:
            for row, at in enumerate(patches_at.tolist()):
                batch["pixel_patches"][row, at:] = 0

    def _all_pixels(self, placed: Sequence[PlacedImage]) -> Iterator[np.ndarray]:
        """Each image of ``placed`` resized by the resolution (uint8, read-only, cached): ``[h, w, 3]``
        fitted under ``fixed``; ``[rows, cols, patch*patch*3]`` patches under ``patches``. The bytes
        of those not cached are read first, :data:`READ_AHEAD_BYTES` at a time, then each is decoded
        when it is asked for: each pass's code and data stay in the CPU's caches (5 % of the fill
        against reading and decoding in turn), and one image's pixels at a time are held."""
        found = self._images.cached([image.image for image in placed])
        start = 0
        while start < len(placed):
            data: dict[str, bytes] = {}
            held, stop = 0, start
            while stop < len(placed) and held < READ_AHEAD_BYTES:
                image = placed[stop]
                if found[stop] is None and image.image not in data:
                    data[image.image] = self.media.image_bytes(image.chunk_path, image.image)
                    held += len(data[image.image])
                stop += 1
            for image, pixels in zip(placed[start:stop], found[start:stop]):
                yield pixels if pixels is not None else self._images.get(
                    image.image, lambda: self._resized(image, data[image.image]))  # noqa: B023 - called at once
            start = stop

    def _resized(self, image: PlacedImage, data: bytes) -> np.ndarray:
        try:
            decoded = decode_rgb(data, self.max_pixels)
        except BadImage as exc:   # checked when built: these bytes decoded then
            raise ChunkIntegrityError(f"image {image.image[:16]}… of chunk {image.chunk_path} no longer decodes "
                                      f"({exc}): is the installed Pillow another build than the lake's?") from None
        if self.resolution.kind == "fixed":
            out = _array(decoded.resize(_fit(*decoded.size, self.resolution.size), RESAMPLE))
        else:
            p = self.resolution.patch_size
            rows, cols = _grid(*decoded.size, self.resolution)
            resized = _array(decoded.resize((cols * p, rows * p), RESAMPLE))
            out = np.ascontiguousarray(resized.reshape(rows, p, cols, p, 3).transpose(0, 2, 1, 3, 4)
                                       ).reshape(rows, cols, p * p * 3)
        out.setflags(write=False)
        return out


def _array(image: Image.Image) -> np.ndarray:
    """An RGB image's pixels, ``[height, width, 3]`` uint8 (read-only): its bytes as they are,
    without ``np.asarray``'s array interface (a tenth more for the same bytes)."""
    return np.frombuffer(image.tobytes(), np.uint8).reshape(image.height, image.width, 3)


# Sizes repeat across a lake's images: one image's fit or grid is a dict lookup, not numpy on arrays of one.
@functools.lru_cache(maxsize=4096)
def _fit(width: int, height: int, size: tuple[int, int]) -> tuple[int, int]:
    fit_w, fit_h = fit_sizes(np.array([width]), np.array([height]), size)
    return int(fit_w[0]), int(fit_h[0])


@functools.lru_cache(maxsize=4096)
def _grid(width: int, height: int, resolution: ImageResolution) -> tuple[int, int]:
    rows, cols = patch_grids(np.array([width]), np.array([height]), resolution)
    return int(rows[0]), int(cols[0])
