"""Cold start, side by side: time from process start to the first denoise step and to the
finished video, for
  (A) `runtime run` from `aot build` artifacts,
  (B) the same pipeline under plain jax.jit in a fresh process, no cache (bench/jit_run.py),
  (C) (B) with JAX's persistent compilation cache warm.
Runs alternate A, B, C, A, B, C, ... so that machine noise hits all three alike; the result is
medians [ranges], the ratios A/B and A/C of the medians and the range of each round's own
ratio, and the host's 1-minute load at each round. First step is counted from the OS's start
of each process (the report's seconds_from_process_start_to_first_step). The floor of A's first step, measured
in the same run: a bare `python -c "import jax; jax.devices()"`, `cat` of the weight files, and
the programs' own seconds to the first step (text_encode + kv_cache, from A's report).

    python bench/cold_start.py --model tiny --res 192x320 --frames 9 --steps 3 --repeats 3

`--weights` loads weights already written (default: random weights of --model, written into the
scratch folder; tests/test_bench.py passes its session's tiny weights), `--artifacts` builds
into a folder that may already hold the build (up to date, it is not compiled again; default:
the scratch folder).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import fixtures  # bench/fixtures.py, beside this script
import record  # bench/record.py, beside this script

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SUMMARY = ("spread", "floor", "ratio_first_step", "A_first_step_over_floor", "ratio_total")


def timed(cmd: list[str], report: Path, env: dict | None = None) -> dict[str, float]:
    """Run `cmd` in a fresh process; seconds from its start to the first step and to the end,
    and the programs' own seconds to the first step."""
    start = time.time()
    subprocess.run(cmd, check=True, capture_output=True, env=env)
    end = time.time()
    r = json.loads(report.read_text())
    return {
        "first_step": r["seconds_from_process_start_to_first_step"],
        "total": end - start,
        "programs_to_first_step": r["phases"]["text_encode"] + r["phases"]["kv_cache"],
        **{f"phase_{k}": v for k, v in r["phases"].items()},
    }


def wall(cmd: list[str], env: dict | None = None) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, env=env)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--res", default="192x320")
    parser.add_argument("--frames", type=int, default=9)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--target", default="cpu-8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--weights", type=Path, help="weights of --model (default: random ones)")
    parser.add_argument(
        "--artifacts", type=Path, help="the folder to build into (default: a scratch folder)"
    )
    parser.add_argument(
        "--out", type=Path, help="results JSON (default bench/results/cold_start_<model>.json)"
    )
    args = parser.parse_args()
    out = args.out or ROOT / "bench" / "results" / f"cold_start_{args.model}.json"
    shape = ["--res", args.res, "--frames", str(args.frames), "--batch", "1"]

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        artifacts, cache = args.artifacts or tmp / "artifacts", tmp / "jax-cache"
        weights = fixtures.random_weights(args.model, tmp / "weights", args.weights)
        (build,) = fixtures.build("--model", args.model, *shape, "--target", args.target,
                                  "--out", artifacts)  # fmt: skip
        compile_seconds = sum(p["compile_seconds"] for p in build["manifest"]["programs"].values())
        report = tmp / "report.json"
        variants = {
            "A_runtime": ([str(BIN / "runtime"), "run", "--artifacts", str(artifacts), "--weights",
                           str(weights), *shape, "--prompt", "a red cat running in the rain",
                           "--steps", str(args.steps), "--out", str(tmp / "v.mp4"),
                           "--report", str(report)], None),
            "B_jit": ([str(BIN / "python"), str(ROOT / "bench" / "jit_run.py"), "--model", args.model,
                       "--weights", str(weights), *shape, "--steps", str(args.steps),
                       "--target", args.target, "--report", str(report)], None),
        }  # fmt: skip
        variants["C_jit_cache"] = (
            variants["B_jit"][0],
            {**os.environ, "BENCH_JAX_CACHE": str(cache)},
        )
        warm_cmd, warm_env = variants["C_jit_cache"]
        timed(warm_cmd, report, warm_env)  # fills the persistent cache
        weight_files = sorted(str(f) for f in weights.rglob("*") if f.is_file())
        bare_jax = [str(BIN / "python"), "-c", "import jax; jax.devices()"]
        host = {**os.environ, "JAX_PLATFORMS": "cpu"}
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
        floor_runs: list[dict[str, float]] = []
        loads: list[float] = []
        for _ in range(args.repeats):
            loads.append(record.host_load())
            for name, (cmd, env) in variants.items():
                runs[name].append(timed(cmd, report, env))
                print(name, runs[name][-1], flush=True)
            floor_runs.append({"bare_jax": wall(bare_jax, host), "cat_weights": wall(
                ["sh", "-c", 'cat "$@" > /dev/null', "cat", *weight_files])})  # fmt: skip
            print("floor", floor_runs[-1], flush=True)
        weight_bytes = sum(Path(f).stat().st_size for f in weight_files)

    med = {
        name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()
    }
    floor = {k: statistics.median(r[k] for r in floor_runs) for k in floor_runs[0]}
    floor_spread = {k: record.spread([r[k] for r in floor_runs]) for k in floor_runs[0]}

    def round_ratios(key: str, other: str) -> dict:
        a, b = runs["A_runtime"], runs[other]
        return record.spread([x[key] / y[key] for x, y in zip(a, b, strict=True)])

    floor["programs_to_first_step"] = med["A_runtime"]["programs_to_first_step"]
    floor["first_step"] = sum(floor.values())
    result = {
        "command": "python " + " ".join([f"bench/{Path(__file__).name}", *sys.argv[1:]]),
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores",
        "date": time.strftime("%Y-%m-%d"),
        "model": args.model, "res": args.res, "frames": args.frames, "steps": args.steps,
        "target": args.target, "repeats": args.repeats,
        "aot_build_compile_seconds": round(compile_seconds, 2),
        "host_load": loads,
        "runs": runs,
        "median": med,
        "spread": {
            name: {k: record.spread([r[k] for r in rs], 2) for k in ("first_step", "total")}
            for name, rs in runs.items()
        },
        "ratio_per_round": {
            f"{key} A/{other[0]}": round_ratios(key, other)
            for key in ("first_step", "total") for other in ("B_jit", "C_jit_cache")
        },
        "ratio_first_step": {
            "A/B": med["A_runtime"]["first_step"] / med["B_jit"]["first_step"],
            "A/C": med["A_runtime"]["first_step"] / med["C_jit_cache"]["first_step"],
        },
        "weight_bytes": weight_bytes,
        "floor": floor,
        "floor_spread": floor_spread,
        "A_first_step_over_floor": med["A_runtime"]["first_step"] / floor["first_step"],
        "ratio_total": {
            "A/B": med["A_runtime"]["total"] / med["B_jit"]["total"],
            "A/C": med["A_runtime"]["total"] / med["C_jit_cache"]["total"],
        },
    }  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in SUMMARY}, indent=1))


if __name__ == "__main__":
    main()
