"""A shared lake is untrusted input (issue 47, items 1-3): every name a reader takes from a lake is
a name inside it, and every catalog file it reads (the CURRENT pointer, the snapshot, the reader
index) is the file as published, or one clear error naming it: never a file written or read
outside the lake or its cache, a crash, a hang or other batches."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import boto3
import duckdb
import numpy as np
import pyarrow as pa
import pytest
import yaml

from lakeloader.catalog.lake import Lake, open_lake
from lakeloader.catalog.location import checked_name
from lakeloader.catalog.pointer import parse_pointer, seal_pointer
from lakeloader.catalog.reader_index import INDEX_FORMAT, TABLES
from lakeloader.cli import main
from lakeloader.contracts.errors import CatalogIntegrityError
from lakeloader.feed.loader import Loader
from lakeloader.ingest.driver import build

from conftest import reseal_snapshot
from test_s3 import BUCKET, s3_endpoint, storage_options  # noqa: F401  (s3_endpoint: a fixture)

STEPS = range(4)


def lake_of(config: Path) -> Path:
    return config.parent / "lake"


def pointer_of(lake: Path) -> dict[str, Any]:
    return json.loads((lake / "_catalog" / "CURRENT").read_bytes())


def write_pointer(lake: Path, **changes: Any) -> None:
    """Replace keys of the lake's CURRENT pointer and seal it again, as an attacker would."""
    payload = {k: v for k, v in pointer_of(lake).items() if k != "checksum"} | changes
    (lake / "_catalog" / "CURRENT").write_bytes(seal_pointer(payload))


def batch_digests(config: Path) -> list[str]:
    with Loader(config) as loader:
        return [hashlib.sha256(b"".join(np.ascontiguousarray(v).tobytes() for _, v in sorted(loader.batch(s).items())))
                .hexdigest() for s in STEPS]


def test_names_outside_the_lake_are_refused() -> None:
    for bad in ["/etc/passwd", "../other/x.parquet", "a/../../x", "a//b", "", ".", "a/./b", "C:\\x", "a\\..\\b",
                "x\x00y", "s3://bucket/x"]:
        with pytest.raises(CatalogIntegrityError, match="not a name inside the lake"):
            checked_name(bad)
    assert checked_name("web/0123456789abcdef/chunk-00001.parquet") == "web/0123456789abcdef/chunk-00001.parquet"


@pytest.mark.parametrize("changes, why", [
    ({"file": "../../otherlake/_catalog/catalog-000001.duckdb"}, "file"),
    ({"file": "/tmp/site-packages/zz.pth"}, "file"),
    ({"reader_index": {"prefix": "../../elsewhere/catalog-000001", "format": INDEX_FORMAT}}, "reader_index"),
    ({"lake_id": "../../../../x"}, "lake_id"),
    ({"version": "1"}, "version"),
    ({"sha256": {"catalog": "0" * 64}}, "sha256"),
])
def test_a_pointer_naming_anything_but_its_versions_files_is_refused(changes: dict[str, Any], why: str) -> None:
    payload = {"version": 1, "file": "catalog-000001.duckdb", "reader_index": {"prefix": "catalog-000001",
               "format": INDEX_FORMAT}, "sha256": {key: "a" * 64 for key in ("catalog", *TABLES)},
               "published_at": 1.0, "build_id": 1, "lake_id": "0" * 32}
    assert parse_pointer(seal_pointer(payload), "CURRENT", TABLES, INDEX_FORMAT)["version"] == 1
    with pytest.raises(CatalogIntegrityError, match=f"CURRENT is damaged or was altered.*{why}"):
        parse_pointer(seal_pointer(payload | changes), "CURRENT", TABLES, INDEX_FORMAT)
    unsealed = json.dumps(payload | {"checksum": "0" * 64}).encode()
    with pytest.raises(CatalogIntegrityError, match="checksum does not match"):
        parse_pointer(unsealed, "CURRENT", TABLES, INDEX_FORMAT)


def test_a_local_pointer_to_another_lakes_catalog_reads_nothing_of_it(built_lake: Path, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    lake = lake_of(built_lake)
    other = tmp_path / "otherlake"
    shutil.copytree(lake, other)
    write_pointer(lake, file=f"../../otherlake/_catalog/{pointer_of(lake)['file']}")
    (lake / "catalog.duckdb").unlink()   # a lake copied without its writer's catalog: sql reads the snapshot
    assert main(["sql", str(built_lake), "SELECT count(*) FROM chunks"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "CURRENT is damaged or was altered" in err and "Traceback" not in err
    with pytest.raises(CatalogIntegrityError, match="CURRENT"):
        Loader(built_lake).batch(0)


def _alter_chunk_paths(lake: Path, prefix: str) -> None:
    """Prefix every chunk path in the lake's catalog, its published snapshot and reader index with
    ``prefix``, and reseal the pointer (a tampered catalog that passes its checksums)."""
    pointer = pointer_of(lake)
    for catalog in (lake / "_catalog" / pointer["file"], lake / "catalog.duckdb"):
        with duckdb.connect(str(catalog)) as con:
            con.execute("UPDATE chunks SET path = ? || path", [prefix])
    chunks = lake / "_catalog" / f"{pointer['reader_index']['prefix']}.chunks.arrow"
    table = pa.ipc.open_file(pa.BufferReader(chunks.read_bytes())).read_all()
    paths = pa.array([prefix + p for p in table.column("path").to_pylist()], pa.string())
    table = table.set_column(table.schema.get_field_index("path"), "path", paths)
    with pa.OSFile(str(chunks), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    reseal_snapshot(lake)


def test_chunk_paths_reaching_outside_the_lake_are_refused(built_lake: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    lake = lake_of(built_lake)
    shutil.copytree(lake, tmp_path / "otherlake")   # what the altered paths would read
    (tmp_path / "otherlake" / "marker").write_text("")
    _alter_chunk_paths(lake, "../otherlake/")
    with pytest.raises(CatalogIntegrityError, match=r"'\.\./otherlake/.*not a name inside the lake"):
        Loader(built_lake).batch(0)
    with pytest.raises(CatalogIntegrityError, match=r"\.\./otherlake/"):
        open_lake(built_lake).sql("SELECT count(*) FROM documents")
    out = tmp_path / "b.npz"
    assert main(["batches", str(built_lake), "--steps", "0:2", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and "not a name inside the lake" in err.splitlines()[-1]   # after the progress bar
    assert not out.exists()


def _upload_tree(endpoint: str, folder: Path, prefix: str) -> None:
    client = boto3.client("s3", endpoint_url=endpoint)
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        client.upload_file(str(path), BUCKET, f"{prefix}/{path.relative_to(folder)}")


def test_an_s3_lake_writes_nothing_outside_the_readers_cache(built_lake: Path, tmp_path: Path,
                                                             s3_endpoint: str,  # noqa: F811
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    lake = lake_of(built_lake)
    target = tmp_path / "venv" / "site-packages" / "zz.pth"
    escape = tmp_path / "escaped"
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    prefix = "hostile"
    _upload_tree(s3_endpoint, lake, prefix)
    # The file an absolute name would fetch: the object the joined key names.
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/_catalog/{target}".replace("//", "/"), Body=b"import os\n")
    config = yaml.safe_load(built_lake.read_text())
    config["lake"] = f"s3://{BUCKET}/{prefix}"
    config["storage_options"] = storage_options(s3_endpoint)
    s3_config = tmp_path / "s3.yaml"
    s3_config.write_text(yaml.safe_dump(config))
    payload = {k: v for k, v in pointer_of(lake).items() if k != "checksum"}
    for changes in ({"file": str(target)}, {"lake_id": f"../../../../../../../../..{escape}"},
                    {"reader_index": {"prefix": f"../../..{escape}/catalog-000001", "format": INDEX_FORMAT}}):
        client.put_object(Bucket=BUCKET, Key=f"{prefix}/_catalog/CURRENT", Body=seal_pointer(payload | changes))
        assert main(["sql", str(s3_config), "SELECT count(*) FROM chunks"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "CURRENT is damaged or was altered" in err, err
        with pytest.raises(CatalogIntegrityError, match="CURRENT"):
            Loader(s3_config).batch(0)
        assert not target.exists() and not escape.exists() and not target.parent.exists()
    # A snapshot altered in the lake is never cached, never opened.
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/_catalog/CURRENT", Body=seal_pointer(payload))
    damaged = bytearray((lake / "_catalog" / payload["file"]).read_bytes())
    damaged[len(damaged) // 2] ^= 1
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/_catalog/{payload['file']}", Body=bytes(damaged))
    assert main(["sql", str(s3_config), "SELECT count(*) FROM chunks"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{payload['file']} is damaged or was altered" in err, err
    assert not list(Path(Lake(f"s3://{BUCKET}/{prefix}", storage_options(s3_endpoint)).cache_dir)
                    .glob(f"snapshots/*/{payload['file']}"))


FLIPS_SCRIPT = textwrap.dedent("""
    import hashlib, json, random, sys
    import numpy as np
    from pathlib import Path
    from lakeloader.catalog.lake import open_lake
    from lakeloader.contracts.errors import LakeloaderError
    from lakeloader.feed.loader import Loader

    config, flips_per_file, seed = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    catalog = config.parent / "lake" / "_catalog"

    def outcome():
        with Loader(config) as loader:
            digests = [hashlib.sha256(b"".join(np.ascontiguousarray(v).tobytes()
                                               for _, v in sorted(loader.batch(s).items()))).hexdigest()
                       for s in range(4)]
        rows = open_lake(config).sql("SELECT count(*) AS n, sum(num_tokens) AS t FROM chunks").to_dict("records")
        return {"batches": digests, "chunks": rows}

    intact = outcome()
    print(json.dumps({"intact": intact}), flush=True)
    rng = random.Random(seed)
    current = json.loads((catalog / "CURRENT").read_bytes())["reader_index"]["prefix"]
    for path in sorted(p for p in catalog.iterdir() if p.name == "CURRENT" or p.name.startswith(current)):
        data = path.read_bytes()
        positions = range(len(data)) if len(data) <= flips_per_file else rng.sample(range(len(data)), flips_per_file)
        for position in positions:
            bit = rng.randrange(8)
            flipped = bytearray(data)
            flipped[position] ^= 1 << bit
            print(json.dumps({"file": path.name, "position": position, "bit": bit, "started": True}), flush=True)
            path.write_bytes(bytes(flipped))
            try:
                result = {"same": outcome() == intact}
            except LakeloaderError as exc:
                result = {"error": type(exc).__name__, "message": str(exc)}
            finally:
                path.write_bytes(data)
            print(json.dumps({"file": path.name, "position": position, "bit": bit, **result}), flush=True)
""")


def test_flipped_bits_in_catalog_files_give_the_intact_batches_or_one_error_naming_the_file(
        built_lake: Path, tmp_path: Path) -> None:
    """Every file under _catalog/ (pointer, snapshot, reader index), bits flipped one at a time in a
    child process (a crash or hang would end it): each run gives exactly the intact batches and
    catalog, or a lakeloader error naming the damaged file."""
    (lake_of(built_lake) / "catalog.duckdb").unlink()   # as copied without it: `sql` reads the snapshot too
    script = tmp_path / "flips.py"
    script.write_text(FLIPS_SCRIPT)
    result = subprocess.run([sys.executable, str(script), str(built_lake), "40", str(random.randrange(1 << 30))],
                            capture_output=True, text=True, timeout=400, check=False, cwd=tmp_path)
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    started = [line for line in lines if line.get("started")]
    assert result.returncode == 0, f"child ended {result.returncode} at {started[-1:]}: {result.stderr[-2000:]}"
    runs = [line for line in lines if "file" in line and not line.get("started")]
    assert len(runs) == len(started) >= 120
    for run in runs:
        if "error" in run:
            named = run["file"] if run["file"] != "CURRENT" else "_catalog/CURRENT"
            assert named in run["message"] and "\n" not in run["message"], run
        else:
            assert run["same"], f"other data with no error: {run}"
    errors = [run for run in runs if "error" in run]
    assert len(errors) >= len(runs) * 0.9   # the files are read and checked, not skipped


def test_a_lake_published_before_checksums_reads_again_once_built(built_lake: Path, dask_scheduler: str) -> None:
    """A pointer without checksums (an older lakeloader's) is refused by readers with what to do;
    a build takes it, publishes a sealed one, and the batches are those of before."""
    lake = lake_of(built_lake)
    expected = batch_digests(built_lake)
    legacy = {k: v for k, v in pointer_of(lake).items() if k not in ("checksum", "sha256")}
    (lake / "_catalog" / "CURRENT").write_text(json.dumps(legacy))
    with pytest.raises(CatalogIntegrityError, match="no checksum.*`lakeloader build CONFIG` publishes"):
        Loader(built_lake).batch(0)
    build(built_lake, scheduler=dask_scheduler, progress=False)
    assert pointer_of(lake)["version"] == legacy["version"] + 1
    assert batch_digests(built_lake) == expected
