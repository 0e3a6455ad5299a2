"""Weights against disk speed: one transformer (random bf16 weights of a preset) loaded into 8
host CPU devices (fsdp=8) from the project's checkpoint (one safetensors file per component,
the project's layout), from the same parameters in the checkpoint format before it (orbax, with
its default zstd), and from a diffusers folder, each side by side with `cat` of the same
files to /dev/null, the sources alternating round by round (page cache warm for all: what a
serving host that just downloaded the weights sees). Each figure: the median and range of the
rounds, with the host's load average at each. GB/s = file bytes / median seconds.

    python bench/weights_load.py --model wan2.1-t2v-1.3b --repeats 3

Writes bench/results/weights_load.json; the weight files are shared with bench/lora_merge.py
(--work).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import orbax.checkpoint as ocp  # noqa: E402
import record  # noqa: E402  (bench/record.py, beside this script)
from lora_merge import sharded_abstract, timed_load, write_sources  # noqa: E402

from wan import checkpoint  # noqa: E402
from wan.presets import resolve_model  # noqa: E402


def files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def orbax_copy(ckpt: Path, abstract: dict) -> Path:
    """The checkpoint's transformer as checkpoints of format 1 held it (orbax's defaults)."""
    folder = ckpt.with_name("checkpoint-orbax")
    if not (folder / "transformer").is_dir():
        tree = checkpoint.load_component(ckpt, "transformer", abstract)
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save((folder / "transformer").absolute(), tree)
        (folder / checkpoint.MARKER).write_bytes((ckpt / checkpoint.MARKER).read_bytes())
    return folder


def timed_cat(paths: list[Path]) -> float:
    start = time.perf_counter()
    subprocess.run(["cat", *map(str, paths)], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="wan2.1-t2v-1.3b")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path("/tmp/lora_merge_bench"))
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results" / "weights_load.json"
    )
    args = parser.parse_args()
    config = resolve_model(args.model)
    sources = dict(
        zip(("checkpoint", "diffusers"), write_sources(config, args.work / args.model), strict=True)
    )
    abstract = sharded_abstract(config)
    sources["checkpoint-orbax"] = orbax_copy(sources["checkpoint"], abstract)
    paths = {name: files(source / "transformer") for name, source in sources.items()}
    for name, source in sources.items():  # warm: page cache, jax, orbax
        timed_cat(paths[name]), timed_load(source, abstract, None)
    # Rounds alternate the sources, each load beside its `cat`: a busy moment of the host
    # falls on every source alike, and each round's load / cat is taken from one moment.
    runs = {name: {"cat": [], "load": [], "host_load": []} for name in sources}
    for _ in range(args.repeats):
        for name, source in sources.items():
            runs[name]["host_load"].append(record.host_load())
            runs[name]["cat"].append(timed_cat(paths[name]))
            runs[name]["load"].append(timed_load(source, abstract, None)[0])
    results = {}
    for name, run in runs.items():
        size = sum(p.stat().st_size for p in paths[name])
        results[name] = {
            "bytes": size,
            "seconds_cat": record.spread(run["cat"]),
            "seconds_load": record.spread(run["load"]),
            "gb_per_s_load": round(size / 1e9 / statistics.median(run["load"]), 2),
            "load_over_cat": record.spread(
                [lo / c for lo, c in zip(run["load"], run["cat"], strict=True)], 2
            ),
            "host_load": run["host_load"],
        }
        print(name, results[name], flush=True)
    record.save(
        args.out,
        {
            "command": f"python bench/weights_load.py --model {args.model} --repeats {args.repeats}",
            "model": args.model,
            "mesh": "fsdp=8 (host CPU devices)",
            "threads": os.cpu_count(),
            "sources": results,
        },
    )


if __name__ == "__main__":
    main()
