"""Peak memory per device, compile seconds and peak RSS per program for deviceless builds of
the real presets at 720p/81 frames, from this CPU host: the programs `aot build` makes, with its
default mesh per (model, target, batch).

The presets share one VAE, so its decode (by far the longest compile) is compiled once per
(target, batch), with the first model's plan, and its row is shared by the others. Every
(model, target, batch) compiles in a fresh process (RSS per build); `--jobs 2` runs two at
once (compile seconds then include the contention). Records already in the results file are
kept, so the table can be filled in several sittings.

    python bench/memory_table.py --models wan2.1-t2v-1.3b wan2.1-t2v-14b wan2.2-t2v-a14b \\
        --targets tpu7x-8 tpu-v6e-8 --batches 1 2 8 --jobs 2

Attention side by side (the denoise step only, auto = splash on TPU, against blockwise):

    python bench/memory_table.py --models wan2.1-t2v-14b --targets tpu-v6e-8 tpu7x-8 \\
        --batches 1 8 --attentions auto blockwise --programs denoise_step \\
        --out bench/results/attention_720p.json

Results: bench/results/memory_table.json (one row per model, target, batch).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import record  # noqa: E402  (bench/record.py, beside this script)

from wan.interface import RADIAL_STEP  # noqa: E402  (jax-free: the environment is set per job)

GiB = float(1 << 30)
TRANSFORMER_PROGRAMS = ["text_encode", "kv_cache", "denoise_step"]


# The plain build options the table sweeps: the attribute of each flag's list of values, its
# build option, and the row key that records the value asked for.
SWEPT = {
    "quants": ("quant", "quant"),
    "sparse_attentions": ("sparse_attention", "requested_sparse_attention"),
    "attention_quants": ("attention_quant", "requested_attention_quant"),
}


def _tera(flops: float) -> float:
    """FLOPs as TFLOP to 6 significant digits (the tiny model's are millionths of one)."""
    return float(f"{flops / 1e12:.6g}")


def compile_one(model: str, target_name: str, batch: int, res: str, frames: int,
                only: list[str], attention: str, plain: dict[str, str]) -> dict:  # fmt: skip
    """Runs in its own process: plan as `aot build` does, compile `only`, measure."""
    from aot import targets

    target = targets.parse_target(target_name)
    targets.prepare_environment(target)
    from aot import hlo
    from aot.building import analyses
    from aot.building.entries import memory_stats, replicated_param_bytes
    from aot.building.lower import compile_plan
    from aot.building.plan import plan_build, transformer_bytes, ulysses_all_to_alls
    from aot.hlo import cost as hlo_cost
    from aot.reports import check
    from wan.configs import VideoShape
    from wan.presets import resolve_model
    from wan.sparse_attention import canonical

    config = resolve_model(model)
    width, height = (int(v) for v in res.split("x"))
    num_devices = len(targets.devices(target))
    shape = VideoShape(width, height, frames, batch)
    requested = None if attention == "auto" else attention
    values = {**plain, "sparse_attention": canonical(plain["sparse_attention"])}
    plan = plan_build(model, config, shape, target, num_devices, attention=requested, **values)
    quant = plain["quant"]
    policy = check.load_policy()
    facts = check.BuildFacts(plan.key.target, target.hbm_bytes, ulysses_all_to_alls(plan))
    programs = {}
    for program, compiled, _, seconds, rss in compile_plan(plan, only=only):
        module = hlo.parse(compiled.as_text())
        memory = memory_stats(compiled)
        found = check.ProgramCheck(memory["peak"], tuple(hlo.collectives(module)))
        violations = check.program_violations(Path(), program.name, found, policy, facts)
        recorded = analyses.recorded(plan, program, module)  # what the manifest records
        programs[program.name] = {
            "peak_gib": round(memory["peak"] / GiB, 3),
            "argument_gib": round(memory["argument"] / GiB, 3),
            "temp_gib": round(memory["temp"] / GiB, 3),
            "compile_seconds": round(seconds, 1),
            "peak_rss_gib": round(rss / GiB, 2),
            "tflops": _tera(hlo_cost.flops(module)),
            "eight_bit_tflops": _tera(hlo_cost.eight_bit_flops(module)),
            "replicated_param_gib": round(replicated_param_bytes(program.name, compiled) / GiB, 3),
            # the custom-call kernels' FLOPs, which the HLO count cannot see (the steps)
            "kernel_tflops": _tera(recorded.get("kernel_flops", 0)),
            # their part on 8-bit operands (--attention-quant), at the 8-bit rate
            "eight_bit_kernel_tflops": _tera(recorded.get("eight_bit_kernel_flops", 0)),
            # a step's video self-attention: the fraction of blocks its kernel computes, its
            # FLOPs dense and as built (aot.building.plan.self_attention)
            **(
                {
                    "attention_density": round(recorded["attention_density"], 4),
                    "self_attention_tflops_dense": _tera(recorded["self_attention_flops_dense"]),
                    "self_attention_tflops": _tera(recorded["self_attention_flops"]),
                }
                if "attention_density" in recorded
                else {}
            ),
            "tpu_custom_calls": sum(
                t == "tpu_custom_call" for t in hlo_cost.cost(module).custom_calls.values()
            ),
            "collectives": {
                k: v["count"] for k, v in hlo.collective_summary(module).items() if v["count"]
            },
            # aot check's verdict with the default policy (docs/check.md)
            "policy_violations": [v.message for v in violations],
        }
    return {
        "build": plan.key.folder_name(),
        "mesh": dict(plan.mesh.items()),
        "vae_mesh": list(plan.sharding_plan.vae_mesh),
        "vae_axis": plan.sharding_plan.vae_layout.axis,
        "attention": plan.attention,
        "context_parallel": plan.key.context_parallel,
        "ulysses_all_to_alls": ulysses_all_to_alls(plan),
        "peak_tflops": (targets.peak_flops(target, "") or 0) / 1e12,
        "peak_8bit_tops": target.chip.peak_8bit / 1e12 if target.chip else None,
        "quant": quant,
        "sparse_attention": plan.key.option("sparse_attention"),
        "attention_quant": plan.key.option("attention_quant"),
        "transformer_weight_gib": round(transformer_bytes(config, quant) / GiB, 2),
        "hbm_gib": target.hbm_bytes / GiB if target.hbm_bytes else None,
        "programs": programs,
    }


def _flags(plain: dict[str, str], defaults_too: bool) -> list[str]:
    """The sweep flags asking for exactly `plain` (values by build option)."""
    return [
        arg
        for attribute, (option, _) in SWEPT.items()
        if defaults_too or plain[option] != "none"
        for arg in ("--" + attribute.replace("_", "-"), plain[option])
    ]


def run_one(model: str, target: str, batch: int, attention: str, args: argparse.Namespace,
            only: list[str], plain: dict[str, str]) -> dict:  # fmt: skip
    cmd = [sys.executable, __file__, "--one", model, target, str(batch), "--res", args.res,
           "--frames", str(args.frames), "--attentions", attention,
           *_flags(plain, defaults_too=True), "--only", *only]  # fmt: skip
    start = time.time()
    result = subprocess.run(cmd, capture_output=True, text=True)
    command = (f"python bench/memory_table.py --models {model} --targets {target} --batches "
               f"{batch} --res {args.res} --frames {args.frames} --attentions {attention} "
               f"--programs {' '.join(only)}"
               + "".join(f" {arg}" for arg in _flags(plain, defaults_too=False)))  # fmt: skip
    row = {"model": model, "target": target, "batch": batch, "requested_attention": attention,
           "command": command,
           **{key: plain[option] for option, key in SWEPT.values()}}  # fmt: skip
    if result.returncode != 0:
        return row | {"error": result.stderr.strip().splitlines()[-1:]}
    return row | {"wall_seconds": round(time.time() - start, 1)} | json.loads(result.stdout)


def _order(row: dict) -> tuple:
    return row["model"], row["target"], row["batch"], row.get("attention", ""), _quant(row)


def _quant(row: dict) -> str:
    return row.get("quant", "none")  # rows from before --quants are full precision


def _verdict(programs) -> str:
    """The policy check over the programs compiled: pass, or the violations' messages."""
    if any("policy_violations" not in p for p in programs):
        return "not run"
    violations = [m for p in programs for m in p["policy_violations"]]
    return "; ".join(violations) if violations else "pass"


def markdown(rows: list[dict]) -> str:
    """Per program: peak GiB per device (XLA's memory analysis, exact from one build); one row
    per (model, target, batch). Compile seconds and the compiler's RSS, one build each and
    swinging with the host's load, stay in the results file: `bench/build_wall.py` times builds
    over alternating rounds."""
    names = [*TRANSFORMER_PROGRAMS, "vae_decode"]
    vae = {(r["target"], r["batch"]): r["programs"]["vae_decode"]
           for r in rows if "vae_decode" in r.get("programs", {})}  # fmt: skip
    lines = [
        "| model | target (HBM GiB) | B | mesh | VAE mesh | attention | "
        + " | ".join(names)
        + " | step lower bound s | aot check |",
        "|---|---|---|---|---|---|" + "---|" * len(names) + "---|---|",
    ]
    for r in sorted(rows, key=_order):
        if "programs" not in r:
            lines.append(f"| {r['model']} | {r['target']} | {r['batch']} | error: {r['error']} |")
            continue
        programs = {**r["programs"], "vae_decode": vae.get((r["target"], r["batch"]))}
        cells = [
            f"{p['peak_gib']:.2f}" if p else "not run" for p in (programs.get(n) for n in names)
        ]
        mesh = ",".join(f"{k}={v}" for k, v in r["mesh"].items() if v > 1)
        hbm = f" ({r['hbm_gib']:.0f})" if r["hbm_gib"] else ""
        attention = f"{r.get('attention', 'blockwise')} {r.get('context_parallel', 'gather')}"
        step = r["programs"].get("denoise_step")
        bound = (
            f"{(step['tflops'] + step.get('kernel_tflops', 0)) / r['peak_tflops']:.2f}"
            if step and r.get("peak_tflops")
            else "-"
        )
        lines.append(
            f"| {r['model']}{'' if _quant(r) == 'none' else ' --quant ' + _quant(r)} | "
            f"{r['target']}{hbm} | {r['batch']} | {mesh} | "
            f"{tuple(r['vae_mesh'])} {r['vae_axis']} | {attention} | "
            + " | ".join(cells)
            + f" | {bound} | {_verdict(r['programs'].values())} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=["wan2.1-t2v-14b"])
    parser.add_argument("--targets", nargs="+", default=["tpu7x-8", "tpu-v6e-8"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 2, 8])
    parser.add_argument("--res", default="1280x720")
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument(
        "--attentions", nargs="+", default=["auto"], help="aot build --attention values"
    )
    parser.add_argument("--programs", nargs="+", default=None, help="compile only these")
    parser.add_argument(
        "--quants", nargs="+", default=["none"], help="aot build --quant values (wan.quant)"
    )
    parser.add_argument(
        "--sparse-attentions",
        nargs="+",
        default=["none"],
        help="aot build --sparse-attention values (wan.sparse_attention)",
    )
    parser.add_argument(
        "--attention-quants", nargs="+", default=["none"],
        help="aot build --attention-quant values (wan.models.attention_quant)",
    )  # fmt: skip
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results" / "memory_table.json"
    )
    parser.add_argument(
        "--one", nargs=3, metavar=("MODEL", "TARGET", "BATCH"), help=argparse.SUPPRESS
    )
    parser.add_argument("--only", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--markdown", action="store_true", help="print the results as a table")
    args = parser.parse_args()
    if args.markdown:
        print(markdown(record.rows(args.out)))
        return
    if args.one:
        model, target, batch = args.one
        row = compile_one(
            model,
            target,
            int(batch),
            args.res,
            args.frames,
            args.only,
            args.attentions[0],
            {option: getattr(args, attribute)[0] for attribute, (option, _) in SWEPT.items()},
        )
        print(json.dumps(row))
        return

    from wan.presets import resolve_model

    first = args.models[0]
    for model in args.models[1:]:
        if resolve_model(model).vae != resolve_model(first).vae:
            parser.error(f"{model} has another VAE than {first}: run it separately")
    keys = ("model", "target", "batch", "requested_attention", "res", "frames",
            *(key for _, key in SWEPT.values()))  # fmt: skip
    absent = {key: "none" for _, key in SWEPT.values()}  # rows from before each sweep
    done = {
        tuple(r.get(k, absent.get(k, "auto")) for k in keys)
        for r in record.rows(args.out)
        if "error" not in r
    }
    every = TRANSFORMER_PROGRAMS + ["vae_decode"]
    sweeps = [
        dict(zip([option for option, _ in SWEPT.values()], values, strict=True))
        for values in itertools.product(*(getattr(args, attribute) for attribute in SWEPT))
    ]
    jobs = [
        (m, t, b, a, [p for p in every + ([RADIAL_STEP] if plain["sparse_attention"] != "none" else [])
                      if p in (args.programs or [*every, RADIAL_STEP])
                      and (p != "vae_decode" or m == first)],
         plain)
        for t in args.targets for b in args.batches for m in args.models for a in args.attentions
        for plain in sweeps
        if (m, t, b, a, args.res, args.frames, *plain.values()) not in done
    ]  # fmt: skip
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = [
            pool.submit(run_one, m, t, b, a, args, only, plain) for m, t, b, a, only, plain in jobs
        ]
        for future in concurrent.futures.as_completed(futures):
            row = future.result() | {"res": args.res, "frames": args.frames}
            if "programs" in row and "vae_decode" not in row["programs"]:
                row["vae_decode_from"] = first  # the same VAE program: see the docstring
            print(json.dumps(row), flush=True)
            record.save(args.out, row)


if __name__ == "__main__":
    main()
