"""Step caching as a generation asks for it (`runtime run --cache ...`, `Pipeline.generate(...,
cache=)`) and what it did, checked against the build before anything loads. No jax: the CLI
checks a request before jax starts."""

from __future__ import annotations

import dataclasses
import math
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from runtime import step_cache
from runtime.request import RequestError
from wan import interface

CACHES = ("magcache", "fbcache")
# MagCache's and diffusers' FirstBlockCacheConfig's defaults.
DEFAULT_THRESHOLDS = {"magcache": step_cache.MagCacheSettings().threshold, "fbcache": 0.05}


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheRequest:
    """Step caching asked for a generation (`runtime run --cache ...`)."""

    kind: str  # one of CACHES
    threshold: float  # MagCache: accumulated error; fbcache: the first block's relative change
    max_skip: int = step_cache.MagCacheSettings.max_skip  # MagCache: most consecutive skips
    retention: float = step_cache.MagCacheSettings.retention  # MagCache: first steps kept
    mag_ratios: Mapping[str, Sequence[float]] | None = None  # per expert; None: shipped ratios
    calibrate: bool = False  # MagCache: skip nothing, measure this model's ratios

    def __post_init__(self):
        if self.kind not in CACHES:
            raise RequestError(f"--cache {self.kind}: use one of {', '.join(CACHES)}")
        if self.kind == "magcache":
            self.magcache_settings()  # checks the values
        elif not (math.isfinite(self.threshold) and self.threshold >= 0):
            raise RequestError(
                f"--cache-threshold {self.threshold}: give a finite number >= 0 "
                "(the first block's relative change under which a step reuses the others)"
            )

    def magcache_settings(self) -> step_cache.MagCacheSettings:
        return step_cache.MagCacheSettings(
            threshold=self.threshold, max_skip=self.max_skip, retention=self.retention
        )


@dataclasses.dataclass
class CacheOutcome:
    """What step caching did in one generation (GenerationReport.cache)."""

    cache: str | None  # magcache, fbcache or None
    settings: dict[str, Any]
    skipped_steps: list[int]  # step indices whose blocks did not run (fbcache: after the first)
    block_steps_run: int  # transformer blocks run, summed over the steps
    block_steps_total: int  # what running every block of every step takes
    mag_ratios: dict[str, list[float]] | None = None  # calibrate: this model's ratios per expert


def check_cache(
    key: Any,
    request: CacheRequest | None,
    num_experts: int,
    model: str,
    artifacts: str = "ARTIFACTS",
) -> dict[str, tuple[float, ...]] | None:
    """Whether the build of `key` serves `request`, and MagCache's ratios per expert (given,
    else shipped for `model`, a preset name or a weights folder); one line naming what to
    change otherwise."""
    if request is None:
        return None
    if not key.step_cache:
        command = key.with_options(step_cache=True).build_argv(model, artifacts)
        raise RequestError(
            f"--cache {request.kind} needs a build with step caching (--step-cache); "
            f"make it with: {shlex.join(command)}"
        )
    if request.kind != "magcache" or request.calibrate:
        return None
    experts = interface.components(num_experts)[1:-1]  # the transformers
    if request.mag_ratios is None:
        return step_cache.shipped_mag_ratios(model, experts)
    if missing := [e for e in experts if e not in request.mag_ratios]:
        raise RequestError(f"the MagCache ratios have no list for {', '.join(missing)}")
    return {e: tuple(request.mag_ratios[e]) for e in experts}
