"""The evaluation pass of a config's own ``evaluation`` section (issue 51 item 2): one pass over
each dataset listed, in order, every document exactly once, the same number of batches on every
process (the last padded and masked by ``example_mask``), rows labelled by ``dataset_ids``; a
dataset read only by the pass needs no mixture weight, and its packing is kept by the build."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from lakeloader.cli import main
from lakeloader.contracts.errors import ConfigError
from lakeloader.feed.loader import Loader
from lakeloader.ingest.driver import build

from conftest import assert_batches_equal, stdlib_texts, write_config, write_jsonl

SEQ_LEN = 32
EVAL_BATCH = 6


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory, dask_scheduler: str) -> Path:
    """Datasets a and b mixed for training; v (held out) and a evaluated, batch 6."""
    root = tmp_path_factory.mktemp("evaluation")
    for name, texts in {"a": stdlib_texts("json"), "b": stdlib_texts("zoneinfo"),
                        "v": [t[:3000] for t in stdlib_texts("email", limit=6)]}.items():
        write_jsonl(root / "data" / f"{name}.jsonl", texts)
    config = write_config(root, {n: {"sources": [str(root / "data" / f"{n}.jsonl")]} for n in "abv"},
                          build={"split_size": "8KB"}, mixture={"weights": {"a": 1.0, "b": 1.0}},
                          evaluation={"datasets": ["v", "a"], "batch_size": EVAL_BATCH},
                          loader={"seq_len": SEQ_LEN, "batch_size": 8, "packing": "pack", "prefetch": 0})
    build(config, scheduler=dask_scheduler, progress=False)
    return config


def _global(config: Path, processes: int) -> tuple[list[dict[str, Any]], list[list[Any]]]:
    """The eval pass's global batches from ``processes`` loaders, and each step's examples."""
    loaders = [Loader(config, mode="eval", process_index=p, process_count=processes) for p in range(processes)]
    counts = {loader.num_batches() for loader in loaders}
    assert len(counts) == 1, f"processes disagree on the pass's batches: {counts}"
    batches, examples = [], []
    for step in range(counts.pop() or 0):
        parts = [loader.batch(step) for loader in loaders]
        assert {len(p["input_ids"]) for p in parts} == {EVAL_BATCH // processes}
        batches.append({k: np.concatenate([p[k] for p in parts]) for k in parts[0]})
        examples.append([e for loader in loaders for e in loader.examples(step).examples])
    for loader in loaders:
        loader.close()
    return batches, examples


def test_the_pass_reads_each_listed_dataset_once_in_order(lake: Path) -> None:
    with Loader(lake) as training, Loader(lake, mode="eval") as evaluation:
        assert training.dataset_names == ("a", "b") and evaluation.dataset_names == ("v", "a")
        lengths = {s.name: s.reader.chunk_lengths(s.chunks) for s in evaluation.datasets}
    one, examples = _global(lake, 1)
    ids = np.concatenate([b["dataset_ids"] for b in one])
    mask = np.concatenate([b["example_mask"] for b in one])
    real = ids[ids >= 0]
    assert (np.diff(real) >= 0).all() and set(real.tolist()) == {0, 1}   # all of v, then all of a
    assert np.array_equal(mask, (ids >= 0).astype(np.float32)) and mask[-1] == 0 or mask.all()
    assert all(b["loss_mask"][b["example_mask"] == 0].sum() == 0 for b in one)   # padding rows train nothing
    covered: dict[tuple[str, int, int], list[tuple[int, int]]] = {}
    for row in (e for step in examples for e in step if e is not None):
        for item in row.items:
            covered.setdefault((row.dataset, item.chunk, item.doc), []).append((item.start, item.stop))
    for name in ("v", "a"):   # every document's rendered tokens exactly once
        for chunk, length in enumerate(lengths[name].tolist()):
            docs = sorted(d for n, c, d in covered if (n, c) == (name, chunk))
            assert docs == list(range(len(docs)))
            total = 0
            for doc in docs:
                pieces = sorted(covered[name, chunk, doc])
                assert pieces[0][0] == 0 and all(x[1] == y[0] for x, y in zip(pieces, pieces[1:]))
                total += pieces[-1][1]
            assert total == length, (name, chunk)


@pytest.mark.parametrize("processes", [2, 3])
def test_every_process_count_gives_the_same_pass(lake: Path, processes: int) -> None:
    one, _ = _global(lake, 1)
    many, _ = _global(lake, processes)
    assert_batches_equal(many, one, f"eval pass on {processes} processes")


def test_the_command_line_writes_the_pass(lake: Path, tmp_path: Path) -> None:
    with Loader(lake, mode="eval") as loader:
        total = loader.num_batches()
        expected = [loader.batch(step) for step in range(total or 0)]
    out = tmp_path / "eval.npz"
    assert main(["batches", str(lake), "--mode", "eval", "--steps", f"0:{total}", "--out", str(out), "--no-progress"]) == 0
    with np.load(out) as found:
        assert found["dataset_names"].tolist() == ["v", "a"]
        for name in ("input_ids", "example_mask", "dataset_ids"):
            np.testing.assert_array_equal(found[name], np.stack([b[name] for b in expected]))


def _with(config: Path, tmp_path: Path, **evaluation: Any) -> Path:
    raw = yaml.safe_load(config.read_text())
    raw["evaluation"] = evaluation
    path = tmp_path / "edited.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def test_an_evaluation_section_is_checked_with_its_key(lake: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"evaluation\.datasets\.1.*no dataset 'w'"):
        Loader(_with(lake, tmp_path, datasets=["v", "w"]))
    with pytest.raises(ConfigError, match=r"evaluation\.datasets.*more than once"):
        Loader(_with(lake, tmp_path, datasets=["v", "v"]))
    with pytest.raises(ConfigError, match=r"evaluation\.seq_len.*\['a'\] are both mixed and evaluated"):
        Loader(_with(lake, tmp_path, datasets=["v", "a"], seq_len=64))


def test_the_prompt_side_of_a_pass_cuts_each_document_where_generation_starts(tmp_path: Path,
                                                                              dask_scheduler: str) -> None:
    records = [{"prompt": f"Question {i}: what does {t.splitlines()[0][:40]!r} say?", "response": t[:300]}
               for i, t in enumerate(stdlib_texts("json") + stdlib_texts("email", limit=8))]
    path = tmp_path / "data" / "qa.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    datasets = {"qa": {"sources": [str(path)], "format": "supervised", "supervised": {"separator": "<|sep|>"}}}
    loader = {"seq_len": 256, "batch_size": 4, "packing": "pad", "pack": {"long_documents": "truncate"}}
    whole = write_config(tmp_path, datasets, loader=loader, evaluation={"datasets": ["qa"]})
    build(whole, scheduler=dask_scheduler, progress=False)
    raw = yaml.safe_load(whole.read_text())
    raw["evaluation"]["prompts"] = True
    prompts = tmp_path / "prompts.yaml"
    prompts.write_text(yaml.safe_dump(raw, sort_keys=False))
    with Loader(whole, mode="eval") as full, Loader(prompts, mode="eval") as cut:
        separator = full.tokenizer.token_to_id("<|sep|>")
        assert full.num_batches() == cut.num_batches()
        seen = 0
        for step in range(full.num_batches() or 0):
            a, b = full.batch(step), cut.batch(step)
            assert sorted(b) == ["dataset_ids", "example_mask", "input_ids", "prompt_lengths", "reference_lengths",
                                 "references"]
            for row in range(len(a["input_ids"])):
                n = int((a["segment_ids"][row] > 0).sum())
                p, r = int(b["prompt_lengths"][row]), int(b["reference_lengths"][row])
                if b["example_mask"][row] == 0:
                    assert p == r == 0 and n == 0
                    continue
                document = [*a["input_ids"][row][:n].tolist(), int(a["targets"][row][n - 1])]
                assert [*b["input_ids"][row][:p].tolist(), *b["references"][row][:r].tolist()] == document
                assert document[p - 1] == separator and p + r == n + 1   # generation starts after the separator
                trained = np.flatnonzero(a["loss_mask"][row][:n])
                assert trained[0] == p - 1   # the first target the full row trains is the reference's first token
                assert (b["input_ids"][row][p:] == cut.pad_id).all() and (b["references"][row][r:] == cut.pad_id).all()
                seen += 1
        assert seen == len(records)


def test_prompts_need_rows_of_one_document(lake: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"evaluation\.prompts.*needs loader\.packing: pad"):
        Loader(_with(lake, tmp_path, datasets=["v"], prompts=True), mode="eval")
