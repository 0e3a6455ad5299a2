"""The boundaries between the packages and between the rooms inside them (docs/architecture.md,
"The rooms and their doors"). Between packages, on what Python actually imports: the runtime
loads executables and weights by name and never imports model code (flax, `wan.models`), and
`wan` imports neither `aot` nor `runtime`. Between rooms, on every import statement of every
module (inside functions too): what each room may import of the others (ROOMS), and the server
coming into generation by its door alone (`runtime.generation`, never one of its modules)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
# room -> the rooms of `runtime` and `aot` it may import (its own always). A room is a package;
# a module at a package's top (aot.cli) is a room of its own.
ROOMS = {
    "runtime.trust": set(),
    "runtime.builds": {"runtime.trust"},
    "runtime.generation": {"runtime.trust", "runtime.builds"},
    "runtime.serve": {"runtime.trust", "runtime.builds", "runtime.generation"},
    "runtime.cli": {"runtime.trust", "runtime.builds", "runtime.generation", "runtime.serve"},
    "aot.targets": {"runtime.trust", "runtime.builds"},
    "aot.hlo": set(),
    "aot.reports": {"aot.hlo", "aot.targets", "runtime.trust", "runtime.builds"},
    "aot.building": {
        "aot.hlo",
        "aot.targets",
        "aot.reports",
        "runtime.trust",
        "runtime.builds",
    },  # fmt: skip
    "aot.cli": {
        "aot.building",
        "aot.hlo",
        "aot.reports",
        "aot.targets",
        "runtime.trust",
        "runtime.builds",
        "runtime.cli.args",
    },  # fmt: skip
}
# Rooms reached only by their door (the package itself), from the rooms named.
DOORS = {"runtime.generation": {"runtime.serve"}}


def _modules(package: str) -> list[str]:
    return sorted(
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for path in (ROOT / package).rglob("*.py")
    )


def _loaded_after_importing(modules: list[str]) -> set[str]:
    """The modules a fresh interpreter holds after importing `modules`."""
    code = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "print(json.dumps(sorted(sys.modules)))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert result.returncode == 0, result.stderr
    return set(json.loads(result.stdout))


def _top(loaded: set[str], prefixes: tuple[str, ...]) -> set[str]:
    return {m for m in loaded if any(m == p or m.startswith(p + ".") for p in prefixes)}


def test_the_runtime_imports_no_model_code():
    modules = _modules("runtime")
    assert {"runtime.serve.server", "runtime.generation.pipeline", "runtime.cli"} <= set(modules)
    loaded = _loaded_after_importing(modules)
    assert _top(loaded, ("flax", "wan.models", "wan.programs", "aot")) == set()


def test_wan_imports_neither_aot_nor_the_runtime():
    modules = _modules("wan")
    assert "wan.models.transformer" in modules
    loaded = _loaded_after_importing(modules)
    assert "flax" in loaded  # the models were imported
    assert _top(loaded, ("aot", "runtime")) == set()


def test_the_request_checks_load_no_jax():
    """What the CLI checks before jax starts (a request, its step caching, its outputs, its
    image) imports no jax: a bad request is refused in the time Python takes to start."""
    loaded = _loaded_after_importing(
        ["runtime.generation.step_cache", "runtime.generation.request", "runtime.generation.outputs", "runtime.builds.build_options",
         "runtime.generation.images"]
    )  # fmt: skip
    assert "numpy" in loaded and _top(loaded, ("jax", "jaxlib", "flax")) == set()


def _room(module: str) -> str | None:
    return next((room for room in ROOMS if module == room or module.startswith(room + ".")), None)


def _imports(path: Path) -> set[str]:
    """Every module an import statement of `path` names (relative imports resolved)."""
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = module.split(".")[: -node.level or None]
                base = ".".join([*parent, base] if base else parent)
            names |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return names


def room_violations(package: str) -> list[str]:
    """`module imports name`, for each import that crosses into a room it may not."""
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        room = _room(module)
        if room is None:
            continue
        for name in sorted(_imports(path)):
            target = _room(name)
            if target is None or target == room:
                continue
            allowed = ROOMS[room]
            if not (
                target in allowed
                or name in allowed
                or any(name.startswith(a + ".") for a in allowed)
            ):
                found.append(f"{module} imports {name}")
            elif room in DOORS.get(target, set()) and name not in (
                target,
                *(f"{target}.{n}" for n in _door_names(target)),
            ):
                found.append(f"{module} imports {name}, not through the door {target}")
    return found


def _door_names(door: str) -> set[str]:
    """The names a door exports (a `from door import name` names them)."""
    import importlib

    return set(importlib.import_module(door).__all__)


def test_every_module_is_in_a_room():
    for package in ("runtime", "aot"):
        for path in (ROOT / package).rglob("*.py"):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            module = module.removesuffix(".__init__")
            assert module in (package,) or _room(module), f"{module} is in no room of ROOMS"


@pytest.mark.parametrize("package", ["runtime", "aot"])
def test_rooms_import_only_what_they_may(package):
    assert room_violations(package) == []


def test_the_room_check_finds_a_crossing(tmp_path, monkeypatch):
    """Control: a generation module importing the server, and a server module reaching past
    generation's door, are both found."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "runtime" / "generation").mkdir(parents=True)
    (tmp_path / "runtime" / "serve").mkdir()
    (tmp_path / "runtime" / "generation" / "a.py").write_text("from runtime.serve import b\n")
    (tmp_path / "runtime" / "serve" / "b.py").write_text(
        "def f():\n    from runtime.generation.pipeline import Pipeline\n"
    )
    assert room_violations("runtime") == [
        "runtime.generation.a imports runtime.serve",
        "runtime.generation.a imports runtime.serve.b",
        "runtime.serve.b imports runtime.generation.pipeline, not through the door runtime.generation",
        "runtime.serve.b imports runtime.generation.pipeline.Pipeline, not through the door runtime.generation",
    ]
