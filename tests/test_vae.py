"""WanVAE (the decode half) and WanVAEEncoder against diffusers' AutoencoderKLWan (random
weights, fp32), their structure and their compiled shape: one scan over chunks, whatever the
number of latent frames."""

from __future__ import annotations

import dataclasses
import gc
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLWan
from diffusers.models.autoencoders.autoencoder_kl_wan import WanAttentionBlock
from flax import nnx

from wan import sharding
from wan.component_configs import VAEConfig
from wan.models.vae import Conv3d, WanVAE, denormalize_latents
from wan.models.vae_encoder import WanVAEEncoder
from wan.presets import PRESETS
from wan.weights import flatten, import_folder, unflatten
from wan.weights.vae import encoder_rule, rule

TINY = PRESETS["tiny"].vae
# Temporal factor 2, spatial factor 4, three resnets per up block, encoder attention.
OTHER = VAEConfig(
    base_dim=8,
    z_dim=4,
    dim_mult=(1, 2, 4),
    num_res_blocks=2,
    attn_scales=(0.5,),
    temperal_downsample=(True, False),
    latents_mean=(0.0,) * 4,
    latents_std=(1.0,) * 4,
)


def to_torch_layout(x: jax.Array) -> np.ndarray:
    return np.asarray(x).transpose(0, 4, 1, 2, 3)


def to_ours(x: torch.Tensor) -> jax.Array:
    return jnp.asarray(x.numpy().transpose(0, 2, 3, 4, 1))


def abstract_state(cfg: VAEConfig, half: type = WanVAE) -> tuple[nnx.GraphDef, nnx.State]:
    return nnx.split(nnx.eval_shape(lambda: half(cfg, rngs=nnx.Rngs(0))))


def imported(folder, cfg: VAEConfig, half: type, half_rule) -> nnx.Module:
    """`half` of the VAE with the weights of the diffusers folder, through its rule."""
    graphdef, state = abstract_state(cfg, half)
    expected = {k: (v.shape, v.dtype) for k, v in flatten(nnx.to_pure_dict(state)).items()}
    nnx.replace_by_pure_dict(state, unflatten(import_folder(folder, expected, half_rule)))
    return nnx.merge(graphdef, state)


@pytest.fixture(scope="module")
def pair(tmp_path_factory, request):
    """A random diffusers VAE and our two halves with its weights, each imported from the one
    save_pretrained folder (the decode half's rule skips the encoder's tensors, and back)."""
    cfg = request.param
    torch.manual_seed(0)
    ref = AutoencoderKLWan(
        **{k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(cfg).items()}
    )
    with torch.no_grad():  # non-trivial gains and biases, so a misplaced one shows
        for name, p in ref.named_parameters():
            if name.endswith("gamma"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    folder = tmp_path_factory.mktemp("vae")
    ref.save_pretrained(folder)
    decode = imported(folder, cfg, WanVAE, rule)
    return ref.eval(), decode, imported(folder, cfg, WanVAEEncoder, encoder_rule)


@pytest.fixture
def attention_in_encoder(monkeypatch):
    """diffusers' encoder passes feat_cache to every down block, which WanAttentionBlock does not
    accept (so attn_scales crashes there); the reference here ignores it, like we do."""
    forward = WanAttentionBlock.forward
    monkeypatch.setattr(WanAttentionBlock, "forward", lambda self, x, **_: forward(self, x))


@pytest.mark.parametrize("pair", [TINY, OTHER], indirect=True, ids=["tiny", "other"])
def test_decode_matches_diffusers(pair):
    ref, model, _ = pair
    torch.manual_seed(1)
    # 3 latent frames: the cache and temporal upsampling are exercised
    z = torch.randn(2, ref.config.z_dim, 3, 4, 6)
    with torch.no_grad():
        want = ref.decode(z).sample.numpy()
    got = to_torch_layout(jax.jit(lambda m, z: m.decode(z))(model, to_ours(z)))
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-4
    assert 0.0 < np.abs(want).max() <= 1.0


@pytest.mark.parametrize("pair", [TINY, OTHER], indirect=True, ids=["tiny", "other"])
@pytest.mark.usefixtures("attention_in_encoder")
def test_encode_matches_diffusers(pair):
    ref, _, model = pair
    torch.manual_seed(2)
    x = torch.randn(1, 3, 9, 32, 48)  # the first frame, then two chunks of 4
    with torch.no_grad():
        posterior = ref.encode(x).latent_dist
    mean, logvar = jax.jit(lambda m, x: m.encode(x))(model, to_ours(x))
    assert mean.shape == to_ours(posterior.mean).shape
    assert np.abs(to_torch_layout(mean) - posterior.mean.numpy()).max() <= 1e-4
    assert np.abs(to_torch_layout(logvar) - posterior.logvar.numpy()).max() <= 1e-4


def test_the_encoder_compiles_once_whatever_the_frame_count():
    """The first chunk (one frame) runs in the scan body of the others, padded in front: the
    lowered encode holds one copy of the encoder's convolutions for 5 frames as for 81."""
    model = nnx.eval_shape(lambda: WanVAEEncoder(TINY, rngs=nnx.Rngs(0)))

    def convolutions(frames: int) -> int:
        x = jax.ShapeDtypeStruct((1, frames, 32, 48, 3), jnp.float32)
        text = jax.jit(lambda m, x: m.encode(x)).lower(model, x).as_text()
        return text.count("stablehlo.convolution")

    layers = sum(isinstance(node, Conv3d) for _, node in nnx.iter_graph(model))
    assert convolutions(5) == convolutions(81) == layers  # each conv layer lowered once


def test_latent_normalization_follows_wan_pipeline():
    cfg = VAEConfig()
    latents = torch.randn(1, cfg.z_dim, 2, 3, 4)
    mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1)
    want = (latents / inv_std + mean).numpy()
    raw = denormalize_latents(to_ours(latents), cfg)
    np.testing.assert_allclose(to_torch_layout(raw), want, rtol=0, atol=1e-6)


def test_real_config_structure_matches_diffusers():
    """The two halves hold diffusers' default AutoencoderKLWan between them: every diffusers
    tensor has a parameter of its shape (after the rule's transform) in exactly one half, the
    decode half (the VAE component the programs take) none of the encoder's, and eval_shape
    allocates nothing."""
    with torch.device("meta"):
        ref = AutoencoderKLWan()
    gc.collect()  # an earlier test's arrays, freed meanwhile, would not be this one's
    before = {id(a) for a in jax.live_arrays()}
    halves = {
        half_rule: flatten(nnx.to_pure_dict(abstract_state(VAEConfig(), half)[1]))
        for half, half_rule in ((WanVAE, rule), (WanVAEEncoder, encoder_rule))
    }
    assert not {id(a) for a in jax.live_arrays()} - before
    assert {path[0] for path in halves[rule]} == {"decoder", "post_quant_conv"}
    for flat in halves.values():
        assert all(isinstance(v, jax.ShapeDtypeStruct) for v in flat.values())
    assert sum(math.prod(v.shape) for flat in halves.values() for v in flat.values()) == sum(
        p.numel() for p in ref.parameters()
    )
    others = {rule: ("encoder", "quant_conv"), encoder_rule: ("decoder", "post_quant_conv")}
    for half_rule, flat in halves.items():
        mapped = set()
        for name, tensor in ref.state_dict().items():
            target = half_rule(name)
            if target is None:
                assert name.partition(".")[0] in others[half_rule], name
                continue
            shape = target.transform(np.broadcast_to(np.float32(0), tensor.shape)).shape
            assert shape == flat[target.path].shape, name
            mapped.add(target.path)
        assert mapped == set(flat)


def test_decode_and_encode_compile_to_one_scan():
    """The chunks after the first run as one while loop: the program does not grow with T."""

    def lowered(half: type, method: str, shape: tuple[int, ...]) -> str:
        graphdef, state = abstract_state(TINY, half)
        fn = jax.jit(lambda s, x: getattr(nnx.merge(graphdef, s), method)(x))
        return fn.lower(state, jax.ShapeDtypeStruct(shape, jnp.float32)).as_text()

    for half, method, short, long in [
        (WanVAE, "decode", (1, 2, 4, 6, TINY.z_dim), (1, 6, 4, 6, TINY.z_dim)),
        (WanVAEEncoder, "encode", (1, 5, 16, 24, 3), (1, 21, 16, 24, 3)),
    ]:
        a, b = lowered(half, method, short), lowered(half, method, long)
        assert a.count("stablehlo.while") == b.count("stablehlo.while") == 1, method
        assert abs(len(b) - len(a)) < 0.02 * len(a), method


def test_decode_sharded_over_width_matches_unsharded():
    """With the width on a 2-device 'vae_spatial' axis every level stays sharded (the
    constraints are there) and the result is unchanged."""
    graphdef, state = abstract_state(TINY)
    rng = np.random.default_rng(3)  # random params without flax's (slow, eager) initializers
    params = jax.tree.map(lambda s: 0.2 * rng.standard_normal(s.shape, np.float32), state)
    z = jnp.asarray(rng.standard_normal((1, 2, 4, 6, TINY.z_dim), np.float32))
    decode = jax.jit(lambda s, z: nnx.merge(graphdef, s).decode(z))
    want = decode(params, z)
    auto = (jax.sharding.AxisType.Auto,) * 2
    mesh = jax.make_mesh((1, 2), ("redundant", "vae_spatial"), auto, devices=jax.devices()[:2])
    with jax.set_mesh(mesh), sharding.axis_rules((("vae_width", "vae_spatial"),)):
        lowered = decode.lower(params, z)
        compiled = lowered.compile()
        got = compiled(params, z)
    assert lowered.as_text().count("sharding_constraint") > 50
    assert "all-to-all" not in compiled.as_text()  # no width <-> height flips
    assert got.sharding.spec[3] == "vae_spatial"
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
