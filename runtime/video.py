"""MP4 output: H.264 through the ffmpeg binary that ships inside the imageio-ffmpeg wheel."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import imageio_ffmpeg
import numpy as np

FPS = 16  # WAN's native frame rate


def video_paths(out: Path, batch: int) -> list[Path]:
    """`out` for one video; `stem_0.mp4`, `stem_1.mp4`, ... for a batch."""
    if batch == 1:
        return [out]
    return [out.with_name(f"{out.stem}_{i}{out.suffix}") for i in range(batch)]


def write_mp4(frames: np.ndarray, path: Path, fps: int = FPS) -> Path:
    """uint8 frames (F, H, W, 3) -> an H.264 MP4 (yuv420p), written atomically."""
    frames = np.ascontiguousarray(frames, dtype=np.uint8)
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"expected frames (F, H, W, 3), got {frames.shape}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial.mp4")
    height, width = frames.shape[1:3]
    # macro_block_size=1: keep the exact size (WAN sizes are multiples of 16 anyway).
    writer = imageio_ffmpeg.write_frames(
        str(tmp), (width, height), fps=fps, codec="libx264", macro_block_size=1, quality=8
    )
    with warnings.catch_warnings():
        # The fork is followed at once by exec of ffmpeg, which is safe with JAX's threads.
        warnings.filterwarnings("ignore", "os.fork", RuntimeWarning)
        writer.send(None)
    try:
        for frame in frames:
            writer.send(frame)
    finally:
        writer.close()
    os.replace(tmp, path)
    return path
