"""diffusers `WanTransformer3DModel` state dict -> `wan.models.transformer.WanTransformer` params.

The module tree mirrors diffusers', so the mapping is mechanical: `blocks.N.` becomes layer N
of the stacked `blocks`, three submodules are renamed, and the leaf name and layout follow
from the kind of layer (Linear, Conv3d, norm, or a raw table). `rule` also names the modules as
the original Wan release does, for LoRA files (`wan.lora` asks the kind registry for it).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping

from wan.weights import Target, WeightError, conv3d, identity, linear

# diffusers submodule path -> ours (diffusers wraps these Linears in containers).
_RENAMES = {
    "attn1.to_out.0": "attn1.to_out",
    "attn2.to_out.0": "attn2.to_out",
    "ffn.net.0.proj": "ffn.linear_1",
    "ffn.net.2": "ffn.linear_2",
    "condition_embedder.image_embedder.ff.net.0.proj": "condition_embedder.image_embedder.ff.linear_1",
    "condition_embedder.image_embedder.ff.net.2": "condition_embedder.image_embedder.ff.linear_2",
}
# weight -> scale, no layout change (norm1: the image embedder's; the blocks' has no weight)
_NORMS = {"norm_q", "norm_k", "norm_added_k", "norm1", "norm2"}
_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")
_IGNORED = ("norm_added_q",)  # diffusers ignores these unexpected keys on load too
_TABLES = ("scale_shift_table",)  # raw parameters: the tensor is named after the module
_POSITIONS = "condition_embedder.image_embedder.pos_embed"  # Wan 2.1 FLF2V's, a raw parameter

# The original Wan module names (its own checkpoints, ComfyUI and kohya/musubi LoRAs) ->
# diffusers'. Inside a block; the original norm3 is the cross-attention norm, diffusers' norm2.
ORIGINAL_BLOCK_MODULES = {
    **{f"self_attn.{o}": f"attn1.{d}" for o, d in (("q", "to_q"), ("k", "to_k"), ("v", "to_v"))},
    **{f"cross_attn.{o}": f"attn2.{d}" for o, d in (("q", "to_q"), ("k", "to_k"), ("v", "to_v"))},
    "self_attn.o": "attn1.to_out.0",
    "cross_attn.o": "attn2.to_out.0",
    "self_attn.norm_q": "attn1.norm_q",
    "self_attn.norm_k": "attn1.norm_k",
    "cross_attn.norm_q": "attn2.norm_q",
    "cross_attn.norm_k": "attn2.norm_k",
    "cross_attn.k_img": "attn2.add_k_proj",
    "cross_attn.v_img": "attn2.add_v_proj",
    "cross_attn.norm_k_img": "attn2.norm_added_k",
    "ffn.0": "ffn.net.0.proj",
    "ffn.2": "ffn.net.2",
    "norm3": "norm2",
    "modulation": "scale_shift_table",
}
ORIGINAL_MODULES = {
    "patch_embedding": "patch_embedding",
    "text_embedding.0": "condition_embedder.text_embedder.linear_1",
    "text_embedding.2": "condition_embedder.text_embedder.linear_2",
    "time_embedding.0": "condition_embedder.time_embedder.linear_1",
    "time_embedding.2": "condition_embedder.time_embedder.linear_2",
    "time_projection.1": "condition_embedder.time_proj",
    "head.head": "proj_out",
    "head.modulation": "scale_shift_table",
    "img_emb.proj.0": "condition_embedder.image_embedder.norm1",
    "img_emb.proj.1": "condition_embedder.image_embedder.ff.net.0.proj",
    "img_emb.proj.3": "condition_embedder.image_embedder.ff.net.2",
    "img_emb.proj.4": "condition_embedder.image_embedder.norm2",
}


def _target(name: str) -> Target | None:
    """Target of one diffusers tensor. Tensors of modules this model lacks (image-to-video
    weights) map to paths the importer rejects; a leaf that is neither weight nor bias raises."""
    if any(part in _IGNORED for part in name.split(".")):
        return None
    layer, prefix, local = None, (), name
    if match := _BLOCK.fullmatch(name):
        layer, prefix, local = int(match[1]), ("blocks",), match[2]
    if local in _TABLES:
        return Target((*prefix, local), layer, identity)
    if name == _POSITIONS:
        return Target(tuple(name.split(".")), None, identity)
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


@dataclasses.dataclass(frozen=True, eq=False)
class TransformerRule:
    """A transformer kind's weight rule: called with a diffusers tensor name, its `Target`. It
    also maps the module names of the model's original release (its own checkpoints, ComfyUI
    and kohya LoRAs) to diffusers', and names a module's tensors, for `wan.lora`."""

    target: Callable[[str], Target | None]
    original_block_modules: Mapping[str, str]  # inside a block: original name -> diffusers'
    original_modules: Mapping[str, str]  # outside the blocks
    tables: tuple[str, ...]  # raw parameters: their tensor is named after the module

    def __call__(self, name: str) -> Target | None:
        return self.target(name)

    def from_original(self, module: str) -> str | None:
        """The diffusers name of an original module (`blocks.3.self_attn.q` ->
        `blocks.3.attn1.to_q`); None for a name the original model does not have."""
        if match := _BLOCK.fullmatch(module):
            local = self.original_block_modules.get(match[2])
            return None if local is None else f"blocks.{match[1]}.{local}"
        return self.original_modules.get(module)

    def tensor_name(self, module: str, leaf: str) -> str:
        """The diffusers tensor of a module's `leaf` ('weight' or 'bias')."""
        return module if module.rpartition(".")[2] in self.tables else f"{module}.{leaf}"


rule = TransformerRule(_target, ORIGINAL_BLOCK_MODULES, ORIGINAL_MODULES, _TABLES)
