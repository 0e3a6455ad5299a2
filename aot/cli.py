"""`aot`: build, list, inspect and check ahead-of-time compiled WAN programs.

jax is imported only inside commands, after `main` has arranged the process for the target
(host device count, libtpu's deviceless mode): users never set XLA flags themselves.
"""

from __future__ import annotations

import contextlib
import json
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

import click

from aot import targets
from aot.targets import gpu
from runtime.builds.build_options import OPTIONS
from runtime.cli.args import TRUSTED_KEY, CliError, OneLineErrors, os_error_text, parse_resolution

POLICY_OPTION = click.option(
    "--policy",
    "policy_path",
    type=click.Path(path_type=Path),
    help="Policy TOML for the HLO/memory check (default: aot's own; see docs/check.md).",
)


@click.group(cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Ahead-of-time compile the WAN text-to-video programs for any target."""


_MATRIX = [
    click.option("--model", required=True, help="Preset name or diffusers-format folder."),
    click.option("--res", "resolutions", multiple=True, required=True, help="WxH, repeatable."),
    click.option(
        "--frames", "frames_list", multiple=True, required=True, type=int, help="4k+1, repeatable."
    ),
    click.option(
        "--batch",
        "batches",
        multiple=True,
        required=True,
        type=int,
        help="Videos per call, repeatable.",
    ),
    click.option(
        "--target",
        required=True,
        help=(
            "cpu-N, cpu-PxN (P processes of N), current, single-host TPU VMs, one "
            f"process ({targets.describe_aliases()}), tpu-<gen>:<topology> (a slice in hosts of the "
            f"generation's VM: {targets.describe_hosts()}), tpu-<gen>:<topology>/<host> "
            "(other VM sizes, e.g. tpu-v6e:4x4/2x2), NVIDIA GPUs compiled for without one: "
            f"{', '.join(f'gpu-{k}[xN]' for k in gpu.KINDS)} (N GPUs of one host), "
            "gpu:FILE.txtpb[xN] (a config from `aot gpu-target capture`)."
        ),
    ),
    click.option(
        "--no-cfg",
        is_flag=True,
        help="Build without classifier-free guidance (the step runs B, not 2B).",
    ),
]


# The build options, made from their one declaration (runtime.builds.build_options).
_BUILD_OPTIONS = [
    click.option(
        option.flag,
        option.name,
        default=option.flag_default or option.default,
        show_default=not option.is_flag,
        help=option.help.format(fast_vae_vmem_mib=targets.FAST_COMPILE_VAE_VMEM_MIB),
        **(
            {"is_flag": True}
            if option.is_flag
            else {"type": click.Choice(option.choices) if option.choices else str}
        ),
    )
    for option in OPTIONS.values()
]


def _matrix_options(command: Callable) -> Callable:
    """The options that describe a build matrix, shared by `aot build` and `aot plan`."""
    for option in reversed(_MATRIX + _BUILD_OPTIONS):
        command = option(command)
    return command


@cli.command("build")
@_matrix_options
@click.option(
    "--out", type=click.Path(path_type=Path), default=Path("artifacts"), show_default=True
)
@click.option("--force", is_flag=True, help="Rebuild even when an identical build exists.")
@click.option(
    "--strict", is_flag=True, help="Fail when the HLO/memory policy check finds a violation."
)
@POLICY_OPTION
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option(
    "--jobs",
    type=int,
    help=(
        "Programs compiled at once, each in its own process (default: what the cores and free "
        "memory allow, a compile taking ~2 cores and up to ~6 GiB)."
    ),
)
@click.option(
    "--sign-key",
    type=click.Path(path_type=Path),
    help="Sign each manifest and program store entry with this private key (`aot keygen`).",
)
def build_cmd(out, force, strict, policy_path, as_json, jobs, sign_key, **matrix) -> None:
    """Compile the program matrix (--res x --frames x --batch) for one target."""
    from aot.building.request import check_out

    check_out(out)
    plans = _plans(**matrix)  # a mistyped request is refused before jax is imported
    from aot.building import build as builder
    from aot.building import store
    from aot.building.jobs import check_jobs, compile_distinct, default_jobs
    from aot.reports import check, report
    from runtime.trust import signing

    try:
        policy = check.load_policy(policy_path)
        signer = signing.load_signing_key(sign_key) if sign_key is not None else None
        jobs = default_jobs() if jobs is None else jobs
        check_jobs(jobs, plans[0].target)
        ledger = builder.CallLedger(force, signer, policy)
        # Up-to-date builds are found without writing: a read-only --out is fine when all are.
        done = {plan.key: builder.up_to_date(plan, out, ledger) for plan in plans}
        pending = [plan for plan in plans if done[plan.key] is None]
        for plan in pending:
            builder.check_replaceable(out / plan.key.folder_name())
        if pending:
            with store.building(out):  # from the workers' compiles until each manifest is in
                if jobs > 1:
                    compile_distinct(pending, out, jobs, ledger, show_progress=not as_json)
                progress = None if as_json else (lambda line: click.echo(line, err=True))
                done.update(
                    (plan.key, builder.build(plan, out, ledger, progress)) for plan in pending
                )
        results = [done[plan.key] for plan in plans]
    except OSError as e:  # a full disk, a read-only --out
        raise CliError(f"cannot write the builds into {out}: {os_error_text(e)}") from None
    built = sum(not r.skipped for r in results)
    if as_json:
        click.echo(json.dumps(report.builds_json(results), indent=1))
    else:
        click.echo(report.builds_table(results))
        if built == 0:
            click.echo(
                f"nothing to compile: all {len(results)} builds are up to date (--force rebuilds)"
            )
        else:
            click.echo(f"{built} built, {len(results) - built} up to date, in {out}")
    # The `aot check` of these builds: warnings on stderr, or exit 1 with --strict.
    try:
        violations = check.violation_lines(check.check_paths([r.folder for r in results], policy))
    except check.CheckInputError as e:
        raise CliError(str(e)) from None
    for line in violations:
        click.echo(f"{'error' if strict else 'warning'}: {line}", err=True)
    if violations:
        click.echo(
            f"{len(violations)} policy violation(s) (policy: {policy.source}; `aot check` "
            "shows them all)",
            err=True,
        )
        if strict:
            raise click.exceptions.Exit(1)


def _plans(model, resolutions, frames_list, batches, target, no_cfg, **options) -> list:
    """The BuildPlans of a matrix, in --res, --frames, --batch order; bad input is a CliError."""
    from aot.building import request
    from aot.building.local_job import local_job
    from runtime.builds.processes import JobError
    from wan.configs import VideoShape
    from wan.presets import resolve_model

    try:
        name = Path(model).name if Path(model).is_dir() else model
        request.check_model_name(name)
        config = resolve_model(model)
        tgt = targets.parse_target(target)
        shapes = [
            VideoShape(*parse_resolution(res), frames, batch, cfg=not no_cfg)
            for res in resolutions
            for frames in frames_list
            for batch in batches
        ]
        # Checked before jax is imported and any device starts: a mistyped size never reaches it.
        for shape in shapes:
            request.check_shape(config, shape)
        from aot.building import plan as planner

        requested = planner.resolve_options(options)
        # cpu-PxN: this process joins a local multi-process job until the command is done.
        click.get_current_context().with_resource(local_job(tgt))
        num_devices = len(targets.devices(tgt))
        return [
            planner.plan_build(name, config, shape, tgt, num_devices, **requested)
            for shape in shapes
        ]
    except (ValueError, OSError, targets.TargetError, JobError, request.BuildError) as e:
        raise CliError(str(e)) from None


@cli.command("plan")
@_matrix_options
@click.option(
    "--out", type=click.Path(path_type=Path), default=Path("artifacts"), show_default=True
)
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def plan_cmd(out, as_json, **matrix) -> None:
    """The builds of a matrix, each with the `aot build` command that makes just it: run them
    on separate workers (a CI matrix, Kubernetes or Ray jobs) and copy the folders into one
    artifacts folder. Compiles nothing."""
    from aot.reports import report

    entries = [_plan_entry(plan, matrix["model"], out) for plan in _plans(**matrix)]
    if as_json:
        click.echo(json.dumps(entries, indent=1))
    else:
        click.echo(
            report.text_table(["build", "command"], [[e["folder"], e["command"]] for e in entries])
        )


def _plan_entry(plan, model: str, out: Path) -> dict:
    """One build of a plan: its key, folder name and the command that makes it (every option
    resolved, so the worker builds this key whatever its own defaults)."""
    key = plan.key
    args = key.build_argv(model, out)
    return {"key": key.to_json(), "folder": key.folder_name(), "command": shlex.join(args)}


@cli.command("list")
@click.argument("folder", type=click.Path(path_type=Path), default=Path("artifacts"))
def list_cmd(folder: Path) -> None:
    """A table of the builds in FOLDER."""
    from aot.reports import report

    if not folder.is_dir():
        raise CliError(f"{folder} is not a folder of builds (make one with `aot build`)")
    click.echo(report.list_table(folder))


@cli.command("gc")
@click.argument("folder", type=click.Path(path_type=Path), default=Path("artifacts"))
@click.option("--dry-run", is_flag=True, help="List what would be removed, remove nothing.")
def gc_cmd(folder: Path, dry_run: bool) -> None:
    """Remove the stored programs (FOLDER/.programs) that no build in FOLDER references, and
    the temporary folders of killed builds. Only what `aot build` writes is ever removed; it
    waits for the builds in progress."""
    from aot.building import store
    from wan.atomic import remove_owned

    if not folder.is_dir():
        raise CliError(f"{folder} is not a folder of builds (make one with `aot build`)")

    def waiting() -> None:
        click.echo("waiting for the builds in progress to finish", err=True)

    with contextlib.nullcontext() if dry_run else store.collecting(folder, waiting):
        garbage = store.garbage(folder, _manifests(folder))
        verb = "would remove" if dry_run else "removed"
        removed, size = 0, 0
        for path, files in [*garbage.unused.items(), *garbage.leftovers.items()]:
            path_size = store.size(path, files)
            if not (dry_run or remove_owned(path, files)):
                click.echo(f"left alone: {path} (something else appeared in it)")
                continue
            what = "leftover of a killed build" if path in garbage.leftovers else "program"
            click.echo(f"{verb} {what} {path.name} ({path_size / 1e6:.1f} MB)")
            removed += path in garbage.unused
            size += path_size
    for path in garbage.foreign:
        click.echo(f"left alone: {path} (not a program entry)")
    click.echo(f"{verb} {removed} unreferenced program(s), {size / 1e6:.1f} MB")


def _manifests(folder: Path) -> list:
    """The manifests of the builds in `folder`; a build whose manifest does not read is
    skipped with a line saying why (its files stay whole: they are its own hard links)."""
    from runtime.builds.artifact import Manifest
    from runtime.builds.loader import read_builds

    manifests = []
    for path, found in read_builds(folder):
        if isinstance(found, Manifest):
            manifests.append(found)
        else:
            click.echo(f"skipped {path.name}: {found}", err=True)
    return manifests


@cli.command("inspect")
@click.argument("build_dir", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True)
def inspect_cmd(build_dir: Path, as_json: bool) -> None:
    """The full report of one build."""
    from aot.reports import report
    from runtime.builds.artifact import ArtifactError, read_manifest

    try:
        manifest = read_manifest(build_dir)
    except ArtifactError as e:
        raise CliError(str(e)) from None
    click.echo(
        json.dumps(manifest.to_json(), indent=1) if as_json else report.inspect_text(manifest)
    )


@cli.command("check")
@click.argument("artifacts", nargs=-1, required=True, type=click.Path(path_type=Path))
@POLICY_OPTION
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@TRUSTED_KEY
def check_cmd(
    artifacts: tuple[Path, ...],
    policy_path: Path | None,
    as_json: bool,
    trusted_keys: tuple[Path, ...],
) -> None:
    """Check builds (or folders of builds) against an HLO collective and memory policy (and,
    with --trusted-key, that each is signed by a trusted key).

    Exit 0 when every build passes, 1 on any violation, 2 on bad input."""
    from aot.reports import check
    from runtime.trust import signing

    try:
        policy = check.load_policy(policy_path)
        trusted = signing.load_trusted_keys(trusted_keys)
        results = check.check_paths(artifacts, policy, trusted)
    except check.CheckInputError as e:
        raise CliError(str(e)) from None
    if as_json:
        click.echo(json.dumps(check.to_json(results, policy), indent=1))
    else:
        click.echo(check.text(results, policy))
    if any(r.violations for r in results):
        raise click.exceptions.Exit(1)


@cli.command("keygen")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="The private key file.")
def keygen_cmd(out: Path) -> None:
    """Make an Ed25519 key pair for signing builds: the private key at --out (mode 0600, for
    `aot build --sign-key`) and its public key at --out.pub (for --trusted-key)."""
    from runtime.trust import signing

    private, public = signing.generate(out)
    key = signing.load_trusted_key(public)
    click.echo(f"wrote {private} (private: keep it secret) and {public} (key id {key.key_id})")


@cli.group("gpu-target")
def gpu_target_cmd() -> None:
    """GPU target configs: what a deviceless GPU build (--target gpu-...) compiles for."""


@gpu_target_cmd.command("capture")
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--device", default=0, show_default=True, help="CUDA device ordinal.")
def capture_cmd(out: Path, device: int) -> None:
    """Write the target config of this host's GPU to OUT (.txtpb), for `aot build --target
    gpu:OUT[xN]` on any host. Run it on the GPU host."""
    if out.suffix != ".txtpb":
        raise CliError(f"{out}: name the config FILE.txtpb (as --target gpu:FILE.txtpb reads it)")
    text = gpu.capture(device)
    config = gpu.parse_config(text, "the captured config")
    try:
        out.write_text(text)
    except OSError as e:
        raise CliError(f"cannot write {out}: {os_error_text(e)}") from None
    click.echo(
        f"{config.device_kind}: {config.hbm_bytes / (1 << 30):.0f} GiB, "
        f"{config.peak_bf16 / 1e12:.0f} bf16 TFLOP/s, compute capability "
        f"{config.compute_capability}; build with --target gpu:{out}"
    )


@gpu_target_cmd.command("diff")
@click.argument("first")
@click.argument("second")
def diff_cmd(first: str, second: str) -> None:
    """The device fields that differ between two configs, each a shipped kind
    ({kinds}) or a .txtpb file. Exit 1 when they differ."""

    def config(name: str) -> gpu.GpuConfig:
        return gpu.shipped_config(name) if name in gpu.KINDS else gpu.read_config(name)

    lines = gpu.diff_configs(config(first), config(second))
    click.echo("\n".join(lines) if lines else "same device fields")
    if lines:
        raise click.exceptions.Exit(1)


diff_cmd.help = diff_cmd.help.format(kinds=", ".join(gpu.KINDS))


def _prepare_from_argv(argv: list[str]) -> None:
    """Set up the process for the --target on the command line before jax is imported."""
    for i, arg in enumerate(argv):
        value = argv[i + 1] if arg == "--target" and i + 1 < len(argv) else None
        if arg.startswith("--target="):
            value = arg.split("=", 1)[1]
        if value:
            # An unknown target is reported by the command, with its usage context.
            with contextlib.suppress(targets.TargetError):
                targets.prepare_environment(targets.parse_target(value))
            return


def main() -> None:
    _prepare_from_argv(sys.argv[1:])
    cli(prog_name="aot")
