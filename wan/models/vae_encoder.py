"""The Wan 2.1 video VAE's encoder (diffusers' `AutoencoderKLWan.encode`) in Flax NNX,
channels-last: video -> latent posterior. No program of the text-to-video pipeline runs it (the
decode component, `wan.models.vae.WanVAE`, holds none of its weights); it is kept for an image-to-video
pipeline, and tested against diffusers' encode (tests/test_vae.py).

Like diffusers, video runs through the encoder chunk by chunk: the first frame alone (temporal
downsampling is skipped on it, so its output has fewer frames), then 4 frames at a time in one
`jax.lax.scan` whose carry is the feature cache. The blocks, the causal convs and the cache and
sharding conventions are the decoder's (`wan.models.vae`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from wan.component_configs import VAEConfig
from wan.models.vae import (
    AttentionBlock,
    Cache,
    Make,
    MidBlock,
    ResidualBlock,
    cache_parts,
    causal,
    chain,
    joined,
    pin,
    pin_cache,
    stream_padded_first,
)

ENCODE_CHUNK = 4  # video frames per encoder chunk after the first (diffusers' value)


class Downsample(nnx.Module):
    """/2 in space (zero pad right and bottom, 3x3 conv with stride 2); with `temporal`, then
    /2 in time by a stride-2 conv over the previous chunk's last frame and this chunk."""

    def __init__(self, dim: int, temporal: bool, make: Make):
        self.resample = make.conv(dim, dim, (1, 3, 3), stride=(1, 2, 2), pad=(0, 1))
        self.time_conv = make.conv(dim, dim, (3, 1, 1), stride=(2, 1, 1)) if temporal else None

    def __call__(self, x: jax.Array, cache: Cache, first: jax.Array | None = None):
        """`first` None: `cache` None is the first chunk alone; a boolean scalar: this is the
        first chunk, at the others' shapes with its real frame last (`stream_padded_first`)."""
        x = self.resample(x)
        if self.time_conv is None:
            return x, None
        last = pin(x[:, -1:])
        if cache is None and first is None:  # diffusers: the first chunk is not downsampled
            return x, last
        if cache is None:  # the cache's shape (the padded stream's first call)
            cache = jnp.zeros_like(last)
        y = self.time_conv(jnp.concatenate([cache, x], axis=1))
        if first is None:
            return y, last
        # The first chunk's frames, not downsampled, at the downsampled shape: its real frame
        # stays last (the frames before it are zeroed by the next causal conv).
        return jnp.where(first, x[:, x.shape[1] - y.shape[1] :], y), last


class Encoder(nnx.Module):
    """conv_in -> per level: residual (+ attention) blocks, downsampling -> mid -> head.
    `down_blocks` is one flat list as in diffusers (its indices name the weights)."""

    def __init__(self, cfg: VAEConfig, make: Make):
        dims = [cfg.base_dim * m for m in (1, *cfg.dim_mult)]
        self.conv_in = make.conv(cfg.in_channels, dims[0], 3)
        blocks: list[nnx.Module] = []
        scale = 1.0
        for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
            for _ in range(cfg.num_res_blocks):
                blocks.append(ResidualBlock(in_dim, out_dim, make))
                if scale in cfg.attn_scales:
                    blocks.append(AttentionBlock(out_dim, make))
                in_dim = out_dim
            if i != len(cfg.dim_mult) - 1:
                blocks.append(Downsample(out_dim, cfg.temperal_downsample[i], make))
                scale /= 2.0
        self.down_blocks = nnx.List(blocks)
        self.mid_block = MidBlock(dims[-1], make)
        self.norm_out = make.norm(dims[-1])
        self.conv_out = make.conv(dims[-1], 2 * cfg.z_dim, 3)

    def __call__(
        self, x: jax.Array, cache: Cache, first: jax.Array | None = None
    ) -> tuple[jax.Array, Cache]:
        c_in, c_down, c_mid, c_out = cache_parts(cache, 4)
        x, c_in = causal(self.conv_in, x, c_in, first)
        x, c_down = chain(self.down_blocks, x, c_down, first)
        x, c_mid = self.mid_block(x, c_mid, first)
        x, c_out = causal(self.conv_out, nnx.silu(self.norm_out(x)), c_out, first)
        return x, (c_in, c_down, c_mid, c_out)


def stream(
    net: Callable[[jax.Array, Cache], tuple[jax.Array, Cache]], first: jax.Array, chunks: jax.Array
) -> jax.Array:
    """`net` (the encoder) over the first chunk alone, then over `chunks` (B, N, t, H, W, C) in
    one scan whose carry is the cache; the outputs joined along time."""
    y0, cache = net(pin(first), None)

    def step(cache: Cache, chunk: jax.Array) -> tuple[Cache, jax.Array]:
        y, cache = net(pin(chunk), pin_cache(cache))
        return pin_cache(cache), y

    _, ys = jax.lax.scan(step, pin_cache(cache), jnp.moveaxis(chunks, 1, 0))
    return pin(jnp.concatenate([y0, joined(ys)], axis=1))


class WanVAEEncoder(nnx.Module):
    """AutoencoderKLWan's encode half: video -> posterior. Its parameters are diffusers'
    `encoder` and `quant_conv` (imported by `wan.weights.vae.encoder_rule`)."""

    def __init__(
        self,
        cfg: VAEConfig,
        *,
        dtype: Any = jnp.float32,
        param_dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ):
        make = Make(dtype, param_dtype, rngs)
        self.dtype = dtype
        self.encoder = Encoder(cfg, make)
        self.quant_conv = make.conv(2 * cfg.z_dim, 2 * cfg.z_dim, 1)

    def encode(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Video (B, F, H, W, C_in) -> posterior (mean, logvar), each (B, 1 + (F-1)//4 * 4/r,
        H/s, W/s, z_dim) for temporal factor r and spatial factor s. Trailing frames that do not
        fill a chunk of 4 are dropped, as in diffusers. Every chunk runs in one scan body, the
        first (one frame) padded in front to the others' 4 (`stream_padded_first`): one copy of
        the encoder to compile whatever the frame count."""
        b, f, *frame = x.shape
        n = (f - 1) // ENCODE_CHUNK
        x = x.astype(self.dtype)
        padding = jnp.zeros((b, ENCODE_CHUNK - 1, *frame), x.dtype)
        video = jnp.concatenate([padding, x[:, : 1 + n * ENCODE_CHUNK]], axis=1)
        chunks = video.reshape(b, n + 1, ENCODE_CHUNK, *frame)
        moments = self.quant_conv(stream_padded_first(self.encoder, chunks))
        mean, logvar = jnp.split(moments, 2, axis=-1)
        return mean, jnp.clip(logvar, -30.0, 20.0)
