"""WanVAE22Encoder (the Wan 2.2 VAE's encode half, TI2V-5B's image mode) against diffusers'
AutoencoderKLWan(is_residual, patch_size=2).encode (random weights, fp32), and the weight rule's
coverage of the Wan 2.2 encoder."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import tiny_wan22_vae
from diffusers import AutoencoderKLWan
from flax import nnx

from wan.component_configs import VAE22Config
from wan.models.vae22_encoder import WanVAE22Encoder
from wan.weights import flatten, import_folder, unflatten
from wan.weights.vae import encoder_rule

TOLERANCE = 1e-4
SHAPES = {"portrait": (64, 48), "landscape": (48, 64)}  # (height, width): latents 4x3, 3x4


def abstract_state(cfg: VAE22Config) -> tuple[nnx.GraphDef, nnx.State]:
    return nnx.split(nnx.eval_shape(lambda: WanVAE22Encoder(cfg, rngs=nnx.Rngs(0))))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The tiny random Wan 2.2 VAE and our encoder with its weights, imported from its
    save_pretrained folder through the rule."""
    torch.manual_seed(0)
    ref = tiny_wan22_vae(z_dim=8).eval()
    folder = tmp_path_factory.mktemp("vae22")
    ref.save_pretrained(folder)
    graphdef, state = abstract_state(VAE22Config.from_dict(dict(ref.config)))
    expected = {k: (v.shape, v.dtype) for k, v in flatten(nnx.to_pure_dict(state)).items()}
    nnx.replace_by_pure_dict(state, unflatten(import_folder(folder, expected, encoder_rule)))
    return ref, nnx.merge(graphdef, state)


def diffusers_mode(ref: AutoencoderKLWan, video: np.ndarray) -> np.ndarray:
    """diffusers' argmax latents of a channels-last video, channels-last."""
    with torch.no_grad():
        mode = ref.encode(torch.from_numpy(video).permute(0, 4, 1, 2, 3)).latent_dist.mode()
    return mode.permute(0, 2, 3, 4, 1).numpy()


@pytest.mark.parametrize("frames", [1, 5, 9], ids=["image", "video", "video-2-chunks"])
@pytest.mark.parametrize("orientation", sorted(SHAPES))
def test_encode_matches_diffusers(pair, frames, orientation):
    """One frame (image mode: the first chunk alone), five (the first, then a chunk of 4 in
    the scan: the cache, both temporal downsamplers and the shortcuts' time averaging
    exercised) and nine (the cache carried from one scan step to the next): the mean within
    1e-4 of diffusers'; another video moves it well past that."""
    ref, model = pair
    height, width = SHAPES[orientation]
    rng = np.random.default_rng(frames)
    video, other = rng.uniform(-1, 1, (2, 2, frames, height, width, 3)).astype(np.float32)
    got = np.asarray(jax.jit(lambda m, x: m(x))(model, jnp.asarray(video)))
    want = diffusers_mode(ref, video)
    assert got.shape == want.shape == (2, 1 + (frames - 1) // 4, height // 16, width // 16, 8)
    err = np.abs(got - want).max()
    print(f"{orientation} F={frames}: max abs error {err:.2e}")
    assert err <= TOLERANCE
    assert np.abs(got - diffusers_mode(ref, other)).max() > 100 * TOLERANCE


def test_image_mode_compiles_no_scan_and_video_one():
    """An image is the first chunk alone, without an empty scan (whose body would be compiled
    all the same); a video's chunks after the first are one while loop."""
    cfg = VAE22Config(base_dim=8, z_dim=4, latents_mean=(0.0,) * 4, latents_std=(1.0,) * 4)
    graphdef, state = abstract_state(cfg)
    encode = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
    for frames, loops in [(1, 0), (9, 1)]:
        text = encode.lower(state, jax.ShapeDtypeStruct((1, frames, 32, 48, 3), jnp.float32))
        assert text.as_text().count("stablehlo.while") == loops, frames


def test_rule_covers_the_real_encoder():
    """diffusers' default Wan 2.2 VAE (TI2V-5B's shapes, on the meta device): every encoder
    tensor maps to a parameter of its shape, every parameter gets one, and no decoder tensor
    maps (the residual shortcuts have no weights)."""
    cfg = VAE22Config()
    config = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(cfg).items()}
    with torch.device("meta"):
        ref = AutoencoderKLWan(**config, is_residual=True)
    flat = flatten(nnx.to_pure_dict(abstract_state(cfg)[1]))
    mapped = set()
    for name, tensor in ref.state_dict().items():
        target = encoder_rule(name)
        if target is None:
            assert name.partition(".")[0] in ("decoder", "post_quant_conv"), name
            continue
        shape = target.transform(np.broadcast_to(np.float32(0), tensor.shape)).shape
        assert shape == flat[target.path].shape, name
        mapped.add(target.path)
    assert mapped == set(flat)
    assert any(".avg_shortcut" in n for n, _ in ref.encoder.named_modules())
    assert not any("avg_shortcut" in n for n in ref.state_dict())
