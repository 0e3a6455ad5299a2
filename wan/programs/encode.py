"""The programs before the steps: the prompt's embeddings and every step's cross-attention keys and
values (`text_encode`, `kv_cache`); image to video's image encodings and step conditioning
(`image_encode`, `vae_encode`, `image_kv_cache`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from wan import axes, sharding
from wan.configs import ModelConfig, VideoShape
from wan.models.text_encoder import prompt_embeddings
from wan.models.vae import normalize_latents
from wan.programs.core import (
    KV_AXES,
    Axes,
    Program,
    ProgramOptions,
    Tree,
    abstract_module,
    kv_shape,
    per_video,
    sds,
    split_abstract,
)
from wan.sharding import LATENTS, VIDEO


def text_encode_program(config: ModelConfig, shape: VideoShape, options: ProgramOptions) -> Program:
    graphdef, params, param_axes = split_abstract(abstract_module(config, "text_encoder", options))
    length = config.text_encoder.max_length

    def text_encode(params: Tree, ids: jax.Array, mask: jax.Array) -> jax.Array:
        encoder = nnx.merge(graphdef, params)
        out = prompt_embeddings(encoder(ids, mask), mask, length)
        return {"embeddings": sharding.constrain(out, (axes.BATCH, None, None))}

    tokens = sds((shape.step_batch, length), jnp.int32)
    return Program(
        "text_encode",
        text_encode,
        {"params": params, "ids": tokens, "mask": tokens},
        {"params": param_axes, "ids": (axes.BATCH, None), "mask": (axes.BATCH, None)},
        {"embeddings": (axes.BATCH, None, None)},
        "transformer",
    )


def kv_cache_program(config: ModelConfig, shape: VideoShape, options: ProgramOptions) -> Program:
    graphdef, params, param_axes = split_abstract(abstract_module(config, "transformer", options))
    tc = config.transformer
    emb = sds((shape.step_batch, config.text_encoder.max_length, tc.text_dim), config.dtype)

    def kv_cache(params: Tree, embeddings: jax.Array) -> dict[str, tuple[jax.Array, jax.Array]]:
        # Batch pinned on input and output: each device computes and keeps its own slice.
        embeddings = sharding.constrain(embeddings, (axes.BATCH, None, None))
        model = nnx.merge(graphdef, params)
        k, v = model.compute_kv_cache(embeddings)
        return {"kv": (sharding.constrain(k, KV_AXES), sharding.constrain(v, KV_AXES))}

    return Program(
        "kv_cache",
        kv_cache,
        {"params": params, "embeddings": emb},
        {"params": param_axes, "embeddings": (axes.BATCH, None, None)},
        {"kv": (KV_AXES, KV_AXES)},
        "transformer",
    )


IMAGE_TOKENS: Axes = (axes.BATCH, None, None)  # CLIP features (B, tokens, width), per video


CLIP_PIXELS: Axes = (axes.BATCH, None, None, None, None)  # (B, images, size, size, 3)


def image_encode_program(
    config: ModelConfig, shape: VideoShape, options: ProgramOptions
) -> Program:
    """Each video's images (CLIP-preprocessed, channels-last: its first frame, and for Wan 2.1
    FLF2V its last, `ModelConfig.clip_images`) -> their CLIP features one after the other: the
    penultimate layer's tokens, which the transformer's image embedder takes."""
    graphdef, params, param_axes = split_abstract(abstract_module(config, "image_encoder", options))
    size = config.image_encoder.image_size
    pixels = sds((shape.batch, config.clip_images, size, size, 3), jnp.float32)

    def image_encode(params: Tree, pixels: jax.Array) -> dict[str, jax.Array]:
        encoder = nnx.merge(graphdef, params)
        pixels = sharding.constrain(pixels, CLIP_PIXELS)
        features = encoder(pixels.reshape(-1, *pixels.shape[2:]))
        features = features.reshape(shape.batch, -1, features.shape[-1])  # (B, n * tokens, C)
        return {"image_embeddings": sharding.constrain(features.astype(config.dtype), IMAGE_TOKENS)}

    return Program(
        "image_encode",
        image_encode,
        {"params": params, "pixels": pixels},
        {"params": param_axes, "pixels": CLIP_PIXELS},
        {"image_embeddings": IMAGE_TOKENS},
        "transformer",
    )


def vae_encode_program(config: ModelConfig, shape: VideoShape, options: ProgramOptions) -> Program:
    """Each video's image (in [-1, 1], the build's size) -> the step's condition: the VAE
    latents of the image followed by frames - 1 zero frames (normalized as the latents are),
    after a mask whose channels mark the frames each latent frame stands for that are given
    (the first frame's). On the VAE mesh, laid out as the decode is; the small condition is
    then replicated, for the transformer mesh to take its slices without an all-to-all."""
    graphdef, params, param_axes = split_abstract(abstract_module(config, "vae_encoder", options))
    image = sds((shape.batch, shape.height, shape.width, 3), jnp.float32)
    image_axes = (axes.VAE_BATCH, axes.VAE_HEIGHT, axes.VAE_WIDTH, None)
    mode = image_condition(config, options)
    # `first_frame` encodes the image alone (one latent frame), and takes no last image.
    frames = shape.frames if mode == "channels" else 1

    def vae_encode(params, image, last_image, has_last) -> dict[str, jax.Array]:
        encoder = nnx.merge(graphdef, params)
        video = jnp.zeros((shape.batch, frames, *image.shape[1:]), image.dtype).at[:, 0].set(image)
        if frames > 1:  # the last frame: the last image where given (first-last-frame)
            last = jnp.where(per_video(has_last, image.ndim), last_image, 0.0)
            video = video.at[:, -1].set(last)
        mean, _ = encoder.encode(sharding.constrain(video, VIDEO))  # the posterior's argmax
        condition = normalize_latents(mean.astype(jnp.float32), config.vae)
        if mode == "channels":
            # A channel per frame a latent frame stands for, 1 where the frame is given: the
            # first frame (all of latent frame 0's) and the last (latent frame T-1's last).
            mask = jnp.zeros((*condition.shape[:-1], config.vae.temporal_factor), jnp.float32)
            mask = mask.at[:, 0].set(1.0)
            if frames > 1:
                mask = mask.at[:, -1, ..., -1].set(per_video(has_last, 3).astype(jnp.float32))
            condition = jnp.concatenate([mask, condition], axis=-1)
        return {"condition": sharding.constrain(condition, (None,) * condition.ndim)}

    return Program(
        "vae_encode",
        vae_encode,
        {
            "params": params,
            "image": image,
            "last_image": image,
            "has_last": sds((shape.batch,), jnp.bool_),
        },
        {"params": param_axes, "image": image_axes, "last_image": image_axes, "has_last": (None,)},
        {"condition": (None,) * 5},
        "vae",
        # The first conv's tile (3 input channels, full resolution) takes 4.1 MiB at 720p:
        # 5 compiles fastest of those that fit (bench/vae_encode_vmem.py).
        scoped_vmem=True,
        vmem_floor_mib=5,
        vmem_hint="a larger --vae-vmem",
    )


def image_kv_cache_program(
    config: ModelConfig, shape: VideoShape, options: ProgramOptions
) -> Program:
    """kv_cache's keys and values of the prompts, with the image tokens' after them (CLIP
    features: both rows of a video's CFG pair see its image), and the condition laid out as the
    latents are: what every image-to-video step reads."""
    graphdef, params, param_axes = split_abstract(abstract_module(config, "transformer", options))
    tc = config.transformer
    emb = sds((shape.step_batch, config.text_encoder.max_length, tc.text_dim), config.dtype)
    image = None
    if config.image_encoder is not None:
        image = sds((shape.batch, config.image_tokens, tc.image_dim), config.dtype)
    condition = sds(condition_shape(config, shape, image_condition(config, options)), jnp.float32)
    _, kv_axes = step_conditioning(config, shape, options)

    def image_kv_cache(params, embeddings, image_embeddings, condition):
        embeddings = sharding.constrain(embeddings, (axes.BATCH, None, None))
        if image_embeddings is not None and shape.cfg:
            image_embeddings = jnp.repeat(image_embeddings, 2, axis=0)
        model = nnx.merge(graphdef, params)
        cross = model.compute_kv_cache(embeddings, image_embeddings)
        return {
            "kv": {
                "cross": tuple(sharding.constrain(t, KV_AXES) for t in cross),
                "condition": sharding.constrain(condition, LATENTS),
            }
        }

    return Program(
        "image_kv_cache",
        image_kv_cache,
        {"params": params, "embeddings": emb, "image_embeddings": image, "condition": condition},
        {"params": param_axes, "embeddings": (axes.BATCH, None, None),
         "image_embeddings": None if image is None else IMAGE_TOKENS,
         "condition": (None,) * 5},
        {"kv": kv_axes},
        "transformer",
        receives={"condition": "vae_encode.condition"},
    )  # fmt: skip


def image_condition(config: ModelConfig, options: ProgramOptions) -> str | None:
    """How an image conditions this build's steps (`ModelConfig.image_condition`), None for a
    text-to-video build."""
    return None if options.build.get("pipeline", "t2v") == "t2v" else config.image_condition


def step_conditioning(
    config: ModelConfig, shape: VideoShape, options: ProgramOptions
) -> tuple[Tree, Tree]:
    """(shapes, logical axes) of what every step reads, the `kv` that kv_cache (or
    image_kv_cache) leaves: the prompt's cross-attention keys and values; for image to video,
    {"cross": those and the image tokens' (with CLIP features), "condition": the image's}."""
    kv = kv_shape(config, shape)
    mode = image_condition(config, options)
    if mode is None:
        return (kv, kv), (KV_AXES, KV_AXES)
    cross, cross_axes = [kv, kv], [KV_AXES, KV_AXES]
    if config.image_encoder is not None:
        image = sds((*kv.shape[:2], config.image_tokens, kv.shape[3]), config.dtype)
        cross, cross_axes = cross + [image, image], cross_axes + [KV_AXES, KV_AXES]
    condition = sds(condition_shape(config, shape, mode), jnp.float32)
    return (
        {"cross": tuple(cross), "condition": condition},
        {"cross": tuple(cross_axes), "condition": LATENTS},
    )


def condition_shape(config: ModelConfig, shape: VideoShape, mode: str) -> tuple[int, ...]:
    """The condition's (B, T, h, w, C): `channels`, a mask channel per frame a latent frame
    stands for, then the latents of the image and the zero frames after it; `first_frame`, the
    image's one latent frame."""
    batch, frames, *grid, channels = shape.latent_shape(config)
    if mode == "first_frame":
        return (batch, 1, *grid, channels)
    return (batch, frames, *grid, config.vae.temporal_factor + channels)
