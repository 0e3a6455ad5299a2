"""What the bench scripts set up alike: a preset's random weights (or the folder given), `aot
build` into a folder, the tools of another source tree (`--before`/`--after` comparisons), and
`runtime serve` started on a free port and waited for. Each runs the project's own commands, as a
user would, from this interpreter's environment."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

BIN = Path(sys.executable).parent
POLL_S = 0.1


def env_of(tree: Path | None) -> dict[str, str] | None:
    """The environment that runs the tools of source tree `tree` (None: this one's)."""
    return None if tree is None else {**os.environ, "PYTHONPATH": str(tree.resolve())}


def tool(name: str, *args: str | Path, tree: Path | None = None) -> subprocess.CompletedProcess:
    """`name args` (aot, runtime, python) run to the end, its output captured; an error exits
    with its last line."""
    done = subprocess.run(
        [str(BIN / name), *map(str, args)], capture_output=True, text=True, env=env_of(tree)
    )
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        sys.exit(f"{name} {' '.join(map(str, args))[:200]} failed: {last}")
    return done


def random_weights(
    model: str, out: Path, given: Path | None = None, tree: Path | None = None
) -> Path:
    """`given`, else random weights of preset `model` written to `out`."""
    if given is not None:
        return given
    tool("python", "-m", "wan.random_weights", "--model", model, "--out", out, tree=tree)
    return out


def build(*args: str | Path, tree: Path | None = None) -> list[dict]:
    """`aot build args --json`: its report, one entry a build."""
    return json.loads(tool("aot", "build", *args, "--json", tree=tree).stdout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(
    artifacts: Path, weights: Path, out: Path, *extra: str, tree: Path | None = None
) -> tuple[subprocess.Popen, str]:
    """`runtime serve` of `artifacts` into `out` on a free port, once `/healthz` answers 200:
    (the process, its URL). A server that exits first ends the script saying so."""
    port = free_port()
    process = subprocess.Popen(
        [str(BIN / "runtime"), "serve", "--artifacts", str(artifacts), "--weights", str(weights),
         "--port", str(port), "--out-dir", str(out), *extra],
        env=env_of(tree), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    while True:
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(f"{url}/healthz", timeout=60) as answer,
        ):
            if answer.status == 200:
                return process, url
        if process.poll() is not None:
            sys.exit(f"runtime serve exited with {process.returncode}")
        time.sleep(POLL_S)
