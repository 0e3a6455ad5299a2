"""Which weights stay on the devices between programs, and the memory peak that makes.

Each weight component is *resident* (placed when the pipeline loads, kept for every request)
or *transient* (placed before the programs that take it, deleted right after the last: the
text encoder of a 1.3B build on one 16 GB chip, 10.6 GiB used once per prompt; at 1280x720 its
transformer too, deleted after the last step so that the VAE decode fits). The resident peak of a
build is, per device, the largest over its programs of that program's own peak (its arguments,
the weights it takes among them, outputs and temporaries) plus the resident weights it does not
take, plus every loaded program's code. `aot build` records the placement and that peak in the
manifest (`plan` makes transient, one at a time, the component that lowers the peak most, until
it is under the budget), `aot check` holds the peak to the budget, and the runtime places and
deletes weights as the placement says (`runtime run --placement` overrides it).

Not counted: what a request holds between programs besides the weights (the prompt's keys and
values during the decode are freed first; a continuous server's other slots, a few MB a video).
Flax-free: the runtime imports it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence

from wan.interface import CONTINUOUS_PROGRAMS, SIGNATURES

RESIDENT, TRANSIENT = "resident", "transient"
PLACEMENTS = (RESIDENT, TRANSIENT)
# What may be transient: the encoders and the VAE, each taken by one program once a request,
# and a one-expert model's transformer, taken by the request's kv_cache and steps: placed before
# the first, deleted after the last step (before the decode; each request then places it again).
# Not the experts of a two-expert model (their kv caches are made together, so both would be
# placed at once), nor a continuous build's transformer (its steps never end).
MOVABLE = ("text_encoder", "image_encoder", "vae_encoder", "vae", "transformer")
CONTINUOUS = frozenset(p for ps in CONTINUOUS_PROGRAMS.values() for p in ps)


def movable(programs: Collection[str], components: Collection[str]) -> tuple[str, ...]:
    """The components of a build (its `programs`, its weights' `components`) that may be
    transient (MOVABLE)."""
    steps_end = "transformer_2" not in components and not CONTINUOUS & set(programs)
    return tuple(c for c in MOVABLE if c in components and (c != "transformer" or steps_end))


def unmovable(
    programs: Collection[str], components: Collection[str], placement: Mapping[str, str]
) -> list[str]:
    """The components `placement` makes transient that the build may not (`movable`)."""
    free = movable(programs, components)
    return sorted(c for c, p in placement.items() if p != RESIDENT and c not in free)


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
    """Per device: a program's own peak (arguments included) and its generated code."""

    peak: int
    code: int


def taken_by(program: str, components: Sequence[str]) -> tuple[str, ...]:
    """The components of `components` whose weights `program` takes, one per call (a
    two-expert model's step runs with either transformer)."""
    kind = SIGNATURES[program].weights
    experts = ("transformer", "transformer_2")
    return tuple(c for c in components if c == kind or (kind == experts[0] and c in experts))


def resident_peak(
    programs: Sequence[str],
    memory: Mapping[str, ProgramMemory],
    weights: Mapping[str, int],
    placement: Mapping[str, str],
) -> tuple[int, str]:
    """(bytes per device, the program where it is reached) of a build whose programs run in
    the order `programs`, with `weights` (component -> bytes per device) placed as
    `placement` says (a component it does not name: resident)."""
    code = sum(memory[p].code for p in programs)
    resident = {c: b for c, b in weights.items() if placement.get(c, RESIDENT) == RESIDENT}
    worst = (0, "")
    for program in programs:
        for call in taken_by(program, list(weights)) or (None,):
            others = sum(b for c, b in resident.items() if c != call)
            worst = max(worst, (memory[program].peak + others + code, program))
    return worst


def plan(
    programs: Sequence[str],
    memory: Mapping[str, ProgramMemory],
    weights: Mapping[str, int],
    budget: int | None,
) -> dict[str, str]:
    """Every component resident while the resident peak is over `budget` (None: no budget),
    then, one at a time, the movable component whose transience lowers the peak most (of
    equal gains the largest) made transient, until it fits or no move lowers it."""
    placement = dict.fromkeys(weights, RESIDENT)
    peak = resident_peak(programs, memory, weights, placement)[0]
    while budget is not None and peak > budget:
        options = [
            (
                resident_peak(programs, memory, weights, {**placement, c: TRANSIENT})[0],
                -weights[c],
                c,
            )
            for c in movable(programs, weights)
            if placement.get(c) == RESIDENT
        ]
        if not options or min(options)[0] >= peak:
            break
        peak, _, component = min(options)
        placement[component] = TRANSIENT
    return placement


def parse_override(text: str) -> tuple[str, str]:
    """`COMPONENT=PLACEMENT` (as `runtime run --placement` takes it); ValueError else."""
    component, sep, value = text.partition("=")
    if not sep or value not in PLACEMENTS:
        raise ValueError(
            f"--placement {text!r}: give COMPONENT=PLACEMENT, PLACEMENT one of "
            f"{', '.join(PLACEMENTS)} (e.g. text_encoder=transient)"
        )
    if component not in MOVABLE:
        raise ValueError(
            f"--placement {text!r}: {component or 'nothing'} cannot be transient; the components "
            f"that can: {', '.join(MOVABLE)}"
        )
    return component, value
