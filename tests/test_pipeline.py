"""Whole pipeline vs diffusers' WanPipeline: tokenize, encode, 4 denoise steps with CFG, decode.

A tiny WanPipeline with random weights is saved offline; our side reads that folder (configs
and safetensors through the project's importer), compiles the four programs for 8 CPU devices
and runs the runtime's generation loop. Same prompts, same initial latents. Tolerance: frames
in [0, 1] within 1e-3 (fp32).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import save_tiny_diffusers_pipeline
from diffusers import WanPipeline

from aot.building.lower import compile_in_process
from aot.building.plan import plan_build
from aot.targets import parse_target
from runtime.generation.pipeline import Pipeline
from wan.configs import ModelConfig, VideoShape

WIDTH, HEIGHT, FRAMES, STEPS = 32, 48, 9, 4  # portrait; 3 latent frames
PROMPTS = ["a red cat running in the rain", "a boat on the sea at night"]
NEGATIVE = ["blurry low quality", ""]
ATOL = 1e-3  # frames in [0, 1], float32


@pytest.mark.parametrize("two_experts", [False, True], ids=["wan2.1", "two-experts"])
def test_pipeline_matches_diffusers(tmp_path, two_experts):
    folder = tmp_path / "pipe"
    save_tiny_diffusers_pipeline(folder, two_experts)
    noise = np.random.default_rng(0).standard_normal(
        (len(PROMPTS), 16, (FRAMES - 1) // 4 + 1, HEIGHT // 8, WIDTH // 8), dtype=np.float32
    )
    guidance_2 = 3.0 if two_experts else None

    reference = WanPipeline.from_pretrained(folder, torch_dtype=torch.float32)

    def diffusers_frames(prompts: list[str]) -> np.ndarray:
        return reference(prompt=prompts, negative_prompt=NEGATIVE, height=HEIGHT, width=WIDTH,
                         num_frames=FRAMES, num_inference_steps=STEPS, guidance_scale=5.0,
                         guidance_scale_2=guidance_2, latents=torch.from_numpy(noise),
                         output_type="np").frames  # fmt: skip

    expected = diffusers_frames(PROMPTS)
    # Controls, the same noise: the prompts swapped between the rows; and (two experts) the
    # first expert for every step. Each moves the frames well past the tolerance.
    controls = [diffusers_frames(PROMPTS[::-1])]
    if two_experts:
        reference.transformer_2 = reference.transformer
        controls.append(diffusers_frames(PROMPTS))

    config = ModelConfig.from_diffusers(folder, dtype="float32")
    assert config.num_experts == (2 if two_experts else 1)
    shape = VideoShape(width=WIDTH, height=HEIGHT, frames=FRAMES, batch=len(PROMPTS))
    plan = plan_build("tiny-diffusers", config, shape, parse_target("cpu-8"), 8)
    executables = compile_in_process(plan, frames_dtype="float32")
    pipe = Pipeline.assemble(executables, folder, plan.key, "in-process", config)
    frames, report = pipe.generate(
        PROMPTS, NEGATIVE, steps=STEPS, guidance=5.0, guidance_2=guidance_2, init_noise=noise
    )

    assert frames.shape == expected.shape == (2, FRAMES, HEIGHT, WIDTH, 3)
    assert report.compile_count == 0
    np.testing.assert_allclose(frames, expected, atol=ATOL, rtol=0)
    assert np.ptp(frames) > 0.05  # the comparison is between real videos, not flat frames
    for control in controls:
        assert all(np.abs(frames[i] - control[i]).max() > 10 * ATOL for i in range(len(PROMPTS)))
