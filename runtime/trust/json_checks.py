"""Strict JSON fields for outside data (build manifests): each check takes (value, where) and
returns the value (converted where a dataclass wants a tuple); a wrong value raises one
ArtifactError line naming the field by its JSON path."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from wan.errors import InputError

MAX_DIM = (1 << 31) - 1  # one dimension of an array, a video or a mesh
MAX_BYTES = (1 << 63) - 1  # byte counts (memory, traffic)
MAX_STRING = 4096  # characters of one string field
MAX_CONFIG_DEPTH = 16  # nesting of the recorded model config


class ArtifactError(InputError):
    """An artifact cannot be used here; the message says why and what to do."""


Check = Callable[[Any, str], Any]
REBUILD = "rebuild with `aot build --force`"
PLAIN_KEY = re.compile(r"[\w.:*-]{1,64}")
PLAIN_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}")  # no separators, not hidden
SHA256 = re.compile(r"[0-9a-f]{64}")
CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def at(where: str, key: Any) -> str:
    """The path of `key` in the object at `where`, printable on one line."""
    name = key if isinstance(key, str) and PLAIN_KEY.fullmatch(key) else repr(key)[:40]
    return f"{where}.{name}" if where else name


def malformed(where: str, what: str) -> ArtifactError:
    return ArtifactError(f"`{where}` {what}" if where else f"the manifest {what}")


def string(value: Any, where: str) -> str:
    if not isinstance(value, str) or len(value) > MAX_STRING or CONTROL.search(value):
        raise malformed(where, f"must be a one-line string of at most {MAX_STRING} characters")
    return value


def boolean(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise malformed(where, "must be true or false")
    return value


def integer(low: int, high: int) -> Check:
    def check(value: Any, where: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise malformed(where, f"must be an integer in [{low}, {high}]")
        return value

    return check


BYTES = integer(0, MAX_BYTES)
POSITIVE = integer(1, MAX_DIM)


def number(value: Any, where: str) -> float | int:
    """A finite non-negative number (seconds, FLOPs, FLOP/s)."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_BYTES:
        return value
    if isinstance(value, float) and math.isfinite(value) and value >= 0:
        return value
    raise malformed(where, "must be a finite non-negative number")


def fraction(value: Any, where: str) -> float | int:
    """A number in [0, 1]."""
    if number(value, where) > 1:
        raise malformed(where, "must be a number in [0, 1]")
    return value


def optional(check: Check) -> Check:
    return lambda value, where: None if value is None else check(value, where)


def key_of(registry: Mapping[str, Any]) -> Check:
    """A name registered in `registry` when the value is checked (registries may grow)."""

    def check(value: Any, where: str) -> str:
        if not isinstance(value, str) or value not in registry:
            raise malformed(where, f"must be one of {', '.join(registry)}")
        return value

    return check


def one_of(*choices: str) -> Check:
    def check(value: Any, where: str) -> str:
        if value not in choices or not isinstance(value, str):
            raise malformed(where, f"must be one of {', '.join(choices)}")
        return value

    return check


def matching(pattern: re.Pattern[str], what: str) -> Check:
    def check(value: Any, where: str) -> str:
        if not isinstance(value, str) or not pattern.fullmatch(value):
            raise malformed(where, f"must be {what}")
        return value

    return check


def as_list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise malformed(where, "must be a list")
    return value


def list_of(check: Check) -> Check:
    return lambda value, where: [
        check(v, f"{where}[{i}]") for i, v in enumerate(as_list(value, where))
    ]


def tuple_of(check: Check, length: int | None = None) -> Check:
    def tuple_check(value: Any, where: str) -> tuple[Any, ...]:
        items = tuple(list_of(check)(value, where))
        if length is not None and len(items) != length:
            raise malformed(where, f"must have {length} items")
        return items

    return tuple_check


def as_object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise malformed(where, "must be a JSON object")
    return value


def dict_of(check: Check, required: Sequence[str] = ()) -> Check:
    """An object of plain keys (names of axes, programs, collectives, options) to values."""

    def dict_check(value: Any, where: str) -> dict[str, Any]:
        for key in as_object(value, where):
            if not PLAIN_KEY.fullmatch(key):
                raise malformed(at(where, key), "is not a plain key name")
        out = {k: check(v, at(where, k)) for k, v in value.items()}
        if missing := [k for k in required if k not in out]:
            raise malformed(at(where, missing[0]), "is missing")
        return out

    return dict_check


def config(value: Any, where: str) -> dict[str, Any]:
    """A JSON object recorded for people (the model config), nested at most MAX_CONFIG_DEPTH."""
    level = [as_object(value, where)]
    for _ in range(MAX_CONFIG_DEPTH):
        level = [
            v
            for item in level
            for v in (item.values() if isinstance(item, dict) else item)
            if isinstance(v, dict | list)
        ]
    if level:
        raise malformed(where, f"is nested deeper than {MAX_CONFIG_DEPTH} levels")
    return value


def option(value: Any, where: str) -> str | int | float | bool:
    """An XLA compiler option's value."""
    if isinstance(value, str):
        return string(value, where)
    if isinstance(value, bool | int) or (isinstance(value, float) and math.isfinite(value)):
        return value
    raise malformed(where, "must be a string, number or boolean")


def fields(raw: Any, where: str, checks: dict[str, Check], defaults: dict[str, Any]) -> dict:
    """The fields of the JSON object `raw` at `where`, each checked; an absent field takes its
    default, or is an error when it has none; a field not in `checks` is an error."""
    as_object(raw, where)
    if unknown := sorted(set(raw) - set(checks)):
        raise malformed(at(where, unknown[0]), "is not a field of this schema")
    if missing := [k for k in checks if k not in raw and k not in defaults]:
        raise malformed(at(where, missing[0]), "is missing")
    return {k: checks[k](raw[k], at(where, k)) if k in raw else defaults[k] for k in checks}


def defaults(cls: type) -> dict[str, Any]:
    """The defaults of a dataclass's fields (fresh ones from each default_factory)."""
    out = {}
    for field in dataclasses.fields(cls):
        if field.default is not dataclasses.MISSING:
            out[field.name] = field.default
        elif field.default_factory is not dataclasses.MISSING:
            out[field.name] = field.default_factory()
    return out
