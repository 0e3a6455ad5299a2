"""LoRAs merged at load time: key formats, the merge itself, and end to end against diffusers'
`load_lora_weights` + `set_adapters` with the distilled recipe (4 steps, guidance 1, no CFG,
Euler at shift 5), on tiny random pipelines and LoRAs made here offline."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from conftest import run_cli, save_tiny_diffusers_pipeline
from diffusers import WanTransformer3DModel
from safetensors.numpy import save_file

from runtime.builds.loader import Request
from runtime.generation.compiles import CompileCounter
from runtime.generation.pipeline import Pipeline
from wan import checkpoint, kinds, lora, programs, sharding, weights
from wan.configs import VideoShape
from wan.presets import PRESETS
from wan.random_weights import write_random_checkpoint
from wan.weights import transformer as transformer_rules

WIDTH, HEIGHT, FRAMES = 48, 32, 1  # one latent frame: the VAE decode compiles fastest
SHAPE = ["--res", f"{WIDTH}x{HEIGHT}", "--frames", str(FRAMES), "--batch", "1"]
PROMPT = "a red cat running in the rain"
RECIPE = ["--steps", "4", "--guidance", "1", "--sampler", "euler", "--shift", "5"]
RANK, SCALE = 4, 0.8
# Modules the test LoRAs adapt (diffusers names): every Linear of every block, and three outside.
BLOCK_LINEARS = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q",
                 "attn2.to_k", "attn2.to_v", "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2")  # fmt: skip
TOP_LINEARS = ("condition_embedder.time_proj", "condition_embedder.text_embedder.linear_1",
               "proj_out")  # fmt: skip
TINY_SHAPES = {
    p: a.shape
    for p, a in weights.flatten(
        programs.split_abstract(programs.abstract_module(PRESETS["tiny"], "transformer"))[1]
    ).items()
}
_TO_ORIGINAL = {d: o for o, d in transformer_rules.ORIGINAL_BLOCK_MODULES.items()}
_TO_ORIGINAL_TOP = {d: o for o, d in transformer_rules.ORIGINAL_MODULES.items()}


# ----------------------------------------------------------------------------------------------
# LoRA files made offline.


def random_lora(state_dict: dict[str, torch.Tensor], num_layers: int, seed: int) -> dict:
    """{diffusers module: (down (r, in), up (out, r), bias delta (out,))} for the test modules
    of a diffusers transformer's state dict; large enough to change the video visibly."""
    rng = np.random.default_rng(seed)
    modules = [f"blocks.{i}.{m}" for i in range(num_layers) for m in BLOCK_LINEARS]
    out = {}
    for module in (*modules, *TOP_LINEARS):
        n_out, n_in = state_dict[f"{module}.weight"].shape
        down = rng.standard_normal((RANK, n_in), dtype=np.float32) / np.sqrt(n_in)
        up = 0.6 * rng.standard_normal((n_out, RANK), dtype=np.float32) / np.sqrt(RANK)
        out[module] = (down, up, 0.05 * rng.standard_normal(n_out, dtype=np.float32))
    return out


def save_peft(deltas: dict, path) -> None:
    """diffusers/PEFT keys, alpha = rank (no metadata), bias deltas as lora_B.bias."""
    tensors = {}
    for module, (down, up, bias) in deltas.items():
        tensors[f"transformer.{module}.lora_A.weight"] = down
        tensors[f"transformer.{module}.lora_B.weight"] = up
        tensors[f"transformer.{module}.lora_B.bias"] = bias
    save_file(tensors, path)


def original_name(module: str) -> str:
    if module.startswith("blocks."):
        _, layer, local = module.split(".", 2)
        return f"blocks.{layer}.{_TO_ORIGINAL[local]}"
    return _TO_ORIGINAL_TOP[module]


def save_comfyui(deltas: dict, path) -> None:
    """The same updates in ComfyUI keys, with alpha = rank / 2 and up doubled to match."""
    tensors = {}
    for module, (down, up, bias) in deltas.items():
        name = f"diffusion_model.{original_name(module)}"
        tensors[f"{name}.lora_down.weight"] = down
        tensors[f"{name}.lora_up.weight"] = 2 * up
        tensors[f"{name}.alpha"] = np.array(RANK / 2, np.float32)
        tensors[f"{name}.diff_b"] = bias
    save_file(tensors, path)


# ----------------------------------------------------------------------------------------------
# Key formats and the merge.


def split_key(key: str, fmt: str, *, kind: str | None = None) -> tuple[str, str] | None:
    """(diffusers module name, part) of one key as wan.lora reads it for a transformer of kind
    `kind` (None: the default kind)."""
    return lora._split(key, fmt, lora.transformer_rule(kind))


@pytest.mark.parametrize(
    ("key", "fmt", "expected"),
    [
        ("transformer.blocks.3.attn1.to_q.lora_A.weight", "diffusers", ("blocks.3.attn1.to_q", "down")),
        ("blocks.3.attn1.to_out.0.lora_B.weight", "diffusers", ("blocks.3.attn1.to_out.0", "up")),
        ("transformer.proj_out.lora_B.bias", "diffusers", ("proj_out", "up_b")),
        ("diffusion_model.blocks.1.self_attn.o.lora_up.weight", "comfyui", ("blocks.1.attn1.to_out.0", "up")),
        ("diffusion_model.blocks.0.cross_attn.k.lora_A.weight", "comfyui", ("blocks.0.attn2.to_k", "down")),
        ("diffusion_model.blocks.0.ffn.0.alpha", "comfyui", ("blocks.0.ffn.net.0.proj", "alpha")),
        ("diffusion_model.blocks.1.norm3.diff", "comfyui", ("blocks.1.norm2", "diff")),
        ("diffusion_model.blocks.1.cross_attn.norm_q.diff", "comfyui", ("blocks.1.attn2.norm_q", "diff")),
        ("diffusion_model.blocks.0.modulation.diff", "comfyui", ("blocks.0.scale_shift_table", "diff")),
        ("diffusion_model.head.head.diff_b", "comfyui", ("proj_out", "diff_b")),
        ("diffusion_model.time_projection.1.diff", "comfyui", ("condition_embedder.time_proj", "diff")),
        ("blocks.0.self_attn.q.lora_down.weight", "comfyui", ("blocks.0.attn1.to_q", "down")),
        ("lora_unet_blocks_3_cross_attn_k.lora_down.weight", "kohya", ("blocks.3.attn2.to_k", "down")),
        ("lora_unet_blocks_0_ffn_2.alpha", "kohya", ("blocks.0.ffn.net.2", "alpha")),
        ("lora_unet_text_embedding_0.lora_up.weight", "kohya", ("condition_embedder.text_embedder.linear_1", "up")),
        ("diffusion_model.blocks.0.self_attn.x.lora_up.weight", "comfyui", None),
        ("diffusion_model.blocks.0.self_attn.q.weight", "comfyui", None),
    ],
)  # fmt: skip
def test_keys_map_to_diffusers_modules(key, fmt, expected):
    assert lora.detect_format([key]) == fmt
    assert split_key(key, fmt) == expected


@pytest.fixture
def toy_transformer_kinds():
    """Two transformer kinds registered here: one whose rule names its original modules its own
    way (only `attn.q`, for diffusers' `attn1.to_q`), one whose rule is a bare function."""
    base = kinds.lookup("transformer", "per_video")
    own_names = dataclasses.replace(
        base.weight_rule, original_block_modules={"attn.q": "attn1.to_q"}, original_modules={}
    )
    added = [
        kinds.register(dataclasses.replace(base, name="toy-names", rule=own_names)),
        kinds.register(dataclasses.replace(base, name="toy-bare", rule=lambda name: None)),
    ]
    yield
    for kind in added:
        del kinds.REGISTRY[kind.component, kind.name]


@pytest.mark.usefixtures("toy_transformer_kinds")
def test_keys_map_through_the_transformer_kinds_rule(tmp_path):
    """wan.lora asks the kind registry for the transformer kind's rule: a kind's own original
    names are the ones read (ComfyUI and kohya), and a kind whose rule names no modules refuses
    LoRA files in one line."""
    comfy, kohya = (
        "diffusion_model.blocks.2.attn.q.lora_down.weight",
        "lora_unet_blocks_2_attn_q.alpha",
    )
    assert split_key(comfy, "comfyui", kind="toy-names") == ("blocks.2.attn1.to_q", "down")
    assert split_key(kohya, "kohya", kind="toy-names") == ("blocks.2.attn1.to_q", "alpha")
    assert split_key(comfy, "comfyui") is None  # the default kind's names differ
    original = "diffusion_model.blocks.2.self_attn.q.lora_down.weight"
    assert split_key(original, "comfyui", kind="toy-names") is None
    with pytest.raises(lora.LoraError, match="'toy-bare': its weight rule names no modules"):
        lora.check([(tmp_path / "any.safetensors", 1.0)], TINY_SHAPES, kind="toy-bare")
    with pytest.raises(kinds.KindError, match="transformer kind 'nope' is not one"):
        lora.transformer_rule("nope")


def test_lora_asks_the_registry_and_stays_flax_free():
    code = (
        "import sys; from wan import lora; rule = lora.transformer_rule();"
        "from wan.weights import transformer; assert rule is transformer.rule;"
        "bad = [m for m in sys.modules if m.split('.')[0] == 'flax']; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_parse_spec():
    assert lora.parse_spec("a/b.safetensors") == (Path("a/b.safetensors"), 1.0)
    assert lora.parse_spec("a/b.safetensors:0.5") == (Path("a/b.safetensors"), 0.5)
    assert lora.parse_spec("a:b.safetensors") == (Path("a:b.safetensors"), 1.0)


def _merged(tree: dict, deltas: dict) -> dict:
    flat = {p: np.array(v) for p, v in weights.flatten(tree).items()}
    for p, delta in deltas.items():
        delta.merge_into(flat[p], ())
    return flat


def test_merge_low_rank_full_deltas_and_repeats(tmp_path):
    """up @ down with alpha / rank, .diff on norms, tables, the conv patch embedding and the
    text embedder, .diff_b on a bias; one file twice: the scales add up."""
    rng = np.random.default_rng(0)
    down = rng.standard_normal((3, 32), dtype=np.float32)
    up = rng.standard_normal((64, 3), dtype=np.float32)
    tensors = {
        "diffusion_model.blocks.1.ffn.0.lora_down.weight": down,
        "diffusion_model.blocks.1.ffn.0.lora_up.weight": up,
        "diffusion_model.blocks.1.ffn.0.alpha": np.array(6.0, np.float32),
        "diffusion_model.blocks.0.norm3.diff": rng.standard_normal(32, dtype=np.float32),
        "diffusion_model.blocks.1.modulation.diff": rng.standard_normal((1, 6, 32), dtype=np.float32),
        "diffusion_model.head.modulation.diff": rng.standard_normal((1, 2, 32), dtype=np.float32),
        "diffusion_model.patch_embedding.diff": rng.standard_normal((32, 16, 1, 2, 2), dtype=np.float32),
        "diffusion_model.text_embedding.0.diff": rng.standard_normal((32, 32), dtype=np.float32),
        "diffusion_model.head.head.diff_b": rng.standard_normal(64, dtype=np.float32),
    }  # fmt: skip
    save_file(tensors, tmp_path / "l.safetensors")
    file = tmp_path / "l.safetensors"
    deltas, applied = lora.prepare([(file, 0.5), (file, 0.25)], TINY_SHAPES)
    assert [a.parameters for a in applied] == [7, 7] and applied[0].format == "comfyui"
    assert applied[0].sha256 == lora.file_sha256(file) and applied[1].scale == 0.25
    base = {p: rng.standard_normal(s).astype(np.float32) for p, s in TINY_SHAPES.items()}
    got = _merged(weights.unflatten(base), deltas)
    s = 0.75
    want = {p: v.copy() for p, v in base.items()}
    want["blocks", "ffn", "linear_1", "kernel"][1] += s * 2.0 * (up @ down).T
    want["blocks", "norm2", "scale"][0] += s * tensors["diffusion_model.blocks.0.norm3.diff"]
    want["blocks", "scale_shift_table"][1] += (
        s * tensors["diffusion_model.blocks.1.modulation.diff"]
    )
    want["scale_shift_table",] += s * tensors["diffusion_model.head.modulation.diff"]
    want["patch_embedding", "kernel"] += s * tensors[
        "diffusion_model.patch_embedding.diff"
    ].transpose(2, 3, 4, 1, 0)
    want["condition_embedder", "text_embedder", "linear_1", "kernel"] += (
        s * tensors["diffusion_model.text_embedding.0.diff"].T
    )
    want["proj_out", "bias"] += s * tensors["diffusion_model.head.head.diff_b"]
    changed = {p for p in base if not np.array_equal(want[p], base[p])}
    assert changed == set(deltas) and len(changed) == 7
    for p in base:
        np.testing.assert_allclose(got[p], want[p], rtol=1e-5, atol=1e-5, err_msg=str(p))  # fmt: skip


def test_merge_rounds_once_to_the_weight_dtype():
    import ml_dtypes

    w = np.array([[1.0, 2.0], [3.0, 4.0]], ml_dtypes.bfloat16)
    tiny = lora.Dense(np.full((2, 2), 1e-3, np.float32), 1.0)
    delta = lora.ParamDelta((2, 2), ((None, tiny), (None, tiny), (None, tiny)))
    merged = w.copy()
    delta.merge_into(merged, ())
    expected = (w.astype(np.float32) + 3e-3).astype(ml_dtypes.bfloat16)
    assert merged.dtype == w.dtype and np.array_equal(merged, expected)


def test_checkpoint_merges_shard_by_shard(tmp_path):
    """A checkpoint restored into shardings with replicas (data=2), then merged one shard at a
    time: equal to merging the host copy; nothing compiles."""
    config = PRESETS["tiny"]
    folder = write_random_checkpoint(config, tmp_path / "ckpt", seed=1)
    _, params, axes = programs.split_abstract(programs.abstract_module(config, "transformer"))
    mesh = sharding.make_mesh(
        jax.devices()[:8], (("data", 2), ("fsdp", 2), ("context", 1), ("tensor", 2))
    )
    shards = programs.shardings(mesh, params, axes, sharding.TRANSFORMER_RULES)
    abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), params, shards
    )
    rng = np.random.default_rng(2)
    file = tmp_path / "l.safetensors"
    save_file(
        {
            "blocks.0.ffn.net.0.proj.lora_A.weight": rng.standard_normal((2, 32), np.float32),
            "blocks.0.ffn.net.0.proj.lora_B.weight": rng.standard_normal((64, 2), np.float32),
            "blocks.1.attn1.to_q.lora_B.bias": rng.standard_normal(32, np.float32),
        },
        file,
    )
    deltas, _ = lora.prepare([(file, 1.0)], TINY_SHAPES)
    plain = checkpoint.load_component(folder, "transformer", abstract)
    counter = CompileCounter()
    merged = weights.flatten(checkpoint.load_component(folder, "transformer", abstract, deltas))
    assert counter.count == 0
    expected = _merged(plain, deltas)
    flat_abstract = weights.flatten(abstract)
    for p, value in merged.items():
        assert value.sharding == flat_abstract[p].sharding
        np.testing.assert_array_equal(np.asarray(value), expected[p], err_msg=str(p))
    kernel = ("blocks", "ffn", "linear_1", "kernel")
    assert not np.array_equal(expected[kernel], np.asarray(weights.flatten(plain)[kernel]))


def _lora_error(tmp_path, tensors: dict, match: str) -> None:
    save_file(tensors, tmp_path / "bad.safetensors")
    with pytest.raises(lora.LoraError, match=match):
        lora.prepare([(tmp_path / "bad.safetensors", 1.0)], TINY_SHAPES)


def test_errors_name_the_key_the_parameter_and_both_shapes(tmp_path):
    a, b = np.zeros((2, 32), np.float32), np.zeros((32, 2), np.float32)
    _lora_error(tmp_path, {"transformer.blocks.0.attn1.add_k_proj.lora_A.weight": a,
                           "transformer.blocks.0.attn1.add_k_proj.lora_B.weight": b},
                r"key transformer\.blocks\.0\.attn1\.add_k_proj\.lora_\w\.weight names no weight"
                r" of this model \(formats known: diffusers/PEFT")  # fmt: skip
    _lora_error(tmp_path, {"lora_unet_blocks_0_ffn_0.lora_down.weight": a,
                           "lora_te_text_model_encoder_layers_0.lora_down.weight": a},
                "key lora_te_text_model_encoder_layers_0.lora_down.weight names no transformer weight")  # fmt: skip
    _lora_error(tmp_path, {"lora_te_text_model_encoder_layers_0.lora_down.weight": a},
                "names no weight of this model")  # fmt: skip
    _lora_error(tmp_path, {"blocks.0.ffn.net.2.lora_A.weight": a, "blocks.0.ffn.net.2.lora_B.weight": b},
                r"does not fit blocks\.ffn\.linear_2\.kernel: the update is \(32, 32\) \(in, out\), "
                r"the parameter \(64, 32\)")  # fmt: skip
    _lora_error(tmp_path, {"blocks.5.attn1.to_q.lora_A.weight": a, "blocks.5.attn1.to_q.lora_B.weight": b},
                "is for layer 5, the model has 2")  # fmt: skip
    _lora_error(tmp_path, {"blocks.0.attn1.to_q.lora_A.weight": a}, "has no lora_up partner")
    _lora_error(tmp_path, {"diffusion_model.blocks.0.norm3.diff": np.zeros(31, np.float32)},
                r"blocks\.norm2\.scale is \(32,\)")  # fmt: skip


def test_a_peft_bias_scales_as_its_pair(tmp_path):
    """lora_B.bias is part of lora_B's output: PEFT scales it by lora_alpha / rank as the
    product (tests/test_lora_i2v.py compares with PEFT's merge); alone, with a lora_alpha in
    the metadata, its scale is unknown: refused."""
    rng = np.random.default_rng(0)
    down, up = rng.standard_normal((2, 32), np.float32), rng.standard_normal((32, 2), np.float32)
    bias = rng.standard_normal(32, np.float32)
    meta = {"lora_adapter_metadata": json.dumps({"transformer.lora_alpha": 8})}
    file = tmp_path / "l.safetensors"
    save_file({"blocks.0.attn1.to_q.lora_A.weight": down, "blocks.0.attn1.to_q.lora_B.weight": up,
               "blocks.0.attn1.to_q.lora_B.bias": bias}, file, metadata=meta)  # fmt: skip
    deltas, _ = lora.prepare([(file, 0.5)], TINY_SHAPES)
    got = _merged(weights.unflatten({p: np.zeros(s, np.float32) for p, s in TINY_SHAPES.items()}), deltas)  # fmt: skip
    np.testing.assert_allclose(got["blocks", "attn1", "to_q", "bias"][0], 0.5 * 4 * bias, rtol=1e-6)
    np.testing.assert_allclose(got["blocks", "attn1", "to_q", "kernel"][0], 0.5 * 4 * (up @ down).T, rtol=1e-5, atol=1e-5)  # fmt: skip
    save_file({"blocks.0.attn1.to_q.lora_B.bias": bias}, file, metadata=meta)
    with pytest.raises(lora.LoraError, match=r"lora_B\.bias has no lora_A/lora_B weights"):
        lora.prepare([(file, 1.0)], TINY_SHAPES)


def test_unreadable_files(tmp_path):
    (tmp_path / "text.safetensors").write_text("not a safetensors file at all")
    with pytest.raises(lora.LoraError, match="is not a safetensors file"):
        lora.read_lora(tmp_path / "text.safetensors")
    save_file({"blocks.0.attn1.to_q.lora_A.weight": np.zeros((2, 32), np.float32)},
              tmp_path / "ok.safetensors")  # fmt: skip
    data = (tmp_path / "ok.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-10])
    with pytest.raises(lora.LoraError, match="is truncated"):
        lora.read_lora(tmp_path / "cut.safetensors")
    (tmp_path / "cut_header.safetensors").write_bytes(data[:20])
    with pytest.raises(lora.LoraError, match="cut short in its header"):
        lora.read_lora(tmp_path / "cut_header.safetensors")


# ----------------------------------------------------------------------------------------------
# End to end: `runtime run --lora` against diffusers.


def _noise() -> np.ndarray:
    return np.random.default_rng(1).standard_normal(
        (1, 16, (FRAMES - 1) // 4 + 1, HEIGHT // 8, WIDTH // 8), np.float32
    )


def _setup(root, two_experts: bool) -> dict:
    """A tiny diffusers pipeline, its --no-cfg build, LoRA files for it, the noise."""
    folder = root / "Wan-tiny-Diffusers"
    save_tiny_diffusers_pipeline(folder, two_experts)
    run_cli("aot", "build", "--model", str(folder), *SHAPE, "--no-cfg", "--target", "cpu-8",
            "--out", str(root / "artifacts"))  # fmt: skip
    model = WanTransformer3DModel.from_pretrained(folder / "transformer")
    deltas = random_lora(model.state_dict(), model.config.num_layers, seed=5)
    save_peft(deltas, root / "peft.safetensors")
    save_comfyui(deltas, root / "comfy.safetensors")
    np.save(root / "noise.npy", _noise())
    return {"folder": folder, "artifacts": root / "artifacts", "root": root}


@pytest.fixture(scope="module")
def wan21(tmp_path_factory):
    return _setup(tmp_path_factory.mktemp("lora21"), two_experts=False)


@pytest.fixture(scope="module")
def wan22(tmp_path_factory):
    return _setup(tmp_path_factory.mktemp("lora22"), two_experts=True)


def _diffusers_frames(folder, lora_file, into_transformer_2: bool = False) -> np.ndarray:
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    pipe = WanPipeline.from_pretrained(folder)
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=5.0)
    pipe.load_lora_weights(
        lora_file, adapter_name="test", load_into_transformer_2=into_transformer_2
    )
    pipe.set_adapters(["test"], [SCALE])
    return pipe(
        prompt=PROMPT, height=HEIGHT, width=WIDTH, num_frames=FRAMES, num_inference_steps=4,
        guidance_scale=1.0, latents=torch.from_numpy(_noise()), output_type="np",
    ).frames  # fmt: skip


def _run(setup, *extra, out="v.mp4", check=True):
    root = setup["root"]
    return run_cli(
        "runtime", "run", "--artifacts", str(setup["artifacts"]), "--weights", str(setup["folder"]),
        *SHAPE, "--prompt", PROMPT, *RECIPE, "--init-noise", str(root / "noise.npy"),
        "--out", str(root / out), *extra, check=check,
    )  # fmt: skip


def _in_process(setup, **loras) -> np.ndarray:
    counter = CompileCounter()
    pipe = Pipeline.load(setup["artifacts"], setup["folder"], Request(VideoShape(WIDTH, HEIGHT, FRAMES, 1, cfg=False)), **loras)  # fmt: skip
    frames, report = pipe.generate(PROMPT, steps=4, guidance=1.0, init_noise=_noise(), sampler="euler", shift=5.0)  # fmt: skip
    assert counter.count == 0 and report.compile_count == 0  # loading and merging included
    return frames


def test_distilled_lora_matches_diffusers(wan21):
    root = wan21["root"]
    _run(wan21, "--lora", f"{root / 'peft.safetensors'}:{SCALE}", "--save-frames", str(root / "f.npy"),
         "--report", str(root / "r.json"))  # fmt: skip
    ours = np.load(root / "f.npy")
    expected = _diffusers_frames(wan21["folder"], root / "peft.safetensors")
    assert np.abs(ours.astype(np.float32) / 255 - expected).max() <= 2 / 255

    report = json.loads((root / "r.json").read_text())
    assert report["compile_count"] == 0 and (report["sampler"], report["shift"]) == ("euler", 5.0)
    (applied,) = report["loras"]
    assert applied == {
        "file": str(root / "peft.safetensors"), "sha256": lora.file_sha256(root / "peft.safetensors"),
        "scale": SCALE, "transformer": "transformer", "format": "diffusers",
        "parameters": 2 * len(BLOCK_LINEARS) * 2 + 2 * len(TOP_LINEARS),  # weights and biases
        "skipped_image_tensors": 0,
    }  # fmt: skip

    comfy = _in_process(wan21, loras=[(root / "comfy.safetensors", SCALE)])
    np.testing.assert_array_equal(comfy, ours)  # the two formats: the same weights, bit for bit
    plain = _in_process(wan21)
    assert np.abs(plain.astype(np.float32) - ours).max() / 255 > 20 * 2 / 255


def test_lora_2_goes_to_the_low_noise_expert(wan22):
    root = wan22["root"]
    _run(wan22, "--lora-2", f"{root / 'peft.safetensors'}:{SCALE}", "--save-frames", str(root / "f.npy"))  # fmt: skip
    ours = np.load(root / "f.npy")
    expected = _diffusers_frames(
        wan22["folder"], root / "peft.safetensors", into_transformer_2=True
    )
    assert np.abs(ours.astype(np.float32) / 255 - expected).max() <= 2 / 255
    plain = _in_process(wan22)
    assert np.abs(plain.astype(np.float32) - ours).max() / 255 > 20 * 2 / 255


def _truncated(root):
    data = (root / "peft.safetensors").read_bytes()
    (root / "bad.safetensors").write_bytes(data[: len(data) // 2])
    return "is truncated"


def _unknown_key(root):
    save_file({"transformer.blocks.0.attn1.to_x.lora_A.weight": np.zeros((2, 32), np.float32),
               "transformer.blocks.0.attn1.to_x.lora_B.weight": np.zeros((32, 2), np.float32)},
              root / "bad.safetensors")  # fmt: skip
    return "key transformer.blocks.0.attn1.to_x.lora_A.weight names no weight of this model"


def _wrong_shape(root):
    save_file({"transformer.proj_out.lora_A.weight": np.zeros((2, 32), np.float32),
               "transformer.proj_out.lora_B.weight": np.zeros((48, 2), np.float32)},
              root / "bad.safetensors")  # fmt: skip
    return "the update is (32, 48) (in, out), the parameter (32, 64)"


def _not_safetensors(root):
    (root / "bad.safetensors").write_bytes(b"PK\x03\x04 a zip file, say")
    return "is not a safetensors file"


@pytest.mark.parametrize("bad", [_truncated, _unknown_key, _wrong_shape, _not_safetensors])
def test_bad_lora_files_are_one_line_errors(wan21, bad):
    message = bad(wan21["root"])
    result = _run(wan21, "--lora", str(wan21["root"] / "bad.safetensors"), out="bad.mp4", check=False)  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr and not (wan21["root"] / "bad.mp4").exists()


def test_lora_2_needs_two_experts(wan21):
    result = _run(wan21, "--lora-2", str(wan21["root"] / "peft.safetensors"), out="bad.mp4", check=False)  # fmt: skip
    assert result.returncode == 2 and "has one transformer: use --lora" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
