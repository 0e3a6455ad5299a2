"""Executables of a build, stored as XLA's own bytes behind a JSON header: loaded without pickle.

A `<program>.exec` file is `MAGIC`, the header's length (8 bytes, little endian), the header
(JSON, `ExecutableHeader`) and then the bytes the backend's client serialized, as one zstd frame
(about 10x smaller: a 1.3B 480p build's 47 MB are 5 MB; decompressing is faster than reading
what it saves). The manifest's sizes and sha256s are those of the stored file; the header
declares the bytes before compression, and no more are decompressed. The header
declares everything jax's `Compiled` holds beside XLA's executable: each flat input and output
(shape, dtype, sharding over the program's mesh, donation, whether XLA kept it) and the call's
tree (tuples, lists, dicts and None only). The loader checks every field, rebuilds the avals,
shardings and trees from them, deserializes XLA's bytes with the client's own deserializer and
checks the rebuilt shardings against the ones XLA compiled in. Nothing is unpickled, so no
crafted state can reach a Python object; what remains trusted is XLA's executable itself, which
is native code (docs/security.md: signed builds close that). Called only with bytes whose size
and sha256 the manifest vouched for (`runtime.builds.artifact.read_verified`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from collections.abc import Sequence
from typing import Any

import zstandard

from runtime.builds.artifact import ProgramEntry
from runtime.trust import json_checks as jc
from runtime.trust.json_checks import PLAIN_KEY, REBUILD, ArtifactError

MAGIC = b"\x89wan-aot executable\r\n\x1a\n"
FORMAT = 2  # 1: XLA's bytes uncompressed (refused: rebuild)
ZSTD_LEVEL = 12  # 11x on the 1.3B's VAE decode in 0.3 s; 19 gains 10% more for 14x the time
MAX_XLA_BYTES = 4 << 30  # XLA's bytes of one program (real 14B ones: tens of MB)
_LENGTH = struct.Struct("<Q")
MAX_HEADER_BYTES = 16 << 20  # real headers: a few hundred bytes per array (the 14B: < 1 MB)
MAX_TREE_DEPTH = 64  # nesting of a program's arguments (real ones: < 10)
MAX_RANK = 16
MAX_MESHES = 16  # meshes one program places arrays on (real ones: 1 or 2)

# Every dtype a build's arrays may have: numbers only (an object dtype cannot be expressed).
DTYPES = frozenset({
    "bool", "int4", "int8", "int16", "int32", "int64", "uint4", "uint8", "uint16", "uint32",
    "uint64", "float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2",
    "complex64", "complex128",
})  # fmt: skip
MEMORY_KINDS = frozenset({"device"})  # arrays in host memory are not stored (none are built)
AXIS_TYPES = ("Auto", "Explicit", "Manual")  # jax.sharding.AxisType, by name

Spec = tuple[str | tuple[str, ...] | None, ...]


@dataclasses.dataclass(frozen=True)
class Placement:
    """A NamedSharding: its mesh (an index into the header's), PartitionSpec and memory kind."""

    mesh: int
    spec: Spec
    memory_kind: str | None


@dataclasses.dataclass(frozen=True)
class ArrayHeader:
    """One flat input or output of the executable."""

    path: str  # for messages: the argument or result and its key path
    shape: tuple[int, ...]
    dtype: str
    weak_type: bool
    placement: Placement | None  # None: an input XLA dropped as unused
    donated: bool = False  # inputs only


@dataclasses.dataclass(frozen=True)
class MeshHeader:
    """A mesh over the program's devices (a program may read on one and write on another: the
    devices in the same order, the axes different)."""

    axes: tuple[tuple[str, int], ...]  # name, size
    axis_types: tuple[str, ...]  # jax.sharding.AxisType names
    device_ids: tuple[int, ...]  # flat, in mesh order


@dataclasses.dataclass(frozen=True)
class ExecutableHeader:
    name: str  # jax's name of the computation
    device_ids: tuple[int, ...]  # the build's devices in the order they are passed to XLA
    meshes: tuple[MeshHeader, ...]
    inputs: tuple[ArrayHeader, ...]
    outputs: tuple[ArrayHeader, ...]
    in_tree: Any  # JSON form of the call's tree (`_tree_json`)
    out_tree: Any
    no_kwargs: bool
    committed: bool
    xla_bytes: int  # XLA's serialized executable before compression
    format: int = FORMAT


# -- the call's trees as JSON: a leaf is 0, None is null; containers are tagged ------------------


def _tree_json(node: Any, depth: int = 0) -> Any:
    """The JSON form of a tree whose leaves are 0 (a treedef unflattened with zeros)."""
    if depth > MAX_TREE_DEPTH:
        raise ValueError(f"nested deeper than {MAX_TREE_DEPTH}")
    if node is None:
        return None
    if type(node) is int and node == 0:
        return 0
    if type(node) in (tuple, list):
        return {type(node).__name__: [_tree_json(c, depth + 1) for c in node]}
    if type(node) is dict and all(type(k) in (str, int) for k in node):
        return {"dict": [[k, _tree_json(v, depth + 1)] for k, v in node.items()]}
    raise ValueError(
        f"holds a {type(node).__name__}: only tuples, lists, dicts and None are stored"
    )


def _tree_from_json(raw: Any, where: str, depth: int = 0) -> Any:
    """The tree (leaves 0) of its JSON form; ArtifactError for anything else."""
    if depth > MAX_TREE_DEPTH:
        raise jc.malformed(where, f"is nested deeper than {MAX_TREE_DEPTH} levels")
    if raw is None or (type(raw) is int and raw == 0):
        return raw
    if isinstance(raw, dict) and len(raw) == 1:
        (tag, children), inner = next(iter(raw.items())), f"{where}.{next(iter(raw))}"
        if tag in ("tuple", "list"):
            items = [
                _tree_from_json(c, f"{inner}[{i}]", depth + 1)
                for i, c in enumerate(jc.as_list(children, inner))
            ]
            return tuple(items) if tag == "tuple" else items
        if tag == "dict":
            out = {}
            for i, pair in enumerate(jc.as_list(children, inner)):
                if not (isinstance(pair, list) and len(pair) == 2 and type(pair[0]) in (str, int)):
                    raise jc.malformed(f"{inner}[{i}]", "must be a [key, subtree] pair")
                if pair[0] in out:
                    raise jc.malformed(f"{inner}[{i}]", "repeats a key")
                out[pair[0]] = _tree_from_json(pair[1], f"{inner}[{i}]", depth + 1)
            if len({type(k) for k in out}) > 1:
                raise jc.malformed(inner, "mixes string and integer keys")
            return out
    raise jc.malformed(where, "must be 0 (a leaf), null, or one of tuple, list, dict")


# -- writing (aot build) ----------------------------------------------------------------------


def dump_executable(compiled: Any, device_ids: Sequence[int], input_names: Sequence[str]) -> bytes:
    """The executable file of `compiled` (called with the positional arguments `input_names`),
    on `device_ids` in the order XLA was given them."""
    import jax

    unloaded = getattr(compiled._executable, "_unloaded_executable", None)
    if unloaded is None or compiled._params.const_args:
        raise ValueError("this compiled program cannot be serialized (no unloaded executable)")
    if (unloaded.unordered_effects or unloaded.ordered_effects or unloaded.host_callbacks
            or unloaded.keepalive or getattr(unloaded, "mut", None)):  # fmt: skip
        raise ValueError("a program with effects or host callbacks cannot be stored")
    xla = _xla_bytes(unloaded.xla_executable)
    in_avals = [info._aval for info in jax.tree.leaves(compiled.args_info)]
    donated = [info.donated for info in jax.tree.leaves(compiled.args_info)]
    flat_in = compiled._input_shardings_flat()
    paths = [_named(p, input_names) for p in _paths(compiled.in_tree)]
    meshes = list(
        dict.fromkeys(s.mesh for s in [*flat_in, *unloaded.output_shardings] if s is not None)
    )
    header = ExecutableHeader(
        name=unloaded.name,
        device_ids=tuple(device_ids),
        meshes=tuple(_mesh_header(m, device_ids) for m in meshes),
        inputs=tuple(
            _array_header(p, a, s, meshes, d)
            for p, a, s, d in zip(paths, in_avals, flat_in, donated, strict=True)
        ),
        outputs=tuple(
            _array_header(p, a, s, meshes)
            for p, a, s in zip(
                _paths(compiled.out_tree),
                unloaded.output_avals,
                unloaded.output_shardings,
                strict=True,
            )
        ),
        in_tree=_tree_json(compiled.in_tree.unflatten([0] * compiled.in_tree.num_leaves)),
        out_tree=_tree_json(compiled.out_tree.unflatten([0] * compiled.out_tree.num_leaves)),
        no_kwargs=bool(compiled._no_kwargs),
        committed=bool(unloaded.committed),
        xla_bytes=len(xla),
    )
    text = json.dumps(dataclasses.asdict(header), separators=(",", ":")).encode()
    return MAGIC + _LENGTH.pack(len(text)) + text + zstandard.compress(xla, ZSTD_LEVEL)


def _xla_bytes(executable: Any) -> bytes:
    """XLA's serialization of a loaded (local) or unloaded (deviceless) executable."""
    from jax._src.lib import _jax
    from jax._src.lib import xla_client as xc

    if isinstance(executable, xc.LoadedExecutable):
        return executable.client.serialize_executable(executable)
    if isinstance(executable, _jax.Executable):
        return executable.serialize()
    raise ValueError(f"cannot serialize a {type(executable).__name__}")


def _paths(treedef: Any) -> list[str]:
    import jax

    tree = treedef.unflatten([0] * treedef.num_leaves)
    return [
        jax.tree_util.keystr(p, simple=True, separator="/")
        for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]
    ]


def _named(path: str, input_names: Sequence[str]) -> str:
    """A flat input's path with its argument's name: "0/1/blocks/..." (args, second) is
    "<second name>/blocks/..." as the manifest names it."""
    args, index, *rest = path.split("/")
    if args != "0":
        raise ValueError("a stored program takes positional arguments only")
    return "/".join([input_names[int(index)], *rest])


def _mesh_header(mesh: Any, device_ids: Sequence[int]) -> MeshHeader:
    ids = tuple(d.id for d in mesh.devices.flat)
    if ids != tuple(device_ids):  # as jax requires of one computation's shardings
        raise ValueError("a program's mesh is not on the build's devices in their order")
    return MeshHeader(tuple(mesh.shape.items()), tuple(t.name for t in mesh.axis_types), ids)


def _array_header(
    path: str, aval: Any, sharding: Any, meshes: list[Any], donated: bool = False
) -> ArrayHeader:
    import jax

    placement = None
    if sharding is not None:
        if not isinstance(sharding, jax.sharding.NamedSharding):
            raise ValueError(
                f"{path}: a {type(sharding).__name__} cannot be stored (NamedSharding only)"
            )
        spec = sharding.spec
        if getattr(spec, "unreduced", None) or getattr(spec, "reduced", None):
            raise ValueError(f"{path}: unreduced or reduced axes cannot be stored")
        if sharding.memory_kind not in (None, *MEMORY_KINDS):
            raise ValueError(f"{path}: arrays in {sharding.memory_kind} memory cannot be stored")
        placement = Placement(meshes.index(sharding.mesh), tuple(spec), sharding.memory_kind)
    dtype = str(aval.dtype)
    if dtype not in DTYPES:
        raise ValueError(f"{path}: dtype {dtype} cannot be stored")
    return ArrayHeader(path, tuple(aval.shape), dtype, bool(aval.weak_type), placement, donated)


# -- reading (the runtime) --------------------------------------------------------------------


def _spec_entry(value: Any, where: str) -> str | tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return jc.matching(PLAIN_KEY, "a mesh axis name")(value, where)
    return jc.tuple_of(jc.matching(PLAIN_KEY, "a mesh axis name"))(value, where)


def _placement(raw: Any, where: str) -> Placement | None:
    if raw is None:
        return None
    checks = {
        "mesh": jc.integer(0, MAX_MESHES - 1),
        "spec": jc.tuple_of(_spec_entry),
        "memory_kind": jc.optional(jc.one_of(*sorted(MEMORY_KINDS))),
    }
    return Placement(**jc.fields(raw, where, checks, {}))


def _array(raw: Any, where: str) -> ArrayHeader:
    checks = {
        "path": jc.string,
        "shape": jc.tuple_of(jc.integer(0, jc.MAX_DIM)),
        "dtype": jc.one_of(*sorted(DTYPES)),
        "weak_type": jc.boolean,
        "placement": _placement,
        "donated": jc.boolean,
    }
    array = ArrayHeader(**jc.fields(raw, where, checks, {}))
    if len(array.shape) > MAX_RANK:
        raise jc.malformed(f"{where}.shape", f"has more than {MAX_RANK} dimensions")
    return array


def _axis(raw: Any, where: str) -> tuple[str, int]:
    name, size = jc.tuple_of(lambda v, w: v, 2)(raw, where)
    return jc.matching(PLAIN_KEY, "a mesh axis name")(name, f"{where}[0]"), jc.POSITIVE(
        size, f"{where}[1]"
    )


def _mesh(raw: Any, where: str) -> MeshHeader:
    checks = {
        "axes": jc.tuple_of(_axis),
        "axis_types": jc.tuple_of(jc.one_of(*AXIS_TYPES)),
        "device_ids": jc.tuple_of(jc.integer(0, jc.MAX_DIM)),
    }
    mesh = MeshHeader(**jc.fields(raw, where, checks, {}))
    names = [name for name, _ in mesh.axes]
    if len(set(names)) != len(names) or len(mesh.axis_types) != len(names):
        raise jc.malformed(where, "must name each axis once, with its type")
    if math.prod(n for _, n in mesh.axes) != len(mesh.device_ids):
        raise jc.malformed(f"{where}.device_ids", "must hold as many devices as the axes make")
    return mesh


_HEADER_FIELDS: dict[str, jc.Check] = {
    "format": jc.integer(FORMAT, FORMAT),
    "name": jc.string,
    "device_ids": jc.tuple_of(jc.integer(0, jc.MAX_DIM)),
    "meshes": jc.tuple_of(_mesh),
    "inputs": jc.tuple_of(_array),
    "outputs": jc.tuple_of(_array),
    "in_tree": lambda v, w: v,
    "out_tree": lambda v, w: v,
    "no_kwargs": jc.boolean,
    "committed": jc.boolean,
    "xla_bytes": jc.integer(0, MAX_XLA_BYTES),
}


def read_header(blob: bytes) -> tuple[ExecutableHeader, bytes]:
    """(header, XLA's bytes as stored: compressed) of an executable file, every field checked;
    ArtifactError else."""
    if not blob.startswith(MAGIC):
        raise ArtifactError(
            "the executable is not in this runtime's format (builds made before the pickle-free "
            f"format stored pickles, which are never loaded): {REBUILD}"
        )
    start = len(MAGIC) + _LENGTH.size
    if len(blob) < start:
        raise ArtifactError(f"the executable is truncated: {REBUILD}")
    (length,) = _LENGTH.unpack_from(blob, len(MAGIC))
    if length > min(MAX_HEADER_BYTES, len(blob) - start):
        raise ArtifactError(f"the executable's header claims {length} bytes: {REBUILD}")
    try:
        raw = json.loads(blob[start : start + length].decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise ArtifactError(
            f"the executable's header is not JSON ({str(e)[:120]}): {REBUILD}"
        ) from None
    if isinstance(raw, dict) and raw.get("format") == 1:
        raise ArtifactError(
            f"the executable is in the uncompressed format of older builds: {REBUILD}"
        )
    try:
        header = ExecutableHeader(**jc.fields(raw, "executable header", _HEADER_FIELDS, {}))
        _check_consistent(header)
    except ArtifactError as e:
        raise ArtifactError(f"{e}: {REBUILD}") from None
    return header, blob[start + length :]


def decompressed(header: ExecutableHeader, stored: bytes) -> bytes:
    """XLA's bytes from their stored zstd frame: exactly the header's `xla_bytes`, never more
    decompressed; ArtifactError for anything else."""
    try:  # a frame's own content size is not trusted (decompress() would allocate it)
        with zstandard.ZstdDecompressor().stream_reader(stored) as reader:
            parts, size = [], 0
            while size <= header.xla_bytes and (part := reader.read(header.xla_bytes + 1 - size)):
                parts.append(part)
                size += len(part)
        xla = b"".join(parts)
    except zstandard.ZstdError as e:
        raise ArtifactError(
            f"the executable's code does not decompress ({str(e)[:120]}): {REBUILD}"
        ) from None
    if len(xla) != header.xla_bytes:
        raise ArtifactError(
            f"the executable's code is {len(xla)} bytes, its header says {header.xla_bytes}: "
            f"{REBUILD}"
        )
    return xla


def _check_consistent(header: ExecutableHeader) -> None:
    """The header's parts agree: meshes and devices, placements and meshes, trees and arrays."""
    where = "executable header"
    if len(set(header.device_ids)) != len(header.device_ids):
        raise jc.malformed(f"{where}.device_ids", "must list each device once")
    for i, mesh in enumerate(header.meshes):
        if mesh.device_ids != header.device_ids:  # one device assignment per computation
            raise jc.malformed(
                f"{where}.meshes[{i}].device_ids", "must be the header's devices in order"
            )
    for kind, arrays in (("inputs", header.inputs), ("outputs", header.outputs)):
        for i, array in enumerate(arrays):
            at, p = f"{where}.{kind}[{i}].placement", array.placement
            if p is None:
                if kind == "outputs":
                    raise jc.malformed(at, "is missing")
                continue
            if p.mesh >= len(header.meshes):
                raise jc.malformed(f"{at}.mesh", "is not one of the header's meshes")
            used = [a for e in p.spec for a in ((e,) if isinstance(e, str) else e or ())]
            names = {name for name, _ in header.meshes[p.mesh].axes}
            if len(set(used)) != len(used) or not set(used) <= names:
                raise jc.malformed(at, "must use its mesh's axes, each once")
            if len(p.spec) > len(array.shape):
                raise jc.malformed(at, "partitions more dimensions than the array has")
    for tree, arrays in (("in_tree", header.inputs), ("out_tree", header.outputs)):
        leaves = _count_leaves(_tree_from_json(getattr(header, tree), f"{where}.{tree}"))
        if leaves != len(arrays):
            raise jc.malformed(f"{where}.{tree}", f"has {leaves} leaves for {len(arrays)} arrays")


def _count_leaves(tree: Any) -> int:
    if tree is None:
        return 0
    if isinstance(tree, tuple | list):
        return sum(_count_leaves(c) for c in tree)
    if isinstance(tree, dict):
        return sum(_count_leaves(c) for c in tree.values())
    return 1


def declared_header(entry: ProgramEntry, blob: bytes) -> ExecutableHeader:
    """The header of `entry`'s executable file, when it declares the arrays its manifest entry
    records (path, shape and dtype of every input and output); ArtifactError else."""
    header, _ = read_header(blob)
    for kind, recorded, declared in (
        ("inputs", entry.inputs, header.inputs),
        ("outputs", entry.outputs, header.outputs),
    ):
        if [(s.path, tuple(s.shape), s.dtype) for s in sorted(recorded, key=lambda s: s.path)] != [
            (a.path, a.shape, a.dtype) for a in sorted(declared, key=lambda a: a.path)
        ]:
            raise ArtifactError(
                f"the executable declares other {kind} than the manifest records: {REBUILD}"
            )
    return header


def load_executable(blob: bytes, devices: Sequence[Any]) -> Any:
    """The `jax.stages.Compiled` of an executable file, on `devices` (in the recorded mesh
    order); ArtifactError for anything but a sound executable for these devices."""
    header, stored = read_header(blob)
    if [d.id for d in devices] != list(header.device_ids):
        raise ArtifactError(
            f"devices {[d.id for d in devices]} are not in the executable's order {list(header.device_ids)}"
        )
    xla = decompressed(header, stored)
    try:
        return _compiled(header, xla, devices)
    except ArtifactError:
        raise
    except Exception as e:  # XLA and jax raise anything on bytes that are not theirs
        reason = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise ArtifactError(f"cannot load the executable ({reason}): {REBUILD}") from None


def _check_shards(executable: Any, inputs: tuple[list, list], outputs: tuple[list, list]) -> None:
    """Each array's shard (by the header's shape, dtype and sharding) is the parameter or result
    XLA compiled: XLA's own check of a mismatched buffer crashes the process on CPU."""
    from jax._src.lib import xla_client as xc

    (module,) = executable.hlo_modules()
    program = xc.XlaComputation(module.as_serialized_hlo_module_proto()).program_shape()
    inputs, outputs = list(zip(*inputs, strict=True)), list(zip(*outputs, strict=True))
    params, result = program.parameter_shapes(), program.result_shape()
    if len(params) == 1 and params[0].is_tuple() and len(inputs) != 1:  # jax's tupled arguments
        params = params[0].tuple_shapes()
    results = result.tuple_shapes() if result.is_tuple() and len(outputs) != 1 else [result]
    for kind, arrays, shapes in (("inputs", inputs, params), ("outputs", outputs, results)):
        declared = [(tuple(s.shard_shape(a.shape)), a.dtype) for a, s in arrays]
        compiled = [(tuple(x.dimensions()), x.numpy_dtype()) for x in shapes]
        if declared != compiled:
            raise ArtifactError(
                f"the executable's header declares {kind} XLA did not compile for: {REBUILD}"
            )


@dataclasses.dataclass(frozen=True)
class DeclaredCall:
    """What an executable takes, from its header alone: the `args_info` tree of the jax
    Compiled it loads as (a jax.ShapeDtypeStruct per array) and its `input_shardings` (None for
    an input XLA dropped). The loader checks them against XLA's own when it loads the
    executable; until then they let the weights be placed while XLA deserializes."""

    args_info: Any
    input_shardings: Any


def declared_call(header: ExecutableHeader, devices: Sequence[Any]) -> DeclaredCall:
    """The DeclaredCall of `header` on `devices` (in its recorded order)."""
    import jax

    try:
        sharding = _shardings(header, devices)
        in_tree = jax.tree_util.tree_structure(_tree_from_json(header.in_tree, "in_tree"))
        return DeclaredCall(
            in_tree.unflatten(
                [
                    jax.ShapeDtypeStruct(a.shape, jax.numpy.dtype(a.dtype), weak_type=a.weak_type)
                    for a in header.inputs
                ]
            ),
            in_tree.unflatten([a.placement and sharding(a.placement) for a in header.inputs]),
        )
    except Exception as e:  # jax raises anything on a mesh or tree that is not sound
        reason = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise ArtifactError(
            f"the executable's header does not load ({reason}): {REBUILD}"
        ) from None


def _shardings(header: ExecutableHeader, devices: Sequence[Any]) -> Any:
    """Placement -> the NamedSharding it declares, on the header's meshes over `devices`."""
    import jax
    import numpy as np

    by_id = {d.id: d for d in devices}
    meshes = [
        jax.sharding.Mesh(
            np.array([by_id[i] for i in m.device_ids], dtype=object).reshape(
                [n for _, n in m.axes]
            ),
            tuple(name for name, _ in m.axes),
            axis_types=tuple(jax.sharding.AxisType[t] for t in m.axis_types),
        )
        for m in header.meshes
    ]

    def sharding(p: Placement) -> Any:
        spec = jax.sharding.PartitionSpec(*p.spec)
        return jax.sharding.NamedSharding(meshes[p.mesh], spec, memory_kind=p.memory_kind)

    return sharding


# Longer than most: jax's own assembly of a Compiled, in its order, each part checked first.
def _compiled(header: ExecutableHeader, xla: bytes, devices: Sequence[Any]) -> Any:
    """jax's Compiled, built as jax builds it after a compile (pxla.UnloadedMeshExecutable
    .from_hlo) from the header and XLA's deserialized executable."""
    import jax
    from jax._src import core
    from jax._src.interpreters import pxla
    from jax._src.lib import xla_client as xc
    from jax._src.stages import ArgInfo

    sharding = _shardings(header, devices)

    def aval(a: ArrayHeader) -> Any:
        return core.ShapedArray(a.shape, jax.numpy.dtype(a.dtype), weak_type=a.weak_type)

    def placed(a: ArrayHeader) -> Any:  # the aval as the compiled computation types it
        return core.update_aval_with_sharding(aval(a), sharding(a.placement))

    all_in_avals = [aval(a) for a in header.inputs]
    kept = [i for i, a in enumerate(header.inputs) if a.placement is not None]
    in_avals = [placed(header.inputs[i]) for i in kept]
    in_shardings = [sharding(header.inputs[i].placement) for i in kept]
    out_avals = [placed(a) for a in header.outputs]
    out_shardings = [sharding(a.placement) for a in header.outputs]

    device_list = xc.DeviceList(tuple(devices))
    client = devices[0].client
    executable = client.deserialize_executable(xla, executable_devices=device_list)
    _check_shards(executable, (in_avals, in_shardings), (out_avals, out_shardings))
    try:  # the header's shardings are the ones XLA compiled in
        in_shardings = pxla._maybe_get_and_check_in_shardings(
            executable, in_shardings, device_list, in_avals, 0
        )
        out_shardings = pxla._maybe_get_and_check_out_shardings(
            executable, out_shardings, device_list, out_avals, 0
        )
    except AssertionError as e:
        raise ArtifactError(
            f"the executable's header does not match XLA's shardings ({str(e)[:160]}): {REBUILD}"
        ) from None
    xla_in_layouts, xla_out_layouts = pxla._get_layouts_from_executable(
        executable, [None] * len(in_avals), [None] * len(out_avals), 0, in_avals, out_avals
    )
    debug = core.DebugInfo("jit", header.name, tuple(a.path for a in header.inputs), None)
    unloaded = pxla.UnloadedMeshExecutable(
        xla_executable=executable,
        device_list=device_list,
        backend=client,
        input_avals=in_avals,
        input_shardings=in_shardings,
        output_avals=out_avals,
        output_shardings=out_shardings,
        committed=header.committed,
        name=header.name,
        unordered_effects=[],
        ordered_effects=[],
        keepalive=[],
        host_callbacks=[],
        kept_var_idx=set(kept),
        mut=None,
        xla_in_layouts=xla_in_layouts,
        dispatch_in_layouts=pxla.get_dispatch_layouts(xla_in_layouts, in_shardings, in_avals),
        xla_out_layouts=xla_out_layouts,
        all_args_info=pxla.AllArgsInfo(all_in_avals, debug),
        pgle_profiler=None,
    )
    in_tree = jax.tree_util.tree_structure(_tree_from_json(header.in_tree, "in_tree"))
    out_tree = jax.tree_util.tree_structure(_tree_from_json(header.out_tree, "out_tree"))
    args_info = in_tree.unflatten(
        [ArgInfo(a, h.donated) for a, h in zip(all_in_avals, header.inputs, strict=True)]
    )
    return jax.stages.Compiled(unloaded.load(), [], args_info, out_tree, no_kwargs=header.no_kwargs)
