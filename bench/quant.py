"""What 8-bit weights cost at load: the `small` preset on cpu-8, its full-precision build and its
`--quant w8a8-int8` build, loaded in one process, alternating, 3 rounds:

- (A) full-precision weights into the full-precision build;
- (B) the same weights into the w8a8-int8 build (quantized on the host at load, layer by layer);
- (C) a checkpoint written by `python -m wan.quantize` into the w8a8-int8 build (read as stored).

The figure is each load's `weights` phase (Pipeline.load_phases), with the checkpoints' sizes.

    python bench/quant.py --out bench/results/quant_load.json

`--model`, `--res` and `--frames` pick another preset and shape, `--weights` loads full-precision
weights already written (default: random ones), `--artifacts` builds into a folder that may
already hold the builds (up to date, they are not compiled again; default: a scratch folder);
tests/test_bench.py runs the tiny model so.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fixtures  # bench/fixtures.py, beside this script
import record  # noqa: E402  (bench/record.py, beside this script)

BIN = Path(sys.executable).parent


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="small")
    parser.add_argument("--res", default="320x192")
    parser.add_argument("--frames", type=int, default=17)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--weights", type=Path, help="weights of --model (default: random ones)")
    parser.add_argument(
        "--artifacts", type=Path, help="the folder to build into (default: a scratch folder)"
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    shape = ["--res", args.res, "--frames", str(args.frames), "--batch", "1"]
    from aot import targets

    targets.prepare_environment(targets.parse_target("cpu-8"))
    from runtime.builds.artifact import read_manifest
    from runtime.generation.pipeline import Pipeline
    from wan.configs import ModelConfig
    from wan.quantize import quantize_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        full = fixtures.random_weights(args.model, root / "weights", args.weights)
        stored = quantize_checkpoint(full, "w8a8-int8", root / "weights-int8")
        artifacts, built = args.artifacts or root / "artifacts", {}
        for mode in ("none", "w8a8-int8"):  # each build's folder, as `aot build` reports it
            (report,) = fixtures.build("--model", args.model, *shape, "--target", "cpu-8",
                                       "--quant", mode, "--out", artifacts)  # fmt: skip
            built[mode] = Path(report["folder"])
        plain, int8 = built["none"], built["w8a8-int8"]
        config = ModelConfig.from_folder(full)
        variants = {"A": (plain, full), "B": (int8, full), "C": (int8, stored)}
        seconds: dict[str, list[float]] = {v: [] for v in variants}
        host_load = []
        for _ in range(args.rounds):
            host_load.append(record.host_load())
            for name, (build, weights) in variants.items():
                pipe = Pipeline.from_build(build, read_manifest(build), weights, config)
                seconds[name].append(pipe.load_phases["weights"])
                del pipe
        sizes = {"full": _size(full), "int8": _size(stored)}
    medians = {v: statistics.median(s) for v, s in seconds.items()}
    row = {
        "command": shlex.join(["python", "bench/quant.py", *sys.argv[1:]]),
        "model": args.model, "shape": " ".join(shape), "target": "cpu-8",
        "weights_seconds": seconds, "median": medians,
        "ratio_B_over_A": round(medians["B"] / medians["A"], 3),
        "ratio_C_over_A": round(medians["C"] / medians["A"], 3),
        # Each round's own ratios (its loads side by side): their median and range.
        "round_ratios": {
            f"{v}/A": record.spread(
                [x / a for x, a in zip(seconds[v], seconds["A"], strict=True)], 3
            )
            for v in ("B", "C")
        },
        "host_load": host_load,
        "checkpoint_bytes": sizes,
    }  # fmt: skip
    record.save(args.out, row)
    print(row)


if __name__ == "__main__":
    main()
