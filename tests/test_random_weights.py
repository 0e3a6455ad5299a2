"""The tiny image-to-video presets (wan.presets: tiny-i2v, tiny-i2v-a14b, tiny-ti2v) are the
architectures of the tests' diffusers-made folders (tests/conftest.py), and `python -m
wan.random_weights` writes their weights without torch, which `aot build` and `runtime run
--image` then use end to end. (tiny-ti2v's image pipeline is served in tests/test_playground.py.)"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from conftest import run_cli, save_tiny_i2v_pipeline
from PIL import Image
from test_server import decode

from wan.configs import ModelConfig
from wan.presets import PRESETS

# Runs the tool as `python -m` does and says whether torch was imported on the way.
WITHOUT_TORCH = """
import runpy, sys
sys.argv = ["random_weights", *sys.argv[1:]]
runpy.run_module("wan.random_weights", run_name="__main__")
assert "torch" not in sys.modules, "torch was imported"
"""


@pytest.mark.parametrize("preset, clip", [("tiny-i2v", True), ("tiny-i2v-a14b", False)])
def test_the_presets_are_the_tests_diffusers_models(preset, clip, tmp_path):
    save_tiny_i2v_pipeline(tmp_path / "pipe", clip=clip)
    assert ModelConfig.from_folder(tmp_path / "pipe").hash() == PRESETS[preset].hash()


def test_the_ti2v_preset_runs_both_pipelines():
    config = PRESETS["tiny-ti2v"]
    assert config.pipelines == ("t2v", "i2v") and config.image_condition == "first_frame"
    assert config.fps == 24


@pytest.mark.parametrize("preset", ["tiny-i2v", "tiny-i2v-a14b"])
def test_random_weights_build_and_run_image_to_video(preset, tmp_path):
    """The checkpoint written without torch reads as the preset, builds its own pipeline and
    makes a video from an image at the build's size."""
    weights = tmp_path / "weights"
    subprocess.run(
        [sys.executable, "-c", WITHOUT_TORCH, "--model", preset, "--out", str(weights)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    assert ModelConfig.from_folder(weights).hash() == PRESETS[preset].hash()
    shape = ["--res", "48x32", "--frames", "5", "--batch", "1"]
    run_cli("aot", "build", "--model", preset, *shape, "--target", "cpu-1",
            "--out", str(tmp_path / "artifacts"))  # fmt: skip
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (64, 96, 3), dtype=np.uint8)).save(tmp_path / "cat.png")
    run_cli("runtime", "run", "--artifacts", str(tmp_path / "artifacts"), "--weights",
            str(weights), "--image", str(tmp_path / "cat.png"), "--prompt", "a cat", *shape,
            "--steps", "2", "--out", str(tmp_path / "cat.mp4"))  # fmt: skip
    assert decode(tmp_path / "cat.mp4").shape == (5, 32, 48, 3)
