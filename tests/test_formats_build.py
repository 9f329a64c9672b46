"""Reading records of every format into parts: exact parts from JSONL and Parquet, bad records
raised (naming file, line and reason) or rejected, and plain-text sources refused at planning."""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lakeloader.config import Config, DatasetConfig
from lakeloader.contracts.errors import ConfigError, InputError
from lakeloader.contracts.formats import Part, RecordError
from lakeloader.ingest.documents import SplitDocuments, SplitSource, read_split
from lakeloader.plan.planner import dataset_fingerprint, plan_dataset
from lakeloader.plan.sources import expand_sources
from lakeloader.plan.splits import plan_splits

CHAT = [{"messages": [{"role": "system", "content": ""}, {"role": "user", "content": "Hi?"},
                      {"role": "assistant", "content": "Hello."}]},
        {"messages": [{"role": "user", "content": "2+2"}, {"role": "tool", "content": "4"}]}]
CHAT_PARTS = [[Part(0, ""), Part(1, "Hi?"), Part(2, "Hello.")], [Part(1, "2+2"), Part(3, "4")]]
SUPERVISED = [{"prompt": "Q1", "response": "A1"}, {"prompt": "", "response": "only an answer"}]
SUPERVISED_PARTS = [[Part(0, "Q1"), Part(1, "A1")], [Part(0, ""), Part(1, "only an answer")]]
INTERLEAVED = [{"items": [{"text": "a cat:"}, {"image": "s3://img/cat.png"}, {"text": "cute"}]},
               {"items": [{"image": "id-7"}]}]
INTERLEAVED_PARTS = [[Part(0, "a cat:"), Part(1, "", "s3://img/cat.png"), Part(0, "cute")],
                     [Part(1, "", "id-7")]]



def lists(docs: Any) -> list[list[Part]]:
    """Documents (tuples of parts) as lists, to compare with literals."""
    return [list(d) for d in docs.documents]

def dataset(fmt: str = "text", **options: Any) -> DatasetConfig:
    return DatasetConfig(sources=["x"], format=fmt, **options)


def read(path: Path, config: DatasetConfig, on_error: str = "raise") -> SplitDocuments:
    """Every split of ``path`` read with ``config``'s record format, concatenated."""
    [shard], _ = expand_sources([str(path)], {})
    record_format = config.record_format()
    out = SplitDocuments([], [], 0, [], 0)
    for split in plan_splits(shard, 1 << 20, {}):
        docs = read_split(SplitSource(shard.url, shard.layout, shard.compression, split, record_format,
                                      on_error, {}))
        out.documents += docs.documents
        out.records += docs.records
        out.rejects += docs.rejects
        out.num_records += docs.num_records
    return out


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def write_parquet(path: Path, columns: dict[str, pa.Array], row_group_size: int = 1) -> Path:
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
    return path


def test_record_format_from_config() -> None:
    chat = dataset("chat", chat={"roles": ["user", "bot"], "loss_roles": ["bot"], "template": {}}).record_format()
    assert chat.fields == (("content_key", "content"), ("messages_field", "messages"), ("role_key", "role"),
                           ("roles", ("user", "bot")))
    assert chat.kind_names == ("user", "bot") and chat.columns == ("messages",) and not chat.text_only
    assert pickle.loads(pickle.dumps(chat)) == chat and hash(chat) == hash(
        dataset("chat", chat={"roles": ["user", "bot"], "loss_roles": [], "template": {}}).record_format())
    fim = dataset("fim", text_field="body", fim={"rate": 1.0}).record_format()
    assert (fim.fields, fim.kind_names, fim.columns, fim.text_only) == ((("text_field", "body"),), ("text",),
                                                                        ("body",), True)
    assert dataset("supervised").record_format().columns == ("prompt", "response")
    assert dataset("interleaved").record_format().kind_names == ("text", "image")
    assert dataset().record_format().text_parts("a line") == (Part(0, "a line"),)


def test_text_and_fim(tmp_path: Path) -> None:
    docs = read(write_jsonl(tmp_path / "t.jsonl", [{"text": "one", "n": 1}, {"text": "two"}]), dataset())
    assert lists(docs) == [[Part(0, "one")], [Part(0, "two")]] and docs.records == [0, 1]
    (tmp_path / "t.txt").write_text("first\r\nsecond\n")
    assert lists(read(tmp_path / "t.txt", dataset())) == [[Part(0, "first")], [Part(0, "second")]]
    code = write_jsonl(tmp_path / "c.jsonl", [{"code": "def f(): pass", "text": "ignored"}])
    assert lists(read(code, dataset("fim", fim={"text_field": "code"}))) == [[Part(0, "def f(): pass")]]
    parquet = write_parquet(tmp_path / "c.parquet", {"code": pa.array(["x = 1", "y = 2"])})
    assert lists(read(parquet, dataset("fim", text_field="code"))) == [[Part(0, "x = 1")], [Part(0, "y = 2")]]


@pytest.mark.parametrize("fmt, records, parts", [
    ("chat", CHAT, CHAT_PARTS), ("supervised", SUPERVISED, SUPERVISED_PARTS),
    ("interleaved", INTERLEAVED, INTERLEAVED_PARTS)])
def test_jsonl_and_parquet_give_the_same_parts(tmp_path: Path, fmt: str, records: list[dict[str, Any]],
                                               parts: list[list[Part]]) -> None:
    docs = read(write_jsonl(tmp_path / "d.jsonl", records), dataset(fmt))
    assert lists(docs) == parts and docs.records == [0, 1] and not docs.rejects
    # pyarrow infers list<struct<role, content>> and list<struct<text, image>> (absent keys are null).
    table = pa.Table.from_pylist(records)
    if fmt == "interleaved":
        assert str(table.schema.field("items").type) == "list<item: struct<text: string, image: string>>"
    path = write_parquet(tmp_path / "d.parquet", {**{n: table.column(n) for n in table.column_names},
                                                  "other": pa.array([1, 2])})
    docs = read(path, dataset(fmt))
    assert lists(docs) == parts and docs.records == [0, 0]  # one row group per row


def test_renamed_fields_and_roles(tmp_path: Path) -> None:
    chat = dataset("chat", chat={"messages_field": "conv", "role_key": "from", "content_key": "value",
                                 "roles": ["human", "gpt"], "template": {}, "loss_roles": ["gpt"]})
    path = write_jsonl(tmp_path / "c.jsonl", [{"conv": [{"from": "human", "value": "hi"},
                                                        {"from": "gpt", "value": "yo"}]}])
    assert lists(read(path, chat)) == [[Part(0, "hi"), Part(1, "yo")]]
    supervised = dataset("supervised", supervised={"prompt_field": "q", "response_field": "a"})
    path = write_parquet(tmp_path / "s.parquet", {"q": pa.array(["?"]), "a": pa.array(["!"])})
    assert lists(read(path, supervised)) == [[Part(0, "?"), Part(1, "!")]]


ROLES = "['system', 'user', 'assistant', 'tool']"
BAD = {
    "text_missing": ("text", {"body": "x"}, "no field 'text' (fields: body); set text_field"),
    "text_type": ("text", {"text": 42}, "field 'text' is int, expected a string"),
    "text_empty": ("text", {"text": ""}, "empty document (field 'text' is empty)"),
    "chat_missing": ("chat", {"a": 1, "b": 2}, "no field 'messages' (fields: a, b); set chat.messages_field"),
    "chat_not_list": ("chat", {"messages": {"role": "user"}}, "field 'messages' is dict, expected a list of messages"),
    "chat_null": ("chat", {"messages": None}, "field 'messages' is null, expected a list of messages"),
    "chat_no_messages": ("chat", {"messages": []}, "no messages"),
    "chat_not_object": ("chat", {"messages": ["hi"]}, "messages[0] is str, expected an object with 'role' and 'content'"),
    "chat_role": ("chat", {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                                        {"role": "bot", "content": "c"}]},
                  f"messages[2] has role 'bot', not one of {ROLES}; add it to chat.roles"),
    "chat_no_role": ("chat", {"messages": [{"from": "user", "content": "a"}]},
                     "messages[0] has no 'role' (keys: content, from); set chat.role_key"),
    "chat_no_content": ("chat", {"messages": [{"role": "user", "text": "a"}]},
                        "messages[0] has no 'content' (keys: role, text); set chat.content_key"),
    "chat_content_type": ("chat", {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": 5}]},
                          "messages[1].content is int, expected a string"),
    "chat_empty": ("chat", {"messages": [{"role": "system", "content": ""}, {"role": "user", "content": ""}]},
                   "empty document (every 'content' in 'messages' is empty)"),
    "supervised_missing": ("supervised", {"prompt": "q"},
                           "no field 'response' (fields: prompt); set supervised.response_field"),
    "supervised_null": ("supervised", {"prompt": None, "response": "a"}, "field 'prompt' is null"),
    "supervised_type": ("supervised", {"prompt": "q", "response": ["a"]}, "field 'response' is list, expected a string"),
    "supervised_empty": ("supervised", {"prompt": "", "response": ""},
                         "empty document (fields 'prompt' and 'response' are empty)"),
    "interleaved_missing": ("interleaved", {"text": "x"}, "no field 'items' (fields: text); set interleaved.items_field"),
    "interleaved_no_items": ("interleaved", {"items": []}, "no items"),
    "interleaved_neither": ("interleaved", {"items": [{"text": "a"}, {}, {"text": "b"}, {"caption": "c"}]},
                            "items[1] has neither 'text' nor 'image'"),
    "interleaved_both": ("interleaved", {"items": [{"text": "a", "image": "b"}]}, "items[0] has both 'text' and 'image'"),
    "interleaved_image_type": ("interleaved", {"items": [{"image": 3}]}, "items[0].image is int, expected a URI or id string"),
    "interleaved_text_type": ("interleaved", {"items": [{"text": {"a": 1}}]}, "items[0].text is dict, expected a string"),
    "interleaved_empty": ("interleaved", {"items": [{"text": ""}]},
                          "empty document (every 'text' in 'items' is empty and there is no 'image')"),
}
GOOD = {"text": {"text": "good"}, "chat": CHAT[1], "supervised": SUPERVISED[0], "interleaved": INTERLEAVED[1]}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_jsonl_record(tmp_path: Path, case: str) -> None:
    fmt, record, reason = BAD[case]
    with pytest.raises(RecordError, match="^" + re.escape(reason)):
        dataset(fmt).record_format().parts(record)
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD[fmt], record, GOOD[fmt]])
    with pytest.raises(InputError) as info:
        read(path, dataset(fmt))
    assert str(info.value).startswith(f"{path}: line 2: {reason}"), str(info.value)
    docs = read(path, dataset(fmt), on_error="skip")
    assert [(r.location, r.line) for r in docs.rejects] == [("line 2", 2)]
    assert docs.rejects[0].reason.startswith(reason) and docs.records == [0, 2] and docs.num_records == 3


def test_bad_parquet_rows_and_columns(tmp_path: Path) -> None:
    messages = [[{"role": "user", "content": "a"}], [{"role": "bot", "content": "b"}], None,
                [{"role": "user", "content": None}]]
    path = write_parquet(tmp_path / "chat.parquet", {"messages": pa.array(messages)}, row_group_size=2)
    with pytest.raises(InputError, match=f"^{path}: row 1: messages\\[0\\] has role 'bot'"):
        read(path, dataset("chat"))
    docs = read(path, dataset("chat"), on_error="skip")
    assert lists(docs) == [[Part(1, "a")]] and docs.num_records == 4
    assert [(r.location, r.line, r.reason) for r in docs.rejects] == [
        ("row 1", 1, f"messages[0] has role 'bot', not one of {ROLES}; add it to chat.roles"),
        ("row 2", 2, "field 'messages' is null, expected a list of messages"),
        ("row 3", 3, "messages[0].content is null, expected a string")]
    docs = read(path, dataset("supervised"), on_error="skip")
    assert [(r.location, r.line, r.reason) for r in docs.rejects] == [
        (f"rows {a}-{a + 1} (row group {a // 2})", None,
         "no column 'prompt' (columns: messages); set supervised.prompt_field") for a in (0, 2)]
    with pytest.raises(InputError, match="rows 0-1 \\(row group 0\\): no column 'text' \\(columns: messages\\); "
                                         "set text_field"):
        read(path, dataset())


def test_plain_text_sources_only_for_text_formats(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("hello\n")
    write_jsonl(tmp_path / "b.jsonl", CHAT)
    sources = [str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")]

    def config(fmt: str, **options: Any) -> Config:
        return Config(lake=str(tmp_path / "lake"), tokenizer="t.json",
                      datasets={"d": DatasetConfig(sources=sources, format=fmt, **options)})

    with pytest.raises(ConfigError) as info:
        plan_dataset("d", config("chat"), "tok")
    message = str(info.value)
    assert "dataset 'd'" in message and str(tmp_path / "a.txt") in message and "b.jsonl" not in message
    assert "format: chat needs JSON Lines or Parquet sources" in message
    assert plan_dataset("d", config("fim"), "tok").fields == ("text",)
    sources.pop(0)
    plan = plan_dataset("d", config("chat", chat={"roles": ["user", "assistant", "tool", "system"]}), "tok")
    assert plan.fields == ("user", "assistant", "tool", "system")


def test_fingerprint_follows_build_fields_only() -> None:
    def fingerprint(**options: Any) -> str:
        return dataset_fingerprint(DatasetConfig(sources=["x"], format="chat", **options), [], "tok", 1 << 20)

    base = fingerprint()
    assert fingerprint(chat={"loss_roles": []}) == base
    assert fingerprint(chat={"template": {}}) == base
    assert fingerprint(chat={"content_key": "value"}) != base
    assert fingerprint(chat={"roles": ["user", "assistant"], "template": {}}) != base
