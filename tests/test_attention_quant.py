"""8-bit attention (`aot build --attention-quant`, wan.models.attention_quant): its accuracy
against bf16 attention on inputs shaped like DiT activations (bench/attention_8bit.py's
`dit_like`, which says how), the smoothing that makes it, the Pallas TPU kernel (interpret mode)
with and without the Radial mask and under Ulysses, the kernel compiled for deviceless TPUs,
whole tiny pipelines, the FLOPs counted at the 8-bit rate, and the refusals."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import QUANT_ATTENTION_SHAPE, deviceless_tpu_devices, run_cli

from aot.building.plan import (
    BuildError,
    eight_bit_kernel_flops,
    kernel_flops,
    plan_build,
    self_attention,
)
from aot.targets import parse_target
from runtime.builds.artifact import read_manifest
from wan import sharding
from wan.configs import VideoShape
from wan.models.attention import attention, dot_product_attention, resolve
from wan.models.attention_quant import quant_splash_attention, smooth_keys
from wan.models.radial_mask import RadialSpec
from wan.presets import PRESETS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from attention_8bit import (
    TOKENS,  # noqa: E402  (the bench's inputs)
    unsmoothed,  # noqa: E402
)
from attention_8bit import dit_like as dit_like_arrays  # noqa: E402

# bench/attention_8bit.py measures them (bench/results/attention_8bit.json). The bounds
# hold for int8 (on `dit_like`: cos >= 0.9998, rel L1 <= 1.6%, the Pallas kernel and blockwise
# alike). fp8 (e4m3: 3 mantissa bits) has a floor of its own, over the issue's: on plain
# N(0, 1) inputs with no outlier at all, its Q K^T alone is 3.9% rel L1 from bf16 and with
# P V in fp8 too 5.3-5.5% (cos 0.9985); 4.8-5.1% (0.9987) on `dit_like`. Its bounds here are
# that floor's; int8 on the same N(0, 1) inputs: 1.4%.
BOUNDS = {"int8": (0.999, 0.02), "fp8": (0.998, 0.06)}


def dit_like(seed: int = 0, tokens: int = TOKENS) -> tuple[jax.Array, ...]:
    return tuple(jnp.asarray(x, jnp.bfloat16) for x in dit_like_arrays(seed, tokens))


def per_head(out: jax.Array, ref: jax.Array) -> list[tuple[float, float]]:
    """(cosine similarity, relative L1) of each head's output."""
    found = []
    for h in range(out.shape[2]):
        a = np.asarray(out[0, :, h], np.float64).ravel()
        b = np.asarray(ref[0, :, h], np.float64).ravel()
        cos = a @ b / np.linalg.norm(a) / np.linalg.norm(b)
        found.append((cos, np.abs(a - b).sum() / np.abs(b).sum()))
    return found


def within(found: list[tuple[float, float]], fmt: str) -> bool:
    cos_min, l1_max = BOUNDS[fmt]
    return all(cos >= cos_min and l1 <= l1_max for cos, l1 in found)


def kernels(fmt: str, sparse=None) -> dict:
    return {
        "blockwise": jax.jit(resolve("blockwise:128:128", sparse=sparse, quant=fmt)),
        "splash": jax.jit(resolve("splash:128:128:128", sparse=sparse, quant=fmt, interpret=True)),
    }


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_8bit_attention_is_close_to_bf16(fmt):
    q, k, v = dit_like()
    ref = dot_product_attention(q, k, v)  # bf16 attention: fp32 scores and softmax
    for name, kernel in kernels(fmt).items():
        found = per_head(kernel(q, k, v), ref)
        assert within(found, fmt), (name, found)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_without_smoothing_the_keys_it_is_measurably_worse(fmt):
    """The control: the same blocks and quantizer on the raw keys (the bench's `unsmoothed`)
    against the kernel, which smooths them."""
    q, k, v = dit_like()
    ref = dot_product_attention(q, k, v)
    raw = per_head(unsmoothed(q, k, v, fmt), ref)
    smooth = per_head(jax.jit(resolve("blockwise:128:128", quant=fmt))(q, k, v), ref)
    assert not within(raw, fmt)
    assert all(r[1] > 2.5 * s[1] for r, s in zip(raw, smooth, strict=True)), (raw, smooth)


def test_smoothing_is_exact_in_full_precision():
    """Softmax is shift-invariant along the keys: subtracting the mean key changes nothing."""
    q, k, v = (x.astype(jnp.float32) for x in dit_like())
    np.testing.assert_allclose(
        dot_product_attention(q, smooth_keys(k, TOKENS), v), dot_product_attention(q, k, v),
        atol=2e-5, rtol=0,
    )  # fmt: skip


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_8bit_attention_with_the_radial_mask(fmt):
    """Sparse and 8-bit at once: against bf16 attention under the same mask (blocks it drops
    skipped in the Pallas kernel, entries masked in blockwise)."""
    spec = RadialSpec(frames=5, tokens_per_frame=240, block=16)
    q, k, v = dit_like()
    ref = dot_product_attention(q, k, v, sparse=spec)
    assert np.abs(np.asarray(ref - dot_product_attention(q, k, v), np.float32)).max() > 0.1
    for name, kernel in kernels(fmt, spec).items():
        assert within(per_head(kernel(q, k, v), ref), fmt), name


def test_the_kernel_under_ulysses_is_the_kernel():
    """Tokens sharded over context=4, heads all-to-all'd: each device runs the kernel on whole
    sequences of its heads, so the result is the single-device kernel's."""
    q, k, v = dit_like(tokens=1024)
    q, k, v = (jnp.tile(x, (1, 1, 4, 1)) for x in (q, k, v))  # 8 heads: 2 per device
    mesh = sharding.make_mesh(jax.devices("cpu")[:8], sharding.MeshShape(data=2, context=4).items())
    with jax.set_mesh(mesh), sharding.axis_rules(sharding.TRANSFORMER_RULES):
        got = jax.jit(lambda q, k, v: attention(q, k, v, "splash:128:128:128", "ulysses",
                                                quant="int8"))(q, k, v)  # fmt: skip
    want = quant_splash_attention(q, k, v, blocks=(128, 128), fmt="int8", interpret=True)
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), atol=1e-6, rtol=0
    )


@pytest.mark.parametrize(
    "target, fmt, sparse",
    [
        ("tpu-v6e-8", "int8", None),
        ("tpu-v6e-8", "int8", RadialSpec(frames=5, tokens_per_frame=600)),
        ("tpu7x-8", "fp8", None),
        ("tpu7x-8", "fp8", RadialSpec(frames=5, tokens_per_frame=240)),
    ],
)
def test_the_kernel_compiles_for_a_deviceless_tpu(target, fmt, sparse, monkeypatch):
    """int8 Q K^T with int32 accumulation on v6e, fp8 Q K^T and P V on tpu7x, Mosaic lowering
    the 8-bit dots (and the mask's arithmetic) for a chip that is not here."""
    device = deviceless_tpu_devices(monkeypatch, parse_target(target))[0]
    tokens = 3000 if sparse is None else sparse.tokens
    on_chip = jax.sharding.SingleDeviceSharding(device)
    x = jax.ShapeDtypeStruct((1, tokens, 2, 128), jnp.bfloat16, sharding=on_chip)
    kernel = jax.jit(resolve("splash:512:512:512", sparse=sparse, quant=fmt))
    compiled = kernel.lower(x, x, x).compile()
    assert "quant_splash_attention" in compiled.as_text()


TINY = PRESETS["tiny"]
SHAPE = QUANT_ATTENTION_SHAPE


@pytest.fixture(scope="module")
def quant_builds(attention_quant_builds) -> dict[str, Path]:
    """The session's full-precision, int8 and fp8 builds (conftest: bench/attention_8bit.py's
    test runs its pipelines on them too)."""
    return attention_quant_builds


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return 10 * np.log10(255**2 / mse) if mse else float("inf")


def test_a_tiny_8bit_pipeline_is_close_to_full_precision(quant_builds, tiny_weights, tmp_path):
    """Whole pipelines (the tiny model computes in float32; 4 steps): the int8 build's frames
    at 50 dB PSNR or more from the full-precision build's, fp8's at 45 (measured 58.2 and
    53.0 dB), and a control: another seed is at 10 dB."""
    frames = {}
    for name, seed in [("none", 3), ("int8", 3), ("fp8", 3), ("none_other_seed", 4)]:
        fmt = name.split("_")[0]
        out = tmp_path / f"{name}.npy"
        run_cli(
            "runtime", "run", "--artifacts", str(quant_builds[fmt].parent),
            "--weights", str(tiny_weights), *SHAPE, "--prompt", "a fox in the snow",
            "--steps", "4", "--seed", str(seed), "--out", str(tmp_path / f"{name}.mp4"),
            "--save-frames", str(out), "--report", str(tmp_path / f"{name}.json"),
        )  # fmt: skip
        frames[name] = np.load(out)
        assert json.loads((tmp_path / f"{name}.json").read_text())["compile_count"] == 0
    control = psnr(frames["none_other_seed"], frames["none"])
    assert psnr(frames["int8"], frames["none"]) >= 50
    assert psnr(frames["fp8"], frames["none"]) >= 45
    assert control < 30


def test_the_8bit_dots_are_counted_at_their_rate(quant_builds):
    """On CPU the blockwise kernel's int8 dots stay in the optimized HLO: half of the
    self-attention FLOPs (Q K^T), counted at the 8-bit rate. XLA's CPU backend has no fp8 dot
    and upcasts fp8 operands before it: none is counted as 8-bit there."""
    steps = {f: read_manifest(quant_builds[f]).programs["denoise_step"] for f in quant_builds}
    self_flops = steps["none"].self_attention_flops
    assert steps["none"].eight_bit_flops == 0
    assert steps["int8"].eight_bit_flops == pytest.approx(self_flops / 2, rel=1e-6)
    assert steps["fp8"].eight_bit_flops == 0


def tpu_plan(target: str, fmt: str, sparse: str = "none", attention: str = "splash:512:512:512"):
    return plan_build(
        "tiny", TINY, VideoShape(192, 320, 33, 1), parse_target(target), 8,
        mesh=sharding.MeshShape(data=2, tensor=4), attention=attention,
        attention_quant=fmt, sparse_attention=sparse,
    )  # fmt: skip


def test_the_splash_kernel_s_8bit_flops_and_the_lower_bound():
    """The Pallas kernel is opaque to the HLO count: its 8-bit part is counted apart
    (eight_bit_kernel_flops), and the step's lower bound takes it at the 8-bit rate."""
    int8, fp8 = tpu_plan("tpu-v6e-8", "int8"), tpu_plan("tpu7x-8", "fp8")
    dense = self_attention(int8, radial=False)
    assert eight_bit_kernel_flops(int8) == pytest.approx(dense.flops / 2)
    assert eight_bit_kernel_flops(fp8) == pytest.approx(self_attention(fp8, False).flops)
    assert eight_bit_kernel_flops(tpu_plan("tpu-v6e-8", "none")) == 0
    assert kernel_flops(int8) == kernel_flops(tpu_plan("tpu-v6e-8", "none"))  # same work
    radial = tpu_plan("tpu-v6e-8", "int8", "radial:0.2:12:1:128", "splash:128:128:128")
    sparse = self_attention(radial, radial=True)
    assert sparse.flops < sparse.dense_flops and sparse.eight_bit_flops == sparse.flops / 2
    blockwise = tpu_plan("tpu-v6e-8", "int8", attention="blockwise")
    assert eight_bit_kernel_flops(blockwise) == 0  # the HLO counts XLA's dots itself


@pytest.mark.parametrize(
    "target, fmt, attention, says",
    [
        ("tpu7x-8", "int8", "splash:512:512:512", "no int8 matrix unit"),
        ("tpu-v6e-8", "fp8", "splash:512:512:512", "no fp8 matrix unit"),
        ("gpu-h100", "int8", "triton", "no 8-bit attention kernel"),
        ("cpu-8", "int8", "dot", "--attention-quant with --attention dot"),
        # The chip measured it slower than bf16 attention (aot.building.plan.SLOWER_ON_CHIP).
        ("tpu-v5e-8", "int8", "splash:512:512:512", r"not offered for v5e: .* \(0.76x\)"),
    ],
)
def test_refusals(target, fmt, attention, says):
    with pytest.raises(BuildError, match=says):
        plan_build(
            "tiny", TINY, VideoShape(192, 320, 33, 1), parse_target(target),
            8 if target != "gpu-h100" else 1, attention=attention, attention_quant=fmt,
        )  # fmt: skip
