"""The device loop: each build variant run with `runtime run` on the accelerator attached, a fresh
process per run (what a user starts), and the table of what the runs measured.

Per variant (a build folder of --artifacts, and the `runtime run` options it runs with): s/step
(median and range over every step of --runs runs), the build's step lower bound beside it and their ratio
(the fraction of the device's peak the step reaches), process start to first step and to the
video, each phase's seconds, the device's peak memory (`memory_stats`, as the run's report
records it) beside the build's prediction (`aot inspect`'s resident peak), and compilations.

    python bench/chip.py --artifacts ART --weights W --res 832x480 --frames 81 --steps 4 \
        --variant dense=BUILD_FOLDER_NAME --variant "nocfg=OTHER --guidance 1" --out DIR

Builds are made on any host for the device (`aot build --target tpu-v5e:1x1`) and copied to
it with the weights (docs/benchmarks.md, "On a TPU v5e chip"). Writes DIR/chip.json (every
run's report) and prints the markdown table (`--markdown DIR/chip.json` prints it again).
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
from pathlib import Path

import record  # bench/record.py, beside this script

from runtime.builds.artifact import read_manifest
from wan import interface, sparse_attention

RUNTIME = [sys.executable, "-c", "import sys; from runtime.cli import main; main()"]
PROMPT = "a red fox running through fresh snow at dawn, cinematic"
GiB = float(1 << 30)


def run_variant(args: argparse.Namespace, name: str, build: str, flags: list[str]) -> dict:
    """--runs fresh `runtime run` processes of one variant: their reports and the summary."""
    folder = args.artifacts / build
    manifest = read_manifest(folder)
    reports = []
    scratch = Path(tempfile.mkdtemp())  # the videos and reports: the reports go in chip.json
    for index in range(args.runs):
        report = scratch / f"{name}_{index}.json"
        command = [
            *RUNTIME, "run", "--artifacts", str(args.artifacts), "--build", build,
            "--weights", str(args.weights), "--res", args.res, "--frames", str(args.frames),
            "--steps", str(args.steps), "--prompt", PROMPT, "--seed", str(index),
            "--out", str(scratch / f"{name}.mp4"), "--report", str(report), *flags,
        ]  # fmt: skip
        started = time.time()
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
        if done.returncode:
            tail = (done.stdout + done.stderr)[-2000:]
            print(f"{name} run {index}: exit {done.returncode}\n{tail}", flush=True)
            return {"variant": name, "build": build, "flags": flags, "failed": tail}
        reports.append(json.loads(report.read_text()))
        print(f"{name} run {index}: {time.time() - started:.1f} s", flush=True)
    sparse = manifest.key.option("sparse_attention") != sparse_attention.NONE
    program = interface.sparse_variant(manifest.key.step_program) if sparse else None
    row = {"variant": name, "build": build, "flags": flags, "steps": args.steps}
    return summarize({**row, "step_lower_bound": manifest.step_lower_bound(program)}, reports)


def summarize(row: dict, reports: list[dict]) -> dict:
    """A variant's figures from its runs' reports: s/step over every step, and over the steps
    that ran whole (a step cache's skipped ones left out) against the lower bound."""
    skipped = [set(r["cache"]["skipped_steps"]) for r in reports]
    every = [t for r in reports for t in r["step_seconds"]]
    whole = [t for r, s in zip(reports, skipped, strict=True)
             for i, t in enumerate(r["step_seconds"]) if i not in s]  # fmt: skip
    bound, memory = row["step_lower_bound"], [r["memory"] for r in reports]
    return {
        **row,
        "seconds_per_step": record.spread(every),
        "whole_step_seconds": record.spread(whole),
        "skipped_steps": sum(len(s) for s in skipped) / len(reports),
        "fraction_of_peak": None if bound is None else round(bound / statistics.median(whole), 3),
        "to_first_step": record.spread(
            [r["seconds_from_process_start_to_first_step"] for r in reports]
        ),
        "to_video": record.spread([r["seconds_from_process_start_to_video"] for r in reports]),
        "phases": {
            phase: record.spread([r["phases"][phase] for r in reports])
            for phase in reports[0]["phases"]
        },
        "device_peak_gib": record.spread([m["device_peak_bytes"] / GiB for m in memory])
        if all(m["device_peak_bytes"] for m in memory)
        else None,
        "predicted_peak_gib": round(memory[0]["predicted_peak_bytes"] / GiB, 3),
        "placement": memory[0]["placement"],
        "compile_count": max(r["compile_count"] for r in reports),
        "reports": reports,
    }


def markdown(rows: list[dict]) -> str:
    """The table docs/benchmarks.md quotes: one row per variant."""
    lines = [
        "| variant | s/step | skipped steps | lower bound | of peak | to first step s | to video s | device peak GiB | predicted GiB | compiles |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    rows = [r if "failed" in r else summarize(r, r["reports"]) for r in rows]
    for r in rows:
        if "failed" in r:
            lines.append(f"| {r['variant']} | failed: {r['failed'].splitlines()[-1][:80]} ||||||||")
            continue
        bound = "-" if r["step_lower_bound"] is None else f"{r['step_lower_bound']:.3f}"
        share = "-" if r["fraction_of_peak"] is None else f"{100 * r['fraction_of_peak']:.0f}%"
        lines.append(
            f"| {r['variant']} | {record.cell(r['seconds_per_step'], 3)} | {r['skipped_steps']:g} | "
            f"{bound} | {share} | "
            f"{record.cell(r['to_first_step'])} | {record.cell(r['to_video'])} | "
            f"{record.cell(r['device_peak_gib'])} | {r['predicted_peak_gib']:.2f} | {r['compile_count']} |"
        )
    phases = sorted({p for r in rows if "phases" in r for p in r["phases"]})
    lines += ["", "| variant | " + " | ".join(phases) + " |", "|---" * (len(phases) + 1) + "|"]
    for r in rows:
        if "phases" in r:
            cells = [record.cell(r["phases"].get(p)) for p in phases]
            lines.append(f"| {r['variant']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = record.sitting_parser(__doc__)
    parser.add_argument("--artifacts", type=Path)
    parser.add_argument("--weights", type=Path)
    parser.add_argument("--res", default="832x480")
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=BUILD [RUN OPTIONS]",
        help="a build folder of --artifacts and the `runtime run` options it runs with",
    )
    args = parser.parse_args()
    if record.printed_kept(args, markdown):
        return
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for spec in args.variant:
        name, _, rest = spec.partition("=")
        build, *flags = shlex.split(rest)
        rows.append(run_variant(args, name, build, flags))
        record.save_sitting(args.out / "chip.json", rows)
    print(markdown(rows))


if __name__ == "__main__":
    main()
