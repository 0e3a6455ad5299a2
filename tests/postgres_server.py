"""A real PostgreSQL server for the fleet tests, in a temporary folder: the host's `postgres`
binaries when it has them (Debian's postgresql package), else those of the pip-installable
`pgserver` (a test dependency). PostgreSQL refuses to run as root: as root, the server runs as
`nobody` (setpriv). Stopped, killed and started again at will (a store that goes away), or
paused and resumed (a store that hangs)."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg

UNPRIVILEGED = 65534  # nobody / nogroup


def binaries() -> Path:
    """The folder of initdb and postgres."""
    found = shutil.which("postgres")
    candidates = [Path(found).resolve().parent] if found else []
    candidates += sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)
    for folder in candidates:
        if (folder / "initdb").is_file() and (folder / "postgres").is_file():
            return folder
    import pgserver  # the pip-installable server's binaries

    package = Path(pgserver.__file__).parent
    if os.geteuid() != 0:
        return package / "pginstall" / "bin"
    # As root the server runs as nobody, who may not reach into the venv (a checkout under a
    # private home): a copy where every user can, once a process, of the package and of the
    # libraries its binaries find beside it ($ORIGIN/../../../pgserver.libs).
    global _COPY
    if _COPY is None:
        _COPY = Path(tempfile.mkdtemp(prefix="wan-pginstall-"))
        atexit.register(shutil.rmtree, _COPY, True)
        _COPY.chmod(0o755)
        for name in ("pgserver", "pgserver.libs"):
            shutil.copytree(package.parent / name, _COPY / name, symlinks=True)
    return _COPY / "pgserver" / "pginstall" / "bin"


_COPY: Path | None = None  # pgserver's binaries, copied for the unprivileged server user


def _as_server_user() -> list[str]:
    if os.geteuid() != 0:
        return []
    return ["setpriv", f"--reuid={UNPRIVILEGED}", f"--regid={UNPRIVILEGED}", "--clear-groups"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresServer:
    """initdb'd once; `start`, `stop` (fast shutdown) and `kill` (SIGKILL) as often as a test
    wants, on the same port and data."""

    def __init__(self) -> None:
        # Not under pytest's tmp_path: its root is private to root, and the server runs as nobody.
        self.root = Path(tempfile.mkdtemp(prefix="wan-pg-"))
        self.root.chmod(0o755)
        self.data = self.root / "data"
        self.data.mkdir(mode=0o700)
        self.sockets = self.root / "sockets"
        self.sockets.mkdir()
        self.log = self.root / "postgres.log"
        self.log.touch()
        if os.geteuid() == 0:
            for path in (self.data, self.sockets, self.log):
                os.chown(path, UNPRIVILEGED, UNPRIVILEGED)
        self.bin = binaries()
        self.port = _free_port()
        subprocess.run(
            [*_as_server_user(), str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres",
             "--auth=trust", "--encoding=UTF8", "--no-sync"],
            check=True, capture_output=True,
        )  # fmt: skip
        self.proc: subprocess.Popen | None = None
        self.start()

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [*_as_server_user(), str(self.bin / "postgres"), "-D", str(self.data), "-p",
             str(self.port), "-h", "127.0.0.1", "-k", str(self.sockets), "-c", "fsync=off",
             "-c", "max_connections=50"],
            stdout=subprocess.DEVNULL, stderr=self.log.open("a"),
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            with contextlib.suppress(psycopg.OperationalError):
                psycopg.connect(self.url(), connect_timeout=2).close()
                return
            assert time.monotonic() < deadline, self.log.read_text()[-3000:]
            time.sleep(0.1)

    def stop(self) -> None:
        """A fast shutdown: the clients' connections are closed."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # fast (SIGTERM waits for every client to leave)
            self.proc.wait(60)
        self.proc = None

    def processes(self) -> list[int]:
        """The postmaster and its children (the backends, the background workers)."""
        children = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError):
                pid, _, rest = stat.read_text().partition(" (")
                if int(rest.rpartition(")")[2].split()[1]) == self.proc.pid:
                    children.append(int(pid))
        return [self.proc.pid, *children]

    def pause(self) -> None:
        """Every process of the server stopped (SIGSTOP): it accepts connections (the kernel
        does) and answers nothing, a hung server."""
        os.kill(self.proc.pid, signal.SIGSTOP)  # first: it forks no new child meanwhile
        for pid in self.processes()[1:]:
            os.kill(pid, signal.SIGSTOP)

    def resume(self) -> None:
        for pid in reversed(self.processes()):
            os.kill(pid, signal.SIGCONT)

    def new_database(self, name: str) -> str:
        with psycopg.connect(self.url(), autocommit=True) as db:
            db.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


@contextlib.contextmanager
def postgres_server() -> Iterator[PostgresServer]:
    server = PostgresServer()
    try:
        yield server
    finally:
        server.close()
