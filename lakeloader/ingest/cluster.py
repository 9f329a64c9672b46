"""Getting a Dask client: a LocalCluster of worker processes, or an existing scheduler."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator

from distributed import Client, LocalCluster, WorkerPlugin

from lakeloader.contracts.errors import InputError, SchedulerError

log = logging.getLogger(__name__)

# One tokenizer thread per worker process: the workers are the parallelism.
WORKER_ENV = {"RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "true", "OMP_NUM_THREADS": "1"}


def default_workers() -> int:
    """Number of local worker processes when none is configured: the usable cores."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _is_input_error_report(record: logging.LogRecord) -> bool:
    """Whether ``record`` is a worker's "Compute Failed" report of an :class:`InputError`."""
    args = record.args if isinstance(record.args, tuple) else ()
    exception_text = args[3] if len(args) > 3 and isinstance(args[3], str) else ""
    return str(record.msg).startswith("Compute Failed") and any(
        exception_text.startswith(f"{name}(") for name in _input_error_names())


def _input_error_names() -> set[str]:
    found, todo = set(), [InputError]
    while todo:
        cls = todo.pop()
        found.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return found


def _demote_input_errors(record: logging.LogRecord) -> bool:
    """Log filter: a worker's traceback of a user's bad input becomes a DEBUG record (the driver
    raises the task's InputError with its clean message); every other record passes unchanged."""
    if not _is_input_error_report(record):
        return True
    record.levelno, record.levelname = logging.DEBUG, "DEBUG"
    return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def _hide_cancelled_tasks(record: logging.LogRecord) -> bool:
    """Log filter: drop a worker's warning that a task it ran was cancelled (a build stopped by
    Ctrl-C closes its cluster mid-task; the driver says so in one line); others pass unchanged."""
    return not str(record.getMessage()).endswith("ended with CancelledError")


def _hide_lost_heartbeats(record: logging.LogRecord) -> bool:
    """Log filter for a local cluster's workers: drop a heartbeat that found the scheduler gone
    (it lives in the build's own process: a build that stops, by Ctrl-C or an error, closes it
    while workers still beat, and says what happened in one line); others pass unchanged."""
    return not str(record.getMessage()).startswith("Failed to communicate with scheduler during heartbeat")


def _hide_forgotten_gathers(record: logging.LogRecord) -> bool:
    """Log filter for a build's own LocalCluster's scheduler (it runs in the build's process): drop
    its error for a gather of tasks all forgotten, those the build cancelled as it stopped (Ctrl-C
    arriving while results were gathered); the build says in one line that it stopped."""
    if record.msg != "Couldn't gather keys: %s":
        return True
    states = record.args   # (logging keeps a lone dict argument as the record's args)
    return not (isinstance(states, dict) and states and all(state == "forgotten" for state in states.values()))


class QuietLocalShutdown(WorkerPlugin):
    """Installs :func:`_hide_lost_heartbeats` on each worker of a build's own LocalCluster (the
    workers of a cluster of the user's keep their logs: there they are an operator's to read)."""

    name = "lakeloader-quiet-local-shutdown"

    def setup(self, worker: object) -> None:
        """Add the filter once per worker process."""
        logger = logging.getLogger("distributed.worker")
        if _hide_lost_heartbeats not in logger.filters:
            logger.addFilter(_hide_lost_heartbeats)


class QuietInputErrors(WorkerPlugin):
    """Installs :func:`_demote_input_errors` on each worker's ``distributed.worker`` logger, and
    :func:`_hide_cancelled_tasks` on its state machine's."""

    name = "lakeloader-quiet-input-errors"

    def setup(self, worker: object) -> None:
        """Add the filters once per worker process."""
        for name, record_filter in (("distributed.worker", _demote_input_errors),
                                    ("distributed.worker.state_machine", _hide_cancelled_tasks)):
            logger = logging.getLogger(name)
            if record_filter not in logger.filters:
                logger.addFilter(record_filter)


@contextlib.contextmanager
def _workers_ignore_interrupts() -> Iterator[None]:
    """Start worker processes inside this block ignoring SIGINT (what they inherit and keep:
    Python leaves an ignored SIGINT ignored): Ctrl-C in a terminal reaches the whole process
    group, and the build's driver alone must handle it (it records the run as interrupted and
    closes the cluster), not every worker with a traceback of its own. A Ctrl-C during the
    second or two the cluster starts is lost with them."""
    if threading.current_thread() is not threading.main_thread():
        yield   # signals are the main thread's: a build run in another thread gets no Ctrl-C
        return
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)


class _QuietWhenLost(logging.Filter):
    """Log filter for a build's client: once it is no longer running (it lost its scheduler, or
    it is closing), drop what it logs (its reconnecting, and the tracebacks of closing while it
    reconnects): a build that lost its scheduler says so in one line (:class:`SchedulerError`)."""

    def __init__(self, client: Client) -> None:
        super().__init__()
        self.client = client

    def filter(self, record: logging.LogRecord) -> bool:
        return self.client.status in ("running", "newly-created")


@contextlib.contextmanager
def _quiet_when_lost(client: Client) -> Iterator[None]:
    logger = logging.getLogger("distributed.client")
    quiet = _QuietWhenLost(client)
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def scheduler_address(client: Client, scheduler: str | None) -> str:
    """The address of ``client``'s scheduler (``scheduler``, the address or scheduler file
    asked for, if the client no longer knows it)."""
    address = getattr(getattr(client, "scheduler", None), "address", None)
    return str(address or scheduler or "the local cluster")


def _connect(scheduler: str) -> Client:
    """A client of the scheduler at ``scheduler`` (address or scheduler-file path); a
    SchedulerError naming it if it cannot be reached."""
    kwargs = {"scheduler_file": scheduler} if scheduler.endswith(".json") else {"address": scheduler}
    try:
        return Client(**kwargs)
    except OSError as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise SchedulerError(
            f"cannot reach the Dask scheduler {scheduler} ({reason}): start it and its workers "
            "(`dask scheduler`, `dask worker ADDRESS --nthreads 1`), or give --scheduler its address "
            "or scheduler file") from None


@contextlib.contextmanager
def dask_client(workers: int | None = None, scheduler: str | None = None,
                dashboard: str | None = "127.0.0.1:0") -> Iterator[Client]:
    """A Dask client: connected to ``scheduler`` (address or scheduler-file path) if given (a
    SchedulerError if it cannot be reached), else to a new LocalCluster of ``workers``
    single-threaded processes, closed on exit, whose dashboard listens on ``dashboard``
    (host:port; loopback by default; None: no dashboard). Once the client has lost its
    scheduler or is closing, its own log records are dropped (the build reports a lost one)."""
    if scheduler:
        client = _connect(scheduler)
        with _quiet_when_lost(client), client:   # quiet until the client is closed
            client.register_plugin(QuietInputErrors())
            log.info("connected to Dask scheduler %s (dashboard: %s)", scheduler, client.dashboard_link)
            yield client
        return
    count = workers or default_workers()
    with _workers_ignore_interrupts():
        cluster = LocalCluster(n_workers=count, threads_per_worker=1, processes=True, dashboard_address=dashboard,
                               env=WORKER_ENV)
    scheduler_log = logging.getLogger("distributed.scheduler")
    scheduler_log.addFilter(_hide_forgotten_gathers)
    try:
        with cluster:
            client = Client(cluster)
            with _quiet_when_lost(client), client:
                client.register_plugin(QuietInputErrors())
                client.register_plugin(QuietLocalShutdown())
                log.info("Dask LocalCluster with %d worker processes; dashboard: %s", count, client.dashboard_link)
                yield client
    finally:
        scheduler_log.removeFilter(_hide_forgotten_gathers)
