"""The components' configs: one frozen dataclass per component kind (transformer, the two VAEs,
the text and image encoders), each mirroring its diffusers config.json and read strictly
(wan.strict_config). `wan.configs.ModelConfig` holds one of each a model has.

Flax-free: the runtime reads them without model code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

from wan import kinds
from wan.errors import InputError
from wan.strict_config import (
    StrictConfig,
    excerpt,
    require,
)

# Wan 2.1 VAE latent statistics (diffusers' AutoencoderKLWan defaults).
WAN21_LATENTS_MEAN = (
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
)  # fmt: skip
WAN21_LATENTS_STD = (
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
)  # fmt: skip
# Wan 2.2 VAE (TI2V-5B) latent statistics, 48 channels (Wan2.2's Wan2_2_VAE, its diffusers
# config).
WAN22_LATENTS_MEAN = (
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557,
    -0.1382, 0.0542, 0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825,
    -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230,
    -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748,
    0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
)  # fmt: skip
WAN22_LATENTS_STD = (
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013,
    0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978,
    0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093,
    0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887,
    0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
)  # fmt: skip


class ComponentConfig(StrictConfig):
    """The config of a component kind: its class names the component and the kind
    (`wan.kinds`)."""

    component: ClassVar[str]
    kind: ClassVar[str]


class VAEKindConfig(ComponentConfig):
    """A VAE config: its latent geometry comes from its kind (`wan.kinds.ComponentKind.latent`)."""

    component: ClassVar[str] = "vae"
    # Frames per second of the videos: the rate the released models with this VAE were trained
    # at and their pipelines write (Wan 2.1 and 2.2 A14B: 16; TI2V-5B: 24). Not a field, so it
    # is no part of a config's hash.
    fps: ClassVar[int] = 16

    @property
    def geometry(self) -> kinds.LatentGeometry:
        return kinds.lookup(self.component, self.kind).latent(self)

    @property
    def spatial_factor(self) -> int:
        return self.geometry.spatial

    @property
    def temporal_factor(self) -> int:
        return self.geometry.temporal


@dataclasses.dataclass(frozen=True)
class TransformerConfig(ComponentConfig):
    """diffusers `WanTransformer3DModel` config (text-to-video subset)."""

    component: ClassVar[str] = "transformer"
    kind: ClassVar[str] = "per_video"

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
    # Wan 2.1 image to video: the width of the CLIP image features and of the keys and values
    # every cross-attention makes of them (the model's width). None: no image features. Left
    # out of the model's dict (and hash) when None, as before they existed (`UNSET_OMITTED`).
    image_dim: int | None = None
    added_kv_proj_dim: int | None = None
    # Wan 2.1 FLF2V (first-last-frame): a position table over both images' features, which the
    # image embedder adds before its norm (diffusers' WanImageEmbedding.pos_embed).
    pos_embed_seq_len: int | None = None

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

    def validate(self) -> None:
        require(
            self.qk_norm == "rms_norm_across_heads",
            f"qk_norm is {excerpt(self.qk_norm)}; the {self.kind} transformer implements only "
            '"rms_norm_across_heads"',
        )
        require(
            (self.image_dim is None) == (self.added_kv_proj_dim is None),
            "image_dim and added_kv_proj_dim are set together (image features) or neither",
        )
        require(
            self.added_kv_proj_dim in (None, self.inner_dim),
            f"added_kv_proj_dim is {self.added_kv_proj_dim}, expected the model's width "
            f"{self.inner_dim}: the image keys and values are made of the embedded features",
        )
        require(
            self.pos_embed_seq_len is None or self.image_dim is not None,
            "pos_embed_seq_len is set but image_dim is not: the position table is the image "
            "features'",
        )


@dataclasses.dataclass(frozen=True)
class VAEConfig(VAEKindConfig):
    """diffusers `AutoencoderKLWan` config (Wan 2.1 VAE)."""

    kind: ClassVar[str] = "wan2.1"

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

    def validate(self) -> None:
        _validate_pyramid(self)

    def fixed_values(self) -> dict[str, tuple[Any, ...]]:
        # Wan 2.2's VAE (TI2V-5B) is residual, patchified and decodes from a wider base.
        return {
            "is_residual": (False,),
            "patch_size": (None,),
            "decoder_base_dim": (None, self.base_dim),
            "clip_output": (True,),  # the decoded frames are clipped to [-1, 1]
            "scale_factor_spatial": (self.spatial_factor,),
            "scale_factor_temporal": (self.temporal_factor,),
        }


def _validate_pyramid(vae: VAEConfig | VAE22Config) -> None:
    """The levels and latent statistics of a Wan VAE agree."""
    require(
        1 <= len(vae.dim_mult) <= 8, f"dim_mult has {len(vae.dim_mult)} levels, expected 1 to 8"
    )
    require(
        len(vae.temperal_downsample) == len(vae.dim_mult) - 1,
        f"temperal_downsample has {len(vae.temperal_downsample)} entries, expected one "
        f"per downsampling level ({len(vae.dim_mult) - 1})",
    )
    for name in ("latents_mean", "latents_std"):
        count = len(getattr(vae, name))
        require(count == vae.z_dim, f"{name} has {count} values, expected z_dim's {vae.z_dim}")


@dataclasses.dataclass(frozen=True)
class VAE22Config(VAEKindConfig):
    """diffusers `AutoencoderKLWan` config of the Wan 2.2 VAE (TI2V-5B: `is_residual`, its
    pixels patchified `patch_size` x `patch_size` into channels, a wider decoder). `base_dim` is
    the encoder's width, which the decode half does not use; it is read for the hash."""

    kind: ClassVar[str] = "wan2.2"
    fps: ClassVar[int] = 24

    base_dim: int = 160
    decoder_base_dim: int | None = 256  # None: base_dim
    z_dim: int = 48
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    attn_scales: tuple[float, ...] = ()
    temperal_downsample: tuple[bool, ...] = (False, True, True)
    latents_mean: tuple[float, ...] = WAN22_LATENTS_MEAN
    latents_std: tuple[float, ...] = WAN22_LATENTS_STD
    patch_size: int | None = 2  # None: no patches
    in_channels: int = 12
    out_channels: int = 12

    @property
    def decoder_width(self) -> int:
        return self.decoder_base_dim or self.base_dim

    def validate(self) -> None:
        _validate_pyramid(self)
        pixels = (self.patch_size or 1) ** 2
        require(
            self.out_channels % pixels == 0,
            f"out_channels is {self.out_channels}, expected a multiple of the {pixels} pixels of "
            f"a {self.patch_size}x{self.patch_size} patch",
        )

    def fixed_values(self) -> dict[str, tuple[Any, ...]]:
        return {
            "is_residual": (True,),
            "clip_output": (True,),  # the decoded frames are clipped to [-1, 1]
            "scale_factor_spatial": (self.spatial_factor,),
            "scale_factor_temporal": (self.temporal_factor,),
        }


@dataclasses.dataclass(frozen=True)
class TextEncoderConfig(ComponentConfig):
    """transformers `UMT5Config`, encoder side."""

    component: ClassVar[str] = "text_encoder"
    kind: ClassVar[str] = "umt5"

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

    def fixed_values(self) -> dict[str, tuple[Any, ...]]:
        # T5 shares one relative attention bias over its layers, UMT5 has one per layer; the
        # feed-forward is gated, with tanh-approximated GELU.
        return {
            "model_type": ("umt5",),
            "feed_forward_proj": ("gated-gelu",),
            "dense_act_fn": ("gelu_new",),
            "is_gated_act": (True,),
        }


@dataclasses.dataclass(frozen=True)
class ImageEncoderConfig(ComponentConfig):
    """transformers `CLIPVisionConfig`: Wan 2.1 image to video's CLIP ViT-H/14, whose
    penultimate layer's hidden states are the image features."""

    component: ClassVar[str] = "image_encoder"
    kind: ClassVar[str] = "clip_vision"
    # The activations implemented: GELU (exact, erf) and x * sigmoid(1.702 x).
    ACTIVATIONS: ClassVar[tuple[str, ...]] = ("gelu", "quick_gelu")

    hidden_size: int = 1280
    intermediate_size: int = 5120
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    image_size: int = 224
    patch_size: int = 14
    num_channels: int = 3
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-5
    projection_dim: int = 1024  # the projection head's width: the features are taken before it

    @property
    def tokens(self) -> int:
        """Tokens of an image: the class token and one per patch (257 for ViT-H/14 at 224)."""
        return (self.image_size // self.patch_size) ** 2 + 1

    def validate(self) -> None:
        require(
            self.hidden_act in self.ACTIVATIONS,
            f"hidden_act is {excerpt(self.hidden_act)}, the {self.kind} image encoder implements "
            f"only {' or '.join(self.ACTIVATIONS)}",
        )
        require(
            self.hidden_size % self.num_attention_heads == 0,
            f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads "
            f"{self.num_attention_heads}",
        )
        require(
            self.patch_size <= self.image_size,
            f"patch_size {self.patch_size} is larger than image_size {self.image_size}",
        )
        require(
            2 <= self.num_hidden_layers <= 1024,
            f"num_hidden_layers is {self.num_hidden_layers}, expected 2 to 1024 (the features are "
            "the penultimate layer's)",
        )
        require(self.layer_norm_eps > 0, f"layer_norm_eps is {self.layer_norm_eps}, expected > 0")

    def fixed_values(self) -> dict[str, tuple[Any, ...]]:
        return {"model_type": ("clip_vision_model",)}
