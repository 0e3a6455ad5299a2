"""Multi-process CPU targets (`cpu-PxN`) on one machine: this process becomes process 0 of a
jax.distributed job and starts P-1 peers that hold the other "hosts'" devices while it compiles.

Compiling is SPMD: every process of the job compiles the same program for the same global
devices, so one executable, compiled by process 0, serves every process of the job at run time
(tests/test_multiprocess.py runs it). The peers only join the job; process 0 writes the build.

    python -m aot.building.local_job COORDINATOR NUM_PROCESSES PROCESS_ID LOCAL_DEVICES   (a peer)
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Iterator

from aot.targets import Target
from runtime.builds import processes


def free_port() -> int:
    """A TCP port free on this machine now (for a local job's coordinator)."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_job(target: Target) -> Iterator[None]:
    """Run the block as process 0 of `target`'s job (a no-op for one-process targets)."""
    if target.num_processes == 1:
        yield
        return
    import jax

    coordinator = f"localhost:{free_port()}"
    local = target.num_devices // target.num_processes
    peers = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "aot.building.local_job",
                coordinator,
                str(target.num_processes),
                str(i),
                str(local),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for i in range(1, target.num_processes)
    ]
    try:
        processes.join(coordinator, target.num_processes, 0)
    except BaseException:
        for peer in peers:
            peer.kill()
        raise
    try:
        yield
    finally:
        # Also after an error in the block: a peer killed instead would fail the shutdown
        # barrier at exit, which aborts this process (a C++ check failure) after the message.
        for peer in peers:
            peer.stdin.close()  # the peers leave the job: shutdown is a barrier of all processes
        jax.distributed.shutdown()
        for peer in peers:
            peer.wait()


def _peer(coordinator: str, num_processes: int, process_id: int, local_devices: int) -> None:
    parent = os.getppid()
    processes.use_host_devices(local_devices)
    processes.join(coordinator, num_processes, process_id)
    import jax

    jax.devices()  # starting the backend publishes this process's devices to the job
    sys.stdin.read()  # until process 0 is done, or gone
    if os.getppid() != parent:
        os._exit(1)  # process 0 (and the job's coordinator with it) died: no shutdown barrier
    jax.distributed.shutdown()


if __name__ == "__main__":
    _peer(sys.argv[1], *(int(v) for v in sys.argv[2:5]))
