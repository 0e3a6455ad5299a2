"""Weight rule: transformers `CLIPVisionModel` (or `CLIPVisionModelWithProjection`) state dict
-> `wan.models.image_encoder.CLIPVisionEncoder`.

The module keeps transformers' names: `encoder.layers.N.` becomes layer N of the stacked
`encoder.layers`, a Linear's or the patch conv's `weight` its `kernel` (transposed), an
embedding table's its `embedding`; the layer norms keep `weight` and `bias`.
"""

from __future__ import annotations

import re

from wan.weights import Target, WeightError, conv2d, identity, linear

# transformers 4 names every tensor under `vision_model.` (a CLIPVisionModelWithProjection's
# still are: Wan 2.1's image encoder); transformers 5 saves a CLIPVisionModel's without.
_PREFIX = "vision_model."
_LAYER = re.compile(r"encoder\.layers\.(\d+)\.(.+)\.(weight|bias)")
_LAYER_NORMS = {"layer_norm1", "layer_norm2"}
_LAYER_LINEARS = {
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj",
    "mlp.fc1", "mlp.fc2",
}  # fmt: skip
_EMBEDDINGS = {
    "embeddings.class_embedding": Target(("embeddings", "class_embedding")),
    "embeddings.patch_embedding.weight": Target(
        ("embeddings", "patch_embedding", "kernel"), transform=conv2d
    ),
    "embeddings.position_embedding.weight": Target(
        ("embeddings", "position_embedding", "embedding")
    ),
    "pre_layrnorm.weight": Target(("pre_layrnorm", "weight")),
    "pre_layrnorm.bias": Target(("pre_layrnorm", "bias")),
}
# No parameter here: the final norm and the projection head make only the pooled output and the
# image embedding, not the penultimate hidden states Wan takes; `position_ids` is a buffer
# (arange) that transformers before 4.31 saved.
SKIPPED = {
    "post_layernorm.weight",
    "post_layernorm.bias",
    "embeddings.position_ids",
    "visual_projection.weight",
}


def rule(name: str) -> Target | None:
    """Map one transformers tensor name to its parameter (None: deliberately skipped)."""
    local = name.removeprefix(_PREFIX)
    if local in SKIPPED:
        return None
    if local in _EMBEDDINGS:
        return _EMBEDDINGS[local]
    match = _LAYER.fullmatch(local)
    if match is None or match[2] not in _LAYER_NORMS | _LAYER_LINEARS:
        raise WeightError(f"unexpected CLIP vision tensor {name}")
    layer, module, leaf = int(match[1]), match[2], match[3]
    path = ("encoder", "layers", *module.split("."))
    if module in _LAYER_NORMS or leaf == "bias":
        return Target((*path, leaf), layer=layer, transform=identity)
    return Target((*path, "kernel"), layer=layer, transform=linear)
