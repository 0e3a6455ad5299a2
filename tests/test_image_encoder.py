"""CLIP vision encoder vs transformers' CLIPVisionModel: the penultimate hidden states that
diffusers' WanImageToVideoPipeline.encode_image takes (fp32, tiny random model), the config read
from a transformers config.json, and the weight rule's coverage of a real ViT-H/14 checkpoint."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import CLIPVisionConfig, CLIPVisionModel, CLIPVisionModelWithProjection

from wan.component_configs import ImageEncoderConfig
from wan.models.image_encoder import CLIPVisionEncoder
from wan.strict_config import ConfigKeyError, WeightError
from wan.weights import flatten, import_folder, unflatten
from wan.weights.image_encoder import rule

CFG = ImageEncoderConfig(
    hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
    image_size=28, patch_size=14, projection_dim=16,
)  # fmt: skip
TOLERANCE = 1e-4
# Wan-AI/Wan2.1-I2V-14B-480P-Diffusers' image_encoder/config.json (a CLIPVisionConfig saved by
# transformers 4.48, from a CLIPVisionModelWithProjection).
WAN_CONFIG = {
    "_name_or_path": "image_encoder", "architectures": ["CLIPVisionModelWithProjection"],
    "attention_dropout": 0.0, "dropout": 0.0, "hidden_act": "gelu", "hidden_size": 1280,
    "image_size": 224, "initializer_factor": 1.0, "initializer_range": 0.02,
    "intermediate_size": 5120, "layer_norm_eps": 1e-05, "model_type": "clip_vision_model",
    "num_attention_heads": 16, "num_channels": 3, "num_hidden_layers": 32, "patch_size": 14,
    "projection_dim": 1024, "torch_dtype": "float32", "transformers_version": "4.48.0.dev0",
}  # fmt: skip


def clip_config(cfg: ImageEncoderConfig) -> CLIPVisionConfig:
    return CLIPVisionConfig(**dataclasses.asdict(cfg))


def load(folder, cfg: ImageEncoderConfig):
    """Our encoder with the weights of a transformers folder: a jitted pixels -> features."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: CLIPVisionEncoder(cfg, rngs=nnx.Rngs(0))))
    expected = {p: (v.shape, v.dtype) for p, v in flatten(nnx.to_pure_dict(state)).items()}
    nnx.replace_by_pure_dict(state, unflatten(import_folder(folder, expected, rule)))
    encode = jax.jit(lambda st, pixels: nnx.merge(graphdef, st)(pixels))
    return lambda pixels: np.asarray(encode(state, jnp.asarray(pixels)))


@pytest.fixture(scope="module", params=["gelu", "quick_gelu"])
def reference(request, tmp_path_factory):
    """A random transformers CLIPVisionModel saved with save_pretrained, its config read back
    from the folder, and our encoder loaded from it."""
    torch.manual_seed(0)
    model = CLIPVisionModel(clip_config(dataclasses.replace(CFG, hidden_act=request.param)))
    with torch.no_grad():  # norms and embeddings away from their neutral init
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.uniform_(0.5, 1.5)
            elif "norm" in name:
                param.normal_(0.0, 0.1)
            elif name.endswith(("class_embedding", "position_embedding.weight")):
                param.normal_(0.0, 1.0)
    folder = tmp_path_factory.mktemp(f"image_encoder_{request.param}")
    model.eval().save_pretrained(folder)
    cfg = ImageEncoderConfig.from_dict(json.loads((folder / "config.json").read_text()))
    return model, folder, cfg, load(folder, cfg)


def features(model, pixels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """transformers' (hidden_states[-2], hidden_states[-1]) of NCHW pixels."""
    with torch.no_grad():
        out = model(torch.from_numpy(pixels), output_hidden_states=True)
    return out.hidden_states[-2].numpy(), out.hidden_states[-1].numpy()


def nhwc(pixels: np.ndarray) -> np.ndarray:
    return pixels.transpose(0, 2, 3, 1)


def pixels(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(2, 3, 28, 28)).astype(np.float32)


def test_config_read_from_the_saved_folder(reference):
    model, _, cfg, _ = reference
    assert cfg == dataclasses.replace(CFG, hidden_act=model.config.hidden_act)
    assert cfg.tokens == 5


def test_penultimate_hidden_states_match_transformers(reference):
    model, _, cfg, encode = reference
    image = pixels(0)
    want, last = features(model, image)
    got = encode(nhwc(image))
    assert got.shape == want.shape == (2, cfg.tokens, cfg.hidden_size)
    np.testing.assert_allclose(got, want, atol=TOLERANCE, rtol=0)
    # Controls: the last layer's output, and another image's features, are far from these.
    assert np.abs(got - last).max() > 100 * TOLERANCE
    assert np.abs(encode(nhwc(pixels(1))) - want).max() > 100 * TOLERANCE


def test_a_checkpoint_with_projection_loads_the_same(reference, tmp_path):
    """CLIPVisionModelWithProjection (Wan's image encoder class) names its tensors under
    `vision_model.` and adds the projection head, which is skipped."""
    model, folder, cfg, encode = reference
    with_projection = CLIPVisionModelWithProjection(model.config)
    with_projection.vision_model.load_state_dict(model.state_dict())
    with_projection.save_pretrained(tmp_path)
    image = nhwc(pixels(2))
    np.testing.assert_array_equal(load(tmp_path, cfg)(image), encode(image))


def test_real_configs_load():
    assert ImageEncoderConfig.from_dict(WAN_CONFIG) == ImageEncoderConfig()
    assert ImageEncoderConfig().tokens == 257
    raw = clip_config(CFG).to_dict()  # every key transformers writes, defaults included
    assert ImageEncoderConfig.from_dict(raw) == CFG


@pytest.mark.parametrize(
    ("key", "value", "error", "match"),
    [
        ("use_rotary_embeddings", True, ConfigKeyError, "does not understand"),
        ("model_type", "siglip_vision_model", ConfigKeyError, "clip_vision_model"),
        ("hidden_act", "gelu_new", WeightError, "gelu or quick_gelu"),
        ("num_attention_heads", 7, WeightError, "multiple"),
        ("num_hidden_layers", 1, WeightError, "penultimate"),
        ("layer_norm_eps", 0.0, WeightError, "layer_norm_eps"),
    ],
)
def test_config_refuses(key, value, error, match):
    with pytest.raises(error, match=match):
        ImageEncoderConfig.from_dict({**WAN_CONFIG, key: value})


def test_rule_rejects_unknown_tensor():
    with pytest.raises(WeightError, match="unexpected CLIP vision tensor"):
        rule("vision_model.encoder.layers.0.self_attn.qkv.weight")
    with pytest.raises(WeightError, match="unexpected CLIP vision tensor"):
        rule("text_model.embeddings.token_embedding.weight")


def test_rule_covers_the_real_model():
    """ViT-H/14, abstract (nothing allocated): every tensor of transformers' model lands on a
    parameter of its shape or is deliberately skipped (the final norm and the projection head),
    and every parameter, every layer of the stacked ones, gets a tensor (zero-byte views)."""
    real = ImageEncoderConfig()
    abstract = nnx.eval_shape(
        lambda: CLIPVisionEncoder(
            real, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0)
        )
    )
    state = nnx.state(abstract)
    ours = flatten(nnx.to_pure_dict(state))
    assert ours["encoder", "layers", "mlp", "fc1", "kernel"].shape == (32, 1280, 5120)
    assert nnx.get_partition_spec(state)["encoder"]["layers"]["self_attn"]["q_proj"][
        "kernel"
    ].get_value() == jax.sharding.PartitionSpec("layers", "embed", "heads")

    with torch.device("meta"):
        torch_model = CLIPVisionModelWithProjection(clip_config(real))
    skipped, written = set(), {}
    for name, tensor in torch_model.state_dict().items():
        target = rule(name)
        if target is None:
            skipped.add(name)
            continue
        view = np.broadcast_to(np.zeros((), np.float32), tuple(tensor.shape))
        shape = ours[target.path].shape
        assert target.transform(view).shape == (shape if target.layer is None else shape[1:]), name
        written.setdefault(target.path, set()).add(target.layer)
    assert skipped == {
        "vision_model.post_layernorm.weight",
        "vision_model.post_layernorm.bias",
        "visual_projection.weight",
    }
    assert set(written) == set(ours)
    for path, layers in written.items():
        stacked = path[:2] == ("encoder", "layers")
        assert layers == (set(range(real.num_hidden_layers)) if stacked else {None}), path
    assert sum(int(np.prod(x.shape)) for x in ours.values()) == sum(
        p.numel() for n, p in torch_model.named_parameters() if n not in skipped
    )
