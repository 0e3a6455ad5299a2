"""A program's identity in the store is what it lowers to (plus compiler, devices, interface and
options), not the project's source: an edit that lowers to the same module reuses every stored
program, and one that changes a program recompiles just that program. A build whose manifest
records this code's lowering digest (aot.building.sources) is found up to date without lowering;
any other is found so only by lowering its programs again."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from conftest import TINY_SHAPE, with_its_store

from aot.building import sources
from runtime.builds.artifact import MANIFEST, read_manifest
from wan import kinds

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


def _settle() -> None:
    """Let the files just written age past the margin within which a process does not vouch
    for them (aot.building.sources.CHANGE_MARGIN_S): the next `aot` records its digest."""
    time.sleep(sources.CHANGE_MARGIN_S + 0.1)


def test_only_what_lowers_differently_is_compiled_again(tiny_build, tmp_path):
    """The store starts with the session's build's programs (its folder left out): the copy of
    the tree lowers to the same programs, so its first build is made from them, compiling none."""
    tree = tmp_path / "tree"
    for package in ("wan", "aot", "runtime"):
        shutil.copytree(
            ROOT / package, tree / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    out = tmp_path / "artifacts"
    shutil.rmtree(with_its_store(tiny_build, out))
    _settle()
    first = _aot(tree, out)
    assert not first["skipped"] and first["found_by"] is None
    assert set(first["programs"].values()) == {"reused"}
    assert first["manifest"]["lowering_digest"]
    # Nothing changed: found up to date by the manifest's lowering digest, nothing lowered.
    assert _aot(tree, out)["found_by"] == "digest"

    # A comment (and the line numbers below it) changes nothing that is lowered: found up to
    # date by lowering (the digest is another).
    _edit(tree / "wan" / "models" / "transformer.py", '"""', '"""An edited docstring.\n\n')
    docstring = _aot(tree, out)
    assert docstring["skipped"] and docstring["found_by"] == "lowering"
    (tree / "wan" / "notes.py").write_text("# a new module changes no program\n")
    assert _aot(tree, out)["found_by"] == "lowering"

    # The decode's output mapping changes: its program is compiled again, the others reused,
    # although the manifest records a digest (not this code's).
    _edit(tree / "wan" / "programs" / "decode.py", "/ 2 + 0.5, 0.0, 1.0)", "/ 2 + 0.25, 0.0, 1.0)")
    _settle()
    again = _aot(tree, out)
    assert not again["skipped"]
    assert again["programs"].pop("vae_decode") == "compiled"
    assert set(again["programs"].values()) == {"reused"}
    assert again["manifest"]["lowering_digest"] not in (None, first["manifest"]["lowering_digest"])
    assert _aot(tree, out)["found_by"] == "digest"


def _edit_manifest(folder: Path, edit) -> None:
    manifest = json.loads((folder / MANIFEST).read_text())
    edit(manifest)
    (folder / MANIFEST).write_text(json.dumps(manifest))


def test_only_this_codes_digest_spares_the_lowering(tiny_build, tmp_path):
    """A manifest whose digest is not this code's (an edit, simulated), or that records none (an
    older aot's), is checked by lowering: up to date when its programs are those the plan lowers
    to, rebuilt when one is not. The rebuilt manifest records this code's digest."""
    out = tmp_path / "artifacts"
    build = with_its_store(tiny_build, out)
    other = "0" * 64

    _edit_manifest(build, lambda m: m.update(lowering_digest=other))
    assert _aot(ROOT, out)["found_by"] == "lowering"

    _edit_manifest(build, lambda m: m.pop("lowering_digest"))
    assert read_manifest(build).lowering_digest is None
    assert _aot(ROOT, out)["found_by"] == "lowering"

    # A program other than the plan's (the edit changed it): not up to date, its folder made
    # again from the store (which holds every program the plan lowers to).
    def changed(m):
        m.update(lowering_digest=other)
        m["programs"]["vae_decode"]["program_id"] = "f" * 64

    _edit_manifest(build, changed)
    rebuilt = _aot(ROOT, out)
    assert not rebuilt["skipped"] and set(rebuilt["programs"].values()) == {"reused"}
    assert rebuilt["manifest"]["programs"]["vae_decode"]["program_id"] != "f" * 64
    assert rebuilt["manifest"]["lowering_digest"] not in (None, other)
    assert _aot(ROOT, out)["found_by"] == "digest"


def _imports(path: Path, root: Path) -> set[str]:
    """The modules of the project's packages that the file `path` imports anywhere (inside
    functions too), and each package above them."""
    found = set()
    module = path.relative_to(root).with_suffix("").parts
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = list(module[: len(module) - node.level]) if node.level else []
            base += node.module.split(".") if node.module else []
            names = [".".join(base)] + [".".join([*base, a.name]) for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] in ("wan", "aot", "runtime"):
                found.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return found


def _module_file(name: str, root: Path) -> Path | None:
    path = root.joinpath(*name.split("."))
    for file in (path / "__init__.py", path.with_suffix(".py")):
        if file.is_file():
            return file
    return None  # an attribute (from x import name), not a module


def test_the_lowering_digest_holds_every_module_lowering_imports():
    """Every module of the project that lowering may run (what aot.building.lower and
    aot.building.store import, at any depth, and the modules the component kinds name) is a
    file of aot.building.sources.SOURCES: an edit of any of them changes the digest."""
    digested = {name for name, _ in sources.source_files()}
    refs = [
        value.partition(":")[0] if isinstance(value, str) else value.__module__
        for kind in kinds.REGISTRY.values()
        for value in vars(kind).values()
        if (isinstance(value, str) and ":" in value) or callable(value)
    ]
    todo = [ROOT / "aot/building/lower.py", ROOT / "aot/building/store.py"]
    todo += [_module_file(ref, ROOT) for ref in refs]
    reached: set[Path] = set()
    while todo:
        file = todo.pop()
        if file is None or file in reached:
            continue
        reached.add(file)
        todo += [_module_file(name, ROOT) for name in _imports(file, ROOT)]
    names = {file.relative_to(ROOT).as_posix() for file in reached}
    assert "wan/models/vae.py" in names and "runtime/builds/loader.py" in names
    assert names <= digested, sorted(names - digested)
