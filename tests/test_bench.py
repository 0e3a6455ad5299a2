"""Benchmarks the docs quote still run: each on the tiny model into a scratch folder (the
real presets are what docs/benchmarks.md records; the code path is the same)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_weights_load_runs_from_a_fresh_folder(tmp_path):
    """bench/weights_load.py writes its own sources (a checkpoint and a diffusers folder, with
    the transformer's config.json the loader requires) and loads each."""
    out = tmp_path / "weights_load.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "weights_load.py"), "--model", "tiny",
         "--repeats", "1", "--work", str(tmp_path / "work"), "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    sources = {
        row for entry in [json.loads(out.read_text())] for row in json.dumps(entry).split('"')
    }
    assert {"checkpoint", "diffusers", "checkpoint-orbax"} <= sources
