"""UMT5 text encoder (transformers' `UMT5EncoderModel`) in Flax NNX.

T5 v1.1 encoder: pre-norm blocks of self-attention and a gated-GELU feed-forward, RMS layer
norms without mean subtraction, no biases, no attention scaling. UMT5 differs from T5 in one
point: every layer owns its relative position bias (T5 shares the first layer's).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from wan import axes
from wan.component_configs import TextEncoderConfig
from wan.models.partitioned import logical_init
from wan.sharding import constrain

# Activation layouts. Prompt tokens are "kv_length" as in the transformer: short, kept whole.
HIDDEN = (axes.BATCH, axes.KV_LENGTH, axes.ACT_EMBED)  # the residual stream (B, L, d_model)
HEADS = (axes.BATCH, axes.KV_LENGTH, axes.HEADS, None)  # per-head activations (B, L, heads, d_kv)


def relative_position_buckets(length: int, num_buckets: int, max_distance: int) -> jax.Array:
    """(L, L) bucket of key position minus query position, bidirectional as in T5:
    half the buckets per direction, exact for small distances, log-spaced up to
    `max_distance`. Same float32 arithmetic as transformers, so the same buckets."""
    position = jnp.arange(length, dtype=jnp.int32)
    relative = position[None, :] - position[:, None]
    half = num_buckets // 2
    direction = jnp.where(relative > 0, half, 0)
    distance = jnp.abs(relative)
    max_exact = half // 2
    log_ratio = jnp.log(distance.astype(jnp.float32) / max_exact) / math.log(
        max_distance / max_exact
    )
    large = max_exact + (log_ratio * (half - max_exact)).astype(jnp.int32)
    large = jnp.minimum(large, half - 1)
    return direction + jnp.where(distance < max_exact, distance, large)


class RMSNorm(nnx.Module):
    """T5 layer norm: scale by the root mean square, accumulated in float32."""

    def __init__(self, dim: int, eps: float, *, dtype: jnp.dtype, param_dtype: jnp.dtype):
        self.weight = nnx.Param(
            logical_init(nnx.initializers.ones, (axes.EMBED,))(None, (dim,), param_dtype)
        )
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight.astype(self.dtype) * x32.astype(self.dtype)


def _linear(
    din: int, dout: int, logical: tuple[str, str], *, dtype, param_dtype, rngs: nnx.Rngs
) -> nnx.Linear:
    return nnx.Linear(
        din, dout, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
        kernel_init=logical_init(nnx.initializers.lecun_normal(), logical),
    )  # fmt: skip


class SelfAttention(nnx.Module):
    """Multi-head self-attention with a learned relative position bias and no 1/sqrt(d) scale
    (T5 folds it into the initialisation)."""

    def __init__(self, cfg: TextEncoderConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        inner = cfg.num_heads * cfg.d_kv
        proj = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q = _linear(cfg.d_model, inner, (axes.EMBED, axes.HEADS), **proj)
        self.k = _linear(cfg.d_model, inner, (axes.EMBED, axes.HEADS), **proj)
        self.v = _linear(cfg.d_model, inner, (axes.EMBED, axes.HEADS), **proj)
        self.o = _linear(inner, cfg.d_model, (axes.HEADS, axes.EMBED), **proj)
        bias_init = logical_init(nnx.initializers.normal(1.0), (None, axes.HEADS))
        self.relative_attention_bias = nnx.Param(
            bias_init(
                rngs.params(), (cfg.relative_attention_num_buckets, cfg.num_heads), param_dtype
            )
        )
        self.num_heads = cfg.num_heads
        self.dtype = dtype

    def __call__(self, x: jax.Array, key_mask: jax.Array, buckets: jax.Array) -> jax.Array:
        b, length, _ = x.shape
        q, k, v = (
            constrain(proj(x).reshape(b, length, self.num_heads, -1), HEADS)
            for proj in (self.q, self.k, self.v)
        )
        bias = self.relative_attention_bias[...].astype(self.dtype)[buckets]  # (L, L, heads)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) + bias.transpose(2, 0, 1)[None]
        scores = jnp.where(key_mask[:, None, None, :], scores, jnp.finfo(scores.dtype).min)
        weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(self.dtype)
        out = constrain(jnp.einsum("bhqk,bkhd->bqhd", weights, v), HEADS)
        return self.o(out.reshape(b, length, -1))


class GatedGelu(nnx.Module):
    """T5 v1.1 feed-forward: wo(gelu_tanh(wi_0 x) * wi_1 x)."""

    def __init__(self, cfg: TextEncoderConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        proj = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.wi_0 = _linear(cfg.d_model, cfg.d_ff, (axes.EMBED, axes.MLP), **proj)
        self.wi_1 = _linear(cfg.d_model, cfg.d_ff, (axes.EMBED, axes.MLP), **proj)
        self.wo = _linear(cfg.d_ff, cfg.d_model, (axes.MLP, axes.EMBED), **proj)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.wo(jax.nn.gelu(self.wi_0(x), approximate=True) * self.wi_1(x))


class Block(nnx.Module):
    """One encoder layer: x + attn(norm(x)), then x + ffn(norm(x))."""

    def __init__(self, cfg: TextEncoderConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        self.attention_norm = RMSNorm(cfg.d_model, cfg.layer_norm_epsilon, **kw)
        self.attention = SelfAttention(cfg, **kw, rngs=rngs)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.layer_norm_epsilon, **kw)
        self.ffn = GatedGelu(cfg, **kw, rngs=rngs)

    def __call__(self, x: jax.Array, key_mask: jax.Array, buckets: jax.Array) -> jax.Array:
        x = x + self.attention(self.attention_norm(x), key_mask, buckets)
        x = x + self.ffn(self.ffn_norm(x))
        return constrain(x, HIDDEN)


class UMT5Encoder(nnx.Module):
    """Token ids (B, L) and their attention mask -> last hidden state (B, L, d_model)."""

    def __init__(
        self,
        cfg: TextEncoderConfig,
        *,
        dtype: jnp.dtype = jnp.float32,
        param_dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.cfg = cfg
        self.shared = nnx.Embed(
            cfg.vocab_size, cfg.d_model, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
            embedding_init=logical_init(nnx.initializers.normal(1.0), (axes.VOCAB, axes.EMBED)),
        )  # fmt: skip

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: axes.LAYERS})
        def layers(rngs: nnx.Rngs) -> Block:
            return Block(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

        self.block = layers(rngs)
        self.final_layer_norm = RMSNorm(
            cfg.d_model, cfg.layer_norm_epsilon, dtype=dtype, param_dtype=param_dtype
        )

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array) -> jax.Array:
        cfg = self.cfg
        buckets = relative_position_buckets(
            input_ids.shape[1],
            cfg.relative_attention_num_buckets,
            cfg.relative_attention_max_distance,
        )
        key_mask = attention_mask > 0

        @nnx.scan(
            in_axes=(0, nnx.Carry), out_axes=nnx.Carry,
            transform_metadata={nnx.PARTITION_NAME: axes.LAYERS},
        )  # fmt: skip
        def run(block: Block, x: jax.Array) -> jax.Array:
            return block(x, key_mask, buckets)

        x = constrain(self.shared(input_ids), HIDDEN)
        return self.final_layer_norm(run(self.block, x))


def prompt_embeddings(
    encoder_out: jax.Array, attention_mask: jax.Array, max_length: int = 512
) -> jax.Array:
    """diffusers' WanPipeline: keep each prompt's first `length` positions (length = number of
    real tokens), zero the rest, and pad or cut the sequence axis to `max_length`."""
    length = jnp.sum(attention_mask > 0, axis=-1)
    seq = encoder_out.shape[1]
    keep = jnp.arange(seq)[None, :] < length[:, None]
    out = jnp.where(keep[..., None], encoder_out, 0)[:, :max_length]
    return jnp.pad(out, ((0, 0), (0, max_length - out.shape[1]), (0, 0)))
