"""Peak memory per device, compile seconds and peak RSS per program for deviceless builds of
the real presets, from this CPU host. Every build goes through `aot build --json` (one fresh
process per build, so RSS is per build), and builds already present are reused (aot skips an
unchanged key), so the table can be filled in several sittings.

    python bench/memory_table.py --models wan2.1-t2v-14b --targets tpu7x-8 tpu-v6e-8 --batches 1 2 8
    python bench/memory_table.py --models wan2.1-t2v-14b --targets tpu7x-8 --batches 2 8 --vae-spatial 1 8

Results: bench/results/memory_<name>.json (one record per build and program).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
GiB = float(1 << 30)


def build(
    model: str, target: str, batch: int, res: str, frames: int, out: Path, extra: list[str]
) -> dict:
    cmd = [str(BIN / "aot"), "build", "--model", model, "--res", res, "--frames", str(frames),
           "--batch", str(batch), "--target", target, "--out", str(out), "--json", *extra]  # fmt: skip
    command = "aot " + " ".join(cmd[1:])
    start = time.time()
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        return {"command": command, "error": result.stderr.strip().splitlines()[-1:]}
    (entry,) = json.loads(result.stdout)
    m = entry["manifest"]
    return {
        "command": command,
        "wall_seconds": round(time.time() - start, 1),
        "skipped": entry["skipped"],
        "build": Path(entry["folder"]).name,
        "mesh": m["mesh_axes"],
        "vae_mesh": m["vae_mesh_axes"],
        "vae_axis": m["key"]["vae_axis"],
        "hbm_gib": m["hbm_bytes"] / GiB if m["hbm_bytes"] else None,
        "programs": {
            name: {
                "peak_gib": round(p["memory"]["peak"] / GiB, 3),
                "temp_gib": round(p["memory"]["temp"] / GiB, 3),
                "argument_gib": round(p["memory"]["argument"] / GiB, 3),
                "compile_seconds": p["compile_seconds"],
                "peak_rss_gib": round(p["peak_rss_bytes"] / GiB, 2),
                "tflops": round(p["flops"] / 1e12, 3),
                "collectives": {k: v for k, v in p["collectives"].items() if v["count"]},
            }
            for name, p in m["programs"].items()
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=["wan2.1-t2v-14b"])
    parser.add_argument("--targets", nargs="+", default=["tpu7x-8", "tpu-v6e-8"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 2, 8])
    parser.add_argument("--res", default="1280x720")
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--vae-spatial", nargs="*", default=["auto"], help="auto and/or N values")
    parser.add_argument("--artifacts", type=Path, default=ROOT / "bench" / "artifacts")
    parser.add_argument("--name", default="table")
    args = parser.parse_args()
    out = ROOT / "bench" / "results" / f"memory_{args.name}.json"
    records = json.loads(out.read_text())["builds"] if out.exists() else []
    for model, target, batch, spatial in itertools.product(
        args.models, args.targets, args.batches, args.vae_spatial
    ):
        record = build(
            model, target, batch, args.res, args.frames, args.artifacts, ["--vae-spatial", spatial]
        )
        record.update(model=model, target=target, batch=batch, vae_spatial=spatial)
        records = [r for r in records if r["command"] != record["command"]] + [record]
        print(json.dumps(record), flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({
            "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores",
            "date": time.strftime("%Y-%m-%d"),
            "builds": records,
        }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
