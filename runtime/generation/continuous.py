"""Step-level continuous batching on a `--continuous` build (wan.interface.CONTINUOUS_PROGRAMS):
the batch's B slots each hold a video at its own step, with its own step count, guidance,
sampler, shift and seed. A video joins at a step boundary (its prompt's keys and values and its
noise written into a free slot on the devices, by `join_kv` and `join_latents`), every step
advances the occupied slots (`slot_step`, one sampler row and guidance per slot; the others
keep what they hold), and a video that has had its steps is decoded alone (`slot_decode`) and
leaves its slot while the others go on.

Each video equals its batch-1 generation (same prompt, settings and seed): its noise comes from
its own seed, and a slot's rows never mix with another's. A two-expert model runs a step per
expert in use, each marking its own slots. Step caching decides for a whole batch, so it is
not offered here (aot.building.plan refuses the combination). Runs the executables only: no compile.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from runtime.generation.batching import Settings, Video
from runtime.generation.compiles import no_compilation
from runtime.generation.denoise import place
from runtime.generation.pipeline import Pipeline, handoff
from runtime.generation.request import RequestError, check_settings, initial_latents
from wan import interface, schedulers


@dataclasses.dataclass
class SlotVideo:
    """A video in a slot: its id, its sampler tables, and which expert and guidance run its
    step i; `done` steps so far."""

    id: str
    tables: schedulers.SamplerTables
    expert_at: Callable[[int], tuple[str, float]]
    done: int = 0

    @property
    def steps(self) -> int:
        return self.tables.num_steps


@dataclasses.dataclass(frozen=True)
class Finished:
    """A video that left its batch: its frames (F, H, W, 3) uint8, or why it failed."""

    id: str
    frames: np.ndarray | None
    error: str | None = None


class SlotBatch:
    """The slots of one continuous build's batch, on the devices."""

    def __init__(self, pipe: Pipeline):
        if not pipe.key.option("continuous"):
            raise RequestError(
                f"build {pipe.name} is not a continuous build (aot build --continuous)"
            )
        self.pipe = pipe
        self.slots: list[SlotVideo | None] = [None] * pipe.key.batch
        self.expert_names = ["transformer", "transformer_2"][: pipe.config.num_experts]
        step = interface.named("slot_step", pipe.exe["slot_step"].args_info[0])
        self.step_in = interface.named("slot_step", pipe.exe["slot_step"].input_shardings[0])
        self.latent_shape = tuple(step["latents"].shape)
        # Empty slots hold zeros: latents, sampler state and keys and values alike.
        self.latents, self.state = self._zeros(step, "latents"), self._zeros(step, "state")
        self.kv = {expert: self._zeros(step, "kv") for expert in self.expert_names}
        self.zero_row = {k: np.zeros(v.shape[1:], v.dtype) for k, v in step["row"].items()}

    def _zeros(self, step: dict[str, Any], name: str) -> Any:
        """The slot step's input `name` as zeros on the devices, laid out as the step takes it."""
        return jax.tree.map(
            lambda info, s: place(np.zeros(info.shape, info.dtype), s),
            step[name],
            self.step_in[name],
        )

    @property
    def free(self) -> list[int]:
        return [i for i, slot in enumerate(self.slots) if slot is None]

    @property
    def occupied(self) -> int:
        return len(self.slots) - len(self.free)

    def join(self, videos: Sequence[tuple[str, Video, Settings]]) -> None:
        """Put `videos` (id, video, settings) into free slots, lowest first: their keys and
        values and their noise are written on the devices; the other slots are untouched."""
        free = self.free
        if len(videos) > len(free):
            raise RequestError(f"{len(videos)} videos cannot join {len(free)} free slots")
        pipe, batch = self.pipe, len(self.slots)
        joining = np.zeros(batch, bool)
        prompts, negatives = [""] * batch, [""] * batch
        noise = np.zeros(self.latent_shape, np.float32)
        entering = {}
        for slot, (video_id, video, settings) in zip(free, videos, strict=False):
            check_settings(settings.guidance, settings.guidance_2, settings.shift)
            tables = schedulers.make_tables(
                pipe.scheduler(settings.sampler, settings.shift), settings.steps
            )
            _, expert_at = pipe.experts(tables, settings.guidance, settings.guidance_2)
            joining[slot] = True
            prompts[slot], negatives[slot] = video.prompt, video.negative_prompt
            noise[slot] = initial_latents((1, *self.latent_shape[1:]), video.seed, None)[0]
            entering[slot] = SlotVideo(video_id, tables, expert_at)
        texts = pipe.texts(prompts, negatives)
        mask = place(joining, pipe.input_sharding("join_kv", "joining"))
        with no_compilation():
            new_kv = pipe.kv_caches(pipe.encode(texts), self.expert_names)
            for expert in self.expert_names:
                self.kv[expert] = pipe.run("join_kv", kv=self.kv[expert], new_kv=new_kv[expert],
                                           joining=mask)["kv"]  # fmt: skip
            joined = pipe.run(
                "join_latents", latents=self.latents, state=self.state,
                noise=place(noise, pipe.input_sharding("join_latents", "noise")),
                joining=place(joining, pipe.input_sharding("join_latents", "joining")),
            )  # fmt: skip
        self.latents, self.state = joined["latents"], joined["state"]
        for slot, video in entering.items():
            self.slots[slot] = video

    def step(self) -> list[Finished]:
        """One step of every occupied slot (per expert in use), then the videos that have had
        all their steps decoded and their slots freed; a video whose latents became NaN or
        infinite fails alone."""
        pipe, batch = self.pipe, len(self.slots)
        by_expert: dict[str, list[int]] = {}
        for i, video in enumerate(self.slots):
            if video is not None:
                by_expert.setdefault(video.expert_at(video.done)[0], []).append(i)
        with no_compilation():
            for expert, members in by_expert.items():
                rows = [self.slots[i].tables.row(self.slots[i].done) if i in members else self.zero_row
                        for i in range(batch)]  # fmt: skip
                guidance = [self.slots[i].expert_at(self.slots[i].done)[1] if i in members else 0.0
                            for i in range(batch)]  # fmt: skip
                out = pipe.run(
                    "slot_step",
                    params=pipe.params[expert],
                    latents=self.latents,
                    kv=tuple(handoff(a, s) for a, s in zip(self.kv[expert], self.step_in["kv"], strict=True)),
                    row={k: place(np.stack([r[k] for r in rows]), self.step_in["row"][k]) for k in self.zero_row},
                    state=self.state,
                    guidance=place(np.asarray(guidance, np.float32), self.step_in["guidance"]),
                    active=place(np.isin(np.arange(batch), members), self.step_in["active"]),
                )  # fmt: skip
                self.latents, self.state = out["latents"], out["state"]
            finite = _finite_videos(self.latents)
            left = []
            for i, video in enumerate(self.slots):
                if video is None:
                    continue
                video.done += 1
                if not finite[i]:
                    why = (f"the latents became NaN or Inf at step {video.done} of {video.steps}: "
                           "check the guidance and the weights")  # fmt: skip
                    left.append(Finished(video.id, None, why))
                elif video.done == video.steps:
                    left.append(Finished(video.id, self._decode(i)))
                else:
                    continue
                self.slots[i] = None
        return left

    def progress(self) -> dict[str, tuple[int, int]]:
        """(steps done, steps) of each video in a slot, by id."""
        return {v.id: (v.done, v.steps) for v in self.slots if v is not None}

    def _decode(self, slot: int) -> np.ndarray:
        pipe = self.pipe
        latents = handoff(self.latents, pipe.input_sharding("slot_decode", "latents"))
        slot_index = place(np.int32(slot), pipe.input_sharding("slot_decode", "slot"))
        frames = pipe.run(
            "slot_decode", params=pipe.weights("vae"), latents=latents, slot=slot_index
        )
        frames = np.asarray(frames["frames"])[0]
        pipe.release("vae")
        return frames


def _finite_videos(x: jax.Array) -> np.ndarray:
    """Whether each video (along the batch axis) of `x` holds no NaN or Inf, read on the host
    shard by shard (a jnp reduction would compile)."""
    finite = np.ones(x.shape[0], bool)
    for shard in x.addressable_shards:
        if shard.replica_id == 0:
            rows = np.asarray(shard.data).reshape(shard.data.shape[0], -1)
            finite[shard.index[0]] &= np.isfinite(rows).all(axis=1)
    return finite
