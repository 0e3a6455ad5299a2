"""Multi-host: a build for 2 processes x 4 CPU devices (`cpu-2x4`, a jax.distributed job on
this machine) run by two `runtime run` processes gives the frames of the same build for one
process x 8 devices. The mesh puts the batch on `data`, so the latents reach the spatially
sharded VAE through the in-program gather and the frames come back replicated to every host."""

from __future__ import annotations

import math
import subprocess

import numpy as np
import pytest
from conftest import BIN, run_cli

from aot.local_job import free_port
from aot.targets import TargetError, parse_target
from runtime.artifact import ArtifactError, read_manifest
from runtime.loader import Present, Request, match_build
from wan.configs import VideoShape

SHAPE = ["--res", "64x96", "--frames", "5", "--batch", "2"]
RUN = ["--prompt", "a red cat", "--steps", "3", "--seed", "3", *SHAPE]


def test_parse_multi_process_target():
    target = parse_target("cpu-2x4")
    assert (target.num_devices, target.num_processes) == (8, 2)
    with pytest.raises(TargetError, match="P, N >= 1"):
        parse_target("cpu-0x4")


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """The same build for one process x 8 devices and for two processes x 4."""
    out = tmp_path_factory.mktemp("multiprocess") / "artifacts"
    for target in ("cpu-8", "cpu-2x4"):
        run_cli("aot", "build", "--model", "tiny", *SHAPE, "--mesh", "data=2,context=4",
                "--target", target, "--out", str(out))  # fmt: skip
    return out


def read_manifests(artifacts) -> dict:
    """target -> manifest of the builds in `artifacts`."""
    found = [read_manifest(p) for p in artifacts.iterdir() if not p.name.startswith(".")]
    return {m.key.target: m for m in found}


def test_decode_handoff_as_designed(artifacts):
    """Batch 2 on 8 devices: the denoise step leaves the latents sharded over `data` and the
    decode is spatial (vae_spatial = 8). The handoff takes the latents as the step leaves them
    and gathers them whole (small) rather than switching mesh through an all-to-all; the decode
    takes them in its own spatial layout; only a multi-process job replicates its frames: one
    all-gather of the whole frames, nothing else (one process keeps them where they were
    decoded)."""
    manifests = read_manifests(artifacts)
    assert sorted(manifests) == ["cpu-2x4", "cpu-8"]
    for m in manifests.values():
        assert m.vae_mesh_axes == {"redundant": 1, "vae_spatial": 8}
        step, handoff, decode = (
            m.programs[n] for n in ("denoise_step", "latents_handoff", "vae_decode")
        )
        (left,) = [o.sharding for o in step.outputs if o.path == "latents"]
        (received,) = [i.sharding for i in handoff.inputs if i.path == "latents"]
        (handed,) = [o.sharding for o in handoff.outputs if o.path == "latents"]
        (taken,) = [i.sharding for i in decode.inputs if i.path == "latents"]
        assert left == received == "P('data', None, None, None, None)", (left, received)
        assert handed == taken == "P(None, None, None, 'vae_spatial', None)", (handed, taken)
        assert "all-to-all" not in decode.collectives, decode.collectives
        assert set(handoff.collectives) <= {"all-gather"}, handoff.collectives

    one, two = (manifests[t].programs["vae_decode"] for t in ("cpu-8", "cpu-2x4"))
    (frames,) = two.outputs
    assert frames.path == "frames" and frames.sharding == "P(None, None, None, None, None)"
    assert one.outputs[0].sharding == "P(None, None, None, 'vae_spatial', None)"
    frame_bytes = math.prod(frames.shape) * np.dtype(frames.dtype).itemsize
    runs = {kind: (c["count"], c["bytes"]) for kind, c in one.collectives.items()}
    count, nbytes = runs.get("all-gather", (0, 0))
    runs["all-gather"] = (count + 1, nbytes + frame_bytes)
    assert {kind: (c["count"], c["bytes"]) for kind, c in two.collectives.items()} == runs, (
        one.collectives,
        two.collectives,
    )


def test_two_processes_equal_one(artifacts, tmp_path, tiny_weights):
    manifests = read_manifests(artifacts)
    assert manifests["cpu-2x4"].process_count == 2 and manifests["cpu-8"].process_count == 1
    with pytest.raises(ArtifactError, match="2-process job.*--num-processes"):
        match_build(artifacts, Request(VideoShape(64, 96, 5, 2)), "tiny", Present.host_cpu(3))
    decode = manifests["cpu-2x4"].programs["vae_decode"]
    assert decode.outputs[0].sharding == "P(None, None, None, None, None)"

    base = [str(BIN / "runtime"), "run", "--artifacts", str(artifacts), "--weights",
            str(tiny_weights), *RUN]  # fmt: skip
    run_cli("runtime", *base[1:], "--out", str(tmp_path / "one.mp4"), "--save-frames",
            str(tmp_path / "one.npy"))  # fmt: skip
    coordinator = f"localhost:{free_port()}"
    procs = [
        subprocess.Popen(
            [
                *base,
                "--out",
                str(tmp_path / "two.mp4"),
                "--save-frames",
                str(tmp_path / "two.npy"),
                "--coordinator",
                coordinator,
                "--num-processes",
                "2",
                "--process-id",
                str(i),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err
    assert "0 compilations" in outputs[0][0] and "cpu-2x4" in outputs[0][0]
    assert "wrote" not in outputs[1][0]  # process 0 writes the files and reports
    assert sorted(f.name for f in tmp_path.glob("two*")) == ["two.npy", "two_0.mp4", "two_1.mp4"]

    one, two = np.load(tmp_path / "one.npy"), np.load(tmp_path / "two.npy")
    # Same programs and inputs; only the all-reduce order differs (gloo across processes vs
    # in-process), which can move a float across a rounding boundary of the uint8 frames.
    diff = np.abs(one.astype(int) - two.astype(int))
    assert diff.max() <= 1 and (diff > 0).mean() < 1e-3, (diff.max(), (diff > 0).mean())


def test_multi_process_run_needs_all_three_options(tiny_weights, tmp_path):
    result = run_cli("runtime", "run", "--artifacts", str(tmp_path), "--weights",
                     str(tiny_weights), *RUN, "--out", str(tmp_path / "v.mp4"),
                     "--num-processes", "2", check=False)  # fmt: skip
    assert result.returncode == 2 and "--coordinator HOST:PORT" in result.stderr
    assert "Traceback" not in result.stderr


def test_missing_process_is_a_one_line_error(artifacts, tmp_path, tiny_weights):
    """jax's coordination client would abort the process (C++) when a peer never arrives."""
    for process_id, message in ((0, "processes [1] of the 2-process job did not reach"),
                                (1, "process 0 of the job did not answer")):  # fmt: skip
        result = run_cli("runtime", "run", "--artifacts", str(artifacts), "--weights",
                         str(tiny_weights), *RUN, "--out", str(tmp_path / "v.mp4"),
                         "--coordinator", f"localhost:{free_port()}", "--num-processes", "2",
                         "--process-id", str(process_id), "--join-timeout", "2", check=False)  # fmt: skip
        assert result.returncode == 2 and message in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1


def test_serve_refuses_a_multi_process_build(artifacts, tiny_weights, tmp_path):
    """`runtime serve` runs on one host: a build for two processes is refused, exit 2, with
    the reason and what to run instead."""
    (multi,) = [p.name for p in artifacts.iterdir() if "_cpu-2x4_" in p.name]
    result = run_cli("runtime", "serve", "--artifacts", str(artifacts), "--weights",
                     str(tiny_weights), "--build", multi, "--out-dir", str(tmp_path / "out"),
                     "--port", "0", check=False)  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"build {multi} cannot serve" in result.stderr.splitlines()[0]
    assert f"{multi}: a 2-process job, this one has 1" in result.stderr
