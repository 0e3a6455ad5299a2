"""The device programs of the pipeline, as pure functions plus their abstract inputs.

Each program takes parameters as plain nested dicts (pure dicts of the NNX state) and plain
dicts/tuples elsewhere, so a serialized executable's pytree definitions name no flax or wan
class. Shardings are attached from logical axis names through wan.sharding; `aot` lowers these
on any target and the runtime calls the resulting executables. Their named inputs and outputs
are `wan.interface.SIGNATURES` (tabled in docs/architecture.md); a step's batch is
S = 2B with classifier-free guidance (prompt and negative-prompt rows in pairs), else B.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from wan import axes, interface, kinds, schedulers, sharding, sparse_attention
from wan.configs import ModelConfig, VideoShape
from wan.models.radial_mask import RadialSpec
from wan.models.text_encoder import prompt_embeddings
from wan.models.transformer import HIDDEN, Embedded, WanTransformer
from wan.models.vae import WanVAE, denormalize_latents, normalize_latents
from wan.sharding import LATENTS, VIDEO

Tree = Any
Axes = tuple[str | None, ...]
KV_AXES: Axes = (axes.LAYERS, axes.BATCH, axes.KV_LENGTH, axes.HEADS)  # a KV cache's arrays


@dataclasses.dataclass(frozen=True)
class ProgramOptions:
    """The build's choices the programs are made with (aot.building.plan resolves them)."""

    attention: str = "dot"
    context_parallel: str = "gather"
    gather_latents: bool = False  # ShardingPlan.gather_latents
    frames_dtype: str = "uint8"  # float32: frames in [0, 1], for comparisons
    # The plain build options' values by name (runtime.builds.build_options: `quant`, ...): a program
    # or a module made for an option reads it here.
    build: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def module_options(self, names: Sequence[str]) -> dict[str, Any]:
        """The options among `names` (a kind's `module_options`) that this build sets; the
        module's own default stands for one it does not."""
        values = {"attention": self.attention, "context_parallel": self.context_parallel}
        values.update(self.build)
        return {name: values[name] for name in names if name in values}


# ----------------------------------------------------------------------------------------------
# Modules <-> pure parameter dicts.


def make_module(
    config: ModelConfig,
    component: str,
    options: ProgramOptions | None = None,
    rngs: nnx.Rngs | None = None,
) -> nnx.Module:
    """The module of a component with freshly initialised (random) weights: the module of the
    component's kind (`wan.kinds`), given the build options it takes (`module_options`)."""
    part = kinds.part(config, component)
    kind = kinds.of(part)
    module_factory, _ = kind.half(component)
    return module_factory(
        part,
        dtype=jnp.dtype(config.dtype),
        param_dtype=jnp.dtype(kind.param_dtype or config.dtype),
        rngs=rngs or nnx.Rngs(0),
        **(options or ProgramOptions()).module_options(kind.module_options),
    )


def abstract_module(
    config: ModelConfig, component: str, options: ProgramOptions | None = None
) -> nnx.Module:
    """The module of a component, built abstractly (no weights allocated)."""
    return nnx.eval_shape(lambda: make_module(config, component, options))


def components(config: ModelConfig) -> tuple[str, ...]:
    """The weight components of a model's pipeline, named as in a diffusers pipeline folder."""
    programs = [p for pipeline in config.pipelines for p in interface.PIPELINES[pipeline]]
    return interface.components(config.num_experts, programs)


def split_abstract(module: nnx.Module) -> tuple[nnx.GraphDef, Tree, Tree]:
    """(graphdef, abstract pure-dict params, logical axes per param as a matching dict)."""
    graphdef, state = nnx.split(module)
    specs = nnx.get_partition_spec(state)
    pure = nnx.to_pure_dict(state)
    # Unnamed parameters (P()) are replicated: one None per dimension.
    logical = jax.tree.map(
        lambda s, a: tuple(s) + (None,) * (len(a.shape) - len(s)),
        nnx.to_pure_dict(specs),
        pure,
        is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec),
    )
    return graphdef, pure, logical


# ----------------------------------------------------------------------------------------------
# The programs.


@dataclasses.dataclass(frozen=True)
class Program:
    """A function and its abstract arguments with logical axes, before any mesh is chosen; its
    inputs and outputs are named as in `wan.interface.SIGNATURES`."""

    name: str
    fn: Callable[..., dict[str, Any]]  # called with the inputs in order, returns outputs by name
    args: dict[str, Tree]  # input name -> pytree of jax.ShapeDtypeStruct
    arg_axes: dict[str, Tree]  # input name -> matching pytree of logical-axes tuples
    out_axes: dict[str, Tree]  # output name -> logical axes
    mesh: str  # "transformer" or "vae"
    # Inputs the program consumes (their buffers may hold its outputs): the caller must not use
    # them after the call.
    donate: tuple[str, ...] = ()
    # Inputs that arrive as another program leaves them on the devices: name -> "program.output".
    receives: dict[str, str] = dataclasses.field(default_factory=dict)
    # Outputs the host reads (frames): whole on every device in a multi-process job, where each
    # process needs them on its own host.
    host_outputs: bool = False
    # Compiled for the build's scoped VMEM on TPU (--vae-vmem): convolution-heavy programs,
    # whose compile time follows the tiles libtpu emits for it; at least `vmem_floor_mib` (MiB),
    # what its largest tile needs.
    scoped_vmem: bool = False
    vmem_floor_mib: int = 0
    # What `aot build` records of it besides memory, FLOPs and collectives, by name
    # (aot.building.analyses.ANALYSES).
    analyses: tuple[str, ...] = ()
    # What to change when it does not fit the target's on-chip memory (VMEM), for the error.
    vmem_hint: str | None = None

    def __post_init__(self):
        signature = interface.SIGNATURES[self.name]
        if (tuple(self.args), tuple(self.arg_axes), tuple(self.out_axes)) != (
            signature.inputs,
            signature.inputs,
            signature.outputs,
        ):
            raise ValueError(f"{self.name}: inputs or outputs differ from {signature}")

    @property
    def donate_argnums(self) -> tuple[int, ...]:
        return tuple(interface.SIGNATURES[self.name].inputs.index(n) for n in self.donate)


def _is_axes(x: Any) -> bool:
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def shardings(mesh: jax.sharding.Mesh, shapes: Tree, logical: Tree, rules: sharding.Rules) -> Tree:
    """NamedShardings for a pytree of shapes from its logical axes."""
    return jax.tree.map(
        lambda ax, s: sharding.named_sharding(mesh, ax, s.shape, rules),
        logical,
        shapes,
        is_leaf=_is_axes,
    )


def _sds(shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def text_encode_program(config: ModelConfig, shape: VideoShape, options: ProgramOptions) -> Program:
    graphdef, params, param_axes = split_abstract(abstract_module(config, "text_encoder", options))
    length = config.text_encoder.max_length

    def text_encode(params: Tree, ids: jax.Array, mask: jax.Array) -> jax.Array:
        encoder = nnx.merge(graphdef, params)
        out = prompt_embeddings(encoder(ids, mask), mask, length)
        return {"embeddings": sharding.constrain(out, (axes.BATCH, None, None))}

    tokens = _sds((shape.step_batch, length), jnp.int32)
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
    emb = _sds((shape.step_batch, config.text_encoder.max_length, tc.text_dim), config.dtype)

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


# ----------------------------------------------------------------------------------------------
# Image to video: the image's CLIP features and latents, and the conditioning of every step.

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
    pixels = _sds((shape.batch, config.clip_images, size, size, 3), jnp.float32)

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
    image = _sds((shape.batch, shape.height, shape.width, 3), jnp.float32)
    image_axes = (axes.VAE_BATCH, axes.VAE_HEIGHT, axes.VAE_WIDTH, None)
    mode = image_condition(config, options)
    # `first_frame` encodes the image alone (one latent frame), and takes no last image.
    frames = shape.frames if mode == "channels" else 1

    def vae_encode(params, image, last_image, has_last) -> dict[str, jax.Array]:
        encoder = nnx.merge(graphdef, params)
        video = jnp.zeros((shape.batch, frames, *image.shape[1:]), image.dtype).at[:, 0].set(image)
        if frames > 1:  # the last frame: the last image where given (first-last-frame)
            last = jnp.where(_per_video(has_last, image.ndim), last_image, 0.0)
            video = video.at[:, -1].set(last)
        mean, _ = encoder.encode(sharding.constrain(video, VIDEO))  # the posterior's argmax
        condition = normalize_latents(mean.astype(jnp.float32), config.vae)
        if mode == "channels":
            # A channel per frame a latent frame stands for, 1 where the frame is given: the
            # first frame (all of latent frame 0's) and the last (latent frame T-1's last).
            mask = jnp.zeros((*condition.shape[:-1], config.vae.temporal_factor), jnp.float32)
            mask = mask.at[:, 0].set(1.0)
            if frames > 1:
                mask = mask.at[:, -1, ..., -1].set(_per_video(has_last, 3).astype(jnp.float32))
            condition = jnp.concatenate([mask, condition], axis=-1)
        return {"condition": sharding.constrain(condition, (None,) * condition.ndim)}

    return Program(
        "vae_encode",
        vae_encode,
        {
            "params": params,
            "image": image,
            "last_image": image,
            "has_last": _sds((shape.batch,), jnp.bool_),
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
    emb = _sds((shape.step_batch, config.text_encoder.max_length, tc.text_dim), config.dtype)
    image = None
    if config.image_encoder is not None:
        image = _sds((shape.batch, config.image_tokens, tc.image_dim), config.dtype)
    condition = _sds(condition_shape(config, shape, image_condition(config, options)), jnp.float32)
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


def kv_shape(config: ModelConfig, shape: VideoShape) -> jax.ShapeDtypeStruct:
    tc = config.transformer
    return _sds(
        (tc.num_layers, shape.step_batch, config.text_encoder.max_length, tc.inner_dim),
        config.dtype,
    )


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
        image = _sds((*kv.shape[:2], config.image_tokens, kv.shape[3]), config.dtype)
        cross, cross_axes = cross + [image, image], cross_axes + [KV_AXES, KV_AXES]
    condition = _sds(condition_shape(config, shape, mode), jnp.float32)
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


def sampler_row_shapes(config: ModelConfig) -> dict[str, jax.ShapeDtypeStruct]:
    row = schedulers.make_tables(config.scheduler, 2).row(0)
    return {k: _sds(np.shape(v), np.float32) for k, v in row.items()}


# A transformer pass of a denoise step: (model, embedded step inputs, KV cache, the program's
# extra inputs by name) -> (the blocks' output tokens, the program's extra outputs by name).
TransformerPass = Callable[[WanTransformer, Embedded, Any, dict[str, Any]], tuple[jax.Array, dict]]


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
    analyses: tuple[str, ...] = ("attention_kernels", "self_attention"),
    per_slot: bool = False,
) -> Program:
    """A denoise step: the transformer on the latents (both CFG passes at once), guidance and
    the sampler's update; `transformer_pass` runs the blocks (or stands in for them).
    `per_slot` (continuous batching): one sampler row and one guidance scale per video of the
    batch, and only the videos marked in its `active` input change."""
    graphdef, params, param_axes = split_abstract(abstract_module(config, "transformer", options))
    latents = _sds(shape.latent_shape(config), jnp.float32)
    kv, kv_axes = step_conditioning(config, shape, options)
    mode = image_condition(config, options)
    slots = (shape.batch,) if per_slot else ()
    row = {k: _sds((*slots, *s.shape), s.dtype) for k, s in sampler_row_shapes(config).items()}
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
            row, guidance = _slot_rows(row, latents.ndim), _per_video(guidance, latents.ndim)
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
            active = _per_video(extra["active"], latents.ndim)
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
         "guidance": _sds(slots, jnp.float32), **extra_args},
        {"params": param_axes, "latents": LATENTS, "kv": kv_axes,
         "row": {k: (None,) * len(s.shape) for k, s in row.items()}, "state": state_axes,
         "guidance": (None,) * len(slots), **extra_axes},
        {"latents": LATENTS, "state": state_axes, **extra_out_axes},
        "transformer",
        donate=("latents", "state", *donate),  # a step holds one copy of each
        analyses=analyses,
        vmem_hint="smaller --attention splash blocks (e.g. splash:1024:1024:512)",
    )  # fmt: skip


def _radial_pass(settings: sparse_attention.Radial) -> TransformerPass:
    """Radial Attention's blocks: the first `dense_layers` dense, the others' video
    self-attention through the mask of the step's token grid; two loops over the stacked
    weights (the kernel is a trace-time choice, so one loop body cannot switch it per layer)."""

    def radial_pass(model, embedded, kv, extra):
        layers = model.config.num_layers
        dense = min(settings.dense_layers, layers)
        mask = RadialSpec.of(settings, embedded.grid)
        x = model.run_block_range(embedded.tokens, embedded, kv, 0, dense)
        return model.run_block_range(x, embedded, kv, dense, layers, mask), {}

    return radial_pass


def radial_step_program(config: ModelConfig, shape: VideoShape, options: ProgramOptions) -> Program:
    """The denoise step of a `--sparse-attention radial` build after its dense steps."""
    settings = sparse_attention.parse(options.build["sparse_attention"])
    if settings is None:
        raise ValueError("radial_step is the step of a --sparse-attention radial build")
    return _step_program(
        "radial_step", config, shape, options, _radial_pass(settings),
        analyses=("radial_attention",),
    )  # fmt: skip


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


def _per_video(value: jax.Array, ndim: int) -> jax.Array:
    """One value per video (B,), shaped to broadcast over arrays (B, ...) of `ndim` dims."""
    return value.reshape(value.shape[0], *(1,) * (ndim - 1))


def _slot_rows(row: dict[str, jax.Array], ndim: int) -> dict[str, jax.Array]:
    """Sampler rows, one per video, shaped as `schedulers.step` uses them on latents of `ndim`
    dims: a coefficient (B,) broadcast per video, a history's weights (B, order) as
    (order, B, 1, ...) so that weight k is again one per video."""
    return {
        k: _per_video(v, ndim) if v.ndim == 1 else v.T.reshape(*v.T.shape, *(1,) * (ndim - 1))
        for k, v in row.items()
    }


# ----------------------------------------------------------------------------------------------
# Continuous batching (`aot build --continuous`): the batch's B videos are slots, each at its
# own step; programs that write new videos into slots and decode one slot's video.


def slot_step_program(config: ModelConfig, shape: VideoShape, options: ProgramOptions) -> Program:
    """A denoise step of the videos marked `active`, each with its own sampler row and guidance
    (a two-expert model: one call per expert, each marking its videos)."""
    return _step_program(
        "slot_step", config, shape, options,
        extra_args={"active": _sds((shape.batch,), jnp.bool_)},
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
        {"kv": (kv, kv), "new_kv": (kv, kv), "joining": _sds((shape.batch,), jnp.bool_)},
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
    latents = _sds(shape.latent_shape(config), jnp.float32)
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
         "joining": _sds((shape.batch,), jnp.bool_)},
        {"latents": LATENTS, "state": state_axes, "noise": LATENTS, "joining": (None,)},
        {"latents": LATENTS, "state": state_axes},
        "transformer",
        donate=("latents", "state"),
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Step caching (`aot build --step-cache`). Two residuals of the tokens, carried on the devices
# from the last computed step: the first block's (its output minus its input) and the other
# blocks' (the last block's output minus the first's). MagCache's residual of all the blocks is
# their sum; the first-block cache compares the first and reuses the second.

RESIDUAL_AXES: Axes = HIDDEN


def _residual_shape(config: ModelConfig, shape: VideoShape) -> jax.ShapeDtypeStruct:
    tokens = shape.tokens(config) // shape.batch
    return _sds((shape.step_batch, tokens, config.transformer.inner_dim), config.dtype)


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


def _cache_pass(cfg: bool) -> TransformerPass:
    """The first block, then the others unless the first's residual changed by at most
    `threshold` in every context (a negative threshold always computes): the first-block
    cache's decision, made on the devices so that a step needs no host round trip."""

    def cache_pass(model, embedded, kv, extra):
        x0 = embedded.tokens
        layers = model.config.num_layers
        xa = model.run_block_range(x0, embedded, kv, 0, 1)
        first = xa - x0
        change = _first_block_change(first, extra["first_residual"], cfg)
        skip = jnp.all(change <= extra["threshold"])

        def computed(_):
            x1 = model.run_block_range(xa, embedded, kv, 1, layers)
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


def cache_step_program(config: ModelConfig, shape: VideoShape, options: ProgramOptions) -> Program:
    """A full step that also leaves its residuals on the devices and their per-token norms for
    the host (MagCache's calibration), or, under the first-block cache's threshold, reuses the
    given residual after the first block."""
    residual = _residual_shape(config, shape)
    return _step_program(
        "cache_step", config, shape, options, _cache_pass(shape.cfg),
        {"first_residual": residual, "residual": residual, "threshold": _sds((), jnp.float32)},
        {"first_residual": RESIDUAL_AXES, "residual": RESIDUAL_AXES, "threshold": ()},
        {"first_residual": RESIDUAL_AXES, "residual": RESIDUAL_AXES,
         "residual_norm": RESIDUAL_AXES[:2], "skipped": ()},
        donate=("first_residual", "residual"),
    )  # fmt: skip


def cached_step_program(config: ModelConfig, shape: VideoShape, options: ProgramOptions) -> Program:
    """A step whose blocks are replaced by the given residuals (MagCache's skipped step)."""
    residual = _residual_shape(config, shape)
    return _step_program(
        "cached_step", config, shape, options, _cached_pass,
        {"first_residual": residual, "residual": residual},
        {"first_residual": RESIDUAL_AXES, "residual": RESIDUAL_AXES},
        analyses=(),  # no attention runs: its kernels' FLOPs are not this step's
    )  # fmt: skip


def state_shapes(config: ModelConfig, shape: VideoShape) -> dict[str, jax.ShapeDtypeStruct]:
    init = schedulers.init_state(config.scheduler, shape.latent_shape(config))
    return {
        "last_sample": _sds(init.last_sample.shape, np.float32),
        "x0_history": _sds(init.x0_history.shape, np.float32),
    }


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
    latents = _sds(shape.latent_shape(config), jnp.float32)

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
    host_outputs=True, scoped_vmem=True, analyses=("vae_gathers",), vmem_hint="a smaller --vae-vmem"
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
    latents = _sds(shape.latent_shape(config), jnp.float32)

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
    latents = _sds(shape.latent_shape(config), jnp.float32)

    def slot_decode(params: Tree, latents: jax.Array, slot: jax.Array) -> jax.Array:
        if options.gather_latents:  # as latents_handoff: replicated before the spatial slices
            latents = sharding.constrain(latents, (None,) * latents.ndim)
        video = jax.lax.dynamic_index_in_dim(latents, slot, keepdims=True)
        return _decoded(nnx.merge(graphdef, params), video, config, options)

    return Program(
        "slot_decode",
        slot_decode,
        {"params": params, "latents": latents, "slot": _sds((), jnp.int32)},
        {"params": param_axes, "latents": LATENTS, "slot": ()},
        {"frames": VIDEO},
        "vae",
        receives={"latents": "slot_step.latents"},
        **_DECODE,
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
