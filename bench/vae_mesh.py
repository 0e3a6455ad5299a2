"""The VAE decode alone, side by side on one target: one video per device, mesh (N, 1), against
the spatially sharded (1, N), at several batches (B=8 720p on tpu7x-8, peak HBM
68.12 -> 24.32 GiB). Deviceless compile of the real VAE; peak bytes per device, compile seconds
and collectives per variant.

    python bench/vae_mesh.py --target tpu7x-8 --res 1280x720 --frames 81 --batches 2 8

`--meshes` picks the variants (default both); rows already in the results file for other
(batch, mesh) pairs are kept, so the comparison can be filled in several sittings.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import record  # noqa: E402  (bench/record.py, beside this script)

from aot import targets  # noqa: E402

GiB = float(1 << 30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target", default="tpu7x-8")
    parser.add_argument("--model", default="wan2.1-t2v-14b")
    parser.add_argument("--res", default="1280x720")
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--batches", nargs="+", type=int, default=[2, 8])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "vae_mesh.json")
    parser.add_argument(
        "--meshes", nargs="+", choices=["N,1", "1,N"], default=["N,1", "1,N"],
        help="one video per device (N,1) and/or spatially sharded (1,N)",
    )  # fmt: skip
    args = parser.parse_args()
    target = targets.parse_target(args.target)
    targets.prepare_environment(target)

    from aot import hlo
    from aot.building import entries, lower, progress
    from aot.building import plan as planner
    from wan.configs import VideoShape
    from wan.presets import resolve_model

    config = resolve_model(args.model)
    devices = targets.devices(target)
    n = len(devices)
    width, height = (int(v) for v in args.res.split("x"))
    for batch in args.batches:
        shape = VideoShape(width, height, args.frames, batch)
        for spatial in [1 if m == "N,1" else n for m in args.meshes]:
            plan = planner.plan_build(args.model, config, shape, target, n, vae_spatial=spatial)
            layout, vae_mesh = plan.sharding_plan.vae_layout, plan.sharding_plan.vae_mesh
            (lowered,) = lower.lower_plan(plan, only={"vae_decode"})
            with progress.RssSampler() as rss:
                start = time.perf_counter()
                compiled = lowered.compile()
                seconds = time.perf_counter() - start
            module = hlo.parse(compiled.as_text())
            row = {
                "command": f"python bench/vae_mesh.py --target {args.target} --model {args.model} "
                f"--res {args.res} --frames {args.frames} --batches {batch} --meshes "
                f"{'N,1' if vae_mesh[1] == 1 else '1,N'}",
                "batch": batch,
                "vae_mesh": list(vae_mesh),
                "vae_axis": layout.axis,
                "peak_gib": round(entries.memory_stats(compiled)["peak"] / GiB, 3),
                "compile_seconds": round(seconds, 1),
                "peak_rss_gib": round(rss.peak / GiB, 2),
                "collectives": {
                    k: v for k, v in hlo.collective_summary(module).items() if v["count"]
                },
            }
            print(json.dumps(row), flush=True)
            record.save(args.out, row)


if __name__ == "__main__":
    main()
