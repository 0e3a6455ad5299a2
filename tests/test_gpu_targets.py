"""Deviceless GPU targets: the shipped target configs, `gpu-<kind>[xN]` and `gpu:FILE.txtpb`
targets, the Pallas Triton attention kernel, a tiny build for gpu-h100 compiled on this CPU
host (the kernel in its denoise step, no cuDNN attention, cuBLAS matmuls counted), its refusal on
a CPU host, and bench/device_check.py's dry run. Needs the gpu extra (skipped without it)."""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from conftest import TINY_SHAPE, run_cli, with_its_store

from aot import targets
from aot.building import build, plan
from aot.targets import gpu
from wan.models import attention

ROOT = Path(__file__).resolve().parent.parent
GB = 1e9
needs_plugin = pytest.mark.skipif(
    not __import__("importlib").util.find_spec("jax_plugins.xla_cuda13"),
    reason="needs the gpu extra (jax-cuda13-plugin)",
)


@pytest.mark.parametrize(
    ("kind", "device_kind", "hbm_gb", "tflops", "cc"),
    [
        ("h100", "NVIDIA H100 80GB HBM3", 84.9, 989, "9.0"),
        ("h200", "NVIDIA H200 141GB HBM3e", 151.4, 989, "9.0"),
        ("b200", "NVIDIA B200", 191.5, 2225, "10.0"),
    ],
)
def test_shipped_configs(kind, device_kind, hbm_gb, tflops, cc):
    config = gpu.shipped_config(kind)
    assert config.device_kind == device_kind
    assert config.hbm_bytes / GB == pytest.approx(hbm_gb, abs=0.05)
    assert config.peak_bf16 / 1e12 == pytest.approx(tflops, rel=1e-3)  # from the bf16 rate row
    assert config.compute_capability == cc
    assert "collective_memory_granularity:" not in config.text  # this jax rejects it


def test_gpu_target_names():
    eight = targets.parse_target("gpu-h100x8")
    assert (eight.platform, eight.num_devices, eight.hbm_bytes) == ("gpu", 8, 84942979072)
    assert targets.peak_flops(eight, "anything") == pytest.approx(989.4e12, rel=1e-3)
    assert targets.parse_target("gpu-h200").num_devices == 1
    for bad, says in [("gpu-h100x0", "1 to 64 GPUs"), ("gpu-a999", "gpu-h100[xN]"),
                      ("gpu:nowhere.txtpb", "aot gpu-target capture")]:  # fmt: skip
        with pytest.raises(targets.TargetError, match=re.escape(says)) as e:
            targets.parse_target(bad)
        assert "\n" not in str(e.value)


def test_xla_published_spec_and_captured_configs_read(tmp_path):
    # XLA's published spec as it is (a field this jax lacks) reads; its digest is the build's.
    published = gpu.shipped_config("h100").text.replace(
        "  device_interconnect_info {", "  collective_memory_granularity: 2097152\n"
        "  device_interconnect_info {")  # fmt: skip
    (tmp_path / "xla.txtpb").write_text(published)
    target = targets.parse_target(f"gpu:{tmp_path / 'xla.txtpb'}x2")
    assert target.num_devices == 2
    assert target.config_digest == gpu.shipped_config("h100").sha256
    # A capture: the driver's facts over the rate tables of the same compute capability.
    text = gpu.captured_text(
        "NVIDIA H100 PCIe", (9, 0), {"core_count": 114, "device_memory_size": 85 * 10**9}
    )
    captured = gpu.parse_config(text, "capture")
    assert (captured.device_kind, captured.hbm_bytes) == ("NVIDIA H100 PCIe", 85 * 10**9)
    assert captured.peak_bf16 == pytest.approx(gpu.shipped_config("h100").peak_bf16 * 114 / 132)
    diff = gpu.diff_configs(gpu.shipped_config("h100"), captured)
    assert "core_count: 132 -> 114" in diff
    # The digest is in the compiler fingerprint: another config is another target.
    (tmp_path / "cap.txtpb").write_text(text)
    fingerprints = {
        build.compiler_fingerprint(targets.parse_target(name))
        for name in ("gpu-h100", f"gpu:{tmp_path / 'cap.txtpb'}", f"gpu:{tmp_path / 'xla.txtpb'}")
    }
    assert len(fingerprints) == 3
    with pytest.raises(gpu.GpuConfigError, match="bf16 rate"):
        gpu.parse_config(text.replace("key: 16", "key: 99"), "bad")


def test_cudnn_is_refused_for_deviceless_gpu_and_triton_is_the_default():
    target = targets.parse_target("gpu-h100")
    assert plan.choose_attention(None, target, 32760) == "triton"
    assert plan.choose_attention(None, target, 100) == "dot"
    with pytest.raises(plan.BuildError, match="only with the GPU attached") as e:
        plan.choose_attention("cudnn", target, 32760)
    assert "\n" not in str(e.value)
    with pytest.raises(plan.BuildError, match="triton runs on gpu targets"):
        plan.choose_attention("triton", targets.parse_target("cpu-8"), 32760)


@pytest.mark.parametrize(("q_len", "kv_len", "head_dim"), [(100, 37, 24), (40, 512, 64)])
def test_triton_kernel_matches_dot_attention(q_len, kv_len, head_dim):
    """Interpreted on the CPU: padded keys masked, padded queries and head dims sliced off."""
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(keys[0], (2, q_len, 2, head_dim))
    k, v = (jax.random.normal(key, (2, kv_len, 2, head_dim)) for key in keys[1:])
    out = attention.resolve("triton:32:32", interpret=True)(q, k, v)
    ref = attention.dot_product_attention(q, k, v)
    assert jnp.abs(out - ref).max() < 1e-5


@pytest.fixture(scope="module")
def gpu_build(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gpu") / "artifacts"
    run_cli("aot", "build", "--model", "tiny", *TINY_SHAPE, "--target", "gpu-h100",
            "--attention", "triton", "--out", str(out))  # fmt: skip
    (folder,) = (p for p in out.iterdir() if not p.name.startswith("."))
    return folder


@needs_plugin
def test_deviceless_h100_build(gpu_build):
    manifest = json.loads((gpu_build / "manifest.json").read_text())
    assert (manifest["platform"], manifest["device_kind"]) == ("gpu", "NVIDIA H100 80GB HBM3")
    assert manifest["hbm_bytes"] == 84942979072
    assert manifest["peak_flops"] == pytest.approx(989.4e12, rel=1e-3)
    assert "gpu_config=" in manifest["compiler_fingerprint"]
    hlo = {p.name.split(".")[0]: gzip.decompress(p.read_bytes()).decode()
           for p in gpu_build.glob("*.hlo.txt.gz")}  # fmt: skip
    step = hlo["denoise_step"]
    # The attention kernel is the Pallas Triton one, compiled without the GPU.
    assert re.search(r'custom_call_target="__gpu\$xla\.gpu\.triton".*wan_triton_flash_attention',
                     step)  # fmt: skip
    for name, text in hlo.items():
        assert "__cudnn$fmha" not in text, name  # no cuDNN attention anywhere
        assert "__triton_nested_gemm_fusion" not in text, name  # matmuls to cuBLAS
    assert "cudnn" not in step
    assert "__cublas$lt$matmul" in step
    # Our HLO counter counts the cuBLAS matmuls, the kernel's FLOPs are the attention's.
    entry = manifest["programs"]["denoise_step"]
    assert entry["flops"] > 0 and entry["kernel_flops"] > 0
    run_cli("aot", "check", str(gpu_build))


@needs_plugin
def test_gpu_build_on_a_cpu_host_is_refused_in_one_line(gpu_build, tiny_weights, tmp_path):
    result = run_cli("runtime", "run", "--artifacts", str(gpu_build), "--weights",
                     str(tiny_weights), *TINY_SHAPE, "--prompt", "a cat", "--steps", "2",
                     "--out", str(tmp_path / "v.mp4"), check=False)  # fmt: skip
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "NVIDIA H100 80GB HBM3" in lines[0], result.stderr


@needs_plugin
def test_device_check_dry_run(gpu_build, tmp_path):
    # The one step a dry run runs is gpu_build's command: into a copy of it, up to date.
    with_its_store(gpu_build, tmp_path / "artifacts")
    result = subprocess.run(
        [sys.executable, "bench/device_check.py", "--model", "tiny", "--res", "64x128",
         "--frames", "9", "--steps", "2", "--kind", "h100", "--dry-run", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    steps = {s["name"]: s for s in json.loads((tmp_path / "device_check.json").read_text())[
        "steps_run"]}  # fmt: skip
    assert steps["build deviceless (shipped)"]["status"] == "ok"
    run = steps["run deviceless (shipped)"]
    assert run["status"] == "not run (dry run)"
    assert run["argv"][run["argv"].index("--build") + 1].endswith(
        "gpu-h100_d1-f1-c1-t1_vae1x1w_triton"
    )
    assert set(steps) >= {"capture", "diff", "run current (cudnn)", "diffusers"}
    assert (
        "| run current (cudnn) | not run (dry run) |" in (tmp_path / "device_check.md").read_text()
    )
