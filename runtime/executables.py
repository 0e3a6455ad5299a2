"""Executables of a build, serialised and loaded without trusting their pickles.

A `<program>.exec` file is (payload, in_tree, out_tree, device_ids) pickled; `payload` is jax's
own pickle of the unloaded executable. Both are unpickled by unpicklers that resolve nothing but
the exact globals listed in `ALLOWED_GLOBALS`, matched before any import or lookup, and the
structures they give are type-checked before use (docs/security.md says why, and what a crafted
executable can still do). Called only with bytes whose size and sha256 the manifest vouched for
(`runtime.artifact.read_verified`).
"""

from __future__ import annotations

import importlib
import io
import pickle
from collections.abc import Callable, Sequence
from typing import Any

from runtime.artifact import REBUILD, ArtifactError

# Executables: (payload, in_tree, out_tree, device_ids) pickled; the device ids ride inside the
# checksummed file so that a tampered or mismatched manifest order is caught before XLA sees it.
# `payload` is jax's own pickle of the unloaded executable (jax.experimental.serialize_executable)
# whose persistent ids carry the XLA executable's bytes, the devices (by id) and the client.

# The only globals each pickle may name. A name is matched here before anything is imported or
# looked up, then resolved as a plain attribute of its imported module: no dotted names, no
# builtins (the containers are pickle opcodes). Derived by recording every find_class call
# while loading real builds made with jax 0.10.2: tiny cpu-1, cpu-4 (batch 2, no CFG), cpu-8
# (dot; blockwise with Ulysses), cpu-2x4, a bf16 two-expert model (adds ml_dtypes.bfloat16), an
# fp8 --quant build (adds ml_dtypes.float8_e4m3fn) and deviceless tpu-v6e-8 builds (dot;
# splash) all ask for this same set. After a jax upgrade,
# tests/test_hostile_artifacts.py::test_allowed_globals_cover_a_real_build records the globals of
# a fresh build and names any one missing here.
ALLOWED_GLOBALS: dict[str, frozenset[tuple[str, str]]] = {
    "executable": frozenset({
        ("jax._src.tree_util", "default_registry"),
        ("jax._src.tree_util", "tracing_registry"),
        ("jaxlib._jax.pytree", "PyTreeDef"),
    }),
    "payload": frozenset({
        ("jax", "P"),
        ("jax._src.core", "ManualAxisType"),
        ("jax._src.core", "MemorySpace"),
        ("jax._src.core", "ShapedArray"),
        ("jax._src.interpreters.pxla", "AllArgsInfo"),
        ("jax._src.interpreters.pxla", "UnloadedMeshExecutable"),
        ("jax._src.layout", "Layout"),
        ("jax._src.linear_util", "DebugInfo"),
        ("jax._src.mesh", "AbstractDevice"),
        ("jax._src.mesh", "AbstractMesh"),
        ("jax._src.mesh", "AxisType"),
        ("jax._src.mesh", "Mesh"),
        ("jax._src.named_sharding", "_unpickle_named_sharding"),
        ("jax._src.stages", "ArgInfo"),
        ("jaxlib._jax", "DeviceList"),
        ("ml_dtypes", "bfloat16"),
        ("ml_dtypes", "float8_e4m3fn"),  # --quant w8a8-fp8 / w8-fp8 kernels
        ("numpy", "dtype"),
        ("numpy", "ndarray"),
        ("numpy._core.multiarray", "_reconstruct"),
    }),
}  # fmt: skip


def _allowed_global(module: Any, name: Any, pickle_kind: str) -> Any:
    """The global (module, name) if it is in ALLOWED_GLOBALS[pickle_kind]; checked before any
    import or attribute lookup."""
    if (module, name) not in ALLOWED_GLOBALS[pickle_kind]:
        raise ArtifactError(
            f"the {pickle_kind} pickle names {repr(module)[:80]}, {repr(name)[:80]}: not an allowed "
            f"jax/jaxlib/numpy class or function of an executable; refusing to load it; {REBUILD}"
        )
    return getattr(importlib.import_module(module), name)


class _ExecutableUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        return _allowed_global(module, name, "executable")


def dump_executable(compiled: Any, device_ids: Sequence[int]) -> bytes:
    from jax.experimental import serialize_executable

    payload, in_tree, out_tree = serialize_executable.serialize(compiled)
    return pickle.dumps((payload, in_tree, out_tree, list(device_ids)), protocol=5)


def _unpickled(load: Callable[[], Any], what: str) -> Any:
    """What `load` unpickles; any failure of a damaged pickle is an ArtifactError."""
    try:
        return load()
    except ArtifactError:
        raise
    except Exception as e:  # pickle and jax raise anything on hostile bytes
        reason = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise ArtifactError(f"cannot deserialize the {what} ({reason}): {REBUILD}") from None


def _executable_parts(blob: bytes) -> tuple[bytes, Any, Any, list[int]]:
    """(payload, in_tree, out_tree, device_ids) of an executable file, each of its type."""
    from jax.tree_util import PyTreeDef

    parts = _unpickled(lambda: _ExecutableUnpickler(io.BytesIO(blob)).load(), "executable")
    if not (
        isinstance(parts, tuple)
        and len(parts) == 4
        and isinstance(parts[0], bytes)
        and isinstance(parts[1], PyTreeDef)
        and isinstance(parts[2], PyTreeDef)
        and isinstance(parts[3], list)
        and all(type(i) is int for i in parts[3])
    ):
        raise ArtifactError(
            "executable is not (payload, in_tree, out_tree, device_ids): refusing to load it; "
            + REBUILD
        )
    return parts


def executable_device_ids(blob: bytes) -> list[int]:
    return _executable_parts(blob)[3]


def _payload_parts(payload: bytes, devices: Sequence[Any]) -> tuple[Any, list[Any], bool]:
    """(unloaded executable, flat argument infos, no_kwargs) of jax's payload, unpickled onto
    `devices` with only the payload's allowed globals and jax's three persistent ids."""
    from jax._src.interpreters.pxla import UnloadedMeshExecutable
    from jax._src.stages import ArgInfo
    from jax.experimental import serialize_executable

    class PayloadUnpickler(serialize_executable._JaxPjrtUnpickler):
        def find_class(self, module: str, name: str) -> Any:
            return _allowed_global(module, name, "payload")

        def persistent_load(self, pid: Any) -> Any:
            match pid:
                case ("exec", bytes()) | ("client",):
                    return super().persistent_load(pid)
                case ("device", int() as i) if i in self.devices_by_id and type(i) is int:
                    return super().persistent_load(pid)
            raise ArtifactError(
                f"the payload pickle names the persistent id {repr(pid)[:80]}, not jax's exec, "
                f"device of this job or client: refusing to load it; {REBUILD}"
            )

    parts = _unpickled(
        lambda: PayloadUnpickler(io.BytesIO(payload), devices[0].client, devices).load(),
        "executable's payload",
    )
    if not (
        isinstance(parts, tuple)
        and len(parts) == 3
        and type(parts[0]) is UnloadedMeshExecutable
        and isinstance(parts[1], list)
        and all(type(a) is ArgInfo for a in parts[1])
        and isinstance(parts[2], bool)
    ):
        raise ArtifactError(
            "executable's payload is not jax's (executable, argument infos, no_kwargs): "
            f"refusing to load it; {REBUILD}"
        )
    return parts


def load_executable(blob: bytes, devices: Sequence[Any]) -> Any:
    """Deserialize onto `devices` (in the recorded mesh order) with the allow-listed
    unpicklers; ArtifactError for anything but a sound executable for these devices."""
    import jax

    payload, in_tree, out_tree, device_ids = _executable_parts(blob)
    if [d.id for d in devices] != device_ids:
        raise ArtifactError(
            f"devices {[d.id for d in devices]} are not in the executable's order {device_ids}"
        )
    unloaded, args_info_flat, no_kwargs = _payload_parts(payload, devices)

    def load() -> Any:
        args_info = in_tree.unflatten(args_info_flat)
        return jax.stages.Compiled(unloaded.load(), [], args_info, out_tree, no_kwargs=no_kwargs)

    return _unpickled(load, "executable")
