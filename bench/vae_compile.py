"""Compile time of the VAE decode, side by side with another commit of this repository.

Each measurement is a fresh process that lowers and compiles one vae_decode (the real preset's
VAE, one video, vae mesh (1, N) sharded over the spatial axis the build would choose) for a
deviceless target, and reports the seconds and the size of the optimized HLO: its instruction
count and its distinct convolutions (the XLA TPU backend compiles each distinct conv fusion
separately, and that is where the time goes), and libtpu's own seconds per compile stage (HLO
passes, backend passes, code generation). With --against REV the same measurement runs from
a git worktree of REV, alternating with this tree, so machine noise hits both alike.

    python bench/vae_compile.py --res 720x1280 --against f916593 --repeats 1
    python bench/vae_compile.py --res 720x1280 --vae-vmem 4 --vae-vmem 8 --vae-vmem default

--vae-vmem measures this tree once per `aot build --vae-vmem` value (the scoped VMEM libtpu
tiles the decode's convolutions to), --batch another batch (the vae mesh the build picks). A
real-size compile takes 1-15 minutes (by scoped VMEM) and 2-6 GB of memory on a 2-core host.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import record  # bench/record.py, beside this script

ROOT = Path(__file__).resolve().parents[1]


# libtpu logs the seconds of its compile stages at INFO level.
STAGE_LOGS = {"TPU_MIN_LOG_LEVEL": "0", "TPU_STDERR_LOG_LEVEL": "0"}
STAGES = ("HLO_PASSES", "BACKEND_PASSES", "CODE_GENERATION", "END_TO_END")


def stage_seconds(log: str) -> dict[str, float]:
    """Seconds of each libtpu compile stage ("BACKEND_PASSES stage duration: 1m23.9s")."""
    out = {}
    for stage, text in re.findall(r"(\w+) stage duration: (\S+)", log):
        if stage in STAGES:
            m = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m(?!s))?(?:([\d.]+)s)?(?:([\d.]+)ms)?", text)
            if m:
                h, mins, sec, ms = (float(g) if g else 0.0 for g in m.groups())
                out[f"{stage.lower()}_seconds"] = round(3600 * h + 60 * mins + sec + ms / 1e3, 2)
    return out


def measure(
    preset: str,
    target_name: str,
    width: int,
    height: int,
    latent_frames: int,
    batch: int,
    vae_vmem: str | None,
) -> dict:
    """Compile one vae_decode here, as `aot build` would (every build default, --vae-vmem
    `vae_vmem` when given): seconds and HLO figures."""
    from aot import targets

    target = targets.parse_target(target_name)
    targets.prepare_environment(target)
    from aot import hlo
    from aot.building import lower
    from aot.building import plan as planner

    try:
        from aot.hlo.vae_gathers import gathers
    except ImportError:  # a revision before aot.hlo.vae_gathers (--against)
        gathers = hlo.gathers
    from wan import programs  # programs.VideoShape: its name in every revision (--against)
    from wan.presets import PRESETS

    shape = programs.VideoShape(width, height, 4 * (latent_frames - 1) + 1, batch=batch)
    # --vae-vmem is only given to this tree (older ones may predate it)
    vmem = {} if vae_vmem is None else {"vae_vmem_mib": planner.parse_vae_vmem(vae_vmem)}
    plan = planner.plan_build(
        preset, PRESETS[preset], shape, target, len(targets.devices(target)), **vmem
    )
    (lowered,) = lower.lower_plan(plan, only={"vae_decode"})
    layout = getattr(plan, "sharding_plan", plan)  # older revisions: on the plan itself
    if isinstance(lowered, tuple):  # revisions before LoweredProgram: (program, lowered, mesh)
        lowered = lowered[1]
    options = getattr(lowered, "options", {})
    start = time.perf_counter()
    compiled = lowered.compile()
    seconds = time.perf_counter() - start
    text = compiled.as_text()
    convs = set(re.findall(r"= (\S+) convolution\((?:[^)]*)\), (window=\{[^}]*\}[^,]*)", text))
    return {
        "compile_seconds": round(seconds, 2),
        "temp_gib": round(compiled.memory_analysis().temp_size_in_bytes / 2**30, 2),
        "vae_mesh": list(layout.vae_mesh),
        "vae_axis": layout.vae_layout.axis,
        "compiler_options": options,
        "gathered_mb_per_latent_frame": round(gathers(hlo.parse(text)).per_latent_frame / 1e6, 1),
        "hlo_instructions": sum(1 for line in text.splitlines() if " = " in line),
        "distinct_convolutions": len(convs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="wan2.1-t2v-14b")
    parser.add_argument("--target", default="tpu-v6e-8")
    parser.add_argument("--res", action="append", help="WxH, repeatable (default 720x1280)")
    parser.add_argument("--latent-frames", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument(
        "--vae-vmem",
        action="append",
        help="this tree with `aot build --vae-vmem V` (repeatable; default: the build default)",
    )
    parser.add_argument("--against", help="a git revision to measure side by side")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "vae_compile.json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        width, height = (int(v) for v in args.worker.split("x"))
        vmem = args.vae_vmem[0] if args.vae_vmem else None
        print(json.dumps(measure(args.preset, args.target, width, height, args.latent_frames,
                                 args.batch, vmem)))  # fmt: skip
        return
    with tempfile.TemporaryDirectory() as tmp:
        # (name, tree, --vae-vmem): this tree once per --vae-vmem value
        trees = [(f"this tree, --vae-vmem {v}", ROOT, v) for v in args.vae_vmem or []]
        trees = trees or [("this tree", ROOT, None)]
        if args.against:
            other = Path(tmp) / "against"
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(other),
                            args.against], check=True, capture_output=True)  # fmt: skip
            trees.append((args.against, other, None))
        try:
            runs: dict[str, dict[str, list[dict]]] = {}
            for res in args.res or ["720x1280"]:
                for _ in range(args.repeats):
                    for name, tree, vmem in trees:
                        cmd = [sys.executable, str(tree / "bench" / "vae_compile.py"),
                               "--worker", res, "--preset", args.preset, "--target", args.target,
                               "--latent-frames", str(args.latent_frames),
                               *(["--batch", str(args.batch)] if args.batch != 1 else []),
                               *(["--vae-vmem", vmem] if vmem else [])]  # fmt: skip
                        if tree != ROOT:  # the old tree may predate this script
                            cmd[1] = str(Path(__file__).resolve())
                        env = {**os.environ, "PYTHONPATH": str(tree), **STAGE_LOGS}
                        load = record.host_load()
                        out = subprocess.run(cmd, check=True, capture_output=True, text=True,
                                             env=env, cwd=tree)  # fmt: skip
                        result = json.loads(out.stdout.strip().splitlines()[-1])
                        result.update(stage_seconds(out.stderr), host_load=load)
                        runs.setdefault(res, {}).setdefault(name, []).append(result)
                        print(res, name, result, flush=True)
        finally:
            if args.against:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                                str(trees[-1][1])], capture_output=True)  # fmt: skip
    median = {
        res: {name: {k: statistics.median(r[k] for r in rs) if isinstance(v, float | int) else v
                     for k, v in rs[0].items()}
              for name, rs in by_tree.items()}
        for res, by_tree in runs.items()
    }  # fmt: skip
    result = {
        "command": "python " + " ".join([f"bench/{Path(__file__).name}", *sys.argv[1:]]),
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores",
        "date": time.strftime("%Y-%m-%d"),
        "preset": args.preset, "target": args.target, "latent_frames": args.latent_frames,
        "batch": args.batch,
        "runs": runs, "median": median,
        # the compile seconds' median and range over the repeats, with the load at each
        "compile_seconds": {
            res: {name: {**record.spread([r["compile_seconds"] for r in rs], 1),
                         "host_load": [r["host_load"] for r in rs]}
                  for name, rs in by_tree.items()}
            for res, by_tree in runs.items()
        },
    }  # fmt: skip
    if args.against and len(trees) == 2:
        result["compile_ratio_this_over_against"] = {
            res: m[trees[0][0]]["compile_seconds"] / m[args.against]["compile_seconds"]
            for res, m in median.items()
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in result if k not in ("runs",)}, indent=1))


if __name__ == "__main__":
    main()
