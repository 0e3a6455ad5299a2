"""Benchmark results files: {"machine", "date", "rows"}, one row per command that made it, so
a table can be filled in several sittings and every row names the command that remakes it."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
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


def spread(values: Sequence[float], digits: int = 3) -> dict:
    """A noisy measurement as the docs quote it: the median and the range of its runs."""
    return {
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
        "runs": len(values),
    }


def cell(s: dict | None, digits: int = 2) -> str:
    """A `spread` as a table cell: median [min-max] ("-" for none)."""
    if not s:
        return "-"
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"


def save_sitting(path: Path, rows: list[dict], **extra: object) -> None:
    """A device sitting's results file (bench/chip*.py): its rows under the command that made
    them, the date and the commit it ran (rewritten after each row, so a sitting cut short
    keeps what it measured)."""
    path.write_text(json.dumps({
        "command": shlex.join(sys.argv), "date": time.strftime("%Y-%m-%d"), "commit": commit(),
        **extra, "rows": rows,
    }, indent=1))  # fmt: skip


def run_sitting(path: Path, rows: Iterable[dict], markdown: Callable[[list[dict]], str]) -> None:
    """A sitting's rows as they are made: each one's table line printed and the file rewritten
    (`save_sitting`), then the whole table."""
    path.parent.mkdir(parents=True, exist_ok=True)
    done: list[dict] = []
    for row in rows:
        done.append(row)
        print(markdown(done[-1:]).splitlines()[-1], flush=True)
        save_sitting(path, done)
    print(markdown(done))


def sitting_rows(paths: Sequence[Path]) -> list[dict]:
    """The rows of several sittings' files, in order."""
    return [row for path in paths for row in json.loads(Path(path).read_text())["rows"]]


def sitting_parser(doc: str) -> argparse.ArgumentParser:
    """A device sitting script's command line, its own options to be added: --out DIR (where
    its results file goes) and --markdown FILE... (print those kept files' table instead)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--markdown", type=Path, nargs="+", help="print these files' table")
    return parser


def printed_kept(args: argparse.Namespace, markdown: Callable[[list[dict]], str]) -> bool:
    """Whether --markdown was given; if so, its files' table is printed (nothing runs)."""
    if args.markdown:
        print(markdown(sitting_rows(args.markdown)))
    return bool(args.markdown)


def commit() -> str | None:
    """The repository's commit the benchmark ran at (with "+changes" when the tree differs), or
    None outside a git checkout (a copy of the tree on a device host keeps its .git)."""
    import subprocess

    def git(*args: str) -> str:
        root = str(Path(__file__).resolve().parents[1])
        return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip

    try:
        head, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "-uno")
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+changes" if dirty else "")


def host_load() -> float:
    """The host's 1-minute load average: what else the cores were doing."""
    return round(os.getloadavg()[0], 2)
