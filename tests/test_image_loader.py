"""Pixels in the batch: stored images of real builds (the demo image corpus: matplotlib's real
images and Pillow-made ones) decoded and resized by the loader, bitwise the same for any process
count, worker count, resume step and read-while-build; image tokens from the stored sizes."""

from __future__ import annotations

import io
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import ExifTags, Image

from test_s3 import BUCKET, s3_endpoint, storage_options  # noqa: F401  (s3_endpoint: a fixture)

from conftest import DEMO_TOKENIZER, assert_batches_equal, batches_while_building, global_batches
from lakeloader import Loader
from lakeloader.contracts.errors import ChunkIntegrityError, LakeloaderError
from lakeloader.contracts.media import media_path
from lakeloader.contracts.specs import ImageResolution
from lakeloader.demo.images import all_images, variant, write_image_corpus
from lakeloader.feed.slots import Slots, field_of
from lakeloader.images import decode_rgb, inspect_image
from lakeloader.index.image_tokens import fit_sizes, image_token_counts, patch_grids
from lakeloader.ingest.driver import build

PATCHES = {"kind": "patches", "patch_size": 8, "min_pixels": 256, "max_pixels": 4096, "max_patches": 32}
FIXED = {"kind": "fixed", "size": [24, 32]}
STEPS = 6


def _config(root: Path, sources: list[Path], resolution: dict[str, Any], **loader: Any) -> Path:
    config = {
        "lake": str(root / "lake"), "tokenizer": str(DEMO_TOKENIZER),
        "datasets": {"images": {"sources": [str(p) for p in sources], "format": "interleaved", "interleaved": {
            "images": "stored", "image_tokens": 12, "max_images": 3, "resolution": resolution}}},
        "build": {"split_size": "24KB", "publish_interval": 0.2},
        "loader": {"seq_len": 192, "batch_size": 4, "packing": "pack", "shuffle": {"kind": "window", "window_chunks": 2},
                   "prefetch": 0, **loader},
    }
    path = root / f"{resolution['kind']}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    files = write_image_corpus(tmp_path_factory.mktemp("images") / "data")
    return [*files["tar"], *files["parquet"]]


@pytest.fixture(scope="module")
def patches_lake(tmp_path_factory: pytest.TempPathFactory, corpus: list[Path], dask_scheduler: str) -> Path:
    config = _config(tmp_path_factory.mktemp("patches"), corpus, PATCHES)
    build(config, scheduler=dask_scheduler, progress=False)
    return config


@pytest.fixture(scope="module")
def reference(patches_lake: Path) -> list[dict[str, Any]]:
    return global_batches(patches_lake, 1, range(STEPS))


# -- image tokens from metadata ---------------------------------------------------------------------

sides = st.integers(1, 5000)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(sides, sides), min_size=1, max_size=20), st.integers(1, 32), st.integers(0, 300_000),
       st.integers(1, 400_000), st.integers(1, 2048))
def test_patch_grids_stay_in_bounds_and_keep_the_aspect(sizes: list[tuple[int, int]], patch: int, min_pixels: int,
                                                       max_pixels: int, max_patches: int) -> None:
    max_pixels = max(max_pixels, patch * patch)
    min_pixels = min(min_pixels, max_pixels)
    resolution = ImageResolution("patches", patch_size=patch, min_pixels=min_pixels, max_pixels=max_pixels,
                                 max_patches=max_patches)
    widths, heights = (np.array(x) for x in zip(*sizes))
    rows, cols = patch_grids(widths, heights, resolution)
    tokens = image_token_counts(widths, heights, resolution, 99)
    assert (tokens == rows * cols).all() and (rows >= 1).all() and (cols >= 1).all()
    cap = resolution.patch_cap
    assert (tokens <= cap).all() and (tokens * patch * patch <= max(max_pixels, patch * patch)).all()
    # A pure function of each image alone, elementwise.
    for k in range(len(sizes)):
        one = patch_grids(widths[k : k + 1], heights[k : k + 1], resolution)
        assert (int(one[0][0]), int(one[1][0])) == (int(rows[k]), int(cols[k]))
    # The aspect is kept where the grid has room for it (no side pinned at one patch).
    free = (rows > 1) & (cols > 1) & (rows * cols < cap)
    aspect = np.log((cols * heights) / (rows * widths))
    assert (np.abs(aspect[free]) <= np.log(3)).all()
    # The lower bound holds where the cap leaves room to round up each side (and no side is
    # under one patch at the scale that meets it).
    floor = min(cap, -(-min_pixels // (patch * patch)))
    grow = np.sqrt(floor * patch * patch / (widths * heights))
    room = (cap >= 4 * floor) & (np.minimum(widths, heights) * grow >= patch)
    assert not ((tokens < floor) & room).any()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(sides, sides), min_size=1, max_size=20), st.integers(1, 512), st.integers(1, 512))
def test_fixed_fit_stays_in_the_box(sizes: list[tuple[int, int]], box_h: int, box_w: int) -> None:
    widths, heights = (np.array(x) for x in zip(*sizes))
    fit_w, fit_h = fit_sizes(widths, heights, (box_h, box_w))
    assert ((1 <= fit_w) & (fit_w <= box_w) & (1 <= fit_h) & (fit_h <= box_h)).all()
    assert ((fit_w == box_w) | (fit_h == box_h) | (fit_w == 1) | (fit_h == 1)).all()   # as large as fits
    resolution = ImageResolution("fixed", size=(box_h, box_w))
    assert (image_token_counts(widths, heights, resolution, 7) == 7).all()


# -- pixels ---------------------------------------------------------------------------------------

def _images_by_id() -> dict[str, bytes]:
    import hashlib
    return {hashlib.sha256(data).hexdigest(): data for data in all_images().values()}


def test_patches_are_the_images_resized_and_the_tokens_their_count(patches_lake: Path,
                                                                   reference: list[dict[str, Any]]) -> None:
    images = _images_by_id()
    with Loader(patches_lake) as loader:
        image_token = loader.tokenizer.token_to_id("<|image|>")
    resolution = ImageResolution("patches", patch_size=8, min_pixels=256, max_pixels=4096, max_patches=32)
    seen = 0
    for batch in reference:
        for row in range(len(batch["input_ids"])):
            at = 0
            for number in np.flatnonzero(batch["image_mask"][row]).tolist():
                decoded = decode_rgb(images[batch["image_refs"][row, number]])
                rows, cols = (int(x[0]) for x in patch_grids(np.array([decoded.width]), np.array([decoded.height]),
                                                              resolution))
                n = rows * cols
                position = int(batch["image_positions"][row, number])
                run = batch["input_ids"][row, position + 1 : position + 1 + n]
                assert (run == image_token).all() and batch["input_ids"][row, position + 1 + n] != image_token
                resized = np.asarray(decoded.resize((cols * 8, rows * 8), Image.Resampling.BICUBIC))
                patches = resized.reshape(rows, 8, cols, 8, 3).transpose(0, 2, 1, 3, 4).reshape(n, -1)
                assert np.array_equal(batch["pixel_patches"][row, at : at + n], patches)
                assert (batch["patch_image"][row, at : at + n] == number).all()
                assert np.array_equal(batch["patch_grid"][row, at + n - 1], [rows - 1, cols - 1])
                at += n
                seen += 1
            assert (batch["patch_image"][row, at:] == -1).all() and not batch["pixel_patches"][row, at:].any()
    assert seen >= 10


def test_batches_are_bitwise_the_same_for_any_process_count(patches_lake: Path,
                                                           reference: list[dict[str, Any]]) -> None:
    for processes in (2, 4):
        assert_batches_equal(global_batches(patches_lake, processes, range(STEPS)), reference, f"P={processes}")


def test_pixels_are_the_same_whatever_the_bytes_read_before_decoding(patches_lake: Path,
                                                                     reference: list[dict[str, Any]],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch's images read a byte's worth at a time (each read, then decoded, in turn) give the
    batches of the whole batch's images read first."""
    monkeypatch.setattr("lakeloader.feed.pixels.READ_AHEAD_BYTES", 1)
    assert_batches_equal(global_batches(patches_lake, 1, range(STEPS)), reference, "one image read at a time")


def test_pixels_built_in_a_workers_slot_over_its_previous_batch_are_the_same(
        patches_lake: Path, reference: list[dict[str, Any]]) -> None:
    """A worker builds each batch in its shared-memory slot, over the slot's previous batch (the
    pixels' memory is not zeroed first: every byte of it is written). Every numeric field is
    built in place there, so the slot never grows again (a new segment each batch: its pages
    faulted in anew and the pixels copied over)."""
    slots = Slots(f"lakeloader_{os.getpid()}_pixeltest", 0, 2)
    try:
        with Loader(patches_lake) as loader:
            for step in list(range(STEPS)) + list(reversed(range(STEPS))):
                built = slots.pool(step % 2)
                batch = loader.batch(step, built)
                if step >= 2:
                    assert [n for n, v in batch.items() if v.dtype != object and built.offset_of(v) is None] == []
                    assert slots.generation == 2   # (one segment per slot, made by its first batch)
                _, layout, objects = slots.write(step % 2, batch, built)
                got = {f: field_of(slots.memory[step % 2], at, np.dtype(dtype), shape).copy()  # type: ignore[arg-type]
                       for f, dtype, shape, at in layout}
                del batch, built   # (nothing may refer to a slot when its segment closes)
                assert_batches_equal({**got, **objects}, reference[step], f"slot, step {step}")
    finally:
        slots.unlink_all()


def test_worker_processes_and_every_resume_step_give_the_same_batches(patches_lake: Path, tmp_path: Path,
                                                                     reference: list[dict[str, Any]]) -> None:
    config = yaml.safe_load(patches_lake.read_text())
    config["loader"].update(workers=2)
    with_workers = tmp_path / "workers.yaml"
    with_workers.write_text(yaml.safe_dump(config))
    with Loader(with_workers) as loader:
        iterator = loader.iter_from(0)
        got = [next(iterator)]
        time.sleep(4)   # the workers start meanwhile: they build the steps after this one
        got += [next(iterator) for _ in range(STEPS - 1)]
        iterator.close()
    assert_batches_equal(got, reference, "workers=2")
    with Loader(patches_lake) as loader:
        for step in range(STEPS):
            resumed = Loader(patches_lake)
            assert_batches_equal(next(resumed.iter_from(loader.state(step))), reference[step], f"resumed at {step}")
            resumed.close()


def test_a_loader_reading_while_the_lake_builds_gets_the_same_pixels(
        tmp_path: Path, corpus: list[Path], reference: list[dict[str, Any]], dask_scheduler: str) -> None:
    config = _config(tmp_path, corpus, PATCHES)
    during = batches_while_building(config, STEPS, scheduler=dask_scheduler, progress=False)
    assert_batches_equal(during, reference, "read while building")


def test_a_new_resolution_replans_without_rebuilding_a_chunk(tmp_path: Path, patches_lake: Path) -> None:
    shutil.copytree(patches_lake.parent / "lake", tmp_path / "lake")
    config = yaml.safe_load(patches_lake.read_text())
    config["lake"] = str(tmp_path / "lake")
    chunks = {p: p.stat().st_mtime_ns for p in (tmp_path / "lake").rglob("*.parquet") if "_catalog" not in p.parts}
    before = Loader(patches_lake)
    plan = before.datasets[0].plan_key
    before.close()
    config["datasets"]["images"]["interleaved"]["resolution"] = {**PATCHES, "max_patches": 16}
    edited = tmp_path / "edited.yaml"
    edited.write_text(yaml.safe_dump(config))
    report = build(edited, workers=1, progress=False)
    assert report.chunks_built == 0
    assert {p: p.stat().st_mtime_ns for p in chunks} == chunks
    with Loader(edited) as loader:
        assert loader.datasets[0].plan_key != plan
        batch = loader.batch(0)
        most = max(int(np.bincount(r[r >= 0]).max()) for r in batch["patch_image"] if (r >= 0).any())
        assert 1 <= most <= 16 and batch["pixel_patches"].shape[1] == 3 * 16


def test_fixed_resolution_pads_each_image_fitted_at_the_top_left(tmp_path: Path, corpus: list[Path],
                                                                 dask_scheduler: str) -> None:
    config = _config(tmp_path, corpus[:1], FIXED)
    build(config, scheduler=dask_scheduler, progress=False)
    images = _images_by_id()
    with Loader(config) as loader:
        batch = loader.batch(0)
    assert batch["pixel_values"].shape == (4, 3, 24, 32, 3) and batch["pixel_values"].dtype == np.uint8
    row, number = (int(x) for x in np.argwhere(batch["image_mask"])[0])
    decoded = decode_rgb(images[batch["image_refs"][row, number]])
    fit_w, fit_h = (int(x[0]) for x in fit_sizes(np.array([decoded.width]), np.array([decoded.height]), (24, 32)))
    expected = np.zeros((24, 32, 3), np.uint8)
    expected[:fit_h, :fit_w] = np.asarray(decoded.resize((fit_w, fit_h), Image.Resampling.BICUBIC))
    assert np.array_equal(batch["pixel_values"][row, number], expected)
    assert not batch["pixel_values"][~batch["image_mask"]].any()


def test_a_decoder_upgrade_changes_the_fingerprint_and_a_saved_state_names_it(
        patches_lake: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with Loader(patches_lake) as loader:
        state, fingerprint = loader.state(3), loader.fingerprint
    monkeypatch.setattr("lakeloader.feed.loader.DECODER", "Pillow 99.0; libjpeg 9z")
    with Loader(patches_lake) as upgraded:
        assert upgraded.fingerprint != fingerprint
        with pytest.raises(LakeloaderError, match="the image decoder: Pillow .* -> Pillow 99.0"):
            upgraded.restore(state)


def test_a_damaged_media_file_is_an_error_naming_it(tmp_path: Path, patches_lake: Path) -> None:
    shutil.copytree(patches_lake.parent / "lake", tmp_path / "lake")
    config = yaml.safe_load(patches_lake.read_text())
    config["lake"] = str(tmp_path / "lake")
    copy = tmp_path / "copy.yaml"
    copy.write_text(yaml.safe_dump(config))
    for media in (tmp_path / "lake").rglob("*" + media_path("x.parquet")[1:]):
        data = bytearray(media.read_bytes())
        middle = len(data) // 3
        data[middle : middle + 64] = bytes(64)   # inside the images' bytes
        media.write_bytes(bytes(data))
        os.utime(media)
    with Loader(copy) as loader, pytest.raises(ChunkIntegrityError, match="media file"):
        for step in range(STEPS):
            loader.batch(step)


def test_audit_and_explain_count_the_images(patches_lake: Path, reference: list[dict[str, Any]]) -> None:
    from lakeloader.catalog.audit import audit

    frame = audit(patches_lake, 0, STEPS)
    assert int(frame["images"].iloc[0]) > 0 and 0 < float(frame["image_token_share"].iloc[0]) < 1
    with Loader(patches_lake) as loader:
        for step in (0, STEPS - 1):
            assert int(loader.explain(step)["images"].sum()) == int(reference[step]["image_mask"].sum())


def test_a_lake_in_an_object_store_gives_the_same_pixels(
        tmp_path: Path, corpus: list[Path], reference: list[dict[str, Any]], s3_endpoint: str,  # noqa: F811
        dask_scheduler: str) -> None:
    config = _config(tmp_path, corpus, PATCHES)
    raw = yaml.safe_load(config.read_text())
    raw.update(lake=f"s3://{BUCKET}/pixels-lake", storage_options=storage_options(s3_endpoint))
    config.write_text(yaml.safe_dump(raw, sort_keys=False))
    build(config, scheduler=dask_scheduler, progress=False)
    assert_batches_equal(global_batches(config, 2, range(STEPS)), reference, "S3 lake, P=2")


def test_patches_need_stored_images_and_a_mixture_one_resolution(tmp_path: Path, corpus: list[Path]) -> None:
    from lakeloader.config import load_config
    from lakeloader.contracts.errors import ConfigError
    from lakeloader.feed.settings import check_combination

    raw = yaml.safe_load(_config(tmp_path, corpus, PATCHES).read_text())
    raw["datasets"]["images"]["interleaved"]["images"] = "references"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"interleaved\.resolution\.kind: .*needs images: stored"):
        load_config(path)
    raw["datasets"]["images"]["interleaved"]["images"] = "stored"
    raw["datasets"]["other"] = {**raw["datasets"]["images"], "interleaved": {
        **raw["datasets"]["images"]["interleaved"], "resolution": FIXED}}
    raw["mixture"] = {"weights": {"images": 1, "other": 1}}
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match="differ in interleaved.resolution"):
        check_combination(load_config(path), "train")


def _decoded_as_before(data: bytes) -> np.ndarray:
    """The conversion as first written (``ImageOps.exif_transpose``, then RGB, an alpha channel
    always composited onto white): what :func:`decode_rgb` must still give, bitwise."""
    from PIL import ImageOps

    image = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
    if image.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        array = np.asarray(image)
        bits = 16 if image.mode.startswith("I;16") else 32
        image = Image.fromarray((array.astype(np.int64) >> (bits - 8)).clip(0, 255).astype(np.uint8), "L")
    if image.mode == "P":
        image = image.convert("RGBA" if "transparency" in image.info else "RGB")
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = image.convert("RGBA")
        return np.asarray(Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB"))
    return np.asarray(image.convert("RGB"))


def test_the_decoder_gives_the_pixels_of_a_transpose_and_composite_of_every_image() -> None:
    """Transposing only images with an orientation and compositing only images with transparency
    leave every pixel as before: the demo images in all their flips, and in every EXIF orientation
    (including 0 and 9, which are no orientation) as JPEG, opaque and transparent PNG, and WEBP."""
    samples = {f"{name}#{copy}": variant(data, copy) for name, data in all_images().items() for copy in range(8)}
    photo = Image.open(io.BytesIO(all_images()["grace_hopper.jpg"])).reduce(4)
    clear = photo.convert("RGBA")
    clear.putalpha(Image.linear_gradient("L").resize(photo.size))
    for orientation in range(10):
        exif = Image.Exif()
        exif[ExifTags.Base.Orientation] = orientation
        for fmt, image in (("JPEG", photo), ("PNG", photo.convert("RGBA")), ("PNG", clear), ("PNG", photo.convert("LA")),
                           ("WEBP", photo)):
            sink = io.BytesIO()
            image.save(sink, fmt, exif=exif)
            samples[f"orientation {orientation} {fmt} {image.mode}"] = sink.getvalue()
    for name, data in samples.items():
        decoded = decode_rgb(data)
        assert decoded.mode == "RGB" and np.array_equal(np.asarray(decoded), _decoded_as_before(data)), name
        info = inspect_image(data)
        assert (info.width, info.height) == decoded.size, name


def test_pixel_fields_are_split_along_the_batch_axis_only(patches_lake: Path, tmp_path: Path,
                                                          dask_scheduler: str) -> None:
    """A row's patches may number seq_len (here 3 images x 32 patches = 96 = seq_len): the pixel
    fields are still split along the batch axis alone, the token fields along both mesh axes."""
    import jax
    from jax.sharding import Mesh, PartitionSpec

    from lakeloader import JaxFeed

    raw = yaml.safe_load(patches_lake.read_text())
    shutil.copytree(patches_lake.parent / "lake", tmp_path / "lake")
    raw["lake"] = str(tmp_path / "lake")
    raw["loader"].update(seq_len=96, batch_size=8)
    config = tmp_path / "seq96.yaml"
    config.write_text(yaml.safe_dump(raw))
    build(config, scheduler=dask_scheduler, progress=False)   # (the packing counts of seq_len 96 only)
    devices = jax.devices()[:8]   # (8 CPU devices under the suite's XLA_FLAGS: a 4 x 2 mesh)
    mesh = Mesh(np.array(devices).reshape(-1, 2 if len(devices) % 2 == 0 else 1), ("data", "seq"))
    with Loader(config) as loader:
        expected = loader.batch(1)
    with JaxFeed(config, mesh, PartitionSpec("data", "seq"), prefetch=0) as feed:
        got = feed.batch(1)
    assert got["patch_image"].shape == (8, 96) and got["input_ids"].shape == (8, 96)
    assert got["input_ids"].sharding.spec == PartitionSpec("data", "seq")
    for name in ("pixel_patches", "patch_image", "patch_grid", "image_mask", "image_positions"):
        assert got[name].sharding.spec == PartitionSpec("data"), name
        assert np.array_equal(np.asarray(got[name]), expected[name]), name


def test_an_evaluation_pass_and_its_prompts_keep_the_pixels(tmp_path: Path, corpus: list[Path],
                                                            dask_scheduler: str) -> None:
    config = _config(tmp_path, corpus[:1], FIXED)
    raw = yaml.safe_load(config.read_text())
    raw["loader"].update(packing="pad", pack={"long_documents": "truncate"})
    raw["evaluation"] = {"datasets": ["images"]}
    config.write_text(yaml.safe_dump(raw))
    build(config, scheduler=dask_scheduler, progress=False)
    raw["evaluation"]["prompts"] = True
    prompts = tmp_path / "prompts.yaml"
    prompts.write_text(yaml.safe_dump(raw))
    with Loader(config, mode="eval") as full, Loader(prompts, mode="eval") as cut:
        images = 0
        for step in range(full.num_batches() or 0):
            a, b = full.batch(step), cut.batch(step)
            for name in ("pixel_values", "image_mask", "image_positions", "image_refs"):
                assert np.array_equal(a[name], b[name]), name
            images += int(a["image_mask"].sum())
            assert not a["pixel_values"][~a["image_mask"]].any()
            assert (a["image_mask"] == (a["image_refs"] != "")).all()
    assert images > 0
