"""Getting a Dask client: a LocalCluster of worker processes, or an existing scheduler."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

from distributed import Client, LocalCluster, WorkerPlugin

from lakeloader.contracts.errors import InputError

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


class QuietInputErrors(WorkerPlugin):
    """Installs :func:`_demote_input_errors` on each worker's ``distributed.worker`` logger."""

    name = "lakeloader-quiet-input-errors"

    def setup(self, worker: object) -> None:
        """Add the filter once per worker process."""
        logger = logging.getLogger("distributed.worker")
        if _demote_input_errors not in logger.filters:
            logger.addFilter(_demote_input_errors)


@contextlib.contextmanager
def dask_client(workers: int | None = None, scheduler: str | None = None,
                dashboard: str | None = "127.0.0.1:0") -> Iterator[Client]:
    """A Dask client: connected to ``scheduler`` (address or scheduler-file path) if given,
    else to a new LocalCluster of ``workers`` single-threaded processes, closed on exit, whose
    dashboard listens on ``dashboard`` (host:port; loopback by default; None: no dashboard)."""
    if scheduler:
        kwargs = {"scheduler_file": scheduler} if scheduler.endswith(".json") else {"address": scheduler}
        with Client(**kwargs) as client:
            client.register_plugin(QuietInputErrors())
            log.info("connected to Dask scheduler %s (dashboard: %s)", scheduler, client.dashboard_link)
            yield client
        return
    count = workers or default_workers()
    with LocalCluster(
        n_workers=count, threads_per_worker=1, processes=True, dashboard_address=dashboard,
        env=WORKER_ENV,
    ) as cluster, Client(cluster) as client:
        client.register_plugin(QuietInputErrors())
        log.info("Dask LocalCluster with %d worker processes; dashboard: %s", count, client.dashboard_link)
        yield client
