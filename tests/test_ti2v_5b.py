"""Wan 2.2 TI2V-5B: the Wan 2.2 VAE's decode against diffusers' AutoencoderKLWan(is_residual,
patch_size=2), the transformer's step against diffusers' expand_timesteps path, and `runtime run`
of a tiny TI2V-kind diffusers folder against its WanPipeline(expand_timesteps=True), portrait
and landscape; the preset's geometry, the size rules and the frame rate."""

from __future__ import annotations

import dataclasses
import json
import re

import imageio_ffmpeg
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import (
    TI2V_Z,
    _transformer,
    compile_program,
    run_cli,
    save_tiny_ti2v_pipeline,
    tiny_wan22_vae,
)
from flax import nnx
from test_server import serving
from test_sharding import CPU8, place, single_device, vae_mesh

from aot import hlo
from aot.building.plan import BuildError, check_shape
from runtime.builds.artifact import read_manifest
from wan import kinds, programs, sharding
from wan.component_configs import TransformerConfig, VAE22Config
from wan.configs import ModelConfig, VideoShape
from wan.models.transformer import WanTransformer
from wan.models.vae22 import WanVAE22
from wan.presets import PRESETS
from wan.random_weights import random_params
from wan.weights import flatten, import_folder, unflatten
from wan.weights import transformer as transformer_rules
from wan.weights import vae as vae_rules

TI2V = PRESETS["wan2.2-ti2v-5b"]
STEPS, FRAMES, GUIDANCE = 5, 9, 4.0
TOLERANCE = 2 / 255  # uint8 frames vs diffusers' float frames
SHAPES = {"portrait": (64, 128), "landscape": (128, 64)}  # (width, height): latents 4x8, 8x4


def _imported(folder, module, rule):
    """`module` (built abstractly) with the weights of a diffusers folder, through `rule`."""
    graphdef, state = nnx.split(nnx.eval_shape(module))
    expected = {k: (v.shape, v.dtype) for k, v in flatten(nnx.to_pure_dict(state)).items()}
    nnx.replace_by_pure_dict(state, unflatten(import_folder(folder, expected, rule)))
    return nnx.merge(graphdef, state)


def test_preset_geometry_and_frame_rate():
    """16x in space (8x levels, 2x patch), 4x in time, 48 channels: 1280x704 x 121 frames is
    31 x 22 x 40 tokens; the videos are 24 fps (Wan 2.1 and 2.2 A14B: 16)."""
    assert kinds.of(TI2V.vae).name == "wan2.2"
    assert TI2V.vae.geometry == kinds.LatentGeometry(channels=48, temporal=4, spatial=16)
    assert VideoShape(1280, 704, 121, 1).latent_shape(TI2V) == (1, 31, 44, 80, 48)
    assert VideoShape(1280, 704, 121, 1).tokens(TI2V) == 31 * 22 * 40 == 27280
    assert TI2V.transformer.inner_dim == 3072 and TI2V.num_experts == 1
    assert TI2V.scheduler.flow_shift == 5.0
    assert (TI2V.fps, PRESETS["wan2.1-t2v-14b"].fps, PRESETS["wan2.2-t2v-a14b"].fps) == (24, 16, 16)


@pytest.mark.parametrize(
    ("model", "shape", "phrase"),
    [
        ("wan2.2-ti2v-5b", (1280, 720, 121), "1280x720: width and height must be positive "
         "multiples of 32"),
        ("wan2.2-ti2v-5b", (1280, 704, 120), "--frames 120: frames must be 4k+1"),
        ("wan2.1-t2v-14b", (1280, 712, 81), "multiples of 16"),
    ],
)  # fmt: skip
def test_size_rules_are_one_line_errors(model, shape, phrase):
    with pytest.raises(BuildError, match=re.escape(phrase)) as error:
        check_shape(PRESETS[model], VideoShape(*shape, batch=1))
    assert "\n" not in str(error.value)
    check_shape(PRESETS["wan2.1-t2v-14b"], VideoShape(1280, 720, 81, 1))  # 720p: 2.1 only
    check_shape(TI2V, VideoShape(704, 1280, 121, 1))


def test_mismatched_transformer_and_vae_are_refused():
    with pytest.raises(
        ValueError, match="in_channels 16 and out_channels 16, but the wan2.2 VAE's latents"
    ):
        dataclasses.replace(PRESETS["wan2.1-t2v-14b"], vae=VAE22Config()).validate()
    for preset in PRESETS.values():
        assert preset.validate() is preset


@pytest.fixture(scope="module")
def vae_pair(tmp_path_factory):
    torch.manual_seed(0)
    ref = tiny_wan22_vae(z_dim=8).eval()
    folder = tmp_path_factory.mktemp("vae22")
    ref.save_pretrained(folder)
    cfg = VAE22Config.from_dict(dict(ref.config))  # every key understood
    return ref, _imported(folder, lambda: WanVAE22(cfg, rngs=nnx.Rngs(0)), vae_rules.rule)


def test_vae22_decode_matches_diffusers(vae_pair):
    """Random latents of 3 frames (the cache, both temporal upsamplers and the residual
    shortcuts' first-chunk frames exercised): within 1e-4 of diffusers' decode."""
    ref, model = vae_pair
    torch.manual_seed(1)
    z = torch.randn(2, ref.config.z_dim, 3, 4, 6)
    with torch.no_grad():
        want = ref.decode(z).sample.numpy()
    got = jax.jit(lambda m, z: m.decode(z))(model, jnp.asarray(z.numpy().transpose(0, 2, 3, 4, 1)))
    got = np.asarray(got).transpose(0, 4, 1, 2, 3)
    assert got.shape == want.shape == (2, 3, 9, 64, 96)
    assert np.abs(got - want).max() <= 1e-4
    assert np.abs(want).max() > 0.5


def test_step_equals_diffusers_expand_timesteps_path(tmp_path):
    """diffusers' expand_timesteps step gives each token the timestep mask * t; in
    text-to-video the mask is all ones. Our transformer takes one timestep per video: its output
    equals diffusers' per-token path (within 1e-4), for two videos at two timesteps."""
    torch.manual_seed(0)
    ref = _transformer(channels=TI2V_Z).eval()
    ref.save_pretrained(tmp_path)
    cfg = TransformerConfig.from_dict(dict(ref.config))
    model = _imported(
        tmp_path, lambda: WanTransformer(cfg, rngs=nnx.Rngs(0)), transformer_rules.rule
    )
    rng = np.random.default_rng(1)
    latents = rng.standard_normal((2, 3, 4, 6, TI2V_Z)).astype(np.float32)
    text = rng.standard_normal((2, 20, cfg.text_dim)).astype(np.float32)
    t = np.array([999.0, 137.5], np.float32)
    tokens = 3 * 2 * 3  # frames x rows x columns of (1, 2, 2) patches
    mask = torch.ones(tokens)
    per_token = torch.stack([mask * float(v) for v in t])  # (B, tokens), as WanPipeline makes it
    with torch.no_grad():
        want = ref(
            torch.from_numpy(latents).permute(0, 4, 1, 2, 3), per_token, torch.from_numpy(text),
            return_dict=False,
        )[0].permute(0, 2, 3, 4, 1).numpy()  # fmt: skip
    got = np.asarray(jax.jit(lambda m, *a: m(*a))(model, latents, t, text))
    assert got.shape == want.shape
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def ti2v_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ti2v") / "Wan-TI2V-tiny-Diffusers"
    save_tiny_ti2v_pipeline(folder)
    return folder


def test_ti2v_folder_reads_as_its_kinds(ti2v_folder):
    config = ModelConfig.from_folder(ti2v_folder)
    assert kinds.of(config.vae).name == "wan2.2" and config.vae.patch_size == 2
    assert config.vae.geometry == kinds.LatentGeometry(channels=48, temporal=4, spatial=16)
    assert config.transformer.in_channels == 48 and config.fps == 24


@pytest.fixture(scope="module")
def ti2v_builds(ti2v_folder, tmp_path_factory):
    """`aot build` of the tiny TI2V folder, both orientations (SHAPES), FRAMES frames, batch 1,
    cpu-8, in one artifacts folder."""
    artifacts = tmp_path_factory.mktemp("ti2v-artifacts")
    sizes = [arg for width, height in SHAPES.values() for arg in ("--res", f"{width}x{height}")]
    run_cli("aot", "build", "--model", str(ti2v_folder), *sizes, "--frames", str(FRAMES),
            "--batch", "1", "--target", "cpu-8", "--out", str(artifacts))  # fmt: skip
    return artifacts


def _fps(path) -> float:
    """An MP4's frame rate, as ffmpeg reads it."""
    reader = imageio_ffmpeg.read_frames(str(path))
    try:
        return next(reader)["fps"]
    finally:
        reader.close()


@pytest.mark.parametrize("orientation", sorted(SHAPES))
def test_runtime_matches_diffusers_expand_timesteps(
    ti2v_folder, ti2v_builds, tmp_path, orientation
):
    """`aot build` of the tiny TI2V folder (cpu-8) and `runtime run` with the same noise: frames
    within 2/255 of diffusers' WanPipeline(expand_timesteps=True), CFG, 5 UniPC steps; the MP4
    is 24 fps."""
    from diffusers import WanPipeline

    width, height = SHAPES[orientation]
    shape = ["--res", f"{width}x{height}", "--frames", str(FRAMES), "--batch", "1"]
    noise = np.random.default_rng(1).standard_normal(
        (1, TI2V_Z, (FRAMES - 1) // 4 + 1, height // 16, width // 16), np.float32
    )
    np.save(tmp_path / "noise.npy", noise)
    prompt, negative = "a red cat running in the rain", "blurry"
    pipe = WanPipeline.from_pretrained(ti2v_folder)
    assert pipe.config.expand_timesteps
    expected, other_prompt = (
        pipe(
            prompt=text, negative_prompt=negative, height=height, width=width, num_frames=FRAMES,
            num_inference_steps=STEPS, guidance_scale=GUIDANCE, latents=torch.from_numpy(noise),
            output_type="np",
        ).frames
        for text in (prompt, "a boat on the sea at night")
    )  # fmt: skip
    run_cli(
        "runtime", "run", "--artifacts", str(ti2v_builds), "--weights", str(ti2v_folder), *shape,
        "--prompt", prompt, "--negative-prompt", negative, "--steps", str(STEPS),
        "--guidance", str(GUIDANCE), "--init-noise", str(tmp_path / "noise.npy"),
        "--save-frames", str(tmp_path / "frames.npy"), "--out", str(tmp_path / "v.mp4"),
    )  # fmt: skip
    ours = np.load(tmp_path / "frames.npy").astype(np.float32) / 255
    assert ours.shape == expected.shape == (1, FRAMES, height, width, 3)
    assert expected.max() - expected.min() > 0.3  # frames with content, not a constant
    assert np.abs(ours - expected).max() <= TOLERANCE
    # Control: another prompt, the same noise, moves the frames well past the tolerance.
    assert np.abs(ours - other_prompt).max() > 5 * TOLERANCE
    assert _fps(tmp_path / "v.mp4") == 24
    builds = [p for p in ti2v_builds.iterdir() if not p.name.startswith(".")]
    assert [read_manifest(b).fps for b in builds] == [24, 24]  # recorded in the manifests


def test_prompts_file_videos_play_at_the_model_frame_rate(ti2v_folder, ti2v_builds, tmp_path):
    """`runtime run --prompts` writes each line's MP4 at the model's 24 fps, as a single run."""
    width, height = SHAPES["portrait"]
    lines = [{"prompt": f"a red cat {i}", "out": f"v{i}.mp4"} for i in range(2)]
    (tmp_path / "p.jsonl").write_text("\n".join(map(json.dumps, lines)))
    run_cli("runtime", "run", "--artifacts", str(ti2v_builds), "--weights", str(ti2v_folder),
            "--res", f"{width}x{height}", "--frames", str(FRAMES), "--steps", "1",
            "--guidance", str(GUIDANCE), "--prompts", str(tmp_path / "p.jsonl"))  # fmt: skip
    assert [_fps(tmp_path / f"v{i}.mp4") for i in range(2)] == [24, 24]


def test_served_videos_play_at_the_model_frame_rate(ti2v_folder, ti2v_builds, tmp_path):
    """`runtime serve` of the TI2V builds writes its MP4s at 24 fps, and the video object's
    `seconds` counts at 24 fps too."""
    width, height = SHAPES["portrait"]
    with serving(ti2v_builds, ti2v_folder, tmp_path / "out", "--batch-window", "0") as server:
        video = server.post({"prompt": "a red cat", "size": f"{width}x{height}",
                             "frames": FRAMES, "steps": 1}).json()  # fmt: skip
        [done] = server.wait([video["id"]])
        content = server.client.get(f"/v1/videos/{video['id']}/content")
    assert float(done["seconds"]) == pytest.approx((FRAMES - 1) / 24)
    (tmp_path / "served.mp4").write_bytes(content.content)
    assert _fps(tmp_path / "served.mp4") == 24


# ----------------------------------------------------------------------------------------------
# The decode's guarantees, as the Wan 2.1 decode's (tests/test_sharding.py, tests/test_vae.py).

TINY = PRESETS["tiny"]
TINY_TI2V = dataclasses.replace(  # the tiny TI2V folder's shapes
    TINY,
    name="tiny-ti2v",
    transformer=dataclasses.replace(TINY.transformer, in_channels=TI2V_Z, out_channels=TI2V_Z),
    vae=VAE22Config(
        base_dim=8, decoder_base_dim=16, z_dim=TI2V_Z, dim_mult=(1, 2, 2, 2), num_res_blocks=1,
        latents_mean=(0.1,) * TI2V_Z, latents_std=(0.7,) * TI2V_Z,
    ),
).validate()  # fmt: skip


def _decode_program(width: int, height: int, frames: int = 9, dtype: str = "uint8"):
    shape = VideoShape(width, height, frames, batch=1)
    _, _, lat_h, lat_w, _ = shape.latent_shape(TINY_TI2V)
    layout = sharding.choose_vae_layout(lat_h, lat_w, 8)
    return programs.vae_decode_program(
        TINY_TI2V, shape, programs.ProgramOptions(frames_dtype=dtype)
    ), layout


def test_decode_is_one_scan_body():
    """The first chunk runs in the later chunks' body: one while loop, whatever T."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: WanVAE22(TINY_TI2V.vae, rngs=nnx.Rngs(0))))
    decode = jax.jit(lambda s, z: nnx.merge(graphdef, s).decode(z))
    texts = [
        decode.lower(state, jax.ShapeDtypeStruct((1, t, 4, 6, TI2V_Z), jnp.float32)).as_text()
        for t in (2, 6)
    ]
    assert texts[0].count("stablehlo.while") == texts[1].count("stablehlo.while") == 1
    assert abs(len(texts[1]) - len(texts[0])) < 0.02 * len(texts[0])


def test_both_orientations_have_the_same_collectives_and_no_all_to_all():
    """256x160 and 160x256 (latents 10 x 16 and 16 x 10, like 1280x704's 44 x 80 on 8 devices:
    one orientation's width does not divide): width sharded in one, height in the other, the
    same collectives by kind and count, no all-to-all (also through unpatchify and the
    residual shortcuts)."""
    summaries = {}
    for width, height, axis in [(256, 160, "width"), (160, 256, "height")]:
        program, layout = _decode_program(width, height)
        assert layout == sharding.VaeLayout(axis)
        compiled = compile_program(program, vae_mesh(CPU8, (1, 8)), layout.rules(), layout.uneven)
        collectives = hlo.collective_summary(hlo.parse(compiled.as_text()))
        summaries[axis] = {kind: c["count"] for kind, c in collectives.items() if c["count"]}
    assert summaries["width"] == summaries["height"]
    assert "all-to-all" not in summaries["width"]


@pytest.mark.parametrize("width, height, axis", [(128, 64, "width"), (64, 128, "height")])
def test_sharded_decode_equals_single_device(width, height, axis):
    """Spatially sharded over 8 devices: the frames of one device, within 1e-5."""
    program, layout = _decode_program(width, height, frames=5, dtype="float32")
    assert layout == sharding.VaeLayout(axis)
    params = random_params(TINY_TI2V, "vae", seed=3)
    rng = np.random.default_rng(1)
    latents = rng.standard_normal(program.args["latents"].shape).astype(np.float32)
    want = np.asarray(single_device(program, params, latents)["frames"])
    compiled = compile_program(program, vae_mesh(CPU8, (1, 8)), layout.rules(), layout.uneven)
    got = compiled(*place(compiled, params, latents))["frames"]
    assert tuple(compiled.output_shardings["frames"].spec)[2 if axis == "height" else 3] == (
        "vae_spatial"
    )
    assert np.mean((want > 0) & (want < 1)) > 0.05  # not all clipped
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=0)
