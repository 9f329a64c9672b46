"""The front door works: every command and code block of README.md runs, in the README's order, in a
folder holding what its quickstart describes (quickstart.yaml, taken from the README itself, a
tokenizer.json, gzipped JSON Lines under data/web/ and plain text under data/notes/).

`make demo` and `make test` are not run here (the demo and the whole suite have tests of their
own): the Makefile must define them. Every other command must be a `lakeloader` command."""

from __future__ import annotations

import gzip
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
from conftest import DEMO_TOKENIZER, REPO, stdlib_texts

README = REPO / "README.md"
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
QUICKSTART = "quickstart.yaml"


def blocks() -> list[tuple[str, str]]:
    """The README's fenced blocks in order: (language, text)."""
    return BLOCK.findall(README.read_text(encoding="utf-8"))


def commands(text: str) -> list[list[str]]:
    """The commands of a shell block, one a line, comments dropped."""
    return [words for line in text.splitlines() if (words := shlex.split(line, comments=True))]


def quickstart_config() -> str:
    """The README's quickstart config: its YAML block that starts with ``# quickstart.yaml``."""
    configs = [text for language, text in blocks() if language == "yaml" and text.startswith(f"# {QUICKSTART}\n")]
    assert len(configs) == 1, f"README.md: one yaml block starting with '# {QUICKSTART}' expected"
    return configs[0]


def run(argv: list[str], cwd: Path, what: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    env.setdefault("JAX_PLATFORMS", "cpu")
    result = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (f"README.md {what} failed with exit status {result.returncode}\n"
                                    f"--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}")
    return result


@pytest.fixture
def quickstart(tmp_path: Path) -> Path:
    """A folder laid out as the quickstart says, with the README's config in it."""
    web = [*stdlib_texts("json"), *stdlib_texts("email", limit=12)]
    records = [json.dumps({"text": t}) for t in web] + ['{"text": 5}']   # a bad record: on_error: skip
    (tmp_path / "data" / "web").mkdir(parents=True)
    (tmp_path / "data" / "web" / "part-0.jsonl.gz").write_bytes(gzip.compress(("\n".join(records) + "\n").encode()))
    notes = [line for text in stdlib_texts("zoneinfo") for line in text.splitlines() if line.strip()]
    (tmp_path / "data" / "notes").mkdir()
    (tmp_path / "data" / "notes" / "lines.txt").write_text("\n".join(notes) + "\n", encoding="utf-8")
    shutil.copy(DEMO_TOKENIZER, tmp_path / "tokenizer.json")
    (tmp_path / QUICKSTART).write_text(quickstart_config(), encoding="utf-8")
    return tmp_path


def test_lakeloader_is_the_cli_module() -> None:
    # The README's `lakeloader X` is run here as `python -m lakeloader.cli X`: the same entry point.
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]
    assert scripts["lakeloader"] == "lakeloader.cli:main"


def test_python_blocks_import_from_the_public_door() -> None:
    python = [text for language, text in blocks() if language == "python"]
    assert python
    for text in python:
        imports = re.findall(r"^\s*(?:from|import)\s+(lakeloader[\w.]*)", text, flags=re.MULTILINE)
        assert all(name == "lakeloader" for name in imports), f"README.md imports {imports}: use `from lakeloader import ...`"


def test_every_block_runs(quickstart: Path) -> None:
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    ran = {"make": 0, "lakeloader": 0, "python": 0}
    for language, text in blocks():
        if language in ("sh", "bash", "shell", "console"):
            for words in commands(text):
                if words[0] == "make":
                    assert len(words) == 2 and re.search(rf"^{re.escape(words[1])}:", makefile, re.MULTILINE), \
                        f"README.md: `{shlex.join(words)}`: no such Makefile target"
                    ran["make"] += 1
                    continue
                assert words[0] == "lakeloader", f"README.md: `{shlex.join(words)}`: not a command this test runs"
                run([sys.executable, "-m", "lakeloader.cli", *words[1:]], quickstart, f"command `{shlex.join(words)}`")
                ran["lakeloader"] += 1
        elif language == "python":
            run([sys.executable, "-c", text], quickstart, f"Python block:\n{text}")
            ran["python"] += 1
        else:
            assert language in ("yaml", ""), f"README.md: a {language!r} block this test does not run"
    assert ran["make"] == 2 and ran["lakeloader"] >= 4 and ran["python"] >= 2, ran
    # What the commands made: the lake, with the bad record in its rejects, and the batches file.
    assert (quickstart / "lake" / "_catalog" / "CURRENT").exists()
    with np.load(quickstart / "batches.npz") as saved:
        assert saved["input_ids"].shape == (4, 16, 512)
        assert list(saved["dataset_names"]) == ["web", "notes"]
    status = run([sys.executable, "-m", "lakeloader.cli", "sql", QUICKSTART,
                  "SELECT sum(num_rejects) AS rejects FROM datasets", "--format", "json"], quickstart, "check")
    assert json.loads(status.stdout) == [{"rejects": 1}]
