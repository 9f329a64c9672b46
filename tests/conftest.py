"""Shared fixtures: real text corpora, the demo tokenizer, a real Dask LocalCluster, configs."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import sysconfig
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
import zstandard

from lakeloader.catalog.lake import open_lake
from lakeloader.catalog.pointer import delta_file, delta_key, delta_versions, seal_pointer
from lakeloader.catalog.progress import counted
from lakeloader.catalog.reader_index import TABLES, index_file
from lakeloader.catalog.sql import query
from lakeloader.catalog.store import LiveCatalog
from lakeloader.contracts.errors import LakeloaderError
from lakeloader.feed.loader import Loader
from lakeloader.feed.rows import ROW_FIELDS
from lakeloader.ingest.driver import build
from lakeloader.read import read_ahead
from lakeloader.read.catalog_view import CatalogView

REPO = Path(__file__).resolve().parents[1]
DEMO_TOKENIZER = Path(os.environ.get("LAKELOADER_TEST_TOKENIZER", REPO / "demo" / "tokenizer.json"))
# loader.fields the model-based tests' loaders make: every field (the oracles'), or fewer.
FIELD_CHOICES = [ROW_FIELDS, ("input_ids", "targets"), ("input_ids", "targets", "loss_mask", "segment_ids"),
                 ("input_ids", "targets", "positions")]


def with_fields(batch: dict[str, Any], fields: Sequence[str]) -> dict[str, Any]:
    """``batch`` as a loader making the row fields ``fields`` returns it: its other row fields
    left out, its other arrays (dataset ids) kept."""
    return {k: v for k, v in batch.items() if k in fields or k not in ROW_FIELDS}


def stdlib_texts(package: str, limit: int | None = None) -> list[str]:
    """Real text: the sources of a standard-library package, in sorted order."""
    root = Path(sysconfig.get_paths()["stdlib"]) / package
    files = sorted(root.rglob("*.py")) if root.is_dir() else [root.with_suffix(".py")]
    texts = [f.read_text(encoding="utf-8") for f in files[:limit]]
    return [t for t in texts if t]


def write_jsonl(path: Path, texts: list[str], field: str = "text", compression: str | None = None) -> Path:
    """Write ``texts`` as JSON Lines (optionally gzip/zstd compressed)."""
    data = "".join(json.dumps({field: t, "n": i}) + "\n" for i, t in enumerate(texts)).encode()
    if compression == "gzip":
        data = gzip.compress(data, mtime=0)
    elif compression == "zstd":
        data = zstandard.ZstdCompressor(level=3).compress(data)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def write_parquet(path: Path, texts: list[str | None], row_group_size: int = 4) -> Path:
    """Write ``texts`` as a Parquet file with a ``text`` column in several row groups."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": pa.array(texts, pa.string())}), path, row_group_size=row_group_size)
    return path


def shm_segments(pid: int) -> list[str]:
    """The loader-worker shared-memory segments of process ``pid`` left in /dev/shm."""
    return [name for name in os.listdir("/dev/shm") if name.startswith(f"lakeloader_{pid}_")]


def children(pid: int) -> set[int]:
    """Process ids whose parent is ``pid`` (zombies included)."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.add(int(entry))
    return found


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def spawned_workers(before: set[int]) -> set[int]:
    """Live children of this process not in ``before`` (loader workers), the shared-memory
    resource tracker excepted (it serves the interpreter, not a loader)."""
    found = set()
    for pid in children(os.getpid()) - before:
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if alive(pid) and b"resource_tracker" not in command:
            found.add(pid)
    return found


class RunLoaders:
    """A training run's global batches from ``count`` processes' loaders (the tests of runs
    continued under edited configs)."""

    def __init__(self, config: Path, count: int) -> None:
        self.parts = [Loader(config, process_index=p, process_count=count) for p in range(count)]

    def follow(self, state: dict[str, Any], continue_changes: bool) -> None:
        for loader in self.parts:
            loader.follow(state, continue_changes=continue_changes)

    def batch(self, step: int) -> dict[str, np.ndarray]:
        found = [loader.batch(step) for loader in self.parts]
        return {k: np.concatenate([f[k] for f in found]) for k in found[0]}

    def consumed(self, step: int) -> list[tuple[str, int, int]]:
        """(dataset, epoch, example) of each row of ``step``, in row order."""
        return [(e.dataset, e.epoch, e.example) for loader in self.parts
                for e in loader.examples(step).examples if e is not None]

    def close(self) -> None:
        for loader in self.parts:
            loader.close()


def read_run(current: RunLoaders, straight: Loader, step: int, k: int, served: list[Batch],
             rows: list[list[tuple[str, int, int]]]) -> int:
    """Read ``k`` steps of a run from ``step`` on, each equal to ``straight``'s, into ``served``
    and ``rows`` (the (dataset, epoch, example) of each row); returns the next step."""
    for step in range(step, step + k):
        batch = current.batch(step)
        assert_batches_equal(batch, straight.batch(step), "resumed vs never restarted", [step])
        served.append(batch)
        rows.append(current.consumed(step))
    return step + 1


def resume_run(current: RunLoaders, straight: Loader, path: Path, step: int, count: int,
               served: list[Batch], refusal: str | None) -> tuple[RunLoaders, Loader]:
    """The run of ``current`` continued at ``step`` under config ``path`` by ``count`` fresh
    processes' loaders (its state through a checkpoint file, refused first without
    ``continue_changes`` with a message matching ``refusal`` unless None), and by ``straight``'s
    state in one loader of this process (the same changes at the same steps, never restarted);
    the old loaders closed and earlier steps checked against ``served``."""
    state = json.loads(json.dumps(current.parts[0].state(step)))
    resumed = RunLoaders(path, count)
    if refusal is not None:
        with pytest.raises(LakeloaderError, match=refusal):
            resumed.parts[0].follow(state)
    resumed.follow(state, continue_changes=True)
    twin = Loader(path)
    twin.follow(straight.state(step), continue_changes=True)
    straight.close()
    current.close()
    for earlier in sorted({0, step // 2, max(0, step - 1)}):   # earlier steps keep their batches
        if earlier < step:
            assert_batches_equal(resumed.batch(earlier), served[earlier], "after the change", [earlier])
    return resumed, twin


def assert_epochs_whole(rows: list[list[tuple[str, int, int]]],
                        size_of: Callable[[str, int], int]) -> list[tuple[str, int]]:
    """Check the (dataset, epoch, example) of a run's rows, in the order served: each dataset's
    epochs in order, no example repeated within an epoch or past its size (``size_of(dataset,
    epoch)``), every example of each epoch that ended. Returns those (dataset, epoch)."""
    seen: dict[str, list[tuple[int, int]]] = {}
    for step in rows:
        for dataset, epoch, example in step:
            seen.setdefault(dataset, []).append((epoch, example))
    whole = []
    for dataset, taken in seen.items():
        epochs = [e for e, _ in taken]
        assert epochs == sorted(epochs), f"{dataset}: epochs out of order"
        for epoch in sorted(set(epochs)):
            size = size_of(dataset, epoch)
            examples = [k for e, k in taken if e == epoch]
            assert len(set(examples)) == len(examples), f"{dataset} epoch {epoch}: an example repeats"
            assert max(examples) < size, f"{dataset} epoch {epoch}: an example past its {size}"
            if epoch < epochs[-1]:
                assert sorted(examples) == list(range(size)), f"{dataset} epoch {epoch}: examples skipped"
                whole.append((dataset, epoch))
    return whole


def write_config(tmp: Path, datasets: dict[str, Any], **sections: Any) -> Path:
    """A config file in ``tmp`` for a lake in ``tmp/lake`` with the demo tokenizer."""
    config = {"lake": str(tmp / "lake"), "tokenizer": str(DEMO_TOKENIZER), "datasets": datasets}
    config["build"] = {"split_size": "64KB", "publish_interval": 0.5, **sections.pop("build", {})}
    config.update(sections)
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@pytest.fixture(scope="session")
def dask_scheduler() -> Iterator[str]:
    """Address of a real LocalCluster of 2 single-threaded worker processes, shared by the tests."""
    from distributed import LocalCluster

    from lakeloader.ingest.cluster import WORKER_ENV

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
                      env=WORKER_ENV) as cluster:
        yield cluster.scheduler_address


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    # Beside the test's tmp_path, not in it: tests list what they write there.
    monkeypatch.setenv("LAKELOADER_CACHE", str(tmp_path_factory.mktemp("cache")))
    os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "warning")


def batch_files(path: Path) -> dict[str, Any]:
    """The batch fields of a ``lakeloader batches`` file (each ``[steps, rows, ...]``), without the
    ``dataset_names`` it also holds."""
    with np.load(path) as data:
        return {name: data[name] for name in data.files if name != "dataset_names"}


def reseal_snapshot(lake_root: Path) -> dict[str, Any]:
    """Make the lake's CURRENT pointer vouch for its snapshot files as they are now, as someone who
    altered them and knows lakeloader would (the pointer's checksums guard against damage, not
    against a writer of the lake): for tests of what a reader does with an altered catalog. Returns
    the new pointer."""
    current = lake_root / "_catalog" / "CURRENT"
    pointer = {k: v for k, v in json.loads(current.read_bytes()).items() if k != "checksum"}
    files = {"catalog": pointer["file"]}
    if isinstance(pointer.get("reader_index"), dict):
        files |= {table: index_file(pointer["reader_index"]["prefix"], table) for table in TABLES}
    files |= {delta_key(version): delta_file(version) for version in delta_versions(pointer)}
    pointer["sha256"] = {key: hashlib.sha256((lake_root / "_catalog" / name).read_bytes()).hexdigest()
                         for key, name in files.items() if (lake_root / "_catalog" / name).exists()}
    current.write_bytes(seal_pointer(pointer))
    return json.loads(current.read_bytes())


def lake_documents(config_path: Path, dataset: str) -> list[list[int]]:
    """Every document's stored tokens, in the dataset's global chunk order (read with pyarrow)."""
    from lakeloader.catalog.lake import open_lake

    lake = open_lake(config_path)
    paths = lake.sql(
        "SELECT path FROM chunks WHERE dataset = ? AND status = 'committed' ORDER BY global_index",
        [dataset],
    )["path"]
    documents: list[list[int]] = []
    for path in paths:
        documents.extend(pq.read_table(lake.path_of(path)).column("tokens").to_pylist())
    return documents


def global_batches(config: Path, processes: int, steps: range) -> list[dict[str, Any]]:
    """Global batches ``steps`` assembled from ``processes`` loaders' rows (row order kept)."""

    loaders = [Loader(config, process_index=p, process_count=processes) for p in range(processes)]
    out = []
    for step in steps:
        parts = [loader.batch(step) for loader in loaders]
        out.append({k: np.concatenate([p[k] for p in parts]) for k in parts[0]})
    for loader in loaders:
        loader.close()
    return out


Batch = dict[str, Any]


def assert_progress_counted(target: str | os.PathLike[str]) -> None:
    """The progress counters of the lake of ``target`` (a config or a lake) equal their count from
    its chunk rows (catalog/progress.py)."""
    con = open_lake(target).connect()
    try:
        assert not con.execute(query("progress_differs").format(**counted())).fetchone()[0]
    finally:
        con.close()


def assert_batches_equal(a: Batch | list[Batch], b: Batch | list[Batch], what: str = "",
                         steps: Sequence[int] | None = None) -> None:
    """``a`` and ``b`` (one batch or a list of batches) are bitwise equal: the same fields, and
    each field the same dtype, shape and values. A failure names ``what``, the step (``steps[i]``
    for the i-th batch of a list, else its position) and field of the first difference."""
    one = isinstance(a, dict)
    xs, ys = ([a], [b]) if one else (list(a), list(b))
    assert len(xs) == len(ys), f"{what}: {len(xs)} batches != {len(ys)}"
    labels = list(steps) if steps is not None else list(range(len(xs)))
    for label, x, y in zip(labels, xs, ys):
        where = f"{what} step {label}".strip() if not one or steps is not None else what
        assert sorted(x) == sorted(y), f"{where}: fields {sorted(x)} != {sorted(y)}"
        for key in y:
            u, v = np.asarray(x[key]), np.asarray(y[key])
            assert u.dtype == v.dtype, f"{where} field {key!r}: dtype {u.dtype} != {v.dtype}"
            assert u.shape == v.shape, f"{where} field {key!r}: shape {u.shape} != {v.shape}"
            if not np.array_equal(u, v):
                first = tuple(int(i) for i in np.argwhere(u != v)[0]) if u.ndim else ()
                pytest.fail(f"{where} field {key!r} differs first at index {first}: {u[first]!r} != {v[first]!r}"
                            f" ({int((u != v).sum())} elements differ)")


def write_corpus(data: Path, corpus: Mapping[str, Any]) -> None:
    """Write each ``relative path -> content`` of a corpus: texts as JSON Lines (``.jsonl``,
    ``.jsonl.gz``, ``.jsonl.zst``) or Parquet (``.parquet``); a str as the file's raw text."""
    for relative, content in corpus.items():
        path = data / relative
        if isinstance(content, str):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content)
        elif relative.endswith(".parquet"):
            write_parquet(path, list(content))
        else:
            compression = {".gz": "gzip", ".zst": "zstd"}.get(path.suffix)
            write_jsonl(path, list(content), compression=compression)


def _sources_in(data: Path, datasets: Mapping[str, Any]) -> dict[str, Any]:
    """``datasets`` with every relative source (file or glob) made a path under ``data``."""
    return {name: {**spec, "sources": [s if Path(s).is_absolute() else str(data / s) for s in spec["sources"]]}
            for name, spec in datasets.items()}


class Lakes:
    """Built lakes shared by the test session: one build per distinct corpus and config.

    ``corpus`` maps paths relative to the lake's data folder to contents (see
    :func:`write_corpus`); ``datasets`` are config datasets whose relative sources name those
    paths; ``sections`` are further config sections (``build``, ``loader``, ``mixture`` ...) as for
    :func:`write_config`. Identical requests share one build; tests must not change a shared lake
    (:meth:`shared`) and get a private copy of the lake folder (:meth:`copy`) when they do.
    """

    def __init__(self, root: Path, scheduler: str) -> None:
        self.root = root
        self.scheduler = scheduler
        self.builds = 0

    def shared(self, corpus: Mapping[str, Any], datasets: Mapping[str, Any], **sections: Any) -> Path:
        """Config of the shared built lake (``config.parent`` holds ``data/``, ``lake/``)."""
        request = json.dumps([corpus, datasets, sections], sort_keys=True, default=str)
        folder = self.root / hashlib.sha256(request.encode()).hexdigest()[:16]
        if not (folder / "built").exists():
            write_corpus(folder / "data", corpus)
            build(write_config(folder, _sources_in(folder / "data", datasets), **sections),
                  scheduler=self.scheduler, progress=False)
            self.builds += 1
            (folder / "built").touch()
        return folder / "config.yaml"

    def copy(self, dest: Path, corpus: Mapping[str, Any], datasets: Mapping[str, Any], **sections: Any) -> Path:
        """Config in ``dest`` of a private copy (``dest/lake``) of the built lake: free to change."""
        return copied_lake(self.shared(corpus, datasets, **sections), dest)


def copied_lake(config: Path, dest: Path) -> Path:
    """Config in ``dest`` of a private copy (``dest/lake``) of the lake of ``config`` (which lives
    beside its config, as write_config puts it)."""
    shutil.copytree(config.parent / "lake", dest / "lake")
    settings = yaml.safe_load(config.read_text())
    settings["lake"] = str(dest / "lake")
    path = dest / "config.yaml"
    path.write_text(yaml.safe_dump(settings, sort_keys=False))
    return path


@pytest.fixture(scope="session")
def lakes(tmp_path_factory: pytest.TempPathFactory, dask_scheduler: str) -> Lakes:
    """The session's cache of built lakes (see :class:`Lakes`)."""
    return Lakes(tmp_path_factory.mktemp("lakes"), dask_scheduler)


SMALL_LOADER = {"seq_len": 64, "batch_size": 8, "shuffle": {"kind": "window", "window_chunks": 2}}
SMALL_CORPUS_TEXTS: dict[str, Callable[[], list[str]]] = {
    "d.jsonl": lambda: stdlib_texts("json") + stdlib_texts("email", limit=10),
}


def small_lake_request(**overrides: Any) -> dict[str, Any]:
    """The default lake of :func:`built_lake`: one dataset ``d`` of the ``json`` package and ten
    ``email`` modules in chunks of 16KB, read in window-shuffled examples of 64 tokens;
    ``overrides`` replace ``corpus``, ``datasets`` or a config section (e.g. ``loader``)."""
    request: dict[str, Any] = {"corpus": {path: texts() for path, texts in SMALL_CORPUS_TEXTS.items()},
                               "datasets": {"d": {"sources": ["d.jsonl"]}}, "build": {"split_size": "16KB"},
                               "loader": SMALL_LOADER}
    return {**request, **overrides}


@pytest.fixture
def built_lake(request: pytest.FixtureRequest, lakes: Lakes, tmp_path: Path) -> Path:
    """Config (``tmp_path/config.yaml``) of a private copy of a built lake in ``tmp_path/lake``.

    By default the lake of :func:`small_lake_request`; parametrise indirectly with a dict of
    overrides, e.g. ``@pytest.mark.parametrize("built_lake", [{"loader": {...}}], indirect=True)``.
    """
    spec = small_lake_request(**getattr(request, "param", {}))
    return lakes.copy(tmp_path, spec.pop("corpus"), spec.pop("datasets"), **spec)


@pytest.fixture(scope="session")
def two_dataset_lake(tmp_path_factory: pytest.TempPathFactory, dask_scheduler: str) -> dict[str, Path]:
    """A small lake of two datasets in a 0.6/0.4 mixture, built once per session, and a loader
    config per packing ("pack", "concat": both read the same lake; the build registers pack).
    Tests must not change it."""
    root = tmp_path_factory.mktemp("two_datasets")
    write_jsonl(root / "data" / "a.jsonl", stdlib_texts("json"))
    write_jsonl(root / "data" / "b.jsonl", stdlib_texts("zoneinfo"))
    datasets = {"a": {"sources": [str(root / "data" / "a.jsonl")]}, "b": {"sources": [str(root / "data" / "b.jsonl")]}}
    configs = {}
    for packing in ("pack", "concat"):
        path = write_config(root, datasets, build={"split_size": "8KB", "row_group_tokens": 500},
                            loader={"seq_len": 32, "batch_size": 8, "packing": packing,
                                    "shuffle": {"kind": "window", "window_chunks": 2}},
                            mixture={"weights": {"a": 0.6, "b": 0.4}})
        configs[packing] = path.rename(root / f"{packing}.yaml")
    build(configs["pack"], scheduler=dask_scheduler, progress=False)
    return configs


def start_build_thread(config: Path, timeout: float = 60, **options: Any
                       ) -> tuple[threading.Thread, LiveCatalog, list[BaseException]]:
    """Start ``build(config, live=..., **options)`` in a thread and return once the build holds its
    catalog (or has ended): the thread, the build's live-catalog handle for readers in this process,
    and the list the build's exception goes to (for the test to assert on)."""
    live, errors = LiveCatalog(), []

    def run() -> None:
        try:
            build(config, live=live, **options)
        except BaseException as exc:  # surfaced by the test's assertion
            errors.append(exc)

    builder = threading.Thread(target=run)
    builder.start()
    deadline = time.monotonic() + timeout
    while not live.is_open and builder.is_alive():
        assert time.monotonic() < deadline, "the build did not open its catalog"
        time.sleep(0.01)
    return builder, live, errors


def loader_during_build(config: Path, builder: threading.Thread, live: LiveCatalog) -> Loader:
    """A Loader on a running build's live catalog, opened as soon as the build has registered the
    plans it reads; fails if the build ends first (a reader started after it would test nothing)."""
    while builder.is_alive():
        try:
            return Loader(config, catalog=live)
        except LakeloaderError:  # the plans are not registered yet
            time.sleep(0.01)
    raise AssertionError("the build finished before a reader could start")


def batches_while_building(config: Path, steps: int, **options: Any) -> list[dict[str, Any]]:
    """Batches ``0 .. steps - 1`` of a Loader opened on the build of ``config`` (started here with
    ``options``) as soon as it has registered its plans; the build is then joined and must succeed."""
    builder, live, errors = start_build_thread(config, **options)
    loader = loader_during_build(config, builder, live)
    try:
        batches = [loader.batch(step) for step in range(steps)]
    finally:
        loader.close()
        builder.join()
    assert not errors, errors
    return batches


@pytest.fixture
def catalog_query_threads(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """The names of the threads that ask the catalog anything (a query in CatalogView.reading, or
    a lookup in its reader index) during the test, filled as they run."""
    threads: set[str] = set()
    for method in ("reading", "reader_index"):
        def spy(self: CatalogView, *args: Any, original: Any = getattr(CatalogView, method), **options: Any) -> Any:
            threads.add(threading.current_thread().name)
            return original(self, *args, **options)

        monkeypatch.setattr(CatalogView, method, spy)
    return threads


def ahead_thread_caught_up() -> None:
    """Return once the readers' background thread has done all it was asked so far (row groups
    decoded ahead): that thread is one, and runs its tasks in order."""
    read_ahead._AHEAD_POOL.submit(lambda: None).result()
