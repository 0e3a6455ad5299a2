"""Find the build that serves a request and load its executables, safely and in order:
sha256 -> platform, devices, versions -> device order -> restricted deserialisation."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
from pathlib import Path
from typing import Any

from runtime.artifact import (
    MANIFEST,
    PROGRAMS,
    ArtifactError,
    Manifest,
    executable_device_ids,
    load_executable,
    read_manifest,
    verify_files,
)


@dataclasses.dataclass(frozen=True)
class Request:
    width: int
    height: int
    frames: int
    batch: int
    cfg: bool
    model_hash: str | None = None  # the weights' model config hash, when known
    processes: int = 1  # processes of the jax.distributed job that will run it


def candidate_builds(artifacts: Path) -> list[tuple[Path, Manifest]]:
    """The builds in `artifacts` (a build folder itself, or a folder of builds)."""
    if (artifacts / MANIFEST).is_file():
        return [(artifacts, read_manifest(artifacts))]
    if not artifacts.is_dir():
        raise ArtifactError(
            f"{artifacts} does not exist: build with `aot build --out {artifacts} ...`"
        )
    found = []
    for folder in sorted(
        p for p in artifacts.iterdir() if p.is_dir() and not p.name.startswith(".")
    ):
        with contextlib.suppress(ArtifactError):
            found.append((folder, read_manifest(folder)))
    return found


def match_build(artifacts: Path, request: Request, model_name: str) -> tuple[Path, Manifest]:
    """The build for `request`; when none matches, the error lists what exists and the command
    that would make the missing one."""
    builds = candidate_builds(artifacts)
    other_model, other_job = [], []
    for folder, m in builds:
        k = m.key
        if (k.width, k.height, k.frames, k.batch, k.cfg) != (
            request.width, request.height, request.frames, request.batch, request.cfg,
        ):  # fmt: skip
            continue
        if request.model_hash is not None and m.model_hash != request.model_hash:
            other_model.append(folder.name)
            continue
        if m.process_count != request.processes:
            other_job.append(f"{folder.name} (a {m.process_count}-process job)")
            continue
        return folder, m
    have = (
        "; ".join(
            f"{m.key.model} {m.key.width}x{m.key.height} f{m.key.frames} b{m.key.batch}"
            f"{'' if m.key.cfg else ' nocfg'} {m.key.target}"
            for _, m in builds
        )
        or "none"
    )
    target = builds[0][1].key.target if builds else "cpu-8"
    command = (
        f"aot build --model {model_name} --res {request.width}x{request.height} --frames {request.frames} "
        f"--batch {request.batch}{'' if request.cfg else ' --no-cfg'} --target {target} --out {artifacts}"
    )
    if other_job:
        why = (
            f"{', '.join(other_job)} has this shape for another number of processes than "
            f"{request.processes}: run one `runtime run` per process with --coordinator, "
            "--num-processes and --process-id, or build for this job"
        )
    elif other_model:
        why = f"{', '.join(other_model)} has this shape but another model config than the weights"
    else:
        why = f"have: {have}"
    raise ArtifactError(
        f"no build in {artifacts} serves this request ({why}); make it with: {command}"
    )


def installed_versions() -> dict[str, str]:
    out = {}
    for name in ("jax", "jaxlib", "libtpu"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[name] = importlib.metadata.version(name)
    return out


def check_environment(manifest: Manifest, devices: list[Any]) -> None:
    """The build was made for these devices and this compiler: refuse clearly otherwise."""
    have = installed_versions()
    for name, want in manifest.versions.items():
        if have.get(name) != want:
            raise ArtifactError(
                f"build was compiled with {name} {want} but {name} {have.get(name, 'is not installed')} "
                "is here: rebuild with `aot build --force` or install the matching version"
            )
    platform = devices[0].platform if devices else "none"
    if platform != manifest.platform:
        raise ArtifactError(
            f"build is for {manifest.platform} devices but this process has {platform}"
        )
    if len(devices) != len(manifest.device_ids):
        raise ArtifactError(
            f"build needs {len(manifest.device_ids)} {manifest.platform} devices, this process has "
            f"{len(devices)}: run on the target it was built for ({manifest.key.target})"
        )
    kind = devices[0].device_kind
    if kind != manifest.device_kind:
        raise ArtifactError(f"build is for {manifest.device_kind} devices but these are {kind}")


def ordered_devices(manifest: Manifest, devices: list[Any], blobs: dict[str, bytes]) -> list[Any]:
    """The devices in the build's mesh order. The order recorded inside every (checksummed)
    executable must equal the manifest's, and every id must exist here: XLA aborts the process
    on a mismatch, so it is caught before XLA sees it."""
    by_id = {d.id: d for d in devices}
    missing = [i for i in manifest.device_ids if i not in by_id]
    if missing or len(set(manifest.device_ids)) != len(manifest.device_ids):
        raise ArtifactError(
            f"manifest device ids {manifest.device_ids} do not name this process's devices"
        )
    for name, blob in blobs.items():
        if executable_device_ids(blob) != manifest.device_ids:
            raise ArtifactError(
                f"{name}: manifest device order {manifest.device_ids} differs from the executable's "
                f"{executable_device_ids(blob)}: the manifest was edited; rebuild with `aot build --force`"
            )
    return [by_id[i] for i in manifest.device_ids]


def load_build(folder: Path, manifest: Manifest, devices: list[Any]) -> dict[str, Any]:
    """Verified, deserialized executables by program name."""
    verify_files(folder, manifest)
    check_environment(manifest, devices)
    blobs = {
        name: (folder / manifest.programs[name].executable.path).read_bytes() for name in PROGRAMS
    }
    ordered = ordered_devices(manifest, devices, blobs)
    try:
        return {name: load_executable(blob, ordered) for name, blob in blobs.items()}
    except ArtifactError:
        raise
    except Exception as e:  # a corrupt payload that passed sha256 can only come from the builder
        raise ArtifactError(f"cannot deserialize executables in {folder}: {e}") from None
