"""Named model presets with the values of diffusers' Wan conversion configs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from wan.component_configs import (
    ImageEncoderConfig,
    TextEncoderConfig,
    TransformerConfig,
    VAE22Config,
    VAEConfig,
)
from wan.configs import ModelConfig, SchedulerConfig
from wan.errors import InputError

_UMT5_XXL = TextEncoderConfig()
_WAN21_VAE = VAEConfig()
# Wan 2.1 I2V-14B: the T2V-14B's blocks on 36 input channels, with CLIP image features.
_I2V_14B_CLIP = TransformerConfig(
    num_attention_heads=40,
    in_channels=36,
    ffn_dim=13824,
    num_layers=40,
    image_dim=1280,
    added_kv_proj_dim=5120,
)

PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        name="tiny",
        transformer=TransformerConfig(
            num_attention_heads=2,
            attention_head_dim=16,
            text_dim=32,
            freq_dim=32,
            ffn_dim=64,
            num_layers=2,
            rope_max_seq_len=1024,
        ),
        vae=VAEConfig(base_dim=8, dim_mult=(1, 2, 2, 2), num_res_blocks=1),
        text_encoder=TextEncoderConfig(
            vocab_size=256,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
        ),
        scheduler=SchedulerConfig(flow_shift=3.0),
        dtype="float32",
    ),
    # Benchmarks: the real architecture at a width that compiles in tens of seconds on a CPU host.
    "small": ModelConfig(
        name="small",
        transformer=TransformerConfig(
            num_attention_heads=8,
            attention_head_dim=64,
            text_dim=512,
            freq_dim=256,
            ffn_dim=2048,
            num_layers=8,
        ),
        vae=VAEConfig(base_dim=32, num_res_blocks=2),
        text_encoder=TextEncoderConfig(
            vocab_size=4096,
            d_model=512,
            d_kv=64,
            d_ff=1024,
            num_layers=4,
            num_heads=8,
        ),
        scheduler=SchedulerConfig(flow_shift=3.0),
        dtype="float32",
    ),
    "wan2.1-t2v-1.3b": ModelConfig(
        name="wan2.1-t2v-1.3b",
        transformer=TransformerConfig(num_attention_heads=12, ffn_dim=8960, num_layers=30),
        vae=_WAN21_VAE,
        text_encoder=_UMT5_XXL,
        scheduler=SchedulerConfig(flow_shift=3.0),
    ),
    "wan2.1-t2v-14b": ModelConfig(
        name="wan2.1-t2v-14b",
        transformer=TransformerConfig(num_attention_heads=40, ffn_dim=13824, num_layers=40),
        vae=_WAN21_VAE,
        text_encoder=_UMT5_XXL,
        scheduler=SchedulerConfig(flow_shift=5.0),
    ),
    "wan2.2-t2v-a14b": ModelConfig(
        name="wan2.2-t2v-a14b",
        transformer=TransformerConfig(num_attention_heads=40, ffn_dim=13824, num_layers=40),
        vae=_WAN21_VAE,
        text_encoder=_UMT5_XXL,
        scheduler=SchedulerConfig(flow_shift=12.0),
        boundary_ratio=0.875,
    ),
    # Image to video (diffusers' Wan-AI/*-Diffusers configs). Wan 2.1: one architecture for the
    # 480P and 720P releases (their weights and flow shift differ), a CLIP ViT-H/14 image
    # encoder; Wan 2.2 I2V-A14B: the image through its latents only, two experts.
    **{
        name: ModelConfig(
            name=name,
            transformer=_I2V_14B_CLIP,
            vae=_WAN21_VAE,
            text_encoder=_UMT5_XXL,
            scheduler=SchedulerConfig(flow_shift=shift),
            image_encoder=ImageEncoderConfig(),
        )
        for name, shift in (("wan2.1-i2v-14b-480p", 3.0), ("wan2.1-i2v-14b-720p", 5.0))
    },
    # Wan 2.1 FLF2V-14B-720P: the I2V-14B's architecture taking both images' CLIP features
    # behind a position table (diffusers' conversion: pos_embed_seq_len 257 * 2, flow shift 16).
    "wan2.1-flf2v-14b-720p": ModelConfig(
        name="wan2.1-flf2v-14b-720p",
        transformer=dataclasses.replace(_I2V_14B_CLIP, pos_embed_seq_len=2 * 257),
        vae=_WAN21_VAE,
        text_encoder=_UMT5_XXL,
        scheduler=SchedulerConfig(flow_shift=16.0),
        image_encoder=ImageEncoderConfig(),
    ),
    "wan2.2-i2v-a14b": ModelConfig(
        name="wan2.2-i2v-a14b",
        transformer=TransformerConfig(
            num_attention_heads=40, in_channels=36, ffn_dim=13824, num_layers=40
        ),
        vae=_WAN21_VAE,
        text_encoder=_UMT5_XXL,
        scheduler=SchedulerConfig(flow_shift=5.0),
        boundary_ratio=0.9,
    ),
    # One transformer on the Wan 2.2 VAE's 48 channels; 1280x704 (or 704x1280), 121 frames at
    # 24 fps, 50 UniPC steps, guidance 5.0 (the runtime's defaults).
    "wan2.2-ti2v-5b": ModelConfig(
        name="wan2.2-ti2v-5b",
        transformer=TransformerConfig(
            num_attention_heads=24, in_channels=48, out_channels=48, ffn_dim=14336, num_layers=30
        ),
        vae=VAE22Config(),
        text_encoder=_UMT5_XXL,
        scheduler=SchedulerConfig(flow_shift=5.0),
    ),
}

# Tiny image-to-video models of each kind, the shapes of the tests' diffusers folders
# (tests/conftest.py): random weights without torch (`python -m wan.random_weights --model
# tiny-i2v`) and builds that compile in seconds on a CPU host.
_TINY = PRESETS["tiny"]
PRESETS |= {
    # Wan 2.1 I2V: a CLIP vision tower of 2x2 patches (28 pixels), its features in every
    # cross-attention; the image's latents and mask beside the noise (36 channels).
    "tiny-i2v": dataclasses.replace(
        _TINY,
        name="tiny-i2v",
        transformer=dataclasses.replace(
            _TINY.transformer, in_channels=36, image_dim=24, added_kv_proj_dim=32
        ),
        image_encoder=ImageEncoderConfig(
            hidden_size=24,
            intermediate_size=48,
            num_hidden_layers=3,
            num_attention_heads=4,
            image_size=28,
            projection_dim=16,
        ),  # fmt: skip
    ).validate(),
    # Wan 2.2 I2V-A14B: the image through its latents only, two experts.
    "tiny-i2v-a14b": dataclasses.replace(
        _TINY,
        name="tiny-i2v-a14b",
        transformer=dataclasses.replace(_TINY.transformer, in_channels=36),
        boundary_ratio=0.9,
    ).validate(),
    # Wan 2.2 TI2V-5B: the Wan 2.2 VAE's 48 channels; text to video, and image to video with
    # --pipeline i2v.
    "tiny-ti2v": dataclasses.replace(
        _TINY,
        name="tiny-ti2v",
        transformer=dataclasses.replace(_TINY.transformer, in_channels=48, out_channels=48),
        vae=VAE22Config(base_dim=8, decoder_base_dim=16, dim_mult=(1, 2, 2, 2), num_res_blocks=1),
        scheduler=SchedulerConfig(flow_shift=5.0),
    ).validate(),
}


def model_spec(config: ModelConfig, folder: str | Path) -> str:
    """What to pass as `--model` for weights with this config: the preset it equals, else the
    weights folder itself."""
    preset = PRESETS.get(config.name)
    return config.name if preset is not None and preset.hash() == config.hash() else str(folder)


def resolve_model(spec: str) -> ModelConfig:
    """A preset name, a diffusers-format folder (its config.json files are read) or a
    checkpoint written by this project."""
    if spec in PRESETS:
        return PRESETS[spec]
    if Path(spec).is_dir():
        return ModelConfig.from_folder(spec)
    raise InputError(
        f"unknown model {spec!r}: use one of {', '.join(PRESETS)} or a diffusers-format folder"
    )
