"""A small image-text corpus from real images (matplotlib's sample data and icons) and Pillow-made
ones covering every conversion of ``lakeloader/images.py`` (EXIF-rotated, CMYK, 16-bit, palette
with transparency, grayscale with alpha, animated), in every source form ``format: interleaved``
with ``images: stored`` reads: WebDataset tars (captioned images, and JSON interleaved documents),
Parquet (binary column and ``{bytes, path}`` structs) and JSON Lines (relative paths and base64).
Tests, benchmarks and the examples use it; ``configs/images.yaml`` builds it."""

from __future__ import annotations

import base64
import io
import json
import sys
import tarfile
from pathlib import Path

import matplotlib
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

_MPL_DATA = Path(matplotlib.get_data_path())


def real_images() -> dict[str, bytes]:
    """Image files shipped with matplotlib (photos, logos, icons; JPEG and PNG), by file name."""
    files = sorted((_MPL_DATA / "sample_data").glob("*.jpg")) + sorted((_MPL_DATA / "sample_data").glob("*.png"))
    files += sorted((_MPL_DATA / "images").glob("*.png"))
    return {path.name: path.read_bytes() for path in files}


def _saved(image: Image.Image, fmt: str, **options: object) -> bytes:
    sink = io.BytesIO()
    image.save(sink, fmt, **options)
    return sink.getvalue()


def _gradient(width: int, height: int, seed: int = 0) -> Image.Image:
    """An RGB image with a different colour in each corner (so a rotation or flip shows)."""
    image = Image.new("RGB", (width, height))
    image.putdata([((x * 255 // max(width - 1, 1) + seed * 37) % 256, (y * 255 // max(height - 1, 1)) % 256,
                    (seed * 91) % 256) for y in range(height) for x in range(width)])
    return image


def made_images() -> dict[str, bytes]:
    """Pillow-made images of every kind the decoder converts, by file name."""
    base = _gradient(48, 32)
    exif = Image.Exif()
    exif[0x0112] = 6   # orientation: rotate 90 degrees clockwise on display (stored 48x32, shown 32x48)
    frames = [_gradient(24, 16, seed) for seed in range(3)]
    sixteen = Image.new("I;16", (40, 24))
    sixteen.putdata([(x * 1600 + y * 97) % 65536 for y in range(24) for x in range(40)])
    palette = base.convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    return {
        "exif-rotated.jpg": _saved(base, "JPEG", exif=exif, quality=90),
        "cmyk.jpg": _saved(base.convert("CMYK"), "JPEG", quality=90),
        "gray16.png": _saved(sixteen, "PNG"),
        "palette-alpha.png": _saved(palette, "PNG", transparency=0),
        "gray-alpha.png": _saved(base.convert("LA"), "PNG"),
        "gray.jpg": _saved(base.convert("L"), "JPEG", quality=90),
        "rgba.png": _saved(base.convert("RGBA"), "PNG"),
        "photo.webp": _saved(_gradient(64, 40, 5), "WEBP", quality=80),
        "animated.gif": _saved(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0),
        "wide.png": _saved(_gradient(300, 20, 7), "PNG"),
    }


def bad_images(max_pixels: int) -> dict[str, bytes]:
    """Image files no training may see, by the case they stand for: truncated, not an image, and a
    decompression bomb for ``max_pixels`` (an image of more pixels, in a small file)."""
    photo = real_images()["grace_hopper.jpg"]
    side = int(max_pixels ** 0.5) + 2
    return {"truncated.jpg": photo[: len(photo) // 3], "not-an-image.png": b"this is text, not a PNG\n" * 4,
            "bomb.png": _saved(Image.new("1", (side, side)), "PNG")}


def all_images() -> dict[str, bytes]:
    """The real and the made images, by file name."""
    return {**real_images(), **made_images()}


def variant(data: bytes, copy: int) -> bytes:
    """Copy ``copy`` of an image as other bytes of the same format and mode: copy 0 is the image,
    copy k > 0 its k-th of Pillow's seven flips and rotations (the first frame, without EXIF),
    so a corpus of several copies holds as many distinct images of the same kinds."""
    if copy == 0:
        return data
    image = Image.open(io.BytesIO(data))
    fmt, info = str(image.format), image.info
    turned = image.transpose(list(Image.Transpose)[(copy - 1) % len(Image.Transpose)])
    options = {"transparency": info["transparency"]} if "transparency" in info and turned.mode == "P" else {}
    return _saved(turned, fmt, **({"quality": 90} if fmt in ("JPEG", "WEBP") else {}), **options)


def _extension(name: str) -> str:
    return name.rsplit(".", 1)[1].lower()


def _caption(name: str) -> str:
    return f"A picture named {name.rsplit('.', 1)[0].replace('_', ' ').replace('-', ' ')}."


def write_tar(path: Path, samples: list[tuple[str, dict[str, bytes]]]) -> Path:
    """A WebDataset tar (gzip-compressed if ``path`` ends in .gz) of ``samples``: (key, {extension:
    bytes}) each, its members ``key.extension`` in order; fixed member times, so its bytes are too."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz" if path.suffix == ".gz" else "w", format=tarfile.USTAR_FORMAT) as tar:
        for key, members in samples:
            for extension, data in members.items():
                info = tarfile.TarInfo(f"{key}.{extension}")
                info.size, info.mtime, info.mode = len(data), 0, 0o644
                tar.addfile(info, io.BytesIO(data))
    return path


def write_image_corpus(root: Path, copies: int = 1, distinct: bool = False, row_group_size: int = 16
                       ) -> dict[str, list[Path]]:
    """Write the corpus under ``root`` (each image ``copies`` times over, under other keys; with
    ``distinct``, each copy as other bytes: :func:`variant`) and return its source files by form:
    ``tar`` (a .tar of captioned images, a .tar.gz of JSON interleaved documents of two images
    each), ``parquet`` (binary column and structs), ``jsonl`` (relative paths into
    ``root/jsonl/img`` and base64 bytes; Parquet row groups, and so chunks, of ``row_group_size``
    documents)."""
    if distinct:
        originals = sorted(all_images().items())
        images = [(f"{copy}-{name}", variant(data, copy)) for copy in range(copies) for name, data in originals]
        copies = 1
    else:
        images = sorted(all_images().items())
    captioned = [(f"{copy:02d}{i:04d}", {_extension(name): data, "txt": _caption(name).encode()})
                 for copy in range(copies) for i, (name, data) in enumerate(images)
                 if _extension(name) in ("jpg", "png", "webp")]
    interleaved = []
    for copy in range(copies):
        for i in range(0, len(images) - 1, 2):
            (a, da), (b, db) = images[i], images[i + 1]
            first, second = f"first.{_extension(a)}", f"second.{_extension(b)}"
            document = {"items": [{"text": f"First {_caption(a)}"}, {"image": first},
                                  {"text": f"Then {_caption(b)}"}, {"image": second}]}
            interleaved.append((f"doc{copy:02d}{i:04d}", {"json": json.dumps(document).encode(), first: da,
                                                           second: db}))
    tars = [write_tar(root / "tar" / "captioned-000.tar", captioned),
            write_tar(root / "tar" / "interleaved-000.tar.gz", interleaved)]
    hf_image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])   # a Hugging Face Image feature
    item_type = pa.struct([("text", pa.string()), ("image", hf_image)])
    rows = [[{"text": _caption(name), "image": None}, {"text": None, "image": {"bytes": data, "path": name}}]
            for _ in range(copies) for name, data in images]
    (root / "parquet").mkdir(parents=True, exist_ok=True)
    structs = root / "parquet" / "structs.parquet"
    pq.write_table(pa.table({"items": pa.array(rows, pa.list_(item_type))}), structs,
                   row_group_size=row_group_size)
    binary_type = pa.struct([("text", pa.string()), ("image", pa.binary())])
    binary = root / "parquet" / "binary.parquet"
    binary_rows = [[{"text": None, "image": data}, {"text": _caption(name), "image": None}]
                   for _ in range(copies) for name, data in images]
    pq.write_table(pa.table({"items": pa.array(binary_rows, pa.list_(binary_type))}), binary,
                   row_group_size=row_group_size)
    folder = root / "jsonl" / "img"
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in images:
        (folder / name).write_bytes(data)
    lines = []
    for copy in range(copies):
        for i, (name, data) in enumerate(images):
            image = ({"image": f"img/{name}"} if i % 2 == 0 else {"image": {"bytes": base64.b64encode(data).decode()}})
            lines.append(json.dumps({"items": [{"text": _caption(name)}, image, {"text": f"(copy {copy})"}]}))
    jsonl = root / "jsonl" / "docs.jsonl"
    jsonl.write_text("\n".join(lines) + "\n")
    return {"tar": tars, "parquet": [structs, binary], "jsonl": [jsonl]}


def main() -> None:
    """Write the corpus of configs/images.yaml (``python -m lakeloader.demo.images [FOLDER]``)."""
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "data/images")
    written = write_image_corpus(root)
    print(f"wrote {sum(len(v) for v in written.values())} source files under {root}")


if __name__ == "__main__":
    main()
