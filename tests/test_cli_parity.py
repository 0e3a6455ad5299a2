"""`runtime run` against diffusers' WanPipeline, through the CLI as a user runs it, with controls:
the test shows that each input it compares (prompt, negative prompt, guidance) moves the frames
by far more than its tolerance, on diffusers' side and on ours, so a CLI that dropped one fails."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import run_cli, save_tiny_diffusers_pipeline

WIDTH, HEIGHT, FRAMES, STEPS = 48, 32, 9, 3  # landscape, latent 4x6
SHAPE = ["--res", f"{WIDTH}x{HEIGHT}", "--frames", str(FRAMES), "--batch", "1"]
TOLERANCE = 2 / 255  # uint8 frames vs diffusers' float frames
AS_RUN = {"prompt": "a red cat running in the rain", "negative_prompt": "blurry", "guidance": 4.0}
CONTROLS = {  # one input changed at a time
    "another prompt": {"prompt": "a boat on the sea at night"},
    "empty negative prompt": {"negative_prompt": ""},
    "guidance 1": {"guidance": 1.0},
}


@pytest.fixture(scope="module")
def tiny_pipeline(tmp_path_factory):
    """A tiny diffusers folder, its initial noise, and builds of it with and without CFG."""
    root = tmp_path_factory.mktemp("parity")
    folder = root / "Wan-tiny-Diffusers"
    save_tiny_diffusers_pipeline(folder)
    noise = np.random.default_rng(1).standard_normal(
        (1, 16, 3, HEIGHT // 8, WIDTH // 8), np.float32
    )
    np.save(root / "noise.npy", noise)
    for cfg in ([], ["--no-cfg"]):
        run_cli("aot", "build", "--model", str(folder), *SHAPE, *cfg, "--target", "cpu-8",
                "--out", str(root / "artifacts"))  # fmt: skip
    return root, folder, noise


def _diffusers(folder, noise, prompt, negative_prompt, guidance):
    import torch
    from diffusers import WanPipeline

    return WanPipeline.from_pretrained(folder)(
        prompt=prompt, negative_prompt=negative_prompt, height=HEIGHT, width=WIDTH,
        num_frames=FRAMES, num_inference_steps=STEPS, guidance_scale=guidance,
        latents=torch.from_numpy(noise), output_type="np",
    ).frames  # fmt: skip


def _ours(root, folder, tmp_path, prompt, negative_prompt, guidance):
    frames = tmp_path / "frames.npy"
    run_cli(
        "runtime", "run", "--artifacts", str(root / "artifacts"), "--weights", str(folder),
        *SHAPE, "--prompt", prompt, "--negative-prompt", negative_prompt, "--steps", str(STEPS),
        "--guidance", str(guidance), "--init-noise", str(root / "noise.npy"),
        "--save-frames", str(frames), "--out", str(tmp_path / "v.mp4"),
    )  # fmt: skip
    return np.load(frames).astype(np.float32) / 255


@pytest.fixture(scope="module")
def expected(tiny_pipeline):
    """diffusers' frames of AS_RUN, which every test here compares with (made once)."""
    _, folder, noise = tiny_pipeline
    return _diffusers(folder, noise, **AS_RUN)


def test_runtime_matches_diffusers(tiny_pipeline, expected, tmp_path):
    """Frames within 2/255 of diffusers' WanPipeline output (uint8 video vs float frames)."""
    root, folder, noise = tiny_pipeline
    ours = _ours(root, folder, tmp_path, **AS_RUN)
    assert ours.shape == expected.shape
    assert np.abs(ours - expected).max() <= TOLERANCE


@pytest.mark.parametrize("control", sorted(CONTROLS))
def test_each_input_moves_the_frames_past_the_tolerance(tiny_pipeline, expected, tmp_path, control):
    """The comparison above can fail: diffusers' own frames move by more than 3x the tolerance
    when this input changes, and so do ours, so our frames for the changed input fail it."""
    root, folder, noise = tiny_pipeline
    changed = {**AS_RUN, **CONTROLS[control]}
    assert np.abs(_diffusers(folder, noise, **changed) - expected).max() > 3 * TOLERANCE
    assert np.abs(_ours(root, folder, tmp_path, **changed) - expected).max() > 3 * TOLERANCE
