"""A lake repairs itself, and a build trusts a local catalog only if it is the lake's own.

Local lake: a deleted or truncated chunk file is rebuilt by the next ``build`` (a listing finds
it), a damaged file of the right size by ``verify --repair`` (the checksum pass finds it), and a
corrupt ``catalog.duckdb`` comes back from the newest snapshot with ``build --recover-catalog``.
S3 lake (moto server on loopback): a lake whose objects were deleted is built again from nothing,
and a host whose cached writer catalog is older than the lake's newest snapshot, or belongs to a
lake that no longer exists, adopts the snapshot. After every repair each chunk file is
byte-identical to the original and the batches are bitwise equal.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

import boto3
import duckdb
import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

from lakeloader.catalog.lake import Lake, open_lake
from lakeloader.catalog.snapshot import read_pointer
from lakeloader.cli import main
from lakeloader.contracts.errors import CatalogError
from lakeloader.index.ranges import cumulative
from lakeloader.contracts.chunk_file import RECORD_COLUMN, TOKENS_COLUMN, table_parts
from lakeloader.ingest.chunk import EARLIER_DATA_PAGE_BYTES, EncodedParts, chunk_table, encode_chunk_file
from lakeloader.ingest.driver import build
from lakeloader.read.verify import verify_lake

from conftest import (
    Lakes,
    assert_batches_equal,
    assert_progress_counted,
    global_batches,
    small_lake_request,
    stdlib_texts,
    write_config,
    write_jsonl,
)
from test_s3 import BUCKET, config_dict, objects, s3_endpoint, storage_options, write_yaml  # noqa: F401

STEPS = range(4)
LOADER = {"seq_len": 64, "batch_size": 8, "shuffle": {"kind": "window", "window_chunks": 2}}


def chunk_files(lake: Lake) -> dict[str, bytes]:
    """Lake-relative path -> bytes of every committed chunk file."""
    paths = lake.sql("SELECT path FROM chunks WHERE status = 'committed' ORDER BY dataset, global_index").path
    return {path: lake.fs.cat_file(lake.path_of(path)) for path in paths}


def checksums(lake: Lake) -> dict[str, str]:
    frame = lake.sql("SELECT path, checksum FROM chunks WHERE status = 'committed'")
    return dict(zip(frame.path, frame.checksum))


@pytest.fixture
def local_lake(lakes: Lakes, tmp_path: Path) -> tuple[Path, dict[str, bytes], list[dict[str, Any]]]:
    """A built local lake (a private copy): its config, every chunk file's bytes and the first batches."""
    spec = small_lake_request()   # its loader settings are LOADER
    assert spec["loader"] == LOADER
    config = lakes.copy(tmp_path, spec.pop("corpus"), spec.pop("datasets"), **spec)
    files = chunk_files(open_lake(config))
    assert len(files) >= 4
    return config, files, global_batches(config, 1, STEPS)


def assert_lake_as_built(config: Path, files: dict[str, bytes], batches: list[dict[str, Any]]) -> None:
    lake = open_lake(config)
    assert chunk_files(lake) == files
    assert all(hashlib.sha256(data).hexdigest() == checksums(lake)[path] for path, data in files.items())
    assert (verify_lake(config, progress=False).status == "ok").all()
    assert_batches_equal(global_batches(config, 1, STEPS), batches)
    assert_progress_counted(config)


def test_build_rebuilds_missing_and_truncated_chunks(local_lake: Any, dask_scheduler: str,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    config, files, batches = local_lake
    lake = open_lake(config)
    missing, truncated = list(files)[0], list(files)[2]
    Path(lake.path_of(missing)).unlink()
    Path(lake.path_of(truncated)).write_bytes(files[truncated][:100])
    # A new packing plan at the same time: the others' counts come from their files, the damaged
    # chunks' from their rebuild.
    raw = yaml.safe_load(config.read_text())
    raw["loader"]["packing"] = "pack"
    packed = config.with_name("packed.yaml")
    packed.write_text(yaml.safe_dump(raw))
    with caplog.at_level(logging.WARNING, logger="lakeloader"):
        report = build(packed, scheduler=dask_scheduler, progress=False)
    assert report.chunks_built == 2  # exactly the two damaged chunks, nothing else re-tokenized
    assert "its file is missing" in caplog.text and "its file has 100 bytes" in caplog.text
    assert lake.sql("SELECT count(*) AS n FROM chunk_examples").n[0] == len(files)
    assert_lake_as_built(config, files, batches)


def test_verify_repair_rebuilds_a_damaged_chunk_of_the_right_size(local_lake: Any, dask_scheduler: str,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    config, files, batches = local_lake
    lake = open_lake(config)
    damaged = list(files)[1]
    data = bytearray(files[damaged])
    data[len(data) // 2] ^= 0xFF
    Path(lake.path_of(damaged)).write_bytes(bytes(data))
    assert build(config, scheduler=dask_scheduler, progress=False).chunks_built == 0  # a listing cannot tell
    assert main(["verify", str(config), "--no-progress"]) == 1
    assert "verify CONFIG --repair" in capsys.readouterr().err
    assert main(["verify", lake.root, "--repair", "--no-progress"]) == 2
    assert "config the lake was built from" in capsys.readouterr().err
    assert main(["verify", str(config), "--repair", "--scheduler", dask_scheduler, "--no-progress"]) == 0
    assert "after repair, verified" in capsys.readouterr().err
    assert_lake_as_built(config, files, batches)


def test_corrupt_catalog_recovers_from_the_newest_snapshot(local_lake: Any, dask_scheduler: str,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    config, files, batches = local_lake
    lake = open_lake(config)
    catalog = Path(lake.writer_catalog_path)
    catalog.write_bytes(b"\x00garbage" * 4096)
    with pytest.raises(CatalogError, match="--recover-catalog"):
        build(config, scheduler=dask_scheduler, progress=False)
    assert main(["build", str(config), "--recover-catalog", "--scheduler", dask_scheduler, "--no-progress"]) == 0
    assert list(catalog.parent.glob("catalog.duckdb.damaged-*")), "the damaged catalog is kept aside"
    assert_lake_as_built(config, files, batches)


def test_build_repairs_a_chunk_written_with_an_earlier_page_size(tmp_path: Path, dask_scheduler: str) -> None:
    """A lake built before chunk files had their present page size (pyarrow's 1 MiB pages) is
    repaired byte for byte: the rebuild takes the earlier page size the catalog's checksum says."""
    source = write_jsonl(tmp_path / "data" / "a.jsonl", stdlib_texts("email") + stdlib_texts("json"))
    config = write_config(tmp_path, {"d": {"sources": [str(source)]}}, build={"split_size": "64MB"},
                          loader={"seq_len": 64, "batch_size": 8})
    build(config, scheduler=dask_scheduler, progress=False)
    lake = open_lake(config)
    path = lake.sql("SELECT path FROM chunks WHERE status = 'committed'").path.tolist()[0]
    file = Path(lake.path_of(path))
    parquet = pq.ParquetFile(file)
    stored = parquet.read()   # the chunk's table made again from what it stores, as the build makes it
    parts = table_parts(stored)
    ids = stored.column(TOKENS_COLUMN).combine_chunks().values.to_numpy()
    encoded = EncodedParts(ids, parts, [None] * len(parts.part_lengths))
    table = chunk_table(stored.column(RECORD_COLUMN).to_pylist(), encoded, False)
    metadata = parquet.metadata
    bounds = cumulative(np.array([metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]))
    assert encode_chunk_file(table, bounds) == file.read_bytes()   # re-encoding the file gives its bytes
    earlier = encode_chunk_file(table, bounds, EARLIER_DATA_PAGE_BYTES[0])
    assert earlier != file.read_bytes(), "one row group holds more than a page: the page size shows in the bytes"
    # The lake as the earlier lakeloader left it (its file, the catalog's record), then the file lost.
    with duckdb.connect(lake.writer_catalog_path) as con:
        con.execute("UPDATE chunks SET num_bytes = ?, checksum = ? WHERE path = ?",
                    [len(earlier), hashlib.sha256(earlier).hexdigest(), path])
    file.unlink()
    assert build(config, scheduler=dask_scheduler, progress=False).chunks_built == 1
    assert file.read_bytes() == earlier
    assert (verify_lake(config, progress=False).status == "ok").all()


# -- S3 lakes: the host's cached writer catalog against the lake ------------------------------------


def delete_objects(endpoint: str, prefix: str) -> None:
    client = boto3.client("s3", endpoint_url=endpoint)
    for key in objects(endpoint, prefix):
        client.delete_object(Bucket=BUCKET, Key=key)


def test_s3_lake_whose_objects_were_deleted_is_built_again(s3_endpoint: str, tmp_path: Path, dask_scheduler: str,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    write_jsonl(tmp_path / "a.jsonl", stdlib_texts("json", limit=3))
    raw = config_dict(f"s3://{BUCKET}/wiped", [str(tmp_path / "a.jsonl")], storage_options(s3_endpoint))
    raw["loader"] = LOADER
    config = write_yaml(tmp_path / "s3.yaml", raw)
    monkeypatch.setenv("LAKELOADER_CACHE", str(tmp_path / "host-a"))
    first = build(config, scheduler=dask_scheduler, progress=False)
    lake = open_lake(config)
    files, batches = chunk_files(lake), global_batches(config, 1, STEPS)
    old_id = read_pointer(lake).get("lake_id")

    delete_objects(s3_endpoint, "wiped/")  # or a re-created bucket, or the URL on a new server
    with caplog.at_level(logging.INFO, logger="lakeloader"):
        again = build(config, scheduler=dask_scheduler, progress=False)
    assert again.chunks_built == first.chunks_built == again.chunks_total
    assert "the lake is empty, starting a fresh one" in caplog.text
    new_id = read_pointer(lake)["lake_id"]
    assert new_id != old_id
    assert_lake_as_built(config, files, batches)

    # Host B's catalog belongs to the old lake: it adopts the new lake's snapshot.
    monkeypatch.setenv("LAKELOADER_CACHE", str(tmp_path / "host-b"))
    build(config, scheduler=dask_scheduler, progress=False)  # host B's catalog: the new lake's
    monkeypatch.setenv("LAKELOADER_CACHE", str(tmp_path / "host-a"))
    delete_objects(s3_endpoint, "wiped/")
    build(config, scheduler=dask_scheduler, progress=False)  # a third lake at the same URL
    monkeypatch.setenv("LAKELOADER_CACHE", str(tmp_path / "host-b"))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lakeloader"):
        assert build(config, scheduler=dask_scheduler, progress=False).chunks_built == 0
    assert f"belongs to lake {new_id}" in caplog.text and "adopting the lake's published catalog" in caplog.text
    assert open_lake(config).sql("SELECT value FROM lake_meta WHERE key = 'lake_id'").value[0] == \
        read_pointer(lake)["lake_id"]
    assert_lake_as_built(config, files, batches)


def test_s3_host_with_an_older_catalog_adopts_the_newest_snapshot(s3_endpoint: str, tmp_path: Path,
                                                                   dask_scheduler: str,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    write_jsonl(tmp_path / "a.jsonl", stdlib_texts("json", limit=4))
    write_jsonl(tmp_path / "b.jsonl", stdlib_texts("email", limit=4))
    raw = config_dict(f"s3://{BUCKET}/shared", [str(tmp_path / "a.jsonl")], storage_options(s3_endpoint))
    one = write_yaml(tmp_path / "one.yaml", raw)
    raw["datasets"]["more"] = {"sources": [str(tmp_path / "b.jsonl")]}
    raw["mixture"] = {"weights": {"mix": 0.5, "more": 0.5}}
    two = write_yaml(tmp_path / "two.yaml", raw)

    monkeypatch.setenv("LAKELOADER_CACHE", str(tmp_path / "host-a"))
    build(one, scheduler=dask_scheduler, progress=False)
    monkeypatch.setenv("LAKELOADER_CACHE", str(tmp_path / "host-b"))
    grown = build(two, scheduler=dask_scheduler, progress=False)  # adopts A's snapshot, adds "more"
    assert 0 < grown.chunks_built < grown.chunks_total

    monkeypatch.setenv("LAKELOADER_CACHE", str(tmp_path / "host-a"))  # A's catalog lacks "more"
    with caplog.at_level(logging.INFO, logger="lakeloader"):
        report = build(two, scheduler=dask_scheduler, progress=False)
    assert report.chunks_built == 0, "the lake's newer snapshot knows every chunk"
    assert "older than the lake's newest snapshot" in caplog.text
    assert yaml.safe_load(open_lake(two).fs.cat_file(f"{BUCKET}/shared/_catalog/CURRENT"))["version"] > 2
