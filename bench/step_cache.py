"""Step caching's cost per video, two ways.

Measured (`--part measured`): the `small` preset on cpu-8, one `--step-cache` build, 20 steps.
MagCache's ratios are first calibrated by our own calibrate mode on this model; then uncached
and MagCache runs (default settings) alternate in one process, and the denoise phase of each is
timed side by side, with the steps MagCache skipped.

Deviceless (`--part deviceless`): the Wan 2.1 14B at 1280x720, 81 frames, batch 1, the two step
programs of its `--step-cache` build compiled for tpu-v6e-8 on this host (the build's others
left out): the full and the cached step's FLOPs per device, and
the transformer work per video over 50 steps with the shipped Wan 2.1 14B ratios at the default
settings (the steps run, each at its step lower bound: FLOPs at the chip's peak bf16 rate).

    python bench/step_cache.py --part measured --out bench/results/step_cache.json
    python bench/step_cache.py --part deviceless --out bench/results/step_cache.json

`--model`, `--res`, `--frames` and `--steps` replace a part's preset, shape and steps,
`--weights` gives the measured part weights already written (default: random ones) and
`--artifacts` a folder to build its build into, where an up-to-date build is not compiled again
(default: a scratch folder); tests/test_bench.py runs both parts on the tiny model so. The
deviceless part's skipped steps stay those of the shipped Wan 2.1 14B ratios.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fixtures  # bench/fixtures.py, beside this script
import record  # noqa: E402  (bench/record.py, beside this script)

BIN = Path(sys.executable).parent
PROMPT = "a red cat running in the rain"
STEP_PROGRAMS = ("cache_step", "cached_step")  # the full step and the cached one
# Each part's preset, resolution, frames and steps (what docs/benchmarks.md quotes).
DEFAULTS = {
    "measured": ("small", "320x192", 17, 20),
    "deviceless": ("wan2.1-t2v-14b", "1280x720", 81, 50),
}


def _build(model: str, shape: list[str], target: str, out: Path) -> Path:
    (built,) = fixtures.build("--model", model, *shape, "--target", target, "--step-cache",
                              "--out", out)  # fmt: skip
    return Path(built["folder"])


def measured(
    model: str,
    shape: list[str],
    repeats: int,
    steps: int,
    weights: Path | None,
    artifacts: Path | None = None,
) -> dict:
    """Uncached vs MagCache denoise seconds (the small preset), alternating in one process;
    the build made into `artifacts` (default: the scratch folder)."""
    from aot import targets

    targets.prepare_environment(targets.parse_target("cpu-8"))
    from runtime.builds.artifact import read_manifest
    from runtime.generation.pipeline import Pipeline
    from runtime.generation.step_cache import MAGCACHE, CacheRequest
    from wan.configs import ModelConfig

    with tempfile.TemporaryDirectory() as tmp:
        weights = fixtures.random_weights(model, Path(tmp) / "weights", weights)
        folder = _build(model, shape, "cpu-8", artifacts or Path(tmp) / "artifacts")
        config = ModelConfig.from_folder(weights)
        pipe = Pipeline.from_build(folder, read_manifest(folder), weights, config)

        def run(cache: CacheRequest | None):
            return pipe.generate(PROMPT, steps=steps, guidance=5.0, cache=cache)[1]

        calibrate = CacheRequest(kind=MAGCACHE, threshold=0.06, calibrate=True)
        ratios = run(calibrate).cache.mag_ratios
        magcache = CacheRequest(kind=MAGCACHE, threshold=0.06, mag_ratios=ratios)
        run(None)  # warm both paths once before timing
        uncached, cached, skipped, loads = [], [], None, []
        for _ in range(repeats):
            loads.append(record.host_load())
            uncached.append(run(None).phases["denoise"])
            report = run(magcache)
            cached.append(report.phases["denoise"])
            skipped = report.cache.skipped_steps
    ratio = statistics.median(uncached) / statistics.median(cached)
    return {
        "model": model, "shape": " ".join(shape), "target": "cpu-8", "steps": steps,
        "cache": "magcache threshold 0.06, max_skip 3, retention 0.2, ratios from our calibrate",
        "calibrated_ratios": list(ratios["transformer"]),
        "skipped_steps": skipped,
        "denoise_seconds_uncached": uncached, "denoise_seconds_magcache": cached,
        "host_load": loads,
        "uncached": record.spread(uncached, 2), "magcache": record.spread(cached, 2),
        "speedup_median": round(ratio, 3),
        "speedup_per_round": record.spread([u / c for u, c in zip(uncached, cached, strict=True)]),
    }  # fmt: skip


def deviceless(model: str, res: str, frames: int, steps: int) -> dict:
    """Full vs cached step FLOPs of a tpu-v6e-8 `--step-cache` build (the 14B at 720p), and
    MagCache's transformer work per video with the shipped Wan 2.1 14B ratios. Only the two
    step programs are planned, compiled and given their manifest entries as `aot build
    --step-cache` does (aot.building.entries.program_entry): the build's others, its VAE decode
    the longest compile, decide no figure here."""
    from aot import targets

    target = targets.parse_target("tpu-v6e-8")
    targets.prepare_environment(target)
    from aot.building import plan as planner
    from aot.building.entries import program_entry
    from aot.building.lower import compile_lowered, lower_plan
    from runtime.builds.build_options import OPTIONS
    from runtime.generation.step_cache import MagCache, MagCacheSettings, shipped_mag_ratios
    from wan.configs import VideoShape
    from wan.presets import resolve_model

    devices = targets.devices(target)
    width, height = (int(side) for side in res.split("x"))
    options = planner.resolve_options({**{o.name: o.default for o in OPTIONS.values()},
                                       "step_cache": True})  # fmt: skip
    plan = planner.plan_build(model, resolve_model(model), VideoShape(width, height, frames, 1),
                              target, len(devices), **options)  # fmt: skip
    flops, peak_bytes = {}, {}
    with tempfile.TemporaryDirectory() as folder:
        for lowered in lower_plan(plan, only=STEP_PROGRAMS):  # their manifest entries, as built
            compiled, seconds, rss = compile_lowered(lowered, lowered.program.name, None)
            entry = program_entry(plan, Path(folder), lowered, compiled, seconds, rss)
            flops[entry.name] = entry.flops + entry.kernel_flops
            peak_bytes[entry.name] = entry.memory["peak"]
    full_flops, cached_flops = (flops[n] for n in STEP_PROGRAMS)
    ratios = shipped_mag_ratios("wan2.1-t2v-14b", ["transformer"])
    cache = MagCache(MagCacheSettings(), ratios["transformer"], steps)
    skipped = [i for i in range(steps) if cache.skip_next()]
    peak = targets.peak_flops(target, devices[0].device_kind)
    uncached_seconds = steps * full_flops / peak
    cached_seconds = ((steps - len(skipped)) * full_flops + len(skipped) * cached_flops) / peak
    return {
        "model": model, "shape": f"--res {res} --frames {frames} --batch 1", "target": target.name,
        "steps": steps, "full_step_tflop_per_device": round(full_flops / 1e12, 3),
        "cached_step_tflop_per_device": round(cached_flops / 1e12, 4),
        "peak_tflops_per_device": round(peak / 1e12, 1),
        "skipped_steps_shipped_ratios": list(skipped),
        "transformer_seconds_lower_bound_uncached": round(uncached_seconds, 2),
        "transformer_seconds_lower_bound_magcache": round(cached_seconds, 2),
        "work_ratio": round(uncached_seconds / cached_seconds, 3),
        "peak_memory_per_device_gib": {
            n: round(peak_bytes[n] / 2**30, 2) for n in STEP_PROGRAMS
        },
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--part", choices=["measured", "deviceless"], required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", help="the preset (default: the part's, DEFAULTS)")
    parser.add_argument("--res", help="WxH (default: the part's)")
    parser.add_argument("--frames", type=int, help="(default: the part's)")
    parser.add_argument("--steps", type=int, help="(default: the part's)")
    parser.add_argument("--weights", type=Path, help="measured: weights of the preset")
    parser.add_argument(
        "--artifacts", type=Path, help="measured: the folder to build into (default: a scratch one)"
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    defaults = DEFAULTS[args.part]
    model, res, frames, steps = (
        given if given is not None else default
        for given, default in zip(
            (args.model, args.res, args.frames, args.steps), defaults, strict=True
        )
    )
    shape = ["--res", res, "--frames", str(frames), "--batch", "1"]
    if args.part == "measured":
        row = measured(model, shape, args.repeats, steps, args.weights, args.artifacts)
    else:
        row = deviceless(model, res, frames, steps)
    command = shlex.join(["python", "bench/step_cache.py", *sys.argv[1:]])
    record.save(args.out, {"command": command, **row})
    print(row)


if __name__ == "__main__":
    main()
