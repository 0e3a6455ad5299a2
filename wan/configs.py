"""Model configurations: one frozen dataclass per model, mirroring diffusers' config.json.

Flax-free on purpose: the runtime reads configs and presets without importing model code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Self

from wan.errors import InputError

# Wan 2.1 VAE latent statistics (diffusers' AutoencoderKLWan defaults).
WAN21_LATENTS_MEAN = (
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
)  # fmt: skip
WAN21_LATENTS_STD = (
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
)  # fmt: skip


CHECKPOINT_MARKER = "wan_checkpoint.json"  # a project checkpoint's metadata (wan.checkpoint)
DTYPES = ("float32", "bfloat16", "float16")  # what a model's weights and activations may use
MAX_CONFIG_BYTES = 16 << 20  # a config.json is a few KiB; a bigger one is not a config


class WeightError(InputError):
    """A weights folder does not fit the model: names the file and the key or parameter.
    (Defined here, with no heavy import, so that reading a config stays light.)"""


# Integer fields' (lowest, highest) values: the highest are far above every released model
# (the 14B: 5120 wide, 40 layers, a 256384-token vocabulary) and keep a lying config from
# describing a model no memory can hold.
_WIDTH = (1, 1 << 16)
_INT_RANGES = {
    "patch_size": (1, 64),
    "num_attention_heads": (1, 1024),
    "attention_head_dim": (1, 4096),
    "num_layers": (1, 1024),
    "vocab_size": (1, 1 << 22),
    "rope_max_seq_len": (1, 1 << 16),
    "max_length": (1, 1 << 16),
    "dim_mult": (1, 64),
    "num_res_blocks": (1, 64),
    "in_channels": (1, 1024),
    "out_channels": (1, 1024),
    "z_dim": (1, 1024),
    "relative_attention_num_buckets": (1, 1 << 16),
    "relative_attention_max_distance": (1, 1 << 20),
    "num_train_timesteps": (1, 1 << 20),
    "solver_order": (1, 3),
}
# Float fields that must be positive (all must be finite).
_POSITIVE = {"eps", "layer_norm_epsilon", "latents_std", "flow_shift"}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _problem(name: str, kind: str, value: Any) -> str | None:
    """Why `value` does not fit field `name` of annotation `kind` (None when it fits)."""
    if kind.endswith(" | None"):
        return None if value is None else _problem(name, kind.removesuffix(" | None"), value)
    if kind.startswith("tuple["):
        item, _, rest = kind[len("tuple[") : -1].partition(", ")
        length = None if rest == "..." else kind.count(",") + 1
        fits = isinstance(value, list | tuple) and length in (None, len(value))
        if fits and not any(_problem(name, item, v) for v in value):
            return None
        return f"a list of {f'{length} ' if length else ''}items, each {_problem(name, item, None)}"
    if kind == "int":
        low, high = _INT_RANGES.get(name, _WIDTH)
        return None if _is_int(value) and low <= value <= high else f"an integer in [{low}, {high}]"
    if kind == "float":
        if not _is_number(value):
            return "a finite number"
        return "a positive number" if name in _POSITIVE and value <= 0 else None
    if kind == "bool":
        return None if isinstance(value, bool) else "true or false"
    if kind == "str":
        return None if isinstance(value, str) else "a string"
    raise AssertionError(f"no check for {kind}")  # a field added without one


def _from_dict(cls, raw: Any):
    """Build `cls` from a config.json dict: known fields only (each checked against its type
    and range), lists become tuples."""
    if not isinstance(raw, dict):
        raise WeightError(f"the config is {excerpt(raw)}, expected a JSON object")
    fields = {f.name: f.type for f in dataclasses.fields(cls)}
    for name, value in raw.items():
        if name in fields and (problem := _problem(name, fields[name], value)):
            raise WeightError(f"{name} is {excerpt(value)}, expected {problem}")
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items() if k in fields}
    return cls(**kwargs)


def excerpt(value: Any) -> str:
    """`value` of a config or header as JSON, cut short: a message stays one line."""
    try:
        text = json.dumps(value, default=repr)
    except RecursionError:  # nested as deep as the parser allowed
        text = f"a deeply nested {type(value).__name__}"
    return text if len(text) <= 60 else f"{text[:57]}..."


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise WeightError(message)


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """diffusers `WanTransformer3DModel` config (text-to-video subset)."""

    patch_size: tuple[int, int, int] = (1, 2, 2)
    num_attention_heads: int = 40
    attention_head_dim: int = 128
    in_channels: int = 16
    out_channels: int = 16
    text_dim: int = 4096
    freq_dim: int = 256
    ffn_dim: int = 13824
    num_layers: int = 40
    cross_attn_norm: bool = True
    qk_norm: str | None = "rms_norm_across_heads"
    eps: float = 1e-6
    rope_max_seq_len: int = 1024

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    def patch_grid(self, video: Sequence[int]) -> tuple[int, int, int]:
        """(frames, rows, cols) of patches for a latent video of (T, H, W): the token grid."""
        if any(n % p for n, p in zip(video, self.patch_size, strict=True)):
            raise InputError(
                f"latent size {tuple(video)} is not a multiple of the patch size {self.patch_size}"
            )
        grid = tuple(n // p for n, p in zip(video, self.patch_size, strict=True))
        if max(grid) > self.rope_max_seq_len:
            raise InputError(f"patch grid {grid} exceeds rope_max_seq_len={self.rope_max_seq_len}")
        return grid  # type: ignore[return-value]

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Self:
        return _from_dict(cls, raw)


@dataclasses.dataclass(frozen=True)
class VAEConfig:
    """diffusers `AutoencoderKLWan` config (Wan 2.1 VAE)."""

    base_dim: int = 96
    z_dim: int = 16
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    attn_scales: tuple[float, ...] = ()
    temperal_downsample: tuple[bool, ...] = (False, True, True)
    latents_mean: tuple[float, ...] = WAN21_LATENTS_MEAN
    latents_std: tuple[float, ...] = WAN21_LATENTS_STD
    in_channels: int = 3
    out_channels: int = 3

    @property
    def spatial_factor(self) -> int:
        return 2 ** (len(self.dim_mult) - 1)

    @property
    def temporal_factor(self) -> int:
        return 2 ** sum(self.temperal_downsample)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Self:
        config = _from_dict(cls, raw)
        _require(
            1 <= len(config.dim_mult) <= 8,
            f"dim_mult has {len(config.dim_mult)} levels, expected 1 to 8",
        )
        _require(
            len(config.temperal_downsample) == len(config.dim_mult) - 1,
            f"temperal_downsample has {len(config.temperal_downsample)} entries, expected one "
            f"per downsampling level ({len(config.dim_mult) - 1})",
        )
        for name in ("latents_mean", "latents_std"):
            count = len(getattr(config, name))
            _require(
                count == config.z_dim, f"{name} has {count} values, expected z_dim's {config.z_dim}"
            )
        return config


@dataclasses.dataclass(frozen=True)
class TextEncoderConfig:
    """transformers `UMT5Config`, encoder side."""

    vocab_size: int = 256384
    d_model: int = 4096
    d_kv: int = 64
    d_ff: int = 10240
    num_layers: int = 24
    num_heads: int = 64
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    max_length: int = 512  # diffusers' WanPipeline pads prompt embeddings to this

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Self:
        return _from_dict(cls, raw)


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Sampler settings. `kind` is 'unipc' (diffusers UniPCMultistepScheduler) or 'euler'."""

    kind: str = "unipc"
    num_train_timesteps: int = 1000
    flow_shift: float = 5.0
    solver_order: int = 2

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Self:
        """Our own form (`ModelConfig.to_dict`'s), checked."""
        config = _from_dict(cls, raw)
        _require(
            config.kind in ("unipc", "euler"),
            f"kind is {excerpt(config.kind)}, expected unipc or euler",
        )
        return config

    @classmethod
    def from_diffusers(cls, raw: dict[str, Any]) -> Self:
        """A diffusers scheduler_config.json."""
        if not isinstance(raw, dict):
            raise WeightError(f"the config is {excerpt(raw)}, expected a JSON object")
        kind = "euler" if raw.get("_class_name") == "FlowMatchEulerDiscreteScheduler" else "unipc"
        shift = raw.get("flow_shift", raw.get("shift", 5.0))
        _require(
            _is_number(shift) or shift is None,
            f"flow_shift is {excerpt(shift)}, expected a positive number",
        )
        return cls.from_dict(
            {
                "kind": kind,
                "num_train_timesteps": raw.get("num_train_timesteps", 1000),
                "flow_shift": float(shift if shift is not None else 1.0),
                "solver_order": raw.get("solver_order", 2),
            }
        )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A whole text-to-video model. `boundary_ratio` set means two experts (Wan 2.2 A14B):
    the first transformer serves timesteps >= boundary_ratio * num_train_timesteps."""

    name: str
    transformer: TransformerConfig
    vae: VAEConfig
    text_encoder: TextEncoderConfig
    scheduler: SchedulerConfig
    boundary_ratio: float | None = None
    dtype: str = "bfloat16"  # weights and activations of the transformer and text encoder

    @property
    def num_experts(self) -> int:
        return 1 if self.boundary_ratio is None else 2

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def hash(self) -> str:
        """Identifies the architecture and numerics (not the name): builds and weights match on it."""
        blob = json.dumps({**self.to_dict(), "name": None}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Self:
        """Inverse of `to_dict`; a value of the wrong type or range is a WeightError naming
        its key."""
        if not isinstance(raw, dict):
            raise WeightError(f"the model is {excerpt(raw)}, expected a JSON object")
        parts = {"transformer": TransformerConfig, "vae": VAEConfig}
        parts |= {"text_encoder": TextEncoderConfig, "scheduler": SchedulerConfig}
        for key in ("name", *parts):
            _require(key in raw, f"{key} is missing")
        _require(isinstance(raw["name"], str), f"name is {excerpt(raw['name'])}, expected a string")
        config = {}
        for key, part in parts.items():
            with _key_prefix(key):
                config[key] = part.from_dict(raw[key])
        return cls(
            name=raw["name"],
            **config,
            boundary_ratio=_boundary_ratio(raw.get("boundary_ratio")),
            dtype=_dtype(raw.get("dtype", "bfloat16")),
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> Self:
        """The config of a project checkpoint or of a diffusers-format folder (JSON only)."""
        marker = Path(folder) / CHECKPOINT_MARKER
        if marker.is_file():
            meta = read_json(marker)
            with _in_file(marker):
                _require(isinstance(meta, dict) and "model" in meta, "has no model")
                return cls.from_dict(meta["model"])
        return cls.from_diffusers(folder)

    @classmethod
    def from_diffusers(cls, folder: str | Path, dtype: str | None = None) -> Self:
        """Read the config.json files of a diffusers-format model folder. `dtype` defaults to
        the dtype the transformer's weights are stored in."""
        from wan.weights import stored_dtype

        root = Path(folder)

        def read(sub: str, part: type) -> Any:
            path = root / sub / "config.json"
            if not path.is_file():
                raise WeightError(f"{path} is missing: not a diffusers-format WAN folder")
            with _in_file(path):
                return part.from_dict(read_json(path))

        index = root / "model_index.json"
        pipeline = read_json(index) if index.is_file() else {}
        sched_path = root / "scheduler" / "scheduler_config.json"
        with _in_file(sched_path):
            scheduler = SchedulerConfig.from_diffusers(
                read_json(sched_path) if sched_path.is_file() else {}
            )
        with _in_file(index):
            _require(isinstance(pipeline, dict), f"is {excerpt(pipeline)}, expected a JSON object")
            boundary_ratio = _boundary_ratio(pipeline.get("boundary_ratio"))
        return cls(
            name=root.name,
            transformer=read("transformer", TransformerConfig),
            vae=read("vae", VAEConfig),
            text_encoder=read("text_encoder", TextEncoderConfig),
            scheduler=scheduler,
            boundary_ratio=boundary_ratio,
            dtype=dtype or stored_dtype(root / "transformer"),
        )


def read_json(path: Path) -> Any:
    """A config file's JSON (bounded in size); anything else is a WeightError naming it."""
    try:
        with path.open("rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
        if len(data) > MAX_CONFIG_BYTES:
            raise WeightError(f"{path} is over {MAX_CONFIG_BYTES >> 20} MiB: not a config file")
        return json.loads(data.decode())
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError too
        reason = "nested too deeply" if isinstance(e, RecursionError) else "not UTF-8 JSON"
        raise WeightError(f"{path} is {reason}: restore the model's original file") from None


@contextlib.contextmanager
def _in_file(path: Path) -> Iterator[None]:
    """A WeightError raised inside names `path` and says what to do."""
    try:
        yield
    except WeightError as e:
        if str(e).startswith(str(path)):
            raise
        raise WeightError(f"{path}: {e}: restore the model's original file") from None


@contextlib.contextmanager
def _key_prefix(key: str) -> Iterator[None]:
    """A WeightError raised inside says it is about the part `key`."""
    try:
        yield
    except WeightError as e:
        raise WeightError(f"{key}: {e}") from None


def _boundary_ratio(value: Any) -> float | None:
    _require(
        value is None or (_is_number(value) and 0 < value < 1),
        f"boundary_ratio is {excerpt(value)}, expected a number between 0 and 1 (or none)",
    )
    return value


def _dtype(value: Any) -> str:
    _require(value in DTYPES, f"dtype is {excerpt(value)}, expected one of {', '.join(DTYPES)}")
    return value


@dataclasses.dataclass(frozen=True)
class VideoShape:
    """What one call of the pipeline makes: batch videos of width x height pixels (frames = 4k + 1),
    with or without classifier-free guidance."""

    width: int
    height: int
    frames: int
    batch: int
    cfg: bool = True

    @property
    def step_batch(self) -> int:
        return 2 * self.batch if self.cfg else self.batch

    def tokens(self, config: ModelConfig) -> int:
        """Video tokens the transformer attends over: the latent grid over its patch."""
        return math.prod(config.transformer.patch_grid(self.latent_shape(config)[1:4]))

    def latent_shape(self, config: ModelConfig) -> tuple[int, int, int, int, int]:
        """Channels-last latents (B, T, H/8, W/8, C)."""
        vae = config.vae
        frames = (self.frames - 1) // vae.temporal_factor + 1
        s = vae.spatial_factor
        return (self.batch, frames, self.height // s, self.width // s, vae.z_dim)
