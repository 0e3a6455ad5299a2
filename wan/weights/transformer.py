"""diffusers `WanTransformer3DModel` state dict -> `wan.transformer.WanTransformer` params.

The module tree mirrors diffusers', so the mapping is mechanical: `blocks.N.` becomes layer N
of the stacked `blocks`, three submodules are renamed, and the leaf name and layout follow
from the kind of layer (Linear, Conv3d, norm, or a raw table).
"""

from __future__ import annotations

import re

from wan.weights import Target, WeightError, conv3d, identity, linear

# diffusers submodule path -> ours (diffusers wraps these Linears in containers).
_RENAMES = {
    "attn1.to_out.0": "attn1.to_out",
    "attn2.to_out.0": "attn2.to_out",
    "ffn.net.0.proj": "ffn.linear_1",
    "ffn.net.2": "ffn.linear_2",
}
_NORMS = {"norm_q", "norm_k", "norm2"}  # weight -> scale, no layout change
_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")
_IGNORED = ("norm_added_q",)  # diffusers ignores these unexpected keys on load too


def rule(name: str) -> Target | None:
    """Target of one diffusers tensor. Tensors of modules this model lacks (image-to-video
    weights) map to paths the importer rejects; a leaf that is neither weight nor bias raises."""
    if any(part in _IGNORED for part in name.split(".")):
        return None
    layer, prefix, local = None, (), name
    if match := _BLOCK.fullmatch(name):
        layer, prefix, local = int(match[1]), ("blocks",), match[2]
    if local == "scale_shift_table":
        return Target((*prefix, local), layer, identity)
    module, _, leaf = local.rpartition(".")
    module = _RENAMES.get(module, module)
    path = (*prefix, *module.split("."))
    if leaf == "bias":
        return Target((*path, "bias"), layer, identity)
    if leaf != "weight":
        raise WeightError(f"unexpected transformer tensor {name}")
    if path[-1] in _NORMS:
        return Target((*path, "scale"), layer, identity)
    if path[-1] == "patch_embedding":
        return Target((*path, "kernel"), layer, conv3d)
    return Target((*path, "kernel"), layer, linear)
