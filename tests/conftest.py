"""Shared fixtures: real text corpora, the demo tokenizer, a real Dask LocalCluster, configs."""

from __future__ import annotations

import gzip
import json
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
import zstandard

REPO = Path(__file__).resolve().parents[1]
DEMO_TOKENIZER = Path(os.environ.get("LAKELOADER_TEST_TOKENIZER", REPO / "demo" / "tokenizer.json"))


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
def _isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAKELOADER_CACHE", str(tmp_path / "cache"))
    os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "warning")


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
    import numpy as np

    from lakeloader.feed.loader import Loader

    loaders = [Loader(config, process_index=p, process_count=processes) for p in range(processes)]
    out = []
    for step in steps:
        parts = [loader.batch(step) for loader in loaders]
        out.append({k: np.concatenate([p[k] for p in parts]) for k in parts[0]})
    for loader in loaders:
        loader.close()
    return out


def assert_batches_equal(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    """The two lists of batches are bitwise equal: same fields, dtypes and values."""
    import numpy as np

    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in x:
            assert x[key].dtype == y[key].dtype and np.array_equal(x[key], y[key]), key
