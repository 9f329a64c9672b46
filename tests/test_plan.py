"""Planning: every document lands in exactly one split; the global order is the round-robin rule."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lakeloader.config import DatasetConfig
from lakeloader.ingest.documents import SplitSource, _read_byte_range, read_split
from lakeloader.plan.order import round_robin_order
from lakeloader.plan.sources import expand_sources
from lakeloader.plan.splits import plan_splits

TEXT = DatasetConfig(sources=["x"]).record_format()


def brute_force_order(counts: list[int]) -> list[tuple[int, int]]:
    order, remaining = [], list(counts)
    split = 0
    while any(remaining):
        for shard, left in enumerate(remaining):
            if left:
                order.append((shard, split))
                remaining[shard] -= 1
        split += 1
    return order


@given(st.lists(st.integers(0, 12), min_size=0, max_size=12))
def test_round_robin_matches_rule(counts: list[int]) -> None:
    shard, split = round_robin_order(np.array(counts, dtype=np.int64))
    assert list(zip(shard.tolist(), split.tolist())) == brute_force_order(counts)
    # While all K shards have splits, chunk c is split c // K of shard c % K.
    k, full = len(counts), min(counts, default=0)
    for c in range(k * full):
        assert (shard[c], split[c]) == (c % k, c // k)


lines_strategy = st.lists(
    st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\n\r"), max_size=40),
    min_size=0, max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=lines_strategy, split_size=st.integers(1, 300), trailing_newline=st.booleans())
def test_every_line_in_exactly_one_split(tmp_path: Path, lines: list[str], split_size: int,
                                         trailing_newline: bool) -> None:
    path = tmp_path / "f.txt"
    data = "\n".join(lines) + ("\n" if trailing_newline and lines else "")
    path.write_bytes(data.encode())
    [shard], missing = expand_sources([str(path)], {})
    assert not missing
    recovered: list[bytes] = []
    for split in plan_splits(shard, split_size, {}):
        source = SplitSource(str(path), "text", None, split, TEXT, "skip", {})
        body, first = _read_byte_range(source)
        assert split.start <= first or body == b""
        recovered.extend(body.split(b"\n")[:-1] if body.endswith(b"\n") else body.split(b"\n") if body else [])
    expected = [line.encode() for line in data.split("\n")]
    if data.endswith("\n") or not data:
        expected = expected[:-1]
    assert recovered == expected


def test_record_numbers_count_from_the_split(tmp_path: Path) -> None:
    path = tmp_path / "f.txt"
    path.write_text("".join(f"line {i}\n" for i in range(100)))
    [shard], _ = expand_sources([str(path)], {})
    seen = []
    for split in plan_splits(shard, 97, {}):
        docs = read_split(SplitSource(str(path), "text", None, split, TEXT, "raise", {}))
        assert len(docs.records) == docs.num_records
        seen.extend(parts[0].text for parts in docs.documents)
    assert seen == [f"line {i}" for i in range(100)]


def test_sources_sorted_deduplicated_and_missing_reported(tmp_path: Path) -> None:
    for name in ("b.jsonl", "a.jsonl", "c.txt"):
        (tmp_path / name).write_text("{}\n")
    shards, missing = expand_sources(
        [str(tmp_path / "*.jsonl"), str(tmp_path / "a.jsonl"), str(tmp_path / "nope.jsonl"),
         str(tmp_path / "none-*.txt")], {})
    assert [Path(s.url).name for s in shards] == ["a.jsonl", "b.jsonl"]
    assert [(Path(m.source).name, m.reason) for m in missing] == [
        ("nope.jsonl", "file not found"), ("none-*.txt", "pattern matched no files")]
