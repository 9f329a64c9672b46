"""The build driver: the steps of a build in order, with the lake's writer catalog held.

Each step lives where its job does: the writer catalog made the lake's own and published as
snapshots (:mod:`.writer_catalog`), the datasets' plans, packing and mixture registered (here),
the chunk tasks chosen, repairs included (:mod:`.tasks`), run on the Dask cluster and committed
(:mod:`.execute`), and the build run recorded in the ``builds`` table (here).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
from collections.abc import Collection

import duckdb
from tokenizers import Tokenizer

from lakeloader.catalog.lake import Lake
from lakeloader.catalog.sql import example_token_means
from lakeloader.catalog.store import CatalogWriter, LiveCatalog, catalog_failure, is_interrupt
from lakeloader.config import Config, load_config
from lakeloader.contracts import VERSION
from lakeloader.contracts.errors import BuildInterrupted, LakeloaderError, LakeWriteError, SourceError
from lakeloader.contracts.specs import MixtureSpec, PackingSpec
from lakeloader.ingest.execute import BuildRun, Totals, run_tasks
from lakeloader.ingest.media_dedup import dedup_media
from lakeloader.ingest.tasks import TaskBatch, choose_tasks
from lakeloader.ingest.writer_catalog import prepare_writer_catalog, publish
from lakeloader.plan.growth import grown_plan
from lakeloader.plan.planner import (
    DatasetPlan,
    definition_fingerprint,
    filtered_plan,
    plan_dataset,
    with_planned_metadata,
)
from lakeloader.specs import evaluation_config, mixture_spec, packing_specs, plan_keys, token_weights
from lakeloader.storage import with_retries, write_atomically, write_failure
from lakeloader.tokenizer import encoder_name, load_tokenizer, resolve_backend, token_dtype, tokenizer_fingerprint

log = logging.getLogger(__name__)

TOKENIZER_DIR = "_tokenizer"
# The builds row of a complete build until its catalog is saved (a failed save cannot replace it).
_UNSAVED = ("the build ended before its catalog {path} was saved (a full or read-only disk, say; the build's "
            "error output says why): fix that and re-run `lakeloader build CONFIG` (it resumes from the committed chunks)")


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


def _publish_tokenizer(lake: Lake, tokenizer_json: str, fingerprint: str) -> str:
    relative = f"{TOKENIZER_DIR}/{fingerprint[:16]}.json"
    def publish() -> None:
        if not lake.fs.exists(lake.path_of(relative)):
            write_atomically(lake.url_of(relative), tokenizer_json.encode(), lake.storage_options)

    with_retries(publish, what=f"writing the tokenizer file {lake.url_of(relative)}", deadline=lake.io_retry_deadline)
    return relative


def build(config: Config | str | os.PathLike[str], *, workers: int | None = None,
          scheduler: str | None = None, progress: bool = True, recover_catalog: bool = False,
          repair: Collection[tuple[str, int]] = (), dashboard_address: str | None = None,
          live: LiveCatalog | None = None) -> BuildReport:
    """Build (or resume) the lake of ``config``.

    Plans every dataset (chunks of the global order stored before tokenizing anything), runs one
    Dask task per uncommitted split, commits each finished chunk with its row groups and rejects in
    one transaction, and publishes a catalog snapshot every ``build.publish_interval`` seconds and
    at the end. Committed chunks are never re-tokenized unless their file is missing or not the
    size the catalog records, or they are in ``repair`` (``(dataset, global_index)`` pairs, e.g.
    what ``verify`` found corrupt): those are rebuilt byte for byte. A second build of the same
    lake fails at once. The writer catalog is the lake's own (see :func:`prepare_writer_catalog`);
    ``recover_catalog`` replaces it with the lake's newest published snapshot.
    A local cluster's dashboard listens on ``dashboard_address`` if given, else ``build.dashboard``.
    ``live``: a handle that follows this build's catalog while it runs, for readers in this
    process given the same handle (``Loader(config, catalog=live)``) to read it live.
    """
    config = load_config(config)
    lake = Lake(config.lake, config.storage_options, config.io_retry_deadline)
    created = _make_lake_folder(lake)
    try:
        prepare_writer_catalog(lake, recover_catalog)
        writer = CatalogWriter(lake.writer_catalog_path, live)
    except BaseException:
        if created is not None:  # a build that cannot start leaves no empty lake behind
            shutil.rmtree(created, ignore_errors=True)
        raise
    try:
        with writer:
            try:
                report = _build_locked(config, lake, writer, workers, scheduler, progress, repair,
                                       dashboard_address or config.build.dashboard, record_unstarted=created is None)
            except duckdb.Error as exc:  # the catalog refused a write: a full disk, say
                raise catalog_failure(writer.path, exc) or exc
            try:
                writer.checkpoint()
            except (LakeloaderError, duckdb.Error) as exc:
                # Saved already but for the last records (the build's end, the published version),
                # which the write-ahead log keeps: the build stands as recorded and published.
                log.warning("build %d succeeded and is published, but its last catalog records stay in the "
                            "write-ahead log until the next build saves them: %s", report.build_id, exc)
            return report
    except _Unstarted as unstarted:
        if created is not None:   # a new lake whose build could not start: none is left behind
            shutil.rmtree(created, ignore_errors=True)
        error = unstarted.error
        if isinstance(error, duckdb.Error):
            raise catalog_failure(writer.path, error) or error from None
        raise error from None


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


class _Unstarted(Exception):
    """A build failed before its run was recorded (loading the tokenizer, planning, choosing its
    tasks): ``error`` is why."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def _build_locked(config: Config, lake: Lake, writer: CatalogWriter, workers: int | None,
                  scheduler: str | None, progress: bool, repair: Collection[tuple[str, int]],
                  dashboard: str | None, record_unstarted: bool) -> BuildReport:
    """The steps of a build, in order: register the plans, the mixture (unless weighted in tokens)
    and the packing; choose the tasks; run them as one recorded build run; then register a mixture
    weighted in tokens, which needs the complete lake. A failure before the run starts is raised
    as ``_Unstarted``, recorded as a failed run first if ``record_unstarted`` (a lake that existed
    before: every run has a ``builds`` row; a new one is removed instead)."""
    try:
        tokenizer = load_tokenizer(config.tokenizer)
        text = tokenizer.to_str()   # once: the fingerprint, the self-check and the lake's copy use it
        encoder = encoder_name(resolve_backend(tokenizer, config.tokenizer_backend, config.tokenizer, text))
        tokenizer_path, config = _register_plans(config, lake, writer, tokenizer, encoder, text)
        names = list(config.datasets)
        weighs_tokens = token_weights(config)
        if not weighs_tokens and (config.mixture is not None or len(names) == 1):
            _register_mixture(writer, mixture_spec(config))
        packing = _register_packing(config, writer, tokenizer)
        batch = choose_tasks(config, lake, writer, packing, repair)
    except BaseException as exc:
        if record_unstarted:
            _record_unstarted(writer, scheduler, exc, config)
        raise _Unstarted(exc) from exc
    started = time.perf_counter()
    build_id = writer.start_build(
        workers=0, scheduler=scheduler or "local", dashboard="",
        version=VERSION, encoder=encoder,
    )
    run = BuildRun(config, lake, writer, build_id, lake.url_of(tokenizer_path), workers or config.build.workers,
                   scheduler, dashboard, progress)
    status, dashboard, seconds = _run_recorded(run, batch, started)
    if weighs_tokens:  # the weights need the complete lake's mean tokens per example
        _register_mixture(writer, mixture_spec(
            config, example_token_means(writer.con, plan_keys(config, packing), config.loader.seq_len)))
        publish(writer, lake, build_id, config, whole=True)
    totals = run.totals
    log.info("build %d %s: %d chunks, %d docs, %d tokens in %.1fs (%.0f tokens/s)", build_id, status,
             totals.chunks, totals.docs, totals.tokens, seconds, totals.tokens / max(seconds, 1e-9))
    return BuildReport(build_id, lake.url, totals.chunks, batch.total, totals.docs, totals.tokens,
                       totals.rejects, seconds, dashboard)


def _register_plans(config: Config, lake: Lake, writer: CatalogWriter, tokenizer: Tokenizer,
                    encoder: str, text: str) -> tuple[str, Config]:
    """Publish the tokenizer into the lake and register each dataset's plan (its chunks of the
    global order, stored before anything is tokenized; ``encoder``: the resolved encoder's name and
    version; ``text``: the tokenizer's JSON); returns the tokenizer's lake-relative path and the config with the
    metadata field types the plans fixed."""
    fingerprint = tokenizer_fingerprint(tokenizer, text)
    tokenizer_path = _publish_tokenizer(lake, text, fingerprint)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    plans: dict[str, DatasetPlan] = {}
    # Every plan before any is registered (a filter's predicate is checked against the metadata
    # types its source's plan fixed); datasets defined by a filter after the others.
    for name in sorted(config.datasets, key=lambda n: config.datasets[n].from_ is not None):
        source = config.datasets[name].from_
        if source is None:   # files added to a built plan's, unchanged: the plan grows (plan/growth.py)
            plans[name] = grown_plan(plan_dataset(name, config, fingerprint, encoder=encoder), writer.built_plan(name))
        else:
            plans[name] = filtered_plan(name, config, plans[source])
    for name, plan in plans.items():
        source = config.datasets[name].from_
        new = writer.register_plan(
            plan, tokenizer_path=tokenizer_path, token_type=str(token_dtype(vocab_size)),
            vocab_size=vocab_size, split_size=config.build.split_size,
            on_error=config.datasets[name].on_error,
            definition=None if source else definition_fingerprint(name, config), config_file=config.source_file,
        )
        log.info("dataset %r: %d shards, %d chunks planned%s%s%s", name, len(plan.shards), len(plan.chunks),
                 f" (a filter of {source!r})" if source else "", "" if new else " (plan unchanged)",
                 f" (grown: its first {plan.extends[1]} chunks are plan {plan.extends[0][:12]}'s)"
                 if new and plan.extends else "")
    return tokenizer_path, with_planned_metadata(config, list(plans.values()))   # metadata types fixed at planning


def _run_recorded(run: BuildRun, batch: TaskBatch, started: float) -> tuple[str, str | None, float]:
    """Run ``batch`` as build run ``run.build_id`` and check that every dataset has documents;
    whatever happens, record how the run ended and publish the final snapshot. Returns the run's
    status, the dashboard address (None if no cluster was needed) and its seconds since ``started``."""
    dashboard = None
    status, error = "failed", None
    try:
        if batch.has_work:
            dashboard = run_tasks(run, batch)
        dedup_media(run.lake, run.writer, batch.names)   # every chunk committed: each image stored once
        _check_documents(run.writer, batch.names, run.config)
        status = "succeeded"
    except BaseException as exc:
        status, error = _ending(exc, run.config)
        if status == "interrupted":
            raise _interrupted(run) from None
        raise
    finally:
        seconds = time.perf_counter() - started
        _finish(run, status, error, seconds)
    return status, dashboard, seconds


def _finish(run: BuildRun, status: str, error: str | None, seconds: float) -> None:
    """Record the end of the run with its totals, save the catalog and publish the final
    snapshot. A complete build is recorded "succeeded" only once its catalog is saved; one whose
    catalog cannot be saved or that readers cannot see failed: it stays recorded "failed" and the
    error is raised, so the builds table says what the exit status says. After a failure the
    publish is only logged (the build's own error stays the one raised)."""
    stats = _stats(run.totals, seconds)
    if status == "succeeded":
        # The build's commits (in the write-ahead log) into the catalog file before its success
        # is recorded. A disk that fills there leaves DuckDB refusing every later write, the
        # record of the failure included: so it is recorded first, and replaced once saved.
        _record_end(run.writer, run.build_id, "failed", _UNSAVED.format(path=run.writer.path), stats)
        run.writer.checkpoint()
    _record_end(run.writer, run.build_id, status, error, stats)
    try:
        run.publish(whole=True)
    except BaseException as exc:
        ending = _ending(exc, run.config)
        if ending[0] == "interrupted":
            # The pointer is replaced last, whole: an interrupted publish leaves the previous snapshot current.
            _record_end(run.writer, run.build_id, *ending, stats)
            raise _interrupted(run) from None
        if status == "succeeded" or not isinstance(exc, Exception):   # complete, but readers cannot see it
            _record_end(run.writer, run.build_id, *ending, stats)
            raise
        log.warning("could not publish the final catalog snapshot of failed build %d: %s", run.build_id, exc)


def _check_documents(writer: CatalogWriter, names: list[str], config: Config) -> None:
    """SourceError for a built dataset without documents: no mixture or loader can use it."""
    for row in writer.datasets_without_documents(names).itertuples(index=False):
        split = config.split_of(row.name)
        if split is not None:
            source, part = split
            raise SourceError(
                f"dataset {row.name!r} has no documents: the split of dataset {source!r} puts none of its "
                f"documents in its {part} part; change datasets.{source}.split.fraction or remove the split")
        if isinstance(row.source_dataset, str):
            raise SourceError(
                f"dataset {row.name!r} has no documents: its filter where: {row.where!r} selects none of "
                f"the documents of dataset {row.source_dataset!r}; see `lakeloader stats CONFIG` for the "
                f"source's documents, then change datasets.{row.name}.where or remove the dataset")
        listing = "\n".join(f"  {source}" for source in row.sources)
        if row.num_sources > len(row.sources):
            listing += f"\n  ... and {row.num_sources - len(row.sources)} more"
        raise SourceError(
            f"dataset {row.name!r} has no documents: every record of its {row.num_sources} source file(s) "
            f"was rejected ({row.num_rejects} rejects):\n{listing}\nsee "
            f"`lakeloader sql CONFIG \"SELECT * FROM rejects WHERE dataset = '{row.name}'\"`, "
            f"then fix the sources or remove the dataset"
        )


def _ending(exc: BaseException, config: Config) -> tuple[str, str]:
    """How a build run that ``exc`` ended is recorded: its status and error (Ctrl-C, however it
    reached the build, is "interrupted"; the error text is redacted: the builds table is shared)."""
    if is_interrupt(exc):
        return "interrupted", "interrupted by the user"
    return "failed", config.redact(f"{type(exc).__name__}: {exc}")


def _stats(totals: Totals, seconds: float) -> dict[str, float]:
    """A run's totals and rate as its ``builds`` row records them."""
    return dict(chunks_built=totals.chunks, docs=totals.docs, tokens=totals.tokens,
                source_bytes=totals.source_bytes, rejects=totals.rejects, retries=totals.retries,
                seconds=seconds, tokens_per_s=totals.tokens / seconds if seconds else 0.0)


def _interrupted(run: BuildRun) -> BuildInterrupted:
    """What Ctrl-C during build run ``run`` raises, once the run is recorded interrupted."""
    source = run.config.source_file or "CONFIG"
    return BuildInterrupted(f"build {run.build_id} committed {run.totals.chunks} chunks before it stopped; "
                            f"re-run `lakeloader build {source}` to resume (committed chunks are kept)")


def _record_unstarted(writer: CatalogWriter, scheduler: str | None, error: BaseException, config: Config) -> None:
    """Record a build run that ended with ``error`` before it started; only logged if the catalog
    refuses it too (the build's own error stays the one raised)."""
    try:
        build_id = writer.start_build(workers=0, scheduler=scheduler or "local", dashboard="", version=VERSION)
    except Exception as exc:
        log.warning("could not record the failed build in the catalog: %s", exc)
        return
    _record_end(writer, build_id, *_ending(error, config), _stats(Totals(), 0.0))


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


def _register_mixture(writer: CatalogWriter, spec: MixtureSpec) -> None:
    new = writer.register_mixture(spec)
    log.info("mixture %s%s", spec.mixture_id, " registered" if new else " (registered already)")


def _register_packing(config: Config, writer: CatalogWriter, tokenizer: Tokenizer) -> dict[str, PackingSpec]:
    """The packing spec of each dataset under the config's loader (none for concat) and of each
    dataset read only by its evaluation pass, registered (a dataset both mixed and evaluated is
    packed alike for both: the config's checks keep its evaluation seq_len the loader's)."""
    specs = packing_specs(config, tokenizer)
    if config.evaluation is not None:
        evaluation = packing_specs(evaluation_config(config), tokenizer)
        specs.update((name, spec) for name, spec in evaluation.items() if name not in specs)
    for name, spec in specs.items():
        writer.register_packing(name, spec)
    return specs
