"""The program store: each distinct program compiled once per artifacts folder.

A program's identity is the sha256 of its lowered module, its compiler options, the compiler
fingerprint, the device order and its interface names. Builds whose programs have the same
identity (text_encode and kv_cache across resolutions, vae_decode across models that share the
VAE, every program of two models with equal transformers) get one executable: `aot build`
compiles it once and links its files into each build folder, so that a folder stays
self-contained (copy it anywhere).

Entries live in `<out>/.programs/<id>/`: the executable, its optimized HLO and its manifest entry
as JSON. Each is written atomically under its own lock, so concurrent builds into one folder
compile each program once. An entry is checked (its entry.json, its file names, each file's size
and sha256) every time it is reused or linked: a damaged one is compiled again and replaced. The
store is trusted as far as the artifacts folder is: a crafted entry whose entry.json matches its
files passes these checks, as a crafted build folder does, and the runtime's loader is what
refuses its executable.

Builds hold the store's lock shared from their first store access until their manifest is in
place; `aot gc` holds it exclusive, so it never removes an entry that a build has just compiled
or is about to link. It removes only the entries it can identify (a program id holding a readable
entry.json and only its files) and the temporary folders of killed builds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.builds.artifact import (
    MANIFEST,
    ArtifactError,
    Manifest,
    ProgramEntry,
    read_verified,
    verify_file,
)
from runtime.builds.executables import declared_header
from runtime.trust import signing
from runtime.trust.signing import SigningKey
from wan import interface
from wan.atomic import NotOurs, atomic_folder, locked, owned_files, remove_owned, temporaries
from wan.bounded_read import read_bytes, read_json

if TYPE_CHECKING:
    from aot.building.lower import LoweredProgram

STORE = ".programs"
ENTRY = "entry.json"
LOCKS = ".locks"
MAX_ENTRY_BYTES = 64 << 20  # an entry.json lists each array once: a few MB for the 14B
_PROGRAM_ID = re.compile(r"[0-9a-f]{64}")


def program_files(name: str) -> tuple[str, str]:
    """The files of program `name` in a store entry and a build folder: executable, HLO."""
    return f"{name}.exec", f"{name}.hlo.txt.gz"


def our_files() -> frozenset[str]:
    """Every file name `aot build` writes into a build folder, a store entry or their
    temporaries (of every registered program)."""
    names = (file for name in interface.SIGNATURES for file in program_files(name))
    signatures = (signing.signature_path(Path(f)).name for f in (MANIFEST, ENTRY))
    return frozenset({MANIFEST, ENTRY, *signatures, *names})


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


def building(out_root: Path) -> contextlib.AbstractContextManager[None]:
    """The store's lock as a build holds it (shared with other builds, not with `aot gc`)."""
    return locked(out_root / LOCKS / "store.lock", shared=True)


def collecting(
    out_root: Path, waiting: Callable[[], None] | None = None
) -> contextlib.AbstractContextManager[None]:
    """The store's lock as `aot gc` holds it: no build runs meanwhile (`waiting()` is called
    when one must finish first)."""
    return locked(out_root / LOCKS / "store.lock", waiting=waiting)


def fetch_or_make(
    out_root: Path,
    pid: str,
    make: Callable[[Path], ProgramEntry],
    replace: bool = False,
    damaged: Callable[[str], None] | None = None,
    signer: SigningKey | None = None,
) -> tuple[ProgramEntry, Path, bool]:
    """The store's entry `pid`: (manifest entry, its folder, whether it was already there).
    When absent, damaged (`damaged(why)` is called), not signed by `signer` or `replace`d,
    `make(folder)` writes the program's files into `folder` and returns its entry (then signed
    by `signer`); another process making the same entry is waited for, not repeated."""
    folder = out_root / STORE / pid
    with locked(out_root / LOCKS / f"program-{pid}.lock"):
        if os.path.lexists(folder):
            if not replace:
                try:
                    entry = read_entry(folder)
                    if signer is not None:
                        verify_entry(folder, signer)
                    return entry, folder, True
                except ArtifactError as e:
                    if damaged is not None:
                        damaged(str(e))
            owned_files(folder, our_files())  # refused before compiling what could not replace it
        remove_leftovers(folder.parent, pid)
        tmp = folder.parent / f".tmp-{pid}-{os.getpid()}"
        with atomic_folder(folder, tmp, lambda old: owned_files(old, our_files())) as tmp:
            entry = make(tmp)
            (tmp / ENTRY).write_text(json.dumps(dataclasses.asdict(entry)))
            if signer is not None:
                signing.sign(tmp / ENTRY, signer)
        return entry, folder, False


def has(out_root: Path, pid: str, signer: SigningKey | None = None) -> bool:
    """Whether the store of `out_root` holds a sound entry `pid` (signed by `signer`, if any)."""
    try:
        read_entry(out_root / STORE / pid)
        if signer is not None:
            verify_entry(out_root / STORE / pid, signer)
    except ArtifactError:
        return False
    return True


def verify_entry(folder: Path, signer: SigningKey) -> None:
    """The entry's entry.json is signed by `signer`; ArtifactError else."""
    path = folder / ENTRY
    data = read_bytes(
        path, MAX_ENTRY_BYTES, lambda r: ArtifactError(f"{path} {r}"), follow_symlinks=False
    )
    signing.verify(path, data, [signer.public])


def read_entry(folder: Path) -> ProgramEntry:
    """The entry in store folder `folder`, when its entry.json reads, names its program's own
    files, each is a regular file of the recorded size and sha256, and the executable's header
    declares the entry's arrays (runtime.builds.executables: an older format is not reused); else
    ArtifactError."""
    entry = _load_entry(folder)
    verify_file(folder, entry.hlo)
    declared_header(entry, read_verified(folder, entry.executable))
    return entry


def _load_entry(folder: Path) -> ProgramEntry:
    path = folder / ENTRY
    raw = read_json(
        path,
        MAX_ENTRY_BYTES,
        lambda reason: ArtifactError(f"{path} {reason}"),
        follow_symlinks=False,
    )
    try:
        entry = ProgramEntry.from_json(raw)
    except ArtifactError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise ArtifactError(f"{path} is malformed ({str(e)[:200]})") from None
    name = entry.name
    own = isinstance(name, str) and name in interface.SIGNATURES
    if not own or (entry.executable.path, entry.hlo.path) != program_files(name):
        raise ArtifactError(f"{path} names files other than its program's own")
    return entry


def link_files(entry: ProgramEntry, store_folder: Path, build_folder: Path) -> None:
    """The entry's files into a build folder: hard links (no copy) where the file system has
    them, else copies; each checked (size, sha256) where it landed."""
    for file in (entry.executable, entry.hlo):
        source, target = store_folder / file.path, build_folder / file.path
        try:
            os.link(source, target, follow_symlinks=False)
        except OSError:
            shutil.copyfile(source, target, follow_symlinks=False)
        verify_file(build_folder, file)


def remove_leftovers(parent: Path, name: str | None = None) -> list[Path]:
    """Remove the temporary folders killed builds left in `parent` (of `name`, or all) that hold
    only files a build writes: the ones removed. Call with no build of `name` running."""
    removed = []
    for folder in temporaries(parent, name):
        with contextlib.suppress(NotOurs):
            if remove_owned(folder, owned_files(folder, our_files())):
                removed.append(folder)
    return removed


@dataclasses.dataclass
class Garbage:
    """What `aot gc` would remove, and what it leaves alone."""

    unused: dict[Path, list[str]]  # store entries no build references -> their files
    leftovers: dict[Path, list[str]]  # temporary folders of killed builds -> their files
    foreign: list[Path]  # under the store, not a program entry: never removed


def garbage(out_root: Path, manifests: Iterable[Manifest]) -> Garbage:
    """The store entries of `out_root` whose executable none of `manifests` references, the
    leftovers of killed builds, and what is not ours."""
    referenced = {p.executable.sha256 for m in manifests for p in m.programs.values()}
    store = out_root / STORE
    scratch = sorted({*temporaries(out_root), *temporaries(store)})
    leftovers, foreign, unused = {}, [], {}
    for folder in scratch:
        try:
            leftovers[folder] = owned_files(folder, our_files())
        except (NotOurs, OSError):
            foreign.append(folder)
    for folder in sorted(store.iterdir()) if store.is_dir() else []:
        if folder in scratch:
            continue
        try:
            files, sha256 = _entry_files(folder)
        except (ArtifactError, NotOurs, OSError):
            foreign.append(folder)
            continue
        if sha256 not in referenced:
            unused[folder] = files
    return Garbage(unused, leftovers, foreign)


def _entry_files(folder: Path) -> tuple[list[str], str]:
    """(the files of store entry `folder`, its executable's sha256), when it is one: named by
    a program id, holding a readable entry.json and only that entry's files."""
    if not _PROGRAM_ID.fullmatch(folder.name):
        raise NotOurs(f"{folder} is not named by a program id")
    files = owned_files(folder, our_files())
    entry = _load_entry(folder)
    if not set(files) <= {
        ENTRY,
        signing.signature_path(Path(ENTRY)).name,
        *program_files(entry.name),
    }:
        raise NotOurs(f"{folder} holds files its entry does not name")
    return files, entry.executable.sha256


def size(folder: Path, files: Iterable[str]) -> int:
    """Bytes of `files` in `folder`."""
    return sum(os.lstat(folder / name).st_size for name in files)
