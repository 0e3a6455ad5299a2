"""Where a denoising step's time goes on the accelerator attached: a `jax.profiler` trace of steps
of a build run through the Pipeline API, and its device ops summed by kind (attention kernel,
matmuls, quantize/dequantize, layout copies, the rest), with the heaviest ops named.

    python bench/chip_profile.py --artifacts ART --build NAME --weights W --res 832x480 \
        --frames 81 --name dense --out DIR [--steps 3] [--guidance 5]

Traces steps 2..--steps (the first runs untraced) and writes DIR/profile_NAME.json (and the
trace's xplane.pb when it is small enough to keep); then times placing a transient text encoder
again, what `runtime serve` pays per batch. `--summarize TRACE.xplane.pb` sums a kept trace
again (its ops by kind), anywhere.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import re
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import record  # bench/record.py, beside this script

from runtime.builds.loader import Request
from runtime.generation.pipeline import Pipeline
from wan.configs import ModelConfig, VideoShape

# Kinds of device op, first match wins, on the op's HLO text (the trace names each op by it).
# Control flow (the layer loop's `while`, `conditional`, `call`) encloses the ops it runs and
# is not counted again: by its opcode (`%cond.8 = (...) conditional(...)`) or its name.
CONTAINERS = re.compile(r"^%?(while|conditional|call)[.\s=]|\s(while|conditional|call)\(")
KINDS = [
    ("attention kernel", re.compile(r"splash|flash|quant_splash|_mha_", re.I)),
    ("matmul", re.compile(r"^%?\w*convolution|^%?dot|kind=kOutput", re.I)),
    ("layout copy", re.compile(r"^%?(copy|transpose|pad|bitcast|reshape)", re.I)),
    ("quantize/dequantize", re.compile(r"= \(?(s8|u8|f8e4m3fn)\[", re.I)),
    ("collective", re.compile(r"all-gather|all-reduce|all-to-all|collective", re.I)),
    ("norm/elementwise", re.compile(r"fusion|reduce|multiply|add|convert|exp", re.I)),
]


def _stats(event) -> dict[str, str]:
    return {str(k): str(v)[:400] for k, v in event.stats}


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS if pattern.search(name)), "other")


def device_ops(xspace: Path) -> tuple[Any, dict[str, dict]]:
    """The trace's device plane (None for a CPU run: its ops are host threads) and its XLA ops by
    name, each with its summed ns, count and first event's stats (control flow left out)."""
    data = jax.profiler.ProfileData.from_file(str(xspace))
    planes = [p for p in data.planes if p.name.startswith("/device:")]
    if not planes:
        return None, {}
    plane = next((p for p in planes if "TPU" in p.name), planes[0])
    ops: dict[str, dict] = collections.defaultdict(lambda: {"ns": 0, "count": 0})
    for line in plane.lines:
        if line.name != "XLA Ops":
            continue
        for event in line.events:
            if CONTAINERS.search(event.name):
                continue
            op = ops[event.name]
            op["ns"] += event.duration_ns
            op["count"] += 1
            op.setdefault("stats", _stats(event))
    return plane, dict(ops)


def summarize(xspace: Path, steps: int) -> dict:
    """Device op time per kind and the heaviest ops, per traced step."""
    plane, ops = device_ops(xspace)
    if plane is None:
        data = jax.profiler.ProfileData.from_file(str(xspace))
        return {"plane": None, "planes": [p.name for p in data.planes]}
    lines = [line.name for line in plane.lines]
    by_kind: dict[str, float] = collections.defaultdict(float)
    for name, op in ops.items():
        op["kind"] = kind_of(name)
        by_kind[op["kind"]] += op["ns"] / 1e6 / steps
    top = sorted(ops.items(), key=lambda kv: -kv[1]["ns"])[:30]
    return {
        "plane": plane.name,
        "lines": lines,
        "ms_per_step_by_kind": {
            k: round(v, 2) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])
        },
        "device_ms_per_step": round(sum(by_kind.values()), 2),
        "top_ops": [
            {
                "name": n,
                "kind": op["kind"],
                "ms_per_step": round(op["ns"] / 1e6 / steps, 2),
                "count_per_step": op["count"] / steps,
                "stats": op["stats"],
            }
            for n, op in top
        ],  # fmt: skip
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--summarize", type=Path, help="only sum a kept trace's ops (xplane.pb)")
    parser.add_argument("--traced-steps", type=int, default=2, help="the steps that trace holds")
    parser.add_argument("--artifacts", type=Path)
    parser.add_argument("--build")
    parser.add_argument("--weights", type=Path)
    parser.add_argument("--res", default="832x480")
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--guidance", type=float, default=5.0)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--name")
    parser.add_argument("--encoder-placements", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.summarize:
        summary = summarize(args.summarize, args.traced_steps)
        print(json.dumps({k: summary[k] for k in ("ms_per_step_by_kind", "device_ms_per_step")}))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    width, height = map(int, args.res.split("x"))
    config = ModelConfig.from_folder(args.weights)
    shape = VideoShape(width, height, args.frames, 1, args.guidance > 1)
    pipe = Pipeline.load(args.artifacts, args.weights, Request(shape), build=args.build)
    trace = Path(tempfile.mkdtemp())
    marks = {}

    def on_step(done: int, total: int) -> None:
        marks[done] = time.perf_counter()
        if done == 1:
            jax.profiler.start_trace(str(trace))
        if done == total:
            jax.profiler.stop_trace()

    _, report = pipe.generate(
        "a fox in the snow", steps=args.steps, guidance=args.guidance, on_step=on_step
    )
    traced = args.steps - 1
    # What a server pays per batch for a transient text encoder: placing it again (the page
    # cache holds its file by now) and deleting it.
    placements = []
    for _ in range(args.encoder_placements if "text_encoder" in pipe.transient else 0):
        start = time.perf_counter()
        jax.block_until_ready(pipe.weights("text_encoder"))
        placements.append(round(time.perf_counter() - start, 3))
        pipe.release("text_encoder")
    xspace = next(trace.rglob("*.xplane.pb"))
    if xspace.stat().st_size < 15 << 20:
        shutil.copy(xspace, args.out / f"profile_{args.name}.xplane.pb")
    summary = summarize(xspace, traced)
    summary.update(
        command=shlex.join(sys.argv), date=time.strftime("%Y-%m-%d"), build=args.build, commit=record.commit(),
        config=config.transformer.kind, traced_steps=traced,
        wall_ms_per_step=round(1000 * (marks[args.steps] - marks[1]) / traced, 1),
        text_encoder_placement_s=placements, phases=report.phases,
        memory=dataclasses.asdict(report.memory),
    )  # fmt: skip
    (args.out / f"profile_{args.name}.json").write_text(json.dumps(summary, indent=1))
    keys = ("ms_per_step_by_kind", "device_ms_per_step", "wall_ms_per_step",
            "text_encoder_placement_s", "phases", "memory")  # fmt: skip
    print(json.dumps({k: summary.get(k) for k in keys}))


if __name__ == "__main__":
    main()
