"""Images decoded the same way everywhere: at build time to check an image and record its size,
in the loader to make pixels. One decoder (Pillow) and one conversion to RGB, so a pixel depends
only on the image's bytes and :data:`DECODER` (which the loader's fingerprint includes: a decoder
upgrade is never a silent change of data).

The conversion: the first frame of an animated image; EXIF orientation applied; 16-bit and 32-bit
grayscale scaled to 8 bits (the high byte); palette images expanded; CMYK converted by Pillow's
formula; an alpha channel composited onto white; grayscale repeated into three channels.
"""

from __future__ import annotations

import dataclasses
import io
import warnings

import numpy as np
import PIL
from PIL import ExifTags, Image, features

from lakeloader.contracts.media import DEFAULT_MAX_PIXELS

__all__ = ["DECODER", "DEFAULT_MAX_PIXELS", "BadImage", "ImageInfo", "decode_rgb", "inspect_image"]

DECODER = f"Pillow {PIL.__version__}; libjpeg {features.version('jpg')}; zlib {features.version('zlib')}; " \
          f"libwebp {features.version('webp')}"


class BadImage(ValueError):
    """An image that cannot be used: its reason, in words (no location; the caller adds it)."""


@dataclasses.dataclass(frozen=True)
class ImageInfo:
    """What the catalog records of an image, from decoding it once."""

    width: int          # after EXIF orientation
    height: int
    format: str         # JPEG, PNG, WEBP, GIF, ...
    mode: str           # the stored mode, before conversion to RGB
    num_bytes: int


def _open(data: bytes, max_pixels: int) -> Image.Image:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > max_pixels:
                raise BadImage(f"{width}x{height} pixels is more than max_pixels={max_pixels} "
                               "(a decompression bomb, or raise interleaved.max_pixels)")
            image.seek(0)
            image.load()
    except BadImage:
        raise
    except Image.UnidentifiedImageError:
        raise BadImage("is not an image format Pillow can identify (JPEG, PNG, WEBP, GIF, ...)") from None
    except Image.DecompressionBombError as exc:
        raise BadImage(f"decompression bomb ({exc})") from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombWarning, EOFError) as exc:
        raise BadImage(f"cannot be decoded ({type(exc).__name__}: {exc})") from None
    return image


def inspect_image(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> ImageInfo:
    """The size (after EXIF orientation), format and mode of the image in ``data``, decoding all of
    its first frame once; :class:`BadImage` if it is truncated, undecodable or too large."""
    image = _open(data, max_pixels)
    width, height = image.size
    if _orientation(image) in _TRANSPOSING:
        width, height = height, width
    return ImageInfo(width, height, str(image.format), image.mode, len(data))


# How each EXIF orientation is undone (``ImageOps.exif_transpose``'s table); 1 and others: as stored.
_TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
# Those that swap width and height.
_TRANSPOSING = frozenset({5, 6, 7, 8})


def _orientation(image: Image.Image) -> int:
    """The image's EXIF orientation tag (1 when absent), read as ``ImageOps.exif_transpose`` reads
    it, so an image whose size is recorded at build time decodes at that size in the loader."""
    try:
        return int(image.getexif().get(ExifTags.Base.Orientation, 1))
    except (OSError, ValueError, SyntaxError, KeyError, TypeError) as exc:
        raise BadImage(f"has unreadable EXIF data ({type(exc).__name__}: {exc})") from None


def _oriented(image: Image.Image) -> Image.Image:
    """The image as displayed: transposed by its orientation tag, itself (no copy) when none."""
    method = _TRANSPOSE.get(_orientation(image))
    return image if method is None else image.transpose(method)


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        array = np.asarray(image)
        if image.mode == "F":
            array = np.clip(array, 0, 255).astype(np.uint8)
        else:
            bits = 16 if image.mode.startswith("I;16") else 32
            array = (array.astype(np.int64) >> (bits - 8)).clip(0, 255).astype(np.uint8)
        image = Image.fromarray(array, "L")
    if image.mode == "P":
        image = image.convert("RGBA" if "transparency" in image.info else "RGB")
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = image if image.mode == "RGBA" else image.convert("RGBA")
        # Opaque: compositing onto white leaves every pixel as it is. (The alpha band's extrema
        # alone: a quarter of the cost of all four bands'.)
        if rgba.getchannel("A").getextrema()[0] == 255:
            return rgba.convert("RGB")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


def decode_rgb(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """The image in ``data`` as an RGB Pillow image, converted as this module's docstring says;
    :class:`BadImage` if it cannot be."""
    image = _open(data, max_pixels)
    return _to_rgb(_oriented(image))
