"""8-bit transformer Linear layers (`aot build --quant`, wan.quant): the layer against a numpy
float64 reference of the same scheme, quantizing at load (LoRA merged first) against quantizing
the merged weights, quantized checkpoints, and whole tiny pipelines per mode against the
full-precision build (their difference reported and bounded)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from conftest import TINY_SHAPE, run_cli, save_tiny_diffusers_pipeline, with_its_store
from diffusers import WanPipeline
from flax import nnx
from safetensors.numpy import save_file
from test_pipeline import FRAMES, HEIGHT, NEGATIVE, PROMPTS, STEPS, WIDTH

from aot.building.lower import compile_plan
from aot.building.plan import plan_build
from aot.targets import parse_target
from runtime.generation.pipeline import Pipeline
from wan import checkpoint, lora, programs, quant, sharding, weights
from wan.configs import ModelConfig, VideoShape
from wan.models.quant_linear import QuantLinear
from wan.presets import PRESETS
from wan.random_weights import write_random_checkpoint

RTOL = 1e-5
QUANTIZED = ("attn1", "attn2", "ffn")  # a diffusers block's modules whose Linear layers are 8-bit
# Frames in [0, 1], mean |ours - the scheme's|: rounding ties differ. Measured: 0.0007 (int8),
# 0.0014 (fp8); with one activation scale per tensor in the layer itself, 0.0032 and 0.0084.
SCHEME_MEAN = 2e-3


def _reference(x: np.ndarray, q: np.ndarray, scale: np.ndarray, b: np.ndarray, s: quant.Scheme):
    """The scheme in numpy float64: per-token activation scales (w8a8), rounding half to even
    and clipping for int8, a cast to float8_e4m3fn for fp8."""
    w = q.astype(np.float64)
    if not s.activations:
        return x.astype(np.float64) @ (w * scale) + b
    x_scale = np.abs(x).max(axis=-1, keepdims=True).astype(np.float32) / np.float32(s.qmax)
    x_scale = np.where(x_scale == 0, 1, x_scale).astype(np.float32)
    scaled = x.astype(np.float32) / x_scale
    if s.weight_dtype == "int8":
        xq = np.clip(np.round(scaled), -127, 127).astype(np.float64)
    else:
        xq = scaled.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return (xq @ w) * x_scale * scale + b


@pytest.mark.parametrize("mode", sorted(quant.SCHEMES))
def test_the_layer_is_its_scheme(mode):
    s = quant.SCHEMES[mode]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, 48), np.float32)
    x[0, 1] = 0  # an all-zero token quantizes to zero, not NaN
    w = rng.standard_normal((48, 40), np.float32)
    w[:, 3] = 0  # an all-zero output channel
    b = rng.standard_normal(40, np.float32)
    q, scale = quant.quantize_kernel(w, s.weight_dtype)
    assert q.dtype == np.dtype(s.weight_dtype) and scale.shape == (40,)
    layer = QuantLinear(48, 40, (None, None), s, dtype=jnp.float32, param_dtype=jnp.float32,
                        rngs=nnx.Rngs(0))  # fmt: skip
    layer.kernel.value, layer.scale.value, layer.bias.value = (
        jnp.asarray(q),
        jnp.asarray(scale),
        jnp.asarray(b),
    )
    got = np.asarray(jax.jit(lambda v: layer(v))(x), np.float64)
    expected = _reference(x, q, scale, b, s)
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=RTOL * np.abs(expected).max())
    assert np.all(got[0, 1] == b.astype(np.float32))
    # The scheme is not the identity: it moves the output from the float one.
    assert np.abs(got - (x @ w + b)).max() > 100 * RTOL * np.abs(expected).max()


def test_weights_quantize_per_output_channel():
    w = np.array([[1.0, -0.5], [-2.0, 0.25]], np.float32)
    q, scale = quant.quantize_kernel(w, "int8")
    np.testing.assert_allclose(scale, [2 / 127, 0.5 / 127])
    np.testing.assert_array_equal(q, [[64, -127], [-127, 64]])  # 63.5 rounds half to even: 64


def _abstract(config, mode, mesh):
    _, params, axes = programs.split_abstract(
        programs.abstract_module(
            config, "transformer", programs.ProgramOptions(build={"quant": mode})
        )
    )
    shards = programs.shardings(mesh, params, axes, sharding.TRANSFORMER_RULES)
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), params, shards
    )


def test_a_lora_is_merged_before_the_weights_are_quantized(tmp_path):
    """Loading full-precision weights into a w8a8-int8 build with a LoRA gives what quantizing
    the merged weights gives, shard by shard in the build's sharding."""
    config = PRESETS["tiny"]
    folder = write_random_checkpoint(config, tmp_path / "ckpt", seed=1)
    mesh = sharding.make_mesh(
        jax.devices()[:8], (("data", 2), ("fsdp", 2), ("context", 1), ("tensor", 2))
    )
    full, quantized = (_abstract(config, m, mesh) for m in ("none", "w8a8-int8"))
    rng = np.random.default_rng(2)
    file = tmp_path / "l.safetensors"
    save_file({
        "blocks.0.ffn.net.0.proj.lora_A.weight": rng.standard_normal((2, 32), np.float32),
        "blocks.0.ffn.net.0.proj.lora_B.weight": rng.standard_normal((64, 2), np.float32),
    }, file)  # fmt: skip
    shapes = {p: a.shape for p, a in weights.flatten(full).items()}
    deltas, _ = lora.prepare([(file, 1.0)], shapes)
    merged = weights.flatten(checkpoint.load_component(folder, "transformer", full, deltas))
    loaded = weights.flatten(checkpoint.load_component(folder, "transformer", quantized, deltas))
    flat = weights.flatten(quantized)
    kernels = [p for p in flat if p[-1] == "kernel" and quant.is_quantized_dtype(flat[p].dtype)]
    assert len(kernels) == 10  # q, k, v, out of both attentions and the two FFN layers
    for kernel in kernels:
        expected_q, expected_scale = quant.quantize_kernel(np.asarray(merged[kernel]), "int8")
        scale = (*kernel[:-1], "scale")
        assert loaded[kernel].sharding == flat[kernel].sharding
        np.testing.assert_array_equal(np.asarray(loaded[kernel]), expected_q, err_msg=str(kernel))
        np.testing.assert_array_equal(np.asarray(loaded[scale]), expected_scale)
    ffn = ("blocks", "ffn", "linear_1", "kernel")
    plain = weights.flatten(checkpoint.load_component(folder, "transformer", quantized))
    assert not np.array_equal(np.asarray(plain[ffn]), np.asarray(loaded[ffn]))


@pytest.fixture(scope="module")
def quant_builds(tiny_build, tmp_path_factory):
    """The tiny model's full-precision build (the session's) and a build per --quant mode, in
    one artifacts folder (they reuse its text encoder and decode); the full-precision one's
    name."""
    root = tmp_path_factory.mktemp("quant")
    with_its_store(tiny_build, root)
    for mode in quant.SCHEMES:
        run_cli("aot", "build", "--model", "tiny", *TINY_SHAPE, "--target", "cpu-8",
                "--quant", mode, "--out", str(root))  # fmt: skip
    (full,) = [p.name for p in root.iterdir() if not p.name.startswith(".") and "_w8" not in p.name]
    return root, full


def _frames(root, weights_folder, build, tmp_path):
    out = tmp_path / f"{build}.npy"
    run_cli(
        "runtime", "run", "--artifacts", str(root), "--weights", str(weights_folder),
        *TINY_SHAPE, "--prompt", "a red cat running in the rain", "--steps", "4", "--seed", "3",
        "--build", build, "--save-frames", str(out), "--out", str(tmp_path / "v.mp4"),
    )  # fmt: skip
    return np.load(out).astype(np.float64)


@pytest.fixture(scope="module")
def frames_of(quant_builds, tmp_path_factory):
    """`_frames` of a build of quant_builds with given weights, each run once in the module: the
    full-precision build's frames are every mode's reference (one `runtime run`, not four)."""
    root, _ = quant_builds
    made: dict[tuple, np.ndarray] = {}

    def frames(weights_folder, build):
        if (weights_folder, build) not in made:
            scratch = tmp_path_factory.mktemp("frames")
            made[weights_folder, build] = _frames(root, weights_folder, build, scratch)
        return made[weights_folder, build]

    return frames


# Measured on the tiny model (192x320, 9 frames, 4 steps) against its float32 build (this
# test prints them): max 4-40/255, mean 0.14-1.97/255, PSNR 39.2-56.5 dB, fp8 activations
# furthest (3 mantissa bits). A broken scheme (a wrong scale, a transposed kernel) gives noise.
MIN_PSNR_DB = 35.0
MAX_MEAN = 3.0  # /255


@pytest.mark.parametrize("mode", sorted(quant.SCHEMES))
def test_every_mode_runs_close_to_full_precision(quant_builds, frames_of, tiny_weights, mode):
    _, name = quant_builds
    full = frames_of(tiny_weights, name)
    frames = frames_of(tiny_weights, f"{name}_{mode}")
    diff = np.abs(frames - full)
    psnr = 10 * np.log10(255**2 / max((diff**2).mean(), 1e-12))
    print(f"{mode}: max {diff.max():.0f}/255, mean {diff.mean():.2f}/255, PSNR {psnr:.1f} dB")
    assert diff.max() > 0  # the weights are 8-bit
    assert diff.mean() <= MAX_MEAN and psnr >= MIN_PSNR_DB


def test_a_quantized_checkpoint_loads_as_stored(quant_builds, frames_of, tiny_weights, tmp_path):
    """`python -m wan.quantize` writes what quantizing at load makes: the same frames; a build
    without --quant refuses it in one line."""
    root, name = quant_builds
    build = f"{name}_w8a8-int8"
    stored = tmp_path / "int8"
    run_cli("python", "-m", "wan.quantize", "--weights", str(tiny_weights), "--quant",
            "w8a8-int8", "--out", str(stored))  # fmt: skip
    assert np.array_equal(frames_of(stored, build), frames_of(tiny_weights, build))
    refused = run_cli(
        "runtime", "run", "--artifacts", str(root), "--weights", str(stored), *TINY_SHAPE,
        "--prompt", "a", "--steps", "2", "--build", name,
        "--out", str(tmp_path / "x.mp4"), check=False,
    )  # fmt: skip
    assert (
        refused.returncode == 2 and "8-bit" in refused.stderr and "Traceback" not in refused.stderr
    )
    assert len(refused.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "target, mode, unit", [("tpu-v6e-8", "w8a8-fp8", "fp8"), ("tpu7x-8", "w8a8-int8", "int8")]
)
def test_a_target_without_the_8bit_unit_is_refused(tmp_path, target, mode, unit):
    result = run_cli("aot", "build", "--model", "tiny", *TINY_SHAPE, "--target", target,
                     "--quant", mode, "--out", str(tmp_path), check=False)  # fmt: skip
    assert result.returncode == 2 and f"no {unit} matrix unit" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not any(tmp_path.iterdir())


def test_the_tpu_step_runs_its_linear_layers_on_8bit_operands(tmp_path):
    """A deviceless tpu-v6e-8 w8a8-int8 build: the denoise step's and kv_cache's optimized HLO
    hold dots on s8 x s8 operands, counted apart in the manifest, and the step lower bound takes
    them at the chip's 8-bit rate (twice bf16's on v6e). At 32x64, not TINY_SHAPE's 64x128: the
    Linear layers are the same, and the decode, which this test does not read, compiles in
    half the time."""
    from runtime.builds.artifact import read_manifest

    # --vae-vmem 4: the decode, which this test does not read, in its fast compile (13 s less).
    run_cli("aot", "build", "--model", "tiny", "--res", "32x64", "--frames", "9", "--batch", "1",
            "--target", "tpu-v6e-8", "--quant", "w8a8-int8", "--vae-vmem", "4",
            "--out", str(tmp_path))  # fmt: skip
    (folder,) = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    manifest = read_manifest(folder)
    step, kv = manifest.programs["denoise_step"], manifest.programs["kv_cache"]
    assert 0 < step.eight_bit_flops < step.flops and kv.eight_bit_flops > 0
    assert manifest.peak_8bit_flops == 2 * manifest.peak_flops
    all_at_bf16 = (step.flops + step.kernel_flops) / manifest.peak_flops
    saved = step.eight_bit_flops / manifest.peak_8bit_flops
    assert manifest.step_lower_bound() == pytest.approx(all_at_bf16 - saved)


def _scheme_linear(layer: torch.nn.Linear, s: quant.Scheme, per_token: bool) -> None:
    """`layer` computing a w8a8 scheme in torch float64, written from quant's docstring (not
    its code): weights per output channel; activations per token, or (`per_token` False: the
    plausible mistake) one scale for the whole tensor."""
    qmax = s.qmax

    def to_8bit(x: torch.Tensor) -> torch.Tensor:
        if s.weight_dtype == "int8":
            return torch.clamp(torch.round(x), -qmax, qmax)  # half to even
        return x.float().to(torch.float8_e4m3fn).double()

    def nonzero(scale: torch.Tensor) -> torch.Tensor:
        return torch.where(scale == 0, torch.ones_like(scale), scale)

    w = layer.weight.detach().double()  # (out, in)
    w_scale = nonzero(w.abs().amax(dim=1) / qmax)
    wq = to_8bit(w / w_scale[:, None])
    bias = layer.bias.detach().double()

    def forward(x: torch.Tensor) -> torch.Tensor:
        xd = x.double()
        peak = xd.abs().amax(dim=-1, keepdim=True) if per_token else xd.abs().amax()
        x_scale = nonzero(peak / qmax)
        return ((to_8bit(xd / x_scale) @ wq.T) * x_scale * w_scale + bias).to(x.dtype)

    layer.forward = forward


# The programs --quant leaves alone: a quant build's store entries for them are the full
# build's (quant_builds reuses them); compiled once for both modes of the end-to-end test.
UNQUANTIZED_PROGRAMS = ("text_encode", "latents_handoff", "vae_decode")
QUANTIZED_PROGRAMS = ("kv_cache", "denoise_step")


def _scheme_plan(folder, mode: str):
    config = ModelConfig.from_diffusers(folder, dtype="float32")
    shape = VideoShape(width=WIDTH, height=HEIGHT, frames=FRAMES, batch=len(PROMPTS))
    return config, plan_build("tiny-diffusers", config, shape, parse_target("cpu-8"), 8, quant=mode)


def _diffusers_frames(folder, noise: np.ndarray, scheme: quant.Scheme | None, per_token: bool):
    """diffusers' WanPipeline of `folder` on `noise`; with `scheme`, its blocks' Linear layers
    compute it in float64 (`per_token`: as quant's docstring says; else one activation scale
    per tensor)."""
    pipe = WanPipeline.from_pretrained(folder, torch_dtype=torch.float32)
    if scheme is not None:
        for name, layer in pipe.transformer.blocks.named_modules():
            if isinstance(layer, torch.nn.Linear) and name.split(".")[1] in QUANTIZED:
                _scheme_linear(layer, scheme, per_token)
    return pipe(prompt=PROMPTS, negative_prompt=NEGATIVE, height=HEIGHT, width=WIDTH,
                num_frames=FRAMES, num_inference_steps=STEPS, guidance_scale=5.0,
                latents=torch.from_numpy(noise), output_type="np").frames  # fmt: skip


@pytest.fixture(scope="module")
def scheme_pipeline(tmp_path_factory):
    """What both modes of the end-to-end test share: the tiny diffusers pipeline, its noise,
    its full-precision frames, and the executables --quant leaves alone (compiled once)."""
    folder = tmp_path_factory.mktemp("pipe")
    save_tiny_diffusers_pipeline(folder)
    noise = np.random.default_rng(0).standard_normal(
        (len(PROMPTS), 16, (FRAMES - 1) // 4 + 1, HEIGHT // 8, WIDTH // 8), dtype=np.float32
    )
    _, plan = _scheme_plan(folder, "none")
    unquantized = {
        program.name: compiled
        for program, compiled, *_ in compile_plan(
            plan, frames_dtype="float32", only=UNQUANTIZED_PROGRAMS
        )
    }
    return folder, noise, _diffusers_frames(folder, noise, None, True), unquantized


@pytest.mark.parametrize("mode", ["w8a8-int8", "w8a8-fp8"])
def test_a_w8a8_pipeline_is_its_scheme_end_to_end(scheme_pipeline, mode):
    """A whole w8a8 pipeline (4 steps with CFG, decoded) against diffusers' WanPipeline whose
    blocks' Linear layers compute the scheme in float64: closer to it than to full precision,
    and a pipeline with one activation scale per tensor (the plausible mistake) is many times
    further away. (Measured, int8 and fp8, mean |difference| of frames in [0, 1]: 0.0007 and
    0.0014 from the scheme, 0.0011 and 0.0084 from full precision, 0.0127 and 0.0109 from
    per-tensor scales; a 1e-5 relative change of every 8-bit layer's input moves the
    reference itself by 0.0005: a rounding tie flipped spreads.)"""
    folder, noise, full, unquantized = scheme_pipeline
    s = quant.SCHEMES[mode]
    config, plan = _scheme_plan(folder, mode)
    assert set(unquantized) | set(QUANTIZED_PROGRAMS) == set(plan.key.programs)
    executables = {
        **unquantized,
        **{
            program.name: compiled
            for program, compiled, *_ in compile_plan(
                plan, frames_dtype="float32", only=QUANTIZED_PROGRAMS
            )
        },
    }
    pipe = Pipeline.assemble(executables, folder, plan.key, "in-process", config)
    ours, _ = pipe.generate(PROMPTS, NEGATIVE, steps=STEPS, guidance=5.0, init_noise=noise)

    scheme = _diffusers_frames(folder, noise, s, per_token=True)
    mistake = _diffusers_frames(folder, noise, s, per_token=False)
    off = {name: float(np.abs(ours - frames).mean())
           for name, frames in (("scheme", scheme), ("mistake", mistake), ("full", full))}  # fmt: skip
    print(mode, off)
    assert off["scheme"] <= SCHEME_MEAN and off["scheme"] < off["full"], off
    assert off["mistake"] >= 5 * off["scheme"], off
