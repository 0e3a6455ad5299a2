"""Parameters that carry their logical axis names, for wan.sharding's rules to map."""

from __future__ import annotations

from collections.abc import Callable

from flax import nnx

from wan.sharding import LogicalAxes


def logical_init(init: Callable, axes: LogicalAxes) -> Callable:
    """An initializer whose parameters carry logical axis names (`out_sharding` metadata). They
    are not mesh axes: wan.sharding's rules map them, so flax must not shard eagerly with them."""
    return nnx.with_partitioning(init, axes, eager_sharding=False)
