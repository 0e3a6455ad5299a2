"""Import diffusers-format safetensors into the project's parameter trees.

Flax-free: the runtime uses it too. A parameter tree is a nested dict of arrays (the pure
dict of an NNX state); here it is handled flat, keyed by path tuples. Each model has a rule
module (`wan.weights.transformer`, `.vae`, `.text_encoder`) mapping a diffusers tensor name to
a `Target`. Tensors are read through a memory map and written straight into one preallocated
host array per parameter (stacked layers filled slice by slice), so a 14B import holds one
copy of the weights in host memory.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from wan.errors import InputError

Path_ = tuple[str, ...]

_SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}  # fmt: skip


def identity(w: np.ndarray) -> np.ndarray:
    return w


def linear(w: np.ndarray) -> np.ndarray:
    """torch Linear (out, in) -> flax (in, out)."""
    return w.T


def conv3d(w: np.ndarray) -> np.ndarray:
    """torch Conv3d (out, in, t, h, w) -> flax (t, h, w, in, out)."""
    return w.transpose(2, 3, 4, 1, 0)


def conv2d(w: np.ndarray) -> np.ndarray:
    """torch Conv2d (out, in, h, w) -> flax (h, w, in, out)."""
    return w.transpose(2, 3, 1, 0)


@dataclasses.dataclass(frozen=True)
class Target:
    """Where one diffusers tensor lands: `path` in the flat tree, `layer` the index on the
    leading stacked-layers axis (None for unstacked parameters), `transform` the layout change."""

    path: Path_
    layer: int | None = None
    transform: Callable[[np.ndarray], np.ndarray] = identity


Rule = Callable[[str], Target | None]  # None: the tensor has no parameter here (a buffer)


class WeightError(InputError):
    """A weight file does not fit the model: names the parameter and the expected shape."""


def flatten(tree: Mapping[str, Any], prefix: Path_ = ()) -> dict[Path_, Any]:
    out: dict[Path_, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(flatten(value, (*prefix, str(key))))
        else:
            out[(*prefix, str(key))] = value
    return out


def unflatten(flat: Mapping[Path_, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def unflatten_like(
    like: Mapping[Any, Any], flat: Mapping[Path_, Any], prefix: Path_ = ()
) -> dict[Any, Any]:
    """`flat` rebuilt with the structure of `like`, keeping its key types (NNX uses int keys
    for module lists, which the string paths of `flatten` lose)."""
    return {
        key: unflatten_like(value, flat, (*prefix, str(key)))
        if isinstance(value, Mapping)
        else flat[(*prefix, str(key))]
        for key, value in like.items()
    }


def read_safetensors(path: str | Path) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (name, array) from one .safetensors file as read-only memory-mapped views."""
    path = Path(path)
    header, data_start = _header(path)
    if data_start == path.stat().st_size:
        return  # no tensor data (a memory map cannot be empty)
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=data_start)
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        dtype = np.dtype(_SAFETENSORS_DTYPES[info["dtype"]])
        yield name, data[start:end].view(dtype).reshape(info["shape"])


def safetensors_metadata(path: str | Path) -> dict[str, str]:
    """The free-form `__metadata__` strings of a .safetensors file ({} when there are none)."""
    return _header(Path(path))[0].get("__metadata__") or {}


def _header(path: Path) -> tuple[dict[str, Any], int]:
    """(header, offset of the data) of a .safetensors file, checked against the file's size:
    a file that is not safetensors, or is truncated, fails here rather than as a reshape error
    (or a read past the end of a memory map) later."""
    size = path.stat().st_size
    with path.open("rb") as f:
        header_len = int.from_bytes(f.read(8), "little") if size >= 8 else 0
        try:
            if not 2 <= header_len <= size - 8:
                raise ValueError
            header = json.loads(f.read(header_len))
            if not isinstance(header, dict):
                raise ValueError
        except (ValueError, UnicodeDecodeError):
            raise WeightError(
                f"{path} is not a safetensors file (or is cut short in its header)"
            ) from None
    data_size = size - 8 - header_len
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            start, end = (int(x) for x in info["data_offsets"])
            count = int(np.prod([int(d) for d in info["shape"]]))
            dtype = info["dtype"]
        except (KeyError, TypeError, ValueError):
            raise WeightError(f"{path} is not a safetensors file (entry {name})") from None
        if dtype not in _SAFETENSORS_DTYPES:
            raise WeightError(f"{path}: tensor {name} has unsupported dtype {dtype}")
        nbytes = count * np.dtype(_SAFETENSORS_DTYPES[dtype]).itemsize
        if end > data_size:
            raise WeightError(
                f"{path} is truncated: tensor {name} ends at byte {8 + header_len + end}, "
                f"the file has {size}"
            )
        if end - start != nbytes:
            raise WeightError(
                f"{path}: tensor {name} has {end - start} bytes, its shape needs {nbytes}"
            )
    return header, 8 + header_len


def stored_dtype(folder: str | Path) -> str:
    """The floating dtype of the weights in a component folder ('float32', 'bfloat16', ...)."""
    for file in safetensors_files(folder):
        for name, info in _header(file)[0].items():
            if name != "__metadata__" and info["dtype"] in ("F32", "BF16", "F16"):
                return np.dtype(_SAFETENSORS_DTYPES[info["dtype"]]).name
    raise WeightError(f"no floating-point weights in {folder}")


def safetensors_files(folder: str | Path) -> list[Path]:
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise WeightError(f"no .safetensors files in {folder}")
    return files


def import_tensors(
    tensors: Iterator[tuple[str, np.ndarray]],
    expected: Mapping[Path_, tuple[tuple[int, ...], Any]],
    rule: Rule,
) -> dict[Path_, np.ndarray]:
    """Fill a flat parameter tree of the `expected` (shape, dtype) from diffusers tensors.

    Every expected parameter (every layer of a stacked one) must be written exactly once.
    """
    out: dict[Path_, np.ndarray] = {}
    filled: dict[Path_, set[int | None]] = {}
    # The copies (reading the file's pages, transposing, casting) run in one thread per core:
    # numpy releases the GIL while it copies, and each writes its own slice.
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        copies = []
        for name, tensor in tensors:
            target = rule(name)
            if target is None:
                continue
            if target.path not in expected:
                raise WeightError(
                    f"{name} maps to {'.'.join(target.path)}, which the model does not have"
                )
            shape, dtype = expected[target.path]
            value = target.transform(tensor)  # a view: transposes and reshapes copy nothing
            want = tuple(shape[1:]) if target.layer is not None else tuple(shape)
            if value.shape != want:
                raise WeightError(
                    f"{name}: shape {value.shape} does not fit {'.'.join(target.path)}, "
                    f"expected {want}"
                )
            if target.layer is not None and not 0 <= target.layer < shape[0]:
                raise WeightError(
                    f"{name}: layer {target.layer} out of range for {shape[0]} layers"
                )
            if target.path not in out:
                out[target.path] = np.empty(shape, dtype=dtype)
            dst = out[target.path] if target.layer is None else out[target.path][target.layer]
            copies.append(pool.submit(_copy, dst, value))
            filled.setdefault(target.path, set()).add(target.layer)
        for copy in copies:
            copy.result()
    for path, (shape, _) in expected.items():
        got = filled.get(path, set())
        # A parameter filled layer by layer is stacked: every layer must be there.
        stacked = bool(got) and None not in got
        need = set(range(shape[0])) if stacked else {None}
        missing = need - got
        if missing:
            where = "" if missing == {None} else f" (layers {sorted(missing)})"
            raise WeightError(
                f"missing weight for {'.'.join(path)}{where}, expected shape {tuple(shape)}"
            )
    return out


def _copy(dst: np.ndarray, src: np.ndarray, tile: int = 512) -> None:
    """dst[...] = src. A transposed matrix (a Linear's torch layout) is copied a tile at a time:
    one strided copy of the whole matrix misses the cache on every element (4x slower)."""
    if src.ndim != 2 or src.flags.c_contiguous:
        dst[...] = src
        return
    for i in range(0, src.shape[0], tile):
        for j in range(0, src.shape[1], tile):
            dst[i : i + tile, j : j + tile] = src[i : i + tile, j : j + tile]


def import_folder(
    folder: str | Path, expected: Mapping[Path_, tuple[tuple[int, ...], Any]], rule: Rule
) -> dict[Path_, np.ndarray]:
    """Import every .safetensors file of a diffusers component folder (e.g. `transformer/`)."""

    def tensors() -> Iterator[tuple[str, np.ndarray]]:
        for file in safetensors_files(folder):
            yield from read_safetensors(file)

    return import_tensors(tensors(), expected, rule)
