"""The Wan 2.2 video VAE's encoder (diffusers' `AutoencoderKLWan(is_residual=True,
patch_size=2).encode`, TI2V-5B's) in Flax NNX, channels-last: what differs from the Wan 2.1
encoder of `wan.models.vae_encoder`, whose chunked stream, blocks and downsamplers it reuses.

- The pixels are first folded into channels, 2 x 2 patches of RGB (`patchify`, the inverse of
  `wan.models.vae22.unpatchify`): 12 input channels, 16x in space (2x from the patch, 8x from
  the down blocks).
- Each down block is residual: its input, averaged down to the block's output size
  (`avg_down`: time and space folded into channels, then groups of channels averaged; no
  weights), is added to the block's output.

TI2V-5B's image mode encodes the image as one latent frame, a video of one frame: that is the
stream's first chunk alone, which `WanVAE22Encoder.encode` runs without the (then empty) scan.
Every reshape keeps the sharded height or width axis major, so it stays shard-local.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from wan.component_configs import VAE22Config
from wan.models.vae import Cache, Make, MidBlock, ResidualBlock, chain, pin
from wan.models.vae_encoder import ENCODE_CHUNK, Downsample, Encoder, WanVAEEncoder, stream
from wan.sharding import VIDEO, constrain


def patchify(x: jax.Array, patch: int | None) -> jax.Array:
    """diffusers' patchify: (B, T, p H, p W, C) -> (B, T, H, W, C p p); pixel offset (i, j)
    (row, column) of channel c becomes channel c p p + j p + i."""
    if patch is None:
        return x
    b, t, ph, pw, c = x.shape
    h, w = ph // patch, pw // patch
    x = constrain(x.reshape(b, t, h, patch, w, patch, c), (*VIDEO[:3], None, VIDEO[3], None, None))
    x = constrain(x.transpose(0, 1, 2, 4, 6, 5, 3), (*VIDEO[:4], None, None, None))
    return pin(x.reshape(b, t, h, w, c * patch * patch))


def avg_down(x: jax.Array, out_dim: int, factor_t: int, factor_s: int) -> jax.Array:
    """diffusers' AvgDown3D: (B, T, H, W, C) -> (B, ceil(T / factor_t), H / factor_s,
    W / factor_s, out_dim). T is first zero-padded at the front to a multiple of factor_t (the
    first chunk's one frame is averaged with a zero frame); each channel c then spreads over
    its offsets (t, i, j) to channels (c, t, i, j), and consecutive groups of those are
    averaged down to out_dim."""
    x = jnp.pad(x, ((0, 0), (-x.shape[1] % factor_t, 0), (0, 0), (0, 0), (0, 0)))
    b, t, h, w, c = x.shape
    t, h, w = t // factor_t, h // factor_s, w // factor_s
    x = x.reshape(b, t, factor_t, h, factor_s, w, factor_s, c)
    x = constrain(x, (VIDEO[0], None, None, VIDEO[2], None, VIDEO[3], None, None))
    x = constrain(x.transpose(0, 1, 3, 5, 7, 2, 4, 6), (*VIDEO[:4], *(None,) * 4))
    groups = constrain(x.reshape(b, t, h, w, out_dim, -1), (*VIDEO[:4], None, None))
    return pin(groups.mean(axis=-1))


class ResidualDownBlock(nnx.Module):
    """num_res_blocks residual blocks and an optional downsampler, plus the block's input
    averaged down to its output (diffusers' WanResidualDownBlock). `down` is "3d" (time and
    space), "2d" (space) or None (the last block: no downsampler; the shortcut only averages
    channels)."""

    def __init__(
        self, in_dim: int, out_dim: int, num_res_blocks: int, down: str | None, make: Make
    ):
        dims = [in_dim] + [out_dim] * (num_res_blocks - 1)
        self.resnets = nnx.List([ResidualBlock(d, out_dim, make) for d in dims])
        self.downsampler = None if down is None else Downsample(out_dim, down == "3d", make)
        self.out_dim = out_dim
        self.factor_t = 2 if down == "3d" else 1
        self.factor_s = 1 if down is None else 2

    def __call__(self, x: jax.Array, cache: Cache, first: None = None):
        blocks = [*self.resnets, *([self.downsampler] if self.downsampler is not None else [])]
        y, cache = chain(blocks, x, cache, None)
        return y + avg_down(x, self.out_dim, self.factor_t, self.factor_s), cache


class ResidualEncoder(Encoder):
    """Wan 2.1's encoder (its `__call__`: conv_in -> down blocks -> mid -> head) with one
    residual down block per level."""

    def __init__(self, cfg: VAE22Config, make: Make):
        dims = [cfg.base_dim * m for m in (1, *cfg.dim_mult)]
        last = len(cfg.dim_mult) - 1
        downs = [
            None if n == last else "3d" if cfg.temperal_downsample[n] else "2d"
            for n in range(last + 1)
        ]
        self.conv_in = make.conv(cfg.in_channels, dims[0], 3)
        self.down_blocks = nnx.List(
            [
                ResidualDownBlock(in_dim, out_dim, cfg.num_res_blocks, down, make)
                for in_dim, out_dim, down in zip(dims[:-1], dims[1:], downs, strict=True)
            ]
        )
        self.mid_block = MidBlock(dims[-1], make)
        self.norm_out = make.norm(dims[-1])
        self.conv_out = make.conv(dims[-1], 2 * cfg.z_dim, 3)


class WanVAE22Encoder(WanVAEEncoder):
    """AutoencoderKLWan's encode half for the Wan 2.2 VAE: video (B, F, H, W, 3) in [-1, 1] ->
    the posterior's mean (B, 1 + (F-1)//4, H/16, W/16, z_dim), what diffusers'
    `retrieve_latents(..., sample_mode="argmax")` takes. Its parameters are diffusers' `encoder`
    and `quant_conv` (`wan.weights.vae.encoder_rule`)."""

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
        self.encoder = ResidualEncoder(cfg, make)
        self.quant_conv = make.conv(2 * cfg.z_dim, 2 * cfg.z_dim, 1)

    def encode(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Video (B, F, H, W, 3) -> posterior (mean, logvar); trailing frames that do not fill a
        chunk of 4 are dropped, as in diffusers."""
        x = patchify(pin(x.astype(self.dtype)), self.patch_size)
        if x.shape[1] > ENCODE_CHUNK:  # a video: the first chunk alone, then a scan of the rest
            b, f, *frame = x.shape
            n = (f - 1) // ENCODE_CHUNK
            chunks = x[:, 1 : 1 + n * ENCODE_CHUNK].reshape(b, n, ENCODE_CHUNK, *frame)
            y = stream(self.encoder, x[:, :1], chunks)
        else:  # an image (TI2V's image mode): no empty scan, whose body would still compile
            y, _ = self.encoder(x[:, :1], None)
        mean, logvar = jnp.split(self.quant_conv(y), 2, axis=-1)
        return mean, jnp.clip(logvar, -30.0, 20.0)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.encode(x)[0]
