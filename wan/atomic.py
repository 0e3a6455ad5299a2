"""Publishing a folder atomically: it is written under a temporary name and renamed into place
only when complete, so readers never see half of it and a killed writer leaves no look-alike."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_folder(final: Path, tmp: Path) -> Iterator[Path]:
    """Yield `tmp` to fill; on success it replaces `final` (an old `final` is moved aside
    first, then removed), on any error it is removed."""
    tmp.mkdir(parents=True)
    try:
        yield tmp
        old = final.with_name(f".old-{final.name}-{os.getpid()}")
        if final.exists():
            os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path` (created with its folder) until the block ends; the
    kernel drops it if the process dies."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
