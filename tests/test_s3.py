"""Object-store lakes end to end against a real S3 API server on loopback (moto's server).

Sources in S3 (JSONL, JSONL.gz, Parquet) are built on the shared Dask cluster into a lake in S3;
the worker processes reach the endpoint only through the config's ``storage_options``. The S3 lake
holds the same chunks and gives the same batches as a local build of the same files, a reader in
another process reads it while it is built, the local disk cache stays within its bound without
touching the lake's objects, the command line reads ``s3://`` lakes, loader workers read them, and
a mixture read by the workers of two processes while its build runs, is killed and resumes gives
the batches of the finished lake.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import numpy as np
import pytest
import yaml
from moto.server import ThreadedMotoServer
from test_loader import assert_batches_equal, paragraphs
from tokenizers import Tokenizer

from lakeloader.catalog.lake import Lake, open_lake
from lakeloader.catalog.reader_index import TABLES
from lakeloader.catalog.snapshot import KEEP_SNAPSHOTS, publish_snapshot, read_pointer
from lakeloader.catalog.store import CatalogWriter
from lakeloader.cli import main
from lakeloader.feed import workers as workers_module
from lakeloader.feed.loader import Loader
from lakeloader.ingest.driver import BuildReport, build
from lakeloader.read.catalog_view import CatalogView
from lakeloader.read.disk_cache import DiskCache

from conftest import DEMO_TOKENIZER, batch_files, stdlib_texts, write_jsonl, write_parquet

BUCKET = "lakeloader-test"
SEQ_LEN, BATCH = 64, 8
CLI = [sys.executable, "-m", "lakeloader.cli"]
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a moto S3 server on loopback holding an empty bucket ``BUCKET``; dummy credentials
    in the environment (the Dask workers never see them: they use the config's options)."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    try:
        with pytest.MonkeyPatch.context() as patch:
            for name, value in CREDENTIALS.items():
                patch.setenv(name, value)
            nowhere = str(tmp_path_factory.mktemp("aws") / "none")
            patch.setenv("AWS_CONFIG_FILE", nowhere)
            patch.setenv("AWS_SHARED_CREDENTIALS_FILE", nowhere)
            for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
                patch.delenv(name, raising=False)
            # moto keeps its buckets per Python process, not per server: start from nothing
            urllib.request.urlopen(urllib.request.Request(f"{url}/moto-api/reset", method="POST"), timeout=10)
            boto3.client("s3", endpoint_url=url).create_bucket(Bucket=BUCKET)
            yield url
    finally:
        server.stop()


def storage_options(endpoint: str) -> dict[str, Any]:
    return {"endpoint_url": endpoint, "key": CREDENTIALS["AWS_ACCESS_KEY_ID"],
            "secret": CREDENTIALS["AWS_SECRET_ACCESS_KEY"]}


def objects(endpoint: str, prefix: str) -> dict[str, int]:
    """Key -> size of every object under ``prefix`` in the bucket."""
    client = boto3.client("s3", endpoint_url=endpoint)
    found: dict[str, int] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        found.update({item["Key"]: item["Size"] for item in page.get("Contents", [])})
    return found


def upload(endpoint: str, folder: Path, prefix: str) -> None:
    client = boto3.client("s3", endpoint_url=endpoint)
    for path in sorted(folder.iterdir()):
        client.upload_file(str(path), BUCKET, f"{prefix}/{path.name}")


def write_yaml(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def config_dict(lake: str, sources: list[str], options: dict[str, Any] | None, **loader: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "lake": lake, "tokenizer": str(DEMO_TOKENIZER), "datasets": {"mix": {"sources": sources}},
        "build": {"split_size": "20KB", "publish_interval": 0.5},
        "loader": {"seq_len": SEQ_LEN, "batch_size": BATCH, "shuffle": {"kind": "window", "window_chunks": 4},
                   **loader},
    }
    if options is not None:
        config["storage_options"] = options
    return config


def env_of(cache: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "LAKELOADER_CACHE": str(cache), **extra}


def run(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([*CLI, *args], check=False, capture_output=True, text=True, env=env, timeout=timeout)
    assert result.returncode == 0, f"{args} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result


class Lakes:
    """The module's two builds of the same files: one S3 -> S3, one local -> local."""

    def __init__(self, root: Path, endpoint: str) -> None:
        self.root, self.endpoint = root, endpoint
        self.s3_config = root / "s3.yaml"
        self.local_config = root / "local.yaml"
        self.lake_url = f"s3://{BUCKET}/lake"
        self.s3_report: BuildReport | None = None
        self.local_report: BuildReport | None = None

    def config(self, name: str, **loader: Any) -> Path:
        """A copy of the S3 config with loader settings changed."""
        raw = yaml.safe_load(self.s3_config.read_text())
        raw["loader"].update(loader)
        return write_yaml(self.root / f"{name}.yaml", raw)


@pytest.fixture(scope="module")
def lakes(s3_endpoint: str, tmp_path_factory: pytest.TempPathFactory, dask_scheduler: str) -> Iterator[Lakes]:
    root = tmp_path_factory.mktemp("s3")
    texts = stdlib_texts("json") + stdlib_texts("email", limit=12)
    data = root / "data"
    write_jsonl(data / "a.jsonl", texts)
    write_jsonl(data / "b.jsonl.gz", texts[:5], compression="gzip")
    write_parquet(data / "c.parquet", texts[:10], row_group_size=3)
    lakes = Lakes(root, s3_endpoint)
    with pytest.MonkeyPatch.context() as patch:
        upload(s3_endpoint, data, "src")
        write_yaml(lakes.s3_config, config_dict(lakes.lake_url, [f"s3://{BUCKET}/src/*"], storage_options(s3_endpoint)))
        write_yaml(lakes.local_config, config_dict(str(root / "local-lake"), [str(data / "*")], None))
        patch.setenv("LAKELOADER_CACHE", str(root / "build-cache"))  # the builds' host
        lakes.s3_report = build(lakes.s3_config, scheduler=dask_scheduler, progress=False)
        lakes.local_report = build(lakes.local_config, scheduler=dask_scheduler, progress=False)
        yield lakes


CHUNK_COLUMNS = "global_index, shard_index, split_index, status, num_docs, num_tokens, num_bytes, checksum"


def batches(config: Path, steps: range, **kwargs: Any) -> list[dict[str, np.ndarray]]:
    with Loader(config, **kwargs) as loader:
        return [loader.batch(step) for step in steps]


def epoch_steps(config: Path) -> int:
    """Steps that read every example of one epoch (every chunk), plus one into the next epoch."""
    with Loader(config) as loader:
        return loader.datasets[0].train_count() // BATCH + 2


# -- 1. build from S3 into S3 --------------------------------------------------------------------


def test_s3_build_equals_local_build(lakes: Lakes) -> None:
    report, local = lakes.s3_report, lakes.local_report
    assert report.lake == lakes.lake_url
    assert report.chunks_built == report.chunks_total == local.chunks_total > 8
    assert (report.docs, report.tokens) == (local.docs, local.tokens)

    lake = open_lake(lakes.s3_config)
    assert not lake.is_local
    s3_chunks = lake.sql(f"SELECT {CHUNK_COLUMNS}, path FROM chunks ORDER BY global_index")
    local_chunks = open_lake(lakes.local_config).sql(f"SELECT {CHUNK_COLUMNS} FROM chunks ORDER BY global_index")
    assert (s3_chunks.status == "committed").all()
    # Same documents, tokens and chunk bytes; only the fingerprint (it hashes source URLs) differs.
    assert s3_chunks.drop(columns="path").equals(local_chunks)
    shards = lake.sql("SELECT source FROM shards ORDER BY shard_index")
    assert shards.source.tolist() == [f"s3://{BUCKET}/src/{n}" for n in ("a.jsonl", "b.jsonl.gz", "c.parquet")]

    stored = objects(lakes.endpoint, "lake/")
    for path, size in zip(s3_chunks.path, s3_chunks.num_bytes):
        assert stored[f"lake/{path}"] == size
    pointer = yaml.safe_load(lake.fs.cat_file(lake.path_of("_catalog/CURRENT")))
    assert f"lake/_catalog/{pointer['file']}" in stored
    assert not any(".tmp-" in key for key in stored)
    # The snapshot's reader index is in the bucket, and loaders answer from their copy of it.
    assert {f"lake/_catalog/{pointer['reader_index']['prefix']}.{table}.arrow" for table in TABLES} <= set(stored)
    with Loader(lakes.s3_config) as loader:
        assert loader.view.reader_index() is not None

    steps = range(epoch_steps(lakes.local_config))
    for step, (remote, here) in enumerate(zip(batches(lakes.s3_config, steps), batches(lakes.local_config, steps))):
        assert_batches_equal(remote, here, f"step {step}")


# -- 2. a reader in another process while the lake is built ----------------------------------------


def test_reader_process_during_s3_build(lakes: Lakes, tmp_path: Path, dask_scheduler: str) -> None:
    texts = paragraphs("asyncio")
    write_jsonl(tmp_path / "slow" / "a.jsonl", texts)
    upload(lakes.endpoint, tmp_path / "slow", "slowsrc")
    raw = config_dict(f"s3://{BUCKET}/slow", [f"s3://{BUCKET}/slowsrc/*.jsonl"], storage_options(lakes.endpoint),
                      shuffle="none")
    raw["datasets"] = {"slow": raw["datasets"]["mix"]}
    raw["build"]["split_size"] = "4KB"
    config = write_yaml(tmp_path / "slow.yaml", raw)
    tokenizer = Tokenizer.from_file(str(DEMO_TOKENIZER))
    stream = sum(len(e.ids) + 1 for e in tokenizer.encode_batch(texts, add_special_tokens=False))
    steps = (stream - 1) // SEQ_LEN // BATCH + 2   # all of epoch 0: every chunk

    builder = subprocess.Popen([*CLI, "build", str(config), "--scheduler", dask_scheduler, "--no-progress"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=env_of(tmp_path / "builder-cache"))
    reader = None
    try:
        lake = Lake(raw["lake"], raw["storage_options"])
        deadline = time.monotonic() + 60
        while True:
            assert builder.poll() is None, f"the build ended before publishing: {builder.communicate()}"
            assert time.monotonic() < deadline, "the build published nothing in 60s"
            try:
                view = CatalogView(lake)
            except Exception:  # noqa: BLE001 - nothing published yet
                time.sleep(0.05)
                continue
            try:
                chunks = view.dataset("slow")
            finally:
                view.close()
            if chunks.committed:
                break
            time.sleep(0.05)
        reader = subprocess.Popen([*CLI, "batches", str(config), "--steps", f"0:{steps}", "--out",
                                   str(tmp_path / "during.npz")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=env_of(tmp_path / "reader-cache"))
        assert builder.poll() is None and chunks.committed < chunks.planned // 2, (chunks.committed, chunks.planned)
        out, err = reader.communicate(timeout=120)
        assert reader.returncode == 0, f"reader exited {reader.returncode}:\n{out}\n{err}"
        built_out, built_err = builder.communicate(timeout=120)
        assert builder.returncode == 0, f"build exited {builder.returncode}:\n{built_out}\n{built_err}"
    finally:
        for process in (builder, reader):
            if process is not None and process.poll() is None:
                process.kill()
                process.communicate()
    assert chunks.planned > 60
    assert "waiting for chunk" in err, err  # it did read while the build was running

    during = batch_files(tmp_path / "during.npz")
    after = batches(config, range(steps))
    for step in range(steps):
        assert_batches_equal({k: v[step] for k, v in during.items()}, after[step], f"step {step}")


# -- 3. the local disk cache of a remote lake ----------------------------------------------------


def test_cached_snapshot_copies_of_versions_the_lake_no_longer_keeps_are_deleted(lakes: Lakes) -> None:
    """A reader of a remote lake copies the snapshot files it reads into its cache; as it fetches
    a version, the copies of versions older than the lake's newest KEEP_SNAPSHOTS go (a reader
    following a build would otherwise keep every version it saw), the newer ones and unfinished
    downloads stay."""
    reader_cache = os.environ["LAKELOADER_CACHE"]
    with pytest.MonkeyPatch.context() as patch:   # on the builds' host: a few more versions
        patch.setenv("LAKELOADER_CACHE", str(lakes.root / "build-cache"))
        builder = Lake(lakes.lake_url, storage_options(lakes.endpoint))
        with CatalogWriter(builder.writer_catalog_path) as writer:
            for _ in range(KEEP_SNAPSHOTS + 2):
                publish_snapshot(writer.con, builder, None)
    assert os.environ["LAKELOADER_CACHE"] == reader_cache
    lake = Lake(lakes.lake_url, storage_options(lakes.endpoint))
    pointer = read_pointer(lake)
    newest = int(pointer["version"])
    assert newest - KEEP_SNAPSHOTS - 1 >= 1
    folder = Path(lake.cache_dir) / "snapshots" / pointer["lake_id"]
    folder.mkdir(parents=True)
    old, kept = newest - KEEP_SNAPSHOTS, newest - KEEP_SNAPSHOTS + 1
    planted = {f"catalog-{v:06d}.{kind}": v for v in (old - 1, old, kept)
               for kind in ("duckdb", "chunks.arrow", "row_groups.arrow", "examples.arrow")}
    planted[f"catalog-{old:06d}.duckdb.tmp-0123"] = newest   # another thread's download, going on
    for name in planted:
        (folder / name).write_bytes(b"stale copy")
    view = CatalogView(lake)   # reads the newest version's reader index: copies it here
    try:
        assert view.reader_index() is not None
    finally:
        view.close()
    left = {p.name for p in folder.iterdir()}
    assert {name for name, v in planted.items() if v > old} <= left
    assert not {name for name, v in planted.items() if v <= old} & left
    assert {f"{pointer['reader_index']['prefix']}.{table}.arrow" for table in TABLES} <= left


def cache_files(cache: DiskCache) -> dict[str, int]:
    return {name: os.path.getsize(os.path.join(cache.folder, name))
            for name in os.listdir(cache.folder) if ".tmp-" not in name}


def test_disk_cache_bounded_lru_and_never_deletes_lake_data(lakes: Lakes) -> None:
    before = objects(lakes.endpoint, "lake/")
    chunks = open_lake(lakes.s3_config).sql("SELECT path, num_bytes, num_docs FROM chunks ORDER BY global_index")
    sizes = dict(zip(chunks.path, chunks.num_bytes.astype(int)))
    with_docs = set(chunks.path[chunks.num_docs > 0])   # empty splits' chunks hold no tokens to read
    total = sum(sizes.values())

    # Least recently used goes first: b (the largest of four) is evicted, not a (used again).
    b, a, c, d = sorted(sizes, key=lambda p: (-sizes[p], p))[:4]
    lru = DiskCache(Lake(lakes.lake_url, storage_options(lakes.endpoint)), sizes[a] + sizes[b] + sizes[c])
    for path in (a, b, c, a, d):
        lru.open(path, sizes[path]).close()
        time.sleep(0.01)
    assert (lru.downloads, lru.hits) == (4, 1)
    assert set(cache_files(lru)) == {os.path.basename(lru._local(p)) for p in (a, c, d)}
    for name in os.listdir(lru.folder):
        os.remove(os.path.join(lru.folder, name))

    # A whole epoch through a cache of a third of the lake: never more than the limit (plus the
    # newest file), everything read, and the lake's objects untouched.
    limit = total // 3
    small = lakes.config("small-cache", disk_cache_bytes=limit, prefetch=0)
    steps = epoch_steps(small)
    reference = batches(lakes.local_config, range(steps))
    with Loader(small) as loader:
        disk = loader.files.disk
        for step in range(steps):
            assert_batches_equal(loader.batch(step), reference[step], f"small cache, step {step}")
            held = cache_files(disk)
            newest = max(held, key=lambda n: os.stat(os.path.join(disk.folder, n)).st_mtime_ns)
            assert sum(held.values()) <= limit + held[newest], (step, held, limit)
        assert loader.files.files_opened == with_docs
        assert disk.downloads >= len(with_docs) > len(cache_files(disk))   # it did evict
    assert objects(lakes.endpoint, "lake/") == before

    # Smaller than any file, with read-ahead threads: each download evicts the file another
    # thread has just fetched, which must stay readable through its open handle.
    tiny = lakes.config("tiny-cache", disk_cache_bytes=1, prefetch=4)
    with Loader(tiny) as loader:
        for step, batch in zip(range(steps), loader.iter_from(0)):
            assert_batches_equal(batch, reference[step], f"tiny cache, step {step}")
        assert len(cache_files(loader.files.disk)) == 1

    # Big enough: the first pass downloads what is missing, the second is served from disk.
    big = lakes.config("big-cache", disk_cache_bytes=10 * total)
    with Loader(big) as loader:
        first = [loader.batch(step) for step in range(steps)]
        assert sum(cache_files(loader.files.disk).values()) == sum(sizes[p] for p in with_docs)
    with Loader(big) as loader:
        second = [loader.batch(step) for step in range(steps)]
        assert loader.files.disk.downloads == 0 and loader.files.disk.hits >= len(with_docs)
    for step in range(steps):
        assert_batches_equal(first[step], reference[step], f"big cache, step {step}")
        assert_batches_equal(second[step], reference[step], f"from disk, step {step}")
    assert objects(lakes.endpoint, "lake/") == before


@pytest.mark.parametrize("first_fails", [False, True], ids=["once", "first-fails"])
def test_disk_cache_downloads_a_file_once_for_threads_asking_together(
        lakes: Lakes, monkeypatch: pytest.MonkeyPatch, first_fails: bool) -> None:
    """Threads opening the same missing file together (a batch's row groups of one chunk, read in
    the decode threads) wait for one download instead of each fetching the whole file; if that
    download fails, its thread raises and the others download it again."""
    chunks = open_lake(lakes.s3_config).sql("SELECT path, num_bytes FROM chunks WHERE num_docs > 0 ORDER BY global_index")
    path, size = str(chunks.path[0]), int(chunks.num_bytes[0])
    lake = Lake(lakes.lake_url, storage_options(lakes.endpoint))
    cache = DiskCache(lake, 10**9)
    if os.path.exists(cache.local_path(path)):
        os.remove(cache.local_path(path))
    calls: list[str] = []
    original = lake.fs.get_file

    def slow(source: str, target: str, **kwargs: Any) -> Any:
        calls.append(source)
        time.sleep(0.3)   # long enough for every thread to ask meanwhile
        if first_fails and len(calls) == 1:
            raise ConnectionError("connection reset (injected)")
        return original(source, target, **kwargs)

    monkeypatch.setattr(lake.fs, "get_file", slow)
    barrier = threading.Barrier(4)

    def read(_: int) -> bytes | BaseException:
        barrier.wait()
        try:
            with cache.open(path, size) as handle:
                return handle.read()
        except ConnectionError as exc:
            return exc

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(read, range(4)))
    failed = [r for r in results if isinstance(r, BaseException)]
    contents = [r for r in results if isinstance(r, bytes)]
    assert len(failed) == int(first_fails), results
    assert len(calls) == 1 + int(first_fails) and cache.downloads == 1, calls
    assert cache.hits == len(contents) - 1
    assert len(contents[0]) == size and all(c == contents[0] for c in contents)


# -- 4. the command line on s3:// lakes ------------------------------------------------------------


def test_cli_status_and_sql_on_s3_lake(lakes: Lakes, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    docs = lakes.local_report.docs
    assert main(["status", str(lakes.s3_config)]) == 0
    out = capsys.readouterr().out
    assert "== Datasets ==" in out and "complete" in out and f"s3://{BUCKET}/src/a.jsonl" in out
    query = "SELECT name, num_docs FROM datasets"
    assert main(["sql", str(lakes.s3_config), query, "--format", "csv"]) == 0
    assert capsys.readouterr().out.splitlines() == ["name,num_docs", f"mix,{docs}"]

    # Another host: a fresh cache, only the published snapshot; the lake URL alone with the
    # endpoint configured the usual boto way (AWS_ENDPOINT_URL), no storage_options anywhere.
    env = env_of(tmp_path / "other-host", AWS_ENDPOINT_URL=lakes.endpoint)
    result = run("sql", lakes.lake_url, query, "--format", "csv", env=env)
    assert result.stdout.splitlines() == ["name,num_docs", f"mix,{docs}"]
    result = run("status", lakes.lake_url, env=env)
    assert "complete" in result.stdout and f"s3://{BUCKET}/src/c.parquet" in result.stdout

    plain = yaml.safe_load(lakes.s3_config.read_text())
    del plain["storage_options"]
    plain = write_yaml(tmp_path / "plain.yaml", plain)
    run("batches", str(plain), "--steps", "0:3", "--out", str(tmp_path / "env.npz"), env=env)
    got = batch_files(tmp_path / "env.npz")
    for step, expected in enumerate(batches(lakes.s3_config, range(3))):
        assert_batches_equal({k: v[step] for k, v in got.items()}, expected, f"step {step}")


# -- 5. worker processes reading an s3:// lake ----------------------------------------------------


@pytest.mark.parametrize("while_starting", [False, True])
def test_workers_on_an_s3_lake_give_the_batches_of_one_process(lakes: Lakes, monkeypatch: pytest.MonkeyPatch,
                                                               while_starting: bool) -> None:
    """``loader.workers: 2`` on the S3 lake (every worker downloading through the shared disk
    cache), with the workers building every batch or the consumer building the first ones while
    they start, from step 0 and from a resume step: bitwise the batches of one process."""
    monkeypatch.setattr(workers_module, "BUILD_WHILE_STARTING", while_starting)
    steps = epoch_steps(lakes.s3_config)
    reference = batches(lakes.s3_config, range(steps))
    config = lakes.config(f"workers-2-{while_starting}", workers=2, prefetch=2)
    for start in (0, 3):
        with Loader(config) as loader:
            iterator = loader.iter_from(loader.state(start))
            got = [{name: values.copy() for name, values in batch.items()}
                   for batch in itertools.islice(iterator, steps - start)]
            iterator.close()
        assert_batches_equal(got, reference[start:])


# -- 6. all at once: a mixture read by workers of two processes across a killed S3 build ----------


READER = """
import sys
import numpy as np
from lakeloader.feed.loader import Loader
if __name__ == "__main__":
    config, index, steps, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    got = []
    with Loader(config, process_index=index, process_count=2) as loader:
        for step, batch in zip(range(steps), loader.iter_from(0)):
            got.append({name: values.copy() for name, values in batch.items()})
            if step == 0:
                print("first batch", flush=True)
    np.savez(out, **{name: np.stack([batch[name] for batch in got]) for name in got[0]})
"""


def test_a_mixture_read_by_workers_of_two_processes_across_a_killed_s3_build(
        s3_endpoint: str, tmp_path: Path, dask_scheduler: str) -> None:
    """A two-dataset mixture on an S3 lake, read from its first published snapshot on by two
    processes (half the rows each) with ``loader.workers: 2`` each, while its build runs, is
    SIGKILLed and is resumed: each process's batches are its rows of the batches after the build."""
    sources = tmp_path / "sources"
    write_jsonl(sources / "a.jsonl", paragraphs("asyncio"))
    write_jsonl(sources / "b.jsonl", paragraphs("email"))
    upload(s3_endpoint, sources, "crashsrc")
    raw = config_dict(f"s3://{BUCKET}/crash", [], storage_options(s3_endpoint), shuffle="none", workers=2,
                      prefetch=2, wait_timeout=240)
    raw["datasets"] = {name: {"sources": [f"s3://{BUCKET}/crashsrc/{name}.jsonl"]} for name in ("a", "b")}
    raw["mixture"] = {"weights": {"a": 0.5, "b": 0.5}}
    raw["build"]["split_size"] = "4KB"
    config = write_yaml(tmp_path / "crash.yaml", raw)
    tokenizer = Tokenizer.from_file(str(DEMO_TOKENIZER))
    streams = [sum(len(e.ids) + 1 for e in tokenizer.encode_batch(paragraphs(package), add_special_tokens=False))
               for package in ("asyncio", "email")]
    steps = max(streams) // SEQ_LEN // (BATCH // 2) + 2   # every chunk of both datasets (half the rows each)
    build_command = [*CLI, "build", str(config), "--scheduler", dask_scheduler, "--no-progress"]
    builder = subprocess.Popen(build_command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=env_of(tmp_path / "builder-cache"))
    script = tmp_path / "reader.py"
    script.write_text(READER)
    readers: list[subprocess.Popen[str]] = []
    try:
        lake = Lake(raw["lake"], raw["storage_options"])
        deadline = time.monotonic() + 60
        while read_pointer(lake) is None:
            assert builder.poll() is None, f"the build ended before publishing: {builder.communicate()}"
            assert time.monotonic() < deadline, "the build published nothing in 60s"
            time.sleep(0.05)
        readers = [subprocess.Popen([sys.executable, str(script), str(config), str(index), str(steps),
                                     str(tmp_path / f"during-{index}.npz")], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=env_of(tmp_path / f"reader-cache-{index}"))
                   for index in range(2)]
        assert readers[0].stdout is not None
        assert readers[0].stdout.readline().strip() == "first batch"   # read while the build runs
        builder.kill()
        killed_out, killed_err = builder.communicate(timeout=60)
        assert builder.returncode == -9, f"the build ended before it was killed:\n{killed_out}\n{killed_err}"
        view = CatalogView(lake)
        try:   # what the killed build left published: every dataset still short of its plan
            left = {name: (view.dataset(name).committed, view.dataset(name).planned) for name in ("a", "b")}
        finally:
            view.close()
        assert all(committed < planned for committed, planned in left.values()), left
        assert all(reader.poll() is None for reader in readers)   # still reading
        time.sleep(1)
        builder = subprocess.Popen(build_command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env=env_of(tmp_path / "builder-cache"))
        built_out, built_err = builder.communicate(timeout=300)
        assert builder.returncode == 0, f"the resumed build exited {builder.returncode}:\n{built_out}\n{built_err}"
        for reader in readers:
            out, err = reader.communicate(timeout=300)
            assert reader.returncode == 0, f"a reader exited {reader.returncode}:\n{out[-2000:]}\n{err[-5000:]}"
    finally:
        for process in (builder, *readers):
            if process.poll() is None:
                process.kill()
                process.communicate()
    after = batches(config, range(steps))
    rows = BATCH // 2
    for index in range(2):
        during = batch_files(tmp_path / f"during-{index}.npz")
        for step in range(steps):
            expected = {name: values[index * rows:(index + 1) * rows] for name, values in after[step].items()}
            assert_batches_equal({name: values[step] for name, values in during.items()}, expected,
                                 f"process {index} step {step}")
