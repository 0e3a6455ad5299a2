"""LoRAs on the image-to-video transformers: Wan 2.1 I2V's (image features: every block's
`attn2.add_k_proj`, `add_v_proj`, `norm_added_k`, and the image embedder; 36 input channels) and
Wan 2.2 I2V-A14B's (36 input channels, no image features, two experts).

The files are made here offline, on the tiny random pipelines of tests/test_i2v.py, in the
formats people use: diffusers/PEFT (a PEFT LoraConfig on the diffusers transformer, saved by
diffusers' save_lora_weights), ComfyUI and kohya/musubi (the original Wan module names: k_img,
v_img, norm_k_img, img_emb.proj.N), and lightx2v's distill-LoRA layout. Each is merged on the
real loading path (the transformer's parameter shapes, `wan.lora.prepare`, the weight import
with the updates merged on the way; the Wan 2.2 pair through `Pipeline.assemble` of a compiled
build) and compared with a reference: diffusers' own loading and PEFT's merge (fuse_lora), or,
for what diffusers does not read (norm and modulation deltas), the merge computed here from the
same tensors on the diffusers state dict.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from conftest import save_tiny_i2v_pipeline
from diffusers import WanImageToVideoPipeline, WanTransformer3DModel
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from safetensors.torch import save_file as save_torch_file
from test_lora import RANK, save_comfyui, save_peft, split_key

from aot.building.lower import compile_in_process
from aot.building.plan import plan_build
from aot.targets import parse_target
from runtime.generation.pipeline import Pipeline
from wan import checkpoint, interface, lora, programs, weights
from wan.configs import ModelConfig, VideoShape

# peft warns of every 1-D lora_B.bias (lora_bias=True) as of a sharded save.
pytestmark = pytest.mark.filterwarnings("ignore:Adapter 'default'")
ATOL = 1e-5  # float32 merges of O(1) weights, summed in another order
# The original Wan names of the I2V transformer's modules -> diffusers', written out here (not
# read from wan.weights.transformer) so that the reference merges do not share its mapping.
BLOCK = {
    "self_attn.q": "attn1.to_q", "self_attn.k": "attn1.to_k", "self_attn.v": "attn1.to_v",
    "self_attn.o": "attn1.to_out.0", "self_attn.norm_q": "attn1.norm_q",
    "self_attn.norm_k": "attn1.norm_k", "cross_attn.q": "attn2.to_q", "cross_attn.k": "attn2.to_k",
    "cross_attn.v": "attn2.to_v", "cross_attn.o": "attn2.to_out.0",
    "cross_attn.norm_q": "attn2.norm_q", "cross_attn.norm_k": "attn2.norm_k",
    "cross_attn.k_img": "attn2.add_k_proj", "cross_attn.v_img": "attn2.add_v_proj",
    "cross_attn.norm_k_img": "attn2.norm_added_k", "norm3": "norm2", "ffn.0": "ffn.net.0.proj",
    "ffn.2": "ffn.net.2", "modulation": "scale_shift_table",
}  # fmt: skip
TOP = {
    "patch_embedding": "patch_embedding",
    "text_embedding.0": "condition_embedder.text_embedder.linear_1",
    "text_embedding.2": "condition_embedder.text_embedder.linear_2",
    "time_embedding.0": "condition_embedder.time_embedder.linear_1",
    "time_embedding.2": "condition_embedder.time_embedder.linear_2",
    "time_projection.1": "condition_embedder.time_proj",
    "head.head": "proj_out",
    "head.modulation": "scale_shift_table",
    "img_emb.proj.0": "condition_embedder.image_embedder.norm1",
    "img_emb.proj.1": "condition_embedder.image_embedder.ff.net.0.proj",
    "img_emb.proj.3": "condition_embedder.image_embedder.ff.net.2",
    "img_emb.proj.4": "condition_embedder.image_embedder.norm2",
}
# The Linears a PEFT LoRA adapts here (peft target_modules): the image cross-attention's own
# projections and the image embedder's among them.
PEFT_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_k_proj", "add_v_proj", "ffn.net.0.proj",
                "ffn.net.2", "image_embedder.ff.net.0.proj", "image_embedder.ff.net.2",
                "proj_out", "time_proj"]  # fmt: skip
# A Wan 2.2 A14B model's: no image modules; the blocks' only (the Lightning LoRAs' targets).
BLOCK_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"]
# lightx2v's tools/extract/lora_extractor.py (which makes its distill LoRAs from the distilled
# and the base models' difference) decomposes a 2-D weight of 1M parameters or more into
# lora_down/lora_up of the rank (no alpha: the scale is 1) and keeps everything else as full
# deltas: `.diff` (a weight), `.diff_b` (a bias), `.diff_m` (a raw `modulation` table,
# `blocks.N.diff_m`, `head.diff_m`), each key prefixed `diffusion_model.`. In the 14B I2V
# model (width 5120, ffn 13824, text 4096, frequencies 256, image 1280) these are the
# low-rank ones; the head (64 x 5120), the patch embedding (5120 x 36 x 1 x 2 x 2), the norms,
# the biases and the modulation tables are full deltas.
LIGHTX2V_LOW_RANK = {
    *(f"self_attn.{m}" for m in "qkvo"), *(f"cross_attn.{m}" for m in "qkvo"),
    "cross_attn.k_img", "cross_attn.v_img", "ffn.0", "ffn.2", "text_embedding.0",
    "text_embedding.2", "time_embedding.0", "time_embedding.2", "time_projection.1",
    "img_emb.proj.1", "img_emb.proj.3",
}  # fmt: skip
LIGHTX2V_RANK = 4  # the file's is 64


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    """The tiny Wan 2.1 I2V pipeline (image features) and the Wan 2.2 I2V-A14B one (two
    experts, none), saved as diffusers folders."""
    root = tmp_path_factory.mktemp("lora_i2v")
    out = {}
    for name, clip in (("wan21", True), ("a14b", False)):
        save_tiny_i2v_pipeline(root / name, clip=clip)
        out[name] = root / name
    return out


def _config(folder) -> ModelConfig:
    return ModelConfig.from_diffusers(folder, dtype="float32")


def _shapes(config: ModelConfig) -> dict:
    """The transformer's parameter shapes as a build has them (its programs' `params`)."""
    _, params, _ = programs.split_abstract(programs.abstract_module(config, "transformer"))
    return {p: a.shape for p, a in weights.flatten(params).items()}


def _abstract(config: ModelConfig) -> dict:
    """The transformer's abstract parameters, placed on one device."""
    _, params, _ = programs.split_abstract(programs.abstract_module(config, "transformer"))
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), params)


def _load(folder, config: ModelConfig, specs=(), component: str = "transformer") -> dict:
    """Component `component` of `folder` as the runtime loads it (imported, placed), with the
    LoRAs `specs` merged on the way; flat, on the host."""
    deltas, _ = lora.prepare(specs, _shapes(config), component, kind=config.transformer.kind)
    placed = checkpoint.load_component(folder, component, _abstract(config), deltas)
    return {p: np.asarray(v) for p, v in weights.flatten(placed).items()}


def _saved(model: WanTransformer3DModel, folder, name: str = "transformer"):
    """`model` saved as component `name` of a diffusers folder (what the weight import reads)."""
    model.save_pretrained(folder / name)
    return folder


def _max_error(got: dict, want: dict) -> float:
    assert set(got) == set(want)
    return max(float(np.abs(got[p] - want[p]).max()) for p in got)


def _assert_close(got: dict, want: dict) -> float:
    for p in want:
        np.testing.assert_allclose(got[p], want[p], rtol=0, atol=ATOL, err_msg=str(p))
    return _max_error(got, want)


def _changed(a: dict, b: dict) -> set:
    return {p for p in a if not np.array_equal(a[p], b[p])}


# ----------------------------------------------------------------------------------------------
# Key names.


@pytest.mark.parametrize(
    ("key", "fmt", "expected"),
    [
        ("transformer.blocks.1.attn2.add_k_proj.lora_A.weight", "diffusers", ("blocks.1.attn2.add_k_proj", "down")),
        ("diffusion_model.blocks.0.cross_attn.k_img.lora_down.weight", "comfyui", ("blocks.0.attn2.add_k_proj", "down")),
        ("diffusion_model.blocks.1.cross_attn.v_img.alpha", "comfyui", ("blocks.1.attn2.add_v_proj", "alpha")),
        ("diffusion_model.blocks.0.cross_attn.v_img.diff_b", "comfyui", ("blocks.0.attn2.add_v_proj", "diff_b")),
        ("diffusion_model.blocks.1.cross_attn.norm_k_img.diff", "comfyui", ("blocks.1.attn2.norm_added_k", "diff")),
        ("diffusion_model.img_emb.proj.0.diff_b", "comfyui", ("condition_embedder.image_embedder.norm1", "diff_b")),
        ("diffusion_model.img_emb.proj.1.lora_up.weight", "comfyui", ("condition_embedder.image_embedder.ff.net.0.proj", "up")),
        ("diffusion_model.img_emb.proj.3.lora_down.weight", "comfyui", ("condition_embedder.image_embedder.ff.net.2", "down")),
        ("diffusion_model.img_emb.proj.4.diff", "comfyui", ("condition_embedder.image_embedder.norm2", "diff")),
        ("img_emb.proj.1.lora_down.weight", "comfyui", ("condition_embedder.image_embedder.ff.net.0.proj", "down")),
        ("diffusion_model.blocks.1.diff_m", "comfyui", ("blocks.1.scale_shift_table", "diff")),
        ("diffusion_model.head.diff_m", "comfyui", ("scale_shift_table", "diff")),
        ("lora_unet_blocks_1_cross_attn_k_img.lora_down.weight", "kohya", ("blocks.1.attn2.add_k_proj", "down")),
        ("lora_unet_blocks_0_cross_attn_norm_k_img.diff", "kohya", ("blocks.0.attn2.norm_added_k", "diff")),
        ("lora_unet_img_emb_proj_3.alpha", "kohya", ("condition_embedder.image_embedder.ff.net.2", "alpha")),
        ("diffusion_model.blocks.0.cross_attn.q_img.lora_down.weight", "comfyui", None),
        ("diffusion_model.img_emb.proj.2.lora_down.weight", "comfyui", None),  # the GELU
        ("transformer.blocks.0.diff_m", "diffusers", None),
    ],
)  # fmt: skip
def test_image_to_video_keys_map_to_diffusers_modules(key, fmt, expected):
    assert lora.detect_format([key]) == fmt
    assert split_key(key, fmt) == expected


# ----------------------------------------------------------------------------------------------
# Wan 2.1 I2V: diffusers/PEFT, ComfyUI and kohya files against diffusers' loading and PEFT's merge.


def _peft_lora(transformer_dir, seed: int, alpha: int, targets=PEFT_TARGETS):
    """A PEFT LoraConfig (rank RANK, lora_alpha `alpha`, bias deltas) on the modules `targets`
    of the diffusers transformer, its LoRA weights random: (its LoRA state dict, the config)."""
    model = WanTransformer3DModel.from_pretrained(transformer_dir)
    image = "add_k_proj" in targets
    config = LoraConfig(r=RANK, lora_alpha=alpha, target_modules=targets, lora_bias=True)
    model.add_adapter(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:  # PEFT initialises lora_B (and its bias) to zero
                p.copy_(0.3 * torch.randn(p.shape, generator=generator))
    state = get_peft_model_state_dict(model)
    if image:
        adapted = {k.rsplit(".lora_", 1)[0] for k in state}
        assert {"blocks.1.attn2.add_k_proj", "blocks.0.attn2.add_v_proj",
                "condition_embedder.image_embedder.ff.net.0.proj"} <= adapted  # fmt: skip
    return state, config


def _save_peft_file(state, config, folder, name: str):
    """As diffusers writes a LoRA: `transformer.`-prefixed keys, the LoraConfig (lora_alpha)
    in the file's metadata."""
    WanImageToVideoPipeline.save_lora_weights(
        folder, transformer_lora_layers=state, weight_name=name,
        transformer_lora_adapter_metadata=config.to_dict(),
    )  # fmt: skip
    return folder / name


def _diffusers_merged(transformer_dir, lora_file, scale: float) -> WanTransformer3DModel:
    """The transformer with `lora_file` loaded by diffusers (its key conversion, the file's
    metadata) and merged by PEFT at `scale` (fuse_lora), the LoRA layers then removed."""
    model = WanTransformer3DModel.from_pretrained(transformer_dir)
    state, metadata = WanImageToVideoPipeline.lora_state_dict(
        str(lora_file), return_lora_metadata=True
    )
    WanImageToVideoPipeline.load_lora_into_transformer(
        state, transformer=model, adapter_name="test", metadata=metadata
    )
    model.fuse_lora(lora_scale=scale)
    model.unload_lora()
    return model


def _as_updates(state, alpha: int) -> dict:
    """A PEFT LoRA state dict as test_lora's {module: (down, up, bias delta)}: what save_peft
    and save_comfyui write. PEFT scales lora_B's output, its bias included, by alpha / rank:
    folded into up and the bias here."""
    modules = {k.rsplit(".lora_", 1)[0] for k in state}
    return {
        m: (state[f"{m}.lora_A.weight"].numpy(),
            state[f"{m}.lora_B.weight"].numpy() * (alpha / RANK),
            state[f"{m}.lora_B.bias"].numpy() * (alpha / RANK))
        for m in sorted(modules)
    }  # fmt: skip


def _kohya_from_comfyui(comfy_file, path):
    """The ComfyUI file's tensors under kohya/musubi keys (lora_unet_, underscores)."""
    tensors = dict(weights.read_safetensors(comfy_file))
    renamed = {}
    for key, value in tensors.items():
        name, dot, part = key.removeprefix("diffusion_model.").partition(
            next(s for s in (".lora_", ".alpha", ".diff") if s in key)
        )
        renamed[f"lora_unet_{name.replace('.', '_')}{dot}{part}"] = np.array(value)
    from safetensors.numpy import save_file

    save_file(renamed, path)
    return path


def test_wan21_i2v_peft_comfyui_and_kohya_loras_match_diffusers(folders, tmp_path):
    """A PEFT LoRA on every Linear of the blocks (add_k_proj, add_v_proj included), the image
    embedder's and two more, lora_alpha = 2 x rank in the file's metadata, at scale 0.7: the
    parameters we merge on load equal diffusers' loading and PEFT's merge, imported. The same
    update as a ComfyUI file (k_img, v_img, img_emb.proj.N, alpha = rank / 2, .diff_b) and a
    kohya one: the same parameters."""
    folder = folders["wan21"]
    config, scale, alpha = _config(folder), 0.7, 2 * RANK
    state, peft_config = _peft_lora(folder / "transformer", seed=3, alpha=alpha)
    peft_file = _save_peft_file(state, peft_config, tmp_path, "peft.safetensors")
    assert lora.read_lora(peft_file).default_alpha == alpha  # read from the metadata

    reference = _saved(
        _diffusers_merged(folder / "transformer", peft_file, scale), tmp_path / "ref"
    )
    want = _load(reference, config)
    plain = _load(folder, config)
    got = _load(folder, config, [(peft_file, scale)])
    error = _assert_close(got, want)
    image_linears = {p for p in got if {"add_k_proj", "add_v_proj", "ff"} & set(p)}
    assert len(image_linears) == 8 and image_linears <= _changed(got, plain)
    assert _changed(got, plain) == _changed(want, plain)
    print(f"PEFT vs diffusers + peft fuse_lora: max error {error:.2e}")

    updates = _as_updates(state, alpha)
    save_comfyui(updates, tmp_path / "comfy.safetensors")
    save_peft(updates, tmp_path / "plain_peft.safetensors")  # alpha = rank, no metadata
    _kohya_from_comfyui(tmp_path / "comfy.safetensors", tmp_path / "kohya.safetensors")
    keys = set(dict(weights.read_safetensors(tmp_path / "comfy.safetensors")))
    assert {"diffusion_model.blocks.1.cross_attn.k_img.lora_down.weight",
            "diffusion_model.blocks.0.cross_attn.v_img.alpha",
            "diffusion_model.img_emb.proj.1.lora_up.weight",
            "diffusion_model.img_emb.proj.3.diff_b"} <= keys  # fmt: skip
    for name, fmt in (("comfy", "comfyui"), ("kohya", "kohya"), ("plain_peft", "diffusers")):
        file = tmp_path / f"{name}.safetensors"
        assert lora.read_lora(file).format == fmt
        error = _assert_close(_load(folder, config, [(file, scale)]), want)
        print(f"{name} vs diffusers + peft fuse_lora: max error {error:.2e}")


# ----------------------------------------------------------------------------------------------
# lightx2v's distill-LoRA layout, and a file for modules the model lacks.


def _modules(state_dict: dict) -> list[tuple[str, str]]:
    """(original Wan name, diffusers name) of every module of a diffusers state dict."""
    layers = sorted({int(k.split(".")[1]) for k in state_dict if k.startswith("blocks.")})
    out = [(f"blocks.{i}.{o}", f"blocks.{i}.{d}") for i in layers for o, d in BLOCK.items()]
    out += list(TOP.items())
    return [(o, d) for o, d in out if d in state_dict or f"{d}.weight" in state_dict]


def lightx2v_lora(state_dict: dict, seed: int) -> tuple[dict, dict]:
    """A tiny file in the layout of lightx2v's wan2.1_i2v_lora_rank64_lightx2v_4step (rank
    LIGHTX2V_RANK, bfloat16 as the extractor writes by default) for a model with the state
    dict `state_dict` (diffusers names, torch layouts): (its tensors by key, the update of each
    diffusers tensor at scale 1, float32)."""
    rng = np.random.default_rng(seed)
    tensors, updates = {}, {}

    def bf16(shape, std):
        t = torch.from_numpy(std * rng.standard_normal(shape, dtype=np.float32))
        return t.to(torch.bfloat16)

    for original, module in _modules(state_dict):
        key = f"diffusion_model.{original}"
        if module.endswith("scale_shift_table"):  # a raw table: blocks.N.diff_m, head.diff_m
            tensors[f"{key.removesuffix('.modulation')}.diff_m"] = t = bf16(
                state_dict[module].shape, 0.05
            )
            updates[module] = t.float().numpy()
            continue
        weight = state_dict[f"{module}.weight"]
        local = original.split(".", 2)[-1] if original.startswith("blocks.") else original
        if local in LIGHTX2V_LOW_RANK:
            n_out, n_in = weight.shape
            down, up = bf16((LIGHTX2V_RANK, n_in), 0.3), bf16((n_out, LIGHTX2V_RANK), 0.3)
            tensors[f"{key}.lora_down.weight"], tensors[f"{key}.lora_up.weight"] = down, up
            updates[f"{module}.weight"] = up.double().numpy() @ down.double().numpy()
        else:
            tensors[f"{key}.diff"] = t = bf16(weight.shape, 0.05)
            updates[f"{module}.weight"] = t.float().numpy()
        if f"{module}.bias" in state_dict:
            tensors[f"{key}.diff_b"] = t = bf16(state_dict[f"{module}.bias"].shape, 0.05)
            updates[f"{module}.bias"] = t.float().numpy()
    return tensors, updates


def _reference(transformer_dir, updates: dict, scale: float, folder):
    """The diffusers transformer with `scale` x `updates` (by tensor name, torch layouts) added
    to its weights in float64, saved as a diffusers folder."""
    model = WanTransformer3DModel.from_pretrained(transformer_dir)
    state = model.state_dict()
    with torch.no_grad():
        for name, update in updates.items():
            merged = state[name].double().numpy() + scale * update
            state[name].copy_(torch.from_numpy(merged))
    return _saved(model, folder)


def test_lightx2v_i2v_distill_lora_layout(folders, tmp_path):
    """A tiny file with the keys of lightx2v's Wan 2.1 I2V rank-64 4-step LoRA (rank 4 here):
    lora_down/lora_up without alpha on the blocks' attention (k_img and v_img included) and FFN
    Linears, the embedders' and the image embedder's; .diff on the norms (norm_k_img, the image
    embedder's), the head and the 36-channel patch embedding; .diff_b on every bias; .diff_m on
    the modulation tables. Every tensor of the model changes, as the merge computed here from
    the same tensors has it, and the report counts every one of them."""
    folder = folders["wan21"]
    config, scale = _config(folder), 1.0
    state_dict = WanTransformer3DModel.from_pretrained(folder / "transformer").state_dict()
    tensors, updates = lightx2v_lora(state_dict, seed=7)
    assert set(updates) == set(state_dict)  # the layout covers every tensor of the I2V model
    assert {"diffusion_model.blocks.0.diff_m", "diffusion_model.head.diff_m",
            "diffusion_model.blocks.1.cross_attn.norm_k_img.diff",
            "diffusion_model.blocks.1.cross_attn.k_img.lora_down.weight",
            "diffusion_model.blocks.1.cross_attn.v_img.diff_b",
            "diffusion_model.img_emb.proj.0.diff_b", "diffusion_model.img_emb.proj.1.lora_up.weight",
            "diffusion_model.img_emb.proj.4.diff", "diffusion_model.patch_embedding.diff",
            "diffusion_model.head.head.diff"} <= set(tensors)  # fmt: skip
    assert not any(k.endswith(".alpha") for k in tensors)
    file = tmp_path / "wan2.1_i2v_lora_rank4_lightx2v_4step.safetensors"
    save_torch_file(tensors, file)

    want = _load(_reference(folder / "transformer", updates, scale, tmp_path / "ref"), config)
    plain = _load(folder, config)
    got = _load(folder, config, [(file, scale)])
    error = _assert_close(got, want)
    assert _changed(got, plain) == set(plain)  # every parameter
    _, applied = lora.prepare([(file, scale)], _shapes(config), kind=config.transformer.kind)
    layers = config.transformer.num_layers
    per_layer = sum(p[0] == "blocks" for p in plain)
    assert applied[0].format == "comfyui"
    assert applied[0].parameters == per_layer * layers + len(plain) - per_layer
    print(f"lightx2v layout vs the reference merge: max error {error:.2e}")


# ----------------------------------------------------------------------------------------------
# Wan 2.2 I2V-A14B: a high-noise and a low-noise LoRA, one per expert, through Pipeline.assemble.


@pytest.fixture(scope="module")
def a14b_build(folders) -> tuple:
    """The tiny A14B model's --no-cfg build, compiled in process: (config, plan, executables)."""
    config = _config(folders["a14b"])
    shape = VideoShape(48, 32, 1, 1, cfg=False)
    plan = plan_build("tiny-a14b", config, shape, parse_target("cpu-8"), 8)
    return config, plan, compile_in_process(plan)


def _build_shapes(plan, executables) -> dict:
    """The transformer's parameter shapes as the build's first program taking it has them
    (what Pipeline.assemble checks LoRAs against; the CLI reads them from the manifest)."""
    program = interface.first_program_taking("transformer", plan.key.programs)
    taken = interface.named(program, executables[program].args_info[0])["params"]
    return {p: tuple(a.shape) for p, a in weights.flatten(taken).items()}


def test_wan22_i2v_high_and_low_noise_loras_go_to_their_experts(folders, a14b_build, tmp_path):
    """--lora (a PEFT file, lora_alpha = 2 x rank, scale 1) to the high-noise expert, --lora-2
    (a ComfyUI file with alpha and .diff_b, scale 0.6) to the low-noise one, merged by
    Pipeline.assemble into the weights the compiled build takes: each expert equals diffusers'
    loading of its own file alone into it and PEFT's merge (the other expert's LoRA leaves it
    alone)."""
    folder = folders["a14b"]
    config, plan, executables = a14b_build
    targets = [*BLOCK_TARGETS, "proj_out", "time_proj"]
    high_state, high_config = _peft_lora(
        folder / "transformer", seed=11, alpha=2 * RANK, targets=targets
    )
    high = _save_peft_file(high_state, high_config, tmp_path, "high.safetensors")
    low_state, _ = _peft_lora(folder / "transformer_2", seed=12, alpha=RANK, targets=BLOCK_TARGETS)
    save_comfyui(_as_updates(low_state, RANK), tmp_path / "low.safetensors")
    low = tmp_path / "low.safetensors"

    pipe = Pipeline.assemble(
        executables, folder, plan.key, "in-process", config, [(high, 1.0)], [(low, 0.6)]
    )
    assert [(a.transformer, a.format, a.scale) for a in pipe.loras] == [
        ("transformer", "diffusers", 1.0), ("transformer_2", "comfyui", 0.6)
    ]  # fmt: skip
    got = {
        c: {p: np.asarray(v) for p, v in weights.flatten(pipe.params[c]).items()}
        for c in ("transformer", "transformer_2")
    }
    reference = tmp_path / "ref"
    _saved(_diffusers_merged(folder / "transformer", high, 1.0), reference, "transformer")
    _saved(_diffusers_merged(folder / "transformer_2", low, 0.6), reference, "transformer_2")
    assert _build_shapes(plan, executables) == _shapes(config)  # what _load checks against
    for component in ("transformer", "transformer_2"):
        want = _load(reference, config, component=component)
        plain = _load(folder, config, component=component)
        error = _assert_close(got[component], want)
        assert _changed(got[component], plain) == _changed(want, plain) != set()
        print(f"{component} vs diffusers + peft fuse_lora: max error {error:.2e}")


def test_image_keys_are_left_out_on_a_model_without_image_features(folders, a14b_build, tmp_path):
    """The Wan 2.1 I2V lightx2v-layout file on Wan 2.2 I2V-A14B (no image features), against
    the build's shapes (lightx2v's own Wan 2.2 I2V-A14B files carry such keys too): its k_img,
    v_img, norm_k_img and img_emb tensors are left out and counted in the report, for either
    expert; the rest applies exactly as the file without them. Any other key naming a module
    the model lacks is still refused (test_lora.py)."""
    config, plan, executables = a14b_build
    wan21 = WanTransformer3DModel.from_pretrained(folders["wan21"] / "transformer")
    tensors, _ = lightx2v_lora(wan21.state_dict(), seed=7)
    file, without = tmp_path / "i2v.safetensors", tmp_path / "without.safetensors"
    save_torch_file(tensors, file)
    image = ("k_img", "v_img", "img_emb")
    image_tensors = sum(any(m in k for m in image) for k in tensors)
    assert image_tensors > 0
    save_torch_file({k: v for k, v in tensors.items() if not any(m in k for m in image)}, without)
    shapes = _build_shapes(plan, executables)
    lora.check([(file, 1.0)], shapes, kind=config.transformer.kind)
    deltas, [applied] = lora.prepare([(file, 1.0)], shapes, kind=config.transformer.kind)
    expected, [applied_without] = lora.prepare(
        [(without, 1.0)], shapes, kind=config.transformer.kind
    )
    assert applied.skipped_image_tensors == image_tensors
    assert applied_without.skipped_image_tensors == 0
    assert applied.parameters == applied_without.parameters
    assert ("patch_embedding", "kernel") in deltas and len(deltas) == len(shapes)
    assert deltas.keys() == expected.keys()
    for path, delta in expected.items():
        assert [layer for layer, _ in deltas[path].terms] == [layer for layer, _ in delta.terms]
    for loras, loras_2 in (([(file, 1.0)], ()), ((), [(file, 1.0)])):
        pipe = Pipeline.assemble(
            executables, folders["a14b"], plan.key, "x", config, loras, loras_2
        )
        assert [a.skipped_image_tensors for a in pipe.loras] == [image_tensors]
