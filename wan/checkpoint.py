"""Model weights on disk: a diffusers-format folder or the project's own checkpoint (format 2:
one safetensors file per component in the programs' layout; format 1, orbax, is still read).

Both load straight into given shardings: `abstract` trees of `jax.ShapeDtypeStruct` carry the
target sharding of every parameter, and each device receives only its shards. LoRA updates
(`wan.lora`) are merged on the way, a layer or a shard at a time. Flax-free, so the
runtime loads weights without model code.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import safetensors.numpy

from wan import kinds, quant, weights
from wan.atomic import atomic_folder, owned_files
from wan.configs import CHECKPOINT_MARKER as MARKER
from wan.configs import ModelConfig, diffusers_component
from wan.lora import ParamDelta

FORMAT_VERSION = 2  # 1: orbax (still read); 2: one safetensors file per component
PARAMS = "params.safetensors"  # a component's parameters, named by their path joined with "/"
Tree = dict[str, Any]


def is_checkpoint(folder: str | Path) -> bool:
    return (Path(folder) / MARKER).is_file()


def save_checkpoint(
    folder: str | Path,
    config: ModelConfig,
    components: Mapping[str, Tree],
    tokenizer_dir: str | Path | None = None,
) -> Path:
    """Write `components` (component name -> nested dict of arrays) atomically: the folder
    appears complete or not at all."""
    folder = Path(folder).absolute()
    unknown = set(components) - set(kinds.FOLDERS)
    if unknown:
        raise ValueError(
            f"unknown components {sorted(unknown)}; expected some of {sorted(kinds.FOLDERS)}"
        )
    tmp = folder.with_name(f".tmp-{folder.name}-{os.getpid()}")
    with atomic_folder(folder, tmp, lambda old: owned_files(old, _checkpoint_files())):
        # The project's own layout (transposed, layers stacked), uncompressed, as one
        # safetensors file per component: loading is memory-mapped slices placed on the devices,
        # no conversion (bench/weights_load.py against orbax).
        for name, tree in components.items():
            (tmp / name).mkdir()
            flat = {"/".join(p): np.asarray(v) for p, v in weights.flatten(tree).items()}
            safetensors.numpy.save_file(flat, tmp / name / PARAMS)
        if tokenizer_dir is not None:
            shutil.copytree(tokenizer_dir, tmp / "tokenizer")
        meta = {
            "format": FORMAT_VERSION,
            "model": config.to_dict(),
            "components": sorted(components),
        }
        (tmp / MARKER).write_text(json.dumps(meta, indent=2))
    return folder


def _checkpoint_files() -> list[str]:
    """Every file a checkpoint folder can hold: replacing one removes these and nothing else."""
    tokenizer = (
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "spiece.model",
    )
    components = (f"{c}/{PARAMS}" for c in kinds.FOLDERS)
    return [MARKER, *components, *(f"tokenizer/{n}" for n in tokenizer)]


def load_component(
    folder: str | Path,
    component: str,
    abstract: Tree,
    deltas: Mapping[weights.Path_, ParamDelta] | None = None,
) -> Tree:
    """Load one component into the shardings of `abstract` (nested dict of ShapeDtypeStruct),
    with the LoRA updates `deltas` (by parameter path) merged in.

    A diffusers folder is imported tensor by tensor on the host and a checkpoint memory-mapped;
    each parameter is then placed shard by shard, its updates merged into each shard on the way. A checkpoint of format 1 is restored by orbax directly into the shardings, and a
    parameter with updates is then rewritten one shard at a time through the host.
    """
    folder = Path(folder)
    deltas = deltas or {}
    flat_abstract = weights.flatten(abstract)
    path = folder / component
    if is_checkpoint(folder) and path.is_dir() and not (path / PARAMS).is_file():
        return _load_orbax(path, component, abstract, deltas)
    host, pending = read_host(folder, component, flat_abstract)
    return _place_all(host, flat_abstract, deltas, abstract, pending)


def read_host(
    folder: str | Path, component: str, flat_abstract: Mapping[weights.Path_, Any]
) -> tuple[dict[weights.Path_, np.ndarray], dict[weights.Path_, Any]]:
    """A component's parameters on the host (a checkpoint's memory-mapped, a diffusers
    folder's imported), checked against `flat_abstract`, and the 8-bit kernels among them still
    to quantize: by path, the full precision they are held in (`quantized`)."""
    folder = Path(folder)
    quantized = _quantized_kernels(flat_abstract)
    if is_checkpoint(folder):
        path = folder / component
        if not (path / PARAMS).is_file():
            raise weights.WeightError(f"checkpoint {folder} has no {component}/{PARAMS}")
        return _read_params(path / PARAMS, flat_abstract, quantized)
    source = folder / kinds.ENCODE_HALVES.get(component, component)  # an encode half's: its VAE's
    if not source.is_dir():
        raise weights.WeightError(
            f"{folder} has no {source.name}/ (expected a diffusers-format folder)"
        )
    # A diffusers folder holds full precision: the 8-bit kernels are imported as their layer's
    # precision and quantized at placement; their scales are made there.
    made = {(*k[:-1], "scale") for k in quantized}
    expected = {
        p: (tuple(a.shape), quantized.get(p, np.dtype(a.dtype)))
        for p, a in flat_abstract.items()
        if p not in made
    }
    # The tensor names of a diffusers folder are its component kind's (config.json says which).
    _, rule = kinds.of(diffusers_component(folder, component)).half(component)
    return weights.import_folder(source, expected, rule), quantized


def _load_orbax(
    path: Path, component: str, abstract: Tree, deltas: Mapping[weights.Path_, ParamDelta]
) -> Tree:
    """A format-1 (orbax) checkpoint restored straight into the shardings of `abstract`, a
    parameter with updates then rewritten one shard at a time through the host."""
    flat_abstract = weights.flatten(abstract)
    if _quantized_kernels(flat_abstract):
        raise weights.WeightError(
            f"{path} is a format-1 (orbax) checkpoint, which an 8-bit (--quant) build does "
            "not read: write it again as format 2 or use its diffusers folder"
        )
    stored = _orbax_shapes(path, component)
    _check_shapes(stored, flat_abstract)
    restored = _orbax_restore(path, abstract)
    if not deltas:
        return restored
    flat = weights.flatten(restored)
    merged = _in_threads(lambda p: _merge_placed(flat[p], deltas[p]), deltas)
    return weights.unflatten_like(abstract, {**flat, **merged})


def _quantized_kernels(flat_abstract: Mapping[weights.Path_, Any]) -> dict[weights.Path_, Any]:
    """The 8-bit kernels of a --quant build's parameters (wan.models.quant_linear.QuantLinear: a
    kernel of an 8-bit dtype beside its `scale`), each with the precision of its layer (its
    bias's), which the full-precision weights are read as before they are quantized."""
    return {
        p: np.dtype(flat_abstract[(*p[:-1], "bias")].dtype)
        for p, a in flat_abstract.items()
        if p[-1] == "kernel"
        and quant.is_quantized_dtype(a.dtype)
        and (*p[:-1], "scale") in flat_abstract
    }


def _place_all(
    host: dict[weights.Path_, np.ndarray],
    flat_abstract: dict[weights.Path_, jax.ShapeDtypeStruct],
    deltas: Mapping[weights.Path_, ParamDelta],
    abstract: Tree,
    pending: Mapping[weights.Path_, Any],
) -> Tree:
    """Every parameter placed, its updates merged shard by shard; each host array is dropped
    once placed. The kernels in `pending` (full precision) are first merged with their updates
    and quantized a layer at a time, then placed with their scales."""
    scales = {(*k[:-1], "scale") for k in pending}

    def place(p: weights.Path_) -> dict[weights.Path_, jax.Array]:
        if p not in pending:
            return {p: _place(host.pop(p), flat_abstract[p], deltas.get(p))}
        kernel, scale = quantized(host.pop(p), deltas.get(p), flat_abstract[p].dtype, pending[p])
        scale_path = (*p[:-1], "scale")
        return {
            p: _place(kernel, flat_abstract[p]),
            scale_path: _place(scale, flat_abstract[scale_path]),
        }

    placed = {}
    for arrays in _in_threads(place, [p for p in flat_abstract if p not in scales]).values():
        placed.update(arrays)
    return weights.unflatten_like(abstract, placed)


def quantized(
    value: np.ndarray, delta: ParamDelta | None, dtype: Any, precision: Any
) -> tuple[np.ndarray, np.ndarray]:
    """A stacked kernel (layers..., in, out) in `dtype` and its scales, quantized one layer at
    a time from `value` as `precision` with `delta` merged (wan.quant.quantize_kernel): what
    quantizing the merged full-precision weights gives."""
    layers = value.shape[:-2]
    kernel = np.empty(value.shape, dtype)
    scale = np.empty((*layers, value.shape[-1]), np.float32)
    for layer in np.ndindex(layers):
        w = np.array(value[layer], dtype=precision)[None]
        if delta is not None:
            delta.merge_into(w, tuple(slice(i, i + 1) for i in layer))
        kernel[layer], scale[layer] = quant.quantize_kernel(w[0], np.dtype(dtype).name)
    return kernel, scale


def _read_params(
    file: Path,
    flat_abstract: Mapping[weights.Path_, jax.ShapeDtypeStruct],
    quantized: Mapping[weights.Path_, Any],
) -> tuple[dict[weights.Path_, np.ndarray], dict[weights.Path_, Any]]:
    """A checkpoint component's parameters as read-only memory maps, checked against
    `flat_abstract`; others the file holds are left (a VAE written with its encoder's
    weights). The 8-bit kernels of `quantized` are read as stored when the checkpoint holds
    them quantized (with their scales), else pending: full precision, quantized at placement."""
    stored = {tuple(name.split("/")): array for name, array in weights.read_safetensors(file)}
    pending = {
        k: precision
        for k, precision in quantized.items()
        if k in stored and not quant.is_quantized_dtype(stored[k].dtype)
    }
    made = {(*k[:-1], "scale") for k in pending}  # the scales quantizing will make
    needed = {p: a for p, a in flat_abstract.items() if p not in made}
    _check_shapes({p: a.shape for p, a in stored.items()}, needed)
    for p, want in needed.items():
        name = f"{file}: {'/'.join(p)}"
        if quant.is_quantized_dtype(stored[p].dtype) and not quant.is_quantized_dtype(want.dtype):
            raise weights.WeightError(
                f"{name} holds 8-bit weights ({stored[p].dtype}): a checkpoint quantized for "
                "a --quant build; use such a build, or the full-precision weights here"
            )
        weights.check_dtype(name, stored[p].dtype, pending.get(p, want.dtype))
    return {p: stored[p] for p in needed}, pending


def _in_threads(fn: Callable[[weights.Path_], Any], paths: Iterable[weights.Path_]) -> dict:
    """{path: fn(path)} with one thread per core: merging and placing are copies that release
    the GIL, parameter by parameter."""
    paths = list(paths)
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        return dict(zip(paths, pool.map(fn, paths), strict=True))


# One host-to-device copy at a time, each finished before the next starts: copies in flight
# together each stage a host buffer of their own, and on the v5e host the 11.4 GB text encoder
# took 11.5 s placed from 13 threads at once, 22-23 s queued from one, 2.4 s one at a time
# (bench/results/chip_transfer_1.json, chip_transfer_2.json). The host's work (conversions,
# LoRA merges, quantizing) still runs in parallel, outside the lock.
_TRANSFER = threading.Lock()


def _place(
    value: np.ndarray, target: jax.ShapeDtypeStruct, delta: ParamDelta | None = None
) -> jax.Array:
    """`value` (as target's dtype, `delta` merged) in target's sharding: each distinct shard is
    made once on the host (a view when nothing changes) and put on the devices holding it."""
    sharding = getattr(target, "sharding", None)
    if sharding is None:
        host = _block(value, (), target.dtype, delta)
        with _TRANSFER:
            return jax.block_until_ready(jax.device_put(host))
    blocks: dict[tuple, np.ndarray] = {}
    for index in sharding.addressable_devices_indices_map(value.shape).values():
        bounds = _bounds(index, value.shape)
        if bounds not in blocks:
            blocks[bounds] = _block(value, index, target.dtype, delta)
    with _TRANSFER:
        placed = jax.make_array_from_callback(
            value.shape, sharding, lambda index: blocks[_bounds(index, value.shape)]
        )
        return jax.block_until_ready(placed)


def _bounds(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple:
    return tuple(s.indices(n) for s, n in zip(index, shape, strict=True))


def _block(
    value: np.ndarray, index: tuple[slice, ...], dtype: Any, delta: ParamDelta | None
) -> np.ndarray:
    if delta is None:
        return value[index].astype(dtype, copy=False)
    out = np.array(value[index], dtype=dtype)
    delta.merge_into(out, index)
    return out


def _merge_placed(array: jax.Array, delta: ParamDelta) -> jax.Array:
    """`array` with `delta` merged, shard by shard: each distinct shard of this process is
    copied to the host once, merged there and put on every device that holds it (host
    memory: one shard; no device program, so nothing compiles)."""
    groups: dict[tuple, list[Any]] = {}
    for shard in array.addressable_shards:
        bounds = _bounds(shard.index, array.shape)
        groups.setdefault(bounds, []).append(shard)
    placed = {}
    for shards in groups.values():
        host = np.array(shards[0].data)
        delta.merge_into(host, shards[0].index)
        for shard in shards:
            placed[shard.device] = jax.device_put(host, shard.device)
    pieces = [placed[shard.device] for shard in array.addressable_shards]
    return jax.make_array_from_single_device_arrays(array.shape, array.sharding, pieces)


def _orbax_shapes(path: Path, component: str) -> dict[weights.Path_, tuple[int, ...]]:
    """The shapes of an orbax checkpoint (format 1) in `path`: a folder with neither it nor
    params.safetensors is a WeightError."""
    import orbax.checkpoint as ocp  # only format 1 needs it: not every process (0.3 s)

    try:
        with ocp.StandardCheckpointer() as ckptr:
            meta = ckptr.metadata(path.absolute()).item_metadata
        tree = weights.flatten(getattr(meta, "tree", meta))
    except Exception:  # orbax raises FileNotFoundError, ValueError, KeyError, ...; None: empty
        raise weights.WeightError(
            f"{path / PARAMS} is missing: the checkpoint's {component} weights are gone; "
            "write the checkpoint again"
        ) from None
    return {p: m.shape for p, m in tree.items()}


def _orbax_restore(path: Path, abstract: Tree) -> Tree:
    """The parameters of `abstract` from an orbax checkpoint (format 1), restored straight into
    its shardings; others stored there are left (a VAE written with its encoder's weights)."""
    import orbax.checkpoint as ocp  # as in _orbax_shapes

    args = ocp.args.PyTreeRestore(
        item=abstract,
        restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
        partial_restore=True,
    )
    with ocp.PyTreeCheckpointer() as ckptr:
        return ckptr.restore(path.absolute(), args=args)


def _check_shapes(
    stored: Mapping[weights.Path_, tuple[int, ...]],
    flat_abstract: Mapping[weights.Path_, jax.ShapeDtypeStruct],
) -> None:
    """Name the first missing or mis-shaped parameter (instead of a generic error later)."""
    for p, want in flat_abstract.items():
        name = ".".join(p)
        if p not in stored:
            raise weights.WeightError(
                f"missing weight for {name}, expected shape {tuple(want.shape)}"
            )
        got = tuple(stored[p])
        if got != tuple(want.shape):
            raise weights.WeightError(f"{name} has shape {got}, expected {tuple(want.shape)}")
