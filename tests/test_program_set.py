"""The program set is open: a program added in the tests only (its signature, its place in a
pipeline variant, its maker: one entry in each registry) is built, stored, listed in the
manifest, loaded and run, with nothing else changed."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_SHAPE

from aot.build import build
from aot.plan import plan_build
from aot.targets import parse_target
from runtime.artifact import read_manifest
from runtime.loader import Request
from runtime.pipeline import Pipeline, place
from wan import interface, programs, sharding
from wan.configs import ModelConfig, VideoShape

STATS = "latents_stats"  # the toy program: each video's mean latent, on the transformer mesh
TOY_PIPELINE = "t2v_stats"


def latents_stats_program(config, shape, options) -> programs.Program:
    latents = jax.ShapeDtypeStruct(shape.latent_shape(config), jnp.float32)

    def latents_stats(latents):
        return {"mean": latents.mean(axis=(1, 2, 3, 4))}

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


def test_a_toy_program_is_built_loaded_and_run(toy_registries, tiny_weights, tmp_path):
    width, height = (int(v) for v in TINY_SHAPE[1].split("x"))
    shape = VideoShape(width, height, int(TINY_SHAPE[3]), int(TINY_SHAPE[5]))
    config = ModelConfig.from_folder(tiny_weights)
    plan = plan_build("tiny", config, shape, parse_target("cpu-8"), 8, pipeline=TOY_PIPELINE)
    result = build(plan, tmp_path)
    assert result.folder.name.endswith(f"_{TOY_PIPELINE}")
    assert set(read_manifest(result.folder).programs) == set(interface.PIPELINES[TOY_PIPELINE])

    pipe = Pipeline.load(tmp_path, tiny_weights, Request(shape))
    frames, report = pipe.generate("a cat", steps=2)
    assert report.compile_count == 0 and frames.shape[0] == shape.batch
    latents = np.random.default_rng(0).standard_normal(plan.shape.latent_shape(config), np.float32)
    step_in = interface.named("denoise_step", pipe.exe["denoise_step"].input_shardings[0])
    (mean,) = pipe.exe[STATS](place(latents, step_in["latents"])).values()
    np.testing.assert_allclose(np.asarray(mean), latents.mean(axis=(1, 2, 3, 4)), rtol=1e-5)
