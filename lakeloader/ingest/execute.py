"""Running a build's chunk tasks on the Dask cluster: a bounded window of tasks in flight, each
finished batch committed to the catalog (repairs checked byte for byte), progress shown, and a
snapshot published every ``build.publish_interval`` seconds."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator

import duckdb
import pandas as pd
from distributed import Client, Future, as_completed
from distributed.client import FutureCancelledError
from distributed.comm.core import CommClosedError
from tqdm import tqdm

from lakeloader.catalog.lake import Lake
from lakeloader.catalog.store import CatalogWriter
from lakeloader.config import Config
from lakeloader.contracts.chunk_file import ChunkResult
from lakeloader.contracts.errors import ChunkIntegrityError, LakeloaderError, SchedulerError
from lakeloader.contracts.specs import PackingSpec
from lakeloader.ingest.chunk import ChunkTask, build_chunk, plan_committed_chunk
from lakeloader.ingest.cluster import dask_client, scheduler_address
from lakeloader.ingest.document_index import DocumentIndexWriter
from lakeloader.ingest.tasks import TaskBatch
from lakeloader.ingest.writer_catalog import publish
from lakeloader.plan.selection import SelectionTask, evaluate_selection

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Totals:
    """What a build run has committed so far."""

    chunks: int = 0
    docs: int = 0
    tokens: int = 0
    source_bytes: int = 0
    rejects: int = 0
    retries: int = 0

    def add(self, result: ChunkResult) -> None:
        """Count one committed chunk."""
        self.chunks += 1
        self.docs += result.num_docs
        self.tokens += result.num_tokens
        self.source_bytes += result.source_bytes
        self.rejects += len(result.rejects)
        self.retries += result.retries


@dataclasses.dataclass(frozen=True)
class BuildRun:
    """What every step of one build run shares: its config, lake, catalog writer and build id,
    the published tokenizer, the cluster asked for, and the running totals."""

    config: Config
    lake: Lake
    writer: CatalogWriter
    build_id: int
    tokenizer_url: str
    workers: int | None
    scheduler: str | None
    dashboard: str | None   # where a local cluster's dashboard listens (host:port; None: none)
    progress: bool
    totals: Totals = dataclasses.field(default_factory=Totals)

    def publish(self, whole: bool = False) -> None:
        """Publish the writer catalog as the lake's newest snapshot (``whole``: a full one)."""
        publish(self.writer, self.lake, self.build_id, self.config, whole)


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

    def select(self, tasks: list[SelectionTask]) -> None:
        """Submit selection tasks at once (cheap: no window), highest priority to the lowest index."""
        for task in tasks:
            future = self.client.submit(
                evaluate_selection, task, key=f"select-{task.dataset}-{task.global_index}-{time.time_ns()}",
                priority=-task.global_index, pure=False,
            )
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
        if futures and self.client.status == "running":   # a client that lost its scheduler cancelled them
            self.client.cancel(futures)


def run_tasks(run: BuildRun, batch: TaskBatch) -> str:
    """Start the cluster, count the packing of ``batch.unplanned`` chunks, then tokenize the
    pending chunks and commit each finished group (what finished beside a failed task is kept,
    then its error raised). Returns the dashboard address. A scheduler lost on the way is a
    SchedulerError saying what was kept and that a re-run resumes."""
    with dask_client(run.workers, run.scheduler, run.dashboard) as client:
        try:
            dashboard = client.dashboard_link
            run.writer.set_build_cluster(run.build_id, workers=len(client.nthreads()), dashboard=dashboard)
            _plan_committed(client, run, batch.packing, batch.unplanned)
            _tokenize(client, run, batch, dashboard)
        except Exception as exc:
            if _lost_scheduler(client, exc):
                raise _scheduler_lost(run, scheduler_address(client, run.scheduler)) from None
            raise
    return dashboard


# How long an error of the connection to the scheduler may take to show in the client's status.
_LOST_SCHEDULER_WAIT = 5.0


def _lost_scheduler(client: Client, exc: Exception) -> bool:
    """Whether ``exc`` ended the build's use of the cluster because the client lost its scheduler
    (a task's own error, or the catalog's, is not)."""
    if isinstance(exc, (LakeloaderError, duckdb.Error)):
        return False
    if isinstance(exc, FutureCancelledError) and exc.reason == "scheduler-connection-lost":
        return True
    if isinstance(exc, (CommClosedError, ConnectionError)):
        # The reply that broke may come before the client notices: give it a moment.
        deadline = time.monotonic() + _LOST_SCHEDULER_WAIT
        while client.status == "running" and time.monotonic() < deadline:
            time.sleep(0.05)
    return client.status not in ("running", "newly-created")


def _scheduler_lost(run: BuildRun, address: str) -> SchedulerError:
    """The one-line error of a build run whose Dask scheduler went away."""
    config = run.config.source_file or "CONFIG"
    if run.scheduler:
        again = (f"restart the scheduler and its workers (they exit with it) and re-run "
                 f"`lakeloader build {config} --scheduler ADDRESS` to resume")
    else:
        again = f"re-run `lakeloader build {config}` to resume"
    return SchedulerError(f"lost the Dask scheduler at {address}: build {run.build_id} committed "
                          f"{run.totals.chunks} chunks, which are kept; {again}")


def _follow_filters(run: BuildRun, batch: TaskBatch, built: list[ChunkResult], scheduler: _Scheduler,
                    submitted: set[tuple[str, int]]) -> int:
    """Submit the selection tasks of the filtered datasets of the sources of ``built`` (chunks
    just committed) that became ready (their source chunk committed, and the earlier splits of
    its file: its lines are known) and are not in ``submitted`` (this run's, updated); returns how
    many."""
    names = sorted({name for result in built for name in batch.filters.get(result.dataset, ())})
    if not names:
        return 0
    rows = run.writer.pending_selections(names, built=[(result.dataset, result.global_index) for result in built])
    keys = [(d, int(i)) for d, i in zip(rows.dataset, rows.global_index)]
    rows = rows[[key not in submitted for key in keys]]
    submitted.update(keys)
    scheduler.select(batch.selection_tasks(run.config, run.lake, rows))
    return len(rows)


class ResultCommitter:
    """The driver's side of finished chunk tasks: each group of results at hand checked (a repair
    must be the very file its record describes), committed in one transaction, counted in the
    run's totals and the progress bar, and a snapshot published once ``build.publish_interval``
    has passed since the last. The documents index rows of the chunks it commits are written
    as one file per dataset and committed with them (a dataset's small files merged now and then)."""

    def __init__(self, run: BuildRun, repairs: dict[tuple[str, int], str], bar: tqdm | None = None) -> None:
        self.run = run
        self.repairs = repairs
        self.bar = bar
        self.index = DocumentIndexWriter(run.lake, run.writer)
        self.started = time.perf_counter()
        self.last_publish = time.monotonic()

    def commit(self, results: list[ChunkResult]) -> list[ChunkResult]:
        """Commit ``results`` (every result at hand: one transaction whatever their number);
        returns those of built chunks (not selections of filtered datasets)."""
        built = [result for result in results if result.selection is None]
        for result in built:
            _check_repair(result, self.repairs)
        self.write(results)
        totals = self.run.totals
        for result in built:
            totals.add(result)
        if self.bar is not None:
            self.bar.update(len(built))
            elapsed = max(time.perf_counter() - self.started, 1e-9)
            self.bar.set_postfix(docs=f"{totals.docs:,}", tokens_per_s=f"{totals.tokens / elapsed:,.0f}",
                                 rejects=totals.rejects, refresh=False)
        self.publish_if_due()
        return built

    def write(self, results: list[ChunkResult]) -> None:
        """The catalog transaction of :meth:`commit` (the index files written first)."""
        files = self.index.write(results)
        self.run.writer.commit(results, self.run.build_id, files)
        for dataset in sorted({file.dataset for file in files}):
            self.index.compact(dataset)

    def publish_if_due(self) -> None:
        """Publish a snapshot if ``build.publish_interval`` seconds have passed since the last."""
        if time.monotonic() - self.last_publish >= self.run.config.build.publish_interval:
            self.run.publish()
            self.last_publish = time.monotonic()


def _tokenize(client: Client, run: BuildRun, batch: TaskBatch, dashboard: str) -> None:
    """Run the pending chunks' tasks, committing each group of results at hand (gathered in one
    call, committed in one transaction: never waiting for more), with a progress bar; the chunks
    of filtered datasets are evaluated (selection tasks) once their source chunk is committed, and
    committed as they finish. Then each dataset's documents index is merged into a few files."""
    threads = max(1, sum(client.nthreads().values()))
    scheduler = _Scheduler(client, batch.chunk_tasks(run.config, run.lake, run.tokenizer_url),
                           window=2 * threads + 2)
    scheduler.select(batch.selection_tasks(run.config, run.lake, batch.selections))
    selected = len(batch.selections)
    submitted = {(d, int(i)) for d, i in zip(batch.selections.get("dataset", ()),
                                               batch.selections.get("global_index", ()))}
    bar = tqdm(total=len(batch.pending), unit="chunk", desc="build", disable=not run.progress, smoothing=0.1,
               mininterval=0.5)
    if run.progress:
        bar.write(f"Dask dashboard: {dashboard}")
    committer = ResultCommitter(run, batch.repairs, bar)
    try:
        for finished in scheduler.finished():
            lost = [future for future in finished if future.status == "cancelled"]
            if lost:   # cancelled by the client itself: it lost its scheduler
                lost[0].result()
            failed = [future for future in finished if future.status == "error"]
            done = [future for future in finished if future not in failed]
            results: list[ChunkResult] = client.gather(done) if done else []
            built = committer.commit(results)   # keep what finished beside a failure
            if failed:
                failed[0].result()  # raises the task's own error
            selected += _follow_filters(run, batch, built, scheduler, submitted)
    except BaseException:
        scheduler.cancel()
        raise
    finally:
        bar.close()
    if selected:
        log.info("evaluated %d chunk selections of filtered datasets", selected)
    for name in batch.names:   # a few large files for the published lake
        committer.index.compact(name, final=True)


def _plan_committed(client: Client, run: BuildRun, packing: dict[str, PackingSpec],
                    unplanned: dict[str, pd.DataFrame]) -> None:
    """Packing counts for chunks built before this loader config (no tokenizing: each task reads
    a chunk's part layout), committed per dataset."""
    for name, rows in unplanned.items():
        if not len(rows):
            continue
        log.info("dataset %r: computing %s packing counts of %d built chunks", name, packing[name].mode, len(rows))
        n = len(rows)
        futures = client.map(plan_committed_chunk, [run.lake.url_of(p) for p in rows["path"]],
                             [run.config.storage_options] * n, rows["global_index"].astype(int).tolist(),
                             [(packing[name],)] * n, pure=False)
        done = [f.result() for f in tqdm(as_completed(futures), total=len(futures), unit="chunk",
                                         desc=f"plan {name}", disable=not run.progress)]
        run.writer.commit_plans(name, [(index, stats[0]) for index, stats in done])


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
