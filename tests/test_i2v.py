"""Image to video vs diffusers' WanImageToVideoPipeline: tokenize, encode the prompts, the image
(its VAE condition, and for Wan 2.1 its CLIP features), 4 UniPC steps with CFG, decode.

Tiny random pipelines of both kinds are saved offline: Wan 2.1's (a CLIP vision model, image
features in every cross-attention) and Wan 2.2 I2V-A14B's (two experts, the image through its
latents only). Our side reads the folder, compiles the pipeline for 8 CPU devices and runs the
runtime's generation loop on the same prompts, image and initial latents: each kind in one
orientation, and in the other through its first-last-frame test below (A14B landscape, Wan 2.1
FLF2V portrait), so that both kinds are compared in portrait and in landscape. Tolerance:
frames in [0, 1] within 1e-3 (fp32). The batch's second video has another image and prompt,
compared with diffusers' run of that image alone: a control as well (its frames differ from the
first image's by far more than the tolerance).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from conftest import (
    TI2V_Z,
    TINY_SHAPE,
    run_cli,
    save_tiny_i2v_pipeline,
    save_tiny_ti2v_pipeline,
)
from diffusers import WanImageToVideoPipeline
from PIL import Image, ImageOps
from test_prompts_file import MP4_OF_ONE_LEVEL
from test_server import decode

from aot.building.lower import compile_in_process
from aot.building.plan import BuildError, plan_build
from aot.targets import parse_target
from runtime.builds.artifact import read_manifest
from runtime.generation.images import read_image
from runtime.generation.outputs import write_videos
from runtime.generation.pipeline import Pipeline
from runtime.generation.request import RequestError
from wan.configs import ModelConfig, VideoShape

FRAMES, STEPS = 9, 4  # 3 latent frames
PROMPTS = ["a red cat running in the rain", "a boat on the sea at night"]
NEGATIVE = ["blurry low quality", ""]
ATOL = 1e-3  # frames in [0, 1], float32


def picture(seed: int, width: int, height: int) -> Image.Image:
    """A smooth random RGB picture (a VAE sees structure, not only noise)."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
    return Image.fromarray(coarse).resize((width, height), Image.Resampling.BILINEAR)


@pytest.fixture(autouse=True)
def prompt_clean_without_ftfy(monkeypatch):
    """diffusers 0.42's image-to-video module calls ftfy whether or not it is installed (its
    text-to-video module checks): the text-to-video module's cleaning, the same without it."""
    from diffusers.pipelines.wan import pipeline_wan, pipeline_wan_i2v

    monkeypatch.setattr(pipeline_wan_i2v, "prompt_clean", pipeline_wan.prompt_clean)


@pytest.fixture(scope="module", params=[True, False], ids=["wan2.1-clip", "a14b"])
def folder(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("i2v") / "pipe"
    save_tiny_i2v_pipeline(path, clip=request.param)
    return path


@pytest.mark.parametrize(
    "folder,width,height",
    [(True, 48, 32), (False, 32, 48)],
    ids=["wan2.1-clip-landscape", "a14b-portrait"],
    indirect=["folder"],
)  # the other orientation of each: test_first_last_frame_matches_diffusers and Wan 2.1's
def test_i2v_matches_diffusers(folder, width, height):
    config = ModelConfig.from_diffusers(folder, dtype="float32")
    clip = config.image_encoder is not None
    assert config.pipelines == (("i2v-clip",) if clip else ("i2v",))
    # Another size of the same aspect ratio: both resize them (one of another aspect ratio
    # diffusers stretches; this project crops it first, runtime.generation.images.condition_pixels).
    images = [picture(seed, width * 3 // 2, height * 3 // 2) for seed in (0, 1)]
    noise = np.random.default_rng(0).standard_normal(
        (2, 16, (FRAMES - 1) // 4 + 1, height // 8, width // 8), dtype=np.float32
    )
    guidance_2 = None if clip else 3.0

    reference = WanImageToVideoPipeline.from_pretrained(folder, torch_dtype=torch.float32)

    def diffusers_frames(videos: slice, image: Image.Image) -> np.ndarray:
        return reference(
            image=image, prompt=PROMPTS[videos], negative_prompt=NEGATIVE[videos], height=height,
            width=width, num_frames=FRAMES, num_inference_steps=STEPS, guidance_scale=5.0,
            guidance_scale_2=guidance_2, latents=torch.from_numpy(noise[videos]),
            output_type="np",
        ).frames  # fmt: skip

    # The control, the second video with the first's image, in the first video's batch (a
    # diffusers batch takes one image).
    first, control = diffusers_frames(slice(0, 2), images[0])
    expected = np.stack([first, diffusers_frames(slice(1, 2), images[1])[0]])

    shape = VideoShape(width=width, height=height, frames=FRAMES, batch=2)
    plan = plan_build("tiny-i2v", config, shape, parse_target("cpu-8"), 8)
    assert plan.key.programs[:4] == (
        ("text_encode", "image_encode", "vae_encode", "image_kv_cache")
        if clip
        else ("text_encode", "vae_encode", "image_kv_cache", "denoise_step")
    )
    executables = compile_in_process(plan, frames_dtype="float32")
    pipe = Pipeline.assemble(executables, folder, plan.key, "in-process", config)
    frames, report = pipe.generate(
        PROMPTS, NEGATIVE, steps=STEPS, guidance=5.0, guidance_2=guidance_2, init_noise=noise,
        images=images,
    )  # fmt: skip

    assert frames.shape == expected.shape == (2, FRAMES, height, width, 3)
    assert report.compile_count == 0
    np.testing.assert_allclose(frames, expected, atol=ATOL, rtol=0)
    assert np.ptp(frames) > 0.05  # real videos, not flat frames
    assert np.abs(frames[1] - control).max() > 10 * ATOL  # the image matters

    with pytest.raises(RequestError, match="give an image"):
        pipe.generate(PROMPTS, NEGATIVE, steps=STEPS, init_noise=noise)
    with pytest.raises(RequestError, match="one image each"):
        pipe.generate(PROMPTS, NEGATIVE, steps=STEPS, init_noise=noise, images=images * 2)


def test_pipeline_variant_is_the_models(folder):
    """An image-to-video model builds its own variant by default and refuses text to video."""
    config = ModelConfig.from_diffusers(folder, dtype="float32")
    shape = VideoShape(width=32, height=48, frames=FRAMES, batch=1)
    target = parse_target("cpu-8")
    (variant,) = config.pipelines
    assert plan_build("m", config, shape, target, 8).key.option("pipeline") == variant
    with pytest.raises(BuildError, match=f"runs {variant}: use --pipeline {variant}"):
        plan_build("m", config, shape, target, 8, pipeline="t2v")
    with pytest.raises(BuildError, match="--continuous builds text to video only"):
        plan_build("m", config, shape, target, 8, continuous=True)


@pytest.fixture(scope="module")
def clip_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("i2v_clip") / "pipe"
    save_tiny_i2v_pipeline(path, clip=True)
    return path


def test_runtime_run_with_an_image(clip_folder, tmp_path):
    """`runtime run --image` as a user runs it (Wan 2.1's kind: the image through CLIP and the
    VAE): its frames equal Pipeline.generate's on the same build for the same image (the file
    read and prepared by runtime.generation.images), not another image's, and a bad image, a
    missing one or one given to a text-to-video build is one line and exit 2. (The other image
    through the CLI: the --prompts file's second line below.)"""
    folder = clip_folder
    width, height = 48, 32
    shape = ["--res", f"{width}x{height}", "--frames", str(FRAMES), "--batch", "1"]
    artifacts = tmp_path / "artifacts"
    run_cli("aot", "build", "--model", str(folder), *shape, "--target", "cpu-8",
            "--out", str(artifacts))  # fmt: skip
    noise = np.random.default_rng(2).standard_normal(
        (1, 16, (FRAMES - 1) // 4 + 1, height // 8, width // 8), dtype=np.float32
    )
    np.save(tmp_path / "noise.npy", noise)
    pictures = []
    # A picture and its negative: as different as two images are.
    for i, image in enumerate([picture(0, 96, 64), ImageOps.invert(picture(0, 96, 64))]):
        pictures.append(tmp_path / f"image{i}.jpg")
        image.save(pictures[-1], quality=95)

    def run(*extra: str, check: bool = True):
        return run_cli(
            "runtime", "run", "--artifacts", str(artifacts), "--weights", str(folder), *shape,
            "--prompt", PROMPTS[0], "--steps", str(STEPS), "--init-noise",
            str(tmp_path / "noise.npy"), "--out", str(tmp_path / "v.mp4"), *extra, check=check,
        )  # fmt: skip

    run("--image", str(pictures[0]), "--save-frames", str(tmp_path / "frames.npy"))
    video = np.load(tmp_path / "frames.npy").astype(int)

    (build,) = [p for p in artifacts.iterdir() if not p.name.startswith(".")]
    pipe = Pipeline.from_build(build, read_manifest(build), folder, ModelConfig.from_folder(folder))
    expected, other = (
        pipe.generate(PROMPTS[0], steps=STEPS, init_noise=noise, images=read_image(p))[0]
        for p in pictures
    )
    assert np.abs(video - expected.astype(int)).max() <= 1
    # Another image moves the frames by tens of levels: far past the at most 1 level that
    # separates the CLI from Pipeline.generate.
    assert np.abs(video - other.astype(int)).max() > 10

    # A --prompts file whose lines differ only by their image: each line's MP4 is its own
    # image's video (Pipeline.generate's, through the same writer), not the other line's.
    lines = [{"prompt": PROMPTS[0], "seed": 3, "image": p.name, "out": f"line{i}.mp4"}
             for i, p in enumerate(pictures)]  # fmt: skip
    (tmp_path / "p.jsonl").write_text("\n".join(map(json.dumps, lines)))
    run_cli("runtime", "run", "--artifacts", str(artifacts), "--weights", str(folder), *shape,
            "--steps", str(STEPS), "--prompts", str(tmp_path / "p.jsonl"))  # fmt: skip
    expected = []
    for i, image in enumerate(pictures):
        frames, _ = pipe.generate(PROMPTS[0], steps=STEPS, seed=3, images=read_image(image))
        write_videos(frames, [tmp_path / f"expected{i}.mp4"], fps=pipe.config.fps)
        expected.append(decode(tmp_path / f"expected{i}.mp4").astype(int))
    for i in range(2):
        off = [np.abs(decode(tmp_path / f"line{i}.mp4").astype(int) - e).mean() for e in expected]
        # Measured: 0.0 to its own request's MP4 (the same frames, the same writer), 4.5 to 5.6
        # to the other image's (the tiny A14B; more through the CLIP model).
        assert off[i] <= MP4_OF_ONE_LEVEL / 2 < 3.0 < off[1 - i], (i, off)

    not_an_image = tmp_path / "notes.png"
    not_an_image.write_text("not a picture")
    for extra, phrase in [
        (["--image", str(not_an_image)], "is not a PNG, JPEG or WebP image"),
        ([], "is image to video: give an image"),
    ]:
        result = run(*extra, check=False)
        assert result.returncode == 2 and phrase in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_a_text_to_video_build_refuses_an_image(tiny_build, tiny_weights, tmp_path):
    """An image given to a text-to-video build is one line naming what to build, before
    anything loads."""
    image = tmp_path / "image.png"
    picture(0, 64, 64).save(image)
    result = run_cli(
        "runtime", "run", "--artifacts", str(tiny_build), "--weights", str(tiny_weights),
        *TINY_SHAPE, "--prompt", "a cat", "--image", str(image), "--out", str(tmp_path / "v.mp4"),
        check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert "is text to video and takes no image" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "v.mp4").exists()


@pytest.mark.parametrize("width,height", [(64, 96), (96, 64)], ids=["portrait", "landscape"])
def test_ti2v_image_mode_matches_diffusers(tmp_path, width, height):
    """TI2V-5B's image mode (diffusers' expand_timesteps): the image's one latent frame is the
    first frame, its tokens at timestep 0; the same model folder builds text to video by
    default and image to video on request."""
    from diffusers import WanPipeline

    folder = tmp_path / "ti2v"
    save_tiny_ti2v_pipeline(folder)
    config = ModelConfig.from_diffusers(folder, dtype="float32")
    assert config.pipelines == ("t2v", "i2v")
    components = WanPipeline.from_pretrained(folder, torch_dtype=torch.float32).components
    reference = WanImageToVideoPipeline(
        **{k: v for k, v in components.items() if k != "transformer_2"}, expand_timesteps=True
    )
    images = [picture(seed, width * 3 // 2, height * 3 // 2) for seed in (0, 1)]
    noise = np.random.default_rng(0).standard_normal(
        (2, TI2V_Z, (FRAMES - 1) // 4 + 1, height // 16, width // 16), dtype=np.float32
    )

    def diffusers_frames(videos: slice, image: Image.Image) -> np.ndarray:
        return reference(
            image=image, prompt=PROMPTS[videos], negative_prompt=NEGATIVE[videos], height=height,
            width=width, num_frames=FRAMES, num_inference_steps=STEPS, guidance_scale=5.0,
            latents=torch.from_numpy(noise[videos]), output_type="np",
        ).frames  # fmt: skip

    first, control = diffusers_frames(slice(0, 2), images[0])  # as in test_i2v_matches_diffusers
    expected = np.stack([first, diffusers_frames(slice(1, 2), images[1])[0]])

    shape = VideoShape(width=width, height=height, frames=FRAMES, batch=2)
    target = parse_target("cpu-8")
    assert plan_build("ti2v", config, shape, target, 8).key.option("pipeline") == "t2v"
    plan = plan_build("ti2v", config, shape, target, 8, pipeline="i2v")
    pipe = Pipeline.assemble(
        compile_in_process(plan, frames_dtype="float32"), folder, plan.key, "in-process", config
    )
    frames, report = pipe.generate(
        PROMPTS, NEGATIVE, steps=STEPS, guidance=5.0, init_noise=noise, images=images
    )
    assert report.compile_count == 0
    np.testing.assert_allclose(frames, expected, atol=ATOL, rtol=0)
    assert np.ptp(frames) > 0.05
    assert np.abs(frames[1] - control).max() > 10 * ATOL


def test_first_last_frame_matches_diffusers(tmp_path):
    """Wan 2.2 I2V-A14B with a last image (diffusers' `last_image`): the last frame is given and
    marked too. One batch holds a video with a last image and one without, each equal to
    diffusers' run of it; the last image moves the frames well past the tolerance."""
    folder = tmp_path / "a14b"
    save_tiny_i2v_pipeline(folder, clip=False)
    config = ModelConfig.from_diffusers(folder, dtype="float32")
    assert config.takes_last_image
    width, height = 48, 32
    first = picture(0, width * 2, height * 2)
    last = picture(3, width * 2, height * 2)
    noise = np.random.default_rng(4).standard_normal(
        (1, 16, (FRAMES - 1) // 4 + 1, height // 8, width // 8), dtype=np.float32
    )
    reference = WanImageToVideoPipeline.from_pretrained(folder, torch_dtype=torch.float32)

    def diffusers_frames(last_image: Image.Image | None) -> np.ndarray:
        return reference(
            image=first, last_image=last_image, prompt=PROMPTS[0], height=height, width=width,
            num_frames=FRAMES, num_inference_steps=STEPS, guidance_scale=5.0,
            guidance_scale_2=3.0, latents=torch.from_numpy(noise), output_type="np",
        ).frames[0]  # fmt: skip

    expected = np.stack([diffusers_frames(last), diffusers_frames(None)])
    plan = plan_build(
        "a14b", config, VideoShape(width, height, FRAMES, 2), parse_target("cpu-8"), 8
    )
    pipe = Pipeline.assemble(
        compile_in_process(plan, frames_dtype="float32"), folder, plan.key, "in-process", config
    )
    frames, report = pipe.generate(
        PROMPTS[0], steps=STEPS, guidance=5.0, guidance_2=3.0, init_noise=np.repeat(noise, 2, 0),
        images=first, last_images=[last, None],
    )  # fmt: skip
    assert report.compile_count == 0
    np.testing.assert_allclose(frames, expected, atol=ATOL, rtol=0)
    # The last image reaches the step: the condition's last latent frame (its mask channel
    # for the last frame, and its latents) differs between the two videos. Through this tiny
    # random model it moves the frames by less than a level, so the parity above, with and
    # without it, is what shows it used as diffusers uses it.
    condition = np.asarray(pipe.image_conditioning([first, first], [last, None])["condition"])
    assert condition[:, -1, ..., 3].mean(axis=(1, 2)).tolist() == [1.0, 0.0]
    # (by 0.06 at most through the tiny random encoder: the frame is the last of its chunk)
    assert np.abs(condition[0, -1, ..., 4:] - condition[1, -1, ..., 4:]).max() > 0.02
    np.testing.assert_allclose(condition[0, :-1], condition[1, :-1], atol=1e-5, rtol=0)


def test_wan21_first_last_frame_matches_diffusers(tmp_path):
    """Wan 2.1 FLF2V: both images' CLIP features, behind the image embedder's position table,
    and the last frame given and marked in the condition. A batch of two videos with two last
    images, each equal to diffusers' run of it; the second last image moves the frames well
    past the tolerance (a control), and a video without a last image is refused."""
    folder = tmp_path / "flf2v"
    save_tiny_i2v_pipeline(folder, clip=True, first_last=True)
    config = ModelConfig.from_diffusers(folder, dtype="float32")
    assert config.needs_last_image and config.takes_last_image
    assert config.image_tokens == 2 * config.image_encoder.tokens
    width, height = 32, 48
    first = picture(0, width * 2, height * 2)
    lasts = [picture(seed, width * 2, height * 2) for seed in (3, 5)]
    noise = np.random.default_rng(4).standard_normal(
        (1, 16, (FRAMES - 1) // 4 + 1, height // 8, width // 8), dtype=np.float32
    )
    reference = WanImageToVideoPipeline.from_pretrained(folder, torch_dtype=torch.float32)

    def diffusers_frames(last_image: Image.Image) -> np.ndarray:
        return reference(
            image=first, last_image=last_image, prompt=PROMPTS[0], height=height, width=width,
            num_frames=FRAMES, num_inference_steps=STEPS, guidance_scale=5.0,
            latents=torch.from_numpy(noise), output_type="np",
        ).frames[0]  # fmt: skip

    expected = np.stack([diffusers_frames(last) for last in lasts])
    plan = plan_build(
        "flf2v", config, VideoShape(width, height, FRAMES, 2), parse_target("cpu-8"), 8
    )
    pipe = Pipeline.assemble(
        compile_in_process(plan, frames_dtype="float32"), folder, plan.key, "in-process", config
    )
    frames, report = pipe.generate(
        PROMPTS[0], steps=STEPS, guidance=5.0, init_noise=np.repeat(noise, 2, 0), images=first,
        last_images=lasts,
    )  # fmt: skip
    assert report.compile_count == 0
    np.testing.assert_allclose(frames, expected, atol=ATOL, rtol=0)
    assert np.abs(frames[0] - frames[1]).max() > 10 * ATOL  # the last image matters

    with pytest.raises(RequestError, match="give every video a last image"):
        pipe.generate(PROMPTS[0], steps=STEPS, images=first, last_images=[lasts[0], None])
    with pytest.raises(RequestError, match="give every video a last image"):
        pipe.generate(PROMPTS[0], steps=STEPS, images=first)


def test_first_last_frame_model_refuses_one_image(tmp_path):
    """A Wan 2.1 FLF2V model needs every video's last image: `runtime run` without one, and
    `runtime serve` (whose Videos API has one image part), are one line before anything
    loads."""
    folder = tmp_path / "flf2v"
    save_tiny_i2v_pipeline(folder, clip=True, first_last=True)
    image = tmp_path / "first.png"
    picture(0, 64, 96).save(image)
    run = run_cli(
        "runtime", "run", "--artifacts", str(tmp_path / "none"), "--weights", str(folder),
        "--res", "48x32", "--frames", str(FRAMES), "--prompt", "a cat", "--image", str(image),
        "--out", str(tmp_path / "v.mp4"), check=False,
    )  # fmt: skip
    serve = run_cli(
        "runtime", "serve", "--artifacts", str(tmp_path / "none"), "--weights", str(folder),
        "--out-dir", str(tmp_path / "served"), check=False,
    )  # fmt: skip
    for result, says in ((run, "give each video a last image"), (serve, "has no part for")):
        assert result.returncode == 2, result.stderr
        assert "first-last-frame (Wan 2.1 FLF2V)" in result.stderr and says in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "v.mp4").exists()


def test_a_position_table_of_another_length_is_refused():
    """FLF2V's table covers exactly two images' features: another length is another model."""
    from wan.presets import PRESETS
    from wan.weights import WeightError

    flf2v = PRESETS["wan2.1-flf2v-14b-720p"]
    assert flf2v.validate().image_tokens == 514 and flf2v.needs_last_image
    odd = dataclasses.replace(
        flf2v, transformer=dataclasses.replace(flf2v.transformer, pos_embed_seq_len=257)
    )
    with pytest.raises(WeightError, match="pos_embed_seq_len is 257, expected two images'"):
        odd.validate()
    assert not PRESETS["wan2.1-i2v-14b-720p"].takes_last_image
