"""Arrange this process for a build's devices, before jax starts: the host device count of a CPU
build, and membership in the jax.distributed job of a multi-process build (one process per host;
`cpu-PxN` builds emulate P hosts of N devices on one machine)."""

from __future__ import annotations

import os
import re
import sys

INIT_TIMEOUT_S = 120  # a peer that never arrives fails the job instead of hanging it


def use_host_devices(count: int) -> None:
    """Give this process `count` CPU devices; a no-op once jax is imported (it is fixed then)."""
    if "jax" in sys.modules:
        return
    flags = re.sub(
        r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")
    )
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
    os.environ["JAX_PLATFORMS"] = "cpu"


def join(coordinator: str, num_processes: int, process_id: int) -> None:
    """Become process `process_id` of a jax.distributed job (every process calls this with the
    same coordinator address, host:port, served by process 0)."""
    import jax

    # CPU collectives between processes go through gloo (TCP); accelerators use their own.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=INIT_TIMEOUT_S,
    )
