"""The batch hot path's array forms, each against its straightforward form: packed examples
located together fill rows from the located arrays (no ``Item`` per document) exactly as from
their ``Item`` lists, in a mixture of located sets and in any row order; concat windows of one
located set exactly as through the general path; the index helpers equal their loops on random
inputs; the array pool's arrays start at different offsets within a page (copying between two
of them shifted by a few bytes otherwise stalls on 4K aliasing)."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lakeloader.feed.spans import Span, fill_spans
from lakeloader.feed.loader import LOCATE_AHEAD, Loader
from lakeloader.feed.locate_packed import PackedLocator
from lakeloader.feed.packed import Item, LazyItems, PackedExample, fill_packed
from lakeloader.feed.rows import ROW_FIELDS, ArrayPool, row_of
from lakeloader.index.chunk_packing import ITEM_FIELDS
from lakeloader.index.ranges import run_indices
from lakeloader.read.lru import LRU
from lakeloader.read.table_arena import TableArena
from lakeloader.read.spans import SpanReader

from test_formats import build_packed_mixture

SEQ_LEN, BATCH = 64, 16
FIXTURE_ONLY = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory, dask_scheduler: str) -> Path:
    """Plain text, chat (some tokens not targets) and FIM code, several chunks and row groups
    each, packed (long documents split) and mixed."""
    return build_packed_mixture(tmp_path_factory.mktemp("fill-hot-path"), ("web", "chat", "code"), split_size="8KB",
                                seq_len=SEQ_LEN, batch_size=BATCH, scheduler=dask_scheduler)


def _variant(lake: Path, name: str, datasets: list[str] | None = None, **loader: object) -> Path:
    """The lake's config with other loader settings (and only ``datasets``), beside it."""
    config = yaml.safe_load(lake.read_text())
    config["loader"].update(loader)
    if datasets is not None:
        config["datasets"] = {k: v for k, v in config["datasets"].items() if k in datasets}
        config["mixture"]["weights"] = {k: 1 for k in datasets}
    path = lake.parent / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _blank(batch: dict[str, np.ndarray], rows: int, pad_id: int) -> dict[str, np.ndarray]:
    fill = {"input_ids": pad_id, "targets": pad_id}
    return {name: np.full((rows, SEQ_LEN), fill.get(name, 0), batch[name].dtype) for name in ROW_FIELDS}


@pytest.mark.parametrize("shuffle", ["none", "full"])
@FIXTURE_ONLY
@given(data=st.data())
def test_located_packed_examples_fill_as_their_item_lists(lake: Path, shuffle: str, data: st.DataObject) -> None:
    config = _variant(lake, f"pack-{shuffle}", shuffle={"kind": shuffle})
    step = data.draw(st.integers(0, 40), label="step")
    with Loader(config) as loader:
        batch = loader.batch(step)
        examples = loader.examples(step).examples
        assert all(isinstance(e, PackedExample) and isinstance(e.items, LazyItems) for e in examples)
        assert len({id(e.items.located) for e in examples}) > 1, "a mixture: several located sets"  # type: ignore[union-attr]
        # The straightforward path: every example's Item list.
        listed = [PackedExample(e.dataset, e.epoch, e.example, list(e.items), e.pad_id) for e in examples]  # type: ignore[union-attr]
        alone = _blank(batch, BATCH, loader.pad_id)
        fill_packed(alone, list(range(BATCH)), listed)
        for name in ROW_FIELDS:
            assert np.array_equal(alone[name], batch[name]), (step, name)
        # Located examples in any row order, some given as Item lists: the same rows.
        order = data.draw(st.permutations(range(BATCH)), label="order")
        as_list = data.draw(st.sets(st.integers(0, BATCH - 1)), label="as_list")
        mixed = [listed[i] if i in as_list else examples[i] for i in order]
        scattered = _blank(batch, BATCH, loader.pad_id)
        fill_packed(scattered, list(order), mixed)  # type: ignore[arg-type]
        for name in ROW_FIELDS:
            assert np.array_equal(scattered[name], batch[name]), (step, name, "scattered")
        # Item tables held for a chunk at a time (each dataset's arena starts again for nearly
        # every batch, copying out the tables it still holds): the same rows, here and a step on.
        following = loader.batch(step + 1)
        for dataset in loader.datasets:
            dataset._items = TableArena(len(ITEM_FIELDS), 1, first_columns=1)  # type: ignore[attr-defined]
        for at, expected in ((step, batch), (step + 1, following), (step, batch)):
            again = loader.examples(at).examples
            held = _blank(batch, BATCH, loader.pad_id)
            fill_packed(held, list(range(BATCH)), again)  # type: ignore[arg-type]
            for name in ROW_FIELDS:
                assert np.array_equal(held[name], expected[name]), (at, name, "small arena")
        assert (batch["loss_mask"][batch["segment_ids"] > 0] == 0).any(), "some tokens should not be targets"


@pytest.mark.parametrize("shuffle", ["none", "full"])
@pytest.mark.parametrize("dataset", ["web", "chat"])
def test_packed_steps_located_together_fill_as_each_example_alone(lake: Path, dataset: str, shuffle: str) -> None:
    """One dataset's packed training steps asked in order are located several at once (their
    items and row layout up front, each step's rows cut from them; items that continue each
    other where they lie and where they go written as one piece): every batch equals its
    examples each filling its own padded row. Small batches: the steps located together lie in
    several row groups, most steps' in one or two of them."""
    rows = 4
    config = _variant(lake, f"steps-{dataset}-{shuffle}", [dataset], shuffle={"kind": shuffle}, batch_size=rows)
    blocks = joined = 0
    with Loader(config) as loader:
        for step in range(3 * LOCATE_AHEAD):
            batch = loader.batch(step)
            assert loader._located is not None
            blocks += loader._located.steps == LOCATE_AHEAD
            examples = loader.examples(step).examples
            joined += bool(examples[0].items.located.joined.any())  # type: ignore[union-attr]
            alone = _blank(batch, rows, loader.pad_id)
            for number, example in enumerate(examples):
                example.fill(row_of(alone, number))   # type: ignore[union-attr]
            for name in ROW_FIELDS:
                assert np.array_equal(alone[name], batch[name]), (step, name)
    assert blocks >= 2 * LOCATE_AHEAD, "steps asked in order should be located several at once"
    assert joined or shuffle == "full", "read in order, a long document's rows should be one piece"


@pytest.mark.parametrize("shuffle", ["none", "full"])
@pytest.mark.parametrize("packing", ["concat", "pack"])
def test_steps_located_together_equal_each_step_sought(lake: Path, packing: str, shuffle: str) -> None:
    """The batches of steps asked in order (located several at once, from wherever the first
    one was asked) equal those of the same steps asked in any order (each a seek, located
    alone), bitwise; a mixture's steps too (their rows assigned together, each dataset's
    examples located per step)."""
    for datasets in (["chat"], None):
        config = _variant(lake, f"sought-{packing}-{shuffle}-{datasets}", datasets, packing=packing,
                          shuffle={"kind": shuffle}, batch_size=4)
        steps = 3 * LOCATE_AHEAD
        with Loader(config) as loader:
            in_order = [{name: values.copy() for name, values in loader.batch(step).items()} for step in range(steps)]
        with Loader(config) as loader:
            for step in [5, *range(6, steps), *np.random.default_rng(7).permutation(steps).tolist()]:
                batch = loader.batch(step)
                assert batch.keys() == in_order[step].keys()
                for name in batch:
                    assert np.array_equal(batch[name], in_order[step][name]), (datasets, step, name)


def _items_one_by_one(locator: PackedLocator, k: int) -> list[Item]:
    """Example ``k``'s items the straightforward way: its chunk's plan, item by item."""
    offsets = locator.example_offsets()
    chunk = int(np.searchsorted(offsets, k, side="right")) - 1
    plan = locator.plan(chunk)
    _, first_docs = locator.reader.tables.of(locator.growing.chunks, chunk)
    found = []
    items = plan.example_items(k - int(offsets[chunk]))
    for i in range(items.start, items.stop):
        doc = int(plan.item_doc[i])
        group = int(np.searchsorted(first_docs, doc, side="right")) - 1
        found.append(locator._item(chunk, group, doc - int(first_docs[group]), doc, int(plan.item_start[i]),
                                   int(plan.item_stop[i])))
    return found


def test_located_items_are_each_examples_items_from_its_plan(lake: Path) -> None:
    """Provenance: the lazily made items of located examples (the batch path) equal the items
    read one by one from each example's chunk plan and row group."""
    with Loader(lake) as loader:
        for dataset in loader.datasets:
            assert isinstance(dataset.locator, PackedLocator)
            js = np.arange(0, 5 * BATCH, 3)
            epochs, ks = dataset.order.train_examples(js)
            together = dataset.train(js)
            for example, epoch, k in zip(together, epochs.tolist(), ks.tolist()):
                assert (example.epoch, example.example) == (epoch, k)
                alone = _items_one_by_one(dataset.locator, k)
                assert len(example.items) == len(alone) > 0   # type: ignore[attr-defined]
                for a, b in zip(example.items, alone):   # type: ignore[attr-defined]
                    assert (a.chunk, a.doc, a.start, a.stop, a.split, a.images) == \
                        (b.chunk, b.doc, b.start, b.stop, b.split, b.images)
                    assert np.array_equal(a.tokens, b.tokens) and a.tokens.dtype == b.tokens.dtype
                    assert (a.trainable is None) == (b.trainable is None)
                    assert a.trainable is None or np.array_equal(a.trainable, b.trainable)
                assert example.segments() == PackedExample(example.dataset, epoch, k, alone).segments()


@pytest.mark.parametrize("shuffle", ["none", "full"])
def test_windows_of_one_located_set_fill_as_the_general_path(lake: Path, shuffle: str) -> None:
    """Concat training windows all located by one set take the direct path (consecutive windows
    in one row group: one run of its tokens); the same windows given by their pieces (the
    general path) fill the same rows."""
    config = _variant(lake, f"concat-{shuffle}", ["chat"], packing="concat", shuffle={"kind": shuffle})
    direct = consecutive = 0
    with Loader(config) as loader:
        for step in range(24):
            batch = loader.batch(step)
            windows = loader.examples(step).examples
            one = windows[0].located   # type: ignore[union-attr]
            direct += all(w.located is one and int(one.group[w.index]) >= 0 for w in windows)  # type: ignore[union-attr]
            which = [w.index for w in windows]   # type: ignore[union-attr]
            consecutive += len(set(one.group[which].tolist())) == 1 and bool((np.diff(one.at[which]) == SEQ_LEN).all())
            pieces = [Span(w.dataset, w.epoch, w.example, list(w.pieces)) for w in windows]  # type: ignore[union-attr]
            general = _blank(batch, BATCH, loader.pad_id)
            fill_spans(general, list(range(BATCH)), pieces)
            for name in ROW_FIELDS:
                assert np.array_equal(general[name], batch[name]), (step, name)
    assert direct >= 3, "some batches should take the direct path"
    assert (consecutive >= 3) == (shuffle == "none"), "unshuffled batches should be runs of a row group"


def _batches_and_segments(config: Path, steps: int) -> list[tuple[dict[str, np.ndarray], list[object]]]:
    """Each step's batch and its rows' segments (with their provenance)."""
    with Loader(config) as loader:
        return [({name: values.copy() for name, values in loader.batch(step).items()},
                 [w.segments() for w in loader.examples(step).examples])  # type: ignore[union-attr]
                for step in range(steps)]


@pytest.mark.parametrize("datasets", [["web"], ["chat"], None])
def test_unshuffled_windows_inside_one_row_group_equal_what_the_search_finds(lake: Path, datasets: list[str] | None) -> None:
    """Without a shuffle most warm batches lie inside one cached row group, and their windows are
    taken from it without a search per window: the batches and each window's segments (with
    where they lie in their chunks) equal those the search per window gives, over two epochs."""
    config = _variant(lake, f"one-group-{datasets}", datasets, packing="concat", shuffle={"kind": "none"},
                      batch_size=4)
    with Loader(config) as loader:
        steps = 2 * sum(d.train_count() for d in loader.datasets) // 4 + 3
    taken = 0
    one_group = SpanReader._inside_one_group

    def counted(locator: SpanReader, *args: object) -> object:
        nonlocal taken
        found = one_group(locator, *args)  # type: ignore[arg-type]
        taken += found is not None
        return found

    with mock.patch.object(SpanReader, "_inside_one_group", counted):
        direct = _batches_and_segments(config, steps)
    with mock.patch.object(SpanReader, "_inside_one_group", lambda *args: None):
        searched = _batches_and_segments(config, steps)
    assert taken >= steps, "most batches (and their examples) should lie inside one row group"
    for step, ((batch, segments), (expected, expected_segments)) in enumerate(zip(direct, searched)):
        assert batch.keys() == expected.keys()
        for name in batch:
            assert np.array_equal(batch[name], expected[name]), (step, name)
        assert segments == expected_segments, step


def test_windows_inside_one_row_group_are_taken_up_to_its_edges(lake: Path) -> None:
    """Windows reaching a cached row group's last token are taken from it; one more token, or
    one before its first, and they are left to the search."""
    config = _variant(lake, "one-group-edges", ["web"], packing="concat", shuffle={"kind": "none"}, batch_size=4)
    length = SEQ_LEN + 1
    with Loader(config) as loader:
        dataset = loader.datasets[0]
        for step in range(dataset.train_count() // 4 + 1):   # every row group read, cached and indexed
            loader.batch(step)
        spans, index = dataset.reader.span_reader, dataset.reader.span_reader._index
        assert index is not None and index.offsets is dataset.locator.stream_offsets()
        checked = 0
        for g in range(len(index.start)):
            lo, hi = int(index.start[g]), int(index.stop[g])
            if hi - lo <= length:
                continue
            for starts, inside in (([lo, hi - length], True), ([lo + 1, hi - length + 1], False),
                                   ([lo - 1, lo + 1], False)):
                found = spans._inside_one_group(dataset.chunks, np.arange(dataset.chunks.committed),
                                                dataset.locator.stream_offsets(), np.array(starts, np.int64), length,
                                                max(starts) + length)
                if not inside:
                    assert found is None, (g, starts)
                    continue
                assert found is not None, (g, starts)
                assert found.at.tolist() == [0, hi - length - lo] and found.group.tolist() == [0, 0]
                assert found.group_position == [int(index.position[g])]
                assert len(found.groups[0].tokens) == hi - lo
                checked += 1
        assert checked >= 3, "the lake should have several row groups longer than a window"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 6)), max_size=20))
def test_spans_are_run_indices(ranges: list[tuple[int, int]]) -> None:
    first = np.array([f for f, _ in ranges], np.int64)
    counts = np.array([c for _, c in ranges], np.int64)
    expected = [i for f, c in ranges for i in range(f, f + c)]
    found = run_indices(first, counts)
    assert found.dtype == np.int64 and found.tolist() == expected


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.booleans()), max_size=40), st.lists(st.integers(0, 12), max_size=10))
def test_cached_looks_up_as_get_without_computing(operations: list[tuple[int, bool]], asked: list[int]) -> None:
    """``LRU.cached`` returns what ``get`` would (None where missing), computes nothing, and
    marks what it finds as used as ``get`` does: both caches then evict the same keys."""
    one, other = LRU[int, int](4), LRU[int, int](4)
    for key, _ in operations:
        one.get(key, lambda k=key: k * 10)
        other.get(key, lambda k=key: k * 10)
    present = {k for k in range(13) if k in one}
    found = one.cached(asked)
    assert found == [k * 10 if k in present else None for k in asked]
    for key in asked:
        if key in present:
            other.get(key, lambda: pytest.fail("cached value recomputed"))
    assert len(one) == len(other)
    for key in range(20, 24):   # push everything out in order: the same keys go first
        one.get(key, lambda k=key: k)
        other.get(key, lambda k=key: k)
        assert [k for k in range(13) if k in one] == [k for k in range(13) if k in other]


def test_pool_arrays_start_at_different_page_offsets() -> None:
    """A batch's arrays (and the next batch's, while the first is held) start at page offsets at
    least a few cache lines apart, each on a cache line: a copy between two of them shifted by
    one token (targets from inputs) must not alias them within a page."""
    pool = ArrayPool()
    held = [pool.empty((64, 2048), np.float32 if i % 5 == 2 else np.int32) for i in range(10)]
    offsets = [a.ctypes.data % 4096 for a in held]
    assert all(offset % 64 == 0 for offset in offsets), offsets
    for i, a in enumerate(offsets[:5]):
        for b in offsets[i + 1 : 5]:
            assert min((a - b) % 4096, (b - a) % 4096) >= 256, offsets
    assert all(a.flags.c_contiguous and a.flags.writeable for a in held)
    # Reuse is unchanged: an array comes back only once nothing refers to it, at its address.
    address = held[0].ctypes.data
    view = held[0][3:]
    del held[0]
    assert pool.empty((64, 2048), np.int32).ctypes.data != address
    del view
    assert pool.empty((64, 2048), np.int32).ctypes.data == address



def test_pool_fields_of_a_batch_share_memory_reused_once_none_is_held() -> None:
    """A batch's fields made together (``empty_fields``) are separate arrays at page offsets a few
    cache lines apart; their memory comes back only once none of them, nor a view of one, is held."""
    pool = ArrayPool()
    dtypes = [np.int32, np.int32, np.float32, np.int32, np.int32]
    fields = pool.empty_fields((64, 2048), dtypes)
    assert [a.dtype for a in fields] == [np.dtype(d) for d in dtypes] and all(a.shape == (64, 2048) for a in fields)
    for i, a in enumerate(fields):
        a.fill(i)
        assert a.flags.c_contiguous and a.flags.writeable
        for b in fields[i + 1 :]:
            assert not np.shares_memory(a, b)
            gap = (a.ctypes.data - b.ctypes.data) % 4096
            assert min(gap, 4096 - gap) >= 256 and gap % 64 == 0
    assert [int(a[5, 7]) for a in fields] == [0, 1, 2, 3, 4]   # none overwrote another
    addresses = [a.ctypes.data for a in fields]
    kept = fields[3][1:]
    del fields, a, b
    again = pool.empty_fields((64, 2048), dtypes)
    assert not {a.ctypes.data for a in again} & set(addresses)   # a view of one field holds them all
    del again, kept
    assert [a.ctypes.data for a in pool.empty_fields((64, 2048), dtypes)] == addresses   # reused


def _content(example: Span | PackedExample) -> tuple[object, ...]:
    """What an example holds: provenance and every token."""
    if isinstance(example, Span):
        parts = [(p.chunk, p.start, p.tokens.tolist(), p.docs.tolist()) for p in example.pieces]
    else:
        parts = [(i.chunk, i.doc, i.start, i.stop, i.tokens.tolist(), i.images, i.split) for i in example.items]
    return example.dataset, example.epoch, example.example, parts


@pytest.mark.parametrize("packing", ["pack", "concat"])
def test_eval_windows_located_together_equal_one_at_a_time(lake: Path, packing: str) -> None:
    """An evaluation batch's examples are located together (the short last window alone); they
    are the examples of ``eval_window`` one at a time, and so are the batches they fill."""
    config = _variant(lake, f"eval-{packing}", ["chat"], packing=packing)
    with Loader(config, mode="eval") as loader:
        (dataset,) = loader.datasets
        count = dataset.eval_count()
        js = np.concatenate([np.arange(0, count, 7), [count - 1, count - 2, 0]])
        assert [_content(e) for e in dataset.eval(js)] == [_content(dataset.eval(np.array([int(j)]))[0]) for j in js]
        total = loader.num_batches() or 0
        for step in (0, total - 1):   # the last batch: a short window and padding rows
            batch = loader.batch(step)
            examples = loader.examples(step).examples
            alone = _blank(batch, BATCH, loader.pad_id)
            for row, j in enumerate(e.example for e in examples if e is not None):
                one = dataset.eval(np.array([j]))[0]
                type(one).fill_rows(alone, [row], [one])
            for name in ROW_FIELDS:
                assert np.array_equal(alone[name], batch[name]), (step, name)
