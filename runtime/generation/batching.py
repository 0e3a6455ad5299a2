"""Many requests in one compiled batch: which requests share a batch, which batch runs next, and
the batch's generation with each video's own prompt, negative prompt and seed (its noise made
from its own seed, so a video does not depend on its neighbours). Used by `runtime serve` and
`runtime run --prompts`. No jax here: the pipeline is passed in."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from runtime.builds.artifact import BuildKey
from runtime.generation import images
from runtime.generation.request import MAX_SEED, RequestError, check_text
from wan.bounded_read import parse_json, read_bytes

if TYPE_CHECKING:
    from runtime.generation.report import GenerationReport
    from runtime.generation.step_cache import CacheRequest


@dataclasses.dataclass(frozen=True)
class Video:
    """One video of a batch."""

    prompt: str
    negative_prompt: str = ""
    seed: int = 0
    image: Path | None = None  # image to video's first frame (checked by runtime.generation.images)
    last_image: Path | None = None  # and its last (first-last-frame)


@dataclasses.dataclass(frozen=True)
class Settings:
    """What every video of a batch shares besides the build: one generate() call's settings."""

    steps: int = 50
    guidance: float = 5.0
    guidance_2: float | None = None
    sampler: str | None = None
    shift: float | None = None


class BatchPipeline(Protocol):
    key: BuildKey  # its `batch`: the videos one generate() makes

    def generate(
        self, prompt: Any, negative_prompt: Any, **kwargs: Any
    ) -> tuple[np.ndarray, GenerationReport]: ...


@dataclasses.dataclass(frozen=True)
class Group:
    """The requests that can share a batch: the same build (by name) and the same settings."""

    build: str
    settings: Settings


@dataclasses.dataclass(frozen=True)
class Waiting:
    """A queued request as the scheduler sees it."""

    id: str
    group: Group
    created_at: float


def next_batch(
    queued: Sequence[Waiting], batch_of: Callable[[Group], int], now: float, window: float
) -> tuple[list[Waiting], float]:
    """The batch to run now (ids of one group, oldest first) and, when there is none yet, the
    seconds to wait for one. The group whose oldest request waits longest goes first; it runs
    once it fills its build's batch or its oldest request has waited `window` seconds (so that
    requests arriving together share a batch)."""
    if not queued:
        return [], window
    oldest = min(queued, key=lambda w: w.created_at)
    members = sorted((w for w in queued if w.group == oldest.group), key=lambda w: w.created_at)
    size = batch_of(oldest.group)
    wait = oldest.created_at + window - now
    if len(members) >= size or wait <= 0:
        return members[:size], 0.0
    return [], wait


def generate_batch(
    pipe: BatchPipeline,
    videos: Sequence[Video],
    settings: Settings,
    on_step: Callable[[int, int], None] | None = None,
    cache: CacheRequest | None = None,
) -> tuple[np.ndarray, GenerationReport]:
    """The frames (N, F, H, W, 3) of up to the build's batch of `videos` in one generate()
    (`cache`: its step caching): the empty slots are filled with the last video again and their
    frames discarded."""
    batch = pipe.key.batch
    if not 0 < len(videos) <= batch:
        raise RequestError(f"a batch holds 1 to {batch} videos, not {len(videos)}")
    slots = [*videos, *[videos[-1]] * (batch - len(videos))]
    given = [v.image is not None for v in slots]
    if any(given) and not all(given):
        raise RequestError("some videos of the batch have an image and others none: give each one")
    frames, report = pipe.generate(
        [v.prompt for v in slots],
        [v.negative_prompt for v in slots],
        seed=[v.seed for v in slots],
        on_step=on_step,
        cache=cache,
        **({"images": [images.read_image(v.image) for v in slots]} if any(given) else {}),
        **(
            {"last_images": [v.last_image and images.read_image(v.last_image) for v in slots]}
            if any(v.last_image for v in slots)
            else {}
        ),
        **dataclasses.asdict(settings),
    )
    return frames[: len(videos)], report


@dataclasses.dataclass(frozen=True)
class PromptLine:
    """One line of a `runtime run --prompts` file."""

    video: Video
    out: Path
    where: str = "a --prompts line"  # its file and number, as a message names it

    def inputs(self) -> list[tuple[Path, str]]:
        """The files the line reads, each with its name in a message: no line's `out` may be
        one of them (runtime.generation.outputs.check_not_inputs)."""
        given = (("image", self.video.image), ("last_image", self.video.last_image))
        return [(path, f"{self.where}'s {key}") for key, path in given if path is not None]


PROMPT_FIELDS = {
    "prompt": str, "negative_prompt": str, "seed": int, "out": str, "image": str,
    "last_image": str,
}  # fmt: skip
MAX_PROMPT_LINES = 100_000
MAX_PROMPTS_BYTES = 64 << 20  # 100,000 lines of 670 bytes
CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def read_prompts_file(
    path: Path, default_seed: int, out_dir: Path | None = None
) -> list[PromptLine]:
    """The requests of a JSON Lines file: one object per line with `prompt` and `out` (a path
    inside `out_dir`, by default the file's folder), optionally `negative_prompt` and `seed`
    (else `default_seed`). Blank lines are skipped; any other fault names its line."""
    data = read_bytes(
        path,
        MAX_PROMPTS_BYTES,
        lambda reason: RequestError(f"--prompts {path} {reason}: give a JSON Lines file"),
    )
    base = (path.parent if out_dir is None else out_dir).resolve()
    found = [
        _prompt_line(f"--prompts {path} line {number}", line, default_seed, base, path.parent)
        for number, line in enumerate(data.splitlines(), 1)
        if line.strip()
    ]
    if not found or len(found) > MAX_PROMPT_LINES:
        raise RequestError(f"--prompts {path}: give 1 to {MAX_PROMPT_LINES} requests, one a line")
    return found


def _prompt_line(
    where: str, line: bytes, default_seed: int, base: Path, folder: Path
) -> PromptLine:
    """One line; its `out` inside `base`, its `image` (read and checked now, again when its
    batch runs) relative to the prompts file's `folder`."""
    item = parse_json(
        line, lambda reason: RequestError(f"{where} {reason}: give one JSON object a line")
    )
    if not isinstance(item, dict):
        raise RequestError(f"{where} is not a JSON object")
    unknown = sorted(set(item) - set(PROMPT_FIELDS))
    missing = [k for k in ("prompt", "out") if k not in item]
    if unknown or missing:
        raise RequestError(
            f"{where}: {'unknown ' + ', '.join(unknown) if unknown else 'no ' + ', '.join(missing)}"
            f"; a line holds {', '.join(PROMPT_FIELDS)} (prompt and out required)"
        )
    for key, kind in PROMPT_FIELDS.items():
        value = item.get(key)
        if value is not None and (type(value) is not kind):
            raise RequestError(
                f"{where}: {key} is a {type(value).__name__}, give a {kind.__name__}"
            )
    seed = item.get("seed", default_seed)
    if not 0 <= seed <= MAX_SEED:
        shown = seed if abs(seed) < 10**30 else "of too many digits"
        raise RequestError(f"{where}: seed {shown}: give an integer in [0, {MAX_SEED}]")
    for key in ("prompt", "negative_prompt", "out", "image", "last_image"):
        check_text(f"{where}: {key}", item.get(key, ""))
    if "last_image" in item and "image" not in item:
        raise RequestError(f"{where}: last_image goes with image (the first frame)")
    pictures = {}
    for key in ("image", "last_image"):
        if key in item:
            pictures[key] = folder / item[key]
            images.read_image(pictures[key], what=f"{where}: {key}")
    return PromptLine(
        Video(item["prompt"], item.get("negative_prompt", ""), seed, **pictures),
        _out_path(where, item["out"], base),
        where,
    )


def _out_path(where: str, out: str, base: Path) -> Path:
    """A line's `out` inside `base` (resolved: no `..`, no absolute path, no symlink out of
    it), so that a prompts file cannot name a file elsewhere for the run to replace."""
    if CONTROL.search(out):
        raise RequestError(f"{where}: out holds a control character: give a file path")
    target = (base / out).resolve()  # an absolute `out` replaces `base`
    if not target.is_relative_to(base) or target == base:
        raise RequestError(
            f"{where}: out {out!r} is not in {base}: give a file path inside it (relative, "
            "without `..`), or another folder with --out-dir"
        )
    return target
