"""Generation from prebuilt executables: load once, generate many prompts, compile nothing.

Host math is numpy (noise, sampler tables, CFG bookkeeping); the device runs only the
deserialized executables. Arrays pass from one program to the next as they are: the build gave
each consumer its producer's output sharding (a reshard here would compile). Under
jax.distributed every process runs this same code on its own devices (SPMD).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from PIL.Image import Image as PILImage

from runtime.builds.artifact import ArtifactError, BuildKey, Manifest
from runtime.builds.loader import Present, Request, match_build, open_build
from runtime.generation import clock, images
from runtime.generation.compiles import no_compilation
from runtime.generation.denoise import Denoiser, place
from runtime.generation.report import GenerationReport, MemoryOutcome, SparseOutcome
from runtime.generation.request import (
    RequestError,
    check_image,
    check_settings,
    check_text,
    initial_latents,
)
from runtime.generation.step_cache import CacheOutcome, CacheRequest, StepCache, resolve
from runtime.trust.signing import TrustedKey
from wan import checkpoint, interface, lora, residency, schedulers, sparse_attention, tokenizer
from wan.configs import ModelConfig, SchedulerConfig
from wan.errors import InputError
from wan.presets import model_spec
from wan.weights import flatten


class NonFiniteError(InputError):
    """The latents became NaN or infinite during the denoising: the video would be black."""


def handoff(x: jax.Array, sharding: jax.sharding.Sharding) -> jax.Array:
    """`x` for a program whose input sharding is `sharding` (equal by construction)."""
    if not x.sharding.is_equivalent_to(sharding, x.ndim):
        raise ArtifactError(
            f"a program's output sharding {x.sharding} differs from its consumer's {sharding}: "
            "the build is inconsistent; rebuild with `aot build --force`"
        )
    return x


def _abstract(args_info: Any, shardings: Any) -> Any:
    return jax.tree.map(
        lambda info, s: jax.ShapeDtypeStruct(info.shape, info.dtype, sharding=s),
        args_info,
        shardings,
        is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"),
    )


LoraSpecs = Sequence[tuple[str | Path, float]]  # (file, scale) pairs
# Weights already placed, by component and abstract (shapes, dtypes, shardings): builds assembled
# with the same weights and LoRAs share each component's arrays where their shardings agree.
PlacedWeights = dict[tuple[Any, ...], Any]


class Pipeline:
    """Executables plus placed weights. `generate` runs one request shape any number of times."""

    def __init__(
        self,
        executables: dict[str, Any],
        params: dict[str, Any],
        config: ModelConfig,
        tok: Any,
        key: BuildKey,
        name: str,
        loras: Sequence[lora.AppliedLora] = (),
        transient: Mapping[str, Callable[[], Any]] | None = None,
    ):
        self.exe, self.params, self.config, self.tokenizer = executables, params, config, tok
        self.key, self.name = key, name
        self.loras = list(loras)  # merged into `params`
        # Components placed only for the program that takes them (wan.residency): how to place
        # each again; `params` holds one while it is placed.
        self.transient = dict(transient or {})
        self.load_phases: dict[str, float] = {}  # set by from_build
        self.predicted_peak: tuple[int, str] = (0, "")  # set by from_build (wan.residency)
        self.clip: images.ClipProcessor | None = None  # an i2v-clip build's, set by assemble
        # The program that makes what every step reads (image to video: with the image's).
        self.kv_program = "image_kv_cache" if "image_kv_cache" in key.programs else "kv_cache"

    def weights(self, component: str) -> Any:
        """`component`'s placed weights; a transient one is placed now if it is not."""
        if component not in self.params:
            self.params[component] = self.transient[component]()
        return self.params[component]

    def release(self, *components: str) -> None:
        """Delete the transient ones of `components` from the devices (their programs ran)."""
        for component in components:
            if component in self.transient and component in self.params:
                for leaf in jax.tree.leaves(self.params.pop(component)):
                    leaf.delete()

    @classmethod
    def load(
        cls,
        artifacts: str | Path,
        weights: str | Path,
        request: Request,
        build: str | None = None,
        loras: LoraSpecs = (),
        loras_2: LoraSpecs = (),
    ) -> Pipeline:
        """The build in `artifacts` that serves `request` on this job's devices (the one
        named `build`, if given), with the weights of `weights` and the LoRAs `loras` merged
        into the transformer (`loras_2`: into the low-noise expert of a two-expert model)."""
        config = ModelConfig.from_folder(weights)
        request = dataclasses.replace(request, model_hash=config.hash())
        present = Present.of(jax.devices())
        folder, manifest = match_build(
            Path(artifacts), request, model_spec(config, weights), present, build
        )
        return cls.from_build(folder, manifest, weights, config, loras, loras_2)

    @classmethod
    def from_build(
        cls,
        folder: Path,
        manifest: Manifest,
        weights: str | Path,
        config: ModelConfig,
        loras: LoraSpecs = (),
        loras_2: LoraSpecs = (),
        placed: PlacedWeights | None = None,
        trusted: Sequence[TrustedKey] = (),
        placement: Mapping[str, str] | None = None,
        prefetch: bool = False,
    ) -> Pipeline:
        """The build in `folder` (already matched), with the weights of `weights` (and LoRAs,
        as in `load`; `placed`, `placement` and `prefetch`: as in `assemble`, `placement` over
        the manifest's), signed by one of `trusted`, if any."""
        start = time.perf_counter()
        opened = open_build(folder, manifest, jax.devices(), trusted)
        read = time.perf_counter()
        _check_placement(folder.name, manifest, placement or {})
        chosen = {**manifest.placement, **(placement or {})}
        # XLA deserializes the executables while the weights are placed in the shardings their
        # headers declare (checked against XLA's as each loads).
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            loading = pool.submit(opened.load)
            pipe = cls.assemble(
                opened.declared, weights, manifest.key, folder.name, config, loras, loras_2,
                placed, chosen, prefetch,
            )  # fmt: skip
            placed_at = time.perf_counter()
            pipe.exe = loading.result()
        pipe.predicted_peak = manifest.resident_peak(chosen)
        # Wall time in turn: the executables' reads and checks, and any wait for XLA after the
        # weights were placed; the weights, XLA deserializing beside them.
        pipe.load_phases = {
            "deserialize": round(read - start + time.perf_counter() - placed_at, 4),
            "weights": round(placed_at - read, 4),
        }
        return pipe

    @classmethod
    def assemble(
        cls,
        executables: dict[str, Any],
        weights: str | Path,
        key: BuildKey,
        name: str,
        config: ModelConfig | None = None,
        loras: LoraSpecs = (),
        loras_2: LoraSpecs = (),
        placed: PlacedWeights | None = None,
        placement: Mapping[str, str] | None = None,
        prefetch: bool = False,
    ) -> Pipeline:
        """Place the weights of `weights` straight into the executables' input shardings (only
        what each takes is read of `executables`: their `DeclaredCall`s serve while they load),
        merging the LoRAs into the transformers on the way (all checked before any weight is
        read). `placed`: the weights other builds placed with the same weights and LoRAs; a
        component found there in the same shardings is reused, the others are added to it.
        `placement` (wan.residency; default: all resident): a transient component is placed
        before its program and deleted after; with `prefetch`, those the first program takes
        are placed now beside the others (`runtime run`: their transfer overlaps the rest of
        the load; the others would outgrow the build's predicted peak)."""
        config = config or ModelConfig.from_folder(weights)
        lora.check_experts(config.num_experts, loras_2)
        abstracts = _component_abstracts(executables, key, config.num_experts)
        deltas, applied = {}, []
        for component, specs in (("transformer", loras), ("transformer_2", loras_2)):
            if specs:
                shapes = {p: a.shape for p, a in flatten(abstracts[component]).items()}
                deltas[component], summary = lora.prepare(
                    specs, shapes, component, kind=config.transformer.kind
                )
                applied += summary
        placed = {} if placed is None else placed
        keys = {c: _placement(c, a) for c, a in abstracts.items()}
        placement = placement or {}
        # A transient component is read from the weights again each time it is placed (on the
        # v5e host the 1.3B's text encoder took 11.6-14.3 s: bench/chip_profile.py).
        transient = {
            c: functools.partial(checkpoint.load_component, weights, c, a, deltas.get(c))
            for c, a in abstracts.items()
            if placement.get(c, residency.RESIDENT) == residency.TRANSIENT
        }
        resident = [c for c in abstracts if c not in transient and keys[c] not in placed]
        # The components load at once (reads and copies release the GIL), the tokenizer with them.
        with concurrent.futures.ThreadPoolExecutor(len(abstracts) + 1) as pool:
            tok = pool.submit(tokenizer.load_tokenizer, Path(weights) / "tokenizer")
            loads = {
                c: pool.submit(checkpoint.load_component, weights, c, abstracts[c], deltas.get(c))
                for c in resident
            }
            first = residency.taken_by(key.programs[0], list(transient)) if prefetch else ()
            early = {c: pool.submit(transient[c]) for c in first}
            placed.update({keys[c]: load.result() for c, load in loads.items()})
            params = {c: placed[keys[c]] for c in abstracts if c not in transient}
            params.update({c: load.result() for c, load in early.items()})
            tok = tok.result()
        pipe = cls(executables, params, config, tok, key, name, applied, transient)
        if "image_encode" in key.programs:
            pipe.clip = _clip_processor(weights, config.image_encoder.image_size)
        return pipe

    def input_sharding(self, program: str, name: str) -> Any:
        return interface.named(program, self.exe[program].input_shardings[0])[name]

    def run(self, program: str, **inputs: Any) -> dict[str, Any]:
        """`program` on `inputs` (by name), its outputs by name."""
        return self.exe[program](*interface.positional(program, inputs))

    # Longer than most: a generation's phases in the order they run, each timed.
    def generate(
        self,
        prompt: str | list[str],
        negative_prompt: str | list[str] = "",
        *,
        steps: int = 50,
        guidance: float = 5.0,
        guidance_2: float | None = None,
        seed: int | Sequence[int] = 0,
        init_noise: np.ndarray | None = None,
        on_step: Callable[[int, int], None] | None = None,
        sampler: str | None = None,
        shift: float | None = None,
        cache: CacheRequest | None = None,
        images: PILImage | Sequence[PILImage] | None = None,
        last_images: PILImage | Sequence[PILImage | None] | None = None,
    ) -> tuple[np.ndarray, GenerationReport]:
        """uint8 frames (B, F, H, W, 3). `init_noise` in the diffusers layout (B, C, T, h, w);
        else the noise of the whole batch from `seed`, or with one seed per video (a list), each
        video's from its own (video i then equals a batch-1 generation with seed[i]).
        `images`: an image-to-video build's first frames (RGB images, `runtime.generation.images`), one
        for the whole batch or one per video; `last_images` their last frames, where the model
        takes them (`ModelConfig.takes_last_image`; None for a video without one).

        `sampler` (wan.configs.SAMPLERS) and the flow `shift` default to the model's scheduler;
        both only change the host-side step tables, so any build serves any choice (the
        solver order, which sizes the sampler state, is the build's). `cache`: step caching
        (a build with `--step-cache`); its report is the report's `cache`."""
        started_at, start = time.time(), time.perf_counter()
        if self.key.option("continuous"):
            raise RequestError(
                f"build {self.name} is a continuous build (aot build --continuous), which "
                "`runtime serve` runs: for `runtime run`, build without --continuous"
            )
        check_settings(guidance, guidance_2, shift)
        pictures = self._images(images)
        lasts = self._last_images(last_images, pictures)
        cache = resolve(
            self.key, cache, self.config.num_experts, model_spec(self.config, self.key.model)
        )
        texts = self.texts(prompt, negative_prompt)
        step = self.key.step_program
        latent_shape = tuple(interface.named(step, self.exe[step].args_info[0])["latents"].shape)
        latents = _initial_latents(latent_shape, seed, init_noise)
        scheduler = self.scheduler(sampler, shift)
        tables = schedulers.make_tables(scheduler, steps)
        state = schedulers.init_state(scheduler, latent_shape)
        experts, expert_at = self.experts(tables, guidance, guidance_2)
        step_experts = [expert_at(i)[0] for i in range(steps)]
        step_cache = StepCache(cache, step, step_experts, self.config.transformer.num_layers)
        sparse = sparse_attention.parse(self.key.option("sparse_attention"))
        denoiser = Denoiser(self.run, self.exe, step_cache, self.key.cfg, sparse)
        marks = {}  # phase -> seconds from start to its end
        with no_compilation() as counter:
            emb = self.encode(texts)
            marks["text_encode"] = time.perf_counter() - start
            conditioning = {}
            if pictures is not None:
                conditioning = self.image_conditioning(pictures, lasts)
                marks["image_encode"] = time.perf_counter() - start
            try:
                kv = self.kv_caches(emb, experts, conditioning)
                del emb, conditioning  # each program's inputs only (wan.residency's peak)
                marks["kv_cache"] = time.perf_counter() - start
                x = self._denoise(latents, state, tables, kv, expert_at, on_step, denoiser)
            finally:  # a transient transformer leaves before the decode, or a failed step
                self.release(*experts)
            del kv
            marks["denoise"] = time.perf_counter() - start
            frames = self._decode(x)
            marks["vae_decode"] = time.perf_counter() - start
        report = self._report(counter.count, started_at, marks, steps, scheduler)
        outcome = None if sparse is None else SparseOutcome(sparse.text(), denoiser.dense_steps)
        return frames, dataclasses.replace(
            report,
            cache=step_cache.outcome(steps),
            sparse_attention=outcome,
            memory=self.memory_outcome(),
            step_seconds=denoiser.step_seconds,
        )

    def memory_outcome(self) -> MemoryOutcome:
        stats = jax.local_devices()[0].memory_stats() or {}
        placement = {
            c: residency.TRANSIENT if c in self.transient else residency.RESIDENT
            for c in interface.components(self.config.num_experts, self.key.programs)
        }
        return MemoryOutcome(
            placement, *self.predicted_peak, stats.get("peak_bytes_in_use"),
            stats.get("bytes_limit"),
        )  # fmt: skip

    def _report(
        self,
        compile_count: int,
        started_at: float,
        marks: dict[str, float],
        steps: int,
        scheduler: SchedulerConfig,
    ) -> GenerationReport:
        """The report of one generate() from the end of each phase (seconds after its start)."""
        first_step, total = marks["kv_cache"], marks["vae_decode"]
        denoise = marks["denoise"] - first_step
        phases, begin = {}, 0.0
        for name, end in marks.items():
            phases[name], begin = round(end - begin, 4), end
        process_start = clock.process_start_time()
        return GenerationReport(
            compile_count=compile_count,
            started_at=started_at,
            seconds_to_first_step=round(first_step, 4),
            seconds_denoising=round(denoise, 4),
            seconds_total=round(total, 4),
            steps=steps,
            steps_per_second=round(steps / max(denoise, 1e-9), 4),
            build=self.name,
            seconds_from_process_start_to_first_step=round(
                started_at + first_step - process_start, 4
            ),
            seconds_from_process_start_to_video=round(started_at + total - process_start, 4),
            phases={**self.load_phases, **phases},
            sampler=scheduler.kind,
            shift=scheduler.flow_shift,
            loras=list(self.loras),
            cache=CacheOutcome(None, {}, [], 0, 0),
        )

    def scheduler(self, sampler: str | None, shift: float | None) -> SchedulerConfig:
        """The model's scheduler with a request's sampler and flow shift (None: the model's)."""
        return dataclasses.replace(
            self.config.scheduler,
            kind=sampler or self.config.scheduler.kind,
            flow_shift=self.config.scheduler.flow_shift if shift is None else shift,
        )

    def experts(
        self, tables: Any, guidance: float, guidance_2: float | None
    ) -> tuple[list[str], Callable[[int], tuple[str, float]]]:
        """The transformers in use, and for step i the one that runs it with its guidance
        scale: Wan 2.2's high-noise expert (`transformer`) down to the boundary timestep, then
        `transformer_2` (with `guidance_2` when given)."""
        ratio = self.config.boundary_ratio
        boundary = None if ratio is None else ratio * self.config.scheduler.num_train_timesteps

        def expert_at(i: int) -> tuple[str, float]:
            high_noise = boundary is None or float(tables.timesteps[i]) >= boundary
            scale = guidance if high_noise or guidance_2 is None else guidance_2
            return ("transformer" if high_noise else "transformer_2"), scale

        return ["transformer"] + (["transformer_2"] if boundary is not None else []), expert_at

    def texts(self, prompt: str | list[str], negative_prompt: str | list[str]) -> list[str]:
        """The texts to encode, in the step's batch layout: with CFG, prompt i then its
        negative (cond_i, uncond_i)."""
        batch = self.key.batch
        prompts = [prompt] * batch if isinstance(prompt, str) else list(prompt)
        negatives = (
            [negative_prompt] * batch if isinstance(negative_prompt, str) else list(negative_prompt)
        )
        if len(prompts) != batch or len(negatives) != batch:
            raise RequestError(f"this build generates batches of {batch} prompts")
        for text in prompts + negatives:
            check_text("a prompt", text)
        pairs = zip(prompts, negatives, strict=True)
        return [t for pair in pairs for t in pair] if self.key.cfg else prompts

    def encode(self, texts: list[str]) -> jax.Array:
        """Prompt embeddings, laid out as kv_cache takes them."""
        ids, mask = tokenizer.tokenize(self.tokenizer, texts, self.config.text_encoder.max_length)
        emb = self.run(
            "text_encode",
            params=self.weights("text_encoder"),
            ids=place(ids, self.input_sharding("text_encode", "ids")),
            mask=place(mask, self.input_sharding("text_encode", "mask")),
        )["embeddings"]
        emb = jax.block_until_ready(emb)
        self.release("text_encoder")
        return handoff(emb, self.input_sharding(self.kv_program, "embeddings"))

    def _images(self, given: PILImage | Sequence[PILImage] | None) -> list[PILImage] | None:
        """One image per video of the batch, checked against the build's pipeline."""
        check_image(self.key.programs, self.name, given is not None)
        if given is None:
            return None
        batch = self.key.batch
        pictures = [given] * batch if isinstance(given, PILImage) else list(given)
        if len(pictures) != batch:
            raise RequestError(f"this build generates batches of {batch} videos, one image each")
        return pictures

    def _last_images(
        self, given: PILImage | Sequence[PILImage | None] | None, pictures: list | None
    ) -> list[PILImage | None]:
        """One last frame (or None) per video of the batch, where the model takes them."""
        if given is None:
            lasts = [None] * self.key.batch
        elif pictures is None or not self.config.takes_last_image:
            raise RequestError(
                f"build {self.name} takes no last image (first-last-frame: Wan 2.2 I2V-A14B, "
                "Wan 2.1 FLF2V)"
            )
        else:
            lasts = [given] * self.key.batch if isinstance(given, PILImage) else list(given)
        if len(lasts) != self.key.batch:
            raise RequestError(f"this build generates batches of {self.key.batch} videos")
        if self.config.needs_last_image and None in lasts:
            raise RequestError(
                f"build {self.name} is first-last-frame (Wan 2.1 FLF2V): give every video a "
                "last image (--last-image FILE, `last_images=`)"
            )
        return lasts

    def image_conditioning(
        self, pictures: list[PILImage], lasts: list[PILImage | None]
    ) -> dict[str, Any]:
        """image_kv_cache's image inputs: the images' VAE condition (with the last frames
        given) and (a model with an image encoder) their CLIP features, each on the devices as
        that program takes it."""
        width, height = self.key.width, self.key.height
        pixels = np.stack([images.condition_pixels(p, width, height) for p in pictures])
        last = np.stack([
            np.zeros_like(pixels[0]) if p is None else images.condition_pixels(p, width, height)
            for p in lasts
        ])  # fmt: skip
        condition = self.run(
            "vae_encode",
            params=self.weights("vae_encoder"),
            image=place(pixels, self.input_sharding("vae_encode", "image")),
            last_image=place(last, self.input_sharding("vae_encode", "last_image")),
            has_last=place(
                np.array([p is not None for p in lasts]),
                self.input_sharding("vae_encode", "has_last"),
            ),
        )["condition"]
        features = None
        if self.clip is not None:
            # Each video's images through CLIP: its first, and the last where the model's
            # features are both's (`ModelConfig.clip_images`).
            clip = np.stack([
                [images.clip_pixels(p, self.clip) for p in (first, last)[: self.config.clip_images]]
                for first, last in zip(pictures, lasts, strict=True)
            ])  # fmt: skip
            features = self.run(
                "image_encode",
                params=self.weights("image_encoder"),
                pixels=place(clip, self.input_sharding("image_encode", "pixels")),
            )["image_embeddings"]
            features = handoff(features, self.input_sharding(self.kv_program, "image_embeddings"))
        conditioning = jax.block_until_ready({"image_embeddings": features, "condition": condition})
        self.release("image_encoder", "vae_encoder")
        return conditioning

    def kv_caches(
        self, emb: jax.Array, experts: list[str], conditioning: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """What every step reads, per expert: every layer's cross-attention keys and values
        (and an image-to-video build's condition, from `conditioning`)."""
        inputs = {"embeddings": emb, **(conditioning or {})}
        return jax.block_until_ready(
            {e: self.run(self.kv_program, params=self.weights(e), **inputs)["kv"] for e in experts}
        )

    def _denoise(
        self,
        latents: np.ndarray,
        state: schedulers.SamplerState,
        tables: schedulers.SamplerTables,
        kv: dict[str, Any],
        expert_at: Callable[[int], tuple[str, float]],
        on_step: Callable[[int, int], None] | None,
        denoiser: Denoiser,
    ) -> jax.Array:
        """The latents after every step; `expert_at(i)`: step i's transformer and guidance."""
        step_in = denoiser.inputs
        out = {
            "latents": place(latents, step_in["latents"]),
            "state": {
                name: place(getattr(state, name), step_in["state"][name])
                for name in ("last_sample", "x0_history")
            },
        }
        steps = tables.num_steps
        for i in range(steps):
            began = time.perf_counter()
            expert, scale = expert_at(i)
            out = denoiser.step(
                i,
                expert,
                dict(
                    params=self.weights(expert),
                    latents=out["latents"],
                    kv=jax.tree.map(handoff, kv[expert], step_in["kv"]),
                    row={k: place(v, step_in["row"][k]) for k, v in tables.row(i).items()},
                    state=out["state"],
                    guidance=place(np.float32(scale), step_in["guidance"]),
                ),
            )
            # Waiting for each step costs little next to a step (dispatch overlaps the next
            # step's host work only), and it lets a NaN be named by the step that made it.
            if not _all_finite(out["latents"]):
                raise NonFiniteError(
                    f"the latents became NaN or Inf at step {i + 1} of {steps}: check the LoRA "
                    "scales, the guidance, the initial noise and the weights"
                )
            denoiser.step_seconds.append(round(time.perf_counter() - began, 4))
            if on_step is not None:
                on_step(i + 1, steps)
        return out["latents"]

    def _decode(self, latents: jax.Array) -> np.ndarray:
        """uint8 frames on the host (replicated in multi-process builds: local data)."""
        x = handoff(latents, self.input_sharding("latents_handoff", "latents"))
        x = handoff(
            self.run("latents_handoff", latents=x)["latents"],
            self.input_sharding("vae_decode", "latents"),
        )
        frames = np.asarray(self.run("vae_decode", params=self.weights("vae"), latents=x)["frames"])
        self.release("vae")
        return frames


def _check_placement(name: str, manifest: Manifest, placement: Mapping[str, str]) -> None:
    """A placement override of the build's own components, transient only where they may be."""
    for component, where in placement.items():
        if component not in manifest.weight_bytes:
            raise RequestError(
                f"--placement {component}={where}: build {name} has no {component} (its "
                f"components: {', '.join(manifest.weight_bytes)})"
            )
    programs, components = manifest.key.programs, manifest.weight_bytes
    if fixed := residency.unmovable(programs, components, placement):
        raise RequestError(
            f"--placement {fixed[0]}=transient: build {name} keeps its {fixed[0]} resident (its "
            f"components that can be transient: {', '.join(residency.movable(programs, components))})"
        )


def _clip_processor(weights: str | Path, size: int) -> images.ClipProcessor:
    """The image processor of a weights folder (a diffusers folder's `image_processor`), else
    OpenAI CLIP's at the image encoder's size; its crop must be the encoder's input."""
    if (Path(weights) / "image_processor").is_dir():
        processor = images.ClipProcessor.read(weights)
    else:
        processor = images.ClipProcessor(shortest_edge=size, crop_height=size, crop_width=size)
    if (processor.crop_height, processor.crop_width) != (size, size):
        raise InputError(
            f"{weights}: the image processor crops {processor.crop_width}x"
            f"{processor.crop_height}, the image encoder takes {size}x{size}: restore the "
            "model's original image_processor/preprocessor_config.json"
        )
    return processor


def _component_abstracts(
    executables: dict[str, Any], key: BuildKey, num_experts: int
) -> dict[str, Any]:
    """Each component's parameters as the first program taking them wants them (shapes,
    dtypes, shardings): the build gives every program of a component the same shardings."""
    abstracts = {}
    for component in interface.components(num_experts, key.programs):
        program = interface.first_program_taking(component, key.programs)
        info, shardings = (
            interface.named(program, inputs)["params"]
            for inputs in (
                executables[program].args_info[0],
                executables[program].input_shardings[0],
            )
        )
        abstracts[component] = _abstract(info, shardings)
    return abstracts


def _placement(component: str, abstract: Any) -> tuple[Any, ...]:
    """What makes two builds' weights of `component` the same arrays: every tensor's shape,
    dtype and sharding."""
    leaves = sorted(flatten(abstract).items())
    return (component, *((p, a.shape, a.dtype, a.sharding) for p, a in leaves))


def _initial_latents(
    shape: tuple[int, ...], seed: int | Sequence[int], init_noise: np.ndarray | None
) -> np.ndarray:
    """The batch's first latents: as `initial_latents` for one seed, else each video's from
    its own seed as in a batch of one."""
    if isinstance(seed, int):
        return initial_latents(shape, seed, init_noise)
    if init_noise is not None or len(seed) != shape[0]:
        raise RequestError(
            f"this build generates batches of {shape[0]}: give {shape[0]} seeds and no init noise"
        )
    return np.concatenate([initial_latents((1, *shape[1:]), s, None) for s in seed])


def _all_finite(x: jax.Array) -> bool:
    """Whether `x` holds no NaN or Inf, read on the host: a device-to-host copy of each of this
    process's shards (once per replica group), since a jnp reduction would compile."""
    return all(
        np.isfinite(np.asarray(shard.data)).all()
        for shard in x.addressable_shards
        if shard.replica_id == 0
    )
