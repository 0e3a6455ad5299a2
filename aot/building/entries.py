"""A compiled program's files and its manifest entry: the serialised executable, its optimized HLO
and what the reports and `aot check` read (memory per device, FLOPs, collectives, replicated
weights, and what its `analyses` record: aot.building.analyses)."""

from __future__ import annotations

import gzip
import math
from pathlib import Path
from typing import Any

import jax

from aot import hlo
from aot.building import analyses, store
from aot.building.lower import LoweredProgram
from aot.building.plan import BuildPlan
from aot.hlo import cost as hlo_cost
from runtime.builds.artifact import ArraySpec, ProgramEntry, file_entry
from runtime.builds.executables import dump_executable
from wan import interface


def program_entry(
    plan: BuildPlan,
    folder: Path,
    lowered: LoweredProgram,
    compiled: Any,
    seconds: float,
    rss: int,
) -> ProgramEntry:
    """Write the compiled program's files into `folder`: its manifest entry, with what the
    program's `analyses` record (aot.building.analyses)."""
    program = lowered.program
    device_ids = [d.id for d in lowered.mesh.devices.flat]
    executable, hlo_text = store.program_files(program.name)
    (folder / executable).write_bytes(dump_executable(compiled, device_ids, list(program.args)))
    text = compiled.as_text()
    with gzip.open(folder / hlo_text, "wt") as f:
        f.write(text)
    module = hlo.parse(text)
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, list):
        cost = cost[0] if cost else {}
    return ProgramEntry(
        name=program.name,
        executable=file_entry(folder, executable),
        hlo=file_entry(folder, hlo_text),
        input_names=list(program.args),
        output_names=list(program.out_axes),
        inputs=_array_specs(
            interface.named(program.name, compiled.args_info[0]),
            interface.named(program.name, compiled.input_shardings[0]),
        ),
        outputs=_array_specs(
            jax.eval_shape(program.fn, *program.args.values()), compiled.output_shardings
        ),
        compile_seconds=round(seconds, 3),
        compiler_options=lowered.options,
        replicated_param_bytes=replicated_param_bytes(program.name, compiled),
        peak_rss_bytes=rss,
        memory=memory_stats(compiled),
        param_bytes=param_bytes(program.name, compiled),
        flops=hlo_cost.flops(module),
        eight_bit_flops=hlo_cost.eight_bit_flops(module),
        xla_flops=float(cost.get("flops", 0.0)),
        collectives=hlo.collective_summary(module),
        **analyses.recorded(plan, program, module),
    )


def _params(program_name: str, compiled: Any) -> list[tuple[Any, jax.sharding.Sharding]]:
    """The program's `params` leaves with their shardings (none: a program without weights)."""
    args = interface.named(program_name, compiled.args_info[0])
    shardings = interface.named(program_name, compiled.input_shardings[0])
    if "params" not in args:
        return []
    placed = jax.tree.leaves(
        shardings["params"], is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)
    )
    return list(zip(jax.tree.leaves(args["params"]), placed, strict=True))


def param_bytes(program_name: str, compiled: Any) -> int:
    """Bytes per device of the weights the program takes (its `params`, each device's shard)."""
    return sum(
        math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize
        for a, s in _params(program_name, compiled)
    )


def replicated_param_bytes(program_name: str, compiled: Any) -> int:
    """Bytes per device of the weights that a multi-device program keeps whole on every device
    (as MaxText's check for insufficiently sharded parameters reports them)."""
    return sum(
        math.prod(a.shape) * a.dtype.itemsize
        for a, s in _params(program_name, compiled)
        if len(s.device_set) > 1 and s.is_fully_replicated
    )


def _array_specs(shapes: Any, shardings: Any) -> list[ArraySpec]:
    leaves = jax.tree_util.tree_flatten_with_path(shapes)[0]
    flat_shardings = jax.tree.leaves(
        shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)
    )
    specs = []
    for (path, leaf), s in zip(leaves, flat_shardings, strict=True):
        spec = getattr(s, "spec", None)
        specs.append(
            ArraySpec(
                path=jax.tree_util.keystr(path, simple=True, separator="/"),
                shape=tuple(leaf.shape),
                dtype=str(leaf.dtype),
                sharding=str(spec) if spec is not None else str(s),
            )
        )
    return specs


def memory_stats(compiled: Any) -> dict[str, int]:
    """Per-device bytes. peak = arguments + outputs - aliased + temporaries."""
    m = compiled.memory_analysis()
    stats = {
        "argument": int(m.argument_size_in_bytes),
        "output": int(m.output_size_in_bytes),
        "alias": int(m.alias_size_in_bytes),
        "temp": int(m.temp_size_in_bytes),
        "generated_code": int(m.generated_code_size_in_bytes),
    }
    stats["peak"] = stats["argument"] + stats["output"] - stats["alias"] + stats["temp"]
    return stats
