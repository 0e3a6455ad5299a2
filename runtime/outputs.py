"""Paths a run will write, checked before anything loads: a generation must not be computed
only to be lost to a path that could never be written."""

from __future__ import annotations

import os
from pathlib import Path

from wan.errors import InputError


class OutputError(InputError):
    """A path the run would write cannot be written; the message says why."""


def check_writable(path: Path, option: str) -> None:
    """`path` can be created (or replaced) as a file: it is not a folder and its nearest
    existing ancestor is a folder this process may write into (missing folders are made)."""
    if path.is_dir():
        raise OutputError(f"{option} {path} is a folder: give a file path")
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise OutputError(f"{option} {path}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"{option} {path}: {parent} is not writable")
