"""When this process started, as the OS recorded it: start-up that users wait for (interpreter,
imports) counts, which a timer started by our own code would miss."""

from __future__ import annotations

import os
import time
from pathlib import Path


def process_start_time() -> float:
    """Epoch seconds at which this process started (Linux /proc, clock-tick resolution)."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    ticks_after_boot = int(fields[19])  # field 22 of proc(5), counting from the state (field 3)
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks_after_boot / os.sysconf("SC_CLK_TCK")
    return time.time() - age
