"""docs/config.md, the reference of every config key, is what scripts/make_config_docs.py makes of
lakeloader/config.py, and its YAML examples are valid configs."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

from lakeloader.config import load_config

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "config.md"


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_config_docs", ROOT / "scripts" / "make_config_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_config_docs_are_up_to_date() -> None:
    problem = _generator().check()
    assert problem is None, problem


def test_check_reports_a_stale_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    generator = _generator()
    stale = tmp_path / "config.md"
    stale.write_text(DOC.read_text(encoding="utf-8").replace("`loader.seq_len`", "`loader.seqlen`"),
                     encoding="utf-8")
    monkeypatch.setattr(generator, "DOC", stale)
    assert generator.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "out of date" in err and "make_config_docs.py" in err
    assert "-| `loader.seqlen`" in err and "+| `loader.seq_len`" in err


def test_every_key_is_documented() -> None:
    text = DOC.read_text(encoding="utf-8")
    for key in ("lake", "loader.shuffle.window_chunks", "datasets.<name>.chat.template",
                "datasets.<name>.chat.template.<role>.prefix", "mixture.stages[].start_step",
                "build.dashboard", "loader.disk_cache_bytes"):
        assert f"| `{key}` |" in text, key
    assert "`loader.shuffle.window_chunks` | int | `8` | ≥ 1 |" in text
    assert '`"concat"` \\| `"pack"` \\| `"pad"`' in text
    assert "source_file" not in text  # internal, not a key users write


def test_yaml_examples_load(tmp_path: Path) -> None:
    examples = re.findall(r"```yaml\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.DOTALL)
    assert examples
    # load_config only resolves the paths a config names; nothing needs to exist to validate it.
    folder = tmp_path / "configs"
    folder.mkdir()
    for i, example in enumerate(examples):
        path = folder / f"example{i}.yaml"
        path.write_text(example, encoding="utf-8")
        config = load_config(path)
        assert config.datasets and Path(config.lake).is_absolute()
