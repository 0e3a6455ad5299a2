"""`runtime serve` end to end: a real uvicorn server in its own process on a free port, a real HTTP
client (httpx), real kill -9 and SIGTERM; the scheduling, store and batching pieces in-process."""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import os
import signal
import socket
import sqlite3
import subprocess
import threading
import time
from pathlib import Path

import httpx
import imageio_ffmpeg
import numpy as np
import pytest
from conftest import BIN, SMALL, run_cli
from PIL import Image

from runtime.builds.artifact import ArtifactError, BuildKey
from runtime.builds.build_options import OPTIONS
from runtime.builds.loader import Present, Request, serving_routes
from runtime.cli.serve import _serving_builds
from runtime.generation.batching import Group, Settings, Video, Waiting, generate_batch, next_batch
from runtime.generation.outputs import write_videos
from runtime.generation.pipeline import Pipeline
from runtime.generation.request import initial_latents
from runtime.serve.job_store import DATABASE, JobStore, QueueFull
from wan.configs import ModelConfig, VideoShape

SHAPE = {"size": "64x96", "frames": 5}  # small frames: the VAE decode dominates a batch


def decode(path: Path) -> np.ndarray:
    """An MP4's frames (F, H, W, 3) uint8."""
    reader = imageio_ffmpeg.read_frames(str(path))
    meta = next(reader)
    w, h = meta["size"]
    return np.stack([np.frombuffer(f, np.uint8).reshape(h, w, 3) for f in reader])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`runtime serve` in a subprocess; `url` once /healthz answers."""

    def __init__(
        self, artifacts: Path, weights: Path, out_dir: Path, *extra: str, env=None, key=None
    ):
        """`env`: the server's environment (default: this one's); `key`: the API key `client`
        sends."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = out_dir.parent / f"serve-{self.port}.log"
        self.proc = subprocess.Popen(
            [str(BIN / "runtime"), "serve", "--artifacts", str(artifacts), "--weights",
             str(weights), "--port", str(self.port), "--out-dir", str(out_dir), *extra],
            stdout=subprocess.DEVNULL, stderr=self.log.open("w"), env=env,
        )  # fmt: skip
        auth = {"Authorization": f"Bearer {key}"} if key else {}
        self.client = httpx.Client(base_url=self.url, timeout=30, headers=auth)
        deadline = time.monotonic() + 180
        while True:
            assert self.proc.poll() is None, self.log.read_text()
            with contextlib.suppress(httpx.TransportError):
                if self.client.get("/healthz").status_code == 200:
                    return
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)

    def post(self, body: dict) -> httpx.Response:
        return self.client.post("/v1/videos", json=body)

    def metrics(self) -> dict[str, float]:
        text = self.client.get("/metrics").text
        return {
            line.split()[0]: float(line.split()[1])
            for line in text.splitlines()
            if line and not line.startswith("#")
        }

    def wait(self, ids: list[str], statuses=("completed",), timeout: float = 240) -> list[dict]:
        deadline = time.monotonic() + timeout
        while True:
            videos = [self.client.get(f"/v1/videos/{i}").json() for i in ids]
            if all(v["status"] in statuses for v in videos):
                return videos
            assert all(v["status"] != "failed" for v in videos), videos
            assert time.monotonic() < deadline, videos
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.client.close()


@contextlib.contextmanager
def serving(*args, **kwargs):
    server = Server(*args, **kwargs)
    try:
        yield server
    finally:
        server.stop()


def stored_request(seed: int) -> dict:
    """A request as the server stores it (runtime.serve.job_store.REQUEST_FIELDS)."""
    return {"prompt": "q", "negative_prompt": "", "seed": seed, "size": "64x96", "frames": 5,
            "steps": 3}  # fmt: skip


def request(i: int, steps: int = 3) -> dict:
    return {"prompt": f"a cat number {i}", "negative_prompt": f"blur {i}", **SHAPE,
            "steps": steps, "seed": 100 + i, "guidance": 5.0}  # fmt: skip


def test_concurrent_requests_share_batches_and_equal_runtime_run(
    small_builds, tiny_weights, tmp_path
):
    """6 concurrent requests on a batch-2 build: 3 batches, each video equal to `runtime run`
    of its request on the batch-1 build; bad requests are 400 and the server goes on."""
    requests = [request(i) for i in range(6)]
    with serving(
        small_builds, tiny_weights, tmp_path / "out", "--batch-window", "2", "--save-frames"
    ) as server:
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(server.post, requests))
        assert [a.status_code for a in answers] == [202] * 6
        created = [a.json() for a in answers]
        assert all(v["status"] == "queued" and v["progress"] == 0 for v in created)
        assert all(v["object"] == "video" and v["size"] == "64x96" for v in created)
        assert all("_b2_" in v["build"] and v["model"] == "tiny" for v in created)
        # Only the build that serves the shape is loaded, not the batch-1 one beside it.
        [served] = server.client.get("/healthz").json()["builds"]
        assert "_b2_" in served

        bad = [
            {**request(0), "size": "64by96"},
            {**request(0), "size": "64x97"},  # a size no build serves
            {**request(0), "frames": 0},
            {**request(0), "frames": 6},  # no build of 6 frames
            {k: v for k, v in request(0).items() if k != "prompt"},
            {**request(0), "steps": "3"},
            {**request(0), "seed": 1.5},
            {**request(0), "guidance": "high"},
            {**request(0), "colour": "red"},
        ]
        for body in bad:
            answer = server.post(body)
            assert answer.status_code == 400, (body, answer.text)
            assert set(answer.json()["error"]) == {"message", "type", "param", "code"}, answer.text
        unserved = server.post({**request(0), "frames": 6}).json()["error"]["message"]
        assert "64x96 frames=5" in unserved
        not_json = server.client.post(
            "/v1/videos", content=b"{", headers={"content-type": "application/json"}
        )
        assert not_json.status_code == 400 and "error" in not_json.json()
        assert server.client.get("/v1/videos/video_nope").status_code == 404

        videos = server.wait([v["id"] for v in created])
        assert all(v["progress"] == 100 and v["error"] is None for v in videos)
        metrics = server.metrics()
        assert metrics["wan_batches_total"] == 3 and metrics["wan_batch_fill_ratio"] == 1
        assert metrics["wan_compile_count"] == 0 and metrics["wan_videos_completed_total"] == 6
        listed = server.client.get("/v1/videos").json()
        assert {v["id"] for v in listed["data"]} == {v["id"] for v in created}
        frames = []
        for v in created:
            content = server.client.get(f"/v1/videos/{v['id']}/content")
            assert content.status_code == 200 and content.headers["content-type"] == "video/mp4"
            (tmp_path / f"{v['id']}.mp4").write_bytes(content.content)
            assert decode(tmp_path / f"{v['id']}.mp4").shape == (5, 96, 64, 3)
            raw = server.client.get(f"/v1/videos/{v['id']}/content", params={"variant": "frames"})
            frames.append(np.load(io.BytesIO(raw.content), allow_pickle=False))
            # The MP4 is these frames: the one writer's MP4 of them decodes to the same pixels.
            write_videos([frames[-1]], [tmp_path / "expected.mp4"], fps=16)
            np.testing.assert_array_equal(
                decode(tmp_path / f"{v['id']}.mp4"), decode(tmp_path / "expected.mp4")
            )
        assert server.client.get("/healthz").status_code == 200

    # Each video equals `runtime run` of its request on the batch-1 build: the first through the
    # CLI, all through the same Pipeline in this process (which `runtime run` equals bit for bit,
    # tests/test_runtime.py).
    first = requests[0]
    run_cli("runtime", "run", "--artifacts", str(small_builds), "--weights", str(tiny_weights),
            *SMALL, "--batch", "1", "--steps", "3", "--guidance", "5", "--prompt", first["prompt"],
            "--negative-prompt", first["negative_prompt"], "--seed", str(first["seed"]),
            "--out", str(tmp_path / "ref.mp4"), "--save-frames", str(tmp_path / "ref.npy"))  # fmt: skip
    batch_one = Pipeline.load(small_builds, tiny_weights, Request(VideoShape(64, 96, 5, 1)))
    for i, (r, served) in enumerate(zip(requests, frames, strict=True)):
        expected, _ = batch_one.generate(
            r["prompt"], r["negative_prompt"], steps=3, guidance=5.0, seed=r["seed"]
        )
        if i == 0:
            np.testing.assert_array_equal(expected, np.load(tmp_path / "ref.npy"))
        assert served.shape == expected[0].shape == (5, 96, 64, 3)
        assert np.abs(served.astype(int) - expected[0].astype(int)).max() <= 1, i
    # Neighbours differ: the batch did not make one video twice.
    assert np.abs(frames[0].astype(int) - frames[1].astype(int)).max() > 10


def test_full_queue_cancel_and_sigterm_drain(small_builds, tiny_weights, tmp_path):
    """A full queue is 429; a queued video is cancelled; SIGTERM answers 503 while the batch
    in flight finishes, and the server exits 0. The batch's 200 steps (seconds here) outlast
    the half second from its start to the POST after SIGTERM."""
    out = tmp_path / "out"
    with serving(
        small_builds, tiny_weights, out, "--max-queue", "2", "--batch-window", "60"
    ) as server:
        first = server.post(request(0, steps=200)).json()  # waits for a second (60 s window)
        other = server.post(request(1, steps=4)).json()  # another group
        assert server.post(request(2)).status_code == 429
        assert server.post(request(2)).json()["error"]["code"] == "queue_full"
        assert server.client.delete(f"/v1/videos/{other['id']}").json()["deleted"] is True
        assert server.client.get(f"/v1/videos/{other['id']}").status_code == 404
        second = server.post(request(3, steps=200)).json()  # fills the batch: it runs
        assert second["status"] == "queued"
        server.wait([first["id"], second["id"]], ("in_progress",))
        assert server.client.delete(f"/v1/videos/{first['id']}").status_code == 409
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert server.post(request(4)).status_code == 503
        assert server.proc.wait(timeout=120) == 0, server.log.read_text()
    store = JobStore(out)
    jobs, _ = store.page()
    assert [j.status for j in jobs] == ["completed", "completed"]
    assert all(decode(store.video_path(j.id)).shape[0] == 5 for j in jobs)


def test_a_drain_past_its_timeout_leaves_the_batch_queued(small_builds, tiny_weights, tmp_path):
    """SIGTERM while a long batch runs, --drain-timeout 1: the server stops within seconds, not
    after the batch; its videos are queued again (the store says so at once, the log too)."""
    out = tmp_path / "out"
    with serving(small_builds, tiny_weights, out, "--batch-window", "0",
                 "--drain-timeout", "1") as server:  # fmt: skip
        long = server.post(request(0, steps=400)).json()
        server.wait([long["id"]], ("in_progress",))
        server.proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        assert server.proc.wait(timeout=60) == 0, server.log.read_text()
        assert time.monotonic() - start < 30
    assert "the batch in flight was not finished, it stays queued" in server.log.read_text()
    [job] = JobStore(out).page()[0]
    assert (job.id, job.status) == (long["id"], "queued")


def test_kill_9_mid_batch_then_restart(small_builds, tiny_weights, tmp_path):
    """kill -9 while the second batch runs: a restart serves the completed videos and completes
    the others; no partial MP4 is ever visible. The first batch is short (its own group of 3
    steps, run first as the oldest): only the second one must last long enough to be killed."""
    out = tmp_path / "out"
    seen, bad, stop = set(), [], threading.Event()

    def watch() -> None:  # every MP4 that ever appears must decode whole
        while True:
            stopping = stop.is_set()  # then one last pass: the last video may be just written
            for path in (out / "videos").glob("*.mp4") if (out / "videos").exists() else []:
                if path not in seen:
                    try:
                        if decode(path).shape != (5, 96, 64, 3):
                            bad.append(path)
                    except (RuntimeError, ValueError, OSError) as e:
                        bad.append((path, e))
                    seen.add(path)
            if stopping:
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        with serving(small_builds, tiny_weights, out, "--batch-window", "1") as server:
            steps = [3, 3, 200, 200]  # two batches: a short one, then one to kill
            ids = [server.post(request(i, steps=n)).json()["id"] for i, n in enumerate(steps)]
            deadline = time.monotonic() + 240
            while True:
                videos = [server.client.get(f"/v1/videos/{i}").json() for i in ids]
                done = [v for v in videos if v["status"] == "completed"]
                running = [v for v in videos if v["status"] == "in_progress" and v["progress"] > 0]
                if len(done) == 2 and running:
                    break
                assert time.monotonic() < deadline, videos
                time.sleep(0.05)
            os.kill(server.proc.pid, signal.SIGKILL)
            server.proc.wait()
            completed = {v["id"] for v in done}
        kept = {p.stem for p in (out / "videos").glob("*.mp4")}
        assert kept == completed
        before = {i: (out / "videos" / f"{i}.mp4").read_bytes() for i in completed}
        with serving(small_builds, tiny_weights, out) as server:
            videos = server.wait(ids)
            assert all(v["status"] == "completed" for v in videos)
            for i in completed:
                assert server.client.get(f"/v1/videos/{i}/content").content == before[i]
            assert server.metrics()["wan_batches_total"] == 1  # only the unfinished batch ran
    finally:
        stop.set()
        watcher.join()
    assert not bad and len(seen) == 4
    assert not list((out / "videos").glob(".*"))  # no staged file left


# In-process pieces: scheduling, the store, a batch's slots and seeds, a failed batch.


def _key(width: int, frames: int, batch: int, cfg: bool = True) -> BuildKey:
    return BuildKey("tiny", width, 96, frames, batch, cfg, "cpu-8", (), (1, 1), "width", "dot")


def test_one_build_serves_each_route():
    """Per (width, height, frames, CFG, image) the largest batch; one batch: the first name. An
    image-to-video build of a shape serves beside a text-to-video one (a model that runs both:
    the request's image picks)."""
    keys = {"a_b1": _key(64, 5, 1), "a_b4": _key(64, 5, 4), "a_b2": _key(64, 5, 2),
            "nocfg_b1": _key(64, 5, 1, cfg=False), "f9_b1": _key(64, 9, 1),
            "w32_b2": _key(32, 5, 2), "w32_b2_other": _key(32, 5, 2),
            "i2v_b1": _key(64, 5, 1).with_options(pipeline="i2v")}  # fmt: skip
    assert serving_routes(keys) == {
        (64, 96, 5, True, False): "a_b4",
        (64, 96, 5, False, False): "nocfg_b1",
        (64, 96, 9, True, False): "f9_b1",
        (32, 96, 5, True, False): "w32_b2",
        (64, 96, 5, True, True): "i2v_b1",
    }
    assert serving_routes({}) == {}


def test_serve_loads_only_the_builds_it_routes_to(small_builds, tiny_weights):
    """Batch 1 and 2 of one shape: only the batch-2 build loads; naming both is one line."""
    model_hash = ModelConfig.from_folder(tiny_weights).hash()
    builds = _serving_builds(small_builds, model_hash, "tiny", Present.host_cpu(), ())
    assert [m.key.batch for _, m in builds] == [2]
    names = tuple(sorted(p.name for p in small_builds.iterdir() if not p.name.startswith(".")))
    assert len(names) == 2 and "_b1_" in names[0] and "_b2_" in names[1]
    named = _serving_builds(small_builds, model_hash, "tiny", Present.host_cpu(), names[:1])
    assert [f.name for f, _ in named] == [names[0]]  # a batch-1 build alone, when named
    with pytest.raises(ArtifactError) as refused:
        _serving_builds(small_builds, model_hash, "tiny", Present.host_cpu(), names)
    assert str(refused.value) == (
        f"--build {names[0]} and --build {names[1]} both serve 64x96 frames=5 guidance>1 (a "
        "request picks its build by size, frames, CFG and whether it gives an image only): name "
        f"one of them, e.g. {names[1]} (batch 2)"
    )


def test_next_batch_oldest_group_first_and_window():
    a, b = Group("b2", Settings(steps=3)), Group("b2", Settings(steps=4))
    queued = [Waiting("1", b, 10.0), Waiting("2", a, 11.0), Waiting("3", b, 12.0),
              Waiting("4", b, 13.0)]  # fmt: skip
    batch, _ = next_batch(queued, lambda g: 2, now=11.0, window=5.0)
    assert [w.id for w in batch] == ["1", "3"]  # full: runs at once, oldest group first
    batch, wait = next_batch(queued[1:2], lambda g: 2, now=12.0, window=5.0)
    assert batch == [] and wait == pytest.approx(4.0)  # waits for a partner
    batch, _ = next_batch(queued[1:2], lambda g: 2, now=16.5, window=5.0)
    assert [w.id for w in batch] == ["2"]  # the window is over: runs alone
    assert next_batch([], lambda g: 2, now=0.0, window=1.0)[0] == []


class FakePipeline:
    """What generate_batch calls, recording its arguments: video i's frames hold its seed."""

    def __init__(self, batch: int, fail: bool = False):
        # A key of the default build options (not continuous, no step caching).
        option = lambda _, name: OPTIONS[name].default_value  # noqa: E731
        self.key = type(
            "Key", (), {"batch": batch, "model": "tiny", "option": option, "programs": ()}
        )()
        self.config = type("Config", (), {"fps": 16})()
        self.fail, self.calls = fail, []

    def generate(self, prompt, negative_prompt, **kwargs):
        self.calls.append((prompt, negative_prompt, kwargs))
        if self.fail:
            raise RuntimeError("device lost")
        frames = np.stack([np.full((5, 96, 64, 3), s % 256, np.uint8) for s in kwargs["seed"]])
        report = type("Report", (), {"seconds_denoising": 0.1, "steps": kwargs["steps"]})()
        return frames, report


def test_generate_batch_fills_and_discards_slots():
    pipe = FakePipeline(batch=4)
    videos = [Video("a", "x", 1), Video("b", "y", 2), Video("c", "", 3)]
    frames, _ = generate_batch(pipe, videos, Settings(steps=3))
    prompts, negatives, kwargs = pipe.calls[0]
    assert prompts == ["a", "b", "c", "c"] and negatives == ["x", "y", "", ""]
    assert kwargs["seed"] == [1, 2, 3, 3] and kwargs["steps"] == 3
    assert [f[0, 0, 0, 0] for f in frames] == [1, 2, 3]


def test_per_video_seeds_are_batch_one_noise():
    from runtime.generation.pipeline import _initial_latents

    shape = (3, 2, 4, 6, 16)  # (B, T, h, w, C)
    latents = _initial_latents(shape, [5, 9, 5], None)
    for row, seed in zip(latents, [5, 9, 5], strict=True):
        np.testing.assert_array_equal(row, initial_latents((1, *shape[1:]), seed, None)[0])
    # A batch of one with seed s is `runtime run --seed s`'s noise.
    np.testing.assert_array_equal(
        _initial_latents((1, *shape[1:]), [7], None), initial_latents((1, *shape[1:]), 7, None)
    )


def test_job_store_recovers_and_bounds_the_queue(tmp_path):
    store = JobStore(tmp_path)
    group = Group("g", Settings(steps=3, guidance=1.0, sampler="euler", shift=3.0))
    jobs = [store.add(group, stored_request(i), max_queue=3) for i in range(3)]
    with pytest.raises(QueueFull):
        store.add(group, stored_request(3), max_queue=3)
    store.start([jobs[0].id, jobs[1].id])
    store.complete(jobs[0].id)
    (store.videos / f".{jobs[1].id}.mp4.abc.partial").write_bytes(b"half")
    store.close()
    store = JobStore(tmp_path)  # a restart
    assert store.recover() == 2
    assert [j.id for j in store.queued()] == [jobs[1].id, jobs[2].id]
    assert store.get(jobs[0].id).status == "completed"
    assert {j.group for j in store.page()[0]} == {group}  # read back as written
    assert not list(store.videos.iterdir())
    store.start([jobs[1].id])
    assert store.delete(jobs[2].id) and not store.delete(jobs[1].id)  # queued; in progress
    (store.video_path(jobs[0].id)).write_bytes(b"mp4")
    assert store.delete(jobs[0].id) and not store.video_path(jobs[0].id).exists()  # completed
    assert [j.id for j in store.page()[0]] == [jobs[1].id]


def test_an_image_is_kept_with_its_job(tmp_path):
    """An image-to-video job's input_reference file is written before its row, kept across a
    restart, and removed with its job; a refused add, a killed add (a file without a row) or
    a killed write (a staged file) leaves none."""
    store = JobStore(tmp_path)
    group = Group("g", Settings(steps=3))
    job = store.add(group, stored_request(0), max_queue=2, image=b"picture")
    assert (
        store.image_of(job) == store.input_path(job.id) == tmp_path / "inputs" / f"{job.id}.image"
    )
    assert store.image_of(job).read_bytes() == b"picture" and job.request["input_reference"] is True
    assert store.image_of(store.add(group, stored_request(1), max_queue=2)) is None
    with pytest.raises(QueueFull):
        store.add(group, stored_request(2), max_queue=2, image=b"refused")
    assert [p.name for p in store.inputs.iterdir()] == [f"{job.id}.image"]
    (store.inputs / "video_orphan.image").write_bytes(b"no row")
    (store.inputs / ".video_x.image.abc.partial").write_bytes(b"half")
    store.close()
    store = JobStore(tmp_path)  # a restart
    assert store.recover() == 2
    assert [p.name for p in store.inputs.iterdir()] == [f"{job.id}.image"]
    assert store.image_of(store.get(job.id)).read_bytes() == b"picture"
    assert store.delete(job.id) and not list(store.inputs.iterdir())


def test_failed_batch_fails_its_videos_and_serving_goes_on(tmp_path):
    from runtime.serve.service import Service

    store = JobStore(tmp_path)
    pipelines = {"bad": FakePipeline(2, fail=True), "good": FakePipeline(2)}
    for pipe, (w, h) in zip(pipelines.values(), [(64, 96), (96, 64)], strict=True):
        pipe.key.width, pipe.key.height, pipe.key.frames, pipe.key.cfg = w, h, 5, True
    service = Service(pipelines, store, max_queue=8, batch_window=0.0, compile_count=lambda: 0)
    bad = [store.add(Group("bad", Settings(steps=3)), stored_request(i), 8) for i in range(2)]
    good = store.add(Group("good", Settings(steps=3)), stored_request(1), 8)
    _run_until_completed(service, store, good.id)
    assert [store.get(j.id).error for j in bad] == [
        {"code": "generation_failed", "message": "device lost"}
    ] * 2
    assert service.metrics.failed == 2 and service.metrics.completed == 1
    assert "wan_videos_failed_total 2.0" in service.metrics_text()


def test_a_request_without_size_takes_the_one_size_served():
    """`size` omitted: the one size the model is served at for the length; two sizes are a 400
    naming both, a length none serves a 400 naming the lengths served."""
    from runtime.serve.openai_dialect import ApiError, Resolved, ServedBuild, VideoRequest, resolve

    shapes = {"a": (64, 96, 5), "b": (96, 64, 5), "c": (64, 96, 9)}
    builds = {n: ServedBuild(n, "tiny", 16, (w, h, f, True, False), 1)
              for n, (w, h, f) in shapes.items()}  # fmt: skip
    routes = {b.route: name for name, b in builds.items()}

    def placed(**body) -> Resolved:
        return resolve(VideoRequest.model_validate({"prompt": "p", **body}), builds, routes)

    assert placed(frames=9) == Resolved("c", "tiny", 9, "64x96")
    assert placed(seconds="0.25", size="96x64") == Resolved("b", "tiny", 5, "96x64")
    for body, param, says in [
        ({"frames": 5}, "size", "give size: tiny is served at 64x96, 96x64 for 5 frames"),
        ({"frames": 17}, "frames", "makes 17 frames; served: 0.25 s (5 frames), 0.5 s (9 frames)"),
    ]:
        with pytest.raises(ApiError) as refused:
            placed(**body)
        assert (refused.value.status, refused.value.param) == (400, param)
        assert says in refused.value.message, refused.value.message


def test_the_image_picks_the_build_and_never_shares_a_batch(tmp_path):
    """A text-to-video and an image-to-video build of one shape (a model that runs both): a
    request with input_reference runs on the image one, one without on the text one, never in
    one batch; the image its batch reads is the one uploaded."""
    from runtime.serve.openai_dialect import VideoRequest
    from runtime.serve.service import Service

    store = JobStore(tmp_path)
    pipelines = {"t2v": FakePipeline(2), "i2v": FakePipeline(2)}
    for pipe in pipelines.values():
        pipe.key.width, pipe.key.height, pipe.key.frames, pipe.key.cfg = 64, 96, 5, True
    pipelines["i2v"].key.programs = ("text_encode", "vae_encode")
    service = Service(pipelines, store, max_queue=8, batch_window=0.0, compile_count=lambda: 0)
    png = io.BytesIO()
    Image.new("RGB", (64, 96), (200, 30, 30)).save(png, format="PNG")
    body = VideoRequest.model_validate({"prompt": "a cat", "size": "64x96", "frames": 5,
                                        "steps": 3, "seed": 1})  # fmt: skip
    with_image, without = service.submit(body, png.getvalue()), service.submit(body)
    assert (with_image.group.build, without.group.build) == ("i2v", "t2v")
    _run_until_completed(service, store, without.id)  # the image's batch ran first: the oldest
    assert store.get(with_image.id).status == "completed"
    [(prompts, _, image_call)] = pipelines["i2v"].calls
    [(_, _, text_call)] = pipelines["t2v"].calls
    assert prompts == ["a cat", "a cat"] and "images" not in text_call  # one video each
    assert [p.getpixel((0, 0)) for p in image_call["images"]] == [(200, 30, 30)] * 2


@pytest.mark.parametrize(
    "stored",
    ["not json", "[]", '["good"]', '{"a": 1, "b": 2}', '["good", {"colour": 1}]',
     '["good", {"steps": [3]}]', '[7, {"steps": 3}]', "[" * 100_000],
)  # fmt: skip
def test_a_stored_group_that_does_not_read_fails_its_job_only(tmp_path, stored):
    """A damaged row in the job database: the server starts, lists it, fails it with a reason
    and runs the others; a job of a build not loaded fails too."""
    from runtime.serve.service import Service

    store = JobStore(tmp_path)
    request = stored_request(1)
    damaged, good = (store.add(Group("good", Settings(steps=3)), request, 8) for _ in range(2))
    gone = store.add(Group("gone", Settings(steps=3)), request, 8)
    with sqlite3.connect(tmp_path / DATABASE) as db:
        db.execute("UPDATE jobs SET grp=? WHERE id=?", (stored, damaged.id))
    store.close()
    store = JobStore(tmp_path)  # a restart
    assert store.recover() == 3 and store.get(damaged.id).group is None
    pipe = FakePipeline(1)
    pipe.key.width, pipe.key.height, pipe.key.frames, pipe.key.cfg = 64, 96, 5, True
    service = Service({"good": pipe}, store, max_queue=8, batch_window=0.0, compile_count=lambda: 0)
    assert [service.video_object(j)["build"] for j in store.page()[0]] == ["gone", "good", None]
    _run_until_completed(service, store, good.id)
    assert store.get(damaged.id).error == {
        "code": "unreadable_job",
        "message": "its stored batch group does not read: submit the video again",
    }
    assert store.get(gone.id).error == {
        "code": "unsupported_shape",
        "message": "build gone is not served",
    }
    assert {store.get(j.id).status for j in (damaged, gone)} == {"failed"}


def test_the_samplers_are_listed_once():
    """The HTTP request, `runtime run --sampler` and the scheduler config read one list."""
    import pydantic

    from runtime.cli.run import run_cmd
    from runtime.serve.openai_dialect import VideoRequest
    from wan.configs import SAMPLERS, SchedulerConfig

    body = {"prompt": "p", "size": "64x96", "frames": 5}
    assert [VideoRequest(**body, sampler=s).sampler for s in SAMPLERS] == list(SAMPLERS)
    with pytest.raises(pydantic.ValidationError):
        VideoRequest(**body, sampler="ddim")
    [option] = [p for p in run_cmd.params if p.name == "sampler"]
    assert tuple(option.type.choices) == SAMPLERS
    assert SchedulerConfig().kind in SAMPLERS


def _run_until_completed(service, store: JobStore, job_id: str) -> None:
    """Run the service's worker until job `job_id` completes (60 s at most), then drain it."""
    worker = threading.Thread(target=service.run, daemon=True)
    worker.start()
    deadline = time.monotonic() + 60
    while store.get(job_id).status != "completed":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    service.drain()
    worker.join(10)


def test_the_metrics_follow_the_queue(tmp_path):
    """wan_queue_depth, wan_videos_in_progress and wan_seconds_per_step as the queue moves: 3
    queued; a batch of 2 in flight (held on a gate) and 1 queued; all done, and the mean step
    time the reports gave."""
    from runtime.serve.service import Service

    store = JobStore(tmp_path)
    pipe = FakePipeline(2)
    pipe.key.width, pipe.key.height, pipe.key.frames, pipe.key.cfg = 64, 96, 5, True
    started, gate, generate = threading.Event(), threading.Event(), pipe.generate

    def held(*args, **kwargs):
        started.set()
        assert gate.wait(30)
        return generate(*args, **kwargs)

    pipe.generate = held
    service = Service({"good": pipe}, store, max_queue=8, batch_window=0.0, compile_count=lambda: 0)
    jobs = [store.add(Group("good", Settings(steps=3)), stored_request(i), 8) for i in range(3)]

    def metrics() -> tuple[float, ...]:
        values = dict(line.split() for line in service.metrics_text().splitlines()
                      if not line.startswith("#"))  # fmt: skip
        names = ("queue_depth", "videos_in_progress", "videos_completed_total", "seconds_per_step")
        return tuple(float(values[f"wan_{name}"]) for name in names)

    assert metrics() == (3, 0, 0, 0)
    worker = threading.Thread(target=service.run, daemon=True)
    worker.start()
    assert started.wait(30)
    assert metrics() == (1, 2, 0, 0)
    gate.set()
    deadline = time.monotonic() + 30
    while store.get(jobs[2].id).status != "completed":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    service.drain()
    worker.join(10)
    assert metrics() == (0, 0, 3, pytest.approx(0.1 / 3))  # FakePipeline: 0.1 s for 3 steps
