"""Arrange this process for a build's devices, before jax starts: the host device count of a CPU
build, and membership in the jax.distributed job of a multi-process build (one process per host;
`cpu-PxN` builds emulate P hosts of N devices on one machine)."""

from __future__ import annotations

import contextlib
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
    (id, count); then all go on to jax.distributed, which process 0 serves on that port.
    Everything waits `timeout` seconds at most, whatever a peer sends or withholds."""
    host, port = _address(coordinator)
    deadline = time.monotonic() + timeout
    if process_id == 0:
        _admit_peers(coordinator, port, num_processes, deadline, timeout)
        return
    hello = f"{process_id} {num_processes}\n".encode()
    while True:
        try:
            with socket.create_connection((host, port), timeout=5) as conn:
                conn.sendall(hello)
                conn.settimeout(max(deadline - time.monotonic(), 0.01))
                answer = conn.makefile("rb").readline(MAX_LINE).strip()
            break
        except OSError:  # process 0 is not listening yet
            if time.monotonic() > deadline:
                raise JobError(
                    f"process 0 of the job did not answer at {coordinator} within "
                    f"{timeout} s: start it with --process-id 0 on that host"
                ) from None
            time.sleep(0.2)
    if answer != b"go":
        raise JobError(
            f"process 0 at {coordinator} did not admit process {process_id} of {num_processes}: "
            "another process is missing or misconfigured (see process 0's error)"
        )


MAX_LINE = 64  # a hello is "<id> <count>\n"; a longer line is not one
HELLO_TIMEOUT_S = 10  # a peer sends its hello at once; one that stays silent is dropped
_HELLO = re.compile(rb"(\d{1,9}) (\d{1,9})\n?")


def _address(coordinator: str) -> tuple[str, int]:
    """(host, port) of HOST:PORT, the host resolved: a bad address is a JobError now rather
    than a wait for a peer that cannot come."""
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise JobError(f"coordinator {coordinator!r} is not HOST:PORT with a port in [1, 65535]")
    try:
        socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:  # socket.gaierror; an over-long label is a UnicodeError
        raise JobError(
            f"coordinator host {host!r} cannot be resolved ({e}): check --coordinator"
        ) from None
    return host, int(port)


def _admit_peers(coordinator: str, port: int, count: int, deadline: float, timeout: int) -> None:
    """As process 0: wait for the hellos of processes 1..count-1 until `deadline`, then send
    each "go" and let them hang up first (the port is left free for jax)."""
    try:
        server = socket.create_server(("", port))
    except OSError as e:
        raise JobError(
            f"process 0 cannot listen on port {port} ({e.strerror or e}): choose a free port "
            "in --coordinator"
        ) from None
    peers: dict[int, socket.socket] = {}
    with server:
        try:
            while len(peers) < count - 1:
                server.settimeout(max(deadline - time.monotonic(), 0.01))
                try:
                    conn, _ = server.accept()
                except TimeoutError:
                    missing = sorted(set(range(1, count)) - set(peers))
                    raise JobError(
                        f"processes {missing} of the {count}-process job did not reach "
                        f"{coordinator} within {timeout} s: start them with the same "
                        "--coordinator and --num-processes"
                    ) from None
                pid = _hello(conn, coordinator, count, set(peers), deadline)
                if pid is not None:
                    peers[pid] = conn
            for conn in peers.values():
                conn.sendall(b"go\n")
            for conn in peers.values():
                conn.settimeout(HELLO_TIMEOUT_S)
                with contextlib.suppress(OSError):  # one that does not hang up is not waited for
                    conn.recv(1)
        finally:
            for conn in peers.values():
                conn.close()


def _hello(
    conn: socket.socket, coordinator: str, count: int, joined: set[int], deadline: float
) -> int | None:
    """The process id a new connection reports (None, the connection closed, for one that
    stays silent or hangs up); a line that is not a hello of this job is a JobError."""
    conn.settimeout(max(min(deadline - time.monotonic(), HELLO_TIMEOUT_S), 0.01))
    try:
        line = conn.makefile("rb").readline(MAX_LINE)
    except OSError:  # silent until the timeout: not a process of this job
        line = b""
    if not line:
        conn.close()
        return None
    match = _HELLO.fullmatch(line)
    pid, got = (int(match[1]), int(match[2])) if match else (None, None)
    if got != count or pid in joined or not 0 < pid < count:
        with contextlib.suppress(OSError), conn:  # the peer may be gone already
            conn.sendall(b"refused\n")
        said = f"as {pid} of {got}" if match else f"with {line[:MAX_LINE]!r}"
        raise JobError(
            f"a process joined {coordinator} {said}; this job has {count} processes, each "
            "with its own --process-id in [1, P) beside process 0"
        )
    return pid
