"""The store ids of a build's programs (`aot.building.store.program_id`: what they lower to, with the
compiler and target), lowered and not compiled: a refactor that must not change what is
compiled shows the same ids before and after.

    python bench/program_ids.py --model wan2.1-t2v-14b --res 1280x720 --frames 81 --batch 1 \
        --target tpu-v6e-8 --save bench/results/program_ids_14b.json

Run it from another checkout with PYTHONPATH=<that tree> to get that tree's ids (`--label`
names the row); the rows of one file are compared in `docs/benchmarks.md`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import record


def program_ids(model: str, res: str, frames: int, batch: int, target: str) -> dict[str, str]:
    from aot import targets
    from aot.building import build, plan, store
    from aot.building.lower import lower_plan
    from runtime.builds.build_options import OPTIONS
    from wan.configs import VideoShape
    from wan.presets import resolve_model

    tgt = targets.parse_target(target)
    targets.prepare_environment(tgt)
    config = resolve_model(model)
    width, height = (int(side) for side in res.split("x"))
    defaults = plan.resolve_options({o.name: o.default for o in OPTIONS.values()})
    built = plan.plan_build(
        model,
        config,
        VideoShape(width, height, frames, batch, cfg=True),
        tgt,
        len(targets.devices(tgt)),
        **defaults,
    )
    fingerprint = build.compiler_fingerprint(tgt)
    return {
        lowered.program.name: store.program_id(lowered, fingerprint)
        for lowered in lower_plan(built)
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--res", required=True, help="WxH")
    parser.add_argument("--frames", type=int, required=True)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--target", required=True)
    parser.add_argument("--label", help="the row's name (default: the tree's git commit)")
    parser.add_argument("--save", type=Path, help="add the row to this results file")
    args = parser.parse_args()
    start = time.perf_counter()
    ids = program_ids(args.model, args.res, args.frames, args.batch, args.target)
    label = (
        args.label
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    )
    row = {
        "command": f"{args.model} {args.res} f{args.frames} b{args.batch} {args.target} {label}",
        "label": label,
        "lower_seconds": round(time.perf_counter() - start, 1),
        "program_ids": ids,
    }
    print(json.dumps(row, indent=1))
    if args.save:
        record.save(args.save, row)


if __name__ == "__main__":
    main()
