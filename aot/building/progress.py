"""What a long compile shows while it runs: a live progress line, and the process's peak memory."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable


class RssSampler:
    """Peak resident set size of this process while the block runs (sampled every 50 ms)."""

    def __enter__(self) -> RssSampler:
        self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Ticker:
    """A live 'name ... 12s' line while a program compiles, so a long build never looks hung."""

    def __init__(self, label: str, sink: Callable[[str], None] | None):
        self.label, self.sink = label, sink

    def __enter__(self) -> Ticker:
        if self.sink is None:
            return self
        self.start = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        interactive = sys.stderr.isatty()
        period = 0.5 if interactive else 30.0
        self.sink(f"{self.label} compiling")
        while not self._stop.wait(period):
            self.sink(f"{self.label} compiling {time.perf_counter() - self.start:.0f}s")

    def __exit__(self, exc_type: type | None, *_: object) -> None:
        if self.sink is None:
            return
        self._stop.set()
        self._thread.join()
        outcome = "failed after" if exc_type else "done in"
        self.sink(f"{self.label} {outcome} {time.perf_counter() - self.start:.1f}s")
