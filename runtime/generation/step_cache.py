"""Step caching's host side, in one place: the kinds a generation may ask for (`KINDS`), the
request built from the options and checked against the build (`CacheRequest`, `from_options`,
`resolve`), the program each step runs and what the steps skipped (`StepCache`,
`CacheOutcome`), MagCache's decisions (`MagCache`), its calibration and its ratio files.

MagCache skips a denoise step's transformer blocks (the step then adds the last computed
residual to the blocks' input) while the error accumulated from calibrated magnitude ratios
stays small. The decisions follow from the ratios, the settings and the step index only, so the
host makes them and nothing on the devices branches. They are diffusers' MagCache hook's
(`diffusers.hooks.mag_cache`, `MagCacheConfig`) exactly, in its float32 arithmetic; a
two-expert model keeps one cache per expert, each counting its own steps (diffusers' per-module
hook state). The first-block cache's decision depends on the first block's output, so
`cache_step` makes it on the devices under the threshold chosen here. No jax: the CLI checks a
request before jax starts. docs/step_cache.md says where the shipped ratios come from."""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import shlex
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from runtime.builds.artifact import BuildKey
from runtime.generation.outputs import staged
from wan import interface
from wan.bounded_read import read_json
from wan.errors import InputError

MAGCACHE, FBCACHE = "magcache", "fbcache"  # the kinds (KINDS); no kind: every block runs
MAX_RATIOS = 10_000  # ratios per expert: one per step; real lists hold 40-50
MAX_RATIOS_FILE_BYTES = 1 << 20  # two lists of MAX_RATIOS numbers fit in under half of it
CALIBRATE = (
    f"calibrate them once with `runtime run ... --cache {MAGCACHE} --calibrate-mag-ratios "
    "OUT.json`, then pass `--mag-ratios OUT.json`"
)
_NORM_EPSILON = np.float32(1e-8)  # diffusers' calibrate mode: curr / (prev + 1e-8)
ALWAYS_COMPUTE = -1.0  # a first-block cache threshold no relative change is under
FULL_STEP = "denoise_step"  # a build without step caching runs only this
CACHE_STEP, CACHED_STEP = interface.STEP_CACHE_PROGRAMS[FULL_STEP]  # compute / reuse residuals


class StepCacheError(InputError):
    """A step caching option, request or ratios file that cannot be used; the message says what
    to pass."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MagCacheSettings:
    """MagCache's knobs (diffusers' `MagCacheConfig` threshold, max_skip_steps,
    retention_ratio; the defaults are its)."""

    threshold: float = 0.06  # the largest accumulated error a skipped step may carry
    max_skip: int = 3  # the longest run of skipped steps
    retention: float = 0.2  # the fraction of the first steps never skipped

    def __post_init__(self) -> None:
        k, r = self.max_skip, _number(self.retention)
        _check_threshold(self.threshold, MAGCACHE)
        _require(_is_int(k) and k >= 0, "--cache-max-skip", k, "an integer >= 0 (default 3)")
        _require(
            r is not None and 0 <= r <= 1,
            "--cache-retention",
            self.retention,
            "a number in [0, 1] (default 0.2)",
        )

    def to_json(self) -> dict[str, float | int]:
        return dataclasses.asdict(self)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> float | None:
    """`value` as a float when it is an int or a float (inf for an int beyond float's range)."""
    if not (_is_int(value) or isinstance(value, float)):
        return None
    try:
        return float(value)
    except OverflowError:
        return math.inf


def _require(ok: bool, flag: str, value: Any, wanted: str) -> None:
    if not ok:
        raise StepCacheError(f"{flag} {repr(value)[:40]} cannot be used: give {flag} {wanted}")


def _kind(name: str) -> CacheKind:
    _require(name in KINDS, "--cache", name, f"one of {', '.join(KINDS)}")
    return KINDS[name]


def _check_threshold(value: Any, kind: str) -> None:
    t, wanted = _number(value), _kind(kind)
    _require(
        t is not None and 0 <= t < math.inf,
        "--cache-threshold",
        value,
        f"a finite number >= 0 ({kind}: {wanted.threshold_means}; default {wanted.threshold})",
    )


@dataclasses.dataclass(frozen=True)
class CacheKind:
    """A way to skip steps' transformer blocks (`--cache NAME`)."""

    threshold: float  # --cache-threshold's default
    threshold_means: str  # what --cache-threshold bounds
    skips_when: str  # when a step's blocks are skipped


# The one list of cache kinds: the CLI's choices and help, the requests' defaults and checks.
KINDS: dict[str, CacheKind] = {
    MAGCACHE: CacheKind(
        MagCacheSettings.threshold,
        "the accumulated error a skip may carry",
        "the calibrated ratios predict their residual",
    ),
    FBCACHE: CacheKind(
        0.05,  # diffusers' FirstBlockCacheConfig default
        "the first block's relative change under which the others are reused",
        "the first block's output barely changed",
    ),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheRequest:
    """Step caching asked for a generation (`runtime run --cache ...`, `Pipeline.generate`)."""

    kind: str  # one of KINDS
    threshold: float  # the kind's (KINDS[kind].threshold_means)
    max_skip: int = MagCacheSettings.max_skip  # MagCache: most consecutive skips
    retention: float = MagCacheSettings.retention  # MagCache: first steps kept
    mag_ratios: Mapping[str, Sequence[float]] | None = None  # per expert; None: shipped ratios
    calibrate: bool = False  # MagCache: skip nothing, measure this model's ratios

    def __post_init__(self) -> None:
        _check_threshold(self.threshold, self.kind)  # an unknown kind fails there too
        if self.kind == MAGCACHE:
            self.magcache_settings()  # checks max_skip and retention

    def magcache_settings(self) -> MagCacheSettings:
        return MagCacheSettings(
            threshold=self.threshold, max_skip=self.max_skip, retention=self.retention
        )

    def settings(self) -> dict[str, float | int]:
        """The settings the kind reads, for the report."""
        if self.kind == MAGCACHE:
            return self.magcache_settings().to_json()
        return {"threshold": self.threshold}


def from_options(
    kind: str | None,
    threshold: float | None,
    max_skip: int,
    retention: float,
    mag_ratios: Path | None,
    calibrate: bool,
    num_experts: int,
) -> CacheRequest | None:
    """The step caching that `--cache`, `--cache-threshold`, `--cache-max-skip`,
    `--cache-retention`, `--mag-ratios` and `--calibrate-mag-ratios` (`calibrate`) ask for,
    the ratios file read and checked; one line for options that do not go together."""
    if kind is None:
        if threshold is not None or mag_ratios or calibrate:
            raise StepCacheError(
                "--cache-threshold, --mag-ratios and --calibrate-mag-ratios need --cache"
            )
        return None
    default = _kind(kind).threshold
    if kind != MAGCACHE and (mag_ratios or calibrate):
        raise StepCacheError(
            f"--mag-ratios and --calibrate-mag-ratios are MagCache's: use --cache {MAGCACHE}"
        )
    if mag_ratios and calibrate:
        raise StepCacheError("--calibrate-mag-ratios measures the ratios: leave out --mag-ratios")
    return CacheRequest(
        kind=kind,
        threshold=default if threshold is None else threshold,
        max_skip=max_skip,
        retention=retention,
        mag_ratios=read_mag_ratios(mag_ratios, _transformers(num_experts)) if mag_ratios else None,
        calibrate=calibrate,
    )


def resolve(
    key: BuildKey,
    request: CacheRequest | None,
    num_experts: int,
    model: str,
    artifacts: str | Path = "ARTIFACTS",
) -> CacheRequest | None:
    """`request` checked against the build of `key` before any weight loads, with MagCache's
    ratios per expert (given, else shipped for `model`, a preset name or a weights folder); one
    line naming what to change otherwise."""
    if request is None:
        return None
    if key.option("continuous"):
        raise StepCacheError(
            f"--cache {request.kind} with a continuous build ({key.folder_name()}): its videos are "
            "at different steps and step caching decides for a whole batch; serve it without "
            "--cache, or a build with --step-cache and without --continuous"
        )
    if not key.option("step_cache"):
        command = key.with_options(step_cache=True).build_argv(model, artifacts)
        raise StepCacheError(
            f"--cache {request.kind} needs a build with step caching (--step-cache); "
            f"make it with: {shlex.join(command)}"
        )
    if request.kind != MAGCACHE or request.calibrate:
        return request
    experts = _transformers(num_experts)
    if request.mag_ratios is None:
        return dataclasses.replace(request, mag_ratios=shipped_mag_ratios(model, experts))
    if missing := [e for e in experts if e not in request.mag_ratios]:
        raise StepCacheError(f"the MagCache ratios have no list for {', '.join(missing)}")
    return dataclasses.replace(
        request, mag_ratios={e: tuple(request.mag_ratios[e]) for e in experts}
    )


def _transformers(num_experts: int) -> tuple[str, ...]:
    return interface.components(num_experts)[1:-1]


def interpolate_ratios(ratios: Sequence[float], steps: int) -> np.ndarray:
    """`ratios` stretched to `steps` entries by nearest index, as diffusers' `nearest_interp`
    (float32 index grid, round half to even; one step takes the last ratio)."""
    source = np.asarray(ratios, np.float32)
    if steps == 1:
        return source[-1:]
    scale = np.float32((len(source) - 1) / (steps - 1))
    return source[np.round(np.arange(steps, dtype=np.float32) * scale).astype(np.int64)]


class MagCache:
    """One expert's MagCache decisions over one generation of `steps` steps (the steps this
    expert runs): call `skip_next()` once per step it runs, in order."""

    def __init__(self, settings: MagCacheSettings, ratios: Sequence[float], steps: int) -> None:
        if steps < 1 or len(ratios) == 0:
            raise ValueError(f"MagCache needs steps >= 1 and ratios (got {steps}, {len(ratios)})")
        self.settings = settings
        self.ratios = interpolate_ratios(ratios, steps)
        self.retention_steps = int(settings.retention * steps + 0.5)
        self._step = 0
        self._reset()

    def _reset(self) -> None:
        # float32 as in diffusers, whose ratios are a float32 tensor: ties decide alike.
        self._ratio, self._error, self._run = np.float32(1.0), np.float32(0.0), 0

    def skip_next(self) -> bool:
        """Whether this expert's next step skips its blocks (and reuses the residual)."""
        step = self._step
        if step >= len(self.ratios):
            raise RuntimeError(f"MagCache asked for step {step} of {len(self.ratios)}")
        self._step += 1
        if step < self.retention_steps:
            return False
        self._ratio = np.float32(self._ratio * self.ratios[step])
        self._run += 1
        self._error = np.float32(self._error + abs(np.float32(1.0) - self._ratio))
        # Step 0 always computes, so from step 1 on a residual exists to reuse.
        skip = (
            step > 0
            and self._error <= np.float32(self.settings.threshold)
            and self._run <= self.settings.max_skip
        )
        if not skip:
            self._reset()
        return bool(skip)


class MagCalibration:
    """diffusers' MagCache calibrate mode, per expert: each computed step's ratio is 1.0 for the
    expert's first step, else mean(norm / (previous norm + 1e-8)) over the per-token residual
    norms of the prompt (cond) rows."""

    def __init__(self) -> None:
        self._previous: dict[str, np.ndarray] = {}
        self._ratios: dict[str, list[float]] = {}

    def record(self, expert: str, norms: np.ndarray) -> None:
        """Add one step of `expert`: `norms` (rows, tokens), each token's residual norm."""
        norms = np.asarray(norms, np.float32)
        previous = self._previous.get(expert)
        if previous is not None and previous.shape != norms.shape:
            raise ValueError(f"norms {norms.shape} after {previous.shape} for {expert}")
        ratio = 1.0 if previous is None else float(np.mean(norms / (previous + _NORM_EPSILON)))
        self._ratios.setdefault(expert, []).append(ratio)
        self._previous[expert] = norms

    def ratios(self) -> dict[str, tuple[float, ...]]:
        """Each expert's ratios so far, in the order experts first ran."""
        return {expert: tuple(values) for expert, values in self._ratios.items()}


@dataclasses.dataclass
class CacheOutcome:
    """What step caching did in one generation (GenerationReport.cache)."""

    cache: str | None  # one of KINDS; None: off
    settings: dict[str, float | int]
    skipped_steps: list[int]  # step indices whose blocks did not run (fbcache: after the first)
    block_steps_run: int  # transformer blocks run, summed over the steps
    block_steps_total: int  # what running every block of every step takes
    mag_ratios: dict[str, tuple[float, ...]] | None = None  # calibrate: the ratios per expert


class StepCache:
    """Step caching over one generation: the program each step runs and what the steps
    skipped. `step_program`: the build's full step (FULL_STEP: a build without step caching);
    `request` None: no caching; `step_experts[i]`: the expert that runs step i."""

    def __init__(
        self,
        request: CacheRequest | None,
        step_program: str,
        step_experts: Sequence[str],
        num_layers: int,
    ) -> None:
        self.request, self.step_program, self.num_layers = request, step_program, num_layers
        # MagCache stretches an expert's ratios over the steps that expert runs.
        self._expert_steps = collections.Counter(step_experts)
        self._mag: dict[str, MagCache] = {}
        self._started: set[str] = set()  # experts that ran a step: their residuals exist
        calibrate = request is not None and request.calibrate
        self.calibration = MagCalibration() if calibrate else None
        self.skipped: list[int] = []
        self.blocks_run = 0

    def choose(self, expert: str) -> tuple[str, float]:
        """The program that runs `expert`'s next step, and the first-block threshold
        CACHE_STEP is given (ALWAYS_COMPUTE: every block runs)."""
        request, fresh = self.request, expert not in self._started
        self._started.add(expert)
        if self.step_program == FULL_STEP:
            return FULL_STEP, ALWAYS_COMPUTE
        if request is None or request.calibrate:
            return CACHE_STEP, ALWAYS_COMPUTE
        if request.kind == MAGCACHE:
            skip = self._magcache(expert).skip_next()
            return (CACHED_STEP if skip else CACHE_STEP), ALWAYS_COMPUTE
        # An expert's first step has no residual to reuse.
        return CACHE_STEP, ALWAYS_COMPUTE if fresh else request.threshold

    def ran(self, i: int, program: str, skipped: bool) -> None:
        """Count step i, run by `program`; `skipped`: CACHE_STEP reused the other blocks'
        residual (its first block ran)."""
        if program == CACHED_STEP or skipped:
            self.skipped.append(i)
        self.blocks_run += 0 if program == CACHED_STEP else 1 if skipped else self.num_layers

    def outcome(self, steps: int) -> CacheOutcome:
        request = self.request
        return CacheOutcome(
            cache=None if request is None else request.kind,
            settings={} if request is None else request.settings(),
            skipped_steps=self.skipped,
            block_steps_run=self.blocks_run,
            block_steps_total=steps * self.num_layers,
            mag_ratios=None if self.calibration is None else self.calibration.ratios(),
        )

    def _magcache(self, expert: str) -> MagCache:
        if expert not in self._mag:
            self._mag[expert] = MagCache(
                self.request.magcache_settings(),
                self.request.mag_ratios[expert],
                self._expert_steps[expert],
            )
        return self._mag[expert]


_WANTED = "give a JSON list of positive numbers, one per step (for two experts an object of two)"


def read_mag_ratios(path: Path, experts: Sequence[str]) -> dict[str, tuple[float, ...]]:
    """The ratios in `path` for a model with `experts`: a JSON list of positive numbers for one
    transformer, an object {"transformer": [...], "transformer_2": [...]} for two."""
    path = Path(path)
    where = f"--mag-ratios {path}"
    if not path.is_file():  # a folder, a FIFO or nothing: one message for all
        raise StepCacheError(f"{where} is not a file: {_WANTED}")
    value = read_json(
        path,
        MAX_RATIOS_FILE_BYTES,
        lambda reason: StepCacheError(f"{where} {reason}: {_WANTED}"),
        allow_nan=True,  # _ratio names the entry that is NaN
    )
    if len(experts) == 1:
        if not isinstance(value, list):
            raise StepCacheError(f"{where} must be a JSON list of positive numbers, one per step")
        return {experts[0]: _checked_ratios(value, where)}
    if not isinstance(value, dict) or set(value) != set(experts):
        keys = ", ".join(f'"{e}": [...]' for e in experts)
        raise StepCacheError(f"{where} must be a JSON object {{{keys}}}, a list per expert")
    return {e: _checked_ratios(value[e], f"{where} {e}") for e in experts}


def _checked_ratios(values: Any, where: str) -> tuple[float, ...]:
    if not isinstance(values, list) or not 1 <= len(values) <= MAX_RATIOS:
        raise StepCacheError(f"{where} must be a list of 1 to {MAX_RATIOS} positive numbers")
    return tuple(_ratio(value, f"{where}: entry {i}") for i, value in enumerate(values))


def _ratio(value: Any, where: str) -> float:
    number = _number(value)
    if number is None or not 0 < number < math.inf:  # NaN fails too
        raise StepCacheError(f"{where} is {json.dumps(value)[:40]}, not a positive finite number")
    return number


def shipped_mag_ratios(model_name: str, experts: Sequence[str]) -> dict[str, tuple[float, ...]]:
    """The published calibration shipped for preset `model_name` (runtime/generation/mag_ratios.json),
    one list per expert."""
    models = json.loads((resources.files("runtime.generation") / "mag_ratios.json").read_text())[
        "models"
    ]
    if model_name not in models:
        raise StepCacheError(
            f"no MagCache ratios ship for model {model_name!r} (they do for "
            f"{', '.join(models)}): {CALIBRATE}"
        )
    ratios = models[model_name]["ratios"]
    if set(ratios) != set(experts):
        raise StepCacheError(
            f"the shipped MagCache ratios of {model_name} are for {', '.join(ratios)}, not "
            f"{', '.join(experts)}: {CALIBRATE}"
        )
    return {e: _checked_ratios(ratios[e], f"shipped ratios of {model_name} {e}") for e in experts}


def write_mag_ratios(path: Path, ratios: Mapping[str, Sequence[float]]) -> None:
    """Write `ratios` (expert -> ratios) as `read_mag_ratios` reads them back: a list for one
    expert, an object for two; whole or not at all. A ratio that is not a positive finite
    number (a diverged run) is a StepCacheError, and nothing is written."""
    checked = {
        e: _checked_ratios([float(v) for v in values], f"calibrated ratios of {e}")
        for e, values in ratios.items()
    }
    value = next(iter(checked.values())) if len(checked) == 1 else checked
    with staged([Path(path)]) as (temporary,):
        temporary.write_text(json.dumps(value) + "\n")
