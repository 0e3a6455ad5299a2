"""Weight rule: transformers `UMT5EncoderModel` state dict -> `wan.models.text_encoder.UMT5Encoder`."""

from __future__ import annotations

import re

from wan.weights import Target, WeightError, identity, linear

_BLOCK = re.compile(r"encoder\.block\.(\d+)\.layer\.([01])\.(.+)\.weight")

# (sublayer, transformers name) -> (our path under `block`, transform)
_BLOCK_PARAMS = {
    ("0", "layer_norm"): (("attention_norm", "weight"), identity),
    ("0", "SelfAttention.q"): (("attention", "q", "kernel"), linear),
    ("0", "SelfAttention.k"): (("attention", "k", "kernel"), linear),
    ("0", "SelfAttention.v"): (("attention", "v", "kernel"), linear),
    ("0", "SelfAttention.o"): (("attention", "o", "kernel"), linear),
    ("0", "SelfAttention.relative_attention_bias"): (
        ("attention", "relative_attention_bias"),
        identity,
    ),
    ("1", "layer_norm"): (("ffn_norm", "weight"), identity),
    ("1", "DenseReluDense.wi_0"): (("ffn", "wi_0", "kernel"), linear),
    ("1", "DenseReluDense.wi_1"): (("ffn", "wi_1", "kernel"), linear),
    ("1", "DenseReluDense.wo"): (("ffn", "wo", "kernel"), linear),
}


def rule(name: str) -> Target | None:
    """Map one transformers tensor name to its parameter.

    The token embedding is tied: checkpoints hold `shared.weight`, `encoder.embed_tokens.weight`
    or both (the same tensor), so both names land on the one embedding.
    """
    if name in ("shared.weight", "encoder.embed_tokens.weight"):
        return Target(("shared", "embedding"))
    if name == "encoder.final_layer_norm.weight":
        return Target(("final_layer_norm", "weight"))
    match = _BLOCK.fullmatch(name)
    if match is None or (match[2], match[3]) not in _BLOCK_PARAMS:
        raise WeightError(f"unexpected UMT5 encoder tensor {name}")
    path, transform = _BLOCK_PARAMS[match[2], match[3]]
    return Target(("block", *path), layer=int(match[1]), transform=transform)
