"""Model weights on disk: a diffusers-format folder or the project's own orbax checkpoint.

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
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from wan import weights
from wan.atomic import atomic_folder
from wan.configs import CHECKPOINT_MARKER as MARKER
from wan.configs import ModelConfig
from wan.lora import ParamDelta
from wan.weights import text_encoder as text_encoder_rules
from wan.weights import transformer as transformer_rules
from wan.weights import vae as vae_rules

FORMAT_VERSION = 1
# Component folder -> weight rule, named as in a diffusers WanPipeline folder.
RULES: dict[str, weights.Rule] = {
    "transformer": transformer_rules.rule,
    "transformer_2": transformer_rules.rule,
    "vae": vae_rules.rule,
    "text_encoder": text_encoder_rules.rule,
}
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
    unknown = set(components) - set(RULES)
    if unknown:
        raise ValueError(f"unknown components {sorted(unknown)}; expected some of {sorted(RULES)}")
    tmp = folder.with_name(f".tmp-{folder.name}-{os.getpid()}")
    with atomic_folder(folder, tmp):
        # Uncompressed: zstd saves about a fifth of the bytes of bf16 weights and more than
        # doubles the restore time (bench/weights_load.py); loading is what runs at every start.
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False)) as ckptr:
            for name, tree in components.items():
                ckptr.save(tmp / name, args=ocp.args.PyTreeSave(tree))
        if tokenizer_dir is not None:
            shutil.copytree(tokenizer_dir, tmp / "tokenizer")
        meta = {
            "format": FORMAT_VERSION,
            "model": config.to_dict(),
            "components": sorted(components),
        }
        (tmp / MARKER).write_text(json.dumps(meta, indent=2))
    return folder


def load_component(
    folder: str | Path,
    component: str,
    abstract: Tree,
    deltas: Mapping[weights.Path_, ParamDelta] | None = None,
) -> Tree:
    """Load one component into the shardings of `abstract` (nested dict of ShapeDtypeStruct),
    with the LoRA updates `deltas` (by parameter path) merged in.

    A diffusers folder is imported tensor by tensor on the host, its parameters merged layer by
    layer in that host copy, then each placed shard by shard; a checkpoint is restored by orbax
    directly into the shardings, and a parameter with updates is then rewritten one shard at a
    time through the host.
    """
    folder = Path(folder)
    deltas = deltas or {}
    if is_checkpoint(folder):
        path = folder / component
        if not path.is_dir():
            raise weights.WeightError(f"checkpoint {folder} has no {component}/")
        _check_checkpoint_shapes(path, abstract)
        with ocp.StandardCheckpointer() as ckptr:
            restored = ckptr.restore(path.absolute(), abstract)
        if not deltas:
            return restored
        flat = weights.flatten(restored)
        merged = _in_threads(lambda p: _merge_placed(flat[p], deltas[p]), deltas)
        return weights.unflatten_like(abstract, {**flat, **merged})
    source = folder / component
    if not source.is_dir():
        raise weights.WeightError(
            f"{folder} has no {component}/ (expected a diffusers-format folder)"
        )
    flat_abstract = weights.flatten(abstract)
    expected = {p: (tuple(a.shape), np.dtype(a.dtype)) for p, a in flat_abstract.items()}
    host = weights.import_folder(source, expected, RULES[component])
    _in_threads(lambda p: deltas[p].merge_into(host[p], ()), deltas)
    # Each host copy is dropped once placed.
    placed = _in_threads(lambda p: _place(host.pop(p), flat_abstract[p]), flat_abstract)
    return weights.unflatten_like(abstract, placed)


def _in_threads(fn: Callable[[weights.Path_], Any], paths: Iterable[weights.Path_]) -> dict:
    """{path: fn(path)} with one thread per core: merging and placing are copies that release
    the GIL, parameter by parameter."""
    paths = list(paths)
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        return dict(zip(paths, pool.map(fn, paths), strict=True))


def _place(value: np.ndarray, target: jax.ShapeDtypeStruct) -> jax.Array:
    sharding = getattr(target, "sharding", None)
    if sharding is None:
        return jax.device_put(value)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def _merge_placed(array: jax.Array, delta: ParamDelta) -> jax.Array:
    """`array` with `delta` merged, shard by shard: each distinct shard of this process is
    copied to the host once, merged there and put on every device that holds it (host
    memory: one shard; no device program, so nothing compiles)."""
    groups: dict[tuple, list[Any]] = {}
    for shard in array.addressable_shards:
        bounds = tuple(s.indices(n) for s, n in zip(shard.index, array.shape, strict=True))
        groups.setdefault(bounds, []).append(shard)
    placed = {}
    for shards in groups.values():
        host = np.array(shards[0].data)
        delta.merge_into(host, shards[0].index)
        for shard in shards:
            placed[shard.device] = jax.device_put(host, shard.device)
    pieces = [placed[shard.device] for shard in array.addressable_shards]
    return jax.make_array_from_single_device_arrays(array.shape, array.sharding, pieces)


def _check_checkpoint_shapes(path: Path, abstract: Tree) -> None:
    """Name the first missing or mis-shaped parameter instead of orbax's generic error."""
    with ocp.StandardCheckpointer() as ckptr:
        meta = ckptr.metadata(path.absolute()).item_metadata
        stored = weights.flatten(getattr(meta, "tree", meta))
    for p, want in weights.flatten(abstract).items():
        name = ".".join(p)
        if p not in stored:
            raise weights.WeightError(
                f"missing weight for {name}, expected shape {tuple(want.shape)}"
            )
        got = tuple(stored[p].shape)
        if got != tuple(want.shape):
            raise weights.WeightError(f"{name} has shape {got}, expected {tuple(want.shape)}")
