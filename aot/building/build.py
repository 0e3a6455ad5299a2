"""`aot build`: make (or find up to date) the build folder of a plan. Each program of the plan is
lowered (`aot.building.lower`), looked up in the artifacts folder's program store (`aot.building.store`) and compiled
only when absent; its files (`aot.building.entries`) are linked into the build folder, which appears whole
or not at all, with its manifest."""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from pathlib import Path

import jax

from aot.building import sources, store
from aot.building.entries import program_entry
from aot.building.lower import LoweredProgram, compile_lowered, lower_plan
from aot.building.plan import BuildError, BuildPlan, ulysses_all_to_alls
from aot.building.request import check_out
from aot.reports import check
from aot.targets import Target, devices, peak_flops
from runtime.builds.artifact import (
    MANIFEST,
    SCHEMA_VERSION,
    ArtifactError,
    BuildKey,
    Manifest,
    ProgramEntry,
    listed_files,
    program_memory,
    read_manifest,
    read_signed_manifest,
    verify_files,
)
from runtime.builds.loader import host_layout, installed_versions
from runtime.trust import signing
from runtime.trust.signing import SigningKey
from wan import interface, residency, sharding
from wan.atomic import atomic_folder, locked, owned_files


@dataclasses.dataclass
class BuildResult:
    plan: BuildPlan
    folder: Path
    manifest: Manifest
    skipped: bool  # the folder was already there, up to date
    programs: dict[str, str]  # name -> "compiled" or "reused" (from the store); {} if skipped
    # How a skipped build was found up to date: "digest" (its manifest's lowering digest is
    # this code's: its program ids are known without lowering) or "lowering" (its programs
    # lowered, their ids compared); None when built.
    found_by: str | None = None


def compiler_fingerprint(target: Target) -> str:
    """What besides a lowered module decides its executable: the compiler's versions and the
    target (with its host layout, or its GPU target config's digest). The model's code is not
    part of it: the lowered module is (`aot.building.store.program_id`), so an edit that lowers to the
    same module reuses its program."""
    versions_text = "|".join(f"{k}={v}" for k, v in sorted(installed_versions().items()))
    hosts = f"|hosts={target.chips_per_host}" if target.chips_per_host else ""
    # A deviceless GPU target is its config: an edited or re-captured one is another target.
    config = f"|gpu_config={target.config_digest}" if target.config_digest else ""
    return f"{versions_text}|{target.name}{hosts}{config}"


@dataclasses.dataclass
class CallLedger:
    """What one `aot build` call knows of its builds: each plan's programs, lowered once (the
    up-to-date checks, --jobs and the build all read them), and the programs it has compiled
    (by store id), here or in its workers (--jobs): with --force each is still compiled once per
    call, and the first build that has it reports it `compiled`, the others `reused`."""

    force: bool = False
    signer: SigningKey | None = None  # --sign-key: signs each manifest and store entry
    # --policy: its memory budget decides which weights are transient (wan.residency.plan)
    policy: check.Policy = dataclasses.field(default_factory=check.load_policy)
    compiled: set[str] = dataclasses.field(default_factory=set)
    reported: set[str] = dataclasses.field(default_factory=set)
    lowerings: dict[BuildKey, list[tuple[LoweredProgram, str]]] = dataclasses.field(
        default_factory=dict
    )
    # Each lowering's `aot.building.sources.lowering_digest`, taken before it
    digests: dict[BuildKey, str | None] = dataclasses.field(default_factory=dict)

    def lowered(self, plan: BuildPlan) -> list[tuple[LoweredProgram, str]]:
        """The programs of `plan`, lowered (once per call), each with its store id."""
        if plan.key not in self.lowerings:
            self.digests[plan.key] = sources.lowering_digest()
            fingerprint = compiler_fingerprint(plan.target)
            self.lowerings[plan.key] = [
                (lowered, store.program_id(lowered, fingerprint)) for lowered in lower_plan(plan)
            ]
        return self.lowerings[plan.key]

    def replace(self, pid: str) -> bool:
        """Whether the store's entry `pid` is to be compiled again (--force, once per call)."""
        return self.force and pid not in self.compiled

    def status(self, pid: str, compiled_now: bool) -> str:
        if compiled_now:
            self.compiled.add(pid)
        fresh = pid in self.compiled and pid not in self.reported
        self.reported.add(pid)
        return "compiled" if fresh else "reused"


def build(
    plan: BuildPlan,
    out_root: Path,
    ledger: CallLedger | None = None,
    progress: Callable[[str], None] | None = None,
) -> BuildResult:
    """Make (or reuse) the build folder of `plan`. Atomic: the folder appears complete or not
    at all; a lock keeps two builds of one key apart, and the store's lock keeps `aot gc` out.
    An existing folder of that name is replaced only when aot wrote it (`build_files`). Builds
    of one call share a `ledger` (which also says --force)."""
    ledger = ledger if ledger is not None else CallLedger()
    if done := up_to_date(plan, out_root, ledger):
        return done  # found without writing anything: --out may be read-only
    folder = out_root / plan.key.folder_name()
    check_out(out_root)
    check_replaceable(folder)  # before anything is compiled
    with store.building(out_root), locked(out_root / store.LOCKS / f"{folder.name}.lock"):
        if done := up_to_date(plan, out_root, ledger):
            return done  # made meanwhile
        store.remove_leftovers(out_root, folder.name)
        fingerprint = compiler_fingerprint(plan.target)
        with atomic_folder(
            folder, out_root / f".tmp-{folder.name}-{os.getpid()}", build_files
        ) as tmp:
            manifest, statuses = _compile_all(plan, tmp, out_root, fingerprint, ledger, progress)
            manifest.write(tmp)
            if ledger.signer is not None:
                signing.sign(tmp / MANIFEST, ledger.signer)
    return BuildResult(plan, folder, manifest, skipped=False, programs=statuses)


def up_to_date(plan: BuildPlan, out_root: Path, ledger: CallLedger) -> BuildResult | None:
    """The result of `plan` when its build is already in `out_root` (never with --force)."""
    if ledger.force:
        return None
    if (existing := existing_build(out_root, plan, ledger)) is None:
        return None
    manifest, found_by = existing
    folder = out_root / plan.key.folder_name()
    return BuildResult(plan, folder, manifest, skipped=True, programs={}, found_by=found_by)


def existing_build(
    out_root: Path, plan: BuildPlan, ledger: CallLedger
) -> tuple[Manifest, str] | None:
    """The build of this key in `out_root`, if it was made from the same model config and
    compiler, its files are whole (size, sha256) and it holds the programs `plan` lowers to now
    (their store ids: a change to the model's code that changes a program is not up to date);
    and how that was found (`BuildResult.found_by`). The programs are lowered only when the
    manifest's lowering digest is not this process's (`aot.building.sources.lowering_digest`:
    equal digests lower to equal programs), or it records none (an older aot's)."""
    folder = out_root / plan.key.folder_name()
    if not (folder / MANIFEST).is_file():
        return None
    try:
        signer = ledger.signer  # with --sign-key, only a build signed by that key is up to date
        manifest = (
            read_signed_manifest(folder, [signer.public]) if signer else read_manifest(folder)
        )
        ok = (
            manifest.key == plan.key
            and manifest.model_hash == plan.config.hash()
            and manifest.compiler_fingerprint == compiler_fingerprint(plan.target)
        )
        if ok:
            verify_files(folder, manifest)
            digest = manifest.lowering_digest
            found_by = "digest" if digest and digest == sources.lowering_digest() else "lowering"
            ok = (
                found_by == "digest"
                or {name: p.program_id for name, p in manifest.programs.items()}
                == {lowered.program.name: pid for lowered, pid in ledger.lowered(plan)}
            ) and manifest.placement == _placement(plan, manifest.programs, ledger)[0]
    except ArtifactError:
        return None
    return (manifest, found_by) if ok else None


def _placement(
    plan: BuildPlan, entries: dict[str, ProgramEntry], ledger: CallLedger
) -> tuple[dict[str, str], dict[str, int]]:
    """(where the runtime keeps each component, its bytes per device): the placement that
    brings the resident peak under the call's policy's budget (wan.residency.plan)."""
    weights = {
        c: entries[interface.first_program_taking(c, plan.key.programs)].param_bytes
        for c in interface.components(plan.config.num_experts, plan.key.programs)
    }
    budget = ledger.policy.memory_rule(plan.key.target).budget(plan.target.hbm_bytes)
    return residency.plan(plan.key.programs, program_memory(entries), weights, budget), weights


def check_replaceable(folder: Path) -> None:
    """`folder` is absent or a build folder aot wrote (`build_files`)."""
    if os.path.lexists(folder):
        build_files(folder)


def build_files(folder: Path) -> list[str]:
    """The files of build folder `folder` when aot build wrote it (this version or an older one):
    a manifest that reads and nothing but the files it lists; else an error that says what to
    move away."""
    try:
        files = listed_files(folder)
    except ArtifactError:
        raise BuildError(
            f"{folder} exists but is not a build (no readable {MANIFEST}): move it away, or "
            "choose another --out"
        ) from None
    return owned_files(folder, {MANIFEST, signing.signature_path(Path(MANIFEST)).name, *files})


def _compile_all(
    plan: BuildPlan,
    folder: Path,
    out_root: Path,
    fingerprint: str,
    ledger: CallLedger,
    progress: Callable[[str], None] | None,
) -> tuple[Manifest, dict[str, str]]:
    """The manifest of `plan` with its programs' files in `folder`, each compiled unless the
    store of `out_root` has it (--force: unless this call compiled it); and each program's
    status."""
    entries: dict[str, ProgramEntry] = {}
    statuses: dict[str, str] = {}
    lowered_programs = ledger.lowered(plan)
    for index, (lowered, pid) in enumerate(lowered_programs, 1):
        program = lowered.program
        label = f"[{index}/{len(lowered_programs)}] {plan.key.folder_name()} {program.name}"
        entry, stored, reused = store_program(
            plan, lowered, out_root, pid, ledger.replace(pid), label, progress, ledger.signer
        )
        store.link_files(entry, stored, folder)
        entries[program.name] = dataclasses.replace(entry, program_id=pid)
        statuses[program.name] = ledger.status(pid, compiled_now=not reused)
        if reused and progress is not None:
            by_worker = statuses[program.name] == "compiled"
            progress(f"{label} {'compiled by a worker' if by_worker else 'reused'}")
    return _manifest(plan, entries, fingerprint, ledger), statuses


def _manifest(
    plan: BuildPlan, entries: dict[str, ProgramEntry], fingerprint: str, ledger: CallLedger
) -> Manifest:
    """The build's manifest: its programs' entries, the devices, the placement of its weights
    and the resident peak that makes (wan.residency)."""
    devs = devices(plan.target)  # both meshes lay the devices out in this order
    process_count, local_device_count = host_layout(devs)
    notes = []
    layout = plan.sharding_plan
    if layout.vae_layout.padded:
        notes.append(
            f"VAE: neither latent dimension divides vae_spatial={layout.vae_mesh[1]}; width is "
            "sharded unevenly (XLA pads it)"
        )
    placement, weights = _placement(plan, entries, ledger)
    memory = program_memory(entries)
    peak, at = residency.resident_peak(plan.key.programs, memory, weights, placement)
    return Manifest(
        schema_version=SCHEMA_VERSION,
        key=plan.key,
        model_config=plan.config.to_dict(),
        model_hash=plan.config.hash(),
        versions=installed_versions(),
        compiler_fingerprint=fingerprint,
        platform=devs[0].platform,
        device_kind=devs[0].device_kind,
        device_ids=[d.id for d in devs],
        process_count=process_count,
        local_device_count=local_device_count,
        mesh_axes=dict(plan.mesh.items()),
        default_mesh=plan.default_mesh,
        vae_mesh_axes=dict(zip(sharding.VAE_AXES, layout.vae_mesh, strict=True)),
        hbm_bytes=plan.target.hbm_bytes,
        peak_flops=peak_flops(plan.target, devs[0].device_kind),
        peak_8bit_flops=plan.target.chip.peak_8bit if plan.target.chip else None,
        fps=plan.config.fps,
        ulysses_all_to_alls=ulysses_all_to_alls(plan),
        notes=notes,
        programs=entries,
        weight_bytes=weights,
        placement=placement,
        resident_peak_bytes=peak,
        resident_peak_program=at,
        signed_by=ledger.signer.key_id if ledger.signer else None,
        lowering_digest=_lowering_digest(plan, ledger),
    )


def _lowering_digest(plan: BuildPlan, ledger: CallLedger) -> str | None:
    """The lowering digest of the programs of `plan` the ledger lowered: taken before and
    after their lowering (and compiles), None unless both agree (a file changed since this
    process started, a jax flag set meanwhile)."""
    before = ledger.digests.get(plan.key)
    return before if before is not None and before == sources.lowering_digest() else None


def store_program(
    plan: BuildPlan,
    lowered: LoweredProgram,
    out_root: Path,
    pid: str,
    replace: bool,
    label: str,
    progress: Callable[[str], None] | None,
    signer: SigningKey | None = None,
) -> tuple[ProgramEntry, Path, bool]:
    """The store's entry `pid` of `out_root` for `lowered`, compiled unless there and sound
    (and signed by `signer`, if any; or with `replace`): (manifest entry, its store folder,
    whether it was there)."""
    make = functools.partial(_make_program, plan, lowered, label, progress)

    def damaged(why: str) -> None:
        if progress is not None:
            progress(f"{label} stored entry damaged, recompiling ({why})")

    return store.fetch_or_make(out_root, pid, make, replace, damaged, signer)


def _make_program(
    plan: BuildPlan,
    lowered: LoweredProgram,
    label: str,
    progress: Callable[[str], None] | None,
    folder: Path,
) -> ProgramEntry:
    """Compile `lowered` and write its files into `folder`: its manifest entry. Compiled
    afresh: an executable JAX's persistent compilation cache (JAX_COMPILATION_CACHE_DIR) hands
    back serializes without its code on XLA's CPU client (loading it fails: "Function ... not
    found"), so this process does not use the cache (aot's store is its cache)."""
    jax.config.update("jax_enable_compilation_cache", False)
    compiled, seconds, rss = compile_lowered(lowered, label, progress)
    return program_entry(plan, folder, lowered, compiled, seconds, rss)
