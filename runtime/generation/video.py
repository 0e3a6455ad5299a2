"""MP4 output: H.264 through the ffmpeg binary that ships inside the imageio-ffmpeg wheel.

ffmpeg is run directly (not through imageio_ffmpeg.write_frames, which leaves ffmpeg's stderr
unread and its exit status unchecked): a full disk must be an error, not a truncated video."""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path
from typing import IO

import imageio_ffmpeg
import numpy as np

CRF = 10  # H.264 quality (0 lossless .. 51 worst): imageio's quality 8 of 10


class VideoError(OSError):
    """ffmpeg could not write a video; the message is ffmpeg's last error line."""


def video_paths(out: Path, batch: int) -> list[Path]:
    """`out` for one video; `stem_0.mp4`, `stem_1.mp4`, ... for a batch."""
    if batch == 1:
        return [out]
    return [out.with_name(f"{out.stem}_{i}{out.suffix}") for i in range(batch)]


def write_mp4(frames: np.ndarray, path: Path, fps: int) -> None:
    """uint8 frames (F, H, W, 3) -> an H.264 MP4 (yuv420p) of `fps` frames a second at `path`,
    created or overwritten (callers go through runtime.generation.outputs.write_videos). ffmpeg is stopped
    before this returns or raises, so it cannot write after its caller has cleaned up."""
    frames = np.ascontiguousarray(frames, dtype=np.uint8)
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"expected frames (F, H, W, 3), got {frames.shape}")
    height, width = frames.shape[1:3]
    command = [
        imageio_ffmpeg.get_ffmpeg_exe(), "-y", "-hide_banner", "-nostats", "-loglevel", "error",
        "-f", "rawvideo", "-pix_fmt", "rgb24", "-s", f"{width}x{height}", "-r", str(fps),
        "-i", "-", "-an", "-c:v", "libx264", "-pix_fmt", "yuv420p", "-crf", str(CRF),
        "-f", "mp4", str(path),
    ]  # fmt: skip
    # The log goes to a file, not a pipe: a pipe nobody reads while frames are fed could fill.
    with tempfile.TemporaryFile() as log:
        ffmpeg = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=log
        )
        try:
            _feed(ffmpeg.stdin, frames)
            status = ffmpeg.wait()
        finally:
            if ffmpeg.poll() is None:  # interrupted while ffmpeg runs
                ffmpeg.kill()
                ffmpeg.wait()
        if status != 0:
            log.seek(0)
            raise VideoError(_failure(status, log.read()))
    if path.stat().st_size == 0:
        raise VideoError("ffmpeg wrote nothing")


def _feed(stdin: IO[bytes], frames: np.ndarray) -> None:
    """The raw frames to ffmpeg's stdin, closed at the end."""
    try:
        with stdin:
            for frame in frames:
                stdin.write(frame.data)
    except BrokenPipeError:
        pass  # ffmpeg stopped early: its status and log say why


def _failure(status: int, log: bytes) -> str:
    """One line for a failed ffmpeg: its exit status and the last line it logged."""
    what = f"ffmpeg killed by signal {-status}" if status < 0 else f"ffmpeg exited with {status}"
    lines = [line for line in log.decode(errors="replace").splitlines() if line.strip()]
    if not lines:
        return what
    # ffmpeg prefixes lines with its component, e.g. "[out#0/mp4 @ 0x55b6ab665600] ".
    last = re.sub(r"^\[[^]]*\]\s*", "", lines[-1].strip())
    return f"{what}: {last}"
