"""Wall time of one `aot build` matrix at several --jobs, side by side.

Each run is a fresh `aot build ... --jobs N --json` into an empty folder; the values of --jobs
alternate within each repeat so machine noise hits them alike. Recorded per run: wall seconds
and the programs compiled and reused (from the build's JSON; the same at every --jobs).

    python bench/build_jobs.py --jobs 1 --jobs 2 --repeats 2 -- --model tiny --res 192x320 \\
        --res 320x192 --frames 9 --batch 1 --batch 2 --target cpu-8
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import record  # bench/record.py, beside this script

ROOT = Path(__file__).resolve().parents[1]

AOT = Path(sys.executable).with_name("aot")


def measure(jobs: int, matrix: list[str]) -> dict:
    """One `aot build` of `matrix` with --jobs `jobs` into a fresh folder (and the host's load
    when it started)."""
    load = record.host_load()
    with tempfile.TemporaryDirectory(prefix="build_jobs-") as out:
        command = [str(AOT), "build", *matrix, "--jobs", str(jobs), "--json", "--out", out]
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True)
        seconds = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"aot build failed: {done.stderr.strip().splitlines()[-1]}")
    statuses = Counter(
        status for build in json.loads(done.stdout) for status in build["programs"].values()
    )
    return {
        "wall_seconds": round(seconds, 2),
        "compiled": statuses["compiled"],
        "reused": statuses["reused"],
        "host_load": load,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, action="append", required=True)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/build_jobs.json")
    parser.add_argument("matrix", nargs="+", help="aot build options, after --")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {str(jobs): [] for jobs in args.jobs}
    for _ in range(args.repeats):
        for jobs in args.jobs:
            runs[str(jobs)].append(measure(jobs, args.matrix))
            print(jobs, runs[str(jobs)][-1], flush=True)
    median = {jobs: statistics.median(r["wall_seconds"] for r in rs) for jobs, rs in runs.items()}
    first = str(args.jobs[0])
    record.save(args.out, {
        "command": shlex.join(["python", "bench/build_jobs.py", *sys.argv[1:]]),
        "runs": runs,
        "median_wall_seconds": median,
        "wall_seconds": {j: record.spread([r["wall_seconds"] for r in rs], 1) for j, rs in runs.items()},
        f"ratio_to_jobs_{first}": {j: round(s / median[first], 3) for j, s in median.items()},
    })  # fmt: skip
    print(json.dumps(median))


if __name__ == "__main__":
    main()
