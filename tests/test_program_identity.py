"""A program's identity in the store is what it lowers to (plus compiler, devices, interface and
options), not the project's source: an edit that lowers to the same module reuses every stored
program, and one that changes a program recompiles just that program."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import TINY_SHAPE

ROOT = Path(__file__).parent.parent
BUILD = ["build", "--model", "tiny", *TINY_SHAPE, "--target", "cpu-8", "--json"]


def _aot(tree: Path, out: Path, *extra: str) -> dict:
    """`aot` run from the source tree `tree` (a copy of this one), its --json report."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    code = "import sys; from aot.cli import main; sys.argv[0] = 'aot'; main()"
    result = subprocess.run([sys.executable, "-c", code, *BUILD, "--out", str(out), *extra],
                            capture_output=True, text=True, env=env, cwd=tree, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr
    (report,) = json.loads(result.stdout)
    return report


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


def test_only_what_lowers_differently_is_compiled_again(tmp_path):
    tree = tmp_path / "tree"
    for package in ("wan", "aot", "runtime"):
        shutil.copytree(
            ROOT / package, tree / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    out = tmp_path / "artifacts"
    first = _aot(tree, out)
    assert set(first["programs"].values()) == {"compiled"}

    # A comment (and the line numbers below it) changes nothing that is lowered.
    _edit(tree / "wan" / "models" / "transformer.py", '"""', '"""An edited docstring.\n\n')
    assert _aot(tree, out)["skipped"]
    (tree / "wan" / "notes.py").write_text("# a new module changes no program\n")
    assert _aot(tree, out)["skipped"]

    # The decode's output mapping changes: its program is compiled again, the others reused.
    _edit(tree / "wan" / "programs" / "decode.py", "/ 2 + 0.5, 0.0, 1.0)", "/ 2 + 0.25, 0.0, 1.0)")
    again = _aot(tree, out)
    assert not again["skipped"]
    assert again["programs"].pop("vae_decode") == "compiled"
    assert set(again["programs"].values()) == {"reused"}
