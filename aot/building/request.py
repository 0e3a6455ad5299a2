"""What a build request is checked against before anything heavier is imported: the model's name,
the video shape's bounds and --out. `aot build` refuses a mistyped request here, in one line,
before jax starts (aot.building.plan resolves the rest of a request, which needs it)."""

from __future__ import annotations

from pathlib import Path

from wan.configs import ModelConfig, VideoShape
from wan.errors import InputError

# Bounds of a request, far above any WAN use (720p, 81 frames: 75,600 tokens a video), so that
# a mistyped size is a one-line error before anything is traced or allocated.
MAX_SIDE = 8192  # pixels
MAX_FRAMES = 1025
MAX_BATCH = 1024
MAX_STEP_TOKENS = 1 << 24  # video tokens of one denoise step, over its whole (CFG) batch
MAX_MODEL_NAME = 100  # characters: the model's name starts each build folder's name


class BuildError(InputError):
    """A build request that cannot be satisfied; the message says what to change."""


def check_model_name(name: str) -> None:
    """A model name that can start a visible folder's name: not hidden (a leading '.', which
    `aot list`, `runtime run` and `aot gc` pass over), not an option (a leading '-'), no
    separator or control character."""
    bad = (
        not name
        or name[0] in ".-"
        or len(name) > MAX_MODEL_NAME
        or any(c in "/\\" or not c.isprintable() for c in name)
    )
    if bad:
        raise BuildError(
            f"--model {name!r}: a model's name starts the names of its build folders, so it must "
            "not start with '.' (hidden from `aot list` and `runtime run`) or '-', nor hold a "
            f"separator or control character, and must be at most {MAX_MODEL_NAME} characters: "
            "rename the model's folder"
        )


def check_shape(config: ModelConfig, shape: VideoShape) -> None:
    """A video shape the model can make, within the bounds of what a build can serve."""
    if not (0 < shape.width <= MAX_SIDE and 0 < shape.height <= MAX_SIDE):
        raise BuildError(
            f"resolution {shape.width}x{shape.height}: width and height must be 1-{MAX_SIDE} pixels"
        )
    if not 0 < shape.frames <= MAX_FRAMES:
        raise BuildError(f"--frames {shape.frames}: frames must be 1-{MAX_FRAMES}")
    if not 0 < shape.batch <= MAX_BATCH:
        raise BuildError(f"--batch {shape.batch}: batch must be 1-{MAX_BATCH}")
    factor = config.vae.spatial_factor * config.transformer.patch_size[1]
    if shape.width % factor or shape.height % factor:
        raise BuildError(
            f"resolution {shape.width}x{shape.height}: width and height must be positive multiples of {factor}"
        )
    tf = config.vae.temporal_factor
    if (shape.frames - 1) % tf:
        raise BuildError(f"--frames {shape.frames}: frames must be {tf}k+1 (e.g. 9, 17, 81)")
    if (tokens := shape.tokens(config) * shape.step_batch) > MAX_STEP_TOKENS:
        raise BuildError(
            f"{shape.width}x{shape.height}, {shape.frames} frames, step batch {shape.step_batch}: "
            f"{tokens} video tokens per denoise step, over the bound of {MAX_STEP_TOKENS}: "
            "use a smaller --res, --frames or --batch"
        )


def check_out(out_root: Path) -> None:
    """`--out` is a folder, or a path where one can be made (no file on or above it)."""
    for path in (out_root, *out_root.parents):
        if path.exists():
            if not path.is_dir():
                raise BuildError(f"--out {out_root}: {path} is not a folder: choose another --out")
            return
