"""Config validation: errors name the file, line, key, value and what is allowed."""

from __future__ import annotations

from pathlib import Path

import pytest

from lakeloader.config import load_config, parse_size
from lakeloader.contracts.errors import ConfigError

GOOD = """\
lake: ./lake
tokenizer: tok.json
datasets:
  web:
    sources: ["data/*.jsonl"]
build:
  split_size: 8MB
mixture:
  weights: {web: 1.0}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_good_config_resolves_paths_against_its_folder(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, GOOD))
    assert config.lake == str(tmp_path / "lake")
    assert config.tokenizer == str(tmp_path / "tok.json")
    assert config.datasets["web"].sources == [str(tmp_path / "data/*.jsonl")]
    assert config.build.split_size == 8 * 10**6
    assert config.loader.seq_len == 2048


@pytest.mark.parametrize(
    ("bad", "expected"),
    [
        (GOOD.replace("sources:", "format: txt\n    sources:"),
         ["line 5", "datasets.web.format", "'txt'", "'text'"]),
        (GOOD.replace("8MB", "8XB"), ["line 7", "build.split_size", "'8XB'", "64MB"]),
        (GOOD.replace("build:", "bild:"), ["line 6", "bild", "unknown key"]),
        (GOOD.replace("lake: ./lake\n", ""), ["lake", "required key is missing"]),
        (GOOD.replace("{web: 1.0}", "{web: 1.0, code: 2}"), ["mixture", "unknown dataset", "code"]),
        (GOOD.replace("  split_size: 8MB", "  workers: 0"), ["build.workers", "greater than or equal to 1"]),
        (GOOD.replace("web:", "we b:"), ["dataset name", "'we b'"]),
        (GOOD + "loader:\n  packing: zip\n", ["loader.packing", "'zip'", "'concat'", "'pack'", "'pad'"]),
        (GOOD + "loader:\n  fields: [input_ids, positions]\n", ["loader.fields", "must include targets"]),
        (GOOD + "loader:\n  fields: [input_ids, targets, mask]\n", ["loader.fields", "'mask'", "'loss_mask'"]),
        (GOOD + "loader:\n  fields: [input_ids, targets, targets]\n", ["loader.fields", "targets more than once"]),
    ],
)
def test_errors_name_line_key_value_and_allowed(tmp_path: Path, bad: str, expected: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, bad))
    message = str(info.value)
    assert str(tmp_path / "c.yaml") in message
    for word in expected:
        assert word in message, (word, message)


def test_unreadable_and_invalid_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "lake: [unclosed"))


@pytest.mark.parametrize(("text", "size"), [("64MB", 64 * 10**6), ("1.5 KiB", 1536), ("7", 7), (12, 12)])
def test_parse_size(text: str | int, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "MB", "-1MB", "0", "3 parsecs", 0])
def test_parse_size_rejects(text: str | int) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


@pytest.mark.parametrize("path", sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml")))
def test_shipped_configs_are_valid(path: Path) -> None:
    config = load_config(path)
    assert config.datasets and config.lake
