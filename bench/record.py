"""Benchmark results files: {"machine", "date", "rows"}, one row per command that made it, so
a table can be filled in several sittings and every row names the command that remakes it."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path


def rows(path: Path) -> list[dict]:
    return json.loads(path.read_text())["rows"] if path.exists() else []


def save(path: Path, row: dict) -> None:
    """Add `row` to the file, replacing the row of the same command."""
    kept = [r for r in rows(path) if r["command"] != row["command"]]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores",
        "date": time.strftime("%Y-%m-%d"),
        "rows": [*kept, row],
    }, indent=1))  # fmt: skip
