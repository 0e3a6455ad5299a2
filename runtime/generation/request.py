"""What a generation request may hold, checked on the host before any device work: finite
scales, UTF-8 prompts, initial noise of the build's shape. No jax here: `runtime run` checks its
arguments with these before jax starts, and `Pipeline.generate` checks API calls with them."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from tokenize import TokenError

import numpy as np

from runtime.builds.artifact import Manifest
from wan.errors import InputError
from wan.interface import IMAGE_PROGRAMS


class RequestError(InputError):
    """A generation request this pipeline cannot run (a number that is not finite, noise of
    another shape or with NaNs, prompts that do not fit the batch); the message says which."""


# CFG scales and flow shifts in use are 1-20; far past that the float32 step tables and
# guidance overflow, so a larger value is a typo, refused before it makes a NaN video.
MAX_SCALE = 1e4
# A seed is a JSON number every client and schema validator reads exactly (and an int64 where
# it is stored: the job store, reports): the same bound for --seed, --prompts lines and serve.
MAX_SEED = 2**53 - 1


def check_finite(name: str, value: float | None) -> None:
    """A scale or shift is a finite number within +-MAX_SCALE (Python's float() takes 'nan',
    'inf' and '1e308')."""
    if value is not None and not (math.isfinite(value) and abs(value) <= MAX_SCALE):
        raise RequestError(f"{name} {value}: give a finite number within +-{MAX_SCALE:g}")


def check_settings(guidance: float, guidance_2: float | None, shift: float | None) -> None:
    """The request's scales are finite and the flow shift (when given) a positive number."""
    for name, value in (("guidance", guidance), ("guidance_2", guidance_2), ("shift", shift)):
        check_finite(name, value)
    if shift is not None and shift <= 0:
        raise RequestError(f"shift {shift}: give a number > 0")


def check_text(name: str, text: str) -> None:
    """`text` is a str that is valid Unicode: a command line's undecodable bytes arrive as lone
    surrogates (carrying the byte), which no tokenizer can encode."""
    if not isinstance(text, str):
        raise RequestError(f"{name} is a {type(text).__name__}, not text")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        char = ord(text[e.start])
        # U+DC80-U+DCFF carry a byte that was not UTF-8; other surrogates came as JSON escapes.
        what = f"byte 0x{char & 0xFF:02x}" if 0xDC80 <= char <= 0xDCFF else f"U+{char:04X}"
        raise RequestError(
            f"{name} is not valid UTF-8 ({what} at character {e.start + 1}): give UTF-8 text"
        ) from None


def latent_shape(manifest: Manifest) -> tuple[int, ...]:
    """The build's latents, channels-last (B, T, h, w, C): the denoise step's input."""
    (spec,) = (
        s for s in manifest.programs[manifest.key.step_program].inputs if s.path == "latents"
    )
    return tuple(spec.shape)


def read_init_noise(path: Path, shape: tuple[int, ...]) -> np.ndarray:
    """Initial noise for latents of `shape` (channels-last, as `latent_shape`) from a .npy in the
    diffusers layout (B, C, T, h, w): its header is checked (a float array of that shape, the file
    exactly that long) before any data is read, no pickle is ever loaded, values must be finite."""
    expected = _noise_shape(shape)
    header_shape, dtype, data_start = _npy_header(path)
    if dtype.kind != "f" or header_shape != expected:
        raise RequestError(
            f"--init-noise {path} holds {dtype} {header_shape}: this build needs float "
            f"{expected} (B, C, T, H/8, W/8)"
        )
    if path.stat().st_size != data_start + math.prod(expected) * dtype.itemsize:
        raise RequestError(f"--init-noise {path}: its length does not match its header")
    try:
        noise = np.load(path, allow_pickle=False)
    except (ValueError, EOFError) as e:
        raise RequestError(f"--init-noise {path} is not a valid .npy array: {e}") from None
    return checked_noise(noise, shape)


def _npy_header(path: Path) -> tuple[tuple[int, ...], np.dtype, int]:
    """A .npy file's shape, dtype and where its data starts, from its header alone."""
    if not path.is_file():  # a FIFO or a device would block or never end
        raise RequestError(f"--init-noise {path} is not a regular file")
    try:
        with path.open("rb") as f:
            version = np.lib.format.read_magic(f)
            if version not in ((1, 0), (2, 0)):
                raise ValueError(f"npy format version {version} is not supported")
            read_header = getattr(np.lib.format, f"read_array_header_{version[0]}_0")
            with warnings.catch_warnings():  # a Python 2 header: parsed all the same
                warnings.simplefilter("ignore")
                shape, _, dtype = read_header(f)
            return shape, dtype, f.tell()
    # numpy parses the header (at most 10,000 bytes) as a Python literal, with its errors.
    except (ValueError, EOFError, SyntaxError, TypeError, TokenError, RecursionError) as e:
        raise RequestError(f"--init-noise {path} is not a valid .npy array: {e}") from None


def checked_noise(noise: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """`noise` (diffusers layout) as float32 for latents of `shape`: the right shape, finite."""
    expected = _noise_shape(shape)
    try:
        noise = np.asarray(noise, dtype=np.float32)
    except (TypeError, ValueError) as e:
        raise RequestError(f"the init noise is not a float array: {e}") from None
    if noise.shape != expected:
        raise RequestError(
            f"the init noise has shape {noise.shape}, this build needs {expected} "
            "(B, C, T, H/8, W/8)"
        )
    if not np.isfinite(noise).all():
        raise RequestError("the init noise holds NaN or Inf: give finite values")
    return noise


def _noise_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Channels-last (B, T, h, w, C) -> the diffusers layout (B, C, T, h, w)."""
    b, t, h, w, c = shape
    return (b, c, t, h, w)


def initial_latents(shape: tuple[int, ...], seed: int, init_noise: np.ndarray | None) -> np.ndarray:
    """Channels-last (B, T, h, w, C) float32 noise, from `init_noise` (diffusers layout
    (B, C, T, h, w)) or a numpy generator seeded with `seed`."""
    if init_noise is None:
        noise = np.random.default_rng(seed).standard_normal(_noise_shape(shape), np.float32)
    else:
        noise = checked_noise(init_noise, shape)
    return np.ascontiguousarray(noise.transpose(0, 2, 3, 4, 1))


def check_image(programs: tuple[str, ...], build: str, given: bool) -> None:
    """An image exactly when the build (holding `programs`) makes videos from one."""
    takes = not set(IMAGE_PROGRAMS).isdisjoint(programs)
    if not takes and given:
        raise RequestError(
            f"build {build} is text to video and takes no image: build an image-to-video "
            "model (its own pipeline: `aot build --pipeline auto`) for the image"
        )
    if takes and not given:
        raise RequestError(
            f"build {build} is image to video: give an image (--image FILE, `images=`)"
        )
