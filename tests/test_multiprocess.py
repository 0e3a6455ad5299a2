"""Multi-host: a build for 2 processes x 4 CPU devices (`cpu-2x4`, a jax.distributed job on
this machine) run by two `runtime run` processes gives the frames of the same build for one
process x 8 devices. The mesh puts the batch on `data`, so the latents reach the spatially
sharded VAE through the in-program gather and the frames come back replicated to every host."""

from __future__ import annotations

import contextlib
import math
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import BIN, run_cli
from test_server import Server

from aot.building.local_job import free_port
from aot.targets import TargetError, parse_target
from runtime.builds.artifact import ArtifactError, read_manifest
from runtime.builds.loader import Present, Request, match_build
from runtime.serve.peers import EXIT_PEER_LOST, PEER_TIMEOUT_S
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


@pytest.fixture(scope="module")
def two_process_run(artifacts, tiny_weights, tmp_path_factory) -> np.ndarray:
    """RUN's frames (B, F, H, W, 3) from the cpu-2x4 build, run by two `runtime run` processes;
    process 0 wrote them."""
    out = tmp_path_factory.mktemp("two-process-run")
    base = [str(BIN / "runtime"), "run", "--artifacts", str(artifacts), "--weights",
            str(tiny_weights), *RUN, "--out", str(out / "two.mp4"), "--save-frames",
            str(out / "two.npy"), "--coordinator", f"localhost:{free_port()}",
            "--num-processes", "2"]  # fmt: skip
    procs = [
        subprocess.Popen(
            [*base, "--process-id", str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err
    assert "0 compilations" in outputs[0][0] and "cpu-2x4" in outputs[0][0]
    assert "wrote" not in outputs[1][0]  # process 0 writes the files and reports
    assert sorted(f.name for f in out.glob("two*")) == ["two.npy", "two_0.mp4", "two_1.mp4"]
    return np.load(out / "two.npy")


def test_two_processes_equal_one(artifacts, tmp_path, tiny_weights, two_process_run):
    manifests = read_manifests(artifacts)
    assert manifests["cpu-2x4"].process_count == 2 and manifests["cpu-8"].process_count == 1
    with pytest.raises(ArtifactError, match="2-process job.*--num-processes"):
        match_build(artifacts, Request(VideoShape(64, 96, 5, 2)), "tiny", Present.host_cpu(3))
    decode = manifests["cpu-2x4"].programs["vae_decode"]
    assert decode.outputs[0].sharding == "P(None, None, None, None, None)"

    run_cli("runtime", "run", "--artifacts", str(artifacts), "--weights", str(tiny_weights),
            *RUN, "--out", str(tmp_path / "one.mp4"), "--save-frames", str(tmp_path / "one.npy"))  # fmt: skip
    one, two = np.load(tmp_path / "one.npy"), two_process_run
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


def test_serve_without_the_job_refuses_a_multi_process_build(artifacts, tiny_weights, tmp_path):
    """`runtime serve` without --coordinator is one process: a build for two is refused, exit 2,
    with the reason and what to run instead."""
    (multi,) = [p.name for p in artifacts.iterdir() if "_cpu-2x4_" in p.name]
    result = run_cli("runtime", "serve", "--artifacts", str(artifacts), "--weights",
                     str(tiny_weights), "--build", multi, "--out-dir", str(tmp_path / "out"),
                     "--port", "0", check=False)  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"build {multi} cannot serve" in result.stderr.splitlines()[0]
    assert f"{multi}: a 2-process job, this one has 1" in result.stderr
    assert "`runtime serve`) per process with --coordinator" in result.stderr


def multi_build(artifacts: Path) -> str:
    (name,) = [p.name for p in artifacts.iterdir() if "_cpu-2x4_" in p.name]
    return name


@contextlib.contextmanager
def serving_job(artifacts: Path, weights: Path, out: Path, *extra: str):
    """The cpu-2x4 build served by two `runtime serve` processes: (process 0 as a Server,
    process 1's Popen and its log)."""
    job = ["--build", multi_build(artifacts), "--coordinator", f"localhost:{free_port()}",
           "--num-processes", "2", "--batch-window", "0.5", "--save-frames", *extra]  # fmt: skip
    follower_log = out.parent / f"follower-{free_port()}.log"
    follower = subprocess.Popen(
        [str(BIN / "runtime"), "serve", "--artifacts", str(artifacts), "--weights", str(weights),
         "--out-dir", str(out), *job, "--process-id", "1"],
        stdout=subprocess.DEVNULL, stderr=follower_log.open("w"),
    )  # fmt: skip
    leader = None
    try:
        leader = Server(artifacts, weights, out, *job, "--process-id", "0")
        yield leader, follower, follower_log
    finally:
        for proc in (follower, leader and leader.proc):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def exits_within(proc: subprocess.Popen, seconds: float) -> int:
    try:
        return proc.wait(seconds)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the process was still running {seconds} s on")


def test_a_two_process_build_serves_what_runtime_run_makes(
    artifacts, tiny_weights, tmp_path, two_process_run
):
    """Process 0 listens and keeps the jobs, process 1 runs each batch with it: the videos equal
    the same requests' two-process `runtime run` within 1/255, nothing compiles, and a SIGTERM
    to process 0 ends both (exit 0)."""
    same = {"prompt": "a red cat", "size": "64x96", "frames": 5, "steps": 3, "seed": 3}
    with serving_job(artifacts, tiny_weights, tmp_path / "out") as (leader, follower, log):
        ids = [leader.post(body).json()["id"] for body in (same, same, {**same, "seed": 4})]
        leader.wait(ids)
        frames = []
        for job_id in ids:
            answer = leader.client.get(f"/v1/videos/{job_id}/content", params={"variant": "frames"})
            (tmp_path / "f.npy").write_bytes(answer.content)
            frames.append(np.load(tmp_path / "f.npy"))
        assert leader.metrics()["wan_compile_count"] == 0
        assert leader.metrics()["wan_batches_total"] == 2
        leader.proc.send_signal(signal.SIGTERM)
        assert exits_within(leader.proc, 60) == 0
        assert exits_within(follower, 30) == 0, log.read_text()
    for video in frames[:2]:
        diff = np.abs(video.astype(int) - two_process_run[0].astype(int))
        assert diff.max() <= 1 and (diff > 0).mean() < 1e-3, (diff.max(), (diff > 0).mean())
    other = np.abs(frames[2].astype(int) - two_process_run[0].astype(int))
    assert other.mean() > 5, other.mean()  # the control: another seed is another video
    assert "Traceback" not in log.read_text() + leader.log.read_text()


def test_a_lost_process_ends_the_job_and_a_restart_finishes_its_queue(
    artifacts, tiny_weights, tmp_path
):
    """Process 1 killed mid-batch: process 0 says so in one line and exits within the peer
    timeout, its job back in the queue; the whole job started again on the same folder runs it.
    Then process 0 killed: process 1 exits at once."""
    out = tmp_path / "out"
    with serving_job(artifacts, tiny_weights, out) as (leader, follower, _):
        job_id = leader.post({"prompt": "a cat", "size": "64x96", "frames": 5, "steps": 60,
                              "seed": 1}).json()["id"]  # fmt: skip
        wait_for = time.monotonic() + 120
        while leader.client.get(f"/v1/videos/{job_id}").json()["progress"] == 0:
            assert time.monotonic() < wait_for
            time.sleep(0.1)
        follower.kill()
        killed = time.monotonic()
        assert exits_within(leader.proc, PEER_TIMEOUT_S + 30) == EXIT_PEER_LOST
        assert time.monotonic() - killed >= PEER_TIMEOUT_S - 1
        [line] = [x for x in leader.log.read_text().splitlines() if x.startswith("Error:")]
        assert "process(es) [1] of the 2-process job stopped beating" in line, line
        assert "queued again" in line and "restart every process" in line
    with serving_job(artifacts, tiny_weights, out) as (leader, follower, log):
        [video] = leader.wait([job_id], timeout=300)
        assert video["progress"] == 100
        leader.proc.kill()
        assert exits_within(follower, PEER_TIMEOUT_S + 30) != 0
        said = log.read_text()  # jax's coordination client's line, or ours if we saw it first
        assert "JAX distributed service detected fatal errors" in said or (
            "Error: process 0 (the job's coordinator) stopped answering" in said
        ), said[-3000:]
