"""What every program is made of: the build's options, modules as pure parameter dicts, the
`Program` a maker returns, shardings from logical axes, and the shapes programs share."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from wan import axes, interface, kinds, schedulers, sharding
from wan.configs import ModelConfig, VideoShape

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


def sds(shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def kv_shape(config: ModelConfig, shape: VideoShape) -> jax.ShapeDtypeStruct:
    tc = config.transformer
    return sds(
        (tc.num_layers, shape.step_batch, config.text_encoder.max_length, tc.inner_dim),
        config.dtype,
    )


def sampler_row_shapes(config: ModelConfig) -> dict[str, jax.ShapeDtypeStruct]:
    row = schedulers.make_tables(config.scheduler, 2).row(0)
    return {k: sds(np.shape(v), np.float32) for k, v in row.items()}


def state_shapes(config: ModelConfig, shape: VideoShape) -> dict[str, jax.ShapeDtypeStruct]:
    init = schedulers.init_state(config.scheduler, shape.latent_shape(config))
    return {
        "last_sample": sds(init.last_sample.shape, np.float32),
        "x0_history": sds(init.x0_history.shape, np.float32),
    }


def per_video(value: jax.Array, ndim: int) -> jax.Array:
    """One value per video (B,), shaped to broadcast over arrays (B, ...) of `ndim` dims."""
    return value.reshape(value.shape[0], *(1,) * (ndim - 1))
