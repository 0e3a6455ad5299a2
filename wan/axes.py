"""Logical axis names: the models name every sharded dimension of their parameters and
activations with one of these, and `wan.sharding`'s rules map each to mesh axes per build. A
name outside `ALL` is an error, never a silently replicated dimension."""

BATCH = "batch"  # videos (prompt rows in the text encoder): activations and the KV cache
LENGTH = "length"  # video tokens
KV_LENGTH = "kv_length"  # prompt tokens: short, kept whole
EMBED = "embed"  # the model width of weights
ACT_EMBED = "act_embed"  # the model width of activations
HEADS = "heads"  # attention heads (and their fused projections)
MLP = "mlp"  # feed-forward hidden units
VOCAB = "vocab"  # token embeddings' rows
LAYERS = "layers"  # the stacked (scanned) layers

VAE_BATCH = "vae_batch"  # videos in the VAE
VAE_HEIGHT = "vae_height"
VAE_WIDTH = "vae_width"
VAE_CONV_OUT = "vae_conv_out"  # conv kernels' output channels

ALL = frozenset(
    {BATCH, LENGTH, KV_LENGTH, EMBED, ACT_EMBED, HEADS, MLP, VOCAB, LAYERS}
    | {VAE_BATCH, VAE_HEIGHT, VAE_WIDTH, VAE_CONV_OUT}
)
