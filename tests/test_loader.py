"""The loader against naive references built from the chunk files with pyarrow.

Global and strided orderings, resume from any step or saved state, evaluation passes, corrupt or
missing chunks, `explain` provenance and process-count errors. Every comparison is bitwise (equal
values and equal dtypes).
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import json
import math
import os
import shutil
import threading
import time
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import yaml
from tokenizers import Tokenizer

from lakeloader.catalog.lake import open_lake
from lakeloader.cli import main
from lakeloader.contracts.errors import ChunkIntegrityError, LakeloaderError
from lakeloader.feed.loader import Loader, LoaderState
from lakeloader.ingest.driver import build

from conftest import DEMO_TOKENIZER, assert_batches_equal, stdlib_texts, write_config, write_jsonl, write_parquet

SEQ_LEN = 32
BATCH = 8
FIELDS = ("input_ids", "targets", "loss_mask", "segment_ids", "positions")
EOS_TOKEN = "<|endoftext|>"


# -- the lake -------------------------------------------------------------------------------------


def paragraphs(package: str) -> list[str]:
    """Short documents of real text: the blank-line separated paragraphs of a stdlib package."""
    return [p for text in stdlib_texts(package) for p in text.split("\n\n") if p.strip()]


def build_small_lake(root: Path, scheduler: str) -> Path:
    """A lake of two datasets; ``d`` has three shards (whole files, paragraphs, Parquet row groups),
    small splits (some of them empty) and small row groups, ``e`` is small. Returns ``root``."""
    data = root / "data"
    write_jsonl(data / "d" / "a.jsonl", stdlib_texts("json") + stdlib_texts("concurrent"))
    write_jsonl(data / "d" / "b.jsonl", paragraphs("wsgiref"))
    write_parquet(data / "d" / "c.parquet", stdlib_texts("tomllib") + paragraphs("wsgiref")[:40], row_group_size=5)
    write_jsonl(data / "e" / "z.jsonl", paragraphs("zoneinfo"))
    config = write_config(
        root,
        {"d": {"sources": [str(data / "d" / "*")]}, "e": {"sources": [str(data / "e" / "*.jsonl")]}},
        build={"split_size": "8KB", "row_group_tokens": 500},
    )
    report = build(config, scheduler=scheduler, progress=False)
    assert report.chunks_built == report.chunks_total > 30
    return root


def loader_config(root: Path, name: str, datasets: tuple[str, ...] = ("d",), *,
                  mixture: dict[str, Any] | None = None, lake: Path | None = None, out: Path | None = None,
                  **loader: Any) -> Path:
    """A config file ``name.yaml`` (in ``out``, default ``root``) reading ``datasets`` of the lake
    in ``root/lake`` (or ``lake``)."""
    base = yaml.safe_load((root / "config.yaml").read_text())
    config = {
        "lake": str(lake or root / "lake"), "tokenizer": base["tokenizer"],
        "datasets": {n: base["datasets"][n] for n in datasets}, "build": base["build"],
        "loader": {"seq_len": SEQ_LEN, "batch_size": BATCH, "shuffle": "none", **loader},
    }
    if len(datasets) > 1:
        config["mixture"] = mixture or {"weights": {"d": 0.75, "e": 0.25}}
    path = (out or root) / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory, dask_scheduler: str) -> Path:
    return build_small_lake(tmp_path_factory.mktemp("loader"), dask_scheduler)


# -- naive references (pyarrow + plain Python, independent of lakeloader's index code) -----------


@cache
def eos_id() -> int:
    found = Tokenizer.from_file(str(DEMO_TOKENIZER)).token_to_id(EOS_TOKEN)
    assert found is not None
    return found


def chunk_table(root: Path, dataset: str) -> pd.DataFrame:
    """path, shard_index and split_index of every chunk of ``dataset`` in global order."""
    return open_lake(root / "config.yaml").sql(
        "SELECT global_index, path, shard_index, split_index FROM chunks "
        "WHERE dataset = ? AND status = 'committed' ORDER BY global_index", [dataset])


def chunk_documents(root: Path, dataset: str) -> list[list[list[int]]]:
    """Each chunk's documents (token lists), read directly with pyarrow, in global chunk order."""
    lake = open_lake(root / "config.yaml")
    return [pq.read_table(lake.path_of(p)).column("tokens").to_pylist() for p in chunk_table(root, dataset).path]


@dataclasses.dataclass
class Stream:
    """A token stream: documents each followed by EOS, with the document occurrence and chunk of
    every token."""

    tokens: list[int] = dataclasses.field(default_factory=list)
    docs: list[tuple[int, int]] = dataclasses.field(default_factory=list)   # (occurrence, doc)
    chunks: list[int] = dataclasses.field(default_factory=list)

    def add_chunk(self, occurrence: int, chunk: int, documents: list[list[int]]) -> None:
        for d, doc in enumerate(documents):
            for token in [*doc, eos_id()]:
                self.tokens.append(token)
                self.docs.append((occurrence, d))
                self.chunks.append(chunk)


def global_stream(documents: list[list[list[int]]]) -> Stream:
    stream = Stream()
    for c, docs in enumerate(documents):
        stream.add_chunk(c, c, docs)
    return stream


def naive_row(stream: Stream, start: int, length: int = SEQ_LEN, dataset_id: int = 0) -> dict[str, np.ndarray]:
    """One batch row from stream tokens [start, start+length] (clipped at the stream's end; the
    rest is padding with EOS and zero masks) of the mixture's dataset ``dataset_id``."""
    window = stream.tokens[start:start + length + 1]
    docs = stream.docs[start:start + length + 1]
    n = len(window) - 1
    row = {
        "input_ids": np.full(length, eos_id(), np.int32), "targets": np.full(length, eos_id(), np.int32),
        "loss_mask": np.zeros(length, np.float32), "segment_ids": np.zeros(length, np.int32),
        "positions": np.zeros(length, np.int32), "dataset_ids": np.int32(dataset_id),
    }
    segment = position = 0
    for t in range(n):
        row["input_ids"][t] = window[t]
        row["targets"][t] = window[t + 1]
        row["loss_mask"][t] = 1.0
        if t == 0 or docs[t] != docs[t - 1]:
            segment, position = segment + 1, 0
        else:
            position += 1
        row["segment_ids"][t] = segment
        row["positions"][t] = position
    return row


def stack(rows: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {name: np.stack([r[name] for r in rows]) for name in rows[0]}


def global_batch(loaders: list[Loader], step: int) -> dict[str, np.ndarray]:
    """Global batch ``step`` assembled from the row blocks of every process, in process order."""
    parts = [loader.batch(step) for loader in loaders]
    return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}


def processes(config: Path, count: int, **kwargs: Any) -> list[Loader]:
    return [Loader(config, process_index=p, process_count=count, **kwargs) for p in range(count)]


# -- global ordering ----------------------------------------------------------------------------


def test_global_ordering_equals_naive_reference(lake: Path) -> None:
    stream = global_stream(chunk_documents(lake, "d"))
    per_epoch = (len(stream.tokens) - 1) // SEQ_LEN
    steps = per_epoch // BATCH
    assert steps > 100
    loader = Loader(loader_config(lake, "global"))
    assert loader.num_batches() is None  # training is infinite with stop: restart
    multi_segment = 0
    for step in range(steps):
        rows = [naive_row(stream, (step * BATCH + g) * SEQ_LEN) for g in range(BATCH)]
        expected = stack(rows)
        multi_segment += int((expected["segment_ids"].max(axis=1) > 1).sum())
        assert_batches_equal(loader.batch(step), expected, f"step {step}")
    assert multi_segment > 100  # the reference exercises document boundaries inside windows
    # targets are the inputs shifted by one within every window
    batch = loader.batch(1)
    assert np.array_equal(batch["targets"][:, :-1], batch["input_ids"][:, 1:])


def test_global_training_cycles_whole_epochs(lake: Path) -> None:
    """Training cycles the stream epoch by epoch: example j is example j % E of the epoch (E whole
    examples; the tail of the stream that does not fill an example is dropped, nothing shuffles)."""
    stream = global_stream(chunk_documents(lake, "d"))
    per_epoch = (len(stream.tokens) - 1) // SEQ_LEN
    loader = Loader(loader_config(lake, "global"))
    first_crossing = per_epoch // BATCH  # the batch holding the last examples of epoch 0
    for step in (first_crossing, first_crossing + 1, 10**7):
        rows = [naive_row(stream, ((step * BATCH + g) % per_epoch) * SEQ_LEN) for g in range(BATCH)]
        assert_batches_equal(loader.batch(step), stack(rows), f"step {step}")


# -- strided ordering ---------------------------------------------------------------------------

IDEAL = 4


def strided_reference(documents: list[list[list[int]]], examples: int) -> tuple[list[Stream], int]:
    """chunk_iterators[r] = loop(chunks)[r::R*] with each iterator's stream long enough for
    ``examples`` global examples; also the largest looped chunk position used."""
    n = len(documents)
    per_iterator = examples // IDEAL + 1
    streams = []
    last_position = 0
    for r in range(IDEAL):
        stream = Stream()
        position = r
        while len(stream.tokens) < per_iterator * SEQ_LEN + 1:
            stream.add_chunk(position, position % n, documents[position % n])
            last_position = max(last_position, position)
            position += IDEAL
        streams.append(stream)
    return streams, last_position


def strided_example(streams: list[Stream], i: int) -> dict[str, np.ndarray]:
    """example[i] = chunk_examples[i % R*][i // R*]."""
    return naive_row(streams[i % IDEAL], (i // IDEAL) * SEQ_LEN)


@pytest.mark.parametrize("process_count", [1, 2, 4, 8])
def test_strided_ordering_equals_formula_and_reads_only_own_chunks(lake: Path, process_count: int) -> None:
    documents = chunk_documents(lake, "d")
    paths = list(chunk_table(lake, "d").path)
    n = len(documents)
    # Enough steps that every iterator loops past the end of the chunk list.
    first_pass = max(
        sum(len(doc) + 1 for c in range(r, n, IDEAL) for doc in documents[c]) for r in range(IDEAL))
    assert first_pass
    steps = (first_pass // SEQ_LEN + 3) * IDEAL // BATCH + 2
    streams, _ = strided_reference(documents, steps * BATCH)
    config = loader_config(lake, "strided", ordering="strided", ideal_readers=IDEAL)
    loaders = processes(config, process_count)
    rows = BATCH // process_count
    for step in range(steps):
        expected = stack([strided_example(streams, step * BATCH + g) for g in range(BATCH)])
        assert_batches_equal(global_batch(loaders, step), expected, f"P={process_count} step {step}")

    # Chunk locality: a process opens only chunks of the iterators its rows map to.
    for p, loader in enumerate(loaders):
        examples = [b * BATCH + g for b in range(steps) for g in range(p * rows, (p + 1) * rows)]
        iterators = {i % IDEAL for i in examples}
        needed_tokens = {(i % IDEAL, t) for i in examples
                         for t in range((i // IDEAL) * SEQ_LEN, (i // IDEAL + 1) * SEQ_LEN + 1)}
        touched = {paths[streams[r].chunks[t]] for r, t in needed_tokens}
        last = max(streams[r].docs[t][0] for r, t in needed_tokens)  # largest looped position read
        own = {paths[q % n] for r in iterators for q in range(r, last + 1, IDEAL)}
        opened = loader.files.files_opened
        assert touched <= opened <= own, f"process {p} of {process_count}: opened {sorted(opened - own)}"
        if process_count >= 4:
            assert len(iterators) < IDEAL and opened != set(paths)


def test_strided_while_iterators_uneven(lake: Path) -> None:
    """R* that does not divide the chunk count: iterators loop over different chunk sets."""
    documents = chunk_documents(lake, "d")
    ideal = 5 if len(documents) % 5 else 7
    assert len(documents) % ideal
    config = loader_config(lake, "strided5", ordering="strided", ideal_readers=ideal)
    loader = Loader(config)
    n = len(documents)
    streams = []
    for r in range(ideal):
        stream = Stream()
        for position in range(r, 2 * n + ideal, ideal):
            stream.add_chunk(position, position % n, documents[position % n])
        streams.append(stream)
    shortest = min(len(s.tokens) for s in streams) // SEQ_LEN - 1
    for step in itertools.chain(range(4), range(shortest * ideal // BATCH - 3, shortest * ideal // BATCH)):
        rows = [naive_row(streams[i % ideal], (i // ideal) * SEQ_LEN)
                for i in range(step * BATCH, (step + 1) * BATCH)]
        assert_batches_equal(loader.batch(step), stack(rows), f"R*={ideal} step {step}")


# -- resume ---------------------------------------------------------------------------------------

RESUME_STEPS = 12


@pytest.mark.parametrize("prefetch", [0, 3])
@pytest.mark.parametrize("datasets", [("d",), ("d", "e")], ids=["single", "mixture"])
def test_resume_yields_exact_suffix(lake: Path, prefetch: int, datasets: tuple[str, ...]) -> None:
    config = loader_config(lake, f"resume{prefetch}{len(datasets)}", datasets, prefetch=prefetch)
    run = Loader(config)
    uninterrupted = list(itertools.islice(run.iter_from(0), RESUME_STEPS + 1))
    for step, batch in enumerate(uninterrupted):
        assert_batches_equal(batch, run.batch(step), f"iter_from(0) step {step}")
    restarted = Loader(config)  # a fresh process after a crash
    assert restarted.fingerprint == run.fingerprint
    for step in range(RESUME_STEPS + 1):
        saved = run.state(step)
        assert saved == LoaderState(step, run.fingerprint, run.definition, run.run).to_dict()
        checkpoint = json.loads(json.dumps(saved))
        assert checkpoint == saved and (checkpoint["step"], checkpoint["fingerprint"]) == (step, run.fingerprint)
        legacy = {"step": step, "fingerprint": run.fingerprint}   # as saved before states held the run
        for start in (step, saved, checkpoint, LoaderState.from_dict(checkpoint), legacy):
            resumed = list(itertools.islice(restarted.iter_from(start), RESUME_STEPS + 1 - step))
            assert len(resumed) == RESUME_STEPS + 1 - step
            for k, batch in enumerate(resumed):
                assert_batches_equal(batch, uninterrupted[step + k], f"resume at {start!r}, batch {k}")
    # Seeking far ahead is index arithmetic: the same batch as computing it directly.
    far = 10**7
    [first] = itertools.islice(restarted.iter_from(run.state(far)), 1)
    assert_batches_equal(first, run.batch(far), "step 10^7")


def test_read_ahead_builds_in_order_in_one_thread(lake: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """From a local lake, ``loader.prefetch: N`` builds the N batches after the one the consumer
    takes, one after another in one background thread (batches built side by side only contend
    for the GIL), and no more; they are the batches :meth:`Loader.batch` gives."""
    config = loader_config(lake, "read_ahead3", ("d", "e"), prefetch=3)
    loader = Loader(config)
    built: list[tuple[int, str]] = []
    original = Loader.batch

    def recording(self: Loader, step: int) -> Any:
        built.append((step, threading.current_thread().name))
        return original(self, step)

    monkeypatch.setattr(Loader, "batch", recording)
    start = 5
    iterator = loader.iter_from(start)
    for step in range(start, start + 10):
        batch = next(iterator)
        assert_batches_equal(batch, original(loader, step), f"read-ahead step {step}")
        if step == start:   # the consumer waits: the thread builds the next 3 batches, then stops
            deadline = time.monotonic() + 60
            while len(built) < 4 and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.5)
            assert [s for s, _ in built] == [5, 6, 7, 8], built
    iterator.close()
    steps = [step for step, _ in built]
    assert steps == list(range(start, start + len(steps))), steps   # in order, each once
    assert len({name for _, name in built}) == 1 and built[0][1].startswith("lakeloader-prefetch"), built


@pytest.mark.parametrize("prefetch", [0, 2])
def test_resume_eval_pass(lake: Path, prefetch: int) -> None:
    config = loader_config(lake, f"resume_eval{prefetch}", ("d", "e"), prefetch=prefetch)
    run = Loader(config, mode="eval")
    everything = list(run.iter_from(0))
    assert len(everything) == run.num_batches()
    restarted = Loader(config, mode="eval")
    for step in range(0, len(everything) + 1, 7):
        resumed = list(restarted.iter_from(json.loads(json.dumps(run.state(step)))))
        assert len(resumed) == len(everything) - step
        for k, batch in enumerate(resumed):
            assert_batches_equal(batch, everything[step + k], f"eval resume at {step}")


def test_state_of_other_config_is_a_clear_error(lake: Path) -> None:
    loader = Loader(loader_config(lake, "fp_a"))
    other = Loader(loader_config(lake, "fp_b", seq_len=SEQ_LEN * 2))
    assert other.fingerprint != loader.fingerprint
    for state in (other.state(5), LoaderState.from_dict(other.state(5))):
        for continue_changes in (False, True):   # a changed seq_len is never continued
            with pytest.raises(LakeloaderError) as error:
                next(loader.iter_from(state, continue_changes=continue_changes))
            assert "cannot be continued" in str(error.value)
            assert f"loader.seq_len: {SEQ_LEN * 2} -> {SEQ_LEN}" in str(error.value)
    legacy = {"step": 5, "fingerprint": other.fingerprint}   # a state saved before states said what changed
    with pytest.raises(LakeloaderError) as error:
        next(loader.iter_from(legacy))
    assert other.fingerprint in str(error.value) and loader.fingerprint in str(error.value)
    evaluation = Loader(loader_config(lake, "fp_a"), mode="eval")
    with pytest.raises(LakeloaderError, match="mode: eval -> train"):
        next(loader.iter_from(evaluation.state(0)))


# -- evaluation -----------------------------------------------------------------------------------


def eval_reference(streams: list[Stream], batch_size: int) -> tuple[list[dict[str, np.ndarray]], int]:
    """Global eval batches: each dataset's examples [jL, jL+L] clipped, datasets in config order,
    then padding rows (EOS, zero masks, example_mask 0, dataset_ids -1) up to a whole batch."""
    rows = []
    for number, stream in enumerate(streams):
        for j in range(math.ceil((len(stream.tokens) - 1) / SEQ_LEN)):
            rows.append({**naive_row(stream, j * SEQ_LEN, dataset_id=number), "example_mask": np.float32(1.0)})
    examples = len(rows)
    padding = {**naive_row(Stream(), 0, dataset_id=-1), "example_mask": np.float32(0.0)}
    rows += [padding] * (-len(rows) % batch_size)
    batches = [stack(rows[b:b + batch_size]) for b in range(0, len(rows), batch_size)]
    return batches, examples


@pytest.mark.parametrize("batch_size", [8, 12])
def test_eval_pass_every_target_once_with_equal_batches(lake: Path, batch_size: int) -> None:
    names = ("d", "e")
    streams = [global_stream(chunk_documents(lake, name)) for name in names]
    expected, examples = eval_reference(streams, batch_size)
    assert examples % batch_size, "choose sizes whose example count does not divide evenly"
    config = loader_config(lake, f"eval{batch_size}", names, batch_size=batch_size)
    for count in [p for p in (1, 2, 3, 4, 6, 8) if batch_size % p == 0]:
        loaders = processes(config, count, mode="eval")
        assert {loader.num_batches() for loader in loaders} == {len(expected)}
        targets, inputs = [], []
        for step, reference in enumerate(expected):
            parts = [loader.batch(step) for loader in loaders]
            assert len({tuple((k, v.shape) for k, v in part.items()) for part in parts}) == 1
            batch = {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
            assert_batches_equal(batch, reference, f"eval P={count} step {step}")
            mask = batch["loss_mask"] == 1
            targets.append(batch["targets"][mask])
            inputs.append(batch["input_ids"][mask])
        for loader in loaders:
            with pytest.raises(IndexError):
                loader.batch(len(expected))
            assert len(list(loader.iter_from(0))) == len(expected)
        # Every stream token is a target exactly once (all but each stream's first token, which
        # only ever is an input), in order.
        assert np.array_equal(np.concatenate(targets), np.concatenate([s.tokens[1:] for s in streams]))
        assert np.array_equal(np.concatenate(inputs), np.concatenate([s.tokens[:-1] for s in streams]))
    last = expected[-1]
    assert (last["example_mask"] == 0).any() and (last["loss_mask"][last["example_mask"] == 0] == 0).all()
    assert any((b["loss_mask"][b["example_mask"] == 1] == 0).any() for b in expected)  # a clipped example


# -- integrity --------------------------------------------------------------------------------------


def damaged_lake(lake: Path, tmp_path: Path, **loader: Any) -> tuple[Path, Path, int, str]:
    """A copy of the lake in ``tmp_path``: (its config, its folder, a step that needs chunk c, the
    lake-relative path of chunk c), for a non-empty chunk c in the middle of dataset ``d``."""
    copy = tmp_path / "lake"
    shutil.copytree(lake / "lake", copy)
    documents = chunk_documents(lake, "d")
    chunk = len(documents) // 2
    while not documents[chunk]:
        chunk += 1
    start = sum(len(doc) + 1 for docs in documents[:chunk] for doc in docs)  # chunk c's first token
    step = (start // SEQ_LEN) // BATCH
    assert step > 1
    config = loader_config(lake, "damaged", lake=copy, out=tmp_path, **loader)
    return config, copy, step, chunk_table(lake, "d").path[chunk]


def needs_chunk(config: Path, step: int, path: str) -> bool:
    return path in {r.chunk_path for r in Loader(config).explain(step).itertuples()}


def test_corrupt_chunk_is_an_error_naming_it(lake: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config, copy, step, path = damaged_lake(lake, tmp_path)
    assert needs_chunk(config, step, path) and not needs_chunk(config, 0, path)
    data = bytearray((copy / path).read_bytes())
    middle = len(data) // 2
    data[middle - 8:middle + 8] = bytes(b ^ 0xFF for b in data[middle - 8:middle + 8])
    (copy / path).write_bytes(bytes(data))
    loader = Loader(config)
    assert loader.batch(0)["input_ids"].shape == (BATCH, SEQ_LEN)  # other chunks still read
    with pytest.raises(ChunkIntegrityError, match=path) as error:
        loader.batch(step)
    assert "corrupt" in str(error.value)  # caught by the checksum, before any decoding
    with pytest.raises(ChunkIntegrityError, match=path):  # also through the prefetching iterator
        list(itertools.islice(Loader(config).iter_from(step - 1), 3))
    out = tmp_path / "b.npz"
    assert main(["batches", str(config), "--steps", f"{step}:{step + 1}", "--out", str(out)]) == 2
    assert path in capsys.readouterr().err and not out.exists()


def test_missing_chunk_is_an_error_naming_it(lake: Path, tmp_path: Path) -> None:
    config, copy, step, path = damaged_lake(lake, tmp_path)
    os.remove(copy / path)
    loader = Loader(config)
    loader.batch(0)
    with pytest.raises(ChunkIntegrityError, match=path) as error:
        loader.batch(step)
    assert "missing" in str(error.value)


def test_verify_size_detects_truncated_chunk(lake: Path, tmp_path: Path) -> None:
    config, copy, step, path = damaged_lake(lake, tmp_path, verify="size")
    size = (copy / path).stat().st_size
    with open(copy / path, "r+b") as handle:
        handle.truncate(size - 100)
    loader = Loader(config)
    loader.batch(0)
    with pytest.raises(ChunkIntegrityError, match=path) as error:
        loader.batch(step)
    assert str(size) in str(error.value)


# -- explain ----------------------------------------------------------------------------------------


def is_sublist(part: list[int], whole: list[int]) -> bool:
    n = len(part)
    return any(whole[i:i + n] == part for i in range(len(whole) - n + 1))


def source_document(source: str, location: str) -> str:
    """The text of the document at ``location`` ('line N', 1-based, or 'row N', 0-based) of a source."""
    unit, number = location.split()
    if unit == "row":
        return pq.read_table(source).column("text")[int(number)].as_py()
    assert unit == "line", location
    with open(source, encoding="utf-8") as handle:
        line = next(itertools.islice(handle, int(number) - 1, None))
    return json.loads(line)["text"]


def check_explained_step(config: Path, step: int, capsys: pytest.CaptureFixture[str]) -> pd.DataFrame:
    assert main(["explain", str(config), "--step", str(step), "--format", "csv"]) == 0
    frame = pd.read_csv(io.StringIO(capsys.readouterr().out))
    batch = Loader(config).batch(step)
    tokenizer = Tokenizer.from_file(str(DEMO_TOKENIZER))
    assert sorted(set(frame.row)) == list(range(BATCH))
    for row, segments in frame.groupby("row"):
        assert list(segments.segment) == list(range(1, len(segments) + 1))
        assert segments.example_start.iloc[0] == 0 and segments.example_stop.iloc[-1] == SEQ_LEN + 1
        window = [*batch["input_ids"][row].tolist(), int(batch["targets"][row][-1])]
        for entry in segments.itertuples():
            assert entry.dataset in ("d", "e") and not pd.isna(entry.chunk) and not pd.isna(entry.shard)
            text = source_document(entry.source, entry.location)
            document = [*tokenizer.encode(text, add_special_tokens=False).ids, eos_id()]
            tokens = window[entry.example_start:entry.example_stop]
            if entry.segment == 1:
                assert is_sublist(tokens, document), (row, entry)
            else:  # later segments start at their document's first token
                assert tokens == document[:len(tokens)], (row, entry)
            if entry.example_start < SEQ_LEN:
                ids = batch["segment_ids"][row][entry.example_start:min(entry.example_stop, SEQ_LEN)]
                assert (ids == entry.segment).all()
    return frame


def test_explain_names_source_line_of_every_row(lake: Path, capsys: pytest.CaptureFixture[str]) -> None:
    single = loader_config(lake, "explain_d")
    frame = check_explained_step(single, 5, capsys)
    assert set(frame.dataset) == {"d"} and (frame.epoch == 0).all()
    assert frame.location.str.startswith("line").any()
    # Later splits of a JSON Lines shard (lines counted from the file's start) and Parquet rows.
    table = chunk_table(lake, "d")
    documents = chunk_documents(lake, "d")
    for shard, unit in ((1, "line"), (2, "row")):
        chunk = next(c for c in range(len(documents))
                     if table.shard_index[c] == shard and table.split_index[c] >= 2 and documents[c])
        start = sum(len(doc) + 1 for docs in documents[:chunk] for doc in docs)  # its first token
        frame = check_explained_step(single, start // SEQ_LEN // BATCH, capsys)
        read = frame[frame.chunk == chunk]
        assert len(read) and read.location.str.startswith(unit).all()
        assert read.chunk_path.iloc[0] == table.path[chunk] and (read.shard == shard).all()
        assert read.source.str.endswith(("b.jsonl", "c.parquet")[shard - 1]).all()

    mixture = loader_config(lake, "explain_mix", ("d", "e"))
    per_epoch = (sum(len(doc) + 1 for docs in documents for doc in docs) - 1) // SEQ_LEN
    later = 2 * per_epoch // BATCH + 3   # d has 3/4 of every batch: past its first epoch
    frame = check_explained_step(mixture, later, capsys)
    assert set(frame.dataset) == {"d", "e"}
    assert (frame.epoch > 0).all()

    assert main(["explain", str(mixture), "--step", "1"]) == 0
    out = capsys.readouterr().out
    for column in ("dataset", "shard", "chunk", "source", "location", "epoch"):
        assert column in out


# -- process counts -------------------------------------------------------------------------------


def test_batch_size_not_divisible_by_process_count(lake: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    config = loader_config(lake, "indivisible")
    with pytest.raises(LakeloaderError, match="batch_size") as error:
        Loader(config, process_index=0, process_count=3)
    assert "3" in str(error.value) and str(BATCH) in str(error.value)
    with pytest.raises(LakeloaderError, match="process_index"):
        Loader(config, process_index=4, process_count=4)
    out = tmp_path / "never.npz"
    assert main(["batches", str(config), "--steps", "0:2", "--process-count", "3", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "batch_size" in err and "Traceback" not in err and not out.exists()


def test_a_full_shuffle_beyond_the_cache_is_warned_about(lake: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A full shuffle over much more than ``loader.cache_bytes`` decodes a whole row group per
    example: iterating warns, naming the keys to change; a cache that holds the lake, or a block
    shuffle, says nothing."""
    stored = sum(int(n) * 2 for n in open_lake(loader_config(lake, "size")).sql(
        "SELECT num_tokens FROM chunks WHERE dataset = 'd'").num_tokens)
    cases = {"small-full": ({"kind": "full"}, stored // 4, True),
             "large-full": ({"kind": "full"}, stored * 4, False),
             "small-block": ({"kind": "block", "block_size": 4, "window_blocks": 2}, stored // 4, False)}
    for name, (shuffle, cache_bytes, warned) in cases.items():
        caplog.clear()
        with caplog.at_level("WARNING", logger="lakeloader.feed.loader"), \
                Loader(loader_config(lake, name, shuffle=shuffle, cache_bytes=cache_bytes)) as loader:
            next(loader.iter_from(0))
        said = [r.getMessage() for r in caplog.records if "loader.cache_bytes" in r.getMessage()]
        assert bool(said) == warned, (name, said)
        if warned:
            assert "loader.shuffle.kind block or window" in said[0] and "build.row_group_tokens" in said[0]
