"""Helpers shared by the benchmark scripts (not part of the library)."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "out"


def machine() -> str:
    """One line describing where the figures were measured."""
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def report(name: str, figures: dict[str, Any]) -> None:
    """Print the figures and keep them as JSON in benchmarks/out/<name>.json."""
    OUT.mkdir(parents=True, exist_ok=True)
    figures = {"benchmark": name, "machine": machine(), "time": time.strftime("%Y-%m-%d %H:%M"), **figures}
    (OUT / f"{name}.json").write_text(json.dumps(figures, indent=1))
    width = max(map(len, figures))
    for key, value in figures.items():
        shown = f"{value:,.3f}" if isinstance(value, float) else f"{value:,}" if isinstance(value, int) else value
        print(f"{key:<{width}}  {shown}")
