"""Load-time cost of merging a LoRA into the weights: one transformer (random bf16 weights of a
preset) loaded into 8 host CPU devices (fsdp=8), without and with a rank-R LoRA on every Linear
of every block (ComfyUI keys, bf16, with bias and norm deltas as step-distill LoRAs carry them),
side by side in one run (alternating), from the project's checkpoint and from a diffusers
folder. "with" includes reading and checking the LoRA and hashing it for the report.

    python bench/lora_merge.py --model wan2.1-t2v-1.3b --rank 32 --repeats 3

Writes bench/results/lora_merge.json (a row per command) and keeps its weight files in --work.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import jax  # noqa: E402
import record  # noqa: E402  (bench/record.py, beside this script)
import torch  # noqa: E402
from random_lora import write_lora  # noqa: E402  (bench/random_lora.py, beside this script)
from safetensors.torch import save_file  # noqa: E402

from wan import checkpoint, lora, programs, sharding, weights  # noqa: E402
from wan.presets import resolve_model  # noqa: E402
from wan.random_weights import random_params  # noqa: E402


def write_sources(config, work: Path) -> tuple[Path, Path]:
    """The transformer as a project checkpoint and as a diffusers folder (written once)."""
    ckpt, diffusers_dir = work / "checkpoint", work / "diffusers"
    if not checkpoint.is_checkpoint(ckpt):
        checkpoint.save_checkpoint(
            ckpt, config, {"transformer": random_params(config, "transformer", 0)}
        )
    target = diffusers_dir / "transformer" / "diffusion_pytorch_model.safetensors"
    if not (target.is_file() and (target.parent / "config.json").is_file()):
        from diffusers import WanTransformer3DModel

        with torch.device("meta"):
            model = WanTransformer3DModel(**dataclasses.asdict(config.transformer))
        model.save_config(target.parent)  # the loader reads the folder's config.json first
        gen = torch.Generator().manual_seed(0)
        tensors = {
            name: (0.02 * torch.randn(p.shape, generator=gen)).to(torch.bfloat16)
            for name, p in model.state_dict().items()
        }
        target.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, target)
    return ckpt, diffusers_dir


def sharded_abstract(config) -> dict:
    _, params, axes = programs.split_abstract(programs.abstract_module(config, "transformer"))
    mesh = sharding.make_mesh(jax.devices(), sharding.MeshShape(fsdp=len(jax.devices())).items())
    shards = programs.shardings(mesh, params, axes, sharding.TRANSFORMER_RULES)
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), params, shards
    )


def timed_load(source: Path, abstract: dict, lora_file: Path | None) -> tuple[float, float]:
    """(seconds to load, of which preparing the LoRA) for one load, arrays ready."""
    start = time.perf_counter()
    deltas = None
    if lora_file is not None:
        shapes = {p: a.shape for p, a in weights.flatten(abstract).items()}
        deltas, _ = lora.prepare([(lora_file, 1.0)], shapes)
    prepared = time.perf_counter() - start
    tree = checkpoint.load_component(source, "transformer", abstract, deltas)
    jax.block_until_ready(tree)
    seconds = time.perf_counter() - start
    del tree
    return seconds, prepared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="wan2.1-t2v-1.3b")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path("/tmp/lora_merge_bench"))
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "lora_merge.json")
    args = parser.parse_args()
    config = resolve_model(args.model)
    work = args.work / args.model
    sources = dict(zip(("checkpoint", "diffusers"), write_sources(config, work), strict=True))
    lora_file = write_lora(config, args.rank, work / f"lora_rank{args.rank}.safetensors")
    abstract = sharded_abstract(config)
    n_params = sum(a.size for a in weights.flatten(abstract).values())
    results = {}
    for name, source in sources.items():
        without, with_lora, prepare, loads = [], [], [], []
        timed_load(source, abstract, lora_file)  # warm-up: first-use costs of jax and orbax
        for _ in range(args.repeats):
            loads.append(record.host_load())
            without.append(timed_load(source, abstract, None)[0])
            seconds, prepared = timed_load(source, abstract, lora_file)
            with_lora.append(seconds)
            prepare.append(prepared)
        results[name] = {
            "seconds_without": [round(s, 2) for s in without],
            "seconds_with": [round(s, 2) for s in with_lora],
            "seconds_preparing_lora": [round(s, 2) for s in prepare],
            "host_load": loads,
            "without": record.spread(without, 2),
            "with": record.spread(with_lora, 2),
            "ratio": round(statistics.median(with_lora) / statistics.median(without), 2),
            "ratio_per_round": record.spread(
                [w / o for w, o in zip(with_lora, without, strict=True)], 2
            ),
        }
        print(name, results[name], flush=True)
    record.save(
        args.out,
        {
            "command": f"python bench/lora_merge.py --model {args.model} --rank {args.rank} "
            f"--repeats {args.repeats}",
            "model": args.model,
            "transformer_parameters": n_params,
            "lora_rank": args.rank,
            "lora_bytes": lora_file.stat().st_size,
            "mesh": f"fsdp={len(jax.devices())} (host CPU devices)",
            "sources": results,
        },
    )


if __name__ == "__main__":
    main()
