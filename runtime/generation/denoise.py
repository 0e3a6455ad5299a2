"""One denoise step at a time on the devices, each run by the program step caching picked
(`runtime.generation.step_cache.StepCache`): the build's full step, or with `--step-cache` `cache_step`
(every block, or the first-block cache's reuse, which it decides itself) or `cached_step` (no
block: MagCache's skip). The blocks' residuals that `cache_step` returns stay on the devices
and go back in at the same expert's next step. A `--sparse-attention radial` build runs its
dense steps for the first steps its settings keep dense, then their sparse variants
(`radial_step`, `radial_cache_step`: wan.interface.SPARSE_PROGRAMS).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from runtime.generation.request import RequestError
from runtime.generation.step_cache import StepCache
from wan import interface, sparse_attention

RESIDUALS = ("first_residual", "residual")  # cache_step's outputs that go back in


def place(value: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """Host array -> device array with `sharding`, each device receiving only its shards."""
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


Run = Callable[..., dict[str, Any]]  # (program, **inputs by name) -> outputs by name


class Denoiser:
    """Runs the steps of one generation as `cache` picks their programs."""

    def __init__(
        self,
        run: Run,
        executables: Mapping[str, Any],
        cache: StepCache,
        cfg: bool,
        sparse: sparse_attention.Radial | None = None,
    ):
        """`sparse`: the build's Radial settings (None: every step dense)."""
        self.run, self.cache, self.cfg, self.sparse = run, cache, cfg, sparse
        self.dense_steps: list[int] = []  # of a sparse build: the steps that ran dense
        self.step_seconds: list[float] = []  # each step's, to its latents checked on the host
        step = executables[cache.step_program]
        self.inputs = interface.named(cache.step_program, step.input_shardings[0])
        self.arg_info = interface.named(cache.step_program, step.args_info[0])
        self.residuals: dict[str, dict[str, jax.Array]] = {}  # per expert, from its last step

    def step(self, i: int, expert: str, inputs: dict[str, Any]) -> dict[str, Any]:
        """Step i by `expert` on `inputs` (the denoise step's) -> its outputs."""
        program, threshold = self.cache.choose(expert)
        if self.sparse is not None:
            dense = self.sparse.dense_step(i)
            self.dense_steps += [i] if dense else []
            program = program if dense else interface.sparse_variant(program)
        takes = interface.SIGNATURES[program].inputs
        if "residual" in takes:
            inputs = {**inputs, **(self.residuals.get(expert) or self._zero_residuals())}
        if "threshold" in takes:
            inputs = {**inputs, "threshold": place(np.float32(threshold), self.inputs["threshold"])}
        out = self.run(program, **inputs)
        if "residual" in out:
            self.residuals[expert] = {name: out[name] for name in RESIDUALS}
        self.cache.ran(i, program, "skipped" in out and bool(out["skipped"].addressable_data(0)))
        if self.cache.calibration is not None:
            self.cache.calibration.record(expert, self._prompt_rows(out["residual_norm"]))
        return out

    def _zero_residuals(self) -> dict[str, jax.Array]:
        """Residuals for an expert's first step, which computes whatever they hold."""
        return {
            name: place(np.zeros(self.arg_info[name].shape, self.arg_info[name].dtype), shard)
            for name, shard in self.inputs.items()
            if name in RESIDUALS
        }

    def _prompt_rows(self, norms: jax.Array) -> np.ndarray:
        """The per-token residual norms of the prompt rows (CFG: every other row), on the host."""
        rows = np.asarray(jax.device_get(norms)) if norms.is_fully_addressable else None
        if rows is None:
            raise RequestError("--calibrate-mag-ratios runs in a single-process job only")
        return rows[0::2] if self.cfg else rows
