"""Chunks per second through the build driver's commit path, without tokenizing or Dask.

The driver's side of a finished chunk task (:class:`lakeloader.ingest.execute.ResultCommitter`:
the repair check, the catalog transaction, the run's totals, the publish check) is called with
generated chunk results shaped like real ones: one chunk is really built in this process
(several row groups, packing counts of a `pack` loader), then replicated under new global
indexes, every 50th with a reject, into a catalog of ``--lake-chunks`` planned chunks.

- Old against new: ``--chunks`` results committed in groups of 1, 8 and 64 results at hand, by
  the code before the change (a few statements per chunk; kept here as ``old_commit``) and by the
  batched commit (a few statements per group), alternating, ``--rounds`` rounds, medians:
  chunks/s, driver CPU per chunk (process time, DuckDB's threads included) and the ratio.
- Arrivals: results arriving at an offered rate (a thread queues them on a timer, as Dask hands
  them over); the driver takes every result at hand, never waiting for more, and commits them
  together. Per offered rate, old and new: the rate achieved, the mean batch and CPU per chunk.
- Growth: every chunk of the catalog committed in groups of 64 by the new code, with a snapshot
  published every ``build.publish_interval`` (5 s) as a build does: per segment, chunks/s, CPU per
  chunk and the driver's resident memory, to see both stay flat as the lake grows.
- Through Dask (``--dask N``): the whole driver (``run_tasks``: submitting, gathering, committing,
  publishing) on a LocalCluster of 2 workers whose tasks return the generated results at once,
  N chunks: chunks/s and the process's CPU per chunk (a LocalCluster's scheduler runs in the
  driver's process, so its work is counted too; a 2-core machine runs the workers beside it).

    .venv/bin/python benchmarks/driver_commits.py [--lake-chunks 100000] [--chunks 2000] [--rounds 3] [--dask 5000]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
import queue
import shutil
import statistics
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import yaml
from _common import OUT, REPO, report

from lakeloader.catalog.lake import Lake
from lakeloader.catalog.store import CatalogWriter, _column_sums, _starts
from lakeloader.config import Config, load_config
from lakeloader.contracts import VERSION
from lakeloader.contracts.chunk_file import ChunkResult, Reject
from lakeloader.demo.corpus import prepare_corpus
from lakeloader.demo.many_chunks import generated_plan
from lakeloader.ingest.chunk import build_chunk
from lakeloader.ingest.driver import _register_packing, _register_plans
from lakeloader.ingest import execute
from lakeloader.ingest.execute import BuildRun, ResultCommitter
from lakeloader.ingest.tasks import PendingChunks, TaskBatch, choose_tasks
from lakeloader.storage import write_atomically
from lakeloader.tokenizer import encoder_name, load_tokenizer, resolve_backend

TOKENIZER = REPO / "demo" / "tokenizer.json"
GROUPS = (1, 8, 64)

# The code before the change, kept here only: a few statements per chunk, in one transaction.
_OLD_SQL = {
    "commit_chunk": """UPDATE chunks SET
        status = 'committed', num_docs = $num_docs, num_tokens = $num_tokens,
        num_records = $num_records, num_bytes = $num_bytes, checksum = $checksum,
        num_rejects = $num_rejects, source_bytes = $source_bytes, build_id = $build_id,
        worker = $worker, seconds = $seconds, committed_at = now()::TIMESTAMP,
        num_parts = $num_parts, part_tokens = $part_tokens
        WHERE dataset = $dataset AND global_index = $global_index AND status <> 'committed'""",
    "insert_row_groups": """INSERT INTO row_groups
        SELECT $dataset, $global_index, unnest(range(len($num_docs))), unnest($first_docs), unnest($num_docs),
               unnest($first_tokens), unnest($num_tokens), unnest($num_parts), unnest($part_tokens)""",
    "insert_chunk_examples": """INSERT OR IGNORE INTO chunk_examples VALUES ($dataset, $global_index, $plan_key,
        $num_examples, $num_tokens, $truncated_docs, $dropped_tokens, $split_docs)""",
    "insert_reject": """INSERT INTO rejects VALUES ($dataset, $source, $location, $line, $reason, $shard_index,
        $split_index, $global_index, $build_id, now()::TIMESTAMP)""",
}


def old_commit(writer: CatalogWriter, results: Sequence[ChunkResult],
               sources: dict[tuple[str, int], tuple[str, int, int]], build_id: int) -> int:
    """``CatalogWriter.commit`` before the change (selections left out: none here)."""
    con, committed = writer.con, 0
    with writer.transaction():
        for r in results:
            changed = con.execute(_OLD_SQL["commit_chunk"], {
                "dataset": r.dataset, "global_index": r.global_index, "num_docs": r.num_docs,
                "num_tokens": r.num_tokens, "num_records": r.num_records, "num_bytes": r.num_bytes,
                "checksum": r.checksum, "num_rejects": len(r.rejects), "source_bytes": r.source_bytes,
                "build_id": build_id, "worker": r.worker, "seconds": r.seconds,
                "num_parts": _column_sums(r.row_group_parts), "part_tokens": _column_sums(r.row_group_part_tokens),
            }).fetchone()
            plans = [{"dataset": r.dataset, "global_index": r.global_index, **dataclasses.asdict(p)} for p in r.plans]
            if not changed or not changed[0]:
                for plan in plans:
                    con.execute(_OLD_SQL["insert_chunk_examples"], plan)
                continue
            committed += 1
            if r.row_group_docs:
                con.execute(_OLD_SQL["insert_row_groups"], {
                    "dataset": r.dataset, "global_index": r.global_index,
                    "first_docs": _starts(r.row_group_docs), "num_docs": r.row_group_docs,
                    "first_tokens": _starts(r.row_group_tokens), "num_tokens": r.row_group_tokens,
                    "num_parts": r.row_group_parts, "part_tokens": r.row_group_part_tokens})
            for plan in plans:
                con.execute(_OLD_SQL["insert_chunk_examples"], plan)
            source, shard_index, split_index = sources[(r.dataset, r.global_index)]
            for reject in r.rejects:
                con.execute(_OLD_SQL["insert_reject"], {
                    "dataset": r.dataset, "source": source, "location": reject.location, "line": reject.line,
                    "reason": reject.reason, "shard_index": shard_index, "split_index": split_index,
                    "global_index": r.global_index, "build_id": build_id})
    return committed


class OldCommitter(ResultCommitter):
    """The driver's commit path with the catalog transaction of the code before the change."""

    def __init__(self, run: BuildRun, sources: dict[tuple[str, int], tuple[str, int, int]]) -> None:
        super().__init__(run, {})
        self.sources = sources

    def write(self, results: list[ChunkResult]) -> None:
        old_commit(self.run.writer, results, self.sources, self.run.build_id)


def real_result() -> ChunkResult:
    """One chunk of the demo corpus really built in this process (no Dask): several row groups,
    packing counts of a `pack` loader."""
    folder = OUT / "driver-commits-template"
    shutil.rmtree(folder, ignore_errors=True)
    corpus = prepare_corpus(OUT / "demo-corpus", size="demo")
    path = folder / "config.yaml"
    folder.mkdir(parents=True)
    path.write_text(yaml.safe_dump({
        "lake": str(folder / "lake"), "tokenizer": str(TOKENIZER),
        "datasets": {"d": {"sources": [str(corpus["code"][0])]}},
        "build": {"split_size": "256KB", "row_group_tokens": 8192},
        "loader": {"seq_len": 512, "batch_size": 8, "packing": "pack"}}))
    config = load_config(path)
    lake = Lake(config.lake)
    os.makedirs(lake.root, exist_ok=True)
    tokenizer = load_tokenizer(config.tokenizer)
    text = tokenizer.to_str()
    encoder = encoder_name(resolve_backend(tokenizer, config.tokenizer_backend, config.tokenizer, text))
    with CatalogWriter(lake.writer_catalog_path) as writer:
        tokenizer_path, config = _register_plans(config, lake, writer, tokenizer, encoder, text)
        packing = _register_packing(config, writer, tokenizer)
        batch = choose_tasks(config, lake, writer, packing, ())
        task = next(batch.chunk_tasks(config, lake, lake.url_of(tokenizer_path)))
    return build_chunk(task)


def planned_catalog(chunks: int) -> tuple[Path, Path]:
    """A lake whose catalog plans ``chunks`` chunks of dataset "d" over chunks/10 shards, none
    committed (kept as a template file); returns its config and the template."""
    folder = OUT / f"driver-commits-{chunks}"
    template = OUT / f"driver-commits-{chunks}.duckdb"
    config = folder / "config.yaml"
    if not template.exists():
        shutil.rmtree(folder, ignore_errors=True)
        plan = generated_plan("d", chunks, max(1, chunks // 10))
        with CatalogWriter(str(template)) as writer:
            writer.register_plan(plan, tokenizer_path="_tokenizer/t.json", token_type="uint16",
                                 vocab_size=8204, split_size=1, on_error="skip")
    lake = Lake(str(folder))
    os.makedirs(lake.root, exist_ok=True)
    write_atomically(lake.url_of("_tokenizer/t.json"), TOKENIZER.read_bytes(), {})
    config.write_text(yaml.safe_dump({
        "lake": str(folder), "tokenizer": str(TOKENIZER), "datasets": {"d": {"sources": ["/data/*.jsonl"]}}}))
    return config, template


def results_for(template: ChunkResult, indexes: range) -> list[ChunkResult]:
    """``template`` as the result of each chunk of ``indexes`` (every 50th with a reject)."""
    reject = [Reject("line 3", 3, "not JSON: Expecting value (char 0)")]
    return [dataclasses.replace(template, dataset="d", global_index=i, checksum=f"{i:064x}",
                                rejects=reject if i % 50 == 0 else [])
            for i in indexes]


def fresh_run(config_path: Path, template: Path, publish_interval: float) -> BuildRun:
    """A build run on a fresh copy of the planned catalog (writer open, run recorded)."""
    config: Config = load_config(config_path)
    config = config.model_copy(update={"build": config.build.model_copy(update={"publish_interval": publish_interval})})
    lake = Lake(config.lake)
    shutil.rmtree(lake.path_of("_catalog"), ignore_errors=True)
    for leftover in (lake.writer_catalog_path, f"{lake.writer_catalog_path}.wal"):
        if os.path.exists(leftover):
            os.remove(leftover)
    shutil.copyfile(template, lake.writer_catalog_path)
    writer = CatalogWriter(lake.writer_catalog_path)
    build_id = writer.start_build(workers=0, scheduler="none", dashboard="", version=VERSION)
    return BuildRun(config, lake, writer, build_id, lake.url_of("_tokenizer/t.json"), 0, None, None, False)


def sources_of(writer: CatalogWriter) -> dict[tuple[str, int], tuple[str, int, int]]:
    """What the driver before the change kept for every pending chunk (built once per run)."""
    return {(row.dataset, int(row.global_index)): (row.source, int(row.shard_index), int(row.split_index))
            for row in writer.pending_chunks(["d"]).itertuples(index=False)}


def timed(committer: ResultCommitter, results: list[ChunkResult], group: int) -> tuple[float, float]:
    """Wall and CPU seconds of committing ``results`` ``group`` at a time."""
    wall, cpu = time.perf_counter(), time.process_time()
    for start in range(0, len(results), group):
        committer.commit(results[start:start + group])
    return time.perf_counter() - wall, time.process_time() - cpu


def compare(config: Path, template: Path, results: list[ChunkResult], rounds: int) -> dict[str, Any]:
    """Old against new commit path, alternating, for each group size (medians of ``rounds``)."""
    samples: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for round_ in range(rounds):
        for group in GROUPS:
            for code in (("old", "new") if round_ % 2 == 0 else ("new", "old")):
                run = fresh_run(config, template, publish_interval=1e9)
                try:
                    committer = OldCommitter(run, sources_of(run.writer)) if code == "old" else ResultCommitter(run, {})
                    samples.setdefault((code, group), []).append(timed(committer, results, group))
                    assert run.totals.chunks == len(results)
                finally:
                    run.writer.close()
    figures: dict[str, Any] = {}
    for group in GROUPS:
        rate = {code: statistics.median(len(results) / wall for wall, _ in samples[(code, group)])
                for code in ("old", "new")}
        cpu = {code: statistics.median(c / len(results) for _, c in samples[(code, group)]) for code in ("old", "new")}
        figures[f"{group:>2} at hand: old chunks/s"] = round(rate["old"])
        figures[f"{group:>2} at hand: new chunks/s"] = round(rate["new"])
        figures[f"{group:>2} at hand: old / new CPU ms per chunk"] = f"{cpu['old'] * 1e3:.3f} / {cpu['new'] * 1e3:.3f}"
        figures[f"{group:>2} at hand: new/old"] = round(rate["new"] / rate["old"], 2)
    return figures


def offered(committer: ResultCommitter, results: list[ChunkResult], rate: float) -> tuple[float, float, float]:
    """Commit ``results`` arriving at ``rate`` a second, every result at hand at once; returns
    the rate achieved, the mean batch and the CPU seconds per chunk."""
    arrived: queue.SimpleQueue[ChunkResult] = queue.SimpleQueue()

    def arrive() -> None:
        started = time.perf_counter()
        for sent, result in enumerate(results):
            while sent >= (time.perf_counter() - started) * rate:
                time.sleep(0.0005)
            arrived.put(result)

    producer = threading.Thread(target=arrive, daemon=True)
    wall, cpu = time.perf_counter(), time.process_time()
    producer.start()
    done = batches = 0
    while done < len(results):
        at_hand = [arrived.get()]
        while not arrived.empty():
            at_hand.append(arrived.get())
        committer.commit(at_hand)
        done += len(at_hand)
        batches += 1
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    producer.join()
    return len(results) / wall, len(results) / batches, cpu / len(results)


def arrivals(config: Path, template: Path, results: list[ChunkResult], rates: Sequence[int]) -> dict[str, Any]:
    """Old against new commit path with results arriving at each of ``rates``."""
    figures: dict[str, Any] = {}
    for number, rate in enumerate(rates):
        for code in (("old", "new") if number % 2 == 0 else ("new", "old")):
            run = fresh_run(config, template, publish_interval=1e9)
            try:
                committer = OldCommitter(run, sources_of(run.writer)) if code == "old" else ResultCommitter(run, {})
                achieved, batch, cpu = offered(committer, results, rate)
            finally:
                run.writer.close()
            figures[f"offered {rate:,}/s: {code}"] = (f"{achieved:,.0f} chunks/s, {batch:.1f} a batch, "
                                                      f"{cpu * 1e3:.3f} ms CPU per chunk")
    return figures


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def growth(config: Path, template: Path, chunk_template: ChunkResult, chunks: int, segments: int) -> dict[str, Any]:
    """Every planned chunk committed 64 at a time by the new code, publishing every 5 s: per
    segment, chunks/s, CPU per chunk and resident memory."""
    run = fresh_run(config, template, publish_interval=5.0)
    publishes = []
    original = run.publish

    def counted() -> None:
        started = time.perf_counter()
        original()
        publishes.append(time.perf_counter() - started)

    object.__setattr__(run, "publish", counted)
    committer = ResultCommitter(run, {})
    figures: dict[str, Any] = {}
    step = chunks // segments
    try:
        for segment in range(segments):
            results = results_for(chunk_template, range(segment * step, (segment + 1) * step))
            wall, cpu = timed(committer, results, 64)
            figures[f"growth: chunks {segment * step:,}-{(segment + 1) * step:,}"] = (
                f"{len(results) / wall:,.0f} chunks/s, {cpu / len(results) * 1e3:.3f} ms CPU per chunk, "
                f"RSS {rss_mb():.0f} MB")
        median = statistics.median(publishes or [0])
        figures["growth: snapshots published, median ms"] = f"{len(publishes)}, {median * 1e3:.0f}"
    finally:
        run.writer.close()
    return figures


def generated_chunk(template: ChunkResult, task: Any) -> ChunkResult:
    """A chunk task that returns ``template`` as the result of ``task``'s chunk (no tokenizing)."""
    return results_for(template, range(task.global_index, task.global_index + 1))[0]


def through_dask(config: Path, template: Path, chunk_template: ChunkResult, chunks: int) -> dict[str, Any]:
    """The whole driver on a LocalCluster of 2 workers whose tasks return generated results."""
    run = fresh_run(config, template, publish_interval=5.0)
    original = execute.build_chunk
    execute.build_chunk = functools.partial(generated_chunk, chunk_template)
    try:
        pending = PendingChunks(run.writer, ["d"], min(chunks, run.writer.pending_chunk_count(["d"])), pd.DataFrame())
        batch = TaskBatch(["d"], {}, pending, {}, {}, len(pending))
        stop, samples = threading.Event(), []

        def sample() -> None:   # (chunks committed, resident MB) every 2 s
            while not stop.wait(2.0):
                samples.append((run.totals.chunks, rss_mb()))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        wall, cpu = time.perf_counter(), time.process_time()
        execute.run_tasks(dataclasses.replace(run, workers=2), batch)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        stop.set()
        sampler.join()
        assert run.totals.chunks == len(pending)
    finally:
        execute.build_chunk = original
        run.writer.close()
    # The driver's resident memory by tenths of the chunks committed (the median of the samples of each).
    tenths = [[mb for done, mb in samples if tenth * len(pending) <= 10 * done < (tenth + 1) * len(pending)]
              for tenth in range(10)]
    return {"through Dask, 2 workers: chunks": len(pending),
            "through Dask: chunks/s (cluster start included)": round(len(pending) / wall),
            "through Dask: CPU ms per chunk (driver and scheduler)": round(cpu / len(pending) * 1e3, 3),
            "through Dask: driver RSS MB by tenths of the chunks": " ".join(
                f"{statistics.median(mbs):.0f}" if mbs else "-" for mbs in tenths)}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lake-chunks", type=int, default=100_000, help="planned chunks of the catalog")
    parser.add_argument("--chunks", type=int, default=2_000, help="results committed per old/new run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--segments", type=int, default=4, help="growth phase: segments reported")
    parser.add_argument("--dask", type=int, default=0, metavar="N", help="also N chunks through Dask")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    template = real_result()
    config, catalog = planned_catalog(args.lake_chunks)
    figures: dict[str, Any] = {
        "result shape": f"{len(template.row_group_docs)} row groups, {len(template.plans)} packing plan(s), "
                        "a reject every 50 chunks",
        "lake chunks": args.lake_chunks, "results per run": args.chunks,
        "load average at start": " ".join(f"{x:.2f}" for x in os.getloadavg())}
    spread = range(args.lake_chunks // 2, args.lake_chunks // 2 + args.chunks)   # amid the lake
    results = results_for(template, spread)
    figures.update(compare(config, catalog, results, args.rounds))
    figures.update(arrivals(config, catalog, results, (250, 1_000, 4_000)))
    figures.update(growth(config, catalog, template, args.lake_chunks, args.segments))
    if args.dask:
        figures.update(through_dask(config, catalog, template, args.dask))
    figures["load average at end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    report("driver_commits", figures)


if __name__ == "__main__":
    main()
