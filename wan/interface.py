"""The pipeline's programs as the model, the build and the runtime agree on them: each program's
named inputs and outputs, the weight component its `params` input is, and the pipeline variants
(the programs a build holds). `wan.programs` defines the functions with these names, `aot build`
records them in the manifest, and the runtime passes and reads every array by name.

Flax-free: the runtime imports it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class Signature:
    inputs: tuple[str, ...]  # in call order
    outputs: tuple[str, ...]  # the keys of the dict the program returns
    weights: str | None  # the component whose parameters `params` holds (or its second
    # expert's); None: the program takes no weights


# Step caching (`aot build --step-cache`): a full step that also leaves the blocks' residuals on
# the devices (and reuses them after the first block when the first-block cache's `threshold`
# allows); with Radial attention, its sparse variant too.
_CACHE_STEP = Signature(
    ("params", "latents", "kv", "row", "state", "guidance", "first_residual", "residual",
     "threshold"),
    ("latents", "state", "first_residual", "residual", "residual_norm", "skipped"),
    "transformer",
)  # fmt: skip
SIGNATURES: dict[str, Signature] = {
    "text_encode": Signature(("params", "ids", "mask"), ("embeddings",), "text_encoder"),
    "kv_cache": Signature(("params", "embeddings"), ("kv",), "transformer"),
    # Image to video. The image's CLIP features (Wan 2.1: the transformer attends to them beside
    # the prompt), the step's condition (a mask and the VAE latents of the image followed by
    # zero frames, and the last image where `has_last`), and what every step reads, computed once per request: the prompt's and the
    # image's cross-attention keys and values, and the condition.
    "image_encode": Signature(("params", "pixels"), ("image_embeddings",), "image_encoder"),
    "vae_encode": Signature(
        ("params", "image", "last_image", "has_last"), ("condition",), "vae_encoder"
    ),
    "image_kv_cache": Signature(
        ("params", "embeddings", "image_embeddings", "condition"), ("kv",), "transformer"
    ),
    "denoise_step": Signature(
        ("params", "latents", "kv", "row", "state", "guidance"), ("latents", "state"), "transformer"
    ),
    # Radial attention (`aot build --sparse-attention radial`): a denoise step whose video
    # self-attention runs through the static mask after its first dense blocks.
    "radial_step": Signature(
        ("params", "latents", "kv", "row", "state", "guidance"), ("latents", "state"), "transformer"
    ),
    "cache_step": _CACHE_STEP,  # and with Radial attention, its sparse variant:
    "radial_cache_step": _CACHE_STEP,
    # MagCache's step that runs no block.
    "cached_step": Signature(
        ("params", "latents", "kv", "row", "state", "guidance", "first_residual", "residual"),
        ("latents", "state"),
        "transformer",
    ),
    # The denoised latents from the transformer's layout to the decode's, on the devices: the
    # decode then depends on the VAE's mesh only, and models with other transformer meshes
    # share it.
    "latents_handoff": Signature(("latents",), ("latents",), None),
    "vae_decode": Signature(("params", "latents"), ("frames",), "vae"),
    # Continuous batching (`aot build --continuous`): B slots, each a video at its own step.
    # A join writes new prompts' keys and values and new noise into the slots marked `joining`
    # (their sampler state zeroed); a step takes one sampler row and guidance per slot and
    # changes only the slots marked `active`; a finished slot's video is decoded alone.
    "join_kv": Signature(("kv", "new_kv", "joining"), ("kv",), None),
    "join_latents": Signature(("latents", "state", "noise", "joining"), ("latents", "state"), None),
    "slot_step": Signature(
        ("params", "latents", "kv", "row", "state", "guidance", "active"),
        ("latents", "state"),
        "transformer",
    ),
    "slot_decode": Signature(("params", "latents", "slot"), ("frames",), "vae"),
}
# Pipeline variants: the programs a build of each holds, in the order a generation runs them.
# A build key names its variant; the loader checks that its build holds exactly these.
# `i2v`: an image conditions the step through its VAE latents (Wan 2.2 I2V-A14B); `i2v-clip`:
# through its CLIP features too (Wan 2.1 I2V). A model's own variant: `wan.configs.ModelConfig`.
_DENOISE_AND_DECODE = ("denoise_step", "latents_handoff", "vae_decode")
PIPELINES: dict[str, tuple[str, ...]] = {
    "t2v": ("text_encode", "kv_cache", *_DENOISE_AND_DECODE),
    "i2v": ("text_encode", "vae_encode", "image_kv_cache", *_DENOISE_AND_DECODE),
    "i2v-clip": (
        "text_encode", "image_encode", "vae_encode", "image_kv_cache", *_DENOISE_AND_DECODE
    ),
}  # fmt: skip
DEFAULT_PIPELINE = "t2v"
# The programs that take the image or what is made of it: a build holding one makes videos
# from an image.
IMAGE_PROGRAMS = ("image_encode", "vae_encode", "image_kv_cache")
# What a build with step caching holds in place of a program.
STEP_CACHE_PROGRAMS: dict[str, tuple[str, ...]] = {"denoise_step": ("cache_step", "cached_step")}
# What a continuous build holds in place of a program: the step and the joins for the step, a
# video's own decode for the handoff and the batch's decode.
CONTINUOUS_PROGRAMS: dict[str, tuple[str, ...]] = {
    "denoise_step": ("slot_step", "join_kv", "join_latents"),
    "latents_handoff": (),
    "vae_decode": ("slot_decode",),
}
# What a build with sparse attention holds in place of a step that runs the blocks: the dense
# step, which the first steps run, and its sparse variant (step caching's too).
SPARSE_PROGRAMS: dict[str, tuple[str, ...]] = {
    "denoise_step": ("denoise_step", "radial_step"),
    "cache_step": ("cache_step", "radial_cache_step"),
}
RADIAL_STEP = SPARSE_PROGRAMS["denoise_step"][1]
# Every such table; the first program of a replacement has the outputs of the one it replaces.
REPLACEMENTS = (STEP_CACHE_PROGRAMS, CONTINUOUS_PROGRAMS, SPARSE_PROGRAMS)


def replaced(programs: Sequence[str], table: Mapping[str, tuple[str, ...]]) -> tuple[str, ...]:
    """`programs` with the replacements of `table` (one of REPLACEMENTS) in place."""
    return tuple(p for name in programs for p in table.get(name, (name,)))


def sparse_variant(program: str) -> str:
    """What a sparse step of a sparse build runs in place of `program`: its sparse variant, or
    itself where it runs no attention (MagCache's `cached_step`)."""
    return SPARSE_PROGRAMS.get(program, (program, program))[1]


def with_step_cache(programs: Sequence[str]) -> tuple[str, ...]:
    """`programs` with step caching's in place of those it replaces (STEP_CACHE_PROGRAMS)."""
    return replaced(programs, STEP_CACHE_PROGRAMS)


def producer(source: str, programs: Sequence[str]) -> tuple[str, str]:
    """(program, output) of `source` ("program.output") in a build holding `programs`: a
    program another replaces (REPLACEMENTS) is replaced by the first of them, which has its
    outputs."""
    program, output = source.split(".")
    if program not in programs:
        program = next(t[program][0] for t in REPLACEMENTS if t.get(program, ("",))[0] in programs)
    return program, output


def full_step(programs: Sequence[str]) -> str:
    """The program that runs a whole denoise step in a build holding `programs`."""
    return producer("denoise_step.latents", programs)[0]


def components(
    num_experts: int, programs: Sequence[str] = PIPELINES[DEFAULT_PIPELINE]
) -> tuple[str, ...]:
    """The weight components the programs of a build take, named as in a diffusers pipeline
    folder (`vae_encoder`: the encode half of the VAE, which a text-to-video build never
    reads)."""
    taken = {SIGNATURES[p].weights for p in programs}
    experts = ("transformer", "transformer_2")[:num_experts]
    return tuple(
        c
        for c in ("text_encoder", "image_encoder", *experts, "vae_encoder", "vae")
        if (c if c not in experts else "transformer") in taken
    )


def positional(program: str, inputs: Mapping[str, Any]) -> tuple[Any, ...]:
    """`inputs` (by name) in `program`'s call order; every input named, no other."""
    names = SIGNATURES[program].inputs
    if set(inputs) != set(names):
        raise KeyError(f"{program} takes {', '.join(names)}; given {', '.join(inputs)}")
    return tuple(inputs[name] for name in names)


def named(program: str, values: Sequence[Any]) -> dict[str, Any]:
    """`values` in `program`'s call order, by input name."""
    return dict(zip(SIGNATURES[program].inputs, values, strict=True))


def first_program_taking(
    component: str, programs: Sequence[str] = PIPELINES[DEFAULT_PIPELINE]
) -> str:
    """The first of `programs` whose `params` are `component`'s (a second expert is a
    transformer)."""
    kind = "transformer" if component.startswith("transformer") else component
    return next(name for name in programs if SIGNATURES[name].weights == kind)
