"""A shared lake is untrusted input, and a machine has faults: a damaged catalog file, a dry run on
a read-only lake, a bucket that does not exist, mistaken ``storage_options`` and a disk that fills
as the build saves its catalog each end with one line on stderr naming the thing and what to do,
exit status 2, and no traceback; the ``builds`` table says what the exit status says.

The object store is moto's S3 server on loopback (as in ``test_s3``); full and read-only disks
are real tmpfs mounts (``test_faults``'s helpers: skipped without root).
"""

from __future__ import annotations

import os
import json
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import duckdb
import pytest
import yaml

from lakeloader.catalog.lake import open_lake
from lakeloader.cli import main
from lakeloader.config import load_config
from lakeloader.ingest import driver, execute

from conftest import DEMO_TOKENIZER, stdlib_texts, write_config, write_jsonl
from test_faults import remount, tmpfs
from test_s3 import BUCKET, s3_endpoint  # noqa: F401  (s3_endpoint: a fixture)

RECOVER = "recover it from the lake's newest published snapshot with `lakeloader build CONFIG --recover-catalog`"
SECRET = f"planted-secret-{uuid.uuid4().hex}"


def one_line_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """Run the command line in this process: exit status 2 and exactly one line on stderr, the
    error (a traceback would have raised here); returns the line."""
    status = main(list(args))
    err = capsys.readouterr().err
    assert status == 2, (args, status, err)
    assert err.startswith(f"lakeloader {args[0]}: error: ") and err.count("\n") == 1, err
    return err


# -- a damaged catalog file ------------------------------------------------------------------------


def _cut(keep: Callable[[int], int]) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        os.truncate(path, keep(path.stat().st_size))
    return damage


def _overwrite(offset: int, data: Callable[[int], bytes]) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        size = path.stat().st_size
        with open(path, "r+b") as handle:
            handle.seek(offset)
            handle.write(data(size - offset))
    return damage


DAMAGE = {
    "empty": _cut(lambda size: 0),
    "cut_in_the_headers": _cut(lambda size: 6000),
    "cut_in_the_first_block": _cut(lambda size: 20_000),
    "cut_short_at_the_end": _cut(lambda size: min(size - 300_000, 400_000)),   # past the headers, in the data
    "zeroed_headers": _overwrite(0, lambda rest: bytes(12288)),
    "garbage": _overwrite(0, os.urandom),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_catalog_file_is_one_line_with_the_recover_hint(
        built_lake: Path, dask_scheduler: str, capsys: pytest.CaptureFixture[str], damage: str) -> None:
    catalog = built_lake.parent / "lake" / "catalog.duckdb"
    DAMAGE[damage](catalog)
    commands = [("status", str(built_lake)), ("sql", str(built_lake), "SELECT * FROM builds, datasets, shards"),
                ("gc", str(built_lake), "--dry-run"), ("gc", str(built_lake)),
                ("build", str(built_lake), "--scheduler", dask_scheduler, "--no-progress")]
    if damage == "cut_short_at_the_end":   # it opens: the commands that read the blocks lost find it
        commands = [commands[0], commands[1], commands[4]]
    for args in commands:
        line = one_line_error(capsys, *args)
        assert f"catalog {catalog} is corrupt (" in line and RECOVER in line, line


# -- gc --dry-run reads only -----------------------------------------------------------------------


def test_gc_dry_run_lists_a_read_only_lake(built_lake: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lake = built_lake.parent / "lake"
    files = sorted(p.relative_to(lake) for p in lake.rglob("*"))
    with tmpfs(tmp_path / "ro", "16m") as mounted:
        shutil.copytree(lake, mounted, dirs_exist_ok=True)  # the built lake, on a disk then made read-only
        remount(mounted, "ro")
        config = yaml.safe_load(built_lake.read_text())
        config["lake"] = str(mounted)
        ro_config = tmp_path / "ro.yaml"
        ro_config.write_text(yaml.safe_dump(config))
        assert main(["gc", str(ro_config), "--dry-run", "--format", "json"]) == 0
        listed = json.loads(capsys.readouterr().out)   # no chunk folder; the index files the build's compaction replaced
        assert all(row["folder"].startswith("_documents/") for row in listed)
        line = one_line_error(capsys, "gc", str(ro_config))  # removing folders writes: one clear line
        assert f"cannot open the catalog {mounted / 'catalog.duckdb'} for writing" in line
        assert "Read-only file system" in line and "`lakeloader gc --dry-run` only reads" in line
        assert sorted(p.relative_to(mounted) for p in mounted.rglob("*")) == files


def test_gc_dry_run_beside_a_build_holding_the_catalog(built_lake: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lake = open_lake(built_lake)
    stale = lake.path_of("d/0123456789abcdef")   # a replaced plan's folder: the dry run lists it
    lake.fs.makedirs(stale)
    lake.fs.pipe_file(f"{stale}/chunk.parquet", b"x" * 10)
    # Another process holds the catalog read-write, as a build does: the dry run reads the snapshot.
    holder = subprocess.Popen([sys.executable, "-c", HOLD_CATALOG, lake.writer_catalog_path],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "holding\n"
        assert main(["gc", str(built_lake), "--dry-run", "--format", "json"]) == 0
        listed = json.loads(capsys.readouterr().out)   # and the index files the build's compaction replaced
        assert [row for row in listed if not row["folder"].startswith("_documents/")] == [
            {"dataset": "d", "folder": "d/0123456789abcdef", "files": 1, "bytes": 10}]
        line = one_line_error(capsys, "gc", str(built_lake))   # removing them waits for the build
        assert f"catalog {lake.writer_catalog_path} is in use" in line
    finally:
        holder.communicate("", timeout=60)
    assert lake.fs.exists(stale)


HOLD_CATALOG = "import duckdb, sys; con = duckdb.connect(sys.argv[1]); print('holding', flush=True); sys.stdin.read()"


# -- object stores: a bucket that does not exist, storage_options that do not fit ------------------


def s3_config(tmp_path: Path, lake: str, options: dict[str, Any]) -> Path:
    write_jsonl(tmp_path / "data" / "a.jsonl", stdlib_texts("json", limit=2))
    raw = {"lake": lake, "tokenizer": str(DEMO_TOKENIZER), "storage_options": options,
           "datasets": {"code": {"sources": [str(tmp_path / "data" / "a.jsonl")]}},
           "build": {"split_size": "16KB"}, "io_retry_deadline": 5}
    path = tmp_path / "s3.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def test_a_bucket_that_does_not_exist_is_one_line_naming_the_lake(
        s3_endpoint: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lake = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/lake"
    config = s3_config(tmp_path, lake, {"endpoint_url": s3_endpoint, "key": "testing", "secret": SECRET})
    for args in (("build", str(config), "--no-progress"), ("status", str(config)),
                 ("sql", str(config), "SELECT 1"), ("gc", str(config), "--dry-run")):
        line = one_line_error(capsys, *args)
        assert f"lake {lake} (endpoint {s3_endpoint}): bucket " in line and "does not exist" in line, line
        assert "create it, or correct `lake:`" in line and SECRET not in line, line
    assert not list(Path(os.environ["LAKELOADER_CACHE"]).rglob("catalog.duckdb*"))


OPTION_MISTAKES: dict[str, tuple[dict[str, Any], str, str]] = {
    "client_kwargs_not_a_mapping": ({"client_kwargs": "oops"}, "storage_options.client_kwargs",
                                    "must be a mapping"),
    "retries_not_a_mapping": ({"config_kwargs": {"retries": 5}}, "storage_options.config_kwargs.retries",
                              "must be a mapping (max_attempts: an int >= 0;"),
    "unknown_config_kwarg": ({"config_kwargs": {"retry": {"max_attempts": 2}}}, "storage_options.config_kwargs.retry",
                             "did you mean retries?"),
    "misspelled_secret": ({"secrett": SECRET}, "storage_options.secrett", "did you mean secret?"),
    "endpoint_not_a_url": ({"endpoint_url": "not a url"}, "storage_options.endpoint_url", "http(s)://host[:port]"),
    "client_endpoint_not_a_url": ({"client_kwargs": {"endpoint_url": "localhost:9000"}},
                                  "storage_options.client_kwargs.endpoint_url", "http(s)://host[:port]"),
    "endpoint_given_twice": ({"client_kwargs": {"endpoint_url": "http://127.0.0.1:1"}},
                             "storage_options.client_kwargs.endpoint_url", "differs from storage_options.endpoint_url"),
    "s3_additional_kwargs_not_a_mapping": ({"s3_additional_kwargs": "oops"}, "storage_options.s3_additional_kwargs",
                                           "must be a mapping"),
    "s3_additional_kwarg_of_the_wrong_type": ({"s3_additional_kwargs": {"ACL": 5}},
                                              "storage_options.s3_additional_kwargs.ACL", "must be a string"),
    "s3_additional_kwarg_not_a_value": ({"s3_additional_kwargs": {"ServerSideEncryption": SECRET}},
                                        "storage_options.s3_additional_kwargs.ServerSideEncryption",
                                        "must be one of AES256"),
}


@pytest.mark.parametrize("mistake", list(OPTION_MISTAKES))
def test_storage_options_mistakes_are_one_line_config_errors(
        s3_endpoint: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], mistake: str) -> None:
    wrong, key, allowed = OPTION_MISTAKES[mistake]
    options = {"endpoint_url": s3_endpoint, "key": "testing", "secret": SECRET}
    if "secrett" in wrong:
        del options["secret"]
    config = s3_config(tmp_path, f"s3://{BUCKET}/options-{mistake}", {**options, **wrong})
    for args in (("build", str(config), "--no-progress"), ("status", str(config)), ("sql", str(config), "SELECT 1")):
        line = one_line_error(capsys, *args)
        assert f"{config}: invalid config: line " in line and f", {key}: " in line and allowed in line, line
        assert SECRET not in line, line
    # What the check lets through: s3fs's, botocore's and fsspec's own options; and anything for a
    # lake and sources not in S3 (the local filesystem takes and ignores them).
    load_config(s3_config(tmp_path, f"s3://{BUCKET}/fits", {**options, **FITTING}))
    load_config(s3_config(tmp_path, str(tmp_path / "lake"), {**options, **wrong}))


FITTING = {"anon": False, "client_kwargs": {"region_name": "eu-west-1", "verify": False},
           "config_kwargs": {"retries": {"max_attempts": 3, "mode": "standard"}, "connect_timeout": 2,
                             "s3": {"addressing_style": "path"}},
           "s3_additional_kwargs": {"ServerSideEncryption": "aws:kms", "SSEKMSKeyId": "alias/lake"},
           "profile": "lake", "use_listings_cache": False, "skip_instance_cache": True}




# -- a disk that fills as the build saves its catalog --------------------------------------------


def fill(folder: Path, leave: int) -> Path:
    """Fill the file system of ``folder`` but ``leave`` bytes with a file; returns it."""
    filler = folder / "filler"
    stat = os.statvfs(folder)
    left = stat.f_bavail * stat.f_frsize - leave
    with open(filler, "wb") as handle:
        while left > 0:
            handle.write(bytes(min(left, 1 << 20)))
            left -= 1 << 20
    return filler


def builds(config: Path) -> list[str]:
    return open_lake(config).sql("SELECT status FROM builds ORDER BY build_id")["status"].tolist()


@pytest.mark.parametrize("fills", ["before_the_catalog_is_saved", "after_the_final_publish"])
def test_a_disk_that_fills_as_the_build_ends_is_recorded_as_the_exit_says(
        tmp_path: Path, dask_scheduler: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        fills: str) -> None:
    write_jsonl(tmp_path / "data" / "a.jsonl", stdlib_texts("json"))
    config = write_config(tmp_path, {"code": {"sources": [str(tmp_path / "data" / "a.jsonl")]}})
    # 64 KiB left: room for a record in the catalog's write-ahead log, none for a block of its file.
    if fills == "before_the_catalog_is_saved":   # every chunk committed and checked, nothing saved yet
        def check(*args: Any, original: Any = driver._check_documents) -> None:
            original(*args)
            fill(tmp_path / "lake", 64 << 10)
        monkeypatch.setattr(driver, "_check_documents", check)
    else:
        def publish(self: execute.BuildRun, original: Any = execute.BuildRun.publish) -> None:
            original(self)
            fill(tmp_path / "lake", 64 << 10)
        monkeypatch.setattr(execute.BuildRun, "publish", publish)
    with tmpfs(tmp_path / "lake", "16m") as lake:
        status = main(["build", str(config), "--scheduler", dask_scheduler, "--no-progress"])
        err = capsys.readouterr().err
        (lake / "filler").unlink()
        if fills == "before_the_catalog_is_saved":
            assert status == 2 and err.count("\n") == 1, err
            assert f"cannot write {lake / 'catalog.duckdb'}: No space left on device" in err, err
            assert builds(config) == ["failed"]
        else:   # saved and published: only the last records wait in the write-ahead log
            assert status == 0 and err == "", err
            assert builds(config) == ["succeeded"]
        monkeypatch.undo()
        assert main(["build", str(config), "--scheduler", dask_scheduler, "--no-progress"]) == 0
        assert builds(config)[-1] == "succeeded"
        assert duckdb.connect(str(lake / "catalog.duckdb"), read_only=True).execute(
            "SELECT count(*) FROM chunks WHERE status = 'committed'").fetchone()[0] > 0
