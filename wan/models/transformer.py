"""The WAN diffusion transformer (diffusers' `WanTransformer3DModel`, text-to-video) in Flax NNX.

Video latents (B, T, H, W, C) are cut into patches, embedded and run through `num_layers`
identical blocks (adaLN-modulated self-attention with 3-D RoPE, cross-attention to the text,
GELU feed-forward), then projected back to patches: the flow prediction (B, T, H, W, C_out).

The blocks are stacked (leading layer axis on every block parameter) and applied with one
`lax.scan`, so XLA compiles one block body. The text conditioning enters the blocks only
through each cross-attention's keys and values; `compute_kv_cache` computes them for all layers
once per prompt, and `__call__` consumes them.

Numerics follow diffusers: layer norms, adaLN modulation and residual updates in fp32, the
modules diffusers keeps in fp32 (`time_embedder`, `scale_shift_table`s, `norm2`) have fp32
parameters whatever `param_dtype` is.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import DTypeLike

from wan import axes
from wan.component_configs import TransformerConfig
from wan.models.attention import CONTEXT_PARALLEL, padded_length
from wan.models.attention import attention as multi_head_attention
from wan.models.attention import resolve as resolve_attention
from wan.models.partitioned import logical_init
from wan.models.quant_linear import QuantLinear
from wan.models.radial_mask import RadialSpec
from wan.quant import Scheme, scheme
from wan.sharding import constrain

Axes = tuple[str | None, ...]
# (keys, values), each (num_layers, B, L, inner_dim); then the image tokens' (keys, values) in a
# model that takes image features.
KVCache = tuple[jax.Array, ...]


class Embedded(NamedTuple):
    """A step's inputs to the blocks (WanTransformer.embed)."""

    tokens: jax.Array  # (B, S, dim) patch embeddings
    temb: jax.Array  # (B, dim) timestep embedding
    time6: jax.Array  # (B, 6, dim) the blocks' modulation
    rope: tuple[jax.Array, jax.Array]
    grid: tuple[int, int, int]  # (frames, rows, cols) of tokens
    # TI2V-5B's image mode: the first frame's tokens (the given image) are at timestep 0, and
    # this is their (temb, time6); None: every token at the step's timestep.
    first: tuple[jax.Array, jax.Array] | None = None

    @property
    def first_tokens(self) -> int:
        """Tokens of the first latent frame (the ones `first` is for)."""
        return self.grid[1] * self.grid[2]


def per_token(values: jax.Array, first: jax.Array | None, first_tokens: int, length: int):
    """`values` (B, 1, dim) for each of `length` tokens; with `first` (B, 1, dim), that for the
    first `first_tokens` (B, length, dim: a select XLA fuses into its consumer)."""
    if first is None:
        return values
    is_first = (jnp.arange(length) < first_tokens)[None, :, None]
    return jnp.where(is_first, first, values)


HIDDEN: Axes = (axes.BATCH, axes.LENGTH, axes.ACT_EMBED)  # "embed" names weight dims only
KV: Axes = (axes.BATCH, axes.KV_LENGTH, axes.HEADS)


def _linear(
    din: int,
    dout: int,
    logical: Axes,
    *,
    dtype: DTypeLike,
    param_dtype: DTypeLike,
    rngs: nnx.Rngs,
    quant: Scheme | None = None,
) -> nnx.Linear | QuantLinear:
    """nnx.Linear whose kernel/bias carry the logical axis names `logical` = (in, out); with a
    `quant` scheme, its 8-bit form (wan.quant)."""
    if quant is not None:
        return QuantLinear(
            din, dout, logical, quant, dtype=dtype, param_dtype=param_dtype, rngs=rngs
        )
    return nnx.Linear(
        din,
        dout,
        dtype=dtype,
        param_dtype=param_dtype,
        kernel_init=logical_init(nnx.initializers.lecun_normal(), logical),
        bias_init=logical_init(nnx.initializers.zeros_init(), logical[1:]),
        rngs=rngs,
    )


def linear(
    layer: nnx.Linear | QuantLinear,
    x: jax.Array,
    contract: int = 1,
    out: tuple[int, ...] | None = None,
) -> jax.Array:
    """`layer` on the last `contract` axes of x (together its input features), its output
    features split into the axes `out` if given. The kernel is reshaped, not the activations:
    on TPU, XLA then lays each head's rows out as the attention kernel reads them, where
    splitting the output afterwards cost layout copies of q, k, v and of the attention's result
    in every block (docs/benchmarks.md, "Where a dense step goes")."""
    if isinstance(layer, QuantLinear):
        return layer(x, contract, out)
    kernel, bias = layer.kernel[...], layer.bias[...]
    out = out or kernel.shape[1:]
    kernel = kernel.reshape(*x.shape[x.ndim - contract :], *out)
    x, kernel, bias = layer.promote_dtype((x, kernel, bias.reshape(out)), dtype=layer.dtype)
    dims = ((tuple(range(x.ndim - contract, x.ndim)), tuple(range(contract))), ((), ()))
    return jax.lax.dot_general(x, kernel, dims, precision=layer.precision) + bias


def rms_norm(norm: nnx.RMSNorm, x: jax.Array, axes: int = 1) -> jax.Array:
    """`norm` (its features: the last `axes` axes of x together) as nnx.RMSNorm computes it:
    fp32 statistics, the scale folded into the reciprocal."""
    scale = norm.scale[...].reshape(x.shape[x.ndim - axes :])
    x, scale = norm.promote_dtype((x, scale), dtype=norm.dtype)
    x32 = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    features = tuple(range(x.ndim - axes, x.ndim))
    var = jnp.mean(jnp.square(x32), axis=features, keepdims=True)
    return (x32 * (jax.lax.rsqrt(var + norm.epsilon) * scale)).astype(norm.dtype or x.dtype)


def _layer_norm(dim: int, eps: float, *, affine: bool, rngs: nnx.Rngs) -> nnx.LayerNorm:
    """diffusers' FP32LayerNorm: fp32 statistics and parameters, two-pass variance."""
    return nnx.LayerNorm(
        dim,
        epsilon=eps,
        use_scale=affine,
        use_bias=affine,
        use_fast_variance=False,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        scale_init=logical_init(nnx.initializers.ones_init(), (axes.EMBED,)),
        bias_init=logical_init(nnx.initializers.zeros_init(), (axes.EMBED,)),
        rngs=rngs,
    )


def _modulation_table(rows: int, dim: int, rngs: nnx.Rngs) -> nnx.Param:
    """A learned (1, rows, dim) fp32 table added to the timestep projection (adaLN)."""
    init = logical_init(nnx.initializers.normal(dim**-0.5), (None, None, axes.EMBED))
    return nnx.Param(init(rngs.params(), (1, rows, dim), jnp.float32))


def gelu_tanh(x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x, approximate=True)


def gelu_exact(x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x, approximate=False)


class MLP(nnx.Module):
    """linear_1 -> activation -> linear_2 (diffusers' TimestepEmbedding,
    PixArtAlphaTextProjection and FeedForward share this shape)."""

    def __init__(
        self,
        din: int,
        hidden: int,
        dout: int,
        activation: Callable[[jax.Array], jax.Array],
        in_axis: str | None,
        *,
        dtype: DTypeLike,
        param_dtype: DTypeLike,
        rngs: nnx.Rngs,
        quant: Scheme | None = None,
    ):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs, quant=quant)
        self.linear_1 = _linear(din, hidden, (in_axis, axes.MLP), **kw)
        self.linear_2 = _linear(hidden, dout, (axes.MLP, axes.EMBED), **kw)
        self.activation = activation

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear_2(self.activation(self.linear_1(x)))


def timestep_embedding(t: jax.Array, dim: int, max_period: float = 10000.0) -> jax.Array:
    """Sinusoidal embedding [cos, sin] of (B,) timesteps (diffusers' Timesteps with
    flip_sin_to_cos=True, downscale_freq_shift=0), fp32."""
    half = dim // 2
    freqs = jnp.exp(-math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / half)
    angles = t.astype(jnp.float32)[:, None] * freqs[None]
    return jnp.concatenate([jnp.cos(angles), jnp.sin(angles)], axis=-1)


def rope_split(head_dim: int) -> tuple[int, int, int]:
    """Channels of a head rotated by frame, row and column position (diffusers' split)."""
    h = w = 2 * (head_dim // 6)
    return head_dim - h - w, h, w


def _rope_angles(n: int, dim: int, theta: float = 10000.0) -> np.ndarray:
    """(n, dim // 2) angles pos * theta^(-2i/dim), in float64 as diffusers computes them."""
    inv_freq = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    return np.outer(np.arange(n, dtype=np.float64), inv_freq)


def rope_tables(grid: tuple[int, int, int], head_dim: int) -> tuple[jax.Array, jax.Array]:
    """cos, sin of the 3-D rotary angles for a (frames, rows, cols) token grid, flattened in
    (t, h, w) order: each (S, head_dim // 2) fp32. Only the small per-axis tables are program
    constants; the full table is broadcast inside the program."""

    def table(fn: Callable[[np.ndarray], np.ndarray]) -> jax.Array:
        parts = []
        for axis, (n, dim) in enumerate(zip(grid, rope_split(head_dim), strict=True)):
            shape = [1, 1, 1, dim // 2]
            shape[axis] = n
            values = jnp.asarray(fn(_rope_angles(n, dim)).astype(np.float32)).reshape(shape)
            parts.append(jnp.broadcast_to(values, (*grid, dim // 2)))
        return jnp.concatenate(parts, axis=-1).reshape(math.prod(grid), head_dim // 2)

    return table(np.cos), table(np.sin)


def _pair_swap(dim: int) -> np.ndarray:
    """(dim, dim) matrix P with (x P)[2i] = -x[2i+1] and (x P)[2i+1] = x[2i]."""
    swap = np.zeros((dim, dim), np.float32)
    swap[1::2, 0::2] = -np.eye(dim // 2)
    swap[0::2, 1::2] = np.eye(dim // 2)
    return swap


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate consecutive channel pairs (x[2i], x[2i+1]) of (B, S, heads, D) by the angles:
    x[2i] cos - x[2i+1] sin and x[2i] sin + x[2i+1] cos, in fp32. Each channel's partner (signed)
    comes from a matmul by a fixed +-1 permutation (each output one input, so exact): a pair axis
    of 2 instead puts the sequence in the TPU's lanes and costs relayout copies of q and k in
    every block (bench/chip_profile.py)."""
    cos, sin = (jnp.repeat(t, 2, axis=-1)[None, :, None] for t in (cos, sin))
    swap = jnp.asarray(_pair_swap(x.shape[-1]), x.dtype)
    partner = jnp.einsum("...d,de->...e", x, swap, precision="highest")  # exact: one term each
    return (x.astype(jnp.float32) * cos + partner.astype(jnp.float32) * sin).astype(x.dtype)


class Attention(nnx.Module):
    """diffusers' WanAttention: q/k RMS-normalised over all heads together (the full inner dim)
    before the head split. With `image` (Wan 2.1 image to video's cross-attention), the queries
    also attend to the image tokens' own keys and values, and the two results are summed."""

    def __init__(
        self,
        dim: int,
        heads: int,
        eps: float,
        impl: str,
        context_parallel: str,
        *,
        dtype: DTypeLike,
        param_dtype: DTypeLike,
        rngs: nnx.Rngs,
        quant: Scheme | None = None,
        image: bool = False,
        attention_quant: str | None = None,
    ):
        """`attention_quant`: the attention itself in 8 bits, "int8" or "fp8"."""
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs, quant=quant)
        self.to_q = _linear(dim, dim, (axes.EMBED, axes.HEADS), **kw)
        self.to_k = _linear(dim, dim, (axes.EMBED, axes.HEADS), **kw)
        self.to_v = _linear(dim, dim, (axes.EMBED, axes.HEADS), **kw)
        self.to_out = _linear(dim, dim, (axes.HEADS, axes.EMBED), **kw)
        rms = dict(epsilon=eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        rms_init = logical_init(nnx.initializers.ones_init(), (axes.HEADS,))
        self.norm_q = nnx.RMSNorm(dim, scale_init=rms_init, **rms)
        self.norm_k = nnx.RMSNorm(dim, scale_init=rms_init, **rms)
        if image:
            self.add_k_proj = _linear(dim, dim, (axes.EMBED, axes.HEADS), **kw)
            self.add_v_proj = _linear(dim, dim, (axes.EMBED, axes.HEADS), **kw)
            self.norm_added_k = nnx.RMSNorm(dim, scale_init=rms_init, **rms)
        self.image = image
        self.heads = heads
        self.impl = impl
        self.context_parallel = context_parallel
        self.attention_quant = attention_quant

    def key_value(self, source: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Normalised keys and values of `source` (B, L, dim), heads not yet split (the
        cross-attention's cache)."""
        return self.norm_k(self.to_k(source)), self.to_v(source)

    def image_key_value(self, image: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The image tokens' keys and values (their own projections and norm), as key_value."""
        return self.norm_added_k(self.add_k_proj(image)), self.add_v_proj(image)

    def __call__(
        self,
        x: jax.Array,
        kv: tuple[jax.Array, jax.Array] | None = None,
        rope: tuple[jax.Array, jax.Array] | None = None,
        image_kv: tuple[jax.Array, jax.Array] | None = None,
        sparse: RadialSpec | None = None,
        tokens: int | None = None,
    ) -> jax.Array:
        """Attention of x (B, S, dim) to itself, or with `kv` (key_value's) to those;
        `sparse`: self-attention through this Radial mask (radial_step); `tokens`: x's real
        tokens, the rest padding (WanTransformer pads to the kernel's length)."""
        q = self._project(self.to_q, x, self.norm_q)
        if kv is None:
            k, v = self._project(self.to_k, x, self.norm_k), self._project(self.to_v, x)
        else:
            k, v = map(self._heads, kv)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        out = multi_head_attention(
            q, k, v, self.impl, self.context_parallel, sparse, self.attention_quant, tokens
        )
        if image_kv is not None:
            k_img, v_img = map(self._heads, image_kv)
            out = out + multi_head_attention(q, k_img, v_img, self.impl, self.context_parallel)
        return linear(self.to_out, out, contract=2)

    def _project(
        self, layer: nnx.Linear | QuantLinear, x: jax.Array, norm: nnx.RMSNorm | None = None
    ) -> jax.Array:
        """layer(x) split into heads (B, S, heads, head_dim), RMS-normalised over all heads."""
        t = linear(layer, x, out=(self.heads, x.shape[-1] // self.heads))
        return t if norm is None else rms_norm(norm, t, axes=2)

    def _heads(self, t: jax.Array) -> jax.Array:
        return t.reshape(*t.shape[:-1], self.heads, -1)


class WanBlock(nnx.Module):
    """One transformer block: modulated self-attention, cross-attention, modulated FFN."""

    def __init__(
        self,
        cfg: TransformerConfig,
        impl: str,
        context_parallel: str,
        *,
        dtype: DTypeLike,
        param_dtype: DTypeLike,
        rngs: nnx.Rngs,
        quant: Scheme | None = None,
        attention_quant: str | None = None,
    ):
        """`attention_quant`: the video self-attention in 8 bits (cross-attention is not)."""
        dim, eps = cfg.inner_dim, cfg.eps
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs, quant=quant)
        self.norm1 = _layer_norm(dim, eps, affine=False, rngs=rngs)
        heads = cfg.num_attention_heads
        self.attn1 = Attention(
            dim, heads, eps, impl, context_parallel, attention_quant=attention_quant, **kw
        )
        # The prompt's 512 tokens (and an image's 257) are not sharded: every device's queries
        # see all of them.
        image = cfg.added_kv_proj_dim is not None
        self.attn2 = Attention(dim, heads, eps, impl, "gather", image=image, **kw)
        self.norm2 = _layer_norm(dim, eps, affine=True, rngs=rngs) if cfg.cross_attn_norm else None
        self.ffn = MLP(dim, cfg.ffn_dim, dim, gelu_tanh, axes.EMBED, **kw)
        self.norm3 = _layer_norm(dim, eps, affine=False, rngs=rngs)
        self.scale_shift_table = _modulation_table(6, dim, rngs)
        self.dtype = dtype

    def __call__(
        self,
        x: jax.Array,
        cross_kv: tuple[jax.Array, ...],
        time6: jax.Array,
        rope: tuple[jax.Array, jax.Array],
        first: tuple[jax.Array, int] | None = None,
        sparse: RadialSpec | None = None,
        tokens: int | None = None,
    ) -> jax.Array:
        """x (B, S, dim); cross_kv this layer's text keys and values (B, L, dim), then the
        image's when the model takes image features; time6 the timestep projection
        (B, 6, dim); `first`: another projection for the first tokens, and their count;
        `sparse`: the self-attention's Radial mask (cross-attention stays dense); `tokens`:
        x's real tokens, the rest padding that no token attends to."""
        table = self.scale_shift_table[...]
        mod = table + time6.astype(jnp.float32)
        mod_first, first_tokens = (None, 0) if first is None else (table + first[0], first[1])
        shift, scale, gate, c_shift, c_scale, c_gate = (
            per_token(
                mod[:, i : i + 1],
                None if mod_first is None else mod_first[:, i : i + 1],
                first_tokens,
                x.shape[1],
            )
            for i in range(6)
        )
        x32 = x.astype(jnp.float32)

        # Named scopes: the HLO's op names (and `aot check`'s rows) say which part an
        # instruction comes from.
        with jax.named_scope("self_attention"):
            h = (self.norm1(x32) * (1 + scale) + shift).astype(self.dtype)
            attended = self.attn1(h, rope=rope, sparse=sparse, tokens=tokens)
            x = (x32 + attended * gate).astype(self.dtype)

        with jax.named_scope("cross_attention"):
            h = (
                self.norm2(x.astype(jnp.float32)).astype(self.dtype)
                if self.norm2 is not None
                else x
            )
            image_kv = cross_kv[2:] or None
            x = x + self.attn2(h, cross_kv[:2], image_kv=image_kv)

        with jax.named_scope("ffn"):
            x32 = x.astype(jnp.float32)
            h = (self.norm3(x32) * (1 + c_scale) + c_shift).astype(self.dtype)
            return (x32 + self.ffn(h).astype(jnp.float32) * c_gate).astype(self.dtype)


class ImageEmbedder(nnx.Module):
    """CLIP image features -> model width (diffusers' WanImageEmbedding): fp32 layer norm,
    Linear, exact GELU, Linear, fp32 layer norm. With `positions` (Wan 2.1 FLF2V: both images'
    tokens), a learned table is added to the features first."""

    def __init__(
        self,
        din: int,
        dout: int,
        positions: int | None,
        *,
        dtype: DTypeLike,
        param_dtype: DTypeLike,
        rngs: nnx.Rngs,
    ):
        self.pos_embed: nnx.Param | None = nnx.data(None)
        if positions is not None:
            init = logical_init(nnx.initializers.normal(0.02), (None, None, None))
            self.pos_embed = nnx.Param(init(rngs.params(), (1, positions, din), param_dtype))
        self.norm1 = _layer_norm(din, 1e-6, affine=True, rngs=rngs)
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.ff = MLP(din, din, dout, gelu_exact, None, **kw)
        self.norm2 = _layer_norm(dout, 1e-6, affine=True, rngs=rngs)
        self.dtype = dtype

    def __call__(self, features: jax.Array) -> jax.Array:
        if self.pos_embed is not None:  # added in the model's dtype, as diffusers does
            features = features.astype(self.dtype) + self.pos_embed[...].astype(self.dtype)
        h = self.norm1(features.astype(jnp.float32)).astype(self.dtype)
        return self.norm2(self.ff(h).astype(jnp.float32)).astype(self.dtype)


class ConditionEmbedder(nnx.Module):
    """Timestep -> (temb, 6 modulation vectors); text embeddings (and image features) -> model
    width."""

    def __init__(
        self, cfg: TransformerConfig, *, dtype: DTypeLike, param_dtype: DTypeLike, rngs: nnx.Rngs
    ):
        dim = cfg.inner_dim
        self.freq_dim = cfg.freq_dim
        self.time_embedder = MLP(
            cfg.freq_dim, dim, dim, jax.nn.silu, None,
            dtype=jnp.float32, param_dtype=jnp.float32, rngs=rngs,
        )  # fmt: skip
        self.time_proj = _linear(
            dim, 6 * dim, (axes.EMBED, axes.MLP), dtype=dtype, param_dtype=param_dtype, rngs=rngs
        )
        self.text_embedder = MLP(
            cfg.text_dim, dim, dim, gelu_tanh, None,
            dtype=dtype, param_dtype=param_dtype, rngs=rngs,
        )  # fmt: skip
        if cfg.image_dim is not None:
            self.image_embedder = ImageEmbedder(
                cfg.image_dim, dim, cfg.pos_embed_seq_len, dtype=dtype, param_dtype=param_dtype,
                rngs=rngs,
            )  # fmt: skip
        self.dtype = dtype

    def time(self, timestep: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(B,) timesteps -> temb (B, dim) and the block modulation (B, 6, dim)."""
        temb = self.time_embedder(timestep_embedding(timestep, self.freq_dim)).astype(self.dtype)
        time6 = self.time_proj(jax.nn.silu(temb))
        return temb, time6.reshape(time6.shape[0], 6, -1)


class WanTransformer(nnx.Module):
    """diffusers' WanTransformer3DModel (text-to-video), channels-last."""

    def __init__(
        self,
        cfg: TransformerConfig,
        *,
        attention: str = "dot",
        context_parallel: str = "gather",
        quant: str = "none",
        attention_quant: str = "none",
        dtype: DTypeLike = jnp.float32,
        param_dtype: DTypeLike = jnp.float32,
        rngs: nnx.Rngs,
    ):
        """`quant`: the blocks' Linear layers in 8 bits (a wan.quant mode, `aot build --quant`);
        `attention_quant`: their self-attention in 8 bits, "int8" or "fp8"
        (`aot build --attention-quant`; "none": in `dtype`)."""
        attention_8bit = None if attention_quant == "none" else attention_quant
        # fail at construction on an unknown implementation
        resolve_attention(attention, quant=attention_8bit)
        if context_parallel not in CONTEXT_PARALLEL:
            raise ValueError(f"context parallelism {context_parallel!r}: use gather or ulysses")
        dim = cfg.inner_dim
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        self.config = cfg
        self.dtype = dtype
        self.attention, self.attention_quant = attention, attention_8bit
        self.patch_embedding = nnx.Conv(
            cfg.in_channels,
            dim,
            kernel_size=cfg.patch_size,
            strides=cfg.patch_size,
            padding="VALID",
            kernel_init=logical_init(
                nnx.initializers.lecun_normal(), (None, None, None, None, axes.EMBED)
            ),
            bias_init=logical_init(nnx.initializers.zeros_init(), (axes.EMBED,)),
            rngs=rngs,
            **kw,
        )
        self.condition_embedder = ConditionEmbedder(cfg, rngs=rngs, **kw)

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: axes.LAYERS})
        def stacked_blocks(rngs: nnx.Rngs) -> WanBlock:
            return WanBlock(
                cfg, attention, context_parallel, rngs=rngs, quant=scheme(quant),
                attention_quant=attention_8bit, **kw,
            )  # fmt: skip

        self.blocks = stacked_blocks(rngs)
        self.norm_out = _layer_norm(dim, cfg.eps, affine=False, rngs=rngs)
        self.proj_out = _linear(
            dim, cfg.out_channels * math.prod(cfg.patch_size), (axes.EMBED, None), rngs=rngs, **kw
        )
        self.scale_shift_table = _modulation_table(2, dim, rngs)

    def compute_kv_cache(
        self, encoder_hidden_states: jax.Array, image_features: jax.Array | None = None
    ) -> KVCache:
        """Text embeddings (B, L, text_dim) -> every layer's cross-attention keys and values,
        each (num_layers, B, L, inner_dim); with CLIP `image_features` (B, image tokens,
        image_dim), the image tokens' keys and values follow (Wan 2.1 image to video)."""
        context = self.condition_embedder.text_embedder(encoder_hidden_states.astype(self.dtype))
        image = None
        if image_features is not None:
            # Batch-sharded in and out, like the tokens: left to XLA, the norms' fsdp-sharded
            # gains reach the features and are undone by an all-to-all.
            features = constrain(image_features.astype(self.dtype), HIDDEN)
            image = constrain(self.condition_embedder.image_embedder(features), HIDDEN)
        graphdef, params = nnx.split(self.blocks.attn2)

        def layer(_, p):
            attn = nnx.merge(graphdef, p)
            kv = attn.key_value(context)
            if image is not None:
                kv += attn.image_key_value(image)
            return None, tuple(constrain(t, KV) for t in kv)

        _, kv = jax.lax.scan(layer, None, params)
        return kv

    def __call__(
        self,
        latents: jax.Array,
        timestep: jax.Array,
        encoder_hidden_states: jax.Array | None = None,
        kv_cache: KVCache | None = None,
        image_features: jax.Array | None = None,
    ) -> jax.Array:
        """latents (B, T, H, W, C_in), timestep (B,) (or a scalar), and either the text
        embeddings (B, L, text_dim) (with the image features, for a model that takes them) or
        their `compute_kv_cache` -> flow (B, T, H, W, C_out)."""
        if (encoder_hidden_states is None) == (kv_cache is None):
            raise ValueError("pass exactly one of encoder_hidden_states and kv_cache")
        if kv_cache is None:
            kv_cache = self.compute_kv_cache(encoder_hidden_states, image_features)
        embedded = self.embed(latents, timestep)
        return self.head(self.run_blocks(embedded, kv_cache), embedded)

    def embed(
        self, latents: jax.Array, timestep: jax.Array, first_at_zero: bool = False
    ) -> Embedded:
        """What every block takes besides its text keys/values: the patch tokens, the timestep's
        embedding and modulation, the rotary tables. `first_at_zero` (TI2V-5B's image mode,
        diffusers' expand_timesteps): the first latent frame's tokens are at timestep 0."""
        batch = latents.shape[0]
        grid = self.config.patch_grid(latents.shape[1:4])
        rope = rope_tables(grid, self.config.attention_head_dim)

        # The patch embedding is a Conv with stride = kernel = patch: a Linear on each patch.
        # Applied to the patch sequence pinned sequence-sharded, each device embeds only its
        # own tokens (as a conv, XLA lays its output out by the weights' fsdp channels and
        # then all-to-alls it to the sequence sharding).
        patches = constrain(self._patchify(latents.astype(self.dtype), grid), (*HIDDEN[:2], None))
        conv = self.patch_embedding
        x = patches @ conv.kernel[...].reshape(-1, self.config.inner_dim) + conv.bias[...]
        temb, time6 = self.condition_embedder.time(jnp.broadcast_to(timestep, (batch,)))
        first = self.condition_embedder.time(jnp.zeros((batch,))) if first_at_zero else None
        return Embedded(x, temb, time6, rope, grid, first)

    def _block_first(self, embedded: Embedded) -> tuple[jax.Array, int] | None:
        return None if embedded.first is None else (embedded.first[1], embedded.first_tokens)

    def run_blocks(self, embedded: Embedded, kv_cache: KVCache) -> jax.Array:
        """The tokens after every block: one scanned block body."""
        graphdef, params = nnx.split(self.blocks)
        first = self._block_first(embedded)
        x, rope, tokens = self._padded(embedded.tokens, embedded.rope)

        @jax.named_scope("blocks")
        def layer(x, inputs):
            p, kv = inputs
            block = nnx.merge(graphdef, p)
            x = block(constrain(x, HIDDEN), kv, embedded.time6, rope, first, tokens=tokens)
            return constrain(x, HIDDEN), None

        x, _ = jax.lax.scan(layer, x, (params, tuple(kv_cache)))
        return x[:, :tokens]

    def run_block_range(
        self,
        x: jax.Array,
        embedded: Embedded,
        kv_cache: KVCache,
        start: int,
        stop: int,
        sparse: RadialSpec | None = None,
    ) -> jax.Array:
        """`x` after blocks start..stop-1: a loop that reads each layer's slice of the stacked
        weights in place (slicing the stack for a scan would copy the weights); `sparse`: their
        self-attention through this Radial mask."""
        graphdef, params = nnx.split(self.blocks)
        first = self._block_first(embedded)
        x, rope, tokens = self._padded(x, embedded.rope)

        @jax.named_scope("blocks")
        def layer(i, x):
            p, kv = jax.tree.map(
                lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False),
                (params, tuple(kv_cache)),
            )
            block = nnx.merge(graphdef, p)
            x = block(constrain(x, HIDDEN), kv, embedded.time6, rope, first, sparse, tokens)
            return constrain(x, HIDDEN)

        return jax.lax.fori_loop(start, stop, layer, x)[:, :tokens]

    def _padded(
        self, x: jax.Array, rope: tuple[jax.Array, jax.Array]
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array], int]:
        """The tokens x (B, S, dim) and their rope tables zero-padded to the length the
        self-attention kernel computes (attention.padded_length), and S: padded once a pass,
        the blocks' q, k and v come out of their projections at the kernel's length (padding
        them in every block costs a copy of each)."""
        tokens = x.shape[1]
        pad = padded_length(self.attention, tokens, self.attention_quant) - tokens
        if not pad:
            return x, rope, tokens
        rope = tuple(jnp.pad(t, ((0, pad), (0, 0))) for t in rope)
        return jnp.pad(x, ((0, 0), (0, pad), (0, 0))), rope, tokens

    def head(self, x: jax.Array, embedded: Embedded) -> jax.Array:
        """The blocks' output tokens -> flow (B, T, H, W, C_out)."""
        # Batch-sharded like the tokens; left to XLA, the weights' fsdp layout of the time
        # embedding's channels reaches here and is undone by an all-to-all.
        temb = constrain(embedded.temb, (axes.BATCH, axes.ACT_EMBED))
        shift, scale = jnp.split(self.scale_shift_table[...] + temb[:, None], 2, axis=1)
        if embedded.first is not None:
            shift_0, scale_0 = jnp.split(
                self.scale_shift_table[...] + embedded.first[0][:, None], 2, axis=1
            )
            shift = per_token(shift, shift_0, embedded.first_tokens, x.shape[1])
            scale = per_token(scale, scale_0, embedded.first_tokens, x.shape[1])
        x = (self.norm_out(x.astype(jnp.float32)) * (1 + scale) + shift).astype(self.dtype)
        return self._unpatchify(self.proj_out(x), embedded.grid)

    def _patchify(self, x: jax.Array, grid: tuple[int, int, int]) -> jax.Array:
        """(B, T, H, W, C) -> (B, S, pt*ph*pw*C), patch channels ordered (pt, ph, pw, C) as the
        patch embedding's kernel (pt, ph, pw, C, D) is."""
        (t, h, w), (pt, ph, pw) = grid, self.config.patch_size
        x = x.reshape(x.shape[0], t, pt, h, ph, w, pw, -1)
        x = x.transpose(0, 1, 3, 5, 2, 4, 6, 7)
        return x.reshape(x.shape[0], t * h * w, -1)

    def _unpatchify(self, x: jax.Array, grid: tuple[int, int, int]) -> jax.Array:
        """(B, S, pt*ph*pw*C) -> (B, T, H, W, C); patch channels are ordered (pt, ph, pw, C)."""
        (t, h, w), (pt, ph, pw) = grid, self.config.patch_size
        x = x.reshape(x.shape[0], t, h, w, pt, ph, pw, -1)
        x = x.transpose(0, 1, 4, 2, 5, 3, 6, 7)
        return x.reshape(x.shape[0], t * pt, h * ph, w * pw, -1)
