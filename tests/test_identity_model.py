"""Model-based test of a lake shared by several configs (issue 48, item 3).

Four small configs over one lake give the dataset names ``web`` and ``web_en`` overlapping and
conflicting definitions: the same sources under two split sizes, other sources, filters of one
source with two predicates. A hypothesis state machine builds, reads, gc's and rebuilds them in
random order against an oracle of which definition of each name the lake holds (the last build
defining it) and of what each config must read (its own corpus, split and predicate, computed
here from the JSONL it wrote). Every loader reads exactly its own definition's documents and
chunks, or refuses in one line naming a dataset the lake holds under another definition (or
not at all) and the build command; gc never removes what a config the oracle says is built
reads. ``LAKELOADER_IDENTITY_EXAMPLES`` sets the number of random walks (default 8, of up to 8
steps after a first build: about 30 s on 2 cores; a deeper run can raise it).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule, run_state_machine_as_test
from tokenizers import Tokenizer

from lakeloader.cli import main
from lakeloader.contracts.errors import CatalogError
from lakeloader.feed.loader import Loader
from lakeloader.ingest.driver import build

from conftest import DEMO_TOKENIZER

EXAMPLES = int(os.environ.get("LAKELOADER_IDENTITY_EXAMPLES", "8"))
TOKENIZER = Tokenizer.from_file(str(DEMO_TOKENIZER))
EOS = TOKENIZER.token_to_id("<|endoftext|>")
BATCH = 4
LOADER = {"seq_len": 256, "batch_size": BATCH, "packing": "pad", "pack": {"long_documents": "error"},
          "shuffle": "none"}
METADATA = {"lang": "string"}


@dataclass(frozen=True)
class Definition:
    """What one config means by one dataset name: a corpus cut at a split size, or a filter of its
    source's definition by a language (the oracle's key: equal keys, equal data)."""

    corpus: str
    split_size: int
    lang: str | None = None   # a filter: where lang = '<lang>'


# Each config: its datasets' definitions and the datasets its mixture reads.
CONFIGS: dict[str, tuple[dict[str, Definition], tuple[str, ...]]] = {
    "both_en": ({"web": Definition("x", 1024), "web_en": Definition("x", 1024, "en")}, ("web", "web_en")),
    "fr_only": ({"web": Definition("x", 1024), "web_en": Definition("x", 1024, "fr")}, ("web_en",)),
    "other_sources": ({"web": Definition("y", 1024)}, ("web",)),
    "other_split": ({"web": Definition("x", 2048), "web_en": Definition("x", 2048, "en")}, ("web", "web_en")),
}


def corpus_records(tag: str, count: int) -> list[dict[str, Any]]:
    """``count`` short distinct documents of corpus ``tag``, in English and French by turns."""
    return [{"text": f"{tag} {i}: " + " ".join(f"{tag}{(i * 5 + j) % 17}" for j in range(2 + i % 6)),
             "lang": ("en", "fr", "en")[i % 3]} for i in range(count)]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list[dict[str, Any]]]]:
    """The two corpora (one JSONL file each) and their records, shared by every walk."""
    root = tmp_path_factory.mktemp("identity-corpora")
    out = {}
    for tag, count in (("x", 48), ("y", 36)):
        path = root / tag / f"{tag}.jsonl"
        path.parent.mkdir()
        records = corpus_records(tag, count)
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        out[tag] = (path, records)
    return out


def write_configs(root: Path, corpora: dict[str, tuple[Path, list[dict[str, Any]]]]) -> dict[str, Path]:
    """The four configs of the lake ``root/lake``, as files ``root/<name>.yaml``."""
    paths = {}
    for name, (definitions, reads) in CONFIGS.items():
        datasets: dict[str, Any] = {}
        for dataset, definition in definitions.items():
            if definition.lang is None:
                datasets[dataset] = {"sources": [str(corpora[definition.corpus][0])], "metadata_fields": METADATA}
            else:
                datasets[dataset] = {"from": "web", "where": f"lang = '{definition.lang}'"}
        split = {d.split_size for d in definitions.values()}.pop()
        config: dict[str, Any] = {"lake": str(root / "lake"), "tokenizer": str(DEMO_TOKENIZER), "datasets": datasets,
                                  "build": {"split_size": split, "publish_interval": 0.2}, "loader": LOADER}
        if len(datasets) > 1:
            config["mixture"] = {"weights": {dataset: 1 for dataset in reads}}
        paths[name] = root / f"{name}.yaml"
        paths[name].write_text(yaml.safe_dump(config, sort_keys=False))
    return paths


def served(config: Path) -> tuple[dict[str, list[list[int]]], dict[str, int]]:
    """Each dataset's documents as an eval pass of ``config`` serves them (a document a row, its
    EOS removed) and the chunks the loader sees planned for it, by dataset name."""
    documents: dict[str, list[list[int]]] = {}
    with Loader(config, mode="eval") as loader:
        names = loader.dataset_names
        chunks = {d.name: d.chunks.planned for d in loader.datasets}
        for batch in loader:
            for row in range(BATCH):
                if batch["example_mask"][row]:
                    ids = batch["input_ids"][row][batch["segment_ids"][row] > 0].tolist()
                    assert ids[-1] == EOS
                    documents.setdefault(names[batch["dataset_ids"][row]], []).append(ids[:-1])
    return documents, chunks


def identity_walks(base: Path, corpora: dict[str, tuple[Path, list[dict[str, Any]]]],
                   scheduler: str) -> type[RuleBasedStateMachine]:
    """The state machine of one walk over a fresh lake in ``base``."""

    def expected(definition: Definition) -> list[list[int]]:
        path, records = corpora[definition.corpus]
        return [TOKENIZER.encode(r["text"], add_special_tokens=False).ids for r in records
                if definition.lang is None or r["lang"] == definition.lang]

    def expected_chunks(definition: Definition) -> int:
        return math.ceil(corpora[definition.corpus][0].stat().st_size / definition.split_size)

    class SharedLake(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.root = Path(tempfile.mkdtemp(dir=base))
            self.configs = write_configs(self.root, corpora)
            self.holder: dict[str, Definition] = {}   # the definition of each name the lake holds

        def foreign(self, name: str) -> list[str]:
            """The datasets of config ``name`` the lake does not hold as it defines them."""
            return [dataset for dataset, definition in CONFIGS[name][0].items()
                    if self.holder.get(dataset) != definition]

        def check_read(self, name: str) -> None:
            """A loader of ``name`` reads exactly its definitions' documents and chunks, or (the
            oracle says the lake holds another definition of a dataset it reads) refuses in one
            line naming one of those datasets and the build command."""
            definitions, reads = CONFIGS[name]
            foreign = self.foreign(name)
            if not foreign:
                documents, chunks = served(self.configs[name])
                assert documents == {d: expected(definitions[d]) for d in reads}, name
                assert chunks == {d: expected_chunks(definitions[d]) for d in reads}, name
                return
            with pytest.raises(CatalogError) as caught:
                served(self.configs[name])
            message = str(caught.value)
            assert "\n" not in message and f"lakeloader build {self.configs[name]}" in message, message
            assert any(f"dataset {dataset!r}" in message for dataset in foreign), (name, foreign, message)

        @initialize(name=st.sampled_from(sorted(CONFIGS)))
        def first_build(self, name: str) -> None:
            """Every walk starts from a lake some config built (reading no lake is not the point)."""
            self.build_config(name)

        @rule(name=st.sampled_from(sorted(CONFIGS)))
        def build_config(self, name: str) -> None:
            """Build config ``name``: the lake holds its definition of each of its names."""
            build(self.configs[name], scheduler=scheduler, progress=False)
            self.holder.update(CONFIGS[name][0])
            self.check_read(name)

        @rule(name=st.sampled_from(sorted(CONFIGS)))
        def read(self, name: str) -> None:
            self.check_read(name)

        @rule(name=st.sampled_from(sorted(CONFIGS)))
        def collect_garbage(self, name: str) -> None:
            """``lakeloader gc CONFIG``; then every config the oracle says is built still reads."""
            assert main(["gc", str(self.configs[name])]) == 0
            for other in sorted(CONFIGS):
                if not self.foreign(other):
                    self.check_read(other)

    return SharedLake


def test_configs_sharing_a_lake_read_their_own_definitions(
        tmp_path: Path, dask_scheduler: str, corpora: dict[str, tuple[Path, list[dict[str, Any]]]],
        capsys: pytest.CaptureFixture[str]) -> None:
    run_state_machine_as_test(identity_walks(tmp_path, corpora, dask_scheduler), settings=settings(
        max_examples=EXAMPLES, stateful_step_count=8, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]))
