"""The check a session runs once when the device tool lends it a GPU (bench/device_check.sh).

On that GPU's host, each step a fresh process: capture the GPU's target config and diff it with
the shipped spec; build the model deviceless (a CPU-only process) from the shipped config and
from the captured one and run the build that matches the GPU; build it on the GPU
(`--target current`: cuDNN attention, then the Pallas Triton kernel), recording XLA's autotune
results for later deviceless builds, and run both; run diffusers' WanPipeline (torch bf16, its
default attention) with random weights. Writes `device_check.json` and `device_check.md`
(s/step and peak GPU memory of each run) into --out.

`--dry-run` (any host, the test suite's path): runs what needs no GPU (the deviceless build from
the shipped config), lists the other steps' commands, and writes both files with them not run.
The project runs from the tree (PYTHONPATH), with the device image's jax.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
AOT = [sys.executable, "-c", "import sys; from aot.cli import main; sys.argv[0] = 'aot'; main()"]
RUNTIME = [
    sys.executable, "-c", "import sys; from runtime.cli import main; sys.argv[0] = 'runtime'; main()"
]  # fmt: skip
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": "", "JAX_PLATFORMS": "cpu"}
# jax grows its GPU memory as used, so the driver's figure is the run's peak, not a preallocation.
GROWING = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
GiB = 1 << 30


@dataclasses.dataclass
class Step:
    name: str
    argv: list[str]
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    needs_gpu: bool = True
    report: str | None = None  # a runtime run's --report, read for s/step
    build_of: tuple[str, str] | None = None  # a run's build: (target token, attention)
    cwd: Path = ROOT
    timeout: int = 600
    status: str = "not run"  # "ok", "failed (rc N)", "not run (dry run)"
    seconds: float | None = None
    seconds_per_step: float | None = None
    peak_gpu_gib: float | None = None
    output_tail: str = ""


def plan(args: argparse.Namespace) -> list[Step]:
    """The steps, in order, for `args`."""
    out, shape = args.out, ["--res", args.res, "--frames", str(args.frames), "--batch", "1"]
    art, weights, captured = out / "artifacts", out / "weights", out / f"captured_{args.kind}.txtpb"
    # The captured config is named relative to --out, its steps run there: the target's name
    # (in the build folder's name) holds no directories.
    build = [*AOT, "build", "--model", args.model, *shape, "--out", str(art)]
    deviceless = [*build, "--attention", "triton"]  # also where `auto` would pick dot (tiny)
    steps = [
        Step("capture", [*AOT, "gpu-target", "capture", captured.name], cwd=out),
        Step("diff", [*AOT, "gpu-target", "diff", args.kind, captured.name], cwd=out),
        Step("build deviceless (shipped)", [*deviceless, "--target", f"gpu-{args.kind}"], CPU_ONLY,
             needs_gpu=False),
        Step("build deviceless (captured)", [*deviceless, "--target", f"gpu:{captured.name}"],
             CPU_ONLY, cwd=out),
        Step("weights", [sys.executable, "-m", "wan.random_weights", "--model", args.model,
                         "--out", str(weights)], CPU_ONLY),
        Step("build current (cudnn)", [*build, "--target", "current"],
             {"XLA_FLAGS": f"--xla_gpu_dump_autotune_results_to={out / 'autotune.txtpb'}"}),
        Step("build current (triton)", [*build, "--target", "current", "--attention", "triton"]),
    ]  # fmt: skip
    runs = {  # run name: (its build's target token in the folder name, attention)
        "run deviceless (shipped)": (f"_gpu-{args.kind}_", "triton"),
        "run deviceless (captured)": (f"_gpu:{captured.name}_", "triton"),
        "run current (cudnn)": ("_current_", "cudnn"),
        "run current (triton)": ("_current_", "triton"),
    }
    for name, build_of in runs.items():
        report = str(out / f"{name.replace(' ', '_').replace('(', '').replace(')', '')}.json")
        steps.append(Step(name, [*RUNTIME, "run", "--artifacts", str(art), "--build", "",
                                 "--weights", str(weights), *shape, "--prompt", args.prompt,
                                 "--steps", str(args.steps), "--out", str(out / "video.mp4"),
                                 "--report", report], GROWING, report=report,
                          build_of=build_of))  # fmt: skip
    steps.append(Step("diffusers", [sys.executable, __file__, "--diffusers", *passed_args(args)]))
    return steps


def passed_args(args: argparse.Namespace) -> list[str]:
    return ["--model", args.model, "--res", args.res, "--frames", str(args.frames),
            "--steps", str(args.steps), "--out", str(args.out), "--kind", args.kind]  # fmt: skip


def _env(extra: dict[str, str]) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


class GpuMemory:
    """The most GPU memory in use while a step runs, sampled from nvidia-smi every 0.2 s."""

    def __init__(self) -> None:
        self.peak_mib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.2):
            query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
            used = subprocess.run(query, capture_output=True, text=True).stdout.split()
            self.peak_mib = max([self.peak_mib, *(int(u) for u in used if u.isdigit())])

    def __enter__(self) -> GpuMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def resolve_build(step: Step, art: Path) -> None:
    """Name the build a run uses: the one folder in `art` of its target and attention."""
    target, attention = step.build_of
    found = [p.name for p in art.iterdir() if target in p.name and f"_{attention}" in p.name]
    step.argv[step.argv.index("--build") + 1] = found[0] if len(found) == 1 else "<not built>"


def run_step(step: Step, dry_run: bool, art: Path) -> None:
    if step.build_of and art.is_dir():
        resolve_build(step, art)
    if dry_run and step.needs_gpu:
        step.status = "not run (dry run)"
        return
    started = time.perf_counter()
    with GpuMemory() if not dry_run else _nothing() as memory:
        try:
            result = subprocess.run(step.argv, capture_output=True, text=True, env=_env(step.env),
                                    cwd=step.cwd, timeout=step.timeout)  # fmt: skip
            rc, tail = result.returncode, (result.stdout + result.stderr)[-3000:]
        except subprocess.TimeoutExpired:
            rc, tail = 124, f"timed out after {step.timeout} s"
    step.seconds = round(time.perf_counter() - started, 2)
    # `aot gpu-target diff` exits 1 when the configs differ: a finding, not a failure.
    step.status = "ok" if rc == 0 or (step.name == "diff" and rc == 1) else f"failed (rc {rc})"
    step.output_tail = tail
    if memory is not None and memory.peak_mib:
        step.peak_gpu_gib = round(memory.peak_mib * (1 << 20) / GiB, 2)
    if step.report and rc == 0:
        report = json.loads(Path(step.report).read_text())
        step.seconds_per_step = round(report["seconds_denoising"] / report["steps"], 4)
    if step.name == "diffusers" and rc == 0:
        measured = json.loads(tail.strip().splitlines()[-1])
        step.seconds_per_step, step.peak_gpu_gib = measured["s_per_step"], measured["peak_gib"]


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        pass


def markdown(args: argparse.Namespace, steps: list[Step]) -> str:
    rows = [
        f"| {s.name} | {s.status} | {_num(s.seconds_per_step, 3)} | {_num(s.peak_gpu_gib, 1)} "
        f"| {_num(s.seconds, 1)} |"
        for s in steps
    ]
    return "\n".join([
        f"{args.model}, {args.res}, {args.frames} frames, batch 1, {args.steps} steps "
        f"(`bench/device_check.sh{' --dry-run' if args.dry_run else ''}`)",
        "",
        "| step | status | s/step | peak GPU GiB | step s |",
        "|---|---|---|---|---|",
        *rows,
    ]) + "\n"  # fmt: skip


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def diffusers_run(args: argparse.Namespace) -> None:
    """diffusers' WanPipeline with random weights of the model's size on the GPU (torch bf16,
    its default attention), prompt embeddings given (no text encoder): prints one JSON line."""
    import torch
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline
    from diffusers import WanTransformer3DModel as Transformer

    sizes = {"wan2.1-t2v-1.3b": dict(num_attention_heads=12, ffn_dim=8960, num_layers=30),
             "wan2.1-t2v-14b": dict(num_attention_heads=40, ffn_dim=13824, num_layers=40)}  # fmt: skip
    with torch.device("cuda"):
        transformer = Transformer(**sizes[args.model]).to(torch.bfloat16)
        vae = AutoencoderKLWan().to(torch.float32)
    pipe = WanPipeline(None, None, transformer, vae, UniPCMultistepScheduler(flow_shift=3.0))
    width, height = map(int, args.res.split("x"))
    embeds = torch.randn(1, 512, 4096, device="cuda", dtype=torch.bfloat16)
    marks: list[float] = []

    def on_step(pipe: Any, i: int, t: Any, kwargs: dict) -> dict:
        torch.cuda.synchronize()
        marks.append(time.perf_counter())
        return kwargs

    torch.cuda.reset_peak_memory_stats()
    pipe(prompt_embeds=embeds, negative_prompt_embeds=embeds, height=height, width=width,
         num_frames=args.frames, num_inference_steps=args.steps, guidance_scale=5.0,
         callback_on_step_end=on_step, output_type="np")  # fmt: skip
    s_per_step = (marks[-1] - marks[0]) / (len(marks) - 1)  # the first step's warm-up left out
    peak = torch.cuda.max_memory_allocated() / GiB
    print(json.dumps({"s_per_step": round(s_per_step, 4), "peak_gib": round(peak, 2)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="wan2.1-t2v-1.3b")
    parser.add_argument("--res", default="832x480")
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--kind", default="h200", help="the shipped config to compare (gpu-KIND)")
    parser.add_argument("--prompt", default="a red fox running through snow")
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/tmp/device_check")
    parser.add_argument("--dry-run", action="store_true", help="no GPU: run what needs none")
    parser.add_argument("--diffusers", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.out = args.out.resolve()
    if args.diffusers:
        return diffusers_run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    steps = plan(args)
    for step in steps:
        print(f"[device_check] {step.name}", flush=True)
        run_step(step, args.dry_run, args.out / "artifacts")
        print(f"[device_check] {step.name}: {step.status} ({step.seconds} s)", flush=True)
    results = {
        "model": args.model, "res": args.res, "frames": args.frames, "steps": args.steps,
        "dry_run": args.dry_run, "steps_run": [dataclasses.asdict(s) for s in steps],
    }  # fmt: skip
    (args.out / "device_check.json").write_text(json.dumps(results, indent=1, default=str))
    (args.out / "device_check.md").write_text(markdown(args, steps))
    print(markdown(args, steps))


if __name__ == "__main__":
    main()
