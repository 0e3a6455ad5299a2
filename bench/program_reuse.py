"""Which programs of a build matrix the program store compiles and which it reuses, for real
presets, by lowering only (no compile: a minute on a CPU host): the program id (aot.building.store) of
every program of every build, counted per program name, and for each further model which of
its programs equal the first model's.

    python bench/program_reuse.py --model wan2.1-t2v-14b --model wan2.2-t2v-a14b \\
        --res 720x1280 --res 1280x720 --frames 81 --batch 1 --batch 8 --target tpu-v6e-8
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from aot import targets  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", required=True)
    parser.add_argument("--res", action="append", required=True)
    parser.add_argument("--frames", type=int, action="append", required=True)
    parser.add_argument("--batch", type=int, action="append", required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results" / "program_reuse.json"
    )
    args = parser.parse_args()
    target = targets.parse_target(args.target)
    targets.prepare_environment(target)
    from aot.building import build, lower, store
    from aot.building import plan as planner
    from wan.configs import VideoShape
    from wan.presets import resolve_model

    devices = targets.devices(target)
    fingerprint = build.compiler_fingerprint(target)
    ids: dict[str, dict[str, str]] = {}
    start = time.perf_counter()
    for model in args.model:
        for res in args.res:
            width, height = (int(v) for v in res.split("x"))
            for frames in args.frames:
                for batch in args.batch:
                    shape = VideoShape(width, height, frames, batch)
                    plan = planner.plan_build(
                        model, resolve_model(model), shape, target, len(devices)
                    )
                    for lowered in lower.lower_plan(plan):
                        pid = store.program_id(lowered, fingerprint)
                        name = f"{plan.key.folder_name()}/{lowered.program.name}"
                        ids.setdefault(model, {})[name] = pid
    seen: set[str] = set()
    per_model = {}
    for model, programs in ids.items():
        compiled: dict[str, int] = {}
        reused: dict[str, int] = {}
        for name, pid in programs.items():
            program = name.rsplit("/", 1)[1]
            counter = reused if pid in seen else compiled
            counter[program] = counter.get(program, 0) + 1
            seen.add(pid)
        per_model[model] = {"compiled": compiled, "reused": reused}
    result = {
        "command": "python " + " ".join([f"bench/{Path(__file__).name}", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d"),
        "lowering_seconds": round(time.perf_counter() - start, 1),
        "per_model": per_model,
        "program_ids": ids,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(per_model, indent=1))


if __name__ == "__main__":
    main()
