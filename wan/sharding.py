"""Every sharding decision of the project, in one place: logical axis names -> mesh axes.

Model code names the logical axes of its parameters and activations and calls `constrain`;
which mesh axis (if any) each logical axis lands on is decided here, once per build, through
`axis_rules`. Outside a mesh (or without rules) `constrain` is the identity, so the models run
unchanged on one device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator, Sequence

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from wan import axes

LogicalAxes = Sequence[str | None]
Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

# Activation layouts that cross module boundaries.
# VAE activations (B, T, H, W, C)
VIDEO = (axes.VAE_BATCH, None, axes.VAE_HEIGHT, axes.VAE_WIDTH, None)
LATENTS = (axes.BATCH, None, None, None, None)  # diffusion latents (B, T, h, w, C) between programs

_state = threading.local()


@contextlib.contextmanager
def axis_rules(rules: Rules, uneven: frozenset[str] = frozenset()) -> Iterator[None]:
    """Within this context, `constrain` maps logical axes through `rules`; logical axes in
    `uneven` stay sharded even when the mesh axis does not divide them (XLA pads)."""
    previous = getattr(_state, "rules", None)
    _state.rules = (tuple(rules), frozenset(uneven))
    try:
        yield
    finally:
        _state.rules = previous


def current_rules() -> tuple[Rules, frozenset[str]]:
    return getattr(_state, "rules", None) or ((), frozenset())


def logical_to_spec(
    logical: LogicalAxes,
    shape: Sequence[int],
    mesh_shape: dict[str, int],
    rules: Rules,
    uneven: frozenset[str] = frozenset(),
) -> P:
    """PartitionSpec for an array of `shape`: each logical axis takes the mesh axes its rule
    names, skipping axes the mesh lacks, axes already used, and axes whose product does not
    divide the dimension (then that dimension stays replicated: no error inside jit), unless
    the logical axis is in `uneven`."""
    unknown = set(logical) - axes.ALL - {None}
    if unknown:
        raise ValueError(f"unknown logical axis {sorted(unknown)}: name it in wan.axes")
    table = dict(rules)
    used: set[str] = set()
    spec: list[str | tuple[str, ...] | None] = []
    for name, size in zip(logical, shape, strict=True):
        target = table.get(name) if name is not None else None
        mesh_axes = (target,) if isinstance(target, str) else tuple(target or ())
        mesh_axes = tuple(
            a for a in mesh_axes if a in mesh_shape and mesh_shape[a] > 1 and a not in used
        )
        extent = 1
        for a in mesh_axes:
            extent *= mesh_shape[a]
        if not mesh_axes or (size % extent and name not in uneven):
            spec.append(None)
            continue
        used.update(mesh_axes)
        spec.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return P(*spec)


def current_spec(logical: LogicalAxes, shape: Sequence[int]) -> P | None:
    """The PartitionSpec of an array of `shape` under the current mesh and rules; None outside
    a mesh or without rules."""
    mesh = jax.sharding.get_abstract_mesh()
    rules, uneven = current_rules()
    if mesh.empty or not rules:
        return None
    return logical_to_spec(logical, shape, dict(mesh.shape), rules, uneven)


def constrain(x: jax.Array, logical: LogicalAxes) -> jax.Array:
    """Pin `x` to the layout its logical axes get under the current mesh and rules."""
    spec = current_spec(logical, x.shape)
    return x if spec is None else jax.lax.with_sharding_constraint(x, spec)


# ----------------------------------------------------------------------------------------------
# The transformer mesh and its rules.

TRANSFORMER_AXES = ("data", "fsdp", "context", "tensor")

TRANSFORMER_RULES: Rules = (
    # activations and the KV cache: one slice of the batch per group
    (axes.BATCH, ("data", "fsdp")),
    (axes.LENGTH, ("context", "fsdp")),  # video tokens; fsdp only when the batch left it unused
    (axes.KV_LENGTH, None),  # prompt tokens: short, kept whole
    (axes.EMBED, "fsdp"),  # weights only: activations never name "embed" on a sharded axis
    (axes.ACT_EMBED, None),
    (axes.HEADS, "tensor"),
    (axes.MLP, "tensor"),
    (axes.VOCAB, "tensor"),
    (axes.LAYERS, None),
)


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """Sizes of the transformer mesh axes, in TRANSFORMER_AXES order."""

    data: int = 1
    fsdp: int = 1
    context: int = 1
    tensor: int = 1

    @property
    def size(self) -> int:
        return self.data * self.fsdp * self.context * self.tensor

    def items(self) -> tuple[tuple[str, int], ...]:
        return tuple((a, getattr(self, a)) for a in TRANSFORMER_AXES)

    @classmethod
    def parse(cls, text: str) -> MeshShape:
        """`data=2,context=4` (unnamed axes are 1)."""
        sizes: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, _, value = part.partition("=")
            if name not in TRANSFORMER_AXES or not value.isdigit() or int(value) < 1:
                raise ValueError(
                    f"bad mesh entry {part!r}: use {','.join(a + '=N' for a in TRANSFORMER_AXES)}"
                )
            sizes[name] = int(value)
        return cls(**sizes)


def default_mesh(
    num_devices: int, step_batch: int, weight_bytes: int, hbm_bytes: int | None
) -> MeshShape:
    """data x fsdp x context. fsdp just large enough that the transformer weights take <= 40%
    of a device's HBM; then as much data parallelism as the step batch (2B with CFG) allows
    (the batch is sharded over data x fsdp, all or nothing); the remaining devices shard the
    sequence (context parallelism, and fsdp too when the batch cannot use it)."""
    fsdp = 1
    if hbm_bytes:
        fsdp = next(
            (f for f in _divisors(num_devices) if weight_bytes / f <= 0.4 * hbm_bytes), num_devices
        )
    rest = num_devices // fsdp
    data = max(d for d in _divisors(rest) if step_batch % (d * fsdp) == 0 or d == 1)
    return MeshShape(data=data, fsdp=fsdp, context=rest // data)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def make_mesh(
    devices: Sequence[jax.Device], axes: tuple[tuple[str, int], ...]
) -> jax.sharding.Mesh:
    """A mesh over `devices` in the given order (the order is part of the build)."""
    names = tuple(name for name, _ in axes)
    shape = tuple(size for _, size in axes)
    grid = np.asarray(devices, dtype=object).reshape(shape)
    return jax.sharding.Mesh(grid, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))


def named_sharding(
    mesh: jax.sharding.Mesh, logical: LogicalAxes, shape: Sequence[int], rules: Rules
) -> jax.sharding.NamedSharding:
    return jax.sharding.NamedSharding(
        mesh, logical_to_spec(logical, shape, dict(mesh.shape), rules)
    )


# ----------------------------------------------------------------------------------------------
# The VAE mesh ('redundant', 'vae_spatial') and its spatial axis: both decided once per build.

VAE_AXES = ("redundant", "vae_spatial")


def vae_mesh_shape(num_devices: int, batch: int, vae_spatial: int | None = None) -> tuple[int, int]:
    """(redundant, vae_spatial). Auto: one video per device, (N, 1), when the batch is a positive
    multiple of N (no cross-device traffic at all); else (1, N). An explicit value must divide N."""
    if vae_spatial is not None:
        if vae_spatial < 1 or num_devices % vae_spatial:
            raise ValueError(
                f"--vae-spatial {vae_spatial} must divide the device count {num_devices}"
            )
        return num_devices // vae_spatial, vae_spatial
    if batch > 0 and batch % num_devices == 0:
        return num_devices, 1
    return 1, num_devices


@dataclasses.dataclass(frozen=True)
class VaeLayout:
    """The VAE's spatial sharding for one build: `axis` is sharded over 'vae_spatial' at every
    pyramid level; `padded` when neither latent dimension divides and width is padded."""

    axis: str  # "width" or "height"
    padded: bool = False

    @property
    def uneven(self) -> frozenset[str]:
        return frozenset({axes.VAE_WIDTH}) if self.padded else frozenset()

    def rules(self) -> Rules:
        return (
            (axes.VAE_BATCH, "redundant"),
            (axes.VAE_WIDTH if self.axis == "width" else axes.VAE_HEIGHT, "vae_spatial"),
            # Conv kernels replicated: a spatially sharded conv needs the whole kernel on every
            # device, and kernels sharded over vae_spatial were all-gathered again for every
            # latent frame (~140 MB per frame at 720p on tpu-v6e-8, bf16), while all of them,
            # encoder included, take 0.5 GB per device in fp32.
            (axes.VAE_CONV_OUT, None),
        )


def choose_vae_layout(latent_height: int, latent_width: int, vae_spatial: int) -> VaeLayout:
    """Decided once from the latent (H/8, W/8): width if vae_spatial divides it, else height if
    it divides, else width with padding. Every level above the latent is a multiple of it, so
    the choice holds at every pyramid level and no activation ever flips axis."""
    if latent_width % vae_spatial == 0:
        return VaeLayout("width")
    if latent_height % vae_spatial == 0:
        return VaeLayout("height")
    return VaeLayout("width", padded=True)


# ----------------------------------------------------------------------------------------------
# The plan of one build: both meshes, their rules, and the handoffs between programs.


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """Every sharding decision of one build. Each program runs on the mesh it names
    ("transformer" or "vae"); the plan gives that mesh and its rules, and whether the latents
    are gathered whole on their way to the decode."""

    transformer: MeshShape
    vae_mesh: tuple[int, int]  # (redundant, vae_spatial)
    vae_layout: VaeLayout
    latent_shape: tuple[int, ...]  # (B, T, h, w, C): what the denoise step hands the decode

    @classmethod
    def choose(
        cls, transformer: MeshShape, latent_shape: Sequence[int], vae_spatial: int | None = None
    ) -> ShardingPlan:
        """The VAE mesh and spatial axis for a transformer mesh and latent shape (see
        vae_mesh_shape and choose_vae_layout); ValueError for a bad vae_spatial."""
        batch, _, height, width, _ = latent_shape
        vae_mesh = vae_mesh_shape(transformer.size, batch, vae_spatial)
        layout = choose_vae_layout(height, width, vae_mesh[1])
        return cls(transformer, vae_mesh, layout, tuple(latent_shape))

    def meshes(self, devices: Sequence[jax.Device]) -> dict[str, jax.sharding.Mesh]:
        """Both meshes over `devices`, in the same device order."""
        return {
            "transformer": make_mesh(devices, self.transformer.items()),
            "vae": make_mesh(devices, tuple(zip(VAE_AXES, self.vae_mesh, strict=True))),
        }

    def rules(self, mesh: str) -> tuple[Rules, frozenset[str]]:
        """(rules, uneven logical axes) of the programs on `mesh`."""
        if mesh == "vae":
            return self.vae_layout.rules(), self.vae_layout.uneven
        return TRANSFORMER_RULES, frozenset()

    def latents_spec(self) -> P:
        """How the denoise step leaves the latents on the transformer mesh."""
        return logical_to_spec(
            LATENTS, self.latent_shape, dict(self.transformer.items()), TRANSFORMER_RULES
        )

    @property
    def gather_latents(self) -> bool:
        """The latents handoff replicates the latents before slicing them spatially: they
        arrive batch-sharded, and an all-gather of the small latents beats an all-to-all."""
        return self.latents_spec()[0] is not None and self.vae_mesh[1] > 1
