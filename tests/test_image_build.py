"""Images in the lake (``format: interleaved`` with ``interleaved.images: stored``), built by real
Dask from real WebDataset tars, Parquet (binary and ``{bytes, path}`` structs), JSON Lines
(relative paths and base64) and S3 URLs (moto's server on loopback): each chunk's media file holds
the source bytes of its distinct images, the ``images`` view says what Pillow says of each, every
kind of image converts to RGB, the lake is the same whatever the worker count and after a failed
build resumed, and a bad image never reaches a chunk (raise names it, skip rejects its document)."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import re
import shutil
import signal
from pathlib import Path
from typing import Any

import boto3
import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image, ImageOps
from test_resume import read_catalog, running_build, snapshot_counts, wait_until
from test_s3 import BUCKET, s3_endpoint, storage_options  # noqa: F401  (s3_endpoint: a fixture)

from lakeloader.catalog.lake import open_lake
from lakeloader.catalog.store import connect_reader
from lakeloader.config import DatasetConfig
from lakeloader.contracts.errors import ConfigError, InputError
from lakeloader.contracts.media import MEDIA_SCHEMA, image_id, media_path
from lakeloader.demo.images import all_images, bad_images, write_image_corpus, write_tar
from lakeloader.images import DECODER, decode_rgb
from lakeloader.ingest.documents import SplitSource, read_split
from lakeloader.ingest.driver import build
from lakeloader.ingest.repair import repair_lake
from lakeloader.plan.splits import Split
from lakeloader.read.verify import verify_lake

from conftest import write_config

STORED = {"images": "stored", "image_tokens": 4, "max_images": 4}
MAX_PIXELS = 1_000_000


def interleaved(sources: list[str], **options: Any) -> dict[str, Any]:
    return {"sources": sources, "format": "interleaved", "interleaved": {**STORED, **options}}


def pillow_facts(data: bytes) -> tuple[int, int, str, str, int]:
    """(width after EXIF orientation, height, format, mode, bytes) as Pillow itself says."""
    image = Image.open(io.BytesIO(data))
    oriented = ImageOps.exif_transpose(image)
    return oriented.width, oriented.height, str(image.format), image.mode, len(data)


def lake_files(lake: Path) -> dict[str, bytes]:
    """Every chunk and media file of a lake by its path in the lake (not the catalog's snapshots,
    nor the documents index, whose files follow how the chunks were committed together)."""
    return {str(p.relative_to(lake)): p.read_bytes() for p in sorted(lake.rglob("*.parquet"))
            if not p.relative_to(lake).parts[0].startswith("_")}


def images_view(config: Path) -> list[tuple[Any, ...]]:
    """The rows of the lake's images view, in order."""
    frame = open_lake(config).sql("SELECT dataset, chunk, doc, image, image_id, width, height, format, mode, "
                                  "num_bytes FROM images ORDER BY ALL")
    return [tuple(row) for row in frame.itertuples(index=False, name=None)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[Path]]]:
    root = tmp_path_factory.mktemp("images")
    return root, write_image_corpus(root / "data")


def test_every_source_form_stores_the_source_bytes_and_pillows_facts(
        corpus: tuple[Path, dict[str, list[Path]]], s3_endpoint: str, tmp_path: Path,  # noqa: F811
        dask_scheduler: str) -> None:
    root, sources = corpus
    images = all_images()
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    names = sorted(images)[:6]
    for name in names:
        client.put_object(Bucket=BUCKET, Key=f"images/{name}", Body=images[name])
    urls = tmp_path / "urls.jsonl"
    documents = [{"items": [{"text": f"from S3: {name}"}, {"image": f"s3://{BUCKET}/images/{name}"},
                            {"image": f"s3://{BUCKET}/images/{names[0]}"}]} for name in names]
    urls.write_text("".join(json.dumps(document) + "\n" for document in documents))
    datasets = {"tar": interleaved([str(p) for p in sources["tar"]]),
                "parquet": interleaved([str(p) for p in sources["parquet"]]),
                "jsonl": interleaved([str(p) for p in sources["jsonl"]]),
                "s3": interleaved([str(urls)])}
    config = write_config(tmp_path, datasets, storage_options=storage_options(s3_endpoint),
                          build={"split_size": "16KB"})
    report = build(config, scheduler=dask_scheduler, progress=False)
    assert report.rejects == 0
    facts = {image_id(data): pillow_facts(data) for data in images.values()}
    rows = images_view(config)
    assert {row[0] for row in rows} == set(datasets)
    for dataset, chunk, doc, image, key, *found in rows:
        assert tuple(found) == facts[key], (dataset, chunk, doc, image)
    # Every image of every source is in the lake, as often as the sources use it.
    assert sum(row[0] == "s3" for row in rows) == 2 * len(names)
    assert {row[4] for row in rows if row[0] == "parquet"} == set(facts)
    lake = tmp_path / "lake"
    chunks = open_lake(config).sql("SELECT dataset, global_index, path, media_bytes, media_checksum FROM chunks "
                                   "WHERE status = 'committed'")
    by_chunk: dict[tuple[str, int], list[tuple[Any, ...]]] = {}
    for row in rows:
        by_chunk.setdefault((row[0], row[1]), []).append(row)
    for chunk in chunks.itertuples(index=False):
        data = (lake / media_path(chunk.path)).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (chunk.media_bytes, chunk.media_checksum)
        media = pq.ParquetFile(io.BytesIO(data))
        assert media.schema_arrow == MEDIA_SCHEMA and media.num_row_groups == media.metadata.num_rows
        table = media.read()
        occurrences = by_chunk.get((chunk.dataset, chunk.global_index), [])
        first_use = list(dict.fromkeys(row[4] for row in occurrences))
        assert table.column("image_id").to_pylist() == first_use   # once per chunk, in order of first use
        for key, stored in zip(first_use, table.column("bytes").to_pylist()):
            assert image_id(stored) == key and stored in images.values()
        # The chunk file's image parts: their ids and sizes, 0 for text parts.
        parts = pq.read_table(lake / chunk.path, columns=["part_kinds", "part_refs", "part_widths", "part_heights"])
        expect = iter(occurrences)
        for kinds, refs, widths, heights in zip(*(parts.column(c).to_pylist() for c in parts.column_names)):
            for kind, ref, width, height in zip(kinds, refs, widths, heights):
                if kind == 1:
                    row = next(expect)
                    assert (ref, width, height) == (row[4], row[5], row[6])
                else:
                    assert (ref, width, height) == (None, 0, 0)
    assert any(len(v) > len(set(r[4] for r in v)) for v in by_chunk.values()), "a chunk must reuse an image"
    stats = open_lake(config).stats().set_index("dataset")
    assert stats.loc["s3", "images"] == 2 * len(names) and stats.loc["s3", "distinct_images"] == len(names)
    assert open_lake(config).sql("SELECT count(*) AS n FROM documents").n[0] == sum(
        open_lake(config).sql("SELECT num_docs FROM datasets").num_docs)


def test_every_kind_of_image_converts_through_a_real_build(corpus: tuple[Path, dict[str, list[Path]]],
                                                            tmp_path: Path, dask_scheduler: str) -> None:
    _, sources = corpus
    config = write_config(tmp_path, {"d": interleaved([str(p) for p in sources["parquet"]][:1])})
    build(config, scheduler=dask_scheduler, progress=False)
    kinds = open_lake(config).sql("SELECT DISTINCT image_id, format, mode, width, height FROM images")
    assert {"CMYK", "I;16", "P", "LA", "L", "RGBA", "RGB"} <= set(kinds["mode"])
    assert {"GIF", "WEBP", "JPEG", "PNG"} <= set(kinds["format"])
    stored = {}
    for path in (tmp_path / "lake").rglob("*.media.parquet"):
        table = pq.read_table(path)
        stored.update(zip(table.column("image_id").to_pylist(), table.column("bytes").to_pylist()))
    for row in kinds.itertuples(index=False):
        pixels = decode_rgb(stored[row.image_id])
        assert pixels.mode == "RGB" and pixels.size == (row.width, row.height), row
    rotated = image_id(all_images()["exif-rotated.jpg"])
    assert tuple(kinds.set_index("image_id").loc[rotated, ["width", "height"]]) == (32, 48)   # stored 48x32
    # A media file is checked and repaired like its chunk file: byte for byte.
    files = sorted((tmp_path / "lake").rglob("*.media.parquet"))
    intact = {path: path.read_bytes() for path in files}
    files[0].unlink()
    damaged = bytearray(intact[files[1]])
    damaged[len(damaged) // 2] ^= 1
    files[1].write_bytes(bytes(damaged))
    report = verify_lake(config, progress=False)
    report = report[report.global_index >= 0]   # (the documents index files' rows: ok)
    assert sorted(report.status) == ["checksum", "missing"] + ["ok"] * (len(files) - 2)
    assert all("media file" in detail for detail in report.detail[report.status != "ok"])
    build(config, scheduler=dask_scheduler, progress=False)   # finds the missing one by listing
    assert files[0].read_bytes() == intact[files[0]]
    repair_lake(config, verify_lake(config, progress=False), scheduler=dask_scheduler, progress=False)
    assert {path: path.read_bytes() for path in files} == intact
    assert set(verify_lake(config, progress=False).status) == {"ok"}


def image_folder(folder: Path) -> list[str]:
    """The demo's images written into ``folder``, one file each; their names, sorted."""
    folder.mkdir(parents=True)
    images = all_images()
    for name, payload in images.items():
        (folder / name).write_bytes(payload)
    return sorted(images)


def test_the_lake_is_the_same_for_any_worker_count_and_after_a_failed_build_resumed(
        corpus: tuple[Path, dict[str, list[Path]]], tmp_path: Path, dask_scheduler: str) -> None:
    root, sources = corpus
    data = tmp_path / "data"
    names = image_folder(data / "img")
    for part in range(3):   # the last file names an image that is not there yet
        lines = [{"items": [{"text": f"doc {part}.{i}"}, {"image": f"img/{name}"}, {"image": f"img/{names[0]}"}]}
                 for i, name in enumerate(names)]
        if part == 2:
            lines[-1]["items"].append({"image": "img/late.png"})
        (data / f"{part}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    datasets = {"j": interleaved([str(data / "*.jsonl")]), "t": interleaved([str(p) for p in sources["tar"]])}
    first = tmp_path / "one"
    first.mkdir()
    config = write_config(first, datasets, build={"split_size": "2KB"})
    late = r"2\.jsonl: line 34: items\[3\] \(image 'img/late.png'\): .*late.png: not found"
    with pytest.raises(InputError, match=late):
        build(config, scheduler=dask_scheduler, progress=False)
    (data / "img" / "late.png").write_bytes(all_images()["wide.png"])
    build(config, scheduler=dask_scheduler, progress=False)   # resumes: the same plan, the rest built
    second = tmp_path / "two"
    second.mkdir()
    other = write_config(second, datasets, build={"split_size": "2KB", "workers": 1})
    build(other, workers=1, progress=False)
    assert lake_files(first / "lake") == lake_files(second / "lake")
    assert images_view(config) == images_view(other)
    files = open_lake(config).sql("SELECT (SELECT 2 * count(*) FROM chunks) + (SELECT count(*) FROM media_files) AS n")
    assert len(lake_files(first / "lake")) == files.n[0]   # chunk and media files, and the rewritten media files


def test_a_build_killed_mid_way_resumes_to_the_same_lake(tmp_path: Path, dask_scheduler: str) -> None:
    data = tmp_path / "data"
    names = image_folder(data / "img")
    for part in range(4):   # ~90 chunks of a few documents, each with two images (one shared)
        lines = [{"items": [{"text": f"doc {part}.{i}: " + "words " * 20}, {"image": f"img/{names[i % len(names)]}"},
                            {"image": f"img/{names[part]}"}]} for i in range(100)]
        (data / f"{part}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    datasets = {"j": interleaved([str(data / "*.jsonl")])}
    reference = tmp_path / "reference"
    reference.mkdir()
    build(write_config(reference, datasets, build={"split_size": "1KB"}), scheduler=dask_scheduler, progress=False)
    total = open_lake(reference / "config.yaml").sql("SELECT count(*) AS n FROM chunks").n[0]
    killed = tmp_path / "killed"
    killed.mkdir()
    config = write_config(killed, datasets, build={"split_size": "1KB", "publish_interval": 0.25})
    lake = killed / "lake"

    def some_committed() -> bool:
        counts = snapshot_counts(lake)
        return counts is not None and counts[1] > 0   # (not later: under load the rest commits within a poll)

    log = killed / "build.log"
    with running_build(config, log) as proc:
        wait_until(some_committed, proc, log, "some chunks were committed")
        os.kill(proc.pid, signal.SIGKILL)   # the driver: its workers follow it
        assert proc.wait(timeout=30) == -signal.SIGKILL
    before = read_catalog(lake, "SELECT path FROM chunks WHERE status = 'committed'").path.tolist()
    assert 0 < len(before) < total, "the driver must be killed mid-build"
    kept = {path: os.stat(lake / media_path(path)).st_ino for path in before}
    build(config, scheduler=dask_scheduler, progress=False)
    assert {path: os.stat(lake / media_path(path)).st_ino for path in before} == kept   # not rebuilt
    assert lake_files(lake) == lake_files(reference / "lake")
    assert images_view(config) == images_view(reference / "config.yaml")


# The bad-image table: each case, the record it sits in, and what the error names.
def _bad_sources(root: Path) -> dict[str, tuple[Path, str, str]]:
    """case -> (source file holding good, bad, good documents; the bad record's location; a word of the reason)."""
    bad, good = bad_images(MAX_PIXELS), all_images()
    photo, icon = good["grace_hopper.jpg"], good["rgba.png"]
    (root / "img").mkdir(parents=True)
    for name, data in {**bad, "photo.jpg": photo}.items():
        (root / "img" / name).write_bytes(data)

    def jsonl(name: str, image: Any) -> Path:
        docs = [{"items": [{"text": "good"}, {"image": "img/photo.jpg"}]},
                {"items": [{"text": "bad"}, {"image": image}]},
                {"items": [{"image": {"bytes": base64.b64encode(icon).decode()}}]}]
        path = root / f"{name}.jsonl"
        path.write_text("".join(json.dumps(d) + "\n" for d in docs))
        return path

    def parquet(name: str, image: bytes) -> Path:
        rows = [[{"text": "good", "image": None}, {"text": None, "image": photo}],
                [{"text": "bad", "image": None}, {"text": None, "image": image}],
                [{"text": None, "image": icon}]]
        path = root / f"{name}.parquet"
        pq.write_table(pa.table({"items": pa.array(rows, pa.list_(pa.struct([("text", pa.string()),
                                                                              ("image", pa.binary())])))}), path)
        return path

    def tar(name: str, sample: dict[str, bytes]) -> Path:
        return write_tar(root / f"{name}.tar", [("0001", {"jpg": photo, "txt": b"good"}), ("0002", sample),
                                                ("0003", {"png": icon, "json": b'{"caption": "good"}'})])

    missing = json.dumps({"items": [{"text": "see"}, {"image": "0002.png"}]}).encode()
    return {
        "truncated": (jsonl("truncated", "img/truncated.jpg"), "line 2", "cannot be decoded"),
        "not an image": (parquet("text-bytes", bad["not-an-image.png"]), "row 1", "not an image format"),
        "bomb": (tar("bomb", {"png": bad["bomb.png"], "txt": b"bad"}), "sample 2 (0002)", "max_pixels"),
        "missing file": (jsonl("missing", "img/nowhere.png"), "line 2", "not found"),
        "missing member": (tar("member", {"json": missing, "jpg": photo}), "sample 2 (0002)",
                           "names member '0002.png'"),
        "member not an image": (tar("text-member", {"jpg": b"not a JPEG", "txt": b"bad"}), "sample 2 (0002)",
                                "not an image format"),
    }


def _read(path: Path, on_error: str, split: Split | None = None) -> Any:
    layout = {".jsonl": "jsonl", ".parquet": "parquet", ".tar": "tar"}[path.suffix]
    split = split or {"jsonl": Split("bytes", 0, path.stat().st_size), "parquet": Split("row_group", 0, 1, 0),
                      "tar": Split("file", 0, path.stat().st_size)}[layout]
    record_format = DatasetConfig(sources=["x"], format="interleaved",
                                  interleaved={**STORED, "max_pixels": MAX_PIXELS}).record_format()
    return read_split(SplitSource(str(path), layout, None, split, record_format, on_error, {}))


def test_a_tar_cut_into_byte_ranges_holds_its_samples_once_each(corpus: tuple[Path, dict[str, list[Path]]],
                                                                  tmp_path: Path) -> None:
    _, sources = corpus
    path = next(p for p in sources["tar"] if p.suffix == ".tar")
    size = path.stat().st_size
    whole = _read(path, "raise")
    for step in (5_000, 40_000, size):
        parts = [_read(path, "raise", Split("bytes", a, min(a + step, size))) for a in range(0, size, step)]
        assert [d for part in parts for d in part.documents] == whole.documents, step
        assert sum(part.num_records for part in parts) == whole.num_records == len(whole.documents)
    # A bad sample in a later split is named by its number in the file.
    tar, where, _ = _bad_sources(tmp_path)["bomb"]
    later = Split("bytes", 1024, tar.stat().st_size)   # from after sample 1's first header
    with pytest.raises(InputError, match=re.escape(f"{tar}: {where}: items[0] (member 0002.png)")):
        _read(tar, "raise", later)
    skipped = _read(tar, "skip", later)
    assert [r.location for r in skipped.rejects] == [where] and skipped.rejects[0].line == 2
    assert skipped.num_records == 2 and skipped.records == [1]


def test_bad_images_raise_naming_file_record_and_item_or_skip_their_document(tmp_path: Path) -> None:
    for case, (path, where, reason) in _bad_sources(tmp_path).items():
        with pytest.raises(InputError) as raised:
            _read(path, "raise")
        message = str(raised.value)
        item = 0 if path.suffix == ".tar" and case != "missing member" else 1   # a captioned image is item 0
        assert "\n" not in message and message.startswith(f"{path}: {where}: items[{item}]"), (case, message)
        assert reason in message, (case, message)
        skipped = _read(path, "skip")
        assert len(skipped.documents) == 2 and skipped.records == [0, 2], case
        assert [r.location for r in skipped.rejects] == [where] and reason in skipped.rejects[0].reason, case
        assert len(skipped.images.ids) == 2 and len(skipped.images.rows) == 2, case


def test_bad_images_skipped_in_a_build_are_rejects_and_nothing_else_is_lost(tmp_path: Path,
                                                                             dask_scheduler: str) -> None:
    cases = _bad_sources(tmp_path / "data")
    datasets = {f"d{i}": {**interleaved([str(path)], max_pixels=MAX_PIXELS), "on_error": "skip"}
                for i, (path, _, _) in enumerate(cases.values())}
    config = write_config(tmp_path, datasets)
    build(config, scheduler=dask_scheduler, progress=False)
    lake = open_lake(config)
    rejects = lake.sql("SELECT dataset, location, reason FROM rejects ORDER BY dataset")
    assert list(rejects.location) == [where for _, where, _ in cases.values()]
    assert all(reason in found for (_, _, reason), found in zip(cases.values(), rejects.reason))
    assert set(lake.sql("SELECT num_docs FROM datasets").num_docs) == {2}
    assert set(lake.sql("SELECT count(*) AS n FROM images GROUP BY dataset").n) == {2}
    # A catalog written before chunk_images reads, its images view empty.
    older = tmp_path / "older.duckdb"
    shutil.copy(tmp_path / "lake" / "catalog.duckdb", older)
    with duckdb.connect(str(older)) as con:
        con.execute("DROP TABLE chunk_images")
    reader = connect_reader(str(older))
    try:
        assert reader.execute("SELECT count(*) FROM images").fetchone() == (0,)
        chunks = lake.sql("SELECT count(*) AS n FROM chunks").n[0]
        assert reader.execute("SELECT count(*) FROM chunks").fetchone() == (chunks,)
    finally:
        reader.close()


def test_tars_need_stored_images_and_the_fingerprint_holds_the_decoder(tmp_path: Path,
                                                                        corpus: tuple[Path, dict[str, list[Path]]]
                                                                        ) -> None:
    from lakeloader.config import load_config
    from lakeloader.plan.planner import plan_dataset

    _, sources = corpus
    tars = [str(p) for p in sources["tar"]]
    config = load_config(write_config(tmp_path, {"t": {"sources": tars, "format": "interleaved"}}))
    with pytest.raises(ConfigError, match="interleaved.images: stored"):
        plan_dataset("t", config, "tok")
    references = DatasetConfig(sources=["x"], format="interleaved")
    stored = DatasetConfig(sources=["x"], format="interleaved", interleaved={"images": "stored"})
    assert set(references.build_fields) == {"items_field", "text_key", "image_key"}   # fingerprints as before
    assert stored.build_fields["images"] == "stored" and "max_pixels" in stored.build_fields
    plan = plan_dataset("t", load_config(write_config(tmp_path, {"t": interleaved(tars)})), "tok")
    smaller = plan_dataset("t", load_config(write_config(tmp_path, {"t": interleaved(tars, max_pixels=5)})), "tok")
    assert smaller.fingerprint != plan.fingerprint and smaller.chunk_dir != plan.chunk_dir
    assert DECODER.startswith("Pillow ")
