"""Model configurations: one frozen dataclass per model, mirroring diffusers' config.json.

Flax-free on purpose: the runtime reads configs and presets without importing model code.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Self

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


def _from_dict(cls, raw: dict[str, Any]):
    """Build `cls` from a config.json dict: known fields only, lists become tuples."""
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items() if k in names}
    return cls(**kwargs)


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
            raise ValueError(
                f"latent size {tuple(video)} is not a multiple of the patch size {self.patch_size}"
            )
        grid = tuple(n // p for n, p in zip(video, self.patch_size, strict=True))
        if max(grid) > self.rope_max_seq_len:
            raise ValueError(f"patch grid {grid} exceeds rope_max_seq_len={self.rope_max_seq_len}")
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
        return _from_dict(cls, raw)


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
        kind = "euler" if raw.get("_class_name") == "FlowMatchEulerDiscreteScheduler" else "unipc"
        shift = raw.get("flow_shift", raw.get("shift", 5.0))
        return cls(
            kind=kind,
            num_train_timesteps=raw.get("num_train_timesteps", 1000),
            flow_shift=float(shift if shift is not None else 1.0),
            solver_order=raw.get("solver_order", 2),
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
        """Inverse of `to_dict`."""
        return cls(
            name=raw["name"],
            transformer=TransformerConfig.from_dict(raw["transformer"]),
            vae=VAEConfig.from_dict(raw["vae"]),
            text_encoder=TextEncoderConfig.from_dict(raw["text_encoder"]),
            scheduler=SchedulerConfig(**raw["scheduler"]),
            boundary_ratio=raw.get("boundary_ratio"),
            dtype=raw.get("dtype", "bfloat16"),
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> Self:
        """The config of a project checkpoint or of a diffusers-format folder (JSON only)."""
        marker = Path(folder) / CHECKPOINT_MARKER
        if marker.is_file():
            return cls.from_dict(json.loads(marker.read_text())["model"])
        return cls.from_diffusers(folder)

    @classmethod
    def from_diffusers(cls, folder: str | Path, dtype: str | None = None) -> Self:
        """Read the config.json files of a diffusers-format model folder. `dtype` defaults to
        the dtype the transformer's weights are stored in."""
        from wan.weights import stored_dtype

        root = Path(folder)

        def read(sub: str) -> dict[str, Any]:
            path = root / sub / "config.json"
            if not path.is_file():
                raise FileNotFoundError(f"{path} is missing: not a diffusers-format WAN folder")
            return json.loads(path.read_text())

        pipeline = (
            json.loads((root / "model_index.json").read_text())
            if (root / "model_index.json").is_file()
            else {}
        )
        sched_path = root / "scheduler" / "scheduler_config.json"
        sched = json.loads(sched_path.read_text()) if sched_path.is_file() else {}
        return cls(
            name=root.name,
            transformer=TransformerConfig.from_dict(read("transformer")),
            vae=VAEConfig.from_dict(read("vae")),
            text_encoder=TextEncoderConfig.from_dict(read("text_encoder")),
            scheduler=SchedulerConfig.from_dict(sched),
            boundary_ratio=pipeline.get("boundary_ratio"),
            dtype=dtype or stored_dtype(root / "transformer"),
        )


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
