"""Account the all-gathers of a chunked decode (the VAE's: the first latent chunk alone, the
later chunks in one scan): gathered bytes per device outside the scan and per trip of it, so
that a build can record what one latent frame gathers (`gathers`).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from aot.hlo import Loop, Module, collectives, loops

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
