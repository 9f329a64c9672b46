"""Datasets defined by a filter (issue 14 item 4): ``{from: web, where: "<SQL predicate>"}``.

The predicate is checked before any work: parsed and bound by DuckDB against an empty relation of
the source dataset's metadata fields and ``num_tokens``, refused unless it is one pure expression.
The build and the readers of filtered datasets are not there yet: a valid filter is refused with
a config error that says so, before anything is planned or written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from lakeloader.cli import main
from lakeloader.config import load_config
from lakeloader.contracts.errors import ConfigError
from lakeloader.contracts.selection import where_problem

from conftest import write_jsonl

WEB = {"metadata_fields": {"lang": "string", "score": "float"}}


def config_file(tmp_path: Path, filtered: dict[str, Any], **more: Any) -> Path:
    write_jsonl(tmp_path / "web.jsonl", ["a text", "another text"])
    raw = {"lake": str(tmp_path / "lake"), "tokenizer": str(Path(__file__).parents[1] / "demo" / "tokenizer.json"),
           "datasets": {"web": {"sources": [str(tmp_path / "web.jsonl")], **WEB}, "web_en": filtered, **more},
           "mixture": {"weights": {"web": 1, "web_en": 1}}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@pytest.mark.parametrize("filtered,key,says", [
    ({"from": "web", "where": "lang = 'en' AND colour = 'red'"}, "datasets.web_en.where", 'column "colour" not found'),
    ({"from": "web", "where": "lang = 'en' AND"}, "datasets.web_en.where", "not a SQL predicate"),
    ({"from": "web", "where": "lang IN (SELECT 'en')"}, "datasets.web_en.where", "not one pure expression"),
    ({"from": "web", "where": "1) UNION SELECT (1"}, "datasets.web_en.where", "not one pure expression"),
    ({"from": "web", "where": "true; DROP TABLE chunks"}, "datasets.web_en.where", "not a SQL predicate"),
    ({"from": "web", "where": "length(read_text('/etc/passwd')) > 0"}, "datasets.web_en.where", "table function"),
    ({"from": "web", "where": "count(*) > 1"}, "datasets.web_en.where", "aggregates"),
    ({"from": "web", "where": "  "}, "datasets.web_en.where", "empty"),
    ({"from": "news", "where": "true"}, "datasets.web_en.from", "no dataset 'news'"),
    ({"from": "web", "where": "true", "sources": ["x.jsonl"]}, "datasets.web_en.sources", "remove this key"),
    ({"from": "web", "where": "true", "format": "chat"}, "datasets.web_en.format", "remove this key"),
    ({"from": "web"}, "datasets.web_en.where", "needs where"),
    ({"where": "true"}, "datasets.web_en.where", "add from"),
])
def test_a_wrong_filter_is_a_config_error_naming_its_key_before_any_work(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], filtered: dict[str, Any], key: str, says: str) -> None:
    path = config_file(tmp_path, filtered)
    with pytest.raises(ConfigError) as error:
        load_config(path)
    message = str(error.value)
    assert key in message and says in message and str(path) in message and "line " in message, message
    assert main(["build", str(path)]) == 2
    assert key in capsys.readouterr().err
    assert not (tmp_path / "lake").exists()   # nothing planned, nothing written


def test_a_filter_of_a_filtered_dataset_is_refused(tmp_path: Path) -> None:
    path = config_file(tmp_path, {"from": "web", "where": "true"}, web_hq={"from": "web_en", "where": "score > 0.5"})
    with pytest.raises(ConfigError, match=r"datasets\.web_hq\.from.*'web_en' is itself defined by a filter"):
        load_config(path)


def test_a_valid_filter_is_refused_as_not_supported_yet(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = config_file(tmp_path, {"from": "web", "where": "lang = 'en' AND score >= 0.5 AND num_tokens < 8192"})
    with pytest.raises(ConfigError, match=r"datasets\.web_en\.where.*not supported yet"):
        load_config(path)
    assert main(["build", str(path)]) == 2
    assert "not supported yet" in capsys.readouterr().err
    assert not (tmp_path / "lake").exists()


def test_predicates_bind_against_the_planned_types() -> None:
    assert where_problem("lang = 'en' AND score >= 0.5 AND num_tokens < 8192", WEB["metadata_fields"]) is None
    assert where_problem("flag AND num_tokens BETWEEN 1 AND 10", {"flag": "bool"}) is None
    assert where_problem("lang LIKE 'e%' OR lang IS NULL", {"lang": None}) is None   # untyped: a string
    assert "not found" in where_problem("tokens > 3", {})
    assert "does not bind" in where_problem("flag + 1 > 1", {"flag": "bool"})   # no bool + int
