"""Read XLA's optimized HLO text (`compiled.as_text()`): its structure, loops and collectives.

Why this exists: `compiled.cost_analysis()` counts a while loop's body once, so a 40-layer
`scan` reports about one layer, and collectives only show up in the optimized HLO. This module
parses the text (`parse`), works out each while loop's trip count (`loops`) and how many times
each computation runs per program execution (`Module.multipliers`: loop trip counts multiply,
nested loops compound), and from that lists the collectives with their per-device bytes and
source location (`collectives`, `collective_summary`). `aot.hlo.cost` counts FLOPs and
`aot.hlo.vae_gathers` accounts a chunked decode's all-gathers over the module parsed here.

The parser (over the lexical layer, `aot.hlo.text`) is written against real CPU and TPU
output: long `backend_config` JSON with braces and quoted strings, tiled layouts
(`{1,0:T(8,128)(2,1)S(1)}`), tuple shapes with `/*index=5*/` comments, new-style
`replica_groups=mesh[...] {...}`, and source locations either inline (`source_file=`,
`source_line=`) or through the module's `StackFrames` tables.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

from aot.hlo.text import (
    Shape,
    close_bracket,
    ints,
    names,
    open_brackets,
    parse_shape,
    split_top,
    strip_comments,
    unquote,
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

_METADATA_FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|[^\s}]+)')
_KNOWN_TRIP_COUNT = re.compile(r'known_trip_count\\?"\s*:\s*\{\s*\\?"n\\?"\s*:\s*\\?"?(\d+)')
_TABLE_ROW = re.compile(r"^(\d+)\s+(.*)$")
_OPCODE = re.compile(r"\s*([\w-]+)\(")
_HEADER = re.compile(r"(ENTRY\s+)?%?([^\s(]+)")


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
            self.files[key] = unquote(rest)
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
    s = strip_comments(line.strip())
    s = s.removeprefix("ROOT ")
    eq = s.index("=")
    name = s[:eq].strip().lstrip("%")
    shape, i = parse_shape(s, eq + 1)
    m = _OPCODE.match(s, i)
    if m is None:
        raise ValueError(f"cannot parse HLO instruction: {line.strip()[:120]!r}")
    opcode, open_paren = m.group(1), m.end() - 1
    close = close_bracket(s, open_paren)
    inside = s[open_paren + 1 : close]
    literal, operands = None, ()
    if opcode in ("constant", "parameter"):
        literal = inside.strip()
    else:
        operands = tuple(op.split()[-1].lstrip("%") for op in split_top(inside))
    attrs = {}
    for part in split_top(s[close + 1 :]):
        key, _, value = part.partition("=")
        attrs[key.strip()] = value.strip()
    calls = tuple(
        (key, callee) for key in _CALL_ATTRS if key in attrs for callee in names(attrs[key])
    )
    meta = dict(_METADATA_FIELD.findall(attrs.get("metadata", "")))
    source_file = unquote(meta["source_file"]) if "source_file" in meta else None
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
        op_name=unquote(meta["op_name"]) if "op_name" in meta else None,
        source_file=source_file,
        source_line=source_line,
    )


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
            if open_brackets(pending) > 0:
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
                    dimensions=ints(dims) if dims is not None else None,
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
