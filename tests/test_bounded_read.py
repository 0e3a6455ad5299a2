"""wan.bounded_read, the one reader of small outside files: a FIFO refused without blocking, a
symlink refused where the caller asks, a size bound, strict JSON; each refusal is the caller's
error with one clause about the path."""

from __future__ import annotations

import math
import os
import re

import pytest

from wan.bounded_read import read_json, read_text


class Refused(Exception):
    pass


def refuse(reason: str) -> Refused:
    return Refused(reason)


@pytest.mark.parametrize(
    ("content", "limit", "reason"),
    [
        (b" " * 65 + b"[]", 64, "is over 64 bytes"),
        (b"[" + b" " * (4 << 10) + b"]", 4 << 10, "is over 4 KiB"),
        (b"[1, NaN]", 64, "is not valid JSON (NaN is not a number JSON allows)"),
        (b"[-Infinity]", 64, "is not valid JSON (-Infinity is not a number JSON allows)"),
        (b"[1, 2", 64, "is not valid JSON (Expecting"),
        (b"\xff[]", 64, "is not valid JSON (not UTF-8: invalid start byte at byte 0)"),
        (b"[" * 100_000 + b"]" * 100_000, 1 << 20, "is not valid JSON (nested too deeply)"),
    ],
)
def test_refused_json(tmp_path, content, limit, reason):
    (tmp_path / "f.json").write_bytes(content)
    with pytest.raises(Refused, match=f"^{re.escape(reason)}"):
        read_json(tmp_path / "f.json", limit, refuse)


def test_nan_where_allowed(tmp_path):
    (tmp_path / "f.json").write_bytes(b"[NaN, 1]")
    value = read_json(tmp_path / "f.json", 64, refuse, allow_nan=True)
    assert math.isnan(value[0]) and value[1] == 1


def test_not_a_regular_file(tmp_path):
    os.mkfifo(tmp_path / "fifo")  # a blocking open would wait for a writer forever
    for path, reason in [
        (tmp_path / "fifo", "is not a regular file"),
        (tmp_path, "is not a regular file"),
        (tmp_path / "missing", "is missing"),
    ]:
        with pytest.raises(Refused, match=f"^{reason}$"):
            read_json(path, 64, refuse)


def test_symlinks_refused_only_where_asked(tmp_path):
    (tmp_path / "real.json").write_text('{"a": 1}')
    (tmp_path / "link.json").symlink_to(tmp_path / "real.json")
    assert read_json(tmp_path / "link.json", 64, refuse) == {"a": 1}
    with pytest.raises(Refused, match="^is a symbolic link"):
        read_json(tmp_path / "link.json", 64, refuse, follow_symlinks=False)


def test_text(tmp_path):
    (tmp_path / "t.txt").write_bytes("caf\u00e9".encode())
    assert read_text(tmp_path / "t.txt", 5, refuse) == "caf\u00e9"
    (tmp_path / "t.txt").write_bytes(b"caf\xe9")
    with pytest.raises(Refused, match=r"^is not UTF-8 text \(unexpected end of data at byte 3\)"):
        read_text(tmp_path / "t.txt", 5, refuse)
