"""Bounded reads of the small files that come from outside (configs, manifests, store entries,
calibrations): one reader, each caller phrasing its own one-line error.

A file is opened without blocking (a FIFO would otherwise hang the process until a writer came),
must be a regular file, optionally not a symlink, and at most `limit + 1` bytes are read, so a
huge or endless file costs nothing. The reasons given to a caller's `refuse` are clauses about
the path ("is over 16 MiB"), so that `refuse` can put the path before them and a remedy after."""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

Refuse = Callable[[str], Exception]  # a reason ("is over 4 KiB") -> the caller's one-line error


def open_regular(path: Path, refuse: Refuse, *, follow_symlinks: bool = True) -> BinaryIO:
    """`path` opened for reading if it is a regular file (and, unless `follow_symlinks`, not a
    symlink); else `refuse(reason)` is raised."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise refuse("is missing") from None
    except OSError as e:
        if e.errno == errno.ELOOP and not follow_symlinks:
            raise refuse("is a symbolic link, not a file of its own") from None
        raise refuse(f"is unreadable ({e.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # before fdopen, which refuses a folder itself
        os.close(fd)
        raise refuse("is not a regular file")
    return os.fdopen(fd, "rb")


def read_text(path: Path, limit: int, refuse: Refuse, *, follow_symlinks: bool = True) -> str:
    """The UTF-8 text of the regular file `path` of at most `limit` bytes."""
    try:
        return _read(path, limit, refuse, follow_symlinks).decode("utf-8")
    except UnicodeDecodeError as e:
        raise refuse(f"is not UTF-8 text ({_decode_failure(e)})") from None


def read_json(
    path: Path,
    limit: int,
    refuse: Refuse,
    *,
    follow_symlinks: bool = True,
    allow_nan: bool = False,
) -> Any:
    """The JSON value in the regular file `path` of at most `limit` bytes: UTF-8, not nested
    beyond the parser's recursion, and without NaN or Infinity unless `allow_nan` (for callers
    whose own checks name the entry that holds one)."""
    return parse_json(_read(path, limit, refuse, follow_symlinks), refuse, allow_nan=allow_nan)


def read_bytes(path: Path, limit: int, refuse: Refuse, *, follow_symlinks: bool = True) -> bytes:
    """The bytes of the regular file `path` of at most `limit` bytes (to check a signature over
    them before `parse_json`)."""
    return _read(path, limit, refuse, follow_symlinks)


def parse_json(data: bytes, refuse: Refuse, *, allow_nan: bool = False) -> Any:
    """The JSON value of `data`, as `read_json` reads a file."""
    try:
        return json.loads(data.decode("utf-8"), parse_constant=None if allow_nan else _no_constant)
    except UnicodeDecodeError as e:
        raise refuse(f"is not valid JSON (not UTF-8: {_decode_failure(e)})") from None
    except RecursionError:
        raise refuse("is not valid JSON (nested too deeply)") from None
    except ValueError as e:  # JSONDecodeError, a constant, an integer of too many digits
        first = (str(e).splitlines() or [type(e).__name__])[0]
        # Python's advice for too many digits (raise its limit) is not the user's to take.
        first = first.partition("; use sys.set_int_max_str_digits")[0]
        raise refuse(f"is not valid JSON ({first[:200]})") from None


def check_size(path: Path, limit: int, refuse: Refuse) -> None:
    """`path` is a regular file of at most `limit` bytes, for a library that reads it by name
    itself (a sentencepiece model): its size is known before a byte is read."""
    with open_regular(path, refuse) as f:
        if os.fstat(f.fileno()).st_size > limit:
            raise refuse(f"is over {_size(limit)}")


def _size(limit: int) -> str:
    """'16 MiB', '4 KiB', '100 bytes'."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if limit >= 1 << shift and limit % (1 << shift) == 0:
            return f"{limit >> shift} {unit}"
    return f"{limit} bytes"


def _read(path: Path, limit: int, refuse: Refuse, follow_symlinks: bool) -> bytes:
    with open_regular(path, refuse, follow_symlinks=follow_symlinks) as f:
        try:
            data = f.read(limit + 1)
        except OSError as e:
            raise refuse(f"is unreadable ({e.strerror})") from None
    if len(data) > limit:
        raise refuse(f"is over {_size(limit)}")
    return data


def _decode_failure(e: UnicodeDecodeError) -> str:
    return f"{e.reason} at byte {e.start}"


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number JSON allows")
