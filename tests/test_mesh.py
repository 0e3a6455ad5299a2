"""The default transformer mesh (wan.sharding.default_mesh), checked against its docstring's rule
with hand-computed tables, and against the meshes of the real-preset builds recorded in
bench/results (planned only: nothing is lowered or compiled).

The rule: fsdp is the smallest divisor f of the device count with weights / f <= 40% of a
device's HBM (the device count when none is; 1 without a known HBM); data is the largest
divisor d of devices / fsdp such that the step batch divides over d * fsdp (else 1); context
takes the devices left.
"""

from __future__ import annotations

import pytest

from aot.building import plan as planner
from aot.targets import TPU_HBM, parse_target
from wan import sharding
from wan.configs import VideoShape
from wan.presets import PRESETS

HBM = 100  # a device's HBM in the tables below: weights up to 40 fit without sharding


@pytest.mark.parametrize(
    "num_devices, weight_bytes, hbm_bytes, fsdp",
    [
        (8, 30, HBM, 1),  # fits whole
        (8, 40, HBM, 1),  # exactly 40%: "<=" fits
        (8, 41, HBM, 2),  # just over: half of it (20.5) fits
        (8, 80, HBM, 2),  # 80 / 2 = 40: exactly fits at 2
        (8, 81, HBM, 4),  # 40.5 at 2, 20.25 at 4
        (8, 160, HBM, 4),  # 40 at 4
        (8, 161, HBM, 8),
        (8, 320, HBM, 8),  # 40 at 8
        (8, 321, HBM, 8),  # never fits: every device holds a slice anyway
        (8, 10**6, HBM, 8),
        (8, 10**6, None, 1),  # no known HBM (CPU, GPU): weights are not sharded
        (6, 100, HBM, 3),  # divisors of 6, not powers of two: 50 at 2 > 40, 33.3 at 3
        (6, 10**6, HBM, 6),
        (1, 10**6, HBM, 1),  # one device: nothing to shard over
    ],
)
def test_default_mesh_fsdp(num_devices, weight_bytes, hbm_bytes, fsdp):
    # step batch 1 puts no batch on data, so the rest of the devices go to context.
    expected = sharding.MeshShape(data=1, fsdp=fsdp, context=num_devices // fsdp)
    assert sharding.default_mesh(num_devices, 1, weight_bytes, hbm_bytes) == expected


@pytest.mark.parametrize(
    "weight_bytes, hbm_bytes, step_batch, data, fsdp, context",
    [
        # fsdp = 1 (weights fit, or no known HBM): data takes what the batch divides over.
        (30, HBM, 2, 2, 1, 4),
        (30, HBM, 4, 4, 1, 2),
        (30, HBM, 8, 8, 1, 1),
        (30, HBM, 16, 8, 1, 1),  # more batch than devices: all 8 on data
        (30, HBM, 6, 2, 1, 4),  # 6 divides over 2 of the divisors of 8, not 4 or 8
        (30, HBM, 3, 1, 1, 8),  # odd batch: all on context
        (10**6, None, 8, 8, 1, 1),
        (10**6, None, 6, 2, 1, 4),
        # fsdp = 2: the batch must divide over data x fsdp = 2d.
        (80, HBM, 2, 1, 2, 4),  # 2 % (2 * 2): data = 2 would need a batch of 4
        (80, HBM, 8, 4, 2, 1),
        (80, HBM, 16, 4, 2, 1),
        (80, HBM, 6, 1, 2, 4),  # 6 % 4 != 0
        (80, HBM, 3, 1, 2, 4),
        # fsdp = 4 (the 14B on a v6e-8): data is 2 only for a batch divisible by 8.
        (160, HBM, 2, 1, 4, 2),
        (160, HBM, 8, 2, 4, 1),
        (160, HBM, 16, 2, 4, 1),
        (160, HBM, 12, 1, 4, 2),  # 12 % 8 != 0
        # fsdp = 8: nothing left for data or context.
        (320, HBM, 2, 1, 8, 1),
        (320, HBM, 16, 1, 8, 1),
    ],
)
def test_default_mesh_data_context_split(weight_bytes, hbm_bytes, step_batch, data, fsdp, context):
    mesh = sharding.default_mesh(8, step_batch, weight_bytes, hbm_bytes)
    assert mesh == sharding.MeshShape(data=data, fsdp=fsdp, context=context)
    assert mesh.size == 8


# Parameters of the real transformers (diffusers' Wan2.1 checkpoints; the same count as
# `nnx.state(wan.programs.abstract_module(config, "transformer"), nnx.Param)`).
REAL_PARAMETERS = {"wan2.1-t2v-1.3b": 1_418_996_800, "wan2.1-t2v-14b": 14_288_491_584}


@pytest.mark.parametrize("model", list(REAL_PARAMETERS))
def test_transformer_bytes_is_the_models_weights(model):
    """The weight figure the mesh is chosen from is the model's own, from its abstract state:
    2 bytes per bf16 parameter and 4 per parameter kept in fp32 (the time embedder, the
    modulation tables and norm2, 0.2% of the 1.3B's parameters)."""
    config = PRESETS[model]
    assert config.dtype == "bfloat16"
    weights, bf16 = planner.transformer_bytes(config), 2 * REAL_PARAMETERS[model]
    assert bf16 < weights < 1.01 * bf16, (weights, bf16)


@pytest.mark.parametrize(
    "model, target, width, height, batch, mesh, vae_mesh, vae_axis",
    [
        # bench/results/build_14b_720x1280_b8_tpu-v6e-8.txt: 28 GB of weights, 32 GiB per chip:
        # 14 GB at fsdp 2 is over 40% (13.7 GB), fsdp 4 it is; batch 8 (16 with CFG) on data 2.
        ("wan2.1-t2v-14b", "tpu-v6e-8", 720, 1280, 8, (2, 4, 1, 1), (8, 1), "width"),
        # bench/results/attention_720p.json: batch 1 (2 with CFG) cannot use data with fsdp 4.
        ("wan2.1-t2v-14b", "tpu-v6e-8", 720, 1280, 1, (1, 4, 2, 1), (1, 8), "height"),
        # bench/results/memory_14b.json, memory_table.json: 192 GiB per tpu7x chip, no fsdp.
        ("wan2.1-t2v-14b", "tpu7x-8", 1280, 720, 8, (8, 1, 1, 1), (8, 1), "width"),
        ("wan2.1-t2v-1.3b", "tpu7x-8", 1280, 720, 8, (8, 1, 1, 1), (8, 1), "width"),
    ],
)
def test_real_preset_default_meshes(model, target, width, height, batch, mesh, vae_mesh, vae_axis):
    """The meshes `aot build` picked for the recorded real-size builds, from their plan."""
    target = parse_target(target)
    assert target.hbm_bytes == TPU_HBM[target.generation]
    plan = planner.plan_build(
        model, PRESETS[model], VideoShape(width, height, 81, batch), target, num_devices=8
    )
    assert plan.default_mesh
    assert dict(plan.key.mesh) == dict(zip(sharding.TRANSFORMER_AXES, mesh, strict=True))
    assert (tuple(plan.key.vae_mesh), plan.key.vae_axis) == (vae_mesh, vae_axis)
