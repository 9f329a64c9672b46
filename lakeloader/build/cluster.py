"""Getting a Dask client: a LocalCluster of worker processes, or an existing scheduler."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

from distributed import Client, LocalCluster

log = logging.getLogger(__name__)

# One tokenizer thread per worker process: the workers are the parallelism.
WORKER_ENV = {"RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "true", "OMP_NUM_THREADS": "1"}


def default_workers() -> int:
    """Number of local worker processes when none is configured: the usable cores."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@contextlib.contextmanager
def dask_client(workers: int | None = None, scheduler: str | None = None,
                dashboard: str | None = "127.0.0.1:0") -> Iterator[Client]:
    """A Dask client: connected to ``scheduler`` (address or scheduler-file path) if given,
    else to a new LocalCluster of ``workers`` single-threaded processes, closed on exit, whose
    dashboard listens on ``dashboard`` (host:port; loopback by default; None: no dashboard)."""
    if scheduler:
        kwargs = {"scheduler_file": scheduler} if scheduler.endswith(".json") else {"address": scheduler}
        with Client(**kwargs) as client:
            log.info("connected to Dask scheduler %s (dashboard: %s)", scheduler, client.dashboard_link)
            yield client
        return
    count = workers or default_workers()
    with LocalCluster(
        n_workers=count, threads_per_worker=1, processes=True, dashboard_address=dashboard,
        env=WORKER_ENV,
    ) as cluster, Client(cluster) as client:
        log.info("Dask LocalCluster with %d worker processes; dashboard: %s", count, client.dashboard_link)
        yield client
