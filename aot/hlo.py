"""Read XLA's optimized HLO text (`compiled.as_text()`): loops, collectives, FLOPs.

Why this exists: `compiled.cost_analysis()` counts a while loop's body once, so a 40-layer
`scan` reports about one layer, and collectives only show up in the optimized HLO. This module
parses the text, works out how many times each computation runs per program execution (loop
trip counts multiply, nested loops compound), and from that

- lists the collectives with their per-device bytes and source location (`collectives`),
- counts FLOPs the way XLA's HloCostAnalysis does, with the loop trip counts applied (`cost`).

The parser is written against real CPU and TPU output: long `backend_config` JSON with braces
and quoted strings, tiled layouts (`{1,0:T(8,128)(2,1)S(1)}`), tuple shapes with
`/*index=5*/` comments, new-style `replica_groups=mesh[...] {...}`, and source locations either
inline (`source_file=`, `source_line=`) or through the module's `StackFrames` tables.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections import Counter
from collections.abc import Iterable

# Elementwise ops: HloCostAnalysis counts one op per output element, as a transcendental for
# the ops below and as a FLOP for the others.
_TRANSCENDENTAL = frozenset(
    [
        "atan2",
        "cbrt",
        "cosine",
        "erf",
        "exponential",
        "exponential-minus-one",
        "log",
        "log-plus-one",
        "logistic",
        "power",
        "rsqrt",
        "sine",
        "sqrt",
        "tan",
        "tanh",
    ]
)
_ELEMENTWISE = _TRANSCENDENTAL | frozenset(
    [
        "abs",
        "add",
        "and",
        "bitcast-convert",
        "ceil",
        "clamp",
        "compare",
        "complex",
        "convert",
        "count-leading-zeros",
        "divide",
        "floor",
        "imag",
        "is-finite",
        "maximum",
        "minimum",
        "multiply",
        "negate",
        "not",
        "or",
        "popcnt",
        "real",
        "reduce-precision",
        "remainder",
        "round-nearest-afz",
        "round-nearest-even",
        "select",
        "shift-left",
        "shift-right-arithmetic",
        "shift-right-logical",
        "sign",
        "stochastic-convert",
        "subtract",
        "xor",
    ]
)

# Collective opcodes -> normalised kind. Async pairs are counted at their -start.
COLLECTIVES = {
    "all-to-all": "all-to-all",
    "ragged-all-to-all": "ragged-all-to-all",
    "all-gather": "all-gather",
    "all-gather-start": "all-gather",
    "all-reduce": "all-reduce",
    "all-reduce-start": "all-reduce",
    "reduce-scatter": "reduce-scatter",
    "collective-permute": "collective-permute",
    "collective-permute-start": "collective-permute",
    "collective-broadcast": "collective-broadcast",
}

# Custom-call targets known to do no arithmetic (TPU scratch allocation).
_BOOKKEEPING_CUSTOM_CALLS = frozenset(["AllocateBuffer"])

# Attributes that name called computations.
_CALL_ATTRS = (
    "calls",
    "to_apply",
    "condition",
    "body",
    "branch_computations",
    "true_computation",
    "false_computation",
    "select",
    "scatter",
    "called_computations",
)

# A quoted string (with escapes), a comment, or a bracket/comma: the tokens the scanners need.
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|/\*.*?\*/|[(){}\[\],]')
_OPEN = {"(": ")", "{": "}", "[": "]"}
_METADATA_FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|[^\s}]+)')
_KNOWN_TRIP_COUNT = re.compile(r'known_trip_count\\?"\s*:\s*\{\s*\\?"n\\?"\s*:\s*\\?"?(\d+)')
_TABLE_ROW = re.compile(r"^(\d+)\s+(.*)$")
_ARRAY_SHAPE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_OPCODE = re.compile(r"\s*([\w-]+)\(")
_HEADER = re.compile(r"(ENTRY\s+)?%?([^\s(]+)")


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


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    opcode: str
    shape: Shape
    operands: tuple[str, ...]  # instruction names
    attrs: dict[str, str]  # raw attribute text by key (metadata, backend_config, dims, ...)
    calls: tuple[tuple[str, str], ...]  # (attribute, computation name) in order
    computation: str
    literal: str | None = None  # text inside constant(...) / parameter(...)
    op_name: str | None = None
    source_file: str | None = None
    source_line: int | None = None


@dataclasses.dataclass(frozen=True)
class Computation:
    name: str
    instructions: tuple[Instruction, ...]
    root: Instruction
    is_entry: bool


@dataclasses.dataclass(frozen=True)
class Loop:
    """A while loop and its trip count; `trip_count` is None when it could not be derived."""

    name: str  # the while instruction
    computation: str
    body: str
    condition: str
    trip_count: int | None
    source: str  # "known_trip_count" (backend_config), "condition" (derived), "unknown"


@dataclasses.dataclass(frozen=True)
class Module:
    name: str
    computations: dict[str, Computation]
    entry: str
    instructions: dict[str, Instruction]  # HLO instruction names are unique per module
    loops: dict[str, Loop]  # by while instruction name
    # Times each computation is entered per program execution: entry 1, while body and
    # condition x trip count (unknown: x1), everything else (fusions, calls, async, every
    # branch of a conditional) inherits its caller's count, summed over call sites. A reducer (to_apply) counts once per call of its caller, not per
    # element. Computations unreachable from the entry are absent.
    multipliers: dict[str, int]

    def operand(self, instruction: Instruction, i: int) -> Instruction:
        return self.instructions[instruction.operands[i]]


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of the HLO.

    `bytes` is the size of the result on one device for one execution: for all-gather the
    gathered output, for reduce-scatter the scattered (small) output, for all-reduce,
    all-to-all and collective-permute the output (same size as the input). For the async
    `all-gather-start` / `collective-permute-start` (tuples that carry the input too) it is the
    output element only; the matching `-done` is not listed.
    """

    kind: str  # all-to-all, all-gather, all-reduce, reduce-scatter, collective-permute, ...
    name: str
    opcode: str
    computation: str
    count: int  # executions per program execution (loop multipliers applied)
    bytes: int  # per device, per execution
    shape: Shape
    replica_groups: str | None
    dimensions: tuple[int, ...] | None  # set for array-form all-to-all / all-gather etc.
    op_name: str | None
    source_file: str | None
    source_line: int | None


@dataclasses.dataclass(frozen=True)
class Cost:
    """FLOPs and transcendentals per program execution, loop trip counts applied."""

    flops: float
    transcendentals: float
    unknown_loops: tuple[str, ...]  # while instructions counted once (trip count unknown)
    custom_calls: dict[str, str]  # custom-call name -> target: work not counted (see cost)


def _bits(dtype: str) -> int:
    """Bits per element: the width in the type's name (s32, bf16, f8e4m3fn, c64); pred 8;
    token and opaque 0."""
    if dtype == "pred":
        return 8
    width = re.match(r"[a-z]+(\d+)", dtype)
    return int(width.group(1)) if width else 0


# ---------------------------------------------------------------------------- text scanning


def _strip_comments(s: str) -> str:
    if "/*" not in s:
        return s
    return _TOKEN.sub(lambda m: "" if m.group().startswith("/*") else m.group(), s)


def _close(s: str, i: int) -> int:
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


def _split_top(s: str) -> list[str]:
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


def _parse_shape(s: str, i: int) -> tuple[Shape, int]:
    """Parse a shape starting at s[i]; return it and the index after it (layouts skipped)."""
    while s[i] == " ":
        i += 1
    if s[i] == "(":
        end = _close(s, i)
        elements, j = [], i + 1
        while j < end:
            if s[j] in ", ":
                j += 1
                continue
            shape, j = _parse_shape(s, j)
            elements.append(shape)
        return Shape("tuple", tuple_shapes=tuple(elements)), end + 1
    m = _ARRAY_SHAPE.match(s, i)
    if m is None:
        raise ValueError(f"cannot parse HLO shape at {s[i : i + 80]!r}")
    dims = tuple(int(d.strip().lstrip("<=")) for d in m.group(2).split(",") if d.strip())
    j = m.end()
    if j < len(s) and s[j] == "{":
        j = _close(s, j) + 1
    return Shape(m.group(1), dims), j


def _unquote(v: str) -> str:
    if not v.startswith('"'):
        return v
    try:
        return json.loads(v)
    except ValueError:
        return v[1:-1]


def _names(value: str) -> tuple[str, ...]:
    return tuple(n.lstrip("%") for n in re.findall(r"[^\s,{}]+", value))


def _ints(value: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"-?\d+", value))


# ---------------------------------------------------------------------------- parsing


@dataclasses.dataclass
class _StackTables:
    files: dict[int, str] = dataclasses.field(default_factory=dict)
    locations: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)
    frames: dict[int, int] = dataclasses.field(default_factory=dict)

    def add(self, section: str, line: str) -> None:
        m = _TABLE_ROW.match(line.strip())
        if m is None:
            return
        key, rest = int(m.group(1)), m.group(2)
        fields = dict(_METADATA_FIELD.findall(rest))
        if section == "FileNames":
            self.files[key] = _unquote(rest)
        elif section == "FileLocations":
            self.locations[key] = (int(fields["file_name_id"]), int(fields["line"]))
        elif section == "StackFrames":
            self.frames[key] = int(fields["file_location_id"])

    def location(self, frame_id: int) -> tuple[str | None, int | None]:
        """Innermost source location of a stack frame."""
        loc = self.locations.get(self.frames.get(frame_id, -1))
        if loc is None:
            return None, None
        return self.files.get(loc[0]), loc[1]


def _parse_instruction(line: str, computation: str, tables: _StackTables) -> Instruction:
    s = _strip_comments(line.strip())
    s = s.removeprefix("ROOT ")
    eq = s.index("=")
    name = s[:eq].strip().lstrip("%")
    shape, i = _parse_shape(s, eq + 1)
    m = _OPCODE.match(s, i)
    if m is None:
        raise ValueError(f"cannot parse HLO instruction: {line.strip()[:120]!r}")
    opcode, open_paren = m.group(1), m.end() - 1
    close = _close(s, open_paren)
    inside = s[open_paren + 1 : close]
    literal, operands = None, ()
    if opcode in ("constant", "parameter"):
        literal = inside.strip()
    else:
        operands = tuple(op.split()[-1].lstrip("%") for op in _split_top(inside))
    attrs = {}
    for part in _split_top(s[close + 1 :]):
        key, _, value = part.partition("=")
        attrs[key.strip()] = value.strip()
    calls = tuple(
        (key, callee) for key in _CALL_ATTRS if key in attrs for callee in _names(attrs[key])
    )
    meta = dict(_METADATA_FIELD.findall(attrs.get("metadata", "")))
    source_file = _unquote(meta["source_file"]) if "source_file" in meta else None
    source_line = int(meta["source_line"]) if "source_line" in meta else None
    if source_file is None and "stack_frame_id" in meta:
        source_file, source_line = tables.location(int(meta["stack_frame_id"]))
    return Instruction(
        name=name,
        opcode=opcode,
        shape=shape,
        operands=operands,
        attrs=attrs,
        calls=calls,
        computation=computation,
        literal=literal,
        op_name=_unquote(meta["op_name"]) if "op_name" in meta else None,
        source_file=source_file,
        source_line=source_line,
    )


def _open_brackets(text: str) -> int:
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


def parse(hlo_text: str) -> Module:
    """Parse the text of one HLO module (as printed by `compiled.as_text()`)."""
    module_name, entry = "", None
    tables = _StackTables()
    computations: dict[str, Computation] = {}
    section = None  # stack-table section being read
    current: tuple[str, bool, list[tuple[Instruction, bool]]] | None = None  # (ins, is_root)
    pending = ""  # an instruction whose attributes span lines (a Pallas kernel's metadata)
    for line in hlo_text.splitlines():
        stripped = line.strip()
        if current is not None and (pending or (stripped.endswith("{") and "=" in stripped)):
            pending = f"{pending} {stripped}" if pending else stripped
            if _open_brackets(pending) > 0:
                continue
            stripped, pending = pending, ""
        if current is not None:
            # A computation closes with "}" or, for one on another execution thread (TPU
            # SparseCore), '}, execution_thread="sparsecore"'.
            if stripped == "}" or stripped.startswith("}, "):
                name, is_entry, body = current
                instructions = tuple(ins for ins, _ in body)
                root = next((ins for ins, is_root in body if is_root), instructions[-1])
                computations[name] = Computation(name, instructions, root, is_entry)
                current = None
            elif stripped:
                ins = _parse_instruction(stripped, current[0], tables)
                current[2].append((ins, stripped.startswith("ROOT ")))
            continue
        if not stripped:
            section = None
        elif line.startswith("HloModule"):
            module_name = re.split(r"[\s,]", line)[1]
        elif stripped in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = stripped
        elif section is not None:
            tables.add(section, stripped)
        elif stripped.endswith("{"):
            m = _HEADER.match(stripped)
            current = (m.group(2), bool(m.group(1)), [])
            if m.group(1):
                entry = m.group(2)
    if entry is None:
        raise ValueError("no ENTRY computation in HLO text")
    instructions = {ins.name: ins for c in computations.values() for ins in c.instructions}
    partial = Module(module_name, computations, entry, instructions, {}, {})
    loops = {
        ins.name: _loop(partial, ins) for ins in instructions.values() if ins.opcode == "while"
    }
    partial = dataclasses.replace(partial, loops=loops)
    return dataclasses.replace(partial, multipliers=_multipliers(partial))


# ---------------------------------------------------------------------------- loops


def _through(module: Module, ins: Instruction) -> Instruction:
    """Look through copies and bitcasts (they do not change a scalar's value)."""
    while ins.opcode in ("copy", "bitcast") and ins.operands:
        ins = module.operand(ins, 0)
    return ins


def _inline(module: Module, ins: Instruction) -> tuple[Instruction, list[Instruction]]:
    """An instruction and its operands; a fusion is replaced by its root, whose parameters are
    mapped back to the fusion's operands (XLA wraps single ops like `compare` in fusions)."""
    ins = _through(module, ins)
    if ins.opcode != "fusion":
        return ins, [module.operand(ins, i) for i in range(len(ins.operands))]
    root = module.computations[ins.calls[0][1]].root
    operands = []
    for name in root.operands:
        inner = module.instructions[name]
        if inner.opcode == "parameter":
            inner = module.operand(ins, int(inner.literal))
        operands.append(inner)
    return root, operands


def _scalar_constant(module: Module, ins: Instruction) -> int | None:
    ins = _through(module, ins)
    if ins.opcode != "constant" or ins.shape.dims:
        return None
    try:
        return int(ins.literal)
    except ValueError:
        return None


def _tuple_index(module: Module, ins: Instruction, parameter: str) -> int | None:
    """k if `ins` is get-tuple-element(parameter, index=k), else None."""
    ins = _through(module, ins)
    if ins.opcode == "get-tuple-element" and ins.operands[0] == parameter:
        return int(ins.attrs["index"])
    return None


def _trip_count(direction: str, init: int, bound: int, step: int) -> int | None:
    if step == 0:
        return None
    if direction in ("LT", "LE") and step > 0:
        end = bound + (direction == "LE")
        return max(0, -(-(end - init) // step))
    if direction in ("GT", "GE") and step < 0:
        end = bound - (direction == "GE")
        return max(0, -(-(init - end) // -step))
    if direction == "NE" and (bound - init) % step == 0 and (bound - init) // step >= 0:
        return (bound - init) // step
    return None


def _derive_trip_count(module: Module, xla_while: Instruction) -> int | None:
    """Trip count of `while (i < N) { i += s }` with i's start, N and s constants.

    The condition compares a tuple element (the induction variable) with a constant, or with a
    tuple element that stays constant (initialised to a constant, passed through unchanged).
    """
    cond = module.computations[xla_while.attrs["condition"].lstrip("%")]
    body = module.computations[xla_while.attrs["body"].lstrip("%")]
    compare, sides = _inline(module, cond.root)
    if compare.opcode != "compare" or len(sides) != 2:
        return None
    init_tuple = _through(module, module.operand(xla_while, 0))
    body_root = _through(module, body.root)
    if init_tuple.opcode != "tuple" or body_root.opcode != "tuple":
        return None
    cond_param = next(i.name for i in cond.instructions if i.opcode == "parameter")
    body_param = next(i.name for i in body.instructions if i.opcode == "parameter")

    def init_of(k: int) -> int | None:
        return _scalar_constant(module, module.operand(init_tuple, k))

    def value_of(side: Instruction) -> tuple[int | None, int | None]:
        """(tuple index, constant value) of one side of the comparison."""
        k = _tuple_index(module, side, cond_param)
        if k is None:
            return None, _scalar_constant(module, side)
        invariant = _tuple_index(module, module.operand(body_root, k), body_param) == k
        return k, init_of(k) if invariant else None

    (k_lhs, c_lhs), (k_rhs, c_rhs) = value_of(sides[0]), value_of(sides[1])
    direction = compare.attrs.get("direction", "")
    if k_lhs is not None and c_rhs is not None and c_lhs is None:
        k, bound = k_lhs, c_rhs
    elif k_rhs is not None and c_lhs is not None and c_rhs is None:
        k, bound = k_rhs, c_lhs
        direction = {"LT": "GT", "LE": "GE", "GT": "LT", "GE": "LE"}.get(direction, direction)
    else:
        return None
    init = init_of(k)
    update, terms = _inline(module, module.operand(body_root, k))
    if init is None or update.opcode not in ("add", "subtract") or len(terms) != 2:
        return None
    if _tuple_index(module, terms[0], body_param) == k:
        step = _scalar_constant(module, terms[1])
    elif update.opcode == "add" and _tuple_index(module, terms[1], body_param) == k:
        step = _scalar_constant(module, terms[0])
    else:
        return None
    if step is None:
        return None
    return _trip_count(direction, init, bound, -step if update.opcode == "subtract" else step)


def _loop(module: Module, xla_while: Instruction) -> Loop:
    known = _KNOWN_TRIP_COUNT.search(xla_while.attrs.get("backend_config", ""))
    if known:
        trips, source = int(known.group(1)), "known_trip_count"
    else:
        trips = _derive_trip_count(module, xla_while)
        source = "condition" if trips is not None else "unknown"
    return Loop(
        name=xla_while.name,
        computation=xla_while.computation,
        body=xla_while.attrs["body"].lstrip("%"),
        condition=xla_while.attrs["condition"].lstrip("%"),
        trip_count=trips,
        source=source,
    )


def _call_edges(module: Module, ins: Instruction) -> list[tuple[str, int]]:
    """(callee, times per execution of `ins`) for the computations `ins` runs."""
    if ins.opcode in ("async-done", "async-update"):  # the async-start already ran it
        return []
    factor = 1
    if ins.opcode == "while":
        factor = module.loops[ins.name].trip_count or 1
    return [(callee, factor) for _, callee in ins.calls]


def _multipliers(module: Module) -> dict[str, int]:
    order, seen = [], set()

    def visit(name: str) -> None:  # post-order over the call graph (a DAG)
        seen.add(name)
        for ins in module.computations[name].instructions:
            for callee, _ in _call_edges(module, ins):
                if callee not in seen:
                    visit(callee)
        order.append(name)

    visit(module.entry)
    counts = dict.fromkeys(reversed(order), 0)  # callers before callees
    counts[module.entry] = 1
    for name in counts:
        for ins in module.computations[name].instructions:
            for callee, factor in _call_edges(module, ins):
                counts[callee] += counts[name] * factor
    return counts


def loops(module: Module) -> list[Loop]:
    """The while loops that run (reachable from the entry), callers before callees."""
    return [
        module.loops[ins.name]
        for name in module.multipliers
        for ins in module.computations[name].instructions
        if ins.opcode == "while"
    ]


# ---------------------------------------------------------------------------- collectives


def collectives(module: Module) -> list[Collective]:
    """Every collective that runs, callers before callees, with its executions per run.

    A collective without metadata (TPU puts some inside fusions) takes its op_name and source
    location from the instruction that calls its computation.
    """
    callers = {callee: ins for ins in module.instructions.values() for _, callee in ins.calls}
    found = []
    for comp_name, count in module.multipliers.items():
        for ins in module.computations[comp_name].instructions:
            kind = COLLECTIVES.get(ins.opcode)
            if kind is None:
                continue
            located = ins
            while located.op_name is None and located.computation in callers:
                located = callers[located.computation]
            shape = ins.shape
            if ins.opcode in ("all-gather-start", "collective-permute-start") and shape.is_tuple:
                shape = shape.tuple_shapes[1]  # (input, output, ...): the output
            dims = ins.attrs.get("dimensions")
            found.append(
                Collective(
                    kind=kind,
                    name=ins.name,
                    opcode=ins.opcode,
                    computation=comp_name,
                    count=count,
                    bytes=shape.bytes,
                    shape=shape,
                    replica_groups=ins.attrs.get("replica_groups"),
                    dimensions=_ints(dims) if dims is not None else None,
                    op_name=located.op_name,
                    source_file=located.source_file,
                    source_line=located.source_line,
                )
            )
    return found


def collective_summary(source: Module | Iterable[Collective]) -> dict[str, dict[str, int]]:
    """Per kind: `count`/`bytes` executed per program run (loop multipliers applied) and
    `static_count`/`static_bytes` over the instructions as written (each counted once).
    `source` is a module (all its collectives) or a selection from `collectives`."""
    items = collectives(source) if isinstance(source, Module) else source
    summary: dict[str, dict[str, int]] = {}
    for c in items:
        s = summary.setdefault(
            c.kind, {"count": 0, "bytes": 0, "static_count": 0, "static_bytes": 0}
        )
        s["count"] += c.count
        s["bytes"] += c.count * c.bytes
        s["static_count"] += 1
        s["static_bytes"] += c.bytes
    return summary


# ---------------------------------------------------------------------------- FLOPs


def _window(ins: Instruction) -> list[dict[str, int]]:
    """Per spatial dimension: size, stride, pad_lo, pad_hi, lhs_dilate, rhs_dilate."""
    text = ins.attrs.get("window", "").strip("{}")
    fields = dict(f.split("=", 1) for f in text.split() if "=" in f)
    if "size" not in fields:
        return []
    sizes = [int(x) for x in fields["size"].split("x")]
    n = len(sizes)

    def per_dim(key: str, default: int) -> list[int]:
        return [int(x) for x in fields[key].split("x")] if key in fields else [default] * n

    pads = (
        [tuple(int(p) for p in x.split("_")) for x in fields["pad"].split("x")]
        if "pad" in fields
        else [(0, 0)] * n
    )
    strides, base = per_dim("stride", 1), per_dim("lhs_dilate", 1)
    dilation = per_dim("rhs_dilate", 1)
    return [
        dict(
            size=sizes[d],
            stride=strides[d],
            pad_lo=pads[d][0],
            pad_hi=pads[d][1],
            lhs_dilate=base[d],
            rhs_dilate=dilation[d],
        )
        for d in range(n)
    ]


def _valid_positions(w: dict[str, int], in_size: int, out_size: int, k_size: int) -> int:
    """Number of (output, kernel) position pairs that read an input element, as XLA counts."""
    if (
        in_size == out_size == k_size == w["lhs_dilate"]
        and w["rhs_dilate"] == 1
        and max(1, in_size - 1) == w["stride"]
        and w["pad_lo"] == w["pad_hi"] == 0
    ):
        return in_size
    if (
        in_size == 1
        and k_size == out_size
        and w["rhs_dilate"] == w["lhs_dilate"] == w["stride"] == 1
        and w["pad_lo"] == w["pad_hi"] == out_size - 1
    ):
        return out_size
    count = 0
    for k in range(k_size):
        if w["stride"] == 1 and w["lhs_dilate"] == 1:
            base = w["pad_lo"] - k * w["rhs_dilate"]
            count += max(min(in_size + base, out_size) - max(base, 0), 0)
            continue
        for o in range(out_size):
            undilated = o * w["stride"] - w["pad_lo"] + k * w["rhs_dilate"]
            if undilated % w["lhs_dilate"] == 0 and 0 <= undilated // w["lhs_dilate"] < in_size:
                count += 1
    return count


def _convolution_flops(module: Module, ins: Instruction) -> float:
    lhs, rhs = module.operand(ins, 0).shape, module.operand(ins, 1).shape
    lhs_labels, rhs_out = ins.attrs["dim_labels"].split("_", 1)
    rhs_labels, out_labels = rhs_out.split("->")
    batch = lhs.dims[lhs_labels.index("b")]
    in_feature = lhs.dims[lhs_labels.index("f")]
    out_feature = ins.shape.dims[out_labels.index("f")]
    positions = 1
    for d, w in enumerate(_window(ins)):
        label = str(d)
        positions *= _valid_positions(
            w,
            lhs.dims[lhs_labels.index(label)],
            ins.shape.dims[out_labels.index(label)],
            rhs.dims[rhs_labels.index(label)],
        )
    groups = int(ins.attrs.get("feature_group_count", 1))
    batch_groups = int(ins.attrs.get("batch_group_count", 1))
    return 2.0 * (in_feature // groups) * out_feature * (batch // batch_groups) * positions


def _reduce_window_count(ins: Instruction) -> int:
    window = _window(ins)
    out = ins.shape.tuple_shapes[0] if ins.shape.is_tuple else ins.shape
    size = math.prod(w["size"] for w in window)
    count = (size - 1) * out.elements
    # XLA counts a reduce-window that is a reduce plus a broadcast along one dimension (a
    # cumulative op) as that reduce.
    reduced = [d for d, w in enumerate(window) if w["size"] != 1]
    padded = [d for d, w in enumerate(window) if w["pad_lo"] or w["pad_hi"]]
    if len(reduced) == 1 and len(padded) == 1 and not ins.shape.is_tuple:
        for d, w in enumerate(window):
            if (
                w["size"] != 1
                and w["pad_lo"] == w["pad_hi"] != 0
                and w["size"] == 2 * w["pad_lo"] + 1
            ):
                if w["pad_lo"] == out.dims[d] - 1:
                    size = out.dims[d]
                    count = out.elements // size + size - 1
                break
    return count


class _Counter:
    """HloCostAnalysis-style recursion over computations, with loop trip counts applied."""

    def __init__(self, module: Module):
        self.module = module
        self.memo: dict[str, tuple[float, float]] = {}
        self.unknown_loops: set[str] = set()
        self.custom_calls: dict[str, str] = {}

    def computation(self, name: str) -> tuple[float, float]:
        if name not in self.memo:
            totals = [self.instruction(ins) for ins in self.module.computations[name].instructions]
            self.memo[name] = (sum(t[0] for t in totals), sum(t[1] for t in totals))
        return self.memo[name]

    def scaled(self, name: str, n: float) -> tuple[float, float]:
        flops, trans = self.computation(name)
        return flops * n, trans * n

    def instruction(self, ins: Instruction) -> tuple[float, float]:
        m, op, out = self.module, ins.opcode, ins.shape
        called = [c for _, c in ins.calls]
        if op in _ELEMENTWISE:
            return (
                (0.0, float(out.elements)) if op in _TRANSCENDENTAL else (float(out.elements), 0.0)
            )
        if op in ("dot", "scaled-dot"):
            lhs = m.operand(ins, 0).shape
            width = math.prod(lhs.dims[d] for d in _ints(ins.attrs.get("lhs_contracting_dims", "")))
            return 2.0 * out.elements * width, 0.0
        if op == "convolution":
            return _convolution_flops(m, ins), 0.0
        if op == "fusion":
            inner = m.computations[called[0]].instructions
            if ins.attrs.get("kind") == "kCustom":  # XLA costs these by their gather/scatter
                for sub in inner:
                    if sub.opcode == "gather":
                        return 0.0, 0.0
                    if sub.opcode == "scatter":
                        return self.instruction(sub)
            return self.computation(called[0])
        if op == "while":
            loop = m.loops[ins.name]
            if loop.trip_count is None:
                self.unknown_loops.add(ins.name)
            trips = loop.trip_count if loop.trip_count is not None else 1
            body, cond = self.computation(loop.body), self.computation(loop.condition)
            return (body[0] + cond[0]) * trips, (body[1] + cond[1]) * trips
        if op in ("call", "async-start"):
            return self.computation(called[0])
        if op == "conditional":
            branches = [self.computation(c) for c in called]
            return max(b[0] for b in branches), max(b[1] for b in branches)
        if op == "reduce":
            result = out.tuple_shapes[0] if out.is_tuple else out
            return self.scaled(called[0], m.operand(ins, 0).shape.elements - result.elements)
        if op == "reduce-window":
            return self.scaled(called[0], _reduce_window_count(ins))
        if op == "map":
            return self.scaled(called[0], out.elements)
        if op == "scatter":
            n = (len(ins.operands) - 1) // 2
            return self.scaled(called[0], m.operand(ins, n + 1).shape.elements)
        if op == "select-and-scatter":
            source = m.operand(ins, 1).shape.elements
            window = math.prod(w["size"] for w in _window(ins))
            select = self.scaled(called[0], source * (window - 1))
            scatter = self.scaled(called[1], source)
            return select[0] + scatter[0], select[1] + scatter[1]
        if op == "sort":
            n = m.operand(ins, 0).shape.elements
            return float(n * (n - 1).bit_length()), 0.0  # n x ceil(log2 n)
        if op in ("all-reduce", "all-reduce-start"):  # XLA assumes 2 replicas: 1 op per element
            return float(out.elements), 0.0
        if op == "fft":
            lengths = _ints(ins.attrs.get("fft_length", ""))
            real = m.operand(ins, 0).shape
            log_factors = math.prod(n.bit_length() - 1 for n in lengths)  # floor(log2 n)
            return 8.0 * log_factors * real.elements, 0.0
        if op == "triangular-solve":
            a, b = m.operand(ins, 0).shape, m.operand(ins, 1).shape
            return 2.0 * a.dims[-1] * b.elements, 0.0
        if op == "cholesky":
            a = m.operand(ins, 0).shape
            return float(a.dims[-1] * a.elements // 3), 0.0
        if op in ("rng", "rng-bit-generator"):
            return 0.0, float(out.elements)
        if op == "custom-call":
            target = _unquote(ins.attrs.get("custom_call_target", ""))
            if target not in _BOOKKEEPING_CUSTOM_CALLS:
                self.custom_calls[ins.name] = target
        return 0.0, 0.0


def cost(module: Module) -> Cost:
    """FLOPs and transcendentals of one execution, counted like XLA's HloCostAnalysis (dots
    2 x output x contracted size, convolutions 2 x output x kernel window x input features per
    group, elementwise ops 1 per output element, reductions (input - output elements) x reducer)
    but with while bodies and conditions multiplied by their trip counts. Differences from XLA:
    a custom-call counts 0 (XLA: -1) and is listed unless it is known bookkeeping (a Pallas
    kernel's work is invisible here); a loop of unknown trip count counts once and is listed."""
    counter = _Counter(module)
    flops, trans = counter.computation(module.entry)
    return Cost(flops, trans, tuple(sorted(counter.unknown_loops)), counter.custom_calls)


def flops(module: Module) -> float:
    """FLOPs per execution with loop trip counts applied (see `cost`)."""
    return cost(module).flops


# ----------------------------------------------------------------------------------------------
# Gathered bytes of a chunked decode (the VAE: first chunk alone, later chunks in one scan).

WINDOWED_GATHER = "windowed_dot_general_body_ag"  # XLA's name for a permute-ring all-gather


@dataclasses.dataclass(frozen=True)
class Gathers:
    first: int  # bytes gathered per device outside the chunk scan (the first chunk)
    per_trip: int  # bytes per trip of the chunk scan: one latent frame in steady state
    trips: int
    all_to_all: int  # all-to-all executions per run
    top: list[tuple[str, int]]  # (op_name, bytes per run) of the largest gathers

    @property
    def per_latent_frame(self) -> int:
        return max(self.first, self.per_trip)


def _reachable(module: Module, root: str) -> set[str]:
    seen, todo = set(), [root]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(c for ins in module.computations[name].instructions for _, c in ins.calls)
    return seen


def chunk_scan(module: Module) -> Loop | None:
    """The decode's scan over latent frames: the entry's while loop that JAX emitted (XLA adds
    loops of its own, e.g. windowed einsums, whose op_name is not JAX's `while`)."""
    scans = [
        loop
        for loop in loops(module)
        if loop.computation == module.entry
        and (module.instructions[loop.name].op_name or "").endswith("/while")
    ]
    return scans[0] if len(scans) == 1 else None


def gathers(module: Module) -> Gathers:
    """The gathered bytes of a chunked decode (e.g. the VAE's), split into its chunk scan and
    the rest (a module without one chunk scan counts everything as `first`)."""
    scan = chunk_scan(module)
    body = _reachable(module, scan.body) if scan else set()
    found = collectives(module)
    gathered = [
        c
        for c in found
        if c.kind == "all-gather"
        or (c.kind == "collective-permute" and WINDOWED_GATHER in c.computation)
    ]
    trips = (scan.trip_count or 1) if scan else 0
    top: Counter[str] = Counter()
    for c in gathered:
        top[c.op_name or c.name] += c.count * c.bytes
    return Gathers(
        first=sum(c.count * c.bytes for c in gathered if c.computation not in body),
        per_trip=sum(c.count * c.bytes for c in gathered if c.computation in body) // max(trips, 1),
        trips=trips,
        all_to_all=sum(c.count for c in found if c.kind == "all-to-all"),
        top=top.most_common(8),
    )
