"""One name, two definitions (issue 48, item 3): configs of one lake that give a dataset name to
different definitions (other sources, split size, fields) never read each other's data: a
loader, ``status`` and ``stats`` of a config whose dataset the lake holds under another
definition refuse it in one line naming the dataset, who built the lake's plan and what to do."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import duckdb
import pytest
import yaml
from tokenizers import Tokenizer

from lakeloader.catalog.lake import open_lake
from lakeloader.catalog.pointer import seal_pointer
from lakeloader.cli import main
from lakeloader.contracts.errors import CatalogError
from lakeloader.feed.loader import Loader
from lakeloader.ingest.driver import build

from conftest import DEMO_TOKENIZER, reseal_snapshot

TOKENIZER = Tokenizer.from_file(str(DEMO_TOKENIZER))
EOS = TOKENIZER.token_to_id("<|endoftext|>")
BATCH = 4
LOADER = {"seq_len": 256, "batch_size": BATCH, "packing": "pad", "pack": {"long_documents": "error"},
          "shuffle": "none"}


def texts(tag: str, count: int) -> list[str]:
    """``count`` short distinct documents of corpus ``tag``."""
    return [f"{tag} document {i}: " + " ".join(f"{tag}{(i * 7 + j) % 23}" for j in range(3 + i % 5))
            for i in range(count)]


def write_corpus(path: Path, docs: list[str], field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({field: doc, "n": i}) + "\n" for i, doc in enumerate(docs)))
    return path


def config_file(root: Path, name: str, datasets: dict[str, Any], split_size: str = "1KB",
                weights: dict[str, float] | None = None) -> Path:
    """Config ``root/<name>.yaml`` of the lake ``root/lake``."""
    config: dict[str, Any] = {"lake": str(root / "lake"), "tokenizer": str(DEMO_TOKENIZER), "datasets": datasets,
                              "build": {"split_size": split_size, "publish_interval": 0.2, "workers": 1},
                              "loader": LOADER}
    if len(datasets) > 1:
        config["mixture"] = {"weights": weights or {n: 1 for n in datasets}}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def eval_documents(config: Path) -> dict[str, list[list[int]]]:
    """Each dataset's documents as an eval pass serves them (packing: pad, a document a row; the
    EOS each ends with removed), by dataset name."""
    out: dict[str, list[list[int]]] = {}
    with Loader(config, mode="eval") as loader:
        names = loader.dataset_names
        for batch in loader:
            for row in range(BATCH):
                if batch["example_mask"][row]:
                    ids = batch["input_ids"][row][batch["segment_ids"][row] > 0].tolist()
                    assert ids[-1] == EOS
                    out.setdefault(names[batch["dataset_ids"][row]], []).append(ids[:-1])
    return out


def encoded(docs: list[str]) -> list[list[int]]:
    return [TOKENIZER.encode(doc, add_special_tokens=False).ids for doc in docs]


def test_two_configs_giving_one_name_other_sources_never_read_each_others_data(
        tmp_path: Path, dask_scheduler: str, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    """The reproduction: building b.yaml (web: other sources) after a.yaml, a loader of a.yaml
    read b's documents with no error. Now it refuses in one line naming the dataset, b.yaml and
    the command that makes a.yaml's data the lake's again; status and stats of a.yaml too; the
    build of b.yaml warns that it displaces a.yaml's definition."""
    a_docs, b_docs = texts("alpha", 40), texts("beta", 30)
    a = config_file(tmp_path, "a", {"web": {"sources": [str(write_corpus(tmp_path / "x" / "a.jsonl", a_docs))]}})
    b = config_file(tmp_path, "b", {"web": {"sources": [str(write_corpus(tmp_path / "y" / "b.jsonl", b_docs))]}})
    build(a, scheduler=dask_scheduler, progress=False)
    assert eval_documents(a) == {"web": encoded(a_docs)}
    with caplog.at_level("WARNING", logger="lakeloader.catalog.store"):
        build(b, scheduler=dask_scheduler, progress=False)
    assert any("dataset 'web': replacing the lake's plan" in r.getMessage() and "a.yaml" in r.getMessage()
               and "b.yaml" in r.getMessage()
               for r in caplog.records)
    assert eval_documents(b) == {"web": encoded(b_docs)}
    refused = (r"dataset 'web' of lake .* holds another definition than .*a\.yaml's .*built from .*b\.yaml.*"
               r"lakeloader build .*a\.yaml.* or give the dataset a name of its own")
    with pytest.raises(CatalogError, match=refused) as caught:
        Loader(a, mode="eval")
    assert "\n" not in str(caught.value)
    with pytest.raises(CatalogError, match=refused):
        open_lake(a).status()
    with pytest.raises(CatalogError, match=refused):
        open_lake(a).stats()
    assert main(["status", str(a)]) == 2
    assert "holds another definition" in capsys.readouterr().err
    assert main(["status", str(a), "--whole-lake"]) == 0   # the lake as it is: b's web
    capsys.readouterr()
    build(a, scheduler=dask_scheduler, progress=False)
    assert eval_documents(a) == {"web": encoded(a_docs)}
    with pytest.raises(CatalogError, match=r"'web' .*another definition than .*b\.yaml's .*built from .*a\.yaml"):
        Loader(b, mode="eval")


@pytest.mark.parametrize("change", ["split_size", "text_field", "metadata_fields"])
def test_one_name_other_settings_is_another_definition(tmp_path: Path, dask_scheduler: str, change: str) -> None:
    """The same sources under another split size, text field or metadata fields: another plan; a
    loader of the config the lake does not hold refuses it, and reads once it is built again."""
    docs = texts("gamma", 40)
    source = str(write_corpus(tmp_path / "x" / "c.jsonl", docs))
    web: dict[str, Any] = {"sources": [source]}
    other = {"split_size": {}, "text_field": {"text_field": "text"}, "metadata_fields": {"metadata_fields": ["n"]}}
    a = config_file(tmp_path, "a", {"web": web})
    b = config_file(tmp_path, "b", {"web": {**web, **other[change]}},
                    split_size="2KB" if change == "split_size" else "1KB")
    if change == "text_field":   # text_field: text is the default: the same definition, both read
        build(a, scheduler=dask_scheduler, progress=False)
        build(b, scheduler=dask_scheduler, progress=False)
        assert eval_documents(a) == eval_documents(b) == {"web": encoded(docs)}
        return
    build(a, scheduler=dask_scheduler, progress=False)
    build(b, scheduler=dask_scheduler, progress=False)
    with pytest.raises(CatalogError, match=r"'web' .*another definition than .*a\.yaml's .*built from .*b\.yaml"):
        Loader(a, mode="eval")
    with Loader(b, mode="eval") as loader:
        chunks = loader.datasets[0].chunks.planned
    size = (tmp_path / "x" / "c.jsonl").stat().st_size
    assert chunks == math.ceil(size / (2048 if change == "split_size" else 1024))
    assert eval_documents(b) == {"web": encoded(docs)}


def test_a_lake_from_before_definitions_were_recorded_still_reads(tmp_path: Path, dask_scheduler: str) -> None:
    """A catalog and a published snapshot without the dataset_definitions table (a lake built
    before it; the snapshot without a reader index, as then) still read: its plans are taken as
    the config's, as before; the next build records the definitions again."""
    docs = texts("delta", 20)
    a = config_file(tmp_path, "a", {"web": {"sources": [str(write_corpus(tmp_path / "x" / "d.jsonl", docs))]}})
    build(a, scheduler=dask_scheduler, progress=False)
    lake = tmp_path / "lake"
    current = lake / "_catalog" / "CURRENT"
    pointer = {k: v for k, v in json.loads(current.read_bytes()).items() if k not in ("checksum", "reader_index")}
    for catalog in (lake / "catalog.duckdb", lake / "_catalog" / pointer["file"]):
        con = duckdb.connect(str(catalog))
        con.execute("DROP TABLE dataset_definitions")
        con.close()
    current.write_bytes(seal_pointer(pointer))
    reseal_snapshot(lake)
    assert eval_documents(a) == {"web": encoded(docs)}
    assert open_lake(a).status()["datasets"].name.tolist() == ["web"]
    build(a, scheduler=dask_scheduler, progress=False)
    assert open_lake(a).sql("SELECT count(*) AS n FROM dataset_definitions").n[0] == 1
    assert eval_documents(a) == {"web": encoded(docs)}
