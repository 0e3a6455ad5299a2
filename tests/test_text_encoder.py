"""UMT5 encoder and prompt tokenization vs transformers' UMT5EncoderModel and diffusers'
WanPipeline._get_t5_prompt_embeds (fp32, tiny random model, offline tokenizer)."""

from __future__ import annotations

import dataclasses
import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers.pipelines.wan.pipeline_wan import WanPipeline, prompt_clean
from flax import nnx
from transformers import AutoTokenizer, UMT5Config, UMT5EncoderModel
from transformers.models.umt5.modeling_umt5 import UMT5Attention

from wan.component_configs import TextEncoderConfig
from wan.models.text_encoder import UMT5Encoder, prompt_embeddings, relative_position_buckets
from wan.presets import PRESETS
from wan.tokenizer import TokenizerError, build_word_tokenizer, load_tokenizer, tokenize
from wan.weights import WeightError, flatten, import_folder, unflatten
from wan.weights.text_encoder import rule

CFG = PRESETS["tiny"].text_encoder
LENGTH = 24  # long enough for log-spaced relative position buckets (exact below 8)
PROMPTS = [
    "a golden  retriever dog running on the beach at sunset, cinematic shot &amp; wide view",
    "red car",
]


def umt5_config(cfg: TextEncoderConfig) -> UMT5Config:
    return UMT5Config(
        vocab_size=cfg.vocab_size, d_model=cfg.d_model, d_kv=cfg.d_kv, d_ff=cfg.d_ff,
        num_layers=cfg.num_layers, num_heads=cfg.num_heads,
        relative_attention_num_buckets=cfg.relative_attention_num_buckets,
        relative_attention_max_distance=cfg.relative_attention_max_distance,
        layer_norm_epsilon=cfg.layer_norm_epsilon, feed_forward_proj="gated-gelu", dropout_rate=0.0,
    )  # fmt: skip


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A random transformers encoder saved as safetensors, and our model loaded from it."""
    torch.manual_seed(0)
    model = UMT5EncoderModel(umt5_config(CFG)).eval()
    with torch.no_grad():  # norms and position biases away from their neutral init
        for name, param in model.named_parameters():
            if "layer_norm" in name:
                param.uniform_(0.5, 1.5)
            elif "relative_attention_bias" in name:
                param.normal_(0.0, 1.0)
    folder = tmp_path_factory.mktemp("text_encoder")
    model.save_pretrained(folder)

    graphdef, state = nnx.split(nnx.eval_shape(lambda: UMT5Encoder(CFG, rngs=nnx.Rngs(0))))
    expected = {p: (v.shape, v.dtype) for p, v in flatten(nnx.to_pure_dict(state)).items()}
    nnx.replace_by_pure_dict(state, unflatten(import_folder(folder, expected, rule)))
    encode = jax.jit(lambda st, ids, mask: nnx.merge(graphdef, st)(ids, mask))
    return model, lambda ids, mask: np.asarray(encode(state, ids, mask))


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    build_word_tokenizer(folder, vocab_size=CFG.vocab_size)
    return folder


@pytest.fixture(scope="module")
def tokenizer(tokenizer_folder):
    return load_tokenizer(tokenizer_folder)


@pytest.fixture(scope="module")
def hf_tokenizer(tokenizer_folder):
    """transformers' AutoTokenizer of the same folder: the reference (diffusers uses it)."""
    return AutoTokenizer.from_pretrained(tokenizer_folder, local_files_only=True)


def test_encoder_matches_transformers(reference, tokenizer):
    model, encode = reference
    ids, mask = tokenize(tokenizer, PROMPTS, max_length=LENGTH)
    lengths = mask.sum(1)
    assert lengths[0] > 16 and lengths[1] < 8, lengths  # padding differs between the prompts
    with torch.no_grad():
        want = model(torch.from_numpy(ids).long(), torch.from_numpy(mask).long()).last_hidden_state
    got = encode(ids, mask)
    assert got.shape == (2, LENGTH, CFG.d_model)
    np.testing.assert_allclose(got, want.numpy(), atol=1e-4, rtol=0)


def test_prompt_embeds_match_diffusers(reference, tokenizer, hf_tokenizer):
    """Tokenize + encode + prompt_embeddings == diffusers' WanPipeline._get_t5_prompt_embeds."""
    model, encode = reference
    pipe = types.SimpleNamespace(
        tokenizer=hf_tokenizer, text_encoder=model, _execution_device=torch.device("cpu")
    )
    with torch.no_grad():
        want = WanPipeline._get_t5_prompt_embeds(pipe, PROMPTS, max_sequence_length=LENGTH).numpy()
    ids, mask = tokenize(tokenizer, PROMPTS, max_length=LENGTH)
    got = np.asarray(prompt_embeddings(jnp.asarray(encode(ids, mask)), jnp.asarray(mask), LENGTH))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_prompt_embeddings_zeroes_beyond_length():
    out = jnp.asarray(np.random.default_rng(0).normal(size=(2, 6, 3)) + 5.0, jnp.float32)
    mask = jnp.asarray([[1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]], jnp.int32)
    got = np.asarray(prompt_embeddings(out, mask, max_length=8))
    assert got.shape == (2, 8, 3)
    for row, length in enumerate((4, 2)):
        np.testing.assert_array_equal(got[row, :length], np.asarray(out)[row, :length])
        assert not got[row, length:].any()
    assert prompt_embeddings(out, mask, max_length=4).shape == (2, 4, 3)


def test_relative_position_buckets_match_transformers():
    """Every relative distance of a 512-token prompt, at the real config's bucketing."""
    real = TextEncoderConfig()
    torch_config = umt5_config(dataclasses.replace(real, vocab_size=8, d_model=8, d_kv=2, d_ff=8))
    attention = UMT5Attention(torch_config, has_relative_attention_bias=True)
    position = torch.arange(real.max_length)
    want = attention._relative_position_bucket(position[None, :] - position[:, None])
    got = relative_position_buckets(
        real.max_length, real.relative_attention_num_buckets, real.relative_attention_max_distance
    )
    np.testing.assert_array_equal(np.asarray(got), want.numpy())


def tokenize_like_diffusers(tokenizer, hf_tokenizer, prompts, max_length):
    """Our ids and mask, asserted equal to what diffusers gets from transformers' tokenizer."""
    ids, mask = tokenize(tokenizer, prompts, max_length=max_length)
    want = hf_tokenizer(
        [prompt_clean(p) for p in prompts], padding="max_length", max_length=max_length,
        truncation=True, add_special_tokens=True, return_attention_mask=True, return_tensors="np",
    )  # fmt: skip
    np.testing.assert_array_equal(ids, want["input_ids"])
    np.testing.assert_array_equal(mask, want["attention_mask"])
    return ids, mask


def test_tokenize_like_diffusers(tokenizer, hf_tokenizer):
    prompts = [" a  cat\n\ton the &amp;amp; street  ", "dog " * 40, "", "Ünïcode ~ {x} 42!"]
    ids, mask = tokenize_like_diffusers(tokenizer, hf_tokenizer, prompts, max_length=16)
    assert ids.dtype == mask.dtype == np.int32 and ids.shape == mask.shape == (4, 16)
    lengths = mask.sum(1)
    # truncated; the empty prompt is just </s>
    assert lengths[1] == 16 and lengths[2] == 1 and lengths[3] > 5
    for row, length in enumerate(lengths):
        assert ids[row, length - 1] == hf_tokenizer.eos_token_id == 1
        assert (ids[row, length:] == hf_tokenizer.pad_token_id).all()
    assert hf_tokenizer.pad_token_id == 0
    assert hf_tokenizer.convert_ids_to_tokens(ids[0, :5].tolist()) == [
        "▁a",
        "▁cat",
        "▁on",
        "▁the",
        "▁",
    ]


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(TokenizerError, match="does not exist"):
        load_tokenizer(tmp_path / "missing")
    with pytest.raises(TokenizerError, match="cannot load a tokenizer") as error:
        load_tokenizer(tmp_path)
    assert "\n" not in str(error.value)


def test_a_folder_without_tokenizer_json_loads_through_transformers(tmp_path):
    """A sentencepiece `spiece.model` and its config only (older T5/UMT5 folders): loaded
    through transformers, tokenized exactly as its AutoTokenizer does."""
    import sentencepiece

    corpus = ["a red cat running in the rain", "dog on the street", "the quick brown fox"]
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus * 20), model_prefix=str(tmp_path / "spiece"),
        vocab_size=24, pad_id=0, eos_id=1, unk_id=2, bos_id=-1, minloglevel=2,
    )  # fmt: skip
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "T5Tokenizer", "pad_token": "<pad>", "extra_ids": 0})
    )
    assert not (tmp_path / "tokenizer.json").exists()
    prompts = ["a red cat in the rain", "the fox " * 10, ""]
    hf = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    ids, mask = tokenize_like_diffusers(load_tokenizer(tmp_path), hf, prompts, max_length=12)
    assert mask[2].sum() == 1 and ids[2, 0] == 1  # the empty prompt is just </s>


def test_rule_rejects_unknown_tensor():
    with pytest.raises(WeightError, match="decoder"):
        rule("decoder.block.0.layer.0.SelfAttention.q.weight")


def test_real_config_shapes_and_param_count():
    """The UMT5-XXL encoder: abstract (nothing allocated), same parameter count as transformers,
    and every transformers tensor lands on a parameter of its shape (checked on zero-byte views)."""
    real = TextEncoderConfig()
    abstract = nnx.eval_shape(
        lambda: UMT5Encoder(real, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    )
    state = nnx.state(abstract)
    leaves = jax.tree.leaves(state)
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    ours = flatten(nnx.to_pure_dict(state))
    assert ours["block", "attention", "q", "kernel"].shape == (24, 4096, 4096)
    assert nnx.get_partition_spec(state)["block"]["ffn"]["wo"]["kernel"].get_value() == (
        jax.sharding.PartitionSpec("layers", "mlp", "embed")
    )

    with torch.device("meta"):
        torch_model = UMT5EncoderModel(umt5_config(real))
    assert sum(int(np.prod(x.shape)) for x in leaves) == sum(
        p.numel() for p in torch_model.parameters()
    )
    written: dict[tuple[str, ...], set[int | None]] = {}
    for name, tensor in torch_model.state_dict().items():
        target = rule(name)
        view = np.broadcast_to(np.zeros((), np.float32), tuple(tensor.shape))
        shape = ours[target.path].shape
        assert target.transform(view).shape == (shape if target.layer is None else shape[1:]), name
        written.setdefault(target.path, set()).add(target.layer)
    assert set(written) == set(ours)
