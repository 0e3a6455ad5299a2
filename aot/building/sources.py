"""What decides a plan's lowered programs besides its build key, model config and compiler
fingerprint, as one digest (`lowering_digest`): a build's manifest records it, and `aot build`
finds a build whose digest is this process's up to date without lowering its programs
(`aot.building.build.existing_build`)."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import jax

# The project's code that lowering runs: every module `aot.building.lower` (the programs, their
# meshes and options) and `aot.building.store` (their ids) import, at any depth, and the modules
# the component kinds name (tests/test_program_identity.py checks that it stays so). The rest
# (the CLIs, aot.reports, runtime's generation and serving) decides no program.
SOURCES = (
    "wan",
    "aot/__init__.py",
    "aot/building",
    "aot/hlo",
    "aot/targets",
    "runtime/__init__.py",
    "runtime/builds",
    "runtime/trust",
)
OWN_DISTRIBUTION = "wan_aot"  # pyproject.toml's project name, as its metadata folders spell it
# jax flags that change no lowered module and that processes set differently: the builder
# turns the compilation cache off (aot.building.build._make_program), the runtime forbids
# tracing while it runs.
UNLOWERED_FLAGS = frozenset({
    "jax_enable_compilation_cache", "jax_compilation_cache_dir", "jax_no_tracing",
    "jax_log_compiles", "jax_logging_level", "jax_debug_log_modules",
    "jax_explain_cache_misses", "jax_raise_persistent_cache_errors",
})  # fmt: skip
UNLOWERED_PREFIXES = ("jax_persistent_cache_", "jax_compilation_cache_")
# A file changed this close to the process's start (or after it) may not be what the process
# imported: file times come from a clock that lags by a tick, the start is known to ~20 ms.
CHANGE_MARGIN_S = 0.5


def lowering_digest() -> str | None:
    """sha256 of everything besides the build key, the model config and the compiler
    fingerprint that decides what a plan lowers to, or None when this process cannot vouch for
    it (then builds are checked by lowering, as with a manifest that records none).

    Why equal digests mean equal programs: `aot.building.lower.lower_plan` is a function of the
    plan (its key, model config and target: compared on their own) and of the code it runs and
    reads: this project's (every file of `SOURCES`), third-party packages' (each distribution
    importable here, by name and version, and the Python version) and jax's flags (every one
    but `UNLOWERED_FLAGS`: set by JAX_* variables or in-process, as the tests' matmul precision
    is, they change the modules). XLA_FLAGS act on compiles, not on lowering (the device count
    they set is the target's). A program's store id (`aot.building.store.program_id`) hashes its
    lowered module with the compiler fingerprint, the devices (the target's), its interface
    and its options, all decided by the same inputs.

    What a process runs is what it imported, so the digest is None when a file of `SOURCES` or
    a distribution changed since (`CHANGE_MARGIN_S` before) this process started, off Linux
    (no start time), or when a component kind (wan.kinds.REGISTRY) comes from outside
    `SOURCES` (a kind registered at run time, whose code no file here holds). Code replaced in
    memory (a monkeypatch) is not seen."""
    start = _process_start()
    if start is None:
        return None
    since = start - CHANGE_MARGIN_S
    digest = hashlib.sha256()

    def add(*parts: str | bytes) -> None:
        for part in parts:
            digest.update(part if isinstance(part, bytes) else part.encode())
            digest.update(b"\0")

    for name, path in source_files():
        stat = path.stat()
        if max(stat.st_mtime, stat.st_ctime) >= since:
            return None
        add(name, path.read_bytes())
    for name, changed in _distributions():
        if changed >= since:
            return None
        add(name)
    if not _kinds_within_sources():
        return None
    add(sys.version)
    for name, value in sorted(jax.config.values.items()):
        if name not in UNLOWERED_FLAGS and not name.startswith(UNLOWERED_PREFIXES):
            add(name, repr(value))
    return digest.hexdigest()


def source_files() -> list[tuple[str, Path]]:
    """Every file of `SOURCES` as this process imports them: (its name, "wan/models/vae.py",
    and where it is), compiled caches left out."""
    files = []
    for source in SOURCES:
        package, _, rest = source.partition("/")
        top = Path(importlib.import_module(package).__path__[0])
        path = top / rest
        for file in _walk(path) if path.is_dir() else [path]:
            files.append(((Path(package) / file.relative_to(top)).as_posix(), file))
    return sorted(files)


def _walk(folder: Path) -> Iterator[Path]:
    for parent, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        yield from (Path(parent, n) for n in names if not n.endswith((".pyc", ".pyo")))


def _distributions() -> list[tuple[str, float]]:
    """The distributions importable here (each `name-version.dist-info` or `.egg-info` folder
    of the import path, by name) and when each last changed; this project's own left out (its
    code is `SOURCES`; its editable install's egg-info is importable from the checkout only)."""
    found = {}
    for entry in dict.fromkeys(os.path.abspath(p or ".") for p in sys.path):
        try:
            with os.scandir(entry) as it:
                for item in it:
                    own = item.name.startswith((f"{OWN_DISTRIBUTION}-", f"{OWN_DISTRIBUTION}."))
                    if item.name.endswith((".dist-info", ".egg-info")) and not own:
                        stat = item.stat()
                        found[item.name] = max(stat.st_mtime, stat.st_ctime)
        except OSError:  # not a folder (a zip), or gone
            continue
    return sorted(found.items())


def _kinds_within_sources() -> bool:
    """Whether every registered component kind's code is in `SOURCES`: its import paths
    ("module:attribute") and objects (classes, functions) name modules there."""
    from wan import kinds

    for kind in kinds.REGISTRY.values():
        for field in dataclasses.fields(kind):
            value = getattr(kind, field.name)
            if isinstance(value, str) and ":" in value:
                module = value.partition(":")[0]
            elif callable(value):
                module = getattr(value, "__module__", None) or ""
            else:
                continue
            if not _in_sources(module):
                return False
    return True


def _in_sources(module: str) -> bool:
    """Whether the module named `module` ("wan.models.vae") is a file of `SOURCES`."""
    path = module.replace(".", "/")
    return any(
        path == source.removesuffix("/__init__.py") or path.startswith(f"{source}/")
        for source in SOURCES
    )


def _process_start() -> float | None:
    """When this process started, on the wall clock (Linux: from its start in clock ticks
    after boot and the time since boot); None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        now = time.time()
        ticks = int(stat[stat.rindex(")") + 2 :].split()[19])
        return now - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
