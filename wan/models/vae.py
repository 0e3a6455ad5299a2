"""The Wan 2.1 video VAE's decoder (diffusers' `AutoencoderKLWan.decode`) in Flax NNX,
channels-last, and the blocks its encoder shares (`wan.models.vae_encoder`, not part of the pipeline's
programs).

Video is (B, T, H, W, C). Every 3-D conv is causal in time: it sees the last CACHE_T frames of
its own input from earlier chunks as left context (zeros before the video starts). Like
diffusers, video runs through the network chunk by chunk (decode: one latent frame at a time),
carrying the feature cache, a pytree of fixed-shape arrays, through one `jax.lax.scan`. The
first chunk behaves differently (temporal upsampling is skipped): decode runs it inside the
same scan body, at the later chunks' shapes: after each temporal upsampler only its last frame
is real, and the others are zeroed wherever a causal conv reads them, which is what the zero
padding before the video is. One body means each distinct conv is compiled once: the XLA TPU
backend compiles every distinct conv fusion separately, and a first-chunk copy of the decoder
added a third to the decode's compile time (bench/vae_compile.py).

Cache convention: a block's `__call__(x, cache, first)` takes the cache of its own layers (None
on the encoder's first chunk) and returns `(y, new_cache)`. `first` is None on encode, and on
decode a boolean scalar: this is the video's first chunk.

Sharding: every 5-D activation, every cache tensor and the scan carry is pinned to
`wan.sharding.VIDEO`; conv kernels name their output-channel axis "vae_conv_out". Nearest
upsampling is a broadcast + reshape, so a sharded height or width axis stays local.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from wan import axes
from wan.component_configs import VAEConfig
from wan.models.partitioned import logical_init
from wan.sharding import VIDEO, constrain, current_spec

CACHE_T = 2  # left context of a causal conv with temporal kernel 3
RMS_EPS = 1e-12  # F.normalize's eps

Cache = Any  # a pytree of (B, t, H, W, C) arrays, None on the encoder's first chunk
Block = Callable[[jax.Array, Cache, jax.Array | None], tuple[jax.Array, Cache]]


def pin(x: jax.Array) -> jax.Array:
    """A video activation, pinned to the VIDEO sharding."""
    return constrain(x, VIDEO)


def pin_cache(cache: Cache) -> Cache:
    return jax.tree.map(pin, cache)


def cache_parts(cache: Cache, n: int) -> tuple[Cache, ...]:
    """The caches of n sub-blocks: all None on the first chunk."""
    return (None,) * n if cache is None else tuple(cache)


class Conv3d(nnx.Conv):
    """Conv over (B, T, H, W, C), unpadded in time (the causal context is the caller's) and
    zero-padded in space by `pad` (low, high) on H and W. Input and output are pinned."""

    def __init__(
        self,
        cin: int,
        cout: int,
        kernel: tuple[int, int, int],
        *,
        stride: tuple[int, int, int] = (1, 1, 1),
        pad: tuple[int, int] | None = None,
        dtype: Any,
        param_dtype: Any,
        rngs: nnx.Rngs,
    ):
        pad = (kernel[1] // 2, kernel[1] // 2) if pad is None else pad
        super().__init__(
            cin,
            cout,
            kernel,
            strides=stride,
            padding=((0, 0), pad, pad),
            dtype=dtype,
            param_dtype=param_dtype,
            kernel_init=logical_init(
                nnx.initializers.lecun_normal(), (None, None, None, None, axes.VAE_CONV_OUT)
            ),
            bias_init=logical_init(nnx.initializers.zeros_init(), (axes.VAE_CONV_OUT,)),
            rngs=rngs,
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        return pin(super().__call__(pin(x)))


def real_frames(x: jax.Array, first: jax.Array | None) -> jax.Array:
    """x with the frames that are not real set to zero: on decode's first chunk, all but the
    last (see the module docstring)."""
    t = x.shape[1]
    if first is None or t == 1:
        return x
    keep = jnp.logical_or(jnp.logical_not(first), jnp.arange(t) == t - 1)
    return jnp.where(keep[None, :, None, None, None], x, jnp.zeros((), x.dtype))


def causal(
    conv: Conv3d, x: jax.Array, cache: jax.Array | None, first: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """A temporal-kernel-3 conv of one chunk, continuing the stream: the cache holds the last
    CACHE_T input frames of the previous chunks (zeros before the first), which is what
    diffusers' left padding plus its cache of up to two frames amounts to."""
    if cache is None:
        cache = jnp.zeros((x.shape[0], CACHE_T, *x.shape[2:]), x.dtype)
    x = real_frames(x, first)
    window = jnp.concatenate([cache, x], axis=1)
    return conv(window), pin(window[:, -CACHE_T:])


def upsample_nearest_2x(x: jax.Array) -> jax.Array:
    """Nearest-neighbour x2 on H and W (diffusers' nearest-exact at scale 2), shard-local."""
    b, t, h, w, c = x.shape
    x = jnp.broadcast_to(x[:, :, :, None, :, None, :], (b, t, h, 2, w, 2, c))
    return pin(x.reshape(b, t, 2 * h, 2 * w, c))


def interleave_time(x: jax.Array) -> jax.Array:
    """(B, T, H, W, 2C) -> (B, 2T, H, W, C): channel half s of step t becomes frame 2t + s."""
    b, t, h, w, c2 = x.shape
    # Pinned at every step: left free, XLA TPU routes this reshape through channel-sharded
    # layouts, with all-to-alls on both sides.
    x = constrain(x.reshape(b, t, h, w, 2, c2 // 2), (*VIDEO[:4], None, None))
    x = constrain(x.transpose(0, 1, 4, 2, 3, 5), (*VIDEO[:2], None, *VIDEO[2:4], None))
    return pin(x.reshape(b, 2 * t, h, w, c2 // 2))


@dataclasses.dataclass(frozen=True)
class Make:
    """Builds the layers with one set of dtypes and rngs."""

    dtype: Any
    param_dtype: Any
    rngs: nnx.Rngs

    def conv(self, cin: int, cout: int, kernel: int | tuple[int, int, int], **kw: Any) -> Conv3d:
        kernel = (kernel,) * 3 if isinstance(kernel, int) else kernel
        return Conv3d(
            cin, cout, kernel, dtype=self.dtype, param_dtype=self.param_dtype, rngs=self.rngs, **kw
        )

    def norm(self, dim: int) -> RMSNorm:
        return RMSNorm(dim, dtype=self.dtype, param_dtype=self.param_dtype)


class RMSNorm(nnx.Module):
    """WanRMS_norm: L2-normalise over channels (in fp32), times sqrt(C) and a learned gain."""

    def __init__(self, dim: int, *, dtype: Any, param_dtype: Any):
        self.gamma = nnx.Param(jnp.ones((dim,), param_dtype))
        self.scale = dim**0.5
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        # The sum of squares in fp32, as F.normalize's; applied to x in its own dtype, so that
        # XLA keeps no fp32 copy of a bf16 activation (the decode 6% faster on a v5e:
        # docs/benchmarks.md, "The VAE decode").
        x32 = x.astype(jnp.float32)
        squares = jnp.sum(x32 * x32, axis=-1, keepdims=True)
        inverse = jax.lax.rsqrt(jnp.maximum(squares, RMS_EPS**2)).astype(self.dtype)
        gain = (self.gamma[...].astype(jnp.float32) * self.scale).astype(self.dtype)
        return x.astype(self.dtype) * inverse * gain


class ResidualBlock(nnx.Module):
    """norm -> SiLU -> causal conv, twice, plus a (1x1x1 conv) shortcut."""

    def __init__(self, in_dim: int, out_dim: int, make: Make):
        self.norm1 = make.norm(in_dim)
        self.conv1 = make.conv(in_dim, out_dim, 3)
        self.norm2 = make.norm(out_dim)
        self.conv2 = make.conv(out_dim, out_dim, 3)
        self.conv_shortcut = make.conv(in_dim, out_dim, 1) if in_dim != out_dim else None

    def __call__(self, x: jax.Array, cache: Cache, first: jax.Array | None = None):
        c1, c2 = cache_parts(cache, 2)
        h = x if self.conv_shortcut is None else self.conv_shortcut(x)
        x, c1 = causal(self.conv1, nnx.silu(self.norm1(x)), c1, first)
        x, c2 = causal(self.conv2, nnx.silu(self.norm2(x)), c2, first)
        return x + h, (c1, c2)


class AttentionBlock(nnx.Module):
    """Single-head self-attention over the pixels of each frame. Stateless in time: its
    cache is always None (the signature matches the other blocks)."""

    def __init__(self, dim: int, make: Make):
        self.norm = make.norm(dim)
        self.to_qkv = make.conv(dim, 3 * dim, 1)
        self.proj = make.conv(dim, dim, 1)

    def __call__(self, x: jax.Array, cache: Cache = None, first: jax.Array | None = None):
        b, t, h, w, c = x.shape
        # Pixel order does not matter to attention: the pixels are flattened with the sharded
        # spatial axis major, so that each device keeps its own queries (and gathers only keys
        # and values) whichever axis the build shards.
        spec = current_spec(VIDEO, x.shape)
        width_major = spec is not None and spec[3] is not None
        qkv = self.to_qkv(self.norm(x))
        qkv = (qkv.transpose(0, 1, 3, 2, 4) if width_major else qkv).reshape(b, t, h * w, 3 * c)
        q, k, v = jnp.split(qkv, 3, axis=-1)
        logits = jnp.einsum("btqc,btkc->btqk", q, k) * c**-0.5
        weights = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(v.dtype)
        out = jnp.einsum("btqk,btkc->btqc", weights, v)
        if width_major:
            out = out.reshape(b, t, w, h, c).transpose(0, 1, 3, 2, 4)
        return x + self.proj(pin(out.reshape(b, t, h, w, c))), None


class MidBlock(nnx.Module):
    """resnet -> attention -> resnet at the lowest resolution."""

    def __init__(self, dim: int, make: Make):
        self.resnets = nnx.List([ResidualBlock(dim, dim, make) for _ in range(2)])
        self.attentions = nnx.List([AttentionBlock(dim, make)])

    def __call__(self, x: jax.Array, cache: Cache, first: jax.Array | None = None):
        c0, c1 = cache_parts(cache, 2)
        x, c0 = self.resnets[0](x, c0, first)
        x, _ = self.attentions[0](x)
        x, c1 = self.resnets[1](x, c1, first)
        return x, (c0, c1)


class Upsample(nnx.Module):
    """x2 in space (nearest, then a per-frame 3x3 conv to out_dim channels: dim // 2 in the
    Wan 2.1 VAE, dim in Wan 2.2's); with `temporal`, first x2 in time by a causal conv to
    2 * dim channels split into two frames."""

    def __init__(self, dim: int, out_dim: int, temporal: bool, make: Make):
        self.resample = make.conv(dim, out_dim, (1, 3, 3))
        self.time_conv = make.conv(dim, 2 * dim, (3, 1, 1)) if temporal else None

    def __call__(self, x: jax.Array, cache: Cache, first: jax.Array):
        if self.time_conv is not None:
            y, tail = causal(self.time_conv, x, cache, first)
            # diffusers skips the time conv on the first chunk (its one real frame is put last
            # here) and starts the next chunk from zero padding: a zero cache.
            skipped = pin(jnp.concatenate([jnp.zeros_like(x), x], axis=1))
            x = jnp.where(first, skipped, interleave_time(y))
            cache = pin(jnp.where(first, jnp.zeros_like(tail), tail))
        return self.resample(upsample_nearest_2x(x)), cache


def chain(
    blocks: Iterable[Block], x: jax.Array, cache: Cache, first: jax.Array | None
) -> tuple[jax.Array, Cache]:
    """Run blocks in order, each on its own part of the cache."""
    blocks = list(blocks)
    new = []
    for block, c in zip(blocks, cache_parts(cache, len(blocks)), strict=True):
        x, c = block(x, c, first)
        new.append(c)
    return x, tuple(new)


class UpBlock(nnx.Module):
    """num_res_blocks + 1 residual blocks, then an optional upsampler."""

    def __init__(self, in_dim: int, out_dim: int, num_res_blocks: int, up: str | None, make: Make):
        dims = [in_dim] + [out_dim] * num_res_blocks
        self.resnets = nnx.List([ResidualBlock(d, out_dim, make) for d in dims])
        self.upsamplers = (
            None if up is None else nnx.List([Upsample(out_dim, out_dim // 2, up == "3d", make)])
        )

    def __call__(self, x: jax.Array, cache: Cache, first: jax.Array):
        return chain([*self.resnets, *(self.upsamplers or ())], x, cache, first)


def up_levels(dim_mult: tuple[int, ...], base_dim: int, temperal_downsample: tuple[bool, ...]):
    """(in_dim, out_dim, upsampling) of each up block, lowest resolution first: upsampling is
    "3d" (time and space), "2d" (space) or None (the last block)."""
    dims = [base_dim * m for m in (dim_mult[-1], *dim_mult[::-1])]
    temporal = temperal_downsample[::-1]
    last = len(dim_mult) - 1
    return [
        (i, o, None if n == last else "3d" if temporal[n] else "2d")
        for n, (i, o) in enumerate(zip(dims[:-1], dims[1:], strict=True))
    ]


class Decoder(nnx.Module):
    """conv_in -> mid -> up blocks -> head. `up_blocks` makes the blocks from `up_levels` (Wan
    2.1's: the upsamplers halve the channels, so each block after the first takes half its
    predecessor's width); `base_dim` is the decoder's width."""

    def __init__(self, cfg: Any, make: Make, base_dim: int | None = None):
        levels = up_levels(cfg.dim_mult, base_dim or cfg.base_dim, cfg.temperal_downsample)
        self.conv_in = make.conv(cfg.z_dim, levels[0][0], 3)
        self.mid_block = MidBlock(levels[0][0], make)
        self.up_blocks = nnx.List(self.make_up_blocks(levels, cfg.num_res_blocks, make))
        self.norm_out = make.norm(levels[-1][1])
        self.conv_out = make.conv(levels[-1][1], cfg.out_channels, 3)

    @staticmethod
    def make_up_blocks(levels: list, num_res_blocks: int, make: Make) -> list[nnx.Module]:
        return [
            UpBlock(in_dim if n == 0 else in_dim // 2, out_dim, num_res_blocks, up, make)
            for n, (in_dim, out_dim, up) in enumerate(levels)
        ]

    def __call__(self, x: jax.Array, cache: Cache, first: jax.Array):
        c_in, c_mid, c_up, c_out = cache_parts(cache, 4)
        x, c_in = causal(self.conv_in, x, c_in, first)
        x, c_mid = self.mid_block(x, c_mid, first)
        x, c_up = chain(self.up_blocks, x, c_up, first)
        x, c_out = causal(self.conv_out, nnx.silu(self.norm_out(x)), c_out, first)
        return x, (c_in, c_mid, c_up, c_out)


def joined(ys: jax.Array) -> jax.Array:
    """Scan outputs (N, B, t, H, W, C) -> (B, N * t, H, W, C), in order along time."""
    n, b, t, *rest = ys.shape
    return jnp.moveaxis(ys, 0, 1).reshape(b, n * t, *rest)


def stream_padded_first(net: Block, chunks: jax.Array) -> jax.Array:
    """`net` over every chunk of `chunks` (B, N, t, H, W, C), the first included, in one scan
    body (the first chunk at the others' shapes, its output's real frame last); the real
    frames joined along time."""
    first = jnp.arange(chunks.shape[1]) == 0
    chunks = jnp.moveaxis(chunks, 1, 0)
    _, cache = jax.eval_shape(net, chunks[0], None, first[0])
    cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), cache)

    def step(cache: Cache, inputs: tuple[jax.Array, jax.Array]) -> tuple[Cache, jax.Array]:
        chunk, is_first = inputs
        y, cache = net(pin(chunk), pin_cache(cache), is_first)
        return pin_cache(cache), y

    _, ys = jax.lax.scan(step, pin_cache(cache), (chunks, first))
    return pin(joined(ys)[:, ys.shape[2] - 1 :])


class WanVAE(nnx.Module):
    """AutoencoderKLWan's decode half, what the pipeline's `vae_decode` runs: raw latents ->
    video in [-1, 1]. Its parameters are diffusers' `post_quant_conv` and `decoder`; the
    encoder's (`encoder`, `quant_conv`) are `wan.models.vae_encoder.WanVAEEncoder`'s."""

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
        self.post_quant_conv = make.conv(cfg.z_dim, cfg.z_dim, 1)
        self.decoder = Decoder(cfg, make)

    def decode(self, z: jax.Array) -> jax.Array:
        """Raw latents (B, T, h, w, z_dim) -> video (B, 1 + k(T-1), s*h, s*w, C_out) in [-1, 1]
        for temporal factor k and spatial factor s; one latent frame per chunk."""
        b, t, *frame = z.shape
        x = self.post_quant_conv(z.astype(self.dtype))
        video = stream_padded_first(self.decoder, x.reshape(b, t, 1, *frame))
        return pin(jnp.clip(video, -1.0, 1.0))


def _stats(cfg: VAEConfig) -> tuple[jax.Array, jax.Array]:
    """Channel mean and 1/std as diffusers' WanPipeline holds them (fp32)."""
    mean = jnp.asarray(cfg.latents_mean, jnp.float32)
    return mean, 1.0 / jnp.asarray(cfg.latents_std, jnp.float32)


def normalize_latents(latents: jax.Array, cfg: VAEConfig) -> jax.Array:
    """Raw VAE latents -> diffusion latents (channels-last): (latents - mean) * (1/std)."""
    mean, inv_std = _stats(cfg)
    return ((latents.astype(jnp.float32) - mean) * inv_std).astype(latents.dtype)


def denormalize_latents(latents: jax.Array, cfg: VAEConfig) -> jax.Array:
    """Diffusion latents -> raw VAE latents (channels-last): latents / (1/std) + mean."""
    mean, inv_std = _stats(cfg)
    return (latents.astype(jnp.float32) / inv_std + mean).astype(latents.dtype)
