"""The artifact format shared by `aot build` (writer) and the runtime (reader).

One folder per build: `manifest.json` plus, per program, the serialized executable
(`<program>.exec`) and its optimized HLO (`<program>.hlo.txt.gz`). Executables are code, so
loading is ordered for safety: sha256 of every file, then platform/devices/versions, then the
device order, and only then deserialisation through an unpickler that accepts only jax, jaxlib
and numpy classes (and jax's own reconstructor functions).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from wan.configs import VideoShape
from wan.errors import InputError

SCHEMA_VERSION = 2  # 2: program inputs and outputs by name (wan.interface)
MANIFEST = "manifest.json"


class ArtifactError(InputError):
    """An artifact cannot be used here; the message says why and what to do."""


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
    attention: str  # kernel and its largest blocks, e.g. "splash:3072:2048:1024"
    context_parallel: str = "gather"  # or "ulysses" (wan.attention)
    vae_vmem_mib: int | None = None  # TPU: scoped VMEM of the VAE decode's kernels; None: XLA's

    @property
    def shape(self) -> VideoShape:
        return VideoShape(self.width, self.height, self.frames, self.batch, self.cfg)

    def folder_name(self) -> str:
        mesh = "-".join(f"{name[0]}{size}" for name, size in self.mesh)
        vae = f"vae{self.vae_mesh[0]}x{self.vae_mesh[1]}{self.vae_axis[0]}"
        cfg = "" if self.cfg else "_nocfg"
        attention = self.attention.replace(":", "-")
        ulysses = "_ulysses" if self.context_parallel == "ulysses" else ""
        vmem = f"_vmem{self.vae_vmem_mib}" if self.vae_vmem_mib else ""
        return (
            f"{self.model}_{self.width}x{self.height}_f{self.frames}_b{self.batch}{cfg}"
            f"_{self.target.replace('/', '-host')}_{mesh}_{vae}_{attention}{ulysses}{vmem}"
        )

    def to_json(self) -> dict[str, Any]:
        raw = dataclasses.asdict(self)
        raw["mesh"] = dict(self.mesh)
        raw["vae_mesh"] = list(self.vae_mesh)
        return raw

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> BuildKey:
        return cls(
            **{**raw, "mesh": tuple(raw["mesh"].items()), "vae_mesh": tuple(raw["vae_mesh"])}
        )


@dataclasses.dataclass(frozen=True)
class FileEntry:
    path: str  # relative to the build folder
    sha256: str
    size: int


@dataclasses.dataclass(frozen=True)
class ArraySpec:
    """One flat input or output of an executable."""

    path: str  # input or output name, then the key path in it: "params/blocks/attn1/to_q/kernel"
    shape: tuple[int, ...]
    dtype: str
    sharding: str  # PartitionSpec as text


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
    flops: float  # loop trip counts applied
    xla_flops: float  # XLA's cost analysis as reported (loop bodies counted once)
    collectives: dict[str, dict[str, int]]  # kind -> count, bytes (per device, trips applied)
    # vae_decode: bytes all-gathered per device per latent frame (the steady-state chunk)
    gathered_bytes_per_latent_frame: int | None = None
    kernel_flops: float = 0.0  # per device: custom-call kernels' work, which `flops` cannot see
    compiler_options: dict[str, Any] = dataclasses.field(default_factory=dict)  # XLA's, by name
    # per device: bytes of `params` left whole on every device of a multi-device mesh
    replicated_param_bytes: int = 0

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> ProgramEntry:
        return cls(
            **{
                **raw,
                "executable": FileEntry(**raw["executable"]),
                "hlo": FileEntry(**raw["hlo"]),
                "inputs": [_array_spec(a) for a in raw["inputs"]],
                "outputs": [_array_spec(a) for a in raw["outputs"]],
            }
        )


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

    def step_lower_bound(self) -> float | None:
        """Seconds a denoise step takes at the device's peak bf16 rate (the roofline): a
        measured step over it is the step's MFU."""
        step = self.programs.get("denoise_step")
        if step is None or not self.peak_flops:
            return None
        return (step.flops + step.kernel_flops) / self.peak_flops

    def to_json(self) -> dict[str, Any]:
        raw = dataclasses.asdict(self)
        raw["key"] = self.key.to_json()
        return raw

    def parameter_shapes(self, program: str) -> dict[tuple[str, ...], tuple[int, ...]]:
        """Shapes of a program's parameters (its `params` input) by path in the tree."""
        return {
            tuple(spec.path.split("/")[1:]): tuple(spec.shape)
            for spec in self.programs[program].inputs
            if spec.path.startswith("params/")
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Manifest:
        if raw.get("schema_version") != SCHEMA_VERSION:
            raise ArtifactError(
                f"manifest schema {raw.get('schema_version')} is not {SCHEMA_VERSION}: rebuild with `aot build`"
            )
        # Manifests older than the field: every process held an equal share of the devices.
        raw.setdefault("local_device_count", len(raw["device_ids"]) // raw["process_count"])
        raw.setdefault("default_mesh", False)
        raw.setdefault("peak_flops", None)
        raw.setdefault("ulysses_all_to_alls", 0)
        programs = {name: ProgramEntry.from_json(p) for name, p in raw["programs"].items()}
        return cls(**{**raw, "key": BuildKey.from_json(raw["key"]), "programs": programs})

    def write(self, folder: Path) -> None:
        (folder / MANIFEST).write_text(json.dumps(self.to_json(), indent=1))


def _array_spec(raw: dict[str, Any]) -> ArraySpec:
    return ArraySpec(**{**raw, "shape": tuple(raw["shape"])})


def read_manifest(folder: str | Path) -> Manifest:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"{folder} is not a build: no {MANIFEST} (run `aot build`)")
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ArtifactError(
            f"{path} is unreadable ({e}): rebuild with `aot build --force`"
        ) from None
    try:
        return Manifest.from_json(raw)
    except (KeyError, TypeError) as e:
        raise ArtifactError(
            f"{path} is malformed ({e}): rebuild with `aot build --force`"
        ) from None


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def file_entry(folder: Path, name: str) -> FileEntry:
    path = folder / name
    return FileEntry(path=name, sha256=sha256_file(path), size=path.stat().st_size)


def verify_files(folder: Path, manifest: Manifest) -> None:
    """Every file the manifest lists exists with its recorded size and sha256."""
    for program in manifest.programs.values():
        for entry in (program.executable, program.hlo):
            path = folder / entry.path
            if not path.is_file():
                raise ArtifactError(f"{path} is missing: rebuild with `aot build --force`")
            if path.stat().st_size != entry.size:
                raise ArtifactError(
                    f"{path} is {path.stat().st_size} bytes, manifest says {entry.size} (truncated?): "
                    "rebuild with `aot build --force`"
                )
            if sha256_file(path) != entry.sha256:
                raise ArtifactError(
                    f"{path} fails its sha256 check: rebuild with `aot build --force`"
                )


# ----------------------------------------------------------------------------------------------
# Executables: (payload, in_tree, out_tree, device_ids) pickled; the device ids ride inside the
# checksummed file so that a tampered or mismatched manifest order is caught before XLA sees it.

_ALLOWED_PACKAGES = ("jax", "jaxlib", "numpy", "ml_dtypes")
_ALLOWED_BUILTINS = frozenset({"tuple", "list", "dict", "set", "frozenset", "slice", "complex"})
_ALLOWED_OBJECTS = frozenset({"_reconstruct", "scalar", "default_registry", "tracing_registry"})


def _allowed(module: str, name: str, obj: Any) -> bool:
    if module == "builtins":
        return name in _ALLOWED_BUILTINS
    if module.split(".")[0] not in _ALLOWED_PACKAGES:
        return False
    # Classes, the reconstructor functions jax/numpy register for their own pickling, and the
    # pytree registry that PyTreeDefs name.
    return isinstance(obj, type) or name.startswith("_unpickle") or name in _ALLOWED_OBJECTS


class _RestrictedMixin:
    def find_class(self, module: str, name: str) -> Any:
        obj = super().find_class(module, name)  # type: ignore[misc]
        if not _allowed(module, name, obj):
            raise ArtifactError(
                f"executable refers to {module}.{name}, which is not an allowed jax/jaxlib/numpy "
                "class: refusing to load it (rebuild with `aot build --force`)"
            )
        return obj


class _RestrictedUnpickler(_RestrictedMixin, pickle.Unpickler):
    pass


def dump_executable(compiled: Any, device_ids: Sequence[int]) -> bytes:
    from jax.experimental import serialize_executable

    payload, in_tree, out_tree = serialize_executable.serialize(compiled)
    return pickle.dumps((payload, in_tree, out_tree, list(device_ids)), protocol=5)


def executable_device_ids(blob: bytes) -> list[int]:
    return _RestrictedUnpickler(io.BytesIO(blob)).load()[3]


def load_executable(blob: bytes, devices: Sequence[Any]) -> Any:
    """Deserialize onto `devices` (in the recorded mesh order) with the restricted unpickler."""
    import jax
    from jax.experimental import serialize_executable

    payload, in_tree, out_tree, device_ids = _RestrictedUnpickler(io.BytesIO(blob)).load()
    if [d.id for d in devices] != list(device_ids):
        raise ArtifactError(
            f"devices {[d.id for d in devices]} are not in the executable's order {device_ids}"
        )

    class Unpickler(_RestrictedMixin, serialize_executable._JaxPjrtUnpickler):
        pass

    backend = devices[0].client
    unloaded, args_info_flat, no_kwargs = Unpickler(io.BytesIO(payload), backend, devices).load()
    loaded = unloaded.load()
    args_info = in_tree.unflatten(args_info_flat)
    return jax.stages.Compiled(loaded, [], args_info, out_tree, no_kwargs=no_kwargs)
