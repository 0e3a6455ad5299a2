"""Lowering a plan's programs for their meshes (abstract inputs only: no weights, no arrays, no
target hardware) and compiling them, XLA's refusal turned into one line."""

from __future__ import annotations

import dataclasses
import functools
import re
import time
from collections.abc import Callable, Collection, Iterator
from typing import Any

import jax

from aot.building import analyses
from aot.building.plan import BuildError, BuildPlan, compiler_options
from aot.building.progress import RssSampler, Ticker
from aot.targets import devices
from runtime.builds.loader import host_layout
from wan import interface, sharding
from wan import programs as wan_programs


@dataclasses.dataclass(frozen=True)
class LoweredProgram:
    """One program of a build, lowered for its mesh, and the XLA options it compiles with."""

    program: wan_programs.Program
    lowered: jax.stages.Lowered
    mesh: jax.sharding.Mesh
    options: dict[str, Any]

    def compile(self) -> Any:
        return self.lowered.compile(compiler_options=self.options or None)


def lower_plan(
    plan: BuildPlan, frames_dtype: str = "uint8", only: Collection[str] | None = None
) -> Iterator[LoweredProgram]:
    """Lower the programs of `plan` (or those named in `only`) one by one, each on the mesh it
    names, its handed-over inputs placed as their producers leave them."""
    devs = devices(plan.target)
    layout = plan.sharding_plan
    meshes = layout.meshes(devs)
    options = wan_programs.ProgramOptions(
        attention=plan.attention,
        context_parallel=plan.key.context_parallel,
        gather_latents=layout.gather_latents,
        frames_dtype=frames_dtype,
        build=dict(plan.key.options),
    )
    names = tuple(plan.key.programs)
    replicated = host_layout(devs)[0] > 1  # a multi-process job: host outputs whole everywhere

    # Each program made when first needed: a --jobs worker lowering one program makes just it
    # and its producers, not every module of the plan.
    @functools.cache
    def made(name: str) -> wan_programs.Program:
        (program,) = wan_programs.programs(plan.config, plan.shape, options, [name])
        return program

    @functools.cache
    def leaves(name: str) -> dict[str, Any]:
        program = made(name)
        rules, _ = layout.rules(program.mesh)
        return output_shardings(
            program, meshes[program.mesh], rules, replicated and program.host_outputs
        )

    for program in (made(n) for n in names if only is None or n in only):
        analyses.check(program)
        mesh = meshes[program.mesh]
        placed = {}
        for name, source in program.receives.items():
            producer, output = interface.producer(source, names)
            placed[name] = leaves(producer)[output]
        lowered = lower_program(
            program,
            mesh,
            *layout.rules(program.mesh),
            placed=placed,
            replicated_out=replicated and program.host_outputs,
        )
        yield LoweredProgram(program, lowered, mesh, compiler_options(plan, program))


def compile_plan(
    plan: BuildPlan,
    progress: Callable[[str], None] | None = None,
    frames_dtype: str = "uint8",
    only: Collection[str] | None = None,
) -> Iterator[tuple[wan_programs.Program, Any, jax.sharding.Mesh, float, int]]:
    """Compile the programs of `plan` (or those named in `only`) one by one: (program,
    compiled, mesh, seconds, peak RSS)."""
    for lowered in lower_plan(plan, frames_dtype, only):
        name = lowered.program.name
        compiled, seconds, rss = compile_lowered(
            lowered, f"{plan.key.folder_name()} {name}", progress
        )
        yield lowered.program, compiled, lowered.mesh, seconds, rss


def compile_lowered(
    lowered: LoweredProgram, label: str, progress: Callable[[str], None] | None
) -> tuple[Any, float, int]:
    """(compiled, seconds, peak RSS), with a live progress line; XLA's refusal is a
    BuildError."""
    with Ticker(label, progress), RssSampler() as rss:
        start = time.perf_counter()
        try:
            compiled = lowered.compile()
        except jax.errors.JaxRuntimeError as e:
            raise BuildError(compile_failure(lowered.program, str(e))) from None
        seconds = time.perf_counter() - start
    return compiled, seconds, rss.peak


def compile_failure(program: wan_programs.Program, message: str) -> str:
    """One line for XLA's refusal to compile `program`: its status, the sentence that says
    what overflowed, and what to change (the program's `vmem_hint`)."""
    first = next((line.strip() for line in message.splitlines() if line.strip()), "no message")
    overflow = re.search(
        r"(Scoped allocation with size \S+ and limit \S+|Used \S+ of \S+ vmem)", message
    )
    name = program.name
    if overflow is None:
        return f"{name} does not compile for this target ({first})"
    status = first.split(":")[0]
    hint = f"; try {program.vmem_hint}" if program.vmem_hint else ""
    return f"{name} does not compile for this target ({status}: {overflow.group(1)}){hint}"


def compile_in_process(plan: BuildPlan, frames_dtype: str = "uint8") -> dict[str, Any]:
    """The executables of `plan`, compiled here and kept in memory (plain jit, no artifacts)."""
    return {p.name: compiled for p, compiled, *_ in compile_plan(plan, frames_dtype=frames_dtype)}


def lower_program(
    program: wan_programs.Program,
    mesh: jax.sharding.Mesh,
    rules: sharding.Rules,
    uneven: frozenset[str] = frozenset(),
    placed: dict[str, jax.sharding.Sharding] | None = None,
    replicated_out: bool = False,
) -> jax.stages.Lowered:
    """Lower `program` for `mesh` under `rules` (abstract inputs only). `placed`: inputs (by
    name) that arrive with a given sharding, as another program leaves them."""
    placed = placed or {}
    in_shardings = tuple(
        placed[name]
        if name in placed
        else wan_programs.shardings(mesh, a, program.arg_axes[name], rules)
        for name, a in program.args.items()
    )
    out_shardings = output_shardings(program, mesh, rules, replicated_out)
    # keep_unused: every executable takes its whole parameter tree (kv_cache reads a few of the
    # transformer's weights), so all programs of a component share one placed copy.
    # A fresh function per call: the rules are read while tracing, and jax would reuse a trace
    # of the same function made under other rules.
    jitted = jax.jit(
        lambda *args: program.fn(*args),
        in_shardings=in_shardings,
        out_shardings=out_shardings,
        keep_unused=True,
        donate_argnums=program.donate_argnums,
    )
    with jax.set_mesh(mesh), sharding.axis_rules(rules, uneven):
        return jitted.lower(*program.args.values())


def output_shardings(
    program: wan_programs.Program, mesh: jax.sharding.Mesh, rules: sharding.Rules, whole: bool
) -> dict[str, Any]:
    """How `program` leaves its outputs on `mesh`, by name: by their logical axes, or `whole`
    on every device."""
    out_shapes = jax.eval_shape(program.fn, *program.args.values())
    out_axes = (
        jax.tree.map(lambda s: (None,) * len(s.shape), out_shapes) if whole else program.out_axes
    )
    return wan_programs.shardings(mesh, out_shapes, out_axes, rules)
