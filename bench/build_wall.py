"""Wall time, peak RSS and per-program compile seconds of whole `aot build`s, variants side by
side: each run is a fresh `aot build --json` into an empty folder (nothing reused), the variants
alternate within each round so the host's load hits them alike, and the host's 1-minute load
average is recorded at each run. Medians and ranges over the rounds.

    python bench/build_wall.py --rounds 3 --variant "4 MiB decode=" \\
        --variant "compiler default=--vae-vmem default" --out bench/results/build_wall_14b.json \\
        -- --model wan2.1-t2v-14b --res 720x1280 --frames 81 --batch 8 --target tpu-v6e-8
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import record  # bench/record.py, beside this script

ROOT = Path(__file__).resolve().parents[1]
AOT = Path(sys.executable).with_name("aot")


def measure(options: list[str]) -> dict:
    """One `aot build` with `options` into a fresh folder: wall, the process's peak RSS, each
    program's compile seconds (from the build's JSON), the load when it started."""
    load = record.host_load()
    with tempfile.TemporaryDirectory(prefix="build_wall-") as out:
        command = [str(AOT), "build", *options, "--jobs", "1", "--json", "--out", out]
        start = time.perf_counter()
        child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        stdout = child.stdout.read()
        _, status, usage = os.wait4(child.pid, 0)
        seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"aot build {shlex.join(options)} failed")
    (build,) = json.loads(stdout)
    programs = build["manifest"]["programs"]
    return {
        "wall_seconds": round(seconds, 1),
        "peak_rss_gib": round(usage.ru_maxrss * 1024 / 2**30, 2),  # ru_maxrss: KiB on Linux
        "compile_seconds": {name: round(p["compile_seconds"], 1) for name, p in programs.items()},
        "host_load": load,
    }


def summary(runs: list[dict]) -> dict:
    programs = runs[0]["compile_seconds"]
    return {
        "wall_seconds": record.spread([r["wall_seconds"] for r in runs], 1),
        "peak_rss_gib": record.spread([r["peak_rss_gib"] for r in runs], 2),
        "compile_seconds": {
            name: record.spread([r["compile_seconds"][name] for r in runs], 1) for name in programs
        },
        "host_load": [r["host_load"] for r in runs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--variant", action="append", required=True, metavar="NAME=OPTIONS",
        help="a name and the aot build options it adds (may be empty)",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/build_wall.json")
    parser.add_argument("build", nargs="+", help="the aot build options every variant has")
    args = parser.parse_args()
    variants = dict(v.split("=", 1) for v in args.variant)
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, extra in variants.items():
            runs[name].append(measure([*args.build, *shlex.split(extra)]))
            print(name, json.dumps(runs[name][-1]), flush=True)
    summaries = {name: summary(rs) for name, rs in runs.items()}
    first = next(iter(variants))
    base = summaries[first]["wall_seconds"]["median"]
    record.save(args.out, {
        "command": shlex.join(["python", "bench/build_wall.py", *sys.argv[1:]]),
        "runs": runs,
        "summary": summaries,
        f"wall_ratio_to_{first}": {
            name: round(s["wall_seconds"]["median"] / base, 3) for name, s in summaries.items()
        },
    })  # fmt: skip
    print(json.dumps(summaries, indent=1))


if __name__ == "__main__":
    main()
