"""The build driver: plans, schedules chunk tasks on Dask, and alone writes the catalog."""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import posixpath
import shutil
import time
from collections.abc import Collection, Iterator
from typing import Any

import duckdb
import pandas as pd
from distributed import Client, Future, as_completed
from tokenizers import Tokenizer
from tqdm import tqdm

from lakeloader.catalog.lake import Lake
from lakeloader.catalog.snapshot import (
    POINTER,
    SNAPSHOT_DIR,
    catalog_identity,
    local_snapshot,
    publish_snapshot,
    read_pointer,
)
from lakeloader.catalog.sql import example_token_means
from lakeloader.catalog.store import RECOVER_CATALOG_HINT, CatalogWriter, catalog_failure, connect_reader
from lakeloader.config import Config, load_config
from lakeloader.contracts import VERSION
from lakeloader.contracts.chunk_file import ChunkResult
from lakeloader.contracts.errors import CatalogError, ChunkIntegrityError, LakeWriteError, SourceError
from lakeloader.index.layout import PackingSpec
from lakeloader.index.mixing import Mixer
from lakeloader.index.templates import packing_specs
from lakeloader.ingest.chunk import ChunkTask, build_chunk, plan_committed_chunk
from lakeloader.ingest.cluster import dask_client
from lakeloader.ingest.documents import SplitSource
from lakeloader.plan.planner import plan_dataset
from lakeloader.plan.sources import url_from_bytes
from lakeloader.plan.splits import Split
from lakeloader.storage import with_retries, write_atomically, write_failure
from lakeloader.tokenizer import encoder_name, load_tokenizer, resolve_backend, token_dtype, tokenizer_fingerprint

log = logging.getLogger(__name__)

TOKENIZER_DIR = "_tokenizer"


@dataclasses.dataclass(frozen=True)
class BuildReport:
    """What one build run did."""

    build_id: int
    lake: str
    chunks_built: int
    chunks_total: int
    docs: int
    tokens: int
    rejects: int
    seconds: float
    dashboard: str | None

    @property
    def tokens_per_s(self) -> float:
        """Tokens tokenized and committed per second of this run."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclasses.dataclass
class _Totals:
    chunks: int = 0
    docs: int = 0
    tokens: int = 0
    source_bytes: int = 0
    rejects: int = 0
    retries: int = 0

    def add(self, result: ChunkResult) -> None:
        self.chunks += 1
        self.docs += result.num_docs
        self.tokens += result.num_tokens
        self.source_bytes += result.source_bytes
        self.rejects += len(result.rejects)
        self.retries += result.retries


def _catalog_identity_of(path: str) -> tuple[str | None, int]:
    """Lake id and published version of the catalog file at ``path`` (opened read-only)."""
    con = connect_reader(path)  # a build holding it raises CatalogLockedError: let it through
    try:
        return catalog_identity(con)
    finally:
        con.close()


def _set_aside(lake: Lake, path: str, why: str) -> None:
    """Remove the writer catalog at ``path`` (and its WAL): a local lake's is moved aside, never
    deleted; a remote lake's is only this host's cache and is deleted."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    for file in (path, f"{path}.wal"):
        if not os.path.exists(file):
            continue
        if lake.is_local:
            os.replace(file, f"{file}.{why}-{stamp}")
            log.warning("moved %s aside to %s", file, f"{file}.{why}-{stamp}")
        else:
            os.remove(file)


def _adopt(lake: Lake, pointer: dict[str, Any], why: str) -> None:
    path = lake.writer_catalog_path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temporary = f"{path}.adopt-{os.getpid()}"
    snapshot = with_retries(lambda: local_snapshot(lake, pointer), deadline=lake.io_retry_deadline,
                            what=f"reading the published catalog of {lake.describe()}")
    shutil.copyfile(snapshot, temporary)
    os.replace(temporary, path)
    log.warning("%s: adopting the lake's published catalog (snapshot version %d of lake %s) as the "
                "writer catalog %s", why, pointer["version"], pointer.get("lake_id"), path)


def _prepare_writer_catalog(lake: Lake, recover: bool) -> None:
    """Make the writer catalog the lake's own before a build opens it.

    A local catalog is used only if it belongs to this lake (same lake id as the published
    snapshot) and is not older than the lake's newest snapshot; otherwise the snapshot is
    adopted, or (a remote lake with nothing published: an empty lake) the build starts fresh.
    ``recover`` sets a local catalog aside and adopts the newest snapshot whatever it holds.
    """
    path = lake.writer_catalog_path
    pointer = with_retries(lambda: read_pointer(lake), deadline=lake.io_retry_deadline,
                           what=f"reading the published catalog of {lake.describe()}")
    if recover:
        if pointer is None:
            raise CatalogError(
                f"--recover-catalog: lake {lake.url} has no published catalog snapshot ({POINTER}) to "
                "recover from; delete the lake and build it again")
        _set_aside(lake, path, "damaged")
        _adopt(lake, pointer, "--recover-catalog")
        return
    if not os.path.exists(path):
        if pointer is not None:
            _adopt(lake, pointer, f"no writer catalog at {path}")
        else:
            log.info("lake %s has no catalog yet: starting a new lake", lake.url)
        return
    try:
        lake_id, version = _catalog_identity_of(path)
    except duckdb.Error as exc:
        raise CatalogError(f"the catalog {path} of lake {lake.url} cannot be opened ({type(exc).__name__}: "
                           f"{exc}); {RECOVER_CATALOG_HINT}") from exc
    if pointer is None:
        if lake.is_local:
            return  # the catalog lives in the lake itself: it is the lake's
        log.warning("the local catalog %s (lake %s) is for a lake with published snapshots, but %s has "
                    "none: the lake is empty, starting a fresh one", path, lake_id, lake.url)
        _set_aside(lake, path, "stale")
        return
    published_id = pointer.get("lake_id")
    if lake_id is None and published_id is None:
        return  # a lake from before lake ids: nothing to compare
    if lake_id != published_id:
        why = f"the local catalog {path} belongs to lake {lake_id}, {lake.url} is lake {published_id}"
    elif version < int(pointer["version"]):
        why = (f"the local catalog {path} is as of snapshot version {version}, older than the lake's "
               f"newest snapshot {pointer['version']}")
    else:
        log.info("using the writer catalog %s (lake %s, snapshot version %d)", path, lake_id, version)
        return
    _set_aside(lake, path, "replaced")
    _adopt(lake, pointer, why)


def _chunk_file_sizes(lake: Lake, folder: str, config: Config) -> dict[str, int]:
    """Lake-relative path -> size of every file in chunk folder ``folder`` (one listing)."""
    full = lake.path_of(folder)

    def listing() -> list[dict[str, Any]]:
        lake.fs.invalidate_cache(full)
        try:
            return lake.fs.ls(full, detail=True)
        except FileNotFoundError:
            return []

    entries = with_retries(listing, what=f"listing the chunk folder {lake.url_of(folder)}",
                           deadline=config.io_retry_deadline)
    return {f"{folder}/{posixpath.basename(entry['name'].rstrip('/'))}": int(entry["size"])
            for entry in entries if entry.get("type") == "file"}


def _chunks_to_repair(lake: Lake, writer: CatalogWriter, names: list[str], config: Config,
                      requested: Collection[tuple[str, int]]) -> pd.DataFrame:
    """Committed chunks whose file is missing or not the size the catalog records (found by
    listing each chunk folder, not by reading the files), plus those in ``requested``."""
    committed = writer.committed_chunks(names)
    if committed.empty:
        return committed
    sizes: dict[str, int] = {}
    for folder in writer.chunk_folders(names):
        sizes.update(_chunk_file_sizes(lake, folder, config))
    wanted = set(requested)
    rows = []
    for row in committed.itertuples(index=False):
        size = sizes.get(row.path)
        if size is None:
            problem = "its file is missing"
        elif size != row.num_bytes:
            problem = f"its file has {size} bytes, the catalog says {row.num_bytes}"
        elif (row.dataset, int(row.global_index)) in wanted:
            problem = "verify found it damaged"
        else:
            continue
        log.warning("chunk %d of dataset %r (%s): %s; rebuilding it", row.global_index, row.dataset,
                    lake.url_of(row.path), problem)
        rows.append(row)
    return pd.DataFrame(rows, columns=committed.columns)


def _publish(writer: CatalogWriter, lake: Lake, build_id: int, config: Config) -> None:
    with_retries(lambda: publish_snapshot(writer.con, lake, build_id),
                 what=f"publishing the catalog snapshot of {lake.describe()}", deadline=config.io_retry_deadline)


def _remove_partial_files(lake: Lake, folders: list[str]) -> None:
    """Delete temporary files a killed build left behind (safe: this build holds the lock)."""
    if not lake.is_local:
        return  # object stores write chunks in one PUT: nothing partial is ever visible
    for folder in folders:
        for leftover in glob.glob(os.path.join(lake.path_of(folder), "*.tmp-*")):
            os.remove(leftover)
            log.info("removed %s left by an interrupted build", leftover)


def _publish_tokenizer(lake: Lake, tokenizer_json: str, fingerprint: str) -> str:
    relative = f"{TOKENIZER_DIR}/{fingerprint[:16]}.json"
    if not lake.fs.exists(lake.path_of(relative)):
        write_atomically(lake.url_of(relative), tokenizer_json.encode(), lake.storage_options)
    return relative


def _tasks(pending: pd.DataFrame, config: Config, lake: Lake, tokenizer_url: str,
           packing: dict[str, PackingSpec]) -> Iterator[ChunkTask]:
    formats = {name: dataset.record_format() for name, dataset in config.datasets.items()}
    for row in pending.itertuples(index=False):
        dataset = config.datasets[row.dataset]
        yield ChunkTask(
            dataset=row.dataset,
            global_index=int(row.global_index),
            source=SplitSource(
                url=url_from_bytes(row.source_raw) if isinstance(row.source_raw, (bytes, bytearray)) else row.source,
                layout=row.layout,
                compression=row.compression if isinstance(row.compression, str) else None,
                split=Split(row.split_kind, int(row.split_start), int(row.split_stop), int(row.first_row)),
                record_format=formats[row.dataset],
                on_error=dataset.on_error,
                storage_options=config.storage_options,
            ),
            chunk_url=lake.url_of(row.path),
            tokenizer_url=tokenizer_url,
            encoder=row.encoder,
            row_group_tokens=config.build.row_group_tokens,
            io_retry_deadline=config.io_retry_deadline,
            packing=(packing[row.dataset],) if row.dataset in packing else (),
        )


class _Scheduler:
    """Keeps a bounded window of chunk tasks in flight, highest priority to the lowest index."""

    def __init__(self, client: Client, tasks: Iterator[ChunkTask], window: int) -> None:
        self.client = client
        self.tasks = tasks
        self.window = window
        self.running = as_completed()
        self.in_flight: dict[str, ChunkTask] = {}

    def fill(self) -> None:
        while len(self.in_flight) < self.window:
            task = next(self.tasks, None)
            if task is None:
                return
            future = self.client.submit(
                build_chunk, task, key=f"chunk-{task.dataset}-{task.global_index}-{time.time_ns()}",
                priority=-task.global_index, pure=False,
            )
            self.in_flight[future.key] = task
            self.running.add(future)

    def finished(self) -> Iterator[list[Future]]:
        self.fill()
        for batch in self.running.batches():
            for future in batch:
                self.in_flight.pop(future.key, None)
            self.fill()
            yield batch

    def cancel(self) -> None:
        futures = list(self.running.futures)
        self.running.clear()
        if futures:
            self.client.cancel(futures)


def build(config: Config | str | os.PathLike[str], *, workers: int | None = None,
          scheduler: str | None = None, progress: bool = True, recover_catalog: bool = False,
          repair: Collection[tuple[str, int]] = (), dashboard_address: str | None = None) -> BuildReport:
    """Build (or resume) the lake of ``config``.

    Plans every dataset (chunks of the global order stored before tokenizing anything), runs one
    Dask task per uncommitted split, commits each finished chunk with its row groups and rejects in
    one transaction, and publishes a catalog snapshot every ``build.publish_interval`` seconds and
    at the end. Committed chunks are never re-tokenized unless their file is missing or not the
    size the catalog records, or they are in ``repair`` (``(dataset, global_index)`` pairs, e.g.
    what ``verify`` found corrupt): those are rebuilt byte for byte. A second build of the same
    lake fails at once. The writer catalog is the lake's own (see :func:`_prepare_writer_catalog`);
    ``recover_catalog`` replaces it with the lake's newest published snapshot.
    A local cluster's dashboard listens on ``dashboard_address`` if given, else ``build.dashboard``.
    """
    config = load_config(config)
    lake = Lake(config.lake, config.storage_options, config.io_retry_deadline)
    created = _make_lake_folder(lake)
    try:
        _prepare_writer_catalog(lake, recover_catalog)
        writer = CatalogWriter(lake.writer_catalog_path)
    except BaseException:
        if created is not None:  # a build that cannot start leaves no empty lake behind
            shutil.rmtree(created, ignore_errors=True)
        raise
    with writer:
        try:
            return _build_locked(config, lake, writer, workers, scheduler, progress, repair)
        except duckdb.Error as exc:  # the catalog refused a write: a full disk, say
            raise catalog_failure(writer.path, exc) or exc


def _make_lake_folder(lake: Lake) -> str | None:
    """Create a local lake's folder; returns the topmost folder this created (None if none)."""
    if not lake.is_local:
        return None
    top = None
    folder = os.path.abspath(lake.root)
    while not os.path.lexists(folder):
        top, folder = folder, os.path.dirname(folder)
    try:
        os.makedirs(lake.root, exist_ok=True)
    except OSError as exc:
        failure = write_failure("the lake folder (config key `lake`)", lake.root, exc)
        if os.path.lexists(folder) and not os.path.isdir(folder):
            failure = LakeWriteError(f"{failure} ({folder} is a file, not a folder)")
        raise failure from exc
    return top


def _build_locked(config: Config, lake: Lake, writer: CatalogWriter, workers: int | None,
                  scheduler: str | None, progress: bool, repair: Collection[tuple[str, int]]) -> BuildReport:
    tokenizer = load_tokenizer(config.tokenizer)
    fingerprint = tokenizer_fingerprint(tokenizer)
    tokenizer_path = _publish_tokenizer(lake, tokenizer.to_str(), fingerprint)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    encoder = encoder_name(resolve_backend(tokenizer, config.tokenizer_backend, config.tokenizer))
    names = list(config.datasets)
    for name in names:
        plan = plan_dataset(name, config, fingerprint, encoder=encoder)
        new = writer.register_plan(
            plan, tokenizer_path=tokenizer_path, token_type=str(token_dtype(vocab_size)),
            vocab_size=vocab_size, split_size=config.build.split_size,
            on_error=config.datasets[name].on_error,
        )
        log.info("dataset %r: %d shards, %d chunks planned%s", name, len(plan.shards),
                 len(plan.chunks), "" if new else " (plan unchanged)")
    token_weights = config.mixture is not None and config.mixture.unit == "tokens"
    if not token_weights and (config.mixture is not None or len(names) == 1):
        _register_mixture(writer, Mixer.from_config(config))
    packing = _register_packing(config, writer, tokenizer)
    unplanned = {name: writer.chunks_without_plan(name, spec.plan_key) for name, spec in packing.items()}
    _remove_partial_files(lake, [SNAPSHOT_DIR, *writer.chunk_folders(names)])
    repairs = _chunks_to_repair(lake, writer, names, config, repair)
    expected = {(row.dataset, int(row.global_index)): row.checksum for row in repairs.itertuples(index=False)}
    pending = writer.pending_chunks(names)
    if len(repairs):  # their packing counts come with the rebuilt chunks, not from their files
        unplanned = {name: rows[~rows.global_index.isin(repairs.global_index[repairs.dataset == name])]
                     for name, rows in unplanned.items()}
        pending = pd.concat([pending, repairs[pending.columns]]).sort_values("global_index", kind="stable")
    total = writer.chunk_count(names)
    log.info("%d of %d chunks to build%s", len(pending), total,
             f" ({len(repairs)} committed ones to repair)" if len(repairs) else "")
    worker_count = workers or config.build.workers
    started = time.perf_counter()
    totals = _Totals()
    dashboard = None
    build_id = writer.start_build(
        workers=0, scheduler=scheduler or "local", dashboard="",
        version=VERSION, encoder=encoder,
    )
    status, error = "failed", None
    try:
        if len(pending) or any(len(rows) for rows in unplanned.values()):
            dashboard = _run_tasks(config, lake, writer, pending, build_id, totals,
                                   lake.url_of(tokenizer_path), worker_count, scheduler, progress,
                                   packing, unplanned, expected)
        _check_documents(writer, names)
        status = "succeeded"
    except KeyboardInterrupt:
        status, error = "interrupted", "interrupted by the user"
        raise
    except BaseException as exc:
        error = config.redact(f"{type(exc).__name__}: {exc}")  # the builds table is shared
        raise
    finally:
        seconds = time.perf_counter() - started
        stats = dict(chunks_built=totals.chunks, docs=totals.docs, tokens=totals.tokens,
                     source_bytes=totals.source_bytes, rejects=totals.rejects, retries=totals.retries,
                     seconds=seconds, tokens_per_s=totals.tokens / seconds if seconds else 0.0)
        _record_end(writer, build_id, status, error, stats)
        try:
            _publish(writer, lake, build_id, config)
        except Exception as exc:
            if status == "succeeded":  # complete, but readers cannot see it: the build failed
                _record_end(writer, build_id, "failed", f"{type(exc).__name__}: {exc}", stats)
                raise
            log.warning("could not publish the final catalog snapshot of failed build %d: %s", build_id, exc)
    if token_weights:  # the weights need the complete lake's mean tokens per example
        plans = {name: spec.plan_key if (spec := packing.get(name)) else None for name in Mixer.dataset_names(config)}
        _register_mixture(writer, Mixer.from_config(
            config, example_token_means(writer.con, plans, config.loader.seq_len)))
        _publish(writer, lake, build_id, config)
    log.info("build %d %s: %d chunks, %d docs, %d tokens in %.1fs (%.0f tokens/s)", build_id, status,
             totals.chunks, totals.docs, totals.tokens, seconds, totals.tokens / max(seconds, 1e-9))
    return BuildReport(build_id, lake.url, totals.chunks, total, totals.docs, totals.tokens,
                       totals.rejects, seconds, dashboard)


def _check_documents(writer: CatalogWriter, names: list[str]) -> None:
    """SourceError for a built dataset without documents: no mixture or loader can use it."""
    for row in writer.datasets_without_documents(names).itertuples(index=False):
        listing = "\n".join(f"  {source}" for source in row.sources)
        if row.num_sources > len(row.sources):
            listing += f"\n  ... and {row.num_sources - len(row.sources)} more"
        raise SourceError(
            f"dataset {row.name!r} has no documents: every record of its {row.num_sources} source file(s) "
            f"was rejected ({row.num_rejects} rejects):\n{listing}\nsee "
            f"`lakeloader sql CONFIG \"SELECT * FROM rejects WHERE dataset = '{row.name}'\"`, "
            f"then fix the sources or remove the dataset"
        )


def _check_repair(result: ChunkResult, repairs: dict[tuple[str, int], str]) -> None:
    """A repaired chunk must be the very file its catalog record describes."""
    expected = repairs.get((result.dataset, result.global_index))
    if expected is None or expected == result.checksum:
        return
    raise ChunkIntegrityError(
        f"chunk {result.global_index} of dataset {result.dataset!r} was rebuilt, but the new file has "
        f"sha256 {result.checksum[:16]}…, the catalog says {expected[:16]}…: its source changed since "
        "it was planned, or this lakeloader/pyarrow writes different bytes. Readers will reject it; "
        "build the dataset into a new lake.")


def _record_end(writer: CatalogWriter, build_id: int, status: str, error: str | None,
                stats: dict[str, float]) -> None:
    """Record how a build run ended. After a failure the build's own error stays the one raised
    (a full disk may refuse this write too): this one is only logged."""
    try:
        writer.finish_build(build_id, status=status, error=error, **stats)
    except Exception as exc:
        if status == "succeeded":
            raise
        log.warning("could not record the end of failed build %d in the catalog (the next build "
                    "marks it interrupted): %s", build_id, exc)


def _register_mixture(writer: CatalogWriter, mixer: Mixer) -> None:
    new = writer.register_mixture(mixer)
    log.info("mixture %s%s", mixer.mixture_id, " registered" if new else " (registered already)")


def _register_packing(config: Config, writer: CatalogWriter, tokenizer: Tokenizer) -> dict[str, PackingSpec]:
    """The packing spec of each dataset under the config's loader (none for concat), registered."""
    specs = packing_specs(config, tokenizer)
    for name, spec in specs.items():
        writer.register_packing(name, spec)
    return specs


def _plan_committed(client: Client, config: Config, lake: Lake, writer: CatalogWriter,
                    packing: dict[str, PackingSpec], unplanned: dict[str, pd.DataFrame], progress: bool) -> None:
    """Packing counts for chunks built before this loader config (no tokenizing: each task reads
    a chunk's part layout), committed per dataset."""
    for name, rows in unplanned.items():
        if not len(rows):
            continue
        log.info("dataset %r: computing %s packing counts of %d built chunks", name, packing[name].mode, len(rows))
        n = len(rows)
        futures = client.map(plan_committed_chunk, [lake.url_of(p) for p in rows["path"]],
                             [config.storage_options] * n, rows["global_index"].astype(int).tolist(),
                             [(packing[name],)] * n, pure=False)
        done = [f.result() for f in tqdm(as_completed(futures), total=len(futures), unit="chunk",
                                         desc=f"plan {name}", disable=not progress)]
        writer.commit_plans(name, [(index, stats[0]) for index, stats in done])


def _run_tasks(config: Config, lake: Lake, writer: CatalogWriter, pending: pd.DataFrame,
               build_id: int, totals: _Totals, tokenizer_url: str, workers: int | None,
               scheduler: str | None, progress: bool, packing: dict[str, PackingSpec],
               unplanned: dict[str, pd.DataFrame], repairs: dict[tuple[str, int], str]) -> str:
    sources = {
        (row.dataset, int(row.global_index)): (row.source, int(row.shard_index), int(row.split_index))
        for row in pending.itertuples(index=False)
    }
    with dask_client(workers, scheduler, config.build.dashboard) as client:
        dashboard = client.dashboard_link
        threads = max(1, sum(client.nthreads().values()))
        writer.set_build_cluster(build_id, workers=len(client.nthreads()), dashboard=dashboard)
        _plan_committed(client, config, lake, writer, packing, unplanned, progress)
        run = _Scheduler(client, _tasks(pending, config, lake, tokenizer_url, packing), window=2 * threads + 2)
        bar = tqdm(total=len(pending), unit="chunk", desc="build", disable=not progress, smoothing=0.1,
                   mininterval=0.5)
        if progress:
            bar.write(f"Dask dashboard: {dashboard}")
        last_publish = time.monotonic()
        started = time.perf_counter()
        try:
            for batch in run.finished():
                failed = [future for future in batch if future.status == "error"]
                results: list[ChunkResult] = [future.result() for future in batch if future not in failed]
                for result in results:
                    _check_repair(result, repairs)
                writer.commit(results, sources, build_id)  # keep what finished beside a failure
                if failed:
                    failed[0].result()  # raises the task's own error
                for result in results:
                    totals.add(result)
                bar.update(len(results))
                elapsed = max(time.perf_counter() - started, 1e-9)
                bar.set_postfix(docs=f"{totals.docs:,}", tokens_per_s=f"{totals.tokens / elapsed:,.0f}",
                                rejects=totals.rejects, refresh=False)
                if time.monotonic() - last_publish >= config.build.publish_interval:
                    _publish(writer, lake, build_id, config)
                    last_publish = time.monotonic()
        except BaseException:
            run.cancel()
            raise
        finally:
            bar.close()
    return dashboard
