"""Every sharding decision of the project, in one place: logical axis names -> mesh axes.

Model code names the logical axes of its parameters and activations and calls `constrain`;
which mesh axis (if any) each logical axis lands on is decided here, once per build, through
`axis_rules`. Outside a mesh (or without rules) `constrain` is the identity, so the models run
unchanged on one device.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

import jax
from jax.sharding import PartitionSpec as P

LogicalAxes = Sequence[str | None]
Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

# Activation layouts used by the models.
VIDEO = ("vae_batch", None, "vae_height", "vae_width", None)  # VAE activations (B, T, H, W, C)

_state = threading.local()


@contextlib.contextmanager
def axis_rules(rules: Rules) -> Iterator[None]:
    """Within this context, `constrain` maps logical axes through `rules`."""
    previous = getattr(_state, "rules", None)
    _state.rules = tuple(rules)
    try:
        yield
    finally:
        _state.rules = previous


def current_rules() -> Rules:
    return getattr(_state, "rules", None) or ()


def logical_to_spec(
    logical: LogicalAxes, shape: Sequence[int], mesh_shape: dict[str, int], rules: Rules
) -> P:
    """PartitionSpec for an array of `shape`: each logical axis takes the mesh axes its rule
    names, skipping axes the mesh lacks, axes already used, and axes whose product does not
    divide the dimension (then that dimension stays replicated: no error inside jit)."""
    table = dict(rules)
    used: set[str] = set()
    spec: list[str | tuple[str, ...] | None] = []
    for name, size in zip(logical, shape, strict=True):
        target = table.get(name) if name is not None else None
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        axes = tuple(a for a in axes if a in mesh_shape and mesh_shape[a] > 1 and a not in used)
        extent = 1
        for a in axes:
            extent *= mesh_shape[a]
        if not axes or size % extent:
            spec.append(None)
            continue
        used.update(axes)
        spec.append(axes[0] if len(axes) == 1 else axes)
    return P(*spec)


def constrain(x: jax.Array, logical: LogicalAxes) -> jax.Array:
    """Pin `x` to the layout its logical axes get under the current mesh and rules."""
    mesh = jax.sharding.get_abstract_mesh()
    rules = current_rules()
    if mesh.empty or not rules:
        return x
    spec = logical_to_spec(logical, x.shape, dict(mesh.shape), rules)
    return jax.lax.with_sharding_constraint(x, spec)
