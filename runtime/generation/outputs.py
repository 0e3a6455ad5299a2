"""Paths a run will write: checked before anything loads (a generation must not be computed only
to be lost to a path that could never be written), then written all or nothing.

Every output is staged in a temporary file next to it, fsynced and renamed into place once all of
them are complete, so an existing file is replaced only by a whole new one, and a failure or an
interruption (SIGINT, SIGTERM) leaves neither a partial output nor a temporary file behind.
`write_videos` is the one way videos are written, with any other outputs of the run beside them."""

from __future__ import annotations

import contextlib
import errno
import functools
import math
import os
import secrets
import stat
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np

from runtime.generation.video import write_mp4
from wan.errors import InputError


class OutputError(InputError):
    """A path the run would write cannot be written; the message says why."""


class WriteError(OSError):
    """An output could not be written; the message names it and says why."""


Writer = Callable[[Path], None]  # writes one output's content at the (staged) path it is given
THUMBNAIL_QUALITY = 90  # WebP, of 100
SPRITE_TILES, SPRITE_TILE_PIXELS, SPRITE_QUALITY = 16, 256, 85  # a spritesheet's (JPEG)


def npy_path(path: Path) -> Path:
    """Where `np.save(path)` writes: `path`, with `.npy` appended unless it ends so."""
    return path if path.suffix == ".npy" else path.with_name(f"{path.name}.npy")


def check_outputs(outputs: Sequence[tuple[Path, str]]) -> None:
    """Each (path, option) can be written, and no two name the same file."""
    for path, option in outputs:
        check_writable(path, option)
    seen: dict[object, tuple[Path, str]] = {}
    for path, option in outputs:
        for identity in _identities(path):
            if identity in seen:
                other, other_option = seen[identity]
                raise OutputError(
                    f"{option} {path} and {other_option} {other} are the same file: "
                    "give each output its own path"
                )
            seen[identity] = (path, option)


def check_not_inputs(
    outputs: Sequence[tuple[Path, str]], inputs: Sequence[tuple[Path, str]]
) -> None:
    """No (path, option) of `outputs` is a file of `inputs` or inside a folder of them (the
    weights, the artifacts): an output is renamed over whatever is at its path, so one naming
    an input would replace it."""
    sources = [(_resolved(path, option), path, option) for path, option in inputs]
    for path, option in outputs:
        target = _resolved(path, option)
        for source, given, source_option in sources:
            if target.is_relative_to(source):
                relation = "is" if target == source else "is inside"
                raise OutputError(
                    f"{option} {path} {relation} {source_option} {given}, an input of this run: "
                    "write it elsewhere"
                )


def check_writable(path: Path, option: str) -> None:
    """`path` (through any symlink) is a regular file or a new path, and the nearest existing
    folder above it accepts a new file (tried, not inferred from permission bits: root may write
    anywhere but into a read-only mount or /proc). Missing folders are made when written."""
    target = _resolved(path, option)
    if target.is_dir():
        raise OutputError(f"{option} {path} is a folder: give a file path")
    if target.exists() and not stat.S_ISREG(target.stat().st_mode):
        raise OutputError(
            f"{option} {path} is not a regular file (a device, FIFO or socket): give a file path"
        )
    parent = target.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise OutputError(f"{option} {path}: {parent} is a file, not a folder")
    try:
        _probe(parent)
    except OSError as e:
        raise OutputError(f"{option} {path}: {parent} is not writable ({e.strerror})") from None


def _probe(folder: Path) -> None:
    """Make a file in `folder` and remove it: an unnamed one (O_TMPFILE) where the filesystem
    can, which no signal or kill can leave behind (a SIGTERM landing between a named probe's
    creation and its removal left it there); else a named one, removed at once."""
    if (unnamed := getattr(os, "O_TMPFILE", None)) is not None:
        try:
            os.close(os.open(folder, unnamed | os.O_WRONLY, 0o600))
            return
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
    probe = _temporary_path(folder, ".write-probe")
    try:
        _create_empty(probe)
    finally:
        probe.unlink(missing_ok=True)


@contextlib.contextmanager
def staged(paths: Sequence[Path]) -> Iterator[list[Path]]:
    """Temporary files to write, one per path, in each path's folder (missing folders made).
    When the block ends they are fsynced and renamed over the paths; when it raises (a full
    disk, KeyboardInterrupt) they are removed, with the folders made for them."""
    targets = [p.resolve() for p in paths]
    made: list[Path] = []
    temporaries: list[Path] = []
    try:
        for target in targets:
            # Each listed before it is made: an interruption between the two leaves nothing.
            for folder in _missing_folders(target.parent):
                made.append(folder)
                folder.mkdir()
            temporaries.append(_temporary_path(target.parent, f".{target.name}"))
            _create_empty(temporaries[-1])
        yield temporaries
        for temporary in temporaries:
            _fsync(temporary)
        for temporary, target in zip(temporaries, targets, strict=True):
            os.replace(temporary, target)
        for folder in {t.parent for t in targets}:
            _fsync(folder)
    except BaseException:
        for temporary in temporaries:
            temporary.unlink(missing_ok=True)
        for folder in reversed(made):
            with contextlib.suppress(OSError):  # not empty: something else was put there
                folder.rmdir()
        raise


def write_videos(
    videos: Iterable[np.ndarray],
    paths: Sequence[Path],
    fps: int,
    extra: Mapping[Path, Writer] | None = None,
) -> None:
    """Each video (uint8 frames (F, H, W, 3)) as an MP4 of `fps` frames a second (the model's:
    ModelConfig.fps) at its path, and each `extra` path by its writer, all or nothing
    (`write_files`). The one way videos are written."""
    mp4s = {
        path: functools.partial(write_mp4, video, fps=fps)
        for video, path in zip(videos, paths, strict=True)
    }
    write_files({**mp4s, **(extra or {})})


def previews(video: np.ndarray, thumbnail: Path, spritesheet: Path) -> dict[Path, Writer]:
    """The writers of a video's previews, to write beside its MP4 (`write_videos`' `extra`):
    its first frame as a WebP `thumbnail`, and up to SPRITE_TILES frames, evenly spaced and
    each at most SPRITE_TILE_PIXELS on its longer side, in a grid (row by row) as a JPEG
    `spritesheet`."""
    from PIL import Image  # only a server writes previews

    def write_thumbnail(path: Path) -> None:
        Image.fromarray(video[0]).save(path, format="WEBP", quality=THUMBNAIL_QUALITY)

    def write_spritesheet(path: Path) -> None:
        count, height, width = video.shape[:3]
        picked = sorted(
            set(np.linspace(0, count - 1, min(count, SPRITE_TILES)).round().astype(int))
        )
        scale = min(1.0, SPRITE_TILE_PIXELS / max(width, height))
        tile = (max(1, round(width * scale)), max(1, round(height * scale)))
        columns = math.ceil(math.sqrt(len(picked)))
        rows = math.ceil(len(picked) / columns)
        sheet = Image.new("RGB", (columns * tile[0], rows * tile[1]))
        for i, index in enumerate(picked):
            frame = Image.fromarray(video[index]).resize(tile, Image.Resampling.BILINEAR)
            sheet.paste(frame, ((i % columns) * tile[0], (i // columns) * tile[1]))
        sheet.save(path, format="JPEG", quality=SPRITE_QUALITY)

    return {thumbnail: write_thumbnail, spritesheet: write_spritesheet}


def write_files(writers: Mapping[Path, Writer]) -> None:
    """Each path written by its writer into a staged file, all renamed into place together
    (`staged`). A failed write (a full disk, ffmpeg's error) is one WriteError naming the path."""
    paths = list(writers)
    with _naming(", ".join(map(str, paths))), staged(paths) as temporaries:
        for (path, write), temporary in zip(writers.items(), temporaries, strict=True):
            with _naming(str(path)):
                write(temporary)


def write_npy(path: Path, array: np.ndarray) -> None:
    """`array` as a .npy file at `path`. Not np.save: on a full disk its `tofile` says only
    "N requested and M written"; a plain write raises the OS's error (ENOSPC)."""
    array = np.ascontiguousarray(array)
    with path.open("wb") as f:
        np.lib.format.write_array_header_1_0(f, np.lib.format.header_data_from_array_1_0(array))
        f.write(array.data)


@contextlib.contextmanager
def _naming(what: str) -> Iterator[None]:
    """An OSError raised inside as one WriteError line: 'cannot write WHAT: reason'."""
    try:
        yield
    except WriteError:
        raise
    except OSError as e:
        raise WriteError(f"cannot write {what}: {e.strerror or e}") from None


def _resolved(path: Path, option: str) -> Path:
    try:
        return path.resolve()
    except (RuntimeError, OSError) as e:  # a symlink loop
        raise OutputError(f"{option} {path}: {e}") from None


def _identities(path: Path) -> set[object]:
    """What makes two paths one file: the same resolved path, or the same inode (a hard link)."""
    target = path.resolve()
    identities: set[object] = {target}
    with contextlib.suppress(OSError):
        st = target.stat()
        identities.add((st.st_dev, st.st_ino))
    return identities


def _temporary_path(folder: Path, prefix: str) -> Path:
    """A name in `folder` no file has (48 random bits), for a file made and removed by us."""
    return folder / f"{prefix}.{secrets.token_hex(6)}.partial"


def _create_empty(path: Path) -> None:
    """A new empty file at `path`, with the permissions the umask gives a new file."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))


def _missing_folders(folder: Path) -> list[Path]:
    """`folder` and those of its parents that do not exist, outermost first."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    return missing[::-1]


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
