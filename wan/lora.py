"""LoRA files merged into the transformer's weights while they are placed: no rebuild, since
the weights are inputs of the compiled programs.

A file is read as memory-mapped tensors, its key format detected, and every key mapped to a
diffusers tensor name and from there, through the weight import's own rule (the transformer
kind's, from the kind registry `wan.kinds`: it also maps the original release's module names),
to a parameter of the project's tree. What is merged is

    W' = W + sum over files of  scale * (alpha / rank) * up @ down   (and scale * diff)

in float32, rounded once to the weight's dtype (a PEFT lora_B.bias, part of lora_B's output, is
scaled by alpha / rank as the product is). The low-rank factors stay as they are in the
file; a parameter's update is computed for one block of it at a time (a layer of a stacked
parameter, or one device's shard), so no full-size float32 copy of a stacked tensor is made.

Flax-free: the runtime imports it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from wan import kinds
from wan.weights import (
    Path_,
    WeightError,
    dtype_kind,
    linear,
    read_safetensors,
    safetensors_metadata,
)

FORMATS = (
    "diffusers/PEFT (transformer.blocks.N.attn1.to_q.lora_A.weight, .lora_B.weight), "
    "ComfyUI (diffusion_model.blocks.N.self_attn.q.lora_down.weight, .lora_up.weight, .alpha), "
    "kohya (lora_unet_blocks_N_self_attn_q.lora_down.weight), full deltas (.diff, .diff_b, "
    "and lightx2v's blocks.N.diff_m for a block's modulation)"
)
# Key suffix -> the part of a module's update it holds; longest first.
_PARTS = (
    (".lora_down.weight", "down"),
    (".lora_A.weight", "down"),
    (".lora_up.weight", "up"),
    (".lora_B.weight", "up"),
    (".lora_B.bias", "up_b"),  # PEFT's lora_bias: a bias delta scaled as its pair (alpha / rank)
    (".diff_b", "diff_b"),
    (".diff_m", "diff_m"),  # lightx2v: `blocks.N.diff_m` is `blocks.N.modulation.diff`
    (".alpha", "alpha"),
    (".diff", "diff"),
)
# Module names only the original Wan model uses: a file naming them is in its format.
_ORIGINAL_HINT = re.compile(
    r"(^|\.)(self_attn|cross_attn|head\.head|time_projection|text_embedding|time_embedding|img_emb)\."
)
_PREFIXES = {
    "diffusers": ("transformer.", "base_model.model."),
    "comfyui": ("diffusion_model.",),
    "kohya": ("lora_unet_",),
}
_KOHYA_BLOCK = re.compile(r"blocks_(\d+)_(.+)")


class LoraError(WeightError):
    """A LoRA file that cannot be applied to this model; names the file and the key."""


def transformer_rule(kind: str | None = None) -> Any:
    """The weight rule of transformer kind `kind` (None: the default kind), from the kind
    registry: a `wan.weights.transformer.TransformerRule`, which also names the modules as the
    original release does. Resolved by name, so this module stays flax-free."""
    name = kind or kinds.default("transformer")
    rule = kinds.lookup("transformer", name).weight_rule
    if not hasattr(rule, "from_original"):
        raise LoraError(
            f"transformer kind {name!r}: its weight rule names no modules for LoRA files, so no "
            "LoRA applies to this model"
        )
    return rule


@functools.cache
def _underscored(rule: Any) -> tuple[dict[str, str], dict[str, str]]:
    """kohya spells module paths with underscores: underscored original name -> dotted, inside
    a block and outside."""
    return (
        {k.replace(".", "_"): k for k in rule.original_block_modules},
        {k.replace(".", "_"): k for k in rule.original_modules},
    )


@dataclasses.dataclass(frozen=True)
class LowRank:
    """`scale * left @ right` in the parameter's (in, out) layout: left = down.T, right = up.T."""

    left: np.ndarray  # (in, rank), as stored in the file
    right: np.ndarray  # (rank, out)
    scale: float

    def block(self, index: tuple[slice, ...], out: np.ndarray | None = None) -> np.ndarray:
        """This update's float32 block `index` (into `out` when given)."""
        rows, cols = index
        left = np.float32(self.scale) * self.left[rows].astype(np.float32)  # (in, rank): small
        return np.matmul(left, self.right[:, cols].astype(np.float32), out=out)


@dataclasses.dataclass(frozen=True)
class Dense:
    """`scale * delta`, a full delta already in the parameter's layout."""

    delta: np.ndarray
    scale: float

    def block(self, index: tuple[slice, ...], out: np.ndarray | None = None) -> np.ndarray:
        """This update's float32 block `index` (into `out` when given)."""
        return np.multiply(self.delta[index].astype(np.float32), np.float32(self.scale), out=out)


@dataclasses.dataclass(frozen=True)
class ParamDelta:
    """Every update of one parameter (all files; per layer when it is stacked)."""

    shape: tuple[int, ...]
    terms: tuple[tuple[int | None, LowRank | Dense], ...]  # (layer or None, update)

    def merge_into(self, value: np.ndarray, index: tuple[slice, ...]) -> None:
        """Add the updates to `value`, the writable block `index` of the parameter: in float32,
        rounded once to value's dtype, a stacked parameter one layer at a time."""
        index = _normalized(index, self.shape)
        if self.terms[0][0] is None:
            _add(value, [u for _, u in self.terms], index, np.empty(value.shape, np.float32))
            return
        layers = range(*index[0].indices(self.shape[0]))
        by_layer: dict[int, list[LowRank | Dense]] = {}
        for layer, update in self.terms:
            by_layer.setdefault(layer, []).append(update)
        scratch = np.empty(value.shape[1:], np.float32)  # one layer's block, reused
        for layer, updates in sorted(by_layer.items()):
            if layer in layers:
                _add(value[layers.index(layer)], updates, index[1:], scratch)


def _normalized(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    """Explicit bounds for every dimension (jax passes `slice(None)` for unsharded ones)."""
    padded = (*index, *[slice(None)] * (len(shape) - len(index)))
    return tuple(slice(*s.indices(n)) for s, n in zip(padded, shape, strict=True))


def _add(
    value: np.ndarray, updates: list[LowRank | Dense], index: tuple[slice, ...], scratch: np.ndarray
) -> None:
    """value = round(value + sum of the updates' blocks), summed in float32 in `scratch`: the
    first update is computed into it, so a single LoRA makes no other full-size temporary."""
    updates[0].block(index, out=scratch)
    for update in updates[1:]:
        scratch += update.block(index)
    scratch += value
    value[...] = scratch


@dataclasses.dataclass(frozen=True)
class Module:
    """What a file holds for one module (a diffusers module name): a low-rank pair, its alpha,
    and full deltas of the weight and of the bias. `keys` are the file's keys, for messages."""

    keys: dict[str, str]  # part -> key in the file
    # part -> tensor: 'down', 'up', 'alpha', 'diff', 'diff_b', 'up_b' (lora_B's bias)
    tensors: dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class LoraFile:
    path: Path
    format: str  # 'diffusers', 'comfyui' or 'kohya'
    modules: dict[str, Module]  # by diffusers module name
    default_alpha: float | None  # diffusers metadata's lora_alpha; None: alpha = rank
    rule: Any  # the transformer kind's weight rule it was read for (`transformer_rule`)


@dataclasses.dataclass(frozen=True)
class AppliedLora:
    """One LoRA as applied, for reports."""

    file: str
    sha256: str
    scale: float
    transformer: str  # 'transformer' or 'transformer_2' (the low-noise expert)
    format: str
    parameters: int  # weight tensors changed, each layer of a stacked parameter counted
    # Tensors of image-feature modules (Wan 2.1 image to video's) on a model that has none,
    # left out: lightx2v's Wan 2.2 I2V-A14B files carry them, as ComfyUI skips them.
    skipped_image_tensors: int = 0


def parse_spec(text: str) -> tuple[Path, float]:
    """`FILE[:SCALE]` -> (path, scale); scale 1.0 when absent. What follows the last colon is
    the scale unless it reads as a file name (a ':' inside a path); a scale that is not a
    finite number is a LoraError."""
    path, sep, scale = text.rpartition(":")
    if not sep or "/" in scale or scale.endswith(".safetensors"):
        return Path(text), 1.0
    try:
        value = float(scale)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise LoraError(
            f"LoRA {text}: the scale {scale!r} is not a finite number: use FILE:SCALE with a "
            "finite SCALE such as 0.8"
        )
    return Path(path), value


def detect_format(names: Sequence[str]) -> str:
    if any(n.startswith("lora_unet_") for n in names):
        return "kohya"
    if any(n.startswith("diffusion_model.") or _ORIGINAL_HINT.search(n) for n in names):
        return "comfyui"
    return "diffusers"


def _split(key: str, fmt: str, rule: Any) -> tuple[str, str] | None:
    """(diffusers module name, part) of one key of a file in format `fmt`; None when the key
    names no module of the transformer (whose weight rule is `rule`) in that format."""
    found = next(((key[: -len(s)], p) for s, p in _PARTS if key.endswith(s)), None)
    if found is None:
        return None
    name, part = found
    name = next((name[len(p) :] for p in _PREFIXES[fmt] if name.startswith(p)), name)
    if fmt == "diffusers":
        return None if part == "diff_m" else (name, part)
    if part == "diff_m":  # the full delta of the module's raw `modulation` table
        name, part = f"{name}{'_' if fmt == 'kohya' else '.'}modulation", "diff"
    if fmt == "kohya":
        name = _dotted(name, rule)
    module = rule.from_original(name)
    return None if module is None else (module, part)


def _dotted(name: str, rule: Any) -> str:
    """A kohya module name (`blocks_3_self_attn_q`) in the original dotted spelling."""
    in_block, outside = _underscored(rule)
    if match := _KOHYA_BLOCK.fullmatch(name):
        local = in_block.get(match[2])
        return f"blocks.{match[1]}.{local}" if local else name
    return outside.get(name, name)


def read_lora(path: str | Path, *, kind: str | None = None) -> LoraFile:
    """Read a LoRA file's tensors (memory-mapped) and group them by module of a transformer of
    kind `kind` (None: the default kind)."""
    path, rule = Path(path), transformer_rule(kind)
    try:
        tensors = dict(read_safetensors(path))
        metadata = safetensors_metadata(path)
    except (WeightError, OSError) as e:
        raise LoraError(f"LoRA {e}") from None
    if not tensors:
        raise LoraError(f"LoRA {path} holds no tensors")
    fmt = detect_format(list(tensors))
    modules: dict[str, Module] = {}
    for key, tensor in tensors.items():
        split = _split(key, fmt, rule)
        if split is None:
            raise LoraError(f"LoRA {path}: key {key} names no transformer weight ({_known()})")
        module, part = split
        _check_values(path, key, part, tensor)
        entry = modules.setdefault(module, Module({}, {}))
        if part in entry.keys:
            raise LoraError(f"LoRA {path}: {key} and {entry.keys[part]} are the same tensor")
        entry.keys[part], entry.tensors[part] = key, tensor
    return LoraFile(path, fmt, modules, _metadata_alpha(path, metadata), rule)


def _check_values(path: Path, key: str, part: str, tensor: np.ndarray) -> None:
    """A LoRA tensor holds finite floats (an alpha may be an integer): a NaN or Inf would
    blacken every frame, an integer label on float data would misread it."""
    kind = dtype_kind(tensor.dtype)
    if kind not in (("float", "integer") if part == "alpha" else ("float",)):
        raise LoraError(
            f"LoRA {path}: {key} is stored as {tensor.dtype.name}; a LoRA's tensors are floats"
        )
    if kind == "float" and not np.isfinite(tensor).all():
        raise LoraError(
            f"LoRA {path}: {key} holds NaN or infinite values: the file is damaged, use another one"
        )


def _positive_alpha(where: str, value: object) -> float:
    """An alpha as a float; one that is not a finite positive number is a LoraError."""
    number = value if isinstance(value, int | float) and not isinstance(value, bool) else None
    if number is None or not math.isfinite(number) or number <= 0:
        raise LoraError(f"{where} is {value!r}, not a finite positive number: fix the file")
    return float(number)


def _known() -> str:
    return f"formats known: {FORMATS}"


def _metadata_alpha(path: Path, metadata: Mapping[str, str]) -> float | None:
    """lora_alpha of diffusers' `lora_adapter_metadata` (its PEFT LoraConfig); refuses the
    settings that would change the update's form."""
    raw = metadata.get("lora_adapter_metadata")
    if raw is None:
        return None
    try:
        config = {k.removeprefix("transformer."): v for k, v in json.loads(raw).items()}
    except (ValueError, AttributeError, RecursionError):
        raise LoraError(f"LoRA {path}: lora_adapter_metadata is not a JSON object") from None
    for unsupported in ("use_rslora", "use_dora", "alpha_pattern"):
        if config.get(unsupported):
            raise LoraError(f"LoRA {path}: {unsupported} is not supported")
    alpha = config.get("lora_alpha")
    return None if alpha is None else _positive_alpha(f"LoRA {path}: lora_alpha", alpha)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def check_experts(num_experts: int, loras_2: Sequence[object]) -> None:
    if loras_2 and num_experts == 1:
        raise LoraError(
            "--lora-2 (loras_2) is for the low-noise expert of a two-expert model; this model "
            "has one transformer: use --lora"
        )


def check(
    specs: Sequence[tuple[str | Path, float]],
    shapes: Mapping[Path_, tuple[int, ...]],
    *,
    kind: str | None = None,
):
    """Raise LoraError for the first LoRA of `specs` that does not fit a transformer of kind
    `kind` with parameters of `shapes` (reads the files' headers and tensor shapes, no
    weights)."""
    _collect(specs, shapes, kind)


def prepare(
    specs: Sequence[tuple[str | Path, float]],
    shapes: Mapping[Path_, tuple[int, ...]],
    transformer: str = "transformer",
    *,
    kind: str | None = None,
) -> tuple[dict[Path_, ParamDelta], list[AppliedLora]]:
    """The updates of the LoRA files `specs` ((path, scale) pairs; a file may repeat, the
    scales add up) for a transformer whose parameters have `shapes`, checked against them
    before any weight is read. `kind`: the transformer's (None: the default kind)."""
    terms, files = _collect(specs, shapes, kind)
    applied = [
        AppliedLora(
            str(f.path), file_sha256(f.path), float(scale), transformer, f.format, touched, skipped
        )
        for f, scale, touched, skipped in files
    ]
    deltas = {p: ParamDelta(tuple(shapes[p]), tuple(t)) for p, t in terms.items()}
    return deltas, applied


def _collect(
    specs: Sequence[tuple[str | Path, float]],
    shapes: Mapping[Path_, tuple[int, ...]],
    kind: str | None,
) -> tuple[
    dict[Path_, list[tuple[int | None, LowRank | Dense]]], list[tuple[LoraFile, float, int, int]]
]:
    """(updates by parameter, (file, scale, tensors it changes, image-feature tensors left
    out) per spec)."""
    terms: dict[Path_, list[tuple[int | None, LowRank | Dense]]] = {}
    files = []
    for path, scale in specs:
        lora = read_lora(path, kind=kind)
        touched: set[tuple[Path_, int | None]] = set()
        skipped = 0
        for module, entry in lora.modules.items():
            if _absent_image_module(lora, module, shapes):
                skipped += len(entry.tensors)
                continue
            for param, layer, update in _updates(lora, module, entry, shapes, float(scale)):
                terms.setdefault(param, []).append((layer, update))
                touched.add((param, layer))
        files.append((lora, float(scale), len(touched), skipped))
    return terms, files


# The modules of Wan 2.1 image to video's image features (diffusers' names): each block's
# cross-attention's image keys and values, and the image embedder.
IMAGE_FEATURE_MODULES = re.compile(
    r"blocks\.\d+\.attn2\.(add_k_proj|add_v_proj|norm_added_k)"
    r"|condition_embedder\.image_embedder\..+"
)


def _absent_image_module(lora: LoraFile, module: str, shapes: Mapping[Path_, Any]) -> bool:
    """A module of the image features that this model (with parameters `shapes`) lacks."""
    if not IMAGE_FEATURE_MODULES.fullmatch(module):
        return False
    try:
        target = lora.rule(lora.rule.tensor_name(module, "weight"))
    except WeightError:
        return False
    return target is not None and target.path not in shapes


def _updates(
    lora: LoraFile,
    module: str,
    entry: Module,
    shapes: Mapping[Path_, tuple[int, ...]],
    scale: float,
) -> list[tuple[Path_, int | None, LowRank | Dense]]:
    """(parameter, layer, update) for each update one module of a file makes."""
    parts, keys = entry.tensors, entry.keys
    out = []
    # PEFT's lora_B.bias is added as lora_B's output is: times alpha / rank, as a low-rank
    # pair's product; with no pair, alpha = rank is the only reading (with no alpha known).
    bias_scale = scale
    if pair := [keys[p] for p in ("down", "up", "alpha") if p in parts]:
        param, layer, want, transform = _target(lora, module, "weight", pair[0], shapes)
        if transform is not linear:
            raise LoraError(
                f"LoRA {lora.path}: {pair[0]}: a low-rank pair applies to Linear weights only; "
                f"{'.'.join(param)} is not one (a full delta, .diff, is)"
            )
        low_rank = _low_rank(lora, entry, want, param, scale)
        out.append((param, layer, low_rank))
        bias_scale = low_rank.scale
    elif "up_b" in parts and lora.default_alpha is not None:
        raise LoraError(
            f"LoRA {lora.path}: {keys['up_b']} has no lora_A/lora_B weights, whose rank and "
            "the file's lora_alpha scale it"
        )
    for part, leaf in (("diff", "weight"), ("diff_b", "bias"), ("up_b", "bias")):
        if part in parts:
            param, layer, want, transform = _target(lora, module, leaf, keys[part], shapes)
            try:
                delta = transform(parts[part])
            except ValueError:  # a transpose of the wrong number of dimensions
                delta = parts[part]
            if tuple(delta.shape) != want:
                raise LoraError(
                    f"LoRA {lora.path}: {keys[part]} has shape {tuple(delta.shape)} in the parameter's "
                    f"layout, {'.'.join(param)} is {want}"
                )
            out.append((param, layer, Dense(delta, bias_scale if part == "up_b" else scale)))
    return out


def _low_rank(
    lora: LoraFile, entry: Module, want: tuple[int, ...], param: Path_, scale: float
) -> LowRank:
    """A lora_down/lora_up pair (and its alpha) checked against the (in, out) kernel `want`."""
    parts, keys, where = entry.tensors, entry.keys, f"LoRA {lora.path}"
    if "down" not in parts or "up" not in parts:
        have, miss = ("down", "up") if "down" in parts else ("up", "down")
        raise LoraError(f"{where}: {keys.get(have) or keys['alpha']} has no lora_{miss} partner")
    down, up = parts["down"], parts["up"]
    got = (down.shape[-1], up.shape[0]) if down.ndim == up.ndim == 2 else None
    if got != want or up.shape[1] != down.shape[0]:
        raise LoraError(
            f"{where}: {keys['down']} (down {down.shape}, up {up.shape}) does not fit "
            f"{'.'.join(param)}: the update is {got} (in, out), the parameter {want}"
        )
    rank = down.shape[0]
    if rank == 0:
        raise LoraError(f"{where}: {keys['down']} has rank 0: the file is damaged")
    if "alpha" not in parts:
        alpha = lora.default_alpha or rank
    elif parts["alpha"].size == 1:
        alpha = _positive_alpha(
            f"{where}: {keys['alpha']}", parts["alpha"].astype(np.float64).item()
        )
    else:
        raise LoraError(f"{where}: {keys['alpha']} is not a single number")
    return LowRank(down.T, up.T, scale * alpha / rank)


def _target(
    lora: LoraFile, module: str, leaf: str, key: str, shapes: Mapping[Path_, tuple[int, ...]]
):
    """(parameter path, layer, shape of one layer's block, layout transform) of a module's
    weight or bias, through the diffusers weight import's rule."""
    name = lora.rule.tensor_name(module, leaf)
    try:
        target = lora.rule(name)
    except WeightError:
        target = None
    if target is None or target.path not in shapes:
        raise LoraError(f"LoRA {lora.path}: key {key} names no weight of this model ({_known()})")
    shape = tuple(shapes[target.path])
    if target.layer is None:
        return target.path, None, shape, target.transform
    if not 0 <= target.layer < shape[0]:
        raise LoraError(
            f"LoRA {lora.path}: key {key} is for layer {target.layer}, the model has {shape[0]}"
        )
    return target.path, target.layer, shape[1:], target.transform
