"""The lexical layer of XLA's HLO text (`aot.hlo` parses modules with it): brackets matched
outside quoted strings, top-level comma splits, comments dropped, shapes (arrays with their
layouts skipped, tuples) and attribute values (quoted strings, integer lists).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

# A quoted string (with escapes), a comment, or a bracket/comma: the tokens the scanners need.
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|/\*.*?\*/|[(){}\[\],]')
_OPEN = {"(": ")", "{": "}", "[": "]"}
_ARRAY_SHAPE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")


@dataclasses.dataclass(frozen=True)
class Shape:
    """An array shape (`dtype`, `dims`) or a tuple (`dtype == "tuple"`, `tuple_shapes`)."""

    dtype: str
    dims: tuple[int, ...] = ()
    tuple_shapes: tuple[Shape, ...] = ()

    @property
    def is_tuple(self) -> bool:
        return self.dtype == "tuple"

    @property
    def elements(self) -> int:
        """Elements of an array; of a tuple, summed over its arrays."""
        if self.is_tuple:
            return sum(s.elements for s in self.tuple_shapes)
        return math.prod(self.dims)

    @property
    def bytes(self) -> int:
        """Bytes of an array (dynamic dims at their bound); of a tuple, summed over its arrays."""
        if self.is_tuple:
            return sum(s.bytes for s in self.tuple_shapes)
        return -(-self.elements * _bits(self.dtype) // 8)  # packed sub-byte types round up

    def __str__(self) -> str:
        if self.is_tuple:
            return "(" + ", ".join(map(str, self.tuple_shapes)) + ")"
        return f"{self.dtype}[{','.join(map(str, self.dims))}]"


def _bits(dtype: str) -> int:
    """Bits per element: the width in the type's name (s32, bf16, f8e4m3fn, c64); pred 8;
    token and opaque 0."""
    if dtype == "pred":
        return 8
    width = re.match(r"[a-z]+(\d+)", dtype)
    return int(width.group(1)) if width else 0


def strip_comments(s: str) -> str:
    if "/*" not in s:
        return s
    return _TOKEN.sub(lambda m: "" if m.group().startswith("/*") else m.group(), s)


def close_bracket(s: str, i: int) -> int:
    """Index of the bracket that closes the one at s[i] (strings skipped)."""
    depth = 0
    for m in _TOKEN.finditer(s, i):
        t = m.group()
        if t in _OPEN:
            depth += 1
        elif t in ")}]":
            depth -= 1
            if depth == 0:
                return m.start()
    raise ValueError(f"unbalanced brackets in HLO: {s[i : i + 80]!r}")


def split_top(s: str) -> list[str]:
    """Split at commas outside brackets and strings."""
    parts, depth, start = [], 0, 0
    for m in _TOKEN.finditer(s):
        t = m.group()
        if t in _OPEN:
            depth += 1
        elif t in ")}]":
            depth -= 1
        elif t == "," and depth == 0:
            parts.append(s[start : m.start()])
            start = m.end()
    parts.append(s[start:])
    return [p.strip() for p in parts if p.strip()]


def parse_shape(s: str, i: int) -> tuple[Shape, int]:
    """Parse a shape starting at s[i]; return it and the index after it (layouts skipped)."""
    while s[i] == " ":
        i += 1
    if s[i] == "(":
        end = close_bracket(s, i)
        elements, j = [], i + 1
        while j < end:
            if s[j] in ", ":
                j += 1
                continue
            shape, j = parse_shape(s, j)
            elements.append(shape)
        return Shape("tuple", tuple_shapes=tuple(elements)), end + 1
    m = _ARRAY_SHAPE.match(s, i)
    if m is None:
        raise ValueError(f"cannot parse HLO shape at {s[i : i + 80]!r}")
    dims = tuple(int(d.strip().lstrip("<=")) for d in m.group(2).split(",") if d.strip())
    j = m.end()
    if j < len(s) and s[j] == "{":
        j = close_bracket(s, j) + 1
    return Shape(m.group(1), dims), j


def unquote(v: str) -> str:
    """An attribute's value without its quotes, JSON escapes decoded (unquoted: unchanged)."""
    if not v.startswith('"'):
        return v
    try:
        return json.loads(v)
    except ValueError:
        return v[1:-1]


def names(value: str) -> tuple[str, ...]:
    return tuple(n.lstrip("%") for n in re.findall(r"[^\s,{}]+", value))


def ints(value: str) -> tuple[int, ...]:
    """The integers in an attribute's value, in order (`{0,2}` -> (0, 2))."""
    return tuple(int(x) for x in re.findall(r"-?\d+", value))


def open_brackets(text: str) -> int:
    """Brackets opened and not closed in `text`, outside string literals."""
    depth, quoted, escaped = 0, False, False
    for ch in text:
        if quoted:
            quoted = escaped or ch != '"'
            escaped = not escaped and ch == "\\"
        elif ch == '"':
            quoted = True
        elif ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
    return depth
