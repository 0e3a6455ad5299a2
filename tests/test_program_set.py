"""The program set and the build options are open: a program added in the tests only (its
signature, its place in a pipeline variant, its maker: one entry in each registry) and a build
option it reads (one entry in runtime.builds.build_options.OPTIONS) are built, stored, listed in the
manifest and the folder name, loaded and run, with nothing else changed."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_SHAPE

from aot.building.build import build
from aot.building.plan import BuildError, plan_build
from aot.targets import parse_target
from runtime.builds import build_options
from runtime.builds.artifact import read_manifest
from runtime.builds.loader import Request
from runtime.generation.pipeline import Pipeline, place
from runtime.trust import json_checks
from wan import interface, programs, sharding
from wan.configs import ModelConfig, VideoShape

STATS = "latents_stats"  # the toy program: each video's mean latent, on the transformer mesh
TOY_PIPELINE = "t2v_stats"
# The toy option: a factor the toy program scales its means by.
STATS_SCALE = build_options.BuildOption(
    "stats_scale",
    "--stats-scale",
    "What the latents' means are scaled by.",
    token=lambda key: f"_x{key.option('stats_scale'):g}",
    argv=lambda key: ["--stats-scale", str(key.option("stats_scale"))],
    default="1",
    check=json_checks.number,
    parse=float,
)


def latents_stats_program(config, shape, options) -> programs.Program:
    latents = jax.ShapeDtypeStruct(shape.latent_shape(config), jnp.float32)

    scale = options.build["stats_scale"]

    def latents_stats(latents):
        return {"mean": latents.mean(axis=(1, 2, 3, 4)) * scale}

    return programs.Program(
        STATS,
        latents_stats,
        {"latents": latents},
        {"latents": sharding.LATENTS},
        {"mean": (None,)},
        "transformer",
        receives={"latents": "denoise_step.latents"},
    )


@pytest.fixture
def toy_registries(monkeypatch):
    monkeypatch.setitem(
        interface.SIGNATURES, STATS, interface.Signature(("latents",), ("mean",), None)
    )
    monkeypatch.setitem(interface.PIPELINES, TOY_PIPELINE, (*interface.PIPELINES["t2v"], STATS))
    monkeypatch.setitem(programs.MAKERS, STATS, latents_stats_program)
    monkeypatch.setitem(build_options.OPTIONS, STATS_SCALE.name, STATS_SCALE)


def test_a_toy_program_is_built_loaded_and_run(toy_registries, tiny_weights, tmp_path):
    width, height = (int(v) for v in TINY_SHAPE[1].split("x"))
    shape = VideoShape(width, height, int(TINY_SHAPE[3]), int(TINY_SHAPE[5]))
    config = ModelConfig.from_folder(tiny_weights)
    plan = plan_build(
        "tiny", config, shape, parse_target("cpu-8"), 8, pipeline=TOY_PIPELINE, stats_scale=2.5
    )
    result = build(plan, tmp_path)
    assert result.folder.name.endswith(f"_{TOY_PIPELINE}_x2.5")
    manifest = read_manifest(result.folder)
    assert set(manifest.programs) == set(interface.PIPELINES[TOY_PIPELINE])
    assert manifest.key.option("stats_scale") == 2.5 and manifest.key == plan.key
    assert plan.key.build_argv("tiny", tmp_path)[-4:-2] == ["--stats-scale", "2.5"]

    pipe = Pipeline.load(tmp_path, tiny_weights, Request(shape))
    frames, report = pipe.generate("a cat", steps=2)
    assert report.compile_count == 0 and frames.shape[0] == shape.batch
    latents = np.random.default_rng(0).standard_normal(plan.shape.latent_shape(config), np.float32)
    step_in = interface.named("denoise_step", pipe.exe["denoise_step"].input_shardings[0])
    (mean,) = pipe.exe[STATS](place(latents, step_in["latents"])).values()
    np.testing.assert_allclose(np.asarray(mean), 2.5 * latents.mean(axis=(1, 2, 3, 4)), rtol=1e-5)


def test_a_plain_option_value_is_checked(toy_registries, tiny_weights):
    shape = VideoShape(64, 128, 9, 1)
    config = ModelConfig.from_folder(tiny_weights)
    with pytest.raises(BuildError, match="--stats-scale"):
        plan_build("tiny", config, shape, parse_target("cpu-8"), 8, stats_scale="big")
    with pytest.raises(BuildError, match="not a build option"):
        plan_build("tiny", config, shape, parse_target("cpu-8"), 8, no_such_option=1)
