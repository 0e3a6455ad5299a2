"""The generation pipeline under plain `jax.jit` in a fresh process: trace, lower and compile
the same four programs that `aot build` serialises, then run them exactly as `runtime run` does.
The cold-start benchmark's baseline (B) and, with JAX's persistent compilation cache, (C).

    python bench/jit_run.py --model tiny --weights W --res 192x320 --frames 9 --steps 3 --report R
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from aot import targets  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--weights", required=True, type=Path)
    parser.add_argument("--res", required=True)
    parser.add_argument("--frames", type=int, required=True)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--target", default="cpu-8")
    parser.add_argument("--report", type=Path, required=True)
    args = parser.parse_args()
    target = targets.parse_target(args.target)
    targets.prepare_environment(target)
    if cache := os.environ.get("BENCH_JAX_CACHE"):
        os.environ["JAX_COMPILATION_CACHE_DIR"] = cache
        os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

    from aot.building.lower import compile_in_process
    from aot.building.plan import plan_build
    from runtime.generation.pipeline import Pipeline
    from wan.configs import VideoShape
    from wan.presets import resolve_model

    width, height = (int(v) for v in args.res.split("x"))
    config = resolve_model(args.model)
    shape = VideoShape(width, height, args.frames, args.batch)
    plan = plan_build(args.model, config, shape, target, len(targets.devices(target)))
    pipe = Pipeline.assemble(compile_in_process(plan), args.weights, plan.key, "jit")
    _, report = pipe.generate("a red cat running in the rain", steps=args.steps, guidance=5.0)
    args.report.write_text(json.dumps(dataclasses.asdict(report)))


if __name__ == "__main__":
    main()
