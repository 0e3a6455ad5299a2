"""`aot check`: hold builds to an HLO and memory policy, so that CI catches a model or sharding
change that brings back all-to-alls or outgrows the HBM before it reaches a TPU.

Every program's optimized HLO (`<program>.hlo.txt.gz`, its sha256 checked against the manifest)
is parsed with `aot.hlo`: all collectives, async `-start` forms included (counted once, the
matching `-done` is not a second collective), with their executions per program run (loop trip
counts applied) and per-device bytes. Peak memory per device is the manifest's
`memory["peak"]` (arguments + outputs - aliased + temporaries).

Policy (TOML; the default ships as `aot/reports/policy.toml`; format in docs/check.md):

    [programs.<program>]          # a program of wan.interface.SIGNATURES
    forbid = ["all-to-all"]       # kinds that must not occur at all
    max_count = {all-gather = 200}          # executions per run, summed over the kind;
                                  # "ulysses": the count the build states for its attention
    max_bytes = {all-reduce = 1_073_741_824}  # bytes per device per run, summed over the kind

    [targets."*"]                 # every target; a table named after a target (e.g.
    hbm_fraction = 0.9            # "tpu-v6e-8") replaces these keys for that target
    budget_bytes = 17179869184    # absolute per-device budget; applies to cpu/current too

The memory budget is the smaller of `budget_bytes` and `hbm_fraction` x the target's HBM per
device (the manifest's `hbm_bytes`, from aot.targets.TPU_HBM), for each program's own peak and
for the pipeline's resident peak (each program's peak plus the weights the runtime keeps on the
devices meanwhile, wan.residency); targets without a known HBM
(cpu-N, current) are skipped unless `budget_bytes` is given. Kinds: all-to-all,
ragged-all-to-all, all-gather, all-reduce, reduce-scatter, collective-permute,
collective-broadcast.

JSON output (`aot check --json`), schema version 2:

    {
      "schema_version": 2,
      "policy": str,                  # the policy file, or "default"
      "ok": bool,                     # true iff "violations" is empty
      "builds": [{
        "build": str,                 # build folder name
        "path": str,
        "target": str | null,         # null: the build does not read (an "unreadable" violation)
        "hbm_bytes": int | null,      # per device, when known for the target
        "memory_budget_bytes": int | null,   # null: memory rule skipped
        "resident_peak_bytes": int,   # per device: the pipeline's peak (wan.residency), 0
        "resident_peak_program": str | null, # if unreadable; and the program where it is
        "placement": {"<component>": "resident" | "transient"} | null,
        "ok": bool,
        "programs": {"<program>": {
          "peak_bytes": int,
          "collectives": {"<kind>": {"count": int, "bytes": int,
                                     "static_count": int, "static_bytes": int}}
        }}
      }],
      "violations": [{
        "build": str, "path": str, "program": str,   # "-" for "unreadable"
        "rule": "forbid" | "max_count" | "max_bytes" | "memory" | "unreadable",
        "kind": str | null,           # the collective kind; null for "memory" and "unreadable"
        "limit": int,                 # forbid: 0
        "actual": int,                # forbid/max_count: executions; max_bytes/memory: bytes
        "message": str,
        "instructions": [{            # the HLO collectives behind it, largest traffic first;
          "name": str, "opcode": str, # empty for "memory"
          "computation": str, "count": int, "bytes": int, "shape": str,
          "replica_groups": str | null, "op_name": str | null,
          "source_file": str | null, "source_line": int | null
        }]
      }]
    }
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Iterable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from aot import hlo, targets
from aot.reports.report import text_table
from runtime.builds.artifact import (
    MANIFEST,
    ArtifactError,
    FileEntry,
    Manifest,
    ProgramEntry,
    read_hlo_text,
    read_manifest,
    read_signed_manifest,
    read_verified,
)
from runtime.builds.executables import declared_header
from runtime.builds.loader import build_folders
from runtime.trust.signing import TrustedKey
from wan import residency
from wan.bounded_read import read_text
from wan.errors import InputError
from wan.interface import SIGNATURES

SCHEMA_VERSION = 2  # 2: each build's resident peak and placement
KINDS = frozenset(hlo.COLLECTIVES.values())
GiB = float(1 << 30)
MAX_POLICY_BYTES = 1 << 20  # the default policy is 1 KB
TABLE_INSTRUCTIONS = 5  # per violation in the text table; --json lists them all


class CheckInputError(InputError):
    """Bad input to the check (policy or build folders); the message is one line."""


# ---------------------------------------------------------------------------- policy


@dataclasses.dataclass(frozen=True)
class ProgramRules:
    forbid: tuple[str, ...] = ()
    max_count: dict[str, int | str] = dataclasses.field(default_factory=dict)  # or ULYSSES
    max_bytes: dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class MemoryRule:
    hbm_fraction: float | None = None
    budget_bytes: int | None = None

    def budget(self, hbm_bytes: int | None) -> int | None:
        """Bytes per device, or None when no rule applies to this target."""
        budgets = [] if self.budget_bytes is None else [self.budget_bytes]
        if self.hbm_fraction is not None and hbm_bytes:
            budgets.append(int(self.hbm_fraction * hbm_bytes))
        return min(budgets, default=None)


@dataclasses.dataclass(frozen=True)
class Policy:
    source: str
    programs: dict[str, ProgramRules]
    targets: dict[str, dict[str, Any]]  # target name or "*" -> memory rule keys

    def memory_rule(self, target: str) -> MemoryRule:
        return MemoryRule(**{**self.targets.get("*", {}), **self.targets.get(target, {})})


def load_policy(path: Path | None = None) -> Policy:
    """The policy in `path`, or the default one shipped with aot."""
    if path is None:
        return parse_policy((resources.files("aot.reports") / "policy.toml").read_text(), "default")
    text = read_text(
        Path(path),
        MAX_POLICY_BYTES,
        lambda reason: CheckInputError(f"policy {path} {reason}: give a policy TOML file"),
    )
    return parse_policy(text, str(path))


def parse_policy(text: str, source: str) -> Policy:
    """Parse and validate a policy; unknown keys, programs, kinds or targets are errors (a
    typo must not silently turn a rule off)."""
    try:
        raw = tomllib.loads(text)
    except RecursionError:  # tomllib has no nesting limit of its own
        raise CheckInputError(f"policy {source} is not valid TOML: nested too deeply") from None
    except tomllib.TOMLDecodeError as e:
        raise CheckInputError(f"policy {source} is not valid TOML: {e}") from None
    where = f"policy {source}"
    _keys(raw, {"programs", "targets"}, where)
    programs = {}
    for name, rules in _subtable(raw, "programs", where).items():
        at = f"{where} [programs.{name}]"
        if name not in SIGNATURES:
            raise CheckInputError(f"{at}: unknown program (programs: {', '.join(SIGNATURES)})")
        if not isinstance(rules, dict):
            raise CheckInputError(f"{at}: must be a table")
        _keys(rules, {"forbid", "max_count", "max_bytes"}, at)
        forbid = rules.get("forbid", [])
        if not isinstance(forbid, list):
            raise CheckInputError(f"{at} forbid: must be a list of collective kinds")
        programs[name] = ProgramRules(
            forbid=tuple(_kind(k, f"{at} forbid") for k in forbid),
            max_count=_limits(rules, "max_count", at),
            max_bytes=_limits(rules, "max_bytes", at),
        )
    target_rules = {}
    for name, rule in _subtable(raw, "targets", where).items():
        at = f'{where} [targets."{name}"]'
        if name != "*":
            try:
                targets.parse_target(name)
            except targets.TargetError as e:
                raise CheckInputError(f"{at}: {e}") from None
        if not isinstance(rule, dict):
            raise CheckInputError(f"{at}: must be a table")
        _keys(rule, {"hbm_fraction", "budget_bytes"}, at)
        fraction = rule.get("hbm_fraction")
        if fraction is not None and (
            isinstance(fraction, bool)
            or not isinstance(fraction, int | float)
            or not 0 < fraction <= 1
        ):
            raise CheckInputError(f"{at} hbm_fraction: must be a number in (0, 1]")
        if "budget_bytes" in rule:
            _count(rule["budget_bytes"], f"{at} budget_bytes")
        target_rules[name] = dict(rule)
    return Policy(source, programs, target_rules)


def _keys(table: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise CheckInputError(
            f"{where}: unknown key {unknown[0]!r} (allowed: {', '.join(sorted(allowed))})"
        )


def _subtable(raw: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    value = raw.get(key, {})
    if not isinstance(value, dict):
        raise CheckInputError(f"{where}: {key} must be a table")
    return value


def _kind(kind: Any, where: str) -> str:
    if kind not in KINDS:
        raise CheckInputError(
            f"{where}: unknown collective kind {kind!r} (kinds: {', '.join(sorted(KINDS))})"
        )
    return kind


# A max_count that each build states for itself: the all-to-alls its Ulysses attention needs.
ULYSSES = "ulysses"


def _count(value: Any, where: str, stated: bool = False) -> int | str:
    if stated and value == ULYSSES:
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        or_stated = f' or "{ULYSSES}"' if stated else ""
        raise CheckInputError(f"{where}: must be a non-negative integer{or_stated}")
    return value


def _limits(rules: dict[str, Any], key: str, where: str) -> dict[str, int | str]:
    table = rules.get(key, {})
    if not isinstance(table, dict):
        raise CheckInputError(f"{where} {key}: must be a table of kind = limit")
    return {
        _kind(kind, f"{where} {key}"): _count(v, f"{where} {key}.{kind}", key == "max_count")
        for kind, v in table.items()
    }


# ---------------------------------------------------------------------------- checking


@dataclasses.dataclass(frozen=True)
class Violation:
    build: Path
    program: str  # "-" for unreadable
    rule: str  # forbid, max_count, max_bytes, memory, unreadable, signature
    kind: str | None
    limit: int
    actual: int
    message: str
    instructions: tuple[hlo.Collective, ...]

    def line(self) -> str:
        """One line for logs: build, program, rule and the largest instruction."""
        text = f"{self.build.name} {self.program}: {self.message}"
        if self.instructions:
            text += f"; {_instruction_text(self.instructions[0])}"
            if len(self.instructions) > 1:
                text += f" (+{len(self.instructions) - 1} more)"
        return text


@dataclasses.dataclass(frozen=True)
class ProgramCheck:
    peak_bytes: int
    collectives: tuple[hlo.Collective, ...]


@dataclasses.dataclass(frozen=True)
class BuildCheck:
    folder: Path
    manifest: Manifest | None  # None: the build does not read (one "unreadable" violation)
    memory_budget: int | None
    programs: dict[str, ProgramCheck]
    violations: tuple[Violation, ...]
    resident_peak: tuple[int, str] = (0, "")  # per device, at which program (wan.residency)

    @classmethod
    def unreadable(cls, folder: Path, why: str) -> BuildCheck:
        violation = Violation(folder, "-", "unreadable", None, 0, 0, why, ())
        return cls(folder, None, None, {}, (violation,))


def find_builds(paths: Iterable[Path]) -> dict[Path, bool]:
    """Build folders among `paths`: each is a build (has a manifest) or a folder of builds.
    Each with whether it was named itself (True) or found in a folder of builds."""
    found: dict[Path, bool] = {}
    for path in map(Path, paths):
        if os.path.lexists(path / MANIFEST):
            found[path] = True
            continue
        if not path.is_dir():
            raise CheckInputError(f"{path} does not exist or is not a folder")
        builds = build_folders(path)
        if not builds:
            raise CheckInputError(
                f"{path} is neither a build folder (no {MANIFEST}) nor a folder of builds"
            )
        found.update((b, found.get(b, False)) for b in builds)
    return found


def check_paths(
    paths: Iterable[Path], policy: Policy, trusted: Sequence[TrustedKey] = ()
) -> list[BuildCheck]:
    """Check every build found in `paths` (see find_builds). A build named itself must read
    (else CheckInputError); one found in a folder of builds that does not read is a result
    with an "unreadable" violation saying why, and the others are still checked. With `trusted`
    keys, a build not signed by one of them is a "signature" violation, and nothing else of it
    is read."""
    results = []
    for folder, named in find_builds(paths).items():
        try:
            results.append(check_build(folder, policy, trusted))
        except CheckInputError as e:
            if named:
                raise
            results.append(BuildCheck.unreadable(folder, str(e)))
    return results


def check_build(folder: Path, policy: Policy, trusted: Sequence[TrustedKey] = ()) -> BuildCheck:
    if trusted:
        try:
            manifest = read_signed_manifest(folder, trusted)
        except ArtifactError as e:
            violation = Violation(folder, "-", "signature", None, 0, 0, str(e), ())
            return BuildCheck(folder, None, None, {}, (violation,))
    try:
        manifest = manifest if trusted else read_manifest(folder)
    except ArtifactError as e:
        raise CheckInputError(str(e)) from None
    budget = policy.memory_rule(manifest.key.target).budget(manifest.hbm_bytes)
    programs, violations = {}, []
    for name, entry in manifest.programs.items():
        _check_executable(folder, entry)
        collectives = tuple(hlo.collectives(_read_hlo(folder, entry.hlo)))
        program = ProgramCheck(entry.memory["peak"], collectives)
        programs[name] = program
        violations += program_violations(folder, name, program, policy, BuildFacts.of(manifest))
    resident = manifest.resident_peak()
    if (
        budget is not None
        and resident[0] > budget
        and not any(v.rule == "memory" for v in violations)
    ):
        violations.append(resident_violation(folder, manifest, budget))
    return BuildCheck(folder, manifest, budget, programs, tuple(violations), resident)


def resident_violation(folder: Path, manifest: Manifest, budget: int) -> Violation:
    """The pipeline does not fit although each program does: at its peak program, the weights
    the runtime keeps there (wan.residency) and the program's own peak, and what to change."""
    peak, at = manifest.resident_peak()
    own = manifest.programs[at].memory["peak"]
    kept = [
        f"{c} {b / GiB:.2f}"
        for c, b in manifest.weight_bytes.items()
        if manifest.placement[c] == residency.RESIDENT
    ]
    # Only a move that lowers the peak is worth naming: the VAE transient still sits beside
    # the transformer at a peak reached in vae_decode, which takes it.
    movable = [
        c
        for c in residency.movable(manifest.key.programs, manifest.weight_bytes)
        if manifest.placement.get(c) == residency.RESIDENT
        and manifest.resident_peak({**manifest.placement, c: residency.TRANSIENT})[0] < peak
    ]
    change = (
        f"make {', '.join(movable)} transient (`runtime run --placement {movable[0]}=transient`) "
        "or "
        if movable
        else ""
    )
    message = (
        f"resident peak {peak / GiB:.2f} GiB per device at {at} ({at} {own / GiB:.2f} GiB, "
        f"resident weights GiB: {', '.join(kept)}) > budget "
        f"{_budget_text(budget, manifest.hbm_bytes)}: {change}build a smaller batch or size, "
        "--quant w8a8-int8, or for more devices"
    )
    return Violation(folder, at, "memory", None, budget, peak, message, ())


@dataclasses.dataclass(frozen=True)
class BuildFacts:
    """What the policy's rules read from a build besides its programs."""

    target: str
    hbm_bytes: int | None
    ulysses_all_to_alls: int

    @classmethod
    def of(cls, manifest: Manifest) -> BuildFacts:
        return cls(manifest.key.target, manifest.hbm_bytes, manifest.ulysses_all_to_alls)


def program_violations(
    folder: Path, name: str, program: ProgramCheck, policy: Policy, build: BuildFacts
) -> list[Violation]:
    """What `policy` finds wrong with one compiled program of `build`: its collectives against
    the program's rules, its peak memory against the target's budget."""
    violations = _collective_violations(
        folder, name, program.collectives, policy.programs.get(name, ProgramRules()), build
    )
    budget = policy.memory_rule(build.target).budget(build.hbm_bytes)
    if budget is not None and program.peak_bytes > budget:
        message = (
            f"peak {program.peak_bytes / GiB:.2f} GiB per device > budget "
            f"{_budget_text(budget, build.hbm_bytes)}"
        )
        violations.append(
            Violation(folder, name, "memory", None, budget, program.peak_bytes, message, ())
        )
    return violations


def _check_executable(folder: Path, entry: ProgramEntry) -> None:
    """The program's executable is whole and in this version's format, declaring the arrays
    the manifest records (read, never loaded: runtime.builds.executables)."""
    try:
        declared_header(entry, read_verified(folder, entry.executable))
    except ArtifactError as e:
        raise CheckInputError(f"{folder.name}: {entry.name}: {e}") from None


def _read_hlo(folder: Path, entry: FileEntry) -> hlo.Module:
    """The HLO module of a program: its file verified (inside the folder, size, sha256) before
    it is decompressed, with a bound (runtime.builds.artifact.read_hlo_text)."""
    path = folder / entry.path
    try:
        text = read_hlo_text(folder, entry)
    except ArtifactError as e:
        raise CheckInputError(str(e)) from None
    try:
        return hlo.parse(text)
    # Text that passed its sha256 came from a builder; these are what a parser of a text it did
    # not expect raises.
    except (ValueError, KeyError, IndexError, TypeError, AttributeError, RecursionError) as e:
        reason = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise CheckInputError(f"{path}: cannot parse the HLO ({reason})") from None


def _budget_text(budget: int, hbm_bytes: int | None) -> str:
    text = f"{budget / GiB:.2f} GiB"
    if hbm_bytes:
        text += f" ({100 * budget / hbm_bytes:.0f}% of {hbm_bytes / GiB:.0f} GiB HBM)"
    return text


def _collective_violations(
    folder: Path,
    program: str,
    collectives: Sequence[hlo.Collective],
    rules: ProgramRules,
    build: BuildFacts,
) -> list[Violation]:
    def of_kind(kind: str) -> tuple[hlo.Collective, ...]:
        found = (c for c in collectives if c.kind == kind)
        return tuple(sorted(found, key=lambda c: (-c.count * c.bytes, c.name)))

    out = []
    for kind in rules.forbid:
        if found := of_kind(kind):
            runs = sum(c.count for c in found)
            message = f"{kind} forbidden: {len(found)} in the HLO, {runs} executions per run"
            out.append(Violation(folder, program, "forbid", kind, 0, runs, message, found))
    for kind, stated in rules.max_count.items():
        found = of_kind(kind)
        limit = build.ulysses_all_to_alls if stated == ULYSSES else stated
        if (runs := sum(c.count for c in found)) > limit:
            source = f" (the build's {ULYSSES} attention)" if stated == ULYSSES else ""
            message = f"{kind}: {runs} executions per run > max_count {limit}{source}"
            out.append(Violation(folder, program, "max_count", kind, limit, runs, message, found))
    for kind, limit in rules.max_bytes.items():
        found = of_kind(kind)
        if (total := sum(c.count * c.bytes for c in found)) > limit:
            message = f"{kind}: {total} bytes per device per run > max_bytes {limit}"
            out.append(Violation(folder, program, "max_bytes", kind, limit, total, message, found))
    return out


# ---------------------------------------------------------------------------- output


def _source(c: hlo.Collective) -> str:
    if c.source_file is None:
        return "-"
    path = c.source_file
    if os.path.isabs(path) and path.startswith(os.getcwd() + os.sep):
        path = os.path.relpath(path)
    return f"{path}:{c.source_line}" if c.source_line is not None else path


def _instruction_text(c: hlo.Collective) -> str:
    text = f"{c.name} ({c.opcode})"
    if c.source_file is not None:
        text += f" at {_source(c)}"
    if c.op_name:
        text += f" [{c.op_name}]"
    return text


def text(results: Sequence[BuildCheck], policy: Policy) -> str:
    """A table of the builds checked, then one of the violations (if any) and a verdict."""
    rows = []
    for r in results:
        if r.manifest is None:
            rows.append([r.folder.name, "-", "-", "-", "-", "unreadable"])
            continue
        peak, peak_name = r.resident_peak
        budget = "skipped" if r.memory_budget is None else f"{r.memory_budget / GiB:.2f} GiB"
        kinds: dict[str, int] = {}
        for p in r.programs.values():
            for kind, s in hlo.collective_summary(p.collectives).items():
                kinds[kind] = kinds.get(kind, 0) + s["count"]
        rows.append([
            r.folder.name, r.manifest.key.target, f"{peak / GiB:.2f} GiB [{peak_name}]", budget,
            " ".join(f"{k}:{n}" for k, n in sorted(kinds.items())) or "none",
            f"{len(r.violations)} violation(s)" if r.violations else "ok",
        ])  # fmt: skip
    columns = ["build", "target", "resident peak/device", "budget", "collectives", "result"]
    out = [text_table(columns, rows)]
    violations = [v for r in results for v in r.violations]
    if violations:
        out += ["", _violations_table(violations)]
    failed = sum(bool(r.violations) for r in results)
    out.append(
        f"\n{len(violations)} violation(s) in {failed} of {len(results)} build(s) "
        f"(policy: {policy.source})"
        if violations
        else f"\n{len(results)} build(s) pass (policy: {policy.source})"
    )
    return "\n".join(out)


def _violations_table(violations: Sequence[Violation]) -> str:
    rows = []
    for v in violations:
        shown = v.instructions[:TABLE_INSTRUCTIONS]
        for i, c in enumerate(shown or [None]):
            head = [v.build.name, v.program, v.message] if i == 0 else ["", "", ""]
            if c is None:
                rows.append([*head, "-", "-", "-"])
            else:
                rows.append(
                    [*head, f"{c.name} ({c.opcode}) x{c.count}", _source(c), c.op_name or "-"]
                )
        if len(v.instructions) > len(shown):
            rows.append(
                ["", "", "", f"... {len(v.instructions) - len(shown)} more (--json)", "", ""]
            )
    return text_table(["build", "program", "violation", "instruction", "source", "op_name"], rows)


def violation_lines(results: Sequence[BuildCheck]) -> list[str]:
    """One line per violation, for the warnings at the end of `aot build`."""
    return [v.line() for r in results for v in r.violations]


def to_json(results: Sequence[BuildCheck], policy: Policy) -> dict[str, Any]:
    """The --json report (schema in the module docstring)."""
    violations = [v for r in results for v in r.violations]
    return {
        "schema_version": SCHEMA_VERSION,
        "policy": policy.source,
        "ok": not violations,
        "builds": [
            {
                "build": r.folder.name,
                "path": str(r.folder),
                "target": r.manifest and r.manifest.key.target,
                "hbm_bytes": r.manifest and r.manifest.hbm_bytes,
                "memory_budget_bytes": r.memory_budget,
                "resident_peak_bytes": r.resident_peak[0],
                "resident_peak_program": r.resident_peak[1] or None,
                "placement": r.manifest and r.manifest.placement,
                "ok": not r.violations,
                "programs": {
                    name: {
                        "peak_bytes": p.peak_bytes,
                        "collectives": hlo.collective_summary(p.collectives),
                    }
                    for name, p in r.programs.items()
                },
            }
            for r in results
        ],
        "violations": [
            {
                "build": v.build.name,
                "path": str(v.build),
                "program": v.program,
                "rule": v.rule,
                "kind": v.kind,
                "limit": v.limit,
                "actual": v.actual,
                "message": v.message,
                "instructions": [_instruction_json(c) for c in v.instructions],
            }
            for v in violations
        ],
    }


def _instruction_json(c: hlo.Collective) -> dict[str, Any]:
    return {
        "name": c.name,
        "opcode": c.opcode,
        "computation": c.computation,
        "count": c.count,
        "bytes": c.bytes,
        "shape": str(c.shape),
        "replica_groups": c.replica_groups,
        "op_name": c.op_name,
        "source_file": c.source_file,
        "source_line": c.source_line,
    }
