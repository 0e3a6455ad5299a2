"""The denoise step and its variants: the plain step, Radial attention's (`radial_step`),
continuous batching's slots and joins (`slot_step`, `join_kv`, `join_latents`), step caching's
(`cache_step`, `cached_step`, and with Radial attention `radial_cache_step`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from wan import schedulers, sharding, sparse_attention
from wan.configs import ModelConfig, VideoShape
from wan.models.radial_mask import RadialSpec
from wan.models.transformer import HIDDEN, Embedded, WanTransformer
from wan.programs.core import (
    KV_AXES,
    Axes,
    Program,
    ProgramOptions,
    Tree,
    abstract_module,
    kv_shape,
    per_video,
    sampler_row_shapes,
    sds,
    split_abstract,
    state_shapes,
)
from wan.programs.encode import image_condition, step_conditioning
from wan.sharding import LATENTS

# A transformer pass of a denoise step: (model, embedded step inputs, KV cache, the program's
# extra inputs by name) -> (the blocks' output tokens, the program's extra outputs by name).
TransformerPass = Callable[[WanTransformer, Embedded, Any, dict[str, Any]], tuple[jax.Array, dict]]
# What the build analyses of a step that runs every block dense (aot.building.analyses).
DENSE_ANALYSES = ("attention_kernels", "self_attention")


def _all_blocks(model: WanTransformer, embedded: Embedded, kv: Any, extra: dict) -> tuple:
    return model.run_blocks(embedded, kv), {}


# Longer than most: the step and its whole interface (inputs, axes, outputs) in one place.
def _step_program(
    name: str,
    config: ModelConfig,
    shape: VideoShape,
    options: ProgramOptions,
    transformer_pass: TransformerPass = _all_blocks,
    extra_args: dict[str, Tree] | None = None,
    extra_axes: dict[str, Tree] | None = None,
    extra_out_axes: dict[str, Tree] | None = None,
    donate: tuple[str, ...] = (),
    analyses: tuple[str, ...] = DENSE_ANALYSES,
    per_slot: bool = False,
) -> Program:
    """A denoise step: the transformer on the latents (both CFG passes at once), guidance and
    the sampler's update; `transformer_pass` runs the blocks (or stands in for them).
    `per_slot` (continuous batching): one sampler row and one guidance scale per video of the
    batch, and only the videos marked in its `active` input change."""
    graphdef, params, param_axes = split_abstract(abstract_module(config, "transformer", options))
    latents = sds(shape.latent_shape(config), jnp.float32)
    kv, kv_axes = step_conditioning(config, shape, options)
    mode = image_condition(config, options)
    slots = (shape.batch,) if per_slot else ()
    row = {k: sds((*slots, *s.shape), s.dtype) for k, s in sampler_row_shapes(config).items()}
    state = state_shapes(config, shape)
    state_axes = {"last_sample": LATENTS, "x0_history": (None, *LATENTS)}
    extra_args, extra_axes, extra_out_axes = (
        extra_args or {},
        extra_axes or {},
        extra_out_axes or {},
    )

    def step(params, latents, kv, row, state, guidance, *extra):
        model = nnx.merge(graphdef, params)
        extra = dict(zip(extra_args, extra, strict=True))
        x = latents
        kv_condition = None
        if mode is not None:
            kv_condition = kv["condition"]
            x = _conditioned(x, kv_condition, mode)
            kv = kv["cross"]
        x = x.astype(config.dtype)
        t = row["timestep"]
        if shape.cfg:
            # Pairs (cond_i, uncond_i) side by side, as the prompts are encoded: a device holding
            # a video's latents holds both of its passes, so guidance needs no collective.
            x = jnp.repeat(x, 2, axis=0)
            t = jnp.repeat(t, 2) if per_slot else t
        t = jnp.broadcast_to(t, (x.shape[0],))
        embedded = model.embed(x, t, first_at_zero=mode == "first_frame")
        tokens, extra_out = transformer_pass(model, embedded, kv, extra)
        flow = model.head(tokens, embedded).astype(jnp.float32)
        if per_slot:
            row, guidance = _slot_rows(row, latents.ndim), per_video(guidance, latents.ndim)
        if shape.cfg:
            pairs = flow.reshape(-1, 2, *flow.shape[1:])
            cond, uncond = pairs[:, 0], pairs[:, 1]
            flow = uncond + guidance * (cond - uncond)
        new, new_state = schedulers.step(
            row, schedulers.SamplerState(**state), flow, latents.astype(jnp.float32)
        )
        new_state = {"last_sample": new_state.last_sample, "x0_history": new_state.x0_history}
        if mode == "first_frame":  # the first frame stays the image's (diffusers blends it in
            new = _conditioned(new, kv_condition, mode)  # for each step and before the decode)
        if per_slot:  # the slots not in this step keep what they hold
            active = per_video(extra["active"], latents.ndim)
            new = jnp.where(active, new, latents)
            new_state = {
                "last_sample": jnp.where(active, new_state["last_sample"], state["last_sample"]),
                "x0_history": jnp.where(active[None], new_state["x0_history"], state["x0_history"]),
            }
        return {"latents": sharding.constrain(new, LATENTS), "state": new_state, **extra_out}

    return Program(
        name,
        step,
        {"params": params, "latents": latents, "kv": kv, "row": row, "state": state,
         "guidance": sds(slots, jnp.float32), **extra_args},
        {"params": param_axes, "latents": LATENTS, "kv": kv_axes,
         "row": {k: (None,) * len(s.shape) for k, s in row.items()}, "state": state_axes,
         "guidance": (None,) * len(slots), **extra_axes},
        {"latents": LATENTS, "state": state_axes, **extra_out_axes},
        "transformer",
        donate=("latents", "state", *donate),  # a step holds one copy of each
        analyses=analyses,
        vmem_hint="smaller --attention flash blocks (e.g. flash:1024:1024:256)",
    )  # fmt: skip


BlockRange = Callable[[WanTransformer, jax.Array, Embedded, Any, int, int], jax.Array]


def _dense_range(
    model: WanTransformer, x: jax.Array, embedded: Embedded, kv: Any, start: int, stop: int
) -> jax.Array:
    return model.run_block_range(x, embedded, kv, start, stop)


def _radial_range(settings: sparse_attention.Radial) -> BlockRange:
    """Blocks start..stop-1 of a Radial step: those under `dense_layers` dense, the others'
    video self-attention through the mask of the step's token grid; two loops over the stacked
    weights (the kernel is a trace-time choice, so one loop body cannot switch it per layer)."""

    def radial_range(model, x, embedded, kv, start, stop):
        dense = min(max(settings.dense_layers, start), stop)
        mask = RadialSpec.of(settings, embedded.grid)
        if dense > start:
            x = model.run_block_range(x, embedded, kv, start, dense)
        return model.run_block_range(x, embedded, kv, dense, stop, mask) if stop > dense else x

    return radial_range


def _radial_settings(options: ProgramOptions, name: str) -> sparse_attention.Radial:
    settings = sparse_attention.parse(options.build["sparse_attention"])
    if settings is None:
        raise ValueError(f"{name} is a step of a --sparse-attention radial build")
    return settings


def radial_step_program(config: ModelConfig, shape: VideoShape, options: ProgramOptions) -> Program:
    """The denoise step of a `--sparse-attention radial` build after its dense steps."""
    blocks = _radial_range(_radial_settings(options, "radial_step"))

    def radial_pass(model, embedded, kv, extra):
        return blocks(model, embedded.tokens, embedded, kv, 0, model.config.num_layers), {}

    return _step_program(
        "radial_step", config, shape, options, radial_pass, analyses=("radial_attention",)
    )


def _conditioned(latents: jax.Array, condition: jax.Array, mode: str) -> jax.Array:
    """The transformer's input of image to video: the condition beside the latents' channels,
    or in place of their first frame."""
    if mode == "channels":
        return jnp.concatenate([latents, condition], axis=-1)
    return jnp.concatenate([condition.astype(latents.dtype), latents[:, 1:]], axis=1)


def denoise_step_program(
    config: ModelConfig, shape: VideoShape, options: ProgramOptions
) -> Program:
    return _step_program("denoise_step", config, shape, options)


def _slot_rows(row: dict[str, jax.Array], ndim: int) -> dict[str, jax.Array]:
    """Sampler rows, one per video, shaped as `schedulers.step` uses them on latents of `ndim`
    dims: a coefficient (B,) broadcast per video, a history's weights (B, order) as
    (order, B, 1, ...) so that weight k is again one per video."""
    return {
        k: per_video(v, ndim) if v.ndim == 1 else v.T.reshape(*v.T.shape, *(1,) * (ndim - 1))
        for k, v in row.items()
    }


def slot_step_program(config: ModelConfig, shape: VideoShape, options: ProgramOptions) -> Program:
    """A denoise step of the videos marked `active`, each with its own sampler row and guidance
    (a two-expert model: one call per expert, each marking its videos)."""
    return _step_program(
        "slot_step", config, shape, options,
        extra_args={"active": sds((shape.batch,), jnp.bool_)},
        extra_axes={"active": (None,)},
        per_slot=True,
    )  # fmt: skip


def _select_rows(joining: jax.Array, new: jax.Array, old: jax.Array, axis: int) -> jax.Array:
    """`old` with the videos marked in `joining` (B,) taken from `new`; along `axis`, a video
    has len / B consecutive rows (its CFG pair)."""
    per_video = old.shape[axis] // joining.shape[0]
    mask = jnp.repeat(joining, per_video).reshape(
        (1,) * axis + (old.shape[axis],) + (1,) * (old.ndim - axis - 1)
    )
    return jnp.where(mask, new, old)


def join_kv_program(config: ModelConfig, shape: VideoShape, options: ProgramOptions) -> Program:
    """The batch's cross-attention keys and values with the joining videos' rows (prompt and
    negative prompt) replaced by a fresh KV cache's, computed for them by kv_cache."""
    kv = kv_shape(config, shape)

    def join_kv(kv, new_kv, joining):
        return {
            "kv": tuple(
                sharding.constrain(_select_rows(joining, n, o, axis=1), KV_AXES)
                for n, o in zip(new_kv, kv, strict=True)
            )
        }

    return Program(
        "join_kv",
        join_kv,
        {"kv": (kv, kv), "new_kv": (kv, kv), "joining": sds((shape.batch,), jnp.bool_)},
        {"kv": (KV_AXES, KV_AXES), "new_kv": (KV_AXES, KV_AXES), "joining": (None,)},
        {"kv": (KV_AXES, KV_AXES)},
        "transformer",
        donate=("kv",),
    )


def join_latents_program(
    config: ModelConfig, shape: VideoShape, options: ProgramOptions
) -> Program:
    """The batch's latents with the joining videos' replaced by their initial noise, and their
    sampler state zeroed (a video's state before its first step)."""
    latents = sds(shape.latent_shape(config), jnp.float32)
    state = state_shapes(config, shape)
    state_axes = {"last_sample": LATENTS, "x0_history": (None, *LATENTS)}

    def join_latents(latents, state, noise, joining):
        return {
            "latents": sharding.constrain(_select_rows(joining, noise, latents, 0), LATENTS),
            "state": {
                "last_sample": _select_rows(joining, 0.0, state["last_sample"], 0),
                "x0_history": _select_rows(joining, 0.0, state["x0_history"], 1),
            },
        }

    return Program(
        "join_latents",
        join_latents,
        {"latents": latents, "state": state, "noise": latents,
         "joining": sds((shape.batch,), jnp.bool_)},
        {"latents": LATENTS, "state": state_axes, "noise": LATENTS, "joining": (None,)},
        {"latents": LATENTS, "state": state_axes},
        "transformer",
        donate=("latents", "state"),
    )  # fmt: skip


RESIDUAL_AXES: Axes = HIDDEN


def _residual_shape(config: ModelConfig, shape: VideoShape) -> jax.ShapeDtypeStruct:
    tokens = shape.tokens(config) // shape.batch
    return sds((shape.step_batch, tokens, config.transformer.inner_dim), config.dtype)


def _first_block_change(first: jax.Array, previous: jax.Array, cfg: bool) -> jax.Array:
    """The first block residual's relative change since the last computed step (diffusers'
    FirstBlockCache: mean |r - r_prev| / mean |r_prev|), per cache context: with CFG the prompt
    rows and the negative-prompt rows each make one, as diffusers' two passes do."""
    change = jnp.abs(first.astype(jnp.float32) - previous.astype(jnp.float32)).sum(axis=(1, 2))
    size = jnp.abs(previous.astype(jnp.float32)).sum(axis=(1, 2))
    if cfg:
        change, size = change.reshape(-1, 2).sum(0), size.reshape(-1, 2).sum(0)
    else:
        change, size = change.sum(keepdims=True), size.sum(keepdims=True)
    return change / size


def _cache_pass(cfg: bool, blocks: BlockRange = _dense_range) -> TransformerPass:
    """The first block, then the others unless the first's residual changed by at most
    `threshold` in every context (a negative threshold always computes): the first-block
    cache's decision, made on the devices so that a step needs no host round trip. `blocks`
    runs a range of blocks (a Radial step's: `_radial_range`)."""

    def cache_pass(model, embedded, kv, extra):
        x0 = embedded.tokens
        layers = model.config.num_layers
        xa = blocks(model, x0, embedded, kv, 0, 1)
        first = xa - x0
        change = _first_block_change(first, extra["first_residual"], cfg)
        skip = jnp.all(change <= extra["threshold"])

        def computed(_):
            x1 = blocks(model, xa, embedded, kv, 1, layers)
            return x1, first, x1 - xa

        def reused(_):
            return xa + extra["residual"], extra["first_residual"], extra["residual"]

        x1, first_out, rest_out = jax.lax.cond(skip, reused, computed, None)
        norms = jnp.linalg.norm((x1 - x0).astype(jnp.float32), axis=-1)
        return x1, {
            "first_residual": sharding.constrain(first_out, RESIDUAL_AXES),
            "residual": sharding.constrain(rest_out, RESIDUAL_AXES),
            "residual_norm": sharding.constrain(norms, RESIDUAL_AXES[:2]),
            "skipped": skip,
        }

    return cache_pass


def _cached_pass(model, embedded, kv, extra):
    """MagCache's skipped step: the blocks' output is their input plus the last computed
    step's residual of all the blocks."""
    return embedded.tokens + extra["first_residual"] + extra["residual"], {}


def _cache_step(
    name: str, config: ModelConfig, shape: VideoShape, options: ProgramOptions,
    blocks: BlockRange, analyses: tuple[str, ...],
) -> Program:  # fmt: skip
    residual = _residual_shape(config, shape)
    return _step_program(
        name, config, shape, options, _cache_pass(shape.cfg, blocks),
        {"first_residual": residual, "residual": residual, "threshold": sds((), jnp.float32)},
        {"first_residual": RESIDUAL_AXES, "residual": RESIDUAL_AXES, "threshold": ()},
        {"first_residual": RESIDUAL_AXES, "residual": RESIDUAL_AXES,
         "residual_norm": RESIDUAL_AXES[:2], "skipped": ()},
        donate=("first_residual", "residual"), analyses=analyses,
    )  # fmt: skip


def cache_step_program(config: ModelConfig, shape: VideoShape, options: ProgramOptions) -> Program:
    """A full step that also leaves its residuals on the devices and their per-token norms for
    the host (MagCache's calibration), or, under the first-block cache's threshold, reuses the
    given residual after the first block."""
    return _cache_step("cache_step", config, shape, options, _dense_range, DENSE_ANALYSES)


def radial_cache_step_program(
    config: ModelConfig, shape: VideoShape, options: ProgramOptions
) -> Program:
    """cache_step after a `--sparse-attention radial` build's dense steps: its blocks as
    radial_step runs them."""
    blocks = _radial_range(_radial_settings(options, "radial_cache_step"))
    return _cache_step("radial_cache_step", config, shape, options, blocks, ("radial_attention",))


def cached_step_program(config: ModelConfig, shape: VideoShape, options: ProgramOptions) -> Program:
    """A step whose blocks are replaced by the given residuals (MagCache's skipped step)."""
    residual = _residual_shape(config, shape)
    return _step_program(
        "cached_step", config, shape, options, _cached_pass,
        {"first_residual": residual, "residual": residual},
        {"first_residual": RESIDUAL_AXES, "residual": RESIDUAL_AXES},
        analyses=(),  # no attention runs: its kernels' FLOPs are not this step's
    )  # fmt: skip
