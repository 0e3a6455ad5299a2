"""Seconds to write one video's MP4 (`runtime.generation.video.write_mp4`: the `write` phase of
`runtime run`) by what its frames hold: noise, which is what random weights make and the
encoder's worst case, and a smooth moving gradient, at a video's size.

    python bench/mp4_write.py --res 832x480 --frames 81 --repeats 3

Writes bench/results/mp4_write.json (a row per command): the seconds (median and range) and
the file's bytes per kind of frames.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import record  # bench/record.py, beside this script

from runtime.generation.video import write_mp4

ROOT = Path(__file__).resolve().parents[1]


def frames(kind: str, count: int, height: int, width: int) -> np.ndarray:
    """uint8 frames (T, H, W, 3): uniform noise, or a gradient that moves 3 pixels a frame."""
    if kind == "noise":
        return np.random.default_rng(0).integers(0, 256, (count, height, width, 3), np.uint8)
    x = np.arange(width)[None, None, :] + 3 * np.arange(count)[:, None, None]
    ramp = np.broadcast_to((x % 256).astype(np.uint8), (count, height, width))
    return np.repeat(ramp[..., None], 3, axis=-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--res", default="832x480")
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--fps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/mp4_write.json")
    args = parser.parse_args()
    width, height = map(int, args.res.split("x"))
    row = {"command": shlex.join(["python", "bench/mp4_write.py", *sys.argv[1:]]),
           "host_load": record.host_load()}  # fmt: skip
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "video.mp4"
        for kind in ("noise", "gradient"):
            video, seconds = frames(kind, args.frames, height, width), []
            for _ in range(args.repeats):
                start = time.perf_counter()
                write_mp4(video, path, args.fps)
                seconds.append(time.perf_counter() - start)
            row[kind] = {"seconds": record.spread(seconds), "bytes": path.stat().st_size}
            print(kind, row[kind], flush=True)
    record.save(args.out, row)


if __name__ == "__main__":
    main()
