"""Step caching (`aot build --step-cache`, `runtime run --cache ...`) against diffusers' own cache
hooks on the same tiny WanPipeline (CFG, 12 UniPC steps): the same skipped steps, frames within
2/255; a cached run moves the frames by more than that (the cache acts), and a step-cache build
without a cache gives the plain build's frames bit for bit."""

from __future__ import annotations

import contextlib
import io
import json
import re

import numpy as np
import pytest
import torch
from conftest import run_cli, save_tiny_diffusers_pipeline
from diffusers import WanPipeline, WanTransformer3DModel
from diffusers.hooks import FirstBlockCacheConfig, MagCacheConfig, first_block_cache, mag_cache
from test_server import serving

WIDTH, HEIGHT, FRAMES, STEPS = 48, 32, 9, 12
SHAPE = ["--res", f"{WIDTH}x{HEIGHT}", "--frames", str(FRAMES), "--batch", "1"]
TOLERANCE = 2 / 255  # uint8 frames vs diffusers' float frames
PROMPTS = {"prompt": "a red cat running in the rain", "negative_prompt": "blurry"}
GUIDANCE = 4.0
# Ratios and settings under which MagCache skips steps in runs of one and of several: retention
# keeps step 0, the accumulated error and max_skip decide the rest.
MAG_RATIOS = [1.0, 1.0, 1.0, 0.99, 0.97, 1.0, 1.0, 1.0, 1.0, 0.96, 1.0, 1.0]
MAG = {"threshold": 0.06, "max_skip": 3, "retention": 0.1}
FBC_THRESHOLD = 0.05
FBC_MARGIN = 0.03  # every relative change is at least 3% of the threshold away from it
# The other blocks of the fbcache model are scaled up, so that reusing their residual moves the
# frames by more than the tolerance (at the tiny model's init it moves them by less).
FBC_BLOCK_GAIN = 3.0
# The calibration model's time embedder is scaled up, so that its blocks' residual changes from
# step to step: magnitude ratios up to 25% from 1 (at the tiny model's init, within 0.34%, where
# an all-ones calibration would pass a loose check).
CAL_TIME_GAIN = 4.0
CAL_RTOL = 1e-3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Tiny diffusers folders (one transformer; fbcache's and calibration's variants of it; two
    experts), the initial noise, and the --step-cache builds of "one" and "two" (and the plain
    build of "one"). The variants differ from "one" in their weights only: its step-cache build
    runs them (a build is matched by the model's config hash, which they share)."""
    root = tmp_path_factory.mktemp("step_cache")
    save_tiny_diffusers_pipeline(root / "one")
    save_tiny_diffusers_pipeline(root / "two", two_experts=True)
    _with_gain(root / "fbc", "blocks.1.ffn.net.2", FBC_BLOCK_GAIN)
    _with_gain(root / "cal", "condition_embedder.time_embedder", CAL_TIME_GAIN)
    noise = np.random.default_rng(1).standard_normal(
        (1, 16, 3, HEIGHT // 8, WIDTH // 8), np.float32
    )
    np.save(root / "noise.npy", noise)
    # The plain build of "one" only: the tests compare the step-cache builds with diffusers,
    # not with their plain builds.
    for model, caches in (("one", ([], ["--step-cache"])), ("two", (["--step-cache"],))):
        for cache in caches:
            run_cli("aot", "build", "--model", str(root / model), *SHAPE, *cache,
                    "--target", "cpu-8", "--out", str(root / "artifacts"))  # fmt: skip
    return root, noise


def _with_gain(folder, prefix: str, gain: float) -> None:
    """A tiny diffusers pipeline saved in `folder`, its transformer's parameters under
    `prefix` multiplied by `gain`."""
    save_tiny_diffusers_pipeline(folder)
    transformer = WanTransformer3DModel.from_pretrained(folder / "transformer")
    with torch.no_grad():
        for name, p in transformer.named_parameters():
            if name.startswith(prefix):
                p.mul_(gain)
    transformer.save_pretrained(folder / "transformer")


@contextlib.contextmanager
def _recording(cls, method: str, record):
    """Calls of diffusers' hook method `cls.method`, each passed to record(self, result, args)."""
    original = getattr(cls, method)

    def wrapper(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        record(self, result, args)
        return result

    setattr(cls, method, wrapper)
    try:
        yield
    finally:
        setattr(cls, method, original)


def _diffusers(folder, noise, caches=None):
    """diffusers' frames, with a cache config per transformer name when given."""
    pipe = WanPipeline.from_pretrained(folder)
    for name, config in (caches or {}).items():
        getattr(pipe, name).enable_cache(config)
    return pipe(
        **PROMPTS, height=HEIGHT, width=WIDTH, num_frames=FRAMES, num_inference_steps=STEPS,
        guidance_scale=GUIDANCE, latents=torch.from_numpy(noise), output_type="np",
    ).frames  # fmt: skip


def _ours(root, model, tmp_path, *cache_args):
    """Our frames and the run's report through `runtime run`."""
    frames, report = tmp_path / "frames.npy", tmp_path / "report.json"
    run_cli(
        "runtime", "run", "--artifacts", str(root / "artifacts"), "--weights", str(root / model),
        *SHAPE, *PROMPTS_ARGS, "--steps", str(STEPS), "--guidance", str(GUIDANCE),
        "--init-noise", str(root / "noise.npy"), "--save-frames", str(frames),
        "--report", str(report), "--out", str(tmp_path / "v.mp4"), *cache_args,
    )  # fmt: skip
    return np.load(frames).astype(np.float32) / 255, json.loads(report.read_text())


PROMPTS_ARGS = ["--prompt", PROMPTS["prompt"], "--negative-prompt", PROMPTS["negative_prompt"]]


def _builds(root, model):
    return sorted(p.name for p in (root / "artifacts").iterdir() if p.name.startswith(model))


def _plain_build(root, model):
    (name,) = [n for n in _builds(root, model) if not n.endswith("_stepcache")]
    return name


def _step_cache_build(root, model):
    (name,) = [n for n in _builds(root, model) if n.endswith("_stepcache")]
    return name


def _magcache_args(tmp_path, ratios) -> list[str]:
    path = tmp_path / "ratios.json"
    path.write_text(json.dumps(ratios))
    return [
        "--cache", "magcache", "--mag-ratios", str(path),
        "--cache-threshold", str(MAG["threshold"]), "--cache-max-skip", str(MAG["max_skip"]),
        "--cache-retention", str(MAG["retention"]),
    ]  # fmt: skip


def _magcache_config(ratios, steps=STEPS) -> MagCacheConfig:
    return MagCacheConfig(
        threshold=MAG["threshold"], max_skip_steps=MAG["max_skip"],
        retention_ratio=MAG["retention"], num_inference_steps=steps, mag_ratios=list(ratios),
    )  # fmt: skip


def _skips_of(calls: list[bool], contexts: int = 2) -> list[int]:
    """Step indices diffusers skipped, from its should_compute per call (CFG: cond, uncond);
    both contexts decide alike here, which the test asserts."""
    per_context = [calls[i::contexts] for i in range(contexts)]
    assert all(c == per_context[0] for c in per_context)
    return [i for i, compute in enumerate(per_context[0]) if not compute]


BUILT_AS = {"fbc": "one", "cal": "one"}  # the variants run one's builds (`tiny`)


def _run_ours(root, model, tmp_path, args):
    """Our frames and report from the model's --step-cache build."""
    build = _step_cache_build(root, BUILT_AS.get(model, model))
    return _ours(root, model, tmp_path, "--build", build, *args)


def test_magcache_matches_diffusers(tiny, tmp_path):
    root, noise = tiny
    decisions = []
    record = lambda hook, result, args: decisions.append(  # noqa: E731
        hook.state_manager.get_state().should_compute
    )
    with _recording(mag_cache.MagCacheHeadHook, "new_forward", record):
        expected = _diffusers(root / "one", noise, {"transformer": _magcache_config(MAG_RATIOS)})
    ours, report = _run_ours(root, "one", tmp_path, _magcache_args(tmp_path, MAG_RATIOS))
    skipped = _skips_of(decisions)
    assert 0 < len(skipped) < STEPS - 1
    assert report["cache"]["skipped_steps"] == skipped
    assert report["cache"]["block_steps_run"] == 2 * (STEPS - len(skipped))
    assert report["compile_count"] == 0
    assert np.abs(ours - expected).max() <= TOLERANCE
    # The cache acts: uncached frames are further from the cached ones than the tolerance.
    uncached = _diffusers(root / "one", noise)
    assert np.abs(uncached - expected).max() > TOLERANCE
    assert np.abs(ours - uncached).max() > TOLERANCE


def test_two_experts_keep_one_magcache_each(tiny, tmp_path):
    """Wan 2.2's expert pair: one cache per transformer, the second starting afresh at the
    switch, as diffusers' hook on each transformer does."""
    root, noise = tiny
    pipe = WanPipeline.from_pretrained(root / "two")
    pipe.scheduler.set_timesteps(STEPS)
    boundary = pipe.config.boundary_ratio * pipe.scheduler.config.num_train_timesteps
    high_steps = int((pipe.scheduler.timesteps >= boundary).sum())
    ratios = {"transformer": MAG_RATIOS[:high_steps], "transformer_2": [1.0] * STEPS}
    decisions = {"transformer": [], "transformer_2": []}
    # Each expert's cache runs over the steps that expert runs.
    expert_steps = {"transformer": high_steps, "transformer_2": STEPS - high_steps}
    configs = {name: _magcache_config(r, expert_steps[name]) for name, r in ratios.items()}
    owner = {}  # hook -> transformer name

    def record(hook, result, args):
        decisions[owner[id(hook.config)]].append(hook.state_manager.get_state().should_compute)

    for name, config in configs.items():
        owner[id(config)] = name
    with _recording(mag_cache.MagCacheHeadHook, "new_forward", record):
        expected = _diffusers(root / "two", noise, configs)
    ours, report = _run_ours(root, "two", tmp_path, _magcache_args(tmp_path, ratios))
    high = _skips_of(decisions["transformer"])
    low = [high_steps + i for i in _skips_of(decisions["transformer_2"])]
    assert high and low  # each expert skips
    assert report["cache"]["skipped_steps"] == high + low
    assert np.abs(ours - expected).max() <= TOLERANCE


def test_calibration_matches_diffusers(tiny, tmp_path):
    """--calibrate-mag-ratios writes the ratios diffusers' calibrate mode prints (its cond
    pass: the prompt rows), skipping nothing."""
    root, noise = tiny
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        _diffusers(
            root / "cal",
            noise,
            {"transformer": MagCacheConfig(num_inference_steps=STEPS, calibrate=True)},
        )
    expected = json.loads(re.findall(r"\n(\[[^\]]*\])\n", printed.getvalue())[0])
    out = tmp_path / "calibrated.json"
    args = ["--cache", "magcache", "--calibrate-mag-ratios", str(out)]
    _, report = _run_ours(root, "cal", tmp_path, args)
    assert report["cache"]["skipped_steps"] == []
    np.testing.assert_allclose(json.loads(out.read_text()), expected, rtol=CAL_RTOL)
    # Control: the ratios are far from any constant (an all-ones or a shifted calibration).
    assert np.ptp(expected) > 100 * CAL_RTOL


def test_first_block_cache_matches_diffusers(tiny, tmp_path):
    root, noise = tiny
    changes, decisions = [], []

    def record(hook, compute, args):
        # Called before the hook stores a computed step's residual: `previous` is the last one.
        previous, residual = hook.state_manager.get_state().head_block_residual, args[0]
        decisions.append(compute)
        if previous is not None:
            changes.append(((residual - previous).abs().mean() / previous.abs().mean()).item())

    with _recording(first_block_cache.FBCHeadBlockHook, "_should_compute_remaining_blocks", record):
        expected = _diffusers(
            root / "fbc", noise, {"transformer": FirstBlockCacheConfig(threshold=FBC_THRESHOLD)}
        )
    ours, report = _run_ours(
        root, "fbc", tmp_path,
        ["--cache", "fbcache", "--cache-threshold", str(FBC_THRESHOLD)],
    )  # fmt: skip
    skipped = _skips_of(decisions)
    assert skipped and len(skipped) < STEPS - 1
    margins = [abs(c - FBC_THRESHOLD) / FBC_THRESHOLD for c in changes]
    assert min(margins) > FBC_MARGIN, (changes, FBC_THRESHOLD)
    assert report["cache"]["skipped_steps"] == skipped
    assert report["cache"]["block_steps_run"] == 2 * STEPS - len(skipped)
    assert np.abs(ours - expected).max() <= TOLERANCE
    uncached = _diffusers(root / "fbc", noise)
    assert np.abs(uncached - expected).max() > TOLERANCE
    assert np.abs(ours - uncached).max() > TOLERANCE


SEEDED = ["--steps", str(STEPS), "--guidance", str(GUIDANCE), "--seed", "5"]  # as served below


def _seeded_run(root, build: str, out, *cache_args: str) -> tuple[np.ndarray, dict]:
    """`runtime run` of PROMPTS (SEEDED) on `build`, one of "one"'s: its video's frames and the
    run's report."""
    run_cli("runtime", "run", "--artifacts", str(root / "artifacts"), "--weights",
            str(root / "one"), *SHAPE, *PROMPTS_ARGS, *SEEDED, "--build", build,
            "--save-frames", str(out / "frames.npy"), "--out", str(out / "v.mp4"), "--report",
            str(out / "report.json"), *cache_args)  # fmt: skip
    return np.load(out / "frames.npy")[0], json.loads((out / "report.json").read_text())


@pytest.fixture(scope="module")
def uncached(tiny, tmp_path_factory):
    """One's step-cache build run without a cache (SEEDED): its frames and report. Run once for
    the two tests that compare with it: the plain build's frames, and a cached run's."""
    root, _ = tiny
    return _seeded_run(root, _step_cache_build(root, "one"), tmp_path_factory.mktemp("uncached"))


def test_no_cache_on_a_step_cache_build_is_the_plain_build_bit_for_bit(tiny, uncached, tmp_path):
    root, _ = tiny
    plain, _ = _seeded_run(root, _plain_build(root, "one"), tmp_path)
    with_programs, report = uncached
    assert report["cache"]["cache"] is None
    assert np.array_equal(plain, with_programs)


def _fails(root, tmp_path, *args) -> str:
    """stderr of a run that must fail with one line (exit 2) and write nothing."""
    result = run_cli(
        "runtime", "run", "--artifacts", str(root / "artifacts"), "--weights", str(root / "one"),
        *SHAPE, "--prompt", "a", "--steps", "3", "--out", str(tmp_path / "v.mp4"), *args,
        check=False,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "v.mp4").exists()
    return result.stderr


def test_bad_cache_requests_are_one_line(tiny, tmp_path):
    root, _ = tiny
    plain = _plain_build(root, "one")
    # A cache on a build without the programs: the exact command to make one, before any
    # weight is read (the VAE's weights are made unreadable to show it).
    broken = tmp_path / "weights"
    broken.mkdir()
    for part in (root / "one").iterdir():
        (broken / part.name).symlink_to(part)
    (broken / "vae").unlink()
    (broken / "vae").mkdir()
    (broken / "vae" / "config.json").symlink_to(root / "one" / "vae" / "config.json")
    (broken / "vae" / "diffusion_pytorch_model.safetensors").write_bytes(b"not weights")
    result = run_cli(
        "runtime", "run", "--artifacts", str(root / "artifacts"), "--weights", str(broken),
        *SHAPE, "--prompt", "a", "--steps", "3", "--out", str(tmp_path / "v.mp4"),
        "--build", plain, "--cache", "magcache", check=False,
    )  # fmt: skip
    assert result.returncode == 2 and "--step-cache" in result.stderr, result.stderr
    assert "aot build --model" in result.stderr
    build = _step_cache_build(root, "one")
    bad_ratios = tmp_path / "bad.json"
    for content in ("[1.0, -0.5]", '["a"]', "{}", "not json"):
        bad_ratios.write_text(content)
        err = _fails(root, tmp_path, "--build", build, "--cache", "magcache",
                     "--mag-ratios", str(bad_ratios))  # fmt: skip
        assert str(bad_ratios) in err
    err = _fails(root, tmp_path, "--build", build, "--cache", "fbcache", "--cache-threshold", "-1")
    assert "--cache-threshold" in err
    # The tiny model has no shipped ratios: how to calibrate them.
    err = _fails(root, tmp_path, "--build", build, "--cache", "magcache")
    assert "--calibrate-mag-ratios" in err


def test_serve_takes_the_cache_of_its_builds(tiny, tmp_path):
    """`runtime serve --cache` checks every build it would serve before any weight loads."""
    root, _ = tiny
    result = run_cli(
        "runtime", "serve", "--artifacts", str(root / "artifacts"), "--weights", str(root / "one"),
        "--build", _plain_build(root, "one"), "--port", "0", "--out-dir", str(tmp_path / "srv"),
        "--cache", "fbcache", check=False,
    )  # fmt: skip
    assert result.returncode == 2 and "--step-cache" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_serve_with_magcache_is_runtime_run_with_magcache(tiny, uncached, tmp_path):
    """`runtime serve --cache magcache` on the step-cache build: a request's frames equal
    `runtime run --cache magcache` of the same request bit for bit, a run that skipped steps,
    and differ from the uncached run's (the cache acted in the server)."""
    root, _ = tiny
    cache = _magcache_args(tmp_path, MAG_RATIOS)
    cached, report = _seeded_run(root, _step_cache_build(root, "one"), tmp_path, *cache)
    with serving(root / "artifacts", root / "one", tmp_path / "out", "--build",
                 _step_cache_build(root, "one"), "--batch-window", "0", "--save-frames",
                 *cache) as server:  # fmt: skip
        video = server.post({**PROMPTS, "size": f"{WIDTH}x{HEIGHT}", "frames": FRAMES,
                             "steps": STEPS, "guidance": GUIDANCE, "seed": 5}).json()  # fmt: skip
        server.wait([video["id"]])
        answer = server.client.get(
            f"/v1/videos/{video['id']}/content", params={"variant": "frames"}
        )
    served = np.load(io.BytesIO(answer.content))
    np.testing.assert_array_equal(served, cached)
    assert report["cache"]["skipped_steps"]
    assert np.any(served != uncached[0])


def test_aot_check_passes_the_step_cache_builds(tiny):
    """`aot check` reads a step-cache build's programs (cache_step, cached_step) like any."""
    root, _ = tiny
    result = run_cli("aot", "check", str(root / "artifacts"))
    builds = [name for name in _builds(root, "") if not name.startswith(".")]
    assert sum(name.endswith("_stepcache") for name in builds) == 2
    assert f"{len(builds)} build(s) pass" in result.stdout
    for name in builds:
        assert name in result.stdout
