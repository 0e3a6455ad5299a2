"""The programs after the steps: the latents' handoff to the VAE's mesh and the decode to frames
(`latents_handoff`, `vae_decode`, continuous batching's `slot_decode`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from wan import sharding
from wan.configs import ModelConfig, VideoShape
from wan.models.vae import WanVAE, denormalize_latents
from wan.programs.core import (
    Program,
    ProgramOptions,
    Tree,
    abstract_module,
    sds,
    split_abstract,
)
from wan.sharding import LATENTS, VIDEO


def decode_frames(vae: WanVAE, latents: jax.Array, config: ModelConfig) -> jax.Array:
    """Normalised latents (B, T, h, w, C) -> frames in [0, 1], (B, F, H, W, 3), float32."""
    video = vae.decode(denormalize_latents(latents, config.vae).astype(vae.dtype))
    return jnp.clip(video.astype(jnp.float32) / 2 + 0.5, 0.0, 1.0)


def latents_handoff_program(
    config: ModelConfig, shape: VideoShape, options: ProgramOptions
) -> Program:
    """The denoised latents, as the last denoise step leaves them on the transformer mesh, laid
    out as the decode takes them on the VAE mesh. `options.gather_latents`: they arrive
    batch-sharded; replicate them before the spatial layout slices them (an all-gather of the
    small latents instead of an all-to-all)."""
    latents = sds(shape.latent_shape(config), jnp.float32)

    def latents_handoff(latents: jax.Array) -> dict[str, jax.Array]:
        if options.gather_latents:
            latents = sharding.constrain(latents, (None,) * latents.ndim)
        return {"latents": sharding.constrain(latents, VIDEO)}

    return Program(
        "latents_handoff",
        latents_handoff,
        {"latents": latents},
        {"latents": VIDEO},
        {"latents": VIDEO},
        "vae",
        receives={"latents": "denoise_step.latents"},
    )


# What the decode programs are besides their inputs: the host reads their frames; their
# convolutions compile for the build's scoped VMEM; the build records their all-gathers.
_DECODE = dict(
    host_outputs=True,
    scoped_vmem=True,
    analyses=("vae_gathers",),
    vmem_hint="another --vae-vmem: larger where one allocation is over its limit, smaller where "
    "the VMEM as a whole is",
)


def _decoded(vae: WanVAE, latents: jax.Array, config: ModelConfig, options: ProgramOptions) -> dict:
    """The decode's output: frames as uint8 (what videos are made of), or as float32 in [0, 1]
    for comparisons (`options.frames_dtype`)."""
    frames = decode_frames(vae, sharding.constrain(latents, VIDEO), config)
    if options.frames_dtype == "uint8":
        frames = jnp.round(frames * 255).astype(jnp.uint8)
    return {"frames": sharding.constrain(frames, VIDEO)}


def vae_decode_program(config: ModelConfig, shape: VideoShape, options: ProgramOptions) -> Program:
    """The batch's frames; the latents arrive in the VAE's layout (latents_handoff)."""
    graphdef, params, param_axes = split_abstract(abstract_module(config, "vae", options))
    latents = sds(shape.latent_shape(config), jnp.float32)

    def vae_decode(params: Tree, latents: jax.Array) -> jax.Array:
        return _decoded(nnx.merge(graphdef, params), latents, config, options)

    return Program(
        "vae_decode",
        vae_decode,
        {"params": params, "latents": latents},
        {"params": param_axes, "latents": VIDEO},
        {"frames": VIDEO},
        "vae",
        **_DECODE,
    )


def slot_decode_program(config: ModelConfig, shape: VideoShape, options: ProgramOptions) -> Program:
    """One video's frames: the video in slot `slot` of the batch's latents, as the step leaves
    them, taken out and laid out as the decode takes them (the VAE mesh's spatial sharding; on
    a mesh of one video per device, each device decodes it whole), then decoded as `vae_decode`
    decodes a batch of one."""
    graphdef, params, param_axes = split_abstract(abstract_module(config, "vae", options))
    latents = sds(shape.latent_shape(config), jnp.float32)

    def slot_decode(params: Tree, latents: jax.Array, slot: jax.Array) -> jax.Array:
        if options.gather_latents:  # as latents_handoff: replicated before the spatial slices
            latents = sharding.constrain(latents, (None,) * latents.ndim)
        video = jax.lax.dynamic_index_in_dim(latents, slot, keepdims=True)
        return _decoded(nnx.merge(graphdef, params), video, config, options)

    return Program(
        "slot_decode",
        slot_decode,
        {"params": params, "latents": latents, "slot": sds((), jnp.int32)},
        {"params": param_axes, "latents": LATENTS, "slot": ()},
        {"frames": VIDEO},
        "vae",
        receives={"latents": "slot_step.latents"},
        **_DECODE,
    )
