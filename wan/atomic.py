"""Publishing a folder atomically: it is written under a temporary name and renamed into place
only when complete, so readers never see half of it and a killed writer leaves no look-alike.

Nothing the tool did not write is ever removed: an old folder is replaced only when its owner
(`owned_files`) can name every file in it, and only those files are removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import stat
from collections.abc import Callable, Collection, Iterator
from pathlib import Path

from wan.errors import InputError

# `.tmp-<name>-<pid>` while a folder is written, `.old-<name>-<pid>` while it replaces another.
_TEMPORARY = re.compile(r"\.(?:tmp|old)-(.+)-\d+")


class NotOurs(InputError):
    """A folder the tool would replace holds something it did not write."""


@contextlib.contextmanager
def atomic_folder(
    final: Path, tmp: Path, owned_files: Callable[[Path], Collection[str]] | None = None
) -> Iterator[Path]:
    """Yield `tmp` to fill; on success it takes the place of `final`. An existing `final` is
    replaced only when `owned_files(final)` names what is in it (it raises NotOurs otherwise;
    without `owned_files` an existing `final` is refused), and only those files are removed.
    On any error `tmp` is removed."""
    tmp.mkdir(parents=True)
    try:
        yield tmp
        _publish(tmp, final, owned_files)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _publish(tmp: Path, final: Path, owned_files: Callable[[Path], Collection[str]] | None) -> None:
    if not os.path.lexists(final):
        os.rename(tmp, final)  # fails (ENOTEMPTY) if a folder with content appeared meanwhile
        return
    if owned_files is None:
        raise NotOurs(f"{final} exists: move it away, or choose another path")
    names = owned_files(final)
    old = final.with_name(f".old-{final.name}-{os.getpid()}")
    os.rename(final, old)
    try:
        os.rename(tmp, final)
    except BaseException:
        os.rename(old, final)
        raise
    remove_owned(old, names)


def owned_files(folder: Path, allowed: Collection[str]) -> list[str]:
    """The files in `folder` (relative paths, subfolders walked), when it is a real folder (not
    a link) whose files all have paths in `allowed` (regular files, or links: removing a link
    loses nothing); else NotOurs, naming what to move away."""
    if not stat.S_ISDIR(os.lstat(folder).st_mode):
        raise NotOurs(f"{folder} is not a folder this tool wrote: move it away and run again")
    found = []
    for name in sorted(os.listdir(folder)):
        mode = os.lstat(folder / name).st_mode
        inner = [p for p in allowed if p.startswith(f"{name}/")]
        if stat.S_ISDIR(mode) and inner:
            found += [
                f"{name}/{p}"
                for p in owned_files(folder / name, [p[len(name) + 1 :] for p in inner])
            ]
        elif name in allowed and (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
            found.append(name)
        else:
            raise NotOurs(
                f"{folder} holds {name!r}, which this tool did not write there: move it (or the "
                "whole folder) away and run again"
            )
    return found


def remove_owned(folder: Path, names: Collection[str]) -> bool:
    """Remove the files `names` (paths relative to `folder`), then the folders that emptied:
    whether `folder` is gone. Anything else (put there meanwhile) stays, with its folders."""
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            (folder / name).unlink()
    subfolders = {folder / name for path in names for name in _parents(path)}
    for sub in sorted(subfolders, key=lambda p: len(p.parts), reverse=True) + [folder]:
        try:
            sub.rmdir()
        except OSError:  # not empty (it holds something that is not ours) or gone
            if sub == folder:
                return False
    return True


def _parents(path: str) -> list[str]:
    """'a/b/c' -> ['a', 'a/b']."""
    parts = path.split("/")[:-1]
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


def temporaries(parent: Path, name: str | None = None) -> list[Path]:
    """The folders atomic_folder left in `parent` when its process was killed (of `name`, or
    of any name)."""
    if not parent.is_dir():
        return []
    return sorted(
        parent / entry
        for entry in os.listdir(parent)
        if (m := _TEMPORARY.fullmatch(entry)) and name in (None, m.group(1))
    )


@contextlib.contextmanager
def locked(
    path: Path, shared: bool = False, waiting: Callable[[], None] | None = None
) -> Iterator[None]:
    """Hold a lock on `path` (created with its folder) until the block ends: exclusive, or
    `shared` with other shared holders; `waiting()` is called first when it must wait. The
    kernel drops the lock if the process dies."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
        try:
            fcntl.flock(f, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting is not None:
                waiting()
            fcntl.flock(f, mode)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
