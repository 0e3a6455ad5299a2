"""Generation: the loaded build run for a batch of requests, and the files it writes. The door the
server comes in by (`runtime.serve` imports this package, never its modules; tests/
test_boundaries.py): what a batch is and how it runs, the request's bounds, the images it takes
and the files it writes. The classes that bring jax (`Pipeline`, `SlotBatch`) are imported when
first named, so that a server's request checks load no jax."""

from __future__ import annotations

from typing import Any

from runtime.generation import images
from runtime.generation.batching import Group, Settings, Video, Waiting, generate_batch, next_batch
from runtime.generation.outputs import previews, write_files, write_npy, write_videos
from runtime.generation.request import MAX_SCALE, MAX_SEED, check_text
from runtime.generation.step_cache import CacheRequest

_WITH_JAX = {
    "Pipeline": "runtime.generation.pipeline",
    "SlotBatch": "runtime.generation.continuous",
}

__all__ = [
    "MAX_SCALE", "MAX_SEED", "CacheRequest", "Group", "Settings", "Video", "Waiting",
    "check_text", "generate_batch", "images", "next_batch", "previews", "write_files",
    "write_npy", "write_videos", *_WITH_JAX,
]  # fmt: skip


def __getattr__(name: str) -> Any:
    if name in _WITH_JAX:
        import importlib

        return getattr(importlib.import_module(_WITH_JAX[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
