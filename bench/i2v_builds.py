"""Deviceless image-to-video builds of the real presets, each `aot build` alone in a fresh
folder (no program reused from another build), and the text-to-video build beside them.

For each (model, resolution, batch, target): wall seconds of the whole `aot build`, each
program's compile seconds, peak memory per device and peak RSS of the compiling process (from
the manifest), the step's lower bound (its FLOPs at the chip's peak), `aot check`'s verdict
with the default policy, the host's load average when the build started, and the VAE encode's
collectives (portrait and landscape must match).

    python bench/i2v_builds.py --model wan2.1-i2v-14b-720p --res 1280x720 720x1280 \\
        --batches 1 8 --targets tpu-v6e-8 tpu7x-8
    python bench/i2v_builds.py --model wan2.2-i2v-a14b --res 1280x720 --batches 1 \\
        --targets tpu7x-8
    python bench/i2v_builds.py --model wan2.1-i2v-14b-720p wan2.1-t2v-14b --res 720x1280 \\
        --batches 8 --targets tpu-v6e-8 --rounds 2   # I2V against T2V, alternating

Results: bench/results/i2v_builds.json (one row per build and round); `--markdown` prints the
table of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import record  # noqa: E402  (bench/record.py, beside this script)

BIN = Path(sys.executable).parent
GiB = float(1 << 30)
RESULTS = ROOT / "bench" / "results" / "i2v_builds.json"


def build_one(model: str, res: str, batch: int, target: str, frames: int) -> dict:
    """One `aot build` alone in a fresh folder, and `aot check` of it."""
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        built = subprocess.run(
            [str(BIN / "aot"), "build", "--model", model, "--res", res, "--frames", str(frames),
             "--batch", str(batch), "--target", target, "--out", out, "--json"],
            capture_output=True, text=True,
        )  # fmt: skip
        wall = time.perf_counter() - start
        if built.returncode != 0:
            return {"error": built.stderr.strip().splitlines()[-1:]}
        [report] = json.loads(built.stdout)
        checked = subprocess.run(
            [str(BIN / "aot"), "check", report["folder"], "--json"], capture_output=True, text=True
        )
    violations = json.loads(checked.stdout)["violations"] if checked.stdout else []
    verdict = "; ".join(f"{v['program']}: {v['message']}" for v in violations)
    return {"wall_seconds": round(wall, 1), "load_average": round(load, 2),
            "aot_check": verdict or ("pass" if checked.returncode == 0 else checked.stderr.strip()),
            **summary(report["manifest"])}  # fmt: skip


def summary(manifest: dict) -> dict:
    from runtime.builds.artifact import Manifest

    m = Manifest.from_json(manifest)
    return {
        "build": m.key.folder_name(),
        "step_lower_bound_s": m.step_lower_bound(),
        "programs": {
            name: {
                "compile_seconds": round(p.compile_seconds, 1),
                "peak_gib": round(p.memory["peak"] / GiB, 3),
                "peak_rss_gib": round(p.peak_rss_bytes / GiB, 2),
                "collectives": {k: c["count"] for k, c in p.collectives.items() if c["count"]},
            }
            for name, p in m.programs.items()
        },
    }


def markdown(rows: list[dict]) -> str:
    """Per program: peak GiB per device (exact from one build); the last build of each (model,
    res, batch, target). Wall and compile seconds, one build each, stay in the results file:
    `bench/build_wall.py` times builds over alternating rounds."""
    latest = {(r["model"], r["res"], r["batch"], r["target"]): r for r in rows}
    names = ["text_encode", "image_encode", "vae_encode", "kv_cache", "image_kv_cache",
             "denoise_step", "vae_decode"]  # fmt: skip
    lines = [
        "| model | res | B | target | " + " | ".join(names) + " | step lower bound s | aot check |",
        "|---|---|---|---|" + "---|" * len(names) + "---|---|",
    ]
    for r in latest.values():
        if "error" in r:
            lines.append(f"| {r['model']} | {r['res']} | {r['batch']} | {r['target']} | "
                         f"error: {r['error']} |")  # fmt: skip
            continue
        cells = [f"{p['peak_gib']:.2f}" if (p := r["programs"].get(n)) else "-" for n in names]
        bound = r["step_lower_bound_s"]
        lines.append(
            f"| {r['model']} | {r['res']} | {r['batch']} | {r['target']} | "
            + " | ".join(cells)
            + f" | {'-' if bound is None else f'{bound:.2f}'} | {r['aot_check']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", nargs="+", default=["wan2.1-i2v-14b-720p"])
    parser.add_argument("--res", nargs="+", default=["1280x720"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1])
    parser.add_argument("--targets", nargs="+", default=["tpu-v6e-8"])
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--rounds", type=int, default=1, help="alternate the models this often")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--markdown", action="store_true", help="print the table and exit")
    args = parser.parse_args()
    if args.markdown:
        print(markdown(record.rows(args.out)))
        return
    for round_ in range(args.rounds):
        for target in args.targets:
            for res in args.res:
                for batch in args.batches:
                    for model in args.model:  # innermost: the models alternate
                        command = (f"python bench/i2v_builds.py --model {model} --res {res} "
                                   f"--batches {batch} --targets {target} --frames {args.frames}"
                                   + (f"  # round {round_ + 1}" if args.rounds > 1 else ""))  # fmt: skip
                        row = {"command": command, "model": model, "res": res, "batch": batch,
                               "target": target, "round": round_ + 1}  # fmt: skip
                        row |= build_one(model, res, batch, target, args.frames)
                        record.save(args.out, row)
                        print(json.dumps({k: row.get(k) for k in
                                          ("model", "res", "batch", "target", "wall_seconds",
                                           "aot_check", "error")}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
