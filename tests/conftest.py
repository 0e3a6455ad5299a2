"""Test setup: 8 CPU host devices (sharding tests), fp32 matmuls at full precision."""

import os
import shutil

# 8 CPU host devices; the tiny programs' machine code unoptimized (LLVM -O0): the suite is
# mostly compiles, a quarter faster so, and every comparison it makes is between programs
# compiled alike (a runtime's against jit's, against diffusers at a stated tolerance).
os.environ.setdefault(
    "XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# One torch thread a worker: pytest -n 2 on 2 cores, and torch's spare thread busy-waits (a tiny
# diffusers reference took 10x the CPU with two). Only its summation order may change, far
# inside the tolerances the references are compared at.
torch.set_num_threads(1)
from diffusers import (  # noqa: E402
    AutoencoderKLWan,
    UniPCMultistepScheduler,
    WanPipeline,
    WanTransformer3DModel,
)
from transformers import UMT5Config, UMT5EncoderModel  # noqa: E402

from wan.tokenizer import build_word_tokenizer  # noqa: E402

BIN = Path(sys.executable).parent
TINY_SHAPE = ["--res", "64x128", "--frames", "9", "--batch", "1"]
# The 8-bit attention builds' shape: bench/attention_8bit.py's pipelines at its default frames.
QUANT_ATTENTION_SHAPE = ["--res", "64x128", "--frames", "17", "--batch", "1"]
SMALL = ["--res", "64x96", "--frames", "5"]  # the served shape: small frames, the decode dominates
TEXT_GAIN = 3.0  # on the tiny transformer's text path (_transformer)


def run_cli(
    tool: str, *args: str, env: dict | None = None, check: bool = True
) -> subprocess.CompletedProcess:
    """Run `aot`/`runtime` as a user would: a fresh process, its own device setup."""
    result = subprocess.run(
        [str(BIN / tool), *args], capture_output=True, text=True, env=env, timeout=900
    )
    if check and result.returncode != 0:
        raise AssertionError(f"{tool} {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
    return result


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory) -> Path:
    """A folder shared by all xdist workers of this run (builds are locked and skipped)."""
    root = tmp_path_factory.getbasetemp()
    root = root.parent if root.name.startswith("popen-") else root
    (root / "shared").mkdir(exist_ok=True)
    return root / "shared"


@pytest.fixture(scope="session")
def tiny_build(shared_dir) -> Path:
    """`aot build` of the tiny model, portrait 64x128, 9 frames, batch 1, for cpu-8."""
    out = shared_dir / "artifacts"
    run_cli("aot", "build", "--model", "tiny", *TINY_SHAPE, "--target", "cpu-8", "--out", str(out))
    (folder,) = [p for p in out.iterdir() if p.name.startswith("tiny_64x128_f9_b1_")]
    return folder


def with_its_store(build: Path, out: Path) -> Path:
    """A copy of `build` in the artifacts folder `out`, with its programs' store entries, so that
    builds made into `out` reuse what they share with it (and it is up to date)."""
    from aot.building import store
    from runtime.builds.artifact import read_manifest

    shutil.copytree(build, out / build.name)
    for program in read_manifest(build).programs.values():
        entry = build.parent / store.STORE / program.program_id
        shutil.copytree(entry, out / store.STORE / program.program_id, dirs_exist_ok=True)
    return out / build.name


@pytest.fixture(scope="session")
def tiny_weights(shared_dir) -> Path:
    """Random tiny weights in the project's checkpoint format (written once per run)."""
    import fcntl

    from wan.presets import PRESETS
    from wan.random_weights import write_random_checkpoint

    folder = shared_dir / "tiny-weights"
    with (shared_dir / "weights.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not folder.exists():
            write_random_checkpoint(PRESETS["tiny"], folder, seed=0)
    return folder


def _transformer(
    channels: int = 16,
    in_channels: int | None = None,
    image_dim: int | None = None,
    pos_embed_seq_len: int | None = None,
):
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16,
        in_channels=in_channels or channels, out_channels=channels, text_dim=32, freq_dim=32,
        ffn_dim=64, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=1024, image_dim=image_dim,
        added_kv_proj_dim=None if image_dim is None else 32, pos_embed_seq_len=pos_embed_seq_len,
    )  # fmt: skip
    with torch.no_grad():  # make the zero/one-initialised norms and tables matter
        for name, p in model.named_parameters():
            if "norm" in name or "scale_shift" in name:
                p.add_(0.1 * torch.randn_like(p))
            # At its default init the text path moves the frames by less than the CLI parity
            # tolerance: a dropped prompt would pass. x3 makes the prompt, the negative prompt
            # and the guidance each move them by over 3x it (tests/test_cli_parity.py asserts).
            if "text_embedder" in name or "attn2.to_out" in name:
                p.mul_(TEXT_GAIN)
    return model


I2V_CHANNELS = 16 + 4 + 16  # the latents, the mask, the image's latents
CLIP_SIZE = 28  # a tiny CLIP: 2x2 patches of 14 pixels and the class token


def save_tiny_i2v_pipeline(folder, clip: bool, first_last: bool = False) -> None:
    """A tiny diffusers WanImageToVideoPipeline with random weights, saved: Wan 2.1's kind
    (`clip`: a CLIP vision model, image features in every cross-attention; `first_last`: both
    images' features behind a position table, FLF2V's) or Wan 2.2 I2V-A14B's (two experts, the
    image through its latents only)."""
    from diffusers import WanImageToVideoPipeline
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(0)
    image_parts = {"image_encoder": None, "image_processor": None}
    if clip:
        encoder = CLIPVisionModel(
            CLIPVisionConfig(
                hidden_size=24, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                image_size=CLIP_SIZE, patch_size=14, hidden_act="gelu", projection_dim=16,
            )
        ).eval()  # fmt: skip
        processor = CLIPImageProcessor(
            size={"shortest_edge": CLIP_SIZE}, crop_size={"height": CLIP_SIZE, "width": CLIP_SIZE}
        )
        image_parts = {"image_encoder": encoder, "image_processor": processor}
    experts = 1 if clip else 2
    clip_tokens = (CLIP_SIZE // 14) ** 2 + 1
    transformers = [
        _transformer(
            in_channels=I2V_CHANNELS,
            image_dim=24 if clip else None,
            pos_embed_seq_len=2 * clip_tokens if first_last else None,
        )
        for _ in range(experts)
    ]
    if first_last:  # zero at init: a random table, for the test to see it added
        for model in transformers:
            with torch.no_grad():
                model.condition_embedder.image_embedder.pos_embed.normal_(0.0, 1.0)
    with torch.no_grad():  # at its init the image moves the frames by little: the condition's
        for model in transformers:  # channels x10 make another image move them well past it
            model.patch_embedding.weight[:, 16:].mul_(10.0)
    vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1)
    with torch.no_grad():  # the random encoder's latents vary with the image by ~0.1: x20
        vae.quant_conv.weight.mul_(20.0)
    pipe = WanImageToVideoPipeline(
        tokenizer=build_word_tokenizer(folder / "_tokenizer", vocab_size=256),
        text_encoder=_text_encoder(),
        vae=vae,
        scheduler=UniPCMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
        ),
        transformer=transformers[0],
        transformer_2=transformers[1] if experts == 2 else None,
        boundary_ratio=None if clip else 0.9,
        **image_parts,
    )
    pipe.save_pretrained(folder)


def _text_encoder():
    return UMT5EncoderModel(
        UMT5Config(
            vocab_size=256, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            relative_attention_num_buckets=32, relative_attention_max_distance=128,
            feed_forward_proj="gated-gelu", dropout_rate=0.0,
        )
    )  # fmt: skip


def save_tiny_diffusers_pipeline(folder, two_experts: bool = False) -> None:
    """A tiny diffusers WanPipeline with random weights (the tiny preset's shapes), saved."""
    torch.manual_seed(0)
    text_encoder = _text_encoder()
    vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1)
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
    )
    tokenizer = build_word_tokenizer(folder / "_tokenizer", vocab_size=256)
    pipe = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        transformer=_transformer(),
        vae=vae,
        scheduler=scheduler,
        transformer_2=_transformer() if two_experts else None,
        boundary_ratio=0.9 if two_experts else None,
    )
    pipe.save_pretrained(folder)


TI2V_Z = 48  # the Wan 2.2 VAE's latent channels


def tiny_wan22_vae(z_dim: int = TI2V_Z) -> AutoencoderKLWan:
    """A tiny random Wan 2.2 VAE (TI2V-5B's kind): residual, 2x2 pixel patches, 16x in space,
    a decoder twice the encoder's width; non-trivial gains and biases."""
    vae = AutoencoderKLWan(
        base_dim=8, decoder_base_dim=16, z_dim=z_dim, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
        is_residual=True, patch_size=2, in_channels=12, out_channels=12,
        scale_factor_spatial=16, scale_factor_temporal=4,
        latents_mean=torch.randn(z_dim).mul(0.2).tolist(),
        latents_std=torch.rand(z_dim).add(0.5).tolist(),
    )  # fmt: skip
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if name.endswith("gamma"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return vae


def save_tiny_ti2v_pipeline(folder) -> None:
    """A tiny diffusers WanPipeline of the TI2V-5B kind (expand_timesteps, a 48-channel
    transformer, the tiny Wan 2.2 VAE) with random weights, saved."""
    torch.manual_seed(0)
    pipe = WanPipeline(
        tokenizer=build_word_tokenizer(folder / "_tokenizer", vocab_size=256),
        text_encoder=_text_encoder(),
        transformer=_transformer(channels=TI2V_Z),
        vae=tiny_wan22_vae(),
        scheduler=UniPCMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0
        ),
        expand_timesteps=True,
    )
    pipe.save_pretrained(folder)


def compile_program(*args, **kwargs):
    """`aot.building.lower.lower_program(*args, **kwargs)`, compiled: one program outside a build."""
    from aot.building.lower import lower_program

    return lower_program(*args, **kwargs).compile()


def deviceless_tpu_devices(monkeypatch, target) -> list:
    """`aot.targets.devices(target)` for a TPU target, with libtpu's deviceless settings as
    `prepare_environment` makes them (skipped only where libtpu is not installed)."""
    from aot import targets

    pytest.importorskip("libtpu", reason="needs the tpu extra")
    for key, value in dict(
        TPU_SKIP_MDS_QUERY="1",
        TPU_ACCELERATOR_TYPE=f"{target.generation}-8",
        TPU_WORKER_HOSTNAMES="localhost",
        ALLOW_MULTIPLE_LIBTPU_LOAD="1",  # pytest -n 2: another worker may have libtpu loaded
        TPU_MIN_LOG_LEVEL="3",
        TPU_STDERR_LOG_LEVEL="3",
    ).items():
        monkeypatch.setenv(key, value)
    return targets.devices(target)


@pytest.fixture(scope="session")
def small_builds(shared_dir) -> Path:
    """Tiny builds of one shape, batch 1 and batch 2, cpu-8, in one artifacts folder."""
    out = shared_dir / "serve-artifacts"
    run_cli("aot", "build", "--model", "tiny", *SMALL, "--batch", "1", "--batch", "2",
            "--target", "cpu-8", "--out", str(out))  # fmt: skip
    return out


@pytest.fixture(scope="session")
def attention_quant_builds(shared_dir) -> dict[str, Path]:
    """Tiny blockwise builds (cpu-8) with full-precision, int8 and fp8 attention, each in its own
    artifacts folder `<format>` as bench/attention_8bit.py builds them (its --artifacts: up to
    date there, not compiled again); by format, its build folder."""
    import fcntl
    import json

    from aot.building import store

    out, found = shared_dir / "attention-quant", {}
    out.mkdir(exist_ok=True)
    with (shared_dir / "attention-quant.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # pytest -n 2: one worker builds, the other waits
        for fmt in ("none", "int8", "fp8"):
            if found:  # the programs built so far, reused where their ids match (all but the
                # denoise step: the text encoder, kv cache and decode are the full-precision one's)
                shutil.copytree([*found.values()][-1].parent / store.STORE,
                                out / fmt / store.STORE, dirs_exist_ok=True)  # fmt: skip
            result = run_cli(
                "aot", "build", "--model", "tiny", *QUANT_ATTENTION_SHAPE, "--target", "cpu-8",
                "--attention", "blockwise", "--attention-quant", fmt, "--out", str(out / fmt),
                "--json",
            )  # fmt: skip
            (built,) = json.loads(result.stdout)
            found[fmt] = Path(built["folder"])
    return found
