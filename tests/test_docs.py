"""The pages users read (README.md and docs/*.md): short front door, no words that go stale, every
relative link and anchor pointing at something that exists, every complete YAML config valid."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest
import yaml

from lakeloader.config import load_config

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
HISTORY = ROOT / "docs" / "performance-history.md"
README_MAX_LINES = 160

# Words whose meaning depends on when the page is read. The performance history is a dated log:
# its entries name dates, so "now" in an entry means that date; elsewhere pages state what is true.
STALE = re.compile(
    r"\b(today|today's|tonight|yesterday|this round|(?:an |the )?earlier rounds?|previous round|last round|"
    r"this session|same session|this sitting|this hour|at the moment|currently|nowadays|as of now|these days)\b",
    re.IGNORECASE)
STALE_OUTSIDE_THE_LOG = re.compile(r"\bnow\b", re.IGNORECASE)

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def _prose(text: str) -> str:
    """``text`` without its fenced code blocks (their links and words are code, not prose)."""
    return FENCE.sub("", text)


def _slug(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    text = re.sub(r"\]\([^)]*\)|[`*\[]", "", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    anchors: set[str] = set()
    for line in _prose(page.read_text(encoding="utf-8")).splitlines():
        match = re.match(r"#{1,6}\s+(.*)", line)
        if match:
            slug = _slug(match.group(1))
            n = 0
            while (candidate := slug if n == 0 else f"{slug}-{n}") in anchors:
                n += 1
            anchors.add(candidate)
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_words_that_go_stale(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    found = [(n, m.group(0)) for n, line in enumerate(text.splitlines(), 1) for m in STALE.finditer(line)]
    if page != HISTORY:
        found += [(n, m.group(0)) for n, line in enumerate(text.splitlines(), 1)
                  for m in STALE_OUTSIDE_THE_LOG.finditer(line)]
    assert not found, (f"{page.name}: words that go stale (say what is true, or name the date): "
                       + ", ".join(f"line {n}: {word!r}" for n, word in sorted(found)))


def test_readme_is_short() -> None:
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, (f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail "
                                       "into a guide in docs/")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_point_at_what_exists(page: Path) -> None:
    broken = []
    for target in LINK.findall(_prose(page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        path_part, _, anchor = target.partition("#")
        linked = (page.parent / unquote(path_part)).resolve() if path_part else page
        if not linked.exists():
            broken.append(f"{target} (no {linked.relative_to(ROOT) if linked.is_relative_to(ROOT) else linked})")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target} (no heading #{anchor} in {linked.name})")
    assert not broken, f"{page.name}: broken links: " + "; ".join(broken)


def test_links_are_checked() -> None:
    # The link pattern finds the README's guide links (a pattern matching nothing would pass anything).
    targets = LINK.findall(_prose(README.read_text(encoding="utf-8")))
    assert "docs/design.md" in targets and any(t.startswith("docs/") and "#" not in t for t in targets)
    assert _slug("Data flow: what each stage `takes` and **guarantees**") == "data-flow-what-each-stage-takes-and-guarantees"


def _configs(page: Path) -> list[str]:
    """The YAML blocks of ``page`` that are whole configs (they name ``datasets``)."""
    blocks = re.findall(r"^```yaml\n(.*?)^```", page.read_text(encoding="utf-8"), flags=re.MULTILINE | re.DOTALL)
    return [b for b in blocks if isinstance(yaml.safe_load(b), dict) and "datasets" in yaml.safe_load(b)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_config_examples_are_valid(page: Path, tmp_path: Path) -> None:
    # load_config resolves the paths a config names; nothing needs to exist to validate it. An
    # example may leave out lake and tokenizer (it shows datasets): those are filled in.
    for i, block in enumerate(_configs(page)):
        config = {"lake": "./lake", "tokenizer": "tokenizer.json", **yaml.safe_load(block)}
        path = tmp_path / f"example{i}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
        try:
            load_config(path)
        except Exception as error:  # noqa: BLE001 - the message says which example
            pytest.fail(f"{page.name}: YAML example {i + 1} is not a valid config: {error}")
