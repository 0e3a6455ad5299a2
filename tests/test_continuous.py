"""Step-level continuous batching (`aot build --continuous`, runtime.generation.continuous): videos join a
running batch at a step boundary and leave it when done, each equal to its batch-1 generation
within 1/255 whatever slot it took and whenever it joined; zero compiles; `runtime serve` of a
continuous build (a real server, kill -9 and restart); the combinations refused in one line."""

from __future__ import annotations

import io
import os
import signal
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import SMALL, run_cli, save_tiny_diffusers_pipeline
from test_server import SHAPE, serving

from aot.building.lower import compile_in_process
from aot.building.plan import plan_build
from aot.targets import parse_target
from runtime.builds.loader import Request
from runtime.generation.batching import Settings, Video
from runtime.generation.compiles import CompileCounter
from runtime.generation.continuous import SlotBatch
from runtime.generation.pipeline import Pipeline
from wan.configs import ModelConfig, VideoShape


@pytest.fixture(scope="session")
def continuous_build(shared_dir) -> Path:
    """The tiny model's continuous build of test_server's small shape, batch 2, cpu-8."""
    out = shared_dir / "continuous-artifacts"
    run_cli("aot", "build", "--model", "tiny", *SMALL, "--batch", "2", "--continuous",
            "--target", "cpu-8", "--out", str(out))  # fmt: skip
    return out


@pytest.fixture(scope="module")
def batch_one(small_builds, tiny_weights) -> Pipeline:
    """test_server's batch-1 build of the small shape, loaded once: the reference the tests
    compare the continuous build's videos with."""
    return Pipeline.load(small_builds, tiny_weights, Request(VideoShape(64, 96, 5, 1)))


def _close(got: np.ndarray, expected: np.ndarray) -> None:
    """Equal within 1/255 (the uint8 frames of a batch-2 and a batch-1 program), and real."""
    assert got.shape == expected.shape
    assert np.abs(got.astype(int) - expected.astype(int)).max() <= 1
    assert np.ptp(got) > 20


def _run(slots: SlotBatch, joins: dict[int, list[tuple[str, Video, Settings]]]) -> tuple:
    """Steps until every video has left: `joins[n]` join before the n-th step, as many as there
    are free slots (the rest before the next step); the finished videos by id, and the slot
    each took."""
    finished, taken, waiting, n = {}, {}, [], 0
    while waiting or joins or slots.occupied:
        waiting += joins.pop(n, [])
        free = slots.free
        if waiting and free:
            joining, waiting = waiting[: len(free)], waiting[len(free) :]
            slots.join(joining)
            taken.update({video[0]: slot for video, slot in zip(joining, free, strict=False)})
        finished.update({f.id: f for f in slots.step()})
        n += 1
    return finished, taken


def test_videos_joining_at_any_step_equal_batch_one(continuous_build, batch_one, tiny_weights):
    """Joins at step 0, mid-run, and into a slot another video just left; mixed step counts,
    guidance, samplers and shifts in one batch: each video equals its batch-1 generation."""
    config = ModelConfig.from_folder(tiny_weights)
    shape = VideoShape(64, 96, 5, 2)
    continuous = Pipeline.load(continuous_build, tiny_weights, Request(shape, serving=True))
    assert continuous.key.option("continuous") and config.num_experts == 1
    videos = {
        "a": (Video("a red cat", "blurry", 3), Settings(steps=4, guidance=5.0)),
        "b": (Video("a blue dog", "", 7), Settings(steps=6, guidance=3.0, sampler="euler", shift=2.0)),
        "c": (Video("a fox in snow", "dark", 11), Settings(steps=3, guidance=4.0)),
        "d": (Video("a red cat", "blurry", 3), Settings(steps=2, guidance=6.0)),
    }  # fmt: skip
    joins = {0: ["a"], 2: ["b"], 3: ["c"], 4: ["d"]}  # c waits for a to leave, d for c or b
    counter = CompileCounter()
    slots = SlotBatch(continuous)
    finished, taken = _run(slots, {n: [(i, *videos[i]) for i in ids] for n, ids in joins.items()})
    assert counter.count == 0
    assert set(finished) == set(videos) and not slots.occupied
    assert taken["a"] == 0 and taken["b"] == 1 and taken["c"] == 0  # c took the slot a left
    for video_id, (video, settings) in videos.items():
        assert finished[video_id].error is None
        expected, _ = batch_one.generate(
            video.prompt, video.negative_prompt, seed=video.seed, steps=settings.steps,
            guidance=settings.guidance, sampler=settings.sampler, shift=settings.shift,
        )  # fmt: skip
        _close(finished[video_id].frames, expected[0])
    # Control: a video's neighbours and settings do change what it is compared with.
    assert np.abs(finished["a"].frames.astype(int) - finished["d"].frames.astype(int)).max() > 10


def test_two_experts_step_their_own_slots(tmp_path):
    """A two-expert model (Wan 2.2's boundary) with one video on each expert at once: a step
    per expert, each marking its slots; both equal their batch-1 generations."""
    folder = tmp_path / "pipe"
    save_tiny_diffusers_pipeline(folder, two_experts=True)
    config = ModelConfig.from_diffusers(folder, dtype="float32")
    target = parse_target("cpu-8")
    pipes = {}
    for batch, continuous in ((2, True), (1, False)):
        plan = plan_build("tiny-a", config, VideoShape(64, 96, 5, batch), target, 8,
                          continuous=continuous)  # fmt: skip
        exe = compile_in_process(plan)
        pipes[batch] = Pipeline.assemble(exe, folder, plan.key, f"b{batch}", config)
    settings = Settings(steps=6, guidance=5.0, guidance_2=2.0)
    first, second = Video("a cat", "", 1), Video("a dog", "blur", 2)
    slots = SlotBatch(pipes[2])
    slots.join([("first", first, settings)])
    while slots.slots[0].expert_at(slots.slots[0].done)[0] == "transformer":
        slots.step()
    assert 0 < slots.slots[0].done < settings.steps  # the first is on the low-noise expert
    slots.join([("second", second, settings)])
    assert slots.slots[1].expert_at(0)[0] == "transformer"  # the next step runs each expert
    finished, _ = _run(slots, {})
    for video_id, video in (("first", first), ("second", second)):
        expected, _ = pipes[1].generate(video.prompt, video.negative_prompt, seed=video.seed,
                                        steps=6, guidance=5.0, guidance_2=2.0)  # fmt: skip
        _close(finished[video_id].frames, expected[0])


def test_serve_joins_mid_run_and_a_kill_9_loses_nothing(
    continuous_build,
    batch_one,
    tiny_weights,
    tmp_path,
):
    """`runtime serve` of the continuous build: a short video posted while a long one runs
    completes first (it joined, it did not wait for the batch); kill -9 mid-run, and a restart
    completes the long one; both equal their batch-1 generations; zero compiles."""
    out = tmp_path / "out"
    long = {"prompt": "a long cat", "negative_prompt": "", **SHAPE, "steps": 200, "seed": 5}
    short = {"prompt": "a short dog", "negative_prompt": "x", **SHAPE, "steps": 3, "seed": 6,
             "guidance": 3.0, "sampler": "euler", "shift": 4.0}  # fmt: skip
    with serving(continuous_build, tiny_weights, out, "--save-frames") as server:
        [served] = server.client.get("/healthz").json()["builds"]
        assert "_continuous" in served
        long_id = server.post(long).json()["id"]
        while server.client.get(f"/v1/videos/{long_id}").json()["progress"] < 1:
            time.sleep(0.05)
        short_id = server.post(short).json()["id"]
        server.wait([short_id])
        assert server.client.get(f"/v1/videos/{long_id}").json()["status"] == "in_progress"
        metrics = server.metrics()
        assert metrics["wan_compile_count"] == 0 and metrics["wan_videos_completed_total"] == 1
        assert metrics["wan_slot_steps_total"] > metrics["wan_empty_slot_steps_total"] > 0
        assert metrics[f'wan_slots_occupied{{build="{served}"}}'] == 1  # the long video's
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait()
    with serving(continuous_build, tiny_weights, out, "--save-frames") as server:
        server.wait([long_id], timeout=600)
        frames = {
            i: np.load(io.BytesIO(server.client.get(f"/v1/videos/{i}/content",
                                                    params={"variant": "frames"}).content))
            for i in (long_id, short_id)
        }  # fmt: skip
        assert server.metrics()["wan_compile_count"] == 0
    for video_id, body in ((long_id, long), (short_id, short)):
        expected, _ = batch_one.generate(
            body["prompt"], body["negative_prompt"], seed=body["seed"], steps=body["steps"],
            guidance=body.get("guidance", 5.0), sampler=body.get("sampler"), shift=body.get("shift"),
        )  # fmt: skip
        _close(frames[video_id], expected[0])


def test_what_continuous_batching_does_not_do_is_one_line(continuous_build, tiny_weights, tmp_path):
    """`--continuous --step-cache`, `runtime run` of a continuous build, and `serve --cache`
    of one: each refused in one line that says what to do."""
    both = run_cli("aot", "build", "--model", "tiny", *SMALL, "--batch", "2", "--continuous",
                   "--step-cache", "--target", "cpu-8", "--out", str(tmp_path / "a"), check=False)  # fmt: skip
    assert both.returncode == 2 and "--continuous with --step-cache" in both.stderr
    assert len(both.stderr.strip().splitlines()) == 1
    run = run_cli("runtime", "run", "--artifacts", str(continuous_build), "--weights",
                  str(tiny_weights), *SMALL, "--batch", "2", "--prompt", "x", "--out",
                  str(tmp_path / "x.mp4"), check=False)  # fmt: skip
    assert (
        run.returncode != 0 and "a continuous build" in run.stderr and "runtime serve" in run.stderr
    )
    assert "Traceback" not in run.stderr and not (tmp_path / "x.mp4").exists()
    cached = run_cli("runtime", "serve", "--artifacts", str(continuous_build), "--weights",
                     str(tiny_weights), "--out-dir", str(tmp_path / "jobs"), "--port", "0",
                     "--cache", "magcache", check=False)  # fmt: skip
    assert cached.returncode != 0 and "with a continuous build" in cached.stderr
    assert "Traceback" not in cached.stderr


def test_weights_are_placed_once_per_distinct_sharding(
    continuous_build, small_builds, tiny_weights
):
    """Builds loaded with one `placed` (as runtime serve loads its builds): a component whose
    tensors have the same shardings in two builds is the same arrays (read and placed once);
    one whose shardings differ is placed for each."""
    from runtime.builds.loader import read_builds

    config = ModelConfig.from_folder(tiny_weights)
    found = {folder.name: (folder, manifest) for folder, manifest in
             [*read_builds(small_builds), *read_builds(continuous_build)]}  # fmt: skip
    placed: dict = {}
    pipes = {name: Pipeline.from_build(*build, tiny_weights, config, placed=placed)
             for name, build in found.items()}  # fmt: skip
    assert len(pipes) == 3
    names = sorted(pipes)

    def leaves(name: str) -> list:
        return jax.tree.leaves(pipes[name].params["transformer"])

    pairs = {"shared": 0, "apart": 0}
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            same = [x.sharding for x in leaves(a)] == [y.sharding for y in leaves(b)]
            shared = all(x is y for x, y in zip(leaves(a), leaves(b), strict=True))
            assert shared == same, (a, b)
            pairs["shared" if shared else "apart"] += 1
    assert pairs == {"shared": 1, "apart": 2}, pairs  # the two batch-2 builds; the batch-1 one
