"""The program store: each distinct program compiled once per artifacts folder.

A program's identity is the sha256 of its lowered module, its compiler options, the compiler
fingerprint, the device order and its interface names. Builds whose programs have the same
identity (text_encode and kv_cache across resolutions, vae_decode across models that share the
VAE, every program of two models with equal transformers) get one executable: `aot build`
compiles it once and links its files into each build folder, so that a folder stays
self-contained (copy it anywhere).

Entries live in `<out>/.programs/<id>/`: the executable, its optimized HLO and its manifest entry
as JSON. Each is written atomically under its own lock, so concurrent builds into one folder
compile each program once. `aot gc` removes the entries that no build references.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.artifact import ArtifactError, ProgramEntry, read_manifest
from wan.atomic import atomic_folder, locked

if TYPE_CHECKING:
    from aot.build import LoweredProgram

STORE = ".programs"
ENTRY = "entry.json"


def program_id(lowered: LoweredProgram, fingerprint: str) -> str:
    """The identity of a lowered program."""
    digest = hashlib.sha256()
    program = lowered.program
    for part in (fingerprint, repr([d.id for d in lowered.mesh.devices.flat]),
                 repr(list(program.args)), repr(list(program.out_axes)),
                 repr(sorted(lowered.options.items())), lowered.lowered.as_text()):  # fmt: skip
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def fetch_or_make(
    out_root: Path, pid: str, make: Callable[[Path], ProgramEntry], replace: bool = False
) -> tuple[ProgramEntry, Path, bool]:
    """The store's entry `pid`: (manifest entry, its folder, whether it was already there).
    When absent (or with `replace`), `make(folder)` writes the program's files into `folder`
    and returns its entry; another process making the same entry is waited for, not repeated."""
    folder = out_root / STORE / pid
    with locked(out_root / ".locks" / f"program-{pid}.lock"):
        if not replace and (entry := _read_entry(folder)) is not None:
            return entry, folder, True
        for stale in folder.parent.glob(f".tmp-{pid}-*"):
            shutil.rmtree(stale, ignore_errors=True)  # left by a killed build
        with atomic_folder(folder, folder.parent / f".tmp-{pid}-{os.getpid()}") as tmp:
            entry = make(tmp)
            (tmp / ENTRY).write_text(json.dumps(dataclasses.asdict(entry)))
        return entry, folder, False


def has(out_root: Path, pid: str) -> bool:
    """Whether the store of `out_root` holds a complete entry `pid`."""
    return _read_entry(out_root / STORE / pid) is not None


def _read_entry(folder: Path) -> ProgramEntry | None:
    try:
        return ProgramEntry.from_json(json.loads((folder / ENTRY).read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def link_files(entry: ProgramEntry, store_folder: Path, build_folder: Path) -> None:
    """The entry's files into a build folder: hard links (no copy) where the file system has
    them, else copies."""
    for name in (entry.executable.path, entry.hlo.path):
        try:
            os.link(store_folder / name, build_folder / name)
        except OSError:
            shutil.copyfile(store_folder / name, build_folder / name)


def garbage(out_root: Path, builds: Iterable[Path]) -> list[Path]:
    """Store entries whose executable no build in `builds` references."""
    referenced = set()
    for build in builds:
        try:
            manifest = read_manifest(build)
        except ArtifactError:
            continue
        referenced.update(p.executable.sha256 for p in manifest.programs.values())
    unused = []
    for folder in sorted((out_root / STORE).glob("[!.]*")):  # not a build's tmp folder
        entry = _read_entry(folder)
        if entry is None or entry.executable.sha256 not in referenced:
            unused.append(folder)
    return unused
