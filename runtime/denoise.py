"""The denoising loop: one step program per step, on the devices, with step caching's choice of
program made on the host (MagCache) or inside the step (the first-block cache).

A build with `--step-cache` runs `cache_step` for a computed step: it returns the latents and
sampler state as `denoise_step` does, plus the blocks' residuals, which stay on the devices and
go back in at the next step of the same expert. MagCache decides from calibrated ratios alone,
so a skipped step is `cached_step` (no block runs); the first-block cache's decision depends on
the first block's output, so `cache_step` makes it itself under the `threshold` it is given (a
negative threshold always computes) and says whether it skipped.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from runtime import step_cache
from runtime.cache_request import CacheOutcome, CacheRequest
from runtime.request import RequestError
from wan import interface

ALWAYS_COMPUTE = -1.0  # a first-block cache threshold no relative change is under


def place(value: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """Host array -> device array with `sharding`, each device receiving only its shards."""
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


Run = Callable[..., dict[str, Any]]  # (program, **inputs by name) -> outputs by name


class Denoiser:
    """Runs the steps of one generation; `request` None: no caching."""

    def __init__(
        self,
        run: Run,
        executables: Mapping[str, Any],
        step_program: str,
        num_layers: int,
        cfg: bool,
        request: CacheRequest | None,
        ratios: Mapping[str, Sequence[float]] | None,
        step_experts: Sequence[str],
    ):
        self.run, self.step_program, self.num_layers, self.cfg = run, step_program, num_layers, cfg
        self.request, self.ratios = request, ratios
        # MagCache interpolates an expert's ratios to the steps that expert runs.
        self.expert_steps = collections.Counter(step_experts)
        self.inputs = interface.named(step_program, executables[step_program].input_shardings[0])
        self.arg_info = interface.named(step_program, executables[step_program].args_info[0])
        self.residuals: dict[str, dict[str, jax.Array]] = {}  # per expert, from its last step
        self.mag: dict[str, step_cache.MagCache] = {}
        self.calibration = step_cache.MagCalibration() if request and request.calibrate else None
        self.skipped: list[int] = []
        self.blocks_run = 0

    def step(self, i: int, expert: str, inputs: dict[str, Any]) -> dict[str, Any]:
        """Step i by `expert` on `inputs` (the denoise step's) -> its outputs."""
        if self.step_program == "denoise_step":
            self.blocks_run += self.num_layers
            return self.run("denoise_step", **inputs)
        residuals = self.residuals.get(expert) or self._zero_residuals()
        kind = self.request.kind if self.request else None
        if kind == "magcache" and not self.request.calibrate and self._mag(expert).skip_next():
            self.skipped.append(i)
            return self.run("cached_step", **inputs, **residuals)
        fresh = expert not in self.residuals
        threshold = self.request.threshold if kind == "fbcache" and not fresh else ALWAYS_COMPUTE
        out = self.run(
            "cache_step",
            **inputs,
            **residuals,
            threshold=place(np.float32(threshold), self.inputs["threshold"]),
        )
        self.residuals[expert] = {k: out[k] for k in ("first_residual", "residual")}
        if bool(out["skipped"].addressable_data(0)):
            self.skipped.append(i)
            self.blocks_run += 1
        else:
            self.blocks_run += self.num_layers
        if self.calibration is not None:
            self.calibration.record(expert, self._prompt_rows(out["residual_norm"]))
        return out

    def outcome(self, steps: int) -> CacheOutcome:
        request = self.request
        settings = {} if request is None else {"threshold": request.threshold}
        if request is not None and request.kind == "magcache":
            settings = request.magcache_settings().to_json()
        return CacheOutcome(
            cache=None if request is None else request.kind,
            settings=settings,
            skipped_steps=self.skipped,
            block_steps_run=self.blocks_run,
            block_steps_total=steps * self.num_layers,
            mag_ratios=None if self.calibration is None else self.calibration.ratios(),
        )

    def _mag(self, expert: str) -> step_cache.MagCache:
        if expert not in self.mag:
            self.mag[expert] = step_cache.MagCache(
                self.request.magcache_settings(), self.ratios[expert], self.expert_steps[expert]
            )
        return self.mag[expert]

    def _zero_residuals(self) -> dict[str, jax.Array]:
        """Residuals for an expert's first step, which computes whatever they hold."""
        return {
            name: place(np.zeros(self.arg_info[name].shape, self.arg_info[name].dtype), shard)
            for name, shard in self.inputs.items()
            if name in ("first_residual", "residual")
        }

    def _prompt_rows(self, norms: jax.Array) -> np.ndarray:
        """The per-token residual norms of the prompt rows (CFG: every other row), on the host."""
        rows = np.asarray(jax.device_get(norms)) if norms.is_fully_addressable else None
        if rows is None:
            raise RequestError("--calibrate-mag-ratios runs in a single-process job only")
        return rows[0::2] if self.cfg else rows
