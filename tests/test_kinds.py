"""Component kinds (`wan.kinds`) and strict configs (`wan.configs`).

The registry's answers for today's kinds; unknown kinds as one-line errors; the latent geometry
of every preset as before kinds existed (shapes, tokens and hashes); diffusers folders read
strictly (every key understood, implemented as configured, or declared a no-op); and a toy VAE
kind, added here by one `register` call, built and run end to end.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path
from typing import Any, ClassVar

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_SHAPE, run_cli, save_tiny_diffusers_pipeline
from flax import nnx
from safetensors.numpy import save_file

from wan import checkpoint, kinds, programs, weights
from wan.component_configs import (
    WAN21_LATENTS_MEAN,
    WAN21_LATENTS_STD,
    WAN22_LATENTS_MEAN,
    WAN22_LATENTS_STD,
    TextEncoderConfig,
    TransformerConfig,
    VAE22Config,
    VAEConfig,
    VAEKindConfig,
)
from wan.configs import CHECKPOINT_MARKER, NO_OP_KEYS, ModelConfig, VideoShape, WeightError
from wan.models.text_encoder import UMT5Encoder
from wan.models.transformer import WanTransformer
from wan.models.vae import WanVAE
from wan.models.vae22 import WanVAE22
from wan.presets import PRESETS
from wan.random_weights import write_random_checkpoint
from wan.weights import text_encoder as text_encoder_rules
from wan.weights import transformer as transformer_rules
from wan.weights import vae as vae_rules

TINY = PRESETS["tiny"]

# ----------------------------------------------------------------------------------------------
# The registry.


def test_registry_answers_for_todays_kinds():
    expected = {
        ("transformer", "per_video"): (TransformerConfig, WanTransformer, transformer_rules.rule),
        ("vae", "wan2.1"): (VAEConfig, WanVAE, vae_rules.rule),
        ("text_encoder", "umt5"): (TextEncoderConfig, UMT5Encoder, text_encoder_rules.rule),
    }
    assert set(expected) <= set(kinds.REGISTRY)  # (and the toy kind while its tests run)
    for (component, name), (config, module, rule) in expected.items():
        kind = kinds.lookup(component, name)
        assert kinds.default(component) == name == config.kind
        assert (kind.config_class, kind.module_factory, kind.weight_rule) == (config, module, rule)
    assert kinds.of(TINY.vae).latent(TINY.vae) == kinds.LatentGeometry(16, 4, 8)
    assert kinds.of(TINY.transformer).patch(TINY.transformer) == (1, 2, 2)
    assert kinds.part(TINY, "transformer_2") is TINY.transformer
    assert kinds.lookup("vae", "wan2.1").param_dtype == "float32"
    wan22 = kinds.lookup("vae", "wan2.2")  # TI2V-5B's: not the default, claimed by its keys
    assert (wan22.config_class, wan22.module_factory, wan22.weight_rule) == (
        VAE22Config,
        WanVAE22,
        vae_rules.rule,
    )
    assert kinds.of_raw("vae", {"is_residual": True}) is wan22
    assert kinds.of_raw("vae", {"is_residual": False}) is kinds.lookup("vae", "wan2.1")


def _changed(of: str, **changes: Any) -> kinds.ComponentKind:
    return dataclasses.replace(kinds.lookup(of, kinds.default(of)), **changes)


@pytest.mark.parametrize(
    ("call", "phrase"),
    [
        (lambda: kinds.lookup("vae", "wan3"), "vae kind 'wan3' is not one this project has"),
        (lambda: kinds.lookup("vae", ["wan2.1"]), "vae kind ['wan2.1'] is not one"),
        (lambda: kinds.part(TINY, "unet"), "unknown component 'unet'"),
        (lambda: programs.make_module(TINY, "unet"), "unknown component 'unet'"),
        (lambda: kinds.register(kinds.lookup("vae", "wan2.1")), "already registered"),
        (lambda: kinds.register(_changed("vae", name="x", latent=None)),
         "latent geometry is for VAE kinds"),
        (lambda: kinds.register(_changed("text_encoder", component="unet")),
         "component 'unet' is not one of"),
    ],
)  # fmt: skip
def test_unknown_kinds_are_one_line_errors(call, phrase):
    with pytest.raises(kinds.KindError, match=re.escape(phrase)) as error:
        call()
    assert "\n" not in str(error.value)
    assert ("vae", "x") not in kinds.REGISTRY and ("unet", "umt5") not in kinds.REGISTRY


def test_config_naming_an_unknown_kind(tmp_path):
    raw = TINY.to_dict()
    raw["vae"]["kind"] = "wan3"
    (tmp_path / CHECKPOINT_MARKER).write_text(json.dumps({"model": raw}))
    with pytest.raises(WeightError, match=r"vae: vae kind 'wan3' is not one this project has"):
        ModelConfig.from_folder(tmp_path)


# Recorded before kinds existed: configs written then keep their hash, builds and weights match.
HASHES = {
    "tiny": "8941b255c2263f62",
    "small": "1bbabebeb33d38bf",
    "wan2.1-t2v-1.3b": "16d0b5346437a470",
    "wan2.1-t2v-14b": "7775bd90ba1bb590",
    "wan2.2-t2v-a14b": "e600d8d4c560f363",
}


@pytest.mark.parametrize("preset", list(HASHES))
def test_geometry_and_hash_as_before_kinds(preset):
    config = PRESETS[preset]
    assert config.hash() == HASHES[preset]
    assert "kind" not in config.to_dict()["vae"]  # default kinds are not written
    assert (config.vae.spatial_factor, config.vae.temporal_factor) == (8, 4)
    cases = {  # (width, height, frames, batch) -> (latent shape, tokens)
        (832, 480, 81, 1): ((1, 21, 60, 104, 16), 32760),
        (1280, 720, 81, 2): ((2, 21, 90, 160, 16), 75600),
        (192, 320, 9, 1): ((1, 3, 40, 24, 16), 720),
    }
    for (width, height, frames, batch), (latents, tokens) in cases.items():
        shape = VideoShape(width, height, frames, batch)
        assert shape.latent_shape(config) == latents
        assert shape.tokens(config) == tokens


# ----------------------------------------------------------------------------------------------
# Strict configs.

# The configs of diffusers' Wan folders (Wan-AI/Wan2.1-T2V-1.3B-Diffusers, -14B-Diffusers and
# Wan2.2-T2V-A14B-Diffusers), keys as they hold them; the tiny folder below adds what a newer
# diffusers and transformers write.
UMT5_XXL = {
    "_name_or_path": "google/umt5-xxl", "architectures": ["UMT5EncoderModel"],
    "classifier_dropout": 0.0, "d_ff": 10240, "d_kv": 64, "d_model": 4096,
    "decoder_start_token_id": 0, "dense_act_fn": "gelu_new", "dropout_rate": 0.1,
    "eos_token_id": 1, "feed_forward_proj": "gated-gelu", "initializer_factor": 1.0,
    "is_encoder_decoder": True, "is_gated_act": True, "layer_norm_epsilon": 1e-06,
    "model_type": "umt5", "num_decoder_layers": 24, "num_heads": 64, "num_layers": 24,
    "output_past": True, "pad_token_id": 0, "relative_attention_max_distance": 128,
    "relative_attention_num_buckets": 32, "scalable_attention": True,
    "tie_word_embeddings": False, "tokenizer_class": "T5Tokenizer", "torch_dtype": "float32",
    "transformers_version": "4.48.0.dev0", "use_cache": True, "vocab_size": 256384,
}  # fmt: skip
WAN21_VAE = {
    "_class_name": "AutoencoderKLWan", "_diffusers_version": "0.33.0.dev0", "attn_scales": [],
    "base_dim": 96, "dim_mult": [1, 2, 4, 4], "dropout": 0.0,
    "latents_mean": list(WAN21_LATENTS_MEAN), "latents_std": list(WAN21_LATENTS_STD),
    "num_res_blocks": 2, "temperal_downsample": [False, True, True], "z_dim": 16,
}  # fmt: skip
WAN22_A14B_VAE = {
    **WAN21_VAE, "_diffusers_version": "0.35.0.dev0", "decoder_base_dim": None,
    "in_channels": 3, "is_residual": False, "out_channels": 3, "patch_size": None,
    "scale_factor_spatial": 8, "scale_factor_temporal": 4,
}  # fmt: skip
UNIPC = {
    "_class_name": "UniPCMultistepScheduler", "_diffusers_version": "0.33.0.dev0",
    "beta_end": 0.02, "beta_schedule": "linear", "beta_start": 0.0001, "disable_corrector": [],
    "dynamic_thresholding_ratio": 0.995, "final_sigmas_type": "zero", "flow_shift": 3.0,
    "lower_order_final": True, "num_train_timesteps": 1000, "predict_x0": True,
    "prediction_type": "flow_prediction", "rescale_betas_zero_snr": False,
    "sample_max_value": 1.0, "solver_order": 2, "solver_p": None, "solver_type": "bh2",
    "steps_offset": 0, "thresholding": False, "timestep_spacing": "linspace",
    "trained_betas": None, "use_beta_sigmas": False, "use_exponential_sigmas": False,
    "use_flow_sigmas": True, "use_karras_sigmas": False,
}  # fmt: skip


def _transformer(heads: int, ffn: int, layers: int, **extra: Any) -> dict[str, Any]:
    return {
        "_class_name": "WanTransformer3DModel", "_diffusers_version": "0.33.0.dev0",
        "added_kv_proj_dim": None, "attention_head_dim": 128, "cross_attn_norm": True,
        "eps": 1e-06, "ffn_dim": ffn, "freq_dim": 256, "image_dim": None, "in_channels": 16,
        "num_attention_heads": heads, "num_layers": layers, "out_channels": 16,
        "patch_size": [1, 2, 2], "qk_norm": "rms_norm_across_heads", "rope_max_seq_len": 1024,
        "text_dim": 4096, **extra,
    }  # fmt: skip


def _index(**extra: Any) -> dict[str, Any]:
    return {
        "_class_name": "WanPipeline", "_diffusers_version": "0.33.0.dev0",
        "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "WanTransformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLWan"], **extra,
    }  # fmt: skip


A14B_EXTRA = {"pos_embed_seq_len": None, "_diffusers_version": "0.35.0.dev0"}
TI2V_5B_VAE = {
    **WAN22_A14B_VAE, "base_dim": 160, "decoder_base_dim": 256, "in_channels": 12,
    "is_residual": True, "out_channels": 12, "patch_size": 2, "scale_factor_spatial": 16,
    "z_dim": 48, "latents_mean": list(WAN22_LATENTS_MEAN), "latents_std": list(WAN22_LATENTS_STD),
}  # fmt: skip
REAL_FOLDERS = {
    "wan2.1-t2v-1.3b": (_index(), _transformer(12, 8960, 30), WAN21_VAE, UMT5_XXL, UNIPC),
    "wan2.1-t2v-14b": (_index(), _transformer(40, 13824, 40), WAN21_VAE, UMT5_XXL, UNIPC),
    "wan2.2-t2v-a14b": (
        _index(boundary_ratio=0.875, expand_timesteps=False,
               transformer_2=["diffusers", "WanTransformer3DModel"]),
        _transformer(40, 13824, 40, **A14B_EXTRA), WAN22_A14B_VAE, UMT5_XXL,
        {**UNIPC, "flow_shift": 12.0, "time_shift_type": "exponential", "sigma_min": None,
         "sigma_max": None, "shift_terminal": None, "use_dynamic_shifting": False},
    ),
    "wan2.2-ti2v-5b": (
        _index(boundary_ratio=None, expand_timesteps=True, transformer_2=[None, None]),
        _transformer(24, 14336, 30, in_channels=48, out_channels=48, **A14B_EXTRA),
        TI2V_5B_VAE, UMT5_XXL, {**UNIPC, "flow_shift": 5.0},
    ),
}  # fmt: skip


def write_configs(root: Path, index, transformer, vae, text_encoder, scheduler) -> Path:
    """A diffusers-format folder's JSON files (no weights: read with an explicit dtype)."""
    files = {"model_index.json": index, "transformer/config.json": transformer,
             "vae/config.json": vae, "text_encoder/config.json": text_encoder,
             "scheduler/scheduler_config.json": scheduler}  # fmt: skip
    if "transformer_2" in index:
        files["transformer_2/config.json"] = transformer
    for name, content in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(json.dumps(content))
    return root


@pytest.mark.parametrize("preset", list(REAL_FOLDERS))
def test_real_diffusers_configs_read_as_the_presets(tmp_path, preset):
    folder = write_configs(tmp_path / preset, *REAL_FOLDERS[preset])
    config = ModelConfig.from_diffusers(folder, dtype="bfloat16")
    want = PRESETS[preset]
    assert (config.transformer, config.vae, config.text_encoder) == (
        want.transformer,
        want.vae,
        want.text_encoder,
    )
    assert config.boundary_ratio == want.boundary_ratio
    assert config.scheduler.flow_shift == REAL_FOLDERS[preset][4]["flow_shift"]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    """The tests' tiny diffusers WanPipeline (configs as the installed diffusers writes them)."""
    folder = tmp_path_factory.mktemp("kinds") / "tiny-diffusers"
    save_tiny_diffusers_pipeline(folder, two_experts=True)
    return folder


def _edited(tiny_folder: Path, tmp_path: Path, file: str, edit) -> Path:
    """A copy of the tiny folder with `file`'s JSON edited in place by `edit`."""
    folder = shutil.copytree(tiny_folder, tmp_path / "model")
    raw = json.loads((folder / file).read_text())
    edit(raw)
    (folder / file).write_text(json.dumps(raw))
    return folder


def test_tiny_folder_reads_as_the_tiny_preset(tiny_folder):
    config = ModelConfig.from_folder(tiny_folder)
    assert (config.transformer, config.vae, config.text_encoder) == (
        TINY.transformer,
        TINY.vae,
        TINY.text_encoder,
    )
    assert config.boundary_ratio == 0.9 and config.scheduler.flow_shift == 3.0


FILES = {  # the file of each part, and the component its errors name
    "transformer": "transformer/config.json",
    "transformer_2": "transformer_2/config.json",
    "vae": "vae/config.json",
    "text_encoder": "text_encoder/config.json",
    "scheduler": "scheduler/scheduler_config.json",
}


@pytest.mark.parametrize("part", [*FILES, "model_index"])
def test_unknown_key_is_named_with_its_component_and_file(tiny_folder, tmp_path, part):
    file = FILES.get(part, "model_index.json")
    folder = _edited(tiny_folder, tmp_path, file, lambda raw: raw.update(use_fancy_upsampler=True))
    with pytest.raises(WeightError) as error:
        ModelConfig.from_folder(folder)
    message = str(error.value)
    assert message.startswith(f"{folder / file}: ") and "\n" not in message
    assert "use_fancy_upsampler is a key this project does not understand" in message
    assert part == "model_index" or f": {part}: use_fancy_upsampler" in message


def test_no_op_keys_pass(tiny_folder, tmp_path):
    def add_all(raw: dict) -> None:
        raw.update({key: "anything" for key in NO_OP_KEYS if key not in raw})

    folder = shutil.copytree(tiny_folder, tmp_path / "model")
    for file in (*FILES.values(), "model_index.json"):
        raw = json.loads((folder / file).read_text())
        add_all(raw)
        (folder / file).write_text(json.dumps(raw))
    assert ModelConfig.from_folder(folder).hash() == ModelConfig.from_folder(tiny_folder).hash()


def test_a_vae_of_another_model_is_refused(tiny_folder, tmp_path):
    """TI2V-5B's VAE config under the tiny 16-channel transformer: read as the Wan 2.2 kind,
    then refused as a pair that cannot run together."""
    folder = _edited(tiny_folder, tmp_path, "vae/config.json", lambda r: r.update(TI2V_5B_VAE))
    with pytest.raises(WeightError) as error:
        ModelConfig.from_folder(folder)
    assert "transformer: in_channels 16 and out_channels 16, but the wan2.2 VAE's latents " in str(
        error.value
    )
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("file", "edit", "phrase"),
    [
        ("vae/config.json", lambda r: r.update(decoder_base_dim=256),
         "vae: decoder_base_dim is 256, this project implements only null or 8"),
        ("vae/config.json", lambda r: r.update(is_residual=True, patch_size=2),
         "vae: out_channels is 3, expected a multiple of the 4 pixels of a 2x2 patch"),
        ("vae/config.json", lambda r: r.update(is_residual=True, patch_size="2"),
         'vae: patch_size is "2", expected an integer'),
        ("vae/config.json", lambda r: r.update(patch_size=2), "patch_size is 2"),
        ("vae/config.json", lambda r: r.update(scale_factor_spatial=16),
         "scale_factor_spatial is 16, this project implements only 8"),
        ("model_index.json", lambda r: r.update(expand_timesteps="yes"),
         'expand_timesteps is "yes", this project implements only false or true'),
        ("model_index.json", lambda r: r.update(vae=["diffusers", "AutoencoderKLQwenImage"]),
         "reads a AutoencoderKLWan only"),
        ("transformer/config.json", lambda r: r.update(image_dim=1280),
         "image_dim and added_kv_proj_dim are set together"),
        ("transformer/config.json", lambda r: r.update(pos_embed_seq_len=514),
         "pos_embed_seq_len is set but image_dim is not"),
        ("transformer/config.json", lambda r: r.update(qk_norm="rms_norm"),
         'qk_norm is "rms_norm"; the per_video transformer implements only'),
        ("text_encoder/config.json", lambda r: r.update(model_type="t5"), 'model_type is "t5"'),
        ("text_encoder/config.json", lambda r: r.update(feed_forward_proj="relu"),
         'feed_forward_proj is "relu"'),
        ("scheduler/scheduler_config.json", lambda r: r.update(prediction_type="epsilon"),
         'scheduler: prediction_type is "epsilon", this project implements only "flow_prediction"'),
        ("scheduler/scheduler_config.json", lambda r: r.update(use_flow_sigmas=False),
         "use_flow_sigmas is false"),
        ("scheduler/scheduler_config.json", lambda r: r.update(solver_type="bh1"),
         'solver_type is "bh1"'),
        ("scheduler/scheduler_config.json", lambda r: r.update(final_sigmas_type="sigma_min"),
         'final_sigmas_type is "sigma_min"'),
        ("scheduler/scheduler_config.json", lambda r: r.update(_class_name="DDIMScheduler"),
         '_class_name is "DDIMScheduler", expected one of UniPCMultistepScheduler'),
    ],
)  # fmt: skip
def test_unsupported_values_are_refused(tiny_folder, tmp_path, file, edit, phrase):
    folder = _edited(tiny_folder, tmp_path, file, edit)
    with pytest.raises(WeightError) as error:
        ModelConfig.from_folder(folder)
    assert phrase in str(error.value) and str(folder / file) in str(error.value)
    assert "\n" not in str(error.value)


def test_euler_scheduler_folder():
    from wan.configs import SchedulerConfig

    raw = {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0,
           "num_train_timesteps": 1000, "use_dynamic_shifting": False, "base_shift": 0.5}  # fmt: skip
    assert SchedulerConfig.from_diffusers(raw) == SchedulerConfig("euler", 1000, 3.0, 2)
    with pytest.raises(WeightError, match="stochastic_sampling is true"):
        SchedulerConfig.from_diffusers({**raw, "stochastic_sampling": True})


def test_checkpoint_config_is_strict(tmp_path):
    for edit, phrase in (
        (lambda m: m["vae"].update(use_fancy_upsampler=True), "vae: use_fancy_upsampler is a key"),
        (lambda m: m["scheduler"].update(extra=1), "scheduler: extra is a key"),
        (lambda m: m.update(vae_kind="wan2.1"), "vae_kind is a key"),
    ):
        raw = TINY.to_dict()
        edit(raw)
        (tmp_path / CHECKPOINT_MARKER).write_text(json.dumps({"format": 2, "model": raw}))
        with pytest.raises(WeightError, match=phrase) as error:
            ModelConfig.from_folder(tmp_path)
        assert str(error.value).startswith(str(tmp_path / CHECKPOINT_MARKER))


def test_aot_build_refuses_an_unknown_vae_key(tiny_folder, tmp_path):
    folder = _edited(
        tiny_folder, tmp_path, "vae/config.json", lambda raw: raw.update(use_fancy_upsampler=True)
    )
    out = tmp_path / "out"
    result = run_cli("aot", "build", "--model", str(folder), *TINY_SHAPE, "--target", "cpu-8",
                     "--out", str(out), check=False)  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "vae/config.json: vae: use_fancy_upsampler is a key" in line
    assert not out.exists() or not any(out.iterdir())


def test_aot_build_of_a_diffusers_folder_with_no_op_keys(tiny_folder, tmp_path):
    folder = _edited(
        tiny_folder,
        tmp_path,
        "vae/config.json",
        lambda raw: raw.update(gradient_checkpointing=True),
    )
    out = tmp_path / "out"
    run_cli("aot", "build", "--model", str(folder), *TINY_SHAPE, "--target", "cpu-8",
            "--out", str(out))  # fmt: skip
    (build,) = [p for p in out.iterdir() if p.name.startswith("model_64x128_f9_b1_")]
    assert json.loads((build / "manifest.json").read_text())["model_hash"] == (
        ModelConfig.from_folder(tiny_folder).hash()
    )


# ----------------------------------------------------------------------------------------------
# A toy VAE kind, added in one place: a linear decoder with its own geometry.


@dataclasses.dataclass(frozen=True)
class ToyVAEConfig(VAEKindConfig):
    kind: ClassVar[str] = "toy"

    z_dim: int = 16
    temporal: int = 4
    spatial: int = 16  # twice the Wan 2.1 VAE's
    latents_mean: tuple[float, ...] = (0.0,) * 16
    latents_std: tuple[float, ...] = (1.0,) * 16


class ToyDecoder(nnx.Module):
    """Each latent pixel -> `temporal` frames of `spatial` x `spatial` pixels, one linear map."""

    def __init__(self, config: ToyVAEConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.config, self.dtype = config, dtype
        g = config.geometry
        out = g.temporal * g.spatial**2 * 3
        self.proj = nnx.Linear(g.channels, out, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def decode(self, z: jnp.ndarray) -> jnp.ndarray:
        b, t, h, w, _ = z.shape
        g = self.config.geometry
        x = self.proj(z).reshape(b, t, h, w, g.temporal, g.spatial, g.spatial, 3)
        x = x.transpose(0, 1, 4, 2, 5, 3, 6, 7)
        x = x.reshape(b, t * g.temporal, h * g.spatial, w * g.spatial, 3)
        return jnp.tanh(x[:, g.temporal - 1 :])  # the first latent frame is one frame


def toy_rule(name: str) -> weights.Target:
    if name == "proj.weight":
        return weights.Target(("proj", "kernel"), transform=weights.linear)
    if name == "proj.bias":
        return weights.Target(("proj", "bias"))
    raise WeightError(f"unexpected toy VAE tensor {name}")


TOY = kinds.ComponentKind(
    component="vae",
    name="toy",
    config=ToyVAEConfig,
    module=ToyDecoder,
    rule=toy_rule,
    latent=lambda c: kinds.LatentGeometry(c.z_dim, c.temporal, c.spatial),
)
TOY_MODEL = dataclasses.replace(TINY, name="tiny-toy", vae=ToyVAEConfig())
TOY_SHAPE = VideoShape(width=256, height=128, frames=9, batch=1)


@pytest.fixture(scope="module")
def toy_kind():
    kinds.register(TOY)
    yield TOY
    del kinds.REGISTRY["vae", "toy"]


def test_toy_kind_config_module_and_checkpoint(toy_kind, tmp_path):
    assert TOY_SHAPE.latent_shape(TOY_MODEL) == (1, 3, 8, 16, 16)  # 16x in space, not 8x
    assert TOY_MODEL.to_dict()["vae"]["kind"] == "toy"
    assert TOY_MODEL.hash() != TINY.hash()
    _, params, _ = programs.split_abstract(programs.abstract_module(TOY_MODEL, "vae"))
    assert weights.flatten(params)[("proj", "kernel")].shape == (16, 4 * 16 * 16 * 3)
    assert weights.flatten(params)[("proj", "kernel")].dtype == jnp.float32  # param_dtype: model's
    folder = write_random_checkpoint(TOY_MODEL, tmp_path / "ckpt")
    assert ModelConfig.from_folder(folder) == TOY_MODEL
    # A diffusers-format VAE folder of the toy kind imports through its rule.
    diffusers = tmp_path / "diffusers"
    (diffusers / "vae").mkdir(parents=True)
    (diffusers / "vae" / "config.json").write_text(json.dumps(TOY_MODEL.to_dict()["vae"]))
    kernel = np.arange(3072 * 16, dtype=np.float32).reshape(3072, 16)  # torch Linear (out, in)
    save_file({"proj.weight": kernel, "proj.bias": np.zeros(3072, np.float32)},
              diffusers / "vae" / "diffusion_pytorch_model.safetensors")  # fmt: skip
    loaded = checkpoint.load_component(diffusers, "vae", params)
    np.testing.assert_array_equal(np.asarray(loaded["proj"]["kernel"]), kernel.T)


def test_toy_kind_builds_and_runs(toy_kind, tmp_path):
    from aot.building.build import build
    from aot.building.plan import plan_build
    from aot.targets import parse_target
    from runtime.generation.pipeline import Pipeline

    weights_folder = write_random_checkpoint(TOY_MODEL, tmp_path / "weights")
    plan = plan_build("tiny-toy", TOY_MODEL, TOY_SHAPE, parse_target("cpu-8"), 8)
    result = build(plan, tmp_path / "out")
    assert result.manifest.model_hash == TOY_MODEL.hash()
    # Its code is no file of the project's: no digest vouches for its programs (a later
    # `aot build` lowers them to find the build up to date).
    assert result.manifest.lowering_digest is None
    pipe = Pipeline.from_build(result.folder, result.manifest, weights_folder, TOY_MODEL)
    frames, report = pipe.generate("a cat", steps=2, seed=0)
    assert frames.shape == (1, 9, 128, 256, 3) and frames.dtype == np.uint8
    assert report.compile_count == 0 and np.ptp(frames) > 0
