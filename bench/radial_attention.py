"""Radial attention and 8-bit attention at a real shape, from deviceless builds that hold them:
each row of `--builds` (bench/memory_table.py's, one command each) compiled the dense step and
`radial_step` of a `--sparse-attention radial` build, at some splash blocks, with or without
`--attention-quant` and `--quant` (8-bit Linear layers). Per row: radial_step's attention
density and self-attention FLOPs per device as built, the two steps' lower bounds, and the
run's: the build's dense steps first (its setting: 12 of 50), then radial_step; against today's
dense bf16 step for every step, and beside MagCache's shipped ratios (bench/step_cache.py's
skipped steps, the cached step's near-zero work counted as zero).

    python bench/radial_attention.py --targets tpu-v6e-8 tpu7x-8 --markdown

A step's lower bound: its FLOPs per device at the chip's rates, the 8-bit part (8-bit Linear
dots counted in the HLO, the 8-bit attention kernel's Q K^T, and P V in fp8) at the 8-bit rate,
the rest at bf16's (runtime.builds.artifact.Manifest.step_lower_bound, from the row's fields).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import record  # bench/record.py, beside this script

from wan.sparse_attention import parse

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def step_seconds(program: dict, row: dict) -> float:
    """A step program's lower bound (s) from a memory_table row."""
    eight = program.get("eight_bit_tflops", 0) + program.get("eight_bit_kernel_tflops", 0)
    total = program["tflops"] + program["kernel_tflops"]
    return (total - eight) / row["peak_tflops"] + eight / (
        row["peak_8bit_tops"] or row["peak_tflops"]
    )


def levers(row: dict) -> str:
    named = ["radial"]
    if row.get("attention_quant", "none") != "none":
        named.append(f"{row['attention_quant']} attention")
    if row.get("quant", "none") != "none":
        named.append(f"{row['quant']} Linear")
    return " + ".join(named)


def magcache_skips(path: Path) -> tuple[int, int]:
    """(steps skipped, steps) of the shipped ratios' run (bench/step_cache.py --part deviceless)."""
    for row in record.rows(path):
        if "skipped_steps_shipped_ratios" in row:
            return len(row["skipped_steps_shipped_ratios"]), row["steps"]
    raise SystemExit(
        f"{path}: no deviceless MagCache row (run bench/step_cache.py --part deviceless)"
    )


def table(args: argparse.Namespace) -> list[dict]:
    rows = [
        r for r in record.rows(args.builds)
        if "programs" in r and r["model"] == args.model and r["target"] in args.targets
        and r["frames"] == args.frames and r["batch"] == args.batch
        and "radial_step" in r["programs"]
    ]  # fmt: skip
    if not rows:
        raise SystemExit(f"{args.builds}: no radial builds of {args.model} on {args.targets}")
    skipped, cache_steps = magcache_skips(args.step_cache_from)
    out = []
    for row in rows:
        dense_bf16 = [
            r for r in rows
            if r["target"] == row["target"] and r.get("quant", "none") == "none"
            and r.get("attention_quant", "none") == "none"
        ]  # fmt: skip
        if not dense_bf16:
            raise SystemExit(f"no full-precision radial build of {row['target']} to compare with")
        today = step_seconds(dense_bf16[0]["programs"]["denoise_step"], dense_bf16[0])
        settings = parse(row["sparse_attention"])
        dense, radial = (
            step_seconds(row["programs"][p], row) for p in ("denoise_step", "radial_step")
        )
        steps, first = args.steps, min(settings.dense_steps, args.steps)
        run = first * dense + (steps - first) * radial
        step = row["programs"]["radial_step"]
        out.append({
            "target": row["target"], "res": row["res"], "attention": row["attention"],
            "context_parallel": row["context_parallel"], "levers": levers(row),
            "sparse_attention": row["sparse_attention"],
            "attention_density": step["attention_density"],
            "self_attention_tflops_dense": step["self_attention_tflops_dense"],
            "self_attention_tflops": step["self_attention_tflops"],
            "dense_step_s": dense, "radial_step_s": radial, "today_step_s": today,
            "run_s": run, "today_run_s": steps * today,
            "run_ratio_to_today": round(run / (steps * today), 4),
            "magcache_run_s": (cache_steps - skipped) * today * steps / cache_steps,
            "build_command": row["command"],
        })  # fmt: skip
    return sorted(out, key=lambda r: (r["target"], r["res"], r["levers"], r["attention"]))


def markdown(found: list[dict], steps: int) -> str:
    lines = [
        "| target | video | kernel blocks | levers | density | self-attention TFLOP/device, dense -> built | step lower bound, dense step / radial_step | "
        f"{steps} steps (dense first) | / today's dense bf16 run | MagCache's run |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in found:
        lines.append(
            f"| {r['target']} | {r['res']} | {r['attention']} | {r['levers']} | "
            f"{r['attention_density']:.4f} | {r['self_attention_tflops_dense']:,.1f} -> "
            f"{r['self_attention_tflops']:,.1f} | {r['dense_step_s']:.3f} / {r['radial_step_s']:.3f} s | "
            f"{r['run_s']:.2f} s | {r['run_ratio_to_today']:.3f} (of {r['today_run_s']:.2f} s) | "
            f"{r['magcache_run_s']:.2f} s |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="wan2.1-t2v-14b")
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--targets", nargs="+", default=["tpu-v6e-8", "tpu7x-8"])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--builds", type=Path, default=RESULTS / "radial_builds.json")
    parser.add_argument("--step-cache-from", type=Path, default=RESULTS / "step_cache.json")
    parser.add_argument("--out", type=Path, default=RESULTS / "radial_attention.json")
    parser.add_argument("--markdown", action="store_true", help="also print the table")
    args = parser.parse_args()
    found = table(args)
    record.save(args.out, {
        "command": shlex.join(["python", "bench/radial_attention.py", *sys.argv[1:]]),
        "model": args.model, "frames": args.frames, "batch": args.batch, "steps": args.steps,
        "builds": found,
    })  # fmt: skip
    print(markdown(found, args.steps) if args.markdown else json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
