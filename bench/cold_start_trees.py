"""Cold start of `runtime run`, two source trees side by side: each tree builds the same tiny
artifacts, then their runs alternate (before, after, before, ...) so that machine noise hits
both alike. Reports the median and range of the seconds from process start to the first
denoise step, of the load of the executables (the report's `deserialize` phase) and of the
whole run, the ratios of the medians after/before, and the host's load at each round. For a
change to the artifact format or the loader (the pickle-free executables: `git worktree add
/tmp/before <commit>` gives the tree before).

    python bench/cold_start_trees.py --before /tmp/before --after . --repeats 5

The same tree as --before and --after builds once (tests/test_bench.py runs it so, on its
session's tiny weights (`--weights`) and the smallest shape (`--res`, `--frames`), into a folder
that already holds the build (`--artifacts`: up to date, it is not compiled again)).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import fixtures  # bench/fixtures.py, beside this script
import record  # bench/record.py, beside this script

BIN = Path(sys.executable).parent
PHASES = {
    "first_step": lambda r: r["seconds_from_process_start_to_first_step"],
    "deserialize": lambda r: r["phases"]["deserialize"],
    "total": lambda r: r["seconds_from_process_start_to_video"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True)
    parser.add_argument("--after", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--res", default="192x320")
    parser.add_argument("--frames", type=int, default=9)
    parser.add_argument("--weights", type=Path, help="the tiny model's (default: random ones)")
    parser.add_argument("--save", type=Path)
    parser.add_argument(
        "--artifacts",
        type=Path,
        help="build each tree into ARTIFACTS/before and /after, where an up-to-date build is not "
        "compiled again (default: the scratch folder)",
    )
    args = parser.parse_args()
    shape = ["--res", args.res, "--frames", str(args.frames), "--batch", "1"]
    trees = {"before": args.before, "after": args.after}
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        weights = fixtures.random_weights("tiny", root / "w", args.weights, args.after)
        artifacts: dict[Path, Path] = {}  # each tree's build: the same tree twice builds once
        for name, tree in trees.items():
            if tree.resolve() not in artifacts:
                artifacts[tree.resolve()] = (args.artifacts or root) / name
                fixtures.build("--model", "tiny", *shape, "--target", "cpu-8", "--out",
                               artifacts[tree.resolve()], tree=tree)  # fmt: skip
        runs: dict[str, list[dict]] = {name: [] for name in trees}
        loads = []
        for _ in range(args.repeats):
            loads.append(record.host_load())
            for name, tree in trees.items():
                report = root / f"{name}.json"
                fixtures.tool("runtime", "run", "--artifacts", artifacts[tree.resolve()],
                              "--weights", weights, *shape, "--prompt", "a cat",
                              "--steps", str(args.steps), "--out", root / "v.mp4",
                              "--report", report, tree=tree)  # fmt: skip
                runs[name].append(json.loads(report.read_text()))
    seconds = {
        name: {phase: record.spread([read(r) for r in reports]) for phase, read in PHASES.items()}
        for name, reports in runs.items()
    }
    result = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "repeats": args.repeats,
        "host_load": loads,
        "seconds": seconds,
        "ratio_after_over_before": {
            phase: round(seconds["after"][phase]["median"] / seconds["before"][phase]["median"], 3)
            for phase in PHASES
        },
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.save:
        args.save.write_text(text + "\n")


if __name__ == "__main__":
    main()
