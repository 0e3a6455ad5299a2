"""`aot.building.plan.kernel_flops`, the attention kernels' FLOPs that every step lower bound adds to
the HLO count: checked against the attention FLOPs worked out by hand for small configs, 0 for
kernels XLA sees, and the same figure the HLO counter finds in a dot build's attention."""

from __future__ import annotations

import dataclasses
import gzip

import pytest

from aot import hlo
from aot.building.plan import kernel_flops, plan_build
from aot.hlo import cost as hlo_cost
from aot.targets import parse_target
from runtime.builds.artifact import read_manifest
from wan import sharding
from wan.component_configs import ImageEncoderConfig
from wan.configs import VideoShape
from wan.presets import PRESETS

TINY = PRESETS["tiny"]
TEXT_TOKENS = TINY.text_encoder.max_length


def by_hand(batch_rows: int, tokens: int, shards: int) -> float:
    """The tiny model's attention FLOPs per device per step: 4 B H Lq Lkv D (q k^T and p v,
    2 FLOPs a multiply-add) for self-attention (Lkv = the video tokens) and cross-attention
    (Lkv = the prompt tokens), in each layer, over the devices that split the queries."""
    tc = TINY.transformer
    heads, dim = tc.num_attention_heads, tc.attention_head_dim
    per_layer = 4 * batch_rows * heads * tokens * dim * (tokens + TEXT_TOKENS)
    return per_layer * tc.num_layers / shards


def tiny_plan(mesh: sharding.MeshShape, attention: str, batch: int = 1):
    shape = VideoShape(192, 320, 9, batch)
    return plan_build(
        "tiny", TINY, shape, parse_target("tpu-v6e-8"), 8, mesh=mesh, attention=attention
    )


@pytest.mark.parametrize(
    "mesh, shards",
    [
        # CFG's 2 rows on data, the 720 tokens on context: every device a different eighth.
        (sharding.MeshShape(data=2, context=4), 8),
        # 2 heads do not divide over tensor=4: the heads stay whole, 4 devices repeat the work.
        (sharding.MeshShape(data=2, tensor=4), 2),
        (sharding.MeshShape(context=8), 8),
    ],
)
@pytest.mark.parametrize("kernel", ["splash:512:512:512", "cudnn"])
def test_kernel_flops_by_hand(mesh, shards, kernel):
    plan = tiny_plan(mesh, "splash:512:512:512")
    plan = dataclasses.replace(plan, attention=kernel)  # cudnn plans need a GPU target
    shape = plan.shape
    assert shape.step_batch == 2 and shape.tokens(TINY) == 720  # 3 x 20 x 12 patches
    assert kernel_flops(plan) == by_hand(2, 720, shards)


def test_image_tokens_are_counted_where_the_steps_attend_to_them():
    """Wan 2.1 image to video: every layer's queries also attend to the image's CLIP tokens
    (5 here: 2x2 patches and the class token), through the same kernel."""
    clip = ImageEncoderConfig(hidden_size=24, intermediate_size=48, num_hidden_layers=3,
                              num_attention_heads=4, image_size=28, patch_size=14)  # fmt: skip
    transformer = dataclasses.replace(
        TINY.transformer, in_channels=36, image_dim=24, added_kv_proj_dim=32
    )
    i2v = dataclasses.replace(TINY, transformer=transformer, image_encoder=clip).validate()
    plan = plan_build("i2v", i2v, VideoShape(192, 320, 9, 1), parse_target("tpu-v6e-8"), 8,
                      mesh=sharding.MeshShape(data=2, context=4), attention="splash:512:512:512")  # fmt: skip
    tc = TINY.transformer
    image = 4 * 2 * tc.num_attention_heads * 720 * tc.attention_head_dim * clip.tokens
    assert kernel_flops(plan) == by_hand(2, 720, 8) + image * tc.num_layers / 8


@pytest.mark.parametrize("kernel", ["dot", "blockwise"])
def test_xla_visible_kernels_add_nothing(kernel):
    """dot and blockwise attention are ordinary HLO, which the HLO counter already counts."""
    plan = tiny_plan(sharding.MeshShape(data=2, context=4), "dot")
    assert kernel_flops(dataclasses.replace(plan, attention=kernel)) == 0.0
    assert kernel_flops(dataclasses.replace(plan, attention="cudnn")) > 0  # control


class _BatchedDots(hlo_cost._Counter):
    """The HLO counter restricted to dots with batch dimensions: attention's q k^T and p v
    (batched over videos and heads); the projections and the MLP are unbatched matmuls."""

    def dot(self, ins: hlo.Instruction) -> tuple[float, float]:
        return super().dot(ins) if ins.attrs.get("lhs_batch_dims") else (0.0, 0.0)

    RULES = {
        "dot": dot,
        "fusion": hlo_cost._Counter.fusion,
        "while": hlo_cost._Counter.loop,
        "call": hlo_cost._Counter.call,
        "conditional": hlo_cost._Counter.conditional,
    }


def test_dot_builds_attention_flops_in_the_hlo_match_the_formula(tiny_build):
    """The tiny build's denoise step runs dot attention: its batched dots in the optimized HLO,
    counted with the layer scan's trips, are the formula's FLOPs per device, so the HLO
    count and kernel_flops (which a splash build adds instead) measure the same work."""
    m = read_manifest(tiny_build)
    step = m.programs["denoise_step"]
    assert m.key.attention == "dot" and step.kernel_flops == 0.0
    with gzip.open(tiny_build / step.hlo.path, "rt") as f:
        module = hlo.parse(f.read())
    counter = _BatchedDots(module)
    attention, _ = counter.computation(module.entry)
    shards = m.mesh_axes["data"] * m.mesh_axes["context"]  # batch and queries' split
    assert (m.mesh_axes["data"], m.mesh_axes["context"]) == (2, 4)
    tokens = VideoShape(m.key.width, m.key.height, m.key.frames, 1).tokens(TINY)
    assert attention == by_hand(2, tokens, shards)
    assert 0 < attention < step.flops  # the rest: projections, MLP, norms
