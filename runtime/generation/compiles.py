"""Compiling nothing, proved: a counter of the backend's compilations (jax.monitoring reports
every one, a persistent-cache hit too) and a block that refuses any tracing or compiling."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax

from runtime.builds.artifact import ArtifactError

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
    """Counts backend compilations in this process: jax.monitoring reports every one (a
    persistent-cache hit too). One listener per process, installed on first use."""

    _total = 0
    _installed = False

    def __init__(self) -> None:
        if not CompileCounter._installed:
            jax.monitoring.register_event_duration_secs_listener(CompileCounter._listen)
            CompileCounter._installed = True
        self.start = CompileCounter._total

    @staticmethod
    def _listen(event: str, duration: float, **kwargs: Any) -> None:
        if event == COMPILE_EVENT:
            CompileCounter._total += 1

    @property
    def count(self) -> int:
        """Compilations since this counter was made."""
        return CompileCounter._total - self.start


@contextlib.contextmanager
def no_compilation() -> Iterator[CompileCounter]:
    """jax's no-tracing mode (any jit cache miss or eager op raises) plus a compile counter;
    a compilation that still happens fails the block."""
    counter = CompileCounter()
    previous = jax.config.jax_no_tracing
    jax.config.update("jax_no_tracing", True)
    try:
        yield counter
    finally:
        jax.config.update("jax_no_tracing", previous)
    if counter.count:
        raise ArtifactError(f"{counter.count} compilation(s) happened during generation")
