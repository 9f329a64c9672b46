"""The build driver's memory and full publishes as the lake grows, old code against new.

For each lake size N (``--sizes``, committed chunks), a catalog of N + ``--commits`` planned chunks
of one dataset whose first N are committed (generated chunk results, as ``driver_commits.py``
makes them; prepared once per size and kept) is driven, in a child process per measurement so
that its peak is its own, by the code of a checkout (``--baseline`` old, this one new,
alternating which goes first):

- full publish: the writer opens the catalog and publishes one full snapshot (what a build does
  first and last, and after every ``MAX_WRITER_DELTAS`` deltas): seconds, bytes, the process's
  resident memory at open, its peak during the publish, and 5 s after it;
- commits: ``--commits`` results committed 5 at a time by the driver's committer
  (``ResultCommitter``: the documents index files, the progress counters, a snapshot published
  every 5 s), as the driver of a build of this lake would: resident memory at open, median and
  last over the commits (sampled every 100 commits), the peak, and the full publishes among them
  (count and median seconds).

Dask's side of the driver (the scheduler of a local cluster runs in the driver's process) is
measured by ``driver_commits.py --dask N``; this script holds only what grows with the lake.

    .venv/bin/python benchmarks/driver_memory.py [--sizes 10000 100000 1000000] [--commits 20000] --baseline CHECKOUT
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import driver_commits as dc
from _common import OUT, REPO, report

from lakeloader.catalog.store import CatalogWriter
from lakeloader.contracts import VERSION
from lakeloader.ingest.execute import ResultCommitter


def memory() -> dict[str, float]:
    """Resident memory now and its peak since the last ``reset_peak`` (MB)."""
    found = {}
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(("VmRSS:", "VmHWM:")):
                found[line.split(":")[0]] = int(line.split()[1]) / 1024
    return {"rss": found["VmRSS"], "peak": found["VmHWM"]}


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


def prepared(size: int, commits: int) -> tuple[Path, Path]:
    """The config and a catalog of ``size + commits`` planned chunks, the first ``size`` committed."""
    config, planned = dc.planned_catalog(size + commits)
    catalog = OUT / f"driver-memory-{size}-{commits}.duckdb"
    if not catalog.exists():
        template = dc.real_result()
        partial = catalog.with_suffix(".partial")
        shutil.copyfile(planned, partial)
        with CatalogWriter(str(partial)) as writer:
            build_id = writer.start_build(workers=0, scheduler="none", dashboard="", version=VERSION)
            for start in range(0, size, 8192):
                writer.commit(dc.results_for(template, range(start, min(start + 8192, size))), build_id)
        os.replace(partial, catalog)
    return config, catalog


def child_publish(size: int, commits: int) -> dict[str, Any]:
    """(In a child) one full publish of the prepared catalog."""
    config, catalog = prepared(size, commits)
    run = dc.fresh_run(config, catalog, publish_interval=1e9)
    opened = memory()["rss"]
    reset_peak()
    started = time.perf_counter()
    run.publish(whole=True)
    seconds = time.perf_counter() - started
    peak = memory()["peak"]
    folder = run.lake.path_of("_catalog")
    size_bytes = sum(os.path.getsize(os.path.join(folder, name)) for name in os.listdir(folder))
    time.sleep(5)
    return {"s": seconds, "bytes": size_bytes, "open": opened, "peak": peak, "after 5 s": memory()["rss"]}


def child_commits(size: int, commits: int) -> dict[str, Any]:
    """(In a child) ``commits`` results committed 5 at a time, a snapshot published every 5 s."""
    config, catalog = prepared(size, commits)
    template = dc.real_result()
    run = dc.fresh_run(config, catalog, publish_interval=5.0)
    opened = memory()["rss"]
    reset_peak()
    full: list[float] = []
    publish = run.publish

    def timed(whole: bool = False) -> None:
        started, pointer = time.perf_counter(), run.writer.changes.base
        publish(whole)
        if run.writer.changes.base != pointer:
            full.append(time.perf_counter() - started)

    object.__setattr__(run, "publish", timed)
    committer = ResultCommitter(run, {})
    samples = []
    for start in range(size, size + commits, 500):
        results = dc.results_for(template, range(start, min(start + 500, size + commits)))
        for group in range(0, len(results), 5):
            committer.commit(results[group:group + 5])
        samples.append(memory()["rss"])
    run.writer.close()
    return {"open": opened, "median": statistics.median(samples), "last": samples[-1], "peak": memory()["peak"],
            "full publishes": len(full), "full publish s": statistics.median(full) if full else 0.0}


def measured(kind: str, size: int, commits: int, checkout: Path) -> dict[str, Any]:
    """``kind`` (publish, commits) measured in a child process running ``checkout``'s lakeloader."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(checkout), str(REPO / "benchmarks")])}
    done = subprocess.run([sys.executable, __file__, "--child", kind, str(size), str(commits)], env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--commits", type=int, default=20_000)
    parser.add_argument("--baseline", type=Path, required=False, help="the old code's checkout")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, size, commits = args.child
        work = child_publish if kind == "publish" else child_commits
        print(json.dumps(work(int(size), int(commits))))
        return
    figures: dict[str, Any] = {"commits": args.commits,
                               "load average before": " ".join(f"{x:.2f}" for x in os.getloadavg())}
    for i, size in enumerate(args.sizes):
        prepared(size, args.commits)
        codes = (("old", "new") if i % 2 == 0 else ("new", "old")) if args.baseline else ("new",)
        for kind in ("publish", "commits"):
            runs = {code: measured(kind, size, args.commits, args.baseline if code == "old" else REPO)
                    for code in codes}
            for code in ("old", "new"):
                if code not in runs:
                    continue
                run = runs[code]
                if kind == "publish":
                    shown = (f"{run['s']:.1f} s, {run['bytes'] / 2**20:,.0f} MB; RSS open {run['open']:.0f} MB, "
                             f"peak {run['peak']:.0f} MB, 5 s after {run['after 5 s']:.0f} MB")
                else:
                    shown = (f"RSS open {run['open']:.0f} MB, median {run['median']:.0f}, last {run['last']:.0f}, "
                             f"peak {run['peak']:.0f} MB; {run['full publishes']} full publishes, "
                             f"median {run['full publish s']:.1f} s")
                figures[f"{size:>9,} chunks, {kind}: {code}"] = shown
            if len(runs) == 2:
                key = "s" if kind == "publish" else "median"
                figures[f"{size:>9,} chunks, {kind}: new/old ({'seconds' if kind == 'publish' else 'median RSS'}, peak)"] = (
                    f"x{runs['new'][key] / runs['old'][key]:.2f}, x{runs['new']['peak'] / runs['old']['peak']:.2f}")
        print(f"{size} chunks measured", flush=True)
    figures["load average after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    report("driver_memory", figures)


if __name__ == "__main__":
    main()
