"""Find the build that serves a request and load its executables, safely and in order:
sha256 -> platform, devices, versions -> device order -> restricted deserialisation."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import importlib.metadata
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from runtime.builds.artifact import (
    MANIFEST,
    ArtifactError,
    BuildKey,
    Manifest,
    read_manifest,
    read_signed_manifest,
    read_verified,
    verify_files,
)
from runtime.builds.executables import (
    DeclaredCall,
    ExecutableHeader,
    declared_call,
    declared_header,
    load_executable,
)
from runtime.trust.signing import TrustedKey
from wan.configs import VideoShape
from wan.interface import SIGNATURES


@dataclasses.dataclass(frozen=True)
class Request:
    shape: VideoShape
    model_hash: str | None = None  # the weights' model config hash, when known
    serving: bool = False  # for `runtime serve`, which also runs continuous builds


@dataclasses.dataclass(frozen=True)
class Present:
    """The devices a build must fit. A CPU host not yet started (`host_cpu`) gets the device
    count of whichever build is chosen, so only its platform and processes count then."""

    platform: str
    device_kind: str | None  # None: host CPU devices, arranged for the build
    devices: int | None  # all processes'; None as for device_kind
    processes: int = 1

    @classmethod
    def of(cls, devices: list[Any]) -> Present:
        processes, _ = host_layout(devices)
        return cls(devices[0].platform, devices[0].device_kind, len(devices), processes)

    @classmethod
    def host_cpu(cls, processes: int = 1) -> Present:
        return cls("cpu", None, None, processes)


def build_folders(artifacts: Path) -> list[Path]:
    """The build folders in a folder of builds, sorted: its subfolders that have a manifest
    (whether or not it reads), hidden ones (the program store, `.programs`) skipped. Their
    manifests are not read."""
    return sorted(
        p
        for p in artifacts.iterdir()
        if not p.name.startswith(".") and os.path.lexists(p / MANIFEST)
    )


def read_builds(artifacts: Path) -> list[tuple[Path, Manifest | ArtifactError]]:
    """Each build folder in a folder of builds with its manifest, or with why the manifest
    does not read: one broken build never hides the others."""
    found: list[tuple[Path, Manifest | ArtifactError]] = []
    for folder in build_folders(artifacts):
        try:
            found.append((folder, read_manifest(folder)))
        except ArtifactError as e:
            found.append((folder, e))
    return found


def candidate_builds(artifacts: Path) -> list[tuple[Path, Manifest | ArtifactError]]:
    """The builds in `artifacts` (a build folder itself, whose manifest must read, or a folder
    of builds, see read_builds)."""
    if os.path.lexists(artifacts / MANIFEST):
        return [(artifacts, read_manifest(artifacts))]
    if not artifacts.is_dir():
        raise ArtifactError(
            f"{artifacts} does not exist: build with `aot build --out {artifacts} ...`"
        )
    return read_builds(artifacts)


def passed_over(manifest: Manifest, request: Request, present: Present) -> str | None:
    """Why the build of `manifest` cannot serve `request` on `present` devices; None if it can."""
    k, m = manifest.key, manifest
    if k.shape != request.shape:
        return f"another shape ({k.width}x{k.height} f{k.frames} b{k.batch}{'' if k.cfg else ' nocfg'})"
    if k.option("continuous") and not request.serving:
        return "a continuous build (aot build --continuous), which `runtime serve` runs"
    if request.model_hash is not None and m.model_hash != request.model_hash:
        return "another model config than the weights"
    if m.platform != present.platform:
        return f"for {m.platform} devices ({m.device_kind}), this host has {present.platform}"
    if present.device_kind is not None and m.device_kind != present.device_kind:
        return f"for {m.device_kind} devices, these are {present.device_kind}"
    if m.process_count != present.processes:
        return (
            f"a {m.process_count}-process job, this one has {present.processes}: run one "
            "`runtime run` (or `runtime serve`) per process with --coordinator, --num-processes "
            "and --process-id"
        )
    if present.devices is not None and len(m.device_ids) != present.devices:
        return f"needs {len(m.device_ids)} {m.platform} devices, this process has {present.devices}"
    return None


def match_build(
    artifacts: Path,
    request: Request,
    model_name: str,
    present: Present,
    build: str | None = None,
) -> tuple[Path, Manifest]:
    """The build for `request` on `present` devices: the one named `build`, else the only
    candidate, else the only candidate whose mesh is the default for its shape and devices.
    A refusal names every build, one line each, with why it was passed over (a build whose
    manifest does not read: why not)."""
    found = candidate_builds(artifacts)
    builds = [(f, m) for f, m in found if isinstance(m, Manifest)]
    reasons = {folder.name: passed_over(m, request, present) for folder, m in builds}
    unreadable = {f.name: f"unreadable: {m}" for f, m in found if isinstance(m, ArtifactError)}
    fits = [(f, m) for f, m in builds if reasons[f.name] is None]
    if builds and not unreadable and all(m.platform != present.platform for _, m in builds):
        raise ArtifactError(other_platforms(artifacts, builds, present))
    if build is not None:
        chosen = [(f, m) for f, m in builds if f.name == build]
        if chosen and reasons[build] is None:
            return chosen[0]
        state = "is unreadable" if build in unreadable else "is not there"
        why = f"build {build} {'cannot serve this request' if chosen else state}"
    elif len(fits) == 1:
        return fits[0]
    elif len(defaults := [(f, m) for f, m in fits if m.default_mesh]) == 1:
        return defaults[0]
    elif fits:
        why = f"{len(fits)} builds serve this request: choose one with --build NAME"
    else:
        shape = request.shape
        command = (
            f"aot build --model {model_name} --res {shape.width}x{shape.height} "
            f"--frames {shape.frames} --batch {shape.batch}{'' if shape.cfg else ' --no-cfg'}"
            f" --target {builds[0][1].key.target if builds else 'cpu-8'} --out {artifacts}"
        )
        why = f"no build serves this request; make it with: {command}"
    lines = {
        folder.name: reasons[folder.name]
        or f"fits ({'default mesh' if m.default_mesh else 'chosen mesh'})"
        for folder, m in builds
    }
    lines.update(unreadable)
    head = f"{why} (builds in {artifacts}: {len(found)})"
    raise ArtifactError("\n".join([head, *(f"  {name}: {lines[name]}" for name in sorted(lines))]))


# What a request picks a build by: (width, height, frames, CFG, image), the last whether it gives
# an image (an image-to-video build: one of a model that runs both serves beside a text one).
Route = tuple[int, int, int, bool, bool]


def route(key: BuildKey) -> Route:
    return key.width, key.height, key.frames, key.cfg, "vae_encode" in key.programs


def describe_route(r: Route) -> str:
    """Its size, frames and CFG (its kind, text or image to video, is the caller's to say)."""
    width, height, frames, cfg, _ = r
    return f"{width}x{height} frames={frames} {'guidance>1' if cfg else 'guidance<=1'}"


def serving_routes(keys: Mapping[str, BuildKey]) -> dict[Route, str]:
    """For each route, the one build of `keys` (by name) that serves it: a continuous build
    (any settings, joining at the next step), else the largest batch, whose generate() makes
    the most videos at once (of equal ones, the first name).
    `runtime serve` loads one build of each route's shape chosen here (runtime.cli.serve) and
    routes each request by this mapping of the builds it loaded."""
    chosen: dict[Route, str] = {}

    def preference(item: tuple[str, BuildKey]) -> tuple[bool, int, str]:
        name, key = item
        return not key.option("continuous"), -key.batch, name

    for name, key in sorted(keys.items(), key=preference):
        chosen.setdefault(route(key), name)
    return chosen


def other_platforms(artifacts: Path, builds: list[tuple[Path, Manifest]], present: Present) -> str:
    """One line for builds that are all for other devices than these (a GPU build on a CPU
    host): each build's devices, and what to do."""
    each = "; ".join(
        f"{folder.name}: for {m.platform} devices ({len(m.device_ids)} x {m.device_kind})"
        for folder, m in builds
    )
    return (
        f"no build in {artifacts} runs on this host's {present.platform} devices ({each}): run "
        "it on the host of the devices it was built for, or build for this host's devices"
    )


def installed_versions() -> dict[str, str]:
    """The compiler packages a build records and a run must match: jax, jaxlib, libtpu."""
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
    layout = host_layout(devices)
    if layout != (manifest.process_count, manifest.local_device_count):
        raise ArtifactError(
            f"build is for {manifest.process_count} process(es) of {manifest.local_device_count} "
            f"devices, this job is {layout[0]} of {layout[1]}: run it on the hosts of its target "
            f"({manifest.key.target}), one `runtime run` per host"
        )


def host_layout(devices: list[Any]) -> tuple[int, int]:
    """(processes, devices per process) of a job's devices; (n, 0) when they are unequal."""
    per_process = collections.Counter(d.process_index for d in devices)
    counts = set(per_process.values())
    return len(per_process), counts.pop() if len(counts) == 1 else 0


def ordered_devices(
    manifest: Manifest, devices: list[Any], headers: Mapping[str, ExecutableHeader]
) -> list[Any]:
    """The devices in the build's mesh order. The order recorded inside every (checksummed)
    executable must equal the manifest's, and every id must exist here: XLA aborts the process
    on a mismatch, so it is caught before XLA sees it."""
    by_id = {d.id: d for d in devices}
    missing = [i for i in manifest.device_ids if i not in by_id]
    if missing or len(set(manifest.device_ids)) != len(manifest.device_ids):
        raise ArtifactError(
            f"manifest device ids {manifest.device_ids} do not name this process's devices"
        )
    for name, header in headers.items():
        recorded = list(header.device_ids)
        if recorded != manifest.device_ids:
            raise ArtifactError(
                f"{name}: manifest device order {manifest.device_ids} differs from the executable's "
                f"{recorded}: the manifest was edited; rebuild with `aot build --force`"
            )
    return [by_id[i] for i in manifest.device_ids]


def check_signatures(folder: Path, manifest: Manifest) -> None:
    """The build's programs take and return what this runtime passes and reads, by name."""
    for name in manifest.key.programs:
        entry, signature = manifest.programs[name], SIGNATURES[name]
        if (tuple(entry.input_names), tuple(entry.output_names)) != (
            signature.inputs,
            signature.outputs,
        ):
            raise ArtifactError(
                f"{folder.name}: {name} takes ({', '.join(entry.input_names)}) and returns "
                f"({', '.join(entry.output_names)}); this runtime passes ({', '.join(signature.inputs)}) "
                f"and reads ({', '.join(signature.outputs)}): rebuild with `aot build --force`"
            )


def verify_signed(folder: Path, manifest: Manifest, trusted: Sequence[TrustedKey]) -> None:
    """With `trusted` keys: the build is signed by one of them, and its signed manifest is the
    `manifest` in use (whose sha256s then vouch for every file); nothing when none are given."""
    if trusted and read_signed_manifest(folder, trusted) != manifest:
        raise ArtifactError(f"{folder.name}: its manifest changed since it was matched: run again")


@dataclasses.dataclass(frozen=True)
class OpenedBuild:
    """A build's executables read and checked, not yet deserialized: what each program takes
    is known from its header (`declared`), so its weights can be placed while XLA loads them."""

    blobs: dict[str, bytes]  # each program's executable file, the bytes its sha256 vouched for
    devices: list[Any]  # in the build's mesh order
    declared: dict[str, DeclaredCall]

    def load(self) -> dict[str, Any]:
        """The deserialized executables by program name, loaded at once in threads (zstd's
        decompression and XLA's deserialization run without the GIL)."""

        def load(name: str) -> Any:
            with _naming(name):
                return load_executable(blob=self.blobs[name], devices=self.devices)

        with concurrent.futures.ThreadPoolExecutor(len(self.blobs) or 1) as pool:
            return dict(zip(self.blobs, pool.map(load, self.blobs), strict=True))


def open_build(
    folder: Path, manifest: Manifest, devices: list[Any], trusted: Sequence[TrustedKey] = ()
) -> OpenedBuild:
    """The build's verified executables, ready to load (signed by one of `trusted`, if any,
    before any executable is read)."""
    verify_signed(folder, manifest, trusted)
    verify_files(folder, manifest)
    check_environment(manifest, devices)
    check_signatures(folder, manifest)
    # Read once and checked again: the bytes deserialised are the bytes hashed.
    blobs = {
        name: read_verified(folder, manifest.programs[name].executable)
        for name in manifest.key.programs
    }
    headers = {}
    for name, blob in blobs.items():
        with _naming(name):
            headers[name] = declared_header(manifest.programs[name], blob)
    ordered = ordered_devices(manifest, devices, headers)
    declared = {}
    for name, header in headers.items():
        with _naming(name):
            declared[name] = declared_call(header, ordered)
    return OpenedBuild(blobs, ordered, declared)


@contextlib.contextmanager
def _naming(program: str) -> Iterator[None]:
    """An ArtifactError raised inside names `program` first."""
    try:
        yield
    except ArtifactError as e:
        raise ArtifactError(f"{program}: {e}") from None
