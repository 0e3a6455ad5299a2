"""Weight files read into memory in the background, before anything asks for them.

`runtime run` starts reading its checkpoint's files when its arguments are checked, before jax
starts: on a TPU host the device's start (about 9 s on a v5e) and the executables'
deserialisation then overlap the reads (a 1.3B checkpoint is 14 GB, read at about 1 GB/s
there), and placing the weights copies from memory. `read_safetensors` takes a prefetched
file's bytes (once) instead of mapping the file. Only what fits in the host's free memory with
room to spare is prefetched; a file that fails to read is read again the usual way, which
reports the error.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Iterable
from pathlib import Path

import numpy as np

CHUNK = 64 << 20  # bytes per read: large enough for the disk, many per file for the threads
THREADS = 8
HEADROOM = 2.0  # prefetch only when free memory holds this many times the files

_lock = threading.Lock()
_pending: dict[Path, concurrent.futures.Future] = {}
_pool: concurrent.futures.ThreadPoolExecutor | None = None


def start(paths: Iterable[Path]) -> list[Path]:
    """Start reading `paths` (regular files) into memory, in the background: the ones started
    (none when free memory is short)."""
    files = [Path(p).resolve() for p in paths if Path(p).is_file()]
    need = sum(p.stat().st_size for p in files)
    if not files or need * HEADROOM > _free_memory():
        return []
    global _pool
    with _lock:
        _pool = _pool or concurrent.futures.ThreadPoolExecutor(THREADS, "prefetch")
        for path in files:
            if path not in _pending:
                _pending[path] = _pool.submit(_read, path)
    return files


def take(path: Path) -> np.ndarray | None:
    """The bytes of `path` if it was prefetched and read whole (then forgotten: the caller
    holds them), else None."""
    with _lock:
        future = _pending.pop(Path(path).resolve(), None)
    if future is None:
        return None
    try:
        return future.result()
    except OSError:
        return None


def _read(path: Path) -> np.ndarray:
    """The file in one buffer, its chunks read at once (pread releases the GIL)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        data = np.empty(size, np.uint8)
        view = memoryview(data)

        def chunk(start: int) -> None:
            end = min(start + CHUNK, size)
            while start < end:
                got = os.preadv(f.fileno(), [view[start:end]], start)
                if got == 0:
                    raise OSError(f"{path} ended early")
                start += got

        # Chunks go to the threads that are free; this one waits on its own file's.
        for future in [_chunk_pool().submit(chunk, s) for s in range(0, size, CHUNK)]:
            future.result()
    return data


_chunks: concurrent.futures.ThreadPoolExecutor | None = None


def _chunk_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _chunks
    with _lock:
        _chunks = _chunks or concurrent.futures.ThreadPoolExecutor(THREADS, "prefetch-chunk")
    return _chunks


def _free_memory() -> int:
    """Bytes the host can give without swapping: MemAvailable (the page cache counts), else
    the free pages."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0
