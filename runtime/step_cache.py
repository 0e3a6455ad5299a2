"""Step caching's host-side policy: MagCache's decisions, its magnitude ratios and calibration.

MagCache skips a denoise step's transformer blocks (the step then adds the last computed
residual to the blocks' input) while the error accumulated from calibrated magnitude ratios
stays small. The decisions follow from the ratios, the settings and the step index only, so the
host makes them and nothing on the devices branches. They are diffusers' MagCache hook's
(`diffusers.hooks.mag_cache`, `MagCacheConfig`) exactly, in its float32 arithmetic; a
two-expert model keeps one cache per expert, each counting its own steps (diffusers' per-module
hook state). docs/step_cache.md says where the shipped ratios come from."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from runtime.outputs import staged
from wan.errors import InputError

MAX_RATIOS = 10_000  # ratios per expert: one per step; real lists hold 40-50
MAX_RATIOS_FILE_BYTES = 1 << 20  # two lists of MAX_RATIOS numbers fit in under half of it
CALIBRATE = (
    "calibrate them once with `runtime run ... --cache magcache --calibrate-mag-ratios "
    "OUT.json`, then pass `--mag-ratios OUT.json`"
)
_NORM_EPSILON = np.float32(1e-8)  # diffusers' calibrate mode: curr / (prev + 1e-8)


class StepCacheError(InputError):
    """A step cache setting or ratios file that cannot be used; the message says what to pass."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MagCacheSettings:
    """MagCache's knobs (diffusers' `MagCacheConfig` threshold, max_skip_steps,
    retention_ratio; the defaults are its)."""

    threshold: float = 0.06  # the largest accumulated error a skipped step may carry
    max_skip: int = 3  # the longest run of skipped steps
    retention: float = 0.2  # the fraction of the first steps never skipped

    def __post_init__(self) -> None:
        t, k, r = _number(self.threshold), self.max_skip, _number(self.retention)
        _require(
            t is not None and 0 <= t < math.inf,
            "--cache-threshold",
            self.threshold,
            "a finite number >= 0 (default 0.06)",
        )
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


def skipped_steps(
    settings: MagCacheSettings,
    ratios: Mapping[str, Sequence[float]],
    step_experts: Sequence[str],
) -> tuple[int, ...]:
    """The (global) indices of the steps MagCache skips, `step_experts[i]` naming the expert
    that runs step i: one cache per expert, over the steps it runs."""
    caches = {
        expert: MagCache(settings, ratios[expert], step_experts.count(expert))
        for expert in dict.fromkeys(step_experts)
    }
    return tuple(i for i, expert in enumerate(step_experts) if caches[expert].skip_next())


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


_WANTED = "give a JSON list of positive numbers, one per step (for two experts an object of two)"


def read_mag_ratios(path: Path, experts: Sequence[str]) -> dict[str, tuple[float, ...]]:
    """The ratios in `path` for a model with `experts`: a JSON list of positive numbers for one
    transformer, an object {"transformer": [...], "transformer_2": [...]} for two."""
    path = Path(path)
    if not path.is_file():  # a folder, a FIFO (a read would wait forever) or nothing
        raise StepCacheError(f"--mag-ratios {path} is not a file: {_WANTED}")
    with path.open("rb") as f:
        data = f.read(MAX_RATIOS_FILE_BYTES + 1)
    if len(data) > MAX_RATIOS_FILE_BYTES:
        raise StepCacheError(
            f"--mag-ratios {path} is over {MAX_RATIOS_FILE_BYTES >> 10} KiB: {_WANTED}"
        )
    try:
        value = json.loads(data.decode())
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError too
        raise StepCacheError(f"--mag-ratios {path} is not UTF-8 JSON: {_WANTED}") from None
    where = f"--mag-ratios {path}"
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
    """The published calibration shipped for preset `model_name` (runtime/mag_ratios.json),
    one list per expert."""
    models = json.loads((resources.files("runtime") / "mag_ratios.json").read_text())["models"]
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
