"""`runtime run` end to end: zero compilations, frames equal to plain jit, parity with
diffusers, and every fault a one-line error (exit 2) before XLA or pickle can do harm."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY_SHAPE, run_cli

from aot.building.lower import compile_in_process
from aot.building.plan import plan_build
from aot.targets import parse_target
from runtime.builds.artifact import ArtifactError, read_manifest, sha256_file
from runtime.builds.loader import Request
from runtime.generation.pipeline import Pipeline
from wan.configs import VideoShape
from wan.presets import PRESETS

PROMPT = "a red cat running in the rain"
RUN = ["--prompt", PROMPT, "--steps", "3", "--seed", "7", "--guidance", "5"]


def _run(build_root, weights, tmp_path, *extra, check=True, env=None):
    return _run_to(build_root, weights, tmp_path / "video.mp4", *extra, check=check, env=env)


def test_run_compiles_nothing_and_equals_plain_jit(tiny_build, tiny_weights, tmp_path):
    """`runtime run` from artifacts: no compile, and frames bit-identical to the same programs
    compiled in this process (`compile_in_process`, the path `aot build` compiles through).
    That proves the serialised executables round-trip exactly (the artifact is the program
    that was built), not that the program is right: correctness is the parity with diffusers
    (tests/test_cli_parity.py, tests/test_pipeline.py)."""
    result = _run(tiny_build.parent, tiny_weights, tmp_path, "--save-frames", str(tmp_path / "f.npy"),
                  "--report", str(tmp_path / "r.json"))  # fmt: skip
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["compile_count"] == 0 and "0 compilations" in result.stdout
    phases = report["phases"]
    assert list(phases) == ["imports", "devices", "deserialize", "weights", "text_encode",
                            "kv_cache", "denoise", "vae_decode", "write"]  # fmt: skip
    to_step = report["seconds_from_process_start_to_first_step"]
    assert to_step > phases["imports"] + phases["weights"] + phases["text_encode"]
    assert report["seconds_from_process_start_to_video"] > to_step + phases["vae_decode"]
    frames = np.load(tmp_path / "f.npy")
    assert frames.dtype == np.uint8 and frames.shape == (1, 9, 128, 64, 3)
    assert (tmp_path / "video.mp4").stat().st_size > 1000

    # The same programs compiled here under plain jax.jit, same weights and seed.
    plan = plan_build("tiny", PRESETS["tiny"], VideoShape(64, 128, 9, 1), parse_target("cpu-8"), 8)
    assert plan.key == read_manifest(tiny_build).key
    pipe = Pipeline.assemble(compile_in_process(plan), tiny_weights, plan.key, "jit")
    expected, _ = pipe.generate(PROMPT, steps=3, guidance=5.0, seed=7)
    np.testing.assert_array_equal(frames, expected)


def test_missing_build_names_the_command(tiny_build, tiny_weights, tmp_path):
    result = run_cli(
        "runtime", "run", "--artifacts", str(tiny_build.parent), "--weights", str(tiny_weights),
        "--res", "128x64", "--frames", "9", *RUN, "--out", str(tmp_path / "v.mp4"), check=False,
    )  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr
    first, *builds = result.stderr.strip().splitlines()
    assert "aot build --model" in first and "--res 128x64" in first
    assert builds == [f"  {tiny_build.name}: another shape (64x128 f9 b1)"]


@pytest.fixture
def build_copy(tiny_build, tmp_path):
    """A private copy of the tiny build to damage."""
    folder = tmp_path / "artifacts" / tiny_build.name
    shutil.copytree(tiny_build, folder)
    return folder


def _edit_manifest(folder, edit):
    path = folder / "manifest.json"
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))


def _flip_byte(folder):
    path = folder / "denoise_step.exec"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(folder):
    path = folder / "vae_decode.exec"
    path.write_bytes(path.read_bytes()[:-100])


def _other_jax(folder):
    _edit_manifest(folder, lambda m: m["versions"].update(jax="0.4.1"))


def _wrong_device_count(folder):
    """An 8-device build met by a process with 4 devices (a build for `current` devices is run
    where there are fewer: the runtime does not arrange the devices then)."""
    _edit_manifest(folder, lambda m: m["key"].update(target="current"))
    return {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}


def _reordered_devices(folder):
    _edit_manifest(folder, lambda m: m.update(device_ids=m["device_ids"][::-1]))


def _other_inputs(folder):
    """A build whose denoise step takes its inputs in another order than this runtime passes."""
    _edit_manifest(folder, lambda m: m["programs"]["denoise_step"]["input_names"].reverse())


def _gadget(folder):
    """A pickle that would run a shell command when loaded, with a correct sha256 and size."""

    class Gadget:
        def __reduce__(self):
            return (subprocess.call, (["touch", str(folder / "pwned")],))

    path = folder / "text_encode.exec"
    path.write_bytes(pickle.dumps(Gadget()))

    def fix(m):
        m["programs"]["text_encode"]["executable"].update(
            sha256=sha256_file(path), size=path.stat().st_size
        )

    _edit_manifest(folder, fix)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_flip_byte, "fails its sha256 check"),
        (_truncate, "truncated"),
        (_other_jax, "compiled with jax 0.4.1"),
        (_wrong_device_count, "needs 8 cpu devices, this process has 4"),
        (_reordered_devices, "differs from the executable's"),
        (_gadget, "not in this runtime's format"),
        (_other_inputs, "this runtime passes (params, latents, kv, row, state, guidance)"),
    ],
)
def test_faults_are_one_line_errors(build_copy, tiny_weights, tmp_path, damage, message):
    env = damage(build_copy)
    result = _run(build_copy.parent, tiny_weights, tmp_path, check=False, env=env)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (build_copy / "pwned").exists()
    assert not (tmp_path / "video.mp4").exists()


def test_missing_weight_tensor(tiny_build, tiny_weights, tmp_path):
    weights = tmp_path / "weights"
    shutil.copytree(tiny_weights, weights)
    shutil.rmtree(weights / "vae")
    result = _run(tiny_build.parent, weights, tmp_path, check=False)
    assert result.returncode == 2 and "has no vae/" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_loading_in_process_refuses_wrong_devices(build_copy, tiny_weights):
    """The Python API checks the same things before deserialising."""
    _edit_manifest(
        build_copy, lambda m: m.update(device_ids=m["device_ids"][:4], local_device_count=4)
    )
    with pytest.raises(ArtifactError, match="needs 4 cpu devices, this process has 8"):
        Pipeline.load(build_copy.parent, tiny_weights, Request(VideoShape(64, 128, 9, 1)))


def test_runtime_imports_no_model_code():
    code = (
        "import sys, runtime.cli, runtime.generation.pipeline, runtime.builds.loader;"
        "bad = [m for m in sys.modules if m.startswith(('flax', 'wan.models.transformer', 'wan.models.vae',"
        " 'wan.models.text_encoder', 'wan.programs', 'aot'))]; print(bad); assert not bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def _under_a_file(tmp_path):
    (tmp_path / "afile").write_text("x")
    return tmp_path / "afile" / "v.mp4", "is a file"


def _parent_cannot_be_made(tmp_path):
    (tmp_path / "afile").write_text("x")
    return tmp_path / "afile" / "sub" / "v.mp4", "is a file"


def _unwritable(tmp_path):
    # /proc takes no new files from anyone, root included (a chmod-ed folder would not stop root).
    return Path("/proc") / f"wan-aot-{tmp_path.name}.mp4", "is not writable"


def _a_folder(tmp_path):
    return tmp_path, "is a folder"


@pytest.mark.parametrize(
    ("option", "bad"),
    [("--out", _under_a_file), ("--out", _parent_cannot_be_made), ("--out", _unwritable),
     ("--out", _a_folder), ("--save-frames", _under_a_file), ("--report", _parent_cannot_be_made)],
)  # fmt: skip
def test_bad_output_path_is_a_one_line_error(tiny_build, tiny_weights, tmp_path, option, bad):
    path, message = bad(tmp_path)
    out = path if option == "--out" else tmp_path / "ok.mp4"
    extra = [] if option == "--out" else [option, str(path)]
    result = _run_to(tiny_build.parent, tiny_weights, out, *extra)
    assert result.returncode == 2 and f"{option} {path}" in result.stderr
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr and not (tmp_path / "ok.mp4").exists()


def test_bad_output_path_fails_before_the_weights_load(tiny_build, tiny_weights, tmp_path):
    """A refused --out costs a small part of what a run spends before its first step."""
    path, _ = _under_a_file(tmp_path)
    start = time.perf_counter()
    assert _run_to(tiny_build.parent, tiny_weights, path).returncode == 2
    refused = time.perf_counter() - start
    start = time.perf_counter()
    _run_to(tiny_build.parent, tiny_weights, tmp_path / "v.mp4", "--steps", "1", check=True)
    assert refused < 0.5 * (time.perf_counter() - start)


def _run_to(build_root, weights, out, *extra, check=False, env=None):
    return run_cli(
        "runtime", "run", "--artifacts", str(build_root), "--weights", str(weights), *TINY_SHAPE,
        *RUN, "--out", str(out), *extra, check=check, env=env,
    )  # fmt: skip


def test_a_whole_run_imports_no_torch(tiny_build, tiny_weights, tmp_path):
    """`runtime run` to the end (lazy imports included) without torch, transformers or flax."""
    code = (
        "import sys; from runtime.cli import cli; cli.main(sys.argv[1:], standalone_mode=False);"
        "bad = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'flax'});"
        "assert not bad, bad"
    )
    subprocess.run(
        [sys.executable, "-c", code, "run", "--artifacts", str(tiny_build.parent), "--weights",
         str(tiny_weights), *TINY_SHAPE, *RUN, "--steps", "1", "--out", str(tmp_path / "v.mp4")],
        check=True, capture_output=True,
    )  # fmt: skip
    assert (tmp_path / "v.mp4").is_file()


def test_process_start_comes_from_the_os():
    before = time.time()
    code = "import time; from runtime.generation.clock import process_start_time; print(process_start_time())"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    started = float(out.stdout)
    assert before - 0.02 <= started <= before + 0.5  # the interpreter's start, not the import
