"""Peak memory per device, compile seconds and peak RSS per program for deviceless builds of
the real presets at 720p/81 frames, from this CPU host: the programs `aot build` makes, with its
default mesh per (model, target, batch).

The presets share one VAE, so its decode (by far the longest compile) is compiled once per
(target, batch), with the first model's plan, and its row is shared by the others. Every
(model, target, batch) compiles in a fresh process (RSS per build); `--jobs 2` runs two at
once (compile seconds then include the contention). Records already in the results file are
kept, so the table can be filled in several sittings.

    python bench/memory_table.py --models wan2.1-t2v-1.3b wan2.1-t2v-14b wan2.2-t2v-a14b \\
        --targets tpu7x-8 tpu-v6e-8 --batches 1 2 8 --jobs 2

Results: bench/results/memory_table.json (one row per model, target, batch).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import record  # noqa: E402  (bench/record.py, beside this script)

GiB = float(1 << 30)
TRANSFORMER_PROGRAMS = ["text_encode", "kv_cache", "denoise_step"]


def compile_one(model: str, target_name: str, batch: int, res: str, frames: int,
                only: list[str]) -> dict:  # fmt: skip
    """Runs in its own process: plan as `aot build` does, compile `only`, measure."""
    from aot import targets

    target = targets.parse_target(target_name)
    targets.prepare_environment(target)
    from aot import hlo
    from aot.build import compile_plan, memory_stats, plan_build
    from wan.presets import resolve_model
    from wan.programs import VideoShape

    config = resolve_model(model)
    width, height = (int(v) for v in res.split("x"))
    num_devices = len(targets.devices(target))
    plan = plan_build(model, config, VideoShape(width, height, frames, batch), target, num_devices)
    programs = {}
    for program, compiled, _, seconds, rss in compile_plan(plan, only=only):
        module = hlo.parse(compiled.as_text())
        memory = memory_stats(compiled)
        programs[program.name] = {
            "peak_gib": round(memory["peak"] / GiB, 3),
            "argument_gib": round(memory["argument"] / GiB, 3),
            "temp_gib": round(memory["temp"] / GiB, 3),
            "compile_seconds": round(seconds, 1),
            "peak_rss_gib": round(rss / GiB, 2),
            "tflops": round(hlo.flops(module) / 1e12, 3),
            "collectives": {
                k: v["count"] for k, v in hlo.collective_summary(module).items() if v["count"]
            },
        }
    return {
        "build": plan.key.folder_name(),
        "mesh": dict(plan.mesh.items()),
        "vae_mesh": list(plan.vae_mesh),
        "vae_axis": plan.vae_layout.axis,
        "hbm_gib": target.hbm_bytes / GiB if target.hbm_bytes else None,
        "programs": programs,
    }


def run_one(model: str, target: str, batch: int, args: argparse.Namespace, only: list[str]) -> dict:
    cmd = [sys.executable, __file__, "--one", model, target, str(batch), "--res", args.res,
           "--frames", str(args.frames), "--only", *only]  # fmt: skip
    start = time.time()
    result = subprocess.run(cmd, capture_output=True, text=True)
    command = (f"python bench/memory_table.py --models {model} --targets {target} --batches "
               f"{batch} --res {args.res} --frames {args.frames}")  # fmt: skip
    row = {"model": model, "target": target, "batch": batch, "command": command}
    if result.returncode != 0:
        return row | {"error": result.stderr.strip().splitlines()[-1:]}
    return row | {"wall_seconds": round(time.time() - start, 1)} | json.loads(result.stdout)


def markdown(rows: list[dict]) -> str:
    """Per program: peak GiB per device / compile seconds / peak RSS GiB of the compiling
    process; one row per (model, target, batch)."""
    names = [*TRANSFORMER_PROGRAMS, "vae_decode"]
    vae = {(r["target"], r["batch"]): r["programs"]["vae_decode"]
           for r in rows if "vae_decode" in r.get("programs", {})}  # fmt: skip
    lines = [
        "| model | target (HBM GiB) | B | mesh | VAE mesh | " + " | ".join(names) + " |",
        "|---|---|---|---|---|" + "---|" * len(names),
    ]
    for r in sorted(rows, key=lambda r: (r["model"], r["target"], r["batch"])):
        if "programs" not in r:
            lines.append(f"| {r['model']} | {r['target']} | {r['batch']} | error: {r['error']} |")
            continue
        programs = {**r["programs"], "vae_decode": vae.get((r["target"], r["batch"]))}
        cells = [
            f"{p['peak_gib']:.2f} / {p['compile_seconds']:.0f} / {p['peak_rss_gib']:.1f}"
            if p
            else "not run"
            for p in (programs.get(n) for n in names)
        ]
        mesh = ",".join(f"{k}={v}" for k, v in r["mesh"].items() if v > 1)
        hbm = f" ({r['hbm_gib']:.0f})" if r["hbm_gib"] else ""
        lines.append(
            f"| {r['model']} | {r['target']}{hbm} | {r['batch']} | {mesh} | "
            f"{tuple(r['vae_mesh'])} {r['vae_axis']} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=["wan2.1-t2v-14b"])
    parser.add_argument("--targets", nargs="+", default=["tpu7x-8", "tpu-v6e-8"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 2, 8])
    parser.add_argument("--res", default="1280x720")
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results" / "memory_table.json"
    )
    parser.add_argument(
        "--one", nargs=3, metavar=("MODEL", "TARGET", "BATCH"), help=argparse.SUPPRESS
    )
    parser.add_argument("--only", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--markdown", action="store_true", help="print the results as a table")
    args = parser.parse_args()
    if args.markdown:
        print(markdown(record.rows(args.out)))
        return
    if args.one:
        model, target, batch = args.one
        print(json.dumps(compile_one(model, target, int(batch), args.res, args.frames, args.only)))
        return

    from wan.presets import resolve_model

    first = args.models[0]
    for model in args.models[1:]:
        if resolve_model(model).vae != resolve_model(first).vae:
            parser.error(f"{model} has another VAE than {first}: run it separately")
    keys = ("model", "target", "batch", "res", "frames")
    done = {tuple(r[k] for k in keys) for r in record.rows(args.out) if "error" not in r}
    jobs = [
        (m, t, b, TRANSFORMER_PROGRAMS + (["vae_decode"] if m == first else []))
        for t in args.targets for b in args.batches for m in args.models
        if (m, t, b, args.res, args.frames) not in done
    ]  # fmt: skip
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(run_one, m, t, b, args, only) for m, t, b, only in jobs]
        for future in concurrent.futures.as_completed(futures):
            row = future.result() | {"res": args.res, "frames": args.frames}
            if "programs" in row and "vae_decode" not in row["programs"]:
                row["vae_decode_from"] = first  # the same VAE program: see the docstring
            print(json.dumps(row), flush=True)
            record.save(args.out, row)


if __name__ == "__main__":
    main()
