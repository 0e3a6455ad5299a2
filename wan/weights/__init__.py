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
import math
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from wan.bounded_read import open_regular
from wan.strict_config import WeightError, excerpt

Path_ = tuple[str, ...]

_SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}  # fmt: skip
MAX_HEADER_BYTES = 100 << 20  # a 14B checkpoint's header is about 100 KiB


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


# None: the tensor has no parameter here (a buffer, or the VAE encoder's in the decode half)
Rule = Callable[[str], Target | None]


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
    header, data_start = safetensors_header(path)
    tensors = {name: info for name, info in header.items() if name != "__metadata__"}
    if data_start == path.stat().st_size:  # every tensor is empty (a memory map cannot be)
        for name, info in tensors.items():
            yield name, np.empty(info["shape"], _SAFETENSORS_DTYPES[info["dtype"]])
        return
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=data_start)
    for name, info in tensors.items():
        start, end = info["data_offsets"]
        dtype = np.dtype(_SAFETENSORS_DTYPES[info["dtype"]])
        yield name, data[start:end].view(dtype).reshape(info["shape"])


def safetensors_metadata(path: str | Path) -> dict[str, str]:
    """The free-form `__metadata__` strings of a .safetensors file ({} when there are none)."""
    return safetensors_header(Path(path))[0].get("__metadata__") or {}


def safetensors_header(path: str | Path) -> tuple[dict[str, Any], int]:
    """(header, offset of the data) of a .safetensors file, every entry checked: the one
    reader of safetensors headers (checkpoints, diffusers weights, LoRA files). A file that is
    not safetensors, is truncated, or whose header lies (types, offsets past the end, tensors
    overlapping, sizes that disagree with shapes) fails here with a WeightError naming the file
    and the entry, before any of its data is mapped."""
    path = Path(path)
    # Not a plain open: a FIFO would block until a writer came.
    with open_regular(
        path, lambda reason: WeightError(f"{path} {reason}: give a safetensors file")
    ) as f:
        size = os.fstat(f.fileno()).st_size
        header_len = int.from_bytes(f.read(8), "little") if size >= 8 else 0
        if not 2 <= header_len <= min(size - 8, MAX_HEADER_BYTES):
            raise WeightError(f"{path} is not a safetensors file (or is cut short in its header)")
        header = _header_json(path, f.read(header_len))
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise WeightError(f"{path}: __metadata__ is not a map of strings to strings")
    data_size = size - 8 - header_len
    spans = sorted(
        (_tensor_span(path, name, info, header_len, data_size), name)
        for name, info in header.items()
        if name != "__metadata__"
    )
    end_of_previous, previous = 0, None
    for (start, end), name in spans:
        if start != end_of_previous:
            where = f"after {previous}" if previous else "at the start of the data"
            raise WeightError(
                f"{path}: tensor {name} starts at data byte {start}, {end_of_previous} expected "
                f"{where} (tensors overlap or leave a gap): not a valid safetensors file"
            )
        end_of_previous, previous = end, name
    return header, 8 + header_len


def _header_json(path: Path, raw: bytes) -> dict[str, Any]:
    try:
        header = json.loads(raw.decode())
    except (ValueError, RecursionError):  # UnicodeDecodeError, JSONDecodeError, deep nesting
        header = None
    if not isinstance(header, dict):
        raise WeightError(f"{path} is not a safetensors file (its header is not a JSON object)")
    return header


def _tensor_span(
    path: Path, name: str, info: Any, header_len: int, data_size: int
) -> tuple[int, int]:
    """(start, end) in the data of one header entry, checked: a known dtype, a shape of
    non-negative integers, integer offsets within the file that hold exactly the shape."""
    if not isinstance(info, dict):
        raise WeightError(f"{path}: entry {name} is not a JSON object: not a safetensors file")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in _SAFETENSORS_DTYPES:
        raise WeightError(f"{path}: tensor {name} has unsupported dtype {excerpt(dtype)}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise WeightError(f"{path}: tensor {name} has shape {excerpt(shape)}, not a list of counts")
    if (
        not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets))
        or offsets[0] > offsets[1]
    ):
        raise WeightError(
            f"{path}: tensor {name} has data_offsets {excerpt(offsets)}, not [begin, end] byte "
            "counts with begin <= end"
        )
    start, end = offsets
    if end > data_size:
        raise WeightError(
            f"{path} is truncated: tensor {name} ends at byte {8 + header_len + end}, "
            f"the file has {8 + header_len + data_size}"
        )
    nbytes = math.prod(shape) * np.dtype(_SAFETENSORS_DTYPES[dtype]).itemsize
    if end - start != nbytes:
        raise WeightError(
            f"{path}: tensor {name} has {end - start} bytes, its shape needs {nbytes}"
        )
    return start, end


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def dtype_kind(dtype: Any) -> str:
    """'float', 'integer' or 'bool' (else the dtype's name): a parameter may be read from a
    file of another dtype of its kind (f32 into bf16), never of another kind."""
    dtype = np.dtype(dtype)
    if dtype == ml_dtypes.bfloat16 or np.issubdtype(dtype, np.floating):
        return "float"
    if dtype == np.bool_:
        return "bool"
    return "integer" if np.issubdtype(dtype, np.integer) else dtype.name


def check_dtype(name: str, stored: Any, wanted: Any) -> None:
    """A WeightError naming tensor `name` when its stored dtype is of another kind than the
    parameter's (a float tensor labelled I32 would otherwise be read as integers)."""
    if dtype_kind(stored) != dtype_kind(wanted):
        raise WeightError(
            f"{name} is stored as {np.dtype(stored).name}, the model's parameter is "
            f"{np.dtype(wanted).name}: convert the weights to a {dtype_kind(wanted)} dtype"
        )


def stored_dtype(folder: str | Path) -> str:
    """The floating dtype of the weights in a component folder ('float32', 'bfloat16', ...)."""
    for file in safetensors_files(folder):
        for name, info in safetensors_header(file)[0].items():
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
            check_dtype(name, tensor.dtype, dtype)
            want = tuple(shape[1:]) if target.layer is not None else tuple(shape)
            try:
                value = target.transform(tensor)  # a view: transposes and reshapes copy nothing
            except ValueError:  # a transpose of the wrong number of dimensions
                value = tensor
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
