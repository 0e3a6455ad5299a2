"""Compile seconds and peak memory of image to video's `vae_encode` alone, per scoped VMEM
(MiB): how its floor (`wan.programs.Program.vmem_floor_mib`) was chosen. A value below what the
encoder's largest tile needs is recorded with the compiler's error.

    python bench/vae_encode_vmem.py --res 720x1280 --batch 8 --target tpu-v6e-8 --vmem 4 5 6 8

Results: bench/results/vae_encode_vmem.json (one row per value).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import record  # noqa: E402  (bench/record.py, beside this script)

GiB = float(1 << 30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="wan2.1-i2v-14b-720p")
    parser.add_argument("--res", default="720x1280")
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--target", default="tpu-v6e-8")
    parser.add_argument("--vmem", nargs="+", type=int, default=[4, 5, 6, 8])
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/vae_encode_vmem.json")
    args = parser.parse_args()

    from aot import targets

    target = targets.parse_target(args.target)
    targets.prepare_environment(target)
    from aot.building.entries import memory_stats
    from aot.building.lower import compile_lowered, lower_plan
    from aot.building.plan import plan_build
    from wan.configs import VideoShape
    from wan.presets import resolve_model

    config = resolve_model(args.model)
    name = Path(args.model).name if Path(args.model).is_dir() else args.model  # as `aot build`
    width, height = (int(v) for v in args.res.split("x"))
    shape = VideoShape(width, height, args.frames, args.batch)
    plan = plan_build(name, config, shape, target, len(targets.devices(target)))
    [lowered] = lower_plan(plan, only=["vae_encode"])
    for vmem in args.vmem:
        command = (f"python bench/vae_encode_vmem.py --model {args.model} --res {args.res} "
                   f"--frames {args.frames} --batch {args.batch} --target {args.target} "
                   f"--vmem {vmem}")  # fmt: skip
        row = {"command": command, "vmem_mib": vmem}
        # This value exactly, whatever the program's floor (which the build would apply).
        at = dataclasses.replace(lowered, options={"xla_tpu_scoped_vmem_limit_kib": vmem * 1024})
        try:
            compiled, seconds, _ = compile_lowered(at, f"vae_encode at {vmem} MiB", None)
            row |= {"compile_seconds": round(seconds, 1),
                    "peak_gib": round(memory_stats(compiled)["peak"] / GiB, 2)}  # fmt: skip
        except Exception as e:  # noqa: BLE001  (the compiler's refusal is the result)
            row |= {"error": str(e).splitlines()[0][:300]}
        record.save(args.out, row)
        print(row, flush=True)


if __name__ == "__main__":
    main()
