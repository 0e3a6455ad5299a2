"""The boundaries between the packages, checked on what Python actually imports: the runtime
loads executables and weights by name and never imports model code (flax, `wan.models`), and
`wan` imports neither `aot` nor `runtime`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


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
    assert {"runtime.server", "runtime.pipeline", "runtime.cli"} <= set(modules)
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
        ["runtime.step_cache", "runtime.request", "runtime.outputs", "runtime.build_options",
         "runtime.images"]
    )  # fmt: skip
    assert "numpy" in loaded and _top(loaded, ("jax", "jaxlib", "flax")) == set()
