"""The artifact format shared by `aot build` (writer) and the runtime (reader).

One folder per build: `manifest.json` plus, per program, the serialized executable
(`<program>.exec`) and its optimized HLO (`<program>.hlo.txt.gz`). A build folder is outside
data until checked: the manifest is read with a size bound and parsed field by field (types,
ranges, program names, device layout); every file it names is a plain name inside the folder,
not a symlink, and of its recorded size and sha256 before it is used; HLO text is
decompressed with a bound. Executables are code, so loading is ordered for safety: sha256 of
every file, then platform/devices/versions, then the device order, and only then
deserialisation (`runtime.builds.executables`). Every refusal is one `ArtifactError` line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from runtime.builds import build_options
from runtime.trust import json_checks as jc
from runtime.trust import signing
from runtime.trust.json_checks import MAX_DIM, REBUILD, ArtifactError, Check
from runtime.trust.signing import TrustedKey
from wan import interface, residency
from wan.bounded_read import Refuse, open_regular, parse_json, read_bytes, read_json
from wan.configs import VideoShape
from wan.interface import SIGNATURES, full_step

# 2: program inputs and outputs by name; 3: a pipeline variant of programs; 4: executables
# without pickle (runtime.builds.executables); 5: executables compressed, weights' placement and the
# resident peak (wan.residency); fields added since, optional: `_MANIFEST_DEFAULTS`
SCHEMA_VERSION = 5
MANIFEST = "manifest.json"

# Bounds on what a manifest may claim, far above any real build, so that a hostile value is
# refused before it reaches a read, an allocation or XLA.
MAX_MANIFEST_BYTES = 16 << 20  # real manifests: tens of KB (every array of every program)
MAX_FILE_BYTES = 4 << 30  # one executable or HLO file (real 14B executables: tens of MB)
MAX_PROCESSES = 4096  # hosts of a job (the largest TPU slices have a few thousand)
MAX_LOCAL_DEVICES = 1024  # devices of one process (TPU hosts have 4 or 8; jax takes ~10 s to
# start 4096 host CPU devices)
# Decompressed HLO text: HLO text compresses 6-16x in real builds (tiny to 14B), a gzip bomb
# ~1000x, so at most 64x the compressed file, and never over 1 GiB.
HLO_EXPANSION = 64
MAX_HLO_TEXT_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class BuildKey:
    """What a build serves. Two builds with equal keys are interchangeable."""

    model: str
    width: int
    height: int
    frames: int
    batch: int
    cfg: bool
    target: str
    mesh: tuple[tuple[str, int], ...]  # transformer mesh axes in order, e.g. (("data", 2), ...)
    vae_mesh: tuple[int, int]  # (redundant, vae_spatial)
    vae_axis: str  # "width" or "height": the VAE's sharded spatial axis, chosen once
    attention: str  # kernel and its largest blocks, e.g. "flash:3072:2048:512"
    context_parallel: str = "gather"  # or "ulysses" (wan.models.attention)
    vae_vmem_mib: int | None = None  # TPU: scoped VMEM of the VAE decode's kernels; None: XLA's
    # The plain options' values (runtime.builds.build_options.plain_options), in declaration order.
    options: tuple[tuple[str, Any], ...] = ()

    def option(self, name: str) -> Any:
        """A plain build option's value: the key's, else the option's default."""
        return dict(self.options).get(name, build_options.OPTIONS[name].default_value)

    def with_options(self, **values: Any) -> BuildKey:
        """This key with the plain options `values` changed."""
        return dataclasses.replace(self, options=plain_values({**dict(self.options), **values}))

    @property
    def programs(self) -> tuple[str, ...]:
        """The programs the build holds, in the order a generation runs them (as its plain
        options decide: runtime.builds.build_options.held_programs)."""
        return build_options.held_programs(dict(self.plain_items()))

    def plain_items(self) -> list[tuple[str, Any]]:
        """Every plain option's (name, value), defaults included, in declaration order."""
        return [(o.name, self.option(o.name)) for o in build_options.plain_options()]

    @property
    def step_program(self) -> str:
        """The program that runs a whole denoise step."""
        return full_step(self.programs)

    @property
    def shape(self) -> VideoShape:
        return VideoShape(self.width, self.height, self.frames, self.batch, self.cfg)

    def folder_name(self) -> str:
        """The shape and target, then each build option's token (runtime.builds.build_options)."""
        cfg = "" if self.cfg else "_nocfg"
        head = f"{self.model}_{self.width}x{self.height}_f{self.frames}_b{self.batch}{cfg}"
        target = self.target.replace("/", "-host")
        tokens = (option.token(self) for option in build_options.OPTIONS.values())
        return f"{head}_{target}" + "".join(tokens)

    def build_argv(self, model: str, out: str | Path) -> list[str]:
        """The `aot build` command that makes exactly this key (every option resolved, so any
        defaults of the building version give this key)."""
        return [
            "aot", "build", "--model", model, "--res", f"{self.width}x{self.height}",
            "--frames", str(self.frames), "--batch", str(self.batch), "--target", self.target,
            *([] if self.cfg else ["--no-cfg"]), *(arg for o in build_options.OPTIONS.values() for arg in o.argv(self)),
            "--out", str(out),
        ]  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        """Every field, the plain options' values among them (each option's every value)."""
        raw = dataclasses.asdict(self)
        raw["mesh"] = dict(self.mesh)
        raw["vae_mesh"] = list(self.vae_mesh)
        del raw["options"]
        return {**raw, **dict(self.plain_items())}

    @classmethod
    def from_json(cls, raw: Any, where: str = "key") -> BuildKey:
        """The key from its JSON form; ArtifactError naming the first wrong field. A plain
        option the manifest does not name (it predates the option) has its default."""
        plain = build_options.plain_options()
        checks = {**_BUILD_KEY_FIELDS, **{o.name: o.check for o in plain}}
        defaults = {**jc.defaults(cls), **{o.name: o.default_value for o in plain}}
        del defaults["options"]
        fields = jc.fields(raw, where, checks, defaults)
        values = {o.name: fields.pop(o.name) for o in plain}
        return cls(
            **{**fields, "mesh": tuple(fields["mesh"].items()), "options": plain_values(values)}
        )


def plain_values(values: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """BuildKey.options of `values` (by option name): every plain option, in declaration order,
    its default where `values` has none; an unknown name is a KeyError."""
    plain = build_options.plain_options()
    if unknown := set(values) - {o.name for o in plain}:
        raise KeyError(f"not plain build options: {', '.join(sorted(unknown))}")
    return tuple((o.name, values.get(o.name, o.default_value)) for o in plain)


_BUILD_KEY_FIELDS: dict[str, Check] = {
    "model": jc.string,
    "width": jc.POSITIVE,
    "height": jc.POSITIVE,
    "frames": jc.POSITIVE,
    "batch": jc.POSITIVE,
    "cfg": jc.boolean,
    "target": jc.string,
    "mesh": jc.dict_of(jc.POSITIVE),
    "vae_mesh": jc.tuple_of(jc.POSITIVE, length=2),
    "vae_axis": jc.one_of("width", "height"),
    "attention": jc.string,
    "context_parallel": jc.one_of("gather", "ulysses"),
    "vae_vmem_mib": jc.optional(jc.POSITIVE),
}


@dataclasses.dataclass(frozen=True)
class FileEntry:
    path: str  # a plain file name in the build folder
    sha256: str
    size: int

    @classmethod
    def from_json(cls, raw: Any, where: str) -> FileEntry:
        checks = {
            "path": jc.matching(jc.PLAIN_FILE_NAME, "a plain file name inside the build folder"),
            "sha256": jc.matching(jc.SHA256, "64 lowercase hex digits"),
            "size": jc.integer(0, MAX_FILE_BYTES),
        }
        return cls(**jc.fields(raw, where, checks, {}))


@dataclasses.dataclass(frozen=True)
class ArraySpec:
    """One flat input or output of an executable."""

    path: str  # input or output name, then the key path in it: "params/blocks/attn1/to_q/kernel"
    shape: tuple[int, ...]
    dtype: str
    sharding: str  # PartitionSpec as text

    @classmethod
    def from_json(cls, raw: Any, where: str) -> ArraySpec:
        checks = {
            "path": jc.string,
            "shape": jc.tuple_of(jc.integer(0, MAX_DIM)),
            "dtype": jc.string,
            "sharding": jc.string,
        }
        return cls(**jc.fields(raw, where, checks, {}))


@dataclasses.dataclass
class ProgramEntry:
    name: str
    executable: FileEntry
    hlo: FileEntry
    input_names: list[str]  # in call order (wan.interface.SIGNATURES)
    output_names: list[str]
    inputs: list[ArraySpec]
    outputs: list[ArraySpec]
    compile_seconds: float
    peak_rss_bytes: int
    memory: dict[str, int]  # per device: argument, output, alias, temp, generated_code, peak
    param_bytes: int  # per device: its `params` input (the weights it takes), 0 without one
    flops: float  # loop trip counts applied
    xla_flops: float  # XLA's cost analysis as reported (loop bodies counted once)
    collectives: dict[str, dict[str, int]]  # kind -> count, bytes (per device, trips applied)
    # vae_decode: bytes all-gathered per device per latent frame (the steady-state chunk)
    gathered_bytes_per_latent_frame: int | None = None
    kernel_flops: float = 0.0  # per device: custom-call kernels' work, which `flops` cannot see
    compiler_options: dict[str, Any] = dataclasses.field(default_factory=dict)  # XLA's, by name
    # per device: bytes of `params` left whole on every device of a multi-device mesh
    replicated_param_bytes: int = 0
    program_id: str = ""  # its identity in the program store (aot.building.store.program_id)
    eight_bit_flops: float = 0.0  # the part of `flops` in dots on 8-bit operands (--quant w8a8)
    # A step's video self-attention (per device): the fraction of query/key blocks its sparse
    # layers' kernel computes (1: dense), its FLOPs with every layer dense and as built.
    attention_density: float | None = None
    eight_bit_kernel_flops: float = 0.0  # the part of `kernel_flops` on 8-bit operands
    self_attention_flops_dense: float = 0.0
    self_attention_flops: float = 0.0

    @classmethod
    def from_json(cls, raw: Any, where: str = "program") -> ProgramEntry:
        """The entry from its JSON form; ArtifactError naming the first wrong field."""
        return cls(**jc.fields(raw, where, _PROGRAM_FIELDS, jc.defaults(cls)))


_PROGRAM_FIELDS: dict[str, Check] = {
    "name": jc.key_of(SIGNATURES),
    "executable": FileEntry.from_json,
    "hlo": FileEntry.from_json,
    "input_names": jc.list_of(jc.string),
    "output_names": jc.list_of(jc.string),
    "inputs": jc.list_of(ArraySpec.from_json),
    "outputs": jc.list_of(ArraySpec.from_json),
    "compile_seconds": jc.number,
    "peak_rss_bytes": jc.BYTES,
    # what the reports read: aot inspect, aot check
    "memory": jc.dict_of(
        jc.BYTES, required=("argument", "output", "temp", "generated_code", "peak")
    ),
    "param_bytes": jc.BYTES,
    "flops": jc.number,
    "xla_flops": jc.number,
    "collectives": jc.dict_of(jc.dict_of(jc.BYTES, required=("count", "bytes"))),
    "gathered_bytes_per_latent_frame": jc.optional(jc.BYTES),
    "kernel_flops": jc.number,
    "compiler_options": jc.dict_of(jc.option),
    "replicated_param_bytes": jc.BYTES,
    "program_id": jc.string,
    "eight_bit_flops": jc.number,
    "attention_density": jc.optional(jc.fraction),
    "eight_bit_kernel_flops": jc.number,
    "self_attention_flops_dense": jc.number,
    "self_attention_flops": jc.number,
}


def program_memory(programs: Mapping[str, ProgramEntry]) -> dict[str, residency.ProgramMemory]:
    """What wan.residency reads of each program: its own peak and its code, per device."""
    return {
        name: residency.ProgramMemory(p.memory["peak"], p.memory["generated_code"])
        for name, p in programs.items()
    }


def _programs(value: Any, where: str) -> dict[str, ProgramEntry]:
    """Programs this runtime knows (wan.interface.SIGNATURES), each entry named as its key;
    which ones a build must hold is its pipeline's (`_check_pipeline`)."""
    raw = jc.as_object(value, where)
    if unknown := sorted(set(raw) - set(SIGNATURES)):
        raise jc.malformed(where, f"names unknown programs {', '.join(map(str, unknown))[:200]}")
    programs = {name: ProgramEntry.from_json(raw[name], jc.at(where, name)) for name in raw}
    for name, entry in programs.items():
        if entry.name != name:
            raise jc.malformed(jc.at(jc.at(where, name), "name"), f"must be {name}")
    return programs


@dataclasses.dataclass
class Manifest:
    schema_version: int
    key: BuildKey
    model_config: dict[str, Any]
    model_hash: str
    versions: dict[str, str]  # jax, jaxlib, libtpu
    compiler_fingerprint: str
    platform: str
    device_kind: str
    device_ids: list[int]  # in mesh order
    process_count: int  # hosts of the job that runs it: one process per host
    local_device_count: int  # devices of each process
    mesh_axes: dict[str, int]
    default_mesh: bool  # the mesh `aot build` picks for this shape and target without --mesh
    vae_mesh_axes: dict[str, int]
    hbm_bytes: int | None  # per device, when known for the target
    peak_flops: float | None  # bf16 FLOP/s per device, when known for the target
    ulysses_all_to_alls: int  # all-to-alls per denoise step that Ulysses attention puts there
    notes: list[str]
    programs: dict[str, ProgramEntry]
    # Per device: each component's weights, where the runtime keeps them (wan.residency) and
    # the pipeline's peak that makes, at the program named.
    weight_bytes: dict[str, int]
    placement: dict[str, str]
    resident_peak_bytes: int
    resident_peak_program: str
    peak_8bit_flops: float | None = None  # 8-bit OP/s per device (its format: the target's)
    fps: int | None = None  # frames per second of the model's videos (ModelConfig.fps)
    signed_by: str | None = None  # the id of the key that signed it (runtime.trust.signing)
    # What decided its programs' lowering besides its key, model and compiler
    # (aot.building.sources.lowering_digest): an `aot build` whose own is equal finds it up to
    # date without lowering them. None: unknown (a manifest of an older aot, or code changed
    # while the build ran): found up to date by lowering.
    lowering_digest: str | None = None

    def step_lower_bound(self, program: str | None = None) -> float | None:
        """Seconds a denoise step (`program`; default the build's full step) takes at the
        device's peak rates (the roofline): its 8-bit dots at the 8-bit rate, the rest at
        bf16's; a measured step over it is the step's MFU."""
        step = self.programs.get(program or self.key.step_program)
        if step is None or not self.peak_flops:
            return None
        eight_bit = step.eight_bit_flops + step.eight_bit_kernel_flops
        seconds = (step.flops + step.kernel_flops - eight_bit) / self.peak_flops
        return seconds + eight_bit / (self.peak_8bit_flops or self.peak_flops)

    def to_json(self) -> dict[str, Any]:
        raw = dataclasses.asdict(self)
        raw["key"] = self.key.to_json()
        return raw

    def resident_peak(self, placement: Mapping[str, str] | None = None) -> tuple[int, str]:
        """(bytes per device, at which program) with the weights placed as `placement` says
        (default: as the build chose)."""
        chosen = self.placement if placement is None else placement
        return residency.resident_peak(
            self.key.programs, program_memory(self.programs), self.weight_bytes, chosen
        )

    def parameter_shapes(self, program: str) -> dict[tuple[str, ...], tuple[int, ...]]:
        """Shapes of a program's parameters (its `params` input) by path in the tree."""
        return {
            tuple(spec.path.split("/")[1:]): tuple(spec.shape)
            for spec in self.programs[program].inputs
            if spec.path.startswith("params/")
        }

    @classmethod
    def from_json(cls, raw: Any) -> Manifest:
        """The manifest from its JSON form, every field checked (types, ranges, its pipeline's
        programs, a device layout that adds up); ArtifactError naming the first wrong field."""
        version = jc.as_object(raw, "").get("schema_version")
        if isinstance(version, bool) or not isinstance(version, int) or version != SCHEMA_VERSION:
            raise ArtifactError(
                f"manifest schema {repr(version)[:20]} is not {SCHEMA_VERSION} (made by another "
                "version of aot)"
            )
        fields = jc.fields(raw, "", _MANIFEST_FIELDS, _MANIFEST_DEFAULTS)
        _check_device_layout(fields)
        _check_pipeline(fields)
        _check_placement(fields)
        return cls(**fields)

    def write(self, folder: Path) -> None:
        (folder / MANIFEST).write_text(json.dumps(self.to_json(), indent=1))


_DEVICE_ID = jc.integer(0, MAX_DIM)
_LOCAL_DEVICES = jc.integer(1, MAX_LOCAL_DEVICES)
_MANIFEST_FIELDS: dict[str, Check] = {
    "schema_version": jc.integer(SCHEMA_VERSION, SCHEMA_VERSION),
    "key": BuildKey.from_json,
    "model_config": jc.config,
    "model_hash": jc.string,
    "versions": jc.dict_of(jc.string),
    "compiler_fingerprint": jc.string,
    "platform": jc.string,
    "device_kind": jc.string,
    "device_ids": jc.list_of(_DEVICE_ID),
    "process_count": jc.integer(1, MAX_PROCESSES),
    "local_device_count": _LOCAL_DEVICES,
    "mesh_axes": jc.dict_of(jc.POSITIVE),
    "default_mesh": jc.boolean,
    "vae_mesh_axes": jc.dict_of(jc.POSITIVE),
    "hbm_bytes": jc.optional(jc.BYTES),
    "peak_flops": jc.optional(jc.number),
    "peak_8bit_flops": jc.optional(jc.number),
    "fps": jc.optional(jc.integer(1, 1000)),
    "signed_by": jc.optional(jc.matching(re.compile(r"[0-9a-f]{16}"), "a key id (16 hex digits)")),
    "ulysses_all_to_alls": jc.BYTES,
    "notes": jc.list_of(jc.string),
    "programs": _programs,
    "weight_bytes": jc.dict_of(jc.BYTES),
    "placement": jc.dict_of(jc.one_of(*residency.PLACEMENTS)),
    "resident_peak_bytes": jc.BYTES,
    "resident_peak_program": jc.key_of(SIGNATURES),
    "lowering_digest": jc.optional(jc.matching(jc.SHA256, "64 lowercase hex digits")),
}
# Fields a manifest of schema 5 may lack: they came after it (a build made before is read as
# it was).
_MANIFEST_DEFAULTS: dict[str, Any] = {"lowering_digest": None}


def _check_pipeline(fields: dict[str, Any]) -> None:
    """The build holds exactly the programs its options decide."""
    key = fields["key"]
    if set(fields["programs"]) != set(key.programs):
        options = ", ".join(f"{name} {value}" for name, value in key.plain_items())
        raise jc.malformed(
            "programs", f"must be those of its build ({options}): {', '.join(key.programs)}"
        )


def _check_placement(fields: dict[str, Any]) -> None:
    """Weights and a placement of the build's own components, transient only where they may
    be (wan.residency.movable)."""
    components = set(interface.components(2, fields["key"].programs))
    for name in ("weight_bytes", "placement"):
        if unknown := sorted(set(fields[name]) - components):
            raise jc.malformed(name, f"names components the build has not: {', '.join(unknown)}")
    if set(fields["placement"]) != set(fields["weight_bytes"]):
        raise jc.malformed("placement", "must place every component of weight_bytes")
    if fixed := residency.unmovable(
        fields["key"].programs, fields["weight_bytes"], fields["placement"]
    ):
        raise jc.malformed("placement", f"cannot make {', '.join(fixed)} transient")


def _check_device_layout(fields: dict[str, Any]) -> None:
    """Device ids that are distinct and as many as the processes' devices."""
    ids = fields["device_ids"]
    devices = fields["process_count"] * fields["local_device_count"]
    if len(set(ids)) != len(ids):
        raise jc.malformed("device_ids", "must be distinct")
    if len(ids) != devices:
        raise jc.malformed(
            "device_ids",
            f"has {len(ids)} ids, process_count x local_device_count is {devices}",
        )


# ----------------------------------------------------------------------------------------------
# Files of a build: plain names inside the folder, never through a symlink, of a bounded size,
# checked before use.


def _refused(path: Path) -> Refuse:
    """A build file's refusal: one ArtifactError line naming it, saying to rebuild."""
    return lambda reason: ArtifactError(f"{path} {reason}: {REBUILD}")


def listed_files(folder: Path) -> list[str]:
    """The plain file names the manifest in `folder` lists for its programs, whatever its schema
    (a build an older aot made is still aot's to replace); ArtifactError if it does not read."""
    raw = _read_json(Path(folder) / MANIFEST, MAX_MANIFEST_BYTES)
    programs = raw.get("programs") if isinstance(raw, dict) else None
    entries = programs.values() if isinstance(programs, dict) else []
    files = (e.get(kind) for e in entries if isinstance(e, dict) for kind in ("executable", "hlo"))
    names = (f.get("path") for f in files if isinstance(f, dict))
    return [n for n in names if isinstance(n, str) and jc.PLAIN_FILE_NAME.fullmatch(n)]


def _read_json(path: Path, limit: int) -> Any:
    """The JSON value in the build file `path` of at most `limit` bytes (NaN and Infinity
    refused)."""
    return read_json(path, limit, _refused(path), follow_symlinks=False)


def read_manifest(folder: str | Path) -> Manifest:
    """The manifest of the build in `folder`, read with a size bound and checked field by
    field; ArtifactError (one line, naming the file) for anything else."""
    path = Path(folder) / MANIFEST
    if not os.path.lexists(path):
        raise ArtifactError(f"{folder} is not a build: no {MANIFEST} (run `aot build`)")
    return _manifest(path, _read_json(path, MAX_MANIFEST_BYTES))


def read_signed_manifest(folder: str | Path, trusted: Sequence[TrustedKey]) -> Manifest:
    """The manifest of the build in `folder`, when one of the `trusted` keys signed it: the bytes
    whose signature is checked are the bytes parsed (runtime.trust.signing)."""
    path = Path(folder) / MANIFEST
    data = read_bytes(path, MAX_MANIFEST_BYTES, _refused(path), follow_symlinks=False)
    signing.verify(path, data, trusted)
    return _manifest(path, parse_json(data, _refused(path)))


def _manifest(path: Path, raw: Any) -> Manifest:
    try:
        return Manifest.from_json(raw)
    except ArtifactError as e:
        raise ArtifactError(f"{path}: {e}; {REBUILD}") from None


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def file_entry(folder: Path, name: str) -> FileEntry:
    path = folder / name
    return FileEntry(path=name, sha256=sha256_file(path), size=path.stat().st_size)


def _read_checked(folder: Path, entry: FileEntry, keep: bool) -> bytes:
    """The file `entry` names in `folder`, read once and checked: a plain name inside the
    folder, a regular file (not a symlink) of the entry's size (before any byte is read), and
    the bytes read hash to the entry's sha256. The bytes when `keep`, else b""."""
    if not isinstance(entry.path, str) or not jc.PLAIN_FILE_NAME.fullmatch(entry.path):
        raise ArtifactError(
            f"{folder}: file {repr(entry.path)[:80]} must be a plain file name inside the build "
            "folder: refusing it"
        )
    path = folder / entry.path
    digest, kept, read = hashlib.sha256(), [], 0
    with open_regular(path, _refused(path), follow_symlinks=False) as f:
        size = os.fstat(f.fileno()).st_size
        if size != entry.size:
            raise ArtifactError(
                f"{path} is {size} bytes, manifest says {entry.size} (truncated?): {REBUILD}"
            )
        while chunk := f.read(min(1 << 20, entry.size + 1 - read)):
            read += len(chunk)
            digest.update(chunk)
            if keep:
                kept.append(chunk)
    if read != entry.size or digest.hexdigest() != entry.sha256:
        raise ArtifactError(f"{path} fails its sha256 check: {REBUILD}")
    return b"".join(kept)


def verify_file(folder: Path, entry: FileEntry) -> Path:
    """The path of the file `entry` names in `folder`, once it is known to be a plain name
    inside the folder, a regular file (not a symlink), of the entry's size, then of its
    sha256; else ArtifactError."""
    _read_checked(folder, entry, keep=False)
    return folder / entry.path


def read_verified(folder: Path, entry: FileEntry) -> bytes:
    """The bytes of the file `entry` names in `folder`, checked as by verify_file (the bytes
    returned are the bytes hashed)."""
    return _read_checked(folder, entry, keep=True)


def verify_files(folder: Path, manifest: Manifest) -> None:
    """Every file the manifest lists is in the folder with its recorded size and sha256."""
    for program in manifest.programs.values():
        for entry in (program.executable, program.hlo):
            verify_file(folder, entry)


def read_hlo_text(folder: Path, entry: FileEntry) -> str:
    """A program's optimized HLO text: the compressed file verified first (as by verify_file),
    then decompressed to at most HLO_EXPANSION x its size (and MAX_HLO_TEXT_BYTES)."""
    path = folder / entry.path
    if entry.size > MAX_HLO_TEXT_BYTES:
        raise ArtifactError(f"{path} is over {MAX_HLO_TEXT_BYTES >> 30} GiB: {REBUILD}")
    compressed = read_verified(folder, entry)
    limit = min(HLO_EXPANSION * len(compressed) + (1 << 20), MAX_HLO_TEXT_BYTES)
    try:
        return _gunzip(compressed, limit, path).decode("utf-8")
    except (zlib.error, UnicodeDecodeError) as e:
        raise ArtifactError(f"{path} is unreadable ({e}): {REBUILD}") from None


def _gunzip(compressed: bytes, limit: int, path: Path) -> bytearray:
    """One gzip member (as `aot build` writes), inflated a MiB at a time and refused as soon
    as it passes `limit` bytes: a gzip bomb never expands in memory."""
    inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    out, pending = bytearray(), compressed
    while not inflater.eof:
        chunk = inflater.decompress(pending, 1 << 20)
        if not chunk and not inflater.eof:
            raise ArtifactError(f"{path} is truncated: {REBUILD}")
        out += chunk
        if len(out) > limit:
            raise ArtifactError(
                f"{path} expands past {limit >> 20} MiB ({HLO_EXPANSION}x its size): not an "
                f"HLO this toolkit wrote; {REBUILD}"
            )
        pending = inflater.unconsumed_tail
    if inflater.unused_data:
        raise ArtifactError(f"{path} has data after its gzip stream: {REBUILD}")
    return out
