"""Each image stored once per dataset (ingest/media_dedup.py): real Dask builds of documents that
reuse the demo's real images across many chunks. Once the build's end rewrites the media files,
the lake's current media files hold each image once, store fewer bytes, and give bitwise the
batches the lake gave before the rewrite (a loader opened before it included, after ``gc``, and one
reading while the lake builds); a
build killed in the rewrite and run again, and a grown plan, end as an uninterrupted build; verify,
repair and gc keep the rewritten files whole; and the writes are recorded as deltas."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from conftest import assert_batches_equal, batches_while_building, copied_lake, global_batches, write_config
from lakeloader import Loader
from lakeloader.catalog.gc import remove_stale
from lakeloader.catalog.lake import Lake, open_lake
from lakeloader.catalog.store import CatalogWriter, MediaFile
from lakeloader.contracts.media import MEDIA_HOMES_KEY, MEDIA_ID_COLUMN, media_path
from lakeloader.demo.images import all_images
from lakeloader.ingest import media_dedup
from lakeloader.ingest.driver import build
from lakeloader.ingest.repair import repair_lake
from lakeloader.read.catalog_view import CatalogView
from lakeloader.read.verify import verify_lake

PATCHES = {"kind": "patches", "patch_size": 8, "min_pixels": 256, "max_pixels": 4096, "max_patches": 32}
LOADER = {"seq_len": 192, "batch_size": 4, "packing": "pack", "shuffle": {"kind": "window", "window_chunks": 2},
          "prefetch": 0}
STEPS = 4


def _write_corpus(data: Path, parts: range) -> None:
    """JSON Lines files ``<part>.jsonl`` of documents of two images each: one of the demo's images
    in turn, and one per file (used in every chunk of it)."""
    folder = data / "img"
    folder.mkdir(parents=True, exist_ok=True)
    images = all_images()
    for name, payload in images.items():
        (folder / name).write_bytes(payload)
    names = sorted(images)
    for part in parts:
        lines = [{"items": [{"text": f"doc {part}.{i}: " + "words " * 12}, {"image": f"img/{names[(i + part) % len(names)]}"},
                            {"image": f"img/{names[part]}"}]} for i in range(40)]
        (data / f"{part}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def _config(root: Path, data: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    datasets = {"j": {"sources": [str(data / "*.jsonl")], "format": "interleaved", "interleaved": {
        "images": "stored", "image_tokens": 12, "max_images": 3, "resolution": PATCHES}}}
    return write_config(root, datasets, build={"split_size": "2KB", "publish_interval": 0.2}, loader=LOADER)


def _lake_files(lake: Path) -> dict[str, bytes]:
    """Every chunk and media file of a lake by its path (not the catalog's, nor the documents index)."""
    return {str(p.relative_to(lake)): p.read_bytes() for p in sorted(lake.rglob("*.parquet"))
            if not p.relative_to(lake).parts[0].startswith("_")}


def _current_media(config: Path) -> list[tuple[str, str | None]]:
    """Per committed chunk: its chunk file and its rewritten media file (None: its own)."""
    frame = open_lake(config).sql("SELECT c.path, m.path AS deduped FROM chunks c LEFT JOIN media_files m "
                                  "ON m.dataset = c.dataset AND m.global_index = c.global_index "
                                  "WHERE c.status = 'committed' ORDER BY c.global_index")
    return [(row.path, row.deduped if isinstance(row.deduped, str) else None) for row in frame.itertuples()]


def _stored(config: Path) -> tuple[list[str], int]:
    """The image ids held by the lake's current media files (one per row), and their bytes."""
    lake = Path(yaml.safe_load(config.read_text())["lake"])
    ids: list[str] = []
    size = 0
    for chunk, deduped in _current_media(config):
        file = lake / (deduped or media_path(chunk))
        ids += pq.read_table(file, columns=[MEDIA_ID_COLUMN]).column(0).to_pylist()
        size += file.stat().st_size
    return ids, size


def _distinct(config: Path) -> tuple[int, int]:
    row = open_lake(config).sql("SELECT count(*) AS n, count(DISTINCT image_id) AS d FROM images").iloc[0]
    return int(row.n), int(row.d)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("dedup") / "data"
    _write_corpus(folder, range(3))
    return folder


@pytest.fixture(scope="module")
def deduped(tmp_path_factory: pytest.TempPathFactory, data: Path, dask_scheduler: str) -> Path:
    config = _config(tmp_path_factory.mktemp("deduped"), data)
    build(config, scheduler=dask_scheduler, progress=False)
    return config


def test_each_image_is_stored_once_and_batches_are_those_before_the_rewrite(
        tmp_path: Path, data: Path, deduped: Path, dask_scheduler: str, monkeypatch: pytest.MonkeyPatch) -> None:
    config = _config(tmp_path / "built", data)
    with monkeypatch.context() as patched:   # the lake as the chunk tasks wrote it
        patched.setattr("lakeloader.ingest.driver.dedup_media", lambda *args: media_dedup.DedupTotals())
        build(config, scheduler=dask_scheduler, progress=False)
    occurrences, distinct = _distinct(config)
    ids, before = _stored(config)
    assert len(ids) > distinct and len(_current_media(config)) > 10   # images repeat across chunks
    reference = global_batches(config, 1, range(STEPS))
    assert sum(int(b["image_mask"].sum()) for b in reference) > 0
    early = Loader(config)   # opened on the snapshot before the rewrite: reads nothing yet
    build(config, scheduler=dask_scheduler, progress=False)   # nothing to build: the build's end rewrites
    ids, after = _stored(config)
    assert sorted(ids) == sorted(set(ids)) and len(ids) == distinct
    for chunk, rewritten in _current_media(config):   # each image it dropped: its home holds it
        if rewritten:
            footer = pq.read_metadata(config.parent / "lake" / rewritten).metadata
            for image, home in json.loads(footer[MEDIA_HOMES_KEY]).items():
                held = pq.read_table(config.parent / "lake" / home, columns=[MEDIA_ID_COLUMN]).column(0).to_pylist()
                assert image in held
    assert _distinct(config) == (occurrences, distinct)   # the images view counts occurrences still
    assert after < before
    assert _lake_files(config.parent / "lake") == _lake_files(deduped.parent / "lake")
    assert_batches_equal(global_batches(config, 1, range(STEPS)), reference, "after the rewrite")
    removed = remove_stale(Lake(str(config.parent / "lake")))
    replaced = {media_path(chunk) for chunk, rewritten in _current_media(config) if rewritten}
    assert {path for path in removed.folder if not path.startswith("_")} == replaced and replaced
    assert_batches_equal([early.batch(step) for step in range(STEPS)], reference, "a loader of the older snapshot")
    early.close()
    assert (verify_lake(config, progress=False).status == "ok").all()


def test_a_loader_reading_while_the_lake_builds_gets_the_same_batches(tmp_path: Path, data: Path, deduped: Path,
                                                                     dask_scheduler: str) -> None:
    config = _config(tmp_path, data)
    during = batches_while_building(config, STEPS, scheduler=dask_scheduler, progress=False)
    assert any(media for _, media in _current_media(config))
    assert_batches_equal(during, global_batches(deduped, 1, range(STEPS)), "read while building")


def test_a_build_killed_in_the_rewrite_and_run_again_ends_with_the_same_lake(
        tmp_path: Path, data: Path, deduped: Path, dask_scheduler: str, monkeypatch: pytest.MonkeyPatch) -> None:
    config = _config(tmp_path, data)
    recorded = []
    original = CatalogWriter.record_media_files

    def record_then_die(self: CatalogWriter, files: list[MediaFile]) -> None:
        if recorded:
            raise KeyboardInterrupt   # as a killed driver: what it recorded is committed
        recorded.append(len(files))
        original(self, files)

    with monkeypatch.context() as patched:
        patched.setattr(media_dedup, "RECORD_EVERY", 2)
        patched.setattr(CatalogWriter, "record_media_files", record_then_die)
        with pytest.raises(BaseException):
            build(config, scheduler=dask_scheduler, progress=False)
    assert recorded == [2] and len([m for _, m in _current_media(config) if m]) == 2
    build(config, scheduler=dask_scheduler, progress=False)
    assert _lake_files(config.parent / "lake") == _lake_files(deduped.parent / "lake")
    assert _current_media(config) == _current_media(deduped)


def test_verify_repair_build_and_gc_keep_the_rewritten_media_files(tmp_path: Path, deduped: Path,
                                                                  dask_scheduler: str) -> None:
    config = copied_lake(deduped, tmp_path)
    lake = tmp_path / "lake"
    reference = global_batches(deduped, 1, range(STEPS))
    remove_stale(Lake(str(lake)))   # the chunks' own media files of the rewritten ones are gone
    rewritten = [(chunk, media) for chunk, media in _current_media(config) if media]
    assert not any((lake / media_path(chunk)).exists() for chunk, _ in rewritten)
    assert (verify_lake(config, progress=False).status == "ok").all()
    damaged, missing = lake / rewritten[0][1], lake / rewritten[-1][1]
    good = damaged.read_bytes(), missing.read_bytes()
    data = bytearray(good[0])
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    missing.unlink()
    report = verify_lake(config, progress=False)
    bad = report[report.status != "ok"]
    assert sorted(bad.status) == ["checksum", "missing"]
    assert all("media file" in detail for detail in bad.detail)
    assert (repair_lake(config, report, scheduler=dask_scheduler, progress=False).status == "ok").all()
    assert (damaged.read_bytes(), missing.read_bytes()) == good
    assert _current_media(config) == _current_media(deduped)
    missing.unlink()   # found by the build's listing: written again at its end
    build(config, scheduler=dask_scheduler, progress=False)
    assert missing.read_bytes() == good[1]
    assert_batches_equal(global_batches(config, 1, range(STEPS)), reference, "repaired")
    assert hashlib.sha256(good[1]).hexdigest().startswith(rewritten[-1][1].rsplit(".", 2)[-2])


def test_a_grown_plan_stores_the_new_chunks_images_once_too(tmp_path: Path, dask_scheduler: str) -> None:
    data = tmp_path / "data"
    _write_corpus(data, range(2))
    config = _config(tmp_path / "grown", data)
    build(config, scheduler=dask_scheduler, progress=False)
    before = _current_media(config)
    _write_corpus(data, range(2, 4))   # files added: the plan grows, its built chunks kept
    build(config, scheduler=dask_scheduler, progress=False)
    after = _current_media(config)
    assert after[: len(before)] == before and len(after) > len(before)   # appended; the built ones unchanged
    ids, _ = _stored(config)
    assert len(ids) == len(set(ids)) == _distinct(config)[1]
    assert any(media for _, media in after[len(before):])   # new chunks hold images of built ones: rewritten


def test_the_rewrites_are_recorded_as_changes_of_their_chunks(tmp_path: Path) -> None:
    with CatalogWriter(str(tmp_path / "catalog.duckdb")) as writer:
        writer.changes.keys = {}
        writer.record_media_files([MediaFile("d", 3, "d/x.media.0123456789abcdef.parquet", 1, 10, "ab")])
        writer.forget_media_files("d", [5])
        assert writer.changes.keys == {"d": {3, 5}}
        assert writer.media_rewrites("d").empty
        assert writer.changes.keys == {"d": {3, 5}}


def test_a_loader_finds_every_image_without_opening_a_catalog_database(deduped: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The rewritten files come from the reader index, each image's home from its chunk's file."""
    connected: list[bool] = []
    monkeypatch.setattr(CatalogView, "_connect", lambda self, snapshot: connected.append(True))
    with Loader(deduped) as loader:
        batches = [loader.batch(step) for step in range(STEPS)]
    assert not connected
    assert sum(int(b["image_mask"].sum()) for b in batches) > 0
