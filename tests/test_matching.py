"""Which build serves a request: only builds for the devices present are candidates, a default
mesh is preferred, `--build` chooses, and a refusal names every build on a line of its own;
TPU targets record their host layout."""

from __future__ import annotations

import gzip
import json
import re
import shutil

import jax
import pytest
from conftest import TINY_SHAPE, run_cli, with_its_store

from aot import targets
from runtime.builds.artifact import ArtifactError, read_manifest
from runtime.builds.loader import Present, Request, host_layout, match_build
from wan.configs import VideoShape

PROMPT = ["--prompt", "a cat", "--steps", "2", "--guidance", "5"]
SMALL = ["--res", "64x96", "--frames", "5", "--batch", "1"]


@pytest.fixture(scope="module")
def three_builds(tiny_build, tmp_path_factory):
    """cpu-4, cpu-8 and cpu-8 with --mesh context=8 of one shape, in one folder."""
    out = tmp_path_factory.mktemp("three") / "artifacts"
    shutil.copytree(tiny_build, out / tiny_build.name)
    for extra in (["--target", "cpu-4"], ["--target", "cpu-8", "--mesh", "context=8"]):
        run_cli("aot", "build", "--model", "tiny", *TINY_SHAPE, *extra, "--out", str(out))
    return {read_manifest(p).key.target + str(read_manifest(p).default_mesh): p.name
            for p in out.iterdir() if not p.name.startswith(".")}, out  # fmt: skip


def _run(artifacts, weights, tmp_path, *extra):
    return run_cli(
        "runtime", "run", "--artifacts", str(artifacts), "--weights", str(weights), *TINY_SHAPE,
        *PROMPT, "--out", str(tmp_path / "v.mp4"), "--report", str(tmp_path / "r.json"), *extra,
        check=False,
    )  # fmt: skip


def test_two_default_meshes_are_refused_listing_all(three_builds, tiny_weights, tmp_path):
    names, artifacts = three_builds
    result = _run(artifacts, tiny_weights, tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert "3 builds serve this request: choose one with --build NAME" in lines[0]
    assert len(lines) == 4 and all(any(n in line for line in lines[1:]) for n in names.values())
    assert not (tmp_path / "v.mp4").exists()


def test_build_option_picks_the_named_one(three_builds, tiny_weights, tmp_path):
    names, artifacts = three_builds
    chosen = names["cpu-8False"]
    result = _run(artifacts, tiny_weights, tmp_path, "--build", chosen)
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "r.json").read_text())["build"] == chosen


def test_eight_devices_prefer_the_default_mesh(three_builds):
    """This process has 8 devices: cpu-4 is passed over, the default mesh wins over context=8."""
    names, artifacts = three_builds
    request = Request(VideoShape(64, 128, 9, 1))
    folder, _ = match_build(artifacts, request, "tiny", Present.of(jax.devices()))
    assert folder.name == names["cpu-8True"]
    with pytest.raises(ArtifactError, match="needs 4 cpu devices, this process has 8"):
        match_build(artifacts, request, "tiny", Present.of(jax.devices()), names["cpu-4True"])


@pytest.fixture(scope="module")
def tpu_and_cpu(small_builds, tmp_path_factory):
    """A deviceless tpu-v6e-8 build and a cpu-8 build of one shape, in one folder (the cpu-8
    one the session's batch-1 SMALL build, copied with its store)."""
    out = tmp_path_factory.mktemp("tpu") / "artifacts"
    (cpu,) = [p for p in small_builds.iterdir() if "_b1_cpu-8_" in p.name]
    with_its_store(cpu, out)
    # --vae-vmem 4: the decode's fast compile (its shardings and collectives are the same).
    run_cli("aot", "build", "--model", "tiny", *SMALL, "--target", "tpu-v6e-8", "--vae-vmem", "4",
            "--out", str(out))  # fmt: skip
    return out


def test_tpu_v6e_8_is_one_host_and_keeps_frames_sharded(tpu_and_cpu):
    (tpu,) = [p for p in tpu_and_cpu.iterdir() if "tpu-v6e-8" in p.name]
    manifest = read_manifest(tpu)
    assert (manifest.process_count, manifest.local_device_count) == (1, 8)
    decode = manifest.programs["vae_decode"]
    assert decode.outputs[0].sharding != "P(None, None, None, None, None)"
    hlo = gzip.decompress((tpu / decode.hlo.path).read_bytes()).decode()
    assert not re.search(r"= u8\[[\d,]+\]\S* all-gather\(", hlo)  # no frames gathered


def test_another_platform_is_never_chosen(tpu_and_cpu, tmp_path):
    request = Request(VideoShape(64, 96, 5, 1))
    for present in (Present.host_cpu(), Present.of(jax.devices())):
        folder, manifest = match_build(tpu_and_cpu, request, "tiny", present)
        assert manifest.platform == "cpu"
    only = tmp_path / "only-tpu"
    only.mkdir()
    for p in tpu_and_cpu.iterdir():
        if "tpu-v6e-8" in p.name:
            shutil.copytree(p, only / p.name)
            with pytest.raises(ArtifactError, match=rf"{p.name}: for tpu devices"):
                match_build(only, request, "tiny", Present.host_cpu())


@pytest.mark.parametrize(
    ("target", "layout"),
    [("tpu-v6e-8", (1, 8)), ("tpu-v5e-8", (1, 8)), ("tpu-v6e:4x4", (2, 8)),
     ("tpu-v6e:4x4/2x2", (4, 4)), ("tpu-v5p:2x2x2", (2, 4))],
)  # fmt: skip
def test_tpu_host_layouts(target, layout):
    """What a build for `target` records (process_count, local_device_count), from libtpu."""
    tgt = targets.parse_target(target)
    targets.prepare_environment(tgt)  # libtpu reads it when first loaded
    assert host_layout(targets.devices(tgt)) == layout
