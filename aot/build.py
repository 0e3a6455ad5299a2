"""Lower, compile, analyse and serialise one build: the four programs of one (model, video
shape, target, mesh). Abstract inputs only: no weights, no arrays, no target hardware."""

from __future__ import annotations

import dataclasses
import functools
import gzip
import hashlib
import math
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

import jax

from aot import hlo, hlo_cost, store, vae_gathers
from aot.targets import SPLASH_BLOCKS, VAE_VMEM_MIB, Target, devices, peak_flops
from runtime.artifact import (
    MANIFEST,
    SCHEMA_VERSION,
    ArraySpec,
    ArtifactError,
    BuildKey,
    Manifest,
    ProgramEntry,
    dump_executable,
    file_entry,
    read_manifest,
    verify_files,
)
from runtime.loader import host_layout, installed_versions
from wan import attention as attention_lib
from wan import interface, sharding
from wan import programs as wan_programs
from wan.atomic import atomic_folder, locked, owned_files
from wan.configs import ModelConfig, VideoShape
from wan.errors import InputError

# Test hook: kill the process right after this program's files are written.
KILL_AFTER_ENV = "AOT_TEST_KILL_AFTER"
BLOCKWISE_MIN_TOKENS = 8192  # above this, naive attention's temporaries dominate memory
# Bounds of a request, far above any WAN use (720p, 81 frames: 75,600 tokens a video), so that
# a mistyped size is a one-line error before anything is traced or allocated.
MAX_SIDE = 8192  # pixels
MAX_FRAMES = 1025
MAX_BATCH = 1024
MAX_STEP_TOKENS = 1 << 24  # video tokens of one denoise step, over its whole (CFG) batch
MAX_MODEL_NAME = 100  # characters: the model's name starts each build folder's name


class BuildError(InputError):
    """A build request that cannot be satisfied; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class BuildPlan:
    """Everything one build is made from; `key` names its folder."""

    config: ModelConfig
    shape: VideoShape
    target: Target
    sharding_plan: sharding.ShardingPlan
    attention: str
    key: BuildKey
    default_mesh: bool  # the mesh is the one chosen without --mesh (the runtime prefers it)

    @property
    def mesh(self) -> sharding.MeshShape:
        """The transformer mesh."""
        return self.sharding_plan.transformer


@dataclasses.dataclass
class BuildResult:
    plan: BuildPlan
    folder: Path
    manifest: Manifest
    skipped: bool  # the folder was already there, up to date
    programs: dict[str, str]  # name -> "compiled" or "reused" (from the store); {} if skipped


def plan_build(
    model_name: str,
    config: ModelConfig,
    shape: VideoShape,
    target: Target,
    num_devices: int,
    mesh: sharding.MeshShape | None = None,
    vae_spatial: int | None = None,
    attention: str | None = None,
    context_parallel: str | None = None,
    vae_vmem_mib: int | None = None,
) -> BuildPlan:
    """Validate a request and resolve its defaults (mesh, VAE mesh and axis, attention, context
    parallelism, the VAE decode's scoped VMEM)."""
    check_model_name(model_name)
    check_shape(config, shape)
    default = sharding.default_mesh(
        num_devices, shape.step_batch, transformer_bytes(config), target.hbm_bytes
    )
    mesh = mesh or default
    if mesh.size != num_devices:
        raise BuildError(
            f"mesh {_mesh_text(mesh)} has {mesh.size} devices but target {target.name} has {num_devices}"
        )
    if shape.step_batch % mesh.data:
        raise BuildError(
            f"step batch {shape.step_batch} ({'2 x ' if shape.cfg else ''}--batch {shape.batch}) is not "
            f"divisible by data = {mesh.data}: change --batch or --mesh"
        )
    try:
        layout = sharding.ShardingPlan.choose(mesh, shape.latent_shape(config), vae_spatial)
    except ValueError as e:
        raise BuildError(str(e)) from None
    attention = choose_attention(attention, target, shape.tokens(config))
    context_parallel = choose_context_parallel(context_parallel, config, shape, mesh)
    key = BuildKey(
        model=model_name,
        width=shape.width,
        height=shape.height,
        frames=shape.frames,
        batch=shape.batch,
        cfg=shape.cfg,
        target=target.name,
        mesh=mesh.items(),
        vae_mesh=layout.vae_mesh,
        vae_axis=layout.vae_layout.axis,
        attention=attention,
        context_parallel=context_parallel,
        vae_vmem_mib=choose_vae_vmem(vae_vmem_mib, target),
    )
    return BuildPlan(config, shape, target, layout, attention, key, mesh == default)


def check_model_name(name: str) -> None:
    """A model name that can start a visible folder's name: not hidden (a leading '.', which
    `aot list`, `runtime run` and `aot gc` pass over), not an option (a leading '-'), no
    separator or control character."""
    bad = (
        not name
        or name[0] in ".-"
        or len(name) > MAX_MODEL_NAME
        or any(c in "/\\" or not c.isprintable() for c in name)
    )
    if bad:
        raise BuildError(
            f"--model {name!r}: a model's name starts the names of its build folders, so it must "
            "not start with '.' (hidden from `aot list` and `runtime run`) or '-', nor hold a "
            f"separator or control character, and must be at most {MAX_MODEL_NAME} characters: "
            "rename the model's folder"
        )


def check_shape(config: ModelConfig, shape: VideoShape) -> None:
    """A video shape the model can make, within the bounds of what a build can serve."""
    if not (0 < shape.width <= MAX_SIDE and 0 < shape.height <= MAX_SIDE):
        raise BuildError(
            f"resolution {shape.width}x{shape.height}: width and height must be 1-{MAX_SIDE} pixels"
        )
    if not 0 < shape.frames <= MAX_FRAMES:
        raise BuildError(f"--frames {shape.frames}: frames must be 1-{MAX_FRAMES}")
    if not 0 < shape.batch <= MAX_BATCH:
        raise BuildError(f"--batch {shape.batch}: batch must be 1-{MAX_BATCH}")
    factor = config.vae.spatial_factor * config.transformer.patch_size[1]
    if shape.width % factor or shape.height % factor:
        raise BuildError(
            f"resolution {shape.width}x{shape.height}: width and height must be positive multiples of {factor}"
        )
    tf = config.vae.temporal_factor
    if (shape.frames - 1) % tf:
        raise BuildError(f"--frames {shape.frames}: frames must be {tf}k+1 (e.g. 9, 17, 81)")
    if (tokens := shape.tokens(config) * shape.step_batch) > MAX_STEP_TOKENS:
        raise BuildError(
            f"{shape.width}x{shape.height}, {shape.frames} frames, step batch {shape.step_batch}: "
            f"{tokens} video tokens per denoise step, over the bound of {MAX_STEP_TOKENS}: "
            "use a smaller --res, --frames or --batch"
        )


def choose_attention(requested: str | None, target: Target, tokens: int) -> str:
    """The attention kernel of a build, with its block sizes: `auto` (None) is dot for short
    sequences, else the target's flash kernel (splash on TPU, cuDNN on GPU, blockwise on CPU)."""
    platform = target_platform(target)
    if requested is None:
        requested = (
            "dot"
            if tokens <= BLOCKWISE_MIN_TOKENS
            else {"tpu": "splash", "gpu": "cudnn"}.get(platform, "blockwise")
        )
    kernel = attention_lib.kernel_name(requested)
    runs_on = {"splash": "tpu", "cudnn": "gpu"}.get(kernel, platform)
    if runs_on != platform:
        raise BuildError(
            f"--attention {requested}: {kernel} runs on {runs_on} targets, {target.name} is "
            f"{platform}: use blockwise or dot"
        )
    if requested == "splash":
        requested = "splash:" + ":".join(map(str, SPLASH_BLOCKS[target.generation]))
    try:
        attention_lib.resolve(requested)
    except ValueError as e:
        raise BuildError(str(e)) from None
    return requested


def choose_context_parallel(
    requested: str | None,
    config: ModelConfig,
    shape: VideoShape,
    mesh: sharding.MeshShape,
) -> str:
    """`ulysses` where the heads per device divide over the sequence shards, else `gather`."""
    shards, local_heads = _query_layout(config, shape, mesh)
    if requested is None:
        return "ulysses" if shards > 1 and local_heads % shards == 0 else "gather"
    if requested not in attention_lib.CONTEXT_PARALLEL:
        raise BuildError(f"--context-parallel {requested}: use gather or ulysses")
    if requested == "ulysses" and local_heads % shards:
        raise BuildError(
            f"--context-parallel ulysses: {local_heads} heads per device do not divide over "
            f"{shards} sequence shards (mesh {_mesh_text(mesh)}): use gather or another --mesh"
        )
    return requested


def parse_vae_vmem(text: str) -> int | None:
    """`--vae-vmem` as choose_vae_vmem takes it: auto -> None, default -> 0, N -> N."""
    if text == "auto":
        return None
    if text == "default":
        return 0
    if not (text.isdigit() and len(text) <= 6):
        raise BuildError(f"--vae-vmem {text}: use auto, default or a number of MiB")
    return int(text)


def choose_vae_vmem(requested: int | None, target: Target) -> int | None:
    """MiB of scoped VMEM the VAE decode is compiled for (TPU only): auto (None) is
    VAE_VMEM_MIB, 0 the compiler's default."""
    platform = target_platform(target)
    if platform != "tpu":
        if requested:
            raise BuildError(
                f"--vae-vmem {requested}: scoped VMEM is a TPU compiler setting, {target.name} is "
                f"{platform}: leave it out"
            )
        return None
    if requested is None:
        return VAE_VMEM_MIB
    if not 0 <= requested <= 128:
        raise BuildError(f"--vae-vmem {requested}: use 1-128 MiB, or 0 for the compiler's default")
    return requested or None


def compiler_options(plan: BuildPlan, program_name: str) -> dict[str, Any]:
    """The XLA options one program of `plan` compiles with (part of its identity in the store)."""
    if program_name == "vae_decode" and plan.key.vae_vmem_mib:
        return {"xla_tpu_scoped_vmem_limit_kib": plan.key.vae_vmem_mib * 1024}
    return {}


def ulysses_all_to_alls(plan: BuildPlan) -> int:
    """All-to-alls per denoise step the Ulysses design puts there: q, k, v in and the output
    back, in each layer's self-attention (none when the sequence is not sharded)."""
    shards, _ = _query_layout(plan.config, plan.shape, plan.mesh)
    ulysses = plan.key.context_parallel == "ulysses" and shards > 1
    return 4 * plan.config.transformer.num_layers if ulysses else 0


def kernel_flops(plan: BuildPlan) -> float:
    """FLOPs per device per denoise step of the attention kernels that the HLO counts as opaque
    custom calls (splash, cuDNN): self- and cross-attention of every layer; 0 for XLA kernels."""
    if attention_lib.kernel_name(plan.attention) in attention_lib.PARTITIONABLE:
        return 0.0
    tc = plan.config.transformer
    spec, mesh_shape = _query_spec(plan.config, plan.shape, plan.mesh)
    q_shape = _query_shape(plan.config, plan.shape)
    per_layer = attention_lib.flops(q_shape, q_shape[1]) + attention_lib.flops(
        q_shape, plan.config.text_encoder.max_length
    )
    split = math.prod(mesh_shape[a] for entry in spec for a in attention_lib.spec_axes(entry))
    return per_layer * tc.num_layers / split


def _query_shape(config: ModelConfig, shape: VideoShape) -> tuple[int, ...]:
    tc = config.transformer
    return (shape.step_batch, shape.tokens(config), tc.num_attention_heads, tc.attention_head_dim)


def _query_spec(
    config: ModelConfig, shape: VideoShape, mesh: sharding.MeshShape
) -> tuple[jax.sharding.PartitionSpec, dict[str, int]]:
    """How a denoise step lays out its self-attention queries, and the mesh's sizes."""
    mesh_shape = dict(mesh.items())
    spec = sharding.logical_to_spec(
        attention_lib.Q_AXES, _query_shape(config, shape), mesh_shape, sharding.TRANSFORMER_RULES
    )
    return spec, mesh_shape


def _query_layout(
    config: ModelConfig, shape: VideoShape, mesh: sharding.MeshShape
) -> tuple[int, int]:
    """(sequence shards, heads per device) of the self-attention queries of a denoise step."""
    spec, mesh_shape = _query_spec(config, shape, mesh)
    return attention_lib.sequence_layout(spec, mesh_shape, config.transformer.num_attention_heads)


def target_platform(target: Target) -> str:
    """cpu, tpu or gpu: what the target's devices are (`current`: this machine's)."""
    return devices(target)[0].platform if target.platform == "current" else target.platform


def _mesh_text(mesh: sharding.MeshShape) -> str:
    return ",".join(f"{a}={n}" for a, n in mesh.items())


@functools.cache
def transformer_bytes(config: ModelConfig) -> int:
    """Bytes of one transformer's weights (one expert's), from its abstract state."""
    _, params, _ = wan_programs.split_abstract(wan_programs.abstract_module(config, "transformer"))
    return sum(math.prod(p.shape) * p.dtype.itemsize for p in jax.tree.leaves(params))


def compiler_fingerprint(target: Target) -> str:
    """What besides the key decides the executables: compiler versions, target, and the model
    code that is lowered (a change to wan/ must not reuse a stale build)."""
    versions_text = "|".join(f"{k}={v}" for k, v in sorted(installed_versions().items()))
    hosts = f"|hosts={target.chips_per_host}" if target.chips_per_host else ""
    return f"{versions_text}|{target.name}{hosts}|code={model_code_hash()}"


@functools.cache
def model_code_hash() -> str:
    digest = hashlib.sha256()
    package = Path(wan_programs.__file__).parent
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + path.read_bytes())
    return digest.hexdigest()[:16]


# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class CallLedger:
    """The programs one `aot build` call has compiled (by store id), here or in its workers
    (--jobs): with --force each is still compiled once per call, and the first build that has
    it reports it `compiled`, the others `reused`."""

    force: bool = False
    compiled: set[str] = dataclasses.field(default_factory=set)
    reported: set[str] = dataclasses.field(default_factory=set)

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
    return BuildResult(plan, folder, manifest, skipped=False, programs=statuses)


def up_to_date(plan: BuildPlan, out_root: Path, ledger: CallLedger) -> BuildResult | None:
    """The result of `plan` when its build is already in `out_root` (never with --force)."""
    if ledger.force:
        return None
    existing = existing_build(out_root, plan, compiler_fingerprint(plan.target))
    folder = out_root / plan.key.folder_name()
    return BuildResult(plan, folder, existing, skipped=True, programs={}) if existing else None


def existing_build(out_root: Path, plan: BuildPlan, fingerprint: str) -> Manifest | None:
    """The build of this key in `out_root`, if it was made from the same model config and
    compiler and its files are whole (size, sha256)."""
    folder = out_root / plan.key.folder_name()
    if not (folder / MANIFEST).is_file():
        return None
    try:
        manifest = read_manifest(folder)
        ok = (
            manifest.key == plan.key
            and manifest.model_hash == plan.config.hash()
            and manifest.compiler_fingerprint == fingerprint
        )
        if ok:
            verify_files(folder, manifest)
    except ArtifactError:
        return None
    return manifest if ok else None


def check_out(out_root: Path) -> None:
    """`--out` is a folder, or a path where one can be made (no file on or above it)."""
    for path in (out_root, *out_root.parents):
        if path.exists():
            if not path.is_dir():
                raise BuildError(f"--out {out_root}: {path} is not a folder: choose another --out")
            return


def check_replaceable(folder: Path) -> None:
    """`folder` is absent or a build folder aot wrote (`build_files`)."""
    if os.path.lexists(folder):
        build_files(folder)


def build_files(folder: Path) -> list[str]:
    """The files of build folder `folder` when aot build wrote it: a manifest that reads and
    nothing but the files it lists; else an error that says what to move away."""
    try:
        manifest = read_manifest(folder)
    except ArtifactError:
        raise BuildError(
            f"{folder} exists but is not a build (no readable {MANIFEST}): move it away, or "
            "choose another --out"
        ) from None
    files = (f.path for p in manifest.programs.values() for f in (p.executable, p.hlo))
    return owned_files(folder, {MANIFEST, *(f for f in files if isinstance(f, str))})


@dataclasses.dataclass(frozen=True)
class LoweredProgram:
    """One program of a build, lowered for its mesh, and the XLA options it compiles with."""

    program: wan_programs.Program
    lowered: jax.stages.Lowered
    mesh: jax.sharding.Mesh
    options: dict[str, Any]

    def compile(self) -> Any:
        return self.lowered.compile(compiler_options=self.options or None)


def lower_plan(
    plan: BuildPlan, frames_dtype: str = "uint8", only: Collection[str] | None = None
) -> Iterator[LoweredProgram]:
    """Lower the programs of `plan` (or those named in `only`) one by one."""
    devs = devices(plan.target)
    layout = plan.sharding_plan
    meshes = layout.meshes(devs)
    progs = wan_programs.programs(
        plan.config,
        plan.shape,
        plan.attention,
        frames_dtype,
        layout.gather_latents,
        plan.key.context_parallel,
    )
    processes = host_layout(devs)[0]
    for program in (p for p in progs if only is None or p.name in only):
        mesh = meshes[program.mesh]
        lowered = lower_program(
            program,
            mesh,
            *layout.rules(program.mesh),
            placed=layout.placed(program.name, meshes),
            replicated_out=layout.replicated_outputs(program.name, processes),
        )
        yield LoweredProgram(program, lowered, mesh, compiler_options(plan, program.name))


def compile_plan(
    plan: BuildPlan,
    progress: Callable[[str], None] | None = None,
    frames_dtype: str = "uint8",
    only: Collection[str] | None = None,
) -> Iterator[tuple[wan_programs.Program, Any, jax.sharding.Mesh, float, int]]:
    """Compile the programs of `plan` (or those named in `only`) one by one: (program,
    compiled, mesh, seconds, peak RSS)."""
    for lowered in lower_plan(plan, frames_dtype, only):
        name = lowered.program.name
        compiled, seconds, rss = _compile(lowered, f"{plan.key.folder_name()} {name}", progress)
        yield lowered.program, compiled, lowered.mesh, seconds, rss


def _compile(
    lowered: LoweredProgram, label: str, progress: Callable[[str], None] | None
) -> tuple[Any, float, int]:
    """(compiled, seconds, peak RSS), with a live progress line; XLA's refusal is a
    BuildError."""
    with _Ticker(label, progress), RssSampler() as rss:
        start = time.perf_counter()
        try:
            compiled = lowered.compile()
        except jax.errors.JaxRuntimeError as e:
            raise BuildError(compile_failure(lowered.program.name, str(e))) from None
        seconds = time.perf_counter() - start
    return compiled, seconds, rss.peak


# What to change when a program does not fit the target's on-chip memory (VMEM).
_VMEM_HINTS = {
    "vae_decode": "a smaller --vae-vmem",
    "denoise_step": "smaller --attention splash blocks (e.g. splash:1024:1024:512)",
}


def compile_failure(program: str, message: str) -> str:
    """One line for XLA's refusal to compile `program`: its status, the sentence that says
    what overflowed, and what to change."""
    first = next((line.strip() for line in message.splitlines() if line.strip()), "no message")
    overflow = re.search(
        r"(Scoped allocation with size \S+ and limit \S+|Used \S+ of \S+ vmem)", message
    )
    if overflow is None:
        return f"{program} does not compile for this target ({first})"
    status = first.split(":")[0]
    hint = f"; try {_VMEM_HINTS[program]}" if program in _VMEM_HINTS else ""
    return f"{program} does not compile for this target ({status}: {overflow.group(1)}){hint}"


def compile_in_process(plan: BuildPlan, frames_dtype: str = "uint8") -> dict[str, Any]:
    """The executables of `plan`, compiled here and kept in memory (plain jit, no artifacts)."""
    return {p.name: compiled for p, compiled, *_ in compile_plan(plan, frames_dtype=frames_dtype)}


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
    lowered_programs = list(lower_plan(plan))
    for index, lowered in enumerate(lowered_programs, 1):
        program = lowered.program
        label = f"[{index}/{len(lowered_programs)}] {plan.key.folder_name()} {program.name}"
        pid = store.program_id(lowered, fingerprint)
        entry, stored, reused = store_program(
            plan, lowered, out_root, pid, ledger.replace(pid), label, progress
        )
        store.link_files(entry, stored, folder)
        entries[program.name] = entry
        statuses[program.name] = ledger.status(pid, compiled_now=not reused)
        if reused and progress is not None:
            by_worker = statuses[program.name] == "compiled"
            progress(f"{label} {'compiled by a worker' if by_worker else 'reused'}")
        if os.environ.get(KILL_AFTER_ENV) == program.name:
            os.kill(os.getpid(), signal.SIGKILL)
    devs = devices(plan.target)  # both meshes lay the devices out in this order
    process_count, local_device_count = host_layout(devs)
    notes = []
    layout = plan.sharding_plan
    if layout.vae_layout.padded:
        notes.append(
            f"VAE: neither latent dimension divides vae_spatial={layout.vae_mesh[1]}; width is "
            "sharded unevenly (XLA pads it)"
        )
    manifest = Manifest(
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
        ulysses_all_to_alls=ulysses_all_to_alls(plan),
        notes=notes,
        programs=entries,
    )
    return manifest, statuses


def store_program(
    plan: BuildPlan,
    lowered: LoweredProgram,
    out_root: Path,
    pid: str,
    replace: bool,
    label: str,
    progress: Callable[[str], None] | None,
) -> tuple[ProgramEntry, Path, bool]:
    """The store's entry `pid` of `out_root` for `lowered`, compiled unless there and sound (or
    with `replace`): (manifest entry, its store folder, whether it was there)."""
    make = functools.partial(_make_program, plan, lowered, label, progress)

    def damaged(why: str) -> None:
        if progress is not None:
            progress(f"{label} stored entry damaged, recompiling ({why})")

    return store.fetch_or_make(out_root, pid, make, replace=replace, damaged=damaged)


def _make_program(
    plan: BuildPlan,
    lowered: LoweredProgram,
    label: str,
    progress: Callable[[str], None] | None,
    folder: Path,
) -> ProgramEntry:
    """Compile `lowered` and write its files into `folder`: its manifest entry."""
    compiled, seconds, rss = _compile(lowered, label, progress)
    entry = _write_program(folder, lowered, compiled, seconds, rss)
    if lowered.program.name == "denoise_step":
        entry.kernel_flops = kernel_flops(plan)
    return entry


def compile_program(*args: Any, **kwargs: Any) -> Any:
    """`lower_program(*args, **kwargs)`, compiled."""
    return lower_program(*args, **kwargs).compile()


def lower_program(
    program: wan_programs.Program,
    mesh: jax.sharding.Mesh,
    rules: sharding.Rules,
    uneven: frozenset[str] = frozenset(),
    placed: dict[str, jax.sharding.Sharding] | None = None,
    replicated_out: bool = False,
) -> jax.stages.Lowered:
    """Lower `program` for `mesh` under `rules` (abstract inputs only). `placed`: inputs (by
    name) that arrive with a given sharding, as another program leaves them."""
    placed = placed or {}
    in_shardings = tuple(
        placed[name]
        if name in placed
        else wan_programs.shardings(mesh, a, program.arg_axes[name], rules)
        for name, a in program.args.items()
    )
    out_shapes = jax.eval_shape(program.fn, *program.args.values())
    out_axes = (
        jax.tree.map(lambda s: (None,) * len(s.shape), out_shapes)
        if replicated_out
        else program.out_axes
    )
    out_shardings = wan_programs.shardings(mesh, out_shapes, out_axes, rules)
    # keep_unused: every executable takes its whole parameter tree (kv_cache reads a few of the
    # transformer's weights), so all programs of a component share one placed copy.
    # A fresh function per call: the rules are read while tracing, and jax would reuse a trace
    # of the same function made under other rules.
    jitted = jax.jit(
        lambda *args: program.fn(*args),
        in_shardings=in_shardings,
        out_shardings=out_shardings,
        keep_unused=True,
        donate_argnums=program.donate_argnums,
    )
    with jax.set_mesh(mesh), sharding.axis_rules(rules, uneven):
        return jitted.lower(*program.args.values())


def _write_program(
    folder: Path, lowered: LoweredProgram, compiled: Any, seconds: float, rss: int
) -> ProgramEntry:
    program = lowered.program
    device_ids = [d.id for d in lowered.mesh.devices.flat]
    executable, hlo_text = store.program_files(program.name)
    (folder / executable).write_bytes(dump_executable(compiled, device_ids))
    text = compiled.as_text()
    with gzip.open(folder / hlo_text, "wt") as f:
        f.write(text)
    module = hlo.parse(text)
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, list):
        cost = cost[0] if cost else {}
    return ProgramEntry(
        name=program.name,
        executable=file_entry(folder, executable),
        hlo=file_entry(folder, hlo_text),
        input_names=list(program.args),
        output_names=list(program.out_axes),
        inputs=_array_specs(
            interface.named(program.name, compiled.args_info[0]),
            interface.named(program.name, compiled.input_shardings[0]),
        ),
        outputs=_array_specs(
            jax.eval_shape(program.fn, *program.args.values()), compiled.output_shardings
        ),
        compile_seconds=round(seconds, 3),
        compiler_options=lowered.options,
        replicated_param_bytes=replicated_param_bytes(program.name, compiled),
        peak_rss_bytes=rss,
        memory=memory_stats(compiled),
        flops=hlo_cost.flops(module),
        xla_flops=float(cost.get("flops", 0.0)),
        collectives=hlo.collective_summary(module),
        gathered_bytes_per_latent_frame=(
            vae_gathers.gathers(module).per_latent_frame if program.name == "vae_decode" else None
        ),
    )


def replicated_param_bytes(program_name: str, compiled: Any) -> int:
    """Bytes per device of the weights that a multi-device program keeps whole on every device
    (as MaxText's check for insufficiently sharded parameters reports them)."""
    args = interface.named(program_name, compiled.args_info[0])
    shardings = interface.named(program_name, compiled.input_shardings[0])
    if "params" not in args:
        return 0
    leaves = jax.tree.leaves(args["params"])
    placed = jax.tree.leaves(
        shardings["params"], is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)
    )
    return sum(
        math.prod(a.shape) * a.dtype.itemsize
        for a, s in zip(leaves, placed, strict=True)
        if len(s.device_set) > 1 and s.is_fully_replicated
    )


def _array_specs(shapes: Any, shardings: Any) -> list[ArraySpec]:
    leaves = jax.tree_util.tree_flatten_with_path(shapes)[0]
    flat_shardings = jax.tree.leaves(
        shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)
    )
    specs = []
    for (path, leaf), s in zip(leaves, flat_shardings, strict=True):
        spec = getattr(s, "spec", None)
        specs.append(
            ArraySpec(
                path=jax.tree_util.keystr(path, simple=True, separator="/"),
                shape=tuple(leaf.shape),
                dtype=str(leaf.dtype),
                sharding=str(spec) if spec is not None else str(s),
            )
        )
    return specs


def memory_stats(compiled: Any) -> dict[str, int]:
    """Per-device bytes. peak = arguments + outputs - aliased + temporaries."""
    m = compiled.memory_analysis()
    stats = {
        "argument": int(m.argument_size_in_bytes),
        "output": int(m.output_size_in_bytes),
        "alias": int(m.alias_size_in_bytes),
        "temp": int(m.temp_size_in_bytes),
        "generated_code": int(m.generated_code_size_in_bytes),
    }
    stats["peak"] = stats["argument"] + stats["output"] - stats["alias"] + stats["temp"]
    return stats


# ----------------------------------------------------------------------------------------------
# Progress and resource sampling.


class RssSampler:
    """Peak resident set size of this process while the block runs (sampled every 50 ms)."""

    def __enter__(self) -> RssSampler:
        self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Ticker:
    """A live 'name ... 12s' line while a program compiles, so a long build never looks hung."""

    def __init__(self, label: str, sink: Callable[[str], None] | None):
        self.label, self.sink = label, sink

    def __enter__(self) -> _Ticker:
        if self.sink is None:
            return self
        self.start = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        interactive = sys.stderr.isatty()
        period = 0.5 if interactive else 30.0
        self.sink(f"{self.label} compiling")
        while not self._stop.wait(period):
            self.sink(f"{self.label} compiling {time.perf_counter() - self.start:.0f}s")

    def __exit__(self, exc_type: type | None, *_: object) -> None:
        if self.sink is None:
            return
        self._stop.set()
        self._thread.join()
        outcome = "failed after" if exc_type else "done in"
        self.sink(f"{self.label} {outcome} {time.perf_counter() - self.start:.1f}s")
