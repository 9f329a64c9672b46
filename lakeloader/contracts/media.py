"""The media contract between the build and every reader of an interleaved dataset whose images
are stored in the lake (``interleaved.images: stored``).

A chunk's images live in one **media file** beside its chunk file (:func:`media_path`): a Parquet
file with one row per distinct image of the chunk, in order of first use, one row group per image
(so reading one image is one ranged read of its ``bytes`` column chunk), no dictionary, no
compression of the bytes (they are compressed already), page checksums. An image is addressed by
its **image id**, the sha256 of its original bytes (:func:`image_id`): the same image used twice in
a chunk is stored once. At a build's end each chunk holding images that a lower chunk of its dataset
holds too gets a **deduplicated media file** (:func:`deduped_media_path`, recorded in the catalog's
``media_files``): its media file without those images, so each image is stored once per dataset.
An image's **home** is the media file of the lowest chunk holding it; a deduplicated file's footer
names the home of each image of its chunk it no longer holds (:data:`MEDIA_HOMES_KEY`). The chunk file's ``part_refs`` column holds an image part's id; its
``part_widths`` and ``part_heights`` columns hold the image's size after EXIF orientation (0 for a
text part), so packing and seeks are planned from the chunk file without reading a pixel.
"""

from __future__ import annotations

import hashlib

import pyarrow as pa

# Columns of a media file (one row, and one row group, per distinct image of the chunk).
MEDIA_ID_COLUMN = "image_id"        # sha256 hex of the original bytes
MEDIA_BYTES_COLUMN = "bytes"        # the original (compressed) file bytes, as read at build time
MEDIA_WIDTH_COLUMN = "width"        # after EXIF orientation
MEDIA_HEIGHT_COLUMN = "height"
MEDIA_FORMAT_COLUMN = "format"      # Pillow's format name: JPEG, PNG, WEBP, GIF, ...
MEDIA_MODE_COLUMN = "mode"          # Pillow's mode of the stored image: RGB, L, P, RGBA, CMYK, I;16, ...
MEDIA_SCHEMA = pa.schema([
    (MEDIA_ID_COLUMN, pa.string()), (MEDIA_BYTES_COLUMN, pa.binary()),
    (MEDIA_WIDTH_COLUMN, pa.int32()), (MEDIA_HEIGHT_COLUMN, pa.int32()),
    (MEDIA_FORMAT_COLUMN, pa.string()), (MEDIA_MODE_COLUMN, pa.string()),
])
# Chunk-file columns of an interleaved dataset with stored images, per part like part_lengths.
PART_WIDTHS_COLUMN = "part_widths"
PART_HEIGHTS_COLUMN = "part_heights"
MEDIA_SUFFIX = ".media.parquet"
# Key of a deduplicated media file's footer metadata: JSON, image id -> the lake path of its home
# (the media file holding it), for each image of the chunk the file no longer holds.
MEDIA_HOMES_KEY = b"lakeloader.homes"
# The default of ``interleaved.max_pixels``: an image of more pixels is refused before its pixels are
# decoded (Pillow's check of a decompression bomb, made exact). Here, not in images.py, so the
# config (beside images.py in the foundation) can name it.
DEFAULT_MAX_PIXELS = 64 * 1024 * 1024


def image_id(data: bytes) -> str:
    """The id of an image: the sha256 (hex) of its original bytes."""
    return hashlib.sha256(data).hexdigest()


def media_path(chunk_path: str) -> str:
    """The media file of the chunk file at ``chunk_path`` (a path or a name inside the lake)."""
    if not chunk_path.endswith(".parquet"):
        raise ValueError(f"chunk path {chunk_path!r} does not end in .parquet")
    return chunk_path[: -len(".parquet")] + MEDIA_SUFFIX


def deduped_media_path(chunk_path: str, checksum: str) -> str:
    """The deduplicated media file of the chunk file at ``chunk_path`` whose sha256 is ``checksum``
    (named by its content, so rewriting it again gives the same name)."""
    return media_path(chunk_path)[: -len(".parquet")] + f".{checksum[:16]}.parquet"
