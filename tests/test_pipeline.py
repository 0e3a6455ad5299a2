"""Whole pipeline vs diffusers' WanPipeline: tokenize, encode, 4 denoise steps with CFG, decode.

A tiny WanPipeline with random weights is saved offline; our side reads that folder (configs
and safetensors through the project's importer), compiles the four programs for 8 CPU devices
and runs the runtime's generation loop. Same prompts, same initial latents. Tolerance: frames
in [0, 1] within 1e-3 (fp32).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
from transformers import UMT5Config, UMT5EncoderModel

from aot.build import compile_in_process, plan_build
from aot.targets import parse_target
from runtime.pipeline import Pipeline
from wan.configs import ModelConfig
from wan.programs import VideoShape
from wan.tokenizer import build_word_tokenizer

WIDTH, HEIGHT, FRAMES, STEPS = 32, 48, 9, 4  # portrait; 3 latent frames
PROMPTS = ["a red cat running in the rain", "a boat on the sea at night"]
NEGATIVE = ["blurry low quality", ""]


def _transformer() -> WanTransformer3DModel:
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=16,
        out_channels=16, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=1024,
    )  # fmt: skip
    with torch.no_grad():  # make the zero/one-initialised norms and tables matter
        for name, p in model.named_parameters():
            if "norm" in name or "scale_shift" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _save_pipeline(folder, two_experts: bool) -> None:
    torch.manual_seed(0)
    text_encoder = UMT5EncoderModel(
        UMT5Config(
            vocab_size=256, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            relative_attention_num_buckets=32, relative_attention_max_distance=128,
            feed_forward_proj="gated-gelu", dropout_rate=0.0,
        )
    )  # fmt: skip
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


@pytest.mark.parametrize("two_experts", [False, True], ids=["wan2.1", "two-experts"])
def test_pipeline_matches_diffusers(tmp_path, two_experts):
    folder = tmp_path / "pipe"
    _save_pipeline(folder, two_experts)
    noise = np.random.default_rng(0).standard_normal(
        (len(PROMPTS), 16, (FRAMES - 1) // 4 + 1, HEIGHT // 8, WIDTH // 8), dtype=np.float32
    )
    guidance_2 = 3.0 if two_experts else None

    reference = WanPipeline.from_pretrained(folder, torch_dtype=torch.float32)
    expected = reference(
        prompt=PROMPTS,
        negative_prompt=NEGATIVE,
        height=HEIGHT,
        width=WIDTH,
        num_frames=FRAMES,
        num_inference_steps=STEPS,
        guidance_scale=5.0,
        guidance_scale_2=guidance_2,
        latents=torch.from_numpy(noise),
        output_type="np",
    ).frames

    config = ModelConfig.from_diffusers(folder, dtype="float32")
    assert config.num_experts == (2 if two_experts else 1)
    shape = VideoShape(width=WIDTH, height=HEIGHT, frames=FRAMES, batch=len(PROMPTS))
    plan = plan_build("tiny-diffusers", config, shape, parse_target("cpu-8"), 8)
    executables = compile_in_process(plan, frames_dtype="float32")
    pipe = Pipeline.assemble(executables, folder, plan.key, "in-process", config)
    frames, report = pipe.generate(
        PROMPTS, NEGATIVE, steps=STEPS, guidance=5.0, guidance_2=guidance_2, init_noise=noise
    )

    assert frames.shape == expected.shape == (2, FRAMES, HEIGHT, WIDTH, 3)
    assert report.compile_count == 0
    np.testing.assert_allclose(frames, expected, atol=1e-3, rtol=0)
    assert np.ptp(frames) > 0.05  # the comparison is between real videos, not flat frames
