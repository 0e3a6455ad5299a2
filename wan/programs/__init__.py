"""The device programs of the pipeline, as pure functions plus their abstract inputs.

Each program takes parameters as plain nested dicts (pure dicts of the NNX state) and plain
dicts/tuples elsewhere, so a serialized executable's pytree definitions name no flax or wan
class. Shardings are attached from logical axis names through wan.sharding; `aot` lowers these
on any target and the runtime calls the resulting executables. Their named inputs and outputs
are `wan.interface.SIGNATURES` (tabled in docs/architecture.md); a step's batch is
S = 2B with classifier-free guidance (prompt and negative-prompt rows in pairs), else B.

The makers live by stage (`encode`: before the steps, `step`: the steps, `decode`: after them,
on what `core` defines); this package is their registry (`MAKERS`) and the names others use.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from wan.configs import ModelConfig, VideoShape
from wan.programs.core import (
    KV_AXES,
    Program,
    ProgramOptions,
    abstract_module,
    components,
    kv_shape,
    make_module,
    sampler_row_shapes,
    shardings,
    split_abstract,
    state_shapes,
)
from wan.programs.decode import latents_handoff_program, slot_decode_program, vae_decode_program
from wan.programs.encode import (
    condition_shape,
    image_condition,
    image_encode_program,
    image_kv_cache_program,
    kv_cache_program,
    step_conditioning,
    text_encode_program,
    vae_encode_program,
)
from wan.programs.step import (
    cache_step_program,
    cached_step_program,
    denoise_step_program,
    join_kv_program,
    join_latents_program,
    radial_cache_step_program,
    radial_step_program,
    slot_step_program,
)

# The program of each name, made for a model, a video shape and the build's options: a new
# program is one maker here, its Signature in wan.interface and its place in a pipeline there.
MAKERS: dict[str, Callable[[ModelConfig, VideoShape, ProgramOptions], Program]] = {
    "text_encode": text_encode_program,
    "kv_cache": kv_cache_program,
    "image_encode": image_encode_program,
    "vae_encode": vae_encode_program,
    "image_kv_cache": image_kv_cache_program,
    "denoise_step": denoise_step_program,
    "radial_step": radial_step_program,
    "cache_step": cache_step_program,
    "radial_cache_step": radial_cache_step_program,
    "cached_step": cached_step_program,
    "latents_handoff": latents_handoff_program,
    "vae_decode": vae_decode_program,
    "join_kv": join_kv_program,
    "join_latents": join_latents_program,
    "slot_step": slot_step_program,
    "slot_decode": slot_decode_program,
}


def programs(
    config: ModelConfig, shape: VideoShape, options: ProgramOptions, names: Sequence[str]
) -> list[Program]:
    """The programs `names` (a build key's `programs`), in that order."""
    return [MAKERS[name](config, shape, options) for name in names]


__all__ = [
    "KV_AXES", "MAKERS", "Program", "ProgramOptions", "VideoShape", "abstract_module",
    "components", "condition_shape", "image_condition", "kv_shape", "make_module", "programs",
    "sampler_row_shapes", "shardings", "split_abstract", "state_shapes", "step_conditioning",
    *(maker.__name__ for maker in MAKERS.values()),
]  # fmt: skip
