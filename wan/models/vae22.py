"""The Wan 2.2 video VAE's decoder (diffusers' `AutoencoderKLWan(is_residual=True,
patch_size=2)`, TI2V-5B's) in Flax NNX, channels-last: what differs from the Wan 2.1 decoder of
`wan.models.vae`, whose blocks, causal stream and single scan body it reuses.

- Each up block is residual: its input, duplicated up to the block's output size (`dup_up`:
  channels spread over time and space, no weights), is added to the block's output, and its
  upsampler keeps the width (Wan 2.1's halves it).
- The decoder is wider than the encoder (`decoder_base_dim`).
- The decoder's 12 output channels are 2 x 2 patches of RGB pixels (`unpatchify`): the frames
  are 16x the latent in space (8x from the up blocks, 2x from the patch).

On the first chunk diffusers keeps the last of `dup_up`'s `factor_t` frames; decoded at the
later chunks' shapes, as `wan.models.vae` runs the first chunk, that frame is the last, where the real
frame is. Every reshape keeps the sharded height or width axis major, so it stays shard-local.
The encoder is not here: text-to-video decodes only (image-to-video would need it).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from wan.component_configs import VAE22Config
from wan.models.vae import (
    Cache,
    Decoder,
    Make,
    ResidualBlock,
    Upsample,
    WanVAE,
    chain,
    pin,
)
from wan.sharding import VIDEO, constrain


def dup_up(x: jax.Array, out_dim: int, factor_t: int) -> jax.Array:
    """diffusers' DupUp3D: (B, T, H, W, C) -> (B, factor_t T, 2H, 2W, out_dim), each channel
    repeated so that channel block (o, t, h, w) of the repeated channels fills output channel o
    at time offset t and pixel offset (h, w)."""
    b, t, h, w, c = x.shape
    x = jnp.repeat(x, out_dim * factor_t * 4 // c, axis=-1)
    x = constrain(x.reshape(b, t, h, w, out_dim, factor_t, 2, 2), (*VIDEO[:4], *(None,) * 4))
    x = x.transpose(0, 1, 5, 2, 6, 3, 7, 4)
    x = constrain(x, (VIDEO[0], None, None, VIDEO[2], None, VIDEO[3], None, None))
    return pin(x.reshape(b, t * factor_t, 2 * h, 2 * w, out_dim))


def unpatchify(x: jax.Array, patch: int | None) -> jax.Array:
    """diffusers' unpatchify: (B, T, H, W, C p p) -> (B, T, p H, p W, C); channel c p p + i p + j
    is pixel offset (j, i) (row, column) of channel c."""
    if patch is None:
        return x
    b, t, h, w, cpp = x.shape
    c = cpp // patch**2
    x = constrain(x.reshape(b, t, h, w, c, patch, patch), (*VIDEO[:4], None, None, None))
    x = x.transpose(0, 1, 2, 6, 3, 5, 4)
    x = constrain(x, (*VIDEO[:3], None, VIDEO[3], None, None))
    return pin(x.reshape(b, t, patch * h, patch * w, c))


class ResidualUpBlock(nnx.Module):
    """num_res_blocks + 1 residual blocks and an optional upsampler that keeps the width, plus
    the block's input duplicated up to its output (diffusers' WanResidualUpBlock)."""

    def __init__(self, in_dim: int, out_dim: int, num_res_blocks: int, up: str | None, make: Make):
        dims = [in_dim] + [out_dim] * num_res_blocks
        self.resnets = nnx.List([ResidualBlock(d, out_dim, make) for d in dims])
        self.upsampler = None if up is None else Upsample(out_dim, out_dim, up == "3d", make)
        self.out_dim = out_dim
        self.factor_t = 2 if up == "3d" else 1

    def __call__(self, x: jax.Array, cache: Cache, first: jax.Array):
        blocks = [*self.resnets, *([self.upsampler] if self.upsampler is not None else [])]
        y, cache = chain(blocks, x, cache, first)
        if self.upsampler is not None:
            y = y + dup_up(x, self.out_dim, self.factor_t)
        return y, cache


class ResidualDecoder(Decoder):
    """Wan 2.1's decoder with residual up blocks, each taking its predecessor's full width."""

    @staticmethod
    def make_up_blocks(levels: list, num_res_blocks: int, make: Make) -> list[nnx.Module]:
        return [ResidualUpBlock(i, o, num_res_blocks, up, make) for i, o, up in levels]


class WanVAE22(WanVAE):
    """AutoencoderKLWan's decode half for the Wan 2.2 VAE: raw latents (B, T, h, w, z_dim) ->
    video (B, 1 + 4(T-1), 16h, 16w, 3) in [-1, 1]. Its parameters are diffusers'
    `post_quant_conv` and `decoder` (`wan.weights.vae.rule`)."""

    def __init__(
        self,
        cfg: VAE22Config,
        *,
        dtype: Any = jnp.float32,
        param_dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ):
        make = Make(dtype, param_dtype, rngs)
        self.dtype = dtype
        self.patch_size = cfg.patch_size
        self.post_quant_conv = make.conv(cfg.z_dim, cfg.z_dim, 1)
        self.decoder = ResidualDecoder(cfg, make, base_dim=cfg.decoder_width)

    def decode(self, z: jax.Array) -> jax.Array:
        # Clipping commutes with unpatchify (diffusers clips after it).
        return unpatchify(super().decode(z), self.patch_size)
