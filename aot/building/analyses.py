"""What `aot build` records of a program besides memory, FLOPs and collectives: one analysis per
name a `wan.programs.Program` lists in `analyses`, each giving manifest entry fields
(`runtime.builds.artifact.ProgramEntry`) from the build's plan and the program's optimized HLO."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aot.building.plan import (
    BuildError,
    BuildPlan,
    eight_bit_kernel_flops,
    kernel_flops,
    self_attention,
)
from aot.hlo import Module, vae_gathers
from wan.programs import Program

Analysis = Callable[[BuildPlan, Module], dict[str, Any]]

ANALYSES: dict[str, Analysis] = {
    # The decode's all-gathered bytes per latent frame (its spatial sharding's cost).
    "vae_gathers": lambda plan, module: {
        "gathered_bytes_per_latent_frame": vae_gathers.gathers(module).per_latent_frame
    },
    # The attention kernels' FLOPs, which the HLO holds as opaque custom calls.
    "attention_kernels": lambda plan, module: {
        "kernel_flops": kernel_flops(plan),
        "eight_bit_kernel_flops": eight_bit_kernel_flops(plan),
    },
    # The video self-attention's density and FLOPs, dense and as built: a dense step's...
    "self_attention": lambda plan, module: _self_attention(plan, radial=False),
    # ... and radial_step's, whose kernel FLOPs count the blocks its mask keeps.
    "radial_attention": lambda plan, module: {
        "kernel_flops": kernel_flops(plan, radial=True),
        "eight_bit_kernel_flops": eight_bit_kernel_flops(plan, radial=True),
        **_self_attention(plan, radial=True),
    },
}


def _self_attention(plan: BuildPlan, radial: bool) -> dict[str, Any]:
    counted = self_attention(plan, radial)
    return {
        "attention_density": counted.density,
        "self_attention_flops_dense": counted.dense_flops,
        "self_attention_flops": counted.flops,
    }


def check(program: Program) -> None:
    """Every analysis `program` asks for is one this build can make (before it compiles)."""
    unknown = [name for name in program.analyses if name not in ANALYSES]
    if unknown:
        raise BuildError(
            f"{program.name} asks for analyses {', '.join(unknown)}; aot.building.analyses.ANALYSES has "
            f"{', '.join(ANALYSES)}"
        )


def recorded(plan: BuildPlan, program: Program, module: Module) -> dict[str, Any]:
    """The manifest entry fields of every analysis `program` asks for."""
    fields: dict[str, Any] = {}
    for name in program.analyses:
        fields.update(ANALYSES[name](plan, module))
    return fields
