"""The README's quick tour, as a newcomer runs it: its shell block, command by command in its
order, in a fresh folder with this checkout's venv activated (the block's first line), on this
machine's CPU. The server's port is a free one (the block says 8000); everything else is the
block as written. Each step's files are checked: the two videos, the SDK's video."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import imageio_ffmpeg

ROOT = Path(__file__).resolve().parents[1]


def quick_tour() -> str:
    """The first ```sh block after the README's "Quick tour" heading."""
    text = (ROOT / "README.md").read_text()
    after = text[text.index("## Quick tour") :]
    return re.search(r"```sh\n(.*?)```", after, re.S).group(1)


def _activated(script: str) -> str:
    """The block with its first line activating this checkout's venv (the one running here)."""
    assert script.startswith(". .venv/bin/activate\n")
    return script.replace(".venv/bin/activate", f"{Path(sys.executable).parent}/activate", 1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _frames(path: Path) -> int:
    reader = imageio_ffmpeg.read_frames(str(path))
    meta = next(reader)
    count = sum(1 for _ in reader)
    assert meta["size"] == (192, 320)
    return count


def test_the_quick_tour_runs_as_written(tmp_path):
    script = _activated(quick_tour()).replace("8000", str(_free_port()))
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, capture_output=True,
        text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert "completed" in done.stdout and "0 compilations" in done.stdout
    for video in ("cat.mp4", "fade.mp4"):
        assert _frames(tmp_path / video) == 17, video
    assert (tmp_path / "boat.mp4").stat().st_size > 1000


def test_the_tour_fails_when_a_command_does(tmp_path):
    """Control: the same run of a block with one command wrong fails (the tour's checks can)."""
    script = _activated(quick_tour()).replace("--model tiny --out", "--model tiny-nothing --out", 1)
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, capture_output=True,
        text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode != 0 and "tiny-nothing" in done.stderr
    assert not (tmp_path / "cat.mp4").exists()
