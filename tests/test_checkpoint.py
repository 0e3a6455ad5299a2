"""Weights on disk: the project's checkpoint (and its older orbax format) and diffusers folders, restored straight into
given shardings; errors name the parameter and its expected shape."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import torch
from diffusers import WanTransformer3DModel
from flax import nnx
from jax.sharding import NamedSharding

from wan import checkpoint, programs, sharding, weights
from wan.configs import ModelConfig
from wan.models.vae_encoder import WanVAEEncoder
from wan.presets import PRESETS
from wan.random_weights import random_params, write_random_checkpoint

TINY = PRESETS["tiny"]


def _abstract_sharded(component: str) -> dict:
    """The component's parameters as ShapeDtypeStructs sharded over 8 devices (fsdp, tensor)."""
    _, params, axes = programs.split_abstract(programs.abstract_module(TINY, component))
    mesh = sharding.make_mesh(
        jax.devices()[:8], (("data", 1), ("fsdp", 4), ("context", 1), ("tensor", 2))
    )
    shardings = programs.shardings(mesh, params, axes, sharding.TRANSFORMER_RULES)
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), params, shardings
    )


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    return write_random_checkpoint(TINY, tmp_path_factory.mktemp("ckpt") / "tiny", seed=3)


def test_checkpoint_restores_into_given_shardings(tiny_checkpoint):
    assert checkpoint.is_checkpoint(tiny_checkpoint)
    assert ModelConfig.from_folder(tiny_checkpoint) == TINY
    abstract = _abstract_sharded("transformer")
    restored = checkpoint.load_component(tiny_checkpoint, "transformer", abstract)
    expected = random_params(TINY, "transformer", seed=4)  # components are seeded in order
    flat_r, flat_e, flat_a = (weights.flatten(t) for t in (restored, expected, abstract))
    assert flat_r.keys() == flat_e.keys()
    sharded = 0
    for path, value in flat_r.items():
        assert value.sharding == flat_a[path].sharding, path
        np.testing.assert_array_equal(np.asarray(value), flat_e[path])
        sharded += any(value.sharding.spec)
    assert sharded > 10  # the test exercises real sharding, not only replicated arrays


def test_orbax_checkpoints_of_format_1_still_load(tiny_checkpoint, tmp_path):
    """Checkpoints written before format 2 (orbax, one folder per component) load the same."""
    import orbax.checkpoint as ocp

    old = tmp_path / "tiny-orbax"
    (old / "transformer").parent.mkdir()
    expected = random_params(TINY, "transformer", seed=4)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save((old / "transformer").absolute(), expected)
    meta = json.loads((tiny_checkpoint / checkpoint.MARKER).read_text())
    (old / checkpoint.MARKER).write_text(json.dumps({**meta, "format": 1}))
    abstract = _abstract_sharded("transformer")
    restored = weights.flatten(checkpoint.load_component(old, "transformer", abstract))
    for path, value in weights.flatten(expected).items():
        np.testing.assert_array_equal(np.asarray(restored[path]), value)
        assert restored[path].sharding == weights.flatten(abstract)[path].sharding


def test_checkpoint_names_missing_and_misshaped_parameters(tiny_checkpoint):
    abstract = _abstract_sharded("transformer")
    kernel = abstract["proj_out"]["kernel"]
    wrong = dict(
        abstract,
        proj_out={**abstract["proj_out"], "kernel": jax.ShapeDtypeStruct((3, 3), kernel.dtype)},
    )
    with pytest.raises(
        weights.WeightError, match=r"proj_out\.kernel has shape .* expected \(3, 3\)"
    ):
        checkpoint.load_component(tiny_checkpoint, "transformer", wrong)
    extra = dict(abstract, extra={"w": jax.ShapeDtypeStruct((2,), kernel.dtype)})
    with pytest.raises(
        weights.WeightError, match=r"missing weight for extra\.w, expected shape \(2,\)"
    ):
        checkpoint.load_component(tiny_checkpoint, "transformer", extra)


@pytest.fixture(scope="module")
def vae_with_encoder():
    """The tiny VAE's parameters as checkpoints held them when the decode component still had
    the encoder: the decode half's, the encoder's beside them, and the decode half's abstract."""
    decode = random_params(TINY, "vae", seed=5)
    encoder = nnx.to_pure_dict(
        nnx.state(nnx.eval_shape(lambda: WanVAEEncoder(TINY.vae, rngs=nnx.Rngs(0))))
    )
    encoder = jax.tree.map(lambda s: np.full(s.shape, 0.5, s.dtype), encoder)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), decode
    )
    return decode, {**decode, **encoder}, abstract


@pytest.mark.parametrize("fmt", [1, 2])
def test_vae_checkpoint_with_encoder_weights_loads_the_decoder(vae_with_encoder, tmp_path, fmt):
    """A checkpoint written with the VAE encoder's weights (format 2, or orbax's format 1)
    loads the decode component: the encoder's are left, a missing decoder weight is named."""
    import orbax.checkpoint as ocp

    decode, old, abstract = vae_with_encoder
    assert {"encoder", "quant_conv"} <= old.keys() and not {"encoder", "quant_conv"} & decode.keys()
    folder = checkpoint.save_checkpoint(tmp_path / "old", TINY, {"vae": old})
    if fmt == 1:  # one orbax folder per component
        (folder / "vae" / checkpoint.PARAMS).unlink()
        (folder / "vae").rmdir()
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save((folder / "vae").absolute(), old)
    restored = weights.flatten(checkpoint.load_component(folder, "vae", abstract))
    assert restored.keys() == weights.flatten(decode).keys()
    for path, value in weights.flatten(decode).items():
        np.testing.assert_array_equal(np.asarray(restored[path]), value)
    wider = {
        **abstract,
        "decoder": {**abstract["decoder"], "extra": abstract["post_quant_conv"]["bias"]},
    }
    with pytest.raises(weights.WeightError, match=r"missing weight for decoder\.extra"):
        checkpoint.load_component(folder, "vae", wider)


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(checkpoint.shutil, "copytree", fail)
    params = {"vae": random_params(TINY, "vae", 0)}
    with pytest.raises(RuntimeError, match="disk full"):
        checkpoint.save_checkpoint(tmp_path / "ckpt", TINY, params, tokenizer_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []  # no half-written folder, no temp left behind


@pytest.fixture(scope="module")
def diffusers_transformer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("diffusers")
    tc = TINY.transformer
    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=tc.patch_size, num_attention_heads=tc.num_attention_heads,
        attention_head_dim=tc.attention_head_dim, in_channels=tc.in_channels,
        out_channels=tc.out_channels, text_dim=tc.text_dim, freq_dim=tc.freq_dim,
        ffn_dim=tc.ffn_dim, num_layers=tc.num_layers,
    )  # fmt: skip
    model.save_pretrained(folder / "transformer")
    return folder, {k: v.detach().numpy() for k, v in model.state_dict().items()}


def test_diffusers_folder_places_shards(diffusers_transformer):
    folder, state = diffusers_transformer
    restored = checkpoint.load_component(folder, "transformer", _abstract_sharded("transformer"))
    kernel = restored["blocks"]["attn1"]["to_q"]["kernel"]
    assert isinstance(kernel.sharding, NamedSharding) and kernel.sharding.spec[1:] == (
        "fsdp",
        "tensor",
    )
    np.testing.assert_array_equal(np.asarray(kernel[1]), state["blocks.1.attn1.to_q.weight"].T)
    # Each device holds only its shard, never the whole array.
    shard = kernel.addressable_shards[0].data
    assert shard.size == kernel.size // 8


def test_diffusers_folder_missing_tensor_is_named(diffusers_transformer, tmp_path):
    folder, state = diffusers_transformer
    from safetensors.numpy import save_file

    trimmed = {k: v for k, v in state.items() if k != "blocks.1.ffn.net.2.weight"}
    (tmp_path / "transformer").mkdir()
    save_file(trimmed, tmp_path / "transformer" / "diffusion_pytorch_model.safetensors")
    (tmp_path / "transformer" / "config.json").write_text(
        json.dumps(json.loads((folder / "transformer" / "config.json").read_text()))
    )
    with pytest.raises(
        weights.WeightError, match=r"blocks\.ffn\.linear_2\.kernel \(layers \[1\]\), expected shape"
    ):
        checkpoint.load_component(tmp_path, "transformer", _abstract_sharded("transformer"))


def test_safetensors_round_trip_keeps_dtypes(tmp_path):
    """What format-2 checkpoints are written with, read back by our memory-mapped reader."""
    import ml_dtypes
    from safetensors.numpy import save_file

    tensors = {
        "a/bf16": np.arange(6, dtype=np.float32).reshape(2, 3).astype(ml_dtypes.bfloat16),
        "b/f32": np.float32(1.5) * np.ones((3,), np.float32),
        "c/scalar": np.array(7, np.int32),
    }
    save_file(tensors, tmp_path / "t.safetensors")
    back = dict(weights.read_safetensors(tmp_path / "t.safetensors"))
    assert back.keys() == tensors.keys()
    for name, value in tensors.items():
        assert back[name].dtype == value.dtype and back[name].shape == value.shape
        np.testing.assert_array_equal(back[name], value)
