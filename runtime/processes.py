"""Arrange this process for a build's devices, before jax starts: the host device count of a CPU
build, and membership in the jax.distributed job of a multi-process build (one process per host;
`cpu-PxN` builds emulate P hosts of N devices on one machine)."""

from __future__ import annotations

import os
import re
import socket
import time
from pathlib import Path

from wan.errors import InputError

JOIN_TIMEOUT_S = 120  # a process that never arrives fails the job instead of hanging it


def use_host_devices(count: int) -> None:
    """Give this process `count` CPU devices (read when jax starts its backends)."""
    flags = re.sub(
        r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")
    )
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
    os.environ["JAX_PLATFORMS"] = "cpu"


def host_platform() -> str:
    """The platform jax will start on here, told without starting it: JAX_PLATFORMS when set,
    else a TPU (Google PCI vendor id) or an NVIDIA GPU when one is attached, else cpu."""
    if chosen := os.environ.get("JAX_PLATFORMS"):
        return chosen.split(",")[0]
    vendors = (p.read_text().strip() for p in Path("/sys/bus/pci/devices").glob("*/vendor"))
    if "0x1ae0" in vendors:
        return "tpu"
    return "gpu" if Path("/dev/nvidia0").exists() else "cpu"


class JobError(InputError):
    """This process could not join its jax.distributed job; the message says what to check."""


def join(
    coordinator: str, num_processes: int, process_id: int, timeout: int = JOIN_TIMEOUT_S
) -> None:
    """Become process `process_id` of a jax.distributed job (every process calls this with the
    same coordinator address, host:port, served by process 0), waiting `timeout` seconds at
    most for the others."""
    import jax

    # jax's coordination client aborts the whole process (a C++ check failure) when a peer
    # never arrives; meeting on the same port first turns that into a clear error.
    _rendezvous(coordinator, num_processes, process_id, timeout)
    # CPU collectives between processes go through gloo (TCP); accelerators use their own.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=timeout,
    )


def _rendezvous(coordinator: str, num_processes: int, process_id: int, timeout: int) -> None:
    """Process 0 listens on the coordinator's port until every other process has reported its
    (id, count); then all go on to jax.distributed, which process 0 serves on that port."""
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise JobError(f"coordinator {coordinator!r} is not HOST:PORT")
    hello = f"{process_id} {num_processes}\n".encode()
    deadline = time.monotonic() + timeout
    if process_id == 0:
        with socket.create_server(("", int(port))) as server:
            peers: dict[int, socket.socket] = {}
            while len(peers) < num_processes - 1:
                server.settimeout(max(deadline - time.monotonic(), 0.01))
                try:
                    conn, _ = server.accept()
                except TimeoutError:
                    missing = sorted(set(range(1, num_processes)) - set(peers))
                    raise JobError(
                        f"processes {missing} of the {num_processes}-process job did not reach "
                        f"{coordinator} within {timeout} s: start them with the same "
                        "--coordinator and --num-processes"
                    ) from None
                pid, count = (int(v) for v in conn.makefile().readline().split())
                if count != num_processes or pid in peers or not 0 < pid < num_processes:
                    conn.sendall(b"refused\n")
                    raise JobError(
                        f"a process joined as {pid} of {count}; this job has {num_processes} "
                        "processes, each with its own --process-id in [1, P) beside process 0"
                    )
                peers[pid] = conn
            for conn in peers.values():
                conn.sendall(b"go\n")
            for conn in peers.values():  # peers hang up first: the port is left free for jax
                conn.recv(1)
                conn.close()
        return
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=5) as conn:
                conn.sendall(hello)
                conn.settimeout(max(deadline - time.monotonic(), 0.01))
                answer = conn.makefile().readline().strip()
            break
        except OSError:  # process 0 is not listening yet
            if time.monotonic() > deadline:
                raise JobError(
                    f"process 0 of the job did not answer at {coordinator} within "
                    f"{timeout} s: start it with --process-id 0 on that host"
                ) from None
            time.sleep(0.2)
    if answer != "go":
        raise JobError(
            f"process 0 at {coordinator} did not admit process {process_id} of {num_processes}: "
            "another process is missing or misconfigured (see process 0's error)"
        )
