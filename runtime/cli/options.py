"""What `runtime run` and `runtime serve` share: their common options (the artifacts, the
weights, step caching), the checks of their values before anything loads, and how a command
starts jax for the build it serves."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from runtime.builds import processes
from runtime.builds.artifact import Manifest
from runtime.builds.loader import Present
from runtime.cli.args import CliError
from runtime.generation.request import check_finite, check_text
from runtime.generation.step_cache import KINDS, MagCacheSettings
from wan import residency


def utf8_text(ctx: click.Context, param: click.Parameter, text: str | None) -> str | None:
    if text is not None:
        check_text(param.opts[0], text)
    return text


def finite(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    check_finite(param.opts[0], value)
    return value


class Seconds(click.FloatRange):
    """A number of seconds from `min` to `max`; NaN is refused too (click's FloatRange lets it
    through, and a NaN window or timeout never ends)."""

    name = "seconds"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        seconds = super().convert(value, param, ctx)
        if math.isnan(seconds):
            self.fail(f"{value!r} is not a number: give seconds from {self.min} to {self.max}")
        return seconds


ARTIFACTS = click.option(
    "--artifacts", type=click.Path(path_type=Path), default=Path("artifacts"), show_default=True
)


WEIGHTS = click.option(
    "--weights",
    type=click.Path(path_type=Path),
    required=True,
    help="diffusers-format folder or project checkpoint.",
)


def _placements(
    ctx: click.Context, param: click.Parameter, values: tuple[str, ...]
) -> dict[str, str]:
    try:
        return dict(residency.parse_override(v) for v in values)
    except ValueError as e:
        raise CliError(str(e)) from None


PLACEMENT = click.option(
    "--placement",
    multiple=True,
    metavar="COMPONENT=resident|transient",
    callback=_placements,
    help="Where a component's weights stay, over the build's choice (`aot inspect`): resident "
    "(on the devices from the load on) or transient (placed for its program, deleted after). "
    f"Components: {', '.join(residency.MOVABLE)}; repeatable.",
)


LORA = click.option(
    "--lora",
    "lora_args",
    multiple=True,
    metavar="FILE[:SCALE]",
    help="A LoRA merged into the transformer at load (repeatable; scales add up; default 1).",
)
# Step caching's options, shared by `run` and `serve`; runtime.generation.step_cache.from_options reads them.
CACHE_OPTIONS = [
    click.option(
        "--cache",
        type=click.Choice(list(KINDS)),
        help="Step caching (a build with --step-cache): skip a step's transformer blocks when "
        + "; ".join(f"{name}: {kind.skips_when}" for name, kind in KINDS.items())
        + ".",
    ),
    click.option(
        "--cache-threshold",
        type=float,
        callback=finite,
        help="; ".join(
            f"{name}: {kind.threshold_means} (default {kind.threshold})"
            for name, kind in KINDS.items()
        ),
    ),
    click.option(
        "--cache-max-skip",
        default=MagCacheSettings.max_skip,
        show_default=True,
        type=click.IntRange(min=0),
        help="MagCache: most consecutive skipped steps.",
    ),
    click.option(
        "--cache-retention",
        default=MagCacheSettings.retention,
        show_default=True,
        type=click.FloatRange(0, 1),
        help="MagCache: fraction of the first steps never skipped.",
    ),
    click.option(
        "--mag-ratios",
        type=click.Path(path_type=Path, exists=True, dir_okay=False),
        help="MagCache: this model's ratios, a JSON list (two-expert models: an object per "
        "transformer), e.g. from --calibrate-mag-ratios (default: the shipped ones of the preset).",
    ),
]


def _stacked(options: list[Callable]) -> Callable[[Callable], Callable]:
    """One decorator that applies `options` in the order listed (the order --help shows)."""

    def decorate(command: Callable) -> Callable:
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


# A multi-process build's job (one process per host): `runtime run` and `runtime serve` alike.
JOB_OPTIONS = [
    click.option(
        "--coordinator",
        help="Multi-process builds: host:port of process 0; run one command per process, the "
        "same arguments but --process-id.",
    ),
    click.option("--num-processes", default=1, show_default=True, type=click.IntRange(min=1)),
    click.option("--process-id", default=0, show_default=True, type=click.IntRange(min=0)),
    click.option(
        "--join-timeout",
        default=processes.JOIN_TIMEOUT_S,
        show_default=True,
        type=click.IntRange(min=1),
        help="Seconds to wait for the other processes of the job.",
    ),
]
cache_options, job_options = _stacked(CACHE_OPTIONS), _stacked(JOB_OPTIONS)


def check_job(coordinator: str | None, num_processes: int, process_id: int) -> None:
    if (num_processes > 1) != (coordinator is not None) or process_id >= num_processes:
        raise click.UsageError(
            "a multi-process job needs --coordinator HOST:PORT, --num-processes P > 1 and "
            "--process-id in [0, P)"
        )


def start(
    match: Callable[[Present], tuple[Path, Manifest]],
    coordinator: str | None,
    num_processes: int,
    process_id: int,
    join_timeout: int,
) -> tuple[Path, Manifest]:
    """Start jax for the build that `match` finds on the present devices, and return it. Host
    CPU devices are arranged for a cpu-N/cpu-PxN build before jax starts (so the build is
    matched first); accelerators are counted once jax has started."""
    on_cpu = processes.host_platform() == "cpu"
    if on_cpu:
        folder, manifest = match(Present.host_cpu(num_processes))
        if manifest.key.target.startswith("cpu-"):
            processes.use_host_devices(manifest.local_device_count)
    if num_processes > 1:
        try:
            processes.join(coordinator, num_processes, process_id, join_timeout)
        except processes.JobError as e:
            raise CliError(str(e)) from None
    if on_cpu:
        return folder, manifest
    import jax

    return match(Present.of(jax.devices()))


def loras(args: tuple[str, ...], option: str) -> list[tuple[Path, float]]:
    """FILE[:SCALE] arguments as (path, scale); a missing file fails before anything loads."""
    from wan import lora

    specs = [lora.parse_spec(a) for a in args]
    for path, _ in specs:
        if not path.is_file():
            raise CliError(f"{option} {path}: no such file")
    return specs
