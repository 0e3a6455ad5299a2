"""CLIP ViT vision encoder (transformers' `CLIPVisionModel`) in Flax NNX: Wan 2.1 image to
video's image features.

The image is cut into patch_size x patch_size patches, each embedded by a linear map (a conv
with stride = kernel), a learned class token put in front, a learned position embedding added,
and the tokens normalised (`pre_layrnorm`) before pre-norm transformer layers: x + attn(ln(x)),
then x + mlp(ln(x)), with biased projections and a GELU MLP. The features diffusers'
WanImageToVideoPipeline takes are `hidden_states[-2]`, the output of the penultimate layer
without the final norm. Module and parameter names are transformers', so the weight rule
(`wan.weights.image_encoder`) is mechanical.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from wan import axes
from wan.component_configs import ImageEncoderConfig
from wan.models.partitioned import logical_init
from wan.sharding import constrain

# Activation layouts. Image tokens are few (257) and kept whole, as the text encoder's prompts.
HIDDEN = (axes.BATCH, axes.KV_LENGTH, axes.ACT_EMBED)  # the residual stream (B, tokens, hidden)
HEADS = (axes.BATCH, axes.KV_LENGTH, axes.HEADS, None)  # per-head (B, tokens, heads, head_dim)


def quick_gelu(x: jax.Array) -> jax.Array:
    """OpenAI CLIP's sigmoid approximation of GELU."""
    return x * jax.nn.sigmoid(1.702 * x)


ACTIVATIONS = {"gelu": lambda x: jax.nn.gelu(x, approximate=False), "quick_gelu": quick_gelu}


class LayerNorm(nnx.Module):
    """torch's LayerNorm: mean and variance (two-pass) and the affine in float32, whatever the
    activations' dtype."""

    def __init__(self, dim: int, eps: float, *, dtype: jnp.dtype, param_dtype: jnp.dtype):
        self.weight = nnx.Param(
            logical_init(nnx.initializers.ones, (axes.EMBED,))(None, (dim,), param_dtype)
        )
        self.bias = nnx.Param(
            logical_init(nnx.initializers.zeros, (axes.EMBED,))(None, (dim,), param_dtype)
        )
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        y = y * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
        return y.astype(self.dtype)


def _linear(
    din: int, dout: int, logical: tuple[str, str], *, dtype, param_dtype, rngs: nnx.Rngs
) -> nnx.Linear:
    return nnx.Linear(
        din, dout, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
        kernel_init=logical_init(nnx.initializers.lecun_normal(), logical),
        bias_init=logical_init(nnx.initializers.zeros_init(), (logical[1],)),
    )  # fmt: skip


class Embeddings(nnx.Module):
    """Pixels (B, S, S, C) -> tokens (B, 1 + (S / patch)^2, hidden): the class token, then the
    patches row by row, each plus its position's embedding."""

    def __init__(self, cfg: ImageEncoderConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        patch = (cfg.patch_size, cfg.patch_size)
        kernel = (None, None, None, axes.EMBED)  # (h, w, channels in, hidden)
        self.patch_embedding = nnx.Conv(
            cfg.num_channels, cfg.hidden_size, kernel_size=patch, strides=patch,
            padding="VALID", use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
            kernel_init=logical_init(nnx.initializers.lecun_normal(), kernel),
        )  # fmt: skip
        self.class_embedding = nnx.Param(
            logical_init(nnx.initializers.normal(1.0), (axes.EMBED,))(
                rngs.params(), (cfg.hidden_size,), param_dtype
            )
        )
        self.position_embedding = nnx.Embed(
            cfg.tokens, cfg.hidden_size, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
            embedding_init=logical_init(nnx.initializers.normal(1.0), (None, axes.EMBED)),
        )  # fmt: skip
        self.dtype = dtype

    def __call__(self, pixels: jax.Array) -> jax.Array:
        patches = self.patch_embedding(pixels)  # (B, S/p, S/p, hidden)
        b, _, _, hidden = patches.shape
        patches = patches.reshape(b, -1, hidden)
        cls = jnp.broadcast_to(self.class_embedding[...].astype(self.dtype), (b, 1, hidden))
        x = jnp.concatenate([cls, patches], axis=1)
        return x + self.position_embedding(jnp.arange(x.shape[1]))


class SelfAttention(nnx.Module):
    """Multi-head self-attention over all tokens, softmax(q k^T / sqrt(head_dim)) in float32."""

    def __init__(self, cfg: ImageEncoderConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        width = cfg.hidden_size
        proj = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q_proj = _linear(width, width, (axes.EMBED, axes.HEADS), **proj)
        self.k_proj = _linear(width, width, (axes.EMBED, axes.HEADS), **proj)
        self.v_proj = _linear(width, width, (axes.EMBED, axes.HEADS), **proj)
        self.out_proj = _linear(width, width, (axes.HEADS, axes.EMBED), **proj)
        self.num_heads = cfg.num_attention_heads
        self.scale = (width // cfg.num_attention_heads) ** -0.5
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        b, length, _ = x.shape
        q, k, v = (
            constrain(proj(x).reshape(b, length, self.num_heads, -1), HEADS)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * self.scale
        weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(self.dtype)
        out = constrain(jnp.einsum("bhqk,bkhd->bqhd", weights, v), HEADS)
        return self.out_proj(out.reshape(b, length, -1))


class MLP(nnx.Module):
    """fc2(act(fc1 x))."""

    def __init__(self, cfg: ImageEncoderConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        proj = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.fc1 = _linear(cfg.hidden_size, cfg.intermediate_size, (axes.EMBED, axes.MLP), **proj)
        self.fc2 = _linear(cfg.intermediate_size, cfg.hidden_size, (axes.MLP, axes.EMBED), **proj)
        self.activation = ACTIVATIONS[cfg.hidden_act]

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(self.activation(self.fc1(x)))


class EncoderLayer(nnx.Module):
    """One pre-norm layer: x + attn(layer_norm1(x)), then x + mlp(layer_norm2(x))."""

    def __init__(self, cfg: ImageEncoderConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        self.layer_norm1 = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, **kw)
        self.self_attn = SelfAttention(cfg, **kw, rngs=rngs)
        self.layer_norm2 = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, **kw)
        self.mlp = MLP(cfg, **kw, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.self_attn(self.layer_norm1(x))
        x = x + self.mlp(self.layer_norm2(x))
        return constrain(x, HIDDEN)


class Encoder(nnx.Module):
    """The stacked layers (leading axis: layer), run by one scan.

    It holds all of a checkpoint's `num_hidden_layers` layers, the last included, though that
    one never runs: a weight rule sees one tensor name at a time, not the depth, so it cannot
    tell the last layer's tensors apart to leave them out (one layer of 32 in ViT-H)."""

    def __init__(self, cfg: ImageEncoderConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=cfg.num_hidden_layers)
        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: axes.LAYERS})
        def stacked(rngs: nnx.Rngs) -> EncoderLayer:
            return EncoderLayer(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

        self.layers = stacked(rngs)

    def __call__(self, x: jax.Array, depth: int) -> jax.Array:
        """`x` after the first `depth` layers, each read in place from the stack (slicing the
        stack for the scan would copy the weights)."""
        graphdef, params = nnx.split(self.layers)

        def layer(x: jax.Array, i: jax.Array) -> tuple[jax.Array, None]:
            p = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), params)
            return nnx.merge(graphdef, p)(x), None

        x, _ = jax.lax.scan(layer, x, jnp.arange(depth))
        return x


class CLIPVisionEncoder(nnx.Module):
    """Normalised pixels (B, image_size, image_size, num_channels), channels last, as the CLIP
    image processor makes them -> the penultimate layer's hidden states (B, tokens,
    hidden_size)."""

    def __init__(
        self,
        cfg: ImageEncoderConfig,
        *,
        dtype: jnp.dtype = jnp.float32,
        param_dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.cfg = cfg
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        self.embeddings = Embeddings(cfg, **kw, rngs=rngs)
        self.pre_layrnorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, **kw)  # sic
        self.encoder = Encoder(cfg, **kw, rngs=rngs)
        self.dtype = dtype

    def __call__(self, pixels: jax.Array) -> jax.Array:
        cfg = self.cfg
        want = (cfg.image_size, cfg.image_size, cfg.num_channels)
        if pixels.shape[1:] != want:
            raise ValueError(f"pixels are {pixels.shape[1:]} per image, the encoder takes {want}")
        x = constrain(self.pre_layrnorm(self.embeddings(pixels.astype(self.dtype))), HIDDEN)
        # hidden_states[-2]: the output of all layers but the last. The last layer and
        # post_layernorm make only the last hidden state and the pooled output, which Wan never
        # uses, so they are not run.
        return self.encoder(x, cfg.num_hidden_layers - 1)
