"""Cold start, side by side: time from process start to the first denoise step and to the
finished video, for
  (A) `runtime run` from `aot build` artifacts,
  (B) the same pipeline under plain jax.jit in a fresh process, no cache (bench/jit_run.py),
  (C) (B) with JAX's persistent compilation cache warm.
Runs alternate A, B, C, A, B, C, ... so that machine noise hits all three alike; the result is
medians and the ratios A/B and A/C.

    python bench/cold_start.py --model tiny --res 192x320 --frames 9 --steps 3 --repeats 3
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

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def timed(cmd: list[str], report: Path, env: dict | None = None) -> dict[str, float]:
    """Run `cmd` in a fresh process; seconds from its start to the first step and to the end."""
    start = time.time()
    subprocess.run(cmd, check=True, capture_output=True, env=env)
    end = time.time()
    r = json.loads(report.read_text())
    return {
        "first_step": r["started_at"] + r["seconds_to_first_step"] - start,
        "total": end - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--res", default="192x320")
    parser.add_argument("--frames", type=int, default=9)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--target", default="cpu-8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--out", type=Path, help="results JSON (default bench/results/cold_start_<model>.json)"
    )
    args = parser.parse_args()
    out = args.out or ROOT / "bench" / "results" / f"cold_start_{args.model}.json"
    shape = ["--res", args.res, "--frames", str(args.frames), "--batch", "1"]

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        weights, artifacts, cache = tmp / "weights", tmp / "artifacts", tmp / "jax-cache"
        subprocess.run([str(BIN / "python"), "-m", "wan.random_weights", "--model", args.model,
                        "--out", str(weights)], check=True, capture_output=True)  # fmt: skip
        build = subprocess.run([str(BIN / "aot"), "build", "--model", args.model, *shape,
                                "--target", args.target, "--out", str(artifacts), "--json"],
                               check=True, capture_output=True, text=True)  # fmt: skip
        compile_seconds = sum(
            p["compile_seconds"]
            for p in json.loads(build.stdout)[0]["manifest"]["programs"].values()
        )
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
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
        for _ in range(args.repeats):
            for name, (cmd, env) in variants.items():
                runs[name].append(timed(cmd, report, env))
                print(name, runs[name][-1], flush=True)

    med = {
        name: {k: statistics.median(r[k] for r in rs) for k in ("first_step", "total")}
        for name, rs in runs.items()
    }
    result = {
        "command": "python " + " ".join([f"bench/{Path(__file__).name}", *sys.argv[1:]]),
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores",
        "date": time.strftime("%Y-%m-%d"),
        "model": args.model, "res": args.res, "frames": args.frames, "steps": args.steps,
        "target": args.target, "repeats": args.repeats,
        "aot_build_compile_seconds": round(compile_seconds, 2),
        "runs": runs,
        "median": med,
        "ratio_first_step": {
            "A/B": med["A_runtime"]["first_step"] / med["B_jit"]["first_step"],
            "A/C": med["A_runtime"]["first_step"] / med["C_jit_cache"]["first_step"],
        },
        "ratio_total": {
            "A/B": med["A_runtime"]["total"] / med["B_jit"]["total"],
            "A/C": med["A_runtime"]["total"] / med["C_jit_cache"]["total"],
        },
    }  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(
        json.dumps({k: result[k] for k in ("median", "ratio_first_step", "ratio_total")}, indent=1)
    )


if __name__ == "__main__":
    main()
