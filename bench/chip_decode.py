"""The VAE decode alone on the accelerator attached: seconds per decode of each build's
`vae_decode` (the same latents, the build's own executable and the VAE's weights) against its
lower bound (the program's HLO FLOPs at the device's peak), and one traced decode's device ops
summed by kind (bench/chip_profile.py's kinds).

    python bench/chip_decode.py --artifacts ART --weights W \
        --variant vmem4=BUILD --variant default=OTHER_BUILD --runs 3 --out DIR

The builds differ in how their decode was compiled (`aot build --vae-vmem`). The first call of
each is kept apart from the figures: what a first call costs once is the run's, not the
program's. Writes DIR/decode.json and prints the table (`--markdown DIR/decode.json` again).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import chip_profile  # bench/chip_profile.py, beside this script
import jax
import numpy as np
import record

from runtime.builds.artifact import read_manifest
from runtime.builds.loader import Request
from runtime.generation.denoise import place
from runtime.generation.pipeline import Pipeline


def decode_seconds(pipe: Pipeline, latents: np.ndarray) -> float:
    """One decode, from latents on the host to frames on the host."""
    start = time.perf_counter()
    x = place(latents, pipe.input_sharding("vae_decode", "latents"))
    np.asarray(pipe.run("vae_decode", params=pipe.weights("vae"), latents=x)["frames"])
    return time.perf_counter() - start


def run_variant(args: argparse.Namespace, name: str, build: str) -> dict:
    """--runs decodes of one build after a first, and a traced one's ops by kind."""
    manifest = read_manifest(args.artifacts / build)
    entry = manifest.programs["vae_decode"]
    pipe = Pipeline.load(args.artifacts, args.weights, Request(manifest.key.shape), build=build)
    latents_shape = next(a.shape for a in entry.inputs if a.path == "latents")
    latents = np.random.default_rng(0).standard_normal(latents_shape).astype(np.float32)
    seconds = [decode_seconds(pipe, latents) for _ in range(args.runs + 1)]
    trace = Path(tempfile.mkdtemp())
    jax.profiler.start_trace(str(trace))
    decode_seconds(pipe, latents)
    jax.profiler.stop_trace()
    ops = chip_profile.summarize(next(trace.rglob("*.xplane.pb")), 1)
    return {
        "variant": name,
        "build": build,
        "compiler_options": entry.compiler_options,
        "first_call_s": round(seconds[0], 3),
        "decode_s": record.spread(seconds[1:]),
        "tflop": round(entry.flops / 1e12, 1),
        "lower_bound_s": round(entry.flops / manifest.peak_flops, 3)
        if manifest.peak_flops
        else None,
        "ms_by_kind": ops.get("ms_per_step_by_kind"),
        "device_ms": ops.get("device_ms_per_step"),
        "top_ops": [
            {k: op[k] for k in ("name", "kind", "ms_per_step", "count_per_step")}
            for op in ops.get("top_ops", [])[:12]
        ],  # fmt: skip
    }


def markdown(rows: list[dict]) -> str:
    lines = [
        "| variant | compiler options | decode s | first call s | lower bound s | of peak | device ms by kind |",
        "|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in rows:
        d, bound = r["decode_s"], r["lower_bound_s"]
        share = "-" if bound is None else f"{100 * bound / d['median']:.0f}%"
        kinds = ", ".join(f"{k} {v:.0f}" for k, v in (r["ms_by_kind"] or {}).items())
        lines.append(
            f"| {r['variant']} | {r['compiler_options'] or 'default'} | "
            f"{record.cell(d, 3)} | {r['first_call_s']:.2f} | "
            f"{bound} | {share} | {kinds} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = record.sitting_parser(__doc__)
    parser.add_argument("--artifacts", type=Path)
    parser.add_argument("--weights", type=Path)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=BUILD")
    args = parser.parse_args()
    if record.printed_kept(args, markdown):
        return
    rows = (run_variant(args, *spec.partition("=")[::2]) for spec in args.variant)
    record.run_sitting(args.out / "decode.json", rows, markdown)


if __name__ == "__main__":
    main()
