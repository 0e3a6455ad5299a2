"""`runtime run`: generate videos from prebuilt executables, compiling nothing.

The build is matched from manifests (plain JSON) before jax is imported, so the process can be
arranged for it (host device count for cpu-N builds); then the Pipeline API does the work.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import click
import numpy as np
from tqdm import tqdm

from runtime.builds.artifact import ArtifactError, Manifest
from runtime.builds.loader import Present, Request, match_build, verify_signed
from runtime.cli import options as cli_options
from runtime.cli.args import TRUSTED_KEY, CliError, parse_resolution
from runtime.generation import clock, images, step_cache
from runtime.generation.batching import PromptLine, Settings, generate_batch, read_prompts_file
from runtime.generation.outputs import (
    OutputError,
    Writer,
    check_not_inputs,
    check_outputs,
    npy_path,
    write_files,
    write_npy,
    write_videos,
)
from runtime.generation.request import MAX_SEED, check_image, latent_shape, read_init_noise
from runtime.generation.step_cache import CacheRequest, write_mag_ratios
from runtime.generation.video import video_paths
from runtime.trust.signing import TrustedKey
from wan import interface
from wan.configs import SAMPLERS, ModelConfig, VideoShape
from wan.presets import model_spec


@click.command("run")
@cli_options.ARTIFACTS
@cli_options.WEIGHTS
@click.option("--prompt", callback=cli_options.utf8_text, help="The prompt (or --prompts).")
@click.option(
    "--prompts",
    "prompts_file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Offline batches: a JSON Lines file, one video a line: prompt, out (a path inside the "
    "file's folder, or --out-dir), optionally negative_prompt and seed (default --seed); the "
    "lines fill the build's batches, one load for the whole file.",
)
@click.option(
    "--out-dir",
    type=click.Path(path_type=Path, file_okay=False),
    help="With --prompts: the folder the lines' `out` paths are in (default: the file's folder).",
)
@click.option("--negative-prompt", default="", show_default=True, callback=cli_options.utf8_text)
@click.option("--res", "resolution", required=True, help="WxH, e.g. 720x1280 (portrait).")
@click.option("--frames", required=True, type=click.IntRange(min=1))
@click.option("--batch", default=1, show_default=True, type=click.IntRange(min=1))
@click.option("--steps", default=50, show_default=True, type=click.IntRange(min=1))
@click.option(
    "--guidance",
    default=5.0,
    show_default=True,
    type=float,
    callback=cli_options.finite,
    help="CFG scale (> 1 uses a CFG build).",
)
@click.option(
    "--guidance-2",
    default=None,
    type=float,
    callback=cli_options.finite,
    help="Two-expert models: scale for the low-noise expert.",
)
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, MAX_SEED))
@click.option(
    "--sampler",
    type=click.Choice(SAMPLERS),
    help="Sampler (default: the model's scheduler); a host-side table, any build serves it.",
)
@click.option(
    "--shift",
    type=click.FloatRange(min=0, min_open=True),
    callback=cli_options.finite,
    help="Flow-matching timestep shift (default: the model's scheduler's).",
)
@cli_options.LORA
@TRUSTED_KEY
@click.option(
    "--lora-2",
    "lora_2_args",
    multiple=True,
    metavar="FILE[:SCALE]",
    help="Two-expert models: a LoRA for the low-noise expert (transformer_2).",
)
@click.option(
    "--image",
    "image_path",
    type=click.Path(path_type=Path),
    help="Image to video: the first frame (PNG, JPEG or WebP; EXIF rotation applied, cropped "
    "to the build's aspect ratio and resized to its size, as runtime.generation.images says).",
)
@click.option(
    "--last-image",
    "last_image_path",
    type=click.Path(path_type=Path),
    help="First-last-frame (Wan 2.2 I2V-A14B): the video's last frame, prepared as --image.",
)
@click.option(
    "--init-noise",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    help="Latents (B, C, T, H/8, W/8) float32 .npy.",
)
@click.option(
    "--save-frames",
    type=click.Path(path_type=Path),
    help="Also write the uint8 frames (B, F, H, W, 3) as .npy (.npy is appended unless given): "
    "the video without the codec's loss, for quality metrics (PSNR, FVD) and comparisons.",
)
@click.option(
    "--report", "report_path", type=click.Path(path_type=Path), help="Write a JSON report."
)
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    help="Output .mp4 (stem_i.mp4 for a batch; required with --prompt). Existing outputs are "
    "replaced, once all the new ones are complete; missing folders are made.",
)
@click.option(
    "--build",
    "build_name",
    help="The build folder to use when several in --artifacts serve the request.",
)
@cli_options.cache_options
@cli_options.PLACEMENT
@click.option(
    "--calibrate-mag-ratios",
    "calibrate_path",
    type=click.Path(path_type=Path),
    help="MagCache: skip nothing and write this model's ratios to this JSON file.",
)
@cli_options.job_options
# Longer than most: the command in order, each check before the load it protects.
def run_cmd(
    artifacts, weights, prompt, prompts_file, out_dir, negative_prompt, resolution, frames, batch,
    steps, guidance,
    guidance_2, seed, sampler, shift, lora_args, lora_2_args, image_path, last_image_path,
    init_noise, save_frames, report_path,
    out, build_name, cache, cache_threshold, cache_max_skip, cache_retention, mag_ratios,
    placement, calibrate_path, coordinator, num_processes, process_id, join_timeout, trusted_keys,
) -> None:  # fmt: skip
    """Generate a video with the build that matches --res/--frames/--batch.

    Under jax.distributed (one process per host, same arguments but --process-id) every
    process loads the same build and runs it SPMD; process 0 writes the files."""
    width, height = parse_resolution(resolution)
    _check_arguments(weights, coordinator, num_processes, process_id)
    lines = _prompt_lines(
        prompt, prompts_file, out_dir, out, seed, save_frames, init_noise, calibrate_path
    )
    outputs = (
        _outputs(out, batch, save_frames, report_path, calibrate_path)
        if lines is None
        else [(line.out, "a --prompts line's out") for line in lines]
        + ([] if report_path is None else [(report_path, "--report")])
    )
    _check_outputs(outputs)
    # Imported once the paths are known good: wan.lora brings ml_dtypes (a second or more).
    from runtime.trust import signing
    from wan import lora

    trusted = signing.load_trusted_keys(trusted_keys)
    loras, loras_2 = (
        cli_options.loras(lora_args, "--lora"),
        cli_options.loras(lora_2_args, "--lora-2"),
    )
    inputs = [(weights, "--weights"), (artifacts, "--artifacts"), (prompts_file, "--prompts"),
              (init_noise, "--init-noise"), (mag_ratios, "--mag-ratios"), (image_path, "--image"),
              (last_image_path, "--last-image"),
              *((path, "--lora") for path, _ in loras),
              *((path, "--lora-2") for path, _ in loras_2),
              *(given for line in lines or () for given in line.inputs())]  # fmt: skip
    check_not_inputs(outputs, [(path, option) for path, option in inputs if path is not None])
    if lines is not None and (image_path or last_image_path):
        raise CliError(
            "--image and --last-image are for --prompt; a --prompts line gives its own "
            '("image", "last_image")'
        )
    if last_image_path is not None and image_path is None:
        raise CliError("--last-image goes with --image (the first frame)")
    image, last_image = (
        None if path is None else images.read_image(path, what=option)
        for path, option in ((image_path, "--image"), (last_image_path, "--last-image"))
    )
    try:
        config = ModelConfig.from_folder(weights)
        request = Request(VideoShape(width, height, frames, batch, guidance > 1.0), config.hash())
        lora.check_experts(config.num_experts, loras_2)
        cache_request = step_cache.from_options(
            cache, cache_threshold, cache_max_skip, cache_retention, mag_ratios,
            calibrate_path is not None, config.num_experts,
        )  # fmt: skip
    except (ValueError, OSError) as e:  # LoraError is a ValueError
        raise CliError(str(e)) from None

    if last_image is not None and not config.takes_last_image:
        raise CliError(
            f"--last-image: {model_spec(config, weights)} takes the first frame only "
            "(first-last-frame: Wan 2.2 I2V-A14B, Wan 2.1 FLF2V)"
        )
    given_last = [last_image] if lines is None else [line.video.last_image for line in lines]
    if config.needs_last_image and None in given_last:
        raise CliError(
            f"{model_spec(config, weights)} is first-last-frame (Wan 2.1 FLF2V): give each "
            'video a last image (--last-image FILE, a --prompts line\'s "last_image")'
        )
    match = _matcher(artifacts, request, config, weights, build_name, (loras, loras_2), trusted)
    ready = time.time()
    folder, manifest = cli_options.start(
        match, coordinator, num_processes, process_id, join_timeout
    )
    cache_request = step_cache.resolve(
        manifest.key, cache_request, config.num_experts, model_spec(config, weights), artifacts
    )
    if lines is None:
        check_image(manifest.key.programs, folder.name, image is not None)
    for picture, option in ((image, "--image"), (last_image, "--last-image")):
        if picture is not None:  # an aspect ratio the build cannot take, before the load
            images.check_fit(picture, width, height, what=option)
    from runtime.generation.pipeline import Pipeline
    from wan.tokenizer import TokenizerError
    from wan.weights import WeightError

    # Before the load: the process's start and checks, then jax's devices and the match.
    started = {
        "imports": round(ready - clock.process_start_time(), 4),
        "devices": round(time.time() - ready, 4),
    }
    try:
        noise = read_init_noise(init_noise, latent_shape(manifest)) if init_noise else None
        pipe = Pipeline.from_build(
            folder, manifest, weights, config, loras, loras_2, None, trusted, placement,
            prefetch=True,
        )  # fmt: skip
        if lines is not None:
            settings = Settings(steps, guidance, guidance_2, sampler, shift)
            return _run_prompts(pipe, lines, settings, cache_request, report_path)
        with _step_bar(steps) as on_step:
            videos, report = pipe.generate(
                prompt, negative_prompt, steps=steps, guidance=guidance, guidance_2=guidance_2,
                seed=seed, init_noise=noise, on_step=on_step, sampler=sampler, shift=shift,
                cache=cache_request, images=image, last_images=last_image,
            )  # fmt: skip
    except (ArtifactError, lora.LoraError, WeightError, TokenizerError, ValueError, OSError) as e:
        raise CliError(str(e)) from None
    import jax

    if jax.process_index() == 0:
        _write(videos, report, started, out, save_frames, report_path, calibrate_path, config.fps)


def _matcher(
    artifacts: Path,
    request: Request,
    config: ModelConfig,
    weights: Path,
    build_name: str | None,
    lora_specs: tuple[list, list],
    trusted: Sequence[TrustedKey],
) -> Callable[[Present], tuple[Path, Manifest]]:
    """Present devices -> the build, signed by one of `trusted` (if any), and the LoRAs checked
    against its transformer's shapes: a build or LoRA that does not do fails before anything
    loads."""
    from wan import lora

    def match(present: Present) -> tuple[Path, Manifest]:
        try:
            found = match_build(
                artifacts, request, model_spec(config, weights), present, build_name
            )
            verify_signed(*found, trusted)
            for specs in lora_specs:
                transformer = interface.first_program_taking("transformer", found[1].key.programs)
                lora.check(
                    specs, found[1].parameter_shapes(transformer), kind=config.transformer.kind
                )
            return found
        except (ArtifactError, lora.LoraError, OSError) as e:
            raise CliError(str(e)) from None

    return match


def _prompt_lines(
    prompt: str | None,
    prompts_file: Path | None,
    out_dir: Path | None,
    out: Path | None,
    seed: int,
    *single_only: Path | None,
) -> list[PromptLine] | None:
    """The lines of --prompts (None for a single --prompt run), with the options checked: one of
    --prompt and --prompts; --out, --save-frames, --init-noise and --calibrate-mag-ratios are a
    single run's, --out-dir is --prompts'."""
    if (prompt is None) == (prompts_file is None):
        raise click.UsageError("give --prompt TEXT or --prompts FILE.jsonl (one of them)")
    if prompts_file is None:
        if out is None:
            raise click.UsageError("--prompt needs --out FILE.mp4")
        if out_dir is not None:
            raise click.UsageError("--out-dir is for --prompts: give --out FILE.mp4 alone")
        return None
    if out is not None or any(single_only):
        raise click.UsageError(
            "--prompts writes each line's `out`: leave out --out, --save-frames, --init-noise "
            "and --calibrate-mag-ratios"
        )
    return read_prompts_file(prompts_file, seed, out_dir)


def _run_prompts(
    pipe: Any,
    lines: list[PromptLine],
    settings: Settings,
    cache: CacheRequest | None,
    report_path: Path | None,
) -> None:
    """Every line of a --prompts file, the build's batch at a time from one loaded pipeline
    (the last batch's empty slots filled and discarded); each batch's videos are written
    (process 0) before the next batch runs."""
    import jax

    batch = pipe.key.batch
    chunks = [lines[i : i + batch] for i in range(0, len(lines), batch)]
    reports = []
    for number, chunk in enumerate(chunks, 1):
        with _step_bar(settings.steps) as on_step:
            videos, report = generate_batch(
                pipe, [line.video for line in chunk], settings, on_step, cache
            )
        reports.append(dataclasses.asdict(report))
        if jax.process_index() != 0:
            continue
        write_videos(videos, [line.out for line in chunk], pipe.config.fps)
        click.echo(f"batch {number}/{len(chunks)}: wrote {', '.join(str(x.out) for x in chunk)}")
    compiles = sum(r["compile_count"] for r in reports)
    if jax.process_index() == 0 and report_path is not None:
        summary = {"loads": 1, "videos": len(lines), "batch": batch, "batches": reports}
        write_files({report_path: lambda path: path.write_text(json.dumps(summary, indent=1))})
    click.echo(
        f"wrote {len(lines)} videos in {len(chunks)} batches of {batch} with one load "
        f"({compiles} compilations, build {pipe.name})"
    )


@contextlib.contextmanager
def _step_bar(steps: int) -> Iterator[Callable[[int, int], None]]:
    """A progress bar of the denoising steps, and the on_step callback that advances it."""
    with tqdm(total=steps, desc="denoising", unit="step", file=sys.stderr) as bar:

        def on_step(done: int, total: int) -> None:
            bar.update(1)
            if done == total:
                bar.close()  # before the decode, so the bar shows the denoising rate

        yield on_step


def _check_arguments(
    weights: Path, coordinator: str | None, num_processes: int, process_id: int
) -> None:
    if not weights.is_dir():
        raise CliError(
            f"--weights {weights} is not a folder (a diffusers-format folder or a checkpoint)"
        )
    cli_options.check_job(coordinator, num_processes, process_id)


def _outputs(
    out: Path,
    batch: int,
    save_frames: Path | None,
    report_path: Path | None,
    calibrate_path: Path | None,
) -> list[tuple[Path, str]]:
    """Every file the run writes, with its option: the videos, the frames' .npy, the report,
    the calibrated MagCache ratios."""
    outputs = [(p, "--out") for p in video_paths(out, batch)]
    if save_frames is not None:
        outputs.append((npy_path(save_frames), "--save-frames"))
    if report_path is not None:
        outputs.append((report_path, "--report"))
    if calibrate_path is not None:
        outputs.append((calibrate_path, "--calibrate-mag-ratios"))
    return outputs


def _check_outputs(outputs: list[tuple[Path, str]]) -> None:
    """Every path the run will write can be written, and each is its own file, before anything
    loads."""
    try:
        check_outputs(outputs)
    except (OutputError, OSError) as e:
        raise CliError(str(e)) from None


def _write(
    videos: np.ndarray,
    report: Any,
    started: dict[str, float],
    out: Path,
    save_frames: Path | None,
    report_path: Path | None,
    calibrate_path: Path | None,
    fps: int,
) -> None:
    """The videos at the model's frame rate, the frames, the calibrated ratios and the report
    (the write and the whole run timed as it is written): all staged and then renamed into place
    together, or none of them on a failure (runtime.generation.outputs.write_videos)."""
    written = time.time()
    video_files = video_paths(out, len(videos))

    def write_report(path: Path) -> None:
        now = time.time()
        timed = dataclasses.replace(
            report,
            seconds_from_process_start_to_video=round(now - clock.process_start_time(), 4),
            phases={
                **started,
                **report.phases,
                "write": round(now - written, 4),
            },
        )
        path.write_text(json.dumps(dataclasses.asdict(timed), indent=1))

    extra: dict[Path, Writer] = {}
    if save_frames:
        extra[npy_path(save_frames)] = functools.partial(write_npy, array=videos)
    if calibrate_path:
        extra[calibrate_path] = functools.partial(write_mag_ratios, ratios=report.cache.mag_ratios)
    if report_path:
        extra[report_path] = write_report
    write_videos(videos, video_files, fps, extra)
    loras_note = f", {len(report.loras)} LoRA(s)" if report.loras else ""
    click.echo(
        f"wrote {', '.join(map(str, video_files))} ({report.steps} steps, "
        f"{report.steps_per_second:.2f} it/s, {report.compile_count} compilations{loras_note}, "
        f"build {report.build})"
    )
